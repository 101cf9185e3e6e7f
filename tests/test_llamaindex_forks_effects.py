"""Forks and effects of LlamaIndex runs, and reads of runs a store does not hold, on
SQLite, PostgreSQL and Redis.

A step in flight or waiting at a fork's base runs again on the fork from its top:
the effects it applied before the base are the shared prefix, applied once (P2, P3);
its later calls apply on each branch.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from test_llamaindex_resume import committed
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core import NOT_APPLIED, effect
from remit_core.errors import UnknownRecord
from remit_llamaindex import RemitRuntime

APPLIED: list[tuple[str, int]] = []  # every application: (idempotency key, amount)


def _recorded(key: str) -> Any:
    return next((amount for k, amount in APPLIED if k == key), NOT_APPLIED)


@effect(reconcile=_recorded)
def charge_card(amount: int, *, idempotency_key: str) -> int:
    APPLIED.append((idempotency_key, amount))
    return amount


def new_run() -> str:
    return f"lf-{uuid.uuid4().hex[:12]}"


class Untimed(Workflow):
    def __init__(self, **kw: Any) -> None:
        kw.setdefault("timeout", None)
        super().__init__(**kw)


class DepositThenFee(Untimed):
    """`approve` charges a deposit, waits for the answer, then charges a fee: two calls
    of one effect in one step, one before the wait and one after it."""

    @step
    async def approve(self, ctx: Context, ev: StartEvent) -> StopEvent:
        charge_card(100)
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        charge_card(1)
        return StopEvent(result=answer.response)


def test_a_fork_of_a_run_parked_in_a_step_shares_what_it_charged_before_waiting(
    store_url: str,
) -> None:
    """A fork of the parked run (and a fork of that fork) answers its own way and
    charges its own fee; the deposit, charged before the fork's base, stays charged once."""
    run = new_run()
    APPLIED.clear()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = DepositThenFee(runtime=rt).run(run_id=run)
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                break
        await handler.cancel_run()  # this process's copy; the run stays parked
        parked = rt.checkpoints(run)[0]
        assert parked.status == "waiting"
        fork = rt.fork(run, parked.checkpoint_id, "what-if-eve")
        for key, who in ((run, "ada"), (fork, "eve")):
            other = RemitRuntime(store_url)
            answered = await other.respond(
                DepositThenFee(runtime=other), key, HumanResponseEvent(response=who)
            )
            assert await answered == who
        # The fork's checkpoint with the answer delivered and `approve` to run again.
        base = next(c for c in rt.checkpoints(fork) if c.branch != "main" and c.next_steps)
        again = rt.fork(fork, base.checkpoint_id, "what-if-bob")
        again_run = rt.recover(DepositThenFee(runtime=rt), again)
        assert again_run is not None and await again_run == "eve"

    asyncio.run(go())
    amounts = sorted(amount for _, amount in APPLIED)
    assert amounts == [1, 1, 1, 100], APPLIED
    assert len({key for key, _ in APPLIED}) == 4


class Gate:
    """Holds `slow` in flight after its charge until the test opens it."""

    event: asyncio.Event


class Ping(Event):
    pass


class Pong(Event):
    pass


class SlowAndFast(Untimed):
    """`slow` charges, then stays in flight while `fast` completes (its checkpoint
    names `slow` still running), then charges again."""

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Ping | Pong | None:
        ctx.send_event(Ping())
        ctx.send_event(Pong())
        return None

    @step
    async def slow(self, ctx: Context, ev: Ping) -> StopEvent:
        charge_card(100)
        if getattr(Gate, "event", None) is not None:
            await Gate.event.wait()
        charge_card(1)
        return StopEvent(result="done")

    @step
    async def fast(self, ctx: Context, ev: Pong) -> None:
        return None


def test_a_fork_of_a_checkpoint_with_a_step_in_flight_shares_its_earlier_effects(
    store_url: str,
) -> None:
    run = new_run()
    APPLIED.clear()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        Gate.event = asyncio.Event()
        handler = SlowAndFast(runtime=rt).run(run_id=run)
        while not any(c.step == "fast" for c in committed(rt, run)):
            await asyncio.sleep(0.02)
        base = next(c for c in rt.checkpoints(run) if c.step == "fast")
        assert base.next_steps == ("slow",)
        Gate.event.set()
        assert await handler == "done"
        del Gate.event
        fork = rt.fork(run, base.checkpoint_id, "again")
        forked = rt.recover(SlowAndFast(runtime=rt), fork)
        assert forked is not None and await forked == "done"

    asyncio.run(go())
    assert sorted(amount for _, amount in APPLIED) == [1, 1, 100], APPLIED


class Done(Untimed):
    @step
    async def finish(self, ctx: Context, ev: StartEvent) -> StopEvent:
        return StopEvent(result="done")


@pytest.mark.parametrize("read", ["checkpoints", "status", "get_state", "recover"])
def test_reads_of_a_run_the_store_does_not_hold_raise_unknown_record(
    store_url: str, read: str
) -> None:
    """An unknown run id, or an unknown fork of a stored run, is refused alike by every
    read (`rt.checkpoints` listed nothing for the one, the whole run for the other)."""
    rt = RemitRuntime(store_url)
    flow = Done(runtime=rt)
    stored = new_run()
    assert asyncio.run(_run(flow, stored)) == "done"
    calls = {
        "checkpoints": rt.checkpoints,
        "status": rt.status,
        "get_state": lambda r: rt.get_state(flow, r),
        "recover": lambda r: rt.recover(flow, r),
    }
    for unknown, branch in ((new_run(), "main"), (f"{stored}@fork-nothere", "fork-nothere")):
        with pytest.raises(UnknownRecord, match="no such run") as refused:
            calls[read](unknown)
        assert refused.value.ids["branch"] == branch
        assert refused.value.run_id == unknown.partition("@")[0]


async def _run(flow: Workflow, run: str) -> Any:
    return await flow.run(run_id=run)
