"""RemitSaver probed with shapes the earlier rounds used little: a pause edited with
`update_state` (as no node, as the asking `Send` node, as END) and then resumed by
interrupt id or by a plain value, in a node with two questions, over async streams and
across a SIGKILL. Real LangGraph, real forked processes, on every engine."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import operator
import signal
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")


def config(thread: str | None = None) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or f"lg-{uuid.uuid4().hex}"}}


def statuses(saver: RemitSaver, cfg: dict[str, Any]) -> dict[str, str]:
    """The status of every interrupt the thread holds, by id."""
    thread = cfg["configurable"]["thread_id"]
    return {i.interrupt_id: i.status for i in saver.remit.interrupts(thread)}


def asked(out: dict[str, Any]) -> dict[str, str]:
    """The interrupts a run's output asks, id by prompt."""
    return {i.value: i.id for i in out["__interrupt__"]}


# -- a pause edited with update_state, then resumed ----------------------------------------


class Batch(TypedDict):
    items: list[str]
    got: Annotated[list[str], operator.add]


class Item(TypedDict):
    item: str


def reviews(saver: RemitSaver) -> Any:
    """One `review` branch per item (Send); each asks `ok <item>?`."""

    def review(state: Item) -> dict[str, Any]:
        item = state["item"]
        return {"got": [f"{item}={interrupt(f'ok {item}?')}"]}

    builder = StateGraph(Batch)
    builder.add_node("review", review)
    builder.add_conditional_edges(
        START, lambda s: [Send("review", {"item": i}) for i in s["items"]]
    )
    builder.add_edge("review", END)
    return builder.compile(checkpointer=saver)


class One(TypedDict):
    n: int
    who: str | None


def one_question(saver: RemitSaver) -> Any:
    builder = StateGraph(One)
    builder.add_node("ask", lambda s: {"who": interrupt("who?")})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def test_a_resume_map_by_the_ids_an_edit_replaced_is_refused_and_stores_nothing(
    url: str,
) -> None:
    """An edit makes a checkpoint, and LangGraph gives the tasks it runs again new ids:
    they ask under new interrupt ids. A map by the old ones would be acknowledged,
    stored, and never read (LangGraph drops it and asks again): refused instead (P5)."""
    saver = RemitSaver(url)
    graph = reviews(saver)
    cfg = config()
    old = asked(graph.invoke({"items": ["a", "b"], "got": []}, cfg))
    graph.update_state(cfg, {"got": ["edited"]})
    with pytest.raises(ResumeConflict, match="invoke\\(None, config\\)"):
        graph.invoke(Command(resume={old["ok a?"]: "A"}), cfg)
    with pytest.raises(ResumeConflict, match="invoke\\(None, config\\)"):
        graph.invoke(Command(resume="A"), cfg)  # (two are pending: which one?)
    assert set(statuses(saver, cfg).values()) == {"pending"}
    new = asked(graph.invoke(None, cfg))  # asked again, by new ids
    assert sorted(new) == ["ok a?", "ok b?"] and not set(new.values()) & set(old.values())
    out = graph.invoke(Command(resume={new["ok a?"]: "A", new["ok b?"]: "B"}), cfg)
    assert sorted(out["got"]) == ["a=A", "b=B", "edited"] and "__interrupt__" not in out
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume={old["ok b?"]: "B2"}), cfg)
    assert graph.get_state(cfg).values == out


def test_a_resume_map_at_an_edited_pause_of_a_node_is_refused_and_a_plain_value_answers(
    url: str,
) -> None:
    saver = RemitSaver(url)
    graph = one_question(saver)
    cfg = config()
    old = asked(graph.invoke({"n": 0, "who": None}, cfg))["who?"]
    graph.update_state(cfg, {"n": 5})
    with pytest.raises(ResumeConflict) as refused:
        graph.invoke(Command(resume={old: "alice"}), cfg)
    assert refused.value.interrupt_id == old
    assert statuses(saver, cfg) == {old: "pending"}
    assert graph.invoke(Command(resume="bob"), cfg) == {"n": 5, "who": "bob"}
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="mallory"), cfg)
    assert graph.get_state(cfg).values == {"n": 5, "who": "bob"}


@pytest.mark.parametrize("edit", ["as_send_node", "as_end"])
def test_a_resume_after_an_edit_that_ended_the_send_step_is_refused(url: str, edit: str) -> None:
    """An edit as the `Send` node (with its task id) or as END ends the step that held
    the sends: no branch asks again. A value for one of them would be read by nothing."""
    saver = RemitSaver(url)
    graph = reviews(saver)
    cfg = config()
    old = asked(graph.invoke({"items": ["a"], "got": []}, cfg))["ok a?"]
    if edit == "as_send_node":
        task = graph.get_state(cfg).tasks[0].id
        graph.update_state(cfg, {"got": ["a=manual"]}, as_node="review", task_id=task)
    else:
        graph.update_state(cfg, None, as_node=END)
    assert graph.get_state(cfg).next == ()
    for resume in ("A", {old: "A"}):
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume=resume), cfg)
    assert statuses(saver, cfg) == {old: "pending"}
    done = {"items": ["a"], "got": ["a=manual"] if edit == "as_send_node" else []}
    assert graph.invoke(None, cfg) == done
    assert graph.get_state(cfg).values == done


class Answers(TypedDict):
    log: Annotated[list[str], operator.add]


def two_questions(saver: RemitSaver) -> Any:
    """One node asks `first?`, then `second?`."""

    def ask(state: Answers) -> dict[str, Any]:
        return {"log": [f"{interrupt('first?')}+{interrupt('second?')}"]}

    builder = StateGraph(Answers)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def test_a_value_for_the_second_question_of_an_edited_pause_is_refused_not_given_to_the_first(
    url: str,
) -> None:
    """An edit of a node paused at its second question drops the answer to its first:
    LangGraph runs it again from `first?`, which would take the value meant for
    `second?` (cell 8: each value reaches its own interrupt). Refused; the questions are
    asked again in turn after `invoke(None)`. A fork made by editing the pause too."""
    saver = RemitSaver(url)
    graph = two_questions(saver)
    cfg = config()
    graph.invoke({"log": []}, cfg)
    second = asked(graph.invoke(Command(resume="A"), cfg))["second?"]
    paused = graph.get_state(cfg).config["configurable"]
    graph.update_state(cfg, {"log": ["edit"]})
    with pytest.raises(ResumeConflict, match="first question") as refused:
        graph.invoke(Command(resume="B"), cfg)
    assert refused.value.interrupt_id == second
    assert statuses(saver, cfg)[second] == "pending"
    assert list(asked(graph.invoke(None, cfg))) == ["first?"]
    assert list(asked(graph.invoke(Command(resume="A2"), cfg))) == ["second?"]
    assert graph.invoke(Command(resume="B"), cfg)["log"] == ["edit", "A2+B"]
    graph.update_state({"configurable": {**paused, "fork_token": "f"}}, {"log": ["fork"]})
    fork = {"configurable": {"thread_id": paused["thread_id"], "fork_token": "f"}}
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="FB"), fork)
    assert list(asked(graph.invoke(None, fork))) == ["first?"]
    assert list(asked(graph.invoke(Command(resume="FA"), fork))) == ["second?"]
    assert graph.invoke(Command(resume="FB"), fork)["log"] == ["fork", "FA+FB"]
    assert graph.get_state(cfg).values["log"] == ["edit", "A2+B"]


def test_an_edited_pause_of_a_nodes_first_question_still_takes_a_plain_value(url: str) -> None:
    saver = RemitSaver(url)
    graph = two_questions(saver)
    cfg = config()
    graph.invoke({"log": []}, cfg)
    graph.update_state(cfg, {"log": ["edit"]})
    assert list(asked(graph.invoke(Command(resume="A"), cfg))) == ["second?"]
    assert graph.invoke(Command(resume="B"), cfg)["log"] == ["edit", "A+B"]


def test_async_streams_over_an_edited_fan_out_refuse_the_old_ids_and_take_the_new(
    url: str,
) -> None:
    async def main() -> None:
        saver = RemitSaver(url)
        graph = reviews(saver)
        cfg = config()
        first = await graph.ainvoke({"items": ["a", "b"], "got": []}, cfg)
        old = asked(first)
        await graph.aupdate_state(cfg, {"got": ["edited"]})
        with pytest.raises(ResumeConflict):
            async for _ in graph.astream(Command(resume={old["ok a?"]: "A"}), cfg):
                pass
        modes = ["updates", "values", "custom"]
        chunks = [c async for c in graph.astream(None, cfg, stream_mode=modes)]
        new = {
            i.value: i.id
            for mode, chunk in chunks
            if mode == "updates" and "__interrupt__" in chunk
            for i in chunk["__interrupt__"]
        }
        assert sorted(new) == ["ok a?", "ok b?"]
        resume = Command(resume={new["ok a?"]: "A", new["ok b?"]: "B"})
        updates = [c async for c in graph.astream(resume, cfg, stream_mode="updates")]
        assert sorted(u["review"]["got"][0] for u in updates) == ["a=A", "b=B"]
        state = await graph.aget_state(cfg)
        assert sorted(state.values["got"]) == ["a=A", "b=B", "edited"] and state.next == ()
        assert set(statuses(saver, cfg)[i] for i in new.values()) == {"consumed"}
        assert set(statuses(saver, cfg)[i] for i in old.values()) == {"pending"}

    asyncio.run(main())


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_an_edited_fan_out_asked_again_and_killed_midway_ships_each_branch_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The questions an edited fan-out asks again (by new ids) live on the edit's
    checkpoint: a resumer killed after one branch's effect is recovered by
    `invoke(None)` with the values it took, each branch shipping once (P2, P5)."""
    world = World(tmp_path)

    @remit_core.effect(name="ship", reconcile=world.reconcile("ship"))
    def ship(*, idempotency_key: str) -> str:
        return world.apply("ship", idempotency_key)

    def review(state: Item) -> dict[str, Any]:
        item = state["item"]
        answer = interrupt(f"ok {item}?")
        outcome = ship()
        world.point(f"{item}.after_effect")
        return {"got": [f"{item}={answer}:{outcome}"]}

    builder = StateGraph(Batch)
    builder.add_node("review", review)
    builder.add_conditional_edges(
        START, lambda s: [Send("review", {"item": i}) for i in s["items"]]
    )
    builder.add_edge("review", END)
    graph = builder.compile(checkpointer=RemitSaver(url, lease=LEASE))
    cfg = config()
    graph.invoke({"items": ["a", "b"], "got": []}, cfg, durability=durability)
    graph.update_state(cfg, {"got": ["edited"]})
    new = asked(graph.invoke(None, cfg, durability=durability))

    def doomed() -> None:
        world.armed["b.after_effect"] = "kill"
        resume = Command(resume={new["ok a?"]: "A", new["ok b?"]: "B"})
        graph.invoke(resume, cfg, durability=durability)

    proc = CTX.Process(target=doomed)
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.3)  # the dead resumer's claim expires (L1)
    out = graph.invoke(None, cfg, durability=durability)
    assert sorted(out["got"]) == ["a=A:ship-done", "b=B:ship-done", "edited"]
    assert len(world.applications("ship")) == len(set(world.applications("ship"))) == 2
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume={new["ok b?"]: "B2"}), cfg, durability=durability)
