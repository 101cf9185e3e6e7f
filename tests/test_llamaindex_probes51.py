"""LlamaIndex probe round 51: effects a served step calls in threads or tasks of its own.

A step a workflow server runs on a `RemitWorkflowStore` finds its effect scope through
the core's resolver, which keeps the scope it finds in the calling context. A step
that hands its calls to `asyncio.gather` or `asyncio.to_thread` before its first
effect runs them in copies of its context, which each found a scope of their own and
numbered their calls from 0: every call after the first got the first call's key and
outcome and was never applied (P2, silently: the step returned the first call's
outcome for each). The served scope is now one per step execution (the framework's
context of that execution), shared by the threads and tasks the step starts; a step
retried by its retry policy is a new execution and gets the recorded outcomes of the
attempt before it. Checked against a real server on SQLite, PostgreSQL and Redis,
unkilled, retried, and SIGKILLed after the gathered calls applied.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from llamaindex_sink import DIR_VAR, KILL_VAR, applied, die_at, enter, entered, pay, payments
from test_llamaindex_probes47 import KILLED_SERVER, outcome, resumed
from workflows import Workflow, step
from workflows.events import StartEvent, StopEvent
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core import effect
from remit_llamaindex import RemitWorkflowStore

GUARD = 60
TESTS = str(Path(__file__).parent)


@effect(idempotent=True)
async def apay(what: str, *, idempotency_key: str) -> str:
    """`pay` as an async effect (it yields to the loop first, so gathered calls interleave)."""
    await asyncio.sleep(0.01)
    return pay(what)


async def four_calls() -> list[str]:
    """Two sync effects in threads and two async effects in tasks, each started before
    any effect of the step ran."""
    threads = await asyncio.gather(asyncio.to_thread(pay, "t1"), asyncio.to_thread(pay, "t2"))
    tasks = await asyncio.gather(apay("g1"), apay("g2"))
    return [*threads, *tasks]


class Gathered(Workflow):
    @step
    async def charge(self, ev: StartEvent) -> StopEvent:
        enter("charge")
        paid = await four_calls()
        die_at("gathered")
        return StopEvent(result=",".join(paid))


class GatheredFlaky(Workflow):
    """Pays four times at once, then fails its first attempt: the retry pays nothing."""

    @step(retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(3)))
    async def charge(self, ev: StartEvent) -> StopEvent:
        enter("charge")
        paid = await four_calls()
        if entered(Path(os.environ[DIR_VAR])).count("charge") == 1:
            raise RuntimeError("first attempt fails after paying")
        return StopEvent(result=",".join(paid))


def served(store: RemitWorkflowStore) -> Any:
    from llama_agents.server import WorkflowServer

    server = WorkflowServer(workflow_store=store)
    server.add_workflow("gathered", Gathered(timeout=None))
    server.add_workflow("flaky", GatheredFlaky(timeout=None))
    return server


async def run_to_end(store: RemitWorkflowStore, name: str) -> dict[str, Any]:
    server = served(store)
    async with server.contextmanager():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            done = await client.post(f"/workflows/{name}/run", json={"start_event": {}})
            return dict(done.json())


def keys(tmp: Path) -> list[str]:
    return [line.split()[0] for line in payments(tmp)]


@pytest.mark.parametrize(("name", "steps"), [("gathered", 1), ("flaky", 2)])
def test_a_served_steps_calls_in_threads_and_tasks_each_apply_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, steps: int
) -> None:
    """P2: each of the four calls is applied once under a key of its own, and the step
    returns each call's own outcome; a retried step's attempt after the first applies
    none of them again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    store = RemitWorkflowStore(store_url, namespace=uuid.uuid4().hex[:8])
    done = asyncio.run(asyncio.wait_for(run_to_end(store, name), GUARD))
    assert outcome(done) == ("completed", "t1,t2,g1,g2"), done
    assert entered(tmp_path) == ["charge"] * steps
    assert sorted(applied(tmp_path)) == ["g1", "g2", "t1", "t2"], payments(tmp_path)
    assert len(set(keys(tmp_path))) == 4


def test_a_server_killed_after_the_gathered_calls_applied_pays_none_again(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P2, P6: the server is SIGKILLed after the step's four calls applied, before the
    step returned; a server started on the same store runs the step again: nothing is
    applied again, the keys are the first server's, and the run ends as an unkilled
    one does."""
    import llama_agents.server.server as server_module

    monkeypatch.setattr(server_module, "RESUME_FRESH_HANDLER_GRACE", timedelta(0))
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    ns, lease = uuid.uuid4().hex[:8], 2.0
    code = KILLED_SERVER.format(
        tests=TESTS,
        module="test_llamaindex_probes51",
        workflow="gathered",
        url=store_url,
        ns=ns,
        lease=lease,
    )
    env = {**os.environ, DIR_VAR: str(tmp_path), KILL_VAR: "gathered"}
    first = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=GUARD
    )
    assert first.returncode == -9, first.stderr[-2000:]
    assert sorted(applied(tmp_path)) == ["g1", "g2", "t1", "t2"], payments(tmp_path)
    before = sorted(keys(tmp_path))
    assert len(set(before)) == 4

    result = asyncio.run(resumed(served(RemitWorkflowStore(store_url, namespace=ns, lease=lease))))
    status, paid = outcome(result)
    assert status == "completed", result
    # Calls run at once may reach their effects in another order on the replay (each
    # then gets the outcome recorded under its number); none is applied again.
    assert sorted(paid.split(",")) == ["g1", "g2", "t1", "t2"], result
    assert entered(tmp_path) == ["charge", "charge"]
    assert sorted(keys(tmp_path)) == before
