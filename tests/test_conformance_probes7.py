"""Round 7 of the conformance harness's probes: real frameworks, real stores, real processes.

- FORK-VS-CONSUME (cell 28) answered main before its fork, so it never saw a
  backend whose fork answer consumes the original line's interrupt (L3 holds
  only one way). The lines are now answered fork, main, fork.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conformance_parts import Passthrough, Wrapped, adapter, run_scenario

from remit_core.conformance.adapter import RunResult

pytestmark = pytest.mark.slow


class _ForkAnswerTakesMains(Passthrough):
    """A backend whose answer to a fork also consumes the interrupt of the line the fork
    was made from: main's own answer is refused once any fork was answered."""

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        marker = Path(self.env.folder) / f"fork-answered-{run}"
        if branch is None and marker.exists():
            raise RuntimeError("the interrupt was consumed already")
        result = self.inner.resume(run, value, branch=branch)
        if branch is not None:
            marker.touch()
        return result


@pytest.mark.parametrize("framework", ["langgraph", "pydantic-graph"])
def test_a_fork_answer_that_consumes_mains_interrupt_fails_28(
    tmp_path: Path, framework: str
) -> None:
    real = adapter(framework)
    loose = run_scenario(
        Wrapped(real, _ForkAnswerTakesMains), "sqlite", tmp_path / "loose", "FORK-VS-CONSUME"
    )[28]
    assert not loose.passed, loose
    assert "resume main: " in loose.measured, loose
    assert "the interrupt was consumed already" in loose.measured, loose
    honest = run_scenario(real, "sqlite", tmp_path / "honest", "FORK-VS-CONSUME")[28]
    assert honest.passed, honest
    assert honest.measured.startswith(
        "fork approved_by 'bob', main approved_by 'alice', fork 2 approved_by 'dave'"
    ), honest
    assert honest.measured.endswith("a further value refused on every line"), honest
