"""README.md's pydantic-graph example runs as written, and says what 2.x users get."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("\n## pydantic-graph\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_example_runs_and_answers_once(tmp_path: Path) -> None:
    (code,) = re.findall(r"```python\n(.*?)```", _section(), flags=re.S)
    script = tmp_path / "example.py"
    script.write_text(code)

    def run_example() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            timeout=120,
        )

    done = run_example()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "charged 42 Order(amount=42, approved_by='alice')"
    assert (tmp_path / "remit.db").exists()
    again = run_example()
    # The same run id again: the run has ended, so starting it over is a fork.
    assert again.returncode != 0 and "ForkWithoutIntent" in again.stderr


def test_the_section_says_what_2x_users_get() -> None:
    section = _section()
    assert "**pydantic-graph 2.x.**" in section
    assert "no\ndurable path for the 2.x builder API exists here" in section
    assert "pydantic-graph>=1,<2" in section
