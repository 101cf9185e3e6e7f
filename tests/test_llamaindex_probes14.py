"""LlamaIndex probes, round 14, on SQLite, PostgreSQL and Redis: a typed `ctx.store`
carried across the framework's pause (`ctx.to_dict()` to a file) into another
process, a loop (a step that returns the event it takes) SIGKILLed mid-loop and
recovered under a consumer of `stream_events`, an event sent with `step=` to one of
two steps that take it, across a crash of the step it reached, a workflow whose
state model changed between the pause and the resume, and a step retry waiting out its
delay when the process dies. No bug was found in this round: these pin what holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, enter, entered, pay, payments
from pydantic import BaseModel, Field
from test_llamaindex_probes10 import recovered
from test_llamaindex_probes11 import run_driver
from test_llamaindex_probes12 import until_parked
from test_llamaindex_probes13 import applied, crash_here
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core.errors import CheckpointInvalid, ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 30
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe14-{uuid.uuid4().hex[:12]}"


def crash_driving(url: str, flow: str, run: str, tmp: Path, point: str) -> None:
    """Start `run` of the workflow class `flow` (of this module) in a process of its
    own, SIGKILLed at `crash_here(point)`."""
    code = START_DRIVER.format(tests=TESTS, url=url, flow=flow, run=run)
    dead = run_driver(code, tmp, PROBE13_CRASH=point)
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)


START_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes14 import {flow}

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    await {flow}(runtime=rt).run(run_id={run!r})

asyncio.run(main())
"""


class Untimed(Workflow):
    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)


# -- a typed state carried across a pause into another process -------------------------


class Card(BaseModel):
    holder: str = ""
    limit: int = Field(default=0, ge=0)
    tags: tuple[str, ...] = ()


class Order(BaseModel):
    placed: datetime | None = None
    pair: tuple[int, int] = (0, 0)
    seen: set[str] = Field(default_factory=set)
    card: Card = Field(default_factory=Card)
    approved_by: str | None = None


class Filled(Event):
    refused: str


PLACED = datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc)


class Checkout(Untimed):
    """`fill` sets typed values (the ones JSON alone would give back as others: a
    datetime, a tuple, a set, a tuple in a nested model), tries an invalid nested one
    and keeps the refusal's field; `approve` waits for a name, then reads it all back."""

    @step
    async def fill(self, ctx: Context[Order], ev: StartEvent) -> Filled:
        enter("fill")
        await ctx.store.set("placed", PLACED)
        await ctx.store.set("pair", (3, 4))
        await ctx.store.set("seen", {"x", "y"})
        await ctx.store.set("card", Card(holder="ada", limit=50, tags=("gold", "eu")))
        try:
            await ctx.store.set("card.limit", -1)
        except CheckpointInvalid as exc:
            return Filled(refused=str(exc.field))
        return Filled(refused="")

    @step
    async def approve(self, ctx: Context[Order], ev: Filled) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        enter("approve")
        await ctx.store.set("approved_by", answer.response)
        state = await ctx.store.get_state()
        return StopEvent(
            result={
                "refused": ev.refused,
                "placed": state.placed == PLACED,
                "pair": state.pair == (3, 4),
                "seen": state.seen == {"x", "y"},
                "card": state.card == Card(holder="ada", limit=50, tags=("gold", "eu")),
                "by": state.approved_by,
                "paid": pay(f"{state.card.holder}:{state.card.limit}"),
            }
        )


RESTORE_DRIVER = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
from workflows import Context
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes14 import Checkout

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = Checkout(runtime=rt)
    with open({snapshot!r}) as f:
        handler = flow.run(ctx=Context.from_dict(flow, json.load(f)))
    await rt.send_event(handler, HumanResponseEvent(response="bob"))
    print(json.dumps(await asyncio.wait_for(handler, 30)), flush=True)

asyncio.run(main())
"""


def test_a_typed_state_set_before_a_pause_reads_back_in_another_process(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P4 through `ctx.store` with a typed model: values set before the framework's
    pause (`ctx.to_dict()` written to a JSON file, `cancel_run()`) read back equal, as
    their declared types, in the process that restores the file and answers; the
    invalid nested write was refused naming `card.limit` and left the card as it was;
    the stored state is the same one `rt.get_state` reads."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    snapshot = tmp_path / "snapshot.json"

    async def pause() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = Checkout(runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        snapshot.write_text(json.dumps(handler.ctx.to_dict()))
        await handler.cancel_run()
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)

    asyncio.run(pause())
    done = run_driver(
        RESTORE_DRIVER.format(tests=TESTS, url=store_url, snapshot=str(snapshot)), tmp_path
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert json.loads(done.stdout) == {
        "refused": "card.limit",
        "placed": True,
        "pair": True,
        "seen": True,
        "card": True,
        "by": "bob",
        "paid": "ada:50",
    }
    rt = RemitRuntime(store_url)
    state: Any = rt.get_state(Checkout(runtime=rt), run)
    assert (state.placed, state.pair, state.seen) == (PLACED, (3, 4), {"x", "y"})
    assert state.card.tags == ("gold", "eu") and state.approved_by == "bob"
    assert applied(tmp_path) == ["ada:50"] and entered(tmp_path) == ["fill", "approve"]


# -- a loop killed mid-loop, recovered under a stream consumer -------------------------


class Tick(Event):
    n: int


class Progress(Event):
    n: int


class Count(Untimed):
    """`tick` takes `Tick(n)`, pays for round n, writes `Progress(n)` to the event stream
    and returns `Tick(n + 1)`, for five rounds."""

    @step
    async def begin(self, ctx: Context, ev: StartEvent) -> Tick:
        enter("begin")
        return Tick(n=1)

    @step
    async def tick(self, ctx: Context, ev: Tick) -> Tick | StopEvent:
        enter(f"tick:{ev.n}")
        paid = pay(f"round:{ev.n}")
        crash_here(f"tick:{ev.n}")
        await ctx.store.set(f"round{ev.n}", paid)
        ctx.write_event_to_stream(Progress(n=ev.n))
        if ev.n == 5:
            return StopEvent(result=[await ctx.store.get(f"round{k}") for k in range(1, 6)])
        return Tick(n=ev.n + 1)


def test_a_loop_killed_mid_loop_continues_its_rounds_and_its_stream(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2 on a loop: the process is SIGKILLed in round 3 after it paid. Recovery
    runs round 3 again (in flight) without paying again, then rounds 4 and 5; rounds
    1 and 2 are not entered again; each round paid once under its own key. A consumer
    of the recovered handler's `stream_events` sees the rounds it ran, in order, and
    the stream ends with the run."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    crash_driving(store_url, "Count", run, tmp_path, "tick:3")
    assert entered(tmp_path) == ["begin", "tick:1", "tick:2", "tick:3"]

    async def take_over() -> tuple[list[int], Any]:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Count(runtime=rt), run)
        assert handler is not None
        seen = []
        async for ev in handler.stream_events():
            if isinstance(ev, Progress):
                seen.append(ev.n)
        return seen, await asyncio.wait_for(handler, GUARD)

    seen, result = asyncio.run(take_over())
    assert seen == [3, 4, 5]
    assert result == [f"round:{n}" for n in range(1, 6)]
    assert entered(tmp_path)[4:] == ["tick:3", "tick:4", "tick:5"]
    assert applied(tmp_path) == [f"round:{n}" for n in range(1, 6)]
    assert len({line.split()[0] for line in payments(tmp_path)}) == 5
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed"
    state: Any = rt.get_state(Count(runtime=rt), run)
    assert [state[f"round{n}"] for n in range(1, 6)] == result


# -- an event sent to one of two steps that take it -------------------------------------


class Ping(Event):
    who: str


class Hit(Event):
    by: str


class Targeted(Untimed):
    """`start` sends `Ping` to `right` only, though `left` takes it too; `gather` ends the
    run once both `left` and `right` hit (`left` only runs on a `Ping` from outside)."""

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Ping | None:
        enter("start")
        ctx.send_event(Ping(who="start"), step="right")
        return None

    @step
    async def left(self, ctx: Context, ev: Ping) -> Hit:
        enter(f"left:{ev.who}")
        return Hit(by=pay(f"left:{ev.who}"))

    @step
    async def right(self, ctx: Context, ev: Ping) -> Hit:
        enter(f"right:{ev.who}")
        paid = pay(f"right:{ev.who}")
        crash_here("right")
        return Hit(by=paid)

    @step
    async def gather(self, ctx: Context, ev: Hit) -> StopEvent | None:
        got = ctx.collect_events(ev, [Hit, Hit])
        if got is None:
            return None
        enter("gather")
        return StopEvent(result=sorted(h.by for h in got))


def test_an_event_sent_to_one_step_reaches_only_it_across_a_crash(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2 with `send_event(..., step=...)`: the process is SIGKILLed in `right`, after
    it paid for the `Ping` sent to it alone. Recovery runs `right` again on it (not
    `left`, which takes a `Ping` too), without paying again, and parks. From outside, a
    `Ping` sent to `gather` (which takes none) is refused, nothing stored; one sent to
    `left` runs `left` only and ends the run."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    crash_driving(store_url, "Targeted", run, tmp_path, "right")
    assert entered(tmp_path) == ["start", "right:start"]

    async def take_over() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Targeted(runtime=rt), run)
        assert handler is not None
        await until_parked(rt, run)
        assert entered(tmp_path) == ["start", "right:start", "right:start"]
        history = rt.checkpoints(run)
        with pytest.raises(ResumeConflict):
            await rt.send_event(handler, Ping(who="out"), step="gather")
        assert rt.checkpoints(run) == history
        await rt.send_event(handler, Ping(who="out"), step="left")
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(take_over()) == ["left:out", "right:start"]
    assert entered(tmp_path)[3:] == ["left:out", "gather"]
    assert applied(tmp_path) == ["right:start", "left:out"]


# -- a state model changed between the pause and the resume ------------------------------


class Plain(BaseModel):
    amount: int = 0


class Stricter(BaseModel):
    amount: int = 0
    currency: str


class Approve(Untimed):
    """`ask` sets the amount, waits for a name, then pays the amount for it."""

    @step
    async def ask(self, ctx: Context[Plain], ev: StartEvent) -> StopEvent:
        await ctx.store.set("amount", 7)
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        enter("ask")
        return StopEvent(result=pay(f"{answer.response}:{await ctx.store.get('amount')}"))


class ApproveStricter(Untimed):
    """`Approve` as redeployed with a state model that requires a new field."""

    @step
    async def ask(self, ctx: Context[Stricter], ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        enter("stricter")
        return StopEvent(result=pay(f"{answer.response}:{await ctx.store.get('amount')}"))


def test_a_changed_state_model_is_refused_naming_the_field_and_the_run_stays_parked(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P4, P5: the stored state does not satisfy the state model of the workflow that
    resumes it (a required field was added). Answering, restoring and reading it are
    refused with `CheckpointInvalid` naming the field, run and checkpoint, before any
    step runs; the interrupt stays pending, the history as it was, and the workflow
    that wrote the run answers it once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        handler = Approve(runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        snapshot = handler.ctx.to_dict()
        await handler.cancel_run()
        history = rt.checkpoints(run)
        head = history[0].checkpoint_id

        other = RemitRuntime(store_url, lease=1)
        stricter = ApproveStricter(runtime=other)
        with pytest.raises(CheckpointInvalid) as refused:
            await other.respond(stricter, run, HumanResponseEvent(response="eve"))
        assert (refused.value.field, refused.value.run_id) == ("currency", run)
        assert refused.value.checkpoint_id == head
        with pytest.raises(CheckpointInvalid, match="currency"):
            stricter.run(ctx=Context.from_dict(stricter, snapshot))
        with pytest.raises(CheckpointInvalid, match="currency"):
            other.get_state(stricter, run)
        assert other.checkpoints(run) == history
        assert [i.status for i in other.remit.interrupts(run)] == ["pending"]

        answered = await other.respond(
            Approve(runtime=other), run, HumanResponseEvent(response="ada")
        )
        return await asyncio.wait_for(answered, GUARD)

    assert asyncio.run(go()) == "ada:7"
    assert applied(tmp_path) == ["ada:7"] and entered(tmp_path) == ["ask"]


# -- a retry waiting out its delay when the process dies ---------------------------------


class Flaky(Untimed):
    """`charge` pays, then fails on its first attempt (a timeout after the charge went
    through); the framework retries it after a delay of two seconds."""

    @step(retry_policy=retry_policy(wait=wait_fixed(2), stop=stop_after_attempt(3)))
    async def charge(self, ctx: Context, ev: StartEvent) -> StopEvent:
        first = not (Path(os.environ[DIR_VAR]) / "failed").exists()
        enter("charge:first" if first else "charge:retry")
        paid = pay("card")
        if first:
            (Path(os.environ[DIR_VAR]) / "failed").touch()
            # (The process dies once the failure is committed, in the retry's delay.)
            asyncio.get_running_loop().call_later(0.5, crash_here, "retry-delay")
            raise TimeoutError("the response did not come back")
        return StopEvent(result=paid)


def test_a_retry_waiting_out_its_delay_when_the_process_dies_runs_once_more(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2 with a step `retry_policy`: the process dies while the retry of `charge`
    waits out its delay (its first attempt paid, then raised). Recovery runs the step
    once more (the retry the failure scheduled, not twice) and ends the run with what
    it paid; the card is paid once (the first attempt's payment is the step's, and
    its retry finds it in the ledger)."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    crash_driving(store_url, "Flaky", run, tmp_path, "retry-delay")
    assert entered(tmp_path) == ["charge:first"]

    async def take_over() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Flaky(runtime=rt), run)
        assert handler is not None
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(take_over()) == "card"
    assert entered(tmp_path) == ["charge:first", "charge:retry"]
    assert applied(tmp_path) == ["card"]
