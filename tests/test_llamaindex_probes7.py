"""Probes of `RemitRuntime` written from the contract, on SQLite, PostgreSQL and Redis.

A step that started a child workflow (no `run_id`) and then waits for an answer is
forked at its wait: the fork runs the step again from its top, and the child it
started before the fork's base belongs to the prefix the fork shares, as an
`@effect` called there does: the fork finds that child's stored result and the
child's charge is not applied a second time (P2, P3); a child the step starts
after its wait is the fork's own. Anything but an `Event` delivered to a run is
refused with `TypeError`, before anything is stored.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from test_llamaindex_probes6 import Ask
from workflows import Context, Workflow, step
from workflows.events import HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core import NOT_APPLIED, effect
from remit_llamaindex import RemitRuntime

APPLIED: list[tuple[str, int]] = []


def new_run() -> str:
    return f"probe7-{uuid.uuid4().hex[:12]}"


def charged(key: str) -> Any:
    return next((amount for k, amount in APPLIED if k == key), NOT_APPLIED)


@effect(reconcile=charged)
def charge_card(amount: int, *, idempotency_key: str) -> int:
    APPLIED.append((idempotency_key, amount))
    return amount


class Payment(Workflow):
    """A child run: charges the amount it is started with."""

    @step
    async def pay(self, ev: StartEvent) -> StopEvent:
        return StopEvent(result=charge_card(ev.get("amount")))


class DepositThenFee(Workflow):
    """approve: a `Payment` child charges the deposit, the step waits for an answer,
    then a second child charges the fee."""

    def __init__(self, rt: RemitRuntime) -> None:
        super().__init__(timeout=None, runtime=rt)
        self.rt = rt

    @step
    async def approve(self, ctx: Context, ev: StartEvent) -> StopEvent:
        deposit = await Payment(timeout=None, runtime=self.rt).run(amount=100)
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="go on?"), timeout=None
        )
        fee = await Payment(timeout=None, runtime=self.rt).run(amount=1)
        return StopEvent(result=f"{answer.response}:{deposit}+{fee}")


def test_a_fork_at_a_wait_shares_the_child_its_step_started_before_waiting(
    store_url: str,
) -> None:
    """The deposit child ran before the fork's base: the fork's run of `approve` finds
    it (its stored result), and the deposit is charged once; each branch charges its
    own fee through a child of its own."""
    run = new_run()
    APPLIED.clear()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = DepositThenFee(rt).run(run_id=run)
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
                DepositThenFee(other), key, HumanResponseEvent(response=who)
            )
            assert await asyncio.wait_for(answered, 30) == f"{who}:100+1"

    asyncio.run(go())
    assert sorted(amount for _, amount in APPLIED) == [1, 1, 100], APPLIED
    assert len({key for key, _ in APPLIED}) == 3


@pytest.mark.parametrize("value", ["ada", None, {"response": "ada"}])
def test_anything_but_an_event_is_refused_with_type_error(store_url: str, value: Any) -> None:
    """Delivered with `rt.respond` or `rt.send_event`, a value that is not an `Event` is
    refused with `TypeError`; the interrupt stays pending and a real answer is taken."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = Ask(timeout=None, runtime=rt).run(run_id=run)
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                break
        history = rt.checkpoints(run)
        with pytest.raises(TypeError):
            await rt.send_event(handler, value)
        await handler.cancel_run()
        other = RemitRuntime(store_url)
        with pytest.raises(TypeError):
            await other.respond(Ask(timeout=None, runtime=other), run, value)
        assert rt.checkpoints(run) == history
        assert [i.status for i in rt.remit.interrupts(run)] == ["pending"]
        answered = await other.respond(
            Ask(timeout=None, runtime=other), run, HumanResponseEvent(response="bob")
        )
        assert await asyncio.wait_for(answered, 30) == "bob"

    asyncio.run(go())
