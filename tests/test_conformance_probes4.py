"""The matrix's cells check what CONTRACT.md says, on real processes and real stores.

Each case runs one scenario of the harness against a framework's own backend,
or against Remit behind an adapter deliberately broken the way a backend could
be, and shows that the cell no longer passes it:

- CRASH-DURING-RESUME (16): effects counted once only because a *second* value
  was taken after a recovery that lost the first is not "effects once".
- K2-PROC (30): a loser told "ok" without running lost its value (P5: the
  others get ResumeConflict), so one proceeding is not enough.
- K2-PROC (30): a race whose racers were not in flight together is no PASS,
  whatever it measured (the backend had no claim; timing kept it single).
- FORK-RACE (29): saturation counts the racers that ran the fork, not branches.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conformance_parts import Passthrough, Wrapped, adapter, run_scenario

from remit_core.conformance import scenarios
from remit_core.conformance.adapter import ProbeEnv, ProbeSession, RunResult
from remit_core.conformance.runner import _aggregate

pytestmark = pytest.mark.slow


# -- CRASH-DURING-RESUME: the recovery's effects, not a second value's -----------------


def test_effects_once_must_come_from_the_recovery(tmp_path: Path) -> None:
    """CrewAI's SQLiteFlowPersistence loses the accepted value in the crash: its recovery
    pauses again and charges nothing; a second value then charges once. That used to
    pass cell 16; the effects are now counted when the recovery ends."""
    crewai = adapter("crewai")
    vanilla = run_scenario(crewai, "vanilla", tmp_path / "vanilla", "CRASH-DURING-RESUME")
    assert not vanilla[15].passed, vanilla[15]
    assert not vanilla[16].passed, vanilla[16]
    assert "after recovery applied charge=0 notify=0" in vanilla[16].measured
    remit = run_scenario(crewai, "sqlite", tmp_path / "remit", "CRASH-DURING-RESUME")
    assert remit[15].passed and remit[16].passed, remit


# -- K2-PROC: a loser must be refused, not acknowledged ------------------------------------


class _SwallowedConflict(Passthrough):
    """Remit behind a resume that tells a refused resumer "ok" (its value silently lost)."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        try:
            return self.inner.resume(run, value, branch=branch)
        except Exception as exc:
            if type(exc).__name__ != "ResumeConflict":
                raise
            return RunResult("other", self.inner.inspect(run, branch=branch).state)


def test_a_loser_acknowledged_without_running_fails_k2(tmp_path: Path) -> None:
    broken = Wrapped(adapter("langgraph"), _SwallowedConflict)
    verdicts = run_scenario(broken, "sqlite", tmp_path / "broken", "K2-PROC")
    assert "1 of 2 proceeded, 2 acknowledged" in verdicts[30].measured, verdicts[30]
    assert not verdicts[30].passed  # one proceeding is not enough: the other was told "ok"
    honest = run_scenario(adapter("langgraph"), "sqlite", tmp_path / "honest", "K2-PROC")
    assert honest[30].passed and honest[31].passed, honest


# -- K2-PROC: racers that were not in flight together prove nothing -----------------------


def _staggered(session: ProbeSession, env: ProbeEnv) -> ProbeSession:
    """Sessions after the first two (the start's, the first racer's) open 2 s late."""
    index = 0
    while True:
        try:
            os.close(os.open(env.folder / f"session-{index}", os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            index += 1
    if index >= 2:
        time.sleep(2.0)
    return session


def test_a_race_whose_racers_did_not_overlap_is_no_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CrewAI's SQLiteFlowPersistence has no claim: two racers together both proceed.
    With the second racer late, the first finishes alone and the late one is refused,
    which reads "1 of 2 proceeded, 1 acknowledged", a PASS by timing luck before."""
    monkeypatch.setattr(scenarios, "RACE_BARRIER_TIMEOUT", 0.5)
    late = Wrapped(adapter("crewai"), _staggered)
    verdicts = run_scenario(late, "vanilla", tmp_path / "late", "K2-PROC")
    v30 = verdicts[30]
    assert "1 of 2 proceeded, 1 acknowledged" in v30.measured, v30
    assert not v30.passed and v30.inconclusive, v30
    assert "racers did not overlap (only 1 of 2 racers reached the barrier)" in v30.measured
    result = _aggregate(30, [dataclasses.asdict(v30)])
    assert result.status == "ERROR", result
    monkeypatch.setattr(scenarios, "RACE_BARRIER_TIMEOUT", 60.0)
    together = run_scenario(adapter("crewai"), "vanilla", tmp_path / "together", "K2-PROC")
    assert not together[30].passed and not together[30].inconclusive, together[30]


# -- FORK-RACE: saturation counts the racers that ran the fork ------------------------------


def test_fork_race_saturation_counts_racers_that_ran(tmp_path: Path) -> None:
    """pydantic-graph's FileStatePersistence has no branches: both racers replay the old
    checkpoint and run charge again. The saturation read 0.00 (from branches); it is 1.00."""
    pg = adapter("pydantic-graph")
    vanilla = run_scenario(pg, "vanilla", tmp_path / "vanilla", "FORK-RACE")[29]
    assert not vanilla.passed and vanilla.saturation == 1.0, vanilla
    assert "fork run 2 time(s)" in vanilla.measured
    remit = run_scenario(pg, "sqlite", tmp_path / "remit", "FORK-RACE")[29]
    assert remit.passed and remit.saturation == 0.0, remit
