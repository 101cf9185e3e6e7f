"""Round 39 probes of RemitSaver: a `Command(resume=..., update=...)` or new input
that the running graph refuses only against the thread's state (the removal of a
message the chat lacks, an update that breaks a model's validator) was refused
after the run had started: its resume value was consumed, a new input's checkpoint
was stored, and the run's claim stayed held (renewed) for as long as the process
lived, so every later command on the thread got `ResumeConflict`. Such a write is
now refused before anything is claimed for good or stored (P4, P5). Also pinned:
a chat with tool calls, artifacts and removals stored and read back equal to
LangGraph's own saver, ids included; functional-API tasks run in parallel with one
failing; a resume with an update and a goto. Real LangGraph, real stores on every
engine."""

from __future__ import annotations

import operator
import uuid
from typing import Annotated, Any

import pytest
from langchain_core.messages import (
    AIMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, interrupt
from pydantic import BaseModel, model_validator
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid
from remit_langgraph import RemitSaver

DURABILITIES = ["sync", "async", "exit"]


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg39-{uuid.uuid4().hex}"}}


# -- a chat's update its reducer refuses on the chat -----------------------------------


def chat(saver: Any) -> Any:
    """ask (interrupt) -> END; the answer becomes an AI message with id "ai-<answer>"."""

    def ask(state: MessagesState) -> dict[str, Any]:
        answer = interrupt("reply?")
        return {"messages": [AIMessage(f"got {answer}", id=f"ai-{answer}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def ids(state: Any) -> list[str | None]:
    return [m.id for m in state["messages"]]


REFUSED_UPDATES = {
    "removal of an unknown id": [RemoveMessage(id="nope")],
    "a value that is no message": [3],
}


@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("update", list(REFUSED_UPDATES))
def test_a_command_update_its_reducer_refuses_on_the_chat_consumes_nothing(
    url: str, durability: str, update: str
) -> None:
    """`Command(resume="v", update={"messages": [...]})` whose messages the chat's
    reducer refuses: `CheckpointInvalid` naming "messages", the question still
    pending with nothing stored, and the next command, in the same process, answers
    it (it got `ResumeConflict`: the first run's claim was never given back, and its
    value had been consumed)."""
    graph, cfg = chat(RemitSaver(url)), config()
    graph.invoke({"messages": [HumanMessage("hi", id="h1")]}, cfg, durability=durability)
    before = graph.get_state(cfg)
    history = len(list(graph.get_state_history(cfg)))
    with pytest.raises(CheckpointInvalid) as refused:
        graph.invoke(
            Command(resume="v", update={"messages": REFUSED_UPDATES[update]}),
            cfg,
            durability=durability,
        )
    assert refused.value.field == "messages"
    after = graph.get_state(cfg)
    assert after.next == ("ask",) and after.interrupts == before.interrupts
    assert after.values == before.values
    assert len(list(graph.get_state_history(cfg))) == history
    done = graph.invoke(Command(resume="w"), cfg, durability=durability)
    assert ids(done) == ["h1", "ai-w"]


@pytest.mark.parametrize("durability", DURABILITIES)
def test_new_input_its_reducer_refuses_on_the_chat_stores_nothing(
    url: str, durability: str
) -> None:
    """New input removing a message the chat lacks, on a paused thread and on a new
    one: `CheckpointInvalid`, and no input checkpoint is stored (one was, whose
    pending start step failed every later run); the pause still takes its answer."""
    graph, cfg = chat(RemitSaver(url)), config()
    graph.invoke({"messages": [HumanMessage("hi", id="h1")]}, cfg, durability=durability)
    history = len(list(graph.get_state_history(cfg)))
    with pytest.raises(CheckpointInvalid):
        graph.invoke({"messages": [RemoveMessage(id="nope")]}, cfg, durability=durability)
    assert graph.get_state(cfg).next == ("ask",)
    assert len(list(graph.get_state_history(cfg))) == history
    assert ids(graph.invoke(Command(resume="w"), cfg, durability=durability)) == ["h1", "ai-w"]

    fresh = config()
    with pytest.raises(CheckpointInvalid):
        graph.invoke({"messages": [RemoveMessage(id="nope")]}, fresh, durability=durability)
    assert graph.checkpointer.get_tuple(fresh) is None
    graph.invoke({"messages": [HumanMessage("hi", id="h1")]}, fresh, durability=durability)
    assert ids(graph.invoke(Command(resume="x"), fresh)) == ["h1", "ai-x"]


# -- an update that breaks a model's validator -----------------------------------------


class Window(BaseModel):
    lo: int = 0
    hi: int = 10

    @model_validator(mode="after")
    def ordered(self) -> Window:
        if self.lo > self.hi:
            raise ValueError("lo > hi")
        return self


def windowed(saver: Any) -> Any:
    def ask(state: Window) -> dict[str, Any]:
        return {"lo": int(interrupt("new lo?"))}

    builder = StateGraph(Window)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_command_update_that_breaks_the_models_validator_consumes_nothing(
    url: str, durability: str
) -> None:
    """`update={"lo": 50}` with hi=10 breaks the state model's validator: refused
    with nothing consumed or stored; the next command answers the question. So is
    new input that breaks it on a new thread: nothing is stored."""
    graph, cfg = windowed(RemitSaver(url)), config()
    graph.invoke({"lo": 0, "hi": 10}, cfg, durability=durability)
    before = graph.get_state(cfg)
    with pytest.raises(CheckpointInvalid):
        graph.invoke(Command(resume="1", update={"lo": 50}), cfg, durability=durability)
    after = graph.get_state(cfg)
    assert after.values == before.values and after.interrupts == before.interrupts
    assert graph.invoke(Command(resume="3"), cfg, durability=durability) == {"lo": 3, "hi": 10}

    fresh = config()
    with pytest.raises(CheckpointInvalid):
        graph.invoke({"lo": 50, "hi": 10}, fresh, durability=durability)
    assert graph.checkpointer.get_tuple(fresh) is None


# -- held: a chat with tool calls stored and read back ---------------------------------


def tool_chat(saver: Any) -> Any:
    """agent (a tool call) -> tool (asks, answers the call, removes the first human)."""

    def agent(state: MessagesState) -> dict[str, Any]:
        call = {"name": "lookup", "args": {"q": "x", "n": [1, 2]}, "id": "call-1"}
        message = AIMessage(
            content="",
            id="ai-1",
            name="bot",
            tool_calls=[{**call, "type": "tool_call"}],
            usage_metadata={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
            response_metadata={"model": "m"},
            additional_kwargs={"k": {"nested": [1.5, None]}},
        )
        return {"messages": [message]}

    def tool(state: MessagesState) -> dict[str, Any]:
        answer = interrupt("run the tool?")
        result = ToolMessage(
            content=[{"type": "text", "text": answer}],
            tool_call_id="call-1",
            id="tool-1",
            artifact={"raw": [1, 2, 3]},
            status="success",
        )
        return {"messages": [result, RemoveMessage(id="h-0")]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tool", tool)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "tool")
    builder.add_edge("tool", END)
    return builder.compile(checkpointer=saver)


def dumped(values: Any, generated: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each message's class and fields; an id LangGraph generated is named by its place."""
    out = []
    for message in values["messages"]:
        fields = message.model_dump()
        if fields["id"] in generated:
            fields["id"] = "generated"
        out.append((type(message).__name__, fields))
    return out


def test_a_chat_with_tool_calls_reads_back_as_langgraphs_own_ids_included(url: str) -> None:
    """Tool calls, usage, metadata, a list content, an artifact and a removal: every
    checkpoint of the thread, read by a new saver, is what LangGraph's own saver
    holds, and a generated id is the same id on every read (held)."""
    start = {
        "messages": [
            SystemMessage("sys", id="s-0"),
            HumanMessage("hi", id="h-0", additional_kwargs={"a": 1}),
            HumanMessage("no id given"),
        ]
    }

    def script(saver: Any, cfg: dict[str, Any]) -> list[Any]:
        graph = tool_chat(saver)
        graph.invoke(start, cfg)
        graph.invoke(Command(resume="yes"), cfg)
        return [s.values for s in graph.get_state_history(cfg)]

    own = script(InMemorySaver(), config())
    cfg = config()
    script(RemitSaver(url), cfg)
    read = [s.values for s in tool_chat(RemitSaver(url)).get_state_history(cfg)]
    generated = {m.id for m in read[0]["messages"]} - {"s-0", "ai-1", "tool-1"}
    assert len(generated) == 1
    own_generated = {m.id for m in own[0]["messages"]} - {"s-0", "ai-1", "tool-1"}
    assert [dumped(v, generated) for v in read] == [dumped(v, own_generated) for v in own]
    assert [m.id for m in read[0]["messages"]][1] == next(iter(generated))


# -- held: parallel tasks with one failing; a resume with an update and a goto ---------


@pytest.mark.parametrize("durability", DURABILITIES)
def test_parallel_tasks_with_one_failing_rerun_only_it_as_langgraphs_own(
    url: str, durability: str
) -> None:
    """Three `@task` futures, one raising: `invoke(None, config)` after the failure
    runs only the failed task again, as with LangGraph's own saver (held)."""

    def script(saver: Any) -> tuple[Any, list[str]]:
        calls: list[str] = []
        failing = [True]

        @task
        def ok(i: int) -> int:
            calls.append(f"ok{i}")
            return i * 10

        @task
        def flaky(i: int) -> int:
            calls.append(f"flaky{i}")
            if failing[0]:
                raise RuntimeError("down")
            return -i

        @entrypoint(checkpointer=saver)
        def flow(n: int) -> list[int]:
            futures = [ok(1), ok(2), flaky(n)]
            return [f.result() for f in futures]

        cfg = config()
        with pytest.raises(RuntimeError):
            flow.invoke(3, cfg, durability=durability)
        failing[0] = False
        return flow.invoke(None, cfg, durability=durability), sorted(calls)

    own = script(InMemorySaver())
    assert script(RemitSaver(url)) == own == ([10, 20, -3], ["flaky3", "flaky3", "ok1", "ok2"])


class Note(TypedDict):
    note: str
    log: Annotated[list[str], operator.add]


def noted(saver: Any) -> Any:
    builder = StateGraph(Note)
    builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('q')}:{s['note']}"]})
    builder.add_node("after", lambda s: {"log": [f"after:{s['note']}"]})
    builder.add_node("other", lambda s: {"log": ["other"]})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "after")
    builder.add_edge("after", END)
    builder.add_edge("other", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize(
    "command",
    [
        Command(resume="v", update={"note": "n1"}),
        Command(resume="v", update={"note": "n1"}, goto="other"),
        Command(update={"note": "n2"}, goto="other"),
    ],
    ids=["resume+update", "resume+update+goto", "update+goto"],
)
def test_a_resume_with_an_update_and_a_goto_runs_as_langgraphs_own(
    url: str, command: Command[Any]
) -> None:
    """What the run returns, where it stops and its history's steps are LangGraph's
    own saver's, and a second answer is refused once the first was taken (held)."""

    def script(saver: Any) -> tuple[Any, ...]:
        graph, cfg = noted(saver), config()
        graph.invoke({"note": "n0", "log": []}, cfg)
        out = graph.invoke(command, cfg)
        out.pop("__interrupt__", None)
        history = [
            (s.metadata["source"], s.metadata["step"], s.next, s.values["log"])
            for s in graph.get_state_history(cfg)
        ]
        return out, graph.get_state(cfg).next, history

    assert script(RemitSaver(url)) == script(InMemorySaver())
