"""Child workflows started inside a step of a RemitRuntime run, on SQLite, PostgreSQL and Redis.

A parent step starts a `Payment` child workflow without a `run_id` and awaits it;
the child charges a card through the effect API. A real process runs the parent
and is SIGKILLed (mid-child, or after the child completed); a recovery in this
process re-runs the parent's step, which finds the same child again: a child that
had ended answers with its stored result, a child still running continues from
its checkpoints, and the card is charged exactly once either way.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from workflows import Context, Workflow, step
from workflows.events import Event, StartEvent, StopEvent
from workflows.handler import WorkflowHandler
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core import NOT_APPLIED, effect
from remit_core.errors import ForkWithoutIntent, ResumeConflict
from remit_llamaindex import RemitRuntime

RECOVERY_TIMEOUT = 60.0


class Ledger:
    """The outside world, shared by processes: a file with one line per step entry
    (`enter <step>`), per child started (`child <run id>`) and per card charge
    (`charge <idempotency key> <amount>`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()

    def write(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines()

    def charges(self) -> Counter[str]:
        return Counter(line.split()[1] for line in self.lines() if line.startswith("charge "))

    def entries(self) -> Counter[str]:
        return Counter(line.split()[1] for line in self.lines() if line.startswith("enter "))

    def children(self) -> list[str]:
        return [line.split()[1] for line in self.lines() if line.startswith("child ")]

    def charged(self, key: str) -> Any:
        for line in self.lines():
            parts = line.split()
            if parts[:2] == ["charge", key]:
                return int(parts[2])
        return NOT_APPLIED


LEDGER: Ledger | None = None


def ledger() -> Ledger:
    assert LEDGER is not None, "the test sets the ledger first"
    return LEDGER


@effect(reconcile=lambda key: ledger().charged(key))
def charge_card(amount: int, *, idempotency_key: str) -> int:
    ledger().write(f"charge {idempotency_key} {amount}")
    return amount


def kill_here() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Checked(Event):
    amount: int


class Payment(Workflow):
    """check (a negative amount is declined) -> charge (the effect): a child run of
    `Order`'s step."""

    def __init__(self, crash: str = "", **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        self.crash = crash

    @step
    async def check(self, ev: StartEvent) -> Checked:
        ledger().write("enter check")
        if ev.get("amount") < 0:
            raise ValueError("declined")
        return Checked(amount=ev.get("amount"))

    @step
    async def charge(self, ev: Checked) -> StopEvent:
        ledger().write("enter charge")
        paid = charge_card(ev.amount)
        if self.crash == "mid-child":
            kill_here()  # the charge is applied and recorded; the step never completes
        return StopEvent(result=f"receipt-{paid}")


class Order(Workflow):
    """pay: starts one `Payment` child per amount and returns what each gave (its
    receipt, or the error it raised)."""

    def __init__(
        self,
        rt: RemitRuntime,
        crash: str = "",
        amounts: tuple[int, ...] = (100,),
        child_run_id: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt = rt
        self.crash = crash
        self.amounts = amounts
        self.child_run_id = child_run_id

    @step
    async def pay(self, ctx: Context, ev: StartEvent) -> StopEvent:
        ledger().write("enter pay")
        extra = {} if self.child_run_id is None else {"run_id": self.child_run_id}
        handlers = [
            Payment(crash=self.crash, runtime=self.rt).run(amount=amount, **extra)
            for amount in self.amounts
        ]
        for handler in handlers:
            ledger().write(f"child {handler.run_id}")
        outcomes = await asyncio.gather(*handlers, return_exceptions=True)
        await ctx.store.set("children", [h.run_id for h in handlers])
        if self.crash == "after-child":
            kill_here()  # every child ended; this step never completes
        return StopEvent(result=[outcome(o) for o in outcomes])


class RetriedOrder(Workflow):
    """pay, retried once: its first attempt's child is declined (the step fails), the
    retry's child charges."""

    def __init__(self, rt: RemitRuntime, **kw: Any) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt = rt

    @step(retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(2)))
    async def pay(self, ev: StartEvent) -> StopEvent:
        amount = 100 if ledger().entries()["pay"] else -1
        ledger().write("enter pay")
        handler = Payment(runtime=self.rt).run(amount=amount)
        ledger().write(f"child {handler.run_id}")
        return StopEvent(result=await handler)


def outcome(given: Any) -> str:
    if isinstance(given, BaseException):
        return f"{type(given).__name__}: {getattr(given, 'error', given)}"
    return str(given)


@pytest.fixture(autouse=True)
def _ledger(tmp_path: Path) -> Any:
    global LEDGER
    LEDGER = Ledger(tmp_path / "ledger.txt")
    yield
    LEDGER = None


def new_run() -> str:
    return f"order-{uuid.uuid4().hex[:12]}"


CRASHING_PARENT = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import test_llamaindex_child as t
from remit_llamaindex import RemitRuntime

async def main():
    t.LEDGER = t.Ledger(Path({ledger!r}))
    rt = RemitRuntime({url!r}, lease=1)
    result = await t.Order(rt, crash={crash!r}, amounts={amounts!r}).run(run_id={run!r})
    print("FINISHED", result, flush=True)

asyncio.run(main())
"""


def crash_parent(url: str, run: str, crash: str, amounts: tuple[int, ...]) -> None:
    """Run `Order` in a real process that SIGKILLs itself at `crash`."""
    code = CRASHING_PARENT.format(
        tests=str(Path(__file__).parent),
        ledger=str(ledger().path),
        url=url,
        run=run,
        crash=crash,
        amounts=amounts,
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)


async def recovered(rt: RemitRuntime, wf: Workflow, run: str) -> WorkflowHandler:
    """`recover` once the dead process's lease on the run ran out."""
    deadline = time.monotonic() + 15
    while True:
        try:
            handler = rt.recover(wf, run)
        except ResumeConflict:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
            continue
        assert handler is not None
        return handler


def child_runs(rt: RemitRuntime, run: str) -> list[str]:
    return list(rt.get_state(Order(rt), run).get("children"))


def test_a_crash_mid_child_continues_the_child_and_charges_once(store_url: str) -> None:
    """SIGKILL inside the child's `charge` step, after the charge was applied and recorded:
    recovery re-runs the parent's step, which finds the same child run and continues it
    from its checkpoints (`check` is not entered again); the charge is applied once."""
    run = new_run()
    crash_parent(store_url, run, "mid-child", (100,))
    assert ledger().entries() == Counter({"pay": 1, "check": 1, "charge": 1})
    assert sum(ledger().charges().values()) == 1
    (started,) = ledger().children()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Order(rt), run)
        assert await asyncio.wait_for(handler, RECOVERY_TIMEOUT) == ["receipt-100"]
        assert list(ledger().charges().values()) == [1]
        assert child_runs(rt, run) == [started]
        assert rt.status(started) == "completed" and rt.result(started) == "receipt-100"
        assert rt.status(run) == "completed"

    asyncio.run(go())
    assert ledger().children() == [started, started]
    assert list(ledger().charges().values()) == [1]
    assert ledger().entries() == Counter({"pay": 2, "check": 1, "charge": 2})


def test_a_child_whose_dead_holder_outlasts_the_parent_is_waited_for(store_url: str) -> None:
    """The claim a dead process held on the child can outlast its claim on the parent:
    the re-run step waits for that lease to run out, then continues the child."""
    run = new_run()
    crash_parent(store_url, run, "mid-child", (100,))
    (started,) = ledger().children()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        deadline = time.monotonic() + 15
        while True:  # the dead process's lease on the child runs out
            try:
                dying = rt.remit.claim(started, lease=0.8, heartbeat=False)
                break
            except ResumeConflict:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        handler = await recovered(rt, Order(rt), run)
        assert await asyncio.wait_for(handler, RECOVERY_TIMEOUT) == ["receipt-100"]
        assert not dying.released  # it was never given up: its lease ran out
        assert child_runs(rt, run) == [started]

    asyncio.run(go())
    assert list(ledger().charges().values()) == [1]
    assert ledger().entries() == Counter({"pay": 2, "check": 1, "charge": 2})


def test_a_crash_after_the_child_completed_answers_with_its_stored_result(
    store_url: str,
) -> None:
    """SIGKILL in the parent's step after its child completed: recovery does not hang on
    the finished child; the re-run step gets the child's stored result at once, no step
    of the child runs again, and the charge is applied once."""
    run = new_run()
    crash_parent(store_url, run, "after-child", (100,))
    assert ledger().entries() == Counter({"pay": 1, "check": 1, "charge": 1})
    (started,) = ledger().children()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        history = rt.checkpoints(started)
        assert history[0].status == "completed"
        handler = await recovered(rt, Order(rt), run)
        assert await asyncio.wait_for(handler, RECOVERY_TIMEOUT) == ["receipt-100"]
        assert list(ledger().charges().values()) == [1]
        assert child_runs(rt, run) == [started]
        assert rt.checkpoints(started) == history  # answered from the store, not re-run
        assert rt.status(run) == "completed"

    asyncio.run(go())
    assert ledger().children() == [started, started]
    assert list(ledger().charges().values()) == [1]
    assert ledger().entries() == Counter({"pay": 2, "check": 1, "charge": 1})


def test_a_child_that_failed_before_the_crash_raises_its_stored_error(store_url: str) -> None:
    """A child that failed before the crash is not run again: the re-run step gets
    `RunFailed`, carrying the stored error as text."""
    run = new_run()
    crash_parent(store_url, run, "after-child", (-1,))
    (started,) = ledger().children()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        assert rt.status(started) == "failed"
        handler = await recovered(rt, Order(rt, amounts=(-1,)), run)
        result = await asyncio.wait_for(handler, RECOVERY_TIMEOUT)
        assert result == ["RunFailed: ValueError: declined"]
        assert child_runs(rt, run) == [started]

    asyncio.run(go())
    assert ledger().entries() == Counter({"pay": 2, "check": 1})
    assert ledger().charges() == Counter()


def test_two_children_of_one_step_get_distinct_stable_identities(store_url: str) -> None:
    """Two children started by one step execution are two runs; after a crash the re-run
    step finds both again, each under the identity it had, each charged once."""
    run = new_run()
    crash_parent(store_url, run, "after-child", (100, 250))
    assert sorted(ledger().charges().values()) == [1, 1]
    first, second = ledger().children()
    assert first != second

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Order(rt, amounts=(100, 250)), run)
        assert await asyncio.wait_for(handler, RECOVERY_TIMEOUT) == [
            "receipt-100",
            "receipt-250",
        ]
        assert sorted(ledger().charges().values()) == [1, 1]
        assert child_runs(rt, run) == [first, second]
        assert [rt.result(first), rt.result(second)] == ["receipt-100", "receipt-250"]

    asyncio.run(go())
    assert ledger().children() == [first, second, first, second]
    assert sorted(ledger().charges().values()) == [1, 1]
    assert ledger().entries() == Counter({"pay": 2, "check": 2, "charge": 2})


def test_children_of_distinct_step_executions_are_distinct_runs(store_url: str) -> None:
    """The same step of two runs (two step executions) starts two distinct children,
    each charged once, and neither answers for the other."""

    async def go() -> None:
        rt = RemitRuntime(store_url)
        for amount in (5, 7):
            assert await Order(rt, amounts=(amount,)).run(run_id=new_run()) == [f"receipt-{amount}"]

    asyncio.run(go())
    first, second = ledger().children()
    assert first != second
    assert sorted(ledger().charges().values()) == [1, 1]


def test_a_retried_step_starts_children_of_its_own(store_url: str) -> None:
    """A retry is another execution of the step: its child is a new run (the first
    attempt's failed child does not answer for it)."""

    async def go() -> Any:
        rt = RemitRuntime(store_url)
        return await RetriedOrder(rt).run(run_id=new_run())

    assert asyncio.run(go()) == "receipt-100"
    first, second = ledger().children()
    assert first != second
    assert ledger().entries() == Counter({"pay": 2, "check": 2, "charge": 1})
    assert list(ledger().charges().values()) == [1]


def test_an_explicit_child_run_id_is_kept(store_url: str) -> None:
    """A child started with an explicit `run_id` runs under that id, as before; starting
    a second child with an id that already exists is refused, as before."""
    run = new_run()
    explicit = f"{run}-payment"

    async def go() -> None:
        rt = RemitRuntime(store_url)
        assert await Order(rt, child_run_id=explicit).run(run_id=run) == ["receipt-100"]
        assert child_runs(rt, run) == [explicit]
        assert rt.status(explicit) == "completed" and rt.result(explicit) == "receipt-100"
        history = rt.checkpoints(explicit)
        with pytest.raises(ForkWithoutIntent) as refused:
            await Order(rt, child_run_id=explicit).run(run_id=new_run())
        assert refused.value.run_id == explicit
        assert rt.checkpoints(explicit) == history

    asyncio.run(go())
    assert ledger().children() == [explicit]
    assert list(ledger().charges().values()) == [1]
