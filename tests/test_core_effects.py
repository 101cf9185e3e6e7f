"""The effect API (P2), sync and async: intent before, outcome after, a deterministic key.

The async path must not block the event loop: that is shown with a ticker task
that has to run for the effect to finish at all (it releases a database lock
the effect waits on), and with the blocking sync path as the control.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import sqlite3
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from remit_core import (
    NOT_APPLIED,
    EffectInDoubt,
    Fenced,
    FenceRef,
    Remit,
    RemitError,
    StoreUnavailable,
    arun_effect,
    current_idempotency_key,
    effect,
    policy,
    run_effect,
    step_scope,
)
from remit_core.stores.sqlite import sqlite_path


@pytest.fixture
def remit(store_url: str) -> Remit:
    return Remit(store_url)


class Sink:
    """An in-process outside world: counts applications per idempotency key."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def apply(self, key: str, payload: Any = None) -> str:
        self.calls.append((key, payload))
        return f"receipt-{len(self.calls)}"

    def happened(self, key: str) -> Any:
        done = [i for i, (k, _) in enumerate(self.calls, 1) if k == key]
        return f"receipt-{done[0]}" if done else NOT_APPLIED


def test_effect_outside_a_step_is_refused() -> None:
    @effect
    def send() -> None:
        raise AssertionError("must not run")

    with pytest.raises(RemitError, match="outside a Remit step"):
        send()


def test_intent_outcome_and_replay(remit: Remit, run_id: str) -> None:
    sink = Sink()
    seen_keys: list[str | None] = []

    @effect(name="charge")
    def charge(amount: int, *, idempotency_key: str) -> str:
        seen_keys.append(current_idempotency_key())
        return sink.apply(idempotency_key, amount)

    with step_scope(remit, run_id, "step-1"):
        first = (charge(5), charge(7))
    assert first == ("receipt-1", "receipt-2")
    expected = [policy.idempotency_key(run_id, f"step-1/charge#{i}") for i in (0, 1)]
    assert [k for k, _ in sink.calls] == expected == seen_keys
    assert current_idempotency_key() is None
    for i in (0, 1):
        entry = remit.store.get_effect(run_id, f"step-1/charge#{i}")
        assert entry is not None and entry.status == "done"
        assert entry.idempotency_key == expected[i]
    # A replayed step gets the recorded outcomes, in order, without applying again.
    with step_scope(remit, run_id, "step-1"):
        assert (charge(5), charge(7)) == first
    assert len(sink.calls) == 2
    # Another step is another effect.
    with step_scope(remit, run_id, "step-2"):
        assert charge(5) == "receipt-3"


def test_an_effect_called_by_an_effect_is_keyed_under_it(remit: Remit, run_id: str) -> None:
    """A replayed outer effect returns its recorded outcome and calls nothing: the
    effects it called must not have used up the step's occurrences."""
    sink = Sink()

    @effect(name="inner")
    def inner(x: str, *, idempotency_key: str) -> str:
        sink.apply(idempotency_key, x)
        return f"inner:{x}"

    @effect(name="outer")
    def outer(x: str) -> str:
        return inner(x)

    with step_scope(remit, run_id, "s"):
        first = [outer("A"), inner("B")]
    with step_scope(remit, run_id, "s"):
        assert [outer("A"), inner("B")] == first == ["inner:A", "inner:B"]
    assert [payload for _, payload in sink.calls] == ["A", "B"]
    assert remit.store.get_effect(run_id, "s/outer#0/inner#0") is not None
    assert remit.store.get_effect(run_id, "s/inner#0") is not None

    @effect(name="aouter")
    async def aouter(x: str) -> str:
        return inner(x)

    async def step() -> list[str]:
        with step_scope(remit, run_id, "a"):
            return [await aouter("C"), inner("D")]

    assert asyncio.run(step()) == asyncio.run(step()) == ["inner:C", "inner:D"]
    assert [payload for _, payload in sink.calls] == ["A", "B", "C", "D"]


def test_callers_of_one_occurrence_in_one_process_apply_it_once(remit: Remit, run_id: str) -> None:
    """The second caller waits for the first and gets its outcome: it does not take the
    first's intent, in flight, for one in doubt (reconcile would say "not yet")."""
    sink = Sink()
    started = threading.Event()

    def slow(key: str) -> str:
        started.set()
        time.sleep(0.3)
        return sink.apply(key)

    def caller(out: list[str]) -> None:
        with step_scope(remit, run_id, "s"):
            out.append(run_effect("charge", slow, reconcile=sink.happened))

    first: list[str] = []
    second: list[str] = []
    a = threading.Thread(target=caller, args=(first,))
    a.start()
    assert started.wait(5)
    b = threading.Thread(target=caller, args=(second,))
    b.start()
    a.join(10)
    b.join(10)
    assert first == second == ["receipt-1"] and len(sink.calls) == 1

    async def aslow(key: str) -> str:
        await asyncio.sleep(0.3)
        return sink.apply(key)

    async def acaller() -> str:
        with step_scope(remit, run_id, "a"):
            return await arun_effect("charge", aslow, reconcile=sink.happened)

    async def both() -> list[str]:
        return list(await asyncio.gather(acaller(), acaller()))

    assert asyncio.run(both()) == ["receipt-2", "receipt-2"] and len(sink.calls) == 2


def test_key_function_and_signatures(remit: Remit, run_id: str) -> None:
    got: dict[str, Any] = {}

    @effect(key=lambda order_id: f"mail-{order_id}")
    def mail(order_id: str) -> str:
        got["plain"] = current_idempotency_key()
        return order_id

    @effect(name="kw")
    def with_kwargs(**kwargs: Any) -> str:
        got["kwargs"] = kwargs["idempotency_key"]
        return "ok"

    with step_scope(remit, run_id, "s"):
        assert mail("o1") == "o1"
        assert mail("o1") == "o1"  # same user key: recorded, not re-applied
        assert with_kwargs() == "ok"
    assert got["plain"] == policy.idempotency_key(run_id, "mail-o1")
    assert got["kwargs"] == policy.idempotency_key(run_id, "s/kw#0")
    assert remit.store.get_effect(run_id, "mail-o1") is not None


def test_outcomes_round_trip_through_the_codec(remit: Remit, run_id: str) -> None:
    outcome = {
        "at": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
        "amount": Decimal("9.99"),
        "ids": (1, 2),
        "raw": b"\x00",
    }
    for _ in range(2):
        with step_scope(remit, run_id, "s"):
            assert run_effect("pay", lambda key: dict(outcome)) == outcome


def test_unrecordable_outcome_leaves_the_effect_in_doubt(remit: Remit, run_id: str) -> None:
    sink = Sink()
    with step_scope(remit, run_id, "s"), pytest.raises(RemitError, match="cannot record"):
        run_effect("pay", lambda key: (sink.apply(key), object())[1])
    entry = remit.store.get_effect(run_id, "s/pay#0")
    assert entry is not None and entry.status == "intent"
    with step_scope(remit, run_id, "s"), pytest.raises(EffectInDoubt):
        run_effect("pay", sink.apply)
    with step_scope(remit, run_id, "s"):
        assert run_effect("pay", sink.apply, reconcile=sink.happened) == "receipt-1"
    assert len(sink.calls) == 1


class Status(str, enum.Enum):
    PAID = "paid"


def test_an_outcome_that_would_replay_as_another_type_is_refused_not_degraded(
    remit: Remit, run_id: str
) -> None:
    """A str Enum recorded as a str would replay as a str, not as what the first run
    got: refused at record time, as any outcome Remit cannot record as it is."""
    with step_scope(remit, run_id, "s"), pytest.raises(RemitError, match="Status"):
        run_effect("pay", lambda key: Status.PAID)
    entry = remit.store.get_effect(run_id, "s/pay#0")
    assert entry is not None and entry.status == "intent"


def test_failed_apply_then_reconcile_and_idempotent(remit: Remit, run_id: str) -> None:
    sink = Sink()

    def flaky(key: str) -> str:
        raise ConnectionError("target unreachable")

    for name in ("reconciled", "idempotent", "neither"):
        with step_scope(remit, run_id, "s"), pytest.raises(ConnectionError):
            run_effect(name, flaky)
    with step_scope(remit, run_id, "s"):
        # reconcile says "did not happen": applied now, once.
        assert run_effect("reconciled", sink.apply, reconcile=sink.happened) == "receipt-1"
        # idempotent: re-applied with the same key.
        assert run_effect("idempotent", sink.apply, idempotent=True) == "receipt-2"
        with pytest.raises(EffectInDoubt) as err:
            run_effect("neither", sink.apply)
    assert err.value.effect_key == "s/neither#0" and err.value.run_id == run_id
    assert [k for k, _ in sink.calls] == [
        policy.idempotency_key(run_id, "s/reconciled#0"),
        policy.idempotency_key(run_id, "s/idempotent#0"),
    ]


def test_reconcile_that_finds_the_effect_records_its_answer(remit: Remit, run_id: str) -> None:
    sink = Sink()

    def applied_then_lost(key: str) -> str:
        sink.apply(key)
        raise ConnectionResetError("the answer was lost")

    with step_scope(remit, run_id, "s"), pytest.raises(ConnectionResetError):
        run_effect("pay", applied_then_lost)
    with step_scope(remit, run_id, "s"):
        assert run_effect("pay", sink.apply, reconcile=sink.happened) == "receipt-1"
    assert len(sink.calls) == 1
    entry = remit.store.get_effect(run_id, "s/pay#0")
    assert entry is not None and entry.status == "done"


def test_stale_fence_applies_nothing(remit: Remit, run_id: str) -> None:
    sink = Sink()
    old = remit.store.acquire_claim(run_id, "main", "A", now=0.0, lease=1.0)
    remit.store.acquire_claim(run_id, "main", "B", now=5.0, lease=1.0)
    with step_scope(remit, run_id, "s", fence=FenceRef.of(old)), pytest.raises(Fenced):
        run_effect("pay", sink.apply)
    assert sink.calls == [] and remit.store.get_effect(run_id, "s/pay#0") is None


# -- async ---------------------------------------------------------------------------------


def test_async_effect_records_and_replays(remit: Remit, run_id: str) -> None:
    sink = Sink()

    @effect(name="notify")
    async def notify(text: str, *, idempotency_key: str) -> str:
        await asyncio.sleep(0)
        assert current_idempotency_key() == idempotency_key
        return sink.apply(idempotency_key, text)

    async def reconcile(key: str) -> Any:
        await asyncio.sleep(0)
        return sink.happened(key)

    async def step() -> tuple[Any, ...]:
        with step_scope(remit, run_id, "s"):
            a = await notify("hi")
            b = await notify("again")
            c = await arun_effect("raw", lambda key: asyncio.sleep(0, result=key))
            return a, b, c

    first = asyncio.run(step())
    assert first[:2] == ("receipt-1", "receipt-2")
    assert first[2] == policy.idempotency_key(run_id, "s/raw#0")
    assert asyncio.run(step()) == first and len(sink.calls) == 2

    async def in_doubt_then_reconciled() -> Any:
        async def boom(key: str) -> None:
            sink.apply(key)
            raise ConnectionError

        with step_scope(remit, run_id, "t"), pytest.raises(ConnectionError):
            await arun_effect("pay", boom)
        with step_scope(remit, run_id, "t"):
            return await arun_effect("pay", boom, reconcile=reconcile)

    assert asyncio.run(in_doubt_then_reconciled()) == "receipt-3"
    assert len(sink.calls) == 3


def test_async_effect_runs_a_plain_reconcile_off_the_event_loop(remit: Remit, run_id: str) -> None:
    """An async effect in doubt asks a plain (blocking) `reconcile` in a worker thread:
    the event loop goes on meanwhile. An async hook is awaited on the loop."""
    sink = Sink()
    seen: list[str] = []

    def plain(key: str) -> Any:
        try:
            asyncio.get_running_loop()
            seen.append("plain on the loop")
        except RuntimeError:
            seen.append("plain in a thread")
        return sink.happened(key)

    async def hook(key: str) -> Any:
        asyncio.get_running_loop()  # raises off the loop
        seen.append("async on the loop")
        return sink.happened(key)

    async def boom(key: str) -> None:
        sink.apply(key)
        raise ConnectionError

    async def in_doubt(step: str, reconcile: Any) -> Any:
        with step_scope(remit, run_id, step), pytest.raises(ConnectionError):
            await arun_effect("pay", boom)
        with step_scope(remit, run_id, step):
            return await arun_effect("pay", boom, reconcile=reconcile)

    assert asyncio.run(in_doubt("plain", plain)) == "receipt-1"
    assert asyncio.run(in_doubt("async", hook)) == "receipt-2"
    assert seen == ["plain in a thread", "async on the loop"]
    assert len(sink.calls) == 2


def _locked_store(tmp_path: Path) -> tuple[Remit, sqlite3.Connection]:
    """A SQLite-backed Remit whose database another connection holds write-locked."""
    remit = Remit(f"sqlite:///{tmp_path}/loop.db?busy_timeout=1500")
    blocker = sqlite3.connect(sqlite_path(remit.store.url), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    return remit, blocker


async def _run_with_ticker(remit: Remit, blocker: sqlite3.Connection, *, blocking: bool) -> Any:
    """Run one effect while a ticker task ticks 5 times, then releases the write lock.

    The effect's intent write waits for that lock, so it finishes only if the
    ticker ran while the effect was being recorded.
    """
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(5):
            await asyncio.sleep(0.005)
            ticks += 1
        blocker.execute("ROLLBACK")

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        with step_scope(remit, "loop-run", "s"):
            if blocking:
                return run_effect("e", lambda key: "done"), ticks
            return await arun_effect("e", lambda key: asyncio.sleep(0, result="done")), ticks
    finally:
        await task


def test_async_effect_does_not_block_the_event_loop(tmp_path: Path) -> None:
    remit, blocker = _locked_store(tmp_path)
    assert asyncio.run(_run_with_ticker(remit, blocker, blocking=False)) == ("done", 5)


def test_sync_effect_in_a_coroutine_blocks_the_loop_control(tmp_path: Path) -> None:
    """The control: the same measurement fails for a call that blocks the loop."""
    remit, blocker = _locked_store(tmp_path)
    with pytest.raises(StoreUnavailable, match="locked"):
        asyncio.run(_run_with_ticker(remit, blocker, blocking=True))
