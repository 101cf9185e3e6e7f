"""RemitSaver probed from the contract where earlier probes did not go: LangGraph's
functional API (`@entrypoint`, `@task`), k resumers in one event loop, `astream` over
a pause in a nested subgraph, `Send` branches that each ask, and crashes in the
middle of them. Real LangGraph, real processes and SIGKILLs, on every engine."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import operator
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from pydantic import BaseModel, Field
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import AsyncRemitSaver, RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}


def in_process_killed(fn: Any) -> None:
    """Run `fn` in a forked process that must die by SIGKILL; then let its lease lapse."""
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.2)  # the dead resumer's claim expires (L1)


def stored_values(saver: RemitSaver, cfg: dict[str, Any]) -> list[Any]:
    """Every resume value the thread's interrupts hold."""
    thread = cfg["configurable"]["thread_id"]
    return sorted(saver._decode(i.value) for i in saver.remit.interrupts(thread) if i.value)


def wait_for_writes(saver: RemitSaver, cfg: dict[str, Any], channel: str, count: int) -> None:
    """Wait (in a doomed process) until `count` writes to `channel` are stored on the head:
    the tasks that made them have durably finished."""
    thread = cfg["configurable"]["thread_id"]
    for _ in range(1000):
        head = saver.remit.head(thread)
        writes = [] if head is None else saver.remit.writes(thread, head.checkpoint_id)
        if sum(w.channel == channel for w in writes) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"{count} writes to {channel} never stored")


# -- the functional API ----------------------------------------------------------------


class Order(BaseModel):
    amount: int = Field(ge=0)


class Receipt(BaseModel):
    total: int


def test_an_entrypoints_input_and_return_types_are_stored_and_read_back(store_url: str) -> None:
    """An `@entrypoint` has no builder: its input, return and saved types (its
    channels' types) are the ones it declares, allowed as a graph's state types are."""
    saver = RemitSaver(store_url)

    @task
    def price(order: Order) -> int:
        return order.amount * 2

    @entrypoint(checkpointer=saver)
    def checkout(order: Order) -> Receipt:
        total = price(order).result()
        interrupt("pay?")
        return Receipt(total=total)

    cfg = config()
    checkout.invoke(Order(amount=3), cfg)
    assert checkout.invoke(Command(resume="yes"), cfg) == Receipt(total=6)
    assert checkout.get_state(cfg).values == Receipt(total=6)


def checkout_flow(world: World, saver: RemitSaver) -> Any:
    """prepare -> interrupt -> pay (effect "charge") -> notify (effect "notify"), as tasks."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(*, idempotency_key: str) -> str:
        return world.apply("charge", idempotency_key)

    @remit_core.effect(name="notify", reconcile=world.reconcile("notify"))
    def notice(*, idempotency_key: str) -> str:
        return world.apply("notify", idempotency_key)

    @task
    def prepare(amount: int) -> int:
        world.enter("prepare")
        return amount * 2

    @task
    def pay(amount: int) -> str:
        world.enter("pay")
        outcome = charge()
        world.point("pay.after_effect")
        return outcome

    @task
    def notify(outcome: str) -> str:
        world.enter("notify")
        world.point("notify.top")
        return notice()

    @entrypoint(checkpointer=saver)
    def flow(amount: int) -> dict[str, Any]:
        doubled = prepare(amount).result()
        who = interrupt("approve?")
        paid = pay(doubled).result()
        return {"amount": doubled, "who": who, "paid": paid, "sent": notify(paid).result()}

    return flow


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
@pytest.mark.parametrize("point", ["pay.after_effect", "notify.top"])
def test_a_functional_run_killed_in_a_task_finishes_once_and_takes_no_second_value(
    store_url: str, tmp_path: Path, durability: str, point: str
) -> None:
    """P1: a finished @task is read from the checkpoint, not run again; P2: its
    effects apply once; P5: the value the dead resumer gave is the one used, and
    another is refused and not stored."""
    world = World(tmp_path)
    saver = RemitSaver(store_url, lease=LEASE)
    flow = checkout_flow(world, saver)
    cfg = config()
    flow.invoke(3, cfg, durability=durability)

    def doomed() -> None:
        if point == "notify.top" and durability != "exit":
            stop = world.point

            def when_pay_is_stored(name: str) -> None:
                if name == "notify.top":
                    wait_for_writes(saver, cfg, "__return__", 2)  # prepare's and pay's
                stop(name)

            world.point = when_pay_is_stored  # type: ignore[method-assign]
        world.armed[point] = "kill"
        flow.invoke(Command(resume="alice"), cfg, durability=durability)

    in_process_killed(doomed)
    entered = len(world.entries())
    final = flow.invoke(None, cfg, durability=durability)
    assert final == {"amount": 6, "who": "alice", "paid": "charge-done", "sent": "notify-done"}
    recovered = [step for _, step in world.entries()[entered:]]
    assert "prepare" not in recovered
    if point == "notify.top" and durability != "exit":  # ("exit" stores nothing before)
        assert recovered == ["notify"]
    assert len(world.applications("charge")) == len(world.applications("notify")) == 1
    with pytest.raises(ResumeConflict):
        flow.invoke(Command(resume="mallory"), cfg, durability=durability)
    assert stored_values(saver, cfg) == ["alice"]
    assert flow.get_state(cfg).values["who"] == "alice"


def test_k_resumers_in_one_event_loop_one_proceeds_and_the_others_run_no_task(
    store_url: str,
) -> None:
    """k `ainvoke(Command(resume=...))` gathered on one thread: one claims the
    interrupt, the others get `ResumeConflict` before any task body runs."""
    entered: list[str] = []
    applied: list[str] = []
    saver = AsyncRemitSaver(store_url)

    @remit_core.effect(name="charge", idempotent=True)
    async def charge(*, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "charged"

    @task
    async def ask(n: int) -> Any:
        entered.append(f"ask-{n}")
        return interrupt(f"approve {n}?")

    @task
    async def pay() -> str:
        entered.append("pay")
        return await charge()

    @entrypoint(checkpointer=saver)
    async def flow(n: int) -> dict[str, Any]:
        first = await ask(n)
        second = await ask(n + 1)
        return {"answers": [first, second], "paid": await pay()}

    cfg = config()

    async def main() -> None:
        await flow.ainvoke(1, cfg)
        first = (await flow.aget_state(cfg)).interrupts[0]
        del entered[:]
        outcomes = await asyncio.gather(
            *(flow.ainvoke(Command(resume={first.id: f"r{i}"}), cfg) for i in range(8)),
            return_exceptions=True,
        )
        assert sorted(type(o).__name__ for o in outcomes) == ["ResumeConflict"] * 7 + ["dict"]
        assert entered == ["ask-1", "ask-2"]  # the winner's: it asks the second question
        with pytest.raises(ResumeConflict):
            await flow.ainvoke(Command(resume={first.id: "late"}), cfg)
        won = stored_values(saver, cfg)
        assert len(won) == 1
        assert (await flow.ainvoke(Command(resume="s"), cfg)) == {
            "answers": [won[0], "s"],
            "paid": "charged",
        }
        assert entered == ["ask-1", "ask-2", "ask-2", "pay"]  # ask-1 answered: not re-run
        assert len(applied) == 1

    asyncio.run(main())


# -- a pause in a nested subgraph ----------------------------------------------------


class Talk(TypedDict, total=False):
    first: str
    second: str
    said: str
    log: Annotated[list[str], operator.add]


def nested_questions(world: World, saver: RemitSaver) -> Any:
    """prep -> mid (subgraph) -> inner (subgraph): ask1, ask2 (effect "charge"), talk
    (a chat model) -> fin. The subgraphs inherit the checkpointer."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(*, idempotency_key: str) -> str:
        return world.apply("charge", idempotency_key)

    def ask1(state: Talk) -> dict[str, Any]:
        world.enter("ask1")
        return {"first": interrupt("first?")}

    def ask2(state: Talk) -> dict[str, Any]:
        world.enter("ask2")
        answer = interrupt("second?")
        charge()
        world.point("ask2.after_effect")
        return {"second": answer}

    def talk(state: Talk) -> dict[str, Any]:
        world.enter("talk")
        model = GenericFakeChatModel(messages=iter([AIMessage(content="hello there")]))
        return {"said": model.invoke("hi").content}

    def entering(name: str) -> Any:
        return lambda state: world.enter(name) or {"log": [name]}

    inner = StateGraph(Talk)
    for name, fn in (("ask1", ask1), ("ask2", ask2), ("talk", talk)):
        inner.add_node(name, fn)
    inner.add_edge(START, "ask1")
    inner.add_edge("ask1", "ask2")
    inner.add_edge("ask2", "talk")
    inner.add_edge("talk", END)
    mid = StateGraph(Talk)
    mid.add_node("inner", inner.compile())
    mid.add_edge(START, "inner")
    mid.add_edge("inner", END)
    top = StateGraph(Talk)
    top.add_node("prep", entering("prep"))
    top.add_node("mid", mid.compile())
    top.add_node("fin", entering("fin"))
    top.add_edge(START, "prep")
    top.add_edge("prep", "mid")
    top.add_edge("mid", "fin")
    top.add_edge("fin", END)
    return top.compile(checkpointer=saver)


def asking(snapshot: Any) -> list[tuple[tuple[str, ...], list[Any]]]:
    """Each level of a `get_state(subgraphs=True)`: what runs next and what it asks."""
    levels = [(snapshot.next, [i.value for i in snapshot.interrupts])]
    for t in snapshot.tasks:
        if t.state is not None:
            levels += asking(t.state)
    return levels


def test_astream_over_a_pause_in_a_nested_subgraph_resumes_once(
    store_url: str, tmp_path: Path
) -> None:
    """`astream` with "updates", "values" and "messages" and subgraphs=True: the pause
    and the resume stream as LangGraph streams them, the state of every level shows
    the question, and a second value for an answered question is refused."""
    world = World(tmp_path)
    saver = AsyncRemitSaver(store_url)
    modes = ["updates", "values", "messages"]

    async def main(world: World) -> None:
        graph = nested_questions(world, saver)
        cfg = config()
        paused = [
            c async for c in graph.astream({"log": []}, cfg, stream_mode=modes, subgraphs=True)
        ]
        asked = [c for c in paused if c[1] == "updates" and "__interrupt__" in c[2]]
        assert {len(ns) for ns, _, _ in asked} == {0, 1, 2}  # seen at every level
        state = await graph.aget_state(cfg, subgraphs=True)
        assert asking(state) == [
            (("mid",), ["first?"]),
            (("inner",), ["first?"]),
            (("ask1",), ["first?"]),
        ]
        first = state.interrupts[0].id
        await graph.ainvoke(Command(resume="one"), cfg)
        with pytest.raises(ResumeConflict):
            await graph.ainvoke(Command(resume={first: "one-again"}), cfg)
        state = await graph.aget_state(cfg, subgraphs=True)
        assert [q for _, q in asking(state)] == [["second?"]] * 3
        done = [
            c
            async for c in graph.astream(
                Command(resume="two"), cfg, stream_mode=modes, subgraphs=True
            )
        ]
        tokens = "".join(c[2][0].content for c in done if c[1] == "messages")
        assert tokens == "hello there"
        assert done[-1][:2] == ((), "values") and done[-1][2]["second"] == "two"
        with pytest.raises(ResumeConflict):
            await graph.ainvoke(Command(resume="three"), cfg)
        assert stored_values(saver, cfg) == ["one", "two"]
        assert [s for _, s in world.entries()] == [
            "prep",
            "ask1",
            "ask1",
            "ask2",
            "ask2",
            "talk",
            "fin",
        ]

    asyncio.run(main(world))


@pytest.mark.parametrize("durability", ["async", "exit"])
def test_a_run_killed_in_a_nested_subgraph_after_its_effect_recovers_with_its_value(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    """SIGKILL in inner's ask2 after its charge: `invoke(None)` gives ask2 the value the
    dead resumer gave (a second value is refused), ask1 is not re-run, the charge is once."""
    world = World(tmp_path)
    saver = RemitSaver(store_url, lease=LEASE)
    graph = nested_questions(world, saver)
    cfg = config()
    graph.invoke({"log": []}, cfg, durability=durability)
    graph.invoke(Command(resume="one"), cfg, durability=durability)

    def doomed() -> None:
        world.armed["ask2.after_effect"] = "kill"
        graph.invoke(Command(resume="two"), cfg, durability=durability)

    in_process_killed(doomed)
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="two-again"), cfg, durability=durability)
    entered = len(world.entries())
    final = graph.invoke(None, cfg, durability=durability)
    assert (final["first"], final["second"]) == ("one", "two")
    assert [s for _, s in world.entries()[entered:]] == ["ask2", "talk", "fin"]
    assert len(world.applications("charge")) == 1
    assert asking(graph.get_state(cfg, subgraphs=True)) == [((), [])]
    assert stored_values(saver, cfg) == ["one", "two"]


# -- Send branches that each ask -----------------------------------------------------------


class Batch(TypedDict, total=False):
    items: list[str]
    got: Annotated[list[str], operator.add]


class Item(TypedDict):
    item: str


def reviews(world: World, saver: RemitSaver) -> Any:
    """One `review` branch per item (Send): each asks, then ships (effect "ship")."""

    def shipped(key: str) -> Any:
        done = any(line.endswith(f":{key}") for line in world.applications("ship"))
        return "shipped" if done else remit_core.NOT_APPLIED

    @remit_core.effect(name="ship", reconcile=shipped)
    def ship(item: str, *, idempotency_key: str) -> str:
        world.apply("ship", f"{item}:{idempotency_key}")
        return "shipped"

    def review(state: Item) -> dict[str, Any]:
        item = state["item"]
        world.enter(f"review-{item}")
        answer = interrupt(f"ok {item}?")
        ship(item)
        world.point(f"review-{item}.after_effect")
        world.enter(f"done-{item}")
        return {"got": [f"{item}={answer}"]}

    builder = StateGraph(Batch)
    builder.add_node("review", review)
    builder.add_conditional_edges(
        START, lambda s: [Send("review", {"item": i}) for i in s["items"]]
    )
    builder.add_edge("review", END)
    return builder.compile(checkpointer=saver)


def by_item(interrupts: Any) -> dict[str, str]:
    return {i.value.split()[1].rstrip("?"): i.id for i in interrupts}


def shipped_items(world: World) -> list[str]:
    return sorted(line.split(" ", 1)[1].split(":", 1)[0] for line in world.applications("ship"))


@pytest.mark.parametrize("durability", ["async", "exit"])
def test_send_branches_answered_by_id_some_then_the_rest(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    """A resume map answers two of four branches; a map that names an answered one is
    refused whole (its other value is not consumed); the rest are answered after."""
    world = World(tmp_path)
    saver = RemitSaver(store_url)
    graph = reviews(world, saver)
    cfg = config()
    ids = by_item(
        graph.invoke({"items": ["a", "b", "c", "d"]}, cfg, durability=durability)["__interrupt__"]
    )
    out = graph.invoke(Command(resume={ids["a"]: "A", ids["b"]: "B"}), cfg, durability=durability)
    assert sorted(out["got"]) == ["a=A", "b=B"]
    assert sorted(by_item(out["__interrupt__"])) == ["c", "d"]
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume={ids["c"]: "C?", ids["a"]: "A2"}), cfg, durability=durability)
    assert stored_values(saver, cfg) == ["A", "B"]
    assert sorted(by_item(graph.get_state(cfg).interrupts)) == ["c", "d"]
    out = graph.invoke(Command(resume={ids["c"]: "C", ids["d"]: "D"}), cfg, durability=durability)
    assert sorted(out["got"]) == ["a=A", "b=B", "c=C", "d=D"]
    assert shipped_items(world) == ["a", "b", "c", "d"]
    assert [s for _, s in world.entries()].count("done-a") == 1


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_fan_out_killed_midway_reruns_only_the_unfinished_branch(
    store_url: str, tmp_path: Path, durability: str
) -> None:
    """SIGKILL in branch b once branch a's output is stored: `invoke(None)` re-runs b
    alone with its value, a is not re-run, every ship is once, and c, d still ask."""
    world = World(tmp_path)
    saver = RemitSaver(store_url, lease=LEASE)
    graph = reviews(world, saver)
    cfg = config()
    ids = by_item(
        graph.invoke({"items": ["a", "b", "c", "d"]}, cfg, durability=durability)["__interrupt__"]
    )

    def doomed() -> None:
        stop = world.point

        def once_a_is_stored(name: str) -> None:
            if name == "review-b.after_effect":
                wait_for_writes(saver, cfg, "got", 1)
                os.kill(os.getpid(), signal.SIGKILL)
            stop(name)

        world.point = once_a_is_stored  # type: ignore[method-assign]
        graph.invoke(Command(resume={ids["a"]: "A", ids["b"]: "B"}), cfg, durability=durability)

    in_process_killed(doomed)
    entered = len(world.entries())
    out = graph.invoke(None, cfg, durability=durability)
    assert sorted(out["got"]) == ["a=A", "b=B"]
    assert sorted(by_item(out["__interrupt__"])) == ["c", "d"]
    recovered = [s for _, s in world.entries()[entered:]]
    assert sorted(recovered) == ["done-b", "review-b", "review-c", "review-d"]
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume={ids["b"]: "B2"}), cfg, durability=durability)
    out = graph.invoke(Command(resume={ids["c"]: "C", ids["d"]: "D"}), cfg, durability=durability)
    assert sorted(out["got"]) == ["a=A", "b=B", "c=C", "d=D"]
    assert shipped_items(world) == ["a", "b", "c", "d"]
