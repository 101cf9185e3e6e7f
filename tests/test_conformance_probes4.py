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

from remit_core.conformance import scenarios
from remit_core.conformance.adapter import (
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    RunResult,
    Target,
)
from remit_core.conformance.runner import _aggregate, discover
from remit_core.conformance.scenarios import Context

pytestmark = pytest.mark.slow


def _adapter(framework: str) -> ProbeAdapter:
    adapters, notes = discover([framework])
    assert [a.framework for a in adapters] == [framework], notes
    return adapters[0]


def _run(adapter: ProbeAdapter, spec: str, folder: Path, scenario: str) -> dict[int, Any]:
    ctx = Context(adapter, spec, folder, lease=0.5)
    try:
        return scenarios.RUNNERS[scenario](ctx)
    finally:
        ctx.close()


# -- CRASH-DURING-RESUME: the recovery's effects, not a second value's -----------------


def test_effects_once_must_come_from_the_recovery(tmp_path: Path) -> None:
    """CrewAI's SQLiteFlowPersistence loses the accepted value in the crash: its recovery
    pauses again and charges nothing; a second value then charges once. That used to
    pass cell 16; the effects are now counted when the recovery ends."""
    crewai = _adapter("crewai")
    vanilla = _run(crewai, "vanilla", tmp_path / "vanilla", "CRASH-DURING-RESUME")
    assert not vanilla[15].passed, vanilla[15]
    assert not vanilla[16].passed, vanilla[16]
    assert "after recovery applied charge=0 notify=0" in vanilla[16].measured
    remit = _run(crewai, "sqlite", tmp_path / "remit", "CRASH-DURING-RESUME")
    assert remit[15].passed and remit[16].passed, remit


# -- K2-PROC: a loser must be refused, not acknowledged ------------------------------------


class _SwallowedConflict(ProbeSession):
    """Remit behind a resume that tells a refused resumer "ok" (its value silently lost)."""

    def __init__(self, inner: ProbeSession) -> None:
        self.inner = inner

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        try:
            return self.inner.resume(run, value, branch=branch)
        except Exception as exc:
            if type(exc).__name__ != "ResumeConflict":
                raise
            return RunResult("other", self.inner.inspect(run, branch=branch).state)

    # the abstract operations, passed through
    def start(self, run: str) -> RunResult:
        return self.inner.start(run)

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        return self.inner.recover(run, branch=branch)

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        return self.inner.fork(run, checkpoint, token)

    def edit_state(self, run: str, patch: Any) -> None:
        self.inner.edit_state(run, patch)

    def corrupt_head(self, run: str) -> str:
        return self.inner.corrupt_head(run)

    def inspect(self, run: str, *, branch: str | None = None) -> Any:
        return self.inner.inspect(run, branch=branch)

    def copy_store(self, run: str, dest: Target) -> None:
        self.inner.copy_store(run, dest)

    def close(self) -> None:
        self.inner.close()


class _Wrapped(ProbeAdapter):
    """An adapter whose sessions `wrap` wraps (the framework and store are real)."""

    def __init__(self, inner: ProbeAdapter, wrap: Any) -> None:
        self.inner, self.wrap, self.framework = inner, wrap, inner.framework

    def describe(self, target: Target) -> str:
        return self.inner.describe(target)

    def session(self, target: Target, env: ProbeEnv) -> ProbeSession:
        return self.wrap(self.inner.session(target, env), env)  # type: ignore[no-any-return]


def test_a_loser_acknowledged_without_running_fails_k2(tmp_path: Path) -> None:
    broken = _Wrapped(_adapter("langgraph"), lambda s, env: _SwallowedConflict(s))
    verdicts = _run(broken, "sqlite", tmp_path / "broken", "K2-PROC")
    assert "1 of 2 proceeded, 2 acknowledged" in verdicts[30].measured, verdicts[30]
    assert not verdicts[30].passed  # one proceeding is not enough: the other was told "ok"
    honest = _run(_adapter("langgraph"), "sqlite", tmp_path / "honest", "K2-PROC")
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
    late = _Wrapped(_adapter("crewai"), _staggered)
    verdicts = _run(late, "vanilla", tmp_path / "late", "K2-PROC")
    v30 = verdicts[30]
    assert "1 of 2 proceeded, 1 acknowledged" in v30.measured, v30
    assert not v30.passed and v30.inconclusive, v30
    assert "racers did not overlap (only 1 of 2 racers reached the barrier)" in v30.measured
    result = _aggregate(30, [dataclasses.asdict(v30)])
    assert result.status == "ERROR", result
    monkeypatch.setattr(scenarios, "RACE_BARRIER_TIMEOUT", 60.0)
    together = _run(_adapter("crewai"), "vanilla", tmp_path / "together", "K2-PROC")
    assert not together[30].passed and not together[30].inconclusive, together[30]


# -- FORK-RACE: saturation counts the racers that ran the fork ------------------------------


def test_fork_race_saturation_counts_racers_that_ran(tmp_path: Path) -> None:
    """pydantic-graph's FileStatePersistence has no branches: both racers replay the old
    checkpoint and run charge again. The saturation read 0.00 (from branches); it is 1.00."""
    pg = _adapter("pydantic-graph")
    vanilla = _run(pg, "vanilla", tmp_path / "vanilla", "FORK-RACE")[29]
    assert not vanilla.passed and vanilla.saturation == 1.0, vanilla
    assert "fork run 2 time(s)" in vanilla.measured
    remit = _run(pg, "sqlite", tmp_path / "remit", "FORK-RACE")[29]
    assert remit.passed and remit.saturation == 0.0, remit
