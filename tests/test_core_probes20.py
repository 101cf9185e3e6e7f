"""Store writes whose reply is lost on the wire, through a relay to the real server.

The relay forwards every byte between Remit and a real PostgreSQL or Redis until it
is armed; then the request that carries a marker (on PostgreSQL, for a write made
of several statements: the COMMIT after it) is run and its reply dropped, and the
connection closed. Remit sees `StoreUnavailable` though the server committed. For
each write: what the caller sees, and whether the same call made again does the
right thing (its own claim back, the same checkpoint, the same branch, the effect
applied once).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import PG_URL, REDIS_URL
from store_cuts import Relay

from remit_core import Remit, ResumeConflict, StoreUnavailable, WriteConflict, policy
from remit_core.core import ClaimHandle
from remit_core.effects import NOT_APPLIED, effect, step_scope
from remit_core.records import WriteRecord

ENGINES = {"postgresql": PG_URL, "redis": REDIS_URL}


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def relay(engine: str) -> Iterator[Relay]:
    relay = Relay(ENGINES[engine])
    yield relay
    relay.close()


@pytest.fixture
def remits(engine: str, relay: Relay) -> Iterator[tuple[Remit, Remit]]:
    """A Remit through the relay, and one straight to the server."""
    direct = Remit(ENGINES[engine])
    direct.store.setup()
    through = Remit(relay.url)
    yield through, direct
    through.close()
    direct.close()


@pytest.fixture
def run_id(remits: tuple[Remit, Remit]) -> Iterator[str]:
    run = f"lost20-{uuid.uuid4().hex}"
    yield run
    remits[1].delete_run(run)


def _lose(relay: Relay, engine: str, marker: bytes, *, txn: bool) -> None:
    """Lose the reply of the write carrying `marker` after it landed (on PostgreSQL, a
    write of several statements, `txn`: the reply of the COMMIT that follows it)."""
    relay.arm(marker, then=b"COMMIT" if txn and engine == "postgresql" else None)


# -- claims ------------------------------------------------------------------------


def test_claim_whose_reply_was_lost_is_the_callers_not_a_conflict(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    """The take landed: the caller gets its claim (before: `StoreUnavailable`, and the
    same call again `ResumeConflict` with itself until the lease ran out)."""
    through, direct = remits
    _lose(relay, engine, run_id.encode(), txn=False)

    handle = through.claim(run_id, heartbeat=False)

    assert relay.fired.wait(10)
    assert direct.store.get_claim(run_id, "main") == handle.claim
    through.put_writes([WriteRecord(run_id, "c1", "t", 0, "ch", b"v")], fence=handle.fence)
    handle.release()
    direct.claim(run_id, heartbeat=False).release()  # free for anyone after


def test_claim_lost_on_the_way_stays_a_failure_when_another_took_the_run(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    """The take never reached the server and another resumer claimed the run: the
    failure stands; the other's claim is not taken for this caller's."""
    through, direct = remits
    others: list[ClaimHandle] = []
    relay.arm(
        run_id.encode(),
        lose="request",
        meanwhile=lambda: others.append(direct.claim(run_id, heartbeat=False)),
    )

    with pytest.raises(StoreUnavailable):
        through.claim(run_id, heartbeat=False)

    assert relay.fired.wait(10) and len(others) == 1
    assert direct.store.get_claim(run_id, "main") == others[0].claim
    with pytest.raises(ResumeConflict):
        through.claim(run_id, heartbeat=False)
    others[0].release()


def test_claim_at_head_whose_reply_was_lost(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    direct.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    _lose(relay, engine, run_id.encode(), txn=False)
    try:
        handle, head, _ = through.claim_at_head(run_id, heartbeat=False)
    except StoreUnavailable:
        handle, head, _ = through.claim_at_head(run_id, heartbeat=False)
    assert relay.fired.wait(10)
    assert head is not None and head.checkpoint_id == "c1"
    handle.release()
    direct.claim(run_id, heartbeat=False).release()


def test_release_whose_reply_was_lost_frees_the_run(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    handle = through.claim(run_id, heartbeat=False)
    _lose(relay, engine, run_id.encode(), txn=False)
    try:
        handle.release()
    except StoreUnavailable:
        handle.release()
    assert relay.fired.wait(10) and handle.given_up
    direct.claim(run_id, heartbeat=False).release()


def test_renewal_whose_reply_was_lost_keeps_the_claim(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    handle = through.claim(run_id, heartbeat=False)
    _lose(relay, engine, run_id.encode(), txn=False)
    assert handle._renew()  # a lost renewal is tried again at the next beat
    assert relay.fired.wait(10) and not handle.lost
    assert handle._renew() and not handle.lost
    with handle:
        through.put_writes([WriteRecord(run_id, "c", "t", 0, "ch", b"v")], fence=handle.fence)


# -- checkpoints, writes, interrupts, forks ------------------------------------------


@pytest.mark.parametrize("parent", [None, "c1"])
def test_commit_retried_after_a_lost_reply_returns_the_stored_checkpoint(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str, parent: str | None
) -> None:
    through, direct = remits
    if parent is not None:  # (committed here: the commit's retry tries it as main's head)
        through.commit(run_id=run_id, checkpoint_id=parent, parent_id=None, state=b"s1")
    handle = through.claim(run_id, heartbeat=False)
    cid = f"c-{uuid.uuid4().hex}"
    ask = {
        "run_id": run_id,
        "checkpoint_id": cid,
        "parent_id": parent,
        "state": b"s2",
        "metadata": {"step": 2},
        "writes": [WriteRecord(run_id, cid, "t", 0, "ch", b"w")],
        "fence": handle.fence,
        "allow_new_root": True,
        "release": handle,
    }
    _lose(relay, engine, cid.encode(), txn=False)
    with pytest.raises(StoreUnavailable):
        through.commit(**ask)  # type: ignore[arg-type]
    again = through.commit(**ask)  # type: ignore[arg-type]
    assert (again.checkpoint_id, again.parent_id, again.state) == (cid, parent, b"s2")
    head = direct.head(run_id)
    assert head is not None and head.checkpoint_id == cid
    assert [h.checkpoint_id for h in direct.history(run_id)].count(cid) == 1
    assert handle.given_up
    direct.claim(run_id, heartbeat=False).release()  # the commit gave the claim up


@pytest.mark.parametrize("mode", ["first", "overwrite"])
def test_put_writes_retried_after_a_lost_reply(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str, mode: str
) -> None:
    through, direct = remits
    value = f"v-{uuid.uuid4().hex}".encode()
    writes = [WriteRecord(run_id, "c1", "t", 0, "ch", value)]
    _lose(relay, engine, value, txn=False)
    with pytest.raises(StoreUnavailable):
        through.put_writes(writes, mode=mode)  # type: ignore[arg-type]
    through.put_writes(writes, mode=mode)  # type: ignore[arg-type]
    assert [w.value for w in direct.writes(run_id, "c1")] == [value]


def test_expect_absent_writes_whose_reply_was_lost_are_acknowledged(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    """An expected-sequence append that landed is this call's (before: `StoreUnavailable`,
    and the same call again `WriteConflict` with itself)."""
    through, direct = remits
    value = f"v-{uuid.uuid4().hex}".encode()
    writes = [
        WriteRecord(run_id, "c1", "t", 0, "ch", value),
        WriteRecord(run_id, "c1", "t", 1, "ch", b"second"),
    ]
    _lose(relay, engine, value, txn=True)

    through.put_writes(writes, mode="expect_absent")

    assert relay.fired.wait(10)
    assert [w.value for w in direct.writes(run_id, "c1")] == [value, b"second"]
    with pytest.raises(WriteConflict):
        through.put_writes(writes, mode="expect_absent")


def test_expect_absent_writes_lost_on_the_way_stay_a_failure_when_another_took_the_slot(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    value = f"v-{uuid.uuid4().hex}".encode()
    theirs = [WriteRecord(run_id, "c1", "t", 0, "ch", b"theirs")]
    relay.arm(
        value,
        lose="request",
        meanwhile=lambda: direct.put_writes(theirs, mode="expect_absent"),
    )

    with pytest.raises(StoreUnavailable):
        through.put_writes([WriteRecord(run_id, "c1", "t", 0, "ch", value)], mode="expect_absent")

    assert relay.fired.wait(10)
    assert [w.value for w in direct.writes(run_id, "c1")] == [b"theirs"]


def test_open_interrupts_retried_after_a_lost_reply(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    iid = f"i-{uuid.uuid4().hex}"
    _lose(relay, engine, iid.encode(), txn=True)
    with pytest.raises(StoreUnavailable):
        through.open_interrupts(run_id, {iid: b"ask"}, checkpoint_id="c1")
    through.open_interrupts(run_id, {iid: b"ask"}, checkpoint_id="c1")
    got = through.consume(run_id, iid, b"yes")
    assert (got.status, got.value, got.prompt) == ("consumed", b"yes", b"ask")


def test_fork_retried_after_a_lost_reply_gives_the_same_branch(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    direct.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    direct.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s2")
    token = f"tok-{uuid.uuid4().hex}"
    _lose(relay, engine, token.encode(), txn=True)
    with pytest.raises(StoreUnavailable):
        through.fork(run_id, "c1", token)
    branch = through.fork(run_id, "c1", token)
    assert (branch.base_id, branch.fork_token) == ("c1", token)
    assert [b.branch for b in direct.branches(run_id)].count(branch.branch) == 1
    assert direct.fork(run_id, "c1", token) == branch


# -- effects -------------------------------------------------------------------------


def _idem(run_id: str, step: str) -> bytes:
    return policy.idempotency_key(run_id, f"{step}/charge#0").encode()


def _charge(applied: list[str], **declared: Any) -> Any:
    @effect(name="charge", **declared)
    def charge(*, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "charged"

    return charge


@pytest.mark.parametrize("declared", ["plain", "reconcile", "idempotent"])
def test_effect_whose_intent_reply_was_lost_is_applied_once_by_that_call(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str, declared: str
) -> None:
    """The intent landed and nothing was applied: the call applies the effect (before:
    `StoreUnavailable`, and the step run again found the intent in doubt: without
    `reconcile` or `idempotent`, `EffectInDoubt` on every replay, for an effect that
    never happened)."""
    through, direct = remits
    applied: list[str] = []
    options: dict[str, Any] = {
        "plain": {},
        "reconcile": {"reconcile": lambda key: "charged" if key in applied else NOT_APPLIED},
        "idempotent": {"idempotent": True},
    }[declared]
    charge = _charge(applied, **options)
    claim = through.claim(run_id, heartbeat=False)
    _lose(relay, engine, _idem(run_id, "step"), txn=True)

    with step_scope(through, run_id, "step", fence=claim.fence):
        assert charge() == "charged"
    with step_scope(through, run_id, "step", fence=claim.fence):  # the step run again
        assert charge() == "charged"

    assert relay.fired.wait(10)
    assert applied == [_idem(run_id, "step").decode()]
    entry = direct.store.get_effect(run_id, "step/charge#0")
    assert entry is not None and entry.status == "done"
    claim.release()


def test_effect_whose_intent_was_lost_on_the_way_fails_and_applies_once_on_replay(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    applied: list[str] = []
    charge = _charge(applied)
    relay.arm(_idem(run_id, "step"), lose="request")

    with step_scope(through, run_id, "step"), pytest.raises(StoreUnavailable):
        charge()
    assert relay.fired.wait(10) and applied == []
    assert direct.store.get_effect(run_id, "step/charge#0") is None
    with step_scope(through, run_id, "step"):
        assert charge() == "charged"
    assert len(applied) == 1


def test_effect_intent_lost_on_the_way_is_not_taken_for_anothers(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    """Another caller recorded the intent meanwhile (it is applying the effect): this
    call's failure stands; it does not apply the effect too."""
    through, direct = remits
    applied: list[str] = []
    charge = _charge(applied)
    idem = _idem(run_id, "step")

    def other_intent() -> None:
        direct.store.begin_effect(run_id, "step/charge#0", idem.decode(), now=1.0)

    relay.arm(idem, lose="request", meanwhile=other_intent)

    with step_scope(through, run_id, "step"), pytest.raises(StoreUnavailable):
        charge()
    assert relay.fired.wait(10) and applied == []


def test_effect_whose_outcome_reply_was_lost_returns_the_recorded_outcome_on_replay(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    applied: list[str] = []
    mark = f"out-{uuid.uuid4().hex}"

    @effect(name="charge")
    def charge(*, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return mark

    _lose(relay, engine, mark.encode(), txn=True)
    with step_scope(through, run_id, "step"), pytest.raises(StoreUnavailable):
        charge()
    with step_scope(through, run_id, "step"):
        assert charge() == mark
    assert relay.fired.wait(10) and len(applied) == 1


# -- whole runs ----------------------------------------------------------------------


def test_delete_run_retried_after_a_lost_reply(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    direct.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    _lose(relay, engine, run_id.encode(), txn=True)
    try:
        through.delete_run(run_id)
    except StoreUnavailable:
        through.delete_run(run_id)
    assert relay.fired.wait(10)
    assert direct.history(run_id) == [] and direct.branches(run_id) == []


def test_prune_retried_after_a_lost_reply(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    ids = [f"c{n}-{uuid.uuid4().hex}" for n in range(3)]
    for parent, cid in zip([None, *ids], ids, strict=False):
        direct.commit(run_id=run_id, checkpoint_id=cid, parent_id=parent, state=b"s")
    _lose(relay, engine, ids[0].encode(), txn=True)
    try:
        through.prune([run_id])
    except StoreUnavailable:
        through.prune([run_id])
    assert relay.fired.wait(10)
    assert [r.checkpoint_id for r in direct.history(run_id)] == [ids[2]]


def test_copy_run_retried_after_a_lost_reply(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    direct.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    direct.open_interrupts(run_id, {"approve": b"ask"}, checkpoint_id="c1")
    target = f"{run_id}-copy"
    try:
        _lose(relay, engine, target.encode(), txn=True)
        try:
            through.copy_run(run_id, target)
        except StoreUnavailable:
            through.copy_run(run_id, target)
        assert relay.fired.wait(10)
        head = direct.head(target)
        assert head is not None and head.state == b"s1"
        assert direct.consume(target, "approve", b"yes").value == b"yes"
    finally:
        direct.delete_run(target)


def test_fork_commit_retried_after_a_lost_reply_returns_the_stored_checkpoint(
    engine: str, relay: Relay, remits: tuple[Remit, Remit], run_id: str
) -> None:
    through, direct = remits
    direct.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    direct.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s2")
    cid, token = f"f-{uuid.uuid4().hex}", f"tok-{uuid.uuid4().hex}"
    ask: dict[str, Any] = {
        "run_id": run_id,
        "checkpoint_id": cid,
        "parent_id": "c1",
        "state": b"f",
        "fork_token": token,
    }
    _lose(relay, engine, cid.encode(), txn=False)
    with pytest.raises(StoreUnavailable):
        through.commit(**ask)
    again = through.commit(**ask)
    branch = direct.fork_branch(run_id, token)
    assert branch is not None and (again.branch, branch.head_id) == (branch.branch, cid)
    assert len(direct.branches(run_id)) == 2
