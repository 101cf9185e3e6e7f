"""Outside probes of `RemitStatePersistence`, round 44: a node that sends several effects
at once (`asyncio.gather`, two with keys of their own and one without, reaching their
target in a random order) SIGKILLed after some of them reached it, or cancelled from
outside (`asyncio.wait_for`, `task.cancel()`) while one is in flight, and continued by
another process; a run paused at a node that the next deployment renamed or removed;
one instance shared by two threads; and the interface's write methods called directly
by a second process while a first runs the head node; on SQLite, PostgreSQL and Redis,
in real forked processes.

Found (fixed in the core): a node whose `asyncio.gather` sibling raised while its
payment was still on its way gave its claim back at once (the shim's `record_run`
marks the node failed and releases). Another process then found the payment's intent
without an outcome under a claim no longer held, took it for one in doubt, was told
"not applied" by `reconcile` (true at that moment) and posted again; then the first
post landed. A claim given up while effect calls of it still run in its process is
now kept for them, renewed, and released when the last ends: the other process gets
`ResumeConflict` meanwhile, then the recorded outcome. A retry in the same process
takes the kept claim over at once, as before. Kept as a strict expected failure: the
same with the node cancelled while the payment's blocking call runs in a thread of
its own (`asyncio.to_thread`): the effect call ends with the cancel, and a thread it
leaves running is invisible to Remit.

What held is kept as regression tests.

- A node killed after one or two of its three concurrent effects reached their target
  is run again by another process once the lease runs out: the keyed mails and the
  unkeyed audit are each applied once (none sent again and caught by the key rule),
  whatever order each process's calls reach the sink in, and the history is that of
  an uninterrupted run.
- A node cancelled from outside while one of its concurrent effects is in flight
  (before or after it reached its target) is given back: another process continues it
  at once (a 30 s lease, never `ResumeConflict`), each effect is applied once, the
  node before is not run again.
- A run paused at a node the next deployment renamed (same workflow version, or a new
  one that accepts the old) or removed is refused by every entry point (`load_next`,
  `iter_from_persistence`, `load_all`, `paused`, `resume`, `update_state`, `fork`) with
  `VersionMismatch` naming the node; nothing is written, no claim is held, and the old
  deployment answers it and ends it at once.
- One instance driven by two threads at once (each its own event loop, starting or
  continuing the run): one proceeds, the other gets `ResumeConflict` ("one call at a
  time"), the effect applies once and the run ends.
- While one process runs the head node (inside `record_run`), another's
  `snapshot_node`, `snapshot_node_if_new`, `snapshot_end`, `record_run` and
  `load_next` are refused (`ForkWithoutIntent` or `ResumeConflict`), nothing is
  written, and the first process ends the run as if alone.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import NodeSnapshot
from pydantic_graph_parts import shape
from test_pydantic_graph_persistence import (
    GRAPH,
    Answer,
    Done,
    Order,
    Pay,
    Start,
    World,
    drive,
    fresh,
    in_child,
    statuses,
)
from test_pydantic_graph_probes30 import hand_step
from test_pydantic_graph_probes43 import LONG, SHORT, after_lease

from remit_core import ForkWithoutIntent, ResumeConflict, VersionMismatch, arun_effect, failpoints
from remit_core.conformance.processes import fork
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- a node that sends three effects at once ----------------------------------------------


@dataclass
class Post:
    sent: list[str] = field(default_factory=list)


PostCtx = GraphRunContext[Post, World]


@dataclass
class Begin(BaseNode[Post, World, str]):
    async def run(self, ctx: PostCtx) -> Send:
        ctx.deps.enter("begin")
        return Send()


async def one(ctx: PostCtx, name: str, key: str | None) -> str:
    """One effect of `Send`: it awaits a random moment first, so the calls reach the sink
    in another order in each process. A file `hang-<name>-before` / `hang-<name>-after`
    in the world's folder makes the call wait (for a cancel) before or after it reached
    the sink."""
    sink, folder = ctx.deps.sink, ctx.deps.folder
    await asyncio.sleep(random.random() / 20)

    async def apply(idem: str) -> str:
        if (folder / f"hang-{name}-before").exists():
            (folder / f"{name}-in-flight").touch()
            await asyncio.sleep(60)
        receipt = sink.apply(name, idem)
        if (folder / f"hang-{name}-after").exists():
            (folder / f"{name}-in-flight").touch()
            await asyncio.sleep(60)
        return receipt

    return str(await arun_effect(name, apply, key=key, reconcile=sink.reconcile))


@dataclass
class Send(BaseNode[Post, World, str]):
    """Two mails with keys of their own and an audit entry without one, sent at once."""

    async def run(self, ctx: PostCtx) -> Finish:
        ctx.deps.enter("send")
        ctx.state.sent = list(
            await asyncio.gather(
                one(ctx, "mail", "mail:ann"), one(ctx, "mail", "mail:bob"), one(ctx, "audit", None)
            )
        )
        return Finish()


@dataclass
class Finish(BaseNode[Post, World, str]):
    async def run(self, ctx: PostCtx) -> End[str]:
        ctx.deps.enter("finish")
        return End(" ".join(ctx.state.sent))


POST = Graph(nodes=(Begin, Send, Finish), name="post")


def post(url: str, run_id: str, lease: float = LONG) -> RemitStatePersistence[Post, str]:
    p: RemitStatePersistence[Post, str] = RemitStatePersistence(url, run_id, lease=lease)
    p.set_graph_types(POST)
    return p


async def post_on(p: RemitStatePersistence[Post, str], world: World, start: Any = None) -> str:
    context = (
        POST.iter_from_persistence(p, deps=world)
        if start is None
        else POST.iter(start, state=Post(), deps=world, persistence=p)
    )
    async with context as run:
        async for _ in run:
            pass
    assert run.result is not None
    return str(run.result.output)


def check_sent_once(world: World, url: str, run_id: str, output: str) -> None:
    """Each of Send's three effects applied once, none sent again, and the End's output
    holds their receipts; the history is that of an uninterrupted run."""
    assert world.sink.counts() == {"mail": 2, "audit": 1}, world.sink.counts()
    assert not world.sink.repeats(), world.sink.repeats()
    applied = sorted(f"{name}:{key}" for name, key, _ in world.sink.applications())
    assert sorted(output.split()) == applied, (output, applied)
    line = asyncio.run(post(url, run_id).load_all())
    assert shape(line) == [
        ("Begin", "success"),
        ("Send", "success"),
        ("Finish", "success"),
        ("End", "end"),
    ], shape(line)
    assert world.entered()["begin"] == 1


@pytest.mark.parametrize("reached", [1, 2])
def test_a_node_killed_among_its_concurrent_effects_applies_each_once(
    store_url: str, run_id: str, world: World, reached: int
) -> None:
    """P1/P2: `Send` sends two keyed mails and an unkeyed audit entry at once, each after
    a random wait; its process is SIGKILLed once the first (or the second) of them
    reached the sink, before its outcome was recorded. Another process, with other
    random waits, continues the run once the lease runs out: every effect is applied
    once (the one killed in its flight is reconciled, the others return their recorded
    outcome), none is sent again, `Begin` does not run again, and the run ends with the
    three receipts."""

    def first() -> str:
        failpoints.arm("effect.after_apply", f"kill@{reached}")
        return asyncio.run(post_on(post(store_url, run_id, SHORT), world, Begin()))

    assert in_child(first).status == "killed"
    assert sum(world.sink.counts().values()) == reached

    def go_on() -> str:
        return asyncio.run(post_on(post(store_url, run_id), World(world.folder)))

    out = after_lease(go_on)
    assert out.ok, out.summary()
    check_sent_once(world, store_url, run_id, out.value)
    assert world.entered()["send"] == 2


@pytest.mark.parametrize("how", ["wait_for", "cancel"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_node_cancelled_with_an_effect_in_flight_is_taken_on_at_once(
    store_url: str, run_id: str, world: World, how: str, where: str
) -> None:
    """P1/P2/L1: the run is cancelled from outside (`asyncio.wait_for` timing out, or
    `task.cancel()`) while `Send`'s audit entry is in flight, before or after it reached
    the sink, its two mails done or on their way. Another process continues the run at
    once (30 s leases: a claim left behind would be `ResumeConflict`), with deps of its
    own: each effect applied once, and the node before not run again."""
    (world.folder / f"hang-audit-{where}").touch()

    def first() -> str:
        async def cut() -> str:
            task = asyncio.ensure_future(post_on(post(store_url, run_id), world, Begin()))
            while not (world.folder / "audit-in-flight").exists():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the mails reach the sink meanwhile
            if how == "wait_for":
                await asyncio.wait_for(task, 0.05)
            task.cancel()
            await task
            return "not cancelled"

        return asyncio.run(cut())

    cut = in_child(first)
    assert cut.raised("TimeoutError" if how == "wait_for" else "CancelledError"), cut.summary()
    assert world.sink.counts()["audit"] == (1 if where == "after" else 0)
    (world.folder / f"hang-audit-{where}").unlink()

    def go_on() -> str:
        return asyncio.run(post_on(post(store_url, run_id), World(world.folder)))

    out = in_child(go_on)
    assert out.ok, out.summary()
    check_sent_once(world, store_url, run_id, out.value)


# -- a node renamed or removed by the next deployment ---------------------------------------


@dataclass
class NewStart(BaseNode[Order, World, str]):
    async def run(self, ctx: GraphRunContext[Order, World]) -> Question:
        return Question()


@dataclass
class Question(BaseNode[Order, World, str]):
    """`Ask` as the next deployment calls it."""

    async def run(self, ctx: GraphRunContext[Order, World]) -> Answer:
        raise AssertionError("the pause never runs")


NewStart.__name__ = NewStart.__qualname__ = "Start"  # the same node, pointing at `Question`
RENAMED = Graph(nodes=(NewStart, Question, Answer, Pay, Done), name="order")
#: The next deployment took the question out: runs start at the answer.
REMOVED = Graph(nodes=(Answer, Pay, Done), name="order")


@pytest.mark.parametrize("deploy", ["renamed", "renamed-v2", "removed"])
def test_a_run_paused_at_a_node_the_next_deployment_lost_is_refused_and_left_whole(
    store_url: str, run_id: str, world: World, deploy: str
) -> None:
    """P4/L1: a run paused at `Ask`; the next deployment renamed it (`Question`, under
    the same workflow version, or under `v2` accepting the old one) or removed it. Each
    entry point of that deployment (`iter_from_persistence`, `load_next`, `load_all`,
    `paused`, `resume` with and without `pause_id`, `update_state`, `fork`) raises
    `VersionMismatch` naming `Ask`, in another process; nothing is written and no claim
    is held: the old deployment (30 s leases) answers it and ends it at once, the charge
    applied once."""
    p = RemitStatePersistence(store_url, run_id, lease=LONG)
    p.set_graph_types(GRAPH)
    assert asyncio.run(drive(p, world, Start())) == "paused"
    pause = asyncio.run(p.paused())
    assert pause is not None
    graph = REMOVED if deploy == "removed" else RENAMED
    options: dict[str, Any] = (
        {"workflow_version": "v2", "accept_versions": {""}} if deploy == "renamed-v2" else {}
    )

    def new() -> RemitStatePersistence[Any, Any]:
        q: RemitStatePersistence[Any, Any] = RemitStatePersistence(
            store_url, run_id, lease=LONG, **options
        )
        q.set_graph_types(graph)
        return q

    async def iterate() -> None:
        async with graph.iter_from_persistence(new(), deps=world) as run:
            async for _ in run:
                pass

    calls: dict[str, Callable[[], Any]] = {
        "iter_from_persistence": iterate,
        "load_next": lambda: new().load_next(),
        "load_all": lambda: new().load_all(),
        "paused": lambda: new().paused(),
        "resume": lambda: new().resume(Answer("eve")),
        "resume(pause_id)": lambda: new().resume(Answer("eve"), pause_id=pause.id),
        "update_state": lambda: new().update_state(fresh(), pause_id=pause.id),
        "fork": lambda: new().fork(pause.id, "retry"),
    }

    def every_call() -> list[str]:
        said = []
        for name, call in calls.items():
            try:
                asyncio.run(call())
            except VersionMismatch as exc:
                said.append(f"{name}: {exc}")
                continue
            raise AssertionError(f"{name} was not refused")
        return said

    out = in_child(every_call)
    assert out.ok, out.summary()
    assert len(out.value) == len(calls) and all("Ask" in said for said in out.value), out.value
    assert shape(asyncio.run(p.load_all())) == [("Start", "success"), ("Ask", "created")]

    def old_answers() -> Any:
        q = RemitStatePersistence(store_url, run_id, lease=LONG)
        q.set_graph_types(GRAPH)
        asyncio.run(q.resume(Answer("ann"), pause_id=pause.id))
        return asyncio.run(drive(q, World(world.folder)))

    done = in_child(old_answers)
    assert done.ok and done.value == "paid 100", done.summary()
    assert world.sink.counts() == {"charge": 1} and not world.sink.repeats()
    assert statuses(asyncio.run(p.load_all())) == ["success", "created"] + ["success"] * 3 + ["end"]


# -- one instance, two threads ----------------------------------------------------------


@pytest.mark.parametrize("entry", ["start", "continue"])
def test_one_instance_driven_by_two_threads_runs_the_run_once(
    store_url: str, run_id: str, world: World, entry: str
) -> None:
    """P5/P1: one instance handed to two threads, each driving the run in an event loop
    of its own at the same moment (both starting it from `Start`, or both continuing an
    answered pause): one proceeds, the other gets `ResumeConflict` saying an instance
    makes one call at a time; the charge is applied once and the run ends whole."""
    p = RemitStatePersistence(store_url, run_id, lease=LONG)
    p.set_graph_types(GRAPH)
    if entry == "continue":
        assert asyncio.run(drive(p, world, Start())) == "paused"
        asyncio.run(p.resume(Answer("ann")))
    gate = threading.Barrier(2)
    outcomes: list[str] = []

    def driver() -> None:
        gate.wait()
        try:
            outcomes.append(
                str(asyncio.run(drive(p, world, Start() if entry == "start" else None)))
            )
        except ResumeConflict as exc:
            outcomes.append(f"ResumeConflict: {exc}")

    threads = [threading.Thread(target=driver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    won = "paused" if entry == "start" else "paid 100"
    assert sorted(o[:14] for o in outcomes) == sorted([won, "ResumeConflict"]), outcomes
    assert "one call at a time" in next(o for o in outcomes if o.startswith("Resume"))
    if entry == "start":
        asyncio.run(p.resume(Answer("ann")))
        assert asyncio.run(drive(p, world)) == "paid 100"
    assert world.sink.counts() == {"charge": 1} and not world.sink.repeats()
    assert statuses(asyncio.run(p.load_all())) == ["success", "created"] + ["success"] * 3 + ["end"]
    assert world.entered()["start"] == 1


# -- the interface's writes from a second process while the first runs the head -------------


@dataclass
class Slow(BaseNode[Order, World, str]):
    """Holds its run until the world's folder has `go`."""

    async def run(self, ctx: GraphRunContext[Order, World]) -> Done:
        ctx.deps.enter("slow")
        (ctx.deps.folder / "inside").touch()
        while not (ctx.deps.folder / "go").exists():
            await asyncio.sleep(0.02)
        return Done()


SLOW = Graph(nodes=(Slow, Done), name="slow")


def slow(url: str, run_id: str) -> RemitStatePersistence[Order, str]:
    p: RemitStatePersistence[Order, str] = RemitStatePersistence(url, run_id, lease=LONG)
    p.set_graph_types(SLOW)
    return p


def test_direct_writes_of_a_second_process_during_a_node_are_refused(
    store_url: str, run_id: str, world: World
) -> None:
    """P1/P3/P5: a custom driver in one process loads the head node and runs it inside
    `record_run`. Meanwhile another process calls the interface's methods as a second
    driver would: `snapshot_node` (a new node, and the head again), `snapshot_node_if_new`
    of a new node, `snapshot_end`, `record_run` of the head and `load_next`. Each is
    refused (`ForkWithoutIntent` for a node or End written over a head, `ResumeConflict`
    for the running node; `snapshot_node_if_new` of the head's own id does nothing, as
    the interface says), nothing is written, and the first process ends the run as if
    alone."""
    asyncio.run(slow(store_url, run_id).snapshot_node(fresh(), Slow()))

    def custom_driver() -> list[tuple[str, str]]:
        async def go() -> list[tuple[str, str]]:
            p = slow(store_url, run_id)
            assert [await hand_step(p, world) for _ in range(2)] == ["Slow", "Done"]
            return shape(await p.load_all())

        return asyncio.run(go())

    driver = fork(custom_driver)
    try:
        wait_for_file(world.folder / "inside")

        async def second() -> list[str]:
            q = slow(store_url, run_id)
            head, other = (await q.load_all())[-1], Done()
            assert isinstance(head, NodeSnapshot)
            # the head's own id: stored already, so nothing to do (as in the framework)
            await q.snapshot_node_if_new(head.id, fresh(), head.node)
            calls: dict[str, Callable[[], Any]] = {
                "snapshot_node(new)": lambda: q.snapshot_node(fresh(), Done()),
                "snapshot_node(head)": lambda: q.snapshot_node(fresh(), head.node),
                "snapshot_node_if_new(new)": lambda: q.snapshot_node_if_new(
                    other.get_snapshot_id(), fresh(), other
                ),
                "snapshot_end": lambda: q.snapshot_end(fresh(), End("early")),
                "load_next": q.load_next,
            }
            said = []
            for name, call in calls.items():
                try:
                    got = await call()
                except (ForkWithoutIntent, ResumeConflict) as exc:
                    said.append(f"{name}: {type(exc).__name__}")
                    continue
                raise AssertionError(f"{name} was taken: {got!r}")
            try:
                async with q.record_run(head.id):
                    raise AssertionError("record_run of a running node was entered")
            except ResumeConflict:
                said.append("record_run: ResumeConflict")
            return said

        said = asyncio.run(second())
        assert len(said) == 6, said
        assert shape(asyncio.run(slow(store_url, run_id).load_all())) == [("Slow", "running")]
    finally:
        (world.folder / "go").touch()
    out = driver.wait(60)
    assert out.ok, out.summary()
    assert [tuple(s) for s in out.value] == [
        ("Slow", "success"),
        ("Done", "success"),
        ("End", "end"),
    ]
    assert world.entered() == {"slow": 1, "done": 1}


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


# -- an effect left in flight by its node: a sibling raised, or the node was cancelled -------


@dataclass
class Tally:
    sent: list[str] = field(default_factory=list)


@dataclass
class Fan(BaseNode[Tally, World, str]):
    """Posts a payment while it checks the order, at once (`asyncio.gather`). In the first
    attempt (`first` in the world's folder) the check raises at once, or the run is
    cancelled, while the post is still on its way: a blocking client call in a thread
    (`asyncio.to_thread`) or a coroutine, which reaches the payment API once the next
    attempt has posted (`retried` in the folder) or after the seconds `first` holds (5 s
    if none)."""

    async def run(self, ctx: GraphRunContext[Tally, World]) -> End[str]:
        ctx.deps.enter("fan")
        sink, folder = ctx.deps.sink, ctx.deps.folder
        first = (folder / "first").exists()
        wait = float((folder / "first").read_text() or 5) if first else 0.0

        def post(key: str) -> str:
            if first:
                deadline = time.monotonic() + wait
                while not (folder / "retried").exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            receipt = sink.apply("post", key)
            (folder / ("orphan-done" if first else "retried")).touch()
            return receipt

        async def pay() -> str:
            async def apply(key: str) -> str:
                (folder / "in-flight").touch()
                if (folder / "threaded").exists():
                    return await asyncio.to_thread(post, key)
                while first and not (folder / "retried").exists():
                    await asyncio.sleep(0.02)  # the async client's wait (bounded below)
                    if time.monotonic() > started + wait:
                        break
                return post(key)

            return str(await arun_effect("post", apply, reconcile=sink.reconcile))

        async def check() -> str:
            while not (folder / "in-flight").exists():
                await asyncio.sleep(0.01)
            if first and (folder / "check-fails").exists():
                raise ValueError("the order check failed")
            return "checked"

        started = time.monotonic()
        return End(" ".join(await asyncio.gather(pay(), check())))


FAN = Graph(nodes=(Fan,), name="fan")


def fan(url: str, run_id: str) -> RemitStatePersistence[Tally, str]:
    p: RemitStatePersistence[Tally, str] = RemitStatePersistence(url, run_id, lease=LONG)
    p.set_graph_types(FAN)
    return p


@pytest.mark.parametrize(
    "left",
    [
        "sibling-raised",
        pytest.param(
            "cancelled-in-thread",
            marks=pytest.mark.xfail(
                strict=True,
                reason="P2: an effect whose coroutine is cancelled while a thread it started "
                "(`asyncio.to_thread`) still posts: the effect call ends with the cancel, and "
                "the thread it leaves running is invisible to Remit; the claim is given up, "
                "and another process reconciles `NOT_APPLIED` and posts again (README limit)",
            ),
        ),
    ],
)
def test_an_effect_its_node_left_in_flight_is_not_posted_again_by_another_process(
    store_url: str, run_id: str, world: World, left: str
) -> None:
    """P2/L1: a long-lived worker (its event loop lives on) runs `Fan`, which posts a
    payment and checks the order at once. The check raises while the post is still on
    its way (`asyncio.gather` does not cancel the post), or the worker cancels the run
    (`asyncio.wait_for`) while the post's blocking call runs in a thread (which a
    cancel cannot stop). Either way the node ends while its effect is in flight in the
    worker. A second worker continues the run (again while it gets `ResumeConflict`):
    the payment is posted once; a post is never sent twice, here caught only by the
    payment API's key rule."""
    folder = world.folder
    (folder / "first").touch()
    (folder / ("check-fails" if left == "sibling-raised" else "threaded")).touch()

    def long_lived() -> str:
        async def serve() -> str:
            p = fan(store_url, run_id)
            try:
                if left == "sibling-raised":
                    await FAN.run(Fan(), state=Tally(), deps=world, persistence=p)
                else:
                    await asyncio.wait_for(
                        FAN.run(Fan(), state=Tally(), deps=world, persistence=p), 0.5
                    )
            except (ValueError, TimeoutError) as exc:
                (folder / "node-ended").write_text(type(exc).__name__)
            deadline = time.monotonic() + 20
            while not (folder / "orphan-done").exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the worker serves on; the post lands
            return "served"

        return asyncio.run(serve())

    server = fork(long_lived)
    try:
        wait_for_file(folder / "node-ended")
        (folder / "first").unlink()

        def go_on() -> str:
            return asyncio.run(go_fan(store_url, run_id, World(folder)))

        deadline = time.monotonic() + 30
        while True:
            out = in_child(go_on)
            if not out.raised("ResumeConflict") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        done = server.wait(60)
    assert done.ok, done.summary()
    assert out.ok, out.summary()
    assert world.sink.counts() == {"post": 1}
    assert not world.sink.repeats(), "the payment was posted twice"


async def go_fan(url: str, run_id: str, world: World) -> str:
    async with FAN.iter_from_persistence(fan(url, run_id), deps=world) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return str(run.result.output)


def test_an_effect_its_node_left_in_flight_is_not_posted_again_by_its_own_process(
    store_url: str, run_id: str, world: World
) -> None:
    """P2: as above, `Fan`'s check raises while its post is on its way, but the same
    process continues the run at once with a new instance (a worker's retry loop) while
    the post is still in flight in its event loop. The retry's post waits for the one
    in flight and gets its outcome: the payment is posted once."""
    folder = world.folder
    (folder / "first").write_text("1")  # the post lands after 1 s
    (folder / "check-fails").touch()

    def retry_loop() -> str:
        async def serve() -> str:
            with pytest.raises(ValueError):
                await FAN.run(Fan(), state=Tally(), deps=world, persistence=fan(store_url, run_id))
            (folder / "first").unlink()
            return await go_fan(store_url, run_id, World(folder))

        return asyncio.run(serve())

    out = in_child(retry_loop)
    assert out.ok, out.summary()
    assert world.sink.counts() == {"post": 1} and not world.sink.repeats()
    assert out.value.split()[0].startswith("post:")
    assert world.entered()["fan"] == 2
