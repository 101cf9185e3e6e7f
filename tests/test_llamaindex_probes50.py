"""LlamaIndex probe round 50, on SQLite, PostgreSQL and Redis: compensation handlers
(`@catch_error`), code upgraded between a pause or a crash and its resume, and history
pruned (`rt.remit.prune`) under live runs.

Fixed: a copy restored from a paused snapshot (`Context.from_dict` of a `ctx.to_dict()`
taken at the pause) after another resumer answered that pause, and after the pause's
checkpoint was pruned (`Remit.prune` keeps heads and fork bases only), was refused with a
plain `ForkWithoutIntent` telling the user to "pass a fork token" (a fork that could no
longer start from a deleted checkpoint), where the same loser restored before the prune
got `PauseAnswered`, a `ResumeConflict` (P5). The pause's questions outlive its record
(their interrupts are kept): the ones raised at the pause, and the waiters the snapshot
holds (a snapshot taken after a state edit of the parked run names a later checkpoint
than the one that asked), now tell it, and the refusal says the pause can be forked no
more. Nothing runs and nothing is stored either way.

Held (kept as regression tests): a step that exhausts its `retry_policy` routed to a
`@catch_error` handler that pays a compensation, SIGKILLed in the last attempt, in the
handler after it paid, and in the step after it: recovery pays the compensation once
and ends as an unkilled run, and as the framework's own runtime does, the handler's
`StepFailedEvent` (step, attempts, exception class and message) included; a handler's
`max_recoveries` budget survives a SIGKILL (it is counted on the event's lineage in the
checkpoint): a recovery never grants a handler one more round, and the run fails where
the framework's own runtime fails it. A paused or crashed run continued by a new
version of its workflow (`workflow_version="v2"`, `accept_versions=["v1"]`) whose step
now calls another effect before the one it made, and one more after: the earlier call
keeps its key (its recorded outcome, not paid again), the new calls apply once; the
old version's parked copy ends with `ResumeConflict`, and the old version then refuses
the run (`VersionMismatch`, or `PauseAnswered` for its documented pause), storing and
paying nothing. A run pruned at each pause, forked before a prune, answered from
another process that is SIGKILLed after paying: recovery pays once, the fork (its base
kept) is answered on its own branch, and its token gives the same branch again.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from test_llamaindex_probes44 import recovered
from workflows import Context, Workflow, catch_error, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StepFailedEvent,
    StopEvent,
)
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core import NOT_APPLIED, effect
from remit_core.errors import (
    ForkWithoutIntent,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
)
from remit_llamaindex import PauseAnswered, RemitRuntime, RunFailed

GUARD = 60
TESTS = str(Path(__file__).parent)

START = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes50 import {workflow}

async def main():
    rt = RemitRuntime({url!r}, lease=1, workflow_version={version!r})
    try:
        print("RESULT", await {workflow}(runtime=rt).run(run_id={run!r}), flush=True)
    except Exception as exc:
        print("FAILED", type(exc).__name__, exc, flush=True)

asyncio.run(main())
"""


def start(url: str, workflow: str, run: str, tmp: Path, kill: str = "", version: str = "") -> str:
    """Run `workflow` under `run` in a new process, dying at `kill` (if given): what the
    process printed when it was not killed."""
    code = START.format(tests=TESTS, url=url, run=run, workflow=workflow, version=version)
    done = in_process(code, tmp, kill)
    if kill:
        assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr)
        return ""
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def recover(url: str, make: Any, run: str, version: str = "", accept: tuple[str, ...] = ()) -> Any:
    """Recover `run` in this process: the handler's outcome ("RESULT x" or "FAILED ...")
    and the run's stored status."""

    async def go() -> tuple[str, str]:
        rt = RemitRuntime(url, lease=1, workflow_version=version, accept_versions=accept)
        try:
            handler = await recovered(rt, make(rt), run)
            assert handler is not None, "the killed run had already ended"
            try:
                outcome = f"RESULT {await asyncio.wait_for(handler, GUARD)}"
            except Exception as exc:
                outcome = f"FAILED {type(exc).__name__} {exc}"
            return outcome, rt.status(run)
        finally:
            rt.remit.close()

    return asyncio.run(asyncio.wait_for(go(), GUARD))


# -- a compensation handler (`@catch_error`) across a SIGKILL ---------------------------


class Declined(RuntimeError):
    """What the payment step raises on every attempt (a card declined)."""


#: This process's attempts of `Compensated.charge` (a recovery counts its own).
_ATTEMPTS = itertools.count(1)


def settle(what: str, plain: bool) -> str:
    """Pay through the effect API on Remit; on the framework's own runtime (no Remit
    step scope) the same value without the effect."""
    return what if plain else pay(what)


class Refunded(Event):
    note: str


class Compensated(Workflow):
    """`charge` fails on both attempts of its retry policy; `compensate`, its
    `@catch_error` handler, pays an apology; `close` pays a receipt and ends."""

    def __init__(self, *, plain: bool = False, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        self.plain = plain

    @step(retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(2)))
    async def charge(self, ev: StartEvent) -> StopEvent:
        enter("charge")
        die_at(f"attempt{next(_ATTEMPTS)}")
        raise Declined("card declined")

    @catch_error(for_steps=["charge"])
    async def compensate(self, ev: StepFailedEvent) -> Refunded:
        enter("compensate")
        note = settle("apology", self.plain)
        die_at("apologized")
        kind = type(ev.exception).__name__
        return Refunded(note=f"{ev.step_name}:{ev.attempts}:{kind}:{ev.exception}:{note}")

    @step
    async def close(self, ev: Refunded) -> StopEvent:
        enter("close")
        receipt = settle("receipt", self.plain)
        die_at("closed")
        return StopEvent(result=f"{ev.note}:{receipt}")


def framework_outcome(workflow: Workflow) -> str:
    """The outcome of `workflow` on the framework's own runtime, as `recover` gives it."""

    async def go() -> str:
        try:
            return f"RESULT {await asyncio.wait_for(workflow.run(), GUARD)}"
        except Exception as exc:
            return f"FAILED {type(exc).__name__} {exc}"

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("kill", "steps"),
    [
        ("attempt2", ["charge", "charge", "charge", "compensate", "close"]),
        ("apologized", ["charge", "charge", "compensate", "compensate", "close"]),
        ("closed", ["charge", "charge", "compensate", "close", "close"]),
    ],
)
def test_a_compensation_handler_killed_anywhere_pays_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str, steps: list[str]
) -> None:
    """P1, P2, P6: a step exhausting its retries is routed to its `@catch_error` handler,
    which pays an apology. Killed in the last attempt (the retry count is in the
    checkpoint: one more attempt, not two), in the handler after it paid (re-run, the
    apology is the recorded one), or in the step after it: the recovery pays each thing
    once and ends as an unkilled run, and as the framework's own runtime, with the same
    `StepFailedEvent` (the exception's class and message, rebuilt from the checkpoint)."""
    run = f"probe50-ce-{uuid.uuid4().hex[:10]}"
    start(url, "Compensated", run, tmp_path, kill)
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    outcome, status = recover(url, lambda rt: Compensated(runtime=rt), run)
    expected = "RESULT charge:2:Declined:card declined:apology:receipt"
    assert (outcome, status) == (expected, "completed")
    assert applied(tmp_path) == ["apology", "receipt"]
    assert entered(tmp_path) == steps

    clean = tmp_path / "clean"
    clean.mkdir()
    assert start(url, "Compensated", run + "-clean", clean) == expected
    assert applied(clean) == ["apology", "receipt"]
    monkeypatch.setenv(DIR_VAR, str(tmp_path / "plain"))
    (tmp_path / "plain").mkdir()
    assert framework_outcome(Compensated(plain=True)) == expected


class Again(Event):
    n: int


class Relapsing(Workflow):
    """`charge` always fails; its handler (at most two rounds per lineage) pays an
    apology and sends `charge` another round; the third failure fails the run."""

    def __init__(self, *, plain: bool = False, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        self.plain = plain

    @step
    async def charge(self, ev: StartEvent | Again) -> StopEvent:
        n = ev.n if isinstance(ev, Again) else 0
        enter(f"charge{n}")
        die_at(f"charging{n}")
        raise Declined(f"declined {n}")

    @catch_error(for_steps=["charge"], max_recoveries=2)
    async def compensate(self, ev: StepFailedEvent) -> Again:
        n = ev.input_event.n if isinstance(ev.input_event, Again) else 0
        enter(f"compensate{n}")
        settle(f"apology{n}", self.plain)
        die_at(f"apologized{n}")
        return Again(n=n + 1)


@pytest.mark.parametrize("kill", ["apologized0", "charging1", "apologized1", "charging2"])
def test_a_handlers_recovery_budget_survives_a_kill(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str
) -> None:
    """P1, P2, P6: `max_recoveries=2` is counted on the failing event's lineage. A
    SIGKILL at any point of the rounds is recovered to the same end: two apologies paid
    once each, the third failure failing the run (no third round granted because the
    count was lost), as the unkilled run and the framework's own runtime end; the failed
    run's stored error is what its handler raised, and a later recovery runs nothing."""
    run = f"probe50-budget-{uuid.uuid4().hex[:10]}"
    start(url, "Relapsing", run, tmp_path, kill)
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    outcome, status = recover(url, lambda rt: Relapsing(runtime=rt), run)
    rounds = ["charge0", "compensate0", "charge1", "compensate1", "charge2"]
    assert status == "failed"
    assert outcome.startswith("FAILED ") and "declined 2" in outcome, outcome
    assert applied(tmp_path) == ["apology0", "apology1"]
    killed = kill.replace("apologized", "compensate").replace("charging", "charge")
    at = rounds.index(killed)
    assert entered(tmp_path) == [*rounds[: at + 1], killed, *rounds[at + 1 :]]

    async def later() -> None:
        rt = RemitRuntime(url, lease=1)
        try:
            with pytest.raises(RunFailed) as failed:
                rt.result(run)
            assert "declined 2" in str(failed.value.error)
            assert rt.recover(Relapsing(runtime=rt), run) is None
        finally:
            rt.remit.close()

    asyncio.run(later())
    assert applied(tmp_path) == ["apology0", "apology1"]

    clean = tmp_path / "clean"
    clean.mkdir()
    unkilled = start(url, "Relapsing", run + "-clean", clean)
    assert unkilled == outcome
    assert entered(clean) == rounds
    monkeypatch.setenv(DIR_VAR, str(tmp_path / "plain"))
    (tmp_path / "plain").mkdir()
    assert framework_outcome(Relapsing(plain=True)) == outcome
    assert entered(tmp_path / "plain") == rounds


# -- code upgraded between a pause (or a crash) and its resume --------------------------


def screened(tmp: Path) -> list[str]:
    """Every application of `screen`, as what it screened."""
    path = tmp / "screened.txt"
    return [line.split()[1] for line in path.read_text().splitlines()] if path.exists() else []


def _screen_reconcile(key: str) -> Any:
    path = Path(os.environ[DIR_VAR]) / "screened.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    hits = [line.split()[1] for line in lines if line.split()[0] == key]
    return hits[0] if hits else NOT_APPLIED


@effect(reconcile=_screen_reconcile)
def screen(what: str, *, idempotency_key: str) -> str:
    """A fraud check the new version of the workflow added: an effect of its own."""
    with (Path(os.environ[DIR_VAR]) / "screened.txt").open("a") as f:
        f.write(f"{idempotency_key} {what}\n")
    return what


class HoldV1(Workflow):
    """Version 1: `hold` pays a deposit, then waits for a release."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def hold(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("hold1")
        deposit = pay("deposit")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="release?"), timeout=None
        )
        return StopEvent(result=f"{deposit}:{answer.response}")


class HoldV2(Workflow):
    """Version 2 of the same step: a fraud check (another effect) before the deposit,
    and a fee (a second call of `pay`) after it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def hold(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("hold2")
        checked = screen("fraud-check")
        deposit = pay("deposit")
        fee = pay("fee")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="release?"), timeout=None
        )
        return StopEvent(result=f"{checked}:{deposit}:{fee}:{answer.response}")


def test_a_pause_answered_by_the_next_version_keeps_the_earlier_calls(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P4, P5: a run paused by version 1 (its parked copy still live, its
    documented pause taken) is answered by version 2, deployed meanwhile, whose waiting
    step (re-run from its top) now calls a new effect first and `pay` once more after:
    the deposit keeps its key (recorded, not paid again), the new calls apply once. The
    old version's parked copy ends with `ResumeConflict`; the old version then refuses
    the run (an answer: `VersionMismatch` naming the version; its documented pause:
    `PauseAnswered`), and nothing more is stored or paid."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = f"probe50-upgrade-{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        old = RemitRuntime(url, lease=1, workflow_version="v1")
        new = RemitRuntime(url, lease=1, workflow_version="v2", accept_versions=["v1"])
        try:
            parked = HoldV1(runtime=old).run(run_id=run)
            await until_parked(old, run)
            pause = parked.ctx.to_dict()
            assert applied(tmp_path) == ["deposit"]

            answered = await new.respond(
                HoldV2(runtime=new), run, HumanResponseEvent(response="ada")
            )
            assert await asyncio.wait_for(answered, GUARD) == "fraud-check:deposit:fee:ada"
            with pytest.raises(ResumeConflict):
                await asyncio.wait_for(parked, GUARD)
            assert new.remit.history(run)[0].workflow_version == "v2"
            stored = len(new.remit.history(run))

            with pytest.raises(VersionMismatch) as refused:
                await old.respond(HoldV1(runtime=old), run, HumanResponseEvent(response="bob"))
            assert "v2" in str(refused.value)
            again = HoldV1(runtime=old)
            with pytest.raises(PauseAnswered):
                again.run(ctx=Context.from_dict(again, pause))
            with pytest.raises(VersionMismatch):
                old.recover(HoldV1(runtime=old), run)
            assert len(new.remit.history(run)) == stored
            assert new.result(run) == "fraud-check:deposit:fee:ada"
        finally:
            old.remit.close()
            new.remit.close()

    asyncio.run(asyncio.wait_for(go(), GUARD))
    assert applied(tmp_path) == ["deposit", "fee"]
    assert screened(tmp_path) == ["fraud-check"]
    assert entered(tmp_path) == ["hold1", "hold2"]


class ShipV1(Workflow):
    """Version 1: `ship` pays for shipping and ends."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ship(self, ev: StartEvent) -> StopEvent:
        enter("ship1")
        shipping = pay("shipping")
        die_at("shipped")
        return StopEvent(result=shipping)


class ShipV2(Workflow):
    """Version 2 of `ship`: a fraud check first, and insurance after the shipping."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ship(self, ev: StartEvent) -> StopEvent:
        enter("ship2")
        checked = screen("fraud-check")
        shipping = pay("shipping")
        insurance = pay("insurance")
        return StopEvent(result=f"{checked}:{shipping}:{insurance}")


def test_a_crash_recovered_by_the_next_version_keeps_the_earlier_calls(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2: version 1 is SIGKILLed in `ship` after it paid; the fix deployed meanwhile
    (version 2, accepting version 1's checkpoints) recovers the run: shipping is the
    recorded payment, the fraud check and the insurance apply once. Version 1 then
    refuses the run version 2 ended (`VersionMismatch`), running nothing."""
    run = f"probe50-ship-{uuid.uuid4().hex[:10]}"
    start(url, "ShipV1", run, tmp_path, "shipped", version="v1")
    assert applied(tmp_path) == ["shipping"]
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    outcome, status = recover(url, lambda rt: ShipV2(runtime=rt), run, "v2", ("v1",))
    assert (outcome, status) == ("RESULT fraud-check:shipping:insurance", "completed")
    assert applied(tmp_path) == ["shipping", "insurance"]
    assert screened(tmp_path) == ["fraud-check"]
    assert entered(tmp_path) == ["ship1", "ship2"]
    with pytest.raises(VersionMismatch):
        recover(url, lambda rt: ShipV1(runtime=rt), run, "v1")
    assert entered(tmp_path) == ["ship1", "ship2"]


# -- history pruned under live runs (`rt.remit.prune`) -----------------------------------


class Waits(Workflow):
    """Asks with `wait_for_event`, then pays for the answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def approve(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=pay(answer.response))


class Asks(Workflow):
    """Asks the classic way: a step returns the question, another takes the answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ev: StartEvent) -> InputRequiredEvent:
        return InputRequiredEvent(prefix="ok?")

    @step
    async def take(self, ev: HumanResponseEvent) -> StopEvent:
        return StopEvent(result=pay(ev.response))


@pytest.mark.parametrize("pruned", [False, True], ids=["kept", "pruned"])
@pytest.mark.parametrize(
    ("shape", "edited"),
    [(Waits, False), (Asks, False), (Waits, True)],
    ids=["wait_for_event", "classic", "edited"],
)
def test_a_pause_answered_then_pruned_refuses_its_stale_copy_as_answered(
    url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shape: type[Workflow],
    edited: bool,
    pruned: bool,
) -> None:
    """P5: the documented pause of a run (`ctx.to_dict()` while it waits; `edited`: taken
    after a state edit of the parked run, a checkpoint after the one that asked) is
    answered by another resumer, and the history is pruned (`keep_last=1`: the pause's
    checkpoint goes, the head stays). A copy restored from the pause afterwards lost the
    race to answer it: `PauseAnswered` (a `ResumeConflict`), as before the prune, not a
    plain `ForkWithoutIntent` telling it to pass a fork token (no fork can start from a
    deleted checkpoint: its refusal says so). Nothing runs, nothing is stored or paid;
    `rt.context` at the pruned pause is `UnknownRecord`."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = f"probe50-prune-{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        rt = RemitRuntime(url, lease=1)
        other = RemitRuntime(url, lease=1)
        try:
            flow = shape(runtime=rt)
            handler = flow.run(run_id=run)
            await until_parked(rt, run)
            if edited:
                await rt.update_state(flow, run, {"note": "rush"})
            pause = handler.ctx.to_dict()
            asked_at = {i.checkpoint_id for i in rt.remit.interrupts(run)}
            assert (pause["state"]["checkpoint_id"] in asked_at) is not edited
            base = pause["state"]["checkpoint_id"]
            await handler.cancel_run()  # (the documented pause: this copy stops)
            done = await other.respond(
                shape(runtime=other), run, HumanResponseEvent(response="ada")
            )
            assert await asyncio.wait_for(done, GUARD) == "ada"
            if pruned:
                assert other.remit.prune([run], keep_last=1) > 0
                assert other.remit.checkpoint(run, base) is None
                with pytest.raises(UnknownRecord):
                    other.context(shape(runtime=other), run, checkpoint_id=base)
            stored = [c.checkpoint_id for c in other.checkpoints(run)]

            late = RemitRuntime(url, lease=1)
            try:
                copy = shape(runtime=late)
                with pytest.raises(ResumeConflict) as refused:
                    copy.run(ctx=Context.from_dict(copy, pause))
            finally:
                late.remit.close()
            assert isinstance(refused.value, PauseAnswered), refused.value
            assert isinstance(refused.value, ForkWithoutIntent)
            assert refused.value.checkpoint_id == base
            assert refused.value.interrupt_id
            assert ("deleted" in str(refused.value)) is pruned
            assert [c.checkpoint_id for c in other.checkpoints(run)] == stored
            assert other.result(run) == "ada"
        finally:
            rt.remit.close()
            other.remit.close()

    asyncio.run(asyncio.wait_for(go(), GUARD))
    assert applied(tmp_path) == ["ada"]


class TwoAsks(Workflow):
    """Two questions in turn; `settle` pays for both answers, then ends."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def first(self, ctx: Context, ev: StartEvent) -> Again:
        answer = await ctx.wait_for_event(
            HumanResponseEvent,
            waiter_event=InputRequiredEvent(prefix="first?"),
            requirements={"response": "a"},
            timeout=None,
        )
        await ctx.store.set("first", answer.response)
        return Again(n=1)

    @step
    async def second(self, ctx: Context, ev: Again) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="second?"), timeout=None
        )
        paid = pay(f"{await ctx.store.get('first')}+{answer.response}")
        die_at("paid")
        return StopEvent(result=paid)


async def asked(handler: Any) -> None:
    """Until `handler` streams its run's next question (streamed once its pause is stored)."""
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            return
    raise AssertionError("the run ended without asking again")


ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes50 import TwoAsks

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = await rt.respond(TwoAsks(runtime=rt), {run!r}, HumanResponseEvent(response="b"))
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


def test_a_run_pruned_at_each_pause_and_killed_after_paying_pays_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P3, L3: a run is forked at its first pause, then pruned at each pause
    (`keep_last=1`); its second answer comes from another process, SIGKILLed after it
    paid. The recovery pays once and ends with both answers; the fork, whose base the
    prunes keep, is answered on its own branch and pays its own; its token gives the
    same branch again, and the main branch is left as it ended."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = f"probe50-pruned-{uuid.uuid4().hex[:10]}"

    async def first_round() -> tuple[str, str]:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = TwoAsks(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            await handler.cancel_run()
            pause = rt.checkpoints(run)[0].checkpoint_id
            fork = rt.fork(run, pause, fork_token="what-if")
            assert rt.remit.prune([run], keep_last=1) > 0
            done = await rt.respond(TwoAsks(runtime=rt), run, HumanResponseEvent(response="a"))
            await asked(done)
            await done.cancel_run()
            assert rt.remit.prune([run], keep_last=1) > 0
            kept = [c for c in rt.checkpoints(run) if c.branch == "main"]
            assert [c.status for c in kept] == ["waiting", "waiting"]  # (head, fork base)
            assert kept[1].checkpoint_id == pause
        finally:
            rt.remit.close()
        return fork, pause

    fork, pause = asyncio.run(asyncio.wait_for(first_round(), GUARD))
    done = in_process(ANSWER.format(tests=TESTS, url=url, run=run), tmp_path, "paid")
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr)
    assert applied(tmp_path) == ["a+b"]
    outcome, status = recover(url, lambda rt: TwoAsks(runtime=rt), run)
    assert (outcome, status) == ("RESULT a+b", "completed")
    assert applied(tmp_path) == ["a+b"]

    async def on_the_fork() -> None:
        rt = RemitRuntime(url, lease=1)
        try:
            flow = TwoAsks(runtime=rt)
            one = await rt.respond(flow, fork, HumanResponseEvent(response="a"))
            await asked(one)
            two = await rt.respond(flow, fork, HumanResponseEvent(response="z"))
            assert await asyncio.wait_for(two, GUARD) == "a+z"
            assert await asyncio.wait_for(one, GUARD) == "a+z"  # (the copy it answered)
            assert rt.fork(run, pause, fork_token="what-if") == fork
            assert rt.result(run) == "a+b"
        finally:
            rt.remit.close()

    asyncio.run(asyncio.wait_for(on_the_fork(), GUARD))
    assert applied(tmp_path) == ["a+b", "a+z"]
