"""LlamaIndex probe round 53, on SQLite, PostgreSQL and Redis: a payment still on its way
(its request sent, its answer not yet back: `reconcile` says "not applied" until it
lands) when the process's copy of the run stops or parks, and the run continued by
another process, in real processes. Each holds by the core's claim kept for an effect
call still running in its process: the shim's release paths (a stopped copy, a parked
run) honour it.

Found (core, kept as a strict expected failure): `Remit.close()` gives every claim up
with `force=True`, also one kept for an effect call still running in the process (a
worker that closes its `rt.remit` in a `finally` after its handler timed out). Another
process's `rt.recover` then re-runs the step at once, finds the payment's intent under
a claim no longer held, is told "not applied" and pays again; then the first payment
lands: two payments.

Held (kept as regression tests):

- A step pays and runs a check at once (`asyncio.gather`); the check raises while the
  payment is on its way and the step's `retry_policy` runs it again. The copy stopped
  there (the task awaiting the handler times out or is cancelled; or `ctx.to_dict()`
  taken, then the copy stopped, and restored with `Context.from_dict` elsewhere): the
  other process is held back until the payment landed, then gets its outcome; paid once.
- A copy stopped between two `ctx.send_event` of one step, the payment between them on
  its way: the other process's re-run sends the first event no second time, pays no
  second time, sends the second once.
- A step whose `gather` sibling raised goes on without its deposit's call and asks a
  question; the run parks with the call still running. Another process's answer is held
  back until the deposit landed (the answering step runs after it), then taken.
- A copy that timed out, was recovered in its own process (same or another
  `RemitRuntime`: the kept claim is taken over, the re-run's call waits for the first)
  and timed out again: another process still waits for the payment, and pays nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay, payments
from test_llamaindex_probes52 import recovered
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core import NOT_APPLIED, effect
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 60
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe53-{uuid.uuid4().hex[:12]}"


def _dir() -> Path:
    return Path(os.environ[DIR_VAR])


def _reconcile(key: str) -> Any:
    hits = [line.split()[1] for line in payments(_dir()) if line.split()[0] == key]
    return hits[0] if hits else NOT_APPLIED


@effect(reconcile=_reconcile)
async def late_pay(what: str, *, idempotency_key: str) -> str:
    """A payment whose request is on its way until the file "gate" appears, and lands
    then (a payment API slow to take it): until then `reconcile` says "not applied"."""
    enter(f"sent-{what}")
    for _ in range(GUARD * 100):
        if (_dir() / "gate").exists():
            break
        await asyncio.sleep(0.01)
    with (_dir() / "sink.txt").open("a") as f:
        f.write(f"{idempotency_key} {what}\n")
    enter(f"landed-{what}")
    return what


async def flaky_check() -> None:
    """Raises the first time it runs (across processes), at once."""
    marker = _dir() / "checked"
    if not marker.exists():
        marker.touch()
        await asyncio.sleep(0.05)
        raise RuntimeError("the check failed once")


class Gathered(Workflow):
    """One step that pays and checks at once; the check fails once, and the step is
    retried by its `retry_policy`."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step(retry_policy=retry_policy(wait=wait_fixed(0.2), stop=stop_after_attempt(5)))
    async def charge(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("charge")
        paid, _ = await asyncio.gather(late_pay("order"), flaky_check())
        return StopEvent(result=paid)


async def lived_on() -> None:
    """Until the gate opens, and a little after (the payment on its way lands then)."""
    while not (_dir() / "gate").exists():
        await asyncio.sleep(0.01)
    await asyncio.sleep(1.0)


async def restored(flow: Workflow, data: dict[str, Any]) -> Any:
    """`flow.run(ctx=Context.from_dict(...))`, retried while another holder keeps the run."""
    for _ in range(GUARD * 10):
        try:
            return flow.run(ctx=Context.from_dict(flow, data))
        except ResumeConflict:
            await asyncio.sleep(0.1)
    raise AssertionError("the snapshot never became restorable")


STOPPED = """
import asyncio, json, os, sys
sys.path.insert(0, {tests!r})
from llamaindex_sink import entered
from pathlib import Path
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes53 import {flow}, lived_on

async def main():
    tmp = Path(os.environ["LLAMAINDEX_PROBE_DIR"])
    rt = RemitRuntime({url!r}, lease=1)
    handler = {flow}(runtime=rt).run(run_id={run!r})
    while entered(tmp).count({mark!r}) < {count}:  # (the payment is on its way)
        await asyncio.sleep(0.01)
    how = {how!r}
    if how == "snapshot":  # (the framework's pause: the context to a file)
        (tmp / "ctx.json").write_text(json.dumps(handler.ctx.to_dict()))
    if how == "task_cancel":
        waiting = asyncio.ensure_future(handler)
        await asyncio.sleep(0.1)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            pass
    elif how == "cancel_run":
        await handler.cancel_run()
        try:
            await handler
        except Exception:
            pass
    else:
        try:
            await asyncio.wait_for(handler, 0.1)
        except asyncio.TimeoutError:
            pass
    if how == "close":
        rt.remit.close()
    print("STOPPED", flush=True)
    await lived_on()

asyncio.run(main())
"""


def continued_elsewhere(
    code: str, url: str, tmp: Path, run: str, go_on: Callable[[RemitRuntime], Awaitable[Any]]
) -> Any:
    """Run `code` in a process of its own until it prints its first line (its copy of
    the run stopped or parked while a payment is on its way; it lives on until the
    gate opens); meanwhile continue the run here with `go_on` (retrying while refused),
    open the gate three leases after it started, and return the run's result."""
    first = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stderr is not None
        assert first.stdout.readline().strip(), first.stderr.read()

        async def go() -> Any:
            rt = RemitRuntime(url, lease=1)
            try:

                async def open_gate() -> None:
                    await asyncio.sleep(3.0)  # (three leases: a claim not kept is free)
                    (tmp / "gate").touch()

                opener = asyncio.ensure_future(open_gate())
                handler = await go_on(rt)
                await opener
                assert handler is not None
                result = await asyncio.wait_for(handler, GUARD)
                assert rt.status(run) == "completed"
                assert rt.result(run) == result
                return result
            finally:
                rt.remit.close()

        result = asyncio.run(asyncio.wait_for(go(), GUARD * 2))
        _, err = first.communicate(timeout=GUARD)
        assert first.returncode == 0, err
        return result
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def stopped_then_recovered(
    url: str, tmp: Path, run: str, how: str, flow: type[Workflow], mark: str, count: int
) -> Any:
    """Run `flow` in a process of its own until the step marked `mark` was entered
    `count` times (a payment is on its way by then) and stop that copy of the run there
    (`how`); continue it here (`rt.recover`, or the snapshot the copy wrote restored)."""
    code = STOPPED.format(
        tests=TESTS, url=url, run=run, how=how, flow=flow.__name__, mark=mark, count=count
    )

    async def go_on(rt: RemitRuntime) -> Any:
        snapshot = tmp / "ctx.json"
        if snapshot.exists():
            return await restored(flow(runtime=rt), json.loads(snapshot.read_text()))
        return await recovered(rt, flow(runtime=rt), run)

    return continued_elsewhere(code, url, tmp, run, go_on)


CLOSED = pytest.mark.xfail(
    strict=True,
    reason="core: `Remit.close` releases every claim with force=True, also one kept for an "
    "effect call still running in the process; another process then reconciles the call "
    "on its way ('not applied') and applies it again",
)


@pytest.mark.parametrize(
    "how", ["wait_for", "task_cancel", "snapshot", pytest.param("close", marks=CLOSED)]
)
def test_a_gathered_payment_on_its_way_when_the_copy_stops_is_not_paid_again_elsewhere(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """P2, L1: a step pays and runs a check at once (`asyncio.gather`); the check raises
    while the payment is on its way, and the step's `retry_policy` runs it again, whose
    call of the payment waits for the first. The process's copy of the run is stopped
    there (the task awaiting the handler times out or is cancelled; or the process closes
    its `Remit` too) and the process lives on. Another process's `rt.recover` is refused
    while the payment is on its way, then re-runs the step, which gets the payment's
    outcome: it is paid once and the run completes with it."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    assert stopped_then_recovered(url, tmp_path, run, how, Gathered, "charge", 2) == "order"
    assert applied(tmp_path) == ["order"], entered(tmp_path)


# -- a copy stopped between two `ctx.send_event` of one step --------------------------


class Shipped(Event):
    pass


class Billed(Event):
    pass


class Ready(Event):
    what: str


class TwoSends(Workflow):
    """`start` sends `Shipped`, pays (the payment lands late), then sends `Billed`;
    each is handled by a step of its own, and `finish` gathers both."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Shipped | Billed | None:
        enter("start")
        ctx.send_event(Shipped())
        await late_pay("order")
        ctx.send_event(Billed())
        return None

    @step
    async def ship(self, ctx: Context, ev: Shipped) -> Ready:
        enter("ship")
        return Ready(what=pay("label"))

    @step
    async def bill(self, ctx: Context, ev: Billed) -> Ready:
        enter("bill")
        return Ready(what=pay("invoice"))

    @step
    async def finish(self, ctx: Context, ev: Ready) -> StopEvent | None:
        got = ctx.collect_events(ev, [Ready, Ready])
        if got is None:
            return None
        return StopEvent(result=sorted(e.what for e in got))


@pytest.mark.parametrize("how", ["wait_for", "task_cancel"])
def test_a_copy_stopped_between_two_sends_of_a_step_sends_each_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """P1, P2, L1: a step sent one event, then pays (on its way), then sends a second;
    the process's copy of the run is stopped while the payment is on its way, and the
    process lives on. Another process continues the run once the payment landed: the
    step runs again, its first send is not delivered again (the step it reaches ran
    once), the payment is not made again, the second event is sent once, and the run
    completes with both."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    result = stopped_then_recovered(url, tmp_path, run, how, TwoSends, "sent-order", 1)
    assert result == ["invoice", "label"]
    journal = entered(tmp_path)
    assert journal.count("bill") == 1, journal
    assert sorted(applied(tmp_path)) == ["invoice", "label", "order"], journal


# -- a step that parks the run while its gathered payment is on its way ------------------


class AskAfter(Workflow):
    """Pays a deposit and runs a check at once; the check fails once, the step goes on
    without it (the deposit still on its way) and asks whom to bill."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def deposit(self, ctx: Context, ev: StartEvent) -> InputRequiredEvent:
        enter("deposit")
        try:
            await asyncio.gather(late_pay("deposit"), flaky_check())
        except RuntimeError:
            pass  # (the deposit's call goes on: `gather` does not cancel it)
        return InputRequiredEvent(prefix="bill whom?")

    @step
    async def bill(self, ctx: Context, ev: HumanResponseEvent) -> StopEvent:
        enter("bill")
        return StopEvent(result=pay(ev.response))


PARKED = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from llamaindex_parts import until_parked
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes53 import AskAfter, lived_on

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = AskAfter(runtime=rt).run(run_id={run!r})
    await until_parked(rt, {run!r})
    print("PARKED", flush=True)
    await lived_on()

asyncio.run(main())
"""


def test_an_answer_while_the_asking_steps_payment_is_on_its_way_pays_it_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P2, P5, L1: a step's `asyncio.gather` sibling raises while its deposit is on its
    way; the step goes on without waiting for the deposit and asks a question, and the
    run parks with the deposit's call still running in that process (which lives on).
    Another process answers (`rt.respond`, retried while refused): the answer is
    held back while the deposit is on its way (the run's claim is kept for it: the
    answering step runs only once it landed), then taken, not refused for ever: the
    run completes, the asking step ran once, the deposit and the bill are paid once
    each."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = PARKED.format(tests=TESTS, url=url, run=run)

    async def answered(rt: RemitRuntime) -> Any:
        flow = AskAfter(runtime=rt)
        for _ in range(GUARD * 10):
            try:
                return await rt.respond(flow, run, HumanResponseEvent(response="ada"))
            except ResumeConflict:
                await asyncio.sleep(0.1)
        raise AssertionError("the answer was never taken")

    assert continued_elsewhere(code, url, tmp_path, run, answered) == "ada"
    journal = entered(tmp_path)
    assert journal.count("deposit") == 1 and journal.count("bill") == 1, journal
    assert journal.index("landed-deposit") < journal.index("bill"), journal
    assert sorted(applied(tmp_path)) == ["ada", "deposit"], journal


# -- a copy stopped, recovered in its own process, and stopped again -------------------


class Slow(Workflow):
    """One step, whose payment lands late."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def charge(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("charge")
        return StopEvent(result=await late_pay("order"))


TWICE = """
import asyncio, os, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from llamaindex_sink import entered
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes52 import recovered
from test_llamaindex_probes53 import Slow, lived_on

async def stop(handler):
    try:
        await asyncio.wait_for(handler, 0.1)
    except asyncio.TimeoutError:
        pass

async def main():
    tmp = Path(os.environ["LLAMAINDEX_PROBE_DIR"])
    rt = RemitRuntime({url!r}, lease=1)
    handler = Slow(runtime=rt).run(run_id={run!r})
    while "sent-order" not in entered(tmp):
        await asyncio.sleep(0.01)
    await stop(handler)
    again = RemitRuntime({url!r}, lease=1) if {other!r} else rt
    handler = await recovered(again, Slow(runtime=again), {run!r})
    while entered(tmp).count("charge") < 2:  # (the re-run waits for the first call)
        await asyncio.sleep(0.01)
    await stop(handler)
    print("STOPPED", flush=True)
    await lived_on()

asyncio.run(main())
"""


@pytest.mark.parametrize("other", [False, True], ids=["same_runtime", "other_runtime"])
def test_a_copy_recovered_in_its_process_and_stopped_again_is_not_paid_again_elsewhere(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: bool
) -> None:
    """P2, L1: a worker's copy of the run times out while the step's payment is on its
    way; the worker recovers the run itself (the same `RemitRuntime`, or another one in
    its process), whose step runs again and waits for the first call, and times out
    again. Another process's `rt.recover` then continues the run only once the payment
    landed, and the step gets its outcome: it is paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = TWICE.format(tests=TESTS, url=url, run=run, other=other)

    async def go_on(rt: RemitRuntime) -> Any:
        return await recovered(rt, Slow(runtime=rt), run)

    assert continued_elsewhere(code, url, tmp_path, run, go_on) == "order"
    assert applied(tmp_path) == ["order"], entered(tmp_path)
