"""RemitSaver probed in async servers: an async node's effect while the checkpoint of
the step before it is still being committed (LangGraph's default "async" durability)
must not hold the event loop for that commit. Real LangGraph, real stores on every
engine."""

from __future__ import annotations

import asyncio
import operator
import threading
from typing import Annotated, Any

import pytest
from langgraph.graph import START, StateGraph
from test_langgraph_probes4 import config
from typing_extensions import TypedDict

from remit_core import effect, failpoints
from remit_core.errors import Fenced
from remit_core.records import MAIN_BRANCH
from remit_langgraph import AsyncRemitSaver

#: How long each checkpoint commit sleeps (in the worker thread that makes it).
COMMIT_SLEEP = 0.5
#: How long a commit waits for the effect's body before it gives up waiting.
HOLD = 3.0


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def test_an_async_effect_does_not_hold_the_event_loop_while_a_commit_is_in_flight(
    url: str,
) -> None:
    """Node `b` calls an async effect as it starts, while the checkpoint of step `a`
    is still being committed: each commit waits, in its worker thread, until the
    effect's body has run (or `HOLD` seconds). The effect must run while the commit
    waits: before, the effect's scope waited for the commit on the loop's own
    thread, stalling every other request of the server for as long (here the commit
    gave up waiting after `HOLD`, and only then did the effect run). The effect
    applies once and the run ends as usual."""
    applied: list[str] = []
    ran = threading.Event()
    commits: list[bool] = []  # per commit: whether the effect's body released it

    @effect(idempotent=True)
    async def send(*, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        ran.set()
        return "sent"

    async def a(state: Log) -> dict[str, Any]:
        return {"log": ["a"]}

    async def b(state: Log) -> dict[str, Any]:
        return {"log": ["b", await send()]}

    saver = AsyncRemitSaver(url)
    commit = saver.remit.commit

    def held_commit(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            commits.append(ran.wait(HOLD))
        return commit(*args, **kwargs)

    saver.remit.commit = held_commit  # type: ignore[method-assign]
    builder = StateGraph(Log)
    builder.add_node("a", a)
    builder.add_node("b", b)
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    graph = builder.compile(checkpointer=saver)
    cfg = config()

    out = asyncio.run(graph.ainvoke({"log": []}, cfg))
    assert out["log"] == ["a", "b", "sent"]
    assert len(applied) == 1
    # The commit in flight as `b` started was released by the effect, not by its
    # wait running out: the event loop was free while it was in flight.
    assert commits and all(commits), commits
    assert asyncio.run(graph.aget_state(cfg)).values["log"] == ["a", "b", "sent"]


def test_an_async_effect_after_a_takeover_during_a_commit_in_flight_is_not_applied(
    url: str,
) -> None:
    """L2 still holds without the wait: node `b` starts while `a`'s checkpoint is being
    committed, and another resumer takes the thread over (the run's claim is given up
    under it and claimed again) before `b` calls its effect. The effect is refused
    (`Fenced`: its intent write carries the old fence) and not applied, and the run
    stores nothing of `b`."""
    applied: list[str] = []

    @effect(idempotent=True)
    async def send(*, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "sent"

    saver = AsyncRemitSaver(url, lease=30.0)
    other = AsyncRemitSaver(url, lease=30.0)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]

    def take_over() -> None:
        held = other.remit.store.get_claim(thread, MAIN_BRANCH)
        assert held is not None
        other.remit.store.release_claim(held)
        other.remit.claim(thread, MAIN_BRANCH, lease=30.0, heartbeat=False)

    async def a(state: Log) -> dict[str, Any]:
        return {"log": ["a"]}

    async def b(state: Log) -> dict[str, Any]:
        await asyncio.to_thread(take_over)
        return {"log": ["b", await send()]}

    builder = StateGraph(Log)
    builder.add_node("a", a)
    builder.add_node("b", b)
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    graph = builder.compile(checkpointer=saver)

    async def main() -> None:
        failpoints.arm("checkpoint.before_commit", f"sleep:{COMMIT_SLEEP}")
        try:
            await graph.ainvoke({"log": []}, cfg)
        finally:
            failpoints.disarm()

    with pytest.raises(Fenced):
        asyncio.run(main())
    assert applied == []
    stored = saver.read(cfg)
    assert stored is None or "b" not in stored.checkpoint["channel_values"].get("log", [])
