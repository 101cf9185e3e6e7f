"""LlamaIndex probes, round 37, on SQLite, PostgreSQL and Redis: processes and
concurrency. Three workers of a step with `num_workers=3` and a `retry_policy`,
SIGKILLed while all three are mid-step after paying, recovered in another process;
eight processes answering one question asked the classic way, at once behind a barrier;
and a copy of a run stopped (its awaiting task cancelled, or `handler.cancel_run()`)
while its checkpoint write is held, then continued by another process before that write
goes on. No bug was found: these pin what holds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

TESTS = str(Path(__file__).parent)
GUARD = 60


def new_run() -> str:
    return f"probe37-{uuid.uuid4().hex[:12]}"


async def recovered(rt: RemitRuntime, workflow: Workflow, run: str) -> Any:
    """`rt.recover`, retried while a dead process's claim has not run out yet."""
    while True:
        try:
            return rt.recover(workflow, run)
        except ResumeConflict:
            await asyncio.sleep(0.1)


# -- three workers of one step, killed together mid-step --------------------------------


class Item(Event):
    name: str


class Done(Event):
    name: str


class _Workers:
    """The items whose worker has paid in this process, and the event that lets every
    worker go on once all three have (so all three are mid-step at once)."""

    paid: set[str] = set()
    all_paid: asyncio.Event | None = None
    failed: set[str] = set()


class ThreeWorkers(Workflow):
    """`fan` sends three items; `work` (three workers, retried) pays for its item, waits
    until every worker has paid, and its worker of "b" fails once after that in each
    process; `join` ends the run with the three items."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def fan(self, ctx: Context, ev: StartEvent) -> Item | None:
        enter("fan")
        for name in ("a", "b", "c"):
            ctx.send_event(Item(name=name))
        return None

    @step(num_workers=3, retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(3)))
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter("work-" + ev.name)
        pay("item-" + ev.name)
        if _Workers.all_paid is None:
            _Workers.all_paid = asyncio.Event()
        _Workers.paid.add(ev.name)
        if len(_Workers.paid) == 3:
            die_at("all mid-step")
            _Workers.all_paid.set()
        await _Workers.all_paid.wait()
        if ev.name == "b" and "b" not in _Workers.failed:
            _Workers.failed.add("b")
            raise RuntimeError("flaky after paying")
        return Done(name=ev.name)

    @step
    async def join(self, ctx: Context, ev: Done) -> StopEvent | None:
        every = ctx.collect_events(ev, [Done, Done, Done])
        return None if every is None else StopEvent(result=sorted(d.name for d in every))


START_WORKERS = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes37 import ThreeWorkers

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    print("RESULT", await ThreeWorkers(runtime=rt).run(run_id={run!r}), flush=True)

asyncio.run(main())
"""


def test_three_workers_killed_mid_step_together_recover_each_item_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2 with `num_workers=3` and a `retry_policy`: the process is SIGKILLed once
    all three workers have paid and none has returned. Another process recovers the
    run: `fan` is not entered again, each worker runs again (and "b" is retried), each
    item is paid once over the crash and the retry, and `join` gets each item once."""
    run = new_run()
    killed = in_process(
        START_WORKERS.format(tests=TESTS, url=url, run=run), tmp_path, "all mid-step"
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(applied(tmp_path)) == ["item-a", "item-b", "item-c"]

    async def recover() -> Any:
        _Workers.paid, _Workers.all_paid, _Workers.failed = set(), None, set()
        rt = RemitRuntime(url, lease=1)
        try:
            handler = await recovered(rt, ThreeWorkers(runtime=rt), run)
            assert handler is not None
            result = await asyncio.wait_for(handler, GUARD)
            assert rt.recover(ThreeWorkers(runtime=rt), run) is None  # the run has ended
            return result, rt.status(run)
        finally:
            rt.remit.close()

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    assert asyncio.run(asyncio.wait_for(recover(), GUARD)) == (["a", "b", "c"], "completed")
    assert sorted(applied(tmp_path)) == ["item-a", "item-b", "item-c"]
    steps = entered(tmp_path)
    assert steps.count("fan") == 1
    assert (steps.count("work-a"), steps.count("work-b"), steps.count("work-c")) == (2, 3, 2)


# -- eight processes answer one classic question at once --------------------------------


class Asked(Event):
    pass


class Classic(Workflow):
    """`ask` returns a question (the classic pattern); `take` pays for the answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> InputRequiredEvent:
        enter("ask")
        return InputRequiredEvent(prefix="who pays?")

    @step
    async def take(self, ctx: Context, ev: HumanResponseEvent) -> StopEvent:
        enter("take")
        return StopEvent(result=pay("took-" + ev.response))


ANSWER_AT_BARRIER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes37 import Classic

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    rt.status({run!r})  # (connected before the start)
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        answer = HumanResponseEvent(response={who!r})
        handler = await rt.respond(Classic(runtime=rt), {run!r}, answer)
    except ResumeConflict as exc:
        print("REFUSED", type(exc).__name__, flush=True)
    else:
        print("ACK", await handler, flush=True)

asyncio.run(main())
"""


def test_eight_processes_answering_one_classic_question_take_one_answer(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2 with k=8 on a question a step returned: eight processes answer at once
    behind a barrier. Exactly one is acknowledged and its run ends with its answer; the
    seven others get `ResumeConflict`; `take` is entered once and pays once; a ninth
    answer afterwards is refused."""
    run = new_run()
    monkeypatch.setenv(DIR_VAR, str(tmp_path))

    async def park() -> None:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = Classic(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            await handler.cancel_run()  # this copy stops; the stored run stays parked
        finally:
            rt.remit.close()

    asyncio.run(park())
    env = {**os.environ, DIR_VAR: str(tmp_path)}
    racers = [f"r{i}" for i in range(8)]
    procs = {
        who: subprocess.Popen(
            [
                sys.executable,
                "-c",
                ANSWER_AT_BARRIER.format(tests=TESTS, url=url, run=run, who=who),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for who in racers
    }
    for proc in procs.values():
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outcome = {}
    for who, proc in procs.items():
        out, err = proc.communicate(timeout=GUARD * 2)
        assert proc.returncode == 0, err
        outcome[who] = out.split()
    winners = [who for who, said in outcome.items() if said[0] == "ACK"]
    assert len(winners) == 1, outcome
    assert outcome[winners[0]] == ["ACK", "took-" + winners[0]]
    assert (
        sorted(said for who, said in outcome.items() if who not in winners)
        == [["REFUSED", "ResumeConflict"]] * 7
    )
    assert applied(tmp_path) == ["took-" + winners[0]]
    assert entered(tmp_path) == ["ask", "take"]

    async def again() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            with pytest.raises(ResumeConflict):
                await rt.respond(Classic(runtime=rt), run, HumanResponseEvent(response="late"))
            return rt.status(run), rt.result(run)
        finally:
            rt.remit.close()

    assert asyncio.run(again()) == ("completed", "took-" + winners[0])
    assert applied(tmp_path) == ["took-" + winners[0]]


# -- a cancelled copy whose checkpoint write is held -----------------------------------


class Paid(Event):
    pass


class Shop(Workflow):
    """`charge` pays; `finish` ends the run with what was paid."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context, ev: StartEvent) -> Asked:
        enter("prepare")
        return Asked()

    @step
    async def charge(self, ctx: Context, ev: Asked) -> Paid:
        enter("charge")
        pay("order")
        return Paid()

    @step
    async def finish(self, ctx: Context, ev: Paid) -> StopEvent:
        enter("finish")
        return StopEvent(result="paid")


RECOVER_SHOP = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes37 import Shop

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    while True:
        try:
            handler = rt.recover(Shop(runtime=rt), {run!r})
            break
        except ResumeConflict:  # the cancelled copy's claim, until it is given up
            await asyncio.sleep(0.1)
    print("ENDED" if handler is None else f"RESULT {{await handler}}", flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["task", "cancel_run"])
def test_a_cancelled_copy_whose_commit_was_held_never_overwrites_a_newer_head(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """L2, P1, P2: the checkpoint write of `charge`'s result is held (after the effect
    was applied and recorded), and this copy is stopped meanwhile: its awaiting task
    cancelled (the stored run stays resumable) or `handler.cancel_run()` (the cancel
    waits for the write, then ends the run as `cancelled`). Once the stop has returned,
    another process continues the run as far as it may; then the held write goes on.
    It never lands over the newer head: the head, status and result stay those the
    other process left, and the charge was applied once."""
    run = new_run()
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    held, release, written = threading.Event(), threading.Event(), threading.Event()
    outcome: list[str] = []

    async def go() -> tuple[list[str], str, str]:
        rt = RemitRuntime(url, lease=1)
        commit = rt.remit.commit

        def holding_commit(**kw: Any) -> Any:
            if held.is_set() or not str(kw["metadata"].get("step", "")).startswith("charge"):
                return commit(**kw)
            held.set()
            release.wait(GUARD)
            try:
                stored = commit(**kw)
            except BaseException as exc:
                outcome.append(type(exc).__name__)
                raise
            else:
                outcome.append("stored")
                return stored
            finally:
                written.set()

        rt.remit.commit = holding_commit  # type: ignore[method-assign]
        try:
            handler = Shop(runtime=rt).run(run_id=run)
            awaiting = asyncio.ensure_future(handler)
            assert await asyncio.to_thread(held.wait, GUARD)
            if how == "task":
                awaiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await awaiting
            else:  # the cancel is reduced after the held write: release it
                stopping = asyncio.ensure_future(handler.cancel_run())
                release.set()
                await asyncio.wait_for(stopping, GUARD)
                with pytest.raises(WorkflowCancelledByUser):
                    await asyncio.wait_for(awaiting, GUARD)
            done = await asyncio.to_thread(
                in_process, RECOVER_SHOP.format(tests=TESTS, url=url, run=run), tmp_path
            )
            assert done.returncode == 0, done.stderr
            stored = [(c.checkpoint_id, c.status) for c in rt.checkpoints(run)]
            release.set()
            assert await asyncio.to_thread(written.wait, GUARD)
            assert [(c.checkpoint_id, c.status) for c in rt.checkpoints(run)] == stored
            return outcome, rt.status(run), done.stdout.strip()
        finally:
            release.set()
            rt.remit.close()

    written_as, status, recovery = asyncio.run(asyncio.wait_for(go(), GUARD * 2))
    if how == "task":  # the held write goes on after another process moved the run on
        assert (status, recovery) == ("completed", "RESULT paid")
        assert written_as == ["Fenced"]
        assert entered(tmp_path) == ["prepare", "charge", "charge", "finish"]
    else:  # the cancel ended the run after the held write: nothing is left to continue
        assert (status, recovery, written_as) == ("cancelled", "ENDED", ["stored"])
        # (`finish` may have been dispatched before the cancel was reduced, as in the
        # framework; the recovery entered nothing)
        assert entered(tmp_path) in (["prepare", "charge"], ["prepare", "charge", "finish"])
    assert applied(tmp_path) == ["order"]
