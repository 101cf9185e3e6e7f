"""Outside probes of `RemitStatePersistence`, round 14: `graph.run` and `run_sync` with
persistence (racing processes, a thread beside a driving process), runs paused and
answered at once in one event loop, forks of one pause raced by processes with tokens
of their own, nodes that return what no graph holds, states changed after they were
stored, long and large runs, and an instance used again after its run ended; on
SQLite, PostgreSQL and Redis, in real forked processes where the item is about them.

- Isolation / P3: runs started at once from one node object that returns itself (a
  module-level start node) got `ForkWithoutIntent` from one another: a run that stored
  the object again gave it a new snapshot id, and the other runs, holding the same
  object as their next node, took it for a new node started on their run. A driver's
  own stored node object, found under another id, now runs as the snapshot it stored.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph.persistence.in_mem import FullStatePersistence
from test_pydantic_graph_identity import COUNTING, Count
from test_pydantic_graph_persistence import (
    GRAPH,
    Answer,
    Ask,
    Start,
    World,
    drive,
    fresh,
    persistence,
    statuses,
    to_pause,
)
from test_pydantic_graph_probes3 import CARTS, Cart, Elsewhere, Fill, carts, finish, history, shape

from remit_core import CheckpointInvalid, ForkWithoutIntent, ResumeConflict, arun_effect
from remit_core.conformance.processes import Barrier, fork, reap
from remit_core.conformance.world import current_run
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def raced(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run each call in a forked process, all released at once; their outcomes."""
    barrier = Barrier(len(calls))

    def behind_barrier(call: Callable[[], Any]) -> Callable[[], Any]:
        def racer() -> Any:
            barrier.wait()
            return call()

        return racer

    workers = [fork(behind_barrier(call), barrier=barrier) for call in calls]
    try:
        barrier.release()
        return [w.wait(60) for w in workers]
    finally:
        reap(workers)


# -- graph.run and run_sync with persistence ------------------------------------------------


def test_processes_each_running_the_graph_on_one_run_id_run_each_node_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P3: four processes call `graph.run(Fill(), persistence=...)` on one run id at
    once, each with a start node (and so a snapshot id) of its own: a job started twice.
    One runs the graph to its End; the others get `ForkWithoutIntent` (the run has a
    head) or `ResumeConflict` (it is held), and run no node. One line, one End."""

    def starter() -> str:
        p = carts(store_url, run_id)
        return asyncio.run(CARTS.run(Fill(), state=Cart(), deps=world, persistence=p)).output

    outcomes = raced([starter] * 4)
    winners = [o for o in outcomes if o.ok]
    assert [o.value for o in winners] == ["shipped 100"], [o.summary() for o in outcomes]
    assert all(o.raised("ForkWithoutIntent", "ResumeConflict") for o in outcomes if not o.ok)
    line = history(store_url, run_id)
    assert statuses(line) == ["success"] * 3 + ["end"] and line[-1].result.data == "shipped 100"
    assert dict(world.entered()) == dict.fromkeys(("fill", "ship", "ship.after_effect", "close"), 1)
    assert world.sink.counts() == {"ship": 1}
    assert [b.branch for b in carts(store_url, run_id).remit.branches(run_id)] == ["main"]


def test_run_sync_in_a_thread_while_a_process_drives_the_run(
    store_url: str, run_id: str, world: World, tmp_path: Path
) -> None:
    """P5/P3: a process runs the graph and stays inside Ship (its claim heartbeated past
    several leases). Meanwhile threads of another process call `graph.run_sync` on that
    run id (`ForkWithoutIntent`: the run has a head) and continue it with
    `iter_from_persistence` (`ResumeConflict`: the process holds it); nothing they do is
    stored, and the driving process ends the run as if they had not been there. A
    thread's `run_sync` of a run of its own ends beside them."""
    inside, go_on = tmp_path / "inside", tmp_path / "go-on"

    def driver() -> str:
        def hold(node: str) -> None:
            if node == "ship":
                inside.touch()
                deadline = time.monotonic() + 30
                while not go_on.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)

        world.on_enter = hold
        p = carts(store_url, run_id)
        return asyncio.run(CARTS.run(Fill(), state=Cart(), deps=world, persistence=p)).output

    outcomes: dict[str, Any] = {}

    def attempt(name: str, call: Any) -> None:
        try:
            outcomes[name] = call()
        except BaseException as exc:
            outcomes[name] = exc

    process = fork(driver)
    try:
        deadline = time.monotonic() + 30
        while not inside.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert inside.exists()
        time.sleep(2 * LEASE)  # the claim outlives its lease only by its heartbeat
        before = shape(history(store_url, run_id))
        own = f"own-{run_id}"
        calls = {
            "run_sync": lambda: CARTS.run_sync(
                Fill(), state=Cart(), deps=world, persistence=carts(store_url, run_id)
            ),
            "continue": lambda: asyncio.run(finish(carts(store_url, run_id), world)),
            "own": lambda: (
                CARTS.run_sync(
                    Fill(), state=Cart(), deps=world, persistence=carts(store_url, own)
                ).output
            ),
        }
        threads = [threading.Thread(target=attempt, args=item) for item in calls.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert (
            shape(history(store_url, run_id))
            == before
            == [("Fill", "success"), ("Ship", "running")]
        )
        go_on.touch()
        done = process.wait(60)
    finally:
        reap([process])
    assert isinstance(outcomes["run_sync"], ForkWithoutIntent), outcomes
    assert isinstance(outcomes["continue"], ResumeConflict), outcomes
    assert outcomes["own"] == "shipped 100"
    assert done.ok and done.value == "shipped 100", done.summary()
    assert shape(history(store_url, run_id)) == shape(history(store_url, own))
    assert world.entered() == {"fill": 2, "ship": 2, "ship.after_effect": 2, "close": 2}
    assert world.sink.counts() == {"ship": 2}


# -- many runs paused and answered at once in one event loop ----------------------------------


def test_runs_paused_and_answered_at_once_in_one_loop_keep_to_themselves(
    store_url: str, world: World
) -> None:
    """Isolation / P5 / P2: six runs driven to their pause at once in one event loop, all
    answered at once (each with a value of its own), then all continued at once; a second
    round of answers, given at once, is refused for every run. Each run ends with its own
    answer, its own history, one pause consumed, and its effect applied once under a key
    of its own."""
    run_ids = [f"pause-{i}-{uuid.uuid4().hex}" for i in range(6)]

    async def go() -> tuple[list[Any], list[Any]]:
        async def paused(run_id: str) -> str:
            current_run.set(run_id)
            p = await to_pause(store_url, run_id, world)
            snapshot = await p.paused()
            assert snapshot is not None and isinstance(snapshot.node, Ask)
            return snapshot.id

        pauses = await asyncio.gather(*map(paused, run_ids))

        async def answered(i: int) -> Any:
            current_run.set(run_ids[i])
            p = persistence(store_url, run_ids[i])
            await p.resume(Answer(f"v{i}"), pause_id=pauses[i])
            return await drive(p, world)

        ends = await asyncio.gather(*map(answered, range(6)))

        async def late(i: int) -> Any:
            try:
                return await persistence(store_url, run_ids[i]).resume(Answer(f"late{i}"))
            except ResumeConflict as exc:
                return exc

        return ends, list(await asyncio.gather(*map(late, range(6))))

    ends, lates = asyncio.run(asyncio.wait_for(go(), 120))
    assert ends == ["paid 100"] * 6
    assert all(isinstance(x, ResumeConflict) for x in lates), lates
    keys = set()
    for i, run_id in enumerate(run_ids):
        p = persistence(store_url, run_id)
        line = asyncio.run(p.load_all())
        assert statuses(line) == ["success", "created", "success", "success", "success", "end"]
        assert line[-1].state["approved_by"] == f"v{i}" and line[-1].state["log"] == [
            "start",
            "answer",
            "pay",
            "done",
        ]
        pauses = p.remit.interrupts(run_id)
        assert [(x.checkpoint_id, x.status) for x in pauses] == [(line[1].id, "consumed")]
        assert world.sink.counts(run=run_id) == {"charge": 1}
        assert world.journal.entered(run=run_id) == {
            "start": 1,
            "answer": 1,
            "pay": 1,
            "pay.after_effect": 1,
            "done": 1,
        }
        keys |= {key for _, key, run in world.sink.applications() if run == run_id}
    assert len(keys) == 6


def test_runs_sharing_a_start_node_that_returns_itself_keep_to_themselves(
    store_url: str, world: World
) -> None:
    """Isolation / P3: six runs started at once in one event loop from one node object
    (a module-level start node), which returns itself until it ran three times. A run
    that stores that object again gives it a new snapshot id, which the other runs,
    holding the same object as their next node, saw as a new node started on their run:
    `ForkWithoutIntent`, though nothing forked, where pydantic-graph's default
    persistence runs them all. Each run now ends, with its own line of three snapshots
    and one effect per snapshot, each under a key of its own."""
    shared = Count()
    run_ids = [f"shared-{i}-{uuid.uuid4().hex}" for i in range(6)]

    async def one(run_id: str) -> Any:
        current_run.set(run_id)
        p: RemitStatePersistence[Any, int] = RemitStatePersistence(store_url, run_id)
        try:
            return (await COUNTING.run(shared, state=fresh(), deps=world, persistence=p)).output
        except ForkWithoutIntent as exc:
            return exc

    async def all_at_once() -> list[Any]:
        return list(await asyncio.wait_for(asyncio.gather(*map(one, run_ids)), 120))

    ends = asyncio.run(all_at_once())
    assert ends == [3] * 6, ends
    for run_id in run_ids:
        p: RemitStatePersistence[Any, int] = RemitStatePersistence(store_url, run_id)
        p.set_graph_types(COUNTING)
        line = asyncio.run(p.load_all())
        assert statuses(line) == ["success"] * 3 + ["end"] and len({s.id for s in line}) == 4
        assert world.sink.counts(run=run_id) == {"tick": 3}
    assert len({key for _, key, _ in world.sink.applications()}) == 18


# -- forks of one pause, raced by processes with tokens of their own --------------------------


def test_processes_forking_one_pause_with_tokens_of_their_own_make_one_branch_each(
    store_url: str, run_id: str, world: World
) -> None:
    """P3/L3/P2: three processes fork the run's pause at once, each with a token of its
    own, answer their fork and run it to its End while the main line stays paused. Each
    token made one branch: its `load_all` is the shared Start, the pause (run on the
    fork), then the fork's own nodes with its own answer; each fork charged once, under a
    key of its own. The main line is untouched by the forks' Ends: still paused at its
    pause, not ended; then answered, it ends on its own, with one End of its own."""
    main = asyncio.run(to_pause(store_url, run_id, world))
    start, pause = asyncio.run(main.load_all())

    def forker(i: int) -> Any:
        async def go() -> Any:
            forked = await persistence(store_url, run_id).fork(pause.id, f"what-if-{i}")
            await forked.resume(Answer(f"v{i}"), pause_id=pause.id)
            return await drive(forked, world)

        return asyncio.run(go())

    outcomes = raced([lambda i=i: forker(i) for i in range(3)])
    assert [o.value for o in outcomes] == ["paid 100"] * 3, [o.summary() for o in outcomes]

    async def check() -> None:
        branches = main.remit.branches(run_id)
        assert len(branches) == 4 and len({b.branch for b in branches}) == 4
        ends = set()
        for i in range(3):
            forked = persistence(store_url, run_id, fork_token=f"what-if-{i}")
            line = await forked.load_all()
            assert [s.id for s in line[:2]] == [start.id, pause.id]
            assert statuses(line) == ["success", "created", "success", "success", "success", "end"]
            assert [type(s.node).__name__ for s in line[2:5]] == ["Answer", "Pay", "Done"]
            assert line[-1].state["approved_by"] == f"v{i}"
            ends.add(line[-1].id)
            with pytest.raises(ResumeConflict, match="ended"):
                await forked.resume(Answer("late"))
            with pytest.raises(ValueError, match="End"):
                await forked.fork(line[-1].id, f"after-end-{i}")
        assert len(ends) == 3
        # The main line, paused all along: no End of a fork is its.
        assert [s.id for s in await main.load_all()] == [start.id, pause.id]
        still = await main.paused()
        assert still is not None and still.id == pause.id
        with pytest.raises(ForkWithoutIntent, match="already has a head"):
            await GRAPH.run(Start(), state=fresh(), deps=world, persistence=main)
        await main.resume(Answer("ann"), pause_id=pause.id)
        assert await drive(main, world) == "paid 100"
        line = await main.load_all()
        assert sum(isinstance(s, EndSnapshot) for s in line) == 1 and line[-1].id not in ends
        assert line[-1].state["approved_by"] == "ann"

    asyncio.run(check())
    assert world.entered()["start"] == 1 and world.entered()["answer"] == 4
    assert world.sink.counts() == {"charge": 4}
    assert len({key for _, key, _ in world.sink.applications()}) == 4


# -- nodes that return what the graph does not hold ------------------------------------------


@dataclass
class Rules:
    """What `Detour` returns: a node of no graph here, None, or the graph's own node;
    the world its effect acts on (None: no effect)."""

    returns: str = "elsewhere"
    world: World | None = None


@dataclass
class Detour(BaseNode[Cart, Rules, str]):
    """Applies its effect, then returns what its deps say."""

    async def run(self, ctx: GraphRunContext[Cart, Rules]) -> Last:
        world = ctx.deps.world
        if world is not None:  # None: no Remit step to record an effect in
            world.enter("detour")
            sink = world.sink

            async def apply(key: str) -> str:
                return sink.apply("detour", key)

            await arun_effect("detour", apply, reconcile=sink.reconcile)
        ctx.state.steps.append("detour")
        returned: Any = {"elsewhere": Elsewhere(), "none": None, "last": Last()}
        return returned[ctx.deps.returns]  # type: ignore[no-any-return]


@dataclass
class Last(BaseNode[Cart, Rules, str]):
    async def run(self, ctx: GraphRunContext[Cart, Rules]) -> End[str]:
        return End(",".join(ctx.state.steps))


DETOURS = Graph(nodes=(Detour, Last), name="detours")


def detours(url: str, run_id: str) -> RemitStatePersistence[Cart, str]:
    p: RemitStatePersistence[Cart, str] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(DETOURS)
    return p


async def detour_on(p: RemitStatePersistence[Cart, str], rules: Rules) -> str:
    """Continue the stored run of DETOURS node by node to its End; its output."""
    async with DETOURS.iter_from_persistence(p, deps=rules) as run:
        node = run.next_node
        while not isinstance(node, End):
            node = await run.next(node)
    return node.data


def test_a_node_returning_a_node_of_no_graph_stores_nothing_after_it(
    store_url: str, run_id: str, world: World
) -> None:
    """P4/P2: `Detour` applies its effect, then returns a node the graph does not have.
    `graph.run` raises `CheckpointInvalid` at `node` (`FullStatePersistence` stores the
    stray node, then pydantic-graph refuses to run it); nothing follows Detour, which is
    marked `error`. Continued, it runs again (same failure), its effect still applied
    once; fixed, the run ends with that one effect."""
    rules = Rules("elsewhere", world)

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as refused:
            await DETOURS.run(
                Detour(), state=Cart(), deps=rules, persistence=detours(store_url, run_id)
            )
        assert refused.value.field == "node" and "Elsewhere" in str(refused.value)
        (only,) = await detours(store_url, run_id).load_all()
        assert only.status == "error" and only.state == Cart()
        with pytest.raises(CheckpointInvalid):
            await detour_on(detours(store_url, run_id), rules)
        rules.returns = "last"
        assert await detour_on(detours(store_url, run_id), rules) == "detour"
        line = await detours(store_url, run_id).load_all()
        assert statuses(line) == ["success", "success", "end"]

        full: FullStatePersistence[Cart, str] = FullStatePersistence()
        with pytest.raises(GraphRuntimeError, match="not in the graph"):
            await DETOURS.run(Detour(), state=Cart(), deps=Rules("elsewhere"), persistence=full)
        assert isinstance(full.history[-1], NodeSnapshot) and isinstance(
            full.history[-1].node, Elsewhere
        )

    asyncio.run(go())
    assert world.entered()["detour"] == 3
    assert world.sink.counts() == {"detour": 1}


def test_a_node_returning_no_node_is_run_again_with_its_effect_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P2/L1: `Detour` returns None: pydantic-graph raises `GraphRuntimeError` after the
    node's `success` was stored, and nothing follows it. The node is not done: another
    resumer gets `ResumeConflict` until the driver's lease runs out, and the same instance
    continues at once, running it again (its effect applied once)."""
    rules = Rules("none", world)

    async def go() -> None:
        p = detours(store_url, run_id)
        with pytest.raises(GraphRuntimeError, match="Invalid node return type"):
            await DETOURS.run(Detour(), state=Cart(), deps=rules, persistence=p)
        (only,) = await detours(store_url, run_id).load_all()
        assert only.status == "success" and only.state == Cart()  # as pydantic-graph stores it
        with pytest.raises(ResumeConflict):  # the driver's claim, until its lease runs out
            await detours(store_url, run_id).load_next()
        rules.returns = "last"
        assert await detour_on(p, rules) == "detour"

    asyncio.run(go())
    assert world.entered()["detour"] == 2
    assert world.sink.counts() == {"detour": 1}


# -- states changed after they were stored --------------------------------------------------


def test_objects_changed_after_they_were_stored_leave_the_store_as_it_was(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: what a run stored is a copy. The run's state object (mutated in place by every
    node, and by the caller after the run), snapshots `load_all` returned, the answer node
    given to `resume()` and the state given to `update_state()`, all changed after the
    call: the store still holds what was stored then (as `FullStatePersistence`, which
    deep-copies, does), and the run goes on with the answer as it was given."""

    async def go() -> None:
        p = await to_pause(store_url, run_id, world)
        pause = await p.paused()
        assert pause is not None
        edit = fresh()
        edit["amount"] = 5
        edited = await p.update_state(edit, pause_id=pause.id)
        edit["amount"], edit["log"] = 9, ["changed"]
        answer = Answer("ann")
        await p.resume(answer, pause_id=pause.id)
        answer.value = "mallory"
        state = fresh()
        async with GRAPH.iter_from_persistence(p, deps=world) as run:
            async for _ in run:
                pass
            state = run.state
        state["log"].append("after")
        state["approved_by"] = "eve"
        line = await p.load_all()
        line[0].state["log"].append("tampered")
        assert isinstance(line[1].node, Ask)
        reread = await p.load_all()
        assert [s.id for s in reread] == [s.id for s in line]
        assert reread[0].state == fresh()
        assert reread[1].state == {"amount": 100, "approved_by": None, "log": ["start"]}
        assert reread[2].id == edited.id and reread[2].state["amount"] == 5
        assert reread[-1].state == {
            "amount": 5,
            "approved_by": "ann",
            "log": ["answer", "pay", "done"],
        }
        assert [s.state["log"] for s in reread[3:-1]] == [[], ["answer"], ["answer", "pay"]]

    asyncio.run(go())


# -- many snapshots, a large state -----------------------------------------------------------


@dataclass
class Ledger:
    entries: list[int] = field(default_factory=list)
    blob: str = ""


@dataclass
class Tick(BaseNode[Ledger, None, int]):
    """Runs again as a new node (a new snapshot) until it ran `until` times."""

    n: int
    until: int

    async def run(self, ctx: GraphRunContext[Ledger]) -> Tick | End[int]:
        ctx.state.entries.append(self.n)
        if self.n + 1 < self.until:
            return Tick(self.n + 1, self.until)
        return End(len(ctx.state.entries))


TICKS = Graph(nodes=(Tick,), name="ticks")


@pytest.mark.parametrize(("count", "blob"), [(120, 0), (3, 3_000_000)], ids=["long", "large"])
def test_a_long_run_and_a_large_state_load_back_in_order(
    store_url: str, run_id: str, count: int, blob: int
) -> None:
    """A run of 120 snapshots, and one whose state holds 3 MB and a 20,000-item list:
    `load_all()` returns every snapshot once, oldest first, equal (state, node, status)
    to `FullStatePersistence`'s history of the same run, from a new instance."""
    entries = list(range(20_000)) if blob else []

    def start() -> Ledger:
        return Ledger(entries=list(entries), blob="x" * blob)

    async def go() -> None:
        p: RemitStatePersistence[Ledger, int] = RemitStatePersistence(store_url, run_id)
        result = await TICKS.run(Tick(0, count), state=start(), persistence=p)
        assert result.output == len(entries) + count
        full: FullStatePersistence[Ledger, int] = FullStatePersistence()
        await TICKS.run(Tick(0, count), state=start(), persistence=full)
        again: RemitStatePersistence[Ledger, int] = RemitStatePersistence(store_url, run_id)
        again.set_graph_types(TICKS)
        line = await again.load_all()
        assert len(line) == count + 1 == len(full.history)
        assert len({s.id for s in line}) == count + 1
        assert statuses(line) == ["success"] * count + ["end"]
        assert [s.node.n for s in line[:-1]] == list(range(count))
        assert [s.state for s in line] == [s.state for s in full.history]
        assert line[-1].result.data == full.history[-1].result.data

    asyncio.run(go())


# -- an instance used again after its run ended ---------------------------------------------


def test_an_instance_used_again_after_its_run_ended_refuses_and_writes_nothing(
    store_url: str, run_id: str, world: World
) -> None:
    """P3/errors: the instance whose `graph.run` ended the run is used again: to run the
    graph from the start (`ForkWithoutIntent`, saying the run ended), to continue it
    (`GraphRuntimeError`: nothing left to load, as pydantic-graph's own backends), to
    store a node or a second End (`ForkWithoutIntent`), or for another graph
    (`ValueError`). Nothing is written. A fork of one of its nodes, with a token, runs."""

    async def go() -> None:
        p = carts(store_url, run_id)
        assert (await CARTS.run(Fill(), state=Cart(), deps=world, persistence=p)).output == (
            "shipped 100"
        )
        line = await p.load_all()
        with pytest.raises(ForkWithoutIntent, match="ended"):
            await CARTS.run(Fill(), state=Cart(), deps=world, persistence=p)
        with pytest.raises(GraphRuntimeError):
            await finish(p, world)
        with pytest.raises(ForkWithoutIntent):
            await p.snapshot_node(Cart(), Fill())
        with pytest.raises(ForkWithoutIntent):
            await p.snapshot_end(Cart(), End("again"))
        with pytest.raises(ValueError, match="one instance persists"):
            p.set_graph_types(TICKS)
        assert [(s.id, getattr(s, "status", "end")) for s in await p.load_all()] == [
            (s.id, getattr(s, "status", "end")) for s in line
        ]
        forked = await p.fork(line[2].id, "close-again")
        assert await finish(forked, world) == "shipped 100"
        assert shape(await forked.load_all()) == shape(line)

    asyncio.run(go())
    assert world.entered() == {"fill": 1, "ship": 1, "ship.after_effect": 1, "close": 2}
    assert world.sink.counts() == {"ship": 1}
