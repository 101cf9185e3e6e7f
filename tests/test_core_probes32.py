"""Probes of the core and its engines, round 32: an intent left in doubt by a dead
holder, reached at once by two callers under claims of their own (a run's fork and
its line's next holder, each claimed apart), both recovering it.

- Found (the last session's note; fixed in the core): the in-flight rule of round 31
  covers a live holder only. Once the holder that recorded the intent was dead and
  its lease had lapsed, both callers found the intent in doubt at once; with
  `reconcile=` both asked the target, both were truly told "not applied", and both
  applied it (with `idempotent=True` both re-applied it at once). A caller about to
  reconcile or re-apply an intent in doubt now adopts it first: one fenced write
  moves the intent to its claim, as a compare-and-set on the claim it decided on
  (`Store.adopt_effect`). The other caller's compare-and-set fails; it decides again
  on the entry it got back, which is in flight under a claim that is held: it waits
  for the outcome and returns it, or raises `EffectInFlight` having asked and
  applied nothing.

Each race runs on SQLite, PostgreSQL and Redis, each caller in a process of its own,
the dead holder SIGKILLed after recording its intent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from remit_core import (
    NOT_APPLIED,
    EffectInFlight,
    Fenced,
    FenceRef,
    Remit,
    arun_effect,
    effects,
    failpoints,
    policy,
    run_effect,
    step_scope,
)
from remit_core.conformance.processes import Worker, fork, reap
from remit_core.errors import UnknownRecord
from remit_core.records import EffectRecord

KEY = "mail:o-1"
FORK_SCOPE = "fork-rebill"
#: How long each caller waits in its look-up (or its send) for the other to get there
#: too: both get there only while both take the intent for one in doubt.
RENDEZVOUS = 3.0


class Mailer:
    """A mail service in files: each send is a file named by its key; each look-up a
    file named by its caller. A look-up (or, with `meet_in_send`, a send) waits until
    every caller is in it, or `RENDEZVOUS` has passed."""

    def __init__(self, folder: Path, callers: int = 2) -> None:
        self.folder = folder
        self.callers = callers

    def _meet(self, role: str, who: str) -> None:
        (self.folder / f"{role}-{who}").touch()
        deadline = time.monotonic() + RENDEZVOUS
        while len(list(self.folder.glob(f"{role}-*"))) < self.callers:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def send(self, idem: str, who: str, *, meet: bool = False) -> str:
        if meet:
            self._meet("applying", who)
        n = len(list(self.folder.glob("sent-*")))
        (self.folder / f"sent-{n}-{who}").write_text(idem)
        return f"receipt-{who}"

    def lookup(self, idem: str, who: str) -> Any:
        self._meet("asked", who)
        if (self.folder / f"stop-in-lookup-{who}").exists():
            os.kill(os.getpid(), signal.SIGSTOP)
        sent = [p for p in self.folder.glob("sent-*") if p.read_text() == idem]
        return f"receipt-{sent[0].name.split('-')[2]}" if sent else NOT_APPLIED

    def sends(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("sent-*"))

    def asked(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("asked-*"))


def mail(
    url: str, run_id: str, scope: str, mailer: Mailer, who: str, *, lease: float, how: str
) -> Any:
    """The keyed effect under a claim of `scope`, as a shim's step calls it: with
    `reconcile=` (`how="reconcile"`) or declared idempotent (`how="idempotent"`)."""
    remit = Remit(url)
    with remit.claim(run_id, scope, lease=lease) as handle:
        with step_scope(remit, run_id, f"{scope}:Mail", fence=handle.fence):
            if how == "reconcile":
                return run_effect(
                    "mail",
                    lambda idem: mailer.send(idem, who),
                    key=KEY,
                    reconcile=lambda idem: mailer.lookup(idem, who),
                )
            return run_effect(
                "mail", lambda idem: mailer.send(idem, who, meet=True), key=KEY, idempotent=True
            )


def dead_holders_intent(url: str, run_id: str, mailer: Mailer, how: str) -> None:
    """The line's holder records its intent and is SIGKILLed there, with a 1 s lease;
    returns once that lease has lapsed (the intent is in doubt to everyone)."""

    def killed() -> Any:
        failpoints.arm("effect.after_intent", "kill")
        return mail(url, run_id, "main", mailer, "dead", lease=1.0, how=how)

    out = fork(killed).wait(60)
    assert out.status == "killed", out.summary()
    remit = Remit(url)
    deadline = time.monotonic() + 30
    while True:
        claim = remit.store.get_claim(run_id, "main")
        if claim is not None and claim.expires_at < remit.clock():
            break
        assert time.monotonic() < deadline, claim
        time.sleep(0.05)
    entry = remit.store.get_effect(run_id, KEY)
    assert entry is not None and entry.status == "intent" and entry.claim is not None


def both(url: str, run_id: str, mailer: Mailer, how: str) -> list[Worker]:
    """The fork's caller and the line's next holder, reaching the mail at once."""
    callers: list[tuple[str, str]] = [(FORK_SCOPE, "fork"), ("main", "line")]
    return [
        fork(lambda scope=scope, who=who: mail(url, run_id, scope, mailer, who, lease=30, how=how))
        for scope, who in callers
    ]


@pytest.mark.parametrize("how", ["reconcile", "idempotent"])
def test_a_fork_and_the_lines_next_holder_recover_a_dead_holders_mail_once(
    store_url: str, run_id: str, tmp_path: Path, how: str
) -> None:
    """Both callers find the dead holder's intent in doubt at once. One adopts it and
    sends (after asking, with `reconcile=`); the other finds it adopted, waits for its
    outcome and returns the same receipt. One send, under the run's one key; one
    look-up at most."""
    mailer = Mailer(tmp_path)
    dead_holders_intent(store_url, run_id, mailer, how)
    workers = both(store_url, run_id, mailer, how)
    try:
        outs = [w.wait(60) for w in workers]
    finally:
        reap(workers)
    assert all(o.ok for o in outs), [o.summary() for o in outs]
    receipts = {o.value for o in outs}
    assert len(mailer.sends()) == 1, mailer.sends()
    (sent,) = mailer.sends()
    assert receipts == {f"receipt-{sent.split('-')[2]}"}
    assert (tmp_path / sent).read_text() == policy.idempotency_key(run_id, KEY)
    assert len(mailer.asked()) == (1 if how == "reconcile" else 0), mailer.asked()
    entry = Remit(store_url).store.get_effect(run_id, KEY)
    assert entry is not None and entry.status == "done"


def test_the_loser_waits_for_nobody_once_the_adopter_is_gone(
    store_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork's caller adopts the dead holder's intent and is stopped (SIGSTOP) in its
    look-up. The line's next holder finds the intent in flight under the fork's claim:
    it waits (`IN_FLIGHT_WAIT`, 0.5 s here) and raises `EffectInFlight`, having asked
    and sent nothing. Once the fork's caller is SIGKILLed and its lease lapses, the
    line's holder adopts the intent in turn, asks, and sends once."""
    monkeypatch.setattr(effects, "IN_FLIGHT_WAIT", 0.5, raising=False)
    mailer = Mailer(tmp_path, callers=1)
    dead_holders_intent(store_url, run_id, mailer, "reconcile")
    (tmp_path / "stop-in-lookup-fork").touch()
    adopter = fork(
        lambda: mail(store_url, run_id, FORK_SCOPE, mailer, "fork", lease=1.0, how="reconcile")
    )
    try:
        out = adopter.wait(60, stopped_counts=True)
        assert out.status == "stopped", out.summary()
        entry = Remit(store_url).store.get_effect(run_id, KEY)
        assert entry is not None and entry.claim is not None
        assert entry.claim.scope == FORK_SCOPE
        with pytest.raises(EffectInFlight, match="still held"):
            mail(store_url, run_id, "main", mailer, "line", lease=30, how="reconcile")
        assert mailer.asked() == ["asked-fork"] and mailer.sends() == []
    finally:
        adopter.kill()
    time.sleep(1.2)  # the stopped fork's 1 s lease lapses
    got = mail(store_url, run_id, "main", mailer, "line", lease=30, how="reconcile")
    assert got == "receipt-line"
    assert mailer.sends() == ["sent-0-line"]
    assert mailer.asked() == ["asked-fork", "asked-line"]


def recorded(url: str, run_id: str) -> tuple[Remit, FenceRef, FenceRef, EffectRecord]:
    """An intent recorded under a claim of the line ("main"), and a claim of the fork."""
    remit = Remit(url)
    line = remit.store.acquire_claim(run_id, "main", "h-line", now=remit.clock(), lease=30)
    fork_claim = remit.store.acquire_claim(
        run_id, FORK_SCOPE, "h-fork", now=remit.clock(), lease=30
    )
    line_ref, fork_ref = FenceRef.of(line), FenceRef.of(fork_claim)
    entry, created = remit.store.begin_effect(run_id, KEY, "idem", now=1.0, fence=line_ref)
    assert created and entry.claim == line_ref
    return remit, line_ref, fork_ref, entry


def test_adopt_effect_is_a_compare_and_set_on_the_recorded_claim(
    store_url: str, run_id: str
) -> None:
    """The store primitive, on each engine: an intent still under the claim named moves
    to the caller's; named under any other claim (or none), it stays, and the entry
    comes back as it is; a done entry is never adopted."""
    remit, line_ref, fork_ref, _ = recorded(store_url, run_id)
    for stale in (None, fork_ref):
        entry, adopted = remit.store.adopt_effect(run_id, KEY, held=stale, fence=fork_ref)
        assert not adopted and entry.claim == line_ref
    entry, adopted = remit.store.adopt_effect(run_id, KEY, held=line_ref, fence=fork_ref)
    assert adopted and entry.claim == fork_ref and entry.status == "intent"
    entry, adopted = remit.store.adopt_effect(run_id, KEY, held=line_ref, fence=line_ref)
    assert not adopted and entry.claim == fork_ref
    # Unfenced: the claim is cleared (an unfenced caller records none).
    entry, adopted = remit.store.adopt_effect(run_id, KEY, held=fork_ref)
    assert adopted and entry.claim is None
    entry, adopted = remit.store.adopt_effect(run_id, KEY, held=None, fence=line_ref)
    assert adopted and entry.claim == line_ref
    remit.store.finish_effect(run_id, KEY, b"x", now=2.0, fence=line_ref)
    entry, adopted = remit.store.adopt_effect(run_id, KEY, held=line_ref, fence=fork_ref)
    assert not adopted and entry.status == "done" and entry.claim == line_ref


def test_adopt_effect_refuses_a_stale_fence_and_a_deleted_entry(
    store_url: str, run_id: str
) -> None:
    """A caller whose claim was taken over adopts nothing (`Fenced`, the entry as it
    was); an entry gone with its run is `UnknownRecord`."""
    remit, line_ref, fork_ref, _ = recorded(store_url, run_id)
    remit.store.acquire_claim(run_id, FORK_SCOPE, "h-next", now=remit.clock() + 60, lease=30)
    with pytest.raises(Fenced):
        remit.store.adopt_effect(run_id, KEY, held=line_ref, fence=fork_ref)
    entry = remit.store.get_effect(run_id, KEY)
    assert entry is not None and entry.claim == line_ref
    remit.store.delete_run(run_id)
    with pytest.raises(UnknownRecord, match="deleted"):
        remit.store.adopt_effect(run_id, KEY, held=line_ref)


def test_an_adoption_lost_to_another_caller_is_decided_again(
    store_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process, without a race: the caller decided on the intent under the
    line's claim, but the fork's caller (still holding its claim, unexpired) adopted it
    first. The caller's compare-and-set fails, and it decides again: in flight, it
    waits (`IN_FLIGHT_WAIT`) and returns the fork's outcome once recorded, asking and
    applying nothing."""
    remit, line_ref, fork_ref, entry = recorded(store_url, run_id)
    remit.store.release_claim(remit.store.get_claim(run_id, "main"))  # the line's holder died
    calls: list[str] = []
    real = remit.store.adopt_effect

    def adopt_after_the_fork(*args: Any, **kwargs: Any) -> tuple[EffectRecord, bool]:
        if not calls:
            real(run_id, KEY, held=line_ref, fence=fork_ref)  # the fork's caller, first
            remit.store.finish_effect(run_id, KEY, _receipt("fork"), now=3.0, fence=fork_ref)
        calls.append(kwargs["fence"].holder)
        return real(*args, **kwargs)

    # (the store is shared by URL in this process: put back after the test)
    monkeypatch.setattr(remit.store, "adopt_effect", adopt_after_the_fork)
    mailer = Mailer(tmp_path, callers=1)
    with remit.claim(run_id, "main", lease=30) as handle:
        with step_scope(remit, run_id, "main:Mail", fence=handle.fence):
            got = run_effect(
                "mail",
                lambda idem: mailer.send(idem, "line"),
                key=KEY,
                reconcile=lambda idem: mailer.lookup(idem, "line"),
            )
    assert got == "receipt-fork"
    assert len(calls) == 1 and mailer.sends() == [] and mailer.asked() == []


def _receipt(who: str) -> bytes:
    return effects._sealed(f"receipt-{who}", KEY)


def test_a_turn_abandoned_at_event_loop_shutdown_keeps_the_holder_alone(
    store_url: str, run_id: str
) -> None:
    """A thread of the process is applying an effect (its turn held, its send slow); a
    second thread waits for the same occurrence's turn, and a task waits for it too
    (off the event loop, in a thread) when `asyncio.run` ends, cancelling the task
    and the thread's future alike. The second thread still waits for the holder, then
    returns its recorded outcome: one send. (Before, the cancelled future gave back
    the lock the holder held; the second thread took it, asked the service, which had
    not been sent to yet, and sent again.)"""
    remit = Remit(store_url)
    entered, finish = threading.Event(), threading.Event()
    sent: list[str] = []

    def call(who: str) -> Any:
        def send(idem: str) -> str:
            entered.set()
            finish.wait(30)
            sent.append(who)
            return f"receipt-{who}"

        def lookup(idem: str) -> Any:
            return f"receipt-{sent[0]}" if sent else NOT_APPLIED

        with step_scope(remit, run_id, "s"):
            return run_effect("mail", send, key=KEY, reconcile=lookup)

    results: dict[str, Any] = {}
    holder = threading.Thread(target=lambda: results.setdefault("holder", call("holder")))
    holder.start()
    assert entered.wait(30)
    second = threading.Thread(target=lambda: results.setdefault("second", call("second")))
    second.start()
    time.sleep(0.2)  # the second thread waits for the turn

    async def main() -> None:
        async def waiter() -> Any:
            with step_scope(remit, run_id, "s"):

                async def send(idem: str) -> str:
                    sent.append("waiter")
                    return "receipt-waiter"

                return await arun_effect("mail", send, key=KEY)

        asyncio.get_running_loop().create_task(waiter())
        await asyncio.sleep(0.2)  # the task is waiting for the turn; the loop ends

    threading.Timer(1.0, finish.set).start()  # the holder finishes during the shutdown
    asyncio.run(main())
    holder.join(30)
    second.join(30)
    assert not second.is_alive()
    assert sent == ["holder"]
    assert results == {"holder": "receipt-holder", "second": "receipt-holder"}


def test_a_turn_abandoned_at_event_loop_shutdown_is_given_back(store_url: str, run_id: str) -> None:
    """A task waits (off the event loop, in a thread) for an effect's turn that a thread
    of the same process holds; `asyncio.run` ends meanwhile, cancelling the task and
    the thread's future alike. Once the holder finishes, the turn is free: a next
    caller of the same occurrence gets the recorded outcome (it waited for ever
    before: the future's cancellation gave back a lock the thread had not taken yet,
    and the thread then took it for nobody)."""
    remit = Remit(store_url)
    entered, finish = threading.Event(), threading.Event()

    def call(fn: Callable[[str], Any]) -> Any:
        with step_scope(remit, run_id, "s"):
            return run_effect("mail", fn, key=KEY)

    def slow_send(idem: str) -> str:
        entered.set()
        finish.wait(30)
        return "receipt-holder"

    results: list[Any] = []
    holder = threading.Thread(target=lambda: results.append(call(slow_send)))
    holder.start()
    assert entered.wait(30)

    async def main() -> None:
        async def waiter() -> Any:
            with step_scope(remit, run_id, "s"):

                async def send(idem: str) -> str:
                    return "receipt-waiter"

                return await arun_effect("mail", send, key=KEY)

        asyncio.get_running_loop().create_task(waiter())
        await asyncio.sleep(0.2)  # the task is waiting for the turn; the loop ends

    threading.Timer(0.5, finish.set).start()  # the holder finishes during the shutdown
    asyncio.run(main())
    holder.join(30)
    assert results == ["receipt-holder"]
    later = threading.Thread(target=lambda: results.append(call(lambda idem: "again")))
    later.start()
    later.join(30)
    assert not later.is_alive(), "the turn was never given back"
    assert results == ["receipt-holder", "receipt-holder"]


# -- a claim given up while effect calls of it still run in its process ----------------


def holder_of(url: str, run_id: str, scope: str = "main") -> str | None:
    claim = Remit(url).store.get_claim(run_id, scope)
    return None if claim is None else claim.holder


def in_flight_after_release(
    remit: Remit, run_id: str, give_up: Callable[[Any], None]
) -> tuple[threading.Thread, threading.Event, threading.Event, list[Any]]:
    """An effect call of a claim, running in a thread, past its intent; the claim is then
    given up by `give_up(handle)` (the step ended: raised, or committed its last write)."""
    entered, finish = threading.Event(), threading.Event()
    got: list[Any] = []
    handle = remit.claim(run_id, "main", lease=2.0)

    def send(idem: str) -> str:
        entered.set()
        finish.wait(30)
        return "receipt"

    def call() -> None:
        with step_scope(remit, run_id, "main:Mail", fence=handle.fence):
            try:
                got.append(run_effect("mail", send, key=KEY, reconcile=lambda idem: NOT_APPLIED))
            except Fenced as exc:
                got.append(type(exc).__name__)

    thread = threading.Thread(target=call)
    thread.start()
    assert entered.wait(30)
    give_up(handle)
    return thread, finish, entered, got


@pytest.mark.parametrize("how", ["release", "commit"])
def test_a_claim_given_up_mid_effect_is_kept_until_the_call_ends(
    store_url: str, run_id: str, how: str
) -> None:
    """The step gives its claim up (`release()`, or a commit with `release=`) while an
    effect call of it still runs in a thread of the process. The claim is kept for
    the call, renewed past its 2 s lease: another process is refused (`ResumeConflict`)
    and, finding the intent, would wait for it (in flight). The call records its
    outcome under the claim, which is released once the call ends."""
    remit = Remit(store_url)

    def give_up(handle: Any) -> None:
        if how == "release":
            handle.release()
        else:
            remit.commit(
                run_id=run_id,
                checkpoint_id="c1",
                parent_id=None,
                state=b"state",
                fence=handle.fence,
                release=handle,
            )

    thread, finish, _, got = in_flight_after_release(remit, run_id, give_up)
    try:
        time.sleep(2.5)  # past the lease: renewed
        held = holder_of(store_url, run_id)
        assert held, "the claim was given up with an effect call of it running"

        def other_process() -> str:
            try:
                Remit(store_url).claim(run_id, "main")
            except Exception as exc:
                return type(exc).__name__
            return "claimed"

        assert fork(other_process).wait(60).value == "ResumeConflict"
    finally:
        finish.set()
        thread.join(30)
    assert got == ["receipt"]
    entry = remit.store.get_effect(run_id, KEY)
    assert entry is not None and entry.status == "done"
    deadline = time.monotonic() + 30
    while holder_of(store_url, run_id):
        assert time.monotonic() < deadline, "the kept claim was never released"
        time.sleep(0.05)
    if how == "commit":
        head = remit.store.get_head(run_id, "", "main")
        assert head is not None and head.checkpoint_id == "c1"


def test_a_claim_of_the_same_process_takes_a_kept_claim_over_at_once(
    store_url: str, run_id: str
) -> None:
    """A retry in the same process (a worker's loop) claims the scope at once: the kept
    claim is released for it, and the running call's outcome is refused under the old
    fence (its intent stays, in doubt, for the retry's turn to reconcile)."""
    remit = Remit(store_url)
    thread, finish, _, got = in_flight_after_release(remit, run_id, lambda h: h.release())
    try:
        retry = Remit(store_url).claim(run_id, "main", lease=30)
        assert holder_of(store_url, run_id) == retry.claim.holder
        retry.release()
    finally:
        finish.set()
        thread.join(30)
    assert got == ["Fenced"]  # the old call's outcome write, under the old fence


def test_a_kept_claim_is_released_once_held_past_its_limit(
    store_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An effect call that never ends (a thread stuck in its target) keeps the claim at
    most `HELD_FOR_EFFECTS` (0.5 s here): then the lease keeper releases it."""
    from remit_core import core

    monkeypatch.setattr(core, "HELD_FOR_EFFECTS", 0.5)
    remit = Remit(store_url)
    thread, finish, _, got = in_flight_after_release(remit, run_id, lambda h: h.release())
    try:
        deadline = time.monotonic() + 30
        while holder_of(store_url, run_id):
            assert time.monotonic() < deadline, "the kept claim was never released"
            time.sleep(0.05)
    finally:
        finish.set()
        thread.join(30)
    assert got == ["Fenced"]  # its outcome came after the claim was released
