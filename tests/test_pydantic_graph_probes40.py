"""Outside probes of `RemitStatePersistence`, round 40: `set_types` called by hand, a
human-in-the-loop run driven by hand through one `GraphRun`, processes racing
`iter_from_persistence` at a node that raised and at a run that ended, `Graph.initialize`
from racing processes and killed mid-start, states of nested dataclasses, unions,
generics, Decimals and datetimes with an `End` carrying a model, read back in another
process, and `record_run` / `run.next()` called as the interface documents; on SQLite,
PostgreSQL and Redis, in real forked processes where the item is about them.

Found:

- Errors: `set_types(state_type, run_end_type)` called by hand (a public method of
  pydantic-graph's `BaseStatePersistence`) raised pydantic-graph's `RuntimeError`
  "... You should build Pydantic schemas for snapshots using
  `StatePersistence.set_types()`", telling the caller to make the very call that failed.
  It says to call `set_graph_types(graph)` now, and nothing is set up.
- L1 / errors: `load_next()` on a run that has ended took the run's claim before it
  found the End, then gave it back. A process continuing the ended run with
  `iter_from_persistence` while another did the same got `ResumeConflict` ("another
  holder has this run's claim ... retry when that run ends"), for a run that had ended,
  and a retry then got `GraphRuntimeError`. A reader of an ended run takes no claim now:
  each gets pydantic-graph's `GraphRuntimeError`, nothing to restore.

Held: a pause answered with `resume()` inside one hand-driven `GraphRun` and handed to
`run.next(answer)` runs once, the charge once; three processes racing to continue a node
that raised after its charge run it again once, without charging again; four processes
initializing one run with one token store one start; a start SIGKILLed after its token
named the line is started again once; a rich state and an `End` of a model read back
equal in another process; `record_run` of no snapshot of the run raises `LookupError`
and holds nothing; a worker holding the pause it loaded answers it itself and goes on;
`run.next()` given the stored next node read back (`load_all`, `deepcopy`) runs it once.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import pydantic
import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import (
    GRAPH,
    LEASE,
    Answer,
    Ask,
    Pay,
    Start,
    World,
    drive,
    fresh,
    in_child,
    persistence,
    statuses,
    to_pause,
)
from test_pydantic_graph_probes14 import raced

from remit_core import ForkWithoutIntent, ResumeConflict, failpoints
from remit_core.conformance.processes import fork
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def url(store_url: str) -> str:
    return store_url


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- set_types by hand -----------------------------------------------------------------------


def test_set_types_called_by_hand_says_to_call_set_graph_types(url: str, run_id: str) -> None:
    """Errors: `set_types(state_type, run_end_type)` is a public method of pydantic-graph's
    `BaseStatePersistence`; called by hand (outside `set_graph_types`, which knows the
    graph's nodes) the adapter cannot be built. The error says to call
    `set_graph_types(graph)`, not (as pydantic-graph's own words do) to call `set_types()`;
    the instance stays usable for the graph afterwards, and nothing is written."""
    p: RemitStatePersistence[Any, str] = RemitStatePersistence(url, run_id, lease=LEASE)
    with pytest.raises(RuntimeError, match=r"call persistence\.set_graph_types\(graph\)"):
        p.set_types(dict, str)
    assert p.should_set_types()  # nothing half set up
    p.set_graph_types(GRAPH)
    assert asyncio.run(p.load_all()) == []


def test_set_types_by_hand_after_set_graph_types_keeps_the_graphs_types(
    url: str, run_id: str, world: World
) -> None:
    """P4: an instance set up for a graph keeps that graph's types: a later `set_types`
    by hand (other types) is refused, and the run still validates against the graph's."""
    p = persistence(url, run_id)
    with pytest.raises(RuntimeError, match=r"call persistence\.set_graph_types\(graph\)"):
        p.set_types(int, int)  # type: ignore[arg-type]
    assert asyncio.run(drive(p, world, Start())) == "paused"
    assert statuses(asyncio.run(p.load_all())) == ["success", "created"]


# -- a human-in-the-loop run driven by hand through one GraphRun ------------------------------


def test_a_pause_answered_inside_one_hand_driven_graph_run_goes_on_from_the_answer(
    url: str, run_id: str, world: World
) -> None:
    """P1/P5: a driver steps `run.next()` to the pause, answers it with `resume()` on the
    same instance, and hands the answer to `run.next(answer)` in the same `GraphRun`. The
    answer runs (as the stored head, not as a fork), every node runs once, the charge is
    applied once, and a second `resume()` is refused."""

    async def go() -> Any:
        p = persistence(url, run_id)
        async with GRAPH.iter(Start(), state=fresh(), deps=world, persistence=p) as run:
            node = await run.next()
            assert isinstance(node, Ask)
            answer = Answer("ann")
            await p.resume(answer)
            with pytest.raises(ResumeConflict):
                await p.resume(Answer("bob"))
            step: Any = await run.next(answer)
            while not isinstance(step, End):
                step = await run.next(step)
        return step.data, run.state

    output, state = asyncio.run(go())
    assert output == "paid 100" and state["approved_by"] == "ann"
    assert world.entered() == {
        "start": 1,
        "answer": 1,
        "pay": 1,
        "pay.after_effect": 1,
        "done": 1,
    }
    assert world.sink.counts() == {"charge": 1}
    line = asyncio.run(persistence(url, run_id).load_all())
    assert statuses(line) == ["success", "created", "success", "success", "success", "end"]
    assert isinstance(line[-1], EndSnapshot) and line[-1].state["approved_by"] == "ann"


# -- processes racing to continue a node that raised -------------------------------------------


def test_processes_racing_to_continue_a_node_that_raised_after_its_effect_apply_it_once(
    url: str, run_id: str, tmp_path: Path
) -> None:
    """P1/P2/P5: `Pay` applied its charge, then raised (`error`). Three processes behind a
    barrier continue the run with `iter_from_persistence`: `Pay` runs again once (its
    charge read back, not applied again), each later node once, and the line has one End;
    the other processes get `ResumeConflict`, or find nothing left to run."""

    def fail_after_charge(node: str) -> None:
        if node == "pay.after_effect":
            raise RuntimeError("the mail server is down")

    first = World(tmp_path, on_enter=fail_after_charge)

    async def to_error() -> None:
        p = await to_pause(url, run_id, first)
        await p.resume(Answer("ann"))
        with pytest.raises(RuntimeError, match="mail server"):
            await drive(persistence(url, run_id), first)

    asyncio.run(to_error())
    assert statuses(asyncio.run(persistence(url, run_id).load_all()))[-1] == "error"

    def recover() -> Any:
        return asyncio.run(drive(persistence(url, run_id), World(tmp_path)))

    outcomes = raced([recover] * 3)
    summaries = [o.summary() for o in outcomes]
    assert [o.value for o in outcomes if o.ok] in (["paid 100"], []), summaries
    assert all(o.raised("ResumeConflict", "GraphRuntimeError") for o in outcomes if not o.ok), (
        summaries
    )
    world = World(tmp_path)
    if not any(o.ok for o in outcomes):  # each lost a step to another: finish the run
        assert asyncio.run(drive(persistence(url, run_id), world)) == "paid 100"
    assert world.entered() == {
        "start": 1,
        "answer": 1,
        "pay": 2,
        "pay.after_effect": 2,
        "done": 1,
    }
    assert world.sink.counts() == {"charge": 1}
    line = asyncio.run(persistence(url, run_id).load_all())
    assert statuses(line).count("end") == 1
    assert line[-1].state["log"] == ["start", "answer", "pay", "done"]


# -- Graph.initialize from racing processes ------------------------------------------------------


def test_processes_initializing_one_run_with_one_token_store_one_start(
    url: str, run_id: str, world: World
) -> None:
    """P3/P5: a job runner's retries call `graph.initialize(Start(), persistence)` at once
    from four processes, each with the same `fork_token` and a start node of its own. One
    start is stored; the others are refused (`ForkWithoutIntent`: the token's line has
    begun, or `ResumeConflict`: it is being begun), and the run then goes on once."""

    def initializer() -> Any:
        p = persistence(url, run_id, fork_token="job-1")
        asyncio.run(GRAPH.initialize(Start(), p, state=fresh()))
        return p.branch

    outcomes = raced([initializer] * 4)
    summaries = [o.summary() for o in outcomes]
    assert len([o for o in outcomes if o.ok]) == 1, summaries
    assert all(o.raised("ForkWithoutIntent", "ResumeConflict") for o in outcomes if not o.ok)
    line = asyncio.run(persistence(url, run_id, fork_token="job-1").load_all())
    assert len(line) == 1 and isinstance(line[0], NodeSnapshot) and isinstance(line[0].node, Start)
    p = persistence(url, run_id, fork_token="job-1")
    assert asyncio.run(drive(p, world)) == "paused"
    assert world.entered() == {"start": 1}


# -- the interface called as it documents ----------------------------------------------------


def test_record_run_of_no_snapshot_of_the_run_holds_nothing(
    url: str, run_id: str, world: World
) -> None:
    """P1/L1: `record_run` of an id that names no snapshot of the run (another run's, a
    typo) raises a `LookupError` naming it, runs nothing, writes nothing, and leaves no
    claim: another resumer continues the run at once."""

    async def go() -> None:
        await to_pause(url, run_id, world)
        p = persistence(url, run_id)
        ran = []
        with pytest.raises(LookupError, match="Start:nowhere"):
            async with p.record_run("Start:nowhere"):
                ran.append(True)
        assert ran == []
        other = persistence(url, run_id)
        loaded = await other.load_next()  # not held by the refused instance
        assert loaded is not None and isinstance(loaded.node, Ask)
        other.release()

    asyncio.run(go())


def test_a_start_killed_after_its_token_named_the_line_is_started_again_once(
    url: str, run_id: str, world: World
) -> None:
    """P1/P3/L1: a process starting a run with a `fork_token` (`graph.initialize`) is
    SIGKILLed after the token names the run's line and before the first snapshot is
    committed. A retry with the same token (once the dead claim's lease has run out) starts
    the run, on that line, once; the run then goes on once."""

    def killed() -> None:
        failpoints.arm("checkpoint.before_commit", "kill")
        p = persistence(url, run_id, fork_token="job-1")
        asyncio.run(GRAPH.initialize(Start(), p, state=fresh()))

    assert in_child(killed).status == "killed"
    assert asyncio.run(persistence(url, run_id, fork_token="job-1").load_all()) == []

    def retry() -> str:
        deadline = time.monotonic() + 30
        while True:
            p = persistence(url, run_id, fork_token="job-1")
            try:
                asyncio.run(GRAPH.initialize(Start(), p, state=fresh()))
                return p.branch
            except ResumeConflict:  # the dead process's claim, until its lease runs out
                assert time.monotonic() < deadline
                time.sleep(0.1)

    outcome = in_child(retry)
    assert outcome.ok, outcome.summary()
    with pytest.raises(ForkWithoutIntent):  # presented again: the line has begun
        asyncio.run(
            GRAPH.initialize(Start(), persistence(url, run_id, fork_token="job-1"), state=fresh())
        )
    assert asyncio.run(drive(persistence(url, run_id, fork_token="job-1"), world)) == "paused"
    line = asyncio.run(persistence(url, run_id).load_all())  # the token's line is main
    assert statuses(line) == ["success", "created"] and world.entered() == {"start": 1}


# -- rich states and results, read back in another process ------------------------------------


T = TypeVar("T")


@dataclass
class Money:
    amount: Decimal
    currency: Literal["EUR", "USD"] = "EUR"


@dataclass
class Card:
    kind: Literal["card"] = "card"
    last4: str = "4242"


@dataclass
class Wire:
    kind: Literal["wire"] = "wire"
    iban: str = "DE00"


class Page(pydantic.BaseModel, Generic[T]):
    items: list[T] = []
    cursor: str | None = None


@dataclass
class Ledger:
    total: Money = field(default_factory=lambda: Money(Decimal("0.00")))
    method: Card | Wire | None = None
    page: Page[Money] = field(default_factory=Page[Money])
    at: datetime.datetime | None = None
    due: datetime.date | None = None
    window: datetime.timedelta = datetime.timedelta(0)
    tags: dict[str, list[int]] = field(default_factory=dict)


class Receipt(pydantic.BaseModel):
    total: Money
    method: Card | Wire
    lines: Page[Money]


LedgerCtx = GraphRunContext[Ledger]


@dataclass
class Book(BaseNode[Ledger, None, Receipt]):
    async def run(self, ctx: LedgerCtx) -> Hold:
        s = ctx.state
        s.total = Money(Decimal("12.30"), "USD")
        s.method = Wire(iban="FR76 3000")
        s.page = Page[Money](items=[Money(Decimal("0.1")), Money(Decimal("12.20"), "USD")])
        s.at = datetime.datetime(2026, 3, 29, 1, 30, tzinfo=datetime.timezone.utc)
        s.due = datetime.date(2026, 4, 1)
        s.window = datetime.timedelta(days=-1, microseconds=7)
        s.tags = {"a": [1, 2], "": []}
        return Hold(note=Money(Decimal("-0.000001")))


@dataclass
class Hold(BaseNode[Ledger, None, Receipt]):
    note: Money

    async def run(self, ctx: LedgerCtx) -> End[Receipt]:
        s = ctx.state
        assert s.method is not None
        return End(Receipt(total=s.total, method=s.method, lines=s.page))


LEDGER = Graph(nodes=(Book, Hold), name="ledger")
LEDGER_STATE = pydantic.TypeAdapter(Ledger)


def test_a_rich_state_and_an_end_of_a_model_read_back_equal_in_another_process(
    url: str, run_id: str
) -> None:
    """P4/P6: a state of nested dataclasses, a discriminated-by-field union, a generic
    model, Decimals (negative exponents, signs), dates, datetimes and a negative
    timedelta, and an `End` carrying a model of them, stopped at a node and continued in
    another process, reach exactly what an uninterrupted in-memory run reaches."""

    def ledger() -> RemitStatePersistence[Ledger, Receipt]:
        p: RemitStatePersistence[Ledger, Receipt] = RemitStatePersistence(url, run_id, lease=LEASE)
        p.set_graph_types(LEDGER)
        return p

    async def stop() -> None:
        async with LEDGER.iter(Book(), state=Ledger(), persistence=ledger()) as run:
            async for node in run:
                if isinstance(node, Hold):
                    break

    asyncio.run(stop())

    def go_on() -> Any:
        async def run() -> Any:
            async with LEDGER.iter_from_persistence(ledger()) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return run.result.output.model_dump_json(), LEDGER_STATE.dump_json(run.state).decode()

        return asyncio.run(run())

    outcome = in_child(go_on)
    assert outcome.ok, outcome.summary()
    expected = asyncio.run(LEDGER.run(Book(), state=Ledger()))
    assert outcome.value == [
        expected.output.model_dump_json(),
        LEDGER_STATE.dump_json(expected.state).decode(),
    ]
    line = asyncio.run(ledger().load_all())
    end = line[-1]
    assert isinstance(end, EndSnapshot) and end.result.data == expected.output
    assert end.state == expected.state
    hold = line[1]
    assert isinstance(hold, NodeSnapshot) and hold.node == Hold(note=Money(Decimal("-0.000001")))


# -- a worker that holds the pause it loaded, then answers it itself ----------------------------


def test_a_worker_that_loaded_the_pause_answers_it_and_goes_on_with_one_instance(
    url: str, run_id: str, world: World
) -> None:
    """P5/L1: a worker continues a paused run with `iter_from_persistence` and stops at the
    pause it was handed (holding the claim `load_next` took). Another resumer's answer is
    refused meanwhile; the worker's own instance answers it, and continues the run with
    `iter_from_persistence` at once: the answer runs once, the charge applies once."""

    async def go() -> Any:
        await to_pause(url, run_id, world)
        p = persistence(url, run_id)
        async with GRAPH.iter_from_persistence(p, deps=world) as run:
            async for node in run:
                assert isinstance(node, Ask)
                break
        with pytest.raises(ResumeConflict, match="holds the run"):
            await persistence(url, run_id).resume(Answer("bob"))
        await p.resume(Answer("ann"))
        return await drive(p, world)

    assert asyncio.run(go()) == "paid 100"
    line = asyncio.run(persistence(url, run_id).load_all())
    assert line[-1].state["approved_by"] == "ann"
    assert world.entered() == {
        "start": 1,
        "answer": 1,
        "pay": 1,
        "pay.after_effect": 1,
        "done": 1,
    }
    assert world.sink.counts() == {"charge": 1}


def test_processes_continuing_an_ended_run_at_once_write_nothing_and_hold_nothing(
    url: str, run_id: str, world: World
) -> None:
    """P1/P3/L1: three processes call `iter_from_persistence` on a run that has ended, at
    once: each gets pydantic-graph's `GraphRuntimeError` (nothing to restore), nothing is
    written, and no claim is left behind (a fork of a node is made and run at once, and
    nothing before its base runs again)."""

    async def to_end() -> None:
        p = await to_pause(url, run_id, world)
        await p.resume(Answer("ann"))
        assert await drive(persistence(url, run_id), world) == "paid 100"

    asyncio.run(to_end())
    before = asyncio.run(persistence(url, run_id).load_all())

    def go_on() -> Any:
        return asyncio.run(drive(persistence(url, run_id), World(world.folder)))

    outcomes = raced([go_on] * 3)
    assert all(o.raised("GraphRuntimeError") for o in outcomes), [o.summary() for o in outcomes]
    after = asyncio.run(persistence(url, run_id).load_all())
    assert [(s.id, statuses([s])) for s in after] == [(s.id, statuses([s])) for s in before]
    pay = next(s for s in after if isinstance(s, NodeSnapshot) and isinstance(s.node, Pay))

    async def fork_and_run() -> Any:
        fork = await persistence(url, run_id).fork(pay.id, "again")
        return await drive(fork, world)

    assert asyncio.run(fork_and_run()) == "paid 100"
    # The fork's base is the fork's own work (its effects keyed under the fork's branch).
    assert world.sink.counts() == {"charge": 2}
    assert world.entered()["pay"] == 2 and world.entered()["start"] == 1


def test_a_resumer_of_an_ended_run_is_told_it_ended_while_another_reads_it(
    url: str, run_id: str, world: World
) -> None:
    """L1/errors: while one process is inside `iter_from_persistence` of a run that has
    ended (SIGSTOPped there), another's `iter_from_persistence` gets pydantic-graph's
    `GraphRuntimeError` (nothing to restore), not `ResumeConflict` telling it to retry
    "when that run ends": a reader of an ended run takes no claim, and writes nothing."""

    async def to_end() -> None:
        p = await to_pause(url, run_id, world)
        await p.resume(Answer("ann"))
        assert await drive(persistence(url, run_id), world) == "paid 100"

    asyncio.run(to_end())
    before = asyncio.run(persistence(url, run_id).load_all())
    store = persistence(url, run_id).remit.store
    claim = store.get_claim(run_id, "main")  # (the run's last, given back: no holder)

    def reader() -> Any:
        failpoints.arm("claim.after_acquire", "stop")
        return asyncio.run(drive(persistence(url, run_id, lease=60.0), World(world.folder)))

    first = fork(reader)
    try:
        held = first.wait(60, stopped_counts=True)  # stopped holding a claim, or done
        with pytest.raises(GraphRuntimeError, match="Unable to restore"):
            asyncio.run(drive(persistence(url, run_id), world))
    finally:
        first.kill()
        first.wait(10)
    assert held.raised("GraphRuntimeError"), held.summary()
    after = asyncio.run(persistence(url, run_id).load_all())
    assert [(s.id, statuses([s])) for s in after] == [(s.id, statuses([s])) for s in before]
    assert store.get_claim(run_id, "main") == claim  # no claim taken since, none held


# -- run.next() given another object of the node it returned --------------------------------------


@pytest.mark.parametrize("how", ["load_all", "deepcopy"])
def test_run_next_given_the_stored_next_node_read_back_runs_it_once(
    url: str, run_id: str, world: World, how: str
) -> None:
    """P1/P2: a hand driver hands `run.next()` not the node object the last step returned
    but the same node read back (`load_all()[-1].node`) or a `copy.deepcopy` of it: the
    same snapshot id, so it runs as the stored node (no fork, no new start); every node
    runs once, the charge applies once."""

    async def go() -> Any:
        p = await to_pause(url, run_id, world)
        await p.resume(Answer("ann"))
        async with GRAPH.iter_from_persistence(persistence(url, run_id), deps=world) as run:
            step: Any = await run.next()  # Answer runs; Pay is stored
            while not isinstance(step, End):
                if how == "load_all":
                    other = (await persistence(url, run_id).load_all())[-1].node
                else:
                    other = copy.deepcopy(step)
                assert other is not step and other.get_snapshot_id() == step.get_snapshot_id()
                step = await run.next(other)
        return step.data

    assert asyncio.run(go()) == "paid 100"
    assert world.entered() == {
        "start": 1,
        "answer": 1,
        "pay": 1,
        "pay.after_effect": 1,
        "done": 1,
    }
    assert world.sink.counts() == {"charge": 1}
    line = asyncio.run(persistence(url, run_id).load_all())
    assert statuses(line) == ["success", "created", "success", "success", "success", "end"]
