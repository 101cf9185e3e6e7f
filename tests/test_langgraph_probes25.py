"""Round 25 probes of RemitSaver: an `update_state` of one thread made from a node of
a run on another thread (a supervisor editing a worker's thread), sync and async, while
a run on the edited thread is in flight; a `Command(update=...)` sent to a pause whose
resumer was SIGKILLed after its value was consumed. Real LangGraph, real stores on
every engine, real forked processes."""

from __future__ import annotations

import asyncio
import operator
import threading
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_probes10 import LEASE, killed
from test_langgraph_support import World
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid, ResumeConflict
from remit_langgraph import RemitSaver


class Work(TypedDict):
    n: Annotated[int, Ge(0)]
    log: Annotated[list[str], operator.add]


def _config(prefix: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": f"{prefix}-{uuid.uuid4().hex}"}}


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # the class name is the outcome the contract names
        return type(exc).__name__
    return "ok"


async def _aoutcome(coro: Any) -> str:
    try:
        await coro
    except Exception as exc:  # the class name is the outcome the contract names
        return type(exc).__name__
    return "ok"


def _worker(saver: RemitSaver, entered: threading.Event, leave: threading.Event) -> Any:
    """slow (waits for `leave`) -> end: the worker thread's graph."""

    def slow(state: Work) -> dict[str, Any]:
        entered.set()
        assert leave.wait(60)
        return {"log": ["slow"]}

    builder = StateGraph(Work)
    builder.add_node("slow", slow)
    builder.add_node("end", lambda state: {"log": ["end"]})
    builder.add_edge(START, "slow")
    builder.add_edge("slow", "end")
    builder.add_edge("end", END)
    return builder.compile(checkpointer=saver)


def test_an_edit_of_another_thread_from_a_node_is_refused_while_that_thread_runs(
    url: str,
) -> None:
    """A node of a run on thread A edits thread B while a run on B is in flight. Made
    from outside any run, such an edit is refused (`ResumeConflict`), and a refused one
    stores nothing. Made from A's node, it skipped B's claim: it was committed under B's
    running run, which then failed with `ForkWithoutIntent` and lost its steps; and an
    invalid edit's writes were taken for B's run's own, failing it with a
    `CheckpointInvalid` for a value it never wrote."""
    saver = RemitSaver(url)
    entered, leave = threading.Event(), threading.Event()
    worker = _worker(saver, entered, leave)
    a_cfg, b_cfg = _config("supervisor"), _config("worker")
    seen: dict[str, Any] = {}

    def edit(state: Work) -> dict[str, Any]:
        seen["edit"] = _outcome(lambda: worker.update_state(b_cfg, {"log": ["edited"]}))
        seen["invalid"] = _outcome(lambda: worker.update_state(b_cfg, {"n": -1}))
        return {"log": ["edit"]}

    builder = StateGraph(Work)
    builder.add_node("edit", edit)
    builder.add_edge(START, "edit")
    builder.add_edge("edit", END)
    supervisor = builder.compile(checkpointer=saver)

    def run_worker() -> None:
        try:
            seen["worker"] = worker.invoke({"n": 1, "log": []}, b_cfg)
        except Exception as exc:  # the outcome is asserted below
            seen["worker"] = exc

    runner = threading.Thread(target=run_worker)
    runner.start()
    try:
        assert entered.wait(60)
        assert _outcome(lambda: worker.update_state(b_cfg, {"log": ["direct"]})) == (
            ResumeConflict.__name__
        )
        assert supervisor.invoke({"n": 0, "log": []}, a_cfg) == {"n": 0, "log": ["edit"]}
    finally:
        leave.set()
        runner.join(60)
    assert seen["edit"] == ResumeConflict.__name__
    assert seen["invalid"] == CheckpointInvalid.__name__
    assert seen["worker"] == {"n": 1, "log": ["slow", "end"]}
    assert worker.get_state(b_cfg).values == {"n": 1, "log": ["slow", "end"]}
    # With the run over, the same edit from a node is stored.
    entered.clear()
    assert supervisor.invoke({"n": 0, "log": []}, _config("supervisor"))["log"] == ["edit"]
    assert seen["edit"] == "ok"
    assert worker.get_state(b_cfg).values["log"] == ["slow", "end", "edited"]


def test_an_async_edit_of_another_thread_from_a_node_is_refused_while_that_thread_runs(
    url: str,
) -> None:
    """The same through `aupdate_state` from an async node, with both runs in one event
    loop: the edit is refused and the worker's run keeps its result."""
    saver = RemitSaver(url)
    entered, leave = threading.Event(), threading.Event()
    worker = _worker(saver, entered, leave)
    a_cfg, b_cfg = _config("supervisor"), _config("worker")
    seen: dict[str, Any] = {}

    async def edit(state: Work) -> dict[str, Any]:
        seen["edit"] = await _aoutcome(worker.aupdate_state(b_cfg, {"log": ["edited"]}))
        seen["invalid"] = await _aoutcome(worker.aupdate_state(b_cfg, {"n": -1}))
        return {"log": ["edit"]}

    builder = StateGraph(Work)
    builder.add_node("edit", edit)
    builder.add_edge(START, "edit")
    builder.add_edge("edit", END)
    supervisor = builder.compile(checkpointer=saver)

    async def main() -> Any:
        running = asyncio.ensure_future(worker.ainvoke({"n": 1, "log": []}, b_cfg))
        try:
            assert await asyncio.to_thread(entered.wait, 60)
            assert await supervisor.ainvoke({"n": 0, "log": []}, a_cfg) == {
                "n": 0,
                "log": ["edit"],
            }
        finally:
            leave.set()
        return await running

    assert asyncio.run(main()) == {"n": 1, "log": ["slow", "end"]}
    assert seen == {"edit": ResumeConflict.__name__, "invalid": CheckpointInvalid.__name__}
    assert worker.get_state(b_cfg).values == {"n": 1, "log": ["slow", "end"]}


# -- a command without a resume value, after a resumer died holding one ----------------


class Paused(TypedDict):
    x: int
    log: Annotated[list[str], operator.add]


def _asking(world: World, saver: RemitSaver) -> Any:
    """ask (interrupt; then the point "ask.answered") -> done."""

    def ask(state: Paused) -> dict[str, Any]:
        world.enter("ask")
        value = interrupt("who approves?")
        world.point("ask.answered")
        return {"log": [f"ask:{value}"]}

    builder = StateGraph(Paused)
    builder.add_node("ask", ask)
    builder.add_node("done", lambda state: {"log": ["done"]})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "done")
    builder.add_edge("done", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_command_update_after_a_dead_resumer_continues_with_its_consumed_value(
    url: str, tmp_path: Path, durability: str
) -> None:
    """A resumer consumes "alice" and is SIGKILLed in the node that took it. The next run
    brings `Command(update=...)` (no resume value): LangGraph runs the paused node again,
    as `invoke(None, config)` does. It owes the node the consumed value (P5: recovery
    consumes it once, no second value is needed or accepted). It asked the question
    again instead, as pending, and every resume value was then refused as "already
    consumed": the user was shown a question no answer could reach."""
    world = World(tmp_path)
    cfg = _config("paused")
    _asking(world, RemitSaver(url, lease=LEASE)).invoke(
        {"x": 0, "log": []}, cfg, durability=durability
    )

    def resume_and_die() -> None:
        world.armed["ask.answered"] = "kill"
        _asking(world, RemitSaver(url, lease=LEASE)).invoke(
            Command(resume="alice"), cfg, durability=durability
        )

    killed(resume_and_die)
    graph = _asking(world, RemitSaver(url, lease=LEASE))
    out = graph.invoke(Command(update={"x": 5}), cfg, durability=durability)
    assert out == {"x": 5, "log": ["ask:alice", "done"]}
    assert graph.get_state(cfg).next == ()
    assert _outcome(lambda: graph.invoke(Command(resume="mallory"), cfg)) == (
        ResumeConflict.__name__
    )
    assert graph.get_state(cfg).values == {"x": 5, "log": ["ask:alice", "done"]}
