"""RemitSaver probed through LangGraph's functional API on forks: a `@task` that
paid before its entrypoint paused is part of the prefix a fork shares (P2, P3),
across `durability` modes, the async API, a fork of a fork and a SIGKILL in the
fork's first run. Real LangGraph, real processes and SIGKILLs, on every engine."""

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
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import AsyncRemitSaver, RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}


def with_token(snapshot_config: Any, token: str) -> dict[str, Any]:
    return {"configurable": {**snapshot_config["configurable"], "fork_token": token}}


def checkout(world: World, saver: RemitSaver) -> Any:
    """pay(amount) as a task -> ask (a task that interrupts) -> pay(amount + 100)."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(amount: int, *, idempotency_key: str) -> str:
        world.apply("charge", f"{amount}:{idempotency_key}")
        return f"charged {amount}"

    @task
    def pay(amount: int) -> str:
        world.enter(f"pay {amount}")
        outcome = charge(amount)
        world.point(f"pay {amount}.after_effect")
        return outcome

    @task
    def ask(amount: int) -> str:
        return interrupt(f"charge {amount + 100} more?")

    @entrypoint(checkpointer=saver)
    def flow(amount: int) -> dict[str, Any]:
        first = pay(amount).result()
        who = ask(amount).result()
        return {"first": first, "who": who, "second": pay(amount + 100).result()}

    return flow


def charges(world: World, amount: int) -> list[str]:
    """The keys under which `amount` was charged."""
    return [ln.split(":", 1)[1] for ln in world.applications("charge") if f" {amount}:" in ln]


def the_pause(flow: Any, cfg: dict[str, Any]) -> Any:
    """The snapshot of the main line where it paused (its entrypoint pending)."""
    return next(s for s in flow.get_state_history(cfg) if s.next)


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_a_fork_of_a_functional_pause_shares_what_its_tasks_paid_before_asking(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    """P2, P3: a fork of an entrypoint's pause runs the entrypoint again from its
    top; the task that paid before the pause gets the recorded outcome (charged
    once over the whole run), while the task that runs after the fork's own answer
    pays on the fork's timeline. A fork of the fork shares both branches' prefix."""
    world = World(tmp_path)
    flow = checkout(world, RemitSaver(store_url))
    cfg = config()
    flow.invoke(1, cfg, durability=durability)
    done = flow.invoke(Command(resume="alice"), cfg, durability=durability)
    assert done == {"first": "charged 1", "who": "alice", "second": "charged 101"}
    assert len(charges(world, 1)) == len(charges(world, 101)) == 1

    fork = with_token(the_pause(flow, cfg).config, "second-opinion")
    asked = flow.invoke(None, fork, durability=durability)
    assert [i.value for i in asked["__interrupt__"]] == ["charge 101 more?"]
    assert len(charges(world, 1)) == 1  # the prefix's charge is not applied again
    out = flow.invoke(Command(resume="bob"), fork, durability=durability)
    assert out == {"first": "charged 1", "who": "bob", "second": "charged 101"}
    assert len(charges(world, 1)) == 1
    assert len(set(charges(world, 101))) == 2  # main's and the fork's own, once each
    with pytest.raises(ResumeConflict):
        flow.invoke(Command(resume="mallory"), fork, durability=durability)

    again = with_token(the_pause(flow, fork).config, "third-opinion")
    flow.invoke(None, again, durability=durability)
    flow.invoke(Command(resume="carol"), again, durability=durability)
    assert len(charges(world, 1)) == 1
    assert len(set(charges(world, 101))) == 3
    assert flow.get_state(cfg).values["who"] == "alice"
    assert flow.get_state(fork).values["who"] == "bob"


def test_an_async_fork_of_a_functional_pause_shares_what_its_tasks_paid(
    store_url: str,
) -> None:
    """The same through `ainvoke`: async tasks, an async effect."""
    applied: list[tuple[int, str]] = []
    saver = AsyncRemitSaver(store_url)

    @remit_core.effect(name="charge", idempotent=True)
    async def charge(amount: int, *, idempotency_key: str) -> str:
        applied.append((amount, idempotency_key))
        return f"charged {amount}"

    @task
    async def pay(amount: int) -> str:
        return await charge(amount)

    @entrypoint(checkpointer=saver)
    async def flow(amount: int) -> dict[str, Any]:
        first = await pay(amount)
        who = interrupt("who approves?")
        return {"first": first, "who": who, "second": await pay(amount + 100)}

    async def main() -> None:
        cfg = config()
        await flow.ainvoke(1, cfg)
        await flow.ainvoke(Command(resume="alice"), cfg)
        base = [s async for s in flow.aget_state_history(cfg) if s.next][0]
        fork = with_token(base.config, "second-opinion")
        await flow.ainvoke(None, fork)
        out = await flow.ainvoke(Command(resume="bob"), fork)
        assert out == {"first": "charged 1", "who": "bob", "second": "charged 101"}

    asyncio.run(main())
    assert [a for a, _ in applied].count(1) == 1
    assert len({k for a, k in applied if a == 101}) == 2


def test_a_forks_first_run_killed_after_its_shared_task_pays_once(
    store_url: str, tmp_path: Path
) -> None:
    """SIGKILL in the fork's first run, right after the task that the fork shares
    with main returned its recorded outcome; the recovery of the fork still
    charges the prefix once, asks its own question, and pays its answer once."""
    world = World(tmp_path)
    saver = RemitSaver(store_url, lease=LEASE)
    flow = checkout(world, saver)
    cfg = config()
    flow.invoke(1, cfg, durability="sync")
    flow.invoke(Command(resume="alice"), cfg, durability="sync")
    fork = with_token(the_pause(flow, cfg).config, "second-opinion")

    def doomed() -> None:
        world.armed["pay 1.after_effect"] = "kill"
        flow.invoke(None, fork, durability="sync")

    proc = CTX.Process(target=doomed)
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.2)  # the dead run's claim expires (L1)
    assert len(charges(world, 1)) == 1
    asked = flow.invoke(None, fork, durability="sync")
    assert [i.value for i in asked["__interrupt__"]] == ["charge 101 more?"]
    out = flow.invoke(Command(resume="bob"), fork, durability="sync")
    assert out == {"first": "charged 1", "who": "bob", "second": "charged 101"}
    assert len(charges(world, 1)) == 1
    assert len(set(charges(world, 101))) == len(charges(world, 101)) == 2


@pytest.mark.parametrize("durability", ["async", "exit"])
def test_a_fork_shares_what_a_task_paid_before_it_asked_beside_tasks_that_finished(
    store_url: str, durability: str
) -> None:
    """Three tasks run at once: two pay and finish, the third pays, then asks, then
    pays again once answered. A fork of the pause re-runs all three: the three
    payments made before the question are not applied again, while the one made
    after each branch's own answer is applied once per branch."""
    applied: list[tuple[int, str]] = []

    @remit_core.effect(name="charge", idempotent=True)
    def charge(amount: int, *, idempotency_key: str) -> str:
        applied.append((amount, idempotency_key))
        return f"charged {amount}"

    @task
    def pay(amount: int) -> str:
        return charge(amount)

    @task
    def ask(amount: int) -> str:
        charge(amount)
        who = interrupt(f"who approves {amount}?")
        charge(amount + 1000)
        return who

    @entrypoint(checkpointer=RemitSaver(store_url))
    def flow(n: int) -> list[str]:
        return [f.result() for f in (pay(n), pay(n + 1), ask(n + 2))]

    cfg = config()
    flow.invoke(1, cfg, durability=durability)
    assert flow.invoke(Command(resume="alice"), cfg, durability=durability)[2] == "alice"
    fork = with_token(the_pause(flow, cfg).config, "second-opinion")
    flow.invoke(None, fork, durability=durability)
    out = flow.invoke(Command(resume="bob"), fork, durability=durability)
    assert out == ["charged 1", "charged 2", "bob"]
    amounts = [a for a, _ in applied]
    assert (amounts.count(1), amounts.count(2), amounts.count(3)) == (1, 1, 1)
    assert len({k for a, k in applied if a == 1003}) == amounts.count(1003) == 2


def test_a_fork_of_a_nodes_pause_shares_what_a_task_it_called_paid_before_asking(
    store_url: str,
) -> None:
    """A graph node calls a `@task` that pays, asks, then calls it again: a fork of
    the pause shares the first payment and makes the second on its own timeline."""
    applied: list[tuple[int, str]] = []

    @remit_core.effect(name="charge", idempotent=True)
    def charge(amount: int, *, idempotency_key: str) -> str:
        applied.append((amount, idempotency_key))
        return f"charged {amount}"

    @task
    def pay(amount: int) -> str:
        return charge(amount)

    class Log(TypedDict):
        log: Annotated[list[str], operator.add]

    def approve(state: Log) -> dict[str, Any]:
        first = pay(1).result()
        who = interrupt("who approves?")
        return {"log": [first, who, pay(2).result()]}

    builder = StateGraph(Log)
    builder.add_node("approve", approve)
    builder.add_edge(START, "approve")
    builder.add_edge("approve", END)
    graph = builder.compile(checkpointer=RemitSaver(store_url))
    cfg = config()
    graph.invoke({"log": []}, cfg)
    graph.invoke(Command(resume="alice"), cfg)
    fork = with_token(the_pause(graph, cfg).config, "second-opinion")
    graph.invoke(None, fork)
    out = graph.invoke(Command(resume="bob"), fork)
    assert out["log"] == ["charged 1", "bob", "charged 2"]
    amounts = [a for a, _ in applied]
    assert amounts.count(1) == 1
    assert len({k for a, k in applied if a == 2}) == amounts.count(2) == 2
