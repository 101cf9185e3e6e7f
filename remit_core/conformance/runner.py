"""Run the matrix: find adapters, fork one process per scenario, gather the cells.

The parent imports each framework once (`ProbeAdapter.preload`) and stays
single-threaded; each scenario runs in a forked process (its own process
group, so a stuck scenario is killed with all its workers) that forks the
scenario's workers in turn. A few scenarios run at once; scenarios that
mostly wait for a lease to lapse overlap with the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remit_core.conformance.adapter import ProbeAdapter, Target
from remit_core.conformance.cells import BY_ID, RACY, SCENARIOS, Cell
from remit_core.conformance.processes import Outcome, Worker, fork
from remit_core.conformance.scenarios import (
    RUNNERS,
    Context,
    LateNotApplicable,
    ScenarioNotApplicable,
    WorkerCrashed,
)

ENTRY_POINT_GROUP = "remit.probe_adapters"
#: How long one scenario (all its workers) may take before it is killed.
SCENARIO_TIMEOUT = 600.0
#: An N/A is the framework's reason it cannot express a scenario: one without a reason
#: proves nothing, so the cell reads ERROR with this text.
NO_REASON = "the adapter declared this cell N/A without a reason"
#: How long the check that a target's server answers may take (`unreachable`).
REACH_TIMEOUT = 15.0


@dataclass
class CellResult:
    """A cell on one target, over every run of its scenario.

    `status`: PASS, FAIL, N/A or ERROR (the harness could not run it, or a race's
    racers were not in flight together, so the run tested nothing concurrent).
    `saturation` (concurrency cells): the worst (fired - 1) / (k - 1) seen.
    """

    cell: int
    status: str
    measured: str
    saturation: float | None = None
    runs: int = 0
    failed_runs: int = 0


@dataclass
class Column:
    """One framework on one target: a column of the matrix."""

    framework: str
    target: str
    label: str
    kind: str
    cells: dict[int, CellResult] = field(default_factory=dict)
    note: str | None = None

    def tally(self) -> dict[str, int]:
        out = {"PASS": 0, "FAIL": 0, "N/A": 0, "ERROR": 0}
        for r in self.cells.values():
            out[r.status] += 1
        return out

    def verdict(self) -> str:
        t = self.tally()
        n = len(self.cells)
        if self.note:
            return f"{self.label} [{self.framework}]: not run ({self.note})"
        if n and t["PASS"] == n:
            return f"{self.label} [{self.framework}]: all {n} cells PASS"
        parts = [f"{t['PASS']}/{n} PASS", f"{t['FAIL']} FAIL"]
        if t["ERROR"]:
            parts.append(f"{t['ERROR']} ERROR")
        if t["N/A"]:
            parts.append(f"{t['N/A']} N/A")
        return f"{self.label} [{self.framework}]: " + ", ".join(parts)


@dataclass
class Matrix:
    """The whole run: which cells, on which columns, and what was skipped."""

    cells: list[int]
    columns: list[Column]
    notes: list[str]
    repeat: int
    elapsed: float = 0.0
    command: str = ""

    def remit_ok(self) -> bool:
        """True when every Remit column ran and none of its cells failed.

        N/A cells (the framework cannot express the scenario) do not fail the
        run, and are never counted as PASS.
        """
        return all(
            not c.note and all(r.status in ("PASS", "N/A") for r in c.cells.values())
            for c in self.columns
            if c.kind == "remit"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "repeat": self.repeat,
            "elapsed_seconds": round(self.elapsed, 1),
            "notes": self.notes,
            "cells": [dataclasses.asdict(BY_ID[i]) for i in self.cells],
            "columns": [
                {
                    "framework": c.framework,
                    "target": c.target,
                    "label": c.label,
                    "kind": c.kind,
                    "note": c.note,
                    "verdict": c.verdict(),
                    "results": [dataclasses.asdict(r) for r in c.cells.values()],
                }
                for c in self.columns
            ],
            "remit_ok": self.remit_ok(),
        }


def discover(frameworks: Sequence[str] | None = None) -> tuple[list[ProbeAdapter], list[str]]:
    """Installed adapters (entry point group `remit.probe_adapters`), preloaded.

    An adapter whose framework cannot be imported is skipped with a note.
    """
    wanted = list(frameworks or ())
    notes: list[str] = []
    adapters: list[ProbeAdapter] = []
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    for name in wanted:
        if name not in found:
            notes.append(
                f"{name}: no probe adapter installed (known: {', '.join(sorted(found)) or 'none'})"
            )
    for name, ep in sorted(found.items()):
        if wanted and name not in wanted:
            continue
        try:
            adapter = ep.load()
            adapter.preload()
        except ImportError as exc:
            notes.append(f"{name}: skipped, its adapter or framework is not importable ({exc})")
            continue
        if not isinstance(adapter, ProbeAdapter):
            notes.append(f"{name}: skipped, {ep.value} is not a ProbeAdapter")
            continue
        adapters.append(adapter)
    return adapters, notes


def _reach(target: Target) -> None:
    """In a forked process: open the target's store or server once (raises if it cannot)."""
    if target.kind == "remit":
        from remit_core.stores import open_store

        open_store(target.url).close()
        return
    import psycopg

    with psycopg.connect(target.url, connect_timeout=int(REACH_TIMEOUT)) as conn:
        conn.execute("SELECT 1")


def unreachable(spec: str, timeout: float = REACH_TIMEOUT) -> str | None:
    """Why the store or server `spec` names cannot be used; None when it answers.

    Checked once before the matrix so that a server that is down, or a bad
    store option, is one clear error rather than a FAIL in every cell. The
    check runs in a forked process: the parent opens no connection pool and
    stays fork-safe, and a server that never answers costs `timeout` at most.
    """
    target = Target.parse(spec, Path("."), "reach")
    if spec in ("vanilla", "sqlite", "remit"):
        return None  # a fresh file in the run's own folder
    if target.engine == "sqlite":
        from remit_core.conformance.storage import sqlite_path

        parent = sqlite_path(target.url).parent
        if not parent.is_dir():
            return f"{spec}: folder {parent} does not exist"
    if target.kind == "vanilla" and target.engine != "postgresql":
        return None  # the adapter says whether its framework has such a backend
    outcome = fork(functools.partial(_reach, target)).wait(timeout)
    if outcome.ok:
        return None
    if outcome.status == "timeout":
        return f"{spec}: no answer within {timeout:.0f}s"
    return f"{spec}: {outcome.summary()}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:40] or "x"


def _unique_slugs(specs: Sequence[str]) -> dict[str, str]:
    """A folder name per target, distinct even where two specs slug alike (long URLs)."""
    out: dict[str, str] = {}
    for spec in specs:
        slug, n = _slug(spec), 1
        while slug in out.values():
            n += 1
            slug = f"{_slug(spec)}-{n}"
        out[spec] = slug
    return out


@dataclass
class _Job:
    column: Column
    adapter: ProbeAdapter
    scenario: str
    rep: int
    folder: Path
    worker: Worker | None = None
    started: float = 0.0


def _scenario_body(job: _Job, lease: float) -> dict[str, Any]:
    """In the scenario process: run one scenario and return its verdicts as plain data."""
    os.setpgid(0, 0)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the parent's handlers are not ours
        signal.signal(sig, signal.SIG_DFL)
    job.folder.mkdir(parents=True, exist_ok=True)
    log = os.open(job.folder / "scenario.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):  # what the framework prints stays with the scenario, off the terminal
        os.dup2(log, fd)
    os.close(log)
    ctx = Context(job.adapter, job.column.target, job.folder, lease=lease)
    try:
        verdicts = RUNNERS[job.scenario](ctx)
    except ScenarioNotApplicable as exc:
        return {"na": str(exc)}
    except LateNotApplicable as exc:
        return {"crashed": f"N/A declared too late: {exc}"}
    except WorkerCrashed as exc:
        return {"crashed": str(exc)}
    finally:
        ctx.close()
    return {"verdicts": {str(k): dataclasses.asdict(v) for k, v in verdicts.items()}}


def _kill_group(pid: int) -> None:
    for sig in (signal.SIGKILL, signal.SIGCONT):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def run_matrix(
    adapters: Sequence[ProbeAdapter],
    targets: Sequence[str],
    cells: Sequence[Cell],
    folder: Path,
    *,
    repeat: int = 1,
    lease: float = 2.0,
    jobs: int = 3,
    notes: Sequence[str] = (),
    progress: Callable[[int, int, str], None] | None = None,
) -> Matrix:
    """Run `cells` for every adapter on every target; scenarios in forked processes."""
    started = time.monotonic()
    matrix = Matrix([c.id for c in cells], [], list(notes), repeat)
    scenarios = [s for s in SCENARIOS if any(c.scenario == s for c in cells)]
    queue: list[_Job] = []
    targets = list(dict.fromkeys(targets))  # a target named twice is one column
    slugs = _unique_slugs(targets)
    for adapter in adapters:
        for spec in targets:
            col_folder = folder / _slug(adapter.framework) / slugs[spec]
            probe_target = Target.parse(spec, col_folder, "probe")
            column = Column(
                adapter.framework, spec, adapter.describe(probe_target), probe_target.kind
            )
            matrix.columns.append(column)
            column.note = adapter.unsupported(probe_target)
            if column.note:
                continue
            na = dict(adapter.not_applicable(probe_target))
            for cell in cells:
                if cell.id in na:
                    column.cells[cell.id] = _not_applicable(cell.id, na[cell.id])
            for scenario in scenarios:
                todo = [c for c in cells if c.scenario == scenario and c.id not in na]
                if not todo:
                    continue
                for rep in range(repeat if scenario in RACY else 1):
                    queue.append(
                        _Job(
                            column, adapter, scenario, rep, col_folder / f"{_slug(scenario)}-{rep}"
                        )
                    )
    raw: dict[tuple[int, int], list[dict[str, Any]]] = {}
    total, done = len(queue), 0
    running: list[_Job] = []
    try:
        while queue or running:
            while queue and len(running) < max(1, jobs):
                job = queue.pop(0)
                job.started = time.monotonic()
                job.worker = fork(functools.partial(_scenario_body, job, lease))
                # Also set from here: a kill before the child's own setpgid still reaches its group.
                with contextlib.suppress(OSError):
                    os.setpgid(job.worker.pid, job.worker.pid)
                running.append(job)
            for job in list(running):
                assert job.worker is not None
                outcome = job.worker.poll()
                if outcome is None and time.monotonic() - job.started > SCENARIO_TIMEOUT:
                    _kill_group(job.worker.pid)
                    job.worker.wait(30)
                    outcome = Outcome("timeout")  # (stopped here: not a crash of the target)
                if outcome is None:
                    continue
                running.remove(job)
                _kill_group(job.worker.pid)  # no worker outlives its scenario
                done += 1
                _collect(raw, matrix.columns.index(job.column), job, outcome, set(matrix.cells))
                if progress is not None:
                    progress(done, total, f"{job.column.label}: {job.scenario}")
            time.sleep(0.02)
    finally:
        for job in running:
            if job.worker is not None:
                _kill_group(job.worker.pid)
                with contextlib.suppress(ChildProcessError):
                    job.worker.wait(10)
    for (col_index, cell_id), runs in raw.items():
        matrix.columns[col_index].cells[cell_id] = _aggregate(cell_id, runs)
    for column in matrix.columns:
        column.cells = dict(sorted(column.cells.items()))
    matrix.elapsed = time.monotonic() - started
    return matrix


def _collect(
    raw: dict[tuple[int, int], list[dict[str, Any]]],
    col: int,
    job: _Job,
    outcome: Any,
    selected: set[int],
) -> None:
    wanted = [c.id for c in BY_ID.values() if c.scenario == job.scenario and c.id in selected]
    if outcome.ok and "na" in outcome.value:
        reason = str(outcome.value["na"]).strip()
        for cell_id in wanted:
            raw.setdefault((col, cell_id), []).append(
                {"na": reason} if reason else {"error": NO_REASON}
            )
        return
    if outcome.ok and "crashed" in outcome.value:
        for cell_id in wanted:
            raw.setdefault((col, cell_id), []).append(
                {"error": f"scenario failed: {outcome.value['crashed']}"}
            )
        return
    if not outcome.ok:
        detail = outcome.summary()
        if outcome.status == "timeout":
            detail = f"no verdict within {SCENARIO_TIMEOUT:g} s; the scenario was stopped"
        if outcome.error and outcome.error.get("traceback"):
            print(outcome.error["traceback"], file=sys.stderr)
        for cell_id in wanted:
            raw.setdefault((col, cell_id), []).append({"error": f"scenario failed: {detail}"})
        return
    for key, verdict in outcome.value["verdicts"].items():
        if int(key) in wanted:
            raw.setdefault((col, int(key)), []).append(verdict)


def _not_applicable(cell_id: int, reason: object) -> CellResult:
    """N/A with the adapter's reason; ERROR when it gave none (the matrix prints why)."""
    text = str(reason or "").strip()
    return CellResult(cell_id, "N/A", text) if text else CellResult(cell_id, "ERROR", NO_REASON)


def _aggregate(cell_id: int, runs: list[dict[str, Any]]) -> CellResult:
    """One cell's result over its runs: N/A, then FAIL if any run failed (a failure seen
    is a failure, even if another run could not be judged), then ERROR, then PASS."""
    na = [r for r in runs if "na" in r]
    if na:
        return CellResult(cell_id, "N/A", na[0]["na"], runs=len(runs))
    errors = [r for r in runs if "error" in r]
    judged = [r for r in runs if "error" not in r]
    failed = [r for r in judged if not r["passed"] and not r.get("inconclusive")]
    # A race whose racers did not overlap proves nothing: never a PASS from timing luck.
    untested = [r for r in judged if r.get("inconclusive")]
    if errors and not failed:
        return CellResult(
            cell_id, "ERROR", errors[0]["error"], runs=len(runs), failed_runs=len(errors)
        )
    if untested and not failed:
        return CellResult(
            cell_id,
            "ERROR",
            untested[0]["measured"],
            runs=len(runs),
            failed_runs=len(untested),
        )
    sats = [r["saturation"] for r in judged if r.get("saturation") is not None]
    shown = failed[0] if failed else judged[-1]
    measured = shown["measured"]
    if len(runs) > 1 and failed:
        unjudged = len(errors) + len(untested)
        also = f" ({unjudged} could not be judged)" if unjudged else ""
        measured = f"{len(failed)}/{len(runs)} runs failed{also}; {measured}"
    return CellResult(
        cell_id,
        "FAIL" if failed else "PASS",
        measured,
        max(sats) if sats else None,
        runs=len(runs),
        failed_runs=len(failed),
    )
