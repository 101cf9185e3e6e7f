"""LlamaIndex probe round 49, on SQLite, PostgreSQL and Redis: several runs of ONE
workflow object at once in one event loop, each parked on its own question and
answered out of order, through each way the framework and Remit offer to answer.

A server, or any asyncio program, runs one workflow object for many users at once.
Each run parks on its question; answers come in any order, through `rt.respond` with
that object (which answers through the parked copy), `rt.send_event(handler, ...)` and
the framework's own `handler.ctx.send_event`. Each run must take its own answer once
(P5), pay once (P2), keep its own state and stream only its own events, and end with
what the framework's own runtime gives for the same answers (differential).

No bug was found; these pin what holds: answers in reverse order or all at once, through
each path; the documented pause of the three runs restored into the one object (each
restored stream as the framework's); an answer from another object or runtime, or
`rt.cancel`, of one run stopping only that run's parked copy; `rt.update_state` of one
run reaching only its copy; six answers racing on one run (one acknowledged); a process
SIGKILLed after the three answers were acknowledged, or inside one run's `charge` after
it paid, recovered run by run, each paying once; and the workflow `timeout=` counting
alive time across a documented pause, as the framework does.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser, WorkflowTimeoutError
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 60
WHO = ["ada", "bob", "eve"]


class Asked(Event):
    pass


class Approved(Event):
    answer: str


class Progress(Event):
    who: str
    what: str


class Asking(Workflow):
    """`prepare` keeps the start's `who` in the state; `approve` asks and waits;
    `charge` pays for `who` and the answer, streams a progress event, and ends with
    what the run's own state holds."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        # (On the framework's own runtime there is no Remit step to record an effect in.)
        self.remit = "runtime" in kw

    @step
    async def prepare(self, ctx: Context, ev: StartEvent) -> Asked:
        enter(f"prepare:{ev.get('who')}")
        await ctx.store.set("who", ev.get("who"))
        return Asked()

    @step
    async def approve(self, ctx: Context, ev: Asked) -> Approved:
        who = await ctx.store.get("who")
        got = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix=f"charge {who}?")
        )
        return Approved(answer=got.response)

    @step
    async def charge(self, ctx: Context, ev: Approved) -> StopEvent:
        who = await ctx.store.get("who")
        enter(f"charge:{who}")
        paid = pay(f"{who}-by-{ev.answer}") if self.remit else f"{who}-by-{ev.answer}"
        die_at(f"paid:{who}")
        ctx.write_event_to_stream(Progress(who=who, what=paid))
        await ctx.store.set("paid", paid)
        return StopEvent(result=f"{who}:{ev.answer}:{await ctx.store.get('paid')}")


async def streamed(handler: Any, questions: list[str], seen: list[Any]) -> None:
    """Collect what `handler` streams into `seen`; note each question's prefix."""
    async for ev in handler.stream_events():
        seen.append(ev)
        if isinstance(ev, InputRequiredEvent):
            questions.append(ev.prefix)


async def answer(
    how: str, rt: RemitRuntime | None, flow: Workflow, run: str, handler: Any, reply: str
) -> None:
    event = HumanResponseEvent(response=reply)
    if how == "handler.ctx.send_event":
        handler.ctx.send_event(event)
    elif how == "rt.send_event":
        assert rt is not None
        await rt.send_event(handler, event)
    else:
        assert rt is not None
        await rt.respond(flow, run, event)


HOWS = ["rt.respond", "rt.send_event", "handler.ctx.send_event"]


async def three_runs(
    flow: Workflow, rt: RemitRuntime | None, order: str, hows: list[str]
) -> tuple[list[Any], dict[str, list[Any]], dict[str, list[str]], list[str]]:
    """Start one run per name of `flow` at once, wait until each asks, then answer them
    (the last started first, or all at once), each run `i` through `hows[i]`. The
    results, what each stream carried, its questions, and the run ids."""
    runs = [f"probe49-{who}-{uuid.uuid4().hex[:8]}" for who in WHO]
    handlers = [
        flow.run(run_id=run, who=who) if rt is not None else flow.run(who=who)
        for run, who in zip(runs, WHO, strict=True)
    ]
    seen: dict[str, list[Any]] = {who: [] for who in WHO}
    questions: dict[str, list[str]] = {who: [] for who in WHO}
    streams = [
        asyncio.create_task(streamed(h, questions[who], seen[who]))
        for h, who in zip(handlers, WHO, strict=True)
    ]
    for _ in range(GUARD * 20):
        if all(questions[who] for who in WHO):
            break
        await asyncio.sleep(0.05)
    assert all(questions[who] for who in WHO), questions
    if rt is not None:
        for run in runs:
            await until_parked(rt, run)
    replies = [f"{who}-ok" for who in WHO]
    calls = [answer(hows[i], rt, flow, runs[i], handlers[i], replies[i]) for i in range(len(WHO))]
    if order == "reversed":
        for call in reversed(calls):
            await call
    else:
        await asyncio.gather(*calls)
    results = await asyncio.wait_for(asyncio.gather(*handlers), GUARD)
    await asyncio.wait_for(asyncio.gather(*streams), GUARD)
    return results, seen, questions, runs


@pytest.mark.parametrize("order", ["reversed", "at-once"])
@pytest.mark.parametrize("rotate", [0, 1, 2])
def test_runs_of_one_workflow_object_answered_out_of_order_take_their_own_answers(
    store_url: str, order: str, rotate: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2, differential: three runs of one `Asking` object park in one event loop;
    each is answered through another path (rotated over the runs), the last started
    first or all at once. Each handler ends with its own answer and its own state, as
    on the framework's own runtime; each stream carries its own question once and its
    own progress; each run pays once, and a second answer to any of them is refused."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    hows = HOWS[rotate:] + HOWS[:rotate]

    own_dir = tmp_path / "own"
    own_dir.mkdir()
    monkeypatch.setenv(DIR_VAR, str(own_dir))
    own, own_seen, own_questions, _ = asyncio.run(
        three_runs(Asking(), None, order, ["handler.ctx.send_event"] * 3)
    )

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(store_url)

    async def on_remit() -> Any:
        flow = Asking(runtime=rt)
        done = await three_runs(flow, rt, order, hows)
        refusals = []
        for run in done[3]:
            with pytest.raises(ResumeConflict) as refused:
                await rt.respond(flow, run, HumanResponseEvent(response="again"))
            refusals.append(refused.value)
        return done, refusals

    try:
        (results, seen, questions, runs), refusals = asyncio.run(on_remit())
        assert results == own == [f"{w}:{w}-ok:{w}-by-{w}-ok" for w in WHO]
        assert questions == own_questions == {w: [f"charge {w}?"] for w in WHO}
        for who in WHO:
            progress = [(e.who, e.what) for e in seen[who] if isinstance(e, Progress)]
            assert progress == [(who, f"{who}-by-{who}-ok")], seen[who]
            assert [type(e).__name__ for e in seen[who]] == [
                type(e).__name__ for e in own_seen[who]
            ], (seen[who], own_seen[who])
            assert (
                isinstance(seen[who][-1], StopEvent)
                and seen[who][-1].result == results[WHO.index(who)]
            )
        assert sorted(applied(tmp_path)) == sorted(f"{w}-by-{w}-ok" for w in WHO)
        assert sorted(entered(tmp_path)) == sorted(
            [f"prepare:{w}" for w in WHO] + [f"charge:{w}" for w in WHO]
        )
        for run, who in zip(runs, WHO, strict=True):
            assert rt.status(run) == "completed"
            assert rt.result(run) == results[WHO.index(who)]
        assert len(refusals) == 3
        assert sorted(applied(tmp_path)) == sorted(f"{w}-by-{w}-ok" for w in WHO)
    finally:
        rt.remit.close()


def test_the_documented_pause_of_runs_of_one_object_restores_each_its_own_run(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P5, differential: the framework's documented pause (snapshot as the question
    streams, `cancel_run`) taken of three runs of one object in one loop; the snapshots
    restored (`Context.from_dict`) into that one object at once, and answered in
    reverse order through each restored handler: each run goes on under its own id with
    its own state and streams what it streams on the framework's own runtime, and pays
    once."""

    async def rounds(flow: Workflow, rt: RemitRuntime | None) -> tuple[Any, list[str], Any]:
        runs = [f"probe49-{who}-{uuid.uuid4().hex[:8]}" for who in WHO]
        handlers = [
            flow.run(run_id=run, who=who) if rt is not None else flow.run(who=who)
            for run, who in zip(runs, WHO, strict=True)
        ]

        async def paused(handler: Any) -> dict[str, Any]:
            async for ev in handler.stream_events():
                if isinstance(ev, InputRequiredEvent):
                    snapshot = handler.ctx.to_dict()
                    await handler.cancel_run()
                    return snapshot
            raise AssertionError("no question streamed")

        snapshots = await asyncio.wait_for(asyncio.gather(*map(paused, handlers)), GUARD)
        if rt is not None:
            assert [rt.status(run) for run in runs] == ["waiting"] * 3
        restored = [flow.run(ctx=Context.from_dict(flow, s)) for s in snapshots]
        seen: list[list[Any]] = [[] for _ in WHO]
        streams = [
            asyncio.create_task(streamed(h, [], into))
            for h, into in zip(restored, seen, strict=True)
        ]
        for handler, who in reversed(list(zip(restored, WHO, strict=True))):
            handler.ctx.send_event(HumanResponseEvent(response=f"{who}-ok"))
        results = await asyncio.wait_for(asyncio.gather(*restored), GUARD)
        await asyncio.wait_for(asyncio.gather(*streams), GUARD)
        shown = [[(type(e).__name__, e.model_dump(mode="json")) for e in got] for got in seen]
        return results, runs, shown

    own_dir = tmp_path / "own"
    own_dir.mkdir()
    monkeypatch.setenv(DIR_VAR, str(own_dir))
    own, _, own_shown = asyncio.run(rounds(Asking(), None))
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(store_url)
    try:
        results, runs, shown = asyncio.run(rounds(Asking(runtime=rt), rt))
        assert results == own == [f"{w}:{w}-ok:{w}-by-{w}-ok" for w in WHO]
        # Each restored stream carries what the framework's own restored stream carries
        # (its own progress and result, once; not the question asked before the pause).
        assert shown == own_shown
        assert all(sum(name == "Progress" for name, _ in got) == 1 for got in shown), shown
        assert [rt.status(run) for run in runs] == ["completed"] * 3
        assert [rt.result(run) for run in runs] == results
        assert sorted(applied(tmp_path)) == sorted(f"{w}-by-{w}-ok" for w in WHO)
        assert sorted(entered(tmp_path)) == sorted(
            [f"prepare:{w}" for w in WHO] + [f"charge:{w}" for w in WHO]
        )
    finally:
        rt.remit.close()


@pytest.mark.parametrize("how", ["another object", "another runtime", "rt.cancel"])
def test_an_answer_or_cancel_of_one_run_stops_only_that_runs_parked_copy(
    store_url: str, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, liveness: three runs of one object parked in one loop; the middle one is
    answered by `rt.respond` with ANOTHER object of the workflow, or with another
    runtime object on the store, or ended by `rt.cancel` (documented: its parked copy
    here ends with `ResumeConflict`, or `WorkflowCancelledByUser`). The parked copies of
    the other two runs stay parked, past the pace their watches look at the store, and
    their own answers, through their handlers, end them with their own results."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(store_url, lease=1)
    elsewhere = RemitRuntime(store_url, lease=1)

    async def go() -> tuple[list[Any], Any, list[str]]:
        flow = Asking(runtime=rt)
        runs = [f"probe49-{who}-{uuid.uuid4().hex[:8]}" for who in WHO]
        handlers = [flow.run(run_id=run, who=who) for run, who in zip(runs, WHO, strict=True)]
        for run in runs:
            await until_parked(rt, run)
        middle: Any = None
        if how == "rt.cancel":
            await rt.cancel(runs[1])
        else:
            other = elsewhere if how == "another runtime" else rt
            answered = await other.respond(
                Asking(runtime=other), runs[1], HumanResponseEvent(response="x")
            )
            middle = await asyncio.wait_for(answered, GUARD)
        await asyncio.sleep(rt.lease / 3 * 2 + 0.5)  # (the watches of parked copies look)
        assert not handlers[0].is_done() and not handlers[2].is_done()
        await rt.send_event(handlers[2], HumanResponseEvent(response="eve-ok"))
        handlers[0].ctx.send_event(HumanResponseEvent(response="ada-ok"))
        outcomes = await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), GUARD)
        return outcomes, middle, runs

    try:
        outcomes, middle, runs = asyncio.run(go())
        assert outcomes[0] == "ada:ada-ok:ada-by-ada-ok", outcomes
        assert outcomes[2] == "eve:eve-ok:eve-by-eve-ok", outcomes
        paid = ["ada-by-ada-ok", "eve-by-eve-ok"]
        if how == "rt.cancel":
            assert isinstance(outcomes[1], WorkflowCancelledByUser), outcomes
            assert [rt.status(run) for run in runs] == ["completed", "cancelled", "completed"]
        else:
            assert middle == "bob:x:bob-by-x"
            assert isinstance(outcomes[1], ResumeConflict), outcomes
            assert [rt.status(run) for run in runs] == ["completed"] * 3
            paid.append("bob-by-x")
        assert sorted(applied(tmp_path)) == sorted(paid)
    finally:
        rt.remit.close()
        elsewhere.remit.close()


DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from llamaindex_parts import until_parked
from llamaindex_sink import die_at
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes49 import Asking, WHO

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = Asking(runtime=rt)
    runs = {runs!r}
    handlers = [flow.run(run_id=run, who=who) for run, who in zip(runs, WHO)]
    for run in runs:
        await until_parked(rt, run)
    await asyncio.gather(
        *(rt.respond(flow, run, HumanResponseEvent(response=who + "-ok"))
          for run, who in zip(runs, WHO))
    )
    die_at("answered")
    print("RESULT", await asyncio.gather(*handlers), flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("kill", ["answered", "paid:ada", "paid:bob", "paid:eve"])
def test_runs_of_one_object_killed_after_their_answers_recover_each_once(
    store_url: str, kill: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P5, L1: one process runs three runs of one object, answers the three at
    once with `rt.respond` (through the parked copies), and is SIGKILLed once every
    answer was acknowledged, or inside one run's `charge` after it paid. Another
    process recovers each run: each ends with the answer that was acknowledged to it
    (none is asked for again), `prepare` of no run is entered again, and each run pays
    once."""
    runs = [f"probe49-{who}-{uuid.uuid4().hex[:8]}" for who in WHO]
    code = DRIVER.format(tests=str(Path(__file__).parent), url=store_url, runs=runs)
    done = in_process(code, tmp_path, kill)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr)
    before = entered(tmp_path)
    assert sorted(before[:3]) == sorted(f"prepare:{w}" for w in WHO), before
    monkeypatch.setenv(DIR_VAR, str(tmp_path))

    async def recover_all() -> list[Any]:
        rt = RemitRuntime(store_url, lease=1)
        try:
            flow = Asking(runtime=rt)
            handlers = []
            for run in runs:
                for _ in range(GUARD * 10):
                    try:
                        handlers.append(rt.recover(flow, run))
                        break
                    except ResumeConflict:
                        await asyncio.sleep(0.1)
                else:
                    raise AssertionError(f"run {run} never became recoverable")
            await asyncio.wait_for(asyncio.gather(*(h for h in handlers if h is not None)), GUARD)
            assert [rt.status(run) for run in runs] == ["completed"] * 3
            return [rt.result(run) for run in runs]
        finally:
            rt.remit.close()

    results = asyncio.run(recover_all())
    assert results == [f"{w}:{w}-ok:{w}-by-{w}-ok" for w in WHO]
    assert sorted(applied(tmp_path)) == sorted(f"{w}-by-{w}-ok" for w in WHO)
    steps = entered(tmp_path)
    assert sorted(s for s in steps if s.startswith("prepare")) == sorted(
        f"prepare:{w}" for w in WHO
    ), steps
    for who in WHO:
        assert 1 <= steps.count(f"charge:{who}") <= 2, steps
    if kill.startswith("paid:"):
        assert steps.count(kill.replace("paid", "charge")) == 2, steps


def test_an_edit_of_one_parked_run_reaches_only_that_runs_copy(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P4, P1: three runs of one object parked in one loop; `rt.update_state` of the
    middle one is made through its parked copy (documented), and each run then answered
    through its handler: the edited run pays and ends with the edited value, the other
    two with their own, untouched; the stored state of each reads the same."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(store_url, lease=1)

    async def go() -> tuple[list[Any], list[str]]:
        flow = Asking(runtime=rt)
        runs = [f"probe49-{who}-{uuid.uuid4().hex[:8]}" for who in WHO]
        handlers = [flow.run(run_id=run, who=who) for run, who in zip(runs, WHO, strict=True)]
        for run in runs:
            await until_parked(rt, run)
        await rt.update_state(flow, runs[1], {"who": "zed"})
        for handler, who in reversed(list(zip(handlers, WHO, strict=True))):
            await rt.send_event(handler, HumanResponseEvent(response=f"{who}-ok"))
        return await asyncio.wait_for(asyncio.gather(*handlers), GUARD), runs

    try:
        results, runs = asyncio.run(go())
        assert results == [
            "ada:ada-ok:ada-by-ada-ok",
            "zed:bob-ok:zed-by-bob-ok",
            "eve:eve-ok:eve-by-eve-ok",
        ]
        flow = Asking(runtime=rt)
        assert [rt.get_state(flow, run).get("who") for run in runs] == ["ada", "zed", "eve"]
        assert sorted(applied(tmp_path)) == ["ada-by-ada-ok", "eve-by-eve-ok", "zed-by-bob-ok"]
    finally:
        rt.remit.close()


class Timed(Workflow):
    """`prepare` and `charge` each take `self.slow` seconds; `approve` waits between."""

    def __init__(self, slow: float, **kw: Any) -> None:
        super().__init__(timeout=1.6, **kw)
        self.slow = slow

    @step
    async def prepare(self, ev: StartEvent) -> Asked:
        await asyncio.sleep(self.slow)
        return Asked()

    @step
    async def approve(self, ctx: Context, ev: Asked) -> Approved:
        got = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="go?")
        )
        return Approved(answer=got.response)

    @step
    async def charge(self, ev: Approved) -> StopEvent:
        await asyncio.sleep(self.slow)
        return StopEvent(result=ev.answer)


@pytest.mark.parametrize("slow", [0.5, 1.0])
def test_the_workflow_timeout_across_a_documented_pause_matches_the_framework(
    store_url: str, slow: float
) -> None:
    """Differential: a workflow `timeout=1.6` counts the time the run was alive, not the
    time it spent paused (snapshot, `cancel_run`, two seconds, `Context.from_dict` in
    another runtime object). With steps of 0.5 s the restored run completes; with steps
    of 1 s it times out inside `charge`; both as on the framework's own runtime. The
    stored run reads "completed", or "failed" (a timeout with a step in flight)."""

    async def paused_then_restored(make: Any, **run_kw: Any) -> tuple[str, str]:
        wf = make(None)
        handler = wf.run(**run_kw)
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                snapshot = handler.ctx.to_dict()
                await handler.cancel_run()
                break
        await asyncio.sleep(2.0)
        wf = make(wf)
        handler = wf.run(ctx=Context.from_dict(wf, snapshot))
        handler.ctx.send_event(HumanResponseEvent(response="ok"))
        try:
            return "result", await asyncio.wait_for(handler, GUARD)
        except WorkflowTimeoutError as exc:
            return "timeout", type(exc).__name__

    own = asyncio.run(paused_then_restored(lambda _: Timed(slow)))
    first = RemitRuntime(store_url)
    second = RemitRuntime(store_url)

    def on_remit(before: Workflow | None) -> Workflow:
        return Timed(slow, runtime=first if before is None else second)

    run = f"probe49-timed-{uuid.uuid4().hex[:8]}"
    try:
        remit = asyncio.run(paused_then_restored(on_remit, run_id=run))
        expected = ("result", "ok") if slow < 0.8 else ("timeout", "WorkflowTimeoutError")
        assert remit == own == expected
        assert second.status(run) == ("completed" if slow < 0.8 else "failed")
    finally:
        first.remit.close()
        second.remit.close()


def test_answers_racing_on_one_run_in_one_loop_take_the_acknowledged_one(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2 (cell 36, one loop, one workflow object): six tasks answer one parked run
    at once, through `rt.respond` with its own object (the parked copy) and through
    `rt.send_event(handler, ...)`, each with a value of its own, while two other runs of
    the object stay parked. Exactly one is acknowledged, the others get
    `ResumeConflict`; the run ends with the acknowledged value and pays once, and the
    other runs, answered after, end with their own."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(store_url, lease=1)

    async def go() -> tuple[list[Any], list[Any], list[str]]:
        flow = Asking(runtime=rt)
        runs = [f"probe49-{who}-{uuid.uuid4().hex[:8]}" for who in WHO]
        handlers = [flow.run(run_id=run, who=who) for run, who in zip(runs, WHO, strict=True)]
        for run in runs:
            await until_parked(rt, run)

        async def via(i: int) -> None:
            event = HumanResponseEvent(response=f"v{i}")
            if i % 2:
                await rt.send_event(handlers[1], event)
            else:
                await rt.respond(flow, runs[1], event)

        raced = await asyncio.gather(*(via(i) for i in range(6)), return_exceptions=True)
        for i in (0, 2):
            await rt.send_event(handlers[i], HumanResponseEvent(response=f"{WHO[i]}-ok"))
        outcomes = await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), GUARD)
        return raced, outcomes, runs

    try:
        raced, outcomes, runs = asyncio.run(go())
        won = [i for i, r in enumerate(raced) if r is None]
        assert len(won) == 1, raced
        assert all(isinstance(r, ResumeConflict) for r in raced if r is not None), raced
        value = f"v{won[0]}"
        assert outcomes == [
            "ada:ada-ok:ada-by-ada-ok",
            f"bob:{value}:bob-by-{value}",
            "eve:eve-ok:eve-by-eve-ok",
        ]
        assert rt.result(runs[1]) == outcomes[1]
        assert sorted(applied(tmp_path)) == sorted(
            ["ada-by-ada-ok", f"bob-by-{value}", "eve-by-eve-ok"]
        )
    finally:
        rt.remit.close()
