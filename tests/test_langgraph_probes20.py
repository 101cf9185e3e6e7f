"""RemitSaver probed where the earlier rounds stopped: a `Command(resume=...)` sent to a
thread whose last run failed with an exception (it is not paused), a node that raised
after its question was answered and is continued from another process, an `interrupt()`
inside a functional-API `@task` (with `previous` and `entrypoint.final`) resumed by
racing processes whose winner is SIGKILLed after the task's effect, and one thread run
from two event loops in two OS threads at once. Real LangGraph (compared with its own
`InMemorySaver` where the answer is LangGraph's), real stores on every engine, real
forked processes where the property is about processes."""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_probes4 import CTX, LEASE, config
from test_langgraph_probes10 import outcome_of
from test_langgraph_probes15 import chain
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def race_one_killed(
    world: World, point: str, k: int, resume: Callable[[str], Any]
) -> tuple[str, int]:
    """`k` forked resumers behind a barrier, racer i calling `resume(f"r{i}")`; the one
    that reaches `point` is killed there. Checks that it alone died and the others got
    `ResumeConflict`; returns its value and its pid."""
    barrier, results = CTX.Barrier(k), CTX.Queue()

    def racer(i: int) -> None:
        world.armed[point] = "kill"
        barrier.wait(timeout=30)
        results.put((i, outcome_of(lambda: resume(f"r{i}"))))

    procs = [CTX.Process(target=racer, args=(i,)) for i in range(k)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    lost = [results.get(timeout=10) for _ in range(k - 1)]
    assert results.empty()
    assert sorted(p.exitcode for p in procs) == [-signal.SIGKILL] + [0] * (k - 1)
    assert {outcome for _, outcome in lost} == {"ResumeConflict"}
    winner = ({f"r{i}" for i in range(k)} - {f"r{i}" for i, _ in lost}).pop()
    return winner, next(p.pid for p in procs if p.exitcode == -signal.SIGKILL)


def failing(world: World, saver: Any, *, asks: bool) -> Any:
    """a -> b (asks "ok?" if `asks`; raises while the file `fail` exists, else pays the
    effect "charge") -> c."""
    fail = world.journal.parent / "fail"
    fail.touch()

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(*, idempotency_key: str) -> str:
        return world.apply("charge", idempotency_key)

    def a(state: Log) -> dict[str, Any]:
        world.enter("a")
        return {"log": ["a"]}

    def b(state: Log) -> dict[str, Any]:
        world.enter("b")
        answer = interrupt("ok?") if asks else "-"
        if fail.exists():
            raise RuntimeError("card declined")
        paid = charge() if isinstance(saver, RemitSaver) else "charge-done"  # (Remit's effect)
        return {"log": [f"b:{answer}:{paid}"]}

    def c(state: Log) -> dict[str, Any]:
        world.enter("c")
        return {"log": ["c"]}

    builder = StateGraph(Log)
    for name, fn in (("a", a), ("b", b), ("c", c)):
        builder.add_node(name, fn)
    chain(builder, "a", "b", "c")
    return builder.compile(checkpointer=saver)


def in_another_process(fn: Any) -> None:
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_a_resume_of_a_run_that_failed_is_refused_naming_the_failure(
    url: str, tmp_path: Path, durability: str
) -> None:
    """P5: a value sent to a thread that is not paused is refused and stored nowhere;
    the error says why (the last run failed, in node 'b', with its error) and what to do,
    not that the thread finished. `invoke(None, config)` from another process then runs
    the failed step again and pays once."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph = failing(world, saver, asks=False)
    cfg = config()
    with pytest.raises(RuntimeError, match="card declined"):
        graph.invoke({"log": []}, cfg, durability=durability)
    before = saver.get_tuple(cfg)
    assert before is not None and graph.get_state(cfg).next == ("b",)

    with pytest.raises(ResumeConflict) as refused:
        graph.invoke(Command(resume="late"), cfg, durability=durability)
    message = str(refused.value)
    assert "last run failed" in message and "node 'b'" in message
    assert "card declined" in message and "invoke(None, config)" in message
    after = saver.get_tuple(cfg)
    assert after is not None and after.checkpoint["id"] == before.checkpoint["id"]
    assert after.pending_writes == before.pending_writes  # the value was stored nowhere
    assert not [i for i in saver.remit.interrupts(cfg["configurable"]["thread_id"]) if i.value]

    (tmp_path / "fail").unlink()
    in_another_process(lambda: graph.invoke(None, cfg, durability=durability))
    assert graph.get_state(cfg).values["log"] == ["a", "b:-:charge-done", "c"]
    assert len(world.applications("charge")) == 1
    assert [s for _, s in world.entries()] == ["a", "b", "b", "c"]


def test_a_node_that_failed_after_its_answer_keeps_it_in_another_process(
    url: str, tmp_path: Path
) -> None:
    """P5: a node that raised after `interrupt()` returned keeps the value it was given:
    a second value is refused (naming the failure), and the step run again by another
    process reads the first one, as it does with LangGraph's own saver."""
    for saver in (None, RemitSaver(url, lease=LEASE)):
        folder = tmp_path / ("own" if saver is None else "remit")
        folder.mkdir()
        world = World(folder)
        graph = failing(world, saver or InMemorySaver(), asks=True)
        cfg = config()
        graph.invoke({"log": []}, cfg)
        with pytest.raises(RuntimeError, match="card declined"):
            graph.invoke(Command(resume="alice"), cfg)
        (folder / "fail").unlink()
        if saver is None:
            assert graph.invoke(None, cfg)["log"] == ["a", "b:alice:charge-done", "c"]
            continue
        with pytest.raises(ResumeConflict, match="already consumed, then the run failed"):
            graph.invoke(Command(resume="mallory"), cfg)
        in_another_process(lambda graph=graph, cfg=cfg: graph.invoke(None, cfg))
        assert graph.get_state(cfg).values["log"] == ["a", "b:alice:charge-done", "c"]
        assert len(world.applications("charge")) == 1


# -- interrupt() inside a @task, racing resumers, the winner killed -------------------


def asking_flow(world: World, saver: RemitSaver) -> Any:
    """An entrypoint whose @task `approve` asks who approves, then pays (effect "charge")
    and reaches the point "approve.after_effect"; it returns the running total
    (`previous` + amount) and saves it (`entrypoint.final`)."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(amount: int, *, idempotency_key: str) -> str:
        return world.apply("charge", f"{amount}:{idempotency_key}")

    @task
    def approve(amount: int) -> str:
        world.enter("approve")
        who = interrupt(f"approve {amount}?")
        charge(amount)
        world.point("approve.after_effect")
        return str(who)

    @entrypoint(checkpointer=saver)
    def flow(
        amount: int, *, previous: dict[str, Any] | None = None
    ) -> entrypoint.final[dict[str, Any], dict[str, Any]]:
        who = approve(amount).result()
        total = (previous or {}).get("total", 0) + amount
        return entrypoint.final(
            value={"who": who, "total": total}, save={"who": who, "total": total}
        )

    return flow


def test_racing_resumers_of_a_tasks_interrupt_one_proceeds_and_its_death_pays_once(
    url: str, tmp_path: Path
) -> None:
    """P5: of 4 processes resuming an `interrupt()` inside a @task with 4 values, one
    claims it, the others get `ResumeConflict` and enter no task; L1/P2: the winner,
    SIGKILLed after the task's effect, is taken over by a recovery that finishes with
    the winner's value and pays once; `previous` then carries the saved total."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    flow = asking_flow(world, saver)
    cfg = config()
    assert "__interrupt__" in flow.invoke(5, cfg)
    winner, killed_pid = race_one_killed(
        world, "approve.after_effect", 4, lambda v: flow.invoke(Command(resume=v), cfg)
    )
    assert {pid for pid, step in world.entries() if step == "approve"} == {os.getpid(), killed_pid}

    time.sleep(LEASE + 0.2)  # the dead winner's claim expires (L1)
    with pytest.raises(ResumeConflict):
        flow.invoke(Command(resume="late"), cfg)  # the winner's value was consumed
    in_another_process(lambda: flow.invoke(None, cfg))
    assert flow.get_state(cfg).values == {"who": winner, "total": 5}
    assert len(world.applications("charge")) == 1
    assert flow.invoke(2, cfg)["__interrupt__"][0].value == "approve 2?"
    assert flow.invoke(Command(resume="bob"), cfg) == {"who": "bob", "total": 7}
    assert len(world.applications("charge")) == 2


# -- one thread from two event loops --------------------------------------------------


def test_one_thread_run_from_two_event_loops_at_once_lets_one_proceed(url: str) -> None:
    """P5: two OS threads, each with its own event loop, `ainvoke` one thread id at once
    through one saver (`AsyncRemitSaver`): one runs (held inside its node until the other
    is refused), the other gets `ResumeConflict` and enters no node; the thread then
    holds the one run's result."""
    saver = RemitSaver(url, lease=LEASE)
    inside, refused = threading.Event(), threading.Event()
    entered: list[str] = []

    async def step(state: Log) -> dict[str, Any]:
        entered.append(threading.current_thread().name)
        inside.set()
        await asyncio.get_running_loop().run_in_executor(None, refused.wait, 30)
        return {"log": [threading.current_thread().name]}

    builder = StateGraph(Log)
    builder.add_node("step", step)
    chain(builder, "step")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    outcomes: dict[str, str] = {}

    def first() -> None:
        outcomes["first"] = outcome_of(lambda: asyncio.run(graph.ainvoke({"log": []}, cfg)))

    def second() -> None:
        inside.wait(30)
        outcomes["second"] = outcome_of(lambda: asyncio.run(graph.ainvoke({"log": []}, cfg)))
        refused.set()

    threads = [threading.Thread(target=fn, name=fn.__name__) for fn in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes == {"first": "ok", "second": "ResumeConflict"}
    assert entered == ["first"]
    assert graph.get_state(cfg).values["log"] == ["first"]
