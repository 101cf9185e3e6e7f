"""LlamaIndex probes, round 28, on PostgreSQL and Redis: the store's server ending the
runtime's connections while an answer is delivered and the run goes on (PostgreSQL
backends terminated, Redis clients killed, at the core's failpoints). The user sees
`StoreUnavailable` or nothing (a transparent retry), and the run continued afterwards
ends with its answer, its effect applied once. No bug was found: these pin what holds.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, enter, entered, pay, payments
from store_cuts import cut_at, tagged
from workflows import Context, Workflow, step
from workflows.events import (
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core import StoreUnavailable
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime


def new_run() -> str:
    return f"probe28-{uuid.uuid4().hex[:12]}"


def applied(tmp: Path) -> list[str]:
    return [line.split()[1] for line in payments(tmp)]


# -- cutting the runtime's connections at a failpoint --------------------------------


@pytest.fixture
def cutting(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, str], list[int]]:
    """Arm: the next time the core reaches `point`, end the runtime's connections."""

    def arm(point: str, engine: str, name: str) -> list[int]:
        return cut_at(monkeypatch, point, engine, name)

    return arm


class Approval(Workflow):
    """prepare -> wait for an answer -> charge (an effect) -> stop."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("prepare")
        await ctx.store.set("prepared", True)
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        enter("charge")
        paid = pay("charge-" + answer.response)
        await ctx.store.set("by", answer.response)
        return StopEvent(result=paid)


POINTS = [
    "claim.in_acquire",
    "claim.after_acquire",
    "checkpoint.before_commit",
    "checkpoint.in_commit",
    "checkpoint.after_commit",
    "interrupt.before_consume",
    "interrupt.in_consume",
    "interrupt.after_consume",
    "effect.before_intent",
    "effect.in_intent",
    "effect.after_intent",
    "effect.after_apply",
    "effect.in_outcome",
    "effect.after_outcome",
]
CUTS = [
    (e, p)
    for e in ("postgresql", "redis")
    for p in POINTS
    if (e, p) != ("redis", "effect.in_intent")
]


async def drive(
    url: str, run: str, cut_armed: Callable[[], Any]
) -> tuple[Any, list[BaseException]]:
    """Park `run`, arm the cut, answer it; then continue it from fresh runtimes until it
    ends. Its result, and every error on the way."""
    errors: list[BaseException] = []
    rt = RemitRuntime(url, lease=1)
    try:
        flow = Approval(runtime=rt)
        flow.run(run_id=run)  # (parked; its handler is left waiting)
        await until_parked(rt, run)
        cut_armed()
        try:
            resumed = await rt.respond(flow, run, HumanResponseEvent(response="ann"))
            return await resumed, errors
        except Exception as exc:  # noqa: BLE001 - sorted by the test
            errors.append(exc)
        # (The parked copy stays parked when the answer was not taken: it is left, and
        # the run is continued by another runtime, as another process would.)
    finally:
        rt.remit.close()
    for _ in range(40):
        rt2 = RemitRuntime(url, lease=1)
        try:
            flow2 = Approval(runtime=rt2)
            try:
                status = rt2.status(run)
                if status == "completed":
                    return rt2.result(run), errors
                h = rt2.recover(flow2, run)
                if h is None and rt2.status(run) == "waiting":
                    h = await rt2.respond(flow2, run, HumanResponseEvent(response="ann"))
                if h is not None:
                    return await h, errors
            except ResumeConflict:  # (the parked copy's claim, until its lease ends)
                await asyncio.sleep(0.2)
            except Exception as exc:  # noqa: BLE001 - sorted by the test
                errors.append(exc)
        finally:
            rt2.remit.close()
    raise AssertionError(f"never ended; errors {errors!r}")


@pytest.mark.parametrize(("engine", "point"), CUTS)
def test_connections_ended_mid_run_are_store_unavailable_and_the_run_continues_once(
    engine: str,
    point: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cutting: Callable[[str, str, str], list[int]],
) -> None:
    """The runtime's server connections are ended when the answer's delivery reaches
    `point`: every error the user sees is `StoreUnavailable`, and the run continued
    afterwards (recovered, or answered again while it still waits) ends with the
    answer it was given, its effect applied once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    url, name = tagged(engine)
    run = new_run()
    done: list[list[int]] = []
    out, errors = asyncio.run(drive(url, run, lambda: done.append(cutting(point, engine, name))))
    assert done[0] and done[0][0] >= 1, f"{point} never reached with a connection open"
    for exc in errors:
        assert isinstance(exc, StoreUnavailable), f"{type(exc).__module__}: {exc!r}"
    assert out == "charge-ann"
    assert applied(tmp_path) == ["charge-ann"]
    # (The step was in flight, never durably completed: it may run again, from its top.)
    assert entered(tmp_path)[-1] == "charge"
