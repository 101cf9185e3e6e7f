"""RemitSaver probed where the earlier rounds stopped: a resume value for a pause whose
asking node the graph that runs lacks (recompiled without it), where the question was
asked by a `Send` branch or before an `update_state` of the pause. Real LangGraph
(compared with its own `InMemorySaver` where the answer is LangGraph's), real stores on
every engine; and a task that finishes beside a pause while the checkpoint its step
runs on is still being committed (LangGraph's "async" durability)."""

from __future__ import annotations

import operator
import time
import uuid
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import START, StateGraph
from langgraph.types import Command, Send, interrupt
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}


# -- a resume for a question whose node the running graph lacks ---------------------------


def ask(state: Log) -> dict[str, Any]:
    answer = interrupt(f"ok {state['log']}?")
    return {"log": [f"ask:{answer}"]}


def fanned(with_asker: bool) -> StateGraph[Log]:
    """a -> two `Send` branches to `ask`; recompiled without `ask`, to `other`."""
    builder = StateGraph(Log)
    builder.add_node("a", lambda state: {"log": ["a"]})
    if with_asker:
        builder.add_node("ask", ask)
    else:
        builder.add_node("other", lambda state: {"log": ["other"]})
    builder.add_edge(START, "a")
    builder.add_conditional_edges(
        "a", lambda state: [Send("ask", {"log": [str(i)]}) for i in (0, 1)]
    )
    return builder


def chained(with_asker: bool) -> StateGraph[Log]:
    """a -> ask; recompiled without `ask`: a -> other."""
    builder = StateGraph(Log)
    builder.add_node("a", lambda state: {"log": ["a"]})
    if with_asker:
        builder.add_node("ask", ask)
        builder.add_edge("a", "ask")
    else:
        builder.add_node("other", lambda state: {"log": ["other"]})
        builder.add_edge("a", "other")
    builder.add_edge(START, "a")
    return builder


def test_a_resume_of_send_branches_whose_node_the_recompiled_graph_lacks_is_refused(
    url: str,
) -> None:
    """Two `Send` branches to `ask` pause; a graph recompiled without `ask` gets their
    answers: LangGraph ignores the pending sends and ends the run with the values read
    by nothing. Remit refuses them with `ResumeConflict` naming the node, consumes
    nothing, and the graph that has the node then takes them, once (P5)."""
    own, own_cfg = InMemorySaver(), config()
    own_asked = fanned(True).compile(checkpointer=own).invoke({"log": []}, own_cfg)
    own_map = {i.id: "x" for i in own_asked["__interrupt__"]}
    ended = fanned(False).compile(checkpointer=own).invoke(Command(resume=own_map), own_cfg)
    assert ended == {"log": ["a"]}  # (LangGraph's own saver: the values went nowhere)

    saver = RemitSaver(url)
    graph, cfg = fanned(True).compile(checkpointer=saver), config()
    asked = [i.id for i in graph.invoke({"log": []}, cfg)["__interrupt__"]]
    assert len(asked) == 2
    recompiled = fanned(False).compile(checkpointer=saver)
    before = saver.get_tuple(cfg)
    with pytest.raises(ResumeConflict, match="'ask'") as refused:
        recompiled.invoke(Command(resume={i: "x" for i in asked}), cfg)
    assert refused.value.interrupt_id in asked
    after = saver.get_tuple(cfg)
    assert after is not None and before is not None
    assert after.checkpoint["id"] == before.checkpoint["id"]
    assert after.pending_writes == before.pending_writes
    assert sorted(i.id for i in graph.get_state(cfg).interrupts) == sorted(asked)
    done = graph.invoke(Command(resume={i: "y" for i in asked}), cfg)
    assert sorted(done["log"]) == ["a", "ask:y", "ask:y"]


def test_a_resume_of_an_edited_pause_whose_node_the_recompiled_graph_lacks_is_refused(
    url: str,
) -> None:
    """`ask` pauses, `update_state` edits the pause, and a graph recompiled without
    `ask` is resumed: nothing would read the value. Remit refuses it naming the node and
    stores nothing; the graph that has `ask` then resumes the edited pause with its
    own value (P5)."""
    saver = RemitSaver(url)
    graph, cfg = chained(True).compile(checkpointer=saver), config()
    graph.invoke({"log": []}, cfg)
    graph.update_state(cfg, {"log": ["edit"]})
    head = saver.get_tuple(cfg)
    recompiled = chained(False).compile(checkpointer=saver)
    with pytest.raises(ResumeConflict, match="'ask'"):
        recompiled.invoke(Command(resume="lost"), cfg)
    after = saver.get_tuple(cfg)
    assert head is not None and after is not None
    assert after.checkpoint["id"] == head.checkpoint["id"]
    assert after.pending_writes == head.pending_writes
    done = graph.invoke(Command(resume="kept"), cfg)
    assert done["log"] == ["a", "edit", "ask:kept"]


# -- whole-thread calls given one str -------------------------------------------------------


def test_prune_given_one_str_is_refused_and_deletes_no_thread_its_characters_name(
    url: str,
) -> None:
    """`prune("xy", strategy="delete")` would take each character for a thread id and
    delete those threads: refused with `TypeError` (as LangGraph's own PostgreSQL
    saver refuses it) for either strategy, and a list with a bad id among good ones
    deletes none of them."""
    saver = RemitSaver(url)
    graph = chained(True).compile(checkpointer=saver)
    # A one-character thread id that no other test uses (the servers are shared).
    char = chr(0x20000 + uuid.uuid4().int % 0xA000)
    victim = {"configurable": {"thread_id": char}}
    other = config()
    for cfg in (victim, other):
        graph.invoke({"log": []}, cfg)
    for strategy in ("delete", "keep_latest"):
        with pytest.raises(TypeError, match="not one str"):
            saver.prune(char, strategy=strategy)
    with pytest.raises(ValueError, match="reserved"):
        saver.prune(
            [other["configurable"]["thread_id"], "remit-langgraph:run-index"], strategy="delete"
        )
    for cfg in (victim, other):
        assert graph.get_state(cfg).values == {"log": ["a"]}
    saver.prune([char], strategy="delete")
    assert saver.get_tuple(victim) is None


def test_delete_for_runs_given_one_str_is_refused_not_a_silent_no_op(url: str) -> None:
    """`delete_for_runs(run_id)` with the id itself, not a list of it, took each
    character for a run id and deleted nothing, silently: the user believes the run
    rolled back. It is refused with `TypeError`; the list form deletes the run."""
    saver = RemitSaver(url)
    graph, cfg = chained(True).compile(checkpointer=saver), config()
    graph.invoke({"log": []}, cfg)
    lg_run = f"run-{uuid.uuid4().hex}"
    graph.update_state({"configurable": {**cfg["configurable"], "run_id": lg_run}}, {"log": ["u"]})
    assert graph.get_state(cfg).values == {"log": ["a", "u"]}
    with pytest.raises(TypeError, match="not one str"):
        saver.delete_for_runs(lg_run)
    assert graph.get_state(cfg).values == {"log": ["a", "u"]}
    saver.delete_for_runs([lg_run])
    assert graph.get_state(cfg).values == {"log": ["a"]}


# -- a task's writes that overtake its step's checkpoint commit ---------------------------


class SlowOnOneValue(JsonPlusSerializer):
    """LangGraph's own serializer, slow to encode one value (as an encrypting or
    compressing serializer is on a large one): the commit of the checkpoint that holds
    it is still in flight when the step's tasks finish."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        if obj == ["slow"]:
            time.sleep(0.5)
        return super().dumps_typed(obj)


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_task_that_finished_while_its_steps_checkpoint_committed_keeps_its_effect(
    url: str, durability: Any
) -> None:
    """`pay` charges and finishes beside `ask`, which pauses, while the checkpoint of
    their step is still being committed (in "async" durability LangGraph stores the
    tasks' writes beside that commit, not after it). Their writes belong to the run
    all the same: stored under its claim, with `pay`'s effect calls, so an edit of the
    pause, whose resume runs `pay` again, finds its charge and applies nothing (P2)."""
    applied: list[str] = []

    @remit_core.effect(name="charge", idempotent=True)
    def charge(amount: int, *, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return f"charged-{amount}"

    builder = StateGraph(Log)
    builder.add_node("pay", lambda state: {"log": [charge(1)]})
    builder.add_node("ask", lambda state: {"log": [interrupt("who?")]})
    builder.add_edge(START, "pay")
    builder.add_edge(START, "ask")
    saver = RemitSaver(url, serde=SlowOnOneValue())
    graph, cfg = builder.compile(checkpointer=saver), config()
    graph.invoke({"log": ["slow"]}, cfg, durability=durability)
    assert len(applied) == 1
    graph.update_state(cfg, {"log": ["edited"]})
    done = graph.invoke(Command(resume="alice"), cfg, durability=durability)
    assert sorted(done["log"]) == ["alice", "charged-1", "edited", "slow"]
    assert len(applied) == 1, "the edit made pay charge again"
