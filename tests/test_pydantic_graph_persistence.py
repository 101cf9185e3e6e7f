"""RemitStatePersistence against the real pydantic-graph 1.x, on SQLite, PostgreSQL and Redis.

Crash and concurrency items run in real forked processes (SIGKILL, a barrier of
racing resumers); the outside world (step entries, effect applications) is a
SQLite file every process shares.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge, MinLen
from conftest import engine_url
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphNodeStatusError, GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph.persistence.in_mem import FullStatePersistence
from typing_extensions import TypedDict

from remit_core import (
    CheckpointInvalid,
    CorruptRecord,
    ForkWithoutIntent,
    Remit,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
    arun_effect,
    failpoints,
)
from remit_core.conformance.adapter import Target
from remit_core.conformance.processes import Barrier, fork
from remit_core.conformance.storage import corrupt_remit_checkpoint
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_pydantic_graph import EndNotRunnable, RemitStatePersistence

LEASE = 1.0


class Order(TypedDict):
    amount: Annotated[int, Ge(0)]
    approved_by: str | None
    log: list[str]


@dataclass
class World:
    """What nodes touch outside the store: a journal, an effect sink, a crash point."""

    folder: Path
    amount: int = 100
    kill_at: str | None = None
    on_enter: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        self.db = WorldDB(self.folder / "world.db")
        self.journal, self.sink = Journal(self.db), EffectSink(self.db)

    def enter(self, node: str) -> None:
        self.journal.record("enter", node)
        if self.on_enter is not None:
            self.on_enter(node)
        if self.kill_at == node:
            os.kill(os.getpid(), signal.SIGKILL)

    def entered(self) -> dict[str, int]:
        return dict(self.journal.entered())


Ctx = GraphRunContext[Order, World]


@dataclass
class Start(BaseNode[Order, World, str]):
    async def run(self, ctx: Ctx) -> Ask:
        ctx.deps.enter("start")
        ctx.state["amount"] = ctx.deps.amount
        ctx.state["log"].append("start")
        return Ask()


@dataclass
class Ask(BaseNode[Order, World, str]):
    """The pause: drivers stop before it; the answer comes as `Answer(value)`."""

    async def run(self, ctx: Ctx) -> Answer:
        raise AssertionError("the pause never runs")


@dataclass
class Answer(BaseNode[Order, World, str]):
    value: Annotated[str, MinLen(1)]

    async def run(self, ctx: Ctx) -> Pay:
        ctx.deps.enter("answer")
        ctx.state["approved_by"] = self.value
        ctx.state["log"].append("answer")
        return Pay()


async def charge(ctx: Ctx) -> None:
    """The "charge" effect on the world's sink, applied once."""
    sink = ctx.deps.sink

    async def apply(key: str) -> str:
        return sink.apply("charge", key)

    await arun_effect("charge", apply, reconcile=sink.reconcile)


@dataclass
class Pay(BaseNode[Order, World, str]):
    async def run(self, ctx: Ctx) -> Done:
        ctx.deps.enter("pay")
        await charge(ctx)
        ctx.deps.enter("pay.after_effect")
        ctx.state["log"].append("pay")
        return Done()


@dataclass
class Done(BaseNode[Order, World, str]):
    async def run(self, ctx: Ctx) -> End[str]:
        ctx.deps.enter("done")
        ctx.state["log"].append("done")
        return End(f"paid {ctx.state['amount']}")


GRAPH = Graph(nodes=(Start, Ask, Answer, Pay, Done), name="order")


def fresh() -> Order:
    return {"amount": 0, "approved_by": None, "log": []}


@pytest.fixture
def url(store_url: str) -> str:
    return store_url


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def persistence(url: str, run_id: str, **kw: Any) -> RemitStatePersistence[Order, str]:
    p: RemitStatePersistence[Order, str] = RemitStatePersistence(
        url, run_id, **{"lease": LEASE, **kw}
    )
    p.set_graph_types(GRAPH)
    return p


async def drive(p: RemitStatePersistence[Order, str], world: World, node: Any = None) -> Any:
    """Run from `node` (or from the stored head) until the pause or the end."""
    context = (
        GRAPH.iter_from_persistence(p, deps=world)
        if node is None
        else GRAPH.iter(node, state=fresh(), deps=world, persistence=p)
    )
    async with context as run:
        async for step in run:
            if isinstance(step, Ask):
                return "paused"
    return run.result.output if run.result else None


async def to_pause(url: str, run_id: str, world: World) -> RemitStatePersistence[Order, str]:
    p = persistence(url, run_id)
    assert await drive(p, world, Start()) == "paused"
    return p


def in_child(fn: Callable[[], Any]) -> Any:
    """Run `fn` in a forked process; its outcome (ok / error / killed)."""
    return fork(fn).wait(60)


def statuses(snapshots: list[Any]) -> list[str]:
    return [s.status if isinstance(s, NodeSnapshot) else "end" for s in snapshots]


# -- the interface ------------------------------------------------------------------------


def test_every_method_against_graph_run(url: str, run_id: str, world: World) -> None:
    """graph.run / iter / initialize / iter_from_persistence, with every method of the interface."""

    async def go() -> None:
        p = RemitStatePersistence(url, run_id)
        assert p.should_set_types()
        p.set_graph_types(GRAPH)
        assert not p.should_set_types()
        await GRAPH.initialize(Start(), p, state=fresh())
        assert statuses(await p.load_all()) == ["created"]
        assert await drive(p, world) == "paused"
        snap = await p.resume(Answer("ann"))
        await p.snapshot_node_if_new(snap.id, snap.state, snap.node)  # known id: no-op
        assert await drive(p, world) == "paid 100"
        history = await p.load_all()
        assert statuses(history) == ["success", "created", "success", "success", "success", "end"]
        assert isinstance(history[-1], EndSnapshot) and history[-1].result.data == "paid 100"
        assert [type(s.node).__name__ for s in history[:-1]] == [
            "Start",
            "Ask",
            "Answer",
            "Pay",
            "Done",
        ]
        # Every node that ran has its duration; the pause never ran.
        assert [s.duration is not None for s in history[:-1]] == [True, False, True, True, True]
        with pytest.raises(LookupError):
            async with p.record_run("Pay:no-such-snapshot"):
                pass
        assert await p.load_next() is None  # the run ended

    asyncio.run(go())
    assert world.entered() == {"start": 1, "answer": 1, "pay": 1, "pay.after_effect": 1, "done": 1}
    assert world.sink.counts() == {"charge": 1}


def test_effect_is_keyed_by_the_snapshot_id(url: str, run_id: str, world: World) -> None:
    """P2: a node's effects are recorded under its snapshot id, the same on every replay."""

    async def go() -> str:
        p = await to_pause(url, run_id, world)
        await p.resume(Answer("ann"))
        await drive(p, world)
        pay = next(s for s in await p.load_all() if isinstance(getattr(s, "node", None), Pay))
        return pay.id

    pay_id = asyncio.run(go())
    entry = persistence(url, run_id).remit.store.get_effect(run_id, f"{pay_id}/charge#0")
    assert entry is not None and entry.status == "done"


# -- P1 / L1: crashes, reclaim, success with the next snapshot, cancellation ---------------


@pytest.mark.parametrize("where", ["pay", "pay.after_effect"])
def test_killed_node_is_reclaimed_with_its_snapshot_id(
    url: str, run_id: str, world: World, where: str
) -> None:
    """P1/L1: SIGKILL inside a node leaves it running; after the lease, load_next hands the
    same snapshot out again and the run completes; the effect is applied once (P2)."""
    asyncio.run(to_pause(url, run_id, world))

    def crash() -> None:
        world.kill_at = where

        async def go() -> None:
            p = persistence(url, run_id)
            await p.resume(Answer("ann"))
            await drive(p, world)

        asyncio.run(go())

    assert in_child(crash).status == "killed"
    history = asyncio.run(persistence(url, run_id).load_all())
    assert statuses(history)[-1] == "running" and isinstance(history[-1].node, Pay)
    store = persistence(url, run_id).remit.store
    dead = store.get_claim(run_id, "main")
    assert dead is not None and dead.holder != ""  # never released: its lease has to lapse
    time.sleep(LEASE + 0.2)

    async def run_in_place() -> None:  # pydantic-graph's rule holds: no re-run without load_next
        async with persistence(url, run_id).record_run(history[-1].id):
            pass

    with pytest.raises(GraphNodeStatusError):
        asyncio.run(run_in_place())

    async def recover() -> Any:
        p = persistence(url, run_id)
        again = await p.load_next()
        assert again is not None and again.id == history[-1].id and again.status == "pending"
        p.release()
        return await drive(persistence(url, run_id), world)

    assert asyncio.run(recover()) == "paid 100"
    taken = store.get_claim(run_id, "main")
    assert taken is not None and taken.fence > dead.fence  # a new claim, not the dead one's
    assert world.sink.counts() == {"charge": 1}
    assert world.entered()["pay"] == 2 and world.entered()["answer"] == 1


@pytest.mark.parametrize(
    ("point", "pay_entries"), [("checkpoint.before_commit", 2), ("checkpoint.after_commit", 1)]
)
def test_success_is_committed_with_the_next_snapshot(
    url: str, run_id: str, world: World, point: str, pay_entries: int
) -> None:
    """P1: a crash just before Pay's completion commits re-runs Pay; just after, it does not.
    Either way the next node is never lost (the file backend strands the run there)."""
    asyncio.run(to_pause(url, run_id, world))

    def crash() -> None:
        async def go() -> None:
            p = persistence(url, run_id)
            await p.resume(Answer("ann"))
            async with GRAPH.iter_from_persistence(p, deps=world) as run:
                await run.next()  # Answer
                failpoints.arm(point, "kill")
                await run.next()  # Pay, then its completion with Done's snapshot

        asyncio.run(go())

    assert in_child(crash).status == "killed"
    time.sleep(LEASE + 0.2)
    assert asyncio.run(drive(persistence(url, run_id), world)) == "paid 100"
    assert world.entered()["pay"] == pay_entries
    assert world.sink.counts() == {"charge": 1}
    kinds = [
        type(getattr(s, "node", s)).__name__
        for s in asyncio.run(persistence(url, run_id).load_all())
    ]
    assert kinds == ["Start", "Ask", "Answer", "Pay", "Done", "End"]


def test_cancellation_gives_the_node_back(url: str, run_id: str, world: World) -> None:
    """A cancelled node is not left running: another resumer takes it at once, same id."""
    started = asyncio.Event()

    @dataclass
    class Slow(BaseNode[Order, World, str]):
        async def run(self, ctx: GraphRunContext[Order, World]) -> End[str]:
            started.set()
            await asyncio.sleep(60)
            return End("slow")

    slow_graph = Graph(nodes=(Slow,), name="slow")

    async def go() -> None:
        p = RemitStatePersistence(url, run_id, lease=30.0)
        task = asyncio.create_task(slow_graph.run(Slow(), state=fresh(), persistence=p))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        other = RemitStatePersistence(url, run_id, lease=30.0)
        other.set_graph_types(slow_graph)
        (first,) = await other.load_all()
        assert first.status == "created" and first.start_ts is None
        again = await other.load_next()  # no 30 s lease to wait out
        assert again is not None and again.id == first.id
        other.release()

    asyncio.run(go())


# -- P4: validation on write, verified reads, one End --------------------------------------


def test_invalid_state_is_refused_and_the_run_stays_loadable(
    url: str, run_id: str, tmp_path: Path
) -> None:
    """P4: amount=-5 from a node raises CheckpointInvalid naming the field; nothing is written."""
    world = World(tmp_path, amount=-5)

    async def go() -> None:
        p = persistence(url, run_id)
        with pytest.raises(CheckpointInvalid) as bad:
            await drive(p, world, Start())
        assert bad.value.field == "state.amount" and run_id in str(bad.value)
        history = await persistence(url, run_id).load_all()
        assert statuses(history) == ["error"] and history[0].state["amount"] == 0

    asyncio.run(go())


def test_wrong_types_never_reach_the_store(url: str, run_id: str, world: World) -> None:
    """P4: a value of the wrong type (which the file backend writes with a warning) is refused."""

    async def go() -> None:
        p = await to_pause(url, run_id, world)
        head = (await p.load_all())[-1]
        for state, path in (
            ({**head.state, "amount": "many"}, "state.amount"),
            ({**head.state, "amount": -1}, "state.amount"),
        ):
            with pytest.raises(CheckpointInvalid) as bad:
                await p.update_state(state)
            assert bad.value.field == path
        with pytest.raises(CheckpointInvalid) as bad:
            await p.resume(Answer(12345))  # type: ignore[arg-type]
        assert bad.value.field == "node.value"
        assert (await p.paused()) is not None  # still paused, still answerable
        assert [s.id for s in await p.load_all()][-1] == head.id

    asyncio.run(go())


def test_corrupt_and_foreign_records_fail_loudly(
    url: str, run_id: str, world: World, tmp_path: Path
) -> None:
    """P4: altered bytes raise CorruptRecord, another workflow version VersionMismatch;
    both name the run and the checkpoint."""

    async def go() -> None:
        p = await to_pause(url, run_id, world)
        head = (await p.load_all())[-1].id
        v2 = persistence(url, run_id, workflow_version="v2")
        with pytest.raises(VersionMismatch) as other:
            await v2.resume(Answer("ann"))
        assert run_id in str(other.value) and head in str(other.value)
        corrupt_remit_checkpoint(Target(url, "remit", url, tmp_path, "t"), run_id, head)
        with pytest.raises(CorruptRecord) as bad:
            await persistence(url, run_id).load_next()
        assert run_id in str(bad.value) and head in str(bad.value)

    asyncio.run(go())


def test_at_most_one_end(url: str, run_id: str, world: World) -> None:
    """P4/P3: after End, neither a new start nor a second End is written without a fork token."""

    async def go() -> None:
        p = await to_pause(url, run_id, world)
        await p.resume(Answer("ann"))
        await drive(p, world)
        with pytest.raises(ForkWithoutIntent):
            await GRAPH.run(
                Start(), state=fresh(), deps=world, persistence=persistence(url, run_id)
            )
        with pytest.raises(ForkWithoutIntent):
            await persistence(url, run_id).snapshot_end(fresh(), End("again"))
        history = await persistence(url, run_id).load_all()
        assert sum(isinstance(s, EndSnapshot) for s in history) == 1

    asyncio.run(go())


# -- P5: the resume value, once across processes -----------------------------------------


def test_racing_resumers_one_wins(url: str, run_id: str, world: World) -> None:
    """P5: four processes answer at once; one value is consumed and runs, three get
    ResumeConflict and run nothing; a late answer is refused too."""
    asyncio.run(to_pause(url, run_id, world))
    barrier = Barrier(4)

    def resumer(i: int) -> Callable[[], Any]:
        def go() -> str:
            barrier.wait()

            async def answer() -> Any:
                p = persistence(url, run_id)
                await p.resume(Answer(f"v{i}"))
                return await drive(p, world)

            return asyncio.run(answer())

        return go

    workers = [fork(resumer(i), barrier=barrier) for i in range(4)]
    barrier.release()
    outcomes = [w.wait(60) for w in workers]
    winners = [i for i, o in enumerate(outcomes) if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    final = asyncio.run(persistence(url, run_id).load_all())[-1]
    assert final.state["approved_by"] == f"v{winners[0]}"
    assert world.entered()["answer"] == 1 and world.sink.counts() == {"charge": 1}
    with pytest.raises(ResumeConflict):
        asyncio.run(persistence(url, run_id).resume(Answer("late")))


def test_docs_pattern_never_silently_starts_over(url: str, run_id: str, world: World) -> None:
    """P5/P3: the file backend's human-in-the-loop recipe (load_next, then iter(Answer(...)))
    is refused on a paused or ended run instead of growing a second run in place."""

    async def go() -> None:
        await to_pause(url, run_id, world)
        p = persistence(url, run_id)
        snapshot = await p.load_next()
        assert snapshot is not None and isinstance(snapshot.node, Ask)
        with pytest.raises(ForkWithoutIntent):
            async with GRAPH.iter(
                Answer("ann"), state=snapshot.state, deps=world, persistence=p
            ) as run:
                await run.next()
        assert await persistence(url, run_id).paused() is not None  # claim given back

    asyncio.run(go())
    assert world.entered() == {"start": 1}


def opened(url: str, run_id: str, pause_id: str, status: str = "pending") -> None:
    """Wait until the pause's interrupt reaches `status` (a resumer in another process)."""
    remit = persistence(url, run_id).remit
    deadline = time.monotonic() + 30
    while (i := remit.interrupt(run_id, pause_id)) is None or i.status != status:
        assert time.monotonic() < deadline, f"the interrupt never became {status}"
        time.sleep(0.02)


def test_an_answer_consumed_after_a_driver_loaded_the_pause_is_used_not_skipped(
    url: str, run_id: str, world: World
) -> None:
    """P5: resume() found the run free, then a driver loaded the paused node before the
    value was consumed. The driver does not run the pause without the value: it commits
    the answer and gets `ResumeConflict`; the run continues with the acknowledged value."""
    asyncio.run(to_pause(url, run_id, world))
    pause_id = asyncio.run(persistence(url, run_id).load_all())[-1].id

    def answer() -> None:
        failpoints.arm("interrupt.before_consume", "sleep:1.0")
        asyncio.run(persistence(url, run_id).resume(Answer("ann")))

    resumer = fork(answer)
    opened(url, run_id, pause_id)  # the resumer found the run free and is consuming

    async def driver() -> None:
        p = persistence(url, run_id)
        async with GRAPH.iter_from_persistence(p, deps=world) as run:  # loads the pause
            opened(url, run_id, pause_id, "consumed")
            with pytest.raises(ResumeConflict, match="answered"):
                await run.next()  # (the pause itself would fail the test: it never runs)

    asyncio.run(driver())
    assert resumer.wait(60).ok  # acknowledged
    assert asyncio.run(drive(persistence(url, run_id), world)) == "paid 100"
    final = asyncio.run(persistence(url, run_id).load_all())[-1]
    assert final.state["approved_by"] == "ann" and world.sink.counts() == {"charge": 1}


@dataclass
class Wait(BaseNode[Order, World, str]):
    """A pause that a driver may also run: it then goes on with a default after a while
    (longer than a resumer waits for the claim: a lease and a second)."""

    async def run(self, ctx: Ctx) -> Use:
        ctx.deps.enter("wait")
        await asyncio.sleep(LEASE + 2.5)
        return Use("default")


@dataclass
class Use(BaseNode[Order, World, str]):
    value: str

    async def run(self, ctx: Ctx) -> End[str]:
        ctx.state["approved_by"] = self.value
        return End(self.value)


WAITING = Graph(nodes=(Wait, Use), name="waiting")


def test_an_answer_consumed_while_a_driver_runs_the_pause_is_refused_not_acknowledged(
    url: str, run_id: str, world: World
) -> None:
    """P5: the value a run continues with is the acknowledged one. A value consumed while
    another process runs the paused node without it is never used, so resume() raises
    (`HeadMoved`) instead of returning as if it were."""

    def waiting() -> RemitStatePersistence[Order, str]:
        p: RemitStatePersistence[Order, str] = RemitStatePersistence(url, run_id, lease=LEASE)
        p.set_graph_types(WAITING)
        return p

    asyncio.run(WAITING.initialize(Wait(), waiting(), state=fresh()))
    pause_id = asyncio.run(waiting().load_all())[-1].id

    def answer() -> None:
        failpoints.arm("interrupt.before_consume", "sleep:1.0")
        asyncio.run(waiting().resume(Use("ann")))

    resumer = fork(answer)
    opened(url, run_id, pause_id)

    async def driver() -> str | None:
        async with WAITING.iter_from_persistence(waiting(), deps=world) as run:
            async for _ in run:
                pass
        return run.result.output if run.result else None

    assert asyncio.run(driver()) == "default"
    outcome = resumer.wait(60)
    assert outcome.status == "error" and outcome.raised("HeadMoved"), outcome.summary()
    assert asyncio.run(waiting().load_all())[-1].state["approved_by"] == "default"
    assert world.entered() == {"wait": 1}


def test_a_task_that_uses_the_instance_while_it_runs_a_node_is_refused(
    url: str, run_id: str, world: World
) -> None:
    """P5 in one process: an instance makes one call at a time. A task the driver starts
    while the instance runs a node gets `ResumeConflict` for its own run, runs nothing."""
    asyncio.run(to_pause(url, run_id, world))
    p = persistence(url, run_id)
    asyncio.run(p.resume(Answer("ann")))
    helped: list[str] = []

    async def helper() -> None:
        try:
            async with GRAPH.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            helped.append("ran")
        except ResumeConflict:
            helped.append("conflict")

    async def go() -> Any:
        tasks: list[asyncio.Task[None]] = []
        world.on_enter = lambda node: (
            tasks.append(asyncio.get_running_loop().create_task(helper()))
            if node == "pay"  # (it runs when the node awaits its effect)
            else None
        )
        result = await drive(p, world)
        await asyncio.gather(*tasks)
        return result

    assert asyncio.run(go()) == "paid 100"
    assert helped == ["conflict"]
    assert world.entered() == {"start": 1, "answer": 1, "pay": 1, "pay.after_effect": 1, "done": 1}


def test_value_accepted_before_a_crash_is_used_once(url: str, run_id: str, world: World) -> None:
    """P5: killed right after the value was consumed (before its node was stored): recovery
    continues with that value; a second value is refused."""
    asyncio.run(to_pause(url, run_id, world))

    def crash() -> None:
        failpoints.arm("interrupt.after_consume", "kill")
        asyncio.run(persistence(url, run_id).resume(Answer("ann")))

    assert in_child(crash).status == "killed"
    with pytest.raises(ResumeConflict):
        asyncio.run(persistence(url, run_id).resume(Answer("bob")))
    assert asyncio.run(drive(persistence(url, run_id), world)) == "paid 100"
    final = asyncio.run(persistence(url, run_id).load_all())[-1]
    assert final.state["approved_by"] == "ann" and world.sink.counts() == {"charge": 1}


def test_an_edited_pause_is_answered_by_the_id_it_was_asked_with(
    url: str, run_id: str, world: World
) -> None:
    """P5: an operator's `update_state` keeps the pause the same question. The answer
    that names it by the id `paused()` gave before the edit is taken, once, with the
    edited state; a retry of it, by either id, is refused."""

    async def go() -> None:
        await to_pause(url, run_id, world)
        question = await persistence(url, run_id).paused()
        assert question is not None
        edited = await persistence(url, run_id).update_state({**question.state, "amount": 7})
        assert edited.id != question.id
        await persistence(url, run_id).resume(Answer("ann"), pause_id=question.id)
        for pause_id in (question.id, edited.id):
            with pytest.raises(ResumeConflict, match="answered already"):
                await persistence(url, run_id).resume(Answer("bob"), pause_id=pause_id)
        assert await drive(persistence(url, run_id), world) == "paid 7"
        final = (await persistence(url, run_id).load_all())[-1]
        assert final.state["approved_by"] == "ann"

    asyncio.run(go())
    assert world.entered()["answer"] == 1 and world.sink.counts() == {"charge": 1}


def test_an_edit_after_the_answer_was_taken_keeps_the_answer(
    url: str, run_id: str, world: World
) -> None:
    """P5: the answer was consumed, then its resumer died before storing it. An edit
    that comes next is refused (`ResumeConflict`, nothing of it stored) and the run goes
    on with the answer, so no second answer is taken for that pause."""
    asyncio.run(to_pause(url, run_id, world))
    question = asyncio.run(persistence(url, run_id).paused())
    assert question is not None

    def crash() -> None:
        failpoints.arm("interrupt.after_consume", "kill")
        asyncio.run(persistence(url, run_id).resume(Answer("ann")))

    assert in_child(crash).status == "killed"
    with pytest.raises(ResumeConflict, match="edit was not stored"):
        asyncio.run(persistence(url, run_id).update_state({**question.state, "amount": 7}))
    with pytest.raises(ResumeConflict):
        asyncio.run(persistence(url, run_id).resume(Answer("bob"), pause_id=question.id))
    assert asyncio.run(drive(persistence(url, run_id), world)) == "paid 100"
    final = asyncio.run(persistence(url, run_id).load_all())[-1]
    assert final.state["approved_by"] == "ann" and world.sink.counts() == {"charge": 1}


@dataclass
class Flaky(BaseNode[Order, World, str]):
    """Charges, then fails on its first entry (after the effect was applied)."""

    async def run(self, ctx: Ctx) -> Done:
        ctx.deps.enter("flaky")
        await charge(ctx)
        if ctx.deps.entered()["flaky"] == 1:
            raise RuntimeError("the payment API timed out after charging")
        return Done()


FLAKY = Graph(nodes=(Flaky, Done), name="flaky")


def test_a_node_that_raised_is_run_again_or_answered(url: str, run_id: str, world: World) -> None:
    """A node that raised left no snapshot after it: `iter_from_persistence` runs it
    again (its recorded effect is not applied again, P2), and a pause that a driver ran
    by mistake can still be answered with `resume()` (which once said to recover it
    with `iter_from_persistence()`, which then had nothing to load)."""

    async def flaky() -> Any:
        def p() -> RemitStatePersistence[Order, str]:
            flaky_p: RemitStatePersistence[Order, str] = RemitStatePersistence(url, run_id)
            flaky_p.set_graph_types(FLAKY)
            return flaky_p

        with pytest.raises(RuntimeError, match="timed out"):
            await FLAKY.run(Flaky(), state=fresh(), deps=world, persistence=p())
        assert statuses(await p().load_all()) == ["error"]
        async with FLAKY.iter_from_persistence(p(), deps=world) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "paid 0"
        assert statuses(await p().load_all()) == ["success", "success", "end"]

    asyncio.run(flaky())
    assert world.entered()["flaky"] == 2 and world.sink.counts() == {"charge": 1}

    paused = f"{run_id}-pause"

    async def pause_run_by_mistake() -> None:
        await to_pause(url, paused, world)
        with pytest.raises(AssertionError, match="never runs"):
            async with GRAPH.iter_from_persistence(persistence(url, paused), deps=world) as run:
                async for _ in run:
                    pass
        question = await persistence(url, paused).paused()
        assert question is not None and question.status == "error"
        await persistence(url, paused).resume(Answer("ann"), pause_id=question.id)
        assert await drive(persistence(url, paused), world) == "paid 100"

    asyncio.run(pause_run_by_mistake())
    assert world.sink.counts() == {"charge": 2} and world.entered()["answer"] == 1


# -- P3: forks need a token; one token, one branch ---------------------------------------


def test_forks_need_a_token_and_one_token_is_one_branch(
    url: str, run_id: str, world: World
) -> None:
    async def go() -> None:
        p = await to_pause(url, run_id, world)
        await p.resume(Answer("ann"))
        await drive(p, world)
        history = await p.load_all()
        pay = next(s for s in history if isinstance(getattr(s, "node", None), Pay))
        with pytest.raises(ForkWithoutIntent):  # replaying an old snapshot in place
            async with GRAPH.iter(pay.node, state=pay.state, deps=world, persistence=p) as run:
                await run.next()
        assert len(p.remit.branches(run_id)) == 1
        forked = persistence(url, run_id, fork_token="again")
        async with GRAPH.iter(pay.node, state=pay.state, deps=world, persistence=forked) as run:
            async for _ in run:
                pass
        assert forked.branch != "main" and (await forked.load_all())[-1].state == history[-1].state
        assert (await persistence(url, run_id).load_all())[-1].id == history[-1].id
        same = await p.fork(pay.id, "again")
        assert same.branch == forked.branch and len(p.remit.branches(run_id)) == 2

    asyncio.run(go())
    # Pay run again on the fork is the fork's own work (its own key); nothing before it reruns.
    assert world.sink.counts() == {"charge": 2}
    assert world.entered()["start"] == 1 and world.entered()["answer"] == 1


def test_fork_of_a_paused_run_has_its_own_interrupt(url: str, run_id: str, world: World) -> None:
    """L3: both the run and its fork take one answer each."""

    async def go() -> None:
        p = await to_pause(url, run_id, world)
        head = (await p.load_all())[-1].id
        forked = await p.fork(head, "other-answer")
        await forked.resume(Answer("bob"))
        await p.resume(Answer("ann"))
        assert await drive(forked, world) == await drive(p, world) == "paid 100"
        with pytest.raises(ResumeConflict):
            await (await p.fork(head, "other-answer")).resume(Answer("eve"))
        ends = [(await x.load_all())[-1].state["approved_by"] for x in (p, forked)]
        assert ends == ["ann", "bob"]

    asyncio.run(go())


def test_a_token_that_started_the_run_names_its_line(url: str, run_id: str, world: World) -> None:
    """P3: a run started with a fork token (a job runner retrying with a stable token) is
    the line that token names. Presented again, from another process, the token finds
    that line, and a new start there is refused (paused, then ended) instead of forking
    the run off its head and running the graph again. No line gets a second End, and no
    fork starts after an End."""
    job = {"fork_token": "job-7"}
    assert asyncio.run(drive(persistence(url, run_id, **job), world, Start())) == "paused"
    remit = persistence(url, run_id).remit
    named = remit.fork_branch(run_id, "job-7")
    assert named is not None and named.branch == "main"

    def retry(token: str = "job-7") -> Any:
        return asyncio.run(drive(persistence(url, run_id, fork_token=token), world, Start()))

    paused = in_child(retry)
    assert paused.raised("ForkWithoutIntent") and "iter_from_persistence" in paused.error_text()
    p = persistence(url, run_id, **job)
    asyncio.run(p.resume(Answer("ann")))
    assert asyncio.run(drive(p, world)) == "paid 100"
    ended = in_child(retry)
    assert ended.raised("ForkWithoutIntent") and "ended" in ended.error_text()
    other = in_child(lambda: retry("another-job"))  # a new token does not fork off the End
    assert other.raised("ForkWithoutIntent") and "second End" in other.error_text()
    line = asyncio.run(persistence(url, run_id, **job).load_all())
    assert sum(isinstance(s, EndSnapshot) for s in line) == 1
    assert [b.branch for b in remit.branches(run_id)] == ["main"]
    assert world.entered()["start"] == 1 and world.sink.counts() == {"charge": 1}


# -- the async path -------------------------------------------------------------------------


def test_store_calls_do_not_block_the_event_loop(tmp_path: Path, run_id: str, world: World) -> None:
    """Each store call runs in a worker thread: a 0.3 s commit leaves the loop ticking."""
    url = engine_url("sqlite", tmp_path)

    async def go() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        failpoints.arm("checkpoint.before_commit", "sleep:0.3")
        try:
            await persistence(url, run_id).snapshot_node(fresh(), Start())
        finally:
            failpoints.disarm()
            task.cancel()
        return ticks

    assert asyncio.run(go()) >= 5


def test_threads_of_a_process_share_one_holder_identity(tmp_path: Path) -> None:
    """Threads resuming through one `Remit` (K8-THREADS) take and keep claims as one
    process: the identity is made once, however many threads ask for it first."""
    remit = Remit(engine_url("sqlite", tmp_path))
    barrier = threading.Barrier(16)
    seen: list[str] = []

    def ask() -> None:
        barrier.wait()
        seen.append(remit.holder)

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 16 and len(set(seen)) == 1 and str(os.getpid()) in seen[0]


# -- resumers: the answer gives the run back; tasks sharing an instance ----------------------


def test_resume_gives_the_run_back_to_any_process(url: str, run_id: str, world: World) -> None:
    """P5 with a 30 s lease: once the answer is committed, another instance, or a process
    after the resumer exited, continues at once; the answer is still taken once."""
    lease = {"lease": 30.0}
    asyncio.run(to_pause(url, run_id, world))

    def answer() -> None:
        asyncio.run(persistence(url, run_id, **lease).resume(Answer("ann")))

    assert in_child(answer).ok
    with pytest.raises(ResumeConflict):  # consumed once: a second answer is refused
        asyncio.run(persistence(url, run_id, **lease).resume(Answer("bob")))
    began = time.monotonic()
    assert asyncio.run(drive(persistence(url, run_id, **lease), world)) == "paid 100"
    assert time.monotonic() - began < 10  # no lease waited out
    final = asyncio.run(persistence(url, run_id, **lease).load_all())[-1]
    assert final.state["approved_by"] == "ann"

    other = f"{run_id}-b"  # in one process: the resuming instance is not the continuing one
    asyncio.run(to_pause(url, other, world))

    async def two_instances() -> Any:
        await persistence(url, other, **lease).resume(Answer("eve"))
        return await drive(persistence(url, other, **lease), world)

    assert asyncio.run(two_instances()) == "paid 100"
    assert world.entered()["answer"] == 2 and world.sink.counts() == {"charge": 2}


def test_tasks_sharing_one_instance_exclude_each_other(url: str, run_id: str, world: World) -> None:
    """K8-THREADS on one instance: of 8 asyncio tasks, one proceeds and 7 get
    ResumeConflict before running a node (the instance is in a call), whether they
    continue or answer."""

    async def outcome(work: Any) -> Any:
        try:
            return await work
        except ResumeConflict:
            return "conflict"

    async def go() -> tuple[list[Any], list[Any]]:
        p = persistence(url, run_id)
        await GRAPH.initialize(Start(), p, state=fresh())
        started = await asyncio.gather(*(outcome(drive(p, world)) for _ in range(8)))

        async def answer(i: int) -> Any:
            await p.resume(Answer(f"v{i}"))
            return i, await drive(p, world)

        answered = await asyncio.gather(*(outcome(answer(i)) for i in range(8)))
        return started, answered

    started, answered = asyncio.run(go())
    assert sorted(started, key=str) == ["conflict"] * 7 + ["paused"]
    winners = [a for a in answered if a != "conflict"]
    assert len(winners) == 1 and winners[0][1] == "paid 100", answered
    final = asyncio.run(persistence(url, run_id).load_all())[-1]
    assert final.state["approved_by"] == f"v{winners[0][0]}"
    assert world.entered() == {"start": 1, "answer": 1, "pay": 1, "pay.after_effect": 1, "done": 1}
    assert world.sink.counts() == {"charge": 1}


def test_a_task_its_caller_awaits_acts_for_it(url: str, run_id: str, world: World) -> None:
    """`asyncio.wait_for(run.next())` runs each node in a task of its own (Python 3.11):
    the claim is the instance's, so that task runs the node its caller loaded."""

    async def go() -> Any:
        p = persistence(url, run_id)
        await GRAPH.initialize(Start(), p, state=fresh())
        async with GRAPH.iter_from_persistence(p, deps=world) as run:
            node: Any = run.next_node
            while not isinstance(node, Ask):
                node = await asyncio.wait_for(run.next(node), 30)
        await p.resume(Answer("ann"))
        async with GRAPH.iter_from_persistence(p, deps=world) as run:
            node = run.next_node
            while not isinstance(node, End):
                node = await asyncio.wait_for(run.next(node), 30)
        return node.data

    assert asyncio.run(go()) == "paid 100"
    assert world.sink.counts() == {"charge": 1}


# -- options and arguments: typed errors, before anything is opened or written ---------------


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"lease": 0}, ValueError, "lease"),
        ({"lease": -1.0}, ValueError, "lease"),
        ({"lease": float("nan")}, ValueError, "lease"),
        ({"lease": float("inf")}, ValueError, "lease"),
        ({"lease": "30"}, TypeError, "lease"),
        ({"fork_token": ""}, ValueError, "fork_token"),
        ({"fork_token": 7}, TypeError, "fork_token"),
        ({"workflow_version": 2}, TypeError, "workflow_version"),
        ({"accept_versions": "v1"}, TypeError, "accept_versions"),
        ({"accept_versions": ["v1", 2]}, TypeError, "accept_versions"),
    ],
)
def test_bad_options_are_refused_before_the_store_is_opened(
    tmp_path: Path, run_id: str, options: dict[str, Any], error: type[Exception], named: str
) -> None:
    """A lease of 0 or less would expire every claim as it is taken (two processes in one
    node): it, and every other bad option, raises at construction, naming the option."""
    db = tmp_path / "never.db"
    with pytest.raises(error, match=named):
        RemitStatePersistence(f"sqlite:///{db}", run_id, **options)
    assert not db.exists()


def test_bad_inputs_raise_typed_errors_and_write_nothing(
    url: str, run_id: str, world: World, tmp_path: Path
) -> None:
    """run_id and resume()'s answer are checked before any store call, alike on every
    engine: TypeError / ValueError naming what was wrong; the run stays as it was."""
    for bad_id, error in ((None, TypeError), (123, TypeError), ("", ValueError)):
        with pytest.raises(error, match="run_id"):
            RemitStatePersistence(url, bad_id)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="url"):
        RemitStatePersistence(tmp_path, run_id)  # type: ignore[arg-type]

    async def go() -> None:
        p = await to_pause(url, run_id, world)
        before = [s.id for s in await p.load_all()]
        for answer, error in (
            (End("x"), TypeError),
            ("str", TypeError),
            (None, TypeError),
            (Pay, TypeError),  # the class, not a node
            (Stray(), ValueError),  # a node of another graph
            (Pay(), ValueError),  # a node of the graph that does not follow the pause
        ):
            with pytest.raises(error, match="resume"):
                await p.resume(answer)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="got Pay.* paused at Ask.* leads only to Answer"):
            await p.resume(Pay(), pause_id=before[-1])
        assert [s.id for s in await p.load_all()] == before
        assert p.remit.interrupts(run_id) == []  # not even the pause was opened
        assert await p.paused() is not None

    asyncio.run(go())


def test_an_unknown_run_is_refused_and_nothing_is_stored(url: str, run_id: str) -> None:
    """A run id no run has (a typo, a run deleted): every call answers as pydantic-graph's
    own backends do for an empty history (None, [], `GraphRuntimeError`), or with
    `UnknownRecord`, and the store holds nothing for that id afterwards, not even a claim."""
    p = persistence(url, run_id)

    async def go() -> None:
        assert await p.load_next() is None
        assert await p.load_all() == [] and await p.paused() is None
        with pytest.raises(GraphRuntimeError):
            async with GRAPH.iter_from_persistence(p):
                pass
        for call in (p.resume(Answer("ann")), p.update_state(fresh())):
            with pytest.raises(UnknownRecord):
                await call

    asyncio.run(go())
    assert p.remit.store.get_claim(run_id, "main") is None
    assert p.remit.store.list_branches(run_id, "") == []


@dataclass
class Stray(BaseNode[Order, World, str]):
    """A node of no graph here (for `resume`'s check)."""

    async def run(self, ctx: Ctx) -> End[str]:
        return End("slow")


# -- P4: the bad value's full path; values JSON cannot carry ---------------------------------


@dataclass
class Inner:
    amount: Annotated[int, Ge(0)] = 0
    tags: list[str] = field(default_factory=list)


@dataclass
class Form:
    name: str = "x"
    blob: bytes = b""
    inner: Inner = field(default_factory=Inner)
    limit: float | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    extra: Any = None
    names: Sequence[str] = field(default_factory=list)


@dataclass
class Spoil:
    """What `Fill` does to the state, the field it gives `Check`, and the run's result."""

    state: Callable[[Form], Any] = lambda form: None
    k: Any = 1
    result: Any = 5


@dataclass
class Fill(BaseNode[Form, Spoil, int]):
    async def run(self, ctx: GraphRunContext[Form, Spoil]) -> Check:
        ctx.deps.state(ctx.state)
        return Check(k=ctx.deps.k)


@dataclass
class Check(BaseNode[Form, Spoil, int]):
    k: int

    async def run(self, ctx: GraphRunContext[Form, Spoil]) -> End[int]:
        return End(ctx.deps.result)


FORMS = Graph(nodes=(Fill, Check), name="forms")


class Opaque:
    """An object pydantic cannot serialize."""


def refused(url: str, run_id: str, spoil: Spoil) -> tuple[CheckpointInvalid, list[Any]]:
    """Run FORMS with `spoil`: the CheckpointInvalid it raises, and the history after it."""

    async def go() -> tuple[CheckpointInvalid, list[Any]]:
        p: RemitStatePersistence[Form, int] = RemitStatePersistence(url, run_id, lease=LEASE)
        with pytest.raises(CheckpointInvalid) as bad:
            await FORMS.run(Fill(), state=Form(), deps=spoil, persistence=p)
        again: RemitStatePersistence[Form, int] = RemitStatePersistence(url, run_id)
        again.set_graph_types(FORMS)
        return bad.value, await again.load_all()

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("spoil", "path"),
    [
        (Spoil(state=lambda f: setattr(f.inner, "amount", -1)), "state.inner.amount"),
        (Spoil(state=lambda f: f.inner.tags.append(3)), "state.inner.tags.0"),
        (Spoil(state=lambda f: f.sizes.update(a="big")), "state.sizes.a"),
        (Spoil(state=lambda f: setattr(f, "name", Opaque())), "state.name"),
        (Spoil(state=lambda f: setattr(f, "blob", b"\x00\xff")), "state.blob"),
        (Spoil(state=lambda f: setattr(f, "inner", {"amount": 1})), "state.inner"),
        (Spoil(state=lambda f: setattr(f, "extra", (1, 2))), "state.extra"),
        (Spoil(state=lambda f: setattr(f, "extra", {"k": [(1,)]})), "state.extra.k.0"),
        (Spoil(k="zz"), "node.k"),
        (Spoil(result="s"), "result.data"),
    ],
)
def test_checkpoint_invalid_names_the_full_path(
    url: str, run_id: str, spoil: Spoil, path: str
) -> None:
    """P4: whichever check refuses (pydantic's serializer, its validator, or the round
    trip: a tuple in an `Any` field would read back as a list), the error names
    the bad value by its full path from the snapshot; nothing is written."""
    bad, history = refused(url, run_id, spoil)
    assert bad.field == path and path in str(bad) and run_id in str(bad)
    kinds = [type(getattr(s, "node", s)).__name__ for s in history]
    assert kinds == (["Fill", "Check"] if path == "result.data" else ["Fill"])
    assert statuses(history)[-1] == "error"


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_values_json_cannot_carry_are_refused(url: str, run_id: str, value: float) -> None:
    """P4: pydantic writes inf and nan as null, which reads back as None: refused at
    write time (naming the field), so no run resumes with a state it never had."""
    bad, history = refused(url, run_id, Spoil(state=lambda f: setattr(f, "limit", value)))
    assert bad.field == "state.limit" and "None" in str(bad)
    assert [s.state.limit for s in history] == [None] and statuses(history) == ["error"]


def test_values_that_read_back_equal_are_stored(url: str, run_id: str) -> None:
    """P4's round-trip check refuses only what changes: bytes, a float limit, nested
    lists and dicts are stored, and read back as they were; a tuple where the field's
    type reads any sequence back as a list (`Sequence[str]`) is stored too."""

    def fill(form: Form) -> None:
        form.limit, form.blob = 2.5, b"ok"
        form.inner.tags.extend(("a", "b"))
        form.sizes.update(a=1)
        form.extra, form.names = {"k": [1, [2]]}, ("n",)

    async def go() -> Form:
        p: RemitStatePersistence[Form, int] = RemitStatePersistence(url, run_id, lease=LEASE)
        result = await FORMS.run(Fill(), state=Form(), deps=Spoil(state=fill), persistence=p)
        assert result.output == 5
        again: RemitStatePersistence[Form, int] = RemitStatePersistence(url, run_id)
        again.set_graph_types(FORMS)
        return (await again.load_all())[-1].state

    assert asyncio.run(go()) == Form(
        "x", b"ok", Inner(0, ["a", "b"]), 2.5, {"a": 1}, {"k": [1, [2]]}, ["n"]
    )


# -- the interface as pydantic-graph documents it ---------------------------------------------


def test_record_run_and_load_next_as_the_interface_documents(url: str, run_id: str) -> None:
    """Used directly, the interface answers as FullStatePersistence does: a second
    load_next finds nothing to load; record_run stores success and the duration as it
    exits; running the node again is refused."""

    async def script(p: Any) -> list[Any]:
        p.set_graph_types(GRAPH)
        seen: list[Any] = []
        await p.snapshot_node(fresh(), Start())
        first = await p.load_next()
        seen.append((first.status, await p.load_next()))
        async with p.record_run(first.id):
            pass
        (done,) = await p.load_all()
        seen.append((done.status, done.start_ts is not None, done.duration is not None))
        with pytest.raises(GraphNodeStatusError):
            async with p.record_run(first.id):
                pass
        return seen

    remit = persistence(url, run_id)
    assert asyncio.run(script(remit)) == asyncio.run(script(FullStatePersistence()))
    assert asyncio.run(script(persistence(url, f"{run_id}-b"))) == [
        ("pending", None),
        ("success", True, True),
    ]
    (stored,) = asyncio.run(persistence(url, run_id).load_all())  # seen by another instance
    assert stored.status == "success" and stored.duration is not None


def test_record_run_of_a_runs_end_is_refused_naming_it(url: str, run_id: str) -> None:
    """An end is not a node: `record_run` of its id is refused with an error that says
    so (a `GraphNodeStatusError`, as for a node already run), and nothing is stored."""

    async def script() -> tuple[list[Any], EndNotRunnable, list[Any]]:
        p = persistence(url, run_id)
        p.set_graph_types(GRAPH)
        await p.snapshot_node(fresh(), Start())
        first = await p.load_next()
        async with p.record_run(first.id):
            pass
        await p.snapshot_end(fresh(), End("done"))
        before = await p.load_all()
        with pytest.raises(EndNotRunnable) as refused:
            async with p.record_run(before[-1].id):
                raise AssertionError("the body ran")
        return before, refused.value, await persistence(url, run_id).load_all()

    before, error, after = asyncio.run(script())
    assert isinstance(before[-1], EndSnapshot)
    assert isinstance(error, GraphNodeStatusError)
    assert repr(before[-1].id) in str(error) and "the run's end, not a node" in str(error)
    assert [(s.id, getattr(s, "status", None)) for s in after] == [
        (s.id, getattr(s, "status", None)) for s in before
    ]
