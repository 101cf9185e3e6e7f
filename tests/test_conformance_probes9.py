"""Conformance harness probes: backends broken on purpose must not PASS (real frameworks,
real stores, real processes).

- An operation raising `NotApplicable` turned the whole scenario N/A, whenever it
  came: a backend could turn a FAIL into an N/A by declaring N/A only in the bad
  case (after the same operation went through earlier, or after it had run
  steps). Such a late N/A now reads ERROR; an N/A from an operation that never
  went through and left no trace stays N/A.
- FORK-TOKEN-AGAIN (26) and FORK-EFFECTS (27) could not see a fork's steps run
  again under the same idempotency keys: the sink ignores a repeated key, so the
  effect counts stayed at one.
- CRASH-AFTER-EFFECT (11) passed a target that applied the in-doubt charge again
  under its key instead of reconciling it: single only because the sink ignores
  a repeated key.
- RECOVER-KILLED (18) did not check where the first recovery died: one that died
  before it began passed, though no recovery was interrupted midway.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from conformance_parts import Passthrough, Wrapped, adapter, run_scenario

from remit_core.conformance.adapter import NotApplicable, RunResult
from remit_core.conformance.cells import select
from remit_core.conformance.runner import run_matrix
from remit_core.conformance.world import current_resumer

pytestmark = pytest.mark.slow


def _statuses(tmp_path: Path, wrapped: Wrapped, cells: str, spec: str = "sqlite") -> dict[int, Any]:
    matrix = run_matrix([wrapped], [spec], select([cells]), tmp_path, jobs=1, lease=0.5)
    (column,) = matrix.columns
    return {cell: (r.status, r.measured) for cell, r in column.cells.items()}


def _first_time(env: Any, name: str) -> bool:
    """True the first time `name` is asked in this scenario's folder (any process)."""
    try:
        os.close(os.open(Path(env.folder) / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


# -- a late N/A is no N/A ---------------------------------------------------------------


class _RunsAgainThenNotApplicable(Passthrough):
    """The second value is taken and run on (approve entered, charge applied again),
    and then the backend says the scenario cannot be expressed."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        if _first_time(self.env, f"resumed-{run}"):
            return self.inner.resume(run, value, branch=branch)
        self.env.enter("approve")
        self.env.sink.apply("charge")
        raise NotApplicable("a second value cannot be delivered here")


class _RefusalAsNotApplicable(Passthrough):
    """A second value is refused as the store refuses it, but reported as N/A."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        try:
            return self.inner.resume(run, value, branch=branch)
        except Exception as exc:
            raise NotApplicable("a consumed interrupt cannot be resumed") from exc


@pytest.mark.parametrize(
    ("wrap", "why"),
    [
        (_RunsAgainThenNotApplicable, "after it entered approve=1; applied charge=1"),
        (_RefusalAsNotApplicable, "though an earlier resume of this scenario went through"),
    ],
)
def test_an_na_after_the_operation_went_through_is_an_error(
    tmp_path: Path, wrap: Any, why: str
) -> None:
    got = _statuses(tmp_path, Wrapped(adapter("langgraph"), wrap), "5,6")
    assert {cell: status for cell, (status, _) in got.items()} == {5: "ERROR", 6: "ERROR"}, got
    assert "N/A declared too late: resume declared N/A" in got[5][1], got
    assert why in got[5][1], got


class _StartsThenNotApplicable(Passthrough):
    """The run is started for real (prepare entered), then the start says N/A."""

    def start(self, run: str) -> RunResult:
        self.inner.start(run)
        raise NotApplicable("runs cannot be started here")


def test_an_na_after_the_operation_ran_a_step_is_an_error(tmp_path: Path) -> None:
    got = _statuses(tmp_path, Wrapped(adapter("pydantic-graph"), _StartsThenNotApplicable), "1,2")
    assert {cell: status for cell, (status, _) in got.items()} == {1: "ERROR", 2: "ERROR"}, got
    assert (
        "start declared N/A ('runs cannot be started here') after it entered prepare=1"
        in (got[1][1])
    ), got


class _OneRacerNotApplicable(Passthrough):
    """Of two racers forking with one token, the first says N/A; the other forks."""

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        if current_resumer.get() == "r0":
            raise NotApplicable("this fork cannot be expressed")
        return self.inner.fork(run, checkpoint, token)


def test_an_na_from_one_racer_while_another_went_through_is_an_error(tmp_path: Path) -> None:
    got = _statuses(tmp_path, Wrapped(adapter("langgraph"), _OneRacerNotApplicable), "29")
    assert got[29][0] == "ERROR", got
    assert (
        "fork declared N/A ('this fork cannot be expressed') though an earlier fork" in (got[29][1])
    ), got


def test_an_na_from_an_operation_that_never_went_through_stays_na(tmp_path: Path) -> None:
    """CrewAI continues a flow only from its latest state: its fork says so, once."""
    got = _statuses(tmp_path, Wrapped(adapter("crewai"), Passthrough), "25", spec="vanilla")
    assert got[25][0] == "N/A", got
    assert "only from its latest state" in got[25][1], got


# -- a fork run again under the same keys ----------------------------------------------


class _ForkRunAgain(Passthrough):
    """Presenting the same token again returns the same branch, but runs the fork's
    steps again and applies its effects under the keys they had (the sink ignores them)."""

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        before = set(self.env.sink.applications())
        result = self.inner.fork(run, checkpoint, token)
        ran = Path(self.env.folder) / f"fork-applied-{token}.json"
        if not ran.exists():
            applied = [a for a in self.env.sink.applications() if a not in before]
            ran.write_text(json.dumps([[name, key] for name, key, _ in applied]))
            return result
        for name, key in json.loads(ran.read_text()):  # (its steps are named as its effects)
            self.env.enter(name)
            self.env.sink.apply(name, key)
        return result


def test_a_fork_run_again_under_its_keys_fails_26(tmp_path: Path) -> None:
    real = adapter("langgraph")
    again = run_scenario(Wrapped(real, _ForkRunAgain), "sqlite", tmp_path / "a", "FORK-TOKEN-AGAIN")
    assert not again[26].passed, again
    assert "the second presentation re-ran the fork: entered prepare=0 approve=0 " in (
        again[26].measured
    ), again
    assert "the second presentation applied again under the same keys: {" in (again[26].measured), (
        again
    )
    honest = run_scenario(real, "sqlite", tmp_path / "h", "FORK-TOKEN-AGAIN")[26]
    assert honest.passed, honest
    assert "re-ran" not in honest.measured, honest


class _ForkRechargesShared(Passthrough):
    """A fork after charge enters charge again and applies it under its key."""

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        for name, key, _ in list(self.env.sink.applications()):
            if name == "charge":
                self.env.enter("charge")
                self.env.sink.apply("charge", key)
        return self.inner.fork(run, checkpoint, token)


def test_a_fork_that_recharges_under_the_same_key_fails_27(tmp_path: Path) -> None:
    real = adapter("langgraph")
    bad = run_scenario(
        Wrapped(real, _ForkRechargesShared), "sqlite", tmp_path / "b", "FORK-EFFECTS"
    )
    assert not bad[27].passed, bad
    assert bad[27].measured.startswith("charge applied 1 after the fork"), bad
    assert "applied again under the same key 1 time(s)" in bad[27].measured, bad
    assert "charge entered 1 time(s) by the fork" in bad[27].measured, bad
    honest = run_scenario(real, "sqlite", tmp_path / "h", "FORK-EFFECTS")[27]
    assert honest.passed, honest


# -- an in-doubt effect applied again instead of reconciled ---------------------------------


class _ReapplyInDoubt(Passthrough):
    """Recovery applies every keyed effect it finds in doubt again under its key,
    as if the target deduplicated keys, instead of asking the reconcile hook."""

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        for name, key, _ in list(self.env.sink.applications()):
            if key is not None:
                self.env.sink.apply(name, key)
        return self.inner.recover(run, branch=branch)


@pytest.mark.parametrize(
    "spec", ["sqlite", "postgresql://postgres@127.0.0.1:5432/test", "redis://127.0.0.1:6379/0"]
)
def test_an_in_doubt_charge_applied_again_fails_11(tmp_path: Path, spec: str) -> None:
    real = adapter("langgraph")
    bad = run_scenario(Wrapped(real, _ReapplyInDoubt), spec, tmp_path / "b", "CRASH-AFTER-EFFECT")
    assert not bad[11].passed, bad
    assert "applied again under the same key: {'charge': 1}" in bad[11].measured, bad
    assert bad[12].passed, bad  # the steps are as they should be: only P2 is broken
    honest = run_scenario(real, spec, tmp_path / "h", "CRASH-AFTER-EFFECT")
    assert honest[11].passed and honest[12].passed, honest


# -- where the first recovery died -------------------------------------------------------------


class _FirstRecoveryDiesAtOnce(Passthrough):
    """The first recovery is SIGKILLed before it does anything; later ones recover."""

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        if _first_time(self.env, f"recovering-{run}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.recover(run, branch=branch)


@pytest.mark.parametrize("framework", ["langgraph", "llamaindex"])
def test_a_first_recovery_that_died_before_midway_fails_18(tmp_path: Path, framework: str) -> None:
    real = adapter(framework)
    early = run_scenario(
        Wrapped(real, _FirstRecoveryDiesAtOnce), "sqlite", tmp_path / "e", "RECOVER-KILLED"
    )[18]
    assert not early.passed, early
    assert early.measured == (
        "first recovery died before notify.before_effect (killed by signal 9; points reached: none)"
    ), early
    honest = run_scenario(real, "sqlite", tmp_path / "h", "RECOVER-KILLED")[18]
    assert honest.passed, honest
