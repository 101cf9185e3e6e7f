"""RemitSaver under process-level faults on graph shapes other than the probe's line:
parallel branches with effects, a loop that pauses more than once, forks of those,
racing resumers and recoverers behind a barrier, SIGKILL and SIGSTOP. Real LangGraph,
real forked processes, on every engine."""

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
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_langgraph import RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")
DURABILITIES = ["async", "sync", "exit"]


def config(thread: str | None = None, token: str | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = {"thread_id": thread or f"lg-{uuid.uuid4().hex}"}
    if token is not None:
        conf["fork_token"] = token
    return {"configurable": conf}


def outcome_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # the class name is the outcome the contract names
        return type(exc).__name__
    return "ok"


def killed(fn: Callable[[], Any]) -> None:
    """Run `fn` in a forked process that must die by SIGKILL; then let its lease lapse."""
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.3)  # the dead resumer's claim expires (L1)


def race(
    k: int, fn: Callable[[int], Any], judge: Callable[[Callable[[], Any]], Any] = outcome_of
) -> list[tuple[int, int, Any]]:
    """`fn(i)` in k forked processes released together; (i, pid, outcome) of each, the
    outcome as `judge` tells it (by default the error's class name, or "ok")."""
    barrier, results = CTX.Barrier(k), CTX.Queue()

    def racer(i: int) -> None:
        barrier.wait(timeout=30)
        results.put((i, os.getpid(), judge(lambda: fn(i))))

    procs = [CTX.Process(target=racer, args=(i,)) for i in range(k)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    return got


# -- parallel branches with effects -----------------------------------------------------


class Fan(TypedDict):
    approved_by: str | None
    log: Annotated[list[str], operator.add]


BRANCHES = ("a", "b", "c")


def fan_out(world: World, saver: RemitSaver) -> Any:
    """approve (interrupt) -> ship_a | ship_b | ship_c (each one effect) -> join."""

    @remit_core.effect(name="ship", reconcile=world.reconcile("ship"))
    def ship(*, idempotency_key: str) -> str:
        return world.apply("ship", idempotency_key)

    def approve(state: Fan) -> dict[str, Any]:
        world.enter("approve")
        return {"approved_by": interrupt("ship?")}

    def shipper(name: str) -> Callable[[Fan], dict[str, Any]]:
        def step(state: Fan) -> dict[str, Any]:
            world.enter(f"ship-{name}")
            world.point(f"ship-{name}.before_effect")
            outcome = ship()
            world.point(f"ship-{name}.after_effect")
            return {"log": [f"{name}:{outcome}"]}

        return step

    def join(state: Fan) -> dict[str, Any]:
        world.enter("join")
        return {"log": ["join"]}

    builder = StateGraph(Fan)
    builder.add_node("approve", approve)
    builder.add_node("join", join)
    builder.add_edge(START, "approve")
    for name in BRANCHES:
        builder.add_node(f"ship_{name}", shipper(name))
        builder.add_edge("approve", f"ship_{name}")
        builder.add_edge(f"ship_{name}", "join")
    builder.add_edge("join", END)
    return builder.compile(checkpointer=saver)


def fan_paused(url: str, tmp_path: Path, durability: str) -> tuple[World, Any, dict[str, Any]]:
    world = World(tmp_path)
    graph = fan_out(world, RemitSaver(url, lease=LEASE))
    cfg = config()
    graph.invoke({"approved_by": None, "log": []}, cfg, durability=durability)
    return world, graph, cfg


def done_log() -> list[str]:
    return sorted([f"{n}:ship-done" for n in BRANCHES] + ["join"])


@pytest.mark.parametrize("durability", DURABILITIES)
def test_k_recoverers_of_a_fan_out_killed_after_one_branchs_effect(
    url: str, tmp_path: Path, durability: str
) -> None:
    world, graph, cfg = fan_paused(url, tmp_path, durability)

    def doomed() -> None:
        world.armed["ship-b.after_effect"] = "kill"
        graph.invoke(Command(resume="alice"), cfg, durability=durability)

    killed(doomed)
    entered = len(world.entries())
    # The recoverers hold their claim with a long lease: a heartbeat a loaded machine
    # delays past a short one would let a late recoverer in, as L1 allows.
    steady = fan_out(world, RemitSaver(url, lease=30.0))
    got = race(4, lambda i: steady.invoke(None, cfg, durability=durability))
    # One recovers; the others get ResumeConflict, or, come after it ended, find
    # nothing left to run.
    assert "ok" in [out for _, _, out in got]
    assert {out for _, _, out in got} <= {"ok", "ResumeConflict"}, got
    assert len({pid for pid, _ in world.entries()[entered:]}) == 1, "two recoverers ran nodes"
    state = graph.get_state(cfg)
    assert state.values["approved_by"] == "alice" and state.next == ()
    assert sorted(state.values["log"]) == done_log()
    assert len(world.applications("ship")) == 3
    assert len(world.entries("join")) == 1


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_zombie_in_a_parallel_branch_is_fenced_and_ships_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    world, graph, cfg = fan_paused(url, tmp_path, durability)
    results = CTX.Queue()

    def zombie() -> None:
        world.armed["ship-b.before_effect"] = "stop"
        resume = Command(resume="zombie")
        results.put(outcome_of(lambda: graph.invoke(resume, cfg, durability=durability)))

    proc = CTX.Process(target=zombie)
    proc.start()
    deadline = time.time() + 30
    while not world.entries("ship-b") and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(LEASE + 0.5)  # its lease lapses while it is stopped
    final = graph.invoke(None, cfg, durability=durability)
    os.kill(proc.pid, signal.SIGCONT)
    outcome = results.get(timeout=30)
    proc.join(30)
    assert final["approved_by"] == "zombie"
    assert sorted(final["log"]) == done_log()
    assert outcome == "Fenced"
    assert proc.pid not in [pid for pid, _ in world.entries("join")]
    assert len(world.applications("ship")) == 3
    assert graph.get_state(cfg).values == final


# -- a loop that pauses more than once ----------------------------------------------------


class Loop(TypedDict):
    round: int
    log: Annotated[list[str], operator.add]


def looping(world: World, saver: RemitSaver, rounds: int = 3) -> Any:
    """ask (interrupt, then an effect) loops back to itself `rounds` times."""

    @remit_core.effect(name="pay", reconcile=world.reconcile("pay"))
    def pay(*, idempotency_key: str) -> str:
        return world.apply("pay", idempotency_key)

    def ask(state: Loop) -> dict[str, Any]:
        n = state["round"]
        world.enter(f"ask-{n}")
        answer = interrupt(f"round {n}?")
        outcome = pay()
        world.point(f"ask-{n}.after_effect")
        return {"round": n + 1, "log": [f"{n}:{answer}:{outcome}"]}

    builder = StateGraph(Loop)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_conditional_edges("ask", lambda s: "ask" if s["round"] < rounds else END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_loop_killed_after_its_second_rounds_effect_pays_each_round_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    world = World(tmp_path)
    graph = looping(world, RemitSaver(url, lease=LEASE))
    cfg = config()
    graph.invoke({"round": 0, "log": []}, cfg, durability=durability)
    graph.invoke(Command(resume="r0"), cfg, durability=durability)

    def doomed() -> None:
        world.armed["ask-1.after_effect"] = "kill"
        graph.invoke(Command(resume="r1"), cfg, durability=durability)

    killed(doomed)
    out = graph.invoke(None, cfg, durability=durability)
    assert out["round"] == 2 and len(out["__interrupt__"]) == 1
    assert len(world.applications("pay")) == 2
    got = race(4, lambda i: graph.invoke(Command(resume=f"r2-{i}"), cfg, durability=durability))
    assert sorted(o for _, _, o in got) == ["ResumeConflict"] * 3 + ["ok"], got
    winner = next(i for i, _, o in got if o == "ok")
    final = graph.get_state(cfg).values
    assert final["log"] == ["0:r0:pay-done", "1:r1:pay-done", f"2:r2-{winner}:pay-done"]
    assert len(world.applications("pay")) == 3
    assert len(set(world.applications("pay"))) == 3


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_fork_of_a_pause_whose_node_pays_after_asking_pays_for_its_own_answer(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The node made no call before asking: the fork's run of it shares nothing, and
    the call main's answered run made after the base is not the fork's (it got 0 of 2)."""
    world = World(tmp_path)
    graph = looping(world, RemitSaver(url, lease=LEASE), rounds=1)
    cfg = config()
    graph.invoke({"round": 0, "log": []}, cfg, durability=durability)
    pause = graph.get_state(cfg).config["configurable"]
    graph.invoke(Command(resume="alice"), cfg, durability=durability)
    graph.invoke(None, {"configurable": {**pause, "fork_token": "f"}}, durability=durability)
    fork = config(cfg["configurable"]["thread_id"], "f")
    assert graph.invoke(Command(resume="bob"), fork, durability=durability)["round"] == 1
    assert len(set(world.applications("pay"))) == 2, "the fork's answer paid nothing"
    assert graph.get_state(fork).values["log"] == ["0:bob:pay-done"]
    assert graph.get_state(cfg).values["log"] == ["0:alice:pay-done"]


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_fork_of_a_loops_second_pause_killed_on_resume_pays_its_own_round_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    world = World(tmp_path)
    graph = looping(world, RemitSaver(url, lease=LEASE))
    cfg = config()
    graph.invoke({"round": 0, "log": []}, cfg, durability=durability)
    graph.invoke(Command(resume="r0"), cfg, durability=durability)
    second = graph.get_state(cfg)  # paused at round 1
    graph.invoke(Command(resume="r1"), cfg, durability=durability)
    graph.invoke(Command(resume="r2"), cfg, durability=durability)
    assert len(world.applications("pay")) == 3
    fork = {"configurable": {**second.config["configurable"], "fork_token": "redo"}}
    asked = graph.invoke(None, fork, durability=durability)
    assert asked["__interrupt__"][0].value == "round 1?"
    by_token = config(cfg["configurable"]["thread_id"], "redo")

    def doomed() -> None:
        world.armed["ask-1.after_effect"] = "kill"
        graph.invoke(Command(resume="f1"), by_token, durability=durability)

    killed(doomed)
    got = race(3, lambda i: graph.invoke(None, by_token, durability=durability))
    # (one recovers; one that comes after it runs the paused round again, to ask)
    assert "ok" in [o for _, _, o in got] and {o for _, _, o in got} <= {"ok", "ResumeConflict"}
    assert graph.get_state(by_token).values["log"] == ["0:r0:pay-done", "1:f1:pay-done"]
    assert len(world.applications("pay")) == 4  # main's three, the fork's round 1 once
    got = race(
        3, lambda i: graph.invoke(Command(resume=f"f2-{i}"), by_token, durability=durability)
    )
    assert sorted(o for _, _, o in got) == ["ResumeConflict"] * 2 + ["ok"], got
    assert len(world.applications("pay")) == 5
    assert graph.get_state(cfg).values["log"] == ["0:r0:pay-done", "1:r1:pay-done", "2:r2:pay-done"]


# -- a continuation that reads the head while a racing one moves it ----------------------


class Steps(TypedDict):
    log: Annotated[list[str], operator.add]


def paused_before_b(url: str, entered: list[str]) -> tuple[RemitSaver, Any]:
    """A saver and an `a -> b` graph that pauses before `b`; nodes log to `entered`."""
    saver = RemitSaver(url, lease=LEASE)
    builder = StateGraph(Steps)
    for name in ("a", "b"):
        builder.add_node(name, lambda s, n=name: entered.append(n) or {"log": [n]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return saver, builder.compile(checkpointer=saver, interrupt_before=["b"])


def another_continues_first(
    saver: RemitSaver, graph: Any, cfg: dict[str, Any], durability: str
) -> list[Any]:
    """Make this thread's next claim wait for a racing `invoke(None, cfg)` in another
    thread to run to its end first; the list gets that invoke's output."""
    import threading

    me = threading.get_ident()
    raced: list[Any] = []

    def other_first(method: Callable[..., Any]) -> Callable[..., Any]:
        def claim(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me and not raced:
                other = threading.Thread(
                    target=lambda: raced.append(graph.invoke(None, cfg, durability=durability))
                )
                other.start()
                other.join(30)
            return method(*args, **kwargs)

        return claim

    remit = saver.remit
    remit.claim = other_first(remit.claim)  # type: ignore[method-assign]
    remit.claim_at_head = other_first(remit.claim_at_head)  # type: ignore[method-assign]
    return raced


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_continuation_that_loses_the_race_to_a_finished_one_runs_nothing(
    url: str, durability: str
) -> None:
    """Two `invoke(None)` continue a thread paused before `b`: the one that claims
    first runs `b`, ends and releases; the other, whose claim comes just after, must
    continue the thread's head as it then stands (nothing left), not the pause it
    may have read before (a ForkWithoutIntent, or `b` run twice)."""
    entered: list[str] = []
    saver, graph = paused_before_b(url, entered)
    cfg = config()
    graph.invoke({"log": []}, cfg, durability=durability)
    raced = another_continues_first(saver, graph, cfg, durability)
    out = graph.invoke(None, cfg, durability=durability)
    assert raced and raced[0]["log"] == ["a", "b"]
    assert out["log"] == ["a", "b"]
    assert entered == ["a", "b"]


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_forks_continuation_that_loses_the_race_to_a_finished_one_runs_nothing(
    url: str, durability: str
) -> None:
    """As above, on a fork named by its token: the fork's head read before the claim
    may be one that a racing run, claiming first, has moved past and released."""
    entered: list[str] = []
    saver, graph = paused_before_b(url, entered)
    cfg = config()
    graph.invoke({"log": []}, cfg, durability="sync")  # (a history to fork from)
    start = next(s for s in graph.get_state_history(cfg) if s.next == ("a",)).config
    fork = {"configurable": {**start["configurable"], "fork_token": "again"}}
    graph.invoke(None, fork, durability="sync")  # the fork pauses before b too
    by_token = config(cfg["configurable"]["thread_id"], "again")
    raced = another_continues_first(saver, graph, by_token, durability)
    out = graph.invoke(None, by_token, durability=durability)
    assert raced and raced[0]["log"] == ["a", "b"]
    assert out["log"] == ["a", "b"]
    assert entered == ["a", "a", "b"]  # main's a, the fork's a, the winner's b
    assert graph.get_state(cfg).next == ("b",)  # main still paused
