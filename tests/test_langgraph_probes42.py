"""Round 42 of the LangGraph probes: a resume value that the asking node's own
`response_schema` refuses. `interrupt(..., response_schema=Approval)` validates the value
by the model itself (its `field_validator`s), which the JSON Schema Remit checks before
the consume cannot express. LangGraph then raises `ValidationError` from the node and
stores nothing of the answer, so the question can be answered again (its own docs).

Before: Remit had consumed the refused value, so every later `Command(resume=...)` got
`ResumeConflict` ("already consumed") and every `invoke(None, config)` handed the node
the refused value again and failed the same way: a thread nobody could continue (P4
cell 21, liveness). After: the node's refusal opens the question again; the next answer
is consumed once (racing resumers: one wins), a killed resumer's answer is given back
to the recovery, and `invoke(None, config)` asks the question again instead of handing
over the refused value. Also probed and held: a `RunControl.request_drain()` during a
resume (the drained run continues with `invoke(None, config)`, a second value is
refused), and a map answering two parallel questions whose resumer was SIGKILLed
between the two consumes. Real LangGraph (compared with its own `InMemorySaver` where
the answer is LangGraph's), real stores on every engine, real processes killed with
SIGKILL."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import operator
import signal
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import GraphDrained
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import RunControl
from langgraph.types import Command, interrupt
from pydantic import BaseModel, ValidationError, field_validator
from test_langgraph_probes10 import race
from typing_extensions import TypedDict

from remit_core import ResumeConflict, failpoints
from remit_langgraph import RemitSaver

CTX = mp.get_context("fork")
LEASE = 1.0
DURABILITIES = ["sync", "async", "exit"]


class Approval(BaseModel):
    reviewer: str

    @field_validator("reviewer")
    @classmethod
    def known(cls, value: str) -> str:
        if value not in ("alice", "bob", "carol", "dave"):
            raise ValueError(f"unknown reviewer {value}")
        return value


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def approving(saver: Any, *, parallel: bool = False) -> Any:
    """ask (interrupt with an `Approval` schema) -> done; with `parallel`, a second
    node `other` asks a plain question beside it."""

    def ask(state: Log) -> dict[str, list[str]]:
        answer = interrupt("who approves?", response_schema=Approval)
        return {"log": [f"ask:{answer.reviewer}"]}

    def other(state: Log) -> dict[str, list[str]]:
        return {"log": [f"other:{interrupt('other?')}"]}

    builder = StateGraph(Log)
    builder.add_node("ask", ask)
    builder.add_node("done", lambda state: {"log": ["done"]})
    builder.add_edge(START, "ask")
    if parallel:
        builder.add_node("other", other)
        builder.add_edge(START, "other")
        builder.add_edge(["ask", "other"], "done")
    else:
        builder.add_edge("ask", "done")
    builder.add_edge("done", END)
    return builder.compile(checkpointer=saver)


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg42-{uuid.uuid4().hex}"}}


def outcome(fn: Callable[[], Any]) -> Any:
    """What `fn` returned (its log and open questions), or its error's class name."""
    try:
        out = fn()
    except Exception as exc:  # the class is the outcome the contract names
        return type(exc).__name__
    return (out["log"], [i.value for i in out.get("__interrupt__", ())])


def answer(name: str) -> Command[Any]:
    return Command(resume={"reviewer": name})


def script(saver: Any, durability: str) -> list[Any]:
    """Ask; answer with a reviewer the schema's validator refuses; answer again."""
    graph, cfg = approving(saver), config()
    graph.invoke({"log": []}, cfg, durability=durability)
    return [
        outcome(functools.partial(graph.invoke, answer(name), cfg, durability=durability))
        for name in ("mallory", "alice")
    ]


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_refused_answer_leaves_the_question_answerable_once(url: str, durability: str) -> None:
    """LangGraph refuses the value in the node and takes the next one; so does Remit,
    once: a third value finds the question answered (P5)."""
    assert script(InMemorySaver(), durability) == [
        "ValidationError",
        (["ask:alice", "done"], []),
    ]
    graph, cfg = approving(RemitSaver(url)), config()
    graph.invoke({"log": []}, cfg, durability=durability)
    with pytest.raises(ValidationError):
        graph.invoke(answer("mallory"), cfg, durability=durability)
    paused = graph.get_state(cfg)
    assert paused.next == ("ask",)
    assert [i.value for i in paused.interrupts] == ["who approves?"]
    out = graph.invoke(answer("alice"), cfg, durability=durability)
    assert out["log"] == ["ask:alice", "done"]
    with pytest.raises(ResumeConflict):
        graph.invoke(answer("bob"), cfg, durability=durability)
    assert graph.get_state(cfg).values["log"] == ["ask:alice", "done"]


def test_refused_answers_in_turn_by_map_and_async(url: str) -> None:
    """Two refused answers in a row (one by interrupt id), then one taken; the same
    through the async API."""
    graph, cfg = approving(RemitSaver(url)), config()
    graph.invoke({"log": []}, cfg)
    asked = graph.get_state(cfg).interrupts[0].id
    assert outcome(lambda: graph.invoke(answer("mallory"), cfg)) == "ValidationError"
    by_id = Command(resume={asked: {"reviewer": "eve"}})
    assert outcome(lambda: graph.invoke(by_id, cfg)) == "ValidationError"
    assert graph.invoke(Command(resume={asked: {"reviewer": "bob"}}), cfg)["log"] == [
        "ask:bob",
        "done",
    ]

    async def main() -> list[Any]:
        cfg = config()
        await graph.ainvoke({"log": []}, cfg)
        got = []
        for name in ("mallory", "carol", "dave"):
            try:
                got.append((await graph.ainvoke(answer(name), cfg))["log"])
            except Exception as exc:  # the class is the outcome
                got.append(type(exc).__name__)
        return got

    assert asyncio.run(main()) == ["ValidationError", ["ask:carol", "done"], "ResumeConflict"]


def test_continuing_after_a_refused_answer_asks_again(url: str) -> None:
    """`invoke(None, config)` does not hand the node the value it refused (LangGraph's
    own saver does, and fails again): the node asks again, and the next answer is
    taken once."""
    saver = InMemorySaver()
    graph, cfg = approving(saver), config()
    graph.invoke({"log": []}, cfg)
    assert outcome(lambda: graph.invoke(answer("mallory"), cfg)) == "ValidationError"
    assert outcome(lambda: graph.invoke(None, cfg)) == "ValidationError"

    graph, cfg = approving(RemitSaver(url)), config()
    graph.invoke({"log": []}, cfg)
    assert outcome(lambda: graph.invoke(answer("mallory"), cfg)) == "ValidationError"
    assert outcome(lambda: graph.invoke(None, cfg)) == ([], ["who approves?"])
    assert outcome(lambda: graph.invoke(answer("bob"), cfg)) == (["ask:bob", "done"], [])
    assert outcome(lambda: graph.invoke(answer("carol"), cfg)) == "ResumeConflict"


def test_a_refused_answer_beside_a_taken_one(url: str) -> None:
    """A map answers two parallel questions; the node of one refuses its value. The
    other stays answered (a second value for it is refused), the refused one is asked
    again and answered once."""
    graph, cfg = approving(RemitSaver(url), parallel=True), config()
    graph.invoke({"log": []}, cfg)
    ids = {i.value: i.id for i in graph.get_state(cfg).interrupts}
    both = Command(resume={ids["who approves?"]: {"reviewer": "mallory"}, ids["other?"]: "B"})
    assert outcome(lambda: graph.invoke(both, cfg)) == "ValidationError"
    again = Command(resume={ids["other?"]: "C"})
    assert outcome(lambda: graph.invoke(again, cfg)) == "ResumeConflict"
    out = graph.invoke(Command(resume={ids["who approves?"]: {"reviewer": "bob"}}), cfg)
    assert sorted(out["log"]) == ["ask:bob", "done", "other:B"]


def test_racing_answers_to_a_question_asked_again(url: str) -> None:
    """Four processes answer the re-asked question at once, each with its own valid
    reviewer: exactly one proceeds, the others get `ResumeConflict` (P5)."""
    graph, cfg = approving(RemitSaver(url)), config()
    graph.invoke({"log": []}, cfg)
    assert outcome(lambda: graph.invoke(answer("mallory"), cfg)) == "ValidationError"
    names = ["alice", "bob", "carol", "dave"]

    def resume(i: int) -> Any:
        return approving(RemitSaver(url)).invoke(answer(names[i]), cfg)

    got = [o for _, _, o in race(len(names), resume, outcome)]
    won = [g for g in got if g != "ResumeConflict"]
    assert len(won) == 1, got
    log, _ = won[0]
    assert log == graph.get_state(cfg).values["log"]
    assert log[0] in {f"ask:{n}" for n in names} and log[1:] == ["done"]


def killed(fn: Callable[[], Any]) -> None:
    """Run `fn` in a forked process that must die by SIGKILL; then let its lease run out."""
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.3)  # the dead resumer's claim expires (L1): the lease is time


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_resumer_killed_after_answering_again(url: str, durability: str) -> None:
    """The second answer is consumed and its resumer is SIGKILLed before the node runs:
    the recovery continues with that answer (not the refused one), and a new value is
    refused (P5, L1)."""
    graph, cfg = approving(RemitSaver(url, lease=LEASE)), config()
    graph.invoke({"log": []}, cfg, durability=durability)
    assert outcome(lambda: graph.invoke(answer("mallory"), cfg, durability=durability)) == (
        "ValidationError"
    )

    def doomed() -> None:
        failpoints.arm("interrupt.after_consume", "kill")
        approving(RemitSaver(url, lease=LEASE)).invoke(answer("bob"), cfg, durability=durability)

    killed(doomed)
    assert outcome(lambda: graph.invoke(answer("carol"), cfg, durability=durability)) == (
        "ResumeConflict"
    )
    out = graph.invoke(None, cfg, durability=durability)
    assert out["log"] == ["ask:bob", "done"]


# -- what held ------------------------------------------------------------------------


def test_a_resume_drained_by_run_control_continues_once(url: str) -> None:
    """`RunControl.request_drain()` (a server's SIGTERM) stops the resumed run at the
    next step boundary with `GraphDrained`, as with LangGraph's own saver: the answer
    is kept, a second one is refused, and `invoke(None, config)` finishes the run."""

    def drained(saver: Any) -> tuple[Any, list[str], dict[str, Any]]:
        control = RunControl()

        def ask(state: Log) -> dict[str, list[str]]:
            value = interrupt("ok?")
            control.request_drain("sigterm")
            return {"log": [f"ask:{value}"]}

        builder = StateGraph(Log)
        builder.add_node("ask", ask)
        builder.add_node("done", lambda state: {"log": ["done"]})
        builder.add_edge(START, "ask")
        builder.add_edge("ask", "done")
        builder.add_edge("done", END)
        graph, cfg = builder.compile(checkpointer=saver), config()
        graph.invoke({"log": []}, cfg)
        with pytest.raises(GraphDrained):
            graph.invoke(Command(resume="yes"), cfg, control=control)
        state = graph.get_state(cfg)
        return graph, [*state.next, *state.values["log"]], cfg

    _, mem_state, _ = drained(InMemorySaver())
    graph, state, cfg = drained(RemitSaver(url))
    assert state == mem_state == ["done", "ask:yes"]
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="no"), cfg)
    assert graph.invoke(None, cfg)["log"] == ["ask:yes", "done"]


def test_a_map_resumer_killed_between_its_two_consumes(url: str) -> None:
    """A map answers two parallel questions; its resumer is SIGKILLed after the first
    consume. Nothing is answered twice: the same map again is refused (one of its
    questions was consumed), `invoke(None, config)` continues the consumed one and
    asks the other again, which is then answered once."""

    def fan(saver: Any) -> Any:
        def a(state: Log) -> dict[str, list[str]]:
            return {"log": [f"a:{interrupt('a?')}"]}

        def b(state: Log) -> dict[str, list[str]]:
            return {"log": [f"b:{interrupt('b?')}"]}

        builder = StateGraph(Log)
        builder.add_node("a", a)
        builder.add_node("b", b)
        builder.add_node("join", lambda state: {"log": ["join"]})
        builder.add_edge(START, "a")
        builder.add_edge(START, "b")
        builder.add_edge(["a", "b"], "join")
        builder.add_edge("join", END)
        return builder.compile(checkpointer=saver)

    graph, cfg = fan(RemitSaver(url, lease=LEASE)), config()
    graph.invoke({"log": []}, cfg)
    ids = {i.value: i.id for i in graph.get_state(cfg).interrupts}
    both = Command(resume={ids["a?"]: "A", ids["b?"]: "B"})

    def doomed() -> None:
        failpoints.arm("interrupt.after_consume", "kill")
        fan(RemitSaver(url, lease=LEASE)).invoke(both, cfg)

    killed(doomed)
    assert outcome(lambda: graph.invoke(both, cfg)) == "ResumeConflict"
    # The map's first entry was consumed: its node runs with it, the other asks again.
    assert outcome(lambda: graph.invoke(None, cfg)) == (["a:A"], ["b?"])
    out = graph.invoke(Command(resume={ids["b?"]: "B"}), cfg)
    assert sorted(out["log"]) == ["a:A", "b:B", "join"]
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume={ids["b?"]: "again"}), cfg)
