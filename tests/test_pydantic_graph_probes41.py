"""Outside probes of `RemitStatePersistence`, round 41: runs driven with `Graph.iter` /
`iter_from_persistence` (`persistence=`, `deps=`) and SIGKILLed between two snapshots (on
the main line and on a fork) or at every store write from the answer to the End; a node
that leaves its task with `SystemExit`, `KeyboardInterrupt` or a real SIGINT after its
effect; a node that blocks its event loop past its lease; a node that runs another graph
on a run of its own and is killed inside it; and one instance handed to a second graph;
on SQLite, PostgreSQL and Redis, in real forked processes.

No fault found; what held:

- A driver killed as `async for` hands it the next node holds nothing: another process
  continues at once (30 s lease), from that node, nothing before it run again; on a fork,
  the token's holder continues the fork's line and the main line is untouched.
- SIGKILL at each hit of `interrupt.in_consume` / `after_consume`, `claim.after_acquire`,
  `writes.in_txn`, `effect.after_apply`, `effect.in_outcome`, `checkpoint.in_commit` and
  `checkpoint.after_commit` (24 points): the answer is taken once (asked for again only
  if the crash was inside its consume), the charge applied once, the history that of an
  uninterrupted run.
- `SystemExit`, `KeyboardInterrupt` and SIGINT under `asyncio.run` give the node back
  (`created`, claim released), where `FileStatePersistence` leaves it `running`; another
  process reruns it at once, the charge not applied again.
- A node blocking its loop keeps its claim (renewed from a thread): a takeover gets
  `ResumeConflict` and runs nothing.
- A graph run inside a node, on a run of its own: a kill inside it or after it is
  recovered with each effect once, each run's effects keyed apart.
- One instance given a second graph (other nodes, other state type) refuses it with a
  `ValueError` and stores nothing; a rebuilt `Graph` of the same node classes is accepted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot
from pydantic_graph.persistence.file import FileStatePersistence
from test_pydantic_graph_persistence import (
    GRAPH,
    LEASE,
    Answer,
    Ask,
    Done,
    Order,
    Pay,
    Start,
    World,
    charge,
    drive,
    fresh,
    in_child,
    statuses,
    to_pause,
)

from remit_core import ResumeConflict, VersionMismatch, arun_effect, failpoints
from remit_core.conformance.processes import fork
from remit_pydantic_graph import RemitStatePersistence

#: Long enough that a claim left behind would refuse the next resumer: "at once" is
#: checked by that resumer not getting `ResumeConflict`, never by a clock.
HELD = 30.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def held(
    url: str, run_id: str, graph: Graph[Any, Any, Any] = GRAPH, lease: float = HELD
) -> RemitStatePersistence[Any, Any]:
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, run_id, lease=lease)
    p.set_graph_types(graph)
    return p


async def answered(url: str, run_id: str, world: World) -> None:
    """The run driven to its pause and answered, ready to go on from `Answer`."""
    p = held(url, run_id)
    assert await drive(p, world, Start()) == "paused"
    await p.resume(Answer("ann"))


# -- SIGKILL between two snapshots of a Graph.iter run ----------------------------------------


def test_a_run_killed_between_two_snapshots_goes_on_at_once_from_the_next_node(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/L1: a process drives the run with `Graph.iter(..., persistence=, deps=)` and is
    SIGKILLed as `async for` hands it `Pay`: `Answer` ran and `Pay` is stored, not started.
    The dead driver holds nothing between two nodes, so another process continues at once
    (a 30 s lease: a claim left behind would be `ResumeConflict`), with its own deps: it
    runs `Pay` and `Done`, once each, `Start` and `Answer` not again, the charge once."""
    asyncio.run(answered(store_url, run_id, world))

    def driver() -> None:
        async def go() -> None:
            async with GRAPH.iter_from_persistence(held(store_url, run_id), deps=world) as run:
                async for node in run:
                    if isinstance(node, Pay):
                        os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(go())

    assert in_child(driver).status == "killed"
    left = asyncio.run(held(store_url, run_id).load_all())
    assert [type(s.node).__name__ for s in left] == ["Start", "Ask", "Answer", "Pay"]
    assert left[-1].status == "created"

    def recover() -> Any:
        return asyncio.run(drive(held(store_url, run_id), world))

    outcome = in_child(recover)
    assert outcome.ok and outcome.value == "paid 100", outcome.summary()
    line = asyncio.run(held(store_url, run_id).load_all())
    assert statuses(line) == ["success", "created", "success", "success", "success", "end"]
    assert line[3].id == left[-1].id  # the stored Pay, not a new one
    assert line[-1].state["log"] == ["start", "answer", "pay", "done"]
    assert line[-1].state["approved_by"] == "ann"
    assert world.entered() == {
        "start": 1,
        "answer": 1,
        "pay": 1,
        "pay.after_effect": 1,
        "done": 1,
    }
    assert world.sink.counts() == {"charge": 1}


#: Each core failpoint hit from the answer to the run's end, and how often it is hit there
#: (the same on every engine): a SIGKILL at each hit of each.
KILLS = [
    pytest.param(point, nth, id=f"{point}@{nth}")
    for point, hits in (
        ("interrupt.in_consume", 1),
        ("interrupt.after_consume", 1),
        ("claim.after_acquire", 5),
        ("writes.in_txn", 7),
        ("effect.after_apply", 1),
        ("effect.in_outcome", 1),
        ("checkpoint.in_commit", 4),
        ("checkpoint.after_commit", 4),
    )
    for nth in range(1, hits + 1)
]


@pytest.mark.parametrize(("point", "nth"), KILLS)
def test_a_run_killed_at_any_store_write_ends_as_an_uninterrupted_one(
    store_url: str, run_id: str, world: World, point: str, nth: int
) -> None:
    """P1/P2/P5/P6: a process answers the pause and drives the run with `Graph.iter`'s
    `iter_from_persistence(..., deps=)`, and is SIGKILLed at the `nth` hit of a store
    write's failpoint (inside a transaction, or just after it). After the lease, another
    process answers again only if the pause is still open, and continues (or reads the
    End, if the run ended): the run ends with the first answer, the charge applied once,
    `Start` not run again, no node run more than twice, and the history of an
    uninterrupted run."""
    asyncio.run(to_pause(store_url, run_id, world))

    def crash() -> None:
        failpoints.arm(point, f"kill@{nth}")

        async def go() -> None:
            p = held(store_url, run_id, lease=LEASE)
            await p.resume(Answer("ann"))
            await drive(p, world)

        asyncio.run(go())

    assert in_child(crash).status == "killed"
    time.sleep(LEASE + 0.2)

    def recover() -> Any:
        async def go() -> Any:
            p = held(store_url, run_id)
            last = (await p.load_all())[-1]
            if isinstance(last, EndSnapshot):  # it ended: pydantic-graph restores nothing
                out = last.result.data
                answered_again = False
            else:
                pause = await p.paused()
                answered_again = pause is not None and isinstance(pause.node, Ask)
                if answered_again:
                    await p.resume(Answer("ann"))
                out = await drive(p, world)
            with pytest.raises(ResumeConflict):
                await held(store_url, run_id).resume(Answer("bob"))
            return [out, answered_again]

        return asyncio.run(go())

    outcome = in_child(recover)
    assert outcome.ok, outcome.summary()
    out, answered_again = outcome.value
    assert out == "paid 100"
    assert answered_again == (point == "interrupt.in_consume")
    line = asyncio.run(held(store_url, run_id).load_all())
    assert statuses(line) == ["success", "created", "success", "success", "success", "end"]
    assert [type(s.node).__name__ for s in line] == ["Start", "Ask", "Answer", "Pay", "Done", "End"]
    assert line[-1].state == {
        "amount": 100,
        "approved_by": "ann",
        "log": ["start", "answer", "pay", "done"],
    }
    assert world.sink.counts() == {"charge": 1}
    entered = world.entered()
    assert entered["start"] == 1
    assert all(1 <= entered[n] <= 2 for n in ("answer", "pay", "done")), entered


def test_a_fork_killed_between_two_snapshots_goes_on_at_once_on_its_branch(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P3/L1: the run ended; `Pay` is forked with a token and the fork's driver is
    SIGKILLed as `async for` hands it the fork's `Done`. Another process presenting the
    token continues at once (a 30 s lease) on the same branch: `Done` runs once there, the
    fork's `Pay` not again, its charge once for the fork (a fork's own work), and the main
    line is as it ended."""
    asyncio.run(answered(store_url, run_id, world))
    assert asyncio.run(drive(held(store_url, run_id), world)) == "paid 100"
    main = asyncio.run(held(store_url, run_id).load_all())
    pay = main[3]
    assert isinstance(pay.node, Pay)

    def forker() -> None:
        async def go() -> None:
            forked = await held(store_url, run_id).fork(pay.id, "again")
            async with GRAPH.iter_from_persistence(forked, deps=world) as run:
                async for node in run:
                    if isinstance(node, Done):
                        os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(go())

    assert in_child(forker).status == "killed"

    def recover() -> Any:
        async def go() -> Any:
            p: RemitStatePersistence[Any, Any] = RemitStatePersistence(
                store_url, run_id, lease=HELD, fork_token="again"
            )
            p.set_graph_types(GRAPH)
            return await drive(p, world)

        return asyncio.run(go())

    outcome = in_child(recover)
    assert outcome.ok and outcome.value == "paid 100", outcome.summary()

    async def fork_line() -> list[Any]:
        p: RemitStatePersistence[Any, Any] = RemitStatePersistence(
            store_url, run_id, lease=HELD, fork_token="again"
        )
        p.set_graph_types(GRAPH)
        return await p.load_all()

    line = asyncio.run(fork_line())
    assert [type(s.node).__name__ for s in line] == ["Start", "Ask", "Answer", "Pay", "Done", "End"]
    assert line[3].id == pay.id and statuses(line)[3:] == ["success", "success", "end"]
    assert asyncio.run(held(store_url, run_id).load_all()) == main
    assert world.sink.counts() == {"charge": 2}  # once on the main line, once on the fork
    assert world.entered()["pay"] == 2 and world.entered()["done"] == 2


# -- a node that leaves with SystemExit / KeyboardInterrupt after its effect ------------------


@dataclass
class Quit(BaseNode[Order, World, str]):
    """Charges, then leaves its task with the exception the world names (once)."""

    async def run(self, ctx: GraphRunContext[Order, World]) -> Done:
        ctx.deps.enter("quit")
        await charge(ctx)
        ctx.state["log"].append("quit")
        leave = ctx.deps.folder / "leave"
        if leave.exists():
            kind = leave.read_text()
            leave.unlink()
            raise SystemExit(3) if kind == "exit" else KeyboardInterrupt()
        return Done()


QUITTING = Graph(nodes=(Quit, Done), name="quitting")


@pytest.mark.parametrize("kind", ["exit", "interrupt"])
def test_a_node_that_leaves_with_a_base_exception_is_given_back(
    store_url: str, run_id: str, world: World, kind: str
) -> None:
    """L1/P2: `Quit` charges, then raises `SystemExit` (a CLI's `sys.exit`) or
    `KeyboardInterrupt` (Ctrl-C) out of `graph.run`. The node has no result: it is given
    back (`created`, claim released; pydantic-graph's `FileStatePersistence` leaves it
    `running`, stranded), and another process continues at once, running it again under
    the same snapshot id with the state stored with it; the charge is applied once."""
    (world.folder / "leave").write_text(kind)

    def first() -> Any:
        try:
            asyncio.run(
                QUITTING.run(
                    Quit(), state=fresh(), deps=world, persistence=held(store_url, run_id, QUITTING)
                )
            )
        except BaseException as exc:  # noqa: BLE001 - what left the run is the outcome
            return type(exc).__name__
        return "ended"

    outcome = in_child(first)
    assert outcome.ok, outcome.summary()
    assert outcome.value == {"exit": "SystemExit", "interrupt": "KeyboardInterrupt"}[kind]
    (left,) = asyncio.run(held(store_url, run_id, QUITTING).load_all())
    assert left.status == "created" and left.state == fresh()

    def recover() -> Any:
        async def go() -> Any:
            p = held(store_url, run_id, QUITTING)
            async with QUITTING.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return run.result.output

        return asyncio.run(go())

    outcome = in_child(recover)
    assert outcome.ok and outcome.value == "paid 0", outcome.summary()
    line = asyncio.run(held(store_url, run_id, QUITTING).load_all())
    assert statuses(line) == ["success", "success", "end"]
    assert line[0].id == left.id
    assert line[-1].state["log"] == ["quit", "done"]
    assert world.entered() == {"quit": 2, "done": 1}
    assert world.sink.counts() == {"charge": 1}


@dataclass
class Hang(BaseNode[Order, World, str]):
    """Charges, then (once) sends its own process SIGINT, as Ctrl-C does, and waits."""

    async def run(self, ctx: GraphRunContext[Order, World]) -> Done:
        ctx.deps.enter("hang")
        await charge(ctx)
        ctx.state["log"].append("hang")
        interrupt = ctx.deps.folder / "interrupt"
        if interrupt.exists():
            interrupt.unlink()
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(HELD)
        return Done()


HANGING = Graph(nodes=(Hang, Done), name="hanging")


def test_a_node_interrupted_by_sigint_is_given_back_to_any_process(
    store_url: str, run_id: str, world: World
) -> None:
    """L1/P2: a process running the graph under `asyncio.run` gets SIGINT (Ctrl-C, a
    supervisor stopping it) in `Hang`, after its charge: `asyncio.run` cancels the run
    and raises `KeyboardInterrupt`. The node is given back (`created`, claim released, the
    state it was stored with), and another process continues at once (a 30 s lease),
    running it again: the charge is applied once."""
    (world.folder / "interrupt").touch()

    def first() -> Any:
        try:
            asyncio.run(
                HANGING.run(
                    Hang(), state=fresh(), deps=world, persistence=held(store_url, run_id, HANGING)
                )
            )
        except KeyboardInterrupt:
            return "interrupted"
        return "ended"

    outcome = in_child(first)
    assert outcome.ok and outcome.value == "interrupted", outcome.summary()
    (left,) = asyncio.run(held(store_url, run_id, HANGING).load_all())
    assert left.status == "created" and left.state == fresh()

    def recover() -> Any:
        async def go() -> Any:
            p = held(store_url, run_id, HANGING)
            async with HANGING.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return run.result.output

        return asyncio.run(go())

    outcome = in_child(recover)
    assert outcome.ok and outcome.value == "paid 0", outcome.summary()
    line = asyncio.run(held(store_url, run_id, HANGING).load_all())
    assert statuses(line) == ["success", "success", "end"] and line[0].id == left.id
    assert line[-1].state["log"] == ["hang", "done"]
    assert world.entered() == {"hang": 2, "done": 1}
    assert world.sink.counts() == {"charge": 1}


@dataclass
class Block(BaseNode[Order, World, str]):
    """Charges, then blocks its event loop (a synchronous call in an async node) until the
    world's `release` file appears."""

    async def run(self, ctx: GraphRunContext[Order, World]) -> Done:
        ctx.deps.enter("block")
        await charge(ctx)
        (ctx.deps.folder / "inside").touch()
        while not (ctx.deps.folder / "release").exists():
            time.sleep(0.05)  # noqa: ASYNC251 - the blocked loop is the point
        ctx.state["log"].append("block")
        return Done()


BLOCKING = Graph(nodes=(Block, Done), name="blocking")


def test_a_node_that_blocks_its_event_loop_past_its_lease_keeps_its_claim(
    store_url: str, run_id: str, world: World
) -> None:
    """L1/P5: `Block` blocks its process's event loop (a synchronous call) for more than
    two leases. Its claim is renewed from a thread of its own, not from the blocked loop:
    another process trying to take the run over meanwhile gets `ResumeConflict` and runs
    nothing, and the blocked node then ends the run, its charge once."""
    lease = 2.0

    def driver() -> Any:
        p = held(store_url, run_id, BLOCKING, lease=lease)
        result = asyncio.run(BLOCKING.run(Block(), state=fresh(), deps=world, persistence=p))
        return result.output

    running = fork(driver)
    while not (world.folder / "inside").exists():
        time.sleep(0.02)
    time.sleep(2 * lease + 0.5)

    def takeover() -> Any:
        async def go() -> list[str]:
            refused = []
            with pytest.raises(ResumeConflict):
                await held(store_url, run_id, BLOCKING, lease=lease).load_next()
            refused.append("load_next")
            with pytest.raises(ResumeConflict):
                p = held(store_url, run_id, BLOCKING, lease=lease)
                async with BLOCKING.iter_from_persistence(p, deps=world) as run:
                    async for _ in run:
                        pass
            refused.append("iter_from_persistence")
            return refused

        return asyncio.run(go())

    taken = in_child(takeover)
    (world.folder / "release").touch()
    outcome = running.wait(60)
    assert taken.ok and taken.value == ["load_next", "iter_from_persistence"], taken.summary()
    assert outcome.ok and outcome.value == "paid 0", outcome.summary()
    line = asyncio.run(held(store_url, run_id, BLOCKING).load_all())
    assert statuses(line) == ["success", "success", "end"]
    assert world.entered() == {"block": 1, "done": 1}
    assert world.sink.counts() == {"charge": 1}


@dataclass
class Exit(BaseNode[Order, None, str]):
    async def run(self, ctx: GraphRunContext[Order, None]) -> End[str]:
        raise SystemExit(3)


def test_file_persistence_strands_a_node_left_with_a_base_exception(tmp_path: Path) -> None:
    """The comparison the test above makes: pydantic-graph's own `FileStatePersistence`
    marks a node `error` only for an `Exception`; one left with `SystemExit` stays
    `running`, and `iter_from_persistence` can no longer run it."""
    exiting = Graph(nodes=(Exit,), name="exiting")
    file: FileStatePersistence[Order, str] = FileStatePersistence(tmp_path / "run.json")
    with pytest.raises(SystemExit):
        asyncio.run(exiting.run(Exit(), state=fresh(), persistence=file))
    (left,) = asyncio.run(file.load_all())
    assert left.status == "running"


# -- a node that runs another graph, killed inside it -----------------------------------------


@dataclass
class Log:
    log: list[str] = field(default_factory=list)


@dataclass
class Nest:
    """The deps of both graphs: the world, and where the inner graph's run is stored."""

    world: World
    url: str
    inner_id: str


async def effect_on(world: World, name: str) -> str:
    """The effect `name` on the world's sink, applied once; its idempotency key."""
    sink = world.sink

    async def apply(key: str) -> str:
        sink.apply(name, key)
        return key

    key: str = await arun_effect(name, apply, reconcile=sink.reconcile)
    return key


@dataclass
class Child(BaseNode[Log, Nest, str]):
    async def run(self, ctx: GraphRunContext[Log, Nest]) -> End[str]:
        ctx.deps.world.enter("child")
        ctx.state.log.append(await effect_on(ctx.deps.world, "child"))
        ctx.deps.world.enter("child.after_effect")
        return End("child done")


INNER = Graph(nodes=(Child,), name="inner")


async def inner_result(deps: Nest) -> str:
    """The inner graph's result: its run started, or gone on with, or read if it ended."""
    inner: RemitStatePersistence[Log, str] = RemitStatePersistence(
        deps.url, deps.inner_id, lease=LEASE
    )
    inner.set_graph_types(INNER)
    history = await inner.load_all()
    if not history:
        return (await INNER.run(Child(), state=Log(), deps=deps, persistence=inner)).output
    if isinstance(history[-1], EndSnapshot):
        return history[-1].result.data
    async with INNER.iter_from_persistence(inner, deps=deps) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return run.result.output


@dataclass
class Parent(BaseNode[Log, Nest, str]):
    """Applies `before`, runs the inner graph on a run id of its own, applies `after`."""

    async def run(self, ctx: GraphRunContext[Log, Nest]) -> End[str]:
        world = ctx.deps.world
        world.enter("parent")
        ctx.state.log.append(await effect_on(world, "before"))
        ctx.state.log.append(await inner_result(ctx.deps))
        world.enter("parent.after_inner")
        ctx.state.log.append(await effect_on(world, "after"))
        return End("parent done")


OUTER = Graph(nodes=(Parent,), name="outer")


@pytest.mark.parametrize("kill_at", ["child.after_effect", "parent.after_inner"])
def test_a_node_killed_inside_the_graph_it_runs_is_recovered_with_each_effect_once(
    store_url: str, run_id: str, world: World, kill_at: str
) -> None:
    """P1/P2/L1: `Parent` applies `before`, runs an inner graph on a run id of its own
    (whose `Child` applies `child`), then applies `after`. Its process is SIGKILLed in
    `Child` after its effect, or in `Parent` after the inner run ended. After the lease,
    another process continues the outer run: `Parent` runs again, `before` is read back
    from the ledger under the same idempotency key, the inner run goes on (or its End is
    read) with `child` once, `after` is applied once, and each run ends once. The two
    runs' effects are keyed apart: the inner graph's claim and step scope neither take
    the outer node's place nor leak into it."""
    deps = Nest(world, store_url, f"{run_id}-inner")
    world.kill_at = kill_at

    def first() -> None:
        outer = held(store_url, run_id, OUTER, lease=LEASE)
        asyncio.run(OUTER.run(Parent(), state=Log(), deps=deps, persistence=outer))

    assert in_child(first).status == "killed"
    time.sleep(LEASE + 0.2)
    world.kill_at = None

    def recover() -> Any:
        async def go() -> Any:
            async with OUTER.iter_from_persistence(
                held(store_url, run_id, OUTER), deps=deps
            ) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return [run.result.output, run.state.log]

        return asyncio.run(go())

    outcome = in_child(recover)
    assert outcome.ok, outcome.summary()
    output, log = outcome.value
    assert output == "parent done"
    assert world.sink.counts() == {"before": 1, "child": 1, "after": 1}
    before, inner, after = log
    assert inner == "child done" and before != after
    outer_line = asyncio.run(held(store_url, run_id, OUTER).load_all())
    inner_line = asyncio.run(held(store_url, deps.inner_id, INNER).load_all())
    assert statuses(outer_line) == ["success", "end"]
    assert statuses(inner_line) == ["success", "end"]
    assert inner_line[-1].state.log[0] not in (before, after)  # the inner run's own key
    entered = world.entered()
    in_child_killed = kill_at == "child.after_effect"
    assert entered["parent"] == 2
    assert entered["child"] == (2 if in_child_killed else 1)
    assert entered["parent.after_inner"] == (1 if in_child_killed else 2)


# -- one instance handed to a second graph ----------------------------------------------------


@dataclass
class Tally:
    n: int = 0


@dataclass
class Count(BaseNode[Tally, None, int]):
    async def run(self, ctx: GraphRunContext[Tally, None]) -> Report:
        ctx.state.n += 1
        return Report()


@dataclass
class Report(BaseNode[Tally, None, int]):
    async def run(self, ctx: GraphRunContext[Tally, None]) -> End[int]:
        return End(ctx.state.n)


@dataclass
class Named:
    name: str = ""


@dataclass
class Greet(BaseNode[Named, None, str]):
    async def run(self, ctx: GraphRunContext[Named, None]) -> End[str]:
        return End(f"hello {ctx.state.name}")


def counting(**kw: Any) -> Graph[Tally, None, int]:
    """The counting graph, built anew (as a factory builds one per request)."""
    return Graph(nodes=(Count, Report), **kw)


def test_one_instance_refuses_a_second_graph_and_its_run_goes_on(
    store_url: str, run_id: str
) -> None:
    """P4/isolation: the instance that ran `counting()` to `Report` is handed a graph of
    another state type (`Graph.run`, `iter_from_persistence`): `ValueError` naming both
    graphs' nodes, nothing stored; a new instance for that graph on the same run id gets
    `VersionMismatch`. A `Graph` built again from the same node classes (another name,
    types given explicitly) is the same graph: the first instance continues with it."""
    greeting = Graph(nodes=(Greet,), name="greeting")

    async def go() -> None:
        p: RemitStatePersistence[Any, Any] = RemitStatePersistence(store_url, run_id, lease=HELD)
        async with counting().iter(Count(), state=Tally(), persistence=p) as run:
            async for node in run:
                if isinstance(node, Report):
                    break
        before = await p.load_all()
        with pytest.raises(ValueError, match=r"Greet.*Count, Report|Count, Report.*Greet"):
            await greeting.run(Greet(), state=Named("ann"), persistence=p)
        with pytest.raises(ValueError, match="one instance persists one run of one graph"):
            async with greeting.iter_from_persistence(p):
                pass
        other: RemitStatePersistence[Any, Any] = RemitStatePersistence(
            store_url, run_id, lease=HELD
        )
        with pytest.raises(VersionMismatch, match="Count, Report"):
            async with greeting.iter_from_persistence(other):
                pass
        assert await held(store_url, run_id, counting()).load_all() == before
        p.set_graph_types(counting(name="again", state_type=Tally, run_end_type=int))
        async with counting(name="again").iter_from_persistence(p) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == 1

    asyncio.run(go())
