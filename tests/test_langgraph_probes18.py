"""RemitSaver probed where the earlier rounds stopped: a plain resume value after an
`update_state` of a paused subgraph (whose task had answered an earlier question, or
asks its first one again), private state keys (a node's own input type, beside
distinct input and output schemas) checked by P4, an `update_state` whose
`checkpoint_id` names no checkpoint of its thread, a refused `update_state` whose
writes LangGraph stores before its commit, and an edit of a subgraph's namespace
checked by the subgraph's own schema. Real LangGraph (compared with its own
`InMemorySaver` where the answer is LangGraph's), real stores on every engine, sync
and async."""

from __future__ import annotations

import operator
import uuid
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from pydantic import BaseModel, ConfigDict
from test_langgraph_probes11 import statuses
from test_langgraph_probes17 import task_config
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid, ResumeConflict, UnknownRecord
from remit_langgraph import RemitSaver


def config(thread: str | None = None) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or f"lg-{uuid.uuid4().hex}"}}


# -- a plain value after an edit of a paused subgraph -------------------------------------


class Sub(TypedDict, total=False):
    y: int
    log: Annotated[list[str], operator.add]


def subgraph_asking(questions: int, saver: Any) -> Any:
    """START -> sub (a subgraph whose one node asks `questions` questions in turn, then
    logs its answers and y) -> END."""

    def ask(state: Sub) -> dict[str, Any]:
        answers = [interrupt(f"q{n + 1}") for n in range(questions)]
        return {"log": [f"{':'.join(answers)}:{state.get('y')}"]}

    inner = StateGraph(Sub)
    inner.add_node("ask", ask)
    inner.add_edge(START, "ask")
    inner.add_edge("ask", END)
    outer = StateGraph(Sub)
    outer.add_node("sub", inner.compile())
    outer.add_edge(START, "sub")
    outer.add_edge("sub", END)
    return outer.compile(checkpointer=saver)


def prompts(out: dict[str, Any]) -> list[str]:
    return [i.value for i in out["__interrupt__"]]


def test_a_plain_value_after_an_edit_of_a_subgraph_that_had_answered_is_refused(
    url: str,
) -> None:
    """The subgraph's node has its answer to q1 and is paused at q2; an `update_state`
    of the subgraph's namespace makes LangGraph run the node again from q1, so a plain
    value sent for q2 (the one interrupt shown pending) would answer q1 instead (with
    LangGraph's own saver it does). Refused, stored nowhere; `invoke(None)` asks q1
    again under a new id, and plain values then answer q1 and q2 in turn, once each."""
    with RemitSaver.from_conn_string(url) as saver:
        graph = subgraph_asking(2, saver)
        cfg = config()
        graph.invoke({"y": 0, "log": []}, cfg)
        assert prompts(graph.invoke(Command(resume="A1"), cfg)) == ["q2"]
        graph.update_state(task_config(graph, cfg, "sub"), {"y": 7})
        before = statuses(saver, cfg)

        with pytest.raises(ResumeConflict, match="first question") as refused:
            graph.invoke(Command(resume="A2"), cfg)
        assert refused.value.interrupt_id in before
        assert statuses(saver, cfg) == before  # nothing consumed
        assert [i.value for i in graph.get_state(cfg, subgraphs=True).interrupts] == ["q2"]

        assert prompts(graph.invoke(None, cfg)) == ["q1"]
        assert prompts(graph.invoke(Command(resume="B1"), cfg)) == ["q2"]
        out = graph.invoke(Command(resume="B2"), cfg)
        assert out["log"] == ["B1:B2:7"]
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="late"), cfg)
        assert graph.get_state(cfg).values == {"y": 7, "log": ["B1:B2:7"]}


def test_a_plain_value_answers_the_question_an_edited_subgraph_asked_again(url: str) -> None:
    """The subgraph pauses at its only question; its namespace is edited and `invoke(None)`
    asks again under a new interrupt id, which replaces the old one. A plain value
    answers the new question as with LangGraph's own saver (the replaced interrupt is
    not counted as a second one pending), and a map by the replaced id is refused."""

    def walk(saver: Any, resume_old: bool = False) -> tuple[list[Any], dict[str, Any]]:
        graph = subgraph_asking(1, saver)
        cfg = config()
        old = graph.invoke({"y": 0, "log": []}, cfg)["__interrupt__"][0].id
        graph.update_state(task_config(graph, cfg, "sub"), {"y": 7})
        asked = graph.invoke(None, cfg)["__interrupt__"]
        assert [i.value for i in asked] == ["q1"] and asked[0].id != old
        if resume_old:
            with pytest.raises(ResumeConflict):
                graph.invoke(Command(resume={old: "stale"}), cfg)
        out = graph.invoke(Command(resume="B1"), cfg)
        return [out], graph.get_state(cfg).values

    expected = walk(InMemorySaver())
    with RemitSaver.from_conn_string(url) as saver:
        assert (
            walk(saver, resume_old=True) == expected == ([{"y": 7, "log": ["B1:7"]}], expected[1])
        )


# -- private state keys and distinct input/output schemas ----------------------------------


class Ask(TypedDict):
    q: str


class Reply(TypedDict):
    answer: str


class Overall(TypedDict, total=False):
    q: str
    answer: str


class Private(TypedDict):
    secret: Annotated[int, Ge(0)]


class Strict(BaseModel):
    """A state model that forbids keys it does not declare (a whole-state check)."""

    model_config = ConfigDict(extra="forbid")
    q: str
    answer: str = ""


def with_private_key(secret: Any, state: Any = Overall) -> StateGraph:
    """n1 writes private key `secret` (declared by n2's input type `Private`, not by
    the state), n2 reads it."""

    def n1(state: Any) -> dict[str, Any]:
        return {"secret": secret}

    def n2(state: Private) -> dict[str, Any]:
        return {"answer": f"s={state['secret']}"}

    if state is Overall:
        builder = StateGraph(Overall, input_schema=Ask, output_schema=Reply)
    else:
        builder = StateGraph(state)
    builder.add_node("n1", n1)
    builder.add_node("n2", n2)
    builder.add_edge(START, "n1")
    builder.add_edge("n1", "n2")
    builder.add_edge("n2", END)
    return builder


@pytest.mark.parametrize("state", [Overall, Strict])
def test_a_private_state_key_is_checked_by_the_type_that_declares_it(url: str, state: Any) -> None:
    """A graph's private key (`secret: Annotated[int, Ge(0)]`, declared by a node's
    input type) is a state channel LangGraph stores in every checkpoint: a write that
    breaks its type is refused (`CheckpointInvalid` naming it), nothing of it is
    stored and the thread stays before the node; a valid one runs through, with the
    input and output schemas as LangGraph applies them, and a state model that forbids
    undeclared keys still takes the private key beside it."""
    with RemitSaver.from_conn_string(url) as saver:
        for bad in (-1, "x"):
            graph = with_private_key(bad, state).compile(checkpointer=saver)
            cfg = config()
            with pytest.raises(CheckpointInvalid) as refused:
                graph.invoke({"q": "hi"}, cfg)
            assert refused.value.field == "secret"
            snapshot = graph.get_state(cfg)
            assert snapshot.next == ("n1",) and "secret" not in snapshot.values
            with pytest.raises(CheckpointInvalid):
                graph.update_state(cfg, {"secret": bad}, as_node="n1")
            assert graph.get_state(cfg).values == snapshot.values

        graph = with_private_key(3, state).compile(checkpointer=saver)
        cfg = config()
        out = graph.invoke({"q": "hi"}, cfg)
        assert out == ({"answer": "s=3"} if state is Overall else {"q": "hi", "answer": "s=3"})
        assert graph.get_state(cfg).values == {"q": "hi", "answer": "s=3", "secret": 3}
        with pytest.raises(CheckpointInvalid):
            graph.invoke({"q": 5}, config())  # the input schema's key, as before


# -- a checkpoint_id the thread does not have --------------------------------------------


class Log(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def ask_after_a() -> StateGraph:
    def a(state: Log) -> dict[str, Any]:
        return {"log": ["a"]}

    def q(state: Log) -> dict[str, Any]:
        return {"log": [f"q:{interrupt('?')}"]}

    builder = StateGraph(Log)
    builder.add_node("a", a)
    builder.add_node("q", q)
    builder.add_edge(START, "a")
    builder.add_edge("a", "q")
    builder.add_edge("q", END)
    return builder


def test_an_update_state_naming_another_threads_checkpoint_is_unknown_record(url: str) -> None:
    """`update_state` with a `checkpoint_id` of another thread (or one that never was):
    LangGraph reads it as a thread with no checkpoint and would store the edit under a
    parent the thread lacks. Refused as `UnknownRecord` naming that checkpoint (not as a
    fork wanting a token), on a thread with checkpoints and on a new one, by
    `update_state` and `bulk_update_state`; nothing is stored on either thread."""
    from langgraph.types import StateUpdate

    with RemitSaver.from_conn_string(url) as saver:
        graph = ask_after_a().compile(checkpointer=saver)
        one, two = config(), config()
        graph.invoke({"log": []}, one)
        graph.invoke({"log": ["other"]}, two)
        foreign = list(graph.get_state_history(one))[1].config["configurable"]["checkpoint_id"]
        histories = {
            t: [s.config for s in graph.get_state_history(c)]
            for t, c in (("one", one), ("two", two))
        }
        fresh = config()
        for cfg in (two, fresh):
            named = {"configurable": {**cfg["configurable"], "checkpoint_id": foreign}}
            with pytest.raises(UnknownRecord) as refused:
                graph.update_state(named, {"log": ["u"]})
            assert refused.value.checkpoint_id == foreign
            with pytest.raises(UnknownRecord):
                graph.bulk_update_state(named, [[StateUpdate({"log": ["u"]}, None)]])
        assert {
            t: [s.config for s in graph.get_state_history(c)]
            for t, c in (("one", one), ("two", two))
        } == histories
        assert list(graph.get_state_history(fresh)) == []
        assert graph.invoke(Command(resume="ok"), two)["log"] == ["other", "a", "q:ok"]


# -- a refused update_state leaves no writes behind ----------------------------------------


class Counted(TypedDict, total=False):
    n: Annotated[int, Ge(0)]
    log: Annotated[list[str], operator.add]


def paused_before_b(saver: Any) -> Any:
    """a -> b (n = 1) -> END, compiled to pause before b."""

    def a(state: Counted) -> dict[str, Any]:
        return {"log": ["a"]}

    def b(state: Counted) -> dict[str, Any]:
        return {"n": 1, "log": ["b"]}

    builder = StateGraph(Counted)
    builder.add_node("a", a)
    builder.add_node("b", b)
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return builder.compile(checkpointer=saver, interrupt_before=["b"])


@pytest.mark.parametrize("as_node", ["b", "a", None])
def test_a_refused_update_state_stores_none_of_its_writes(url: str, as_node: Any) -> None:
    """LangGraph's `update_state` stores the edit's writes on the checkpoint it continues
    (for its `DeltaChannel` keys) before it commits the edit's checkpoint. An edit
    refused at that commit (`CheckpointInvalid`) stores none of them: as the paused
    node `b`, they would finish `b` with the refused value (state n=-1, nothing next,
    every later run refused). The thread reads, lists and runs on as before, sync and
    async; a valid edit as `b` is stored, writes and all."""
    import asyncio

    with RemitSaver.from_conn_string(url) as saver:
        graph = paused_before_b(saver)
        cfg = config()
        graph.invoke({"log": []}, cfg)
        before = graph.get_state(cfg)
        stored = saver.get_tuple(cfg)
        assert stored is not None and stored.pending_writes == []
        with pytest.raises(CheckpointInvalid):
            graph.update_state(cfg, {"n": -1}, as_node=as_node)
        with pytest.raises(CheckpointInvalid):
            asyncio.run(graph.aupdate_state(cfg, {"n": -2}, as_node=as_node))
        after = graph.get_state(cfg)
        assert (after.values, after.next, after.config) == (before.values, ("b",), before.config)
        assert saver.get_tuple(cfg).pending_writes == []  # type: ignore[union-attr]
        assert graph.invoke(None, cfg) == {"n": 1, "log": ["a", "b"]}

        edited = config()
        graph.invoke({"log": []}, edited)
        asyncio.run(graph.aupdate_state(edited, {"n": 5, "log": ["edit"]}, as_node="b"))
        assert graph.get_state(edited).values == {"n": 5, "log": ["a", "edit"]}
        assert graph.get_state(edited).next == ()


# -- an edit of a subgraph's namespace, checked by the subgraph's schema --------------------


class Inner(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    k: Annotated[int, Ge(0)]


def subgraph_with_own_key(saver: Any) -> Any:
    """START -> sub (s1: k = 2; s2 asks, then logs its answer and k) -> END; `k` is a
    key of the subgraph's state only."""

    def s1(state: Inner) -> dict[str, Any]:
        return {"k": 2}

    def s2(state: Inner) -> dict[str, Any]:
        return {"log": [f"{interrupt('?')}:{state['k']}"]}

    inner = StateGraph(Inner)
    inner.add_node("s1", s1)
    inner.add_node("s2", s2)
    inner.add_edge(START, "s1")
    inner.add_edge("s1", "s2")
    inner.add_edge("s2", END)
    outer = StateGraph(Log)
    outer.add_node("sub", inner.compile())
    outer.add_edge(START, "sub")
    outer.add_edge("sub", END)
    return outer.compile(checkpointer=saver)


def test_an_edit_of_a_paused_subgraph_is_checked_by_the_subgraphs_own_schema(url: str) -> None:
    """`update_state` with a paused subgraph's task config edits the subgraph's state,
    whose keys its own schema declares (`k: Annotated[int, Ge(0)]`, unknown to the
    parent). A value that breaks it is refused (`CheckpointInvalid` naming `k`), sync
    and async; nothing is stored, and the pause answers as before. A valid edit is
    taken and read by the resumed node."""
    import asyncio

    with RemitSaver.from_conn_string(url) as saver:
        graph = subgraph_with_own_key(saver)
        cfg = config()
        graph.invoke({"log": []}, cfg)
        task = task_config(graph, cfg, "sub")
        before = statuses(saver, cfg)
        with pytest.raises(CheckpointInvalid) as refused:
            graph.update_state(task, {"k": -5})
        assert refused.value.field == "k"
        with pytest.raises(CheckpointInvalid):
            asyncio.run(graph.aupdate_state(task, {"k": "many"}))
        assert task_config(graph, cfg, "sub") == task  # the subgraph's head stayed
        assert graph.get_state(cfg, subgraphs=True).tasks[0].state.values == {"log": [], "k": 2}
        assert statuses(saver, cfg) == before
        assert graph.invoke(Command(resume="x"), cfg) == {"log": ["x:2"]}

        edited = config()
        graph.invoke({"log": []}, edited)
        graph.update_state(task_config(graph, edited, "sub"), {"k": 7})
        assert graph.invoke(Command(resume="y"), edited) == {"log": ["y:7"]}


def test_an_edit_langgraph_refuses_before_its_commit_leaves_no_writes_for_the_next(
    url: str,
) -> None:
    """A `bulk_update_state` superstep that writes one plain key twice: LangGraph has
    stored its writes on the head (for `DeltaChannel` keys) when it raises
    `InvalidUpdateError`, before its commit. None of them stay, and none ride with a
    later edit's commit on the same checkpoint: each checkpoint's tasks show only what
    ran or was edited (b is still to run, with no result), time after time."""
    from langgraph.errors import InvalidUpdateError
    from langgraph.types import StateUpdate

    with RemitSaver.from_conn_string(url) as saver:
        graph = paused_before_b(saver)
        cfg = config()
        graph.invoke({"log": []}, cfg)
        for turn in range(3):
            with pytest.raises(InvalidUpdateError):
                graph.bulk_update_state(
                    cfg, [[StateUpdate({"n": 1, "log": ["x"]}, "a"), StateUpdate({"n": 2}, "b")]]
                )
            assert saver.get_tuple(cfg).pending_writes == []  # type: ignore[union-attr]
            graph.update_state(cfg, {"log": [f"ok{turn}"]}, as_node="a")
        assert graph.get_state(cfg).values == {"log": ["a", "ok0", "ok1", "ok2"]}
        for snapshot in graph.get_state_history(cfg):
            if snapshot.next == ("b",):
                assert [t.result for t in snapshot.tasks] == [None]
        assert graph.invoke(None, cfg) == {"n": 1, "log": ["a", "ok0", "ok1", "ok2", "b"]}
