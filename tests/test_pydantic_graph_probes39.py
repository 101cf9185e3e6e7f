"""Outside probes of `RemitStatePersistence`, round 39: the first store open of a process
on a running event loop, the id a refused state edit names, answers raced by processes
behind a barrier, a node SIGKILLed after its effect, forks of an older snapshot, invalid
states on every write path, and the read methods beside pydantic-graph's own
persistences; on SQLite, PostgreSQL and Redis, in real forked processes where the item
is about them.

Found:

- Liveness: the first `RemitStatePersistence(url, ...)` of a process opened its store
  (connecting, creating its tables: 70-185 ms on PostgreSQL or Redis) in the
  constructor, so on the event loop of the coroutine that made it: every other task of
  the loop stalled that long. An instance made while a loop runs opens its store at its
  first call now, in that call's worker thread (one made with no loop running opens it
  as it is made, as before); a mistyped URL is still refused as the instance is made,
  and a relative SQLite path names the file it named then.
- Errors / P4: `update_state(state)` with a state the graph refuses raised
  `CheckpointInvalid` naming (in its message and `checkpoint_id`) the id of the snapshot
  the edit would have stored, an id the caller never saw, not the pause it edited. It
  names the pause now: the `pause_id` given, else the paused snapshot the edit was for.
- P5: an answer (or an edit) that came while another resumer held the run's claim for a
  moment (an edit being stored, a worker that loaded the pause to give it back with
  `release()`) was refused at once with `ResumeConflict`, "another resumer holds the
  run": a client that takes `ResumeConflict` for "the pause was answered" dropped its
  answer while nobody had answered (two processes editing and two answering one pause at
  once: both answers refused, now and then). An answer or an edit now waits up to 2 s
  for such a claim to be given back, reads the run again, and is stored (or refused for
  what the run then is: answered, running).

Held: four processes answering one pause (`pause_id=`) behind a barrier, then each
continuing the run: one answer is taken, the others get `ResumeConflict`, the charge is
applied once; a process SIGKILLed in `Pay` after its charge, recovered by another after
the lease: the charge is not applied again; forks of an older snapshot with one token
from two processes make one branch, with the same ids, and without a token the old
snapshot is refused with `ForkWithoutIntent`; an invalid state is refused on every write
path (start, next node, End, edit, answer) and nothing is written; `load_next`,
`load_all` and `snapshot_end` give what `FullStatePersistence` and
`FileStatePersistence` give on a sequential run; a state's `PrivateAttr` is not stored
(a resumed run has its default), as the README says.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph.persistence.file import FileStatePersistence
from pydantic_graph.persistence.in_mem import FullStatePersistence
from pydantic_graph_parts import persistence as graph_persistence
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

from remit_core import CheckpointInvalid, ForkWithoutIntent, ResumeConflict, StoreUnavailable
from remit_core.stores import open_store
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- the first open of a store, on a running event loop ---------------------------------------


def first_open_on_a_loop(url: str, run_id: str) -> dict[str, Any]:
    """In a fresh process (no store open yet): make the first persistence of `url` in a
    coroutine while a ticker runs on the loop, then read the run; what the loop saw."""

    async def go() -> dict[str, Any]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        made = time.perf_counter()
        p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, run_id, lease=LEASE)
        made = time.perf_counter() - made
        unopened = p._opener.opened is None  # (the instance's store: none yet)
        p.set_graph_types(GRAPH)
        history = await p.load_all()
        await asyncio.sleep(0.05)
        stop.set()
        await task
        # The store the persistence opened is the process's store for that URL.
        same = open_store(url) is p.remit.store
        return {
            "made": made,
            "max_gap": max(gaps),
            "history": len(history),
            "same": same,
            "unopened": unopened,
        }

    return asyncio.run(go())


def test_the_first_persistence_of_a_process_opens_its_store_off_the_event_loop(
    store_url: str, run_id: str
) -> None:
    """Liveness: made in a coroutine, the first persistence of a process does not open its
    store (connect, create tables) on the loop: the constructor returns at once, and a
    ticker on the loop sees no stall while the first call opens it in a worker thread."""
    outcome = in_child(lambda: first_open_on_a_loop(store_url, run_id))
    assert outcome.ok, outcome.summary()
    seen = outcome.value
    assert seen["history"] == 0 and seen["same"]
    # Opening a store the first time takes 10-185 ms (PostgreSQL, Redis: connecting and
    # setting up): the constructor did none of it.
    assert seen["unopened"] and seen["made"] < 0.05, seen
    assert seen["max_gap"] < 0.1, seen


def test_instances_made_on_a_loop_share_one_open_and_work_before_their_first_call(
    store_url: str, run_id: str, world: World
) -> None:
    """Liveness / P5: in a fresh process, instances made on the loop whose first calls
    race (`gather`) share the one store the process opens; a copy made, and a `release()`
    called, before any call need no store; the copy, racing the original for the run, is
    excluded as another resumer is (one proceeds, the other gets `ResumeConflict`)."""

    def fresh_process() -> list[Any]:
        async def go() -> list[Any]:
            a = persistence(store_url, run_id)
            b = persistence(store_url, f"{run_id}-b")
            a.release()  # holds nothing, opens nothing
            c = copy.copy(a)
            assert a._opener.opened is None and c._opener.opened is None
            await asyncio.gather(drive(a, world, Start()), drive(b, world, Start()))
            assert a.remit.store is b.remit.store is open_store(store_url)
            pause = await a.paused()
            assert pause is not None
            results = await asyncio.gather(
                a.resume(Answer("a"), pause_id=pause.id),
                c.resume(Answer("c"), pause_id=pause.id),
                return_exceptions=True,
            )
            return [type(r).__name__ for r in results]

        return asyncio.run(go())

    outcome = in_child(fresh_process)
    assert outcome.ok, outcome.summary()
    assert sorted(outcome.value) == ["NodeSnapshot", "ResumeConflict"]
    assert asyncio.run(drive(persistence(store_url, run_id), world)) == "paid 100"
    assert world.sink.counts() == {"charge": 1}


def test_a_store_that_cannot_be_reached_is_named_by_the_first_call_made_on_a_loop(
    run_id: str,
) -> None:
    """Errors: an instance made on a loop for a store nobody serves raises
    `StoreUnavailable` from its first call (sync: from the constructor, as before), and
    again from the next one: a failed open is not remembered as open."""

    async def go() -> list[str]:
        p = persistence("redis://127.0.0.1:1/0", run_id)
        seen = []
        for _ in range(2):
            with pytest.raises(StoreUnavailable) as refused:
                await p.load_all()
            seen.append(str(refused.value))
        return seen

    seen = asyncio.run(go())
    assert all("127.0.0.1:1" in text for text in seen), seen
    with pytest.raises(StoreUnavailable):
        persistence("redis://127.0.0.1:1/0", run_id)


def test_a_persistence_made_with_no_loop_running_opens_its_store_as_it_is_made(
    store_url: str, run_id: str, world: World
) -> None:
    """Sync use is as before: made outside any event loop, the instance opens its store
    at once (a store that cannot be reached fails there), and runs as ever."""

    def made_outside() -> tuple[bool, str]:
        p = persistence(store_url, run_id)
        started = time.perf_counter()
        store = p.remit.store  # opened by the constructor: no open here
        took = time.perf_counter() - started
        out = asyncio.run(drive(p, world, Start()))
        return took < 0.01 and store is open_store(store_url), out

    outcome = in_child(made_outside)
    assert outcome.ok, outcome.summary()
    assert list(outcome.value) == [True, "paused"]


def test_a_persistence_made_on_a_loop_refuses_a_bad_url_as_it_is_made(
    tmp_path: Path, run_id: str
) -> None:
    """A mistyped URL or a SQLite URL naming a host is refused where the instance is made,
    also on a running loop (where its store opens later); a relative SQLite path names the
    file it named when the instance was made, though the process changes directory first."""

    async def go() -> None:
        with pytest.raises(ValueError, match="unsupported store URL"):
            RemitStatePersistence("sqlit:///x.db", run_id)
        with pytest.raises(ValueError, match="names a host"):
            RemitStatePersistence("sqlite://tmp/x.db", run_id)
        here, there = tmp_path / "here", tmp_path / "there"
        here.mkdir()
        there.mkdir()
        cwd = os.getcwd()
        os.chdir(here)
        try:
            p: RemitStatePersistence[Any, str] = RemitStatePersistence(
                "sqlite:///rel.db", run_id, lease=LEASE
            )
            p.set_graph_types(GRAPH)
            os.chdir(there)
            await p.snapshot_node(fresh(), Start())
        finally:
            os.chdir(cwd)
        assert (here / "rel.db").exists() and not (there / "rel.db").exists()

    asyncio.run(go())


def test_a_fork_token_instance_made_on_a_loop_is_on_its_line_at_its_first_call(
    store_url: str, run_id: str, world: World
) -> None:
    """P3: an instance with a token of an existing fork, made in a coroutine of a fresh
    process (its store opens at its first call), works on that fork from its first call:
    it reads the fork's line and answers the fork, not main."""

    async def setup() -> str:
        p = await to_pause(store_url, run_id, world)
        pause = await p.paused()
        assert pause is not None
        forked = await p.fork(pause.id, "what-if")
        return forked.branch

    branch = asyncio.run(setup())

    def late() -> tuple[str, str, str]:
        async def go() -> tuple[str, str, str]:
            p = persistence(store_url, run_id, fork_token="what-if")
            await p.resume(Answer("eve"))
            return p.branch, await drive(p, world), str(type((await p.load_all())[-1]).__name__)

        return asyncio.run(go())

    outcome = in_child(late)
    assert outcome.ok, outcome.summary()
    assert list(outcome.value) == [branch, "paid 100", "EndSnapshot"]
    main = asyncio.run(persistence(store_url, run_id).load_all())
    assert isinstance(main[-1], NodeSnapshot) and isinstance(main[-1].node, Ask)


# -- a refused state edit names the pause it edits ------------------------------------------


def test_a_refused_edit_names_the_pause_it_was_for(
    store_url: str, run_id: str, world: World
) -> None:
    """Errors / P4: `update_state` with a state the graph refuses (amount below 0) raises
    `CheckpointInvalid` at `state.amount` naming the pause the edit was for (the given
    `pause_id`, also one from before an earlier edit; else the paused snapshot), never
    the id of a snapshot it did not store; nothing is written."""

    async def go() -> None:
        p = await to_pause(store_url, run_id, world)
        pause = await p.paused()
        assert pause is not None
        bad = {**fresh(), "amount": -1}
        with pytest.raises(CheckpointInvalid) as given:
            await p.update_state(bad, pause_id=pause.id)
        assert given.value.field == "state.amount"
        assert given.value.checkpoint_id == pause.id and pause.id in str(given.value)
        with pytest.raises(CheckpointInvalid) as implied:
            await p.update_state(bad)
        assert implied.value.checkpoint_id == pause.id and pause.id in str(implied.value)
        before = await p.load_all()
        edited = await p.update_state({**fresh(), "amount": 7}, pause_id=pause.id)
        with pytest.raises(CheckpointInvalid) as asked_before:
            await p.update_state(bad, pause_id=pause.id)  # the id it was asked with
        assert asked_before.value.checkpoint_id == pause.id
        with pytest.raises(CheckpointInvalid) as now:
            await p.update_state(bad)  # the pause as the run is at it: the edited one
        assert now.value.checkpoint_id == edited.id and edited.id in str(now.value)
        after = await p.load_all()
        assert [s.id for s in after] == [s.id for s in before] + [edited.id]
        await p.resume(Answer("ann"), pause_id=pause.id)
        assert await drive(p, world) == "paid 7"

    asyncio.run(go())


# -- answers raced by processes, a kill after an effect ---------------------------------------


def test_processes_answering_one_pause_behind_a_barrier_take_one_answer(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P1: four processes answer the one pause (`pause_id=`) at once, then each goes on
    with the run (`iter_from_persistence`). One answer is taken and runs; the others get
    `ResumeConflict`; the charge is applied once and the run ends once."""
    pause = asyncio.run(_paused(store_url, run_id, world))

    def answerer(i: int) -> Callable[[], Any]:
        def go() -> Any:
            async def answer() -> Any:
                p = persistence(store_url, run_id)
                await p.resume(Answer(f"v{i}"), pause_id=pause)
                return await drive(p, world)

            return asyncio.run(answer())

        return go

    outcomes = raced([answerer(i) for i in range(4)])
    winners = [i for i, o in enumerate(outcomes) if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert outcomes[winners[0]].value == "paid 100"
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    line = asyncio.run(persistence(store_url, run_id).load_all())
    assert isinstance(line[-1], EndSnapshot) and line[-1].state["approved_by"] == f"v{winners[0]}"
    assert sum(isinstance(s, EndSnapshot) for s in line) == 1
    assert world.sink.counts() == {"charge": 1} and world.entered()["answer"] == 1


def test_edits_and_answers_raced_by_processes_never_lose_an_edit_the_caller_was_told_of(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P4: two processes edit the pause's state (`amount` 7) while two answer it, all
    behind one barrier, each naming the pause. One answer is taken; an edit is either
    stored before it (and the run goes on from it: the answer is taken at the edit) or
    refused with `ResumeConflict`: the run pays 7 exactly when an edit returned normally,
    and charges once."""
    pause = asyncio.run(_paused(store_url, run_id, world))

    def editor() -> Any:
        async def go() -> str:
            p = persistence(store_url, run_id)
            edited = await p.update_state({**fresh(), "amount": 7}, pause_id=pause)
            return edited.id

        return asyncio.run(go())

    def answerer(i: int) -> Callable[[], Any]:
        def go() -> Any:
            async def answer() -> str:
                p = persistence(store_url, run_id)
                taken = await p.resume(Answer(f"v{i}"), pause_id=pause)
                return taken.id

            return asyncio.run(answer())

        return go

    outcomes = raced([editor, answerer(0), editor, answerer(1)])
    summary = [o.summary() for o in outcomes]
    assert all(o.ok or o.raised("ResumeConflict") for o in outcomes), summary
    answers = [outcomes[1], outcomes[3]]
    assert sum(o.ok for o in answers) == 1, summary
    edited = any(outcomes[i].ok for i in (0, 2))
    assert asyncio.run(drive(persistence(store_url, run_id), world)) == (
        "paid 7" if edited else "paid 100"
    ), summary
    assert world.sink.counts() == {"charge": 1} and world.entered()["answer"] == 1


def test_an_answer_that_comes_while_a_worker_holds_the_pause_for_a_moment_is_taken(
    store_url: str, run_id: str, world: World
) -> None:
    """P5: a worker polls the pause (`load_next()`, then `release()` 0.2 s later, as the
    README's pollers do); an answer and an edit sent meanwhile wait for the claim to be
    given back and are stored, instead of `ResumeConflict`, which tells a client that the
    pause was answered while nobody answered it. A driver that keeps the node it loaded
    (to run it) still turns them away, after that wait (half the lease, at most 2 s)."""

    async def go() -> None:
        pause = await _paused(store_url, run_id, world)
        poller = persistence(store_url, run_id)
        polled = await poller.load_next()
        assert polled is not None and polled.id == pause

        async def give_back() -> None:
            await asyncio.sleep(0.2)
            poller.release()

        editor = persistence(store_url, run_id)
        edit, _ = await asyncio.gather(
            editor.update_state({**fresh(), "amount": 7}, pause_id=pause), give_back()
        )
        assert (await editor.paused()) is not None
        polled = await poller.load_next()
        assert polled is not None and polled.id == edit.id
        answerer = persistence(store_url, run_id)
        taken, _ = await asyncio.gather(answerer.resume(Answer("ann"), pause_id=pause), give_back())
        assert isinstance(taken.node, Answer)
        assert await drive(persistence(store_url, run_id), world) == "paid 7"

        other = f"{run_id}-kept"
        kept = await _paused(store_url, other, world)
        driver = persistence(store_url, other)
        assert (await driver.load_next()) is not None  # kept: its lease is 1 s
        started = time.monotonic()
        with pytest.raises(ResumeConflict, match="another resumer holds the run"):
            await persistence(store_url, other).resume(Answer("bob"), pause_id=kept)
        assert 0.4 < time.monotonic() - started < LEASE
        driver.release()

    asyncio.run(go())
    assert world.sink.counts() == {"charge": 1}


async def _paused(url: str, run_id: str, world: World) -> str:
    p = await to_pause(url, run_id, world)
    pause = await p.paused()
    assert pause is not None
    return pause.id


def test_a_node_killed_after_its_effect_is_recovered_without_applying_it_again(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P2: a process SIGKILLed in `Pay` after its charge went out; after the lease,
    another process continues the run: `Pay` runs again under its snapshot id, the charge
    is not applied again, and the run ends once with the answer's state."""
    pause = asyncio.run(_paused(store_url, run_id, world))

    def crash() -> None:
        world.kill_at = "pay.after_effect"

        async def go() -> None:
            p = persistence(store_url, run_id)
            await p.resume(Answer("ann"), pause_id=pause)
            await drive(p, world)

        asyncio.run(go())

    assert in_child(crash).status == "killed"
    left = asyncio.run(persistence(store_url, run_id).load_all())
    assert isinstance(left[-1], NodeSnapshot) and isinstance(left[-1].node, Pay)
    assert left[-1].status == "running"
    time.sleep(LEASE + 0.2)

    def recover() -> Any:
        return asyncio.run(drive(persistence(store_url, run_id), world))

    outcome = in_child(recover)
    assert outcome.ok and outcome.value == "paid 100", outcome.summary()
    line = asyncio.run(persistence(store_url, run_id).load_all())
    assert statuses(line) == ["success", "created"] + ["success"] * 3 + ["end"]  # (Ask: answered)
    pays = [s for s in line if isinstance(s, NodeSnapshot) and isinstance(s.node, Pay)]
    assert [s.id for s in pays] == [left[-1].id]  # the same snapshot, run again
    assert world.sink.counts() == {"charge": 1}
    assert (
        world.entered()["pay"] == 2 and world.entered()["pay.after_effect"] == 2
    )  # (journaled, then killed)
    assert world.entered()["done"] == 1


# -- forks of an older snapshot ----------------------------------------------------------


def test_forks_of_an_older_snapshot_are_one_branch_per_token_from_any_process(
    store_url: str, run_id: str, world: World
) -> None:
    """P3/P6: after the run ended, two processes fork the `Pay` snapshot with one token at
    once: one branch, whose nodes and End have the same ids in both, and the fork's charge
    is its own (applied once for the fork). Without a token the old snapshot is refused
    with `ForkWithoutIntent` and nothing is written."""
    pause = asyncio.run(_paused(store_url, run_id, world))

    async def finish() -> list[Any]:
        p = persistence(store_url, run_id)
        await p.resume(Answer("ann"), pause_id=pause)
        await drive(p, world)
        return await p.load_all()

    main = asyncio.run(finish())
    pay = next(s for s in main if isinstance(s, NodeSnapshot) and isinstance(s.node, Pay))

    def forker() -> Any:
        async def go() -> Any:
            p = persistence(store_url, run_id)
            try:
                forked = await p.fork(pay.id, "again")
            except ForkWithoutIntent as exc:  # (a racer's fork, made first: not this one's)
                raise AssertionError(f"the same token forks the same snapshot: {exc}") from exc
            try:
                await drive(forked, world)
            except ResumeConflict:
                await asyncio.sleep(LEASE + 0.5)  # the other process runs it: read after
            except GraphRuntimeError:
                # The other process ended the fork first: pydantic-graph's own words for a
                # run whose `load_next()` has nothing left to run.
                assert isinstance((await forked.load_all())[-1], EndSnapshot)
            line = await persistence(store_url, run_id, fork_token="again").load_all()
            return [forked.branch, [s.id for s in line]]

        return asyncio.run(go())

    outcomes = raced([forker, forker])
    assert all(o.ok for o in outcomes), [o.summary() for o in outcomes]
    first, second = (list(o.value) for o in outcomes)
    assert first == second and first[0] != "main"
    assert first[1][: len(main) - 2] == [s.id for s in main[: len(main) - 2]]
    assert world.sink.counts() == {"charge": 2}  # main's, and the fork's own, once each

    async def without_token() -> None:
        p = persistence(store_url, run_id)
        async with GRAPH.iter(pay.node, state=pay.state, deps=world, persistence=p) as run:
            await run.next()

    with pytest.raises(ForkWithoutIntent):
        asyncio.run(without_token())
    after = asyncio.run(persistence(store_url, run_id).load_all())
    assert [s.id for s in after] == [s.id for s in main]
    assert world.sink.counts() == {"charge": 2}


# -- invalid states on every write path ----------------------------------------------------


def test_an_invalid_state_is_refused_on_every_write_path(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: a state the graph refuses (amount below 0) is refused on every path that
    stores one: the start node, the next node, the End, an edit, and the state an
    answered node leaves; `CheckpointInvalid` at `state.amount`, and nothing is written."""
    bad = {**fresh(), "amount": -5}

    async def go() -> None:
        p = persistence(store_url, run_id)
        with pytest.raises(CheckpointInvalid, match="state.amount"):
            await p.snapshot_node(bad, Start())
        with pytest.raises(CheckpointInvalid, match="state.amount"):
            await GRAPH.run(Start(), state=bad, deps=world, persistence=p)
        assert await p.load_all() == []
        world.amount = -3  # Start leaves the state invalid: its next node is refused
        with pytest.raises(CheckpointInvalid, match="state.amount"):
            await drive(p, world, Start())
        assert statuses(await p.load_all()) == ["error"]
        world.amount = 100
        assert await drive(p, world) == "paused"
        pause = await p.paused()
        assert pause is not None
        with pytest.raises(CheckpointInvalid, match="state.amount"):
            await p.update_state(bad, pause_id=pause.id)
        with pytest.raises(CheckpointInvalid, match="state.amount"):
            await p.snapshot_end(bad, End("x"))
        with pytest.raises(CheckpointInvalid, match=r"node\.value"):
            await p.resume(Answer(""), pause_id=pause.id)
        line = await p.load_all()
        assert [type(s.node).__name__ for s in line if isinstance(s, NodeSnapshot)] == [
            "Start",
            "Ask",
        ]
        assert all(s.state["amount"] >= 0 for s in line)
        await p.resume(Answer("ann"), pause_id=pause.id)
        assert await drive(p, world) == "paid 100"

    asyncio.run(go())


# -- the read methods beside pydantic-graph's own persistences ------------------------------


@dataclass
class Tally:
    seen: list[str] = field(default_factory=list)


@dataclass
class First(BaseNode[Tally, None, str]):
    async def run(self, ctx: GraphRunContext[Tally]) -> Second:
        ctx.state.seen.append("first")
        return Second(2)


@dataclass
class Second(BaseNode[Tally, None, str]):
    n: int

    async def run(self, ctx: GraphRunContext[Tally]) -> End[str]:
        ctx.state.seen.append(f"second {self.n}")
        return End("/".join(ctx.state.seen))


TALLY = Graph(nodes=(First, Second), name="tally")


def test_reads_match_pydantic_graphs_own_persistences_on_a_sequential_run(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """The interface: a run taken step by step from `load_next` (`iter_from_persistence`
    after `initialize`) leaves `load_all` with the same nodes, statuses, states and End
    as `FullStatePersistence` and `FileStatePersistence`; `load_next` returns None once
    the run has ended, and a second `load_next` from the caller that loaded a node
    returns None, as theirs do."""

    def shaped(line: list[Any]) -> list[tuple[str, str, Any]]:
        return [
            (
                type(s.node).__name__ if isinstance(s, NodeSnapshot) else "End",
                s.status if isinstance(s, NodeSnapshot) else "end",
                s.result.data if isinstance(s, EndSnapshot) else list(s.state.seen),
            )
            for s in line
        ]

    async def run_with(p: Any) -> list[tuple[str, str, Any]]:
        p.set_graph_types(TALLY)
        await TALLY.initialize(First(), p, state=Tally())
        async with TALLY.iter_from_persistence(p) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "first/second 2"
        assert await p.load_next() is None  # ended
        return shaped(await p.load_all())

    async def second_load(p: Any) -> tuple[str, bool]:
        p.set_graph_types(TALLY)
        await p.snapshot_node(Tally(), First())
        first = await p.load_next()
        assert first is not None
        return first.status, await p.load_next() is None

    async def go() -> None:
        full = await run_with(FullStatePersistence())
        assert full == [
            ("First", "success", []),
            ("Second", "success", ["first"]),
            ("End", "end", "first/second 2"),
        ]
        assert await run_with(FileStatePersistence(tmp_path / "run.json")) == full
        assert await run_with(graph_persistence(store_url, run_id, TALLY)) == full
        theirs = await second_load(FullStatePersistence())
        assert await second_load(graph_persistence(store_url, f"{run_id}-2", TALLY)) == theirs

    asyncio.run(go())


# -- a README claim: private attributes are not stored --------------------------------------


class Counted(pydantic.BaseModel):
    n: int = 0
    _cache: dict[str, int] = pydantic.PrivateAttr(default_factory=dict)


@dataclass
class Fill(BaseNode[Counted, None, int]):
    async def run(self, ctx: GraphRunContext[Counted]) -> Read:
        ctx.state.n += 1
        ctx.state._cache["x"] = 1
        return Read()


@dataclass
class Read(BaseNode[Counted, None, int]):
    async def run(self, ctx: GraphRunContext[Counted]) -> End[int]:
        return End(len(ctx.state._cache))


COUNTED = Graph(nodes=(Fill, Read), name="counted")


def test_a_private_attribute_of_the_state_is_not_stored(store_url: str, run_id: str) -> None:
    """P4, as the README says: a model's `PrivateAttr` is not stored (pydantic writes no
    private attribute) and does not make the snapshot refused; read back, and in a run
    continued from the store, it has its default."""

    async def go() -> None:
        p = graph_persistence(store_url, run_id, COUNTED)
        async with COUNTED.iter(Fill(), state=Counted(), persistence=p) as run:
            assert isinstance(await run.next(), Read)  # (Fill ran: the cache is set here)
            assert run.state._cache == {"x": 1}
        line = await graph_persistence(store_url, run_id, COUNTED).load_all()
        assert [s.state.n for s in line] == [0, 1]
        assert all(s.state._cache == {} for s in line)
        later = graph_persistence(store_url, run_id, COUNTED)
        async with COUNTED.iter_from_persistence(later) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == 0

    asyncio.run(go())
