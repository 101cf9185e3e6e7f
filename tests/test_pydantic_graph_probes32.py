"""Outside probes of `RemitStatePersistence`, round 32: a task cancelled while its node's
effect is in flight (on the main line and on a fork), taken on at once by another process;
and a node that raises a different error on each retry of the user's own loop, driven from
alternating processes; on SQLite, PostgreSQL and Redis, in real forked processes.

Held: a node cancelled in its effect (before or after the charge reached the sink), on
the main line or on a fork, is given back at once and continued by another process with
the same token, its effect once per line under one key, nothing before it run again; a
node failing with an error, a timeout of an awaited call, or a `CancelledError` it did not ask for
is retried at once by the user's loop from either process, its effect once; a driver's
step cut short in the effect and retried goes on, or gets `ResumeConflict` if another
process took the node over meanwhile. Found, not a fault of the store: a driver that
retries `run.next(node)` in its own `GraphRun` runs the node with the `run.state` that
the cut step had changed in place (pydantic-graph's one state object), where any other
recovery starts from the stored state, so the two can end with different states.

The lease is 30 s throughout: a claim left held by a cancelled or failed attempt would
make the next attempt's `iter_from_persistence` raise `ResumeConflict`, so "taken on at
once" is checked without a timed assertion.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import NodeSnapshot
from pydantic_graph_parts import shape
from test_pydantic_graph_persistence import World, in_child

from remit_core import arun_effect
from remit_pydantic_graph import RemitStatePersistence

LONG_LEASE = 30.0


def persistence(
    url: str, run_id: str, graph: Graph[Any, Any, Any], fork_token: str | None = None
) -> RemitStatePersistence[Any, Any]:
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(
        url, run_id, lease=LONG_LEASE, fork_token=fork_token
    )
    p.set_graph_types(graph)
    return p


# -- cancelled while the effect is in flight -------------------------------------------------


@dataclass
class Bill:
    total: int = 0
    log: list[str] = field(default_factory=list)


@dataclass
class Deps:
    """The world, and where a first attempt waits to be cancelled inside its effect:
    "before" the charge reaches the sink, "after" it did (its reply never came back)."""

    world: World
    hold: str | None = None
    held: asyncio.Event | None = None


@dataclass
class Open(BaseNode[Bill, Deps, int]):
    async def run(self, ctx: GraphRunContext[Bill, Deps]) -> Charge:
        ctx.deps.world.enter("open")
        ctx.state.total = 7
        ctx.state.log.append("open")
        return Charge()


@dataclass
class Charge(BaseNode[Bill, Deps, int]):
    async def run(self, ctx: GraphRunContext[Bill, Deps]) -> Close:
        deps = ctx.deps
        deps.world.enter("charge")
        ctx.state.log.append("charge.started")  # in memory only, until the node returns

        async def apply(key: str) -> str:
            deps.world.journal.record("apply", key)
            if deps.hold == "before":
                assert deps.held is not None
                deps.held.set()
                await asyncio.Event().wait()
            receipt = deps.world.sink.apply("charge", key)
            if deps.hold == "after":
                assert deps.held is not None
                deps.held.set()
                await asyncio.Event().wait()
            return receipt

        await arun_effect("charge", apply, idempotent=True)
        ctx.state.total *= 10
        ctx.state.log.append("charge")
        return Close()


@dataclass
class Close(BaseNode[Bill, Deps, int]):
    async def run(self, ctx: GraphRunContext[Bill, Deps]) -> End[int]:
        ctx.deps.world.enter("close")
        ctx.state.log.append("close")
        return End(ctx.state.total + 1)


BILLS = Graph(nodes=(Open, Charge, Close), name="bills")


async def cancelled_in_effect(p: RemitStatePersistence[Any, Any], node: Any, deps: Deps) -> None:
    """Run the graph from `node` (with the state stored before it, for a fork) and cancel
    the task as soon as its `Charge` is inside the effect."""
    deps.held = asyncio.Event()
    stored = await p.load_all()
    state = next(s.state for s in stored if s.id == node.get_snapshot_id()) if stored else Bill()
    task = asyncio.create_task(BILLS.run(node, state=state, deps=deps, persistence=p))
    await asyncio.wait_for(deps.held.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("hold", ["before", "after"])
@pytest.mark.parametrize("line", ["main", "fork"])
def test_a_node_cancelled_in_its_effect_is_taken_on_at_once_by_another_process(
    store_url: str, run_id: str, tmp_path: Path, line: str, hold: str
) -> None:
    """P1 / P2 / L1 / P3: `Charge`'s task is cancelled while its idempotent effect is in
    flight, before the charge reached the payment sink or after it did (the reply lost).
    On the main line the run was started by `graph.run`; on a fork, the ended run's
    `Charge` snapshot is run again with a token (`graph.run(old.node, ...)`). The node is
    given back (`created`, no claim held, the state it was stored with); another process
    continues the line at once with `iter_from_persistence` (a 30 s lease: a claim left
    held would be `ResumeConflict`), with the same token on the fork. `Open` never runs
    again, the charge reaches the sink once per line under one key (an `after` retry is
    the same key, which the sink ignores), and the main line of a fork is left as it was."""
    world = World(tmp_path)
    token = "again" if line == "fork" else None

    async def first() -> tuple[list[Any], list[Any]]:
        main_history: list[Any] = []
        if line == "fork":
            ended = await BILLS.run(
                Open(),
                state=Bill(),
                deps=Deps(world),
                persistence=persistence(store_url, run_id, BILLS),
            )
            assert ended.output == 71
            main_history = await persistence(store_url, run_id, BILLS).load_all()
            base = next(s for s in main_history if isinstance(getattr(s, "node", None), Charge))
            p = persistence(store_url, run_id, BILLS, token)
            await cancelled_in_effect(p, base.node, Deps(world, hold))
        else:
            p = persistence(store_url, run_id, BILLS)
            await cancelled_in_effect(p, Open(), Deps(world, hold))
        return main_history, await persistence(store_url, run_id, BILLS, token).load_all()

    main_history, left = asyncio.run(first())
    assert shape(left)[-1] == ("Charge", "created")
    assert left[-1].start_ts is None and left[-1].state == Bill(7, ["open"])

    async def go_on() -> Any:
        p = persistence(store_url, run_id, BILLS, token)
        async with BILLS.iter_from_persistence(p, deps=Deps(World(tmp_path))) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    done = in_child(lambda: asyncio.run(go_on()))
    assert done.ok, done.summary()
    assert done.value == 71

    history = asyncio.run(persistence(store_url, run_id, BILLS, token).load_all())
    assert shape(history) == [
        ("Open", "success"),
        ("Charge", "success"),
        ("Close", "success"),
        ("End", "end"),
    ]
    assert history[-1].state == Bill(70, ["open", "charge.started", "charge", "close"])
    assert [s.id for s in history[:2]] == [s.id for s in left[:2]]
    entered = world.entered()
    assert entered["open"] == 1 and entered["close"] == (2 if line == "fork" else 1)
    keys = [key for name, key, _ in world.sink.applications() if name == "charge"]
    assert len(keys) == len(set(keys)) == (2 if line == "fork" else 1)
    # The attempt cancelled in the effect and the one that took it on used one key.
    attempts = [e.name for e in world.journal.entries() if e.kind == "apply"]
    assert len(attempts) == len(keys) + 1 and attempts[-1] == attempts[-2]
    assert attempts[-1] in keys
    if line == "fork":
        main_now = asyncio.run(persistence(store_url, run_id, BILLS).load_all())
        assert [(s.id, shape([s])) for s in main_now] == [(s.id, shape([s])) for s in main_history]


# -- a node that raises another error on each retry of the user's loop ------------------------


@dataclass
class Tries:
    seen: list[str] = field(default_factory=list)


def _attempt(world: World) -> int:
    return world.entered().get("flaky", 0)


async def _cancelled_elsewhere() -> None:
    """Await a future that another task cancels: `CancelledError` in a task no one
    cancelled (a shared connection closed under it)."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(waiter.cancel)
    await waiter


async def _time_out() -> None:
    """An `asyncio.wait_for` that runs out: the awaited call is cancelled inside the node,
    and the node gets a timeout error, not the cancellation."""
    await asyncio.wait_for(asyncio.Event().wait(), 0)


@dataclass
class Start(BaseNode[Tries, World, str]):
    async def run(self, ctx: GraphRunContext[Tries, World]) -> Flaky:
        ctx.deps.enter("start")
        ctx.state.seen.append("start")
        return Flaky()


@dataclass
class Flaky(BaseNode[Tries, World, str]):
    """Applies its effect, then fails differently on each of its first three tries."""

    async def run(self, ctx: GraphRunContext[Tries, World]) -> End[str]:
        world = ctx.deps
        world.enter("flaky")
        attempt = _attempt(world)
        ctx.state.seen.append(f"flaky{attempt}")
        sink = world.sink

        async def apply(key: str) -> str:
            world.journal.record("apply", key)
            return sink.apply("notify", key)

        await arun_effect("notify", apply, reconcile=sink.reconcile)
        if attempt == 1:
            raise ValueError("the mail server said no")
        if attempt == 2:
            await _time_out()
        if attempt == 3:
            await _cancelled_elsewhere()
        return End(f"sent after {attempt}")


FLAKY = Graph(nodes=(Start, Flaky), name="flaky-retries")


def test_a_node_failing_differently_on_each_retry_applies_its_effect_once(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """P1 / P2 / L1: the user's own retry loop (`graph.run`, then `iter_from_persistence`
    again after each failure), its tries alternating between this process and a forked
    one. `Flaky` applies its effect, then raises a `ValueError`, a timeout error (an
    `asyncio.wait_for` that ran out, its awaited call cancelled inside the node), a
    `CancelledError` of a future another task cancelled (the task itself was not
    cancelled), and then ends. Each try's own error reaches the
    loop as it was raised; the node is left `error` after an exception and `created`
    after the cancellation, with the state it was stored with; each next try (in the
    other process) takes it at once; `Start` runs once and the effect applies once."""
    world = World(tmp_path)
    seen: list[tuple[str, list[tuple[str, str]], list[str]]] = []

    async def attempt(first: bool) -> str:
        p = persistence(store_url, run_id, FLAKY)
        try:
            if first:
                result = await FLAKY.run(
                    Start(), state=Tries(), deps=World(tmp_path), persistence=p
                )
                return f"ended: {result.output}"
            async with FLAKY.iter_from_persistence(p, deps=World(tmp_path)) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return f"ended: {run.result.output}"
        except ValueError as error:
            return f"ValueError: {error}"
        except asyncio.TimeoutError:
            return "timed out"

    async def one_try(first: bool) -> tuple[str, list[tuple[str, str]], list[str]]:
        try:
            outcome = await attempt(first)
        except asyncio.CancelledError:
            outcome = "CancelledError"
        history = await persistence(store_url, run_id, FLAKY).load_all()
        return outcome, shape(history), history[-1].state.seen

    for n in range(4):
        if n % 2 == 0:
            seen.append(asyncio.run(one_try(n == 0)))
        else:
            done = in_child(lambda: asyncio.run(one_try(False)))
            assert done.ok, done.summary()
            outcome, line, state = done.value
            seen.append((outcome, [tuple(pair) for pair in line], state))

    stored_before_flaky = ["start"]
    assert seen == [
        (
            "ValueError: the mail server said no",
            [("Start", "success"), ("Flaky", "error")],
            stored_before_flaky,
        ),
        (
            "timed out",
            [("Start", "success"), ("Flaky", "error")],
            stored_before_flaky,
        ),
        ("CancelledError", [("Start", "success"), ("Flaky", "created")], stored_before_flaky),
        (
            "ended: sent after 4",
            [("Start", "success"), ("Flaky", "success"), ("End", "end")],
            ["start", "flaky4"],
        ),
    ], seen
    assert world.entered() == {"start": 1, "flaky": 4}
    assert world.sink.counts() == {"notify": 1}
    applied = [e.name for e in world.journal.entries() if e.kind == "apply"]
    assert len(applied) == 1
    history = asyncio.run(persistence(store_url, run_id, FLAKY).load_all())
    assert isinstance(history[1], NodeSnapshot) and history[1].duration is not None


# -- a step cut short inside its node, retried by its driver ----------------------------------


@pytest.mark.parametrize("meanwhile", ["nobody", "another process"])
def test_a_step_cut_short_in_its_effect_is_retried_by_its_driver(
    store_url: str, run_id: str, tmp_path: Path, meanwhile: str
) -> None:
    """P1 / P2 / P5: a driver steps the run with `run.next()` under `asyncio.timeout`;
    the step running `Charge` is cut short while its effect is in flight (after the charge
    reached the sink). The driver retries the step with the same node. If nobody took the
    run on meanwhile, the retry runs `Charge` again under its own snapshot id (the charge
    is not applied again: same key) and the run ends; it runs with the driver's `run.state`
    as the cut step left it (pydantic-graph changes one state object in place), where a
    recovery elsewhere starts from the state stored with `Charge`. If another process continued the
    run meanwhile (at once: the node was given back), the retry gets `ResumeConflict`,
    runs nothing, and the run holds the other process's end."""
    world = World(tmp_path)

    async def go() -> tuple[str, Any]:
        p = persistence(store_url, run_id, BILLS)
        deps = Deps(world, "after", asyncio.Event())
        async with BILLS.iter(Open(), state=Bill(), deps=deps, persistence=p) as run:
            charge = await run.next()
            assert isinstance(charge, Charge)

            async def cut() -> None:
                assert deps.held is not None
                await deps.held.wait()
                step.cancel()

            step = asyncio.create_task(run.next(charge))
            canceller = asyncio.create_task(cut())
            with pytest.raises(asyncio.CancelledError):
                await step
            await canceller
            if meanwhile == "another process":
                done = in_child(lambda: asyncio.run(finish()))
                assert done.ok, done.summary()
            deps.hold = None
            try:
                node = await run.next(charge)
                while not isinstance(node, End):
                    node = await run.next(node)
            except Exception as error:  # noqa: BLE001 - the outcome is what is checked
                return type(error).__name__, None
            return "ended", node.data

    async def finish() -> Any:
        p = persistence(store_url, run_id, BILLS)
        async with BILLS.iter_from_persistence(p, deps=Deps(World(tmp_path))) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    outcome = asyncio.run(go())
    expected = ("ended", 71) if meanwhile == "nobody" else ("ResumeConflict", None)
    assert outcome == expected
    history = asyncio.run(persistence(store_url, run_id, BILLS).load_all())
    assert shape(history) == [
        ("Open", "success"),
        ("Charge", "success"),
        ("Close", "success"),
        ("End", "end"),
    ]
    # The retry runs `Charge` with the driver's `run.state`, one object the cut step had
    # changed in place already; a recovery elsewhere runs it from the state stored with it.
    started = 2 if meanwhile == "nobody" else 1
    log = ["open"] + ["charge.started"] * started + ["charge", "close"]
    assert history[-1].state == Bill(70, log)
    assert history[1].state == Bill(7, ["open"])
    assert world.entered() == {"open": 1, "charge": 2, "close": 1}
    assert world.sink.counts() == {"charge": 1}
    attempts = [e.name for e in world.journal.entries() if e.kind == "apply"]
    assert len(attempts) == 2 and len(set(attempts)) == 1
