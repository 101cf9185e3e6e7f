"""The Resume Contract for LangGraph: RemitSaver under the real LangGraph, on every engine.

Processes are forked from the test process (LangGraph already imported) and
race behind a barrier; crashes are real SIGKILLs. The journal and effect sink
are files shared by all processes (see `test_langgraph_support`).
"""

from __future__ import annotations

import multiprocessing as mp
import operator
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.graph import START, StateGraph
from langgraph.types import Command, Send, interrupt
from test_langgraph_support import INITIAL, World, build
from typing_extensions import TypedDict

import remit_core
from remit_core import (
    CheckpointInvalid,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    ResumeConflict,
    failpoints,
)
from remit_langgraph import RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")


def thread_config(**extra: Any) -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}", **extra}}


def outcome_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # the class name is the outcome the contract names
        return type(exc).__name__
    return "ok"


def paused(
    store_url: str, tmp_path: Path, *, durability: str = "async", **options: Any
) -> tuple[World, RemitSaver, Any, dict[str, Any]]:
    """The probe graph on a fresh thread, run to approve's pause."""
    world = World(tmp_path)
    saver = RemitSaver(store_url, lease=LEASE)
    graph = build(world, saver, **options)
    config = thread_config()
    graph.invoke(INITIAL, config, durability=durability)
    return world, saver, graph, config


def run_in_process(fn: Callable[[], Any]) -> int:
    """Run `fn` in a forked process; return its exit status (negative: killed by a signal)."""
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(60)
    assert proc.exitcode is not None, "worker hung"
    return proc.exitcode


# -- P5: consume-once, k = 8 processes -------------------------------------------------


def test_k8_processes_exactly_one_resumer_proceeds(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    barrier, results = CTX.Barrier(8), CTX.Queue()
    before = len(world.entries())

    def resumer(i: int) -> None:
        barrier.wait(timeout=30)
        out = outcome_of(lambda: graph.invoke(Command(resume=f"resumer-{i}"), config))
        results.put((i, os.getpid(), out))

    procs = [CTX.Process(target=resumer, args=(i,)) for i in range(8)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    outcomes = sorted(out for _, _, out in got)
    assert outcomes == ["ResumeConflict"] * 7 + ["ok"], got
    winner_idx, winner_pid = next((i, pid) for i, pid, out in got if out == "ok")
    after = world.entries()[before:]
    assert {pid for pid, _ in after} == {winner_pid}, "a losing resumer entered a node"
    assert [step for _, step in after] == ["approve.top", "approve", "charge", "notify"]
    assert len(world.applications("charge")) == 1
    assert graph.get_state(config).values["approved_by"] == f"resumer-{winner_idx}"


def test_k8_threads_in_one_process(store_url: str, tmp_path: Path) -> None:
    import threading

    world, saver, graph, config = paused(store_url, tmp_path)
    gate = threading.Barrier(8)
    outcomes: list[str] = []

    def resumer(i: int) -> None:
        gate.wait()
        outcomes.append(outcome_of(lambda: graph.invoke(Command(resume=f"t{i}"), config)))

    threads = [threading.Thread(target=resumer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["ResumeConflict"] * 7 + ["ok"]
    assert len(world.entries("charge")) == 1
    assert len(world.applications("charge")) == 1


def test_second_value_to_a_consumed_interrupt_is_refused_and_not_stored(
    store_url: str, tmp_path: Path
) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    done = graph.invoke(Command(resume="alice"), config)
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="mallory"), config)
    thread = config["configurable"]["thread_id"]
    stored = [saver._decode(i.value) for i in saver.remit.interrupts(thread) if i.value]
    assert stored == ["alice"]
    head = saver.get_tuple(config)
    assert head is not None and all("mallory" not in repr(w) for w in head.pending_writes or [])
    assert graph.get_state(config).values == done
    assert len(world.applications("charge")) == 1


def test_invalid_resume_value_leaves_interrupt_pending(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke(Command(resume=12345), config)
    assert err.value.interrupt_id is not None
    assert world.entries("approve") == []
    assert graph.get_state(config).next == ("approve",)
    assert graph.invoke(Command(resume="bob"), config)["approved_by"] == "bob"


def test_multi_interrupt_each_value_reaches_its_interrupt(store_url: str, tmp_path: Path) -> None:
    world = World(tmp_path)
    graph = build(world, RemitSaver(store_url), asks=2)
    config = thread_config()
    first = graph.invoke(INITIAL, config)["__interrupt__"][0]
    second = graph.invoke(Command(resume="v1"), config)["__interrupt__"][0]
    assert first.id != second.id
    with pytest.raises(ResumeConflict):  # a map naming the consumed interrupt
        graph.invoke(Command(resume={first.id: "again"}), config)
    final = graph.invoke(Command(resume={second.id: "v2"}), config)
    assert final["approved_by"] == "v1+v2"
    assert len(world.entries("approve")) == 1


def test_a_pause_edited_with_update_state_takes_exactly_one_resume(
    store_url: str, tmp_path: Path
) -> None:
    import threading

    world, saver, graph, config = paused(store_url, tmp_path)
    graph.update_state(config, {"amount": 50})  # an edit while paused runs no node
    assert graph.get_state(config).next == ("approve",)
    gate = threading.Barrier(4)
    outcomes: dict[str, str] = {}

    def resumer(i: int) -> None:
        gate.wait()
        outcomes[f"t{i}"] = outcome_of(lambda: graph.invoke(Command(resume=f"t{i}"), config))

    threads = [threading.Thread(target=resumer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes.values()) == ["ResumeConflict"] * 3 + ["ok"]
    final = graph.get_state(config).values
    winner = next(who for who, out in outcomes.items() if out == "ok")
    assert (final["amount"], final["approved_by"]) == (50, winner)
    assert len(world.entries("approve")) == 1
    assert len(world.applications("charge")) == 1
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="late"), config)
    thread = config["configurable"]["thread_id"]
    stored = [saver._decode(i.value) for i in saver.remit.interrupts(thread) if i.value]
    assert stored == [winner]


def test_a_pause_answered_by_update_state_as_its_node_takes_no_resume(
    store_url: str, tmp_path: Path
) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    graph.update_state(config, {"approved_by": "manual"}, as_node="approve")
    assert graph.get_state(config).next == ("charge",)
    with pytest.raises(ResumeConflict):  # LangGraph would drop the value unread
        graph.invoke(Command(resume="alice"), config)
    thread = config["configurable"]["thread_id"]
    assert [i.status for i in saver.remit.interrupts(thread)] == ["pending"]
    final = graph.invoke(None, config)
    assert final["approved_by"] == "manual" and world.entries("approve") == []
    assert len(world.applications("charge")) == 1


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_a_value_taken_at_an_edited_pause_is_redelivered_after_sigkill(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    world, saver, graph, config = paused(store_url, tmp_path, durability=durability)
    graph.update_state(config, {"amount": 50})

    def doomed() -> None:
        world.armed["approve.answered"] = "kill"
        graph.invoke(Command(resume="alice"), config, durability=durability)

    assert run_in_process(doomed) == -signal.SIGKILL
    time.sleep(LEASE + 0.2)  # the dead resumer's claim expires (L1)
    final = graph.invoke(None, config, durability=durability)
    assert "__interrupt__" not in final
    assert (final["amount"], final["approved_by"]) == (50, "alice")
    assert len(world.applications("charge")) == 1
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="mallory"), config)


def test_a_resume_at_a_static_pause_is_refused_with_what_to_do(
    store_url: str, tmp_path: Path
) -> None:
    world = World(tmp_path)
    graph = build(world, RemitSaver(store_url), asks=0)
    config = thread_config()
    graph.invoke(INITIAL, config, interrupt_before=["charge"])
    assert graph.get_state(config).next == ("charge",)
    with pytest.raises(ResumeConflict, match=r"invoke\(None, config\)"):
        graph.invoke(Command(resume="yes"), config)
    assert world.entries("charge") == []
    assert graph.invoke(None, config)["log"][-1] == "notify-done"


# -- P1 / P2: SIGKILL and recovery ------------------------------------------------------


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
@pytest.mark.parametrize("point", ["charge.after_effect", "effect.after_apply"])
def test_sigkill_after_effect_recovery_applies_it_once(
    store_url: str, tmp_path: Path, durability: str, point: str
) -> None:
    world, saver, graph, config = paused(store_url, tmp_path, durability=durability)

    def doomed() -> None:
        if point.startswith("effect."):
            failpoints.arm(point, "kill")
        else:
            world.armed[point] = "kill"
        graph.invoke(Command(resume="alice"), config, durability=durability)

    assert run_in_process(doomed) == -signal.SIGKILL
    assert len(world.applications("charge")) == 1
    time.sleep(LEASE + 0.2)  # the dead resumer's claim expires (L1)
    entered = len(world.entries())
    final = graph.invoke(None, config, durability=durability)
    assert final["approved_by"] == "alice"
    assert final["log"] == ["prepare", "approve", "charge-done", "notify-done"]
    assert len(world.applications("charge")) == 1
    assert len(world.applications("notify")) == 1
    recovered = [step for _, step in world.entries()[entered:]]
    assert "prepare" not in recovered
    if durability != "exit":  # "exit" stores nothing until the run ends: approve re-runs
        assert "approve" not in recovered


class Order(TypedDict):
    approved_by: str | None
    log: Annotated[list[str], operator.add]


class Payee(TypedDict):
    who: str
    log: Annotated[list[str], operator.add]


def nested_payments(world: World, saver: RemitSaver) -> Any:
    """approve (interrupt) -> one subgraph per payee (Send), each with a subgraph that
    charges that payee: effects two namespaces deep, in parallel instances."""

    def charged(key: str) -> Any:  # (a kill may land while the other payee's charge is in doubt)
        done = any(line.endswith(f":{key}") for line in world.applications("charge"))
        return "charge-done" if done else remit_core.NOT_APPLIED

    @remit_core.effect(name="charge", reconcile=charged)
    def charge(who: str, *, idempotency_key: str) -> str:
        return world.apply("charge", f"{who}:{idempotency_key}")

    def pay(state: Payee) -> dict[str, Any]:
        world.enter(f"pay-{state['who']}")
        charge(state["who"])
        world.point(f"pay-{state['who']}.after_effect")
        return {"log": [f"paid-{state['who']}"]}

    innermost = StateGraph(Payee)
    innermost.add_node("pay", pay)
    innermost.add_edge(START, "pay")
    middle = StateGraph(Payee)
    middle.add_node("charge", innermost.compile())
    middle.add_edge(START, "charge")

    def approve(state: Order) -> dict[str, Any]:
        return {"approved_by": interrupt("approve?")}

    top = StateGraph(Order)
    top.add_node("approve", approve)
    top.add_node("payee", middle.compile())
    top.add_edge(START, "approve")
    top.add_conditional_edges(
        "approve", lambda s: [Send("payee", {"who": w, "log": []}) for w in ("x", "y")]
    )
    return top.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_effects_in_nested_subgraphs_apply_once_across_a_sigkill(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    """A subgraph's task ids come from checkpoint ids, which an "exit" replay makes
    anew: an effect's key names each enclosing task by its step and path instead."""
    world = World(tmp_path)
    saver = RemitSaver(store_url, lease=LEASE)
    graph = nested_payments(world, saver)
    config = thread_config()
    graph.invoke({"approved_by": None, "log": []}, config, durability=durability)

    def doomed() -> None:
        world.armed["pay-y.after_effect"] = "kill"
        graph.invoke(Command(resume="alice"), config, durability=durability)

    assert run_in_process(doomed) == -signal.SIGKILL
    time.sleep(LEASE + 0.2)
    final = graph.invoke(None, config, durability=durability)
    assert sorted(final["log"]) == ["paid-x", "paid-y"]
    # One charge per payee: neither re-applied by the replay, nor shared between them.
    payees = [line.split(" ", 1)[1].split(":", 1)[0] for line in world.applications("charge")]
    assert sorted(payees) == ["x", "y"]


def test_zombie_resumer_is_fenced(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    results = CTX.Queue()

    def zombie() -> None:
        world.armed["charge.before_effect"] = "stop"
        resume = Command(resume="zombie")
        results.put(outcome_of(lambda: graph.invoke(resume, config, durability="sync")))

    proc = CTX.Process(target=zombie)
    proc.start()
    deadline = time.time() + 30
    while not world.entries("charge") and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(LEASE + 0.3)  # its lease lapses while it is stopped
    final = graph.invoke(None, config)
    assert final["approved_by"] == "zombie"
    os.kill(proc.pid, signal.SIGCONT)
    assert results.get(timeout=30) == Fenced.__name__
    proc.join(30)
    assert len(world.applications("charge")) == 1
    assert graph.get_state(config).values["log"][-1] == "notify-done"


@pytest.mark.parametrize("durability", ["async", "exit"])
def test_a_zombie_stops_instead_of_running_the_rest_of_the_graph(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    # LangGraph raises a refused background write only when the run ends ("async"),
    # and "exit" writes nothing before: the zombie must stop at its next step or
    # effect (its refused write, or its heartbeat finding the claim taken over), not
    # run every remaining node again.
    world, saver, graph, config = paused(store_url, tmp_path)
    results = CTX.Queue()

    def zombie() -> None:
        world.armed["approve.answered"] = "stop"
        if durability == "exit":  # no write to be refused: give its heartbeat a beat
            stop = world.point

            def stop_then_wait(name: str) -> None:
                stop(name)
                if name == "approve.answered":
                    time.sleep(LEASE)  # three heartbeat periods

            world.point = stop_then_wait  # type: ignore[method-assign]
        resume = Command(resume="zombie")
        results.put(outcome_of(lambda: graph.invoke(resume, config, durability=durability)))

    proc = CTX.Process(target=zombie)
    proc.start()
    deadline = time.time() + 30
    while len(world.entries("approve.top")) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(LEASE + 0.5)  # stopped with its answer taken; its lease lapses
    final = graph.invoke(None, config)
    assert final["approved_by"] == "zombie"
    os.kill(proc.pid, signal.SIGCONT)
    assert results.get(timeout=30) == Fenced.__name__
    proc.join(30)
    assert proc.pid not in [pid for pid, _ in world.entries("notify")]
    assert len(world.applications("charge")) == len(world.applications("notify")) == 1
    assert graph.get_state(config).values == final


# -- P3: forks ------------------------------------------------------------------------


def test_fork_needs_a_token_and_one_token_makes_one_branch(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    done = graph.invoke(Command(resume="alice"), config)
    thread = config["configurable"]["thread_id"]
    head = graph.get_state(config).config["configurable"]["checkpoint_id"]
    old = next(s for s in graph.get_state_history(config) if s.next == ("notify",))
    entered = len(world.entries())
    with pytest.raises(ForkWithoutIntent) as err:
        graph.invoke(None, old.config)
    assert err.value.checkpoint_id == old.config["configurable"]["checkpoint_id"]
    assert len(world.entries()) == entered, "a node ran before the refusal"
    with pytest.raises(ForkWithoutIntent):
        graph.update_state(old.config, {"approved_by": "eve"})
    assert len(saver.remit.branches(thread)) == 1

    forked = {"configurable": {**old.config["configurable"], "fork_token": "replay-1"}}
    first = graph.invoke(None, forked)
    again = CTX.Queue()
    assert run_in_process(lambda: again.put(graph.invoke(None, forked))) == 0
    assert first == again.get(timeout=10) == done
    assert len(saver.remit.branches(thread)) == 2
    assert graph.get_state(config).config["configurable"]["checkpoint_id"] == head
    fork_state = graph.get_state({"configurable": {"thread_id": thread, "fork_token": "replay-1"}})
    assert fork_state.values == done
    assert len(world.applications("charge")) == 1

    edit = {"configurable": {**old.config["configurable"], "fork_token": "edit-1"}}
    graph.update_state(edit, {"approved_by": "eve"})
    edited = graph.get_state({"configurable": {"thread_id": thread, "fork_token": "edit-1"}})
    assert edited.values["approved_by"] == "eve"
    assert len(saver.remit.branches(thread)) == 3
    assert graph.get_state(config).config["configurable"]["checkpoint_id"] == head


def test_a_recovery_that_names_the_head_by_its_id_runs_and_applies_nothing_twice(
    store_url: str, tmp_path: Path
) -> None:
    # A client that holds the head's config (`get_state(config).config`) sends it
    # back: that continues the head, as without its checkpoint_id (P1, P2).
    world, saver, graph, config = paused(store_url, tmp_path)

    def resume_and_die() -> None:
        world.armed["charge.after_effect"] = "kill"
        graph.invoke(Command(resume="alice"), config, durability="sync")

    assert run_in_process(resume_and_die) == -signal.SIGKILL
    head = graph.get_state(config).config
    time.sleep(LEASE + 0.3)
    done = graph.invoke(None, head)
    assert done["approved_by"] == "alice"
    assert len(world.entries("approve")) == 1
    assert len(world.applications("charge")) == 1
    assert "fork" not in [s.metadata["source"] for s in graph.get_state_history(config)]


def test_a_fork_recovered_with_the_config_that_made_it_continues_its_head(
    store_url: str, tmp_path: Path
) -> None:
    # The same token again continues its branch: LangGraph must not take the
    # checkpoint_id for time travel there (re-running finished steps, a fork
    # checkpoint per recovery, and effects keyed by the shifted steps applied again).
    world, saver, graph, config = paused(store_url, tmp_path)
    graph.invoke(Command(resume="alice"), config)
    thread = config["configurable"]["thread_id"]
    before = next(s for s in graph.get_state_history(config) if s.next == ("approve",))
    fork = {"configurable": {**before.config["configurable"], "fork_token": "retry"}}
    graph.invoke(None, fork)  # the fork asks again

    def resume_and_die() -> None:
        world.armed["charge.after_effect"] = "kill"
        graph.invoke(Command(resume="bob"), fork, durability="sync")

    assert run_in_process(resume_and_die) == -signal.SIGKILL
    approvals = len(world.entries("approve"))
    time.sleep(LEASE + 0.3)
    done = graph.invoke(None, fork)
    assert done["approved_by"] == "bob"
    assert len(world.entries("approve")) == approvals  # P1: approve's step was durable
    assert len(world.applications("charge")) == 2  # main's, and the fork's once (P2)
    line = graph.get_state_history({"configurable": {"thread_id": thread, "fork_token": "retry"}})
    assert [s.metadata["source"] for s in line].count("fork") == 1
    assert graph.invoke(None, fork) == done  # presented again: nothing left to run


def test_an_edit_of_a_forks_stale_head_is_refused_as_moved_not_as_another_fork(
    store_url: str, tmp_path: Path
) -> None:
    # Two edits with one token race: the loser read the fork's head before the winner
    # moved it. It must learn the branch moved on, not to fork again with a new token.
    world, saver, graph, config = paused(store_url, tmp_path)
    graph.invoke(Command(resume="alice"), config)
    thread = config["configurable"]["thread_id"]
    old = next(s for s in graph.get_state_history(config) if s.next == ("charge",))
    fork = {"configurable": {**old.config["configurable"], "fork_token": "edits"}}
    read = graph.update_state(fork, {"approved_by": "bob"})
    stale = {"configurable": {**read["configurable"], "fork_token": "edits"}}
    head = graph.update_state(fork, {"approved_by": "carol"})["configurable"]["checkpoint_id"]
    with pytest.raises(HeadMoved) as err:
        graph.update_state(stale, {"approved_by": "dave"})
    assert err.value.checkpoint_id == read["configurable"]["checkpoint_id"]
    assert len(saver.remit.branches(thread)) == 2
    edited = graph.get_state({"configurable": {"thread_id": thread, "fork_token": "edits"}})
    assert edited.config["configurable"]["checkpoint_id"] == head
    assert edited.values["approved_by"] == "carol"


def test_a_fork_of_a_paused_run_has_its_own_interrupt(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    head = graph.get_state(config).config["configurable"]
    fork = {"configurable": {**head, "fork_token": "fork-of-pause"}}
    asked = graph.invoke(None, fork)["__interrupt__"][0]
    main_done = graph.invoke(Command(resume="alice"), config)
    fork_only = {"configurable": {"thread_id": head["thread_id"], "fork_token": "fork-of-pause"}}
    assert graph.get_state(fork_only).next == ("approve",)  # L3: main's consume left it
    fork_done = graph.invoke(Command(resume={asked.id: "bob"}), fork_only)
    assert (main_done["approved_by"], fork_done["approved_by"]) == ("alice", "bob")
    assert len(world.entries("approve")) == 2
    assert len(saver.remit.branches(head["thread_id"])) == 2


def test_a_fork_made_by_editing_a_pause_answers_its_question_once(
    store_url: str, tmp_path: Path
) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    head = graph.get_state(config).config["configurable"]
    main_done = graph.invoke(Command(resume="alice"), config)
    graph.update_state({"configurable": {**head, "fork_token": "edit"}}, {"amount": 5})
    fork = {"configurable": {"thread_id": head["thread_id"], "fork_token": "edit"}}
    assert graph.get_state(fork).next == ("approve",)
    fork_done = graph.invoke(Command(resume="bob"), fork)
    assert (fork_done["amount"], fork_done["approved_by"]) == (5, "bob")
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="mallory"), fork)
    assert graph.get_state(config).values == main_done  # L3: main is untouched
    assert len(world.applications("charge")) == 2  # one per timeline


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_fork_of_an_edited_head_runs_on_its_own_branch_only(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    world, saver, graph, config = paused(store_url, tmp_path, durability=durability)
    graph.update_state(config, {"approved_by": "eve", "log": ["edited"]}, as_node="approve")
    head = graph.get_state(config).config["configurable"]
    fork = {"configurable": {**head, "fork_token": "from-edit"}}
    graph.invoke(None, fork, durability=durability)
    assert len(world.entries("charge")) == 1
    # P1 on main: the fork's steps are not main's; main still runs its own.
    assert graph.get_state(config).next == ("charge",)
    graph.invoke(None, config, durability=durability)
    assert len(world.entries("charge")) == 2


def test_a_fork_of_an_edited_pause_takes_its_own_resume(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    graph.update_state(config, {"amount": 7})
    head = graph.get_state(config).config["configurable"]
    asked = graph.invoke(None, {"configurable": {**head, "fork_token": "ask"}})["__interrupt__"]
    fork = {"configurable": {"thread_id": head["thread_id"], "fork_token": "ask"}}
    assert graph.invoke(Command(resume={asked[0].id: "bob"}), fork)["approved_by"] == "bob"
    assert graph.invoke(Command(resume="alice"), config)["approved_by"] == "alice"  # L3
    assert len(world.entries("approve")) == 2


# -- P4: state validity ----------------------------------------------------------------


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_invalid_node_output_is_refused_and_thread_stays_resumable(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    world = World(tmp_path)
    saver = RemitSaver(store_url)
    config = thread_config()
    with pytest.raises(CheckpointInvalid) as err:
        build(world, saver, amount=-5).invoke(INITIAL, config, durability=durability)
    assert err.value.field == "amount"
    assert err.value.run_id == config["configurable"]["thread_id"]
    history = list(saver.list(config))
    assert all(t.checkpoint["channel_values"].get("amount", 0) >= 0 for t in history)
    head = saver.get_tuple(config)
    graph = build(world, saver)
    # The head is the checkpoint before prepare (in "exit" durability too: a failed run
    # saves where it got as it exits); prepare's refused write is not on it.
    assert head is not None and graph.get_state(config).next == ("prepare",)
    assert all(w[1] != "amount" for w in head.pending_writes or [])
    graph.invoke(None, config, durability=durability)
    assert graph.get_state(config).next == ("approve",)
    assert graph.invoke(Command(resume="carol"), config)["approved_by"] == "carol"


def test_invalid_update_state_is_refused(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, config = paused(store_url, tmp_path)
    head = graph.get_state(config)
    with pytest.raises(CheckpointInvalid) as err:
        graph.update_state(config, {"amount": -1})
    assert err.value.field == "amount"
    assert graph.get_state(config).config == head.config
    graph.update_state(config, {"amount": 7})
    assert graph.get_state(config).values["amount"] == 7


# -- P2, P3: a fork shares the effects its re-run tasks made before its base ---------------


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def charging_graph(saver: RemitSaver, applied: list[str], *, parallel: bool) -> Any:
    """parallel=False: `pay` charges, asks, charges again. parallel=True: `pay` charges
    while its sibling `ask` asks, in one step."""

    @remit_core.effect(name="charge", idempotent=True)
    def charge(amount: int, *, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return f"charged-{amount}"

    def pay(state: Log) -> dict[str, Any]:
        if parallel:
            return {"log": [charge(1)]}
        first = charge(10)
        answer = interrupt("go on?")
        return {"log": [first, answer, charge(20)]}

    def ask(state: Log) -> dict[str, Any]:
        return {"log": [interrupt("who?")]}

    builder = StateGraph(Log)
    builder.add_node("pay", pay)
    builder.add_edge(START, "pay")
    if parallel:
        builder.add_node("ask", ask)
        builder.add_edge(START, "ask")
    return builder.compile(checkpointer=saver)


def test_a_fork_of_a_pause_shares_the_effects_its_node_made_before_asking(
    store_url: str,
) -> None:
    applied: list[str] = []
    graph = charging_graph(RemitSaver(store_url), applied, parallel=False)
    config = thread_config()
    thread = config["configurable"]["thread_id"]
    graph.invoke({"log": []}, config)
    paused_at = graph.get_state(config).config["configurable"]
    assert graph.invoke(Command(resume="alice"), config)["log"][1] == "alice"
    assert len(applied) == 2  # main's charge before asking, and after

    fork = {"configurable": {**paused_at, "fork_token": "f1"}}
    graph.invoke(None, fork)  # pay runs again from its top and asks again
    assert len(applied) == 2, "the fork applied again what pay charged before the base"
    f1 = {"configurable": {"thread_id": thread, "fork_token": "f1"}}
    f1_paused = graph.get_state(f1).config["configurable"]
    assert graph.invoke(Command(resume="bob"), f1)["log"] == ["charged-10", "bob", "charged-20"]
    assert len(applied) == 3  # the fork's own charge after its answer

    graph.invoke(None, {"configurable": {**f1_paused, "fork_token": "f2"}})  # a fork of the fork
    f2 = {"configurable": {"thread_id": thread, "fork_token": "f2"}}
    assert graph.invoke(Command(resume="carol"), f2)["log"] == ["charged-10", "carol", "charged-20"]
    assert len(applied) == 4
    assert graph.invoke(None, f1)["log"] == ["charged-10", "bob", "charged-20"]  # P3
    assert len(set(applied)) == 4


def test_a_fork_of_a_step_shares_the_effects_of_a_task_that_finished_beside_a_pause(
    store_url: str,
) -> None:
    applied: list[str] = []
    graph = charging_graph(RemitSaver(store_url), applied, parallel=True)
    config = thread_config()
    thread = config["configurable"]["thread_id"]
    graph.invoke({"log": []}, config)
    paused_at = graph.get_state(config).config["configurable"]
    graph.invoke(None, {"configurable": {**paused_at, "fork_token": "f1"}})  # pay runs again
    f1 = {"configurable": {"thread_id": thread, "fork_token": "f1"}}
    f1_paused = graph.get_state(f1).config["configurable"]
    assert sorted(graph.invoke(Command(resume="bob"), f1)["log"]) == ["bob", "charged-1"]
    assert sorted(graph.invoke(Command(resume="alice"), config)["log"]) == ["alice", "charged-1"]
    graph.invoke(None, {"configurable": {**f1_paused, "fork_token": "f2"}})  # a fork of the fork
    f2 = {"configurable": {"thread_id": thread, "fork_token": "f2"}}
    assert sorted(graph.invoke(Command(resume="carol"), f2)["log"]) == ["carol", "charged-1"]
    assert len(applied) == 1, "a fork applied again what pay charged before the base"


@pytest.mark.parametrize("parallel", [False, True], ids=["asking-node", "sibling"])
def test_an_edit_of_a_pause_keeps_the_effects_made_before_it(
    store_url: str, parallel: bool
) -> None:
    """`update_state` on a pause starts a new step: the paused task (and a sibling
    that finished beside it) runs again there, and finds what it charged."""
    applied: list[str] = []
    graph = charging_graph(RemitSaver(store_url), applied, parallel=parallel)
    config = thread_config()
    graph.invoke({"log": []}, config)
    graph.update_state(config, {"log": ["edited"]})
    graph.update_state(config, {"log": ["edited again"]})
    log = graph.invoke(Command(resume="alice"), config)["log"]
    assert "alice" in log and ("charged-1" in log if parallel else "charged-10" in log)
    assert len(applied) == (1 if parallel else 2), "an edit made a task charge again"
