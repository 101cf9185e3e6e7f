"""A Hypothesis state machine drives each real store against a small in-memory model.

Random sequences of commits (and lost compare-and-sets), forks with tokens,
claims with an injected clock (acquire, renew, release, expiry), interrupt
opens and consumes, effects that crash before or after applying, and fenced
writes from holders whose claim was taken over. After every step the store
must agree with the model, and the contract's invariants must hold:

- no effect is applied twice to the outside world (the sink);
- a branch head only moves forward, to a child of its previous head;
- a consumed interrupt stays consumed, with its first value;
- fences strictly increase on every takeover;
- a write under a stale fence (taken over, or released) changes nothing.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from remit_core import (
    MAIN_BRANCH,
    NOT_APPLIED,
    Claim,
    EffectInDoubt,
    EffectInFlight,
    Fenced,
    FenceRef,
    ForkWithoutIntent,
    HeadMoved,
    Remit,
    ResumeConflict,
    UnknownRecord,
    WriteRecord,
    effects,
    open_store,
    policy,
    run_effect,
    step_scope,
)
from remit_core.records import CheckpointRecord

LEASE = 10.0
HOLDERS = st.sampled_from(["A", "B", "C"])
MAYBE_HOLDER = st.sampled_from([None, "A", "B", "C"])
INTERRUPTS = st.sampled_from(["i0", "i1", "i2"])
TOKENS = st.sampled_from(["t1", "t2"])
#: Each effect key is declared once, with one recovery mode.
EFFECT_MODES = {"e-reconcile": "reconcile", "e-idempotent": "idempotent", "e-neither": "neither"}
CRASHES = st.sampled_from([None, "before_apply", "after_apply"])


class Crash(Exception):
    """The process 'dies' inside an effect: the ledger is left as it was at that moment."""


@dataclass
class Clock:
    now: float = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ClaimRow:
    holder: str
    fence: int
    expires_at: float


class StoreMachine(RuleBasedStateMachine):
    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.run_id = f"model-{uuid.uuid4().hex}"
        self.clock = Clock()
        self.remit = Remit(open_store(self.url), clock=self.clock)
        self.store = self.remit.store
        self.n = 0
        # the model
        self.parent: dict[str, str | None] = {}
        self.heads: dict[str, str] = {}
        self.token_of: dict[str, str | None] = {}
        self.fork_base: dict[str, str] = {}
        self.row: ClaimRow | None = None
        self.max_fence = 0
        self.views: dict[str, Claim] = {}
        self.interrupts: dict[str, tuple[str, bytes | None]] = {}
        self.effects: dict[str, str] = {}
        #: The claim each intent was recorded under (None: an unfenced caller's).
        self.intent_claims: dict[str, FenceRef | None] = {}
        self.sink: Counter[str] = Counter()
        self.idem: dict[str, str] = {}
        self.writes: dict[tuple[str, int], bytes] = {}

    # -- helpers -------------------------------------------------------------------
    def fence_of(self, holder: str | None) -> FenceRef | None:
        view = self.views.get(holder) if holder else None
        return None if view is None else FenceRef.of(view)

    def stale(self, fence: FenceRef | None) -> bool:
        """Taken over (another fence) or given up (the holder changed)."""
        return fence is not None and (
            self.row is None or self.row.fence != fence.fence or self.row.holder != fence.holder
        )

    def next_id(self) -> str:
        self.n += 1
        return f"c{self.n:03d}"

    # -- checkpoints and forks ---------------------------------------------------------
    @rule(data=st.data(), holder=MAYBE_HOLDER)
    def commit_at_head(self, data: st.DataObject, holder: str | None) -> None:
        if self.heads:
            branch = data.draw(st.sampled_from(sorted(self.heads)))
            parent: str | None = self.heads[branch]
        else:
            branch, parent = MAIN_BRANCH, None
        token = self.token_of.get(branch)
        fence = self.fence_of(holder)
        cid = self.next_id()
        try:
            got = self.remit.commit(
                run_id=self.run_id,
                checkpoint_id=cid,
                parent_id=parent,
                state=cid.encode(),
                fork_token=token,
                fence=fence,
            )
        except Fenced:
            assert self.stale(fence)
            return
        assert not self.stale(fence)
        assert got.branch == branch
        stored = self.store.get_branch(self.run_id, "", branch)
        assert stored is not None and stored.head_id == cid
        # The head moved forward: to a child of the previous head.
        record = self.store.get_checkpoint(self.run_id, "", cid)
        assert record is not None and record.parent_id == parent
        self.parent[cid] = parent
        self.heads[branch] = cid
        self.token_of.setdefault(branch, None)

    @rule(data=st.data())
    def commit_from_non_head_without_token(self, data: st.DataObject) -> None:
        others = sorted(set(self.parent) - set(self.heads.values()))
        if not others:
            return
        parent = data.draw(st.sampled_from(others))
        with pytest.raises(ForkWithoutIntent):
            self.remit.commit(
                run_id=self.run_id, checkpoint_id=self.next_id(), parent_id=parent, state=b"x"
            )

    @rule(data=st.data())
    def lost_compare_and_set(self, data: st.DataObject) -> None:
        if not self.heads:
            return
        branch = data.draw(st.sampled_from(sorted(self.heads)))
        wrong = sorted(set(self.parent) - {self.heads[branch]})
        if not wrong:
            return
        expected = data.draw(st.sampled_from(wrong))
        cid = self.next_id()
        record = CheckpointRecord(self.run_id, cid, branch, expected, b"lost", seq=99)
        with pytest.raises(HeadMoved):
            self.store.commit_checkpoint(record, expected_head=expected)

    @rule(data=st.data(), token=TOKENS)
    def fork(self, data: st.DataObject, token: str) -> None:
        if not self.parent:
            return
        base = data.draw(st.sampled_from(sorted(self.parent)))
        name = policy.fork_branch_name(token)
        if token in self.fork_base and self.fork_base[token] != base:
            with pytest.raises(ForkWithoutIntent):
                self.remit.fork(self.run_id, base, token)
            return
        got = self.remit.fork(self.run_id, base, token)
        assert (got.branch, got.base_id, got.fork_token) == (name, base, token)
        if token not in self.fork_base:
            self.fork_base[token] = base
            self.heads[name] = base
            self.token_of[name] = token
        assert got.head_id == self.heads[name]

    # -- claims ------------------------------------------------------------------------
    @rule(holder=HOLDERS)
    def acquire(self, holder: str) -> None:
        now, row = self.clock.now, self.row
        if row is None or row.holder == "" or row.expires_at <= now:
            expected_fence = (0 if row is None else row.fence) + 1
        elif row.holder == holder:
            expected_fence = row.fence
        else:
            with pytest.raises(ResumeConflict):
                self.store.acquire_claim(self.run_id, MAIN_BRANCH, holder, now=now, lease=LEASE)
            return
        claim = self.store.acquire_claim(self.run_id, MAIN_BRANCH, holder, now=now, lease=LEASE)
        assert (claim.holder, claim.fence, claim.expires_at) == (
            holder,
            expected_fence,
            now + LEASE,
        )
        if row is None or claim.fence != row.fence:
            assert claim.fence > self.max_fence  # fences strictly increase on takeover
        self.max_fence = max(self.max_fence, claim.fence)
        self.row = ClaimRow(holder, claim.fence, now + LEASE)
        self.views[holder] = claim

    @rule(holder=HOLDERS)
    def renew(self, holder: str) -> None:
        view = self.views.get(holder)
        if view is None:
            return
        row, now = self.row, self.clock.now
        if row is not None and (row.holder, row.fence) == (view.holder, view.fence):
            renewed = self.store.renew_claim(view, now=now, lease=LEASE)
            assert (renewed.fence, renewed.expires_at) == (view.fence, now + LEASE)
            row.expires_at = now + LEASE
            self.views[holder] = renewed
        else:
            with pytest.raises(Fenced):
                self.store.renew_claim(view, now=now, lease=LEASE)

    @rule(holder=HOLDERS)
    def release(self, holder: str) -> None:
        view = self.views.get(holder)
        if view is None:
            return
        self.store.release_claim(view)
        row = self.row
        if row is not None and (row.holder, row.fence) == (view.holder, view.fence):
            row.holder, row.expires_at = "", 0.0

    @initialize()
    def first_holder(self) -> None:
        """Start with a claim held, so fenced writes happen from the first step."""
        self.acquire("A")

    @rule(holder=HOLDERS)
    def take_over(self, holder: str) -> None:
        """Let the current lease lapse, then `holder` claims: aimed at stale holders."""
        if self.row is not None:
            self.clock.now = max(self.clock.now, self.row.expires_at)
        self.acquire(holder)

    @rule(seconds=st.sampled_from([1.0, 4.0, 11.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.now += seconds

    # -- step writes ----------------------------------------------------------------------
    @rule(holder=MAYBE_HOLDER, idx=st.integers(0, 2), mode=st.sampled_from(["first", "overwrite"]))
    def put_write(self, holder: str | None, idx: int, mode: str) -> None:
        fence = self.fence_of(holder)
        value = f"{holder}-{self.clock.now}".encode()
        w = WriteRecord(self.run_id, "cw", "task", idx, "chan", value)
        try:
            self.remit.put_writes([w], mode=mode, fence=fence)  # type: ignore[arg-type]
        except Fenced:
            assert self.stale(fence)
            return
        assert not self.stale(fence)
        if mode == "overwrite" or ("task", idx) not in self.writes:
            self.writes["task", idx] = value

    # -- interrupts ------------------------------------------------------------------------
    @rule(interrupt_id=INTERRUPTS)
    def open_interrupt(self, interrupt_id: str) -> None:
        self.remit.open_interrupts(self.run_id, {interrupt_id: b"prompt"})
        self.interrupts.setdefault(interrupt_id, ("pending", None))

    @rule(interrupt_id=INTERRUPTS, holder=MAYBE_HOLDER, value=st.binary(max_size=8))
    def consume(self, interrupt_id: str, holder: str | None, value: bytes) -> None:
        fence = self.fence_of(holder)
        try:
            got = self.remit.consume(self.run_id, interrupt_id, value, fence=fence)
        except Fenced:
            assert self.stale(fence)
            return
        except UnknownRecord:
            assert not self.stale(fence) and interrupt_id not in self.interrupts
            return
        except ResumeConflict:
            assert not self.stale(fence)
            assert self.interrupts[interrupt_id][0] == "consumed"
            return
        assert not self.stale(fence)
        assert self.interrupts.get(interrupt_id) == ("pending", None)
        assert (got.status, got.value) == ("consumed", value)
        self.interrupts[interrupt_id] = ("consumed", value)

    # -- effects ---------------------------------------------------------------------------
    def _apply(self, key: str, idem: str, crash: str | None) -> str:
        assert self.idem.setdefault(key, idem) == idem  # the same key on every attempt
        if crash == "before_apply":
            raise Crash(key)
        if not (EFFECT_MODES[key] == "idempotent" and self.sink[key]):
            self.sink[key] += 1
        if crash == "after_apply":
            raise Crash(key)
        return f"out-{key}"

    def _reconcile(self, key: str) -> Any:
        return f"out-{key}" if self.sink[key] else NOT_APPLIED

    @rule(key=st.sampled_from(sorted(EFFECT_MODES)), holder=MAYBE_HOLDER, crash=CRASHES)
    def run_an_effect(self, key: str, holder: str | None, crash: str | None) -> None:
        mode, entry = EFFECT_MODES[key], self.effects.get(key)
        fence = self.fence_of(holder)
        sink_before = self.sink[key]
        # Another caller's intent whose claim is still held, unexpired: in flight.
        recorded, row = self.intent_claims.get(key), self.row
        in_flight = (
            entry == "intent"
            and recorded is not None
            and recorded != fence
            and not self.stale(fence)  # (a zombie waits for nobody: it is fenced)
            and row is not None
            and (row.holder, row.fence) == (recorded.holder, recorded.fence)
            and row.expires_at > self.clock.now
        )
        try:
            with step_scope(self.remit, self.run_id, "step", fence=fence):
                result = run_effect(
                    key,
                    lambda idem: self._apply(key, idem, crash),
                    key=key,
                    reconcile=(lambda _: self._reconcile(key)) if mode == "reconcile" else None,
                    idempotent=mode == "idempotent",
                )
        except EffectInFlight:
            assert in_flight and self.sink[key] == sink_before
            return
        except Crash:
            assert entry != "done" and not in_flight
            assert entry is not None or not self.stale(fence)
            # Recorded under this caller's claim: its new intent, or one in doubt it
            # adopted before re-applying it.
            self.intent_claims[key] = fence
            self.effects[key] = "intent"
            return
        except Fenced:
            assert self.stale(fence) and entry != "done" and not in_flight
            if entry is None:
                assert self.sink[key] == sink_before  # nothing applied without an intent
            return
        except EffectInDoubt:
            assert entry == "intent" and mode == "neither" and not in_flight
            assert self.sink[key] == sink_before
            return
        assert result == f"out-{key}" and not in_flight
        if entry == "done":
            assert self.sink[key] == sink_before
        else:
            assert not self.stale(fence) and (entry is None or mode != "neither")
            self.effects[key] = "done"

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def branches_match(self) -> None:
        stored = {b.branch: b.head_id for b in self.store.list_branches(self.run_id)}
        assert stored == self.heads
        assert {c.checkpoint_id for c in self.store.list_checkpoints(self.run_id)} == set(
            self.parent
        )

    @invariant()
    def claim_matches(self) -> None:
        got = self.store.get_claim(self.run_id, MAIN_BRANCH)
        if self.row is None:
            assert got is None
        else:
            assert got is not None
            assert (got.holder, got.fence) == (self.row.holder, self.row.fence)
            if self.row.holder:
                assert got.expires_at == self.row.expires_at

    @invariant()
    def interrupts_match(self) -> None:
        stored = {i.interrupt_id: (i.status, i.value) for i in self.remit.interrupts(self.run_id)}
        assert stored == self.interrupts

    @invariant()
    def effects_applied_at_most_once(self) -> None:
        assert all(n <= 1 for n in self.sink.values())
        for key, status in self.effects.items():
            entry = self.store.get_effect(self.run_id, key)
            assert entry is not None and entry.status == status
            if status == "done":
                assert self.sink[key] == 1

    @invariant()
    def writes_match(self) -> None:
        stored = {(w.task_id, w.idx): w.value for w in self.remit.writes(self.run_id, "cw")}
        assert stored == self.writes


def test_store_against_model(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # An effect in flight is refused at once: the model's clock does not move while
    # a caller waits, so waiting would only slow the run down.
    monkeypatch.setattr(effects, "IN_FLIGHT_WAIT", 0.0)
    open_store(store_url)
    StoreMachine.url = store_url
    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
