"""RemitSaver probed where a subgraph has a schema of its own: a subgraph node's
write that breaks the subgraph's state schema (a key the parent does not declare),
for a subgraph added as a node, one invoked inside a node function, one with a line
of its own (`checkpointer=True`) and one nested in another, in every durability mode,
sync and async, on a run and on a fork's first run (which replays the subgraph); then
the thread resumes from its last valid checkpoint. Also a write to an `add_messages`
key that LangGraph's reducer cannot apply (no message, the removal of an id the chat
lacks). Real LangGraph, real stores on every engine."""

from __future__ import annotations

import asyncio
import operator
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid
from remit_langgraph import RemitSaver


def config(thread: str | None = None) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or f"lg-{uuid.uuid4().hex}"}}


# -- a subgraph node's write, checked by the subgraph's own schema ------------------------


class Outer(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


class Inner(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    k: Annotated[int, Ge(0)]


def inner_graph(plan: dict[str, Any], **compile_options: Any) -> Any:
    """START -> s1 (k = plan["k"]) -> s2 (logs k) -> END; `k` is the subgraph's key only."""

    def s1(state: Inner) -> dict[str, Any]:
        return {"k": plan["k"]}

    def s2(state: Inner) -> dict[str, Any]:
        return {"log": [f"k={state['k']}"]}

    inner = StateGraph(Inner)
    inner.add_node("s1", s1)
    inner.add_node("s2", s2)
    inner.add_edge(START, "s1")
    inner.add_edge("s1", "s2")
    inner.add_edge("s2", END)
    return inner.compile(**compile_options)


def one_node(node: Any) -> StateGraph[Any]:
    outer = StateGraph(Outer)
    outer.add_node("sub", node)
    outer.add_edge(START, "sub")
    outer.add_edge("sub", END)
    return outer


def as_node(plan: dict[str, Any]) -> StateGraph[Any]:
    return one_node(inner_graph(plan))


def inside_node(plan: dict[str, Any]) -> StateGraph[Any]:
    sub = inner_graph(plan)

    def call(state: Outer) -> dict[str, Any]:
        return {"log": sub.invoke({"log": []})["log"]}

    return one_node(call)


def own_line(plan: dict[str, Any]) -> StateGraph[Any]:
    return one_node(inner_graph(plan, checkpointer=True))


def nested(plan: dict[str, Any]) -> StateGraph[Any]:
    return one_node(one_node(inner_graph(plan)).compile())


SHAPES: dict[str, Callable[[dict[str, Any]], StateGraph[Any]]] = {
    "as-node": as_node,
    "inside-node": inside_node,
    "checkpointer-true": own_line,
    "nested": nested,
}


def stored_ks(saver: RemitSaver, cfg: dict[str, Any]) -> list[Any]:
    """Every value of `k` the thread's records hold, in every namespace: in checkpoints
    and in pending writes."""
    found = []
    for saved in saver.list({"configurable": {"thread_id": cfg["configurable"]["thread_id"]}}):
        values = saved.checkpoint["channel_values"]
        if "k" in values:
            found.append(values["k"])
        found += [v for _, ch, v in saved.pending_writes or () if ch == "k"]
    return found


def run(graph: Any, given: Any, cfg: dict[str, Any], durability: str, use_async: bool) -> Any:
    if use_async:
        return asyncio.run(graph.ainvoke(given, cfg, durability=durability))
    return graph.invoke(given, cfg, durability=durability)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_subgraph_nodes_invalid_write_is_refused_by_the_subgraphs_own_schema(
    url: str, shape: str
) -> None:
    """A subgraph's node writes `k = -1`, which the subgraph's schema refuses
    (`Annotated[int, Ge(0)]`; the parent has no `k`). The run fails with
    `CheckpointInvalid` naming `k`, in every durability mode, sync and async, and no
    record of the thread holds the value. Once the node writes a valid value,
    `invoke(None, config)` resumes the thread from its last valid checkpoint."""
    with RemitSaver.from_conn_string(url) as saver:
        for durability in ("sync", "async", "exit"):
            for use_async in (False, True):
                plan = {"k": -1}
                graph = SHAPES[shape](plan).compile(checkpointer=saver)
                cfg = config()
                with pytest.raises(CheckpointInvalid) as refused:
                    run(graph, {"log": []}, cfg, durability, use_async)
                assert refused.value.field == "k", (durability, use_async)
                assert all(k >= 0 for k in stored_ks(saver, cfg)), (durability, use_async)
                plan["k"] = 3
                out = run(graph, None, cfg, durability, use_async)
                assert out == {"log": ["k=3"]}, (durability, use_async)
                assert graph.get_state(cfg).values == {"log": ["k=3"]}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_subgraph_nodes_invalid_write_on_a_forks_first_run_is_refused(
    url: str, shape: str
) -> None:
    """A fork's first run replays the subgraph from where it stood before the fork's
    base (LangGraph's subgraph loop restores its checkpoint with `list`, not
    `get_tuple`). Its node's `k = -1` is refused there too, sync and async, in
    "sync" and "async" durability; no record of the thread holds it, main is
    untouched, and the fork resumes once the node writes a valid value."""
    with RemitSaver.from_conn_string(url) as saver:
        for durability in ("sync", "async"):
            for use_async in (False, True):
                plan = {"k": 3}
                graph = SHAPES[shape](plan).compile(checkpointer=saver)
                cfg = config()
                run(graph, {"log": []}, cfg, durability, use_async)
                base = next(s for s in graph.get_state_history(cfg) if s.next == ("sub",))
                fork = {"configurable": {**base.config["configurable"], "fork_token": "f"}}
                plan["k"] = -1
                with pytest.raises(CheckpointInvalid) as refused:
                    run(graph, None, fork, durability, use_async)
                assert refused.value.field == "k", (durability, use_async)
                assert all(k >= 0 for k in stored_ks(saver, cfg)), (durability, use_async)
                plan["k"] = 5
                assert run(graph, None, fork, durability, use_async) == {"log": ["k=5"]}
                assert graph.get_state(cfg).values == {"log": ["k=3"]}


# -- a write an `add_messages` key's reducer refuses ----------------------------------------


def chat(plan: dict[str, Any], saver: RemitSaver) -> Any:
    """START -> reply (writes plan["write"] to `messages`) -> END, on `MessagesState`."""
    from langgraph.graph import MessagesState

    builder = StateGraph(MessagesState)
    builder.add_node("reply", lambda state: {"messages": plan["write"]})
    builder.add_edge(START, "reply")
    builder.add_edge("reply", END)
    return builder.compile(checkpointer=saver)


def test_a_message_write_the_reducer_refuses_is_refused_and_the_thread_resumes(url: str) -> None:
    """A node's write to an `add_messages` key that LangGraph's reducer cannot apply (a
    number, a message of an unknown role, the removal of an id the chat lacks) is
    refused with `CheckpointInvalid` naming `messages`, in every durability mode,
    sync and async: no pending write holds it (LangGraph's own saver keeps it, and
    every later run of the thread fails applying it again). Once the node writes a
    message, `invoke(None, config)` goes on. The removal of an id the chat has is taken."""
    from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage

    bad: list[Any] = [42, [{"role": "nope", "content": "x"}], [RemoveMessage(id="absent")]]
    with RemitSaver.from_conn_string(url) as saver:
        for durability in ("sync", "async", "exit"):
            for use_async in (False, True):
                for write in bad:
                    plan = {"write": write}
                    graph = chat(plan, saver)
                    cfg = config()
                    given = {"messages": [HumanMessage("hi", id="m1")]}
                    with pytest.raises(CheckpointInvalid) as refused:
                        run(graph, given, cfg, durability, use_async)
                    assert refused.value.field == "messages", (durability, use_async, write)
                    saved = saver.get_tuple(cfg)
                    assert saved is None or saved.pending_writes == [], (durability, write)
                    plan["write"] = [AIMessage("ok", id="m2")]
                    out = run(graph, None, cfg, durability, use_async)
                    assert [m.content for m in out["messages"]] == ["hi", "ok"]
        plan = {"write": [RemoveMessage(id="m1"), AIMessage("ok", id="m2")]}
        cfg = config()
        out = chat(plan, saver).invoke({"messages": [HumanMessage("hi", id="m1")]}, cfg)
        assert [m.content for m in out["messages"]] == ["ok"]
