"""Outside probes of `RemitStatePersistence`, round 5: written from the contract and
pydantic-graph's public API, on SQLite, PostgreSQL and Redis.

A dataclass state, a pydantic model state with aliases, a graph without state, End
results of several types, deps that cannot be stored, a node generic in its field's
type; runs paused by stopping the iteration and continued in other processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import pytest
from pydantic import BaseModel, Field
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import World, in_child

from remit_core import CheckpointInvalid, arun_effect
from remit_core.conformance.processes import Barrier, fork, reap
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def make(url: str, run_id: str, graph: Graph[Any, Any, Any], **kw: Any) -> Any:
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(
        url, run_id, **{"lease": LEASE, **kw}
    )
    p.set_graph_types(graph)
    return p


async def finish(p: Any, graph: Graph[Any, Any, Any], deps: Any) -> Any:
    async with graph.iter_from_persistence(p, deps=deps) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return run.result.output


def history(url: str, run_id: str, graph: Graph[Any, Any, Any]) -> list[Any]:
    return asyncio.run(make(url, run_id, graph).load_all())


def shape(snapshots: list[Any]) -> list[tuple[str, str]]:
    return [
        (type(s.node).__name__, s.status) if isinstance(s, NodeSnapshot) else ("End", "end")
        for s in snapshots
    ]


# -- a dataclass state: stop, continue elsewhere, race, invalid writes ---------------------------


@dataclass
class Line:
    sku: str
    qty: int


@dataclass
class Tally:
    count: int = 0
    lines: list[Line] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)


TCtx = GraphRunContext[Tally, World]


@dataclass
class Count(BaseNode[Tally, World, int]):
    async def run(self, ctx: TCtx) -> Book:
        ctx.deps.enter("count")
        ctx.state.count = ctx.deps.amount
        ctx.state.lines.append(Line("a", 1))
        ctx.state.seen.append("count")
        return Book()


@dataclass
class Book(BaseNode[Tally, World, int]):
    async def run(self, ctx: TCtx) -> Tell:
        ctx.deps.enter("book")
        sink = ctx.deps.sink

        async def apply(key: str) -> str:
            return sink.apply("book", key)

        await arun_effect("book", apply, reconcile=sink.reconcile)
        ctx.state.seen.append("book")
        if ctx.deps.kill_at == "book.spoil":
            ctx.state.lines[0].qty = "many"  # type: ignore[assignment]
        return Tell()


@dataclass
class Tell(BaseNode[Tally, World, int]):
    async def run(self, ctx: TCtx) -> End[int]:
        ctx.deps.enter("tell")
        ctx.state.seen.append("tell")
        return End(ctx.state.count)


TALLY = Graph(nodes=(Count, Book, Tell), name="tally")


def stop_after(url: str, run_id: str, world: World, nodes: int) -> None:
    """Run `nodes` nodes with graph.iter, then stop iterating (a pause by the driver)."""

    async def go() -> None:
        p = make(url, run_id, TALLY)
        async with TALLY.iter(Count(), state=Tally(), deps=world, persistence=p) as run:
            ran = -1  # the first item is the start node itself, not yet run
            async for _ in run:
                ran += 1
                if ran == nodes:
                    break

    asyncio.run(go())


def test_a_run_stopped_in_one_process_is_continued_in_another(
    store_url: str, run_id: str, world: World
) -> None:
    """P1: a driver stops iterating after Count; a new process continues with
    iter_from_persistence. Count is not run again, Book and Tell once, the state
    carries Count's work, and a third process finds nothing left to run."""
    stop_after(store_url, run_id, world, 1)
    assert shape(history(store_url, run_id, TALLY)) == [("Count", "success"), ("Book", "created")]
    done = in_child(lambda: asyncio.run(finish(make(store_url, run_id, TALLY), TALLY, world)))
    assert done.ok and done.value == 100, done.summary()
    assert world.entered() == {"count": 1, "book": 1, "tell": 1}
    assert world.sink.counts() == {"book": 1}
    end = history(store_url, run_id, TALLY)[-1]
    assert isinstance(end, EndSnapshot) and end.result.data == 100
    assert end.state == Tally(100, [Line("a", 1)], ["count", "book", "tell"])
    late = in_child(lambda: asyncio.run(finish(make(store_url, run_id, TALLY), TALLY, world)))
    assert late.raised("GraphRuntimeError"), late.summary()


def test_k_processes_continuing_a_stopped_run_run_each_node_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P1: four processes continue a run stopped before Book at once. Each node runs
    once, one process returns the End, the others get ResumeConflict (or, after the End,
    GraphRuntimeError); the effect applies once and the line has one End. (A driver holds
    no claim between nodes, so a late one may run Tell after another ran Book.)"""
    stop_after(store_url, run_id, world, 1)
    barrier = Barrier(4)

    def resumer() -> Any:
        barrier.wait()
        return asyncio.run(finish(make(store_url, run_id, TALLY), TALLY, world))

    workers = [fork(resumer, barrier=barrier) for _ in range(4)]
    try:
        barrier.release()
        outcomes = [w.wait(60) for w in workers]
    finally:
        reap(workers)
    ran = [o for o in outcomes if o.ok]
    assert len(ran) == 1 and ran[0].value == 100, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict", "GraphRuntimeError") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    assert world.entered() == {"count": 1, "book": 1, "tell": 1}
    assert world.sink.counts() == {"book": 1}
    assert sum(isinstance(s, EndSnapshot) for s in history(store_url, run_id, TALLY)) == 1


def test_a_node_killed_after_an_effect_node_is_recovered_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P2: a process continuing a stopped run is SIGKILLed as Tell starts, after Book
    (and its effect) completed; after the lease a new process recovers: only Tell runs
    again, and the effect is not applied again."""
    stop_after(store_url, run_id, world, 1)

    def crash() -> None:
        world.on_enter = lambda node: (
            os.kill(os.getpid(), signal.SIGKILL) if node == "tell" else None
        )
        asyncio.run(finish(make(store_url, run_id, TALLY), TALLY, world))

    assert in_child(crash).status == "killed"
    time.sleep(LEASE + 0.2)
    done = in_child(lambda: asyncio.run(finish(make(store_url, run_id, TALLY), TALLY, world)))
    assert done.ok and done.value == 100, done.summary()
    assert world.entered() == {"count": 1, "book": 1, "tell": 2}
    assert world.sink.counts() == {"book": 1}


def test_a_node_that_spoils_a_dataclass_state_writes_nothing(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """P4: Book leaves `lines[0].qty` a str in a dataclass state: CheckpointInvalid naming
    state.lines.0.qty; the head stays Book (error) with the state before it; run again
    without the fault, the run ends and the effect was applied once."""
    world = World(tmp_path, kill_at="book.spoil")
    stop_after(store_url, run_id, world, 1)
    before = history(store_url, run_id, TALLY)

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as bad:
            await finish(make(store_url, run_id, TALLY), TALLY, world)
        assert bad.value.field == "state.lines.0.qty", bad.value
        after = await make(store_url, run_id, TALLY).load_all()
        assert [s.id for s in after] == [s.id for s in before]
        assert after[-1].status == "error" and after[-1].state == before[-1].state
        world.kill_at = None
        assert await finish(make(store_url, run_id, TALLY), TALLY, world) == 100

    asyncio.run(go())
    assert world.sink.counts() == {"book": 1}


# -- a stale driver after a takeover -------------------------------------------------------------


def test_a_stale_driver_retrying_after_being_fenced_gets_resume_conflict(
    store_url: str, run_id: str, world: World
) -> None:
    """L2/P5: a driver stopped inside Book past its lease is taken over and the run ends.
    Continued, its step is fenced; a retry of the same step (run.next()) is refused as a
    racing resumer is (ResumeConflict), and writes nothing."""
    stop_after(store_url, run_id, world, 1)

    def stale() -> list[str]:
        def freeze(node: str) -> None:
            if node == "book":
                os.kill(os.getpid(), signal.SIGSTOP)

        world.on_enter = freeze

        async def go() -> list[str]:
            seen: list[str] = []
            p = make(store_url, run_id, TALLY)
            async with TALLY.iter_from_persistence(p, deps=world) as run:
                for _ in range(2):
                    try:
                        await run.next()
                    except Exception as exc:
                        seen.append(type(exc).__name__)
            return seen

        return asyncio.run(go())

    zombie = fork(stale)
    try:
        assert zombie.wait(60, stopped_counts=True).status == "stopped"
        zombie.outcome = None
        time.sleep(LEASE + 0.2)
        assert asyncio.run(finish(make(store_url, run_id, TALLY), TALLY, world)) == 100
        before = shape(history(store_url, run_id, TALLY))
        zombie.cont()
        late = zombie.wait(60)
    finally:
        reap([zombie])
    assert late.ok, late.summary()
    first, retry = late.value
    assert first in ("Fenced", "ResumeConflict", "HeadMoved"), late.value
    assert retry == "ResumeConflict", late.value
    assert shape(history(store_url, run_id, TALLY)) == before
    assert world.sink.counts() == {"book": 1}


# -- a pydantic model state with aliases ---------------------------------------------------------


class Prefs(BaseModel):
    ui_theme: str = Field(default="light", alias="uiTheme", min_length=1)


class Account(BaseModel):
    owner_name: str = Field(alias="ownerName")
    balance_cents: int = Field(default=0, alias="balanceCents", ge=0)
    prefs: Prefs = Field(default_factory=Prefs)


@dataclass
class Open(BaseNode[Account, None, int]):
    async def run(self, ctx: GraphRunContext[Account]) -> Deposit:
        ctx.state.balance_cents = 500
        return Deposit(cents=250)


@dataclass
class Deposit(BaseNode[Account, None, int]):
    cents: int
    note: Annotated[str, Field(alias="noteText")] = "cash"

    async def run(self, ctx: GraphRunContext[Account]) -> End[int]:
        ctx.state.balance_cents += self.cents
        return End(ctx.state.balance_cents)


ACCOUNTS = Graph(nodes=(Open, Deposit), name="accounts")


@dataclass
class Tune(BaseNode[Prefs, None, str]):
    async def run(self, ctx: GraphRunContext[Prefs]) -> End[str]:
        return End(ctx.state.ui_theme)


TUNES = Graph(nodes=(Tune,), name="tunes")


def test_a_model_state_with_aliases_is_stored_and_read_back(store_url: str, run_id: str) -> None:
    """P4: a valid pydantic model state whose fields have aliases (camelCase, as many
    APIs write them) is stored and read back equal, not refused as missing its fields;
    an invalid value is still refused naming its field (by the name pydantic reads)."""

    async def go() -> None:
        state = Account(ownerName="ann")
        p = make(store_url, run_id, ACCOUNTS)
        result = await ACCOUNTS.run(Open(), state=state, persistence=p)
        assert result.output == 750
        line = await make(store_url, run_id, ACCOUNTS).load_all()
        assert shape(line) == [("Open", "success"), ("Deposit", "success"), ("End", "end")]
        assert line[-1].state == Account(ownerName="ann", balanceCents=750)
        assert line[1].node == Deposit(cents=250, note="cash")
        other = make(store_url, "x" + run_id, ACCOUNTS)
        with pytest.raises(CheckpointInvalid) as bad:
            await ACCOUNTS.initialize(
                Open(), other, state=Account.model_construct(owner_name="b", balance_cents=-1)
            )
        assert "balance" in bad.value.field.lower(), bad.value
        assert await make(store_url, "x" + run_id, ACCOUNTS).load_all() == []
        # Fields with defaults only: written by name they would read back as the defaults.
        prefs = make(store_url, "p" + run_id, TUNES)
        await prefs.snapshot_node(Prefs(uiTheme="dark"), Tune())
        (tune,) = await prefs.load_all()
        assert tune.state == Prefs(uiTheme="dark")
        with pytest.raises(CheckpointInvalid) as bad:
            await prefs.update_state(Prefs.model_construct(ui_theme=""))
        assert bad.value.field == "state.uiTheme", bad.value

    asyncio.run(go())


@dataclass
class Session:
    """A dataclass state with a field pydantic leaves out of dumps: a per-process cache."""

    visits: int = 0
    cache: Annotated[dict[str, Any], Field(exclude=True)] = field(default_factory=dict)


@dataclass
class Visit(BaseNode[Session, None, int]):
    async def run(self, ctx: GraphRunContext[Session]) -> Leave:
        ctx.state.visits += 1
        ctx.state.cache["client"] = object()  # not storable, and not meant to be stored
        return Leave()


@dataclass
class Leave(BaseNode[Session, None, int]):
    async def run(self, ctx: GraphRunContext[Session]) -> End[int]:
        ctx.state.visits += 1
        return End(ctx.state.visits)


SESSIONS = Graph(nodes=(Visit, Leave), name="sessions")


def test_a_dataclass_field_excluded_from_dumps_is_not_stored(store_url: str, run_id: str) -> None:
    """P4: a dataclass state's `Field(exclude=True)` field is left out of the snapshot (as
    a model's is), not refused because it reads back as its default; the run stops after
    Visit and is continued in another process, which starts with an empty cache."""

    async def first() -> None:
        p = make(store_url, run_id, SESSIONS)
        async with SESSIONS.iter(Visit(), state=Session(), persistence=p) as run:
            await run.next()

    asyncio.run(first())
    done = in_child(lambda: asyncio.run(finish(make(store_url, run_id, SESSIONS), SESSIONS, None)))
    assert done.ok and done.value == 2, done.summary()
    line = history(store_url, run_id, SESSIONS)
    assert shape(line) == [("Visit", "success"), ("Leave", "success"), ("End", "end")]
    assert [s.state for s in line] == [Session(0), Session(1), Session(2)]


# -- a graph without state, End results of several types -----------------------------------------


@dataclass
class Ping(BaseNode[None, None, None]):
    async def run(self, ctx: GraphRunContext[None]) -> Pong:
        return Pong(hits=1)


@dataclass
class Pong(BaseNode[None, None, None]):
    hits: int

    async def run(self, ctx: GraphRunContext[None]) -> End[None]:
        return End(None)


STATELESS = Graph(nodes=(Ping, Pong), name="stateless")


def test_a_graph_without_state_is_stopped_and_continued(store_url: str, run_id: str) -> None:
    """P1: a graph with no state and an End of None, stopped after Ping and continued in
    another process; the line is Ping, Pong, End(None)."""

    async def first() -> None:
        p = make(store_url, run_id, STATELESS)
        async with STATELESS.iter(Ping(), persistence=p) as run:
            await run.next()

    asyncio.run(first())
    done = in_child(
        lambda: asyncio.run(finish(make(store_url, run_id, STATELESS), STATELESS, None))
    )
    assert done.ok and done.value is None, done.summary()
    line = history(store_url, run_id, STATELESS)
    assert shape(line) == [("Ping", "success"), ("Pong", "success"), ("End", "end")]
    assert line[1].node == Pong(hits=1) and line[-1].state is None
    assert line[-1].result.data is None


class Receipt(BaseModel):
    total: int = Field(ge=0)
    at: datetime
    tags: tuple[str, ...] = ()


@dataclass
class Sum(BaseNode[Tally, None, Receipt]):
    async def run(self, ctx: GraphRunContext[Tally]) -> End[Receipt]:
        at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
        return End(Receipt(total=ctx.state.count, at=at, tags=("a", "b")))


RECEIPTS = Graph(nodes=(Sum,), name="receipts")


@dataclass
class Pair(BaseNode[Tally, None, tuple[int, str]]):
    async def run(self, ctx: GraphRunContext[Tally]) -> End[tuple[int, str]]:
        if ctx.state.seen:
            return End(ctx.state.seen[0])  # type: ignore[arg-type]  # a str, not the tuple
        return End((ctx.state.count, "x"))


PAIRS = Graph(nodes=(Pair,), name="pairs")


def test_end_results_of_several_types_read_back_equal(store_url: str, run_id: str) -> None:
    """P4: End of a pydantic model (with a datetime and a tuple) and of a tuple reads
    back equal and of its type; an End whose data is not of the graph's end type is
    refused naming result.data, the node is marked error and no End is stored."""

    async def go() -> None:
        r = await RECEIPTS.run(
            Sum(), state=Tally(count=3), persistence=make(store_url, "r" + run_id, RECEIPTS)
        )
        (_, end) = await make(store_url, "r" + run_id, RECEIPTS).load_all()
        assert end.result.data == r.output and isinstance(end.result.data, Receipt)
        assert end.result.data.at.tzinfo is not None and end.result.data.tags == ("a", "b")

        await PAIRS.run(Pair(), state=Tally(count=4), persistence=make(store_url, run_id, PAIRS))
        (_, end) = await make(store_url, run_id, PAIRS).load_all()
        assert end.result.data == (4, "x") and isinstance(end.result.data, tuple)

        wrong = make(store_url, "w" + run_id, PAIRS)
        with pytest.raises(CheckpointInvalid) as bad:
            await PAIRS.run(Pair(), state=Tally(seen=["s"]), persistence=wrong)
        assert bad.value.field.startswith("result.data"), bad.value
        (pair,) = await make(store_url, "w" + run_id, PAIRS).load_all()
        assert isinstance(pair, NodeSnapshot) and pair.status == "error"

    asyncio.run(go())


# -- deps that cannot be stored, run_sync, a generic node -----------------------------------------


T = TypeVar("T")


@dataclass
class Tools:
    """Deps a run holds but no store could: a lock, a callable, an open file."""

    lock: Any
    call: Any
    handle: Any


@dataclass
class Hold(BaseNode[Tally, Tools, int], Generic[T]):
    item: T

    async def run(self, ctx: GraphRunContext[Tally, Tools]) -> Hold[int] | End[int]:
        with ctx.deps.lock:
            ctx.deps.call(self.item)
        if isinstance(self.item, str):
            ctx.state.seen.append(self.item)
            return Hold(item=len(self.item))
        return End(int(self.item))  # type: ignore[arg-type]


HOLDS = Graph(nodes=(Hold,), name="holds")


def test_unstorable_deps_and_a_generic_node_with_run_sync(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """Deps holding a lock, a lambda and an open file are never stored (nothing to refuse);
    a node generic in its field's type stores its str and its int; graph.run_sync works
    on the persistence; a tuple in the TypeVar field is refused, not read back as a list."""
    calls: list[Any] = []
    with open(tmp_path / "f.txt", "w") as handle:
        tools = Tools(threading.Lock(), calls.append, handle)
        p = make(store_url, run_id, HOLDS)
        result = HOLDS.run_sync(Hold(item="four"), state=Tally(), deps=tools, persistence=p)
    assert result.output == 4 and calls == ["four", 4]
    line = history(store_url, run_id, HOLDS)
    assert [s.node.item for s in line[:-1]] == ["four", 4]
    assert isinstance(line[1].node.item, int)

    async def bad() -> None:
        other = make(store_url, "t" + run_id, HOLDS)
        with pytest.raises(CheckpointInvalid) as refused:
            await HOLDS.initialize(Hold(item=(1, 2)), other, state=Tally())
        assert refused.value.field == "node.item", refused.value

    asyncio.run(bad())


def test_iter_from_persistence_on_an_unknown_run_writes_nothing(
    store_url: str, run_id: str
) -> None:
    """As with pydantic-graph's own backends: nothing to load is GraphRuntimeError, and
    nothing is written for the unknown id."""

    async def go() -> None:
        with pytest.raises(GraphRuntimeError):
            await finish(make(store_url, run_id, TALLY), TALLY, None)
        assert await make(store_url, run_id, TALLY).load_all() == []
        assert make(store_url, run_id, TALLY).remit.branches(run_id) == []

    asyncio.run(go())
