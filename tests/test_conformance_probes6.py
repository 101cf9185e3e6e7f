"""Round 6 of the conformance harness's probes: real frameworks, real stores, real processes.

- A worker that dies with no answer (killed by a signal no crash point sent,
  timed out, exited) is no observation of the target: its scenario's cells
  read ERROR, never PASS (a K-PROC loser that died instead of being refused is
  not "the others get ResumeConflict") and never FAIL (the OOM killer is not a
  contract failure).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conformance_parts import Passthrough, Wrapped, adapter, run_scenario

from remit_core.conformance.adapter import RunResult
from remit_core.conformance.cells import select
from remit_core.conformance.runner import _aggregate, run_matrix

pytestmark = pytest.mark.slow


# -- a worker that died with no answer is ERROR, never a verdict --------------------------


class _LoserDies(Passthrough):
    """A racer refused by the store is SIGKILLed (say, by the OOM killer) instead of
    raising: it neither acknowledged nor refused anything."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        try:
            return self.inner.resume(run, value, branch=branch)
        except Exception as exc:
            if type(exc).__name__ == "ResumeConflict":
                os.kill(os.getpid(), signal.SIGKILL)
            raise


class _ResumerDies(Passthrough):
    """Every resume is SIGKILLed before it reaches the store."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def test_a_worker_that_died_unasked_is_an_error_not_a_verdict(tmp_path: Path) -> None:
    langgraph = adapter("langgraph")
    racing = run_matrix(
        [Wrapped(langgraph, _LoserDies)], ["sqlite"], select(["K2-PROC"]), tmp_path / "k2", jobs=1
    )
    for cell_id in (30, 31):
        result = racing.columns[0].cells[cell_id]
        assert result.status == "ERROR", result
        assert "killed by signal 9" in result.measured, result
    dying = run_matrix(
        [Wrapped(langgraph, _ResumerDies)], ["sqlite"], select(["3-4"]), tmp_path / "x", jobs=1
    )
    for cell_id in (3, 4):
        result = dying.columns[0].cells[cell_id]
        assert result.status == "ERROR", result
        assert "gave no answer: killed by signal 9" in result.measured, result
    honest = run_matrix([langgraph], ["sqlite"], select(["3-4"]), tmp_path / "honest", jobs=1)
    assert [r.status for r in honest.columns[0].cells.values()] == ["PASS", "PASS"]


# -- FORK-VS-CONSUME: each branch's interrupt is consumed once ------------------------------


class _ForkTakesAnyValue(Passthrough):
    """A backend whose fork branch takes a further value as if it were pending: the
    value is acknowledged and never read (P5: "rejected, never persisted-but-unread")."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        try:
            return self.inner.resume(run, value, branch=branch)
        except Exception:
            if branch is None:
                raise
            return RunResult("done", self.inner.inspect(run, branch=branch).state, branch)


def test_a_fork_branch_that_takes_a_second_value_fails_28(tmp_path: Path) -> None:
    langgraph = adapter("langgraph")
    loose = run_scenario(
        Wrapped(langgraph, _ForkTakesAnyValue), "sqlite", tmp_path / "loose", "FORK-VS-CONSUME"
    )[28]
    assert not loose.passed, loose
    assert "a further value was accepted by fork (done)" in loose.measured, loose
    honest = run_scenario(langgraph, "sqlite", tmp_path / "honest", "FORK-VS-CONSUME")[28]
    assert honest.passed, honest
    assert honest.measured.endswith("a further value refused on every line"), honest


# -- --repeat: a failure seen in one run is a FAIL, whatever another run did ---------------------


def test_a_failed_run_is_not_hidden_by_a_run_that_could_not_be_judged() -> None:
    failed = {"passed": False, "measured": "2 of 2 proceeded, 2 acknowledged", "saturation": 1.0}
    passed = {"passed": True, "measured": "1 of 2 proceeded, 1 acknowledged", "saturation": 0.0}
    crashed = {"error": "scenario failed: worker 7 gave no answer: timeout"}
    result = _aggregate(30, [passed, failed, crashed])
    assert result.status == "FAIL", result
    assert result.measured == (
        "1/3 runs failed (1 could not be judged); 2 of 2 proceeded, 2 acknowledged"
    ), result
    assert (result.runs, result.failed_runs, result.saturation) == (3, 1, 1.0), result
    assert _aggregate(30, [passed, crashed]).status == "ERROR"
    assert _aggregate(30, [passed, passed]).status == "PASS"


# -- the command line --------------------------------------------------------------------------

REMIT = str(Path(sys.executable).with_name("remit"))
REDIS_URL = os.environ.get("REMIT_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _remit(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REMIT, "conformance", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_repeat_runs_the_crash_recoveries_and_the_summary_counts_columns(tmp_path: Path) -> None:
    """--repeat runs the crash cells N times: RECOVER-TWICE and RECOVER-KILLED SIGKILL a
    worker too, and ran once. The last line counted columns as targets, and a vanilla
    target LangGraph has no saver for was labelled "LangGraph PostgresSaver"."""
    done = _remit(
        "--framework",
        "langgraph",
        "--target",
        "sqlite",
        "--target",
        f"vanilla+{REDIS_URL}",
        "--cells",
        "RECOVER-TWICE,RECOVER-KILLED",
        "--repeat",
        "2",
        "--lease",
        "0.5",
        "--json",
        "m.json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (column,) = [
        c for c in json.loads((tmp_path / "m.json").read_text())["columns"] if c["results"]
    ]
    assert {r["cell"]: (r["status"], r["runs"]) for r in column["results"]} == {
        17: ("PASS", 2),
        18: ("PASS", 2),
    }
    assert "2 cells x 1 column (1 framework on 1 target) in " in done.stdout, done.stdout
    assert "racy cells x2" in done.stdout
    assert "LangGraph's own saver on redis [langgraph]: not run" in done.stdout, done.stdout
    assert "PostgresSaver" not in done.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cells", "5--1"], "unknown cell '5--1'"),
        (["--cells", "1--3"], "unknown cell '1--3'"),
        (["--json", "same.out", "--html", "same.out"], "--json and --html both name same.out"),
        (["--markdown", "r.md", "--html", "./r.md"], "--markdown and --html both name"),
    ],
)
def test_bad_cells_and_reports_on_one_file_are_refused(
    tmp_path: Path, args: list[str], says: str
) -> None:
    done = _remit("--framework", "langgraph", "--target", "sqlite", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "runs backwards" not in done.stderr
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


# -- CORRUPT-RECORD: the error names the checkpoint, not a digit of a timestamp ----------------


class _StampedRefusal(Passthrough):
    """CrewAI's own persistence (checkpoints are row ids: "2", "3") refusing the altered
    state with an error that names the run and a time, but no checkpoint."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        raise RuntimeError(f"flow {run}: the state saved 2025-01-23 14:56:07.890 does not load")


def test_a_checkpoint_id_found_inside_a_timestamp_is_not_named_22(tmp_path: Path) -> None:
    crewai = adapter("crewai")
    stamped = run_scenario(
        Wrapped(crewai, _StampedRefusal), "vanilla", tmp_path / "stamped", "CORRUPT-RECORD"
    )[22]
    assert not stamped.passed, stamped
    assert stamped.measured.startswith("error does not name run and checkpoint"), stamped
    remit = run_scenario(crewai, "sqlite", tmp_path / "remit", "CORRUPT-RECORD")[22]
    assert remit.passed, remit
