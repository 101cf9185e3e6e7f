"""LlamaIndex probes, round 20, on SQLite, PostgreSQL and Redis.

A checkpoint names the classes of the events it holds (the event a waiting step
re-runs on, the type a waiter waits for, an accepted answer) and of a `DictState`'s
model values. Restored by code in which such a class was renamed, moved or removed,
or given a new required field, `rt.context`, `rt.respond` and `rt.recover` raised
the framework's bare `AttributeError`, `ImportError` or `ContextSerdeError`, naming
neither the run nor the checkpoint, and `rt.get_state` called the intact record
corrupt (`CorruptRecord`). They now raise `VersionMismatch` naming the run, the
checkpoint and the class (or the field the class no longer accepts), before anything
runs or is stored.

`with rt.registering(): flow = Flow()`, the framework's implicit plug point, handed
the block to the runtime Remit decorates: the workflow ran on the framework's own
runtime and not one of its runs was stored, without a word. It now runs on Remit.
"""

import asyncio
import sys
import types
import uuid
from typing import Any

import pytest
from llamaindex_parts import until_parked
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ResumeConflict, VersionMismatch
from remit_llamaindex import RemitRuntime

GUARD = 20.0


def new_run() -> str:
    return f"probe20-{uuid.uuid4().hex[:12]}"


# -- a checkpoint naming a class the reading code no longer has ----------------------------


def _module() -> types.ModuleType:
    """A module of the workflow's own classes, loaded as an import would load it."""
    module = types.ModuleType(f"probe20_flow_{uuid.uuid4().hex[:8]}")
    sys.modules[module.__name__] = module
    return module


def _event(module: types.ModuleType, name: str, base: type, **fields: type) -> Any:
    cls = type(name, (base,), {"__module__": module.__name__, "__annotations__": fields})
    setattr(module, name, cls)
    return cls


def _asking(answer: type[Event], begin: type[StartEvent]) -> Workflow:
    """A workflow whose step, started by `begin`, waits for an `answer`."""

    class Asking(Workflow):
        @step
        async def ask(self, ctx: Context, ev: begin) -> StopEvent:  # type: ignore[valid-type]
            await ctx.store.set("order", ev.order)
            reply: Any = await ctx.wait_for_event(
                answer, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
            )
            return StopEvent(result=reply.text)

    return Asking(timeout=None)


def _park(url: str, workflow: Workflow, rt: RemitRuntime, run: str, start: Event) -> list[Any]:
    async def scenario() -> list[Any]:
        handler = workflow.run(run_id=run, start_event=start)
        await until_parked(rt, run)
        await handler.cancel_run()  # (a parked copy's cancel writes nothing)
        return rt.checkpoints(run)

    return asyncio.run(scenario())


def _restores(url: str, workflow: Workflow, run: str, answer: Event) -> list[BaseException]:
    """What restoring the run (`rt.context`) and answering it (`rt.respond`) raise."""
    rt = RemitRuntime(url)
    workflow._runtime = rt  # (the reading workflow, on this runtime)
    raised: list[BaseException] = []

    async def scenario() -> None:
        try:
            rt.context(workflow, run)
        except Exception as exc:
            raised.append(exc)
        try:
            await rt.respond(workflow, run, answer)
        except Exception as exc:
            raised.append(exc)

    asyncio.run(scenario())
    return raised


def test_a_checkpoint_naming_an_event_class_renamed_since_is_a_version_mismatch(
    store_url: str,
) -> None:
    """P4: the run waits for `Answer`, which the reading code renamed `Reply`. Every
    restore is refused with `VersionMismatch` naming the class, the run and the
    checkpoint (not a bare `AttributeError`), and nothing is stored."""
    module = _module()
    answer = _event(module, "Answer", Event, text=str)
    begin = _event(module, "Begin", StartEvent, order=str)
    run = new_run()
    rt = RemitRuntime(store_url)
    writer = _asking(answer, begin)
    writer._runtime = rt
    history = _park(store_url, writer, rt, run, begin(order="o-1"))

    del module.Answer  # renamed in the reading code
    reply = _event(module, "Reply", Event, text=str)
    raised = _restores(store_url, _asking(reply, begin), run, reply(text="ok"))

    assert [type(e) for e in raised] == [VersionMismatch, VersionMismatch], raised
    for exc in raised:
        assert isinstance(exc, VersionMismatch)
        assert "Answer" in str(exc)
        assert (exc.run_id, exc.checkpoint_id) == (run, history[0].checkpoint_id)
    assert RemitRuntime(store_url).checkpoints(run) == history


def test_a_checkpoint_event_its_class_no_longer_accepts_is_a_version_mismatch(
    store_url: str,
) -> None:
    """P4: the step waits on `Begin(order=...)`, and the reading code's `Begin` gained a
    required field. The restore is refused with `VersionMismatch` naming the field
    (not the framework's `ContextSerdeError`), and nothing is stored."""
    module = _module()
    answer = _event(module, "Answer", Event, text=str)
    begin = _event(module, "Begin", StartEvent, order=str)
    run = new_run()
    rt = RemitRuntime(store_url)
    writer = _asking(answer, begin)
    writer._runtime = rt
    history = _park(store_url, writer, rt, run, begin(order="o-1"))

    grown = _event(module, "Begin", StartEvent, order=str, priority=int)
    raised = _restores(store_url, _asking(answer, grown), run, answer(text="ok"))

    assert [type(e) for e in raised] == [VersionMismatch, VersionMismatch], raised
    for exc in raised:
        assert isinstance(exc, VersionMismatch)
        assert exc.ids["field"] == "Begin.priority"
        assert (exc.run_id, exc.checkpoint_id) == (run, history[0].checkpoint_id)
    assert RemitRuntime(store_url).checkpoints(run) == history


class Basket(BaseModel):
    items: list[str] = []


def test_a_state_value_of_a_class_removed_since_is_a_version_mismatch(store_url: str) -> None:
    """P4: a `DictState` holds a model value whose class the reading code no longer has:
    `rt.get_state` raises `VersionMismatch` naming it, the run and the checkpoint."""
    module = _module()
    answer = _event(module, "Answer", Event, text=str)
    begin = _event(module, "Begin", StartEvent, order=str)
    cart = type("Cart", (Basket,), {"__module__": module.__name__})
    module.Cart = cart

    class Shopping(Workflow):
        @step
        async def ask(self, ctx: Context, ev: begin) -> StopEvent:  # type: ignore[valid-type]
            await ctx.store.set("cart", cart(items=[ev.order]))
            reply: Any = await ctx.wait_for_event(answer, timeout=None)
            return StopEvent(result=reply.text)

    run = new_run()
    rt = RemitRuntime(store_url)
    history = _park(store_url, Shopping(runtime=rt, timeout=None), rt, run, begin(order="o-1"))
    del module.Cart

    reader = RemitRuntime(store_url)
    with pytest.raises(VersionMismatch, match="Cart") as refused:
        reader.get_state(Shopping(runtime=reader), run)
    assert (refused.value.run_id, refused.value.checkpoint_id) == (run, history[0].checkpoint_id)


# -- `with rt.registering():`, the framework's other plug point -----------------------------


class Asks(Workflow):
    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=answer.response)


def test_a_workflow_made_inside_rt_registering_runs_on_remit(store_url: str) -> None:
    """P1, P5: a workflow made inside `with rt.registering():` (the framework's implicit
    registration) runs on the Remit runtime: its run is stored, parks, and is answered
    from another runtime once. Before, the block registered it with the framework's
    own runtime, and nothing was stored."""
    run = new_run()

    async def scenario() -> str:
        rt = RemitRuntime(store_url)
        with rt.registering() as registered:
            flow = Asks(timeout=None)
        assert registered is rt
        handler = flow.run(run_id=run)
        await until_parked(rt, run)
        await handler.cancel_run()  # (stops this copy; the stored run stays parked)

        other = RemitRuntime(store_url)
        answered = await other.respond(Asks(runtime=other), run, HumanResponseEvent(response="ada"))
        result = str(await asyncio.wait_for(answered, GUARD))
        with pytest.raises(ResumeConflict):
            await other.respond(Asks(runtime=other), run, HumanResponseEvent(response="bob"))
        return result

    assert asyncio.run(scenario()) == "ada"
    assert RemitRuntime(store_url).status(run) == "completed"
