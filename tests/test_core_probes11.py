"""Probes of the core and its engines, round 11: what a user's odd call or a damaged
record still did.

A consume of an interrupt whose stored prompt fails to verify stored the value and
then raised `CorruptRecord`: the resumer was told its resume failed, and its value
was consumed all the same (P5). Fences, claims to release, plans and blobs of the
wrong type broke with an `AttributeError` deep in the core; an effect name or step
key that is not text was recorded under its repr. An effect outcome or metadata with
an int too long for Python's text conversion escaped as a bare `ValueError` (an
effect left in doubt with no word of which), and an outcome recorded by a writer
with that limit lifted read back as a bare `ValueError`, not `CorruptRecord`. A
history limit or a write index past what an engine counts in broke with each
engine's own error (on Redis `StoreUnavailable`, as if the server were down). An
effect left in doubt in a run, then copied (`copy_run`), was reconciled or re-applied
in the copy under the copy's own idempotency key, not the one it was applied with:
charged twice (P2). An effect whose body called an effect of its own key waited for
its own turn forever.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from remit_core import (
    MAIN_BRANCH,
    NOT_APPLIED,
    CorruptRecord,
    Remit,
    RemitError,
    ResumeConflict,
    WriteRecord,
    current_idempotency_key,
    effect,
    policy,
    run_effect,
    step_scope,
)

# -- helpers ---------------------------------------------------------------------


def _snapshot(remit: Remit, run_id: str) -> tuple[Any, ...]:
    """Everything a run holds, read back from the store."""
    s = remit.store
    return (
        [(c.checkpoint_id, c.branch, c.parent_id) for c in s.list_checkpoints(run_id, None)],
        [(b.branch, b.head_id, b.fork_token) for b in s.list_branches(run_id, None)],
        [(i.interrupt_id, i.status, i.value) for i in s.list_interrupts(run_id)],
        s.get_writes(run_id, "", "c1"),
        s.get_blobs(run_id, "", ["k"]),
        s.get_effect(run_id, "s/e#0"),
    )


def _set_prompt(remit: Remit, run_id: str, interrupt_id: str, prompt: bytes) -> None:
    """Replace the stored (sealed) prompt of an interrupt of main, as damage would."""
    store: Any = remit.store
    if store.url.startswith("redis"):
        from remit_core.stores.redis import _join, run_prefix

        field = _join(MAIN_BRANCH, interrupt_id) + "\x00p"
        store._client().hset(run_prefix(run_id) + "in", field, prompt)
        return
    with store._txn() as txn:
        txn.execute(
            "UPDATE remit_interrupts SET prompt = ? WHERE run_id = ? AND interrupt_id = ?",
            (prompt, run_id, interrupt_id),
        )


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


# -- consume-once and a damaged prompt ------------------------------------------------


def test_a_consume_of_an_interrupt_whose_prompt_fails_to_verify_stores_no_value(
    store_url: str, run_id: str
) -> None:
    """The store consumed the interrupt and stored the value, then the core failed to
    verify the prompt it handed back: the resumer got `CorruptRecord`, and a retry
    once the prompt was repaired got `ResumeConflict` for a value nobody acknowledged."""
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    remit.open_interrupts(run_id, {"approve": b"ok to charge?"}, checkpoint_id="c1")
    sealed = remit.store.get_interrupt(run_id, MAIN_BRANCH, "approve").prompt  # type: ignore[union-attr]
    assert sealed is not None
    _set_prompt(remit, run_id, "approve", _flip_last_byte(sealed))
    with pytest.raises(CorruptRecord) as err:
        remit.consume(run_id, "approve", b"alice")
    assert (err.value.run_id, err.value.checkpoint_id, err.value.interrupt_id) == (
        run_id,
        "c1",
        "approve",
    )
    stored = remit.store.get_interrupt(run_id, MAIN_BRANCH, "approve")
    assert stored is not None and (stored.status, stored.value) == ("pending", None)
    # Repaired, the interrupt takes one value: the one acknowledged to its resumer.
    _set_prompt(remit, run_id, "approve", sealed)
    got = remit.consume(run_id, "approve", b"bob")
    assert (got.value, got.prompt) == (b"bob", b"ok to charge?")
    with pytest.raises(ResumeConflict):
        remit.consume(run_id, "approve", b"carol")
    again = remit.interrupt(run_id, "approve")
    assert again is not None and (again.status, again.value) == ("consumed", b"bob")


# -- arguments of the wrong type ------------------------------------------------------

Call = Callable[[Remit, str, Any], Any]


def _commit_after_c1(**extra: Any) -> Call:
    return lambda r, run, handle: r.commit(
        run_id=run, checkpoint_id="c2", parent_id="c1", state=b"s", **extra
    )


def _effect_under(fence: str) -> Call:
    def call(r: Remit, run: str, handle: Any) -> Any:
        with step_scope(r, run, "s", fence=handle if fence == "handle" else handle.claim.fence):
            return run_effect("e", lambda key: pytest.fail("applied"))

    return call


WRONG_TYPES: dict[str, tuple[Call, str]] = {
    "commit fence=handle": (
        lambda r, run, h: r.commit(
            run_id=run, checkpoint_id="c2", parent_id="c1", state=b"s", fence=h
        ),
        r"fence must be a FenceRef \(pass the handle's \.fence\), got ClaimHandle",
    ),
    "put_writes fence=handle": (
        lambda r, run, h: r.put_writes([WriteRecord(run, "c1", "t", 0, "ch", b"v")], fence=h),
        "fence must be a FenceRef",
    ),
    "open_interrupts fence=handle": (
        lambda r, run, h: r.open_interrupts(run, {"i2": None}, fence=h),
        "fence must be a FenceRef",
    ),
    "consume fence=handle": (
        lambda r, run, h: r.consume(run, "i1", b"yes", fence=h),
        "fence must be a FenceRef",
    ),
    "effect fence=handle": (_effect_under("handle"), "fence must be a FenceRef"),
    "effect fence=int": (_effect_under("int"), "fence must be a FenceRef, got int"),
    "commit release=fence": (
        lambda r, run, h: r.commit(
            run_id=run, checkpoint_id="c2", parent_id="c1", state=b"s", release=h.fence
        ),
        "release must be a ClaimHandle, got FenceRef",
    ),
    "commit plan=str": (_commit_after_c1(plan="main"), "plan must be a CommitPlan, got str"),
    "commit blobs=list": (_commit_after_c1(blobs=["k"]), "blobs must map .*, got list"),
    "commit blobs=bytes": (_commit_after_c1(blobs=b"k"), "blobs must map .*, got bytes"),
}


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_an_argument_of_the_wrong_type_is_a_type_error_naming_it_and_stores_nothing(
    store_url: str, run_id: str, name: str
) -> None:
    """A claim handle passed as its fence (`fence=handle`, not `handle.fence`) and the
    like raised `AttributeError` ('ClaimHandle' object has no attribute 'run_id')."""
    call, message = WRONG_TYPES[name]
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    remit.open_interrupts(run_id, {"i1": None}, checkpoint_id="c1")
    handle = remit.claim(run_id, heartbeat=False)
    before = _snapshot(remit, run_id)
    try:
        with pytest.raises(TypeError, match=message):
            call(remit, run_id, handle)
        assert _snapshot(remit, run_id) == before
        # The same call with the handle's fence goes through.
        remit.put_writes([WriteRecord(run_id, "c1", "t", 0, "ch", b"v")], fence=handle.fence)
        remit.consume(run_id, "i1", b"yes", fence=handle.fence)
        remit.commit(
            run_id=run_id,
            checkpoint_id="c2",
            parent_id="c1",
            state=b"s",
            fence=handle.fence,
            release=handle,
        )
    finally:
        handle.release()
    assert [c.checkpoint_id for c in remit.history(run_id)] == ["c2", "c1"]


@pytest.mark.parametrize(
    ("name", "step_key", "named"),
    [(None, "s", "effect name"), (7, "s", "effect name"), ("e", None, "step key")],
)
def test_an_effect_name_or_step_key_that_is_not_text_is_refused_before_the_ledger(
    store_url: str, run_id: str, name: Any, step_key: Any, named: str
) -> None:
    """Each was formatted into the effect key: the effect was applied and recorded as
    's/None#0', a key no call naming it properly would ever find again."""
    remit = Remit(store_url)
    applied: list[str] = []
    with step_scope(remit, run_id, step_key), pytest.raises(TypeError, match=named):
        run_effect(name, applied.append)
    assert applied == []
    for key in (f"s/{name}#0", f"{step_key}/e#0"):
        assert remit.store.get_effect(run_id, key) is None


# -- numbers past what text or an engine holds ----------------------------------------


def test_an_effect_outcome_too_long_for_text_leaves_the_effect_in_doubt_naming_it(
    store_url: str, run_id: str
) -> None:
    """An int of more digits than Python converts to text escaped as the bare
    `ValueError` of `int.__str__`, naming neither the effect nor Remit."""
    remit = Remit(store_url)
    huge = 10**5000
    with step_scope(remit, run_id, "s"), pytest.raises(RemitError, match="cannot record") as err:
        run_effect("e", lambda key: huge)
    assert err.value.effect_key == "s/e#0"
    assert "more digits than Python converts" in str(err.value)
    entry = remit.store.get_effect(run_id, "s/e#0")
    assert entry is not None and entry.status == "intent"
    # The same number in checkpoint metadata: refused by name, nothing committed.
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    with pytest.raises(ValueError, match="more digits than Python converts"):
        remit.commit(
            run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s", metadata={"n": huge}
        )
    assert [c.checkpoint_id for c in remit.history(run_id)] == ["c1"]


def test_an_outcome_recorded_past_this_readers_digit_limit_is_corrupt_record(
    store_url: str, run_id: str
) -> None:
    """A writer that lifted Python's digit limit records an outcome this reader cannot
    decode: its replay raised the bare `ValueError` of `json.loads`."""
    remit = Remit(store_url)
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with step_scope(remit, run_id, "s"):
            assert run_effect("e", lambda key: 10**5000) == 10**5000
    finally:
        sys.set_int_max_str_digits(limit)
    with step_scope(remit, run_id, "s"), pytest.raises(CorruptRecord) as err:
        run_effect("e", lambda key: pytest.fail("applied again"))
    assert (err.value.run_id, err.value.effect_key) == (run_id, "s/e#0")
    assert "does not decode" in str(err.value)


def test_a_history_limit_or_write_index_past_an_engines_integers_reads_all_or_none(
    store_url: str, run_id: str
) -> None:
    """For a limit past 2**63 - 1, SQLite raised `IntegrityError` (datatype mismatch),
    PostgreSQL `NumericValueOutOfRange` and Redis `StoreUnavailable` (as if the server
    were down); for an index past 2**63, SQLite raised `OverflowError`."""
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1")
    remit.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"2")
    remit.put_writes([WriteRecord(run_id, "c2", "t", i, "ch", b"v") for i in (0, 2**31 - 1)])
    for limit in (2**63 - 1, 2**63, 10**30):
        assert [c.checkpoint_id for c in remit.history(run_id, limit=limit)] == ["c2", "c1"]
    assert [w.idx for w in remit.writes(run_id, "c2", after_idx=0)] == [2**31 - 1]
    for after in (2**31 - 1, 2**31, 2**63, 10**30):
        assert remit.writes(run_id, "c2", after_idx=after) == []


# -- an effect in doubt in a copied run -----------------------------------------------


class _Payments:
    """A payment API: applies a charge once per idempotency key, answers "did K happen?"."""

    def __init__(self) -> None:
        self.charges: dict[str, int] = {}
        self.calls: list[str] = []

    def charge(self, key: str) -> str:
        assert current_idempotency_key() == key
        self.calls.append(key)
        self.charges.setdefault(key, len(self.charges) + 1)
        return f"receipt-{self.charges[key]}"

    def charge_then_lose_the_answer(self, key: str) -> str:
        self.charge(key)
        raise ConnectionResetError("the answer was lost")

    def lookup(self, key: str) -> Any:
        return f"receipt-{self.charges[key]}" if key in self.charges else NOT_APPLIED


@pytest.mark.parametrize("mode", ["reconcile", "idempotent"])
def test_an_effect_in_doubt_in_a_copied_run_is_settled_under_the_key_it_was_applied_with(
    store_url: str, run_id: str, mode: str
) -> None:
    """A copy holds its source's ledger: a done effect replays its outcome, but one in
    doubt was reconciled (or re-applied) under the key of the copy's own id, which the
    target never saw: it charged a second time (P2)."""
    remit = Remit(store_url)
    payments = _Payments()
    with step_scope(remit, run_id, "charge"), pytest.raises(ConnectionResetError):
        run_effect("card", payments.charge_then_lose_the_answer)
    with step_scope(remit, run_id, "notify"):
        run_effect("mail", payments.charge)
    source_key = policy.idempotency_key(run_id, "charge/card#0")
    assert payments.calls == [source_key, policy.idempotency_key(run_id, "notify/mail#0")]
    copy = f"{run_id}-copy"
    remit.copy_run(run_id, copy)
    with step_scope(remit, copy, "charge"):
        receipt = run_effect(
            "card",
            payments.charge,
            reconcile=payments.lookup if mode == "reconcile" else None,
            idempotent=mode == "idempotent",
        )
    with step_scope(remit, copy, "notify"):
        assert run_effect("mail", payments.charge) == "receipt-2"  # recorded: not applied
    assert receipt == "receipt-1"
    assert len(payments.charges) == 2  # the card once, the mail once
    assert set(payments.calls) == {source_key, policy.idempotency_key(run_id, "notify/mail#0")}
    entry = remit.store.get_effect(copy, "charge/card#0")
    assert entry is not None and (entry.status, entry.idempotency_key) == ("done", source_key)
    # The source, settled in turn, finds the same single charge.
    with step_scope(remit, run_id, "charge"):
        assert run_effect("card", payments.charge, reconcile=payments.lookup) == "receipt-1"
    assert len(payments.charges) == 2


# -- an effect whose body calls one of its own key --------------------------------------


def test_an_effect_calling_one_of_its_own_key_is_refused_not_a_deadlock(
    store_url: str, run_id: str
) -> None:
    """Two effects given one key pattern, one calling the other: the inner call waited
    for the turn its own caller held, forever (sync: a lock; async: a thread waiting on
    it), and the step hung without a word."""
    remit = Remit(store_url)
    applied: list[str] = []

    @effect(key=lambda order: f"order:{order}")
    def charge(order: str) -> str:
        applied.append("charge")
        return str(receipt(order))

    @effect(key=lambda order: f"order:{order}")
    def receipt(order: str) -> str:
        applied.append("receipt")
        return "r"

    @effect(key=lambda order: f"order:{order}")
    async def acharge(order: str) -> str:
        applied.append("acharge")
        return str(await areceipt(order))

    @effect(key=lambda order: f"order:{order}")
    async def areceipt(order: str) -> str:
        applied.append("areceipt")
        return "r"

    outcome: list[BaseException] = []

    def step() -> None:
        try:
            with step_scope(remit, run_id, "s"):
                charge("o1")
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=step, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the nested effect waited for its own turn"

    async def astep() -> None:
        with step_scope(remit, run_id, "a"):
            await asyncio.wait_for(acharge("o2"), timeout=30)

    with pytest.raises(RemitError, match="same key is being applied") as err:
        asyncio.run(astep())
    assert err.value.effect_key == "order:o2"
    [sync_err] = outcome
    assert isinstance(sync_err, RemitError) and sync_err.effect_key == "order:o1"
    assert applied == ["charge", "acharge"]  # neither inner call applied anything
    for key in ("order:o1", "order:o2"):  # each outer effect stays in doubt
        entry = remit.store.get_effect(run_id, key)
        assert entry is not None and entry.status == "intent"
    # Apart (not nested), effects of one key are one effect: the second replays the first.
    with step_scope(remit, run_id, "t"):
        assert run_effect("x", lambda key: "first", key="k") == "first"
        assert run_effect("y", lambda key: "second", key="k") == "first"
