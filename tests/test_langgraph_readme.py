"""README.md's LangGraph examples run as written (each in a forked child, in a scratch dir)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import traceback
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def langgraph_examples() -> list[str]:
    section = README.read_text().split("\n## LangGraph\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_has_examples() -> None:
    assert len(langgraph_examples()) == 2


@pytest.mark.parametrize("index", range(2))
def test_readme_example_runs(tmp_path: Path, index: int) -> None:
    code = langgraph_examples()[index]
    errors = mp.get_context("fork").Queue()

    def body() -> None:
        os.chdir(tmp_path)
        try:
            # dont_inherit: this file's `from __future__ import annotations` must not leak in.
            program = compile(code, f"README.md#langgraph-{index}", "exec", dont_inherit=True)
            exec(program, {"__name__": "__main__"})
        except BaseException:
            errors.put(traceback.format_exc())
            raise
        errors.put("")

    proc = mp.get_context("fork").Process(target=body)
    proc.start()
    proc.join(120)
    assert errors.get(timeout=5) == ""
    assert proc.exitcode == 0
    assert any(p.suffix == ".db" for p in tmp_path.iterdir())
