"""Round 51 of the LangGraph probes: a subgraph a node invokes itself.

A node may call a compiled graph (`inner.invoke(...)` in its body) instead of having
it added as a node; the inner graph then runs on the parent's checkpointer, in a
namespace of the node's task, and its interrupts pause the parent. Probed here, on
every engine: an answer the inner graph's schema refuses (the parent's is looser)
opens its question again with the earlier answer kept, and racing answers after it
take one; an inner node that pays (an effect) and is killed right after pays once in
all, in each durability, and the run ends as an unkilled one does and as LangGraph's
own saver ends it (without the kill); two inner graphs called one after the other by
one node, each asking, with a kill between (in "async" and "sync" durability: in
"exit", LangGraph's own savers do not resume such a node either). Real LangGraph, real
stores, real processes killed with SIGKILL; no mocks."""

from __future__ import annotations

import operator
import sqlite3
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_probes49 import LEASE, killed, pay_with
from test_langgraph_support import World, race_answers
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid, ResumeConflict
from remit_langgraph import RemitSaver

DURABILITIES = ["async", "sync", "exit"]


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg51-{uuid.uuid4().hex}"}}


class Strict(TypedDict, total=False):
    amount: Annotated[int, Ge(0)]
    who: str
    log: Annotated[list[str], operator.add]


class Loose(TypedDict, total=False):
    amount: int
    who: str
    log: Annotated[list[str], operator.add]


def outer(call: Any, saver: Any) -> Any:
    """START -> call -> END, on the looser state: only the inner graph refuses."""
    builder = StateGraph(Loose)
    builder.add_node("call", call)
    builder.add_edge(START, "call")
    builder.add_edge("call", END)
    return builder.compile(checkpointer=saver)


def asking_inner() -> Any:
    """ask: who?, then amount? (the amount must be >= 0)."""

    def ask(state: Strict) -> dict[str, Any]:
        who = interrupt("who?")
        return {"who": who, "amount": interrupt("amount?"), "log": [f"by {who}"]}

    inner = StateGraph(Strict)
    inner.add_node("ask", ask)
    inner.add_edge(START, "ask")
    inner.add_edge("ask", END)
    return inner.compile()


def calls_asker(saver: Any) -> Any:
    inner = asking_inner()

    def call(state: Loose) -> dict[str, Any]:
        out = inner.invoke({"amount": 0, "log": []})
        return {"who": out["who"], "amount": out["amount"], "log": out["log"]}

    return outer(call, saver)


def interrupts(out: dict[str, Any]) -> list[Any]:
    return [i.value for i in out.get("__interrupt__", [])]


def test_an_answer_the_inner_graph_refuses_asks_again_and_keeps_the_earlier_one(
    url: str,
) -> None:
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = calls_asker(saver), config()
        assert interrupts(graph.invoke({"amount": 0, "log": []}, cfg)) == ["who?"]
        assert interrupts(graph.invoke(Command(resume="ada"), cfg)) == ["amount?"]
        with pytest.raises(CheckpointInvalid, match="amount"):
            graph.invoke(Command(resume=-5), cfg)
        # Nothing of the refused answer is in the parent's state.
        assert graph.get_state(cfg).values == {"amount": 0, "log": []}
        assert interrupts(graph.invoke(None, cfg)) == ["amount?"]
        out = graph.invoke(Command(resume=5), cfg)
        assert (out["who"], out["amount"], out["log"]) == ("ada", 5, ["by ada"])
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume=6), cfg)
        assert graph.get_state(cfg).values["amount"] == 5
    finally:
        saver.remit.close()


def test_racing_answers_after_the_refusal_take_one(url: str) -> None:
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = calls_asker(saver), config()
        graph.invoke({"amount": 0, "log": []}, cfg)
        graph.invoke(Command(resume="ada"), cfg)
        with pytest.raises(CheckpointInvalid):
            graph.invoke(Command(resume=-5), cfg)
        outcomes = race_answers(graph, cfg, [1, 2, 3, 4])
        won = [out["amount"] for kind, out in outcomes if kind == "ok"]
        assert len(won) == 1, outcomes
        assert [kind for kind, _ in outcomes].count("conflict") == 3
        assert graph.get_state(cfg).values["amount"] == won[0]
        assert graph.get_state(cfg).values["who"] == "ada"
    finally:
        saver.remit.close()


# -- an inner node that pays ----------------------------------------------------------


def paying(world: World, saver: Any) -> Any:
    """call -> (inner: ask who? -> pay, then a point to be killed at) -> END. On
    LangGraph's own saver the payment is a plain call (an effect needs a Remit run)."""
    pay = (
        (lambda: world.apply("pay", uuid.uuid4().hex))
        if isinstance(saver, SqliteSaver)
        else pay_with(world, "pay")
    )

    def ask(state: Strict) -> dict[str, Any]:
        world.enter("ask")
        return {"who": interrupt("who?")}

    def charge(state: Strict) -> dict[str, Any]:
        world.enter("charge")
        pay()
        world.point("charge.paid")
        return {"amount": 7, "log": [f"paid by {state['who']}"]}

    inner_builder = StateGraph(Strict)
    inner_builder.add_node("ask", ask)
    inner_builder.add_node("charge", charge)
    inner_builder.add_edge(START, "ask")
    inner_builder.add_edge("ask", "charge")
    inner_builder.add_edge("charge", END)
    inner = inner_builder.compile()

    def call(state: Loose) -> dict[str, Any]:
        out = inner.invoke({"amount": 0, "log": []})
        return {"who": out["who"], "amount": out["amount"], "log": out["log"]}

    return outer(call, saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_an_inner_node_killed_after_it_paid_pays_once_and_ends_as_unkilled(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The answer is consumed, the inner node pays and its process dies. The answer is
    not taken again (`ResumeConflict`), `invoke(None)` finishes the run with one
    payment in all, and the run ends as an unkilled one and as LangGraph's own
    SqliteSaver (unkilled) end it."""
    for name in ("k", "c", "s"):
        (tmp_path / name).mkdir()
    world, clean, theirs = World(tmp_path / "k"), World(tmp_path / "c"), World(tmp_path / "s")
    saver = RemitSaver(url, lease=LEASE)
    conn = sqlite3.connect(tmp_path / "langgraph.db", check_same_thread=False)
    try:
        graph, cfg = paying(world, saver), config()
        assert interrupts(graph.invoke({"amount": 0, "log": []}, cfg, durability=durability)) == [
            "who?"
        ]

        def doomed() -> None:
            world.armed["charge.paid"] = "kill"
            graph.invoke(Command(resume="ada"), cfg, durability=durability)

        killed(doomed)
        assert len(world.applications("pay")) == 1
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="bob"), cfg, durability=durability)
        out = graph.invoke(None, cfg, durability=durability)
        assert len(world.applications("pay")) == 1
        assert (out["who"], out["amount"], out["log"]) == ("ada", 7, ["paid by ada"])
        assert graph.get_state(cfg).next == ()

        expected = []
        for w, s in ((clean, saver), (theirs, SqliteSaver(conn))):
            plain, pcfg = paying(w, s), config()
            plain.invoke({"amount": 0, "log": []}, pcfg, durability=durability)
            expected.append(plain.invoke(Command(resume="ada"), pcfg, durability=durability))
            assert len(w.applications("pay")) == 1
        assert out == expected[0] == expected[1]
    finally:
        conn.close()
        saver.remit.close()


# -- two inner graphs, one after the other --------------------------------------------


def two_inner(world: World, saver: Any) -> Any:
    """call: inner A asks who? then B asks amount? (B's answer must be >= 0), and
    the node pays between them."""
    pay = pay_with(world, "pay")

    def ask_who(state: Strict) -> dict[str, Any]:
        return {"who": interrupt("who?")}

    def ask_amount(state: Strict) -> dict[str, Any]:
        return {"amount": interrupt("amount?")}

    inners = []
    for node in (ask_who, ask_amount):
        b = StateGraph(Strict)
        b.add_node("ask", node)
        b.add_edge(START, "ask")
        b.add_edge("ask", END)
        inners.append(b.compile())

    def call(state: Loose) -> dict[str, Any]:
        who = inners[0].invoke({"amount": 0, "log": []})["who"]
        pay()
        world.point("call.paid")
        amount = inners[1].invoke({"amount": 0, "log": []})["amount"]
        return {"who": who, "amount": amount, "log": [f"{who}:{amount}"]}

    return outer(call, saver)


# (Not in "exit" durability: there LangGraph's own savers do not resume such a node
# either; the second question's answer goes to the first inner graph, asked again.)
@pytest.mark.parametrize("durability", ["async", "sync"])
def test_two_inner_graphs_of_one_node_with_a_kill_between_them(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The first inner graph's answer is taken, the node pays, and its process dies
    before the second asks. `invoke(None)` asks the second question (the first is not
    asked again, the payment not made again); a refused answer to it asks again; the
    run ends with both answers and one payment."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = two_inner(world, saver), config()
        assert interrupts(graph.invoke({"amount": 0, "log": []}, cfg, durability=durability)) == [
            "who?"
        ]

        def doomed() -> None:
            world.armed["call.paid"] = "kill"
            graph.invoke(Command(resume="ada"), cfg, durability=durability)

        killed(doomed)
        assert len(world.applications("pay")) == 1
        assert interrupts(graph.invoke(None, cfg, durability=durability)) == ["amount?"]
        assert len(world.applications("pay")) == 1
        with pytest.raises(CheckpointInvalid, match="amount"):
            graph.invoke(Command(resume=-1), cfg, durability=durability)
        assert interrupts(graph.invoke(None, cfg, durability=durability)) == ["amount?"]
        out = graph.invoke(Command(resume=3), cfg, durability=durability)
        assert (out["who"], out["amount"], out["log"]) == ("ada", 3, ["ada:3"])
        assert len(world.applications("pay")) == 1
    finally:
        saver.remit.close()
