"""Round 41 of the LlamaIndex probes, on SQLite, PostgreSQL and Redis: workflows a step
starts (child runs), across crashes and step retries.

A step that starts a child under a run id of its own choosing (`Child().run(run_id=
f"{order}-shipment")`, the usual way to make a call idempotent) and whose process was
SIGKILLed after the child started could not be recovered: the re-run step started the
child again, was refused with `ForkWithoutIntent` ("run ... already exists"), and the
parent failed for good. The child now records the step execution that started it, and
the same step (re-run after a crash, or retried) finds it: ended, it answers from the
store; not ended, it continues from its head; its effects apply once. Any other start
under that id (another run's step, or the same execution a second time) is refused as
before.

A step with a `retry_policy` whose child completed (and paid) before the step failed
started a second child on its retry, which paid again, while an `@effect` the step
called itself returned its recorded outcome. A retry's child is now the completed child
of the step's latest earlier attempt (a child that failed is started anew, as before).

Held (pinned): every read and action of `RemitRuntime` on a run id the store does not
hold raises `UnknownRecord` naming the run and stores nothing; an `@effect` called
outside a step raises `RemitError` saying so and applies nothing; an untyped
`ctx.store` holding a list of models, a nested dict with a model inside and a model
reads back equal and of the same types in the step re-run after a SIGKILL, in another
process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, StartEvent, StopEvent
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core.errors import ForkWithoutIntent, RemitError, ResumeConflict, UnknownRecord
from remit_llamaindex import RemitRuntime

GUARD = 60
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe41-{uuid.uuid4().hex[:12]}"


def _entered_here(name: str) -> int:
    return entered(Path(os.environ[DIR_VAR])).count(name)


class Shipment(Workflow):
    """The child: pays for shipping the order."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ship(self, ev: StartEvent) -> StopEvent:
        enter("ship")
        paid = pay(f"ship-{ev.order}")
        die_at("in-child")
        return StopEvent(result=paid)


class Order(Workflow):
    """Starts the shipment under a run id named after the order, then ends."""

    def __init__(self, rt: RemitRuntime, **kw: Any) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt = rt

    @step
    async def place(self, ev: StartEvent) -> StopEvent:
        enter("place")
        got = await Shipment(runtime=self.rt).run(run_id=f"{ev.order}-shipment", order=ev.order)
        die_at("after-child")
        return StopEvent(result=f"placed {got}")


class ShipTwice(Order):
    """Starts the same named shipment twice in one step execution."""

    @step
    async def place(self, ev: StartEvent) -> StopEvent:
        enter("place")
        name = f"{ev.order}-shipment"
        first = await Shipment(runtime=self.rt).run(run_id=name, order=ev.order)
        second = await Shipment(runtime=self.rt).run(run_id=name, order=ev.order)
        return StopEvent(result=f"{first} {second}")


class RetriedOrder(Workflow):
    """Pays a fee, starts the shipment (named, or named by Remit), and fails once after
    both, so that its retry policy runs the step again."""

    def __init__(self, rt: RemitRuntime, named: bool, **kw: Any) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt = rt
        self.named = named

    @step(retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(3)))
    async def place(self, ev: StartEvent) -> StopEvent:
        enter("place")
        fee = pay(f"fee-{ev.order}")
        named = {"run_id": f"{ev.order}-shipment"} if self.named else {}
        got = await Shipment(runtime=self.rt).run(order=ev.order, **named)
        if _entered_here("place") == 1:
            raise RuntimeError("the order service timed out after the shipment")
        die_at("in-retry")
        return StopEvent(result=f"{fee} {got}")


START = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes41 as probes

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = {make}
    print("RESULT", await flow.run(run_id={run!r}, order={order!r}), flush=True)

asyncio.run(main())
"""


def killed(url: str, make: str, run: str, order: str, tmp: Path, kill: str) -> None:
    """`make` (an expression building the workflow from `rt`) run in a process of its
    own that SIGKILLs itself at `kill`."""
    code = START.format(tests=TESTS, url=url, make=make, run=run, order=order)
    dead = in_process(code, tmp, kill=kill)
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)


async def _recovered(rt: RemitRuntime, workflow: Workflow, run: str) -> Any:
    """The run continued by `rt.recover` once the dead process's lease ran out."""
    handler = None
    while handler is None:
        try:
            handler = rt.recover(workflow, run)
        except ResumeConflict:  # the dead process's lease has not run out yet
            await asyncio.sleep(0.1)
    return await asyncio.wait_for(handler, GUARD)


# -- a child under a run id the step names ------------------------------------------------


@pytest.mark.parametrize("kill", ["in-child", "after-child"])
def test_a_named_child_is_found_again_by_its_step_recovered_after_a_crash(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str
) -> None:
    """P1, P2: the parent's process dies inside the named child's step after it paid, or
    after the child ended. Recovery re-runs the parent's step, which starts the child
    under the same id again: the child continues from its head (its step re-run finds
    its payment) or answers with its stored result; one payment, and the parent ends
    with it. Another run starting a child under that id is still refused
    (`ForkWithoutIntent`), running and paying nothing."""
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    killed(url, "probes.Order(rt)", run, order, tmp_path, kill)
    assert applied(tmp_path) == [f"ship-{order}"]
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(url, lease=1)
    result = asyncio.run(_recovered(rt, Order(rt), run))
    assert result == f"placed ship-{order}"
    assert applied(tmp_path) == [f"ship-{order}"]
    reruns = ["ship"] if kill == "in-child" else []
    assert entered(tmp_path) == ["place", "ship", "place", *reruns]
    child = f"{order}-shipment"
    assert rt.status(run) == "completed" and rt.status(child) == "completed"
    assert rt.result(child) == f"ship-{order}"
    history = rt.checkpoints(child)

    async def another() -> Any:
        return await Order(rt).run(run_id=new_run(), order=order)

    with pytest.raises(ForkWithoutIntent) as refused:
        asyncio.run(asyncio.wait_for(another(), GUARD))
    assert refused.value.run_id == child
    assert rt.checkpoints(child) == history
    assert applied(tmp_path) == [f"ship-{order}"]


def test_a_named_child_started_twice_by_one_step_execution_is_refused(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1: one execution of a step starting two children under one id starts two runs;
    the second is refused (`ForkWithoutIntent` naming the id), not answered with the
    first's result, and the first paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    rt = RemitRuntime(url, lease=1)

    async def twice() -> Any:
        return await ShipTwice(rt).run(run_id=run, order=order)

    with pytest.raises(ForkWithoutIntent) as refused:
        asyncio.run(asyncio.wait_for(twice(), GUARD))
    assert refused.value.run_id == f"{order}-shipment"
    assert applied(tmp_path) == [f"ship-{order}"]


# -- a child of a retried step --------------------------------------------------------------


@pytest.mark.parametrize("named", [False, True], ids=["drawn", "named"])
@pytest.mark.parametrize("crash", [False, True], ids=["live", "killed-in-retry"])
def test_a_retry_does_not_start_again_a_child_that_completed(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: bool, crash: bool
) -> None:
    """P2, P6: the step's child completed (paid) and the step then failed; its retry gets
    the child's result, as it gets its own fee's recorded outcome, and pays nothing
    again, the child's step not entered again. With the process SIGKILLed in the
    retry after it got the child's result, the recovery does the same."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    rt = RemitRuntime(url, lease=1)
    if crash:
        killed(url, f"probes.RetriedOrder(rt, named={named})", run, order, tmp_path, "in-retry")
        result = asyncio.run(_recovered(rt, RetriedOrder(rt, named), run))
    else:

        async def live() -> Any:
            return await RetriedOrder(rt, named).run(run_id=run, order=order)

        result = asyncio.run(asyncio.wait_for(live(), GUARD))
    assert result == f"fee-{order} ship-{order}"
    assert sorted(applied(tmp_path)) == sorted([f"fee-{order}", f"ship-{order}"])
    assert entered(tmp_path).count("ship") == 1
    assert entered(tmp_path).count("place") == (3 if crash else 2)
    assert rt.status(run) == "completed"


# -- held: unknown run ids, an effect outside a step ------------------------------------------


class Asking(Workflow):
    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(HumanResponseEvent)
        return StopEvent(result=pay(answer.response))


def test_every_call_on_a_run_id_the_store_does_not_hold_is_unknown_record(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read and action of the runtime on an unknown run id raises `UnknownRecord`
    naming the run, and stores nothing (the id then starts a run as any new one); an
    effect called outside any step raises `RemitError` saying so and applies nothing."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    rt = RemitRuntime(url, lease=1)
    wf = Asking(runtime=rt)

    async def acting() -> list[tuple[str, BaseException]]:
        found: list[tuple[str, BaseException]] = []
        calls: dict[str, Any] = {
            "respond": lambda: rt.respond(wf, run, HumanResponseEvent(response="x")),
            "cancel": lambda: rt.cancel(run),
            "update_state": lambda: rt.update_state(wf, run, {"k": 1}),
        }
        for name, call in calls.items():
            with pytest.raises(UnknownRecord) as refused:
                await call()
            found.append((name, refused.value))
        return found

    found = asyncio.run(acting())
    reads: dict[str, Any] = {
        "recover": lambda: rt.recover(wf, run),
        "context": lambda: rt.context(wf, run),
        "status": lambda: rt.status(run),
        "result": lambda: rt.result(run),
        "get_state": lambda: rt.get_state(wf, run),
        "checkpoints": lambda: rt.checkpoints(run),
        "fork": lambda: rt.fork(run, "c-1", "t-1"),
    }
    for name, call in reads.items():
        with pytest.raises(UnknownRecord) as refused:
            call()
        found.append((name, refused.value))
    for name, error in found:
        assert getattr(error, "run_id", None) == run, name
    assert rt.remit.branch(run) is None
    assert rt.remit.interrupts(run) == []
    with pytest.raises(RemitError, match="outside a Remit step"):
        pay("outside")
    assert applied(tmp_path) == []


# -- held: an untyped store holding models, across a SIGKILL ---------------------------------


class Item(BaseModel):
    name: str
    qty: int


class Filled(Event):
    pass


class Basket(Workflow):
    """Fills an untyped store with models in several shapes, then pays their total."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def fill(self, ctx: Context, ev: StartEvent) -> Filled:
        enter("fill")
        await ctx.store.set("items", [Item(name="a", qty=1), Item(name="b", qty=2)])
        await ctx.store.set("nested", {"x": {"y": [1, 2.5, None, {"z": Item(name="c", qty=3)}]}})
        await ctx.store.set("one", Item(name="d", qty=4))
        return Filled()

    @step
    async def settle(self, ctx: Context, ev: Filled) -> StopEvent:
        enter("settle")
        items = await ctx.store.get("items")
        nested = await ctx.store.get("nested")
        one = await ctx.store.get("one")
        total = sum(i.qty for i in items) + nested["x"]["y"][3]["z"].qty + one.qty
        paid = pay(f"total-{total}")
        die_at("in-settle")
        return StopEvent(result=paid)


def test_models_in_an_untyped_store_read_back_the_same_after_a_crash(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P4: the process dies in `settle` after it paid; the recovery in another
    process re-runs only `settle`, on a store whose models read back as models equal to
    what `fill` wrote, pays nothing again, and `rt.get_state` gives the same values."""
    run = new_run()
    killed(url, "probes.Basket(runtime=rt)", run, "-", tmp_path, "in-settle")
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(url, lease=1)
    assert asyncio.run(_recovered(rt, Basket(runtime=rt), run)) == "total-10"
    assert applied(tmp_path) == ["total-10"]
    assert entered(tmp_path) == ["fill", "settle", "settle"]
    state = rt.get_state(Basket(runtime=rt), run)
    assert state.get("items") == [Item(name="a", qty=1), Item(name="b", qty=2)]
    assert all(type(i) is Item for i in state.get("items"))
    assert state.get("nested") == {"x": {"y": [1, 2.5, None, {"z": Item(name="c", qty=3)}]}}
    assert type(state.get("one")) is Item and state.get("one").qty == 4
