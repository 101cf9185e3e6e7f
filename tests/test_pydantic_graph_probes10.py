"""Outside probes of `RemitStatePersistence`, round 10: process faults on shapes other
than the conformance probe, in real forked processes, on SQLite, PostgreSQL and Redis.

A review loop that pauses twice (a crash while its second answer is taken, k racing
answers at the second pause, a zombie in the loop's body), a node that applies
effects concurrently (`asyncio.gather`, killed or stopped between them), a fork of a
pause whose answer's resumer is killed, k processes forking and answering one pause,
child graphs run concurrently by one parent node.

- P5 / errors: a wrong answer at a loop's second pause was refused as a late one
  (`ResumeConflict`), even naming that pause: it is `ValueError` now, and only an
  answer an answered pause leads to is taken for a late one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import (
    GRAPH,
    Answer,
    Pay,
    World,
    in_child,
    persistence,
    to_pause,
)

from remit_core import ResumeConflict, arun_effect, failpoints
from remit_core.conformance.processes import Barrier, fork, reap
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


async def apply(ctx: GraphRunContext[Any, World], name: str) -> None:
    sink = ctx.deps.sink

    async def go(key: str) -> str:
        return sink.apply(name, key)

    await arun_effect(name, go, reconcile=sink.reconcile)


# -- a review loop that pauses twice ---------------------------------------------------------


@dataclass
class Paper:
    approvals: list[str] = field(default_factory=list)
    revisions: int = 0


PCtx = GraphRunContext[Paper, World]


@dataclass
class Draft(BaseNode[Paper, World, str]):
    async def run(self, ctx: PCtx) -> Review:
        ctx.deps.enter("draft")
        await apply(ctx, "draft")
        return Review()


@dataclass
class Review(BaseNode[Paper, World, str]):
    """The pause, asked once per round: the answer comes as `Verdict(value)`."""

    async def run(self, ctx: PCtx) -> Verdict:
        raise AssertionError("the pause never runs")


@dataclass
class Verdict(BaseNode[Paper, World, str]):
    value: str

    async def run(self, ctx: PCtx) -> Revise | Ship:
        ctx.deps.enter("verdict")
        ctx.state.approvals.append(self.value)
        return Revise() if len(ctx.state.approvals) < 2 else Ship()


@dataclass
class Revise(BaseNode[Paper, World, str]):
    async def run(self, ctx: PCtx) -> Review:
        ctx.deps.enter("revise")
        await apply(ctx, "revise")
        ctx.deps.enter("revise.after_effect")
        ctx.state.revisions += 1
        return Review()


@dataclass
class Ship(BaseNode[Paper, World, str]):
    """Two parcels sent at once (one effect name, two occurrences), a label after them."""

    async def run(self, ctx: PCtx) -> End[str]:
        ctx.deps.enter("ship")
        await asyncio.gather(apply(ctx, "parcel"), apply(ctx, "parcel"))
        await apply(ctx, "label")
        ctx.deps.enter("ship.after_effects")
        return End(" + ".join(ctx.state.approvals))


PAPERS = Graph(nodes=(Draft, Review, Verdict, Revise, Ship), name="papers")


def make(url: str, run_id: str, **kw: Any) -> RemitStatePersistence[Paper, str]:
    p: RemitStatePersistence[Paper, str] = RemitStatePersistence(
        url, run_id, **{"lease": LEASE, **kw}
    )
    p.set_graph_types(PAPERS)
    return p


async def drive(p: RemitStatePersistence[Paper, str], world: World, start: Any = None) -> str:
    """Run until the next pause ("paused") or the end (its output)."""
    context = (
        PAPERS.iter_from_persistence(p, deps=world)
        if start is None
        else PAPERS.iter(start, state=Paper(), deps=world, persistence=p)
    )
    async with context as run:
        async for node in run:
            if isinstance(node, Review):
                p.release()
                return "paused"
    assert run.result is not None
    return run.result.output


def to_second_pause(url: str, run_id: str, world: World) -> None:
    async def go() -> None:
        assert await drive(make(url, run_id), world, Draft()) == "paused"
        await make(url, run_id).resume(Verdict("ann"))
        assert await drive(make(url, run_id), world) == "paused"

    asyncio.run(go())


def history(url: str, run_id: str, **kw: Any) -> list[Any]:
    return asyncio.run(make(url, run_id, **kw).load_all())


def shape(snapshots: list[Any]) -> list[tuple[str, str]]:
    return [
        (type(s.node).__name__, s.status) if isinstance(s, NodeSnapshot) else ("End", "end")
        for s in snapshots
    ]


def test_a_loop_killed_as_its_second_answer_is_taken_uses_that_answer_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P1: killed right after the second pause's answer was consumed (before it was
    stored): recovery goes on with that answer, another is refused; no earlier node
    runs again and every effect applied once."""
    to_second_pause(store_url, run_id, world)

    def crash() -> None:
        failpoints.arm("interrupt.after_consume", "kill")
        asyncio.run(make(store_url, run_id).resume(Verdict("bob")))

    assert in_child(crash).status == "killed"
    with pytest.raises(ResumeConflict):
        asyncio.run(make(store_url, run_id).resume(Verdict("eve")))
    assert asyncio.run(drive(make(store_url, run_id), world)) == "ann + bob"
    assert world.entered() == {
        "draft": 1,
        "verdict": 2,
        "revise": 1,
        "revise.after_effect": 1,
        "ship": 1,
        "ship.after_effects": 1,
    }
    assert world.sink.counts() == {"draft": 1, "revise": 1, "parcel": 2, "label": 1}


def test_k_answers_racing_at_the_second_pause_one_is_taken(
    store_url: str, run_id: str, world: World
) -> None:
    """P5: four processes answer the loop's second pause at once, each then driving the
    run to its end: one answer is taken and runs, three get ResumeConflict and run
    nothing; the end holds the winner's answer."""
    to_second_pause(store_url, run_id, world)
    barrier = Barrier(4)

    def resumer(i: int) -> Callable[[], Any]:
        def go() -> str:
            barrier.wait()

            async def answer() -> str:
                p = make(store_url, run_id)
                await p.resume(Verdict(f"v{i}"))
                return await drive(p, world)

            return asyncio.run(answer())

        return go

    workers = [fork(resumer(i), barrier=barrier) for i in range(4)]
    try:
        barrier.release()
        outcomes = [w.wait(60) for w in workers]
    finally:
        reap(workers)
    winners = [i for i, o in enumerate(outcomes) if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    assert outcomes[winners[0]].value == f"ann + v{winners[0]}"
    assert world.entered()["verdict"] == 2 and world.entered()["ship"] == 1
    assert world.sink.counts() == {"draft": 1, "revise": 1, "parcel": 2, "label": 1}


def test_a_zombie_in_the_loops_body_writes_nothing_after_a_takeover(
    store_url: str, run_id: str, world: World
) -> None:
    """L1/L2/P2: the resumer running Revise (the loop's body) is stopped after its effect,
    past its lease; another process takes the run over, runs Revise again (its effect
    read back, not applied), and the run is answered and ended. Continued, the zombie's
    next snapshot is refused and nothing it does shows in the history."""

    async def first_round() -> None:
        assert await drive(make(store_url, run_id), world, Draft()) == "paused"
        await make(store_url, run_id).resume(Verdict("ann"))

    asyncio.run(first_round())

    def stale() -> Any:
        def freeze(node: str) -> None:
            if node == "revise.after_effect":
                os.kill(os.getpid(), signal.SIGSTOP)

        world.on_enter = freeze
        return asyncio.run(drive(make(store_url, run_id), world))

    zombie = fork(stale)
    try:
        assert zombie.wait(60, stopped_counts=True).status == "stopped"
        zombie.outcome = None
        time.sleep(LEASE + 0.3)

        async def take_over() -> str:
            assert await drive(make(store_url, run_id), world) == "paused"
            await make(store_url, run_id).resume(Verdict("bob"))
            return await drive(make(store_url, run_id), world)

        assert asyncio.run(take_over()) == "ann + bob"
        before = history(store_url, run_id)
        zombie.cont()
        late = zombie.wait(60)
    finally:
        reap([zombie])
    assert late.raised("RemitError"), late.summary()
    after = history(store_url, run_id)
    assert shape(after) == shape(before) and [s.id for s in after] == [s.id for s in before]
    assert isinstance(after[-1], EndSnapshot) and after[-1].state.revisions == 1
    assert world.sink.counts() == {"draft": 1, "revise": 1, "parcel": 2, "label": 1}


@pytest.mark.parametrize("nth", [1, 2])
def test_a_node_killed_between_concurrent_effects_applies_each_once(
    store_url: str, run_id: str, world: World, nth: int
) -> None:
    """P2/P1: Ship applies two parcels at once (asyncio.gather), then a label; killed
    right after its `nth` application, then recovered in another process: each parcel
    and the label applied once, no node before Ship runs again."""
    to_second_pause(store_url, run_id, world)
    asyncio.run(make(store_url, run_id).resume(Verdict("bob")))

    def crash() -> None:
        failpoints.arm("effect.after_apply", f"kill@{nth}")
        asyncio.run(drive(make(store_url, run_id), world))

    assert in_child(crash).status == "killed"
    time.sleep(LEASE + 0.2)
    done = in_child(lambda: asyncio.run(drive(make(store_url, run_id), world)))
    assert done.ok and done.value == "ann + bob", done.summary()
    assert world.entered()["ship"] == 2 and world.entered()["verdict"] == 2
    assert world.sink.counts() == {"draft": 1, "revise": 1, "parcel": 2, "label": 1}


# -- a fork of a pause, its answer's resumer killed ------------------------------------------


def test_a_fork_whose_answer_was_taken_as_its_resumer_died_uses_it_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P3/L3: the first pause is forked with a token; the fork's answer is consumed
    and its resumer killed before storing it. A process with the token goes on with
    that answer (another is refused on the fork), main's own pause is still answered
    separately, and the shared prefix's effect is not applied again."""
    asyncio.run(drive(make(store_url, run_id), world, Draft()))
    (pause,) = [s for s in history(store_url, run_id) if isinstance(s.node, Review)]

    def crash() -> None:
        async def go() -> None:
            forked = await make(store_url, run_id).fork(pause.id, "t1")
            failpoints.arm("interrupt.after_consume", "kill")
            await forked.resume(Verdict("fork-ann"))

        asyncio.run(go())

    assert in_child(crash).status == "killed"

    def recover() -> Any:
        async def go() -> Any:
            p = make(store_url, run_id, fork_token="t1")
            try:
                await p.resume(Verdict("fork-eve"))
            except ResumeConflict:
                pass
            else:
                return "a second answer was taken on the fork"
            return await drive(p, world)

        return asyncio.run(go())

    done = in_child(recover)
    assert done.ok and done.value == "paused", done.summary()

    async def finish_both() -> tuple[str, str]:
        await make(store_url, run_id, fork_token="t1").resume(Verdict("fork-bob"))
        forked = await drive(make(store_url, run_id, fork_token="t1"), world)
        await make(store_url, run_id).resume(Verdict("main-ann"))
        assert await drive(make(store_url, run_id), world) == "paused"
        await make(store_url, run_id).resume(Verdict("main-bob"))
        return forked, await drive(make(store_url, run_id), world)

    assert asyncio.run(finish_both()) == ("fork-ann + fork-bob", "main-ann + main-bob")
    assert world.entered()["draft"] == 1
    assert world.sink.counts() == {"draft": 1, "revise": 2, "parcel": 4, "label": 2}


def test_a_zombie_stopped_between_concurrent_effects_applies_nothing_more(
    store_url: str, run_id: str, world: World
) -> None:
    """L2/P2: the resumer running Ship is stopped right after its first parcel's
    application, past its lease; another process runs Ship again (that parcel
    reconciled, not applied twice) and ends the run. Continued, the zombie records
    nothing, applies no further parcel or label, and the history is unchanged."""
    to_second_pause(store_url, run_id, world)
    asyncio.run(make(store_url, run_id).resume(Verdict("bob")))

    def stale() -> Any:
        failpoints.arm("effect.after_apply", "stop")
        return asyncio.run(drive(make(store_url, run_id), world))

    zombie = fork(stale)
    try:
        assert zombie.wait(60, stopped_counts=True).status == "stopped"
        zombie.outcome = None
        time.sleep(LEASE + 0.3)
        assert asyncio.run(drive(make(store_url, run_id), world)) == "ann + bob"
        before = history(store_url, run_id)
        zombie.cont()
        late = zombie.wait(60)
    finally:
        reap([zombie])
    assert late.raised("RemitError"), late.summary()
    assert [s.id for s in history(store_url, run_id)] == [s.id for s in before]
    assert world.sink.counts() == {"draft": 1, "revise": 1, "parcel": 2, "label": 1}
    assert world.entered()["ship.after_effects"] == 1


def test_k_processes_forking_a_pause_with_one_token_and_answering_take_one_answer(
    store_url: str, run_id: str, world: World
) -> None:
    """P3/P5/L3: four processes fork the first pause with one token and answer the
    fork at once: one branch, one answer taken on it (three ResumeConflict); main's
    pause is untouched and still answerable."""
    asyncio.run(drive(make(store_url, run_id), world, Draft()))
    (pause,) = [s for s in history(store_url, run_id) if isinstance(s.node, Review)]
    barrier = Barrier(4)

    def resumer(i: int) -> Callable[[], Any]:
        def go() -> str:
            barrier.wait()

            async def answer() -> str:
                forked = await make(store_url, run_id).fork(pause.id, "t1")
                await forked.resume(Verdict(f"v{i}"), pause_id=pause.id)
                return await drive(forked, world)

            return asyncio.run(answer())

        return go

    workers = [fork(resumer(i), barrier=barrier) for i in range(4)]
    try:
        barrier.release()
        outcomes = [w.wait(60) for w in workers]
    finally:
        reap(workers)
    winners = [i for i, o in enumerate(outcomes) if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    line = history(store_url, run_id, fork_token="t1")
    assert [s.node.value for s in line if isinstance(s.node, Verdict)] == [f"v{winners[0]}"]
    assert shape(history(store_url, run_id)) == [("Draft", "success"), ("Review", "created")]
    assert asyncio.run(make(store_url, run_id).paused()) is not None
    assert world.entered() == {"draft": 1, "verdict": 1, "revise": 1, "revise.after_effect": 1}


# -- child graphs run at once by one parent node ---------------------------------------------


@dataclass
class Box:
    items: int = 0


@dataclass
class Pack(BaseNode[Box, World, int]):
    async def run(self, ctx: GraphRunContext[Box, World]) -> Seal:
        ctx.deps.enter("pack")
        ctx.state.items = 3
        return Seal()


@dataclass
class Seal(BaseNode[Box, World, int]):
    async def run(self, ctx: GraphRunContext[Box, World]) -> End[int]:
        ctx.deps.enter("seal")
        await apply(ctx, "seal")
        ctx.deps.enter("seal.after_effect")
        return End(ctx.state.items)


CHILD = Graph(nodes=(Pack, Seal), name="child")


async def run_child(url: str, run_id: str, world: World) -> int:
    """The README's recipe: a child run read, continued or started, whatever a crash left."""
    child: RemitStatePersistence[Box, int] = RemitStatePersistence(url, run_id, lease=LEASE)
    child.set_graph_types(CHILD)
    line = await child.load_all()
    if line and isinstance(line[-1], EndSnapshot):
        return line[-1].result.data
    if line:
        async with CHILD.iter_from_persistence(child, deps=world) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output
    return (await CHILD.run(Pack(), state=Box(), deps=world, persistence=child)).output


@dataclass
class Fan(BaseNode[Any, World, str]):
    """Runs three child graphs at once, each under a run id of its own snapshot."""

    async def run(self, ctx: GraphRunContext[Any, World]) -> End[str]:
        ctx.deps.enter("fan")
        runs = [f"{ctx.state['run']}/{self.get_snapshot_id()}/{i}" for i in range(3)]
        items = await asyncio.gather(*(run_child(ctx.state["url"], r, ctx.deps) for r in runs))
        ctx.deps.enter("fan.after_children")
        return End(f"{sum(items)} items")


FANS = Graph(nodes=(Fan,), name="fans")


@pytest.mark.parametrize("nth", [1, 3])
def test_a_parent_killed_while_its_children_run_at_once_recovers_each_once(
    store_url: str, run_id: str, world: World, nth: int
) -> None:
    """P1/P2/L1: Fan runs three child graphs concurrently; the process is killed right
    after the `nth` child effect. A recovery in another process runs Fan again: the
    ended children are read, the others continued; each child's seal applied once."""

    def crash() -> None:
        failpoints.arm("effect.after_apply", f"kill@{nth}")
        p = RemitStatePersistence(store_url, run_id, lease=LEASE)
        state = {"url": store_url, "run": run_id}
        asyncio.run(FANS.run(Fan(), state=state, deps=world, persistence=p))

    assert in_child(crash).status == "killed"
    time.sleep(LEASE + 0.3)

    def recover() -> Any:
        async def go() -> Any:
            p = RemitStatePersistence(store_url, run_id, lease=LEASE)
            async with FANS.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return run.result.output

        return asyncio.run(go())

    done = in_child(recover)
    assert done.ok and done.value == "9 items", done.summary()
    # A child's `pack` with no durable write yet may run again (P1): the children run
    # at once, so any of the three may have entered it before the kill.
    assert world.entered()["fan"] == 2 and 3 <= world.entered()["pack"] <= 6
    assert world.sink.counts() == {"seal": 3}


# -- a wrong answer at a loop's second pause ---------------------------------------------------


def test_a_wrong_answer_at_a_loops_second_pause_is_a_value_error(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/errors: at the second pause of the loop (Review, which leads only to Verdict),
    resume(Ship()) got `ResumeConflict` ("a pause of this run was answered already"),
    even naming the pause by its id: it read as another resumer's win, and a caller
    would drop it. It is a wrong answer to a paused run: `ValueError` naming what the
    pause leads to; nothing stored, the run still paused and answered after."""
    to_second_pause(store_url, run_id, world)

    async def go() -> None:
        question = await make(store_url, run_id).paused()
        assert question is not None
        before = await make(store_url, run_id).load_all()
        for pause_id in (None, question.id):
            with pytest.raises(ValueError, match="got Ship.* leads only to Verdict.* still paused"):
                await make(store_url, run_id).resume(Ship(), pause_id=pause_id)
        assert await make(store_url, run_id).load_all() == before
        await make(store_url, run_id).resume(Verdict("bob"), pause_id=question.id)
        assert await drive(make(store_url, run_id), world) == "ann + bob"

    asyncio.run(go())


def test_a_late_answer_for_an_answered_pause_is_still_a_resume_conflict(
    store_url: str, run_id: str, world: World
) -> None:
    """P5: the other side of the rule above: an answer that the run's answered pause
    leads to, arriving while a driver left the run at a later node (Pay, not started),
    is late: `ResumeConflict`, nothing stored."""

    async def go() -> None:
        await to_pause(store_url, run_id, world)
        await persistence(store_url, run_id).resume(Answer("ann"))
        p = persistence(store_url, run_id)
        async with GRAPH.iter_from_persistence(p, deps=world) as run:
            async for node in run:
                if isinstance(node, Pay):
                    break
        before = await persistence(store_url, run_id).load_all()
        with pytest.raises(ResumeConflict, match="answered already"):
            await persistence(store_url, run_id).resume(Answer("bob"))
        assert await persistence(store_url, run_id).load_all() == before

    asyncio.run(go())
