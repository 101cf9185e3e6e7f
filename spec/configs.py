"""The bounds the model is checked at, shared by TLC (`spec.tlc`) and the Python model.

Each `Config` names the constants of `Remit.tla`. `CONFIGS` holds the named
runs: `ci` and `ci_live` (the CI gate), `counts` (the bounds on which TLC and
the Python model must report the same numbers), `large` (the one-command big
run), `limit_*` (what the contract says it cannot promise) and one `bug_*`
per seeded bug, each with the property TLC must find violated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

BUGS = (
    "non_atomic_claim",
    "blind_refire",
    "fork_no_token",
    "no_validation",
    "no_fencing",
    "lease_never_lapses",
)


@dataclass(frozen=True)
class Config:
    """Constants of one model-checking run (see the header of `Remit.tla`)."""

    resumers: int = 2
    effects: int = 1
    forks: int = 0
    drive: tuple[int, ...] = (1, 1)
    kind: tuple[str, ...] = ("reconcile",)
    max_faults: int = 1
    zombies: bool = False
    dedup: bool = False
    bad_writes: bool = False
    bugs: frozenset[str] = field(default_factory=frozenset)
    liveness: bool = False
    #: The property TLC must report violated (None: everything must hold).
    expect: str | None = None

    def __post_init__(self) -> None:
        if len(self.drive) != self.resumers or len(self.kind) != self.effects:
            raise ValueError("drive needs one branch per resumer and kind one entry per effect")
        if self.forks not in (0, 1) or not set(self.drive) <= set(range(1, 2 + self.forks)):
            raise ValueError("forks is 0 or 1, and every resumer drives an existing branch")
        unknown = set(self.bugs) - set(BUGS)
        if unknown:
            raise ValueError(f"unknown bug switches: {sorted(unknown)}")

    def bug(self, name: str) -> bool:
        return name in self.bugs

    def describe(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "bugs"]
        return ", ".join(parts + [f"bugs={sorted(self.bugs)}"])


_CORRECT = Config(
    resumers=3,
    effects=2,
    forks=1,
    drive=(1, 1, 2),
    kind=("reconcile", "idempotent"),
    max_faults=1,
    zombies=True,
    dedup=True,
    bad_writes=True,
)


def _bug(name: str, expect: str, **bounds: object) -> Config:
    base = Config(resumers=2, drive=(1, 1), max_faults=1)
    return replace(base, bugs=frozenset({name}), expect=expect, **bounds)  # type: ignore[arg-type]


CONFIGS: dict[str, Config] = {
    # Safety of the whole protocol: 2 resumers on main, 1 on a fork, zombies
    # with deduplicating targets, bad writes, one fault.
    "ci": _CORRECT,
    # Liveness (and safety): the same shape with every effect kind, so a run
    # may also end refused in doubt.
    "ci_live": replace(_CORRECT, kind=("reconcile", "plain"), liveness=True),
    # TLC and the Python model must agree on these numbers exactly.
    "counts": Config(
        resumers=2,
        effects=2,
        forks=1,
        drive=(1, 2),
        kind=("reconcile", "idempotent"),
        max_faults=1,
        zombies=True,
        dedup=True,
        bad_writes=True,
    ),
    # The large run: 3 resumers on main and 1 on the fork, 3 faults.
    "large": replace(_CORRECT, resumers=4, drive=(1, 1, 1, 2), max_faults=3),
    # Random walks replayed on the real core: a bigger fault budget than
    # exhaustive search affords, once with each ledger mix.
    "walk_ledger": replace(_CORRECT, max_faults=4),
    "walk_doubt": replace(_CORRECT, kind=("reconcile", "plain"), max_faults=4),
    # The honest limit: a zombie against a target that does not deduplicate.
    "limit_zombie_no_dedup": Config(
        resumers=2, drive=(1, 1), zombies=True, dedup=False, expect="EffectOnce"
    ),
    "bug_non_atomic_claim": _bug("non_atomic_claim", "OneHolder", max_faults=0),
    "bug_blind_refire": _bug("blind_refire", "EffectOnce", kind=("reconcile",)),
    "bug_fork_no_token": _bug("fork_no_token", "ForkNeedsToken", zombies=True, dedup=True),
    "bug_no_validation": _bug("no_validation", "CheckpointValid", bad_writes=True),
    "bug_no_fencing": _bug("no_fencing", "FencedWrites", zombies=True, dedup=True),
    "bug_lease_never_lapses": _bug("lease_never_lapses", "Termination", liveness=True),
}
