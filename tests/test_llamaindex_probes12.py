"""LlamaIndex probes, round 12, on SQLite, PostgreSQL and Redis: a handler parked
(waiting for an answer) in one RemitRuntime object, thread or process, whose run is
answered, continued or cancelled elsewhere (another RemitRuntime object in the same
event loop, another thread, another process). Before, that handler waited for ever:
only copies in the answering runtime's own event loop were told. A parked copy now
looks at its run's stored head at the pace a held claim is renewed (a third of its
lease) and, once the run moved on, ends with `ResumeConflict` (`WorkflowCancelledByUser`
if the run was cancelled), running and storing nothing.
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
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 30
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe12-{uuid.uuid4().hex[:12]}"


class Wait(Workflow):
    """One step waits for a name, then pays for it and returns it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who?"), timeout=None
        )
        enter(f"answer:{answer.response}")
        return StopEvent(result=pay(answer.response))


async def parked(rt: RemitRuntime, run: str) -> Any:
    """The handler of a new `Wait` run, once its waiting head is stored and its claim
    given up (the run is parked: any process may answer it)."""
    handler = Wait(runtime=rt).run(run_id=run)
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    await until_parked(rt, run)
    return handler


async def until_parked(rt: RemitRuntime, run: str) -> None:
    deadline = time.monotonic() + GUARD
    while True:
        branch = await asyncio.to_thread(rt.remit.branch, run)
        if branch is not None and await asyncio.to_thread(rt.status, run) == "waiting":
            claim = await asyncio.to_thread(rt.remit.store.get_claim, run, "main")
            if claim is None or not claim.holder:
                return
        assert time.monotonic() < deadline, "the run did not park"
        await asyncio.sleep(0.05)


def check_answered_once(rt: RemitRuntime, run: str, tmp: Path) -> None:
    assert rt.status(run) == "completed" and rt.result(run) == "ada"
    assert [c.status for c in rt.checkpoints(run)].count("completed") == 1
    assert applied(tmp) == ["ada"]
    assert entered(tmp) == ["answer:ada"]


# -- another RemitRuntime object, same event loop -------------------------------------


def test_a_copy_parked_in_another_runtime_ends_once_the_run_is_answered(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2, P5: two RemitRuntime objects in one event loop (two app components, each
    with its own). A run parked through the first is answered through the second:
    its handler finishes, and the first one's handler ends with `ResumeConflict`
    (before, it waited for ever); the parked copy ran nothing, paid nothing."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        first, second = RemitRuntime(store_url, lease=1), RemitRuntime(store_url, lease=1)
        waiting = await parked(first, run)
        answered = await second.respond(
            Wait(runtime=second), run, HumanResponseEvent(response="ada")
        )
        assert await asyncio.wait_for(answered, GUARD) == "ada"
        with pytest.raises(ResumeConflict, match="moved on elsewhere") as lost:
            await asyncio.wait_for(waiting, GUARD)
        assert lost.value.run_id == run
        check_answered_once(first, run, tmp_path)

    asyncio.run(go())


def test_a_copy_parked_in_another_runtime_ends_cancelled_once_the_run_is_cancelled(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run parked through one RemitRuntime is cancelled through another
    (`rt.cancel`): the parked handler ends with `WorkflowCancelledByUser`, as it does
    for a cancel through its own runtime, and writes nothing after the cancelled end."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        first, second = RemitRuntime(store_url, lease=1), RemitRuntime(store_url, lease=1)
        waiting = await parked(first, run)
        head = await second.cancel(run)
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(waiting, GUARD)
        assert first.checkpoints(run)[0].checkpoint_id == head
        assert first.status(run) == "cancelled"
        assert applied(tmp_path) == [] and entered(tmp_path) == []

    asyncio.run(go())


def test_a_parked_copy_that_is_watched_still_takes_its_own_answer(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look at the store does not stop a copy whose run did not move on elsewhere:
    parked through many beats (a short lease), edited through its own state store
    (which commits a new head from this copy), it still takes its answer and finishes;
    a second answer is refused."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=0.3)
        waiting = await parked(rt, run)
        await asyncio.sleep(1.0)
        await rt.update_state(Wait(runtime=rt), run, {"note": "edited"})
        await asyncio.sleep(1.0)
        await rt.send_event(waiting, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(waiting, GUARD) == "ada"
        with pytest.raises(ResumeConflict):
            await rt.respond(Wait(runtime=rt), run, HumanResponseEvent(response="bob"))
        check_answered_once(rt, run, tmp_path)
        assert rt.get_state(Wait(runtime=rt), run).get("note") == "edited"

    asyncio.run(go())


# -- another thread -------------------------------------------------------------------


def test_a_copy_parked_in_another_thread_ends_once_the_run_is_answered(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One RemitRuntime shared by two threads, each with its event loop (a threaded
    server): a run parked in one thread is answered in the other. The parked thread's
    handler ends with `ResumeConflict` instead of waiting for ever."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    rt = RemitRuntime(store_url, lease=1)
    is_parked = threading.Event()
    outcome: list[BaseException | object] = []

    async def park() -> None:
        waiting = await parked(rt, run)
        is_parked.set()
        try:
            outcome.append(await asyncio.wait_for(waiting, GUARD))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=lambda: asyncio.run(park()))
    thread.start()
    try:
        assert is_parked.wait(GUARD)

        async def answer() -> Any:
            handler = await rt.respond(Wait(runtime=rt), run, HumanResponseEvent(response="ada"))
            return await asyncio.wait_for(handler, GUARD)

        assert asyncio.run(answer()) == "ada"
    finally:
        thread.join(GUARD + 10)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ResumeConflict), outcome
    check_answered_once(rt, run, tmp_path)


# -- another process ------------------------------------------------------------------

PARKED_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes12 import parked

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    waiting = await parked(rt, {run!r})
    open({flag!r}, "w").close()
    try:
        print("RESULT", await asyncio.wait_for(waiting, 60), flush=True)
    except BaseException as exc:
        print("RAISED", type(exc).__name__, flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["respond", "cancel"])
def test_a_copy_parked_in_another_process_ends_once_the_run_moves_on(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A process parks a run and awaits its handler (a server's request); another
    process answers it (`rt.respond`) or cancels it (`rt.cancel`). The parked process's
    handler ends with `ResumeConflict`, or `WorkflowCancelledByUser` for the cancel,
    and its process exits; it ran and paid nothing."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    flag = tmp_path / "parked.flag"
    code = PARKED_DRIVER.format(tests=TESTS, url=store_url, run=run, flag=str(flag))
    driver = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + GUARD
        while not flag.exists():
            assert time.monotonic() < deadline and driver.poll() is None, driver.communicate()
            time.sleep(0.05)
        rt = RemitRuntime(store_url, lease=1)

        async def move_on() -> Any:
            if how == "cancel":
                return await rt.cancel(run)
            handler = await rt.respond(Wait(runtime=rt), run, HumanResponseEvent(response="ada"))
            return await asyncio.wait_for(handler, GUARD)

        moved = asyncio.run(move_on())
        out, err = driver.communicate(timeout=GUARD + 30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    if how == "cancel":
        assert out.split() == ["RAISED", "WorkflowCancelledByUser"], (out, err)
        assert rt.status(run) == "cancelled" and rt.checkpoints(run)[0].checkpoint_id == moved
        assert applied(tmp_path) == [] and entered(tmp_path) == []
    else:
        assert moved == "ada"
        assert out.split() == ["RAISED", "ResumeConflict"], (out, err)
        check_answered_once(rt, run, tmp_path)


# -- racing recoverers of a run holding an accepted answer ---------------------------

ANSWER_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes12 import Wait

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    await rt.respond(Wait(runtime=rt), {run!r}, HumanResponseEvent(response="ada"))

asyncio.run(main())
"""

RECOVER_DRIVER = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes12 import Wait

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    rt.remit
    flow = Wait(runtime=rt)
    while time.time() < {at!r}:
        time.sleep(0.001)
    try:
        handler = rt.recover(flow, {run!r})
    except Exception as exc:
        print("REFUSED", type(exc).__name__, flush=True)
        return
    if handler is None:
        print("NONE", flush=True)
        return
    print("RESULT", await asyncio.wait_for(handler, 60), flush=True)

asyncio.run(main())
"""


def test_racing_recoverers_of_an_accepted_answer_deliver_it_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, L1, P2 (cells 15 and 38 with recoverers): the answering process is SIGKILLed
    right after consuming the run's interrupt (the answer accepted, not delivered).
    Three processes recover the run at the same instant, once that claim's lease has
    run out: exactly one delivers the accepted answer and finishes the run with it;
    each other one is refused with `ResumeConflict` (it raced the winner for the
    claim or the head) or gets None (it read the head once the winner had ended the
    run: nothing is left to recover). The step after the answer runs and pays once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def park() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = await parked(rt, run)
        await handler.cancel_run()  # (stops this copy; the stored run stays parked)

    asyncio.run(park())
    answer = subprocess.run(
        [sys.executable, "-c", ANSWER_DRIVER.format(tests=TESTS, url=store_url, run=run)],
        env={
            **os.environ,
            DIR_VAR: str(tmp_path),
            "REMIT_FAILPOINTS": "interrupt.after_consume=kill",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert answer.returncode == -9, (answer.stdout, answer.stderr)
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "waiting" and entered(tmp_path) == []
    assert [i.status for i in rt.remit.interrupts(run)] == ["consumed"]
    code = RECOVER_DRIVER.format(tests=TESTS, url=store_url, run=run, at=time.time() + 4)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, DIR_VAR: str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    results = [out.strip() for out, _ in outs]
    assert results.count("RESULT ada") == 1, outs
    losers = [r for r in results if r != "RESULT ada"]
    assert set(losers) <= {"NONE", "REFUSED ResumeConflict"}, outs
    check_answered_once(rt, run, tmp_path)
