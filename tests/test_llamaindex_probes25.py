"""LlamaIndex probes, round 25: the workflow server on Remit, on SQLite, PostgreSQL and Redis.

A server process SIGKILLed while a step ran, and started again on the same store
before the dead process's lease ran out (a supervisor restarts it at once), found
the run's claim still held: the resumed run's first write was refused with
`ResumeConflict`, the store stopped the run for good in that process, and the
handler stayed "running" for ever, though its holder was dead (L1).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from llamaindex_sink import DIR_VAR, enter, entered
from workflows import Workflow, step
from workflows.events import Event, StartEvent, StopEvent

from remit_llamaindex import RemitWorkflowStore

TESTS = str(Path(__file__).parent)
GUARD = 30.0


class Prepared(Event):
    pass


class SlowFlow(Workflow):
    """`prepare`, then `work`, whose first entry hangs (the process is killed there)."""

    @step
    async def prepare(self, ev: StartEvent) -> Prepared:
        enter("prepare")
        return Prepared()

    @step
    async def work(self, ev: Prepared) -> StopEvent:
        enter("work")
        flag = Path(os.environ[DIR_VAR]) / "working.flag"
        if not flag.exists():
            flag.write_text("")
            await asyncio.sleep(600)
        return StopEvent(result="done")


def _server(store: RemitWorkflowStore, **kw: Any) -> Any:
    from llama_agents.server import WorkflowServer

    server = WorkflowServer(workflow_store=store, **kw)
    server.add_workflow("slow", SlowFlow(timeout=None))
    return server


async def _result(client: httpx.AsyncClient, handler_id: str, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        result = (await client.get(f"/results/{handler_id}")).json()
        if result.get("status") != "running" or time.monotonic() > deadline:
            return dict(result)
        await asyncio.sleep(0.1)


STARTER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
import httpx
from remit_llamaindex import RemitWorkflowStore
from test_llamaindex_probes25 import _server

async def main():
    server = _server(RemitWorkflowStore({url!r}, namespace={ns!r}, lease={lease!r}))
    async with server.contextmanager():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            started = await client.post("/workflows/slow/run-nowait", json={{"start_event": {{}}}})
            print(started.json()["handler_id"], flush=True)
            await asyncio.sleep(600)

asyncio.run(main())
"""


def _start_and_kill(url: str, ns: str, tmp: Path, lease: float) -> str:
    """A server process starts a `SlowFlow` run, and is SIGKILLed inside `work`."""
    code = STARTER.format(tests=TESTS, url=url, ns=ns, lease=lease)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + GUARD
        while not (tmp / "working.flag").exists():
            assert time.monotonic() < deadline and child.poll() is None, child.communicate()
            time.sleep(0.05)
        assert child.stdout is not None
        handler_id = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    return handler_id


def test_a_server_restarted_within_the_dead_servers_lease_resumes_the_run(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L1, P1: the server restarted at once on the store of a server killed mid-step
    takes the run over once the dead holder's lease runs out, and completes it:
    `prepare` is not entered again, `work` (in flight at the kill) once more."""
    import llama_agents.server.server as server_module

    # Resume the handler though it was started moments ago (the server's grace for
    # request races at start-up would leave it for the next restart).
    monkeypatch.setattr(server_module, "RESUME_FRESH_HANDLER_GRACE", timedelta(0))
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    ns, lease = uuid.uuid4().hex[:8], 2.0
    handler_id = _start_and_kill(store_url, ns, tmp_path, lease)

    async def restart() -> dict[str, Any]:
        server = _server(RemitWorkflowStore(store_url, namespace=ns, lease=lease))
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                return await _result(client, handler_id, lease + GUARD / 2)

    result = asyncio.run(restart())
    assert (result["status"], result.get("result")) == ("completed", "done"), result
    assert entered(tmp_path) == ["prepare", "work", "work"]


def test_a_live_servers_run_is_not_taken_over_by_a_reload_elsewhere(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait above is for a dead holder only: a second server that reloads a run a
    live server drives (an event posted to it) waits out one lease, finds the claim
    renewed, and is refused; the in-flight step is not run a second time."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    ns, lease = uuid.uuid4().hex[:8], 1.0
    code = STARTER.format(tests=TESTS, url=store_url, ns=ns, lease=lease)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    async def post_elsewhere(handler_id: str) -> tuple[int, str]:
        store = RemitWorkflowStore(store_url, namespace=ns, lease=lease)
        server = _server(store)
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                event = {"type": "Prepared", "value": {}}
                await client.post(f"/events/{handler_id}", json={"event": event})
                await asyncio.sleep(lease * 3)
                status = (await client.get(f"/handlers/{handler_id}")).json()["status"]
                return len(store._stopped), status

    try:
        deadline = time.monotonic() + GUARD
        while not (tmp_path / "working.flag").exists():
            assert time.monotonic() < deadline and child.poll() is None, child.communicate()
            time.sleep(0.05)
        assert child.stdout is not None
        handler_id = child.stdout.readline().strip()
        refused, status = asyncio.run(post_elsewhere(handler_id))
        assert child.poll() is None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (refused, status) == (1, "running")
    assert entered(tmp_path) == ["prepare", "work"]
