"""README.md's LlamaIndex Workflows examples run as written (each in a forked child, in a
scratch directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_examples import examples, run_example


def test_the_section_has_examples() -> None:
    assert len(examples("LlamaIndex Workflows")) == 2


@pytest.mark.parametrize("index", range(2))
def test_readme_example_runs(tmp_path: Path, index: int) -> None:
    run_example(examples("LlamaIndex Workflows")[index], f"llamaindex-{index}", tmp_path)
    assert any(p.suffix == ".db" for p in tmp_path.iterdir())
