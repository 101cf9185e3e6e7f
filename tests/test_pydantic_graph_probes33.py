"""Outside probes of `RemitStatePersistence`, round 33: on SQLite, PostgreSQL and Redis.

Found: a `Decimal` or a `Fraction` in a field declared `float` (money kept as `Decimal`
in a state, a node or an `End` that declares `float`) was refused, but with
`CheckpointInvalid.field` `<root>`, or `node` (the wrong part) in a graph of several
nodes: pydantic writes it alone without a warning, and warns only inside the snapshot's
tagged union, where every part is serialized strictly first. Each part is now also
checked as the snapshot serializes it, so the refusal names the value's path.

Found, left as a strict xfail (a design decision): a graph whose state field changed type
under the same `workflow_version` (`zip: str` to `zip: int`, `tags: list[str]` to
`set[str]`) reads a stored run with pydantic's coercions, `"01234"` as `1234` and
`["a", "a"]` as `{"a"}`, and goes on with those values. A field removed or renamed is
refused with `VersionMismatch` naming it (the run would go on without its value); a value
changed as it is read is not looked for.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, make_dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core.errors import CheckpointInvalid, VersionMismatch

# -- a number of another type in a field declared float ------------------------------------


@dataclass
class Till:
    price: float = 0.0
    weights: list[float] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)
    tip: float | None = None


@dataclass
class Quote(BaseNode[Till, None, float]):
    amount: float = 0.0

    async def run(self, ctx: GraphRunContext[Till]) -> Pay | End[float]:
        if self.amount < 0:
            return End(Decimal("9.99"))  # type: ignore[arg-type]  # another type than declared
        return Pay(amount=self.amount)


@dataclass
class Pay(BaseNode[Till, None, float]):
    amount: float = 0.0

    async def run(self, ctx: GraphRunContext[Till]) -> End[float]:
        return End(self.amount)


TILL = Graph(nodes=(Quote, Pay))


@pytest.mark.parametrize(
    ("state", "node", "where"),
    [
        (Till(price=Decimal("1.10")), Quote(), "state.price"),  # type: ignore[arg-type]
        (Till(weights=[1.0, Fraction(1, 3)]), Quote(), "state.weights.1"),  # type: ignore[list-item]
        (Till(rates={"eur": Decimal("0.91")}), Quote(), "state.rates.eur"),  # type: ignore[dict-item]
        (Till(tip=Decimal("2")), Quote(), "state.tip"),  # type: ignore[arg-type]
        (Till(), Quote(amount=Decimal("5.25")), "node.amount"),  # type: ignore[arg-type]
    ],
)
def test_a_number_of_another_type_in_a_float_field_is_refused_at_its_path(
    url: str, run_id: str, state: Till, node: Quote, where: str
) -> None:
    """P4: a `Decimal` or `Fraction` where `float` is declared would read back as a
    float, another value (`Decimal("1.10") != 1.1`); it is refused with the value's path,
    as every other misfit is, and nothing is written."""

    async def go() -> None:
        p = persistence(url, run_id, TILL)
        with pytest.raises(CheckpointInvalid) as caught:
            await TILL.initialize(node, p, state=state)
        assert caught.value.field == where, caught.value
        assert caught.value.run_id == run_id
        assert await persistence(url, run_id, TILL).load_all() == []

    asyncio.run(go())


def test_a_result_of_another_type_than_declared_is_refused_at_result_data(
    url: str, run_id: str
) -> None:
    """P4: an `End` whose data is a `Decimal` where the graph declares `float` is refused
    at `result.data`; the node that returned it is marked `error`, and the run is still
    loadable, at that node."""

    async def go() -> None:
        p = persistence(url, run_id, TILL)
        with pytest.raises(CheckpointInvalid) as caught:
            await TILL.run(Quote(amount=-1.0), state=Till(), persistence=p)
        assert caught.value.field == "result.data", caught.value
        again = persistence(url, run_id, TILL)
        assert shape(await again.load_all()) == [("Quote", "error")]

    asyncio.run(go())


# -- a state field whose type changed between the run and its reader ------------------------


def _parcels(zip_type: Any, tags_type: Any) -> tuple[type, type, Graph[Any, Any, int]]:
    """A one-node graph over a `Parcel` state whose fields have the given types: the same
    graph, node and state names each time, as one module deployed again with a change."""
    parcel = make_dataclass("Parcel", [("zip", zip_type), ("tags", tags_type)])

    @dataclass
    class Ship(BaseNode[parcel, None, int]):  # type: ignore[valid-type]
        async def run(self, ctx: GraphRunContext[Any]) -> End[int]:
            return End(1)

    return parcel, Ship, Graph(nodes=(Ship,))


@pytest.mark.xfail(
    strict=True,
    reason="a value pydantic coerces as it reads a run stored under other field types is "
    "not looked for (only lost keys are): a design decision, see the module docstring",
)
def test_a_state_whose_field_types_changed_is_not_read_as_other_values(
    url: str, run_id: str
) -> None:
    """P4: a run stored with `zip="01234"` and `tags=["a", "a"]` is read by the same graph
    deployed again with `zip: int` and `tags: set[str]`, under the same workflow version:
    it would go on with `zip=1234` and `tags={"a"}`. It should be refused with
    `VersionMismatch` naming `state.zip`, as a removed field is refused."""
    old_state, old_ship, old = _parcels(str, list[str])
    _, _, new = _parcels(int, set[str])

    async def go() -> None:
        await old.initialize(
            old_ship(), persistence(url, run_id, old), state=old_state("01234", ["a", "a"])
        )
        with pytest.raises(VersionMismatch, match="state.zip"):
            await persistence(url, run_id, new).load_all()

    asyncio.run(go())
