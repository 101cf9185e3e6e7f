"""The 39 cells of CONTRACT.md's conformance matrix, as data.

A cell belongs to a scenario; one run of a scenario judges all of its cells.
`racy` scenarios are the ones whose outcome depends on timing (repeated by
`--repeat`); `k` is the number of concurrent resumers of a concurrency cell,
for which the matrix also reports saturation (fired - 1) / (k - 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    """One row of the matrix."""

    id: int
    scenario: str
    fault: str
    checks: str
    passes_when: str
    k: int = 0

    @property
    def concurrent(self) -> bool:
        return self.k > 1


CELLS: tuple[Cell, ...] = (
    Cell(1, "SEQ", "none, resume in same process", "P1", "every step entered once"),
    Cell(2, "SEQ", "none, resume in same process", "P2", "every effect applied once"),
    Cell(3, "SEQ-XPROC", "resume in a new process", "P1", "every step entered once"),
    Cell(4, "SEQ-XPROC", "resume in a new process", "P2", "every effect applied once"),
    Cell(
        5,
        "RESUME-TWICE",
        "second value to a consumed interrupt",
        "P5",
        "rejected with a clear error; nothing persisted",
    ),
    Cell(6, "RESUME-TWICE", "same", "P2", "effects still once"),
    Cell(
        7,
        "RESUME-VALUE",
        "resume, then read state",
        "P5",
        "final state holds exactly the acknowledged value",
    ),
    Cell(
        8,
        "MULTI-INTERRUPT",
        "two interrupts, resumed in turn",
        "P5",
        "each value reaches its own interrupt, once",
    ),
    Cell(
        9,
        "CRASH-BEFORE-EFFECT",
        "SIGKILL in charge before the effect",
        "P1",
        "recovery skips completed steps, runs the rest",
    ),
    Cell(10, "CRASH-BEFORE-EFFECT", "same", "P2", "effects once"),
    Cell(
        11,
        "CRASH-AFTER-EFFECT",
        "SIGKILL after the effect, before charge completes",
        "P2",
        "effect once (reconcile)",
    ),
    Cell(12, "CRASH-AFTER-EFFECT", "same", "P1", "prepare, approve not re-entered"),
    Cell(
        13,
        "CRASH-AFTER-STEP",
        "SIGKILL after charge completes, before the next checkpoint",
        "P2",
        "effect once",
    ),
    Cell(14, "CRASH-AFTER-STEP", "same", "P1", "completed steps not re-entered"),
    Cell(
        15,
        "CRASH-DURING-RESUME",
        "SIGKILL after the resume value is accepted",
        "P5",
        "recovery consumes it once; no second value needed or accepted",
    ),
    Cell(16, "CRASH-DURING-RESUME", "same", "P2", "effects once"),
    Cell(
        17,
        "RECOVER-TWICE",
        "recover two copies of one crashed store",
        "P6",
        "identical final state and effect ledger",
    ),
    Cell(
        18,
        "RECOVER-KILLED",
        "first recovery SIGKILLed midway, second completes",
        "P6",
        "same final state as an uninterrupted run",
    ),
    Cell(
        19,
        "INVALID-STEP-WRITE",
        "a step returns a schema-invalid value",
        "P4",
        "CheckpointInvalid; head unchanged",
    ),
    Cell(
        20,
        "INVALID-EXTERNAL-UPDATE",
        "external state edit with an invalid value",
        "P4",
        "rejected; head unchanged",
    ),
    Cell(
        21,
        "INVALID-RESUME-VALUE",
        "resume value fails its schema",
        "P4",
        "rejected; interrupt still pending and resumable",
    ),
    Cell(
        22,
        "CORRUPT-RECORD",
        "stored checkpoint bytes altered",
        "P4",
        "clear error naming run and checkpoint",
    ),
    Cell(
        23,
        "VERSION-MISMATCH",
        "resumed by another workflow version",
        "P4",
        "refused, or migrated by a registered migration",
    ),
    Cell(
        24,
        "REPLAY-NO-TOKEN",
        "continue from a non-head checkpoint",
        "P3",
        "ForkWithoutIntent; no second branch",
    ),
    Cell(25, "FORK-TOKEN", "same, with a token", "P3", "one new branch; original head intact"),
    Cell(
        26, "FORK-TOKEN-AGAIN", "same token presented twice", "P3", "same branch, identical outputs"
    ),
    Cell(27, "FORK-EFFECTS", "fork after charge", "P2", "shared-prefix effects not re-applied"),
    Cell(
        28,
        "FORK-VS-CONSUME",
        "fork a paused run, resume both",
        "P5",
        "each branch's interrupt consumed once, independently",
    ),
    Cell(
        29,
        "FORK-RACE",
        "two processes fork with one token at once",
        "P3",
        "exactly one branch",
        k=2,
    ),
    Cell(30, "K2-PROC", "2 processes resume at once", "P5", "exactly one proceeds", k=2),
    Cell(31, "K2-PROC", "same", "P2", "effects once", k=2),
    Cell(32, "K4-PROC", "4 processes", "P5", "exactly one proceeds", k=4),
    Cell(33, "K8-PROC", "8 processes", "P5", "exactly one proceeds", k=8),
    Cell(34, "K8-PROC", "same", "P2", "effects once", k=8),
    Cell(35, "K16-PROC", "16 processes", "P5", "exactly one proceeds", k=16),
    Cell(36, "K8-THREADS", "8 threads or tasks in one process", "P5", "exactly one proceeds", k=8),
    Cell(
        37,
        "K8-VALUES",
        "8 processes, 8 different values",
        "P5",
        "final state holds the winner's value; 7 conflicts",
        k=8,
    ),
    Cell(
        38,
        "K8-DEAD-WINNER",
        "winner SIGKILLed after claiming",
        "L1, P2",
        "after lease expiry one other completes; effects once",
        k=8,
    ),
    Cell(
        39,
        "K8-ZOMBIE",
        "winner SIGSTOPped past its lease, then continued",
        "L2, P2",
        "zombie's writes fenced; effects once",
        k=8,
    ),
)

BY_ID: dict[int, Cell] = {c.id: c for c in CELLS}

#: Scenarios in matrix order.
SCENARIOS: tuple[str, ...] = tuple(dict.fromkeys(c.scenario for c in CELLS))

#: Scenarios whose outcome depends on timing, the concurrency and crash cells (every
#: scenario that SIGKILLs a worker, recoveries of a crashed store included): `--repeat N`
#: runs them N times.
RACY: frozenset[str] = frozenset(
    {c.scenario for c in CELLS if c.concurrent}
    | {
        "CRASH-BEFORE-EFFECT",
        "CRASH-AFTER-EFFECT",
        "CRASH-AFTER-STEP",
        "CRASH-DURING-RESUME",
        "RECOVER-TWICE",
        "RECOVER-KILLED",
    }
)


def select(spec: Iterable[str] | None) -> list[Cell]:
    """Cells named by ids ("5"), ranges ("30-35") or scenario names ("K8-PROC"); all if None.

    A selection that names nothing (`--cells ","`) is an error, not "every cell".
    """
    if spec is None:
        return list(CELLS)
    items = [p.strip() for s in spec for p in s.split(",") if p.strip()]
    if not items:
        raise ValueError("--cells names no cell: give ids (5), ranges (30-35) or scenario names")
    chosen: set[int] = set()
    for item in items:
        upper = item.upper()
        if upper in SCENARIOS:
            chosen.update(c.id for c in CELLS if c.scenario == upper)
            continue
        lo, dash, hi = (part.strip() for part in item.partition("-"))
        bounds = (lo, hi) if dash else (lo,)
        if not all(b.isascii() and b.isdigit() for b in bounds):
            raise ValueError(
                f"unknown cell {item!r}: use ids (5), ranges (30-35) or scenario names "
                f"({', '.join(SCENARIOS[:3])}, ...)"
            )
        first, last = int(lo), int(hi if dash else lo)
        if last < first:
            raise ValueError(f"range {item!r} runs backwards: write it {last}-{first}")
        for cell_id in range(first, last + 1):
            if cell_id not in BY_ID:
                raise ValueError(f"no cell {cell_id}: cells are numbered 1 to {len(CELLS)}")
            chosen.add(cell_id)
    return [c for c in CELLS if c.id in chosen]
