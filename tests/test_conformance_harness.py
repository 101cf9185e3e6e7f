"""The conformance harness's own machinery, on real processes and real stores.

Forked workers really die by SIGKILL and really stop; the barrier really
releases k processes together; the effect sink keeps its key rule across
processes; copies and corruption of a Remit store behave as RECOVER-TWICE and
CORRUPT-RECORD need, on SQLite, PostgreSQL and Redis.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from remit_core import CorruptRecord, StateSchema, connect, run_effect, step_scope
from remit_core.conformance import report
from remit_core.conformance.adapter import ProbeEnv, Target
from remit_core.conformance.cells import CELLS, RACY, select
from remit_core.conformance.processes import Barrier, fork
from remit_core.conformance.runner import CellResult, Column, Matrix
from remit_core.conformance.storage import (
    copy_remit_run,
    corrupt_remit_checkpoint,
    discard_copy,
)
from remit_core.effects import NOT_APPLIED


def _env(tmp_path: Path) -> ProbeEnv:
    return ProbeEnv(tmp_path, Target.parse("vanilla", tmp_path, "t"), lease=1.0)


def test_cells_are_the_contract_table() -> None:
    assert [c.id for c in CELLS] == list(range(1, 40))
    assert {c.k for c in CELLS if c.scenario.startswith("K")} == {2, 4, 8, 16}
    assert "SEQ" not in RACY and "K8-ZOMBIE" in RACY


def test_select_by_id_range_and_scenario() -> None:
    assert [c.id for c in select(["30-32", "5"])] == [5, 30, 31, 32]
    assert [c.id for c in select(["k8-proc"])] == [33, 34]
    assert len(select(None)) == 39
    with pytest.raises(ValueError, match="no cell 40"):
        select(["38-40"])
    with pytest.raises(ValueError, match="unknown cell"):
        select(["K9-PROC"])


def test_worker_result_comes_back_as_json_with_the_exception_chain() -> None:
    def fails() -> None:
        try:
            {}["missing"]
        except KeyError as exc:
            raise RuntimeError("wrapped") from exc

    ok = fork(lambda: {"pid_differs": True, "path": Path("/x")}).wait(30)
    bad = fork(fails).wait(30)
    assert ok.ok and ok.value == {"pid_differs": True, "path": "PosixPath('/x')"}
    assert bad.raised("RuntimeError") and bad.raised("KeyError") and bad.raised("Exception")
    assert not bad.raised("ValueError")
    assert "wrapped" in bad.error_text()


def test_armed_point_kills_and_journals(tmp_path: Path) -> None:
    env = _env(tmp_path)

    def body() -> str:
        env.arm("charge.after_effect", "kill")
        with env.operating("run-1", "r0"):
            env.enter("charge")
            env.sink.apply("charge")
            env.point("charge.after_effect")
        return "survived"

    outcome = fork(body).wait(30)
    assert outcome.status == "killed" and outcome.signal == 9
    entries = env.journal.entries()
    assert [(e.kind, e.name, e.run, e.resumer) for e in entries] == [
        ("enter", "charge", "run-1", "r0"),
        ("point", "charge.after_effect", "run-1", "r0"),
    ]
    assert env.sink.counts() == {"charge": 1}


def test_stopped_worker_is_seen_stopped_then_continues(tmp_path: Path) -> None:
    env = _env(tmp_path)

    def body() -> int:
        env.arm("charge.before_effect", "stop")
        env.point("charge.before_effect")
        return 7

    worker = fork(body)
    assert worker.wait(30, stopped_counts=True).status == "stopped"
    time.sleep(0.2)
    assert worker.poll() is None  # still stopped
    worker.cont()
    outcome = worker.wait(30)
    assert outcome.ok and outcome.value == 7


def test_barrier_releases_every_worker_after_all_are_ready(tmp_path: Path) -> None:
    k = 8
    barrier = Barrier(k)

    def body() -> float:
        time.sleep(0.05)
        barrier.wait()
        return time.time()

    workers = [fork(body, barrier=barrier) for _ in range(k)]
    before = time.time()
    assert barrier.release(30) == k
    times = [w.wait(30).value for w in workers]
    assert all(t >= before for t in times)
    assert max(times) - min(times) < 1.0


def test_sink_ignores_a_repeated_key_across_racing_processes(tmp_path: Path) -> None:
    env = _env(tmp_path)
    k = 8
    barrier = Barrier(k)

    def body() -> str:
        barrier.wait()
        env.sink.apply("charge", "key-1")
        return env.sink.apply("notify")

    workers = [fork(body, barrier=barrier) for _ in range(k)]
    barrier.release(30)
    assert all(w.wait(30).ok for w in workers)
    assert env.sink.counts() == {"charge": 1, "notify": k}
    assert env.sink.happened("key-1") and not env.sink.happened("key-2")
    assert env.sink.reconcile("key-1") == "charge:key-1"
    assert env.sink.reconcile("key-2") is NOT_APPLIED


def test_relocated_targets_are_isolated_locations(tmp_path: Path) -> None:
    pg = Target.parse("postgresql://u@h:5432/db?sslmode=disable", tmp_path, "a")
    copy = pg.relocated(tmp_path / "c", "abc", 1)
    assert copy.schema == "probe_copy_abc" and "sslmode=disable" in copy.url
    redis = Target.parse("redis://h:6379/0", tmp_path, "a").relocated(tmp_path, "x", 2)
    assert redis.url == "redis://h:6379/2"
    local = Target.parse("sqlite", tmp_path, "a").relocated(tmp_path / "c", "y")
    assert local.url == f"sqlite:///{tmp_path / 'c' / 'store.db'}" and local.kind == "remit"
    assert Target.parse("vanilla+postgresql://h/db", tmp_path, "a").kind == "vanilla"
    with pytest.raises(ValueError, match="unknown target"):
        Target.parse("mysql://h/db", tmp_path, "a")


def test_copy_keeps_ledger_interrupts_and_run_id(store_url: str, tmp_path: Path) -> None:
    source = Target.parse(store_url, tmp_path / "src", uuid.uuid4().hex[:12])
    dest = source.relocated(tmp_path / "dst", uuid.uuid4().hex[:12], 1)
    run = f"run-{uuid.uuid4().hex}"
    remit = connect(source.url)
    first = remit.commit(run_id=run, checkpoint_id="c1", parent_id=None, state=b"one")
    remit.open_interrupts(run, {"ask": b"?"}, checkpoint_id=first.checkpoint_id)
    remit.consume(run, "ask", b"alice")
    with step_scope(remit, run, "charge-step"):
        receipt = run_effect("charge", lambda key: f"paid:{key}")
    try:
        copy_remit_run(source, dest, run)
        copied = connect(dest.url)
        assert copied.head(run).state == b"one"
        assert copied.interrupt(run, "ask").status == "consumed"
        with step_scope(copied, run, "charge-step"):
            again = run_effect("charge", lambda key: pytest.fail("applied twice"))
        assert again == receipt
    finally:
        discard_copy(dest, run)


def test_corrupted_checkpoint_fails_naming_run_and_checkpoint(
    store_url: str, tmp_path: Path
) -> None:
    target = Target.parse(store_url, tmp_path, "t")
    run = f"run-{uuid.uuid4().hex}"
    remit = connect(target.url)
    remit.commit(run_id=run, checkpoint_id="c1", parent_id=None, state=b"x" * 64)
    corrupt_remit_checkpoint(target, run, "c1")
    with pytest.raises(CorruptRecord) as err:
        remit.head(run)
    assert run in str(err.value) and "c1" in str(err.value)


def test_reports_render_every_status(tmp_path: Path) -> None:
    remit = Column("langgraph", "sqlite", "Remit (sqlite)", "remit")
    remit.cells = {30: CellResult(30, "PASS", "1 of 2 proceeded", 0.0)}
    vanilla = Column("langgraph", "vanilla", "LangGraph SqliteSaver", "vanilla")
    vanilla.cells = {30: CellResult(30, "FAIL", "2 of 2 proceeded", 1.0)}
    other = Column("crewai", "vanilla", "CrewAI SQLite", "vanilla")
    other.cells = {30: CellResult(30, "N/A", "no threads in this framework")}
    matrix = Matrix([30], [remit, vanilla, other], ["pydantic-graph: skipped"], 1, 1.0, "remit x")
    assert matrix.remit_ok()
    text = report.text(matrix)
    assert "FAIL: 2 of 2 proceeded (saturation 1.00)" in text
    assert "N/A: no threads in this framework" in text and "pydantic-graph: skipped" in text
    data = json.loads(report.to_json(matrix))
    assert data["remit_ok"] is True and data["columns"][1]["results"][0]["status"] == "FAIL"
    page = report.to_html(matrix)
    assert page.startswith("<!doctype html>") and "#c62828" in page and "#2e7d32" in page
    assert 'title="2 of 2 proceeded"' in page
    md = report.markdown(matrix)
    assert "| 30 | K2-PROC |" in md and "FAIL: 2 of 2 proceeded" in md
    remit.cells[30] = CellResult(30, "FAIL", "2 of 2 proceeded", 1.0)
    assert not matrix.remit_ok()


def test_state_schema_rejects_the_invalid_probe_write() -> None:
    from remit_core.conformance.adapter import ProbeState, initial_state

    schema = StateSchema(ProbeState)
    schema.validate({**initial_state(), "amount": 100})
    with pytest.raises(Exception, match="amount"):
        schema.validate({**initial_state(), "amount": -5})
