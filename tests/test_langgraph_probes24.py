"""RemitSaver probed where the earlier rounds stopped: a listing by fork token with no
`checkpoint_ns` (the config a user runs a fork with) listed every branch's checkpoints
of the thread, the other branch's later ones among them, read as the fork's. It now
lists the fork's own line, as `get_state_history` shows it and `get_tuple` reads it.
Real LangGraph, real stores on every engine."""

from __future__ import annotations

import asyncio
import operator
import uuid
from typing import Annotated, Any

from langgraph.graph import START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_langgraph import RemitSaver


class Order(TypedDict):
    n: int
    log: Annotated[list[str], operator.add]


def approve(state: Order) -> dict[str, Any]:
    return {"log": [f"approve:{interrupt('ship it?')}"]}


def order_graph(saver: RemitSaver) -> Any:
    builder = StateGraph(Order)
    builder.add_node("prepare", lambda state: {"n": state["n"] + 1, "log": ["prepare"]})
    builder.add_node("approve", approve)
    builder.add_node("notify", lambda state: {"log": ["notify"]})
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "approve")
    builder.add_edge("approve", "notify")
    return builder.compile(checkpointer=saver)


def test_a_listing_by_fork_token_without_a_namespace_shows_only_the_forks_line(
    url: str,
) -> None:
    """A thread paused at `approve` is answered on main ("main"), then forked at its
    pause with a token and answered there ("fork"). `saver.list` with the config the
    fork runs with (`thread_id` and `fork_token`, no `checkpoint_ns`) listed main's
    checkpoints after the pause too, "approve:main" among them, as if the fork had
    written them (while `get_tuple` of the same config reads the fork's head). It
    lists the fork's line: the same checkpoints as `get_state_history`, sync and async."""
    saver = RemitSaver(url)
    graph = order_graph(saver)
    thread = f"t-{uuid.uuid4().hex}"
    main = {"configurable": {"thread_id": thread}}
    graph.invoke({"n": 0, "log": []}, main)
    paused = graph.get_state(main).config
    graph.invoke(Command(resume="main"), main)
    token = f"fork-{uuid.uuid4().hex}"
    graph.invoke(None, {"configurable": {**paused["configurable"], "fork_token": token}})
    fork = {"configurable": {"thread_id": thread, "fork_token": token}}
    graph.invoke(Command(resume="fork"), fork)

    shown = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(fork)]
    listed = list(saver.list(fork))
    logs = [c.checkpoint["channel_values"].get("log") or [] for c in listed]
    assert not [log for log in logs if "approve:main" in log]
    assert [c.config["configurable"]["checkpoint_id"] for c in listed] == shown
    head = saver.get_tuple(fork)
    assert head is not None and listed[0].config == head.config

    async def alisted() -> list[str]:
        return [c.config["configurable"]["checkpoint_id"] async for c in saver.alist(fork)]

    assert asyncio.run(alisted()) == shown
    # The thread's listing (no token) still holds every branch, main's answer too.
    every = [c.checkpoint["channel_values"].get("log") or [] for c in saver.list(main)]
    assert any("approve:main" in log for log in every)
