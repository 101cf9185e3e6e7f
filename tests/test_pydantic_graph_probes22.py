"""Outside probes of `RemitStatePersistence`, round 22; on SQLite, PostgreSQL and Redis.

- P4 / errors: a node of another graph or module whose class has the name of one of the
  graph's nodes (a `Charge` of another graph), returned by a node or given as an answer to
  `resume()`, was refused at `node` with pydantic's "Unable to extract tag using
  discriminator", which names neither node nor class. It is refused naming both classes:
  `CheckpointInvalid` at `node` when a node returns it, `ValueError` from `resume()`.
- Errors: `run.next(End(...))`, and `run.next()` again after the run ended, raised a
  `TypeError` saying that `snapshot_node_if_new()` takes a node, a method the driver never
  called. It says that `run.next()` takes a node to run, and that a run ends when a node
  returns `End`.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core import CheckpointInvalid


def fresh_run() -> str:
    return f"pg22-{uuid.uuid4().hex}"


# -- a node of another graph with the name of one of this graph's -----------------------------


@dataclass
class Ledger:
    amount: int = 0
    approved_by: str | None = None


def strangers() -> tuple[type[BaseNode[Any, Any, Any]], type[BaseNode[Any, Any, Any]]]:
    """Another graph's `Charge` and `Approve`: classes of the same names as this graph's,
    with fields and a `run` of their own."""

    @dataclass
    class Charge(BaseNode[Ledger, None, str]):
        approver: str = "mallory"
        refund: bool = True

        async def run(self, ctx: GraphRunContext[Ledger]) -> End[str]:
            return End("refunded")

    @dataclass
    class Approve(BaseNode[Ledger, None, str]):
        async def run(self, ctx: GraphRunContext[Ledger]) -> End[str]:
            return End("never")

    return Charge, Approve


STRANGE_CHARGE, STRANGE_APPROVE = strangers()


@dataclass
class Prepare(BaseNode[Ledger, None, str]):
    stray: bool = False

    async def run(self, ctx: GraphRunContext[Ledger]) -> Approve:
        ctx.state.amount = 42
        if self.stray:
            return STRANGE_APPROVE()  # type: ignore[return-value]
        return Approve()


@dataclass
class Approve(BaseNode[Ledger, None, str]):
    async def run(self, ctx: GraphRunContext[Ledger]) -> Charge:
        raise RuntimeError("answered with resume()")


@dataclass
class Charge(BaseNode[Ledger, None, str]):
    approver: str = ""

    async def run(self, ctx: GraphRunContext[Ledger]) -> End[str]:
        ctx.state.approved_by = self.approver
        return End(f"charged {ctx.state.amount}")


ORDERS = Graph(nodes=(Prepare, Approve, Charge), name="orders")


def test_a_node_of_another_graph_with_a_name_of_this_graphs_is_refused_naming_both(
    url: str,
) -> None:
    """A node that returns another graph's `Approve`, and an answer that is another graph's
    `Charge`, are refused naming both classes; nothing is written after them, and the
    paused run is answered and ends with this graph's own `Charge`."""
    stray_run, run_id = fresh_run(), fresh_run()

    async def go() -> None:
        p = persistence(url, stray_run, ORDERS)
        with pytest.raises(CheckpointInvalid) as refused:
            await ORDERS.run(Prepare(stray=True), state=Ledger(), persistence=p)
        assert refused.value.field == "node", refused.value
        message = str(refused.value)
        assert "is not this graph's Approve" in message, message
        assert f"{__name__}.Approve" in message and "strangers.<locals>.Approve" in message
        assert shape(await persistence(url, stray_run, ORDERS).load_all()) == [("Prepare", "error")]

        p = persistence(url, run_id, ORDERS)
        async with ORDERS.iter(Prepare(), state=Ledger(), persistence=p) as run:
            async for node in run:
                if isinstance(node, Approve):
                    break
        answer = persistence(url, run_id, ORDERS)
        with pytest.raises(ValueError, match="is not this graph's Charge") as wrong:
            await answer.resume(STRANGE_CHARGE())  # type: ignore[arg-type]
        assert "strangers.<locals>.Charge" in str(wrong.value), wrong.value
        assert shape(await answer.load_all()) == [("Prepare", "success"), ("Approve", "created")]
        assert await answer.paused() is not None

        await answer.resume(Charge(approver="alice"))
        again = persistence(url, run_id, ORDERS)
        async with ORDERS.iter_from_persistence(again) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "charged 42"
        assert run.result.state == Ledger(amount=42, approved_by="alice")

    asyncio.run(go())


# -- run.next() given an End ------------------------------------------------------------------


@dataclass
class Count:
    n: int = 0
    seen: list[str] = field(default_factory=list)


@dataclass
class Step(BaseNode[Count, None, int]):
    async def run(self, ctx: GraphRunContext[Count]) -> Last:
        ctx.state.n += 1
        return Last()


@dataclass
class Last(BaseNode[Count, None, int]):
    async def run(self, ctx: GraphRunContext[Count]) -> End[int]:
        return End(ctx.state.n)


COUNTS = Graph(nodes=(Step, Last), name="counts")


def test_run_next_given_an_end_says_run_next_takes_a_node(url: str) -> None:
    """`run.next(End(...))` mid-run, and `run.next()` once the run has ended, raise a
    `TypeError` about `run.next()`, not about a persistence method the driver never
    called; nothing is written, and the run goes on (or stays ended)."""
    run_id = fresh_run()

    async def go() -> None:
        p = persistence(url, run_id, COUNTS)
        async with COUNTS.iter(Step(), state=Count(), persistence=p) as run:
            await run.next()
            with pytest.raises(TypeError) as given:
                await run.next(End(5))
            assert "run.next() takes a node" in str(given.value), given.value
            assert "snapshot_node_if_new() takes" not in str(given.value)
            assert shape(await p.load_all()) == [("Step", "success"), ("Last", "created")]
            last = await run.next()
            assert isinstance(last, End) and last.data == 1
            with pytest.raises(TypeError) as after:
                await run.next()
            assert "run.next() takes a node" in str(after.value), after.value
        assert shape(await p.load_all()) == [
            ("Step", "success"),
            ("Last", "success"),
            ("End", "end"),
        ]

    asyncio.run(go())
