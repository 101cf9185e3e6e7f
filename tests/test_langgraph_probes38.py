"""Round 38 probes of RemitSaver: a node cache (`CachePolicy` with a graph `cache=`)
whose hit hands over an output the running graph's schema refuses; a thread whose
runs change durability mode, with a SIGKILL in each; k resumers racing on a question
asked inside a subgraph that a node invokes; time travel through the async API from
two processes; and a fork of a checkpoint whose next step ran through, whose run of
that step is its own (its effects under the fork's keys).

Real LangGraph, real stores on every engine, real processes killed with SIGKILL."""

from __future__ import annotations

import asyncio
import operator
import os
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.cache.memory import InMemoryCache
from langgraph.graph import END, START, StateGraph
from langgraph.types import CachePolicy, Command, interrupt
from test_langgraph_probes4 import CTX, LEASE, in_process_killed
from test_langgraph_probes10 import outcome_of
from test_langgraph_probes20 import in_another_process, race_one_killed
from test_langgraph_support import INITIAL, World, build
from typing_extensions import TypedDict

import remit_core
from remit_core import CheckpointInvalid, ForkWithoutIntent, ResumeConflict
from remit_langgraph import RemitSaver


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg38-{uuid.uuid4().hex}"}}


# -- a cache hit the running graph's schema refuses -----------------------------------


class Stock(TypedDict):
    """What a store takes its orders from: a plain count in the first release."""

    stock: int
    log: Annotated[list[str], operator.add]


class BoundedStock(TypedDict):
    """The next release bounds the count: a stock never goes below zero."""

    stock: Annotated[int, Ge(0)]
    log: Annotated[list[str], operator.add]


def reserving(schema: type, saver: RemitSaver, cache: InMemoryCache, entered: list[str]) -> Any:
    """reserve (cached: an expensive lookup, keyed by its input) -> ship. Both releases
    run the same node function, so they share the cache's entries, as two deploys
    sharing a persistent cache do."""

    def ship(state: Any) -> dict[str, Any]:
        entered.append("ship")
        return {"log": ["ship"]}

    builder = StateGraph(schema)
    builder.add_node("reserve", reserve_five, cache_policy=CachePolicy())
    builder.add_node("ship", ship)
    builder.add_edge(START, "reserve")
    builder.add_edge("reserve", "ship")
    builder.add_edge("ship", END)
    return builder.compile(checkpointer=saver, cache=cache)


def reserve_five(state: Any) -> dict[str, Any]:
    return {"stock": state["stock"] - 5, "log": ["reserve"]}


@pytest.mark.parametrize("durability", ["sync", "async", "exit", "ainvoke"])
def test_a_cache_hit_the_schema_refuses_is_refused_before_it_is_stored_or_read(
    url: str, durability: str
) -> None:
    """P4: a node's cached output, filled by the first release (no bound), is handed
    to the second release's run without the node running. It takes `stock` below
    its bound: the run raises `CheckpointInvalid` naming `stock` before any next
    step, and nothing of it is stored, in every durability mode; the thread stays at
    its last valid checkpoint and goes on once its state is edited. (It was stored
    as the node's pending writes, read back by `get_state`, and in the "async" and
    "exit" modes `ship` ran on the refused stock.)"""
    cache, entered = InMemoryCache(), []
    first = reserving(Stock, RemitSaver(url), cache, entered)
    assert first.invoke({"stock": 1, "log": []}, config())["stock"] == -4
    entered.clear()

    saver = RemitSaver(url)
    graph, cfg = reserving(BoundedStock, saver, cache, entered), config()
    with pytest.raises(CheckpointInvalid) as refused:
        if durability == "ainvoke":
            asyncio.run(graph.ainvoke({"stock": 1, "log": []}, cfg))
        else:
            graph.invoke({"stock": 1, "log": []}, cfg, durability=durability)
    assert refused.value.field == "stock"
    assert entered == []  # no step read the refused stock

    thread = cfg["configurable"]["thread_id"]
    head = saver.remit.head(thread)
    assert head is not None and saver.remit.writes(thread, head.checkpoint_id) == []
    state = graph.get_state(cfg)
    assert state.values == {"stock": 1, "log": []}
    assert state.next == ("reserve",) and state.tasks[0].result is None

    graph.update_state(cfg, {"stock": 10})  # another input: the cache has no entry for it
    assert graph.invoke(None, cfg) == {"stock": 5, "log": ["reserve", "ship"]}
    assert entered == ["ship"]


# -- durability changed between the runs of one thread, a SIGKILL in each -------------


@pytest.mark.parametrize(
    "modes", [("exit", "sync", "async"), ("async", "exit", "sync"), ("sync", "async", "exit")]
)
def test_a_thread_run_in_a_new_durability_each_time_and_killed_each_time_pays_once(
    url: str, tmp_path: Path, modes: tuple[str, str, str]
) -> None:
    """P1, P2, P5, L1 across durability modes: the pause is made in one mode, the
    resume (killed once its value is taken, before its node returns) in a second,
    the recovery (killed after the charge) in a third, and the last recovery in the
    first again. The answer is the one the killed resumer took, a second one is
    refused, `prepare` ran once, the charge and the notice applied once each."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph, cfg = build(world, saver), config()
    pause, resume, recover = modes
    assert "__interrupt__" in graph.invoke(INITIAL, cfg, durability=pause)

    def answer() -> None:
        world.armed["approve.answered"] = "kill"
        graph.invoke(Command(resume="alice"), cfg, durability=resume)

    in_process_killed(answer)
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="mallory"), cfg, durability=recover)

    def go_on() -> None:
        world.armed["charge.after_effect"] = "kill"
        graph.invoke(None, cfg, durability=recover)

    in_process_killed(go_on)
    done = graph.invoke(None, cfg, durability=pause)
    assert done["approved_by"] == "alice"
    assert done["log"] == ["prepare", "approve", "charge-done", "notify-done"]
    assert [s for _, s in world.entries() if s == "prepare"] == ["prepare"]
    assert len(world.applications("charge")) == 1
    assert len(world.applications("notify")) == 1


# -- k resumers racing on a question asked inside a subgraph a node invokes -----------


def nested_asking(world: World, saver: RemitSaver) -> Any:
    """pre -> outer, whose body invokes a subgraph (inner: ask -> pay) and returns
    what it answered; `pay` charges after the answer. The subgraph inherits the
    parent's checkpointer, so it pauses and resumes with the thread."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(*, idempotency_key: str) -> str:
        return world.apply("charge", idempotency_key)

    def ask(state: Approval) -> dict[str, Any]:
        world.enter("ask")
        who = interrupt("who approves?", response_schema=str)
        world.enter(f"ask:{who}")
        return {"who": who}

    def pay(state: Approval) -> dict[str, Any]:
        world.enter("pay")
        outcome = charge()
        world.point("pay.after_effect")
        return {"log": [outcome]}

    inner_builder = StateGraph(Approval)
    inner_builder.add_node("ask", ask)
    inner_builder.add_node("pay", pay)
    inner_builder.add_edge(START, "ask")
    inner_builder.add_edge("ask", "pay")
    inner_builder.add_edge("pay", END)
    inner = inner_builder.compile()

    def pre(state: Approval) -> dict[str, Any]:
        world.enter("pre")
        return {"log": ["pre"]}

    def outer(state: Approval) -> dict[str, Any]:
        world.enter("outer")
        done = inner.invoke({"who": "", "log": []})
        return {"who": done["who"], "log": [*done["log"], "outer"]}

    builder = StateGraph(Approval)
    builder.add_node("pre", pre)
    builder.add_node("outer", outer)
    builder.add_edge(START, "pre")
    builder.add_edge("pre", "outer")
    builder.add_edge("outer", END)
    return builder.compile(checkpointer=saver)


class Approval(TypedDict):
    who: str
    log: Annotated[list[str], operator.add]


def test_k8_resumers_of_a_question_in_a_subgraph_a_node_invokes_one_takes_it_and_pays_once(
    url: str, tmp_path: Path
) -> None:
    """P5, L1, P2: eight processes behind a barrier resume a pause inside a subgraph
    that a node invokes, each with its own value: one takes the question, the seven
    others get `ResumeConflict` and enter no node. The winner is SIGKILLed inside the
    subgraph after its charge; once its lease lapses, a recovery in another process
    finishes with the winner's value, the charge applied once, `pre` and the
    subgraph's `ask` run to their end once."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph, cfg = nested_asking(world, saver), config()
    assert graph.invoke({"who": "", "log": []}, cfg)["__interrupt__"][0].value == "who approves?"
    winner, killed = race_one_killed(
        world, "pay.after_effect", 8, lambda v: graph.invoke(Command(resume=v), cfg)
    )
    assert {pid for pid, _ in world.entries()} == {os.getpid(), killed}  # no loser entered

    time.sleep(LEASE + 0.2)  # the dead winner's claim expires (L1)
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="late"), cfg)  # the winner's value was consumed
    in_another_process(lambda: graph.invoke(None, cfg))
    final = graph.get_state(cfg)
    assert final.next == () and final.values["who"] == winner
    assert final.values["log"] == ["pre", "charge-done", "outer"]
    assert len(world.applications("charge")) == 1
    assert [s for _, s in world.entries() if s == "pre"] == ["pre"]
    # Asked, then run again by the winner; the subgraph stored `ask`'s output as it
    # finished, so the recovery does not run it a third time.
    asked = ["ask", "ask", f"ask:{winner}"]
    assert [s for _, s in world.entries() if s.startswith("ask")] == asked


# -- async time travel from two processes -----------------------------------------------


def test_async_time_travel_from_two_processes_with_one_token_makes_one_branch(
    url: str, tmp_path: Path
) -> None:
    """P3, P2 through the async API: a checkpoint found with `aget_state_history`
    (after the charge, before the notice) is refused as a fork without a token, by
    `ainvoke` and by `aupdate_state(..., as_node=...)`, storing nothing; two
    processes behind a barrier then `ainvoke` it with one token: one branch is made,
    the charge of the shared prefix is not applied again, the fork's notice is
    applied once, and main keeps its own head. (The fork's notice, the step right
    after its base, returned main's recorded outcome and was not applied: a step a
    fork runs after its base applies under the fork's keys.)"""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph, cfg = build(world, saver), config()
    thread = cfg["configurable"]["thread_id"]

    async def pause_answer_and_find_base() -> Any:
        await graph.ainvoke(INITIAL, cfg)
        await graph.ainvoke(Command(resume="alice"), cfg)
        return [s async for s in graph.aget_state_history(cfg) if s.next == ("notify",)][0]

    base = asyncio.run(pause_answer_and_find_base())
    before = len(list(saver.list(cfg)))
    with pytest.raises(ForkWithoutIntent):
        asyncio.run(graph.ainvoke(None, base.config))
    with pytest.raises(ForkWithoutIntent):
        asyncio.run(graph.aupdate_state(base.config, {"log": ["edit"]}, as_node="charge"))
    assert len(list(saver.list(cfg))) == before and len(saver.remit.branches(thread)) == 1

    fork = {"configurable": {**base.config["configurable"], "fork_token": "again"}}
    k = 2
    barrier, results = CTX.Barrier(k), CTX.Queue()

    def racer(i: int) -> None:
        racing = build(world, RemitSaver(url, lease=LEASE))
        barrier.wait(timeout=30)
        results.put(outcome_of(lambda: asyncio.run(racing.ainvoke(None, fork))))

    procs = [CTX.Process(target=racer, args=(i,)) for i in range(k)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * k
    outcomes = sorted(results.get(timeout=10) for _ in range(k))
    assert outcomes in (["ok", "ok"], ["ResumeConflict", "ok"])
    assert len(saver.remit.branches(thread)) == 2

    by_token = {"configurable": {"thread_id": thread, "fork_token": "again"}}
    forked = asyncio.run(graph.aget_state(by_token))
    assert forked.next == ()
    assert forked.values["log"] == ["prepare", "approve", "charge-done", "notify-done"]
    assert (
        asyncio.run(graph.aget_state(cfg)).config["configurable"]["checkpoint_id"]
        == (graph.get_state(cfg).config["configurable"]["checkpoint_id"])
    )
    assert len(world.applications("charge")) == 1
    assert len(world.applications("notify")) == 2  # main's, and the fork's own, once
    assert [s for _, s in world.entries() if s == "notify"] == ["notify"] * 2


# -- a fork of a step that ran through: its next step is the fork's own ---------------


class Order(TypedDict):
    amount: int
    log: Annotated[list[str], operator.add]


def pricing(world: World, saver: RemitSaver) -> Any:
    """price -> charge (effect "charge" of the order's amount)."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge_card(amount: int, *, idempotency_key: str) -> str:
        world.apply("charge", f"{idempotency_key} {amount}")
        return f"charged {amount}"

    def price(state: Order) -> dict[str, Any]:
        world.enter("price")
        return {"amount": 100, "log": ["price"]}

    def charge(state: Order) -> dict[str, Any]:
        world.enter("charge")
        return {"log": [charge_card(state["amount"])]}

    builder = StateGraph(Order)
    builder.add_node("price", price)
    builder.add_node("charge", charge)
    builder.add_edge(START, "price")
    builder.add_edge("price", "charge")
    builder.add_edge("charge", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_fork_edited_right_before_a_charge_charges_its_own_amount(
    url: str, tmp_path: Path, durability: str
) -> None:
    """P2, P3: the thread ran through (price 100, charged 100). A fork made by editing
    the checkpoint right before `charge` (`amount` 70, with a token) runs `charge`
    after its base, as its own step: it charges 70 under the fork's key, and says so.
    A fork of that checkpoint without an edit charges again under its own key too,
    as a fork from one step earlier does; main keeps its one charge. (Both forks
    returned main's recorded "charged 100" and charged nothing: the calls of a step
    that ran through after the base were taken for the base's own.)"""
    world = World(tmp_path)
    graph, cfg = pricing(world, RemitSaver(url)), config()
    thread = cfg["configurable"]["thread_id"]
    assert graph.invoke({"amount": 0, "log": []}, cfg, durability=durability)["log"] == [
        "price",
        "charged 100",
    ]
    base = next(s for s in graph.get_state_history(cfg) if s.next == ("charge",))

    edit = {"configurable": {**base.config["configurable"], "fork_token": "discount"}}
    graph.update_state(edit, {"amount": 70}, as_node="price")
    discounted = {"configurable": {"thread_id": thread, "fork_token": "discount"}}
    done = graph.invoke(None, discounted, durability=durability)
    assert done == {"amount": 70, "log": ["price", "charged 70"]}

    replay = {"configurable": {**base.config["configurable"], "fork_token": "replay"}}
    assert graph.invoke(None, replay, durability=durability)["log"] == ["price", "charged 100"]
    amounts = sorted(line.rsplit(" ", 1)[1] for line in world.applications("charge"))
    assert amounts == ["100", "100", "70"]
    assert len({line.split(" ")[1] for line in world.applications("charge")}) == 3  # 3 keys
    assert graph.get_state(cfg).values == {"amount": 100, "log": ["price", "charged 100"]}
    assert [s for _, s in world.entries()] == ["price", "charge", "charge", "charge"]
