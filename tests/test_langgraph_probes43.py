"""Round 43 of the LangGraph probes: a resume that also fans out (`Command(resume=...,
goto=[Send, ...])`) to nodes that ask questions of their own; a node that asks with a
static breakpoint after it (`interrupt_after`); a `DeltaChannel` key on forks made by
`update_state` and by time travel, sync and async; and a graph recompiled with an edge
changed between a pause and its resume.

Found: a plain value sent with a `goto` fan-out at a pause was consumed for the one
pending question, but LangGraph hands a plain value to the first task that asks in that
step, a `Send` branch whose question nobody answered; the asking node asked again under
the consumed id, which every later answer was refused for ("already consumed") while
the state listed it as pending (P5: the value reached another question than the one
it was acknowledged for). Now such a value goes to LangGraph by the id it was consumed
for, and the run goes on as the same resume by id does on LangGraph's own saver.
Held, each compared with LangGraph's own `InMemorySaver` where the answer is
LangGraph's: the by-id fan-out, the breakpoint after an asking node (a second value is
refused), the delta key on forks, and the changed edge. Real LangGraph, real stores on
every engine."""

from __future__ import annotations

import asyncio
import operator
import uuid
from typing import Annotated, Any

import pytest
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from typing_extensions import TypedDict

from remit_core import ResumeConflict
from remit_langgraph import RemitSaver


class Items(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    item: str


def asking(saver: Any, **compile_options: Any) -> Any:
    """ask (interrupt "ok?") -> c; `ask2` (interrupt per item) is reached by `Send`."""

    def ask(state: Items) -> dict[str, list[str]]:
        return {"log": [f"ask:{interrupt('ok?')}"]}

    def ask2(state: Items) -> dict[str, list[str]]:
        item = state.get("item")
        return {"log": [f"ask2:{item}:{interrupt(f'item {item}?')}"]}

    builder = StateGraph(Items)
    builder.add_node("ask", ask)
    builder.add_node("ask2", ask2)
    builder.add_node("c", lambda state: {"log": ["c"]})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "c")
    builder.add_edge("ask2", END)
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver, **compile_options)


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg43-{uuid.uuid4().hex}"}}


FAN_OUT = [Send("ask2", {"item": "p"}), Send("ask2", {"item": "q"})]


def questions(out: dict[str, Any]) -> dict[str, str]:
    return {i.value: i.id for i in out.get("__interrupt__", ())}


def by_id_fan_out(saver: Any, plain: bool = False) -> list[Any]:
    """Pause at ask; answer it (by id, or `plain`) with a fan-out to two asking
    branches; answer those by id. What each step showed."""
    graph, cfg = asking(saver), config()
    asked = questions(graph.invoke({"log": []}, cfg))
    out = graph.invoke(Command(resume="x" if plain else {asked["ok?"]: "x"}, goto=FAN_OUT), cfg)
    seen: list[Any] = [out["log"], sorted(questions(out))]
    ids = questions(out)
    out = graph.invoke(Command(resume={ids["item p?"]: "P"}), cfg)
    seen.append((out["log"], sorted(questions(out))))
    seen.append(graph.invoke(Command(resume={ids["item q?"]: "Q"}), cfg)["log"])
    return seen


def test_a_resume_by_id_with_a_goto_fan_out_answers_each_question_once(url: str) -> None:
    """The answer by id reaches `ask` alone; the two branches ask and are answered by
    their own ids, as with LangGraph's own saver; an answer to a branch already answered
    is refused and stores nothing (P5)."""
    own = by_id_fan_out(InMemorySaver())
    assert own[0] == ["ask:x"] and own[-1] == ["ask:x", "ask2:p:P", "ask2:q:Q", "c"]
    assert by_id_fan_out(RemitSaver(url)) == own

    graph, cfg = asking(RemitSaver(url)), config()
    asked = questions(graph.invoke({"log": []}, cfg))
    ids = questions(graph.invoke(Command(resume={asked["ok?"]: "x"}, goto=FAN_OUT), cfg))
    graph.invoke(Command(resume={ids["item p?"]: "P"}), cfg)
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume={ids["item p?"]: "P2"}), cfg)
    assert graph.invoke(Command(resume={ids["item q?"]: "Q"}), cfg)["log"] == [
        "ask:x",
        "ask2:p:P",
        "ask2:q:Q",
        "c",
    ]


def test_a_plain_answer_with_a_goto_fan_out_reaches_only_its_own_question(url: str) -> None:
    """`Command(resume="x", goto=[Send, Send])` at a pause with one question: Remit
    consumes "x" for that question ("ok?"), so "x" is the answer of `ask` and of no other
    question; the two branches ask theirs, and the run goes on as the same resume by id
    does on LangGraph's own saver (before: LangGraph gave "x" to the first branch, and
    `ask` asked again under the consumed id, which every answer was refused for). A
    second value is refused."""
    own = by_id_fan_out(InMemorySaver())
    assert by_id_fan_out(RemitSaver(url), plain=True) == own

    graph, cfg = asking(RemitSaver(url)), config()
    graph.invoke({"log": []}, cfg)
    out = graph.invoke(Command(resume="x", goto=FAN_OUT), cfg)
    assert out["log"] == ["ask:x"]
    assert sorted(questions(out)) == ["item p?", "item q?"]
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="y"), cfg)


def after_a_question(saver: Any) -> list[Any]:
    """A node that asks, with a breakpoint after it: answer, answer again, continue."""
    graph, cfg = asking(saver, interrupt_after=["ask"]), config()
    graph.invoke({"log": []}, cfg)
    seen: list[Any] = [graph.invoke(Command(resume="x"), cfg)["log"]]
    state = graph.get_state(cfg)
    seen.append((state.next, state.interrupts))
    try:
        seen.append(graph.invoke(Command(resume="y"), cfg)["log"])
    except ResumeConflict:
        seen.append("refused")
    seen.append(graph.invoke(None, cfg)["log"])
    return seen


def test_a_breakpoint_after_an_asking_node_takes_no_second_answer(url: str) -> None:
    """After the answer, the run stops at the breakpoint (nothing pending). LangGraph's
    own saver takes a second value there and runs on; Remit refuses it (the question was
    consumed, P5) and stores nothing; `invoke(None, config)` goes on to the same end."""
    own = after_a_question(InMemorySaver())
    assert own == [["ask:x"], (("c",), ()), ["ask:x", "c"], ["ask:x", "c"]]
    assert after_a_question(RemitSaver(url)) == [*own[:2], "refused", own[3]]


def extend(state: list[str], writes: list[list[str]]) -> list[str]:
    return [*state, *(item for write in writes for item in write)]


class Delta(TypedDict, total=False):
    log: Annotated[list[str], DeltaChannel(extend, snapshot_frequency=50)]


def delta_line(saver: Any) -> Any:
    """a -> b -> ask (interrupt) -> c, the log a `DeltaChannel` key."""

    def ask(state: Delta) -> dict[str, list[str]]:
        return {"log": [f"ask:{interrupt('ok?')}"]}

    builder = StateGraph(Delta)
    builder.add_node("a", lambda state: {"log": ["a"]})
    builder.add_node("b", lambda state: {"log": ["b"]})
    builder.add_node("ask", ask)
    builder.add_node("c", lambda state: {"log": ["c"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "ask")
    builder.add_edge("ask", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


def forked_delta_logs(saver: Any, *, remit: bool) -> list[Any]:
    """Run to the end; fork before `b`, `ask` and `c` by an edit and by time travel (a
    token with Remit, LangGraph's own way without); each fork's logs as it goes."""
    graph, cfg = delta_line(saver), config()
    thread = cfg["configurable"]["thread_id"]
    graph.invoke({"log": ["in"]}, cfg)
    graph.invoke(Command(resume="main"), cfg)
    history = list(graph.get_state_history(cfg))
    seen: list[Any] = []
    for step in ("b", "ask", "c"):
        base = next(s for s in history if s.next == (step,))
        for how in ("edit", "travel"):
            token = f"{how}-{step}"
            at = {"configurable": dict(base.config["configurable"])}
            if remit:
                at["configurable"]["fork_token"] = token
            now = {"configurable": {"thread_id": thread, "fork_token": token}}
            if how == "edit":
                made = graph.update_state(at, {"log": [token]})
                seen.append(graph.get_state(now if remit else made).values["log"])
                out = graph.invoke(None, now if remit else made)
            else:
                out = graph.invoke(None, at)
            now = now if remit else {"configurable": {"thread_id": thread}}
            if "__interrupt__" in out:
                out = graph.invoke(Command(resume=token), now)
            seen.append(out["log"])
    seen.append(asyncio.run(graph.aget_state(cfg)).values["log"] if remit else None)
    return seen


def test_a_delta_key_on_forks_reads_as_with_langgraphs_own_saver(url: str) -> None:
    """A `DeltaChannel` key is rebuilt from its ancestors' writes: on a fork it holds
    the fork's own line (the edit, the fork's answer), never main's later writes, as
    with LangGraph's own saver; main keeps its own."""
    own = forked_delta_logs(InMemorySaver(), remit=False)
    remit = forked_delta_logs(RemitSaver(url), remit=True)
    assert remit[:-1] == own[:-1]
    assert remit[-1] == ["in", "a", "b", "ask:main", "c"]
    assert own[1] == ["in", "a", "edit-b", "b", "ask:edit-b", "c"]


def test_an_async_time_travel_fork_of_a_delta_key_is_its_own_line(url: str) -> None:
    """The same through the async API: a fork before `ask`, answered on the fork, holds
    its answer; main holds its own."""

    async def script(saver: Any, remit: bool) -> list[Any]:
        graph, cfg = delta_line(saver), config()
        await graph.ainvoke({"log": ["in"]}, cfg)
        await graph.ainvoke(Command(resume="main"), cfg)
        base = [s async for s in graph.aget_state_history(cfg) if s.next == ("ask",)][0]
        at = {"configurable": dict(base.config["configurable"])}
        now = cfg
        if remit:
            at["configurable"]["fork_token"] = "t"
            now = {"configurable": {**cfg["configurable"], "fork_token": "t"}}
        await graph.ainvoke(None, at)
        out = await graph.ainvoke(Command(resume="fork"), now)
        return [out["log"], (await graph.aget_state(cfg)).values["log"] if remit else None]

    own = asyncio.run(script(InMemorySaver(), False))
    assert own[0] == ["in", "a", "b", "ask:fork", "c"]
    assert asyncio.run(script(RemitSaver(url), True)) == [own[0], ["in", "a", "b", "ask:main", "c"]]


def routed(saver: Any, after_ask: str) -> Any:
    """ask (interrupt) -> `after_ask` ("c" or "other") -> end."""
    graph = asking(None)
    builder = StateGraph(Items)
    builder.add_node("ask", graph.builder.nodes["ask"].runnable)
    builder.add_node("c", lambda state: {"log": ["c"]})
    builder.add_node("other", lambda state: {"log": ["other"]})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", after_ask)
    builder.add_edge("c", END)
    builder.add_edge("other", END)
    return builder.compile(checkpointer=saver)


def test_a_resume_with_an_edge_changed_since_the_pause_follows_the_new_edge(url: str) -> None:
    """A release that routes `ask` elsewhere resumes the pause once and takes the new
    edge, as with LangGraph's own saver; a second value is refused."""
    own, cfg = InMemorySaver(), config()
    routed(own, "c").invoke({"log": []}, cfg)
    expected = routed(own, "other").invoke(Command(resume="y"), cfg)
    assert expected == {"log": ["ask:y", "other"]}

    saver, cfg = RemitSaver(url), config()
    routed(saver, "c").invoke({"log": []}, cfg)
    assert routed(saver, "other").invoke(Command(resume="y"), cfg) == expected
    with pytest.raises(ResumeConflict):
        routed(saver, "c").invoke(Command(resume="z"), cfg)
    assert routed(saver, "c").get_state(cfg).values == expected
