"""`remit conformance` used as a person would: bad options, unusable stores, signals.

Every case runs the real `remit` console script on real processes, with the
real stores (SQLite files, PostgreSQL, Redis) and the LangGraph probe adapter.
A mistake in the options, or a server that is down, is one clear message and
exit status 2 before anything runs; a run stopped by Ctrl-C or SIGTERM leaves
no scenario process and no temporary folder behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from remit_core.conformance import report
from remit_core.conformance.adapter import Target
from remit_core.conformance.cells import select
from remit_core.conformance.runner import CellResult, Column, Matrix

PG_URL = os.environ.get("REMIT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REMIT_TEST_REDIS", "redis://127.0.0.1:6379/0")
REMIT = str(Path(sys.executable).with_name("remit"))


def _remit(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [REMIT, "conformance", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def _refused(done: subprocess.CompletedProcess, says: str) -> None:
    """Exit 2 with `says` in the message, no traceback, and no matrix printed."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ""


def _closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_selection_naming_no_cell_is_refused() -> None:
    with pytest.raises(ValueError, match="names no cell"):
        select([","])
    with pytest.raises(ValueError, match="unknown cell '3-'"):
        select(["3-"])
    assert len(select(None)) == 39


@pytest.mark.parametrize("spec", ["vanilla+", "vanilla+mysql://h/db", "postgresql://", "redis:x"])
def test_a_target_needs_a_known_url(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown target"):
        Target.parse(spec, tmp_path, "t")


def test_unreachable_stores_are_refused_before_the_run(tmp_path: Path) -> None:
    port = _closed_port()
    for spec in (
        f"postgresql://postgres@127.0.0.1:{port}/test",
        f"redis://127.0.0.1:{port}/0",
        f"vanilla+postgresql://postgres@127.0.0.1:{port}/test",
    ):
        done = _remit("--framework", "langgraph", "--target", spec, cwd=tmp_path)
        _refused(done, f"target {spec}: ")
        assert "refused" in done.stderr.lower()
    bad_option = f"{REDIS_URL}?no_such_option=1"
    _refused(_remit("--target", bad_option, cwd=tmp_path), "no_such_option")
    missing = f"sqlite:///{tmp_path / 'missing' / 'x.db'}"
    _refused(_remit("--target", missing, cwd=tmp_path), "does not exist")


def test_unusable_outputs_and_folders_are_refused_before_the_run(tmp_path: Path) -> None:
    _refused(_remit("--json", str(tmp_path / "no" / "m.json"), cwd=tmp_path), "cannot write")
    _refused(_remit("--html", str(tmp_path), cwd=tmp_path), "cannot write")
    used = tmp_path / "used"
    (used / "langgraph").mkdir(parents=True)
    _refused(_remit("--folder", str(used), cwd=tmp_path), "not an empty folder")
    blocked = tmp_path / "file"
    blocked.write_text("x")
    _refused(_remit("--folder", str(blocked / "sub"), cwd=tmp_path), "--folder")


def test_a_kept_folder_holds_one_run_and_is_not_reused(tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    args = ("--framework", "langgraph", "--target", "sqlite", "--cells", "1-2")
    first = _remit(*args, "--folder", str(folder), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (folder / "langgraph" / "sqlite" / "SEQ-0" / "scenario.log").exists()
    _refused(_remit(*args, "--folder", str(folder), cwd=tmp_path), "not an empty folder")


def test_targets_that_slug_alike_get_their_own_folders(tmp_path: Path) -> None:
    long_url = f"{REDIS_URL}?socket_timeout=30&health_check_interval="
    specs = ["sqlite", "sqlite", f"{long_url}1", f"{long_url}2"]
    targets = [a for spec in specs for a in ("--target", spec)]
    json_path = tmp_path / "m.json"
    args = ("--framework", "langgraph", *targets, "--cells", "1-4", "--json", str(json_path))
    done = _remit(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    columns = json.loads(json_path.read_text())["columns"]
    assert [c["target"] for c in columns] == ["sqlite", f"{long_url}1", f"{long_url}2"]
    assert all(r["status"] == "PASS" for c in columns for r in c["results"]), columns


def test_nothing_to_run_is_not_success(tmp_path: Path) -> None:
    done = _remit(
        "--framework", "crewai", "--target", f"vanilla+{PG_URL}", "--cells", "1", cwd=tmp_path
    )
    assert done.returncode == 2 and "no framework could run" in done.stderr
    assert "CrewAI ships only SQLiteFlowPersistence" in done.stdout


def test_the_text_grid_names_each_columns_framework() -> None:
    columns = [Column(fw, "sqlite", "Remit (sqlite)", "remit") for fw in ("crewai", "langgraph")]
    for column in columns:
        column.cells = {1: CellResult(1, "PASS", "entered prepare=1")}
    above, head = report.text(Matrix([1], columns, [], 1)).splitlines()[:2]
    assert head.count("Remit (sqlite)") == 2
    assert above.index("[crewai]") == head.index("Remit (sqlite)")
    assert above.index("[langgraph]") == head.rindex("Remit (sqlite)")


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` (forks inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_run_leaves_no_process_and_no_folder(
    tmp_path: Path, sig: signal.Signals, status: int
) -> None:
    scratch = tmp_path / f"tmp-{uuid.uuid4().hex}"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.Popen(
        [REMIT, "conformance", "--quiet", "--framework", "langgraph", "--target", "sqlite"]
        + ["--cells", "K8-DEAD-WINNER,K8-ZOMBIE", "--lease", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not list(scratch.glob("remit-conformance-*/langgraph/sqlite/*/world.db")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    assert len(_processes_with(str(scratch))) > 1  # the scenarios are running
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, out + err
    assert "interrupted" in err and "Traceback" not in err
    assert list(scratch.iterdir()) == []
    deadline = time.monotonic() + 30  # killed processes may take a moment to be reaped
    while _processes_with(str(scratch)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(str(scratch)) == []


def _hang(ctx: object) -> dict[int, object]:
    time.sleep(3600)
    return {}


def test_a_scenario_past_its_time_limit_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scenario that gives no verdict in time is stopped, and its cells say why
    (not "killed by signal 9", which reads as a crash of the target)."""
    from remit_core.conformance import runner, scenarios
    from remit_core.conformance.runner import discover, run_matrix

    (adapter,), _ = discover(["langgraph"])
    monkeypatch.setattr(runner, "SCENARIO_TIMEOUT", 1.0)
    monkeypatch.setitem(scenarios.RUNNERS, "SEQ", _hang)  # (the forked scenario inherits it)
    started = time.monotonic()
    matrix = run_matrix([adapter], ["sqlite"], select(["1-2"]), tmp_path / "run", jobs=1)
    assert time.monotonic() - started < 60
    (column,) = matrix.columns
    for cell_id in (1, 2):
        result = column.cells[cell_id]
        assert result.status == "ERROR", result
        assert "no verdict within 1 s" in result.measured, result.measured
