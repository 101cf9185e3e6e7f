"""The 39-cell matrix for pydantic-graph 1.x, on real processes.

Remit (`RemitStatePersistence`) runs on SQLite, PostgreSQL and Redis with the
racy cells repeated 5 times and must pass every cell. pydantic-graph's own
durable backend, `FileStatePersistence`, runs once and is reported as
measured; the cells that exercise its documented failures (research/
pydantic-graph.md) must come out FAIL, which shows the harness can fail it.
Its racing cells are printed, not asserted: its lock file times out under
load, so how many of its resumers proceed varies from run to run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import PG_URL, REDIS_URL

from remit_core.conformance.cells import CELLS
from remit_core.conformance.runner import Column, discover, run_matrix

#: FileStatePersistence failures observed in research/pydantic-graph.md.
KNOWN_VANILLA_FAILURES = {
    5: "RESUME-TWICE: a late answer silently starts a new run in the same file",
    9: "CRASH-BEFORE-EFFECT: the killed node stays running; iter_from_persistence gives up",
    13: "CRASH-AFTER-STEP: only success is stored, the next node is lost",
    19: "INVALID-STEP-WRITE: an invalid state is written with a warning",
    24: "REPLAY-NO-TOKEN: re-running an old node appends to the same history",
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pydantic_graph() -> object:
    adapters, notes = discover(["pydantic-graph"])
    assert [a.framework for a in adapters] == ["pydantic-graph"], notes
    return adapters[0]


def _column(adapter: object, spec: str, folder: Path, repeat: int) -> Column:
    matrix = run_matrix([adapter], [spec], CELLS, folder, repeat=repeat, lease=2.0, jobs=3)
    (column,) = matrix.columns
    assert column.note is None, column.note
    assert sorted(column.cells) == [c.id for c in CELLS]
    return column


@pytest.mark.parametrize("spec", ["sqlite", PG_URL, REDIS_URL], ids=["sqlite", "pg", "redis"])
def test_remit_passes_every_cell(pydantic_graph: object, spec: str, tmp_path: Path) -> None:
    column = _column(pydantic_graph, spec, tmp_path, repeat=5)
    failing = {
        i: f"{r.status}: {r.measured}" for i, r in column.cells.items() if r.status != "PASS"
    }
    assert failing == {}
    saturations = {i: r.saturation for i, r in column.cells.items() if r.saturation is not None}
    assert set(saturations) == {c.id for c in CELLS if c.concurrent}
    assert set(saturations.values()) == {0.0}
    assert all(column.cells[c.id].runs == 5 for c in CELLS if c.concurrent)


def test_file_persistence_is_measured(pydantic_graph: object, tmp_path: Path) -> None:
    column = _column(pydantic_graph, "vanilla", tmp_path, repeat=1)
    print(column.verdict())
    for r in column.cells.values():
        print(f"{r.cell:>2} {r.status:5} {r.measured}")
    statuses = {i: r.status for i, r in column.cells.items()}
    assert "ERROR" not in statuses.values(), {
        i: r.measured for i, r in column.cells.items() if r.status == "ERROR"
    }
    assert {i: statuses[i] for i in KNOWN_VANILLA_FAILURES} == dict.fromkeys(
        KNOWN_VANILLA_FAILURES, "FAIL"
    )
