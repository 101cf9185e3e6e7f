"""Outside probes of `RemitStatePersistence`, round 42: workers that poll one long run
(a loop of 30 nodes) and take it over from each other, some SIGKILLed after a node's
effect; many runs of one process killed at once and recovered by another; a graph of
pydantic-graph's builder API (steps, a parallel map, a join), persisted and run inside a
node; forks of a fork; a fork and its line edited and answered apart; and states and
results of less common types (a stateless graph, a `RootModel`, a bare `dict`, a
recursive model, a union told apart by a callable discriminator, a generic model, an
`End` of a discriminated union, a tuple, an optional model) written in one process and
read in another beside pydantic-graph's own persistences; on SQLite, PostgreSQL and
Redis, in real forked processes.

Found:

- P5 / liveness: a driver stepping a run with `run.next()` holds no claim between two
  nodes. When another process took its next node over meanwhile and left it unfinished
  (killed inside it, killed as the snapshot after it was being stored, or the node
  raised), the driver's next step raised `GraphNodeStatusError` ("Incorrect snapshot
  status 'running'"), where the README promises `ResumeConflict` for a driver whose next
  node another resumer took. `GraphNodeStatusError` is a `GraphRuntimeError`, which is
  also what `iter_from_persistence` raises on an ended run: workers polling a run (again
  on `ResumeConflict`, done on `GraphRuntimeError`) all stopped, and the run stayed
  stranded at a `running` node. It is now `ResumeConflict` naming the node and its
  status; `iter_from_persistence()` then continues the run from that node, its effect
  applied once. (A node this instance itself left `error` is still refused with
  `GraphNodeStatusError`, as pydantic-graph's own persistences refuse it.)

Held:

- Five workers polling a run (`iter_from_persistence`, again on `ResumeConflict`, until
  `GraphRuntimeError` says it ended), three of them SIGKILLed after the effect of a node:
  each node ran once (twice where its runner died), each effect applied once, one line
  of 30 nodes and an End, the state holding every node in order.
- Twelve runs of one process (one event loop) SIGKILLed at an effect: another process
  ends each one, each node's effect applied once per run.
- The builder API has no persistence: `run(persistence=)` is a `TypeError`, and a
  `remit_core.effect` called in one of its steps raises `RemitError` and applies nothing
  (no silent unrecorded effect). Run inside a persisted node and killed after the third
  of five effects of a parallel map, recovery applies each item's keyed effect once and
  ends with every receipt.
- A fork of a snapshot of a fork is one branch per token (the same from a main-line
  instance); each line lists its own history and has its own End; a node run on each
  line applies its effect once there.
- A fork of a pause and the pause itself, each edited and answered, end apart, each
  with its own edit and answer.
- Each state and result type read back in another process as
  `FullStatePersistence` and `FileStatePersistence` give it back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

import pydantic
import pytest
from pydantic_graph import (
    BaseNode,
    End,
    GraphBuilder,
    GraphRunContext,
    StepContext,
    reduce_list_append,
)
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph.persistence.file import FileStatePersistence
from pydantic_graph.persistence.in_mem import FullStatePersistence
from test_pydantic_graph_persistence import (
    LEASE,
    Answer,
    World,
    drive,
    in_child,
    persistence,
    statuses,
    to_pause,
)
from test_pydantic_graph_probes14 import raced

from remit_core import RemitError, ResumeConflict, arun_effect, failpoints
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def held(url: str, run_id: str, graph: Graph[Any, Any, Any]) -> RemitStatePersistence[Any, Any]:
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(graph)
    return p


# -- workers polling one long run, some killed ----------------------------------------------

#: Nodes of the loop, and those whose first runner is SIGKILLed after the node's effect.
TICKS = 30
KILLED_AT = (7, 15, 22)


@dataclass
class Ticks:
    seen: list[int] = field(default_factory=list)


@dataclass
class Tick(BaseNode[Ticks, World, str]):
    """One node of a loop: an effect, then the next node (a new `Tick`) or the End. The
    first process to run a `KILLED_AT` node dies after its effect (where the world's
    folder has a `kill` file); a node whose
    `raise-{i}` file exists raises once after its effect."""

    i: int

    async def run(self, ctx: GraphRunContext[Ticks, World]) -> Tick | End[str]:
        ctx.deps.enter(f"tick{self.i}")
        sink = ctx.deps.sink

        async def apply(key: str) -> str:
            return sink.apply(f"tick{self.i}", key)

        await arun_effect("tick", apply, reconcile=sink.reconcile)
        mark = ctx.deps.folder / f"killed-{self.i}"
        if self.i in KILLED_AT and (ctx.deps.folder / "kill").exists() and not mark.exists():
            mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        fail = ctx.deps.folder / f"raise-{self.i}"
        if fail.exists():
            fail.unlink()
            raise RuntimeError(f"tick {self.i} failed")
        await asyncio.sleep(0.002)
        ctx.state.seen.append(self.i)
        if self.i + 1 == TICKS:
            return End(f"ticked {len(ctx.state.seen)}")
        return Tick(self.i + 1)


LOOP = Graph(nodes=(Tick,), name="loop")


def test_workers_polling_a_long_run_run_each_node_once_also_when_killed(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P2/P5/L1: five processes poll one run of 30 nodes, each continuing it with
    `iter_from_persistence` and trying again on `ResumeConflict` until the run has ended;
    between two nodes a driver holds nothing, so the workers take the run over from each
    other. Three are SIGKILLed after a node's effect; after its lease another takes that
    node over. Each node runs once (twice where its runner died), each effect applies
    once, and the run has one line of 30 nodes and one End. (Before the fix above, a
    surviving worker whose next node a killed worker had taken could stop on
    `GraphNodeStatusError` and leave the run stranded at that node.)"""

    async def begin() -> None:
        p = held(store_url, run_id, LOOP)
        async with LOOP.iter(Tick(0), state=Ticks(), deps=world, persistence=p) as run:
            async for node in run:
                if isinstance(node, Tick) and node.i == 1:
                    break  # stored, not started: nothing is held

    asyncio.run(begin())
    (world.folder / "kill").touch()

    def worker() -> list[Any]:
        async def go() -> list[Any]:
            conflicts = 0
            while True:
                p = held(store_url, run_id, LOOP)
                try:
                    async with LOOP.iter_from_persistence(p, deps=world) as run:
                        async for _ in run:
                            pass
                except ResumeConflict:
                    conflicts += 1
                    await asyncio.sleep(0.005)
                except GraphRuntimeError:  # nothing to restore: the run has ended
                    return ["ended", conflicts]

        return asyncio.run(go())

    outcomes = raced([worker] * 5)
    line = asyncio.run(held(store_url, run_id, LOOP).load_all())
    seen = ([o.summary() for o in outcomes], statuses(line), world.entered())
    assert sorted(o.status for o in outcomes) == ["killed"] * 3 + ["ok"] * 2, seen
    assert all(o.value[0] == "ended" for o in outcomes if o.ok)
    assert statuses(line) == ["success"] * TICKS + ["end"], seen
    assert [s.node.i for s in line[:-1]] == list(range(TICKS))
    assert line[-1].state.seen == list(range(TICKS))
    assert line[-1].result.data == f"ticked {TICKS}"
    assert world.entered() == {f"tick{i}": 2 if i in KILLED_AT else 1 for i in range(TICKS)}
    assert world.sink.counts() == {f"tick{i}": 1 for i in range(TICKS)}


@pytest.mark.parametrize("left", ["running", "success", "error"])
def test_a_drivers_next_node_another_resumer_left_unfinished_is_a_resume_conflict(
    store_url: str, run_id: str, world: World, left: str
) -> None:
    """Found (P5/L1): a driver steps the run with `run.next()` and holds no claim between
    two nodes; meanwhile another process continues the run, takes the driver's next node
    and leaves it unfinished: SIGKILLed inside it (`running`), SIGKILLed as the snapshot
    after it was being stored (`success`), or the node raised (`error`). The driver's
    next step raised `GraphNodeStatusError`, a `GraphRuntimeError`, which a polling worker
    takes for a run with nothing left to restore (the ended run's answer), and so left
    the run stranded. It is `ResumeConflict`, as when the other resumer runs the node to
    its end: nothing runs, and `iter_from_persistence()` continues the run from that node,
    its effect applied once."""
    if left == "error":
        (world.folder / "raise-1").touch()

    def other() -> None:
        if left == "success":
            failpoints.arm("checkpoint.in_commit", "kill@1")

        async def go() -> None:
            p = held(store_url, run_id, LOOP)
            async with LOOP.iter_from_persistence(p, deps=world) as run:
                async for node in run:
                    if left == "running" and isinstance(node, Tick) and node.i == 1:
                        world.kill_at = "tick1"

        asyncio.run(go())

    async def go() -> tuple[Any, str]:
        p = held(store_url, run_id, LOOP)
        async with LOOP.iter(Tick(0), state=Ticks(), deps=world, persistence=p) as run:
            second = await run.next(run.next_node)
            assert isinstance(second, Tick) and second.i == 1
            taken = in_child(other)
            assert taken.status == ("error" if left == "error" else "killed"), taken.summary()
            time.sleep(LEASE + 0.2)
            with pytest.raises(ResumeConflict, match=f"left it {left!r}") as refused:
                await run.next(second)
        assert refused.value.checkpoint_id == second.get_snapshot_id()
        p = held(store_url, run_id, LOOP)
        async with LOOP.iter_from_persistence(p, deps=world) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output, str(refused.value)

    output, _ = asyncio.run(go())
    assert output == f"ticked {TICKS}"
    line = asyncio.run(held(store_url, run_id, LOOP).load_all())
    assert statuses(line) == ["success"] * TICKS + ["end"]
    assert line[-1].state.seen == list(range(TICKS))
    assert world.entered()["tick1"] == 2
    assert world.sink.counts() == {f"tick{i}": 1 for i in range(TICKS)}


@dataclass
class Wobble(BaseNode[Ticks, Path, int]):
    """Raises once where its folder (the deps) has a `raise` file."""

    async def run(self, ctx: GraphRunContext[Ticks, Path]) -> End[int]:
        ctx.state.seen.append(len(ctx.state.seen))
        fail = ctx.deps / "raise"
        if fail.exists():
            fail.unlink()
            raise RuntimeError("wobbled")
        return End(len(ctx.state.seen))


@dataclass
class Steady(BaseNode[Ticks, Path, int]):
    async def run(self, ctx: GraphRunContext[Ticks, Path]) -> Wobble:
        return Wobble()


WOBBLY = Graph(nodes=(Steady, Wobble), name="wobbly")


def test_a_node_the_driver_itself_left_error_is_refused_as_pydantic_graphs_own_refuse_it(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """The edge of the fix above: a driver whose own node raised, retrying `run.next()`
    with it in the same `GraphRun`, gets `GraphNodeStatusError` as with
    `FullStatePersistence` (the node is `error`; nobody else took it), not
    `ResumeConflict`; `iter_from_persistence()` then runs it again and ends the run."""

    async def retried(p: Any) -> tuple[str, str]:
        (tmp_path / "raise").touch()
        async with WOBBLY.iter(Steady(), state=Ticks(), deps=tmp_path, persistence=p) as run:
            wobble = await run.next(run.next_node)
            with pytest.raises(RuntimeError, match="wobbled"):
                await run.next(wobble)
            with pytest.raises(Exception) as again:
                await run.next(wobble)
        line = await p.load_all()
        return type(again.value).__name__, line[-1].status

    theirs = asyncio.run(retried(FullStatePersistence()))
    assert theirs == ("GraphNodeStatusError", "error")
    assert asyncio.run(retried(held(store_url, run_id, WOBBLY))) == theirs

    async def go_on() -> Any:
        p = held(store_url, run_id, WOBBLY)
        async with WOBBLY.iter_from_persistence(p, deps=tmp_path) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    assert asyncio.run(go_on()) == 1


# -- many runs of one process killed at once -------------------------------------------------


@dataclass
class Steps:
    tag: str
    done: list[int] = field(default_factory=list)


@dataclass
class Stage(BaseNode[Steps, World, str]):
    """A node of one of many runs: an effect named after its run and the node."""

    i: int

    async def run(self, ctx: GraphRunContext[Steps, World]) -> Stage | End[str]:
        sink, name = ctx.deps.sink, f"{ctx.state.tag}.{self.i}"

        async def apply(key: str) -> str:
            return sink.apply(name, key)

        await arun_effect("stage", apply, reconcile=sink.reconcile)
        await asyncio.sleep(0.001 * (self.i % 3))
        ctx.state.done.append(self.i)
        return End(ctx.state.tag) if self.i == 4 else Stage(self.i + 1)


STAGES = Graph(nodes=(Stage,), name="stages")


def test_many_runs_of_one_process_killed_at_once_are_each_ended_by_another(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P2/P6: one process runs twelve runs at once on one event loop, each with its own
    instance, and is SIGKILLed as the 25th effect is applied. Another process ends each
    run (continuing it, or starting one whose first node was never stored): every run
    ends, with each node's effect applied once for that run, and its state in order."""
    tags = [f"r{n}" for n in range(12)]

    def crash() -> None:
        failpoints.arm("effect.after_apply", "kill@25")

        async def go() -> None:
            await asyncio.gather(
                *(
                    STAGES.run(
                        Stage(0),
                        state=Steps(tag),
                        deps=world,
                        persistence=held(store_url, f"{run_id}-{tag}", STAGES),
                    )
                    for tag in tags
                )
            )

        asyncio.run(go())

    assert in_child(crash).status == "killed"
    assert 0 < sum(world.sink.counts().values()) < len(tags) * 5
    time.sleep(LEASE + 0.2)

    def recover() -> list[str]:
        async def one(tag: str) -> str:
            p = held(store_url, f"{run_id}-{tag}", STAGES)
            if not await p.load_all():
                result = await STAGES.run(Stage(0), state=Steps(tag), deps=world, persistence=p)
                return result.output
            async with STAGES.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return run.result.output

        async def go() -> list[str]:
            return list(await asyncio.gather(*(one(tag) for tag in tags)))

        return asyncio.run(go())

    outcome = in_child(recover)
    assert outcome.ok and outcome.value == tags, outcome.summary()
    for tag in tags:
        line = asyncio.run(held(store_url, f"{run_id}-{tag}", STAGES).load_all())
        assert statuses(line) == ["success"] * 5 + ["end"], tag
        assert line[-1].state == Steps(tag, [0, 1, 2, 3, 4])
    assert world.sink.counts() == {f"{tag}.{i}": 1 for tag in tags for i in range(5)}


# -- pydantic-graph's builder API ------------------------------------------------------------

ITEMS = ["a", "b", "c", "d", "e"]


def charges() -> Any:
    """A builder graph: a parallel map over the items, a keyed effect per item (steps of
    a map run concurrently, so an effect's place among its step's calls is no key), and
    a join of the receipts."""
    b = GraphBuilder(deps_type=World, input_type=list[str], output_type=list[str])

    @b.step
    async def charge_one(ctx: StepContext[None, World, str]) -> str:
        item, sink = ctx.inputs, ctx.deps.sink
        await asyncio.sleep(0.002 * (ITEMS.index(item) % 3))  # finish out of order

        async def apply(key: str) -> str:
            return sink.apply(f"charge-{item}", key)

        receipt: str = await arun_effect(
            "charge", apply, key=f"item:{item}", reconcile=sink.reconcile
        )
        return receipt

    collect = b.join(reduce_list_append, initial_factory=list[str])
    b.add(
        b.edge_from(b.start_node).map().to(charge_one),
        b.edge_from(charge_one).to(collect),
        b.edge_from(collect).to(b.end_node),
    )
    return b.build()


CHARGES = charges()


@dataclass
class Batch:
    items: list[str] = field(default_factory=list)
    receipts: list[str] = field(default_factory=list)


@dataclass
class ChargeAll(BaseNode[Batch, World, int]):
    """Runs the builder graph: the node is the unit the persistence sees."""

    async def run(self, ctx: GraphRunContext[Batch, World]) -> End[int]:
        ctx.deps.enter("charge_all")
        receipts = await CHARGES.run(deps=ctx.deps, inputs=list(ctx.state.items))
        ctx.state.receipts = sorted(receipts)
        return End(len(receipts))


BATCH = Graph(nodes=(ChargeAll,), name="batch")


def test_a_builder_graph_has_no_persistence_and_its_effects_are_refused_not_lost(
    tmp_path: Path, world: World
) -> None:
    """Errors/P2: a graph of the builder API cannot be given a persistence (`TypeError`
    from its `run`, and from `set_graph_types`), and an effect declared with Remit in one
    of its steps, run without a persisted node around it, raises `RemitError` saying it
    ran outside a Remit step: nothing is applied, rather than an effect that no ledger
    records."""
    url = f"sqlite:///{tmp_path}/remit.db"
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, "builder")
    with pytest.raises(TypeError, match="persistence"):
        asyncio.run(CHARGES.run(deps=world, inputs=ITEMS, persistence=p))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="builder"):
        p.set_graph_types(CHARGES)
    with pytest.raises(RemitError, match="outside a Remit step"):
        asyncio.run(CHARGES.run(deps=world, inputs=ITEMS))
    assert world.sink.counts() == {}


def test_a_builder_graph_run_in_a_persisted_node_and_killed_applies_each_keyed_effect_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P2: a node runs a builder graph whose parallel map applies an effect per item,
    each with a key of its own; the process is SIGKILLed after the third effect. After
    the lease, another process continues the run: the node runs again, the map's items
    already applied get their recorded (or reconciled) receipts, the others are applied,
    each once, and the End holds every item's receipt."""

    def crash() -> None:
        failpoints.arm("effect.after_apply", "kill@3")
        p = held(store_url, run_id, BATCH)
        asyncio.run(BATCH.run(ChargeAll(), state=Batch(list(ITEMS)), deps=world, persistence=p))

    assert in_child(crash).status == "killed"
    assert sum(world.sink.counts().values()) == 3
    time.sleep(LEASE + 0.2)

    def recover() -> Any:
        async def go() -> Any:
            p = held(store_url, run_id, BATCH)
            async with BATCH.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return run.result.output

        return asyncio.run(go())

    outcome = in_child(recover)
    assert outcome.ok and outcome.value == len(ITEMS), outcome.summary()
    line = asyncio.run(held(store_url, run_id, BATCH).load_all())
    assert statuses(line) == ["success", "end"]
    assert world.sink.counts() == {f"charge-{item}": 1 for item in ITEMS}
    assert [r.split(":")[0] for r in line[-1].state.receipts] == [f"charge-{i}" for i in ITEMS]
    assert world.entered() == {"charge_all": 2}


# -- forks of a fork; a fork and its line edited apart ---------------------------------------


def approvals(line: list[Any]) -> list[tuple[str, str, str | None]]:
    return [
        (
            type(s.node).__name__ if isinstance(s, NodeSnapshot) else "End",
            s.status if isinstance(s, NodeSnapshot) else "end",
            s.state["approved_by"],
        )
        for s in line
    ]


def test_a_fork_of_a_forks_snapshot_is_one_branch_with_its_own_line(
    store_url: str, run_id: str, world: World
) -> None:
    """P3/P2: the pause is forked (token T1) and answered there, the main line answered
    apart; then a `Pay` of T1's line is forked (T2). T2's line is T1's up to that `Pay`,
    then its own; T1's and main's are untouched; the same token from a main-line instance
    gives T2 again. `Pay` applies its charge once on each line that ran it."""

    async def go() -> None:
        main = await to_pause(store_url, run_id, world)
        pause = await main.paused()
        assert pause is not None
        first = await main.fork(pause.id, "T1")
        await first.resume(Answer("one"))
        assert await drive(first, world) == "paid 100"
        await main.resume(Answer("main"))
        assert await drive(main, world) == "paid 100"
        one = await first.load_all()
        pay = next(s for s in one if type(s.node).__name__ == "Pay")
        second = await first.fork(pay.id, "T2")
        assert second.branch not in (first.branch, main.branch)
        assert await drive(second, world) == "paid 100"

        lines = {
            token: await persistence(store_url, run_id, fork_token=token).load_all()
            for token in (None, "T1", "T2")
        }
        assert approvals(lines["T1"]) == approvals(one)
        assert [s.id for s in lines["T1"]] == [s.id for s in one]
        base = [s.id for s in one].index(pay.id)
        assert [s.id for s in lines["T2"][:base]] == [s.id for s in one[:base]]
        assert lines["T2"][base].id == pay.id and lines["T2"][base].status == "success"
        assert not {s.id for s in lines["T2"][base + 1 :]} & {s.id for s in one}
        assert approvals(lines["T2"])[-1] == ("End", "end", "one")
        assert approvals(lines[None])[-1] == ("End", "end", "main")
        assert all(isinstance(line[-1], EndSnapshot) for line in lines.values())
        again = await persistence(store_url, run_id).fork(pay.id, "T2")
        assert again.branch == second.branch
        assert [s.id for s in await again.load_all()] == [s.id for s in lines["T2"]]

    asyncio.run(go())
    assert world.sink.counts() == {"charge": 3}
    assert world.entered() == {
        "start": 1,
        "answer": 2,
        "pay": 3,
        "pay.after_effect": 3,
        "done": 3,
    }


def test_a_fork_of_a_pause_and_the_pause_are_edited_and_answered_apart(
    store_url: str, run_id: str, world: World
) -> None:
    """P3/P5/L3: the pause is forked; the fork's pause and the main line's are each edited
    (`update_state` with the `pause_id` their `paused()` gave) and answered: each line
    ends with its own edit and its own answer, neither seeing the other's."""

    async def go() -> None:
        main = await to_pause(store_url, run_id, world)
        pause = await main.paused()
        assert pause is not None
        forked = await main.fork(pause.id, "what-if")
        fork_pause = await forked.paused()
        assert fork_pause is not None
        await forked.update_state({**fork_pause.state, "amount": 5}, pause_id=fork_pause.id)
        await main.update_state({**pause.state, "amount": 7}, pause_id=pause.id)
        asked = (await main.paused(), await forked.paused())
        assert [a.state["amount"] for a in asked if a is not None] == [7, 5]
        await forked.resume(Answer("fork"), pause_id=fork_pause.id)
        await main.resume(Answer("main"), pause_id=pause.id)
        assert await drive(forked, world) == "paid 5"
        assert await drive(main, world) == "paid 7"
        ends = {
            token: (await persistence(store_url, run_id, fork_token=token).load_all())[-1]
            for token in (None, "what-if")
        }
        assert {t: (e.state["amount"], e.state["approved_by"]) for t, e in ends.items()} == {
            None: (7, "main"),
            "what-if": (5, "fork"),
        }

    asyncio.run(go())
    assert world.sink.counts() == {"charge": 2}


# -- states and results of less common types, read in another process -----------------------


@dataclass
class Stateless(BaseNode[None, None, int]):
    async def run(self, ctx: GraphRunContext[None]) -> End[int]:
        return End(3)


class Numbers(pydantic.RootModel[list[int]]):
    pass


@dataclass
class AddNumber(BaseNode[Numbers, None, int]):
    async def run(self, ctx: GraphRunContext[Numbers]) -> SumNumbers:
        ctx.state.root.append(4)
        return SumNumbers()


@dataclass
class SumNumbers(BaseNode[Numbers, None, int]):
    async def run(self, ctx: GraphRunContext[Numbers]) -> End[int]:
        return End(sum(ctx.state.root))


@dataclass
class FillDict(BaseNode[dict, None, int]):  # type: ignore[type-arg]
    async def run(self, ctx: GraphRunContext[dict]) -> CountDict:  # type: ignore[type-arg]
        ctx.state["x"] = {"nested": [1, "two", None]}
        return CountDict()


@dataclass
class CountDict(BaseNode[dict, None, int]):  # type: ignore[type-arg]
    async def run(self, ctx: GraphRunContext[dict]) -> End[int]:  # type: ignore[type-arg]
        return End(len(ctx.state))


class Tree(pydantic.BaseModel):
    name: str
    children: list[Tree] = []


@dataclass
class Grow(BaseNode[Tree, None, int]):
    async def run(self, ctx: GraphRunContext[Tree]) -> End[int]:
        ctx.state.children.append(Tree(name="kid", children=[Tree(name="grandkid")]))
        return End(len(ctx.state.children))


class Cat(pydantic.BaseModel):
    meow: int


class Dog(pydantic.BaseModel):
    bark: int = 0


def pet_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "cat" if "meow" in value else "dog"
    return "cat" if isinstance(value, Cat) else "dog"


class Pets(pydantic.BaseModel):
    pets: list[
        Annotated[
            Annotated[Cat, pydantic.Tag("cat")] | Annotated[Dog, pydantic.Tag("dog")],
            pydantic.Discriminator(pet_kind),
        ]
    ] = []


@dataclass
class Adopt(BaseNode[Pets, None, int]):
    async def run(self, ctx: GraphRunContext[Pets]) -> End[int]:
        ctx.state.pets += [Dog(bark=2), Cat(meow=1), Dog()]
        return End(len(ctx.state.pets))


T = TypeVar("T")


class Box(pydantic.BaseModel, Generic[T]):
    items: list[T] = []


@dataclass
class Pack(BaseNode[Box[int], None, int]):
    async def run(self, ctx: GraphRunContext[Box[int]]) -> End[int]:
        ctx.state.items.append(2)
        return End(sum(ctx.state.items))


class Approved(pydantic.BaseModel):
    kind: Literal["approved"] = "approved"
    amount: int


class Refused(pydantic.BaseModel):
    kind: Literal["refused"] = "refused"
    why: str


Verdict = Annotated[Approved | Refused, pydantic.Field(discriminator="kind")]


@dataclass
class Decide(BaseNode[Box[int], None, Verdict]):
    async def run(self, ctx: GraphRunContext[Box[int]]) -> End[Verdict]:
        return End(Refused(why="over budget"))


@dataclass
class Pair(BaseNode[Box[int], None, tuple[int, str]]):
    async def run(self, ctx: GraphRunContext[Box[int]]) -> End[tuple[int, str]]:
        return End((1, "one"))


class Frozen(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True)
    v: int


@dataclass
class Maybe(BaseNode[Box[int], None, Frozen | None]):
    async def run(self, ctx: GraphRunContext[Box[int]]) -> End[Frozen | None]:
        return End(None)


#: Each case: a graph, its start node and its first state.
CASES: dict[str, tuple[Graph[Any, Any, Any], Callable[[], Any], Callable[[], Any]]] = {
    "stateless": (Graph(nodes=(Stateless,)), Stateless, lambda: None),
    "root-model": (Graph(nodes=(AddNumber, SumNumbers)), AddNumber, lambda: Numbers([1])),
    "bare-dict": (Graph(nodes=(FillDict, CountDict)), FillDict, lambda: {"a": 1}),
    "recursive": (Graph(nodes=(Grow,)), Grow, lambda: Tree(name="root")),
    "callable-union": (Graph(nodes=(Adopt,)), Adopt, Pets),
    "generic": (Graph(nodes=(Pack,)), Pack, lambda: Box[int](items=[1])),
    "end-union": (Graph(nodes=(Decide,)), Decide, Box[int]),
    "end-tuple": (Graph(nodes=(Pair,)), Pair, Box[int]),
    "end-optional": (Graph(nodes=(Maybe,)), Maybe, Box[int]),
}


def history(line: list[Any]) -> str:
    """A line as its nodes, states and result, by `repr` (types included)."""
    return repr(
        [
            (type(s.node).__name__, s.status, s.state)
            if isinstance(s, NodeSnapshot)
            else ("End", s.state, s.result.data)
            for s in line
        ]
    )


def test_states_and_results_of_less_common_types_read_back_as_pydantic_graphs_own(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """P4: each graph runs to its End with Remit in one process and is read in another;
    the output and `load_all()` (nodes, statuses, states and result, types included) are
    what `FullStatePersistence` and `FileStatePersistence` give for the same run."""

    async def theirs(name: str) -> tuple[str, str, str]:
        graph, start, state = CASES[name]
        full: FullStatePersistence[Any, Any] = FullStatePersistence()
        out = await graph.run(start(), state=state(), persistence=full)
        path = tmp_path / f"{name}.json"
        await graph.run(start(), state=state(), persistence=FileStatePersistence(path))
        reader: FileStatePersistence[Any, Any] = FileStatePersistence(path)
        reader.set_graph_types(graph)
        return repr(out.output), history(await full.load_all()), history(await reader.load_all())

    def write() -> list[str]:
        async def go() -> list[str]:
            outs = []
            for name, (graph, start, state) in CASES.items():
                p = held(store_url, f"{run_id}-{name}", graph)
                outs.append(repr((await graph.run(start(), state=state(), persistence=p)).output))
            return outs

        return asyncio.run(go())

    def read() -> list[str]:
        async def go() -> list[str]:
            return [
                history(await held(store_url, f"{run_id}-{name}", graph).load_all())
                for name, (graph, _, _) in CASES.items()
            ]

        return asyncio.run(go())

    written, read_back = in_child(write), in_child(read)
    assert written.ok, written.summary()
    assert read_back.ok, read_back.summary()
    for name, out, line in zip(CASES, written.value, read_back.value, strict=True):
        their_out, full, file = asyncio.run(theirs(name))
        assert full == file, name
        assert (out, line) == (their_out, full), name
