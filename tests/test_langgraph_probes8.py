"""RemitSaver probed with subgraphs on forks: a fork's own subgraph task (a namespace
`name:task_id` only the fork has) and a subgraph with a line of its own
(`checkpointer=True`) that a fork uses before the main line does. Real LangGraph on
every engine."""

from __future__ import annotations

import operator
import uuid
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


class Sub(TypedDict):
    log: Annotated[list[str], operator.add]
    y: int


def config(thread: str, token: str | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = {"thread_id": thread}
    if token is not None:
        conf["fork_token"] = token
    return {"configurable": conf}


def asks_then_calls(saver: RemitSaver, entered: list[str], persistent: bool | None) -> Any:
    """ask (interrupt) -> call, a node that runs a subgraph: s1, then s2 (interrupt)."""

    def s1(state: Log) -> dict[str, Any]:
        entered.append("s1")
        return {"log": ["s1"]}

    def s2(state: Log) -> dict[str, Any]:
        entered.append("s2")
        return {"log": [f"s2:{interrupt('sub?')}"]}

    sub_builder = StateGraph(Log)
    sub_builder.add_node("s1", s1)
    sub_builder.add_node("s2", s2)
    sub_builder.add_edge(START, "s1")
    sub_builder.add_edge("s1", "s2")
    sub_builder.add_edge("s2", END)
    sub = sub_builder.compile(checkpointer=persistent)

    def ask(state: Log) -> dict[str, Any]:
        return {"log": [f"ask:{interrupt('top?')}"]}

    def call(state: Log) -> dict[str, Any]:
        return {"log": sub.invoke({"log": []})["log"]}

    builder = StateGraph(Log)
    builder.add_node("ask", ask)
    builder.add_node("call", call)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "call")
    builder.add_edge("call", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("persistent", [None, True], ids=["task-subgraph", "own-line"])
def test_a_forks_subgraph_resumes_where_it_paused_and_main_keeps_its_own_line(
    store_url: str, persistent: bool | None
) -> None:
    """The fork runs the subgraph first and pauses in it; resumed, only s2 runs again
    (s1 is durably completed on the fork's line). Main then runs the subgraph on a
    line of its own: it neither continues nor sees the fork's."""
    entered: list[str] = []
    graph = asks_then_calls(RemitSaver(store_url), entered, persistent)
    thread = f"lg-{uuid.uuid4().hex}"
    graph.invoke({"log": []}, config(thread))
    head = graph.get_state(config(thread)).config
    graph.invoke(None, {"configurable": {**head["configurable"], "fork_token": "F"}})
    asked = graph.invoke(Command(resume="fork-top"), config(thread, "F"))
    assert [i.value for i in asked["__interrupt__"]] == ["sub?"]

    entered.clear()
    done = graph.invoke(Command(resume="fork-sub"), config(thread, "F"))
    assert entered == ["s2"]
    assert done["log"] == ["ask:fork-top", "s1", "s2:fork-sub"]

    graph.invoke(Command(resume="main-top"), config(thread))
    entered.clear()
    done = graph.invoke(Command(resume="main-sub"), config(thread))
    assert entered == ["s2"]
    assert done["log"] == ["ask:main-top", "s1", "s2:main-sub"]
    assert graph.get_state(config(thread, "F")).values["log"] == [
        "ask:fork-top",
        "s1",
        "s2:fork-sub",
    ]


def test_an_edit_of_a_forks_paused_subgraph_reaches_the_forks_resume(store_url: str) -> None:
    """`get_state(subgraphs=True)` on a fork names its paused subgraph task's state; an
    `update_state` with that config is what the fork's resume continues from."""
    entered: list[str] = []

    def s1(state: Sub) -> dict[str, Any]:
        entered.append("s1")
        return {"y": 1}

    def s2(state: Sub) -> dict[str, Any]:
        entered.append("s2")
        return {"log": [f"s2:{interrupt('sub?')}:{state['y']}"]}

    sub_builder = StateGraph(Sub)
    sub_builder.add_node("s1", s1)
    sub_builder.add_node("s2", s2)
    sub_builder.add_edge(START, "s1")
    sub_builder.add_edge("s1", "s2")
    sub_builder.add_edge("s2", END)
    builder = StateGraph(Log)
    builder.add_node("a", lambda state: {"log": ["a"]})
    builder.add_node("sub", sub_builder.compile())
    builder.add_edge(START, "a")
    builder.add_edge("a", "sub")
    builder.add_edge("sub", END)
    graph = builder.compile(checkpointer=RemitSaver(store_url))

    thread = f"lg-{uuid.uuid4().hex}"
    graph.invoke({"log": []}, config(thread))
    head = graph.get_state(config(thread)).config
    graph.invoke(None, {"configurable": {**head["configurable"], "fork_token": "F"}})
    paused = graph.get_state(config(thread, "F"), subgraphs=True).tasks[0].state
    assert paused.values["y"] == 1
    graph.update_state(paused.config, {"y": 42})
    assert graph.get_state(config(thread, "F"), subgraphs=True).tasks[0].state.values["y"] == 42

    entered.clear()
    done = graph.invoke(Command(resume="fork"), config(thread, "F"))
    assert done["log"][-1] == "s2:fork:42"
    assert entered == ["s2"]
    done = graph.invoke(Command(resume="main"), config(thread))
    assert done["log"][-1] == "s2:main:1"


def test_a_fork_of_a_fork_starts_the_subgraphs_line_from_its_base_branchs_not_mains(
    store_url: str,
) -> None:
    """F1 forks main's pause; main then runs its subgraph (a line of its own) and pauses
    in it; F2 forks F1 where F1 is about to run the subgraph. F2's line of the subgraph
    starts where F1's stood (empty), not at main's newer, paused one."""
    entered: list[str] = []
    graph = asks_then_calls(RemitSaver(store_url), entered, True)
    thread = f"lg-{uuid.uuid4().hex}"
    graph.invoke({"log": []}, config(thread))
    head = graph.get_state(config(thread)).config
    graph.invoke(None, {"configurable": {**head["configurable"], "fork_token": "F1"}})
    graph.invoke(Command(resume="main-top"), config(thread))  # main pauses in s2
    graph.invoke(Command(resume="f1-top"), config(thread, "F1"))  # so does F1
    f1_head = graph.get_state(config(thread, "F1")).config
    graph.invoke(None, {"configurable": {**f1_head["configurable"], "fork_token": "F2"}})

    entered.clear()
    done = graph.invoke(Command(resume="f2-sub"), config(thread, "F2"))
    assert entered == ["s2"]
    assert done["log"] == ["ask:f1-top", "s1", "s2:f2-sub"]
    done = graph.invoke(Command(resume="f1-sub"), config(thread, "F1"))
    assert done["log"] == ["ask:f1-top", "s1", "s2:f1-sub"]
    done = graph.invoke(Command(resume="main-sub"), config(thread))
    assert done["log"] == ["ask:main-top", "s1", "s2:main-sub"]


def test_a_second_resume_with_the_paused_snapshots_config_is_a_resume_conflict(
    store_url: str,
) -> None:
    """Resumers often keep `get_state(config).config` (it names the paused head by its
    id) and resume with it. A second value so addressed answers a consumed interrupt:
    `ResumeConflict` naming it, as for a config without the id (a resume makes no
    fork, so `ForkWithoutIntent` and its advice to pass a fork token would mislead)."""
    import threading

    from remit_core import ResumeConflict

    saver = RemitSaver(store_url)
    entered: list[str] = []
    graph = asks_then_calls(saver, entered, None)
    thread = f"lg-{uuid.uuid4().hex}"
    graph.invoke({"log": []}, config(thread))
    paused = graph.get_state(config(thread))
    assert graph.invoke(Command(resume="ann"), paused.config)["log"] == ["ask:ann"]
    with pytest.raises(ResumeConflict) as err:
        graph.invoke(Command(resume="bob"), paused.config)
    assert err.value.checkpoint_id == paused.config["configurable"]["checkpoint_id"]
    assert err.value.interrupt_id == paused.interrupts[0].id
    stored = [saver._decode(i.value) for i in saver.remit.interrupts(thread) if i.value]
    assert stored == ["ann"]
    assert len(saver.remit.branches(thread, ns="")) == 1

    # Racing resumers with that config: one proceeds, the others get ResumeConflict.
    thread = f"lg-{uuid.uuid4().hex}"
    graph.invoke({"log": []}, config(thread))
    head = graph.get_state(config(thread)).config
    gate, outcomes = threading.Barrier(4), []

    def resumer(i: int) -> None:
        gate.wait()
        try:
            graph.invoke(Command(resume=f"r{i}"), head)
            outcomes.append("ok")
        except ResumeConflict:
            outcomes.append("ResumeConflict")
        except Exception as exc:  # noqa: BLE001 (reported by the assertion)
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=resumer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["ResumeConflict"] * 3 + ["ok"]


@pytest.mark.parametrize("reserved", ["remit-langgraph:run-index", "remit-langgraph:thread-lives"])
def test_the_saver_s_own_run_ids_are_refused_as_thread_ids(store_url: str, reserved: str) -> None:
    """A thread named like the saver's own records would read them, and its
    `delete_thread` would wipe them (`delete_for_runs` would then find no run)."""
    saver = RemitSaver(store_url)
    entered: list[str] = []
    graph = asks_then_calls(saver, entered, None)
    thread, lg_run = f"lg-{uuid.uuid4().hex}", f"run-{uuid.uuid4().hex}"
    graph.invoke({"log": []}, {"configurable": {"thread_id": thread, "run_id": lg_run}})
    calls = [
        lambda: graph.invoke({"log": []}, config(reserved)),
        lambda: graph.get_state(config(reserved)),
        lambda: list(saver.list(config(reserved))),
        lambda: saver.delete_thread(reserved),
        lambda: saver.copy_thread(thread, reserved),
        lambda: saver.copy_thread(reserved, thread),
        lambda: saver.prune([reserved]),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="reserved"):
            call()
    assert entered == []
    # The saver's records are intact: the run index still finds the thread's run.
    saver.delete_for_runs([lg_run])
    assert saver.get_tuple(config(thread)) is None
