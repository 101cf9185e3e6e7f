"""The 39-cell matrix for LangGraph, on real processes: Remit passes, SqliteSaver does not.

Remit runs on SQLite, PostgreSQL and Redis with the racy cells repeated 5
times; LangGraph's own SqliteSaver runs once, and the cells that exercise its
known failures (resume twice, racing resumers, crash after an effect, an
invalid state, replay without a fork token) must come out FAIL, which shows
the harness can fail a target. The CLI writes its three reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remit_core.conformance.adapter import Target
from remit_core.conformance.cells import CELLS, Cell, select
from remit_core.conformance.runner import Column, discover, run_matrix

PG_URL = os.environ.get("REMIT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REMIT_TEST_REDIS", "redis://127.0.0.1:6379/0")

#: Cells whose failure on SqliteSaver is documented in research/langgraph.md.
KNOWN_VANILLA_FAILURES = {
    5: "RESUME-TWICE: a second value is persisted",
    11: "CRASH-AFTER-EFFECT: the effect is applied twice",
    19: "INVALID-STEP-WRITE: an invalid state is persisted",
    24: "REPLAY-NO-TOKEN: time travel silently forks",
    30: "K2-PROC: both resumers proceed",
    33: "K8-PROC: every resumer proceeds",
    34: "K8-PROC: the effect fires once per resumer",
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def langgraph() -> object:
    adapters, notes = discover(["langgraph"])
    assert [a.framework for a in adapters] == ["langgraph"], notes
    return adapters[0]


def _column(adapter: object, spec: str, folder: Path, repeat: int, cells: list[Cell]) -> Column:
    matrix = run_matrix([adapter], [spec], cells, folder, repeat=repeat, lease=2.0, jobs=4)
    (column,) = matrix.columns
    assert column.note is None, column.note
    assert sorted(column.cells) == [c.id for c in cells]
    return column


@pytest.mark.parametrize("spec", ["sqlite", PG_URL, REDIS_URL], ids=["sqlite", "pg", "redis"])
def test_remit_passes_every_cell(langgraph: object, spec: str, tmp_path: Path) -> None:
    column = _column(langgraph, spec, tmp_path, repeat=5, cells=list(CELLS))
    engine = Target.parse(spec, tmp_path, "t").engine
    failing = {
        i: f"{r.status}: {r.measured}" for i, r in column.cells.items() if r.status != "PASS"
    }
    assert failing == {}, engine
    saturations = {i: r.saturation for i, r in column.cells.items() if r.saturation is not None}
    assert set(saturations) == {c.id for c in CELLS if c.concurrent}
    assert set(saturations.values()) == {0.0}
    assert all(column.cells[c.id].runs == 5 for c in CELLS if c.concurrent)


def test_sqlitesaver_fails_its_known_failures(langgraph: object, tmp_path: Path) -> None:
    cells = select(["1,2", ",".join(map(str, KNOWN_VANILLA_FAILURES))])
    column = _column(langgraph, "vanilla", tmp_path, repeat=1, cells=cells)
    statuses = {i: r.status for i, r in column.cells.items()}
    assert "ERROR" not in statuses.values(), {
        i: r.measured for i, r in column.cells.items() if r.status == "ERROR"
    }
    assert {i: statuses[i] for i in KNOWN_VANILLA_FAILURES} == dict.fromkeys(
        KNOWN_VANILLA_FAILURES, "FAIL"
    )
    assert column.cells[33].saturation is not None and column.cells[33].saturation > 0
    assert "charge=2" in column.cells[11].measured
    assert statuses[1] == statuses[2] == "PASS"  # the plain sequence works on SqliteSaver


def test_cli_prints_the_matrix_and_writes_reports(tmp_path: Path) -> None:
    remit = Path(sys.executable).with_name("remit")
    paths = {fmt: tmp_path / f"matrix.{fmt}" for fmt in ("json", "md", "html")}
    done = subprocess.run(
        [
            str(remit),
            "conformance",
            "--framework",
            "langgraph",
            "--target",
            "vanilla",
            "--target",
            "sqlite",
            "--cells",
            "2,24,30",
            "--json",
            str(paths["json"]),
            "--markdown",
            str(paths["md"]),
            "--html",
            str(paths["html"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LangGraph SqliteSaver [langgraph]: 1/3 PASS, 2 FAIL" in done.stdout
    assert "Remit (sqlite) [langgraph]: all 3 cells PASS" in done.stdout
    data = json.loads(paths["json"].read_text())
    assert data["remit_ok"] is True and [c["label"] for c in data["columns"]] == [
        "LangGraph SqliteSaver",
        "Remit (sqlite)",
    ]
    assert "| 24 | REPLAY-NO-TOKEN |" in paths["md"].read_text()
    page = paths["html"].read_text()
    assert "<table>" in page and page.count("<tr>") == 4


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cells", "77"], "no cell 77"),
        (["--cells", "5-3"], "runs backwards"),
        (["--lease", "0"], "--lease"),
        (["--lease", "nan"], "--lease"),
        (["--jobs", "0"], "--jobs"),
        (["--repeat", "0"], "--repeat"),
    ],
)
def test_cli_refuses_bad_usage(tmp_path: Path, args: list[str], says: str) -> None:
    remit = Path(sys.executable).with_name("remit")
    done = subprocess.run(
        [str(remit), "conformance", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and says in done.stderr
