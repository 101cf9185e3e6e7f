"""Outside probes of `RemitStatePersistence`, round 38: snapshot ids a caller gets wrong, a
stored node run again through `Graph.iter` / `Graph.run` after its resumer died or it
raised, results and states of common types read back in another process, custom node
ids raced by processes, and pydantic-graph's beta graph API; on SQLite, PostgreSQL and
Redis, in real forked processes where the item is about them.

Found:

- Errors / P5: `resume(node, pause_id=...)` and `update_state(state, pause_id=...)` with an
  id that names no snapshot of the run (a typo, the pause of another run) raised
  `ResumeConflict`, saying the pause "was answered already, or is not this run's": a
  client that takes `ResumeConflict` for "another resumer answered" dropped its answer
  while the run stayed paused. It raises `UnknownPause` now, an `UnknownRecord` (so a
  `LookupError`, as `record_run` and `fork` of an unknown id raise) that says the id is no
  snapshot of this run; still a `ResumeConflict` for code that caught it so. Nothing is
  stored either way.
- Errors / L1: a stored node left `running` by a resumer that was SIGKILLed (its lease run
  out), or left `error` by a node that raised, run again through `Graph.iter` or
  `Graph.run` from the head `load_all()` gave (as a user who read the run writes it), was
  refused with pydantic-graph's bare "Incorrect snapshot status 'running', must be
  'created' or 'pending'.", naming neither the run nor the snapshot nor a way on. The
  refusal (still `GraphNodeStatusError`) names them and says that
  `iter_from_persistence()` hands the node out again; nothing runs, and that way the run
  ends with its effect applied once.

Held: `End` results of a dataclass, a pydantic model, None and nested containers, and a
state of datetime, Decimal, UUID, enum, bytes and nested dataclass fields, written by
one process, read back exactly (values and types) by another; four processes racing
`iter_from_persistence` on an answered run whose nodes have custom node ids (with a
`:` in them) behind a barrier: the answer's node runs once, the others get
`ResumeConflict` or find the run ended, the charge is applied once; a graph of
pydantic-graph's beta API (`pydantic_graph.beta.GraphBuilder`) is refused by
`set_graph_types` with a `TypeError` that names the builder API.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphNodeStatusError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph_parts import persistence, shape
from test_pydantic_graph_persistence import (
    GRAPH,
    Answer,
    World,
    drive,
    fresh,
    in_child,
    to_pause,
)
from test_pydantic_graph_persistence import persistence as order_persistence
from test_pydantic_graph_probes14 import raced

from remit_core import effect
from remit_core.errors import ResumeConflict, UnknownRecord
from remit_pydantic_graph import RemitStatePersistence, UnknownPause

_T = TypeVar("_T")


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def line_of(url: str, run_id: str) -> list[tuple[str, str, str]]:
    """The run's line as (snapshot id, node, status) triples, read by a new instance."""
    line = asyncio.run(order_persistence(url, run_id).load_all())
    return [(s.id, *pair) for s, pair in zip(line, shape(line), strict=True)]


# -- a pause id that names no snapshot of the run ----------------------------------------


def test_a_pause_id_of_no_snapshot_of_the_run_is_unknown_and_nothing_is_stored(
    url: str, run_id: str, world: World
) -> None:
    """Errors / P5: `resume()` and `update_state()` with a `pause_id` that names no snapshot
    of the run (made up, or another run's pause) raise `UnknownPause`: an `UnknownRecord`
    (a `LookupError`) naming the id, not only a `ResumeConflict`, which a client reads as
    "answered by another resumer". Nothing is stored, no claim is kept, and the answer
    with the pause's own id is then taken and the run ends, charged once."""
    asyncio.run(to_pause(url, run_id, world))
    other_run = f"{run_id}-other"
    asyncio.run(to_pause(url, other_run, world))
    pause = asyncio.run(order_persistence(url, run_id).load_all())[-1]
    other_pause = asyncio.run(order_persistence(url, other_run).load_all())[-1]
    before = line_of(url, run_id)

    async def wrong_ids() -> list[BaseException]:
        p = order_persistence(url, run_id)
        refusals: list[BaseException] = []
        for bogus in (f"Ask:{uuid.uuid4().hex}", other_pause.id):
            calls: list[Awaitable[Any]] = [
                p.resume(Answer("ann"), pause_id=bogus),
                p.update_state({**fresh(), "amount": 5}, pause_id=bogus),
            ]
            for call in calls:
                with pytest.raises(UnknownRecord) as refused:
                    await call
                refusals.append(refused.value)
                assert bogus in str(refused.value)
        return refusals

    refusals = asyncio.run(wrong_ids())
    for refusal in refusals:
        assert isinstance(refusal, UnknownPause)
        assert isinstance(refusal, LookupError) and isinstance(refusal, ResumeConflict)
        assert "no snapshot of this run" in str(refusal), refusal
        assert "answered already" not in str(refusal), refusal
    assert line_of(url, run_id) == before
    paused = asyncio.run(order_persistence(url, run_id).paused())
    assert paused is not None and paused.id == pause.id  # still paused, nobody holds it

    asyncio.run(order_persistence(url, run_id).resume(Answer("ann"), pause_id=pause.id))
    assert asyncio.run(drive(order_persistence(url, run_id), world)) == "paid 100"
    final = asyncio.run(order_persistence(url, run_id).load_all())[-1]
    assert isinstance(final, EndSnapshot) and final.state["approved_by"] == "ann"
    assert world.sink.counts() == {"charge": 1}


# -- a stored node run again through Graph.iter / Graph.run ------------------------------


async def _until_free(call: Callable[[], Awaitable[_T]]) -> _T:
    """`call()` until it stops getting `ResumeConflict` (a dead holder's lease runs out)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await call()
        except ResumeConflict:
            assert time.monotonic() < deadline, "the dead resumer's claim never lapsed"
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("entry", ["iter", "run"])
def test_a_node_a_killed_resumer_left_running_is_refused_by_graph_iter_saying_how_to_go_on(
    url: str, run_id: str, world: World, entry: str
) -> None:
    """Errors / L1 / P2: the process running `Pay` is SIGKILLed after its charge. Another
    process reads the run and runs the head it got from `load_all()` through `Graph.iter`
    (or `Graph.run`), as it would a paused node: once the dead claim has lapsed, that is
    refused with `GraphNodeStatusError` naming the run, the snapshot and
    `iter_from_persistence()`; nothing runs or is stored. `iter_from_persistence()` then
    ends the run, the charge applied once."""
    asyncio.run(to_pause(url, run_id, world))

    def crash() -> None:
        world.kill_at = "pay.after_effect"

        async def go() -> None:
            p = order_persistence(url, run_id)
            await p.resume(Answer("ann"))
            await drive(p, world)

        asyncio.run(go())

    assert in_child(crash).status == "killed"
    before = line_of(url, run_id)
    assert [status for _, _, status in before][-1] == "running"
    head = asyncio.run(order_persistence(url, run_id).load_all())[-1]
    assert isinstance(head, NodeSnapshot)

    async def run_head() -> Any:
        p = order_persistence(url, run_id)
        if entry == "run":
            return await GRAPH.run(head.node, state=head.state, deps=world, persistence=p)
        async with GRAPH.iter(head.node, state=head.state, deps=world, persistence=p) as run:
            async for _ in run:
                pass
        return run.result

    with pytest.raises(GraphNodeStatusError) as refused:
        asyncio.run(_until_free(run_head))
    message = str(refused.value)
    assert refused.value.actual_status == "running"
    assert head.id in message and run_id in message, message
    assert "iter_from_persistence()" in message and "Nothing was run" in message, message
    assert line_of(url, run_id) == before
    assert world.entered()["pay"] == 1

    assert asyncio.run(drive(order_persistence(url, run_id), world)) == "paid 100"
    assert world.sink.counts() == {"charge": 1}
    assert world.entered()["pay"] == 2


#: The charges that reached the payment API, by idempotency key (this process only).
CHARGED: list[str] = []
#: Whether `Charge` raises after its charge (its first run here).
FLAKY: list[bool] = []


@effect(idempotent=True)
async def charge(amount: int, *, idempotency_key: str) -> str:
    CHARGED.append(idempotency_key)
    return f"charged {amount}"


@dataclass
class Cart:
    amount: int = 0
    log: list[str] = field(default_factory=list)


@dataclass
class Fill(BaseNode[Cart, None, str]):
    async def run(self, ctx: GraphRunContext[Cart]) -> Charge:
        ctx.state.amount = 42
        ctx.state.log.append("fill")
        return Charge()


@dataclass
class Charge(BaseNode[Cart, None, str]):
    async def run(self, ctx: GraphRunContext[Cart]) -> End[str]:
        ctx.state.log.append("charge")
        receipt = await charge(ctx.state.amount)
        if FLAKY:
            FLAKY.pop()
            raise RuntimeError("the mail server is down")
        return End(receipt)


CARTS = Graph(nodes=(Fill, Charge))


def test_a_node_that_raised_run_again_through_graph_run_says_how_to_go_on(
    url: str, run_id: str
) -> None:
    """Errors / P2: `Charge` charges, then raises; `graph.run` raises it. Running the head
    `load_all()` gives through `graph.run` again is refused with `GraphNodeStatusError`
    naming the run, the snapshot and `iter_from_persistence()`; nothing runs. That way
    the node runs again and the run ends, the charge applied once."""
    CHARGED.clear()
    FLAKY[:] = [True]

    async def go() -> tuple[GraphNodeStatusError, list[Any], list[Any], str]:
        with pytest.raises(RuntimeError, match="mail server"):
            await CARTS.run(Fill(), state=Cart(), persistence=persistence(url, run_id, CARTS))
        line = await persistence(url, run_id, CARTS).load_all()
        head = line[-1]
        assert isinstance(head, NodeSnapshot) and head.status == "error"
        with pytest.raises(GraphNodeStatusError) as refused:
            await CARTS.run(
                head.node, state=head.state, persistence=persistence(url, run_id, CARTS)
            )
        after = await persistence(url, run_id, CARTS).load_all()
        async with CARTS.iter_from_persistence(persistence(url, run_id, CARTS)) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return refused.value, shape(line), shape(after), run.result.output

    refusal, line, after, output = asyncio.run(go())
    message = str(refusal)
    assert refusal.actual_status == "error" and run_id in message, message
    assert "iter_from_persistence()" in message and "raised" in message, message
    assert line == after == [("Fill", "success"), ("Charge", "error")]
    assert output == "charged 42" and len(CHARGED) == 1


# -- results and states of common types, read back in another process --------------------


class Tier(enum.Enum):
    GOLD = "gold"
    SILVER = "silver"


@dataclass
class Address:
    city: str
    zip: str


@dataclass
class Ledger:
    at: dt.datetime = dt.datetime(2024, 3, 1, 12, 30, tzinfo=dt.timezone.utc)
    day: dt.date = dt.date(2024, 3, 1)
    wait: dt.timedelta = dt.timedelta(hours=2, microseconds=7)
    total: Decimal = Decimal("0.00")
    ref: uuid.UUID = uuid.UUID(int=0)
    tier: Tier = Tier.SILVER
    blob: bytes = b""
    ship_to: Address | None = None
    seen: list[dt.datetime] = field(default_factory=list)


class Invoice(pydantic.BaseModel):
    number: int
    lines: list[tuple[str, Decimal]]
    due: dt.date


@dataclass
class Receipt:
    code: str
    amount: Decimal


Result = Receipt | Invoice | dict[str, list[Receipt]] | None

RESULTS: dict[str, Any] = {
    "dataclass": Receipt("r-1", Decimal("12.50")),
    "model": Invoice(number=7, lines=[("tea", Decimal("3.10"))], due=dt.date(2024, 4, 1)),
    "nested": {"paid": [Receipt("r-2", Decimal("1")), Receipt("r-3", Decimal("2.5"))]},
    "none": None,
}


@dataclass
class Book(BaseNode[Ledger, None, Result]):
    kind: str

    async def run(self, ctx: GraphRunContext[Ledger]) -> End[Result]:
        self.book(ctx.state)
        return End(RESULTS[self.kind])

    @staticmethod
    def book(state: Ledger) -> None:
        state.total += Decimal("19.99")
        state.ref = uuid.UUID("12345678-1234-5678-1234-567812345678")
        state.tier = Tier.GOLD
        state.blob = "naïve €".encode()
        state.ship_to = Address("Lyon", "69001")
        state.seen.append(dt.datetime(2024, 3, 2, 8, 0, tzinfo=dt.timezone(dt.timedelta(hours=2))))


BOOKS = Graph(nodes=(Book,))


@pytest.mark.parametrize("kind", sorted(RESULTS))
def test_results_and_states_of_common_types_read_back_exactly_in_another_process(
    url: str, run_id: str, kind: str
) -> None:
    """P4 (held): a run written by a forked process, read by this one: its `End` result (a
    dataclass, a pydantic model, None, nested containers of dataclasses) and its state
    (datetime, date, timedelta, Decimal, UUID, enum, bytes, nested dataclass) are the
    values and types the writer held."""

    def write() -> str:
        async def go() -> str:
            result = await BOOKS.run(
                Book(kind), state=Ledger(), persistence=persistence(url, run_id, BOOKS)
            )
            return repr(result.output)

        return asyncio.run(go())

    written = in_child(write)
    assert written.ok, written.summary()
    line = asyncio.run(persistence(url, run_id, BOOKS).load_all())
    end = line[-1]
    assert isinstance(end, EndSnapshot)
    assert repr(end.result.data) == written.value
    expected = Ledger()
    Book(kind).book(expected)
    assert end.state == expected
    assert end.result.data == RESULTS[kind] and type(end.result.data) is type(RESULTS[kind])
    state = end.state
    assert state.total == Decimal("19.99") and isinstance(state.total, Decimal)
    assert state.tier is Tier.GOLD and state.blob == "naïve €".encode()
    assert state.ref == uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert state.ship_to == Address("Lyon", "69001") and type(state.ship_to) is Address
    assert state.seen[0].utcoffset() == dt.timedelta(hours=2)
    assert state.wait == dt.timedelta(hours=2, microseconds=7)


# -- custom node ids, raced by processes -------------------------------------------------


@dataclass
class Bill:
    amount: int = 0
    approved_by: str | None = None
    log: list[str] = field(default_factory=list)


BillCtx = GraphRunContext[Bill, World]


@dataclass
class Open(BaseNode[Bill, World, str]):
    @classmethod
    def get_node_id(cls) -> str:
        return "billing:open"

    async def run(self, ctx: BillCtx) -> Approve:
        ctx.deps.enter("open")
        ctx.state.amount = 100
        ctx.state.log.append("open")
        return Approve()


@dataclass
class Approve(BaseNode[Bill, World, str]):
    @classmethod
    def get_node_id(cls) -> str:
        return "billing:approve"

    async def run(self, ctx: BillCtx) -> Settle:
        raise AssertionError("the pause never runs")


@dataclass
class Settle(BaseNode[Bill, World, str]):
    approver: str

    @classmethod
    def get_node_id(cls) -> str:
        return "billing:settle"

    async def run(self, ctx: BillCtx) -> End[str]:
        ctx.deps.enter("settle")
        sink = ctx.deps.sink

        @effect(reconcile=sink.reconcile)
        def pay(*, idempotency_key: str) -> str:
            return sink.apply("charge", idempotency_key)

        await asyncio.to_thread(pay)
        ctx.state.approved_by = self.approver
        ctx.state.log.append("settle")
        return End(f"settled {ctx.state.amount}")


BILLS = Graph(nodes=(Open, Approve, Settle))


def test_processes_racing_a_run_of_custom_node_ids_run_each_node_once(
    url: str, run_id: str, world: World
) -> None:
    """P5 / P2 (held): nodes whose `get_node_id()` is not their class name (and holds a
    `:`, as the snapshot ids do). A paused run is answered; four processes then race
    `iter_from_persistence` behind a barrier: one runs the answer's node, the others get
    `ResumeConflict` (or find the run ended) and run nothing; the charge is applied once;
    the snapshot ids keep pydantic-graph's `{node_id}:{hex}` form."""

    async def to_answer() -> None:
        p = persistence(url, run_id, BILLS)
        async with BILLS.iter(Open(), state=Bill(), deps=world, persistence=p) as run:
            async for node in run:
                if isinstance(node, Approve):
                    break
        await persistence(url, run_id, BILLS).resume(Settle("ann"))

    asyncio.run(to_answer())

    def racer() -> str:
        async def go() -> str:
            p = persistence(url, run_id, BILLS)
            async with BILLS.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return run.result.output

        return asyncio.run(go())

    outcomes = raced([racer] * 4)
    assert sorted(o.status for o in outcomes) == ["error", "error", "error", "ok"], [
        o.summary() for o in outcomes
    ]
    # A loser that looked once the winner had ended the run finds nothing to continue
    # (pydantic-graph's `GraphRuntimeError`, as `load_next()` returns None).
    assert all(
        o.raised("ResumeConflict") or "Unable to restore snapshot" in o.summary()
        for o in outcomes
        if not o.ok
    ), [o.summary() for o in outcomes]
    assert [o.value for o in outcomes if o.ok] == ["settled 100"]
    assert world.entered() == {"open": 1, "settle": 1}
    assert world.sink.counts() == {"charge": 1}
    line = asyncio.run(persistence(url, run_id, BILLS).load_all())
    assert shape(line) == [
        ("Open", "success"),
        ("Approve", "created"),
        ("Settle", "success"),
        ("End", "end"),
    ]
    for snapshot, node_id in zip(
        line, ("billing:open", "billing:approve", "billing:settle", "end"), strict=True
    ):
        assert snapshot.id.rsplit(":", 1)[0] == node_id, snapshot.id
    assert line[-1].state == Bill(100, "ann", ["open", "settle"])


# -- pydantic-graph's beta graph API -------------------------------------------------------


def test_a_graph_of_the_beta_api_is_refused_naming_the_builder(tmp_path: Path) -> None:
    """Errors (held): a graph built with `pydantic_graph.beta.GraphBuilder` has no
    persistence interface; `set_graph_types` refuses it with a `TypeError` that names the
    builder API and the `BaseNode` graph to use, not the graph's diagram."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pydantic_graph.beta import GraphBuilder, StepContext

    builder: Any = GraphBuilder(state_type=Cart, output_type=int)

    @builder.step
    async def count(ctx: StepContext[Cart, None, None]) -> int:
        return 1

    builder.add(builder.edge_from(builder.start_node).to(count))
    builder.add(builder.edge_from(count).to(builder.end_node))
    graph = builder.build()
    p: Any = RemitStatePersistence(f"sqlite:///{tmp_path / 'beta.db'}", "beta-run")
    with pytest.raises(TypeError, match="builder API") as refused:
        p.set_graph_types(graph)
    assert "pydantic_graph.graph.Graph" in str(refused.value)
    assert "flowchart" not in str(refused.value) and "stateDiagram" not in str(refused.value)
