"""RemitSaver probed with subgraphs and their namespaces: an edit of a subgraph's
namespace while its parent is paused (a resume map by the ids it replaced) or while
a run is in flight, two subgraph nodes paused at once answered by racing processes,
a subgraph with a line of its own (`checkpointer=True`) killed after its effect and
continued by later runs, a subgraph run from inside a node (with `checkpointer=None`
and `checkpointer=False`) killed after its effect, and `copy_thread`, `prune` and
`delete_thread` of a thread whose subgraphs hold checkpoints. Real LangGraph,
compared with its `InMemorySaver` where it has an answer; real stores on every
engine; real processes where the property is about processes."""

from __future__ import annotations

import operator
import threading
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_probes10 import LEASE, config, killed, race
from test_langgraph_probes11 import asked, statuses
from test_langgraph_probes15 import chain, charging
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


class Sub(TypedDict, total=False):
    y: int
    log: Annotated[list[str], operator.add]


def asking_sub(name: str, world: World | None = None, persistent: bool | None = None) -> Any:
    """s1 (y += 1) -> s2 (asks "<name>?", then, with a `world`, pays: effect
    "<name>-pay"; without one, as any saver runs it, "paid")."""

    @remit_core.effect(name=f"{name}-pay", idempotent=True)
    def pay(*, idempotency_key: str) -> str:
        assert world is not None
        return world.apply(f"{name}-pay", idempotency_key)

    def s1(state: Sub) -> dict[str, Any]:
        if world is not None:
            world.enter(f"{name}.s1")
        return {"y": state.get("y", 0) + 1, "log": [f"{name}.s1"]}

    def s2(state: Sub) -> dict[str, Any]:
        answer = interrupt(f"{name}?")
        if world is not None:
            world.enter(f"{name}.s2")
        outcome = "paid" if world is None else pay()
        if world is not None:
            world.point(f"{name}.paid")
        return {"log": [f"{name}.s2:{answer}:{state['y']}:{outcome}"]}

    builder = StateGraph(Sub)
    builder.add_node("s1", s1)
    builder.add_node("s2", s2)
    chain(builder, "s1", "s2")
    return builder.compile(checkpointer=persistent)


def two_subgraphs(saver: Any, world: World | None = None) -> Any:
    """START -> a, b (each a subgraph that asks, then pays) in one step -> END."""
    builder = StateGraph(Log)
    for name in ("a", "b"):
        builder.add_node(name, asking_sub(name, world))
        builder.add_edge(START, name)
        builder.add_edge(name, END)
    return builder.compile(checkpointer=saver)


def paused_then_killed(
    world: World, graph: Any, cfg: dict[str, Any], point: str, value: str, durability: str
) -> None:
    """Start the run (it pauses), then resume it with `value` in a process SIGKILLed at
    `point`; return once the dead resumer's lease has run out."""
    graph.invoke({"log": []}, cfg, durability=durability)

    def doomed() -> None:
        world.armed[point] = "kill"
        graph.invoke(Command(resume=value), cfg, durability=durability)

    killed(doomed)


def task_config(graph: Any, cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The config of subgraph task `name`'s state, as `get_state(subgraphs=True)` gives it."""
    snapshot = graph.get_state(cfg, subgraphs=True)
    return dict(next(t for t in snapshot.tasks if t.name == name).state.config)


# -- an edit of a paused subgraph's namespace -------------------------------------------


def test_a_resume_map_by_the_ids_a_subgraph_edit_replaced_is_refused_and_stores_nothing(
    url: str,
) -> None:
    """a and b pause in their subgraphs; `update_state` edits a's (its task config):
    the top head stays as it was, but LangGraph runs a's subgraph again from the edit
    under a new task id, so it asks under a new interrupt id and drops a value by the
    old one (its `InMemorySaver` asks again). A map by a's old id is refused and
    consumes nothing (before: consumed, then never read, P5); b's old id still
    answers, and a's new id, once asked again, takes a's value with the edit."""
    memory = two_subgraphs(InMemorySaver())
    cfg = config()
    old = asked(memory.invoke({"log": []}, cfg))
    memory.update_state(task_config(memory, cfg, "a"), {"y": 10})
    out = memory.invoke(Command(resume={old["a?"]: "A"}), cfg)
    assert asked(out)["a?"] != old["a?"]  # LangGraph's own saver: the value dropped

    saver = RemitSaver(url)
    graph = two_subgraphs(saver)
    cfg = config()
    old = asked(graph.invoke({"log": []}, cfg))
    graph.update_state(task_config(graph, cfg, "a"), {"y": 10})
    with pytest.raises(ResumeConflict, match="edited"):
        graph.invoke(Command(resume={old["a?"]: "A", old["b?"]: "B"}), cfg)
    assert set(statuses(saver, cfg).values()) == {"pending"}
    out = graph.invoke(Command(resume={old["b?"]: "B"}), cfg)
    assert out["log"] == ["b.s1", "b.s2:B:1:paid"]
    now = asked(out)
    assert list(now) == ["a?"] and now["a?"] != old["a?"]
    done = graph.invoke(Command(resume={now["a?"]: "A"}), cfg)
    assert "__interrupt__" not in done
    assert sorted(done["log"]) == ["a.s1", "a.s2:A:10:paid", "b.s1", "b.s2:B:1:paid"]
    assert statuses(saver, cfg)[old["a?"]] != "consumed"  # never took a value


def test_an_edit_of_a_subgraphs_namespace_while_a_run_is_in_flight_is_refused(
    url: str,
) -> None:
    """The thread pauses in a subgraph; while the resumed run is in the subgraph's next
    node, an `update_state` of the subgraph's namespace (its task config, read before)
    is refused with `ResumeConflict` and stores nothing, as an edit of the top graph
    is; the run keeps its result (before: the edit was stored, and the run failed
    at its next checkpoint with `ForkWithoutIntent`)."""
    inside, leave = threading.Event(), threading.Event()

    def slow(state: Sub) -> dict[str, Any]:
        inside.set()
        assert leave.wait(20)
        return {"log": ["slow"]}

    sub = StateGraph(Sub)
    sub.add_node("s1", lambda state: {"log": [f"s1:{interrupt('go?')}"]})
    sub.add_node("slow", slow)
    sub.add_node("s3", lambda state: {"log": [f"s3:{state.get('y')}"]})
    chain(sub, "s1", "slow", "s3")
    builder = StateGraph(Log)
    builder.add_node("sub", sub.compile())
    chain(builder, "sub")
    graph = builder.compile(checkpointer=RemitSaver(url))
    cfg = config()
    graph.invoke({"log": []}, cfg)
    sub_cfg = task_config(graph, cfg, "sub")
    result: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: result.update(graph.invoke(Command(resume="yes"), cfg)), daemon=True
    )
    runner.start()
    assert inside.wait(20)
    try:
        for edit in (sub_cfg, {"configurable": {**sub_cfg["configurable"], "checkpoint_id": None}}):
            with pytest.raises(ResumeConflict, match="a run holds this thread"):
                graph.update_state(edit, {"y": 5})
    finally:
        leave.set()
        runner.join(30)
    assert result == {"log": ["s1:yes", "slow", "s3:None"]}
    history = list(graph.get_state_history({"configurable": {**sub_cfg["configurable"]}}))
    assert all(s.metadata["source"] != "update" for s in history)


# -- two subgraph nodes paused at once, answered by racing processes --------------------


def test_racing_resume_maps_for_two_paused_subgraphs_one_proceeds_and_each_pays_once(
    url: str, tmp_path: Path
) -> None:
    """Four processes behind a barrier: two give a map that answers both subgraphs, two
    a map for a alone. One proceeds (P5); the others get `ResumeConflict` and enter no
    subgraph node; each subgraph pays once (P2). If the winner answered a alone, b's
    question is still pending and a later map answers it."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph = two_subgraphs(saver, world)
    cfg = config()
    ids = asked(graph.invoke({"log": []}, cfg))
    maps = [
        {ids["a?"]: f"A{i}", ids["b?"]: f"B{i}"} if i < 2 else {ids["a?"]: f"A{i}"}
        for i in range(4)
    ]
    outcomes = race(4, lambda i: graph.invoke(Command(resume=maps[i]), cfg))
    won = [(i, pid) for i, pid, outcome in outcomes if outcome == "ok"]
    assert len(won) == 1, outcomes
    assert sorted(o for _, _, o in outcomes if o != "ok") == ["ResumeConflict"] * 3
    ((winner, pid),) = won
    assert {p for p, step in world.entries() if step.endswith(".s2")} == {pid}
    state = graph.get_state(cfg)
    if winner >= 2:
        assert asked({"__interrupt__": state.interrupts}) == {"b?": ids["b?"]}
        graph.invoke(Command(resume={ids["b?"]: "late"}), cfg)
    log = graph.get_state(cfg).values["log"]
    assert f"a.s2:A{winner}:1:a-pay-done" in log
    assert [e for e in log if e.startswith("b.s2:")] == [
        f"b.s2:{'late' if winner >= 2 else f'B{winner}'}:1:b-pay-done"
    ]
    assert len(world.applications("a-pay")) == 1 and len(world.applications("b-pay")) == 1


# -- a subgraph with a line of its own, killed after its effect --------------------------


def own_line(saver: Any, world: World | None = None) -> Any:
    """START -> sub (a subgraph with a line of its own: s1 counts runs in y, s2 asks and
    pays) -> END."""
    builder = StateGraph(Log)
    builder.add_node("sub", asking_sub("sub", world, persistent=True))
    chain(builder, "sub")
    return builder.compile(checkpointer=saver)


def line_of(graph: Any, cfg: dict[str, Any]) -> list[tuple[str, Any]]:
    """The subgraph's own line (namespace "sub"), oldest first: source and y of each."""
    ns = {"configurable": {**cfg["configurable"], "checkpoint_ns": "sub"}}
    return [(s.metadata["source"], s.values.get("y")) for s in graph.get_state_history(ns)][::-1]


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_a_subgraph_with_its_own_line_killed_after_its_effect_recovers_and_keeps_counting(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Run 1 pauses in the subgraph; the resumer is SIGKILLed after s2 paid. Recovery
    (`invoke(None)`) gives s2 the dead resumer's value (a second is refused), does
    not run s1 again, and pays once. Run 2 continues the subgraph's line (y counts 2),
    and the line's history has the checkpoints `InMemorySaver` writes for it."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph = own_line(saver, world)
    cfg = config()
    paused_then_killed(world, graph, cfg, "sub.paid", "first", durability)
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="second"), cfg, durability=durability)
    out = graph.invoke(None, cfg, durability=durability)
    assert out["log"] == ["sub.s1", "sub.s2:first:1:sub-pay-done"]
    assert [s for _, s in world.entries()].count("sub.s1") == 1
    assert len(world.applications("sub-pay")) == 1
    graph.invoke({"log": []}, cfg, durability=durability)
    done = graph.invoke(Command(resume="again"), cfg, durability=durability)
    assert done["log"][-1] == "sub.s2:again:2:sub-pay-done"
    assert len(world.applications("sub-pay")) == 2

    memory = own_line(InMemorySaver())
    mcfg = config()
    for step in ({"log": []}, Command(resume="first"), {"log": []}, Command(resume="again")):
        memory.invoke(step, mcfg, durability=durability)
    assert line_of(graph, cfg) == line_of(memory, mcfg)


# -- a subgraph run from inside a node, killed after its effect --------------------------


@pytest.mark.parametrize("persistent", [None, False], ids=["inherits", "checkpointer-false"])
def test_a_subgraph_invoked_inside_a_node_killed_after_its_effect_pays_once(
    url: str, tmp_path: Path, persistent: bool | None
) -> None:
    """`call` pays a fee, then runs a subgraph with `sub.invoke(...)` (not added as a
    node) whose s1 charges; SIGKILL after the charge. Recovery runs `call` again: the
    fee and the charge are each applied once (P2); only the subgraph that inherits
    the saver stores checkpoints under its namespace (`checkpointer=False`: none).
    (A `checkpointer=False` subgraph inside a "sync" run fails in LangGraph itself,
    with any saver: it waits for a checkpoint it never writes. It runs "async".)"""
    world = World(tmp_path)
    durability = "sync" if persistent is None else "async"
    fee, charge = charging(world, "fee"), charging(world)

    def s1(state: Log) -> dict[str, Any]:
        world.enter("s1")
        outcome = charge()
        world.point("s1.charged")
        return {"log": [outcome]}

    inner = StateGraph(Log)
    inner.add_node("s1", s1)
    inner.add_node("s2", lambda state: {"log": ["s2"]})
    chain(inner, "s1", "s2")
    sub = inner.compile(checkpointer=persistent)

    def call(state: Log) -> dict[str, Any]:
        world.enter("call")
        paid = fee()
        return {"log": [paid, *sub.invoke({"log": []})["log"]]}

    builder = StateGraph(Log)
    builder.add_node("ask", lambda state: {"log": [f"ask:{interrupt('go?')}"]})
    builder.add_node("call", call)
    chain(builder, "ask", "call")
    saver = RemitSaver(url, lease=LEASE)
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    paused_then_killed(world, graph, cfg, "s1.charged", "yes", durability)
    out = graph.invoke(None, cfg, durability=durability)
    assert out["log"] == ["ask:yes", "fee-done", "charge-done", "s2"]
    assert len(world.applications("fee")) == 1
    assert len(world.applications("charge")) == 1
    thread = cfg["configurable"]["thread_id"]
    namespaces = {r.ns for r in saver.remit.history(thread, verify=False)} - {""}
    assert (namespaces != set()) is (persistent is None), namespaces


# -- thread upkeep of a thread whose subgraphs hold checkpoints -------------------------


def nested_and_own(saver: Any) -> Any:
    """START -> own (a subgraph with a line of its own, asks) -> task (a subgraph of the
    task, asks) -> END."""
    builder = StateGraph(Log)
    builder.add_node("own", asking_sub("own", persistent=True))
    builder.add_node("task", asking_sub("task"))
    chain(builder, "own", "task")
    return builder.compile(checkpointer=saver)


def every_record(saver: RemitSaver, thread: str) -> dict[str, list[Any]]:
    """The thread's checkpoints by namespace, its task id dropped (LangGraph's tuples'
    values and sources, newest first), from every namespace the store holds of it."""
    spaces = {r.ns for r in saver.remit.history(thread, verify=False)}
    return {
        ns.split(":")[0]: [
            (t.checkpoint["channel_values"], t.metadata.get("source"))
            for t in saver.list({"configurable": {"thread_id": thread, "checkpoint_ns": ns}})
        ]
        for ns in spaces
    }


def test_copy_prune_and_delete_of_a_thread_with_subgraph_namespaces(url: str) -> None:
    """A thread paused in its second subgraph, after its first (a line of its own) was
    answered. `copy_thread` copies every namespace (the copy's records equal the
    source's) and the copy resumes like it; `prune(keep_latest)` keeps each
    namespace's head, and the pruned thread resumes too; `delete_thread` leaves
    nothing of any namespace, and a run of the thread id again starts the subgraph's
    line from nothing."""
    saver = RemitSaver(url)
    graph = nested_and_own(saver)
    source, copy, pruned = (f"lg-{uuid.uuid4().hex}" for _ in range(3))
    for thread in (source, pruned):
        graph.invoke({"log": []}, config(thread))
        graph.invoke(Command(resume="one"), config(thread))  # now paused in `task`
    held = every_record(saver, source)
    assert held.keys() == {"", "own", "task"}, held
    saver.copy_thread(source, copy)
    assert every_record(saver, copy) == held
    saver.prune([pruned], strategy="keep_latest")
    kept = every_record(saver, pruned)
    assert kept.keys() == held.keys() and all(len(v) == 1 for v in kept.values()), kept
    logs = [graph.invoke(Command(resume="two"), config(t))["log"] for t in (source, copy, pruned)]
    assert logs[0] == logs[1] == logs[2] and logs[0][-1] == "task.s2:two:1:paid", logs
    saver.delete_thread(source)
    assert every_record(saver, source) == {}
    assert list(saver.list({"configurable": {"thread_id": source, "checkpoint_ns": "own"}})) == []
    assert every_record(saver, copy) != {}  # the copy is a thread of its own
    graph.invoke({"log": []}, config(source))
    assert graph.get_state(config(source), subgraphs=True).tasks[0].state.values["y"] == 1
