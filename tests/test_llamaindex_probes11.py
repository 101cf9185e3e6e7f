"""LlamaIndex probes, round 11, on SQLite, PostgreSQL and Redis: a driver SIGKILLed
after each of its first commits in turn (a run's first checkpoint was its session
start, stored without its start event: a child run started again after the crash
waited for ever, so its parent's handler never finished, and a recovered top-level
run started over under another id with an empty start event).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, enter, entered, pay, payments
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.events import HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 20
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe11-{uuid.uuid4().hex[:12]}"


applied = payments


async def recovered(rt: RemitRuntime, flow: Workflow, run: str) -> Any:
    """`rt.recover` once the dead holder's lease has run out."""
    deadline = time.monotonic() + GUARD
    while True:
        try:
            return rt.recover(flow, run)
        except ResumeConflict:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)


def run_driver(code: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- a driver killed after each of its first commits ----------------------------------


class Sub(Workflow):
    """A child run: pays for `what`."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def charge(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter(f"sub:{ev.get('what')}")
        return StopEvent(result=pay(f"sub:{ev.get('what')}"))


class Nest(Workflow):
    """`fan` starts one `Sub` child per name and returns what they paid."""

    def __init__(self, rt: RemitRuntime, **kw: Any) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt = rt

    @step
    async def fan(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("fan")
        handlers = [Sub(runtime=self.rt).run(what=name) for name in ev.get("names")]
        return StopEvent(result=sorted(await asyncio.gather(*handlers)))


NEST_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes11 import Nest

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    print("RESULT", await Nest(rt).run(run_id={run!r}, names=["a"]), flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("commit", [1, 2, 3])
def test_a_driver_killed_after_an_early_commit_is_recovered(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commit: int
) -> None:
    """L1, P1, P2: the driver of a parent whose step starts a child is SIGKILLed right
    after its `commit`-th checkpoint commit (the parent's first, then the child's).
    Recovering the parent, under its own id, finishes it with the child's result; the
    child pays once. (Before, a run's first checkpoint held its session start and not
    its start event: killed there, the child started again waited for ever, and the
    parent recovered after its own first commit started over under another id.)"""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = NEST_DRIVER.format(tests=TESTS, url=store_url, run=run)
    dead = run_driver(code, tmp_path, REMIT_FAILPOINTS=f"checkpoint.after_commit=kill@{commit}")
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)

    async def take_over() -> tuple[str, Any]:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Nest(rt), run)
        assert handler is not None
        return handler.run_id, await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(take_over()) == (run, ["sub:a"])
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed" and rt.result(run) == ["sub:a"]
    assert [line.split()[1] for line in applied(tmp_path)] == ["sub:a"]
    assert entered(tmp_path).count("sub:a") <= 2


# -- an answer sent while the parking process still holds the claim -------------------


class Names(BaseModel):
    n: int = 0
    names: list[str] = []


class Ask(Workflow):
    """`start` asks for a name (`InputRequiredEvent`); `answer` takes the
    `HumanResponseEvent`; both edit the typed state and pay."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context[Names], ev: StartEvent) -> InputRequiredEvent:
        enter("start")
        async with ctx.store.edit_state() as state:
            state.n += 1
        pay("start")
        return InputRequiredEvent(prefix="name?")

    @step
    async def answer(self, ctx: Context[Names], ev: HumanResponseEvent) -> StopEvent:
        enter("answer")
        async with ctx.store.edit_state() as state:
            state.n += 1
            state.names.append(ev.response)
        pay(f"answer:{ev.response}")
        return StopEvent(result=(await ctx.store.get_state()).names)


ASK_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from remit_llamaindex.probe import _settle
from test_llamaindex_probes11 import Ask

async def main():
    rt = RemitRuntime({url!r})
    print(await _settle(Ask(runtime=rt).run(run_id={run!r})), flush=True)

asyncio.run(main())
"""


def test_an_answer_sent_as_the_head_parks_waits_for_the_parking_claim(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5 with one resumer: the parking process commits the "waiting" head, then (held up
    here for 2 s after the commit) releases its claim. An answer sent from another
    process as soon as the head reads "waiting" is delivered once the claim is free,
    not refused; the run finishes with it, each payment once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = ASK_DRIVER.format(tests=TESTS, url=store_url, run=run)
    driver = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "REMIT_FAILPOINTS": "checkpoint.after_commit=sleep:2@2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        async def answer() -> Any:
            rt = RemitRuntime(store_url)
            deadline = time.monotonic() + GUARD
            while not rt.remit.branch(run) or rt.status(run) != "waiting":
                assert time.monotonic() < deadline and driver.poll() is None
                await asyncio.sleep(0.02)
            # (The window this test is about: the parked head with the claim still held.)
            claim = rt.remit.store.get_claim(run, "main")
            assert claim is not None and claim.expires_at > time.time()
            handler = await rt.respond(Ask(runtime=rt), run, HumanResponseEvent(response="ada"))
            return await asyncio.wait_for(handler, GUARD)

        assert asyncio.run(answer()) == ["ada"]
    finally:
        out, err = driver.communicate(timeout=60)
    assert out.strip() == "paused", (out, err)
    rt = RemitRuntime(store_url)
    assert rt.get_state(Ask(runtime=rt), run) == Names(n=2, names=["ada"])
    assert sorted(line.split()[1] for line in applied(tmp_path)) == ["answer:ada", "start"]
    assert entered(tmp_path) == ["start", "answer"]
