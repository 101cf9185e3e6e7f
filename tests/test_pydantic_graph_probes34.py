"""Outside probes of `RemitStatePersistence`, round 34: on SQLite, PostgreSQL and Redis.

A state machine drives one run of a counting graph from three drivers in one event loop,
each with an instance of its own (kept, or made afresh as pydantic-graph's docs make one
per step), through the graph's own `iter_from_persistence` and `run.next()`. A driver
starts a step and stops inside the node; another is let in, finishes it, makes it raise
after its effect, or cancels it; a worker loads the next node and gives it back; an
operator edits the state; in random orders. After every rule: no two drivers are
ever inside a node at once; a driver finds the run free whenever no driver is inside a
node (no claim is left behind by a node that raised or was cancelled); no node is left
`running` with no driver in it; at most one `End`, last. At the end, any driver finishes
the run: the state went up once per node, and each node's effect was applied once.

The interface methods in the odd orders pydantic-graph's code and docs allow (a second
`load_next`, `record_run` of an unknown id, a `record_run` inside another, a node that
calls its run's persistence, `snapshot_end` of a node never run, `snapshot_node_if_new`
of a stored id) are pinned next to pydantic-graph's own `FullStatePersistence`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphNodeStatusError, GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence.in_mem import FullStatePersistence
from pydantic_graph_parts import persistence, shape

from remit_core import effect
from remit_core.errors import ForkWithoutIntent, ResumeConflict
from remit_pydantic_graph import RemitStatePersistence

# -- the counting graph and what its nodes did ----------------------------------------------

#: (amount, idempotency key) of every application of `bump`, in order.
APPLIED: list[tuple[int, str]] = []


@effect(idempotent=True)
async def bump(amount: int, *, idempotency_key: str) -> int:
    APPLIED.append((amount, idempotency_key))
    return amount


class Boom(Exception):
    """A node that fails after its effect."""


@dataclass
class Tally:
    n: int = 0


@dataclass
class Driver:
    """One driver's step: the node signals `inside`, then waits for `go`."""

    name: int
    inside_now: set[int]
    inside: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    fail: bool = False


@dataclass
class Count(BaseNode[Tally, Driver, int]):
    async def run(self, ctx: GraphRunContext[Tally, Driver]) -> Count | End[int]:
        me = ctx.deps
        assert not me.inside_now, f"driver {me.name} entered a node drivers {me.inside_now} are in"
        me.inside_now.add(me.name)
        try:
            me.inside.set()
            await me.go.wait()
            await bump(ctx.state.n)
            if me.fail:
                raise Boom(ctx.state.n)
            ctx.state.n += 1
        finally:
            me.inside_now.discard(me.name)
        return End(ctx.state.n) if ctx.state.n >= 3 else Count()


counting = Graph(nodes=(Count,))


async def one_step(p: RemitStatePersistence[Any, Any], me: Driver) -> object:
    """pydantic-graph's documented step: restore from the persistence, run one node."""
    async with counting.iter_from_persistence(p, deps=me) as run:
        return await run.next()


class Drivers(RuleBasedStateMachine):
    """Three drivers of one run, in one event loop."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        APPLIED.clear()
        self.url, self.loop = url, loop
        self.run_id = f"run-{uuid.uuid4().hex}"
        self.inside_now: set[int] = set()
        self.instances: dict[int, RemitStatePersistence[Any, Any]] = {}
        self.steps: dict[int, tuple[asyncio.Task[object], Driver]] = {}
        self.ended = False
        self.loaded: set[int] = set()  # drivers holding a node `load_next` handed them
        start = self.instance(0)
        self.loop.run_until_complete(counting.initialize(Count(), start, state=Tally()))

    def instance(self, i: int) -> RemitStatePersistence[Any, Any]:
        if i not in self.instances:
            self.instances[i] = persistence(self.url, self.run_id, counting)
        return self.instances[i]

    def wait(self, task: asyncio.Task[object], me: Driver) -> None:
        """Run the loop until the driver's step is inside its node or done."""
        inside = self.loop.create_task(me.inside.wait())
        self.loop.run_until_complete(
            asyncio.wait((task, inside), return_when=asyncio.FIRST_COMPLETED)
        )
        inside.cancel()
        self.loop.run_until_complete(asyncio.gather(inside, return_exceptions=True))

    def settle(self, task: asyncio.Task[object]) -> BaseException | object:
        self.loop.run_until_complete(asyncio.wait((task,)))
        if task.cancelled():
            return asyncio.CancelledError()
        return task.exception() or task.result()

    def note(self, outcome: object) -> None:
        if isinstance(outcome, End):
            assert not self.ended, "a second End"
            self.ended = True

    @rule(i=st.integers(0, 2))
    def begin(self, i: int) -> None:
        if i in self.steps:
            return
        free = not self.inside_now and not self.ended and not self.loaded
        me = Driver(i, self.inside_now)
        task = self.loop.create_task(one_step(self.instance(i), me))
        self.wait(task, me)
        if not task.done():
            self.steps[i] = (task, me)
            self.loaded.discard(i)  # (a node it loaded, its lease run out, was run by another)
            return
        outcome = self.settle(task)
        if isinstance(outcome, BaseException):
            # Another driver is inside a node (its claim), or the run has ended.
            assert isinstance(outcome, (ResumeConflict, GraphRuntimeError)), repr(outcome)
            assert not free, f"driver {i} was refused a free run: {outcome!r}"
        else:
            pytest.fail(f"driver {i} ran a node without entering it: {outcome!r}")

    @rule(i=st.integers(0, 2), fail=st.booleans())
    def finish(self, i: int, fail: bool) -> None:
        if i not in self.steps:
            return
        task, me = self.steps.pop(i)
        me.fail = fail
        me.go.set()
        outcome = self.settle(task)
        if fail:
            assert isinstance(outcome, Boom), repr(outcome)
        else:
            assert isinstance(outcome, (Count, End)), repr(outcome)
            self.note(outcome)

    @rule(i=st.integers(0, 2))
    def cancel(self, i: int) -> None:
        if i not in self.steps:
            return
        task, _ = self.steps.pop(i)
        task.cancel()
        assert isinstance(self.settle(task), asyncio.CancelledError)

    @rule(i=st.integers(0, 2))
    def fresh(self, i: int) -> None:
        """The docs' pattern: a new persistence instance for the next step (an instance
        left holding a loaded node would keep its claim until its lease ran out)."""
        if i not in self.steps and i not in self.loaded:
            self.instances.pop(i, None)

    @rule(i=st.integers(0, 2))
    def load(self, i: int) -> None:
        """A worker looks at the next node (`load_next`) and leaves it for now."""
        if i in self.steps or i in self.loaded:
            return
        free = not self.inside_now and not self.ended and not self.loaded
        try:
            loaded = self.loop.run_until_complete(self.instance(i).load_next())
        except ResumeConflict:
            assert not free, f"driver {i} was refused a free run"
            return
        assert (loaded is None) == self.ended, loaded
        if loaded is not None:
            self.loaded.add(i)

    @rule(i=st.integers(0, 2))
    def release(self, i: int) -> None:
        if i in self.loaded and i not in self.steps:
            self.instance(i).release()
            self.loaded.discard(i)

    @rule(i=st.integers(0, 3))
    def edit(self, i: int) -> None:
        """An operator's edit of the state (the same count, stored again) through a
        driver's instance or one of its own (3): taken only while the run is free."""
        if i in self.steps:
            return
        free = not self.inside_now and not self.ended and not self.loaded
        p = persistence(self.url, self.run_id, counting) if i == 3 else self.instance(i)
        line = self.loop.run_until_complete(p.load_all())
        try:
            edited = self.loop.run_until_complete(p.update_state(Tally(line[-1].state.n)))
        except ResumeConflict:
            assert not free, f"an edit through {i} was refused on a free run"
            return
        assert edited.state == line[-1].state and not self.ended
        self.loaded.discard(i)  # an edit through the instance gives back the node it loaded

    @invariant()
    def line_is_sound(self) -> None:
        reader = persistence(self.url, self.run_id, counting)
        paused = self.loop.run_until_complete(reader.paused())
        if not self.loaded:
            assert (paused is not None) == (not self.ended and not self.steps), paused
        line = self.loop.run_until_complete(reader.load_all())
        kinds = shape(line)
        ends = [k for k in kinds if k == ("End", "end")]
        assert len(ends) <= 1 and (not ends or kinds[-1] == ends[0]), kinds
        running = [k for k in kinds if k[1] == "running"]
        assert len(running) == len(self.steps) <= 1, (kinds, sorted(self.steps))

    def teardown(self) -> None:
        for i in list(self.steps):
            self.cancel(i)
        for i in list(self.loaded):
            self.release(i)
        last = None
        for _ in range(6):  # three nodes, each run once from here
            if self.ended:
                break
            me = Driver(9, self.inside_now)
            me.go.set()
            last = self.settle(
                self.loop.create_task(one_step(persistence(self.url, self.run_id, counting), me))
            )
            assert isinstance(last, (Count, End)), repr(last)
            self.note(last)
        assert self.ended
        end = self.loop.run_until_complete(persistence(self.url, self.run_id, counting).load_all())[
            -1
        ]
        assert end.kind == "end" and end.result.data == 3 and end.state == Tally(3)
        assert [amount for amount, _ in APPLIED] == [0, 1, 2], APPLIED
        assert max(Counter(key for _, key in APPLIED).values()) == 1


def test_drivers_interleaving_steps_run_each_node_once_and_leave_no_claim(url: str) -> None:
    """P1/P2/L1 in one process: random interleavings of three drivers' steps (finished,
    failed after the effect, cancelled inside the node; instances kept or made anew)."""
    loop = asyncio.new_event_loop()
    try:
        run_state_machine_as_test(
            lambda: Drivers(url, loop),
            settings=settings(
                max_examples=25,
                stateful_step_count=12,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
                database=None,
            ),
        )
    finally:
        loop.close()


# -- the interface in the odd orders pydantic-graph allows ----------------------------------


@dataclass
class First(BaseNode[Tally, None, int]):
    async def run(self, ctx: GraphRunContext[Tally]) -> Second:
        ctx.state.n += 1
        return Second()


@dataclass
class Second(BaseNode[Tally, None, int]):
    async def run(self, ctx: GraphRunContext[Tally]) -> End[int]:
        return End(ctx.state.n)


pair = Graph(nodes=(First, Second))


async def started(p: Any) -> Any:
    p.set_graph_types(pair)
    await pair.initialize(First(), p, state=Tally())
    return p


async def outcome(call: Any) -> object:
    try:
        return await call
    except Exception as exc:
        return exc


async def run_inside(p: Any, snapshot_id: str, inner: Any) -> object:
    """`record_run(snapshot_id)` around `inner()`, as a node body that lets what the
    inner call raised through: what the inner call gave."""
    seen: list[object] = []
    try:
        async with p.record_run(snapshot_id):
            seen.append(await outcome(inner()))
            if isinstance(seen[0], Exception):
                raise seen[0]
    except Exception as exc:
        if not seen:
            return exc
    return seen[0]


async def nested_record_run(p: Any) -> tuple[object, list[tuple[str, str]]]:
    """A `record_run` inside the `record_run` of the same node."""
    first = await p.load_next()

    async def inner() -> None:
        async with p.record_run(first.id):
            pass

    return await run_inside(p, first.id, inner), shape(await p.load_all())


async def store_from_inside(p: Any) -> tuple[object, list[tuple[str, str]]]:
    """A node body that stores a node on its own run (`snapshot_node` inside its
    `record_run`), instead of returning it to the graph."""
    first = await p.load_next()
    return await run_inside(p, first.id, lambda: p.snapshot_node(Tally(9), Second())), shape(
        await p.load_all()
    )


async def end_unrun(p: Any) -> tuple[object, list[tuple[str, str]]]:
    """`snapshot_end` of a run whose node was loaded, never run."""
    await p.load_next()
    return await outcome(p.snapshot_end(Tally(), End(7))), shape(await p.load_all())


async def if_new_of_stored(p: Any) -> list[Any]:
    """`snapshot_node_if_new` of the stored node's id, with another state."""
    line = await p.load_all()
    node = line[0].node
    await p.snapshot_node_if_new(node.get_snapshot_id(), Tally(5), node)
    return [s.state for s in await p.load_all()]


def test_odd_orders_of_the_interface_as_pydantic_graphs_own_persistence_or_refused(
    url: str,
) -> None:
    """Each odd order, on pydantic-graph's `FullStatePersistence` and on Remit: Remit
    answers as it does, or refuses typed where it would store a line no graph run makes
    (a node stored by a node's body, an End after a node that never ran); a refused call
    stores nothing, and the run still ends once with the state it would have had."""

    def remit() -> Any:
        return persistence(url, f"run-{uuid.uuid4().hex}", pair)

    async def go() -> None:
        for make in (FullStatePersistence, remit):
            p = await started(make())
            assert await p.load_next() is not None
            assert await p.load_next() is None  # a second load_next from the same caller
            unknown = await outcome(run_inside(p, "First:unknown", lambda: asyncio.sleep(0)))
            assert isinstance(unknown, LookupError), unknown

        # A record_run nested in its own node's: refused; the node ends `error` and
        # runs again.
        refused, line = await nested_record_run(await started(FullStatePersistence()))
        assert isinstance(refused, GraphNodeStatusError) and line == [("First", "error")]
        p = await started(remit())
        refused, line = await nested_record_run(p)
        assert isinstance(refused, ResumeConflict), refused
        assert "one call at a time" in str(refused) and line == [("First", "error")]
        async with pair.iter_from_persistence(p) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == 1
        assert shape(await p.load_all()) == [
            ("First", "success"),
            ("Second", "success"),
            ("End", "end"),
        ]

        # A node body that stores a node on its own run: pydantic-graph's persistence
        # stores it (the graph will store the node the body returns as well); Remit
        # refuses it and stores nothing of it.
        stored, line = await store_from_inside(await started(FullStatePersistence()))
        assert stored is None and line == [("First", "success"), ("Second", "created")]
        p = await started(remit())
        stored, line = await store_from_inside(p)
        assert isinstance(stored, ResumeConflict) and line == [("First", "error")], (stored, line)
        async with pair.iter_from_persistence(p) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == 1
        ends = [s for s in await p.load_all() if s.kind == "end"]
        assert len(ends) == 1 and ends[0].state == Tally(1)

        # An End stored for a node that never ran: pydantic-graph's persistence appends
        # it (twice, if asked twice); Remit refuses it as a new start, storing nothing.
        p = await started(FullStatePersistence())
        assert await end_unrun(p) == (None, [("First", "pending"), ("End", "end")])
        stored, line = await end_unrun(p)
        assert stored is None and line == [("First", "pending"), ("End", "end"), ("End", "end")]
        p = await started(remit())
        for _ in range(2):
            refused, line = await end_unrun(p)
            assert isinstance(refused, ForkWithoutIntent), refused
            assert line == [("First", "pending")]
        p.release()
        assert (await pair.run(First(), state=Tally(), persistence=remit())).output == 1

        # snapshot_node_if_new of a stored id: nothing is stored, on both.
        assert await if_new_of_stored(await started(remit())) == [Tally(0)]
        assert await if_new_of_stored(await started(FullStatePersistence())) == [Tally(0)]

    asyncio.run(go())
