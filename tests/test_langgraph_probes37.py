"""Round 37 probes of RemitSaver: what `list` and `get_state_history` give back on a
thread with a fork (made with a token) and a subgraph that paused on both branches,
asked with `filter`, `before` and `limit` in every combination a LangGraph user or
server writes, side by side with LangGraph's own `InMemorySaver` on the same script;
and a listing of the whole store by user metadata (a `config["metadata"]` key, a
bool and a float from `configurable`). Real LangGraph, real stores."""

from __future__ import annotations

import operator
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from conftest import engine_url
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def _graph(saver: Any) -> Any:
    """a -> sub (s1 -> s2, which asks) -> c."""
    sub = StateGraph(Log)
    sub.add_node("s1", lambda s: {"log": ["s1"]})
    sub.add_node("s2", lambda s: {"log": [f"s2:{interrupt('sq')}"]})
    sub.add_edge(START, "s1")
    sub.add_edge("s1", "s2")
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("sub", sub.compile())
    builder.add_node("c", lambda s: {"log": ["c"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "sub")
    builder.add_edge("sub", "c")
    return builder.compile(checkpointer=saver)


def _forked_thread(saver: Any) -> tuple[Any, str, Any]:
    """Run to the subgraph's question, answer "x"; fork (token "f1") from the checkpoint
    before `sub`, run the fork to the question again and answer "y" there."""
    graph = _graph(saver)
    thread = f"lg-{uuid.uuid4().hex}"
    cfg = {"configurable": {"thread_id": thread}}
    graph.invoke({"log": []}, cfg)
    graph.invoke(Command(resume="x"), cfg)
    base = next(s for s in graph.get_state_history(cfg) if s.next == ("sub",))
    fork = {"configurable": {**base.config["configurable"], "fork_token": "f1"}}
    graph.invoke(None, fork)
    if isinstance(saver, RemitSaver):  # the token names the fork's line from now on
        at = {"configurable": {"thread_id": thread, "fork_token": "f1"}}
    else:  # LangGraph's own saver continues the newest checkpoint: the fork's
        at = {"configurable": {**next(graph.get_state_history(cfg)).config["configurable"]}}
        at["configurable"]["fork_token"] = "f1"
    graph.invoke(Command(resume="y"), at)
    return graph, thread, base.config


def _listings(saver: Any) -> dict[str, Any]:
    """Each listing as (namespace, position, parent position, metadata, log), the
    checkpoint ids replaced by their position in the thread (per namespace, by id)."""
    graph, thread, base = _forked_thread(saver)
    every = {"configurable": {"thread_id": thread}}
    main = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    pos: dict[str, int] = {}
    for t in sorted(saver.list(every), key=lambda t: (_ns(t.config), _id(t.config))):
        pos[_id(t.config)] = len(pos)

    def row(t: Any) -> tuple[Any, ...]:
        meta = {k: v for k, v in t.metadata.items() if k not in ("run_id", "thread_id")}
        meta["parents"] = {k: pos[v] for k, v in (meta.get("parents") or {}).items()}
        parent = pos.get(_id(t.parent_config)) if t.parent_config else None
        log = t.checkpoint["channel_values"].get("log")
        return (_ns(t.config), pos[_id(t.config)], parent, meta, log)

    queries: dict[str, tuple[Any, dict[str, Any]]] = {
        "every": (every, {}),
        "main": (main, {}),
        "loop": (main, {"filter": {"source": "loop"}}),
        "loop, 2": (main, {"filter": {"source": "loop"}, "limit": 2}),
        "step 1": (every, {"filter": {"step": 1}}),
        "fork's": (every, {"filter": {"source": "fork", "fork_token": "f1"}}),
        "before base": (main, {"before": base}),
        "before base, 1": (main, {"before": base, "limit": 1}),
        "before base, loop": (main, {"before": base, "filter": {"source": "loop"}}),
        "limit 0": (main, {"limit": 0}),
    }
    found: dict[str, Any] = {}
    for name, (cfg, kw) in queries.items():
        rows = [row(t) for t in saver.list(cfg, **kw)]
        # Across namespaces the stores order by id, LangGraph's in-memory saver by namespace.
        found[name] = sorted(rows, key=repr) if cfg is every else rows
    found["history"] = [
        (s.next, s.values, s.metadata["source"], s.metadata["step"])
        for s in graph.get_state_history(every)
    ]
    found["history before, 2"] = [
        (s.next, s.values) for s in graph.get_state_history(every, before=base, limit=2)
    ]
    return found


def _id(config: Any) -> str:
    return str(config["configurable"]["checkpoint_id"])


def _ns(config: Any) -> str:
    return str(config["configurable"].get("checkpoint_ns", "")).split(":")[0]


def test_listings_of_a_forked_thread_with_a_subgraph_are_langgraphs_own(url: str) -> None:
    """Every listing of the thread (all namespaces or the graph's, by metadata, before
    the fork's base, with a limit, and `get_state_history`) holds the same checkpoints,
    in the same order, with the same parents, metadata (`source`, `step`, `parents`)
    and values as LangGraph's own saver gives on the same script."""
    theirs = _listings(InMemorySaver())
    ours = _listings(RemitSaver(url))
    assert theirs["main"][0][3]["source"] == "loop" and len(theirs["every"]) == 16
    for name, rows in theirs.items():
        assert ours[name] == rows, name


def _tagged_runs(saver: Any, tag: str) -> None:
    graph = StateGraph(Log)
    graph.add_node("a", lambda s: {"log": ["a"]})
    graph.add_edge(START, "a")
    compiled = graph.compile(checkpointer=saver)
    for n, user in enumerate(["alice", "bob", "alice"]):
        cfg = {
            "configurable": {"thread_id": f"{tag}-{n}", "flagged": n == 1},
            "metadata": {"tag": tag, "user": user, "score": 0.5 * n},
        }
        compiled.invoke({"log": []}, cfg)


def _by_metadata(saver: Any, tag: str) -> dict[str, Any]:
    def rows(**kw: Any) -> list[tuple[str, int]]:
        found = saver.list(None, filter={"tag": tag, **kw.pop("filter", {})}, **kw)
        return sorted((t.config["configurable"]["thread_id"], t.metadata["step"]) for t in found)

    return {
        "alice": rows(filter={"user": "alice"}),
        "alice at step 0": rows(filter={"user": "alice", "step": 0}),
        "flagged (True)": rows(filter={"flagged": True}),
        "flagged (1)": rows(filter={"flagged": 1}),
        "score 1.0": rows(filter={"score": 1.0}),
        "score 1": rows(filter={"score": 1}),
        "no such key, None": rows(filter={"user": "bob", "absent": None}),
        "one": rows(filter={"user": "bob"}, limit=1),
    }


def test_a_listing_of_the_whole_store_by_user_metadata_is_langgraphs_own(
    tmp_path: Path,
) -> None:
    """`list(None, filter=...)` (a server's search of every thread by metadata) finds the
    checkpoints LangGraph's own saver finds: a `config["metadata"]` key, a bool and a
    float from `configurable`, equal values of another type (True == 1, 1.0 == 1), and a
    key no checkpoint has matched by None. On a store of its own: a shared server's
    whole-store listing reads every other user's runs too."""
    tag = uuid.uuid4().hex
    theirs = _by_metadata(_filled(InMemorySaver(), tag), tag)
    ours = _by_metadata(_filled(RemitSaver(engine_url("sqlite", tmp_path)), tag), tag)
    assert theirs["alice"] and theirs["flagged (1)"] and theirs["score 1"]
    assert {k: v for k, v in ours.items() if k != "one"} == {
        k: v for k, v in theirs.items() if k != "one"
    }
    # With a limit the stores give the newest (LangGraph's in-memory saver, the oldest
    # thread's); bob has one thread, so both give one of its checkpoints.
    assert len(ours["one"]) == 1 and ours["one"][0][0] == f"{tag}-1"


def _filled(saver: Any, tag: str) -> Any:
    _tagged_runs(saver, tag)
    return saver


@pytest.mark.parametrize("engine", ["postgresql", "redis"])
def test_a_threads_listing_by_user_metadata_is_langgraphs_own(engine: str, tmp_path: Path) -> None:
    """The same searches, each within one thread (the shared servers' case)."""
    tag = uuid.uuid4().hex
    saver = RemitSaver(engine_url(engine, tmp_path))
    _tagged_runs(saver, tag)
    own = _filled(InMemorySaver(), tag)
    for n in range(3):
        cfg = {"configurable": {"thread_id": f"{tag}-{n}"}}
        for flt in ({"user": "alice"}, {"flagged": 1}, {"score": 1}, {"step": 0, "tag": tag}):
            ours = [t.metadata["step"] for t in saver.list(cfg, filter=flt)]
            theirs = [t.metadata["step"] for t in own.list(cfg, filter=flt)]
            assert ours == theirs, (n, flt)
