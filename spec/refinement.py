"""The model's actions performed by the real core on a real store, and the mapping back.

`Impl` plays K resumer processes and a fork-making client against
`remit_core.Remit` over one store URL (SQLite, PostgreSQL or Redis): each
model action is one call of the core (a claim, a head read, a consume, a
commit, one operation of the effect protocol `remit_core.effects._protocol`)
or one fault (a crash drops a resumer's memory without releasing anything; a
lease lapses by moving the injected clock). The resumer's next program
counter comes from what the core answered, never from the model.

`abstract()` is the refinement mapping: store rows (branch heads and their
checkpoints, the fork's base, interrupts, claim rows, ledger entries) plus
process memory (each resumer's fence and head copy) plus the effect target's
counts give a `spec.model.State`. `replay` drives a labelled model trace
through `Impl` and compares the two states after every step.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from remit_core import codec, effects
from remit_core.core import ClaimHandle, Remit
from remit_core.errors import (
    CheckpointInvalid,
    EffectInDoubt,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    ResumeConflict,
)
from remit_core.records import MAIN_BRANCH, CheckpointRecord, EffectRecord
from remit_core.stores import open_store
from spec.bfs import Trace
from spec.configs import Config
from spec.model import (
    BAD,
    FORK_TOKEN,
    MAIN,
    STATE_SCHEMA,
    Model,
    State,
    branch_name,
    effect_key,
    final,
)

LEASE = 30.0
INTERRUPT = "approve"
_LABEL = re.compile(r"(\w+)\((-?\d+)\)")


class Divergence(AssertionError):
    """The core and the model disagree after a step."""


class Target:
    """An effect's outside world: counts applications, answers "did key K happen?",
    and ignores a repeated idempotency key where the effect or target deduplicates."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.count: dict[tuple[int, int], int] = {}
        self.keys: set[str] = set()

    def apply(self, b: int, e: int, key: str) -> str:
        dedup = self.cfg.kind[e - 1] == "idempotent" or self.cfg.dedup
        if not (dedup and key in self.keys):
            self.count[(b, e)] = self.count.get((b, e), 0) + 1
        self.keys.add(key)
        return f"done:{key[:8]}"

    def lookup(self, key: str) -> Any:
        return f"done:{key[:8]}" if key in self.keys else effects.NOT_APPLIED


@dataclass
class Proc:
    """One resumer process's memory: what a crash loses."""

    pc: str = "idle"
    handle: ClaimHandle | None = None
    local: CheckpointRecord | None = None
    lpos: int = 0
    lval: int = 0
    gen: Generator[Any, Any, Any] | None = None
    call: Any = None
    op: Any = None

    @property
    def fence(self) -> int:
        return 0 if self.handle is None else self.handle.claim.fence


@dataclass
class History:
    """What no store row records: the fault budget spent and what resumers saw."""

    faults: int = 0
    stale: bool = False
    doubt: dict[int, bool] = field(default_factory=dict)


def _state_bytes(pos: int, val: int) -> bytes:
    return codec.dumps({"pos": pos, "approved_by": val})


def _decode(record: CheckpointRecord) -> tuple[int, int]:
    body = codec.loads(record.state)
    return int(body["pos"]), int(body["approved_by"])


class Impl:
    """K resumers and a client driving the real core for one run of the model's workflow."""

    def __init__(self, cfg: Config, url: str, run_id: str | None = None) -> None:
        self.cfg = cfg
        self.final = final(cfg)
        self.store = open_store(url)
        self.run_id = run_id or f"formal-{uuid.uuid4().hex}"
        self.branches = list(range(1, 2 + cfg.forks))
        # One clock per branch: only that branch's resumers read it, so a lease
        # can lapse on one branch without touching the other's.
        self.clock = {b: 1000.0 for b in self.branches}
        self.remits = [
            Remit(
                self.store,
                lease=LEASE,
                holder=f"{self.run_id}-r{r}",
                clock=self._clock_of(cfg.drive[r - 1]),
            )
            for r in range(1, cfg.resumers + 1)
        ]
        self.client = Remit(
            self.store, lease=LEASE, holder=f"{self.run_id}-client", clock=lambda: self.clock[MAIN]
        )
        self.procs = [Proc() for _ in range(cfg.resumers)]
        self.target = Target(cfg)
        self.history = History(doubt={b: False for b in self.branches})
        self.client.commit(
            run_id=self.run_id,
            checkpoint_id=self._ckpt_id(MAIN_BRANCH, 0),
            parent_id=None,
            state=_state_bytes(0, 0),
        )
        self.client.open_interrupts(self.run_id, {INTERRUPT: None})

    def _clock_of(self, b: int) -> Callable[[], float]:
        return lambda: self.clock[b]

    def _ckpt_id(self, branch: str, pos: int) -> str:
        return f"{self.run_id}/{branch}/{pos}"

    def drive(self, r: int) -> int:
        return self.cfg.drive[r - 1]

    # -- one model action ----------------------------------------------------------
    def apply(self, label: str) -> None:
        """Perform the model action `label` (e.g. "Commit(2)") with the real core."""
        m = _LABEL.fullmatch(label)
        if m is None:
            raise ValueError(f"not a model action: {label!r}")
        name, arg = m.group(1), int(m.group(2))
        if name == "Expire" or name == "ZombieExpire":
            self._lapse(arg)
            self.history.faults += name == "ZombieExpire"
        elif name == "Fork":
            self._fork(arg)
        elif name == "Crash":
            self.procs[arg - 1] = Proc()
            self.history.faults += 1
        elif name == "BadWrite":
            self.history.faults += 1
            self._commit(arg, BAD)
        else:
            got = self._step(arg)
            if got != name:
                raise Divergence(f"{label}: the core's resumer {arg} took {got} instead")

    def _lapse(self, b: int) -> None:
        claim = self.store.get_claim(self.run_id, branch_name(b))
        assert claim is not None
        self.clock[b] = max(self.clock[b], claim.expires_at)

    def _fork(self, p: int) -> None:
        fork = self.client.fork(self.run_id, self._ckpt_id(MAIN_BRANCH, p), FORK_TOKEN)
        if p == 0:
            self.client.open_interrupts(self.run_id, {INTERRUPT: None}, branch=fork.branch)

    def _step(self, r: int) -> str:
        """Resumer r's next move; returns the model action it amounted to."""
        proc, remit, b = self.procs[r - 1], self.remits[r - 1], self.drive(r)
        pc = proc.pc
        if pc == "idle":
            try:
                proc.handle = remit.claim(self.run_id, branch_name(b), heartbeat=False)
                proc.pc = "read"
            except ResumeConflict:
                proc.pc = "lost"
            return "Claim"
        if pc == "read":
            head = remit.head(self.run_id, branch=branch_name(b))
            assert head is not None
            proc.local = head
            proc.lpos, proc.lval = _decode(head)
            proc.pc = (
                "release" if proc.lpos == self.final else "consume" if proc.lpos == 0 else "effect"
            )
            return "Read"
        if pc == "consume":
            self._consume(r)
            return "Consume"
        if pc == "commit":
            self._commit(r, proc.lval)
            return "Commit"
        if pc == "effect":
            self._effect_start(r)
            return "Effect"
        if pc in ("begin", "apply", "reconcile", "finish"):
            self._effect_op(r)
            return pc.capitalize()
        if pc == "release":
            assert proc.handle is not None
            proc.handle.release()
            self.procs[r - 1] = Proc(pc="done")
            return "Release"
        if pc == "lost":
            proc.pc = "idle"
            return "Retry"
        raise Divergence(f"resumer {r} in {pc!r} has no next step")

    def _abort(self, r: int, pc: str = "lost") -> None:
        proc = self.procs[r - 1]
        if proc.handle is not None:
            proc.handle.release()
        self.procs[r - 1] = Proc(pc=pc)

    def _note_write(self, r: int) -> None:
        """A fenced write went through: record whether its fence was still current."""
        proc = self.procs[r - 1]
        claim = self.store.get_claim(self.run_id, branch_name(self.drive(r)))
        self.history.stale |= claim is None or claim.fence != proc.fence

    def _consume(self, r: int) -> None:
        proc, remit, b = self.procs[r - 1], self.remits[r - 1], self.drive(r)
        assert proc.handle is not None
        try:
            record = remit.consume(
                self.run_id,
                INTERRUPT,
                codec.dumps(r),
                branch=branch_name(b),
                fence=proc.handle.fence,
            )
            self._note_write(r)
        except Fenced:
            self._abort(r)
            return
        except ResumeConflict:
            recorded = remit.interrupt(self.run_id, INTERRUPT, branch=branch_name(b))
            assert recorded is not None
            record = recorded
        assert record.value is not None
        proc.lval = int(codec.loads(record.value))
        proc.pc = "commit"

    def _commit(self, r: int, val: int) -> None:
        proc, remit, b = self.procs[r - 1], self.remits[r - 1], self.drive(r)
        assert proc.handle is not None and proc.local is not None
        pos = proc.lpos + 1
        token = FORK_TOKEN if b != MAIN else None
        try:
            STATE_SCHEMA.validate({"pos": pos, "approved_by": val}, run_id=self.run_id)
            plan = remit.plan(self.run_id, proc.local.checkpoint_id, fork_token=token)
            record = remit.commit(
                run_id=self.run_id,
                checkpoint_id=self._ckpt_id(plan.branch, pos),
                parent_id=proc.local.checkpoint_id,
                state=_state_bytes(pos, val),
                fork_token=token,
                fence=proc.handle.fence,
                plan=plan,
            )
        except (CheckpointInvalid, ForkWithoutIntent, HeadMoved, Fenced):
            self._abort(r)
            return
        self._note_write(r)
        proc.local, proc.lpos, proc.lval = record, pos, val
        proc.pc = "release" if pos == self.final else "effect"

    def _effect_start(self, r: int) -> None:
        proc, b = self.procs[r - 1], self.drive(r)
        e = proc.lpos
        scope = effects.StepScope(
            self.remits[r - 1], self.run_id, f"step{e}", proc.handle.fence if proc.handle else None
        )
        proc.call = effects._Call(scope, effect_key(b, e))
        kind = self.cfg.kind[e - 1]
        proc.gen = effects._protocol(
            self.run_id,
            proc.call.key,
            has_reconcile=kind == "reconcile",
            idempotent=kind == "idempotent",
        )
        get = next(proc.gen)
        self._advance(r, proc.call.store_op(get))

    def _effect_op(self, r: int) -> None:
        """Perform the pending operation of r's effect protocol and feed back its result."""
        proc, b = self.procs[r - 1], self.drive(r)
        op, e = proc.op, proc.lpos
        if isinstance(op, effects._Apply):
            result = self.target.apply(b, e, proc.call.idem)
        elif isinstance(op, effects._Reconcile):
            result = self.target.lookup(proc.call.idem)
        else:
            try:
                result = proc.call.store_op(op)
            except Fenced:
                self._abort(r)
                return
            self._note_write(r)
        self._advance(r, result)

    def _advance(self, r: int, result: Any) -> None:
        proc = self.procs[r - 1]
        assert proc.gen is not None
        try:
            proc.op = proc.gen.send(result)
            while isinstance(proc.op, effects._Settle | effects._Adopt):
                if isinstance(proc.op, effects._Adopt):
                    proc.op = proc.gen.send(_adopted(proc.op.entry))
                else:
                    proc.op = proc.gen.send(_settled(proc.call, proc.op.entry))
        except StopIteration:
            proc.gen = proc.call = proc.op = None
            proc.pc = "commit"
            return
        except EffectInDoubt:
            self.history.doubt[self.drive(r)] = True
            self._abort(r, "halted")
            return
        proc.pc = {
            effects._Begin: "begin",
            effects._Apply: "apply",
            effects._Reconcile: "reconcile",
            effects._Finish: "finish",
        }[type(proc.op)]

    # -- the refinement mapping ------------------------------------------------------
    def abstract(self) -> State:
        """Store rows + process memory + the target's counts, as a model state."""
        hpos, hval, base, intr = [], [], [], []
        c_holder, c_fence, c_lapsed = [], [], []
        for b in self.branches:
            name = branch_name(b)
            row = self.store.get_branch(self.run_id, "", name)
            if row is None or row.head_id is None:
                hpos.append(0)
                hval.append(0)
                base.append(-1)
            else:
                head = self.client.checkpoint(self.run_id, row.head_id)
                assert head is not None
                p, v = _decode(head)
                hpos.append(p)
                hval.append(v)
                if row.base_id is None:
                    base.append(0)
                else:
                    base_ckpt = self.client.checkpoint(self.run_id, row.base_id)
                    assert base_ckpt is not None
                    base.append(_decode(base_ckpt)[0])
            it = self.client.interrupt(self.run_id, INTERRUPT, branch=name)
            if it is None:
                intr.append(-1)
            elif it.status == "pending":
                intr.append(0)
            else:
                assert it.value is not None
                intr.append(int(codec.loads(it.value)))
            claim = self.store.get_claim(self.run_id, name)
            if claim is None:
                c_holder.append(0)
                c_fence.append(0)
                c_lapsed.append(True)
            else:
                c_holder.append(self._resumer_of(claim.holder))
                c_fence.append(claim.fence)
                c_lapsed.append(claim.expires_at <= self.clock[b])
        ledger = tuple(
            tuple(self._ledger(b, e) for e in range(1, self.cfg.effects + 1)) for b in self.branches
        )
        applied = tuple(
            tuple(self.target.count.get((b, e), 0) for e in range(1, self.cfg.effects + 1))
            for b in self.branches
        )
        stray = any(
            br.fork_token is None and br.branch != MAIN_BRANCH
            for br in self.store.list_branches(self.run_id, None)
        )
        return State(
            pc=tuple(p.pc for p in self.procs),
            fence=tuple(p.fence for p in self.procs),
            lpos=tuple(p.lpos for p in self.procs),
            lval=tuple(p.lval for p in self.procs),
            seen=(0,) * self.cfg.resumers,
            hpos=tuple(hpos),
            hval=tuple(hval),
            base=tuple(base),
            intr=tuple(intr),
            c_holder=tuple(c_holder),
            c_fence=tuple(c_fence),
            c_lapsed=tuple(c_lapsed),
            ledger=ledger,
            applied=applied,
            doubt=tuple(self.history.doubt[b] for b in self.branches),
            faults=self.history.faults,
            stale=self.history.stale,
            stray=stray,
        )

    def _resumer_of(self, holder: str) -> int:
        if holder == "":
            return 0
        m = re.fullmatch(re.escape(self.run_id) + r"-r(\d+)/.*", holder)
        if m is None:
            raise Divergence(f"claim held by {holder!r}, no resumer of this run")
        return int(m.group(1))

    def _ledger(self, b: int, e: int) -> str:
        entry = self.store.get_effect(self.run_id, effect_key(b, e))
        return "none" if entry is None else entry.status

    def cleanup(self) -> None:
        """Delete the run's rows (servers are shared: every run id is unique anyway)."""
        self.store.delete_run(self.run_id)


def _diff(got: State, want: State) -> str:
    return ", ".join(
        f"{f}: core {getattr(got, f)!r} != model {getattr(want, f)!r}"
        for f in State._fields
        if getattr(got, f) != getattr(want, f)
    )


def replay(cfg: Config, trace: Trace, url: str) -> int:
    """Replay a labelled model trace on the real core, comparing states after every step.

    Returns the number of steps replayed; raises `Divergence` at the first difference.
    """
    impl = Impl(cfg, url)
    try:
        got = impl.abstract()
        if got != trace[0][1]:
            raise Divergence("initial states differ: " + _diff(got, trace[0][1]))
        for n, (label, want) in enumerate(trace[1:], 1):
            impl.apply(label)
            got = impl.abstract()
            if got != want:
                raise Divergence(f"step {n} {label}: " + _diff(got, want))
        return len(trace) - 1
    finally:
        impl.cleanup()


ENVIRONMENT = ("Crash", "BadWrite", "Expire", "ZombieExpire", "Fork")


def schedule_replay(cfg: Config, labels: list[str], url: str) -> tuple[State, list[str]]:
    """Replay the schedule of a (buggy model's) counterexample on the correct model and
    the real core in lock-step.

    A resumer's action label means "resumer r takes its next step", whatever the
    correct protocol makes that step; a fault or client action is taken where
    the correct model allows it. Returns the final (core) state and the labels
    actually performed; raises `Divergence` if core and model disagree.
    """
    model = Model(cfg)
    impl = Impl(cfg, url)
    done: list[str] = []
    try:
        s = impl.abstract()
        for label in labels:
            name, arg = _LABEL.fullmatch(label).groups()  # type: ignore[union-attr]
            options = dict(model.successors(s))
            take: str | None = label
            if name not in ENVIRONMENT:
                step = model.step(s, int(arg))
                take = None if step is None else f"{step[0]}({arg})"
            if take is None or take not in options:
                continue
            impl.apply(take)
            got = impl.abstract()
            if got != options[take]:
                raise Divergence(f"{take}: " + _diff(got, options[take]))
            s = got
            done.append(take)
        return s, done
    finally:
        impl.cleanup()


def settle(cfg: Config, labels: list[str], url: str, *, max_steps: int = 400) -> State:
    """Replay `labels` (a schedule), then let only fair actions run (every resumer
    steps, leases of dead holders lapse) until nothing is enabled; returns the
    core's final state. Shows on the real core what the liveness property claims."""
    model = Model(cfg)
    impl = Impl(cfg, url)
    try:
        s = impl.abstract()
        for label in labels:
            options = dict(model.successors(s))
            if label in options:
                impl.apply(label)
                s = impl.abstract()
        for _ in range(max_steps):
            fair = [
                (lab, t)
                for lab, t in model.successors(s)
                if not lab.startswith(("Crash", "BadWrite", "ZombieExpire", "Fork"))
            ]
            if not fair:
                return s
            label, want = fair[0]
            impl.apply(label)
            s = impl.abstract()
            if s != want:
                raise Divergence(f"{label}: " + _diff(s, want))
        raise Divergence(f"no quiescence after {max_steps} fair steps")
    finally:
        impl.cleanup()


def _adopted(entry: EffectRecord) -> tuple[EffectRecord, bool]:
    """An intent in doubt adopted before it is reconciled or re-applied (`effects._Adopt`),
    as no step of the model: adoption moves only the claim an intent was recorded under,
    which the model does not hold, and no other caller of the model adopts it first
    (each branch keys effects of its own, under the branch's one claim). Like the in-doubt
    apply's re-read, its fenced write is left out: the model's zombie reconciles and
    applies, and is refused at its next fenced write (`Finish`)."""
    return entry, True


def _settled(call: effects._Call | None, entry: EffectRecord) -> EffectRecord | None:
    """An intent told apart, in flight or in doubt (`effects._Settle`), with reads only:
    no step of the model. None of its intents is in flight: each branch keys effects
    of its own, recorded under the branch's one claim, and a resumer that finds one
    holds that claim itself, took it over (a new fence), or was taken over (a zombie,
    whose next fenced write is refused)."""
    assert call is not None
    if not call.may_be_in_flight(entry):
        return entry
    got = effects._next_wait(call.settling(entry))
    assert not isinstance(got, float), "an intent in flight: outside this model"
    return got
