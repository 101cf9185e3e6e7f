"""The transition relation of `Remit.tla`, in Python, deciding with `remit_core.policy`.

A `State` is an immutable tuple of the spec's variables (0-based tuple
positions, the spec's values: resumer ids 1..K, branch ids 1..2, positions,
-1 for "none"). `successors(cfg, s)` yields `(label, state)` for every
disjunct of the spec's `Next` that is enabled in `s`, so a breadth-first
search over it counts exactly the states and transitions TLC counts.

Where the spec encodes a decision of the core, this module asks the core:
`policy.decide_claim` (who may take a claim), `policy.fence_is_current` (the
fence check), `policy.plan_commit` (compare-and-set target, fork tokens,
`ForkWithoutIntent`), `policy.effect_action` (the effect ledger) and
`StateSchema.validate` (the write-time schema). The seeded bugs wrap those
answers the way the spec's `Bug*` constants do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from remit_core import policy
from remit_core.errors import CheckpointInvalid, ForkWithoutIntent, HeadMoved
from remit_core.records import MAIN_BRANCH, BranchRecord, Claim, EffectRecord
from remit_core.schema import StateSchema
from spec.configs import Config

RUN = "model-run"
MAIN = 1
BAD = -1
FORK_TOKEN = "fork-token"
NOW = 1.0
WORKING = frozenset(
    {
        "read",
        "consume",
        "commit",
        "effect",
        "begin",
        "apply",
        "reconcile",
        "finish",
        "release",
        "claimw",
    }
)
#: The probe's state as the schema sees it: a position and the approving value.
STATE_SCHEMA = StateSchema(
    {
        "type": "object",
        "properties": {
            "pos": {"type": "integer", "minimum": 0},
            "approved_by": {"type": "integer", "minimum": 0},
        },
        "required": ["pos", "approved_by"],
    }
)


class State(NamedTuple):
    pc: tuple[str, ...]
    fence: tuple[int, ...]
    lpos: tuple[int, ...]
    lval: tuple[int, ...]
    seen: tuple[int, ...]
    hpos: tuple[int, ...]
    hval: tuple[int, ...]
    base: tuple[int, ...]
    intr: tuple[int, ...]
    c_holder: tuple[int, ...]
    c_fence: tuple[int, ...]
    c_lapsed: tuple[bool, ...]
    ledger: tuple[tuple[str, ...], ...]
    applied: tuple[tuple[int, ...], ...]
    doubt: tuple[bool, ...]
    faults: int
    stale: bool
    stray: bool


#: State field -> the spec's variable name.
TLA_NAMES = {
    f: "".join(p if i == 0 else p.capitalize() for i, p in enumerate(f.split("_")))
    for f in State._fields
}


def from_tla(values: dict[str, Any]) -> State:
    """A state of a TLC trace (variables by their spec names) as a `State`."""
    return State(**{f: values[TLA_NAMES[f]] for f in State._fields})


def init(cfg: Config) -> State:
    k, nb, n = cfg.resumers, 1 + cfg.forks, cfg.effects
    return State(
        pc=("idle",) * k,
        fence=(0,) * k,
        lpos=(0,) * k,
        lval=(0,) * k,
        seen=(0,) * k,
        hpos=(0,) * nb,
        hval=(0,) * nb,
        base=tuple(0 if b == MAIN else -1 for b in range(1, nb + 1)),
        intr=tuple(0 if b == MAIN else -1 for b in range(1, nb + 1)),
        c_holder=(0,) * nb,
        c_fence=(0,) * nb,
        c_lapsed=(True,) * nb,
        ledger=(("none",) * n,) * nb,
        applied=((0,) * n,) * nb,
        doubt=(False,) * nb,
        faults=0,
        stale=False,
        stray=False,
    )


def _set(t: tuple[Any, ...], i: int, v: Any) -> tuple[Any, ...]:
    return t[:i] + (v,) + t[i + 1 :]


def _set2(t: tuple[tuple[Any, ...], ...], i: int, j: int, v: Any) -> tuple[tuple[Any, ...], ...]:
    return _set(t, i, _set(t[i], j, v))


def branch_name(b: int) -> str:
    """The store's name of model branch `b`."""
    return MAIN_BRANCH if b == MAIN else policy.fork_branch_name(FORK_TOKEN)


def effect_key(b: int, e: int) -> str:
    """The ledger key of effect `e` run on branch `b`: the step key a shim would give it."""
    return f"{branch_name(b)}/step{e}/effect#0"


def final(cfg: Config) -> int:
    return cfg.effects + 1


class Model:
    """The transition relation for one configuration."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.final = final(cfg)

    # -- the store's rows as the core's records ------------------------------
    def claim_row(self, s: State, b: int) -> Claim | None:
        if s.c_holder[b - 1] == 0 and s.c_fence[b - 1] == 0:
            return None
        holder = s.c_holder[b - 1]
        return Claim(
            RUN,
            branch_name(b),
            "" if holder == 0 else f"r{holder}",
            s.c_fence[b - 1],
            0.0 if s.c_lapsed[b - 1] else NOW + 1,
        )

    def free(self, s: State, r: int) -> bool:
        decision = policy.decide_claim(self.claim_row(s, self.drive(r)), f"r{r}/fresh", NOW)
        assert decision != "keep", "a claim() call always presents a fresh holder"
        return decision == "grant_new"

    def can_write(self, s: State, r: int) -> bool:
        if self.cfg.bug("no_fencing"):
            return True
        return policy.fence_is_current(self.claim_row(s, self.drive(r)), s.fence[r - 1], f"r{r}")

    def stale_now(self, s: State, r: int) -> bool:
        return s.fence[r - 1] != s.c_fence[self.drive(r) - 1]

    def drive(self, r: int) -> int:
        return self.cfg.drive[r - 1]

    def exists(self, s: State, b: int) -> bool:
        return b == MAIN or s.base[b - 1] >= 0

    def settled(self, s: State, b: int) -> bool:
        return s.hpos[b - 1] == self.final or s.doubt[b - 1]

    @staticmethod
    def ckpt_id(b: int, pos: int) -> str:
        return f"{b}:{pos}"

    def head_id(self, s: State, b: int) -> str:
        if b == MAIN or s.hpos[b - 1] == s.base[b - 1]:
            return self.ckpt_id(MAIN, s.hpos[b - 1])
        return self.ckpt_id(b, s.hpos[b - 1])

    def local_id(self, s: State, r: int) -> str:
        b = self.drive(r)
        if b == MAIN or s.lpos[r - 1] == s.base[b - 1]:
            return self.ckpt_id(MAIN, s.lpos[r - 1])
        return self.ckpt_id(b, s.lpos[r - 1])

    def branch_rows(self, s: State) -> list[BranchRecord]:
        rows = [BranchRecord(RUN, MAIN_BRANCH, self.head_id(s, MAIN), created_at=0.0)]
        if self.cfg.forks and s.base[1] >= 0:
            rows.append(
                BranchRecord(
                    RUN,
                    branch_name(2),
                    self.head_id(s, 2),
                    base_id=self.ckpt_id(MAIN, s.base[1]),
                    fork_token=FORK_TOKEN,
                    created_at=1.0,
                )
            )
        return rows

    def target(self, s: State, r: int) -> int:
        """plan_commit of r's local head: the branch it would CAS, or 0 when refused."""
        token = FORK_TOKEN if self.drive(r) != MAIN else None
        try:
            plan = policy.plan_commit(
                RUN, "", self.local_id(s, r), self.branch_rows(s), fork_token=token, now=NOW
            )
        except (ForkWithoutIntent, HeadMoved):
            return 0
        if plan.fork is not None:
            return 0  # Remit.commit: create_branch returns the token's branch -> HeadMoved
        return MAIN if plan.branch == MAIN_BRANCH else 2

    def action(self, s: State, b: int, e: int) -> str:
        st = s.ledger[b - 1][e - 1]
        if st == "intent" and self.cfg.bug("blind_refire"):
            return "reapply"
        entry = None
        if st != "none":
            entry = EffectRecord(RUN, effect_key(b, e), "k", "done" if st == "done" else "intent")
        kind = self.cfg.kind[e - 1]
        return policy.effect_action(
            entry, has_reconcile=kind == "reconcile", idempotent=kind == "idempotent"
        )

    def valid(self, pos: int, val: int) -> bool:
        if self.cfg.bug("no_validation"):
            return True
        try:
            STATE_SCHEMA.validate({"pos": pos, "approved_by": val})
        except CheckpointInvalid:
            return False
        return True

    # -- pieces of actions ---------------------------------------------------
    def _go(self, s: State, r: int, pc: str, **kw: Any) -> State:
        return s._replace(pc=_set(s.pc, r - 1, pc), **kw)

    def _released(self, s: State, r: int) -> dict[str, Any]:
        b = self.drive(r)
        if s.c_holder[b - 1] == r and s.c_fence[b - 1] == s.fence[r - 1]:
            return {
                "c_holder": _set(s.c_holder, b - 1, 0),
                "c_lapsed": _set(s.c_lapsed, b - 1, True),
            }
        return {}

    def _abort(self, s: State, r: int, pc: str = "lost", **kw: Any) -> State:
        """LetGo: release the claim if still ours, and forget what was read."""
        i = r - 1
        return self._go(
            s,
            r,
            pc,
            fence=_set(s.fence, i, 0),
            lpos=_set(s.lpos, i, 0),
            lval=_set(s.lval, i, 0),
            **self._released(s, r),
            **kw,
        )

    def _decide(self, s: State, r: int, e: int, **kw: Any) -> State:
        a = self.action(s, self.drive(r), e)
        if a == "in_doubt":
            b = self.drive(r)
            return self._abort(s, r, "halted", doubt=_set(s.doubt, b - 1, True), **kw)
        nxt = {
            "apply": "begin",
            "return_recorded": "commit",
            "reconcile": "reconcile",
            "reapply": "apply",
        }[a]
        return self._go(s, r, nxt, **kw)

    def _commit(self, s: State, r: int, v: int, **kw: Any) -> State:
        t = self.target(s, r)
        if t == 0:
            stray = s.stray or (self.cfg.bug("fork_no_token") and self.drive(r) == MAIN)
            return self._abort(s, r, stray=stray, **kw)
        if not self.can_write(s, r):
            return self._abort(s, r, **kw)
        p = s.lpos[r - 1] + 1
        return self._go(
            s,
            r,
            "release" if p == self.final else "effect",
            hpos=_set(s.hpos, t - 1, p),
            hval=_set(s.hval, t - 1, v),
            lpos=_set(s.lpos, r - 1, p),
            lval=_set(s.lval, r - 1, v),
            stale=s.stale or self.stale_now(s, r),
            **kw,
        )

    # -- Step(r): the resumer's next move (deterministic) -----------------------
    def step(self, s: State, r: int) -> tuple[str, State] | None:
        pc, b = s.pc[r - 1], self.drive(r)
        i = r - 1
        if pc == "idle":
            if not self.exists(s, b):
                return None
            if not self.free(s, r):
                return "Claim", self._go(s, r, "lost")
            f = s.c_fence[b - 1]
            if self.cfg.bug("non_atomic_claim"):
                return "Claim", self._go(s, r, "claimw", seen=_set(s.seen, i, f))
            return "Claim", self._grant(s, r, f + 1)
        if pc == "claimw":
            return "ClaimWrite", self._grant(s, r, s.seen[i] + 1, seen=_set(s.seen, i, 0))
        if pc == "read":
            h = s.hpos[b - 1]
            nxt = "release" if h == self.final else "consume" if h == 0 else "effect"
            return "Read", self._go(
                s, r, nxt, lpos=_set(s.lpos, i, h), lval=_set(s.lval, i, s.hval[b - 1])
            )
        if pc == "consume":
            if not self.can_write(s, r):
                return "Consume", self._abort(s, r)
            if s.intr[b - 1] == 0:
                return "Consume", self._go(
                    s,
                    r,
                    "commit",
                    intr=_set(s.intr, b - 1, r),
                    lval=_set(s.lval, i, r),
                    stale=s.stale or self.stale_now(s, r),
                )
            return "Consume", self._go(s, r, "commit", lval=_set(s.lval, i, s.intr[b - 1]))
        if pc == "commit":
            return "Commit", self._commit(s, r, s.lval[i])
        e = s.lpos[i]
        if pc == "effect":
            return "Effect", self._decide(s, r, e)
        if pc == "begin":
            if not self.can_write(s, r):
                return "Begin", self._abort(s, r)
            if s.ledger[b - 1][e - 1] == "none":
                return "Begin", self._go(
                    s,
                    r,
                    "apply",
                    ledger=_set2(s.ledger, b - 1, e - 1, "intent"),
                    stale=s.stale or self.stale_now(s, r),
                )
            return "Begin", self._decide(s, r, e)
        if pc == "apply":
            n = s.applied[b - 1][e - 1]
            dedup = self.cfg.kind[e - 1] == "idempotent" or self.cfg.dedup
            applied = s.applied if dedup and n >= 1 else _set2(s.applied, b - 1, e - 1, n + 1)
            return "Apply", self._go(s, r, "finish", applied=applied)
        if pc == "reconcile":
            happened = s.applied[b - 1][e - 1] >= 1
            return "Reconcile", self._go(s, r, "finish" if happened else "apply")
        if pc == "finish":
            if not self.can_write(s, r):
                return "Finish", self._abort(s, r)
            return "Finish", self._go(
                s,
                r,
                "commit",
                ledger=_set2(s.ledger, b - 1, e - 1, "done"),
                stale=s.stale or self.stale_now(s, r),
            )
        if pc == "release":
            return "Release", self._abort(s, r, "done")
        if pc == "lost" and self.free(s, r) and not self.settled(s, b):
            return "Retry", self._go(s, r, "idle")
        return None

    def _grant(self, s: State, r: int, f: int, **kw: Any) -> State:
        b = self.drive(r)
        return self._go(
            s,
            r,
            "read",
            c_holder=_set(s.c_holder, b - 1, r),
            c_fence=_set(s.c_fence, b - 1, f),
            c_lapsed=_set(s.c_lapsed, b - 1, False),
            fence=_set(s.fence, r - 1, f),
            **kw,
        )

    # -- Next ------------------------------------------------------------------
    def successors(self, s: State) -> Iterator[tuple[str, State]]:
        cfg = self.cfg
        budget = s.faults < cfg.max_faults
        for r in range(1, cfg.resumers + 1):
            moved = self.step(s, r)
            if moved is not None:
                yield f"{moved[0]}({r})", moved[1]
            if budget and s.pc[r - 1] in WORKING:
                i = r - 1
                yield (
                    f"Crash({r})",
                    s._replace(
                        pc=_set(s.pc, i, "idle"),
                        fence=_set(s.fence, i, 0),
                        lpos=_set(s.lpos, i, 0),
                        lval=_set(s.lval, i, 0),
                        seen=_set(s.seen, i, 0),
                        faults=s.faults + 1,
                    ),
                )
            if cfg.bad_writes and budget and s.pc[r - 1] == "commit":
                t = s._replace(faults=s.faults + 1)
                if self.valid(s.lpos[r - 1] + 1, BAD):
                    yield f"BadWrite({r})", self._commit(t, r, BAD)
                else:
                    yield f"BadWrite({r})", self._abort(t, r)
        for b in range(1, 2 + cfg.forks):
            holder = s.c_holder[b - 1]
            if holder == 0 or s.c_lapsed[b - 1]:
                continue
            lapsed = _set(s.c_lapsed, b - 1, True)
            running = s.fence[holder - 1] == s.c_fence[b - 1]
            if not running and not cfg.bug("lease_never_lapses"):
                yield f"Expire({b})", s._replace(c_lapsed=lapsed)
            if running and cfg.zombies and budget:
                yield f"ZombieExpire({b})", s._replace(c_lapsed=lapsed, faults=s.faults + 1)
        if cfg.forks and s.base[1] == -1:
            for p in sorted({0, s.hpos[0]}):
                yield (
                    f"Fork({p})",
                    s._replace(
                        base=_set(s.base, 1, p),
                        hpos=_set(s.hpos, 1, p),
                        hval=_set(s.hval, 1, 0 if p == 0 else s.hval[0]),
                        intr=_set(s.intr, 1, 0 if p == 0 else -1),
                    ),
                )

    # -- the contract's invariants ----------------------------------------------
    def invariants(self) -> dict[str, Callable[[State], bool]]:
        """The spec's invariants, by the same names."""
        cfg, k = self.cfg, self.cfg.resumers
        branches = range(1, 2 + cfg.forks)
        effects = range(1, cfg.effects + 1)

        def holding(s: State, r: int) -> bool:
            return s.pc[r - 1] in WORKING and s.fence[r - 1] != 0

        def current(s: State, r: int) -> bool:
            b = self.drive(r)
            return holding(s, r) and s.c_holder[b - 1] == r and s.c_fence[b - 1] == s.fence[r - 1]

        def runs_on(s: State, b: int, e: int) -> bool:
            return self.exists(s, b) and e >= s.base[b - 1]

        def ack(s: State, b: int) -> int:
            return s.intr[0] if b != MAIN and s.base[b - 1] > 0 else s.intr[b - 1]

        return {
            "NoRework": lambda s: all(
                s.lpos[r - 1] == s.hpos[self.drive(r) - 1]
                for r in range(1, k + 1)
                if current(s, r) and s.pc[r - 1] not in ("read", "claimw")
            ),
            "EffectOnce": lambda s: all(n <= 1 for row in s.applied for n in row),
            "LedgerTruthful": lambda s: all(
                s.applied[b - 1][e - 1] >= 1
                for b in branches
                for e in effects
                if s.ledger[b - 1][e - 1] == "done"
            ),
            "ForkPrefixKept": lambda s: all(
                s.ledger[b - 1][e - 1] == "none" and s.applied[b - 1][e - 1] == 0
                for b in branches
                for e in effects
                if not runs_on(s, b, e)
            ),
            "ForkNeedsToken": lambda s: not s.stray,
            "CheckpointValid": lambda s: all(v != BAD for v in s.hval),
            "OneHolder": lambda s: all(
                s.fence[r1 - 1] != s.fence[r2 - 1]
                for r1 in range(1, k + 1)
                for r2 in range(r1 + 1, k + 1)
                if self.drive(r1) == self.drive(r2) and holding(s, r1) and holding(s, r2)
            ),
            "AckedValue": lambda s: all(
                s.hval[b - 1] == ack(s, b) and s.hval[b - 1] > 0
                for b in branches
                if self.exists(s, b) and s.hpos[b - 1] >= 1
            ),
            "RecoveryDeterminism": lambda s: all(
                s.ledger[b - 1][e - 1] == "done" and s.applied[b - 1][e - 1] == 1
                for b in branches
                if s.hpos[b - 1] == self.final
                for e in effects
                if runs_on(s, b, e)
            ),
            "FencedWrites": lambda s: not s.stale,
            "OwnInterrupts": lambda s: all(
                self.drive(v) == b for b, v in enumerate(s.intr, 1) if v > 0
            ),
        }

    def action_properties(self) -> dict[str, Callable[[State, State], bool]]:
        """The spec's [][A]_v properties, checked on every transition."""
        nb = 1 + self.cfg.forks
        return {
            "HeadAdvances": lambda s, t: all(
                t.hpos[b] in (s.hpos[b], s.hpos[b] + 1) for b in range(nb) if self.exists(s, b + 1)
            ),
            "ConsumeOnce": lambda s, t: all(
                t.intr[b] == s.intr[b] for b in range(nb) if s.intr[b] > 0
            ),
        }
