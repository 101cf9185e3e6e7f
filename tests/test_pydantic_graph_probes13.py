"""Outside probes of `RemitStatePersistence`, round 13: runs driven step by step with
`GraphRun.next()`, states and results pydantic cannot always read back, validators,
racing starts, and a graph changed between a pause and its answer, on SQLite,
PostgreSQL and Redis, in real forked processes where the item is about them.

- P1 / errors: a driver whose `run.next()` was cut short (`asyncio.timeout`) as its
  node's end was being stored, and that retried the step (pydantic-graph's `next()`
  then stores the node in hand with `snapshot_node_if_new`), got `ForkWithoutIntent`
  ("starting a new node there: that is a fork"): the run stopped though nothing had
  forked, where pydantic-graph's own persistences go on. The retried step now stores
  the next node after the one it ran (the node does not run again); one whose node
  another resumer took over meanwhile gets `ResumeConflict`.
- Documents: the `GraphRun.next()` pattern of pydantic-graph's docs (a driver editing
  `run.state` between steps), stopped and continued in another process, stores the
  history `FullStatePersistence` holds; a driver that puts another node in place of
  its stored next one is refused as a fork, and holds nothing after.
- P4 (documents): rich dataclass states round-trip across processes; values pydantic
  would read back as others (a look-alike union member, an `init=False` field) and
  states a model's validators would change or refuse are refused naming the field,
  where `FullStatePersistence.dump_json` / `load_json` loses them silently.
- P5 / P3 (documents): k processes starting one run with one snapshot id: one runs it.
- P4 (documents): a graph that renamed a node between the pause and the answer is
  refused naming both sets of nodes, nothing is lost; a new workflow version that
  accepts the old one answers it with the renamed node.
"""

from __future__ import annotations

import asyncio
import decimal
import enum
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import test_pydantic_graph_persistence as order
from pydantic import BaseModel, Discriminator, field_validator, model_validator
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph.persistence.in_mem import FullStatePersistence
from test_pydantic_graph_persistence import World, fresh, in_child, statuses
from test_pydantic_graph_probes5 import finish, history, make, shape

from remit_core import (
    CheckpointInvalid,
    ForkWithoutIntent,
    ResumeConflict,
    VersionMismatch,
    failpoints,
)
from remit_core.conformance.processes import Barrier, fork, reap
from remit_pydantic_graph import RemitStatePersistence

#: Long enough that a claim left behind would fail the next resumer's call.
LONG = 30.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def lines(snapshots: list[Any]) -> list[tuple[str, str, Any]]:
    """Each snapshot's node (or End and its data), status and state."""
    return [
        (type(s.node).__name__, s.status, s.state)
        if isinstance(s, NodeSnapshot)
        else ("End", repr(s.result.data), s.state)
        for s in snapshots
    ]


# -- a step cut short as its node's end was stored, then retried --------------------------------


@asynccontextmanager
async def cut_short(url: str, run_id: str, world: World) -> AsyncIterator[Any]:
    """A run of the order graph from `Answer`, whose first `run.next()` a timeout cut
    short as Answer's `success` (the run's 2nd status write) was being stored: the
    timeout expires once that write is under way (held there by a sleep), however
    slow the machine is."""
    p = order.persistence(url, run_id, lease=LONG)
    failpoints.arm("writes.before", "sleep:0.6@2")

    async def expire_in_the_write(timeout: asyncio.Timeout) -> None:
        while failpoints.hits("writes.before") < 2:
            await asyncio.sleep(0.005)
        timeout.reschedule(asyncio.get_running_loop().time())

    try:
        async with order.GRAPH.iter(
            order.Answer("ann"), state=fresh(), deps=world, persistence=p
        ) as run:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(None) as timeout:
                    watch = asyncio.ensure_future(expire_in_the_write(timeout))
                    try:
                        await run.next()
                    finally:
                        watch.cancel()
            failpoints.disarm("writes.before")
            assert statuses(await p.load_all()) == ["success"]
            yield run
    finally:
        failpoints.disarm("writes.before")


def test_a_step_retried_after_its_end_was_cut_short_goes_on(
    store_url: str, run_id: str, world: World
) -> None:
    """P1: `Answer` ran; its `success` was being stored when the driver's timeout around
    `run.next()` cancelled the task. The driver retries the step: pydantic-graph stores
    the node in hand (`Pay`) with `snapshot_node_if_new` and runs it. It got
    `ForkWithoutIntent`; now the run goes on: Answer is not run again, Pay charges once,
    and the history is the one an uncut run stores."""

    async def cut_then_retry() -> Any:
        async with cut_short(store_url, run_id, world) as run:
            assert isinstance(await run.next(), order.Done)  # the retried step: Pay
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    assert asyncio.run(cut_then_retry()) == "paid 0"
    assert world.entered() == {"answer": 1, "pay": 1, "pay.after_effect": 1, "done": 1}
    assert world.sink.counts() == {"charge": 1}

    uncut = f"{run_id}-uncut"
    assert asyncio.run(order.drive(order.persistence(store_url, uncut), world, order.Answer("ann")))
    ours, theirs = (
        asyncio.run(order.persistence(store_url, rid).load_all()) for rid in (run_id, uncut)
    )
    assert lines(ours) == lines(theirs)


def test_a_retried_step_whose_node_was_taken_over_gets_resume_conflict(
    store_url: str, run_id: str, world: World
) -> None:
    """The other side: after the cut, another instance continued the run (its node's end
    was not stored, so it runs it again, P1) to the end. The cut driver's retry is a
    racing resumer's late step: `ResumeConflict`, never `ForkWithoutIntent`, and
    nothing of it is written."""

    async def go() -> None:
        async with cut_short(store_url, run_id, world) as run:
            other = order.persistence(store_url, run_id)
            assert await order.drive(other, world) == "paid 0"
            before = await other.load_all()
            with pytest.raises(ResumeConflict) as caught:
                await run.next()
            assert caught.value.run_id == run_id
            assert lines(await other.load_all()) == lines(before)

    asyncio.run(go())
    assert world.entered()["pay"] == 1 and world.sink.counts() == {"charge": 1}


# -- GraphRun.next() step by step, as pydantic-graph's docs drive it ----------------------------


@dataclass
class Number:
    number: int = 0
    seen: list[str] = field(default_factory=list)


NCtx = GraphRunContext[Number, World]


@dataclass
class Increment(BaseNode[Number, World, int]):
    async def run(self, ctx: NCtx) -> Check42:
        ctx.deps.enter("increment")
        ctx.state.number += 1
        ctx.state.seen.append("increment")
        return Check42()


@dataclass
class Check42(BaseNode[Number, World, int]):
    async def run(self, ctx: NCtx) -> Increment | Bail | End[int]:
        ctx.deps.enter("check")
        ctx.state.seen.append("check")
        return Increment() if ctx.state.number < 53 else End(ctx.state.number)


@dataclass
class Bail(BaseNode[Number, World, int]):
    async def run(self, ctx: NCtx) -> End[int]:
        ctx.deps.enter("bail")
        return End(-1)


NUMBERS = Graph(nodes=(Increment, Check42, Bail), name="never_42")


async def step_by_step(persistence: Any, deps: World, steps: int) -> None:
    """The docs' `next_never_42` driver: pass each node to `run.next()`, editing the
    state when it reaches 50 (here: past it); stop after `steps` steps (or at the end)."""
    async with NUMBERS.iter(
        Increment(), state=Number(48), deps=deps, persistence=persistence
    ) as run:
        node: Any = run.next_node
        for _ in range(steps):
            if isinstance(node, End):
                break
            if run.state.number == 50:
                run.state.number = 51
            node = await run.next(node)


def test_a_step_by_step_driver_stores_what_full_state_persistence_stores(
    store_url: str, run_id: str, world: World
) -> None:
    """Documents: driven with `run.next(node)` and an edit of `run.state` between steps,
    stopped after six steps (the edit made) and continued in another process with
    `iter_from_persistence`, the run's history is the one `FullStatePersistence` holds
    for the same driver run to its end: the same nodes, statuses and states, each node
    entered once."""
    asyncio.run(step_by_step(make(store_url, run_id, NUMBERS, lease=LONG), world, 6))
    done = in_child(lambda: asyncio.run(finish(make(store_url, run_id, NUMBERS), NUMBERS, world)))
    assert done.ok and done.value == 53, done.summary()

    full: FullStatePersistence[Number, int] = FullStatePersistence()
    (world.folder / "full").mkdir()
    asyncio.run(step_by_step(full, World(world.folder / "full"), 100))
    ours = history(store_url, run_id, NUMBERS)
    assert lines(ours) == lines(full.history)
    assert [s.state.number for s in ours if isinstance(s.node, Increment)] == [48, 49, 51, 52]
    assert world.entered() == {"increment": 4, "check": 4}


def test_a_driver_that_puts_another_node_in_place_of_its_next_is_refused(
    store_url: str, run_id: str, world: World
) -> None:
    """Documents: `run.next(Bail())` where the stored next node is `Check42` (the docs'
    "skip certain nodes") would leave `Check42` never run on the line (P1):
    `ForkWithoutIntent`, nothing written, and the instance holds nothing after, so
    another instance (30 s lease) continues the run at once."""

    async def go() -> None:
        p = make(store_url, run_id, NUMBERS, lease=LONG)
        async with NUMBERS.iter(Increment(), state=Number(52), deps=world, persistence=p) as run:
            assert isinstance(await run.next(), Check42)
            with pytest.raises(ForkWithoutIntent) as caught:
                await run.next(Bail())
        assert caught.value.run_id == run_id
        assert shape(await p.load_all()) == [("Increment", "success"), ("Check42", "created")]
        assert await finish(make(store_url, run_id, NUMBERS, lease=LONG), NUMBERS, world) == 53

    asyncio.run(go())
    assert "bail" not in world.entered()


# -- rich states and results: round trips, and what would not read back ------------------------


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Item:
    when: datetime
    price: decimal.Decimal
    tags: set[str]
    color: Color


@dataclass
class Rich:
    first: Item
    by_id: dict[int, Item] = field(default_factory=dict)
    pairs: list[tuple[int, str]] = field(default_factory=list)
    ref: uuid.UUID | None = None
    ids: frozenset[int] = frozenset()
    span: timedelta = timedelta(0)
    day: date | None = None


@dataclass
class Plain:
    x: int


@dataclass
class LookAlike:
    x: int


@dataclass
class TaggedA:
    x: int
    kind: Literal["a"] = "a"


@dataclass
class TaggedB:
    x: int
    kind: Literal["b"] = "b"


Result = Plain | LookAlike | Annotated[TaggedA | TaggedB, Discriminator("kind")]
RCtx = GraphRunContext[Rich, str]


@dataclass
class Enrich(BaseNode[Rich, str, Result]):
    async def run(self, ctx: RCtx) -> Conclude:
        s = ctx.state
        s.by_id[7] = Item(
            datetime(2024, 2, 29, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2))),
            decimal.Decimal("1.10"),
            {"x", "y"},
            Color.BLUE,
        )
        s.pairs.append((1, "one"))
        s.ref, s.ids, s.span, s.day = uuid.UUID(int=5), frozenset({3, 1}), timedelta(1, 7), None
        return Conclude()


@dataclass
class Conclude(BaseNode[Rich, str, Result]):
    async def run(self, ctx: RCtx) -> End[Result]:
        ctx.state.day = date(2020, 2, 29)
        results: dict[str, Result] = {
            "plain": Plain(1),
            "look-alike": LookAlike(1),
            "tagged": TaggedB(1),
        }
        return End(results[ctx.deps])


RICH = Graph(nodes=(Enrich, Conclude), name="rich")


def rich() -> Rich:
    return Rich(
        Item(datetime(2024, 1, 1, tzinfo=timezone.utc), decimal.Decimal("0"), set(), Color.RED)
    )


def test_rich_states_round_trip_and_look_alike_results_are_refused(
    store_url: str, run_id: str
) -> None:
    """P4: a dataclass state of nested dataclasses with aware datetimes, Decimals, sets,
    frozensets, enums, UUIDs, int-keyed dicts and tuples, stopped after `Enrich` and
    continued in another process, ends equal to the same run on `FullStatePersistence`,
    each value of its type. An End of a union member pydantic would read back as another
    (`LookAlike` as `Plain`, which `FullStatePersistence`'s JSON does) is refused naming
    `result.data`; a discriminated one is stored and read back as itself."""

    async def stop(rid: str) -> None:
        p = make(store_url, rid, RICH, lease=LONG)
        async with RICH.iter(Enrich(), state=rich(), deps="plain", persistence=p) as run:
            await run.next()

    asyncio.run(stop(run_id))
    done = in_child(lambda: asyncio.run(finish(make(store_url, run_id, RICH), RICH, "tagged")))
    assert done.ok, done.summary()
    full: FullStatePersistence[Rich, Result] = FullStatePersistence()
    expected = asyncio.run(RICH.run(Enrich(), state=rich(), deps="tagged", persistence=full))
    ours = history(store_url, run_id, RICH)
    assert lines(ours) == lines(full.history)
    end = ours[-1]
    assert isinstance(end, EndSnapshot) and end.result.data == TaggedB(1)
    assert end.state == expected.state and isinstance(end.state.by_id[7].price, decimal.Decimal)
    assert isinstance(end.state.by_id[7].tags, set) and isinstance(end.state.ids, frozenset)

    async def refused() -> CheckpointInvalid:
        with pytest.raises(CheckpointInvalid) as caught:
            await RICH.run(
                Enrich(),
                state=rich(),
                deps="look-alike",
                persistence=make(store_url, f"{run_id}-2", RICH),
            )
        return caught.value

    error = asyncio.run(refused())
    assert error.field == "result.data" and "LookAlike" in str(error)
    assert shape(history(store_url, f"{run_id}-2", RICH)) == [
        ("Enrich", "success"),
        ("Conclude", "error"),
    ]

    full.set_graph_types(RICH)
    look_alike: FullStatePersistence[Rich, Result] = FullStatePersistence()
    asyncio.run(RICH.run(Enrich(), state=rich(), deps="look-alike", persistence=look_alike))
    full.load_json(look_alike.dump_json())
    last = full.history[-1]
    assert isinstance(last, EndSnapshot) and type(last.result.data) is Plain  # silently another


@dataclass
class Totals:
    name: str = "cart"
    total: int = field(init=False, default=0)


@dataclass
class AddUp(BaseNode[Totals, None, int]):
    async def run(self, ctx: GraphRunContext[Totals]) -> End[int]:
        ctx.state.total += 5
        return End(ctx.state.total)


TOTALS = Graph(nodes=(AddUp,), name="totals")


class Span(BaseModel):
    name: str
    low: int = 0
    high: int = 10

    @field_validator("name")
    @classmethod
    def stripped(cls, value: str) -> str:
        return value.strip()

    @model_validator(mode="after")
    def ordered(self) -> Span:
        if self.low > self.high:
            raise ValueError("low must not exceed high")
        return self


@dataclass
class Widen(BaseNode[Span, str, str]):
    async def run(self, ctx: GraphRunContext[Span, str]) -> End[str]:
        if ctx.deps == "invert":
            ctx.state.low = 20
        if ctx.deps == "pad":
            ctx.state.name = "  ann  "
        ctx.state.high += 5
        return End(ctx.state.name)


SPANS = Graph(nodes=(Widen,), name="spans")


@pytest.mark.parametrize(
    ("graph", "start", "state", "deps", "field_name"),
    [
        (TOTALS, AddUp, Totals, None, "state.total"),
        (SPANS, Widen, lambda: Span(name="ann"), "invert", "state"),
        (SPANS, Widen, lambda: Span(name="ann"), "pad", "state.name"),
    ],
    ids=["init-false-field", "model-validator", "normalizing-validator"],
)
def test_states_pydantic_would_change_or_refuse_are_refused_naming_the_field(
    store_url: str,
    run_id: str,
    graph: Graph[Any, Any, Any],
    start: Any,
    state: Any,
    deps: Any,
    field_name: str,
) -> None:
    """P4: an `init=False` dataclass field (pydantic writes it, then reads its default), a
    model left breaking its `model_validator` (no `validate_assignment`) and a value its
    `field_validator` would normalize on read never reach the store: `CheckpointInvalid`
    naming the field; the node is marked `error` with the state it started from, and the
    run is still continued (with valid input) from another process."""

    async def run() -> CheckpointInvalid:
        with pytest.raises(CheckpointInvalid) as caught:
            await graph.run(
                start(), state=state(), deps=deps, persistence=make(store_url, run_id, graph)
            )
        return caught.value

    error = asyncio.run(run())
    assert error.field == field_name and error.run_id == run_id
    (only,) = history(store_url, run_id, graph)
    assert isinstance(only, NodeSnapshot) and only.status == "error" and only.state == state()
    if graph is SPANS:
        done = in_child(lambda: asyncio.run(finish(make(store_url, run_id, SPANS), SPANS, "ok")))
        assert done.ok and done.value == "ann", done.summary()
        assert history(store_url, run_id, SPANS)[-1].state == Span(name="ann", high=15)


# -- k processes starting one run with one snapshot id -------------------------------------------


def test_k_processes_starting_one_run_with_one_snapshot_id_run_it_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P3: four processes behind a barrier start one run with the same snapshot id
    (`snapshot_node_if_new` is the atomic insert-if-absent the interface asks for, which
    a job runner uses to make its start idempotent), its first node charging. One runs
    the run to its end; the others are refused (`ResumeConflict` while the winner holds
    it, `ForkWithoutIntent` once it ran the node) and run nothing: the charge applies
    once and the line holds one snapshot of that id."""
    barrier = Barrier(4)

    def starter() -> Any:
        barrier.wait()
        pay = order.Pay()
        pay.set_snapshot_id("Pay:job-1")
        return asyncio.run(order.drive(order.persistence(store_url, run_id), world, pay))

    workers = [fork(starter, barrier=barrier) for _ in range(4)]
    try:
        barrier.release()
        outcomes = [w.wait(60) for w in workers]
    finally:
        reap(workers)
    summaries = [o.summary() for o in outcomes]
    assert [o.value for o in outcomes if o.ok] == ["paid 0"], summaries
    assert all(o.raised("ResumeConflict", "ForkWithoutIntent") for o in outcomes if not o.ok)
    assert world.entered() == {"pay": 1, "pay.after_effect": 1, "done": 1}
    assert world.sink.counts() == {"charge": 1}
    line = asyncio.run(order.persistence(store_url, run_id).load_all())
    assert [s.id for s in line].count("Pay:job-1") == 1 and statuses(line)[-1] == "end"


# -- a graph changed between a pause and its answer ----------------------------------------------


@dataclass
class Ask(BaseNode[order.Order, World, str]):
    """The order graph's pause in the next version, which answers it with `Approval`."""

    async def run(self, ctx: order.Ctx) -> Approval:
        raise AssertionError("the pause never runs")


@dataclass
class Approval(BaseNode[order.Order, World, str]):
    """`Answer` renamed."""

    value: str

    async def run(self, ctx: order.Ctx) -> order.Pay:
        ctx.deps.enter("approval")
        ctx.state["approved_by"] = self.value
        return order.Pay()


RENAMED = Graph(nodes=(order.Start, Ask, Approval, order.Pay, order.Done), name="order-v2")


def renamed(url: str, run_id: str, **kw: Any) -> RemitStatePersistence[order.Order, str]:
    p: RemitStatePersistence[order.Order, str] = RemitStatePersistence(url, run_id, **kw)
    p.set_graph_types(RENAMED)
    return p


def test_a_graph_that_renamed_a_node_between_pause_and_answer_loses_nothing(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: a run paused by the order graph is answered by its next version, in which
    `Answer` is renamed `Approval`. Under the same workflow version, the answer and
    continuing are refused with `VersionMismatch` naming both nodes; nothing is written
    and the run stays paused. Under its own version that accepts the old one, the new
    graph answers with `Approval` and ends the run, charging once; the old graph, which
    does not accept the new version, then refuses the run instead of reading it."""
    asyncio.run(order.to_pause(store_url, run_id, world))
    before = asyncio.run(order.persistence(store_url, run_id).load_all())

    for call in (
        lambda: renamed(store_url, run_id).resume(Approval("ann")),
        lambda: finish(renamed(store_url, run_id), RENAMED, world),
    ):
        with pytest.raises(VersionMismatch) as caught:
            asyncio.run(call())
        assert "Answer" in str(caught.value) and "Approval" in str(caught.value)
        assert caught.value.run_id == run_id
    after = asyncio.run(order.persistence(store_url, run_id).load_all())
    assert [s.id for s in after] == [s.id for s in before] and statuses(after)[-1] == "created"

    async def v2() -> Any:
        p = renamed(store_url, run_id, workflow_version="v2", accept_versions={""})
        await p.resume(Approval("ann"))
        async with RENAMED.iter_from_persistence(p, deps=world) as run:
            async for _ in run:
                pass
        return run.result.output if run.result else None

    assert asyncio.run(v2()) == "paid 100"
    line = asyncio.run(
        renamed(store_url, run_id, workflow_version="v2", accept_versions={""}).load_all()
    )
    assert [type(getattr(s, "node", s)).__name__ for s in line] == [
        "Start",
        "Ask",
        "Approval",
        "Pay",
        "Done",
        "End",
    ]
    assert world.sink.counts() == {"charge": 1} and world.entered()["approval"] == 1
    with pytest.raises(VersionMismatch):
        asyncio.run(order.persistence(store_url, run_id).load_all())
