"""LlamaIndex probe round 47: `@effect` in the steps a workflow server runs on
`RemitWorkflowStore`.

Fixed: an `@effect` in a served step raised `RemitError` ("called outside a Remit
step") and the handler failed; the server's store saw ticks and state but gave a step
no effect scope. A served step's effects are now recorded in the run's ledger under
the claim (fence) the store holds on the run, keyed by the step execution's work item,
which the server's replay of the journal gives back: a server SIGKILLed after the
effect applied, or between its intent and its outcome, is followed by a server on the
same store that runs the step again without applying the effect again (P2, P6), and
the run ends as an unkilled run does.

Held (kept as regression tests): each work item of a step gets keys of its own (a
step in a loop, a step run for two events, with the same arguments: applied once per
work item); a step retried by its `retry_policy` after it applied an effect gets the
recorded outcome on the retry (once per work item, as under `RemitRuntime`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from llamaindex_sink import DIR_VAR, KILL_VAR, applied, die_at, enter, entered, pay, payments
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_llamaindex import RemitWorkflowStore

GUARD = 60
TESTS = str(Path(__file__).parent)


class Again(Event):
    paid: list[str]


class Rounds(Workflow):
    """`charge` runs twice in a loop, paying for the same thing each round."""

    @step
    async def charge(self, ev: StartEvent | Again) -> Again | StopEvent:
        paid = list(ev.paid) if isinstance(ev, Again) else []
        n = len(paid)
        enter(f"charge{n}")
        paid.append(pay("round"))
        die_at(f"paid{n}")
        return Again(paid=paid) if n < 1 else StopEvent(result=",".join(paid))


class Item(Event):
    n: int


class Bought(Event):
    what: str


class Fanned(Workflow):
    """`start` sends two items; `buy` runs once for each (same arguments); `gather` ends."""

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        ctx.send_event(Item(n=0))
        ctx.send_event(Item(n=1))

    @step
    async def buy(self, ev: Item) -> Bought:
        enter(f"buy{ev.n}")
        return Bought(what=pay("item"))

    @step
    async def gather(self, ctx: Context, ev: Bought) -> StopEvent | None:
        got = ctx.collect_events(ev, [Bought, Bought])
        return None if got is None else StopEvent(result=",".join(b.what for b in got))


class Flaky(Workflow):
    """`charge` pays, then fails on its first attempt; its retry policy runs it again."""

    @step(retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(3)))
    async def charge(self, ev: StartEvent) -> StopEvent:
        enter("charge")
        paid = pay("retried")
        if entered(Path(os.environ[DIR_VAR])).count("charge") == 1:
            raise RuntimeError("first attempt fails after paying")
        return StopEvent(result=paid)


class PayThenAsk(Workflow):
    """`charge` pays, then waits for an answer: the framework runs it again from its
    top once the answer comes, and the payment must not be made again."""

    @step
    async def charge(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("charge")
        paid = pay("asked")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=f"{paid}:{answer.response}")


class SyncStep(Workflow):
    """A plain (not async) step that pays."""

    @step
    def charge(self, ev: StartEvent) -> StopEvent:
        enter("charge")
        return StopEvent(result=pay("sync"))


def outcome(done: dict[str, Any]) -> tuple[Any, Any]:
    """A handler's status and result (a `StopEvent` the server gives whole, or its value)."""
    result = done.get("result")
    if isinstance(result, dict) and result.get("type") == "StopEvent":
        result = result["value"]["result"]
    return done.get("status"), result


def served(store: RemitWorkflowStore) -> Any:
    from llama_agents.server import WorkflowServer

    server = WorkflowServer(workflow_store=store)
    server.add_workflow("rounds", Rounds(timeout=None))
    server.add_workflow("fanned", Fanned(timeout=None))
    server.add_workflow("flaky", Flaky(timeout=None))
    server.add_workflow("sync", SyncStep(timeout=None))
    server.add_workflow("ask", PayThenAsk(timeout=None), additional_events=[HumanResponseEvent])
    return server


async def run_to_end(store: RemitWorkflowStore, name: str) -> dict[str, Any]:
    server = served(store)
    async with server.contextmanager():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            done = await client.post(f"/workflows/{name}/run", json={"start_event": {}})
            return dict(done.json())


@pytest.mark.parametrize(
    ("name", "result", "paid", "steps"),
    [
        ("rounds", "round,round", ["round", "round"], ["charge0", "charge1"]),
        ("fanned", "item,item", ["item", "item"], ["buy0", "buy1"]),
        ("flaky", "retried", ["retried"], ["charge", "charge"]),
        ("sync", "sync", ["sync"], ["charge"]),
    ],
)
def test_a_served_steps_effects_apply_once_per_work_item(
    store_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    result: str,
    paid: list[str],
    steps: list[str],
) -> None:
    """P2: a step in a loop and a step run for two events pay once per execution (the
    same arguments, each execution its own keys); a step retried by its retry policy
    after paying gets the recorded outcome on the retry, and does not pay again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    store = RemitWorkflowStore(store_url, namespace=uuid.uuid4().hex[:8])
    done = asyncio.run(asyncio.wait_for(run_to_end(store, name), GUARD))
    assert outcome(done) == ("completed", result), done
    assert applied(tmp_path) == paid
    assert sorted(entered(tmp_path)) == sorted(steps)
    keys = [line.split()[0] for line in payments(tmp_path)]
    assert len(set(keys)) == len(keys), keys


def test_a_served_step_run_again_for_its_answer_does_not_pay_again(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P2: a served step that pays and then waits for an answer runs again from its top
    when the answer comes (as the framework re-runs a waiting step); the payment made
    before the wait comes back from the ledger, not paid again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))

    async def go() -> dict[str, Any]:
        store = RemitWorkflowStore(store_url, namespace=uuid.uuid4().hex[:8])
        server = served(store)
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                body = {"start_event": {}}
                started = (await client.post("/workflows/ask/run-nowait", json=body)).json()
                run_id, handler_id = started["run_id"], started["handler_id"]
                while not any(
                    "InputRequired" in e.event.type for e in await store.query_events(run_id)
                ):
                    await asyncio.sleep(0.02)
                answer = {"type": "HumanResponseEvent", "value": {"response": "yes"}}
                sent = await client.post(f"/events/{handler_id}", json={"event": answer})
                assert sent.status_code == 200, sent.text
                while True:
                    result = (await client.get(f"/results/{handler_id}")).json()
                    if result.get("status") != "running":
                        return dict(result)
                    await asyncio.sleep(0.05)

    done = asyncio.run(asyncio.wait_for(go(), GUARD))
    assert outcome(done) == ("completed", "asked:yes"), done
    assert entered(tmp_path) == ["charge", "charge"]
    assert applied(tmp_path) == ["asked"]


KILLED_SERVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
import httpx
from remit_llamaindex import RemitWorkflowStore
from {module} import served

async def main():
    server = served(RemitWorkflowStore({url!r}, namespace={ns!r}, lease={lease!r}))
    async with server.contextmanager():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            await client.post("/workflows/{workflow}/run-nowait", json={{"start_event": {{}}}})
            await asyncio.sleep(600)

asyncio.run(main())
"""


async def resumed(server: Any) -> dict[str, Any]:
    """Start `server`, which resumes the one handler its store holds, and wait for the
    handler's end: its result."""
    async with server.contextmanager():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            [handler] = (await client.get("/handlers")).json()["handlers"]
            deadline = time.monotonic() + GUARD
            while time.monotonic() < deadline:
                result = (await client.get(f"/results/{handler['handler_id']}")).json()
                if result.get("status") != "running":
                    return dict(result)
                await asyncio.sleep(0.1)
            raise AssertionError("the resumed run did not end")


#: Where the first server dies in the second round: after the effect's outcome is
#: recorded (the sink's `die_at`), or after it applied with no outcome recorded (a
#: Remit failpoint on the second effect: in doubt, answered by `reconcile`).
KILLS = {
    "after_outcome": {KILL_VAR: "paid1"},
    "between_intent_and_outcome": {"REMIT_FAILPOINTS": "effect.after_apply=kill@2"},
}


@pytest.mark.parametrize("kill", sorted(KILLS))
def test_a_server_killed_after_the_effect_applied_is_resumed_without_applying_it_again(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str
) -> None:
    """P2, P6: a server process running `Rounds` is SIGKILLed in the second round after
    `pay` applied; a server started on the same store resumes the run (once the dead
    server's lease ran out), runs the second round's step again, and it gets the
    effect's outcome from the ledger (or reconciled) instead of paying again: paid once
    per round, with the keys of the first server, and the result of an unkilled run."""
    import llama_agents.server.server as server_module

    # Resume the handler though it was started moments ago (the server leaves a run
    # started within its grace for the next restart).
    monkeypatch.setattr(server_module, "RESUME_FRESH_HANDLER_GRACE", timedelta(0))
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    ns, lease = uuid.uuid4().hex[:8], 2.0
    code = KILLED_SERVER.format(
        tests=TESTS,
        module="test_llamaindex_probes47",
        workflow="rounds",
        url=store_url,
        ns=ns,
        lease=lease,
    )
    env = {**os.environ, DIR_VAR: str(tmp_path), **KILLS[kill]}
    first = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=GUARD
    )
    assert first.returncode == -9, first.stderr[-2000:]
    assert (entered(tmp_path), applied(tmp_path)) == (["charge0", "charge1"], ["round", "round"])
    keys_before = [line.split()[0] for line in payments(tmp_path)]

    result = asyncio.run(resumed(served(RemitWorkflowStore(store_url, namespace=ns, lease=lease))))
    assert outcome(result) == ("completed", "round,round"), result
    assert entered(tmp_path) == ["charge0", "charge1", "charge1"]
    assert [line.split()[0] for line in payments(tmp_path)] == keys_before
    assert len(set(keys_before)) == 2


ZOMBIE_SERVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
import httpx
from remit_llamaindex import RemitWorkflowStore
from test_llamaindex_probes47 import served

async def main():
    store = RemitWorkflowStore({url!r}, namespace={ns!r}, lease={lease!r})
    server = served(store)
    async with server.contextmanager():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            await client.post("/workflows/rounds/run-nowait", json={{"start_event": {{}}}})
            while not store._stopped or store._runs:
                await asyncio.sleep(0.05)
            print("STOPPED", flush=True)

asyncio.run(main())
"""


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP: its state in /proc reads "T")."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


async def handlers(store_url: str, ns: str) -> list[Any]:
    from llama_agents.server._store.abstract_workflow_store import HandlerQuery

    return await RemitWorkflowStore(store_url, namespace=ns).query(HandlerQuery())


def test_a_zombie_servers_effect_is_fenced_by_the_claim_it_lost(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2, P2: a server is SIGSTOPped in `charge` just before the effect records its
    intent, past its lease, and its run's claim is taken over. Continued, the server
    goes on with the fence of the claim it lost: its effect is refused, nothing is paid,
    and its run stops there. A server started on the store once the claim is free again
    resumes the run and completes it, paying once per round."""
    import signal

    import llama_agents.server.server as server_module

    from remit_core import connect
    from remit_core.errors import ResumeConflict

    monkeypatch.setattr(server_module, "RESUME_FRESH_HANDLER_GRACE", timedelta(0))
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    ns, lease = uuid.uuid4().hex[:8], 2.0
    code = ZOMBIE_SERVER.format(tests=TESTS, url=store_url, ns=ns, lease=lease)
    env = {**os.environ, DIR_VAR: str(tmp_path), "REMIT_FAILPOINTS": "effect.before_intent=stop"}
    zombie = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    remit = connect(store_url, lease=lease)
    try:
        deadline = time.monotonic() + GUARD
        while not stopped(zombie.pid):
            assert zombie.poll() is None and time.monotonic() < deadline, zombie.communicate()
            time.sleep(0.05)
        [handler] = asyncio.run(handlers(store_url, ns))
        while True:  # the zombie's lease runs out: its claim is taken over
            try:
                claim = remit.claim(handler.run_id, "server")
                break
            except ResumeConflict:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        zombie.send_signal(signal.SIGCONT)
        out, err = zombie.communicate(timeout=GUARD)
        assert out.startswith("STOPPED"), err[-2000:]
        assert (entered(tmp_path), applied(tmp_path)) == (["charge0"], [])
        claim.release()

        async def resume() -> dict[str, Any]:
            server = served(RemitWorkflowStore(store_url, namespace=ns, lease=lease))
            async with server.contextmanager():
                transport = httpx.ASGITransport(app=server.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                    while time.monotonic() < deadline:
                        result = (await client.get(f"/results/{handler.handler_id}")).json()
                        if result.get("status") != "running":
                            return dict(result)
                        await asyncio.sleep(0.1)
                    raise AssertionError("the resumed run did not end")

        result = asyncio.run(resume())
    finally:
        if zombie.poll() is None:
            zombie.kill()
            zombie.wait()
        remit.close()
    assert outcome(result) == ("completed", "round,round"), result
    assert applied(tmp_path) == ["round", "round"]
    assert entered(tmp_path) == ["charge0", "charge0", "charge1"]


#: Opened by the test once a second server of this process waits to take the run over.
GATE: dict[str, asyncio.Event] = {}


class Held(Workflow):
    """`charge` pays once the test opens its gate; `nudge` takes the answer posted to
    the other server (doing nothing with it)."""

    @step
    async def charge(self, ev: StartEvent) -> StopEvent:
        enter("charge")
        await GATE["open"].wait()
        return StopEvent(result=pay("held"))

    @step
    async def nudge(self, ev: HumanResponseEvent) -> None:
        enter("nudge")


def test_a_served_step_pays_under_its_servers_claim_while_another_server_waits_for_it(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers of one process on one store: an event posted to the second reloads
    the run the first drives, and the second waits (a lease) for the claim the first
    holds. A step of the first that pays meanwhile pays under the first's claim, once;
    the second is refused the run, and the run completes on the first."""
    from llama_agents.server import WorkflowServer

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    ns, lease = uuid.uuid4().hex[:8], 3.0

    def server(store: RemitWorkflowStore) -> Any:
        made = WorkflowServer(workflow_store=store)
        made.add_workflow("held", Held(timeout=None), additional_events=[HumanResponseEvent])
        return made

    async def go() -> tuple[dict[str, Any], bool]:
        GATE["open"] = asyncio.Event()
        first = RemitWorkflowStore(store_url, namespace=ns, lease=lease)
        second = RemitWorkflowStore(store_url, namespace=ns, lease=lease)
        a, b = server(first), server(second)
        async with a.contextmanager(), b.contextmanager():
            ta, tb = httpx.ASGITransport(app=a.app), httpx.ASGITransport(app=b.app)
            async with (
                httpx.AsyncClient(transport=ta, base_url="http://a") as client_a,
                httpx.AsyncClient(transport=tb, base_url="http://b") as client_b,
            ):
                body = {"start_event": {}}
                started = (await client_a.post("/workflows/held/run-nowait", json=body)).json()
                run_id, handler_id = started["run_id"], started["handler_id"]
                while "charge" not in entered(tmp_path):
                    await asyncio.sleep(0.02)
                answer = {"type": "HumanResponseEvent", "value": {"response": "x"}}
                await client_b.post(f"/events/{handler_id}", json={"event": answer})
                while run_id not in second._runs:
                    await asyncio.sleep(0.01)
                GATE["open"].set()
                while True:
                    result = (await client_a.get(f"/results/{handler_id}")).json()
                    if result.get("status") != "running":
                        break
                    await asyncio.sleep(0.05)
                while run_id not in second._stopped:
                    await asyncio.sleep(0.05)
                return dict(result), run_id in first._stopped

    result, first_stopped = asyncio.run(asyncio.wait_for(go(), GUARD))
    assert outcome(result) == ("completed", "held"), result
    assert not first_stopped
    assert applied(tmp_path) == ["held"]
    assert "nudge" not in entered(tmp_path)
