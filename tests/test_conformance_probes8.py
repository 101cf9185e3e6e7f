"""Round 8 of the conformance harness's probes: real frameworks, real stores, real processes.

- K-PROC (30, 32, 33, 35) and K8-THREADS (36) counted how many resumers
  proceeded and how many were acknowledged, never which: a winner told it
  failed while a loser is told "ok" passed. The one acknowledged must be the
  one that proceeded.
- RESUME-TWICE (5) refused a second value to an interrupt the first never
  consumed: a first value acknowledged but never carried to the end passed.
- CORRUPT-RECORD (22) passed a backend that read the altered record as a
  state and ran a step on it, as long as it raised (naming run and checkpoint)
  before charge.
- An adapter that declared a cell N/A without a reason got an N/A with no
  reason (or a stock one); the matrix now reads ERROR, saying why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from conformance_parts import Passthrough, Wrapped, adapter, run_scenario

from remit_core.conformance.adapter import NotApplicable, RunResult, Target
from remit_core.conformance.cells import select
from remit_core.conformance.runner import NO_REASON, run_matrix
from remit_core.conformance.world import current_resumer

pytestmark = pytest.mark.slow


class _AckTheWrongResumer(Passthrough):
    """The resumer that took the claim and ran the steps is told it failed (its
    acknowledgement was lost); one loser, refused by the store, is told "ok" instead."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        try:
            self.inner.resume(run, value, branch=branch)
        except Exception as refused:
            marker = Path(self.env.folder) / f"loser-acknowledged-{run}"
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                raise refused from None
            return RunResult("done")
        raise RuntimeError(f"the acknowledgement to {current_resumer.get()} was lost")


@pytest.mark.parametrize(("scenario", "cell"), [("K2-PROC", 30), ("K8-THREADS", 36)])
def test_a_loser_acknowledged_in_the_winners_place_fails(
    tmp_path: Path, scenario: str, cell: int
) -> None:
    real = adapter("langgraph")
    swapped = run_scenario(
        Wrapped(real, _AckTheWrongResumer), "sqlite", tmp_path / "swapped", scenario
    )[cell]
    assert not swapped.passed and not swapped.inconclusive, swapped
    assert swapped.measured.startswith("1 of "), swapped
    assert "proceeded, 1 acknowledged, but the one that proceeded" in swapped.measured, swapped
    honest = run_scenario(real, "sqlite", tmp_path / "honest", scenario)[cell]
    assert honest.passed, honest
    assert honest.measured.endswith("proceeded, 1 acknowledged"), honest


class _AckTheFirstValueOnly(Passthrough):
    """The first value is acknowledged but never stored or run; every later value is
    refused, as if the first had consumed the interrupt."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        marker = Path(self.env.folder) / f"acknowledged-{run}"
        if marker.exists():
            raise RuntimeError(f"run {run} has no interrupt waiting for a value")
        marker.touch()
        return RunResult("done")


def test_a_first_value_acknowledged_but_never_run_fails_5(tmp_path: Path) -> None:
    real = adapter("langgraph")
    lost = run_scenario(
        Wrapped(real, _AckTheFirstValueOnly), "sqlite", tmp_path / "lost", "RESUME-TWICE"
    )
    assert not lost[5].passed, lost[5]
    assert lost[5].measured.startswith("the first value was acknowledged (done)"), lost[5]
    assert not lost[6].passed, lost[6]
    honest = run_scenario(real, "sqlite", tmp_path / "honest", "RESUME-TWICE")
    assert honest[5].passed and honest[6].passed, honest


class _StepOnTheCorruptRecord(Passthrough):
    """A step runs on the state read from the altered record before the error is raised."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        self.env.enter("approve")
        return self.inner.resume(run, value, branch=branch)


@pytest.mark.parametrize("framework", ["langgraph", "pydantic-graph"])
def test_a_step_run_on_a_corrupt_record_fails_22(tmp_path: Path, framework: str) -> None:
    real = adapter(framework)
    read = run_scenario(
        Wrapped(real, _StepOnTheCorruptRecord), "sqlite", tmp_path / "read", "CORRUPT-RECORD"
    )[22]
    assert not read.passed, read
    assert "but the corrupt record was read as a state: entered prepare=0 approve=1" in (
        read.measured
    ), read
    honest = run_scenario(real, "sqlite", tmp_path / "honest", "CORRUPT-RECORD")[22]
    assert honest.passed, honest
    assert "read as a state" not in honest.measured, honest


class _NoReasonGiven(Passthrough):
    def start(self, run: str) -> RunResult:
        raise NotApplicable("")


class _SilentAdapter(Wrapped):
    """Declares cell 7 N/A up front, and SEQ N/A from inside it, both without a reason."""

    def not_applicable(self, target: Target) -> Mapping[int, str]:
        return {7: "  "}


def test_an_na_without_a_reason_is_an_error(tmp_path: Path) -> None:
    silent = _SilentAdapter(adapter("langgraph"), _NoReasonGiven)
    matrix = run_matrix([silent], ["sqlite"], select(["1,2,7"]), tmp_path, jobs=1, lease=0.5)
    (column,) = matrix.columns
    got = {cell: (r.status, r.measured) for cell, r in column.cells.items()}
    assert got == {cell: ("ERROR", NO_REASON) for cell in (1, 2, 7)}, got
    assert not matrix.remit_ok()
