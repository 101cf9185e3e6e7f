"""Probes of the core and its engines, round 31: one effect with a key of the user's,
reached at once under two claims of a run (a fork and its line, each claimed apart).

- Found (by the pydantic-graph round 43; fixed in the core): a caller that found
  another caller's intent without an outcome took it for one in doubt whatever that
  caller was doing: with `reconcile=` it asked the target, which truly answered "not
  applied" while the live holder was about to apply it, and applied it; the holder
  then applied it too. An intent now records the claim it was written under
  (migration 7); while that claim is still held, unexpired, by its holder at its
  fence, the intent is in flight: another caller waits for its outcome (up to
  `IN_FLIGHT_WAIT`), then returns it, or raises `EffectInFlight` having applied and
  asked nothing. Once that claim is given up, lapsed or taken over, the intent is in
  doubt as before. A caller's own intent (same claim) is in doubt at once, as before.

Each case runs on SQLite, PostgreSQL and Redis, the line's holder in a process of its
own (stopped with SIGSTOP, or SIGKILLed) and the other caller here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from remit_core import (
    NOT_APPLIED,
    EffectInDoubt,
    EffectInFlight,
    FenceRef,
    Remit,
    arun_effect,
    effects,
    failpoints,
    policy,
    run_effect,
    step_scope,
)
from remit_core.conformance.processes import Worker, fork
from remit_core.records import Claim, EffectRecord

KEY = "mail:o-1"
FORK_SCOPE = "fork-rebill"


class Mailer:
    """A mail service in files: each send is a file named by its key; `asked` counts
    the reconcile look-ups. A send that finds `hold` waits until `go` exists."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def send(self, idem: str, who: str) -> str:
        (self.folder / "applying").write_text(who)
        while (self.folder / "hold").exists() and not (self.folder / "go").exists():
            time.sleep(0.01)
        n = len(list(self.folder.glob("sent-*")))
        (self.folder / f"sent-{n}-{who}").write_text(idem)
        return f"receipt-{who}"

    def lookup(self, idem: str) -> Any:
        (self.folder / f"asked-{time.monotonic_ns()}").touch()
        sent = [p for p in self.folder.glob("sent-*") if p.read_text() == idem]
        return f"receipt-{sent[0].name.split('-')[2]}" if sent else NOT_APPLIED

    def sends(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("sent-*"))

    def asked(self) -> int:
        return len(list(self.folder.glob("asked-*")))


@pytest.fixture
def mailer(tmp_path: Path) -> Mailer:
    return Mailer(tmp_path)


@pytest.fixture
def short_wait(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(effects, "IN_FLIGHT_WAIT", 0.5, raising=False)
    yield


def mail(remit: Remit, run_id: str, scope: str, mailer: Mailer, who: str, lease: float) -> Any:
    """The effect under a claim of `scope`, as a step of a shim calls it."""
    with remit.claim(run_id, scope, lease=lease) as handle:
        with step_scope(remit, run_id, f"{scope}:Mail", fence=handle.fence):
            return run_effect(
                "mail", lambda idem: mailer.send(idem, who), key=KEY, reconcile=mailer.lookup
            )


async def amail(remit: Remit, run_id: str, scope: str, mailer: Mailer, who: str) -> Any:
    with remit.claim(run_id, scope, lease=30.0) as handle:
        with step_scope(remit, run_id, f"{scope}:Mail", fence=handle.fence):

            async def send(idem: str) -> str:
                return mailer.send(idem, who)

            return await arun_effect("mail", send, key=KEY, reconcile=mailer.lookup)


def line(store_url: str, run_id: str, mailer: Mailer, lease: float = 30.0) -> Callable[[], Any]:
    return lambda: mail(Remit(store_url), run_id, "main", mailer, "line", lease)


def stopped_at(worker: Worker, point: str) -> None:
    out = worker.wait(60, stopped_counts=True)
    assert out.status == ("killed" if point == "kill" else "stopped"), out.summary()


def test_an_intent_records_the_claim_it_was_written_under(store_url: str, run_id: str) -> None:
    remit = Remit(store_url)
    seen: list[EffectRecord | None] = []
    with remit.claim(run_id, FORK_SCOPE) as handle:
        with step_scope(remit, run_id, "s", fence=handle.fence):
            run_effect(
                "mail", lambda idem: seen.append(remit.store.get_effect(run_id, KEY)), key=KEY
            )
        assert seen[0] is not None and seen[0].claim == handle.fence
    done = remit.store.get_effect(run_id, KEY)
    assert done is not None and done.status == "done" and done.claim == handle.fence
    # An unfenced caller records none.
    with step_scope(remit, run_id, "s"):
        run_effect("other", lambda idem: seen.append(remit.store.get_effect(run_id, "o")), key="o")
    assert seen[1] is not None and seen[1].claim is None


def test_a_fork_waits_for_the_lines_mail_in_flight_and_returns_its_receipt(
    store_url: str, run_id: str, mailer: Mailer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line's holder is sending (its intent recorded, its claim live; the send
    takes 2 s); the fork's caller reaches the same keyed mail: it waits (as long as
    it takes, here), then returns the line's receipt. The service was asked to send
    once and never asked whether it had."""
    monkeypatch.setattr(effects, "IN_FLIGHT_WAIT", 60.0, raising=False)
    (mailer.folder / "hold").touch()
    held = fork(line(store_url, run_id, mailer))
    try:
        deadline = time.monotonic() + 60
        while not (mailer.folder / "applying").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        threading.Timer(2.0, (mailer.folder / "go").touch).start()
        got = mail(Remit(store_url), run_id, FORK_SCOPE, mailer, "fork", 30.0)
        out = held.wait(60)
    finally:
        held.kill()
    assert out.ok and out.value == got == "receipt-line", (out.summary(), got)
    assert mailer.sends() == ["sent-0-line"] and mailer.asked() == 0


@pytest.mark.parametrize("point", ["effect.after_intent", "effect.after_apply"])
def test_a_fork_finding_the_lines_holder_stopped_mid_mail_sends_nothing(
    store_url: str, run_id: str, mailer: Mailer, short_wait: None, point: str
) -> None:
    """The line's holder is stopped (SIGSTOP) after recording its intent, before or after
    sending; its claim stays live. The fork's caller waits `IN_FLIGHT_WAIT`, then gets
    `EffectInFlight`: nothing sent, nothing asked, its own claim untouched. The line goes
    on and sends once; the fork's next call returns the line's receipt."""

    def stopping() -> Any:
        failpoints.arm(point, "stop")
        return line(store_url, run_id, mailer)()

    held = fork(stopping)
    try:
        stopped_at(held, point)
        remit = Remit(store_url)
        with pytest.raises(EffectInFlight, match="still held") as refused:
            mail(remit, run_id, FORK_SCOPE, mailer, "fork", 30.0)
        assert isinstance(refused.value, EffectInDoubt) and refused.value.effect_key == KEY
        assert mailer.asked() == 0
        assert mailer.sends() == ([] if point == "effect.after_intent" else ["sent-0-line"])
        assert remit.store.get_claim(run_id, FORK_SCOPE).holder == ""  # type: ignore[union-attr]
        held.cont()
        out = held.wait(60)
    finally:
        held.kill()
    assert out.ok and out.value == "receipt-line", out.summary()
    assert mail(remit, run_id, FORK_SCOPE, mailer, "fork", 30.0) == "receipt-line"
    assert mailer.sends() == ["sent-0-line"] and mailer.asked() == 0


def test_an_async_fork_waits_off_the_event_loop_and_is_refused_alike(
    store_url: str, run_id: str, mailer: Mailer, short_wait: None
) -> None:
    """`arun_effect` the same: refused while the line's holder is stopped, the event loop
    running meanwhile (a ticker task keeps ticking); the line's receipt once it is done."""

    def stopping() -> Any:
        failpoints.arm("effect.after_intent", "stop")
        return line(store_url, run_id, mailer)()

    async def fork_side() -> tuple[BaseException | Any, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        t = asyncio.create_task(ticker())
        try:
            got: Any = await amail(Remit(store_url), run_id, FORK_SCOPE, mailer, "fork")
        except EffectInFlight as exc:
            got = exc
        t.cancel()
        return got, ticks

    held = fork(stopping)
    try:
        stopped_at(held, "effect.after_intent")
        got, ticks = asyncio.run(fork_side())
        assert isinstance(got, EffectInFlight) and ticks >= 5, (got, ticks)
        assert mailer.sends() == [] and mailer.asked() == 0
        held.cont()
        assert held.wait(60).ok
    finally:
        held.kill()
    again, _ = asyncio.run(fork_side())
    assert again == "receipt-line" and mailer.sends() == ["sent-0-line"]


def test_a_killed_holders_intent_is_in_doubt_once_its_lease_lapses(
    store_url: str, run_id: str, mailer: Mailer
) -> None:
    """The line's holder is SIGKILLed after recording its intent, with a 1 s lease: the
    fork's caller, coming before the lease ends, waits for it to lapse (well inside
    `IN_FLIGHT_WAIT`), then takes the intent for one in doubt as before: it asks the
    service (not sent), sends once under the run's one idempotency key."""

    def killed() -> Any:
        failpoints.arm("effect.after_intent", "kill")
        return line(store_url, run_id, mailer, lease=1.0)()

    held = fork(killed)
    stopped_at(held, "kill")
    got = mail(Remit(store_url), run_id, FORK_SCOPE, mailer, "fork", 30.0)
    assert got == "receipt-fork"
    assert mailer.sends() == ["sent-0-fork"] and mailer.asked() == 1
    sent = (mailer.folder / "sent-0-fork").read_text()
    assert sent == policy.idempotency_key(run_id, KEY)


def test_a_holders_own_intent_is_in_doubt_at_once(
    store_url: str, run_id: str, mailer: Mailer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An effect whose body raised, retried under the same claim (a step's retry
    policy): its intent is the caller's own, in doubt at once, never in flight (no
    wait at all is allowed here): `reconcile` is asked and the mail sent once."""
    monkeypatch.setattr(effects, "IN_FLIGHT_WAIT", 0.0, raising=False)
    remit = Remit(store_url)
    calls = 0

    def flaky(idem: str) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("mail service hung up")
        return mailer.send(idem, "line")

    with remit.claim(run_id, "main") as handle:
        with step_scope(remit, run_id, "Mail", fence=handle.fence):
            with pytest.raises(ConnectionError):
                run_effect("mail", flaky, key=KEY, reconcile=mailer.lookup)
            assert run_effect("mail", flaky, key=KEY, reconcile=mailer.lookup) == "receipt-line"
    assert mailer.sends() == ["sent-0-line"] and mailer.asked() == 1


def test_in_flight_is_decided_by_the_claim_recorded_with_the_intent() -> None:
    """`policy.intent_in_flight`, a plain function: in flight only while the recorded
    claim is still held by its holder, at its fence, unexpired, and is not the asker's."""
    line_ref = FenceRef("r", "main", 3, "h-line")
    intent = EffectRecord("r", KEY, "idem", "intent", claim=line_ref)
    live = Claim("r", "main", "h-line", 3, expires_at=100.0)
    fork_ref = FenceRef("r", FORK_SCOPE, 1, "h-fork")

    def in_flight(entry: EffectRecord, claim: Claim | None, own: FenceRef | None) -> bool:
        return policy.intent_in_flight(entry, claim, own, now=50.0)

    assert in_flight(intent, live, fork_ref) and in_flight(intent, live, None)
    assert not in_flight(intent, live, line_ref)  # the asker's own
    assert not in_flight(intent, None, fork_ref)  # its claim row gone (run deleted)
    assert not in_flight(intent, Claim("r", "main", "", 3, 0.0), fork_ref)  # given up
    assert not in_flight(intent, Claim("r", "main", "h-line", 3, 50.0), fork_ref)  # lapsed
    assert not in_flight(intent, Claim("r", "main", "h-new", 4, 100.0), fork_ref)  # taken over
    assert not in_flight(intent, Claim("r", "main", "h-line", 4, 100.0), fork_ref)  # re-taken
    # An asker on the same scope whose own claim was taken over by the intent's
    # holder (a zombie) waits for nobody: its next fenced write is refused.
    assert not in_flight(intent, live, FenceRef("r", "main", 2, "h-zombie"))
    done = EffectRecord("r", KEY, "idem", "done", b"o", claim=line_ref)
    assert not in_flight(done, live, fork_ref)
    assert not in_flight(EffectRecord("r", KEY, "idem", "intent"), live, fork_ref)
