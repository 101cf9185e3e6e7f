"""Round 43 of the LlamaIndex probes, on SQLite, PostgreSQL and Redis: two copies
restored from one paused snapshot racing to answer it.

Copies restored from ONE paused snapshot (`Context.from_dict` of the same
`ctx.to_dict()` taken while the run waited, or `rt.context` at that pause's
checkpoint) each answer it. The winner's answer moves the run on; a loser that
restored before that got `ResumeConflict`, but a loser whose restore came after got
`ForkWithoutIntent` ("pass a fork token"): it asked for no fork, someone else answered
its question. Such a restore now raises `PauseAnswered`, a `ResumeConflict` (P5) and,
for code that caught it before, still a `ForkWithoutIntent`, naming the run, the
restored checkpoint, the answered question and the head; nothing runs or is stored.
Any other non-head restore (a pause whose run was cancelled or edited, a checkpoint
that was no pause) stays a plain `ForkWithoutIntent`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import ForkWithoutIntent, ResumeConflict, UnknownRecord
from remit_llamaindex import PauseAnswered, RemitRuntime

GUARD = 60
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe43-{uuid.uuid4().hex[:12]}"


class Sign(Workflow):
    """Waits for who signs (`wait_for_event`), then pays for the signature."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("timeout", None)
        super().__init__(**kw)

    @step
    async def sign(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("sign")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who signs?")
        )
        die_at("after-answer")
        paid = pay(f"signed-{answer.response}")
        die_at("after-pay")
        return StopEvent(result=paid)


class Ask(Workflow):
    """The classic human in the loop: `ask` returns the question, `take` the answer."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("timeout", None)
        super().__init__(**kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> InputRequiredEvent:
        enter("ask")
        return InputRequiredEvent(prefix="who signs?")

    @step
    async def take(self, ctx: Context, ev: HumanResponseEvent) -> StopEvent:
        enter("take")
        die_at("after-answer")
        paid = pay(f"signed-{ev.response}")
        die_at("after-pay")
        return StopEvent(result=paid)


FLOWS = [Sign, Ask]
FLOW_IDS = ["wait_for_event", "classic"]


async def _paused(rt: RemitRuntime, wf: Workflow, run: str) -> dict[str, Any]:
    """Start `wf` as `run`; once it asked, take its snapshot and pause it (the
    framework's documented pause: `ctx.to_dict()`, `cancel_run()`)."""
    handler = wf.run(run_id=run)
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    for _ in range(400):
        if await asyncio.to_thread(rt.status, run) == "waiting":
            break
        await asyncio.sleep(0.05)
    snapshot = handler.ctx.to_dict()
    await handler.cancel_run()
    return snapshot


def _pause_id(rt: RemitRuntime, run: str) -> str:
    (paused,) = [c for c in rt.checkpoints(run) if c.status == "waiting"]
    return paused.checkpoint_id


def _check_answered(exc: BaseException, run: str, pause: str, head: str) -> None:
    """`exc` is the refusal of a restore of the answered pause `pause`: both a
    `ResumeConflict` and a `ForkWithoutIntent`, naming the run, the pause, its question
    and the head it moved on to, and how to go on."""
    assert isinstance(exc, PauseAnswered)
    assert isinstance(exc, ResumeConflict) and isinstance(exc, ForkWithoutIntent)
    assert exc.run_id == run and exc.checkpoint_id == pause
    assert exc.interrupt_id is not None and exc.head_id == head
    text = str(exc)
    assert run in text and pause in text and head in text and "answered" in text
    assert "fork token" in text and "RemitRuntime.context" in text


@pytest.mark.parametrize("flow", FLOWS, ids=FLOW_IDS)
@pytest.mark.parametrize("how", ["from_dict", "rt_context"])
def test_a_copy_restored_after_the_answer_gets_resume_conflict(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flow: type[Workflow], how: str
) -> None:
    """P5 in one event loop, the loser restores after the winner answered and the run
    ended: its restore raises `PauseAnswered` (also `ResumeConflict`, and still
    `ForkWithoutIntent`), runs nothing and stores nothing; paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        snapshot = await _paused(rt, flow(runtime=rt), run)
        pause = _pause_id(rt, run)
        first = flow(runtime=rt)
        won = first.run(ctx=Context.from_dict(first, snapshot))
        await rt.send_event(won, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(won, GUARD) == "signed-ada"
        before = rt.checkpoints(run)
        second = flow(runtime=rt)
        ctx = (
            Context.from_dict(second, snapshot)
            if how == "from_dict"
            else rt.context(second, run, checkpoint_id=pause)
        )
        with pytest.raises(ResumeConflict) as refused:
            second.run(ctx=ctx)
        _check_answered(refused.value, run, pause, before[0].checkpoint_id)
        assert rt.checkpoints(run) == before
        assert rt.status(run) == "completed" and rt.result(run) == "signed-ada"

    asyncio.run(go())
    assert applied(tmp_path) == ["signed-ada"]


class Held(Workflow):
    """Waits for who signs; then holds the answered step until `RELEASE` is set."""

    RELEASE: asyncio.Event | None = None

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("timeout", None)
        super().__init__(**kw)

    @step
    async def sign(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who signs?")
        )
        assert Held.RELEASE is not None
        await Held.RELEASE.wait()
        return StopEvent(result=pay(f"signed-{answer.response}"))


def test_a_copy_restored_while_the_answer_runs_gets_resume_conflict(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The winner's answer was taken and its step is still running (the head moved on,
    the run not ended): a copy restored from the pause now is refused the same way,
    and old `except ForkWithoutIntent` code still catches it."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        Held.RELEASE = asyncio.Event()
        rt = RemitRuntime(url)
        snapshot = await _paused(rt, Held(runtime=rt), run)
        pause = _pause_id(rt, run)
        first = Held(runtime=rt)
        won = first.run(ctx=Context.from_dict(first, snapshot))
        await rt.send_event(won, HumanResponseEvent(response="ada"))
        for _ in range(400):
            if rt.checkpoints(run)[0].checkpoint_id != pause:
                break
            await asyncio.sleep(0.02)
        assert rt.status(run) == "running"
        second = Held(runtime=rt)
        try:
            second.run(ctx=Context.from_dict(second, snapshot))
        except ForkWithoutIntent as exc:  # (code written before: still caught)
            assert isinstance(exc, ResumeConflict) and exc.checkpoint_id == pause
        else:
            raise AssertionError("a restore of the answered pause was not refused")
        Held.RELEASE.set()
        assert await asyncio.wait_for(won, GUARD) == "signed-ada"

    asyncio.run(go())
    assert applied(tmp_path) == ["signed-ada"]


def test_two_copies_of_a_forks_pause_race_the_same_way(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork made at the pause, paused there (its head is its base, stored on the main
    branch), snapshotted and restored twice: the copy restored after the other answered
    is refused with `PauseAnswered` naming the fork's run id; the main branch is left
    waiting, and its own pause still takes an answer."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        await _paused(rt, Sign(runtime=rt), run)
        pause = _pause_id(rt, run)
        fork = rt.fork(run, pause, fork_token="race")
        wf = Sign(runtime=rt)
        live = wf.run(ctx=rt.context(wf, fork))
        snapshot = live.ctx.to_dict()
        await live.cancel_run()
        first = Sign(runtime=rt)
        won = first.run(ctx=Context.from_dict(first, snapshot))
        await rt.send_event(won, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(won, GUARD) == "signed-ada"
        second = Sign(runtime=rt)
        with pytest.raises(ResumeConflict) as refused:
            second.run(ctx=Context.from_dict(second, snapshot))
        _check_answered(refused.value, fork, pause, rt.checkpoints(fork)[0].checkpoint_id)
        assert rt.status(fork) == "completed" and rt.status(run) == "waiting"
        main = await rt.respond(Sign(runtime=rt), run, HumanResponseEvent(response="bob"))
        assert await asyncio.wait_for(main, GUARD) == "signed-bob"

    asyncio.run(go())
    assert sorted(applied(tmp_path)) == ["signed-ada", "signed-bob"]


def test_a_copy_restored_before_the_answer_loses_with_resume_conflict(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: both copies restored before either answered; the loser's answer
    is refused with `ResumeConflict` (`rt.send_event`) and its handler ends with it."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        snapshot = await _paused(rt, Sign(runtime=rt), run)
        first, second = Sign(runtime=rt), Sign(runtime=rt)
        a = first.run(ctx=Context.from_dict(first, snapshot))
        b = second.run(ctx=Context.from_dict(second, snapshot))
        await rt.send_event(a, HumanResponseEvent(response="ada"))
        with pytest.raises(ResumeConflict):
            await rt.send_event(b, HumanResponseEvent(response="bob"))
        assert await asyncio.wait_for(a, GUARD) == "signed-ada"
        with pytest.raises(ResumeConflict):
            await asyncio.wait_for(b, GUARD)

    asyncio.run(go())
    assert applied(tmp_path) == ["signed-ada"]


def test_other_non_head_restores_stay_a_plain_fork(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an answered pause is a lost race. A pause whose run was cancelled, and a
    checkpoint that was no pause (the run's first), are time travel:
    `ForkWithoutIntent`, not a `ResumeConflict`; and a fork token still forks the
    answered pause, answering it again on a branch of its own."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))

    async def go() -> None:
        rt = RemitRuntime(url)
        answered = new_run()
        await _paused(rt, Ask(runtime=rt), answered)
        first_id = rt.checkpoints(answered)[-1].checkpoint_id
        wf = Ask(runtime=rt)
        with pytest.raises(ForkWithoutIntent) as early:
            wf.run(ctx=rt.context(wf, answered, checkpoint_id=first_id))
        assert not isinstance(early.value, ResumeConflict)

        cancelled = new_run()
        snap2 = await _paused(rt, Sign(runtime=rt), cancelled)
        await rt.cancel(cancelled)
        wf2 = Sign(runtime=rt)
        with pytest.raises(ForkWithoutIntent) as gone:
            wf2.run(ctx=Context.from_dict(wf2, snap2))
        assert not isinstance(gone.value, ResumeConflict)

        # Answer the run and fork its answered pause on purpose: one branch.
        pause = _pause_id(rt, answered)
        won = await rt.respond(Ask(runtime=rt), answered, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(won, GUARD) == "signed-ada"
        fork = rt.fork(answered, pause, fork_token="again")
        again = await rt.respond(Ask(runtime=rt), fork, HumanResponseEvent(response="eve"))
        assert await asyncio.wait_for(again, GUARD) == "signed-eve"

    asyncio.run(go())
    assert sorted(applied(tmp_path)) == ["signed-ada", "signed-eve"]


class Typed(Workflow):
    """Waits with a typed state, so that `rt.update_state` may edit it while parked."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("timeout", None)
        super().__init__(**kw)

    @step
    async def sign(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who signs?")
        )
        note = await ctx.store.get("note", default="")
        return StopEvent(result=pay(f"signed-{answer.response}{note}"))


def test_a_pause_edited_since_is_a_plain_fork_and_the_head_answers(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause whose run was edited while parked (the head moved, the question open):
    restoring the old snapshot is a plain `ForkWithoutIntent`; the head still takes
    the answer, with the edit."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        snapshot = await _paused(rt, Typed(runtime=rt), run)
        await rt.update_state(Typed(runtime=rt), run, {"note": "!"})
        wf = Typed(runtime=rt)
        with pytest.raises(ForkWithoutIntent) as refused:
            wf.run(ctx=Context.from_dict(wf, snapshot))
        assert not isinstance(refused.value, ResumeConflict)
        won = await rt.respond(Typed(runtime=rt), run, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(won, GUARD) == "signed-ada!"

    asyncio.run(go())
    assert applied(tmp_path) == ["signed-ada!"]


RACER = """
import asyncio, json, os, sys, time
sys.path.insert(0, {tests!r})
from workflows import Context
from workflows.events import HumanResponseEvent
from remit_core.errors import ForkWithoutIntent, ResumeConflict, UnknownRecord
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes43 as probes

def said(exc):
    kind = "RC" if isinstance(exc, ResumeConflict) else "NOT-RC"
    fork = "FWI" if isinstance(exc, ForkWithoutIntent) else "-"
    return f"{{kind}} {{fork}} {{type(exc).__name__}}"

async def main(me, mode):
    rt = RemitRuntime({url!r}, lease=5)
    wf = getattr(probes, {flow!r})(runtime=rt)
    snapshot = json.loads({snapshot!r})

    def restore():
        if me.endswith(("1", "3")):
            return wf.run(ctx=rt.context(wf, {run!r}, checkpoint_id={pause!r}))
        return wf.run(ctx=Context.from_dict(wf, snapshot))

    handler = None
    try:
        if mode == "early":
            handler = restore()
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        if mode == "after":  # restore only once the winner moved the head
            while await asyncio.to_thread(rt.status, {run!r}) == "waiting":
                await asyncio.sleep(0.01)
        if handler is None:
            handler = restore()
        handler.ctx.send_event(HumanResponseEvent(response=me))
        print("ACK", await asyncio.wait_for(handler, 60), flush=True)
    except (ResumeConflict, ForkWithoutIntent) as exc:
        print("REFUSED", said(exc), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.parametrize("flow", FLOWS, ids=FLOW_IDS)
def test_four_processes_restoring_one_snapshot_take_one_answer(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flow: type[Workflow]
) -> None:
    """P5, P2 with k=4 real processes behind a barrier, restored from ONE paused snapshot
    (two by `Context.from_dict`, two by `rt.context` at the pause), in every order: two
    restore before the barrier, one after it, one only once the head moved. Exactly one
    answer is taken and paid once; every loser gets `ResumeConflict` (a restore refused
    as `PauseAnswered` is also a `ForkWithoutIntent`), and none runs a step."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    rt = RemitRuntime(url, lease=1)
    snapshot = asyncio.run(_paused(rt, flow(runtime=rt), run))
    pause = _pause_id(rt, run)
    env = {**os.environ, DIR_VAR: str(tmp_path)}
    code = RACER.format(
        tests=TESTS,
        url=url,
        run=run,
        pause=pause,
        flow=flow.__name__,
        snapshot=json.dumps(snapshot),
    )
    modes = {"r0": "early", "r1": "early", "r2": "late", "r3": "after"}
    procs = {
        who: subprocess.Popen(
            [sys.executable, "-c", code, who, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for who, mode in modes.items()
    }
    try:
        for proc in procs.values():
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "READY"
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outcome = {}
        for who, proc in procs.items():
            out, err = proc.communicate(timeout=GUARD * 2)
            assert proc.returncode == 0, err
            outcome[who] = out.split()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    winners = [who for who, said in outcome.items() if said[0] == "ACK"]
    assert len(winners) == 1 and winners[0] != "r3", outcome
    assert outcome[winners[0]] == ["ACK", f"signed-{winners[0]}"]
    losers = {who: said for who, said in outcome.items() if who not in winners}
    assert all(said[:2] == ["REFUSED", "RC"] for said in losers.values()), outcome
    assert losers["r3"] == ["REFUSED", "RC", "FWI", "PauseAnswered"], outcome
    assert applied(tmp_path) == [f"signed-{winners[0]}"]
    # Only the winner's answer ran a step that takes it.
    assert entered(tmp_path).count("take") == (1 if flow is Ask else 0)
    assert rt.status(run) == "completed" and rt.result(run) == f"signed-{winners[0]}"


ANSWER_AND_DIE = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
from workflows import Context
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes43 as probes

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    wf = getattr(probes, {flow!r})(runtime=rt)
    handler = wf.run(ctx=Context.from_dict(wf, json.loads({snapshot!r})))
    await rt.send_event(handler, HumanResponseEvent(response="a"))
    print("SENT", flush=True)
    print("DONE", await asyncio.wait_for(handler, 60), flush=True)

asyncio.run(main())
"""


def _answer_and_die(
    url: str, tmp_path: Path, flow: type[Workflow], snapshot: dict[str, Any], kill: str
) -> subprocess.CompletedProcess[str]:
    code = ANSWER_AND_DIE.format(
        tests=TESTS, url=url, flow=flow.__name__, snapshot=json.dumps(snapshot)
    )
    return in_process(code, tmp_path, kill=kill)


@pytest.mark.parametrize("flow", FLOWS, ids=FLOW_IDS)
@pytest.mark.parametrize("kill", ["after-answer", "after-pay"])
def test_a_copy_restored_after_the_winner_died_answering_gets_resume_conflict(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flow: type[Workflow], kill: str
) -> None:
    """P5, P1 with SIGKILL: the winner's answer was taken and committed, then its process
    died in the step that took it (before or after the effect). A copy restored from
    the pause then is refused (`PauseAnswered`, a `ResumeConflict`): its question was
    answered, by the dead winner; `rt.respond` is refused too; `rt.recover` continues
    with the winner's answer, and the effect is applied once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    rt = RemitRuntime(url, lease=1)
    snapshot = asyncio.run(_paused(rt, flow(runtime=rt), run))
    pause = _pause_id(rt, run)
    died = _answer_and_die(url, tmp_path, flow, snapshot, kill)
    assert died.returncode == -9 and "SENT" in died.stdout, died.stderr
    assert applied(tmp_path) == ([] if kill == "after-answer" else ["signed-a"])

    async def lose_then_recover() -> Any:
        wf = flow(runtime=rt)
        with pytest.raises(ResumeConflict) as refused:
            wf.run(ctx=Context.from_dict(wf, snapshot))
        _check_answered(refused.value, run, pause, rt.checkpoints(run)[0].checkpoint_id)
        with pytest.raises(ResumeConflict):
            await rt.respond(flow(runtime=rt), run, HumanResponseEvent(response="b"))
        for _ in range(100):  # (the dead winner's lease runs out)
            try:
                handler = rt.recover(flow(runtime=rt), run)
                break
            except ResumeConflict:
                await asyncio.sleep(0.1)
        assert handler is not None
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(lose_then_recover()) == "signed-a"
    assert applied(tmp_path) == ["signed-a"]
    assert rt.status(run) == "completed"


def test_a_winner_killed_right_after_consuming_leaves_the_answer_its_own(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P1: the winner's process is SIGKILLed right after the store consumed its
    answer, before the answer's tick was committed (the head is still the pause). A
    copy restored from the pause now is refused with `ResumeConflict` (at its restore,
    while the dead winner's claim is leased: the restore would deliver the stored
    answer; or at its own answer, the question was answered): nothing is stored;
    `rt.recover` delivers the dead winner's stored answer; paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    monkeypatch.setenv("REMIT_FAILPOINTS", "interrupt.after_consume=kill")
    run = new_run()
    rt = RemitRuntime(url, lease=1)
    snapshot = asyncio.run(_paused(rt, Sign(runtime=rt), run))
    pause = _pause_id(rt, run)
    died = _answer_and_die(url, tmp_path, Sign, snapshot, "")
    monkeypatch.delenv("REMIT_FAILPOINTS")
    assert died.returncode == -9 and "SENT" not in died.stdout, died.stderr
    assert rt.checkpoints(run)[0].checkpoint_id == pause

    async def lose_then_recover() -> Any:
        wf = Sign(runtime=rt)
        try:  # (refused at once while the dead winner's claim is still leased)
            late = wf.run(ctx=Context.from_dict(wf, snapshot))
        except ResumeConflict:
            pass
        else:
            with pytest.raises(ResumeConflict):
                await rt.send_event(late, HumanResponseEvent(response="b"))
            with pytest.raises(ResumeConflict):
                await asyncio.wait_for(late, GUARD)
        assert rt.checkpoints(run)[0].checkpoint_id == pause
        handler = None
        for _ in range(100):
            try:
                handler = rt.recover(Sign(runtime=rt), run)
                break
            except ResumeConflict:
                await asyncio.sleep(0.1)
        assert handler is not None
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(lose_then_recover()) == "signed-a"
    assert applied(tmp_path) == ["signed-a"]


class Child(Workflow):
    """A child run that pays for its work."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def work(self, ev: StartEvent) -> StopEvent:
        return StopEvent(result=pay(f"child-{ev.tag}"))


class Parent(Workflow):
    """Pays, then starts a child under the run id its start event names."""

    def __init__(self, rt: RemitRuntime, **kw: Any) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt = rt

    @step
    async def go(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("go")
        pay(f"parent-{ev.child}")
        got = await Child(runtime=self.rt).run(run_id=ev.child, tag=ev.child)
        return StopEvent(result=got)


def test_a_fork_refused_inside_a_step_leaves_the_run_to_recover(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step starts a child under the id of a run the store holds already: the start is
    refused with `ForkWithoutIntent` inside the step. The handler ends with it (not a
    hang, nor a `WorkflowRuntimeError`); nothing of the step is committed, so the run
    reads "running" at its last checkpoint, and no claim is left held. A recovery with
    the same code is refused the same way (the parent's effect is not applied again);
    once the code is fixed (the step catches it), `rt.recover` continues the run."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    taken, run = new_run(), new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        assert await Child(runtime=rt).run(run_id=taken, tag="first") == "child-first"
        handler = Parent(rt).run(run_id=run, child=taken)
        with pytest.raises(ForkWithoutIntent) as refused:
            await asyncio.wait_for(handler, GUARD)
        assert refused.value.run_id == taken
        assert rt.status(run) == "running"
        assert [c.status for c in rt.checkpoints(run)] == ["running"]
        claim = rt.remit.store.get_claim(run, "main")
        assert claim is None or not claim.holder or claim.expires_at <= rt.remit.clock()
        again = rt.recover(Parent(rt), run)
        assert again is not None
        with pytest.raises(ForkWithoutIntent):
            await asyncio.wait_for(again, GUARD)
        assert rt.status(run) == "running"

        class Fixed(Parent):
            @step
            async def go(self, ctx: Context, ev: StartEvent) -> StopEvent:
                enter("go")
                pay(f"parent-{ev.child}")
                try:
                    got = await Child(runtime=self.rt).run(run_id=ev.child, tag=ev.child)
                except ForkWithoutIntent:
                    got = await Child(runtime=self.rt).run(tag="own")
                return StopEvent(result=got)

        fixed = rt.recover(Fixed(rt), run)
        assert fixed is not None
        assert await asyncio.wait_for(fixed, GUARD) == "child-own"
        assert rt.status(run) == "completed"

    asyncio.run(go())
    assert sorted(applied(tmp_path)) == ["child-first", "child-own", f"parent-{taken}"]
    assert entered(tmp_path) == ["go", "go", "go"]


@pytest.mark.parametrize("fork", [False, True], ids=["run", "fork_branch"])
def test_cancel_of_an_unknown_run_leaves_no_claim_behind(url: str, fork: bool) -> None:
    """`rt.cancel` of a run (or a fork's branch) the store does not hold raises
    `UnknownRecord` and stores nothing: no claim row for a run that does not exist
    (it took the run's claim before it read the run)."""
    run = new_run()
    target = f"{run}@fork-{uuid.uuid4().hex[:8]}" if fork else run
    branch = target.rpartition("@")[2] if fork else "main"
    rt = RemitRuntime(url)
    with pytest.raises(UnknownRecord):
        asyncio.run(rt.cancel(target))
    assert rt.remit.store.get_claim(run, branch) is None
    with pytest.raises(UnknownRecord):
        rt.status(target)


class Reply(HumanResponseEvent):
    to: str


class ForA(Event):
    pass


class ForB(Event):
    pass


class Got(Event):
    paid: str


class TwoAsks(Workflow):
    """Two steps each wait for a `Reply` to itself (`requirements`) and pay for it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def fan(self, ctx: Context, ev: StartEvent) -> ForA | ForB | None:
        ctx.send_event(ForA())
        ctx.send_event(ForB())
        return None

    async def _one(self, ctx: Context, who: str) -> Got:
        reply = await ctx.wait_for_event(
            Reply, waiter_event=InputRequiredEvent(prefix=f"{who}?"), requirements={"to": who}
        )
        return Got(paid=pay(f"{who}-{reply.response}"))

    @step
    async def wait_a(self, ctx: Context, ev: ForA) -> Got:
        return await self._one(ctx, "a")

    @step
    async def wait_b(self, ctx: Context, ev: ForB) -> Got:
        return await self._one(ctx, "b")

    @step
    async def gather(self, ctx: Context, ev: Got) -> StopEvent | None:
        got = ctx.collect_events(ev, [Got, Got])
        return None if got is None else StopEvent(result=sorted(g.paid for g in got))


def test_a_copy_restored_after_one_of_two_questions_was_answered(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two questions open at the pause; one copy answers the first. A copy restored from
    the pause then, to answer the second, is refused with `PauseAnswered` naming the
    question that was answered (its stale pause would take that one again); the second
    answer, sent with `rt.respond` as the README says, is taken; each paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        wf = TwoAsks(runtime=rt)
        handler = wf.run(run_id=run)
        for _ in range(400):
            found = rt.checkpoints(run) if rt.remit.branch(run) is not None else []
            if found and found[0].status == "waiting" and len(found[0].waiting) == 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the run did not ask both questions")
        snapshot = handler.ctx.to_dict()
        await handler.cancel_run()
        pause = _pause_id(rt, run)
        first = TwoAsks(runtime=rt)
        a = first.run(ctx=Context.from_dict(first, snapshot))
        await rt.send_event(a, Reply(response="ada", to="a"))
        for _ in range(400):
            if rt.checkpoints(run)[0].checkpoint_id != pause:
                break
            await asyncio.sleep(0.02)
        second = TwoAsks(runtime=rt)
        with pytest.raises(ResumeConflict) as refused:
            second.run(ctx=Context.from_dict(second, snapshot))
        assert isinstance(refused.value, PauseAnswered)
        assert refused.value.interrupt_id is not None and "to" in refused.value.interrupt_id
        for _ in range(400):  # (the step waits again, for the second question only)
            head = rt.checkpoints(run)[0]
            if head.status == "waiting" and len(head.waiting) == 1:
                break
            await asyncio.sleep(0.02)
        await rt.send_event(a, Reply(response="bob", to="b"))
        assert await asyncio.wait_for(a, GUARD) == ["a-ada", "b-bob"]

    asyncio.run(go())
    assert sorted(applied(tmp_path)) == ["a-ada", "b-bob"]
