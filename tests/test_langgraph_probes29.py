"""RemitSaver probed for what a LangGraph server or a user's tooling reads back: a
listing of one named checkpoint with a `limit` (`get_state_history` of a config that
names a checkpoint), and the creation time of a fork's first checkpoint, side by
side with LangGraph's own savers. Real LangGraph, real stores on every engine."""

from __future__ import annotations

import datetime
import operator
import time
from typing import Annotated, Any

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.types import interrupt
from test_langgraph_probes4 import config
from typing_extensions import TypedDict

from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def _two_steps(saver: Any) -> Any:
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", lambda s: {"log": ["b"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    return builder.compile(checkpointer=saver)


def _named_reads(saver: Any) -> tuple[list[Any], ...]:
    """What a listing of one named older checkpoint gives, with and without a limit."""
    graph = _two_steps(saver)
    cfg = config()
    graph.invoke({"log": []}, cfg)
    history = list(graph.get_state_history(cfg))
    older = history[2].config
    newest = {"configurable": {"checkpoint_id": history[0].config["configurable"]["checkpoint_id"]}}

    def ids(found: Any) -> list[Any]:
        return [t.config["configurable"]["checkpoint_id"] for t in found]

    return (
        ids(saver.list(older)),
        ids(saver.list(older, limit=1)),
        ids(saver.list(older, limit=1, before=newest)),
        ids(graph.get_state_history(older, limit=1)),
        [older["configurable"]["checkpoint_id"]],
    )


def test_a_listing_of_one_named_checkpoint_with_a_limit_finds_it(url: str) -> None:
    """`list(config, limit=1)` (and `get_state_history(config, limit=1)`) of a config
    that names an older checkpoint gives that checkpoint, as LangGraph's own savers do.
    Before, the store was asked for the `limit` newest checkpoints and the named one
    picked from them: a listing of anything but the newest was empty."""
    theirs = _named_reads(InMemorySaver())
    assert all(found == theirs[-1] for found in theirs)
    ours = _named_reads(RemitSaver(url))
    assert all(found == ours[-1] for found in ours), ours


def test_a_fork_from_an_edited_head_is_created_when_it_is_made(url: str) -> None:
    """A fork made with a token from a head that `update_state` wrote starts with a
    checkpoint of its own (source "fork"): its `created_at` is when the fork was made,
    as with LangGraph's own fork checkpoints, not the copied checkpoint's time (before,
    a server listing the thread's history showed the fork as made at the edit)."""
    saver = RemitSaver(url)

    def ask(state: Log) -> dict[str, list[str]]:
        return {"log": [f"ask:{interrupt('q')}"]}

    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("ask", ask)
    builder.add_edge(START, "a")
    builder.add_edge("a", "ask")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    graph.invoke({"log": []}, cfg)
    graph.update_state(cfg, {"log": ["edit"]})
    edited = graph.get_state(cfg)
    assert edited.metadata is not None and edited.metadata["source"] == "update"
    time.sleep(0.05)
    made = datetime.datetime.now(datetime.timezone.utc)
    forked = {"configurable": {**edited.config["configurable"], "fork_token": "tok"}}
    graph.invoke(None, forked)
    thread = cfg["configurable"]["thread_id"]
    line = list(
        graph.get_state_history({"configurable": {"thread_id": thread, "fork_token": "tok"}})
    )
    fork = next(s for s in line if s.metadata is not None and s.metadata["source"] == "fork")
    assert fork.parent_config is not None
    assert (
        fork.parent_config["configurable"]["checkpoint_id"]
        == (edited.config["configurable"]["checkpoint_id"])
    )
    assert fork.created_at is not None and edited.created_at is not None
    assert datetime.datetime.fromisoformat(fork.created_at) >= made
    assert fork.created_at > edited.created_at
    assert fork.values == edited.values and fork.next == ("ask",)
