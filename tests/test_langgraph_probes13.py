"""RemitSaver's whole-thread operations probed in shapes the earlier rounds left out:
`prune(..., strategy="keep_latest")` on a thread whose state has a `DeltaChannel` key
(on main and on a fork), `copy_thread` into a thread id that was used before, and a
thread deleted while a run on it is in flight. Real LangGraph, on every engine; the
effect's target dedupes by idempotency key, as a payment API does."""

from __future__ import annotations

import asyncio
import operator
import threading
import uuid
from typing import Annotated, Any

import pytest
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_probes14 import blocking
from test_langgraph_saver import extend
from test_langgraph_saver import logging_steps as steps_logging
from typing_extensions import TypedDict

import remit_core
from remit_core import NOT_APPLIED, Fenced, RemitError
from remit_langgraph import RemitSaver


def config(thread: str | None = None, **more: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or f"lg-{uuid.uuid4().hex}", **more}}


# -- prune keep_latest and DeltaChannel keys ---------------------------------------------


class Deltas(TypedDict):
    log: Annotated[list[int], DeltaChannel(extend, snapshot_frequency=4)]
    n: int


def logging_steps(saver: Any) -> Any:
    return steps_logging(saver, Deltas)


@pytest.mark.parametrize("call", ["prune", "aprune"])
def test_keep_latest_keeps_what_a_delta_channel_key_is_rebuilt_from(url: str, call: str) -> None:
    """A `DeltaChannel` key stores its value every few updates and the writes between;
    `keep_latest` deleted the checkpoints between the head and its last snapshot, and
    the key then read as empty (a wrong state, no error), and runs went on from it.
    The ancestors it is rebuilt from stay (older ones go); so do a fork's."""
    saver, reference = RemitSaver(url), InMemorySaver()
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    for i in range(3):
        logging_steps(saver).invoke({"n": 10 * i}, cfg)
        expected = logging_steps(reference).invoke({"n": 10 * i}, cfg)
    assert expected["log"] == [0, 1, 10, 11, 20, 21]
    graph = logging_steps(saver)
    older = [s.config for s in graph.get_state_history(cfg)][4]
    fork = config(thread, fork_token="f")
    graph.update_state(
        {"configurable": {**older["configurable"], "fork_token": "f"}}, {"log": [99]}, "b"
    )
    forked = graph.get_state(fork).values
    stored = len(saver.remit.history(thread))
    if call == "prune":
        saver.prune([thread])
    else:
        asyncio.run(saver.aprune([thread]))
    assert len(saver.remit.history(thread)) < stored  # (old checkpoints went)
    reread = logging_steps(RemitSaver(url))  # nothing cached: a new process
    assert reread.get_state(cfg).values == expected
    assert reread.get_state(fork).values == forked and forked["log"][-1] == 99
    assert reread.invoke({"n": 100}, cfg) == logging_steps(reference).invoke({"n": 100}, cfg)
    assert reread.invoke(None, fork)["log"] == forked["log"]  # (nothing left to run)


def test_keep_latest_still_keeps_only_the_head_of_a_thread_without_delta_keys(url: str) -> None:
    class Log(TypedDict):
        log: Annotated[list[str], operator.add]

    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_edge(START, "a")
    saver = RemitSaver(url)
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    for _ in range(3):
        graph.invoke({"log": ["in"]}, cfg)
    saver.prune([cfg["configurable"]["thread_id"]])
    assert len(saver.remit.history(cfg["configurable"]["thread_id"])) == 1
    assert graph.get_state(cfg).values == {"log": ["in", "a"] * 3}
    with pytest.raises(TypeError, match="not one str"):
        saver.prune(cfg["configurable"]["thread_id"])


# -- copy_thread into a thread id used before ---------------------------------------------


class Payments:
    """A payment API: a repeated idempotency key returns the first charge, applies nothing."""

    def __init__(self) -> None:
        self.by_key: dict[str, int] = {}
        self.applied: list[int] = []

    def charge(self, amount: int, key: str) -> int:
        if key not in self.by_key:
            self.applied.append(amount)
        return self.by_key.setdefault(key, amount)


class Bill(TypedDict):
    amount: int
    charged: int
    approved: str


def billing(saver: RemitSaver, payments: Payments) -> Any:
    """ask for approval, then charge (effect) in the next node."""

    @remit_core.effect(reconcile=lambda key: payments.by_key.get(key, NOT_APPLIED))
    def charge(amount: int, *, idempotency_key: str) -> int:
        return payments.charge(amount, idempotency_key)

    builder = StateGraph(Bill)
    builder.add_node("ask", lambda s: {"approved": interrupt("approve?")})
    builder.add_node("pay", lambda s: {"charged": charge(s["amount"])})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "pay")
    builder.add_edge("pay", END)
    return builder.compile(checkpointer=saver)


def start(amount: int) -> dict[str, Any]:
    return {"amount": amount, "charged": 0, "approved": ""}


@pytest.mark.parametrize("call", ["copy_thread", "acopy_thread"])
def test_a_copy_into_a_thread_id_delete_thread_emptied_is_refused(url: str, call: str) -> None:
    """The copy took its source's keys under the target's id: a target whose first life
    charged, then was deleted, had its copy's charge keyed as that first one, and the
    payment API answered the new charge with the old (25 never charged). Refused, and
    nothing copied; a copy to a new id charges under keys of its own."""
    saver, payments = RemitSaver(url), Payments()
    graph = billing(saver, payments)
    reused, source = config(), config()
    graph.invoke(start(10), reused)
    assert graph.invoke(Command(resume="ann"), reused)["charged"] == 10
    saver.delete_thread(reused["configurable"]["thread_id"])
    graph.invoke(start(25), source)

    def copy(target: dict[str, Any]) -> None:
        ids = (source["configurable"]["thread_id"], target["configurable"]["thread_id"])
        if call == "copy_thread":
            saver.copy_thread(*ids)
        else:
            asyncio.run(saver.acopy_thread(*ids))

    with pytest.raises(RemitError, match="target_thread_id .* was used before") as refused:
        copy(reused)
    assert refused.value.run_id == reused["configurable"]["thread_id"]
    assert graph.get_state(reused).values == {}
    assert saver.remit.history(reused["configurable"]["thread_id"]) == []
    fresh = config()
    copy(fresh)
    assert graph.invoke(Command(resume="bob"), fresh)["charged"] == 25
    assert graph.invoke(Command(resume="cy"), source)["charged"] == 25
    assert payments.applied == [10, 25, 25]  # the copy and its source: two runs, two charges


def test_a_copy_into_a_thread_with_a_line_of_its_own_is_refused_and_changes_nothing(
    url: str,
) -> None:
    """It merged the two threads: the target's history listed the source's checkpoints
    among its own, and the source's effects and interrupts joined the target's."""
    saver, payments = RemitSaver(url), Payments()
    graph = billing(saver, payments)
    source, target = config(), config()
    graph.invoke(start(25), source)
    graph.invoke(start(7), target)
    before = [(s.values, s.next) for s in graph.get_state_history(target)]
    with pytest.raises(RemitError, match="was used before"):
        saver.copy_thread(source["configurable"]["thread_id"], target["configurable"]["thread_id"])
    assert [(s.values, s.next) for s in graph.get_state_history(target)] == before
    assert graph.invoke(Command(resume="dee"), target)["charged"] == 7
    assert graph.invoke(Command(resume="eve"), source)["charged"] == 25
    assert payments.applied == [7, 25]


# -- a thread deleted while a run on it is in flight ------------------------------------


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_a_thread_deleted_under_a_running_run_is_not_brought_back(
    url: str, durability: str
) -> None:
    """The run's next write finds its claim gone (`Fenced`): no head without its history
    is stored, the thread stays deleted, and the thread id starts again from nothing.
    In "async" durability a write may be in flight as the thread is deleted: on
    PostgreSQL the delete removed the claim last, so such a write committed a step's
    checkpoint after the delete had passed its table (or the two deadlocked)."""
    entered, leave = threading.Event(), threading.Event()
    saver = RemitSaver(url)
    graph = blocking(saver, entered, leave)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    outcome: list[BaseException | dict[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(graph.invoke({"log": []}, cfg, durability=durability))
        except BaseException as exc:  # noqa: BLE001 (the outcome is asserted below)
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    assert entered.wait(60)
    saver.delete_thread(thread)
    leave.set()
    runner.join(60)
    assert not runner.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], Fenced), outcome
    other = RemitSaver(url)
    assert other.remit.history(thread) == [] and other.remit.branches(thread) == []
    assert graph.get_state(cfg).values == {}
    entered.clear()
    leave.set()
    assert graph.invoke({"log": ["again"]}, cfg) == {"log": ["again", "a", "b", "c"]}


# -- leaving from_conn_string ----------------------------------------------------------


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_saver_used_after_its_from_conn_string_block_is_store_unavailable(
    url: str, api: str
) -> None:
    """Leaving the block did nothing: the saver went on working, and its store was
    never let go. It is closed now, as LangGraph's own savers are: a later use raises
    `StoreUnavailable` naming the store, and stores nothing."""
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", END)
    cfg = config()

    async def in_async() -> Any:
        async with RemitSaver.from_conn_string(url) as saver:
            graph = builder.compile(checkpointer=saver)
            assert await graph.ainvoke({"log": []}, cfg) == {"log": ["a"]}
        with pytest.raises(remit_core.StoreUnavailable, match="is closed") as err:
            await graph.ainvoke({"log": []}, cfg)
        return err

    if api == "async":
        err = asyncio.run(in_async())
    else:
        with RemitSaver.from_conn_string(url) as saver:
            graph = builder.compile(checkpointer=saver)
            assert graph.invoke({"log": []}, cfg) == {"log": ["a"]}
        with pytest.raises(remit_core.StoreUnavailable, match="is closed") as err:
            graph.invoke({"log": []}, cfg)
    assert url.split("://")[0] in str(err.value)
    again = RemitSaver(url)
    assert again.get_tuple(cfg).checkpoint["channel_values"]["log"] == ["a"]  # type: ignore[union-attr]
    assert len(list(again.list(cfg))) == 3
