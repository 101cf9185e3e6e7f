"""Lint and types as tests: `ruff check .`, `mypy --strict remit_core` and `mypy` of
the shims must pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check() -> None:
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_core() -> None:
    result = _run(sys.executable, "-m", "mypy", "--strict", "remit_core")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_shims() -> None:
    shims = ("remit_langgraph", "remit_llamaindex", "remit_crewai", "remit_pydantic_graph")
    result = _run(sys.executable, "-m", "mypy", *(arg for shim in shims for arg in ("-p", shim)))
    assert result.returncode == 0, result.stdout + result.stderr
