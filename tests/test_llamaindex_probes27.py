"""LlamaIndex probes, round 27, on SQLite, PostgreSQL and Redis: racing recoveries of a
run whose answer was accepted but not delivered, steps with several workers paying at
once, a retried step whose effect raised, several open waiters told apart by
`waiter_id`, and a fan-in by `ctx.collect_events` SIGKILLed between collected events.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay, payments
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core import NOT_APPLIED, effect, failpoints
from remit_core.errors import ResumeConflict, UnknownRecord
from remit_llamaindex import RemitRuntime

TESTS = str(Path(__file__).parent)
RECOVERERS = 4


def new_run() -> str:
    return f"probe27-{uuid.uuid4().hex[:12]}"


class Asking(Workflow):
    """Asks the classic way (`InputRequiredEvent` returned), then pays a note for the
    answer in the step that takes the `HumanResponseEvent`."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> InputRequiredEvent:
        enter("ask")
        pay("asked")
        return InputRequiredEvent(prefix="note?")

    @step
    async def note(self, ctx: Context, ev: HumanResponseEvent) -> StopEvent:
        enter("note")
        return StopEvent(result=pay("note-" + ev.response))


class Waiting(Workflow):
    """Waits inside its step (`ctx.wait_for_event`), then pays a note for the answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def note(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("note")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="note?"), timeout=None
        )
        return StopEvent(result=pay("note-" + answer.response))


FLOWS = {"ask": Asking, "wait": Waiting}

ANSWER_AND_DIE = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from llamaindex_parts import until_parked
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes27 import FLOWS

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = FLOWS[{kind!r}](runtime=rt)
    handler = flow.run(run_id={run!r})
    await until_parked(rt, {run!r})
    print("PARKED", flush=True)
    await rt.respond(flow, {run!r}, HumanResponseEvent(response="yes"))
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""

RECOVER = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes27 import FLOWS

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = FLOWS[{kind!r}](runtime=rt)
    rt.status({run!r})  # (connected before the start)
    print("READY", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 60
    while True:
        try:
            handler = rt.recover(flow, {run!r})
            break
        except ResumeConflict:
            assert time.monotonic() < deadline, "never recovered"
            await asyncio.sleep(0.02)
    if handler is None:
        print("NOTHING", rt.status({run!r}), flush=True)
    else:
        print("RESULT", await asyncio.wait_for(handler, 40), flush=True)

asyncio.run(main())
"""


def recover_together(url: str, run: str, kind: str, tmp: Path) -> list[str]:
    """Start `RECOVERERS` processes recovering `run`, release them together once all
    are ready (a barrier on their stdin), and give back each one's last line."""
    code = RECOVER.format(tests=TESTS, url=url, run=run, kind=kind)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, DIR_VAR: str(tmp)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(RECOVERERS)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("READY"), (line, p.communicate())
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lasts = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (out, err)
        lasts.append(out.splitlines()[-1])
    return lasts


@pytest.mark.parametrize("kind", ["ask", "wait"])
@pytest.mark.parametrize("attempt", range(2))
def test_recoverers_racing_for_an_accepted_answer_pay_the_note_once(
    store_url: str, tmp_path: Path, kind: str, attempt: int
) -> None:
    """P2, P5, P6: the process answering the run is SIGKILLed right after the answer's
    interrupt was consumed, before the answer reached the run; four processes then
    recover the run at once. One delivers the accepted answer, the run ends paying the
    note once, and every other recoverer finds the run ended, with nothing run twice.
    (Before, a recoverer that read the head waiting and then, once the winner had ended
    the run, read it again to build its context, ran that context of an ended run: a
    new run from the start under another id, which paid the first step's effect again
    and waited for ever for an answer.)"""
    del attempt
    run = new_run()
    dead = subprocess.run(
        [
            sys.executable,
            "-c",
            ANSWER_AND_DIE.format(tests=TESTS, url=store_url, run=run, kind=kind),
        ],
        env={
            **os.environ,
            DIR_VAR: str(tmp_path),
            "REMIT_FAILPOINTS": "interrupt.after_consume=kill",
        },
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert dead.returncode == -9, (dead.stdout, dead.stderr)
    assert "note-yes" not in applied(tmp_path)
    lasts = recover_together(store_url, run, kind, tmp_path)
    paid = ["asked", "note-yes"] if kind == "ask" else ["note-yes"]
    assert applied(tmp_path) == paid, (lasts, payments(tmp_path))
    assert lasts.count("RESULT note-yes") == 1, lasts
    assert sorted(lasts)[:-1] == ["NOTHING completed"] * (RECOVERERS - 1), lasts
    steps = entered(tmp_path)
    assert steps.count("ask") == (1 if kind == "ask" else 0), steps


# -- several workers paying at once; a fan-in SIGKILLed between its collected events ------


class Item(Event):
    i: int


class Done(Event):
    i: int
    paid: str


class FanIn(Workflow):
    """`start` sends four `Item`s; `work` (four workers) pays twice for each item, the
    payments off the event loop so that the workers really overlap; `join` collects
    the four `Done` and pays for the lot."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        enter("start")
        for i in range(4):
            ctx.send_event(Item(i=i))
        return None

    @step(num_workers=4)
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter(f"work{ev.i}")
        first = await asyncio.to_thread(pay, f"item{ev.i}a")
        second = await asyncio.to_thread(pay, f"item{ev.i}b")
        return Done(i=ev.i, paid=f"{first}/{second}")

    @step
    async def join(self, ctx: Context, ev: Done) -> StopEvent | None:
        got = ctx.collect_events(ev, [Done] * 4)
        enter(f"join{ev.i}")
        if got is None:
            return None
        return StopEvent(result=pay("all:" + "+".join(sorted(e.paid for e in got))))


FAN_RESULT = "all:" + "+".join(f"item{i}a/item{i}b" for i in range(4))
FAN_PAID = sorted([FAN_RESULT, *(f"item{i}{x}" for i in range(4) for x in "ab")])

START = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes27 import {flow}

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    print("RESULT", await {flow}(runtime=rt).run(run_id={run!r}), flush=True)

asyncio.run(main())
"""


def start_killed(url: str, flow: str, run: str, tmp: Path, point: str) -> None:
    """Start `run` of `flow` in a process of its own, SIGKILLed at failpoint `point`."""
    dead = subprocess.run(
        [sys.executable, "-c", START.format(tests=TESTS, url=url, flow=flow, run=run)],
        env={**os.environ, DIR_VAR: str(tmp), "REMIT_FAILPOINTS": point},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert dead.returncode == -9, (dead.stdout, dead.stderr)


@pytest.mark.parametrize(
    "point", ["effect.after_apply=kill@3", "step.after=kill@3", "step.after=kill@5"]
)
def test_a_fan_in_killed_between_collected_events_fires_once_with_each_event(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """P1, P2: four workers pay at once; the process is SIGKILLed after some payments
    (or after the join collected some of the `Done` events and that was committed).
    Recovered in another process, the join fires once with the four `Done` (none lost
    from its buffer, none collected twice), each payment was applied once, and no
    completed worker and no collected `Done` is taken again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    start_killed(store_url, "FanIn", run, tmp_path, point)

    async def recover() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        for _ in range(200):  # (the dead process's claim holds until its lease runs out)
            try:
                handler = rt.recover(FanIn(runtime=rt), run)
                break
            except ResumeConflict:
                await asyncio.sleep(0.05)
        assert handler is not None
        return await handler

    assert asyncio.run(recover()) == FAN_RESULT
    assert sorted(applied(tmp_path)) == FAN_PAID, payments(tmp_path)
    steps = entered(tmp_path)
    assert steps.count("start") == 1, steps
    for i in range(4):  # (once, and once more if in flight at the crash)
        assert 1 <= steps.count(f"work{i}") <= 2, steps


# -- several waiters open at once, told apart by `waiter_id` -----------------------------


class Ask(InputRequiredEvent):
    i: int


class Yes(HumanResponseEvent):
    i: int


class Waiters(Workflow):
    """Three workers each wait for their own `Yes` (a `waiter_id` and requirements of
    their own), then pay for their item; `join` collects the three."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        enter("start")
        for i in range(3):
            ctx.send_event(Item(i=i))
        return None

    @step(num_workers=3)
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter(f"work{ev.i}")
        answer = await ctx.wait_for_event(
            Yes,
            waiter_event=Ask(i=ev.i, prefix=f"item {ev.i}?"),
            waiter_id=f"item-{ev.i}",
            requirements={"i": ev.i},
            timeout=None,
        )
        return Done(i=ev.i, paid=pay(f"item{ev.i}-{answer.response}"))

    @step
    async def join(self, ctx: Context, ev: Done) -> StopEvent | None:
        got = ctx.collect_events(ev, [Done] * 3)
        if got is None:
            return None
        return StopEvent(result="+".join(sorted(e.paid for e in got)))


PARK = """
import asyncio, os, sys
sys.path.insert(0, {tests!r})
from llamaindex_parts import until_parked
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes27 import Waiters, open_waits

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    Waiters(runtime=rt).run(run_id={run!r})
    await open_waits(rt, {run!r}, 3)
    os._exit(0)

asyncio.run(main())
"""


async def open_waits(rt: RemitRuntime, run: str, n: int) -> tuple[str, ...]:
    """Until the stored head of `run` is parked waiting on `n` interrupts; their ids."""
    for _ in range(400):
        try:
            head = (await asyncio.to_thread(rt.checkpoints, run))[0]
            if head.status == "waiting" and len(head.waiting) == n:
                return head.waiting
        except UnknownRecord:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} never parked on {n} waiters")


ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes27 import Waiters, Yes, open_waits

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = Waiters(runtime=rt)
    try:
        handler = await rt.respond(flow, {run!r}, Yes(i={i}, response={response!r}))
    except ResumeConflict as exc:
        print("REFUSED", exc, flush=True)
        return
    if {left}:
        await open_waits(rt, {run!r}, {left})
        print("PARKED", flush=True)
        handler.cancel_run()  # (stops this copy; the stored run stays parked)
    else:
        print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


def answer_in_process(url: str, run: str, tmp: Path, i: int, response: str, left: int) -> str:
    code = ANSWER.format(tests=TESTS, url=url, run=run, i=i, response=response, left=left)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout.splitlines()[-1]


def test_waiters_open_at_once_take_each_their_own_answer_in_other_processes(
    store_url: str, tmp_path: Path
) -> None:
    """P5: three workers wait at once, each with its own `waiter_id`; answered out of
    order, each from a new process, each answer reaches its own waiter once, a second
    answer to a waiter already answered is refused (and reaches no other waiter), and
    the run ends paying each item once with the answer it was given."""
    run = new_run()
    parked = subprocess.run(
        [sys.executable, "-c", PARK.format(tests=TESTS, url=store_url, run=run)],
        env={**os.environ, DIR_VAR: str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert parked.returncode == 0, (parked.stdout, parked.stderr)
    assert answer_in_process(store_url, run, tmp_path, 2, "two", 2) == "PARKED"
    again = answer_in_process(store_url, run, tmp_path, 2, "again", 2)
    assert again.startswith("REFUSED"), again
    assert answer_in_process(store_url, run, tmp_path, 0, "zero", 1) == "PARKED"
    last = answer_in_process(store_url, run, tmp_path, 1, "one", 0)
    assert last == "RESULT item0-zero+item1-one+item2-two", last
    assert sorted(applied(tmp_path)) == ["item0-zero", "item1-one", "item2-two"]
    assert RemitRuntime(store_url).status(run) == "completed"


# -- a worker pays while another worker's checkpoint is being written ----------------------

FIRST_PAID = threading.Event()


def commit_held() -> None:
    """Until a thread of this process is held at the `checkpoint.before_commit` point (the
    checkpoint built, not yet written)."""
    for _ in range(2000):
        if any(f.f_code is failpoints.hit.__code__ for f in sys._current_frames().values()):
            return
        time.sleep(0.005)
    raise AssertionError("no commit reached checkpoint.before_commit")


class Overlap(Workflow):
    """Two workers: `work` of item 1 pays, and pays again while the checkpoint of item 0's
    result is being written (held at `checkpoint.before_commit`); `join` collects both."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        for i in range(2):
            ctx.send_event(Item(i=i))
        return None

    @step(num_workers=2)
    async def work(self, ctx: Context, ev: Item) -> Done:
        if ev.i == 0:
            assert await asyncio.to_thread(FIRST_PAID.wait, 30)
            failpoints.arm("checkpoint.before_commit", "sleep:2")  # (this result's commit)
            return Done(i=0, paid="-")
        first = pay("b1")
        FIRST_PAID.set()
        await asyncio.to_thread(commit_held)
        return Done(i=1, paid=f"{first}/{pay('b2')}")

    @step
    async def join(self, ctx: Context, ev: Done) -> StopEvent | None:
        got = ctx.collect_events(ev, [Done] * 2)
        if got is None:
            return None
        return StopEvent(result="+".join(sorted(e.paid for e in got)))


def test_an_effect_paid_while_another_workers_checkpoint_is_written_leaves_it_readable(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P4, P6: a worker's effect call made while the checkpoint of another worker's
    result is being written (its metadata built, its write not done) must not change
    what that checkpoint stores. Before, the stored metadata took the later call count
    while the copy sealed in the body kept the earlier one, so the valid checkpoint read
    back as `CorruptRecord` ("metadata does not match the copy sealed in its body"): a
    recovery from it, a fork of it and the run's history all refused."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    FIRST_PAID.clear()
    run = new_run()
    rt = RemitRuntime(store_url, lease=1)
    try:

        async def main() -> Any:
            return await Overlap(runtime=rt).run(run_id=run)

        result = asyncio.run(main())
    finally:
        failpoints.disarm("checkpoint.before_commit")
    assert result == "-+b1/b2"
    assert sorted(applied(tmp_path)) == ["b1", "b2"]
    listed = rt.checkpoints(run)  # (every checkpoint verified)
    assert listed[0].status == "completed"
    for n, cp in enumerate(listed[1:]):  # (a fork of each is refused for no reason)
        assert rt.fork(run, cp.checkpoint_id, f"back-{n}").startswith(run)


# -- a retried worker whose effect raised, next to a worker that pays ----------------------

TRIES: dict[str, int] = {}


def _reconcile_flaky(key: str) -> Any:
    hits = [line.split()[1] for line in payments(Path(os.environ[DIR_VAR])) if line.startswith(key)]
    return hits[0] if hits else NOT_APPLIED


@effect(reconcile=_reconcile_flaky)
def flaky(what: str, *, idempotency_key: str) -> str:
    """Times out before reaching its target on its first call (nothing applied)."""
    TRIES[what] = TRIES.get(what, 0) + 1
    if TRIES[what] == 1:
        raise TimeoutError(f"{what}: the target timed out")
    with (Path(os.environ[DIR_VAR]) / "sink.txt").open("a") as f:
        f.write(f"{idempotency_key} {what}\n")
    return what


class Retried(Workflow):
    """Three workers under a retry policy: item 0 pays, then fails once after paying;
    item 1's effect raises on its first call; item 2 pays in between."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        for i in range(3):
            ctx.send_event(Item(i=i))
        return None

    @step(num_workers=3, retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(2)))
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter(f"work{ev.i}")
        if ev.i == 0:
            paid = await asyncio.to_thread(pay, "item0")
            if entered(Path(os.environ[DIR_VAR])).count("work0") == 1:
                raise ConnectionError("the step failed after its payment")
            return Done(i=0, paid=paid)
        if ev.i == 1:
            return Done(i=1, paid=await asyncio.to_thread(flaky, "item1"))
        return Done(i=2, paid=await asyncio.to_thread(pay, "item2"))

    @step
    async def join(self, ctx: Context, ev: Done) -> StopEvent | None:
        got = ctx.collect_events(ev, [Done] * 3)
        if got is None:
            return None
        return StopEvent(result="+".join(sorted(e.paid for e in got)))


def test_retried_workers_find_their_recorded_effects_and_apply_a_raised_one_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P2 with a step `retry_policy` and workers in parallel: the retry of a worker that
    failed after paying gets the recorded payment back (not paid again); the retry of a
    worker whose effect raised before reaching its target applies it once (through
    `reconcile`); the other worker pays once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    TRIES.clear()
    run = new_run()
    rt = RemitRuntime(store_url, lease=1)

    async def main() -> Any:
        return await Retried(runtime=rt).run(run_id=run)

    assert asyncio.run(main()) == "item0+item1+item2"
    assert sorted(applied(tmp_path)) == ["item0", "item1", "item2"]
    assert TRIES == {"item1": 2}
    steps = entered(tmp_path)
    assert steps.count("work0") == 2 and steps.count("work1") == 2, steps
    assert steps.count("work2") == 1, steps
    assert rt.status(run) == "completed" and len(rt.checkpoints(run)) > 1
