"""Round 24 of the core's probes: the effect API misused, a store's connection cut
in the middle of a write, and a holder fenced out after a takeover.

Misuse: a `fn`, `reconcile` or `key` that cannot be called, an `idempotent` that is
no bool, gets a `TypeError` naming it before anything is recorded (before: a `fn`
of None left an intent in doubt on every replay, a `reconcile=True` failed only in
recovery, and `idempotent="no"` was taken as true). Cuts: the server ends the
store's own connections (PostgreSQL backends terminated, Redis clients killed) at a
failpoint inside a commit, a consume, an effect's intent or its outcome; the caller
gets the true result or `StoreUnavailable`, the same call made again does its job
once, and a reader on another connection sees one outcome, nothing half-written.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import PG_URL, REDIS_URL
from store_cuts import cut_at, tagged

from remit_core import (
    NOT_APPLIED,
    Fenced,
    Remit,
    ResumeConflict,
    StoreUnavailable,
    arun_effect,
    effect,
    policy,
    run_effect,
    step_scope,
)
from remit_core.core import ClaimHandle
from remit_core.records import WriteRecord

SERVERS = {"postgresql": PG_URL, "redis": REDIS_URL}


@pytest.fixture
def remit(store_url: str) -> Iterator[Remit]:
    with Remit(store_url) as remit:
        yield remit


# -- the effect API misused --------------------------------------------------------


@pytest.mark.parametrize("fn", [None, 5, "charge"])
def test_run_effect_with_a_fn_that_cannot_be_called_records_nothing(
    remit: Remit, run_id: str, fn: Any
) -> None:
    """Before: the intent was recorded, then calling `fn` failed; the effect, which
    never happened, stayed in doubt and every replay raised `EffectInDoubt`."""
    with step_scope(remit, run_id, "s"), pytest.raises(TypeError, match="fn must be callable"):
        run_effect("charge", fn)
    assert remit.store.get_effect(run_id, "s/charge#0") is None

    async def astep() -> None:
        with step_scope(remit, run_id, "a"):
            await arun_effect("charge", fn)

    with pytest.raises(TypeError, match="fn must be callable"):
        asyncio.run(astep())
    assert remit.store.get_effect(run_id, "a/charge#0") is None
    with step_scope(remit, run_id, "s"):  # the occurrence was not used up
        assert run_effect("charge", lambda key: "charged") == "charged"
    assert remit.store.get_effect(run_id, "s/charge#0") is not None


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"reconcile": True}, "reconcile must be callable or None, got bool"),
        ({"reconcile": "lookup"}, "reconcile must be callable or None, got str"),
        ({"idempotent": "no"}, "idempotent must be a bool, got str 'no'"),
        ({"idempotent": None}, "idempotent must be a bool, got NoneType"),
        ({"idempotent": 1}, "idempotent must be a bool, got int"),
    ],
)
def test_effect_options_of_the_wrong_type_are_refused_before_anything_is_recorded(
    remit: Remit, run_id: str, option: dict[str, Any], match: str
) -> None:
    """Before: a `reconcile` that is no callable was taken, and failed only when a
    recovery found the effect in doubt (where it matters); an `idempotent` of "no"
    was taken as true, and an effect in doubt applied again."""
    applied: list[str] = []
    with pytest.raises(TypeError, match=match):
        effect(**option)(lambda: applied.append("x"))
    with step_scope(remit, run_id, "s"), pytest.raises(TypeError, match=match):
        run_effect("charge", lambda key: applied.append(key), **option)

    async def astep() -> None:
        async def charge(key: str) -> None:
            applied.append(key)

        with step_scope(remit, run_id, "a"):
            await arun_effect("charge", charge, **option)

    with pytest.raises(TypeError, match=match):
        asyncio.run(astep())
    assert applied == []
    assert remit.store.get_effect(run_id, "s/charge#0") is None
    assert remit.store.get_effect(run_id, "a/charge#0") is None


def test_effect_declared_with_a_key_name_or_target_of_the_wrong_type_is_refused() -> None:
    """At declaration, naming the argument (before: a `key="mail"` failed at each call
    with "'str' object is not callable", and `effect(42)` with an `AttributeError`)."""
    with pytest.raises(TypeError, match=r"effect\(key=\) must be a callable"):
        effect(key="mail")
    with pytest.raises(TypeError, match="effect name must be a str, got bytes"):
        effect(name=b"charge")
    with pytest.raises(TypeError, match="@effect applies to a function, got int"):
        effect(42)


def test_reconcile_that_raises_leaves_the_effect_in_doubt_and_applies_nothing(
    remit: Remit, run_id: str
) -> None:
    """A `reconcile` that fails cannot say whether the effect happened: its error
    reaches the caller, nothing is applied or recorded as done, and a later replay
    whose `reconcile` answers decides then."""
    remit.store.begin_effect(run_id, "s/charge#0", "k", now=1.0)  # a crash after the intent
    applied: list[str] = []

    def lookup(key: str) -> Any:
        raise ConnectionError("payments API down")

    with step_scope(remit, run_id, "s"), pytest.raises(ConnectionError):
        run_effect("charge", applied.append, reconcile=lookup)
    entry = remit.store.get_effect(run_id, "s/charge#0")
    assert entry is not None and entry.status == "intent" and applied == []
    with step_scope(remit, run_id, "s"):
        run_effect("charge", lambda key: applied.append(key), reconcile=lambda k: NOT_APPLIED)
    assert len(applied) == 1


# -- a store's connection cut in the middle of a write ------------------------------


@pytest.fixture(params=sorted(SERVERS))
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cut_remits(engine: str) -> Iterator[tuple[Remit, Remit, str]]:
    """A Remit whose connections carry a name of their own, one straight to the
    server (another connection pool: the reader), and the name to cut."""
    url, name = tagged(engine)
    direct = Remit(SERVERS[engine])
    direct.store.setup()
    named = Remit(url)
    yield named, direct, name
    named.close()
    direct.close()


def _either(call: Any) -> Any:
    """What `call` returned, or None if it raised `StoreUnavailable` (the two answers a
    caller whose connection was cut may get)."""
    try:
        return call()
    except StoreUnavailable:
        return None


def test_commit_cut_inside_its_write(
    engine: str, cut_remits: tuple[Remit, Remit, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    named, direct, name = cut_remits
    run_id = f"cut24-{uuid.uuid4().hex}"
    handle = named.claim(run_id, heartbeat=False)
    cid = f"c-{uuid.uuid4().hex}"
    ask: dict[str, Any] = {
        "run_id": run_id,
        "checkpoint_id": cid,
        "parent_id": None,
        "state": b"state",
        "metadata": {"step": 1},
        "writes": [WriteRecord(run_id, cid, "t", 0, "ch", b"w")],
        "fence": handle.fence,
        "allow_new_root": True,
    }
    ended = cut_at(monkeypatch, "checkpoint.in_commit", engine, name)
    first = _either(lambda: named.commit(**ask))
    monkeypatch.undo()
    assert ended and ended[0] >= 1
    head = direct.head(run_id)
    if first is None:  # refused: nothing of it, or all of it, is stored
        assert head is None or head.checkpoint_id == cid
    else:
        assert head is not None and head.checkpoint_id == cid and first.state == b"state"
    if head is None:
        assert direct.writes(run_id, cid) == []
    again = named.commit(**ask)
    assert (again.checkpoint_id, again.state) == (cid, b"state")
    assert [c.checkpoint_id for c in direct.history(run_id)] == [cid]
    assert [w.value for w in direct.writes(run_id, cid)] == [b"w"]
    handle.release()
    direct.delete_run(run_id)


def test_consume_cut_inside_its_write(
    engine: str, cut_remits: tuple[Remit, Remit, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    named, direct, name = cut_remits
    run_id = f"cut24-{uuid.uuid4().hex}"
    direct.open_interrupts(run_id, {"approve": b"ok?"})
    ended = cut_at(monkeypatch, "interrupt.in_consume", engine, name)
    first = _either(lambda: named.consume(run_id, "approve", b"alice"))
    monkeypatch.undo()
    assert ended and ended[0] >= 1
    stored = direct.interrupt(run_id, "approve")
    assert stored is not None
    if first is not None:
        assert first.value == b"alice" and stored.status == "consumed"
    else:  # told it failed: the value was not stored, and a retry consumes it
        assert stored.status == "pending" and stored.value is None
        assert named.consume(run_id, "approve", b"alice").value == b"alice"
    with pytest.raises(ResumeConflict):
        direct.consume(run_id, "approve", b"mallory")
    final = direct.interrupt(run_id, "approve")
    assert final is not None and (final.status, final.value) == ("consumed", b"alice")
    direct.delete_run(run_id)


@pytest.mark.parametrize("point", ["effect.before_intent", "effect.in_intent", "effect.in_outcome"])
def test_effect_cut_inside_its_writes_applies_once(
    engine: str,
    cut_remits: tuple[Remit, Remit, str],
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    named, direct, name = cut_remits
    run_id = f"cut24-{uuid.uuid4().hex}"
    applied: list[str] = []

    @effect(name="charge", reconcile=lambda key: "charged" if key in applied else NOT_APPLIED)
    def charge(*, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "charged"

    handle = named.claim(run_id, heartbeat=False)
    ended = cut_at(monkeypatch, point, engine, name)
    with step_scope(named, run_id, "step", fence=handle.fence):
        first = _either(charge)
    monkeypatch.undo()
    if engine == "postgresql" or point != "effect.in_intent":  # (Redis has no such point)
        assert ended and ended[0] >= 1
    assert first in ("charged", None)
    entry = direct.store.get_effect(run_id, "step/charge#0")
    if first == "charged":
        assert entry is not None and entry.status == "done"
    with step_scope(named, run_id, "step", fence=handle.fence):  # the step run again
        assert charge() == "charged"
    with step_scope(direct, run_id, "step"):  # a recovery elsewhere
        assert charge() == "charged"
    assert len(applied) == 1
    entry = direct.store.get_effect(run_id, "step/charge#0")
    assert entry is not None and entry.status == "done"
    handle.release()
    direct.delete_run(run_id)


# -- a holder fenced out after a takeover --------------------------------------------


def test_every_write_of_a_holder_taken_over_is_fenced_and_stores_nothing(
    store_url: str, run_id: str
) -> None:
    """The holder's renewals stopped (its heartbeat thread blocked, or the store out of
    its reach) and its lease ran out; another resumer took the run over (L1). Each
    later write of the old holder, of every kind, raises `Fenced` and stores nothing
    (L2), and an effect it had begun before the takeover records no outcome (the new
    holder reconciles it)."""
    now = [1000.0]
    old = Remit(store_url, lease=5.0, clock=lambda: now[0])
    new = Remit(store_url, lease=5.0, clock=lambda: now[0])
    try:
        old.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
        old.open_interrupts(run_id, {"approve": b"ok?"}, checkpoint_id="c1")
        zombie = old.claim(run_id, heartbeat=False)  # as if its renewals were blocked
        applied: list[str] = []
        taken: list[ClaimHandle] = []

        def pay(key: str) -> str:
            """Applied, and meanwhile the zombie's lease ran out and the run was taken."""
            applied.append(key)
            now[0] += 6.0
            taken.append(new.claim(run_id, heartbeat=False))
            return "paid"

        lookup = {"reconcile": lambda key: "paid" if key in applied else NOT_APPLIED}
        with step_scope(old, run_id, "charge", fence=zombie.fence), pytest.raises(Fenced):
            run_effect("pay", pay, **lookup)
        [taker], stale = taken, zombie.fence
        entry = new.store.get_effect(run_id, "charge/pay#0")
        assert entry is not None and entry.status == "intent"  # its outcome was refused

        writes: list[tuple[str, Any]] = [
            ("commit", lambda: old.commit(
                run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s2", fence=stale
            )),
            ("put_writes", lambda: old.put_writes(
                [WriteRecord(run_id, "c1", "t", 0, "ch", b"w")], fence=stale
            )),
            ("open_interrupts", lambda: old.open_interrupts(
                run_id, {"later": None}, checkpoint_id="c1", fence=stale
            )),
            ("consume", lambda: old.consume(run_id, "approve", b"zombie", fence=stale)),
        ]  # fmt: skip
        assert [label for label, write in writes if _refused_as_fenced(write)] == [
            label for label, _ in writes
        ]
        with step_scope(old, run_id, "mail", fence=stale), pytest.raises(Fenced):
            run_effect("send", lambda key: applied.append(key))
        assert applied == [policy.idempotency_key(run_id, "charge/pay#0")]

        head = new.head(run_id)
        assert head is not None and head.checkpoint_id == "c1"
        assert [c.checkpoint_id for c in new.history(run_id)] == ["c1"]
        assert new.writes(run_id, "c1") == []
        assert new.interrupt(run_id, "later") is None
        pending = new.interrupt(run_id, "approve")
        assert pending is not None and pending.status == "pending"
        assert new.store.get_effect(run_id, "mail/send#0") is None
        with step_scope(new, run_id, "charge", fence=taker.fence):  # reconciled, not re-paid
            assert run_effect("pay", pay, **lookup) == "paid"
        assert len(applied) == 1
        # The new holder goes on: its writes land, the interrupt takes its value.
        assert new.consume(run_id, "approve", b"alice", fence=taker.fence).value == b"alice"
        new.commit(
            run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s2", fence=taker.fence
        )
        taker.release()
    finally:
        old.close()
        new.close()


# -- the public API given the wrong types -------------------------------------------


@pytest.mark.parametrize("metadata", [[("step", 1)], "step", 7])
def test_commit_metadata_that_is_no_mapping_is_refused_naming_it(
    remit: Remit, run_id: str, metadata: Any
) -> None:
    """Before: `dict()`'s own error ("cannot convert dictionary update sequence
    element #0 to a sequence"), which names no argument; a list of pairs was taken."""
    with pytest.raises(
        TypeError, match=f"metadata must be a mapping, got {type(metadata).__name__}"
    ):
        remit.commit(
            run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s", metadata=metadata
        )
    assert remit.head(run_id) is None and remit.branches(run_id) == []


def test_public_calls_given_bytes_or_none_for_ids_name_the_argument_and_write_nothing(
    remit: Remit, run_id: str
) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    remit.open_interrupts(run_id, {"approve": b"ok?"}, checkpoint_id="c1")
    calls: list[tuple[str, Any]] = [
        ("run_id", lambda: remit.commit(
            run_id=run_id.encode(), checkpoint_id="c2", parent_id="c1", state=b"s"
        )),
        ("checkpoint_id", lambda: remit.commit(
            run_id=run_id, checkpoint_id=None, parent_id="c1", state=b"s"
        )),
        ("parent_id", lambda: remit.commit(
            run_id=run_id, checkpoint_id="c2", parent_id=b"c1", state=b"s"
        )),
        ("state", lambda: remit.commit(
            run_id=run_id, checkpoint_id="c2", parent_id="c1", state="s"
        )),
        ("interrupt_id", lambda: remit.consume(run_id, b"approve", b"v")),
        ("value", lambda: remit.consume(run_id, "approve", "v")),
        ("value", lambda: remit.consume(run_id, "approve", None)),
        ("fork_token", lambda: remit.fork(run_id, "c1", b"t")),
        ("scope", lambda: remit.claim(run_id, None, heartbeat=False)),
        ("effect key", lambda: _in_step(remit, run_id, key=b"k")),
    ]  # fmt: skip
    for name, call in calls:
        with pytest.raises(TypeError, match=f"^{name} must be"):
            call()
    assert [c.checkpoint_id for c in remit.history(run_id)] == ["c1"]
    assert [b.branch for b in remit.branches(run_id)] == ["main"]
    pending = remit.interrupt(run_id, "approve")
    assert pending is not None and pending.status == "pending"
    assert remit.store.get_claim(run_id, "main") is None
    assert remit.store.get_effect(run_id, "k") is None


def _in_step(remit: Remit, run_id: str, **options: Any) -> Any:
    with step_scope(remit, run_id, "s"):
        return run_effect("charge", lambda key: "charged", **options)


def _refused_as_fenced(write: Any) -> bool:
    """Whether `write` raised `Fenced` (any other outcome: False, or its own error)."""
    try:
        write()
    except Fenced:
        return True
    return False
