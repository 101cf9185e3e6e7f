"""The Resume Contract's 39 cells for CrewAI Flows on Remit: SQLite, PostgreSQL and Redis.

One matrix run (the racy scenarios five times) driven from this process,
which imports CrewAI once; every scenario and its workers are forked from it.
CrewAI's own `SQLiteFlowPersistence` is measured by `remit conformance
--framework crewai --target vanilla` (README.md), not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_crewai_flows  # noqa: F401 - quiet environment, CrewAI preloaded before any fork
from conftest import PG_URL, REDIS_URL

from remit_core.conformance.cells import CELLS, RACY
from remit_core.conformance.runner import Matrix, run_matrix
from remit_crewai.probe import adapter

TARGETS = {"sqlite": "sqlite", "postgresql": PG_URL, "redis": REDIS_URL}
REPEAT = 5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    folder: Path = tmp_path_factory.mktemp("crewai-matrix")
    adapter.preload()
    return run_matrix(
        [adapter], list(TARGETS.values()), list(CELLS), folder, repeat=REPEAT, lease=1.0, jobs=5
    )


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("engine", list(TARGETS))
def test_remit_passes_every_cell(matrix: Matrix, engine: str) -> None:
    (column,) = [c for c in matrix.columns if c.target == TARGETS[engine]]
    assert column.note is None and column.kind == "remit"
    assert sorted(column.cells) == [c.id for c in CELLS]
    failing = {i: f"{r.status}: {r.measured}" for i, r in column.cells.items()}
    failing = {i: text for i, text in failing.items() if not text.startswith("PASS")}
    assert not failing, failing
    for cell in CELLS:
        result = column.cells[cell.id]
        assert result.runs == (REPEAT if cell.scenario in RACY else 1), cell.id
        if cell.concurrent:
            assert result.saturation == 0.0, (cell.id, result.measured)
