"""Round 50 of the LangGraph probes: `Command(resume=, update=, goto=)` is one act.

The value is consumed at the run's start; LangGraph stores the command's update and
goto later (in the background, in "exit" durability only at the run's end). They are
now stored in the consume's own transaction, so a resumer SIGKILLed at any point
leaves either the value and its update and goto, or none of them. Checked here: the
stored writes right after a kill, a kill inside the consume's transaction, an update
to a reducer key applied once after a kill, a node asked twice with a command each
(the second's writes numbered after the first's), a map by id with an update, and
the same commands unkilled against LangGraph's own SqliteSaver.

Also found: an answer that led a subgraph's node (a compiled graph added as a node) to
an output the state schema refuses was refused (`CheckpointInvalid`), but the question
was not asked again: every next answer got `ResumeConflict` ("already consumed"), and
the subgraph kept the refused answer, which `invoke(None)` handed to the node again.
Now the parent task's error is stored and its question opened again, as for a
top-level node, and the subgraph's node keeps only the answers it had before. Real
LangGraph, real stores, real processes killed with SIGKILL; no mocks."""

from __future__ import annotations

import operator
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from test_langgraph_probes49 import LEASE, killed
from test_langgraph_support import World, race_answers
from typing_extensions import TypedDict

import remit_core
from remit_core import CheckpointInvalid, ResumeConflict, failpoints
from remit_langgraph import RemitSaver

DURABILITIES = ["async", "sync", "exit"]
NULL_TASK = "00000000-0000-0000-0000-000000000000"


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg50-{uuid.uuid4().hex}"}}


class Order(TypedDict):
    amount: int
    who: str | None
    log: Annotated[list[str], operator.add]


def routed(saver: Any, world: World | None = None) -> Any:
    """ask (interrupt) -> charge -> END; `skip` only by a goto. `charge` pays through
    an effect when a `world` is given (Remit only)."""
    pay = None
    if world is not None:

        @remit_core.effect(name="pay", reconcile=world.reconcile("pay"))
        def pay(*, idempotency_key: str) -> str:
            return world.apply("pay", idempotency_key)

    def ask(state: Order) -> dict[str, Any]:
        return {"who": interrupt("who?"), "log": ["ask"]}

    def charge(state: Order) -> dict[str, Any]:
        if pay is not None:
            pay()
        return {"log": [f"charge {state['amount']}"]}

    def skip(state: Order) -> dict[str, Any]:
        return {"log": [f"skip {state['amount']}"]}

    builder = StateGraph(Order)
    for name, node in (("ask", ask), ("charge", charge), ("skip", skip)):
        builder.add_node(name, node)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "charge")
    builder.add_edge("charge", END)
    builder.add_edge("skip", END)
    return builder.compile(checkpointer=saver)


def twice(saver: Any) -> Any:
    """One node that asks two questions, then logs both answers."""

    def ask(state: Order) -> dict[str, Any]:
        first = interrupt("first?")
        second = interrupt("second?")
        return {"who": f"{first}+{second}", "log": [f"ask {state['amount']}"]}

    builder = StateGraph(Order)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


class Fan(TypedDict):
    n: int
    amount: int
    log: Annotated[list[str], operator.add]


def fan(saver: Any) -> Any:
    """Three Send branches; branches 0 and 1 ask."""

    def branch(state: dict[str, Any]) -> dict[str, Any]:
        who = interrupt(f"ok {state['i']}?") if state["i"] < 2 else "auto"
        return {"log": [f"{state['i']}:{who}"]}

    def out(state: Fan) -> list[Send]:
        return [Send("branch", {"i": i}) for i in range(state["n"])]

    builder = StateGraph(Fan)
    builder.add_node("branch", branch)
    builder.add_conditional_edges(START, out, ["branch"])
    builder.add_edge("branch", END)
    return builder.compile(checkpointer=saver)


START_ORDER: dict[str, Any] = {"amount": 1, "who": None, "log": []}
COMMAND = Command(resume="dan", update={"amount": 9, "log": ["update"]}, goto="skip")


def null_writes(saver: RemitSaver, cfg: dict[str, Any]) -> dict[str, Any]:
    """The null task's pending writes on the thread's head, by channel."""
    found = saver.get_tuple(cfg)
    assert found is not None
    return {c: v for t, c, v in found.pending_writes or () if t == NULL_TASK}


# -- what a kill leaves --------------------------------------------------------------


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_resumer_killed_after_the_consume_leaves_the_update_and_goto_stored(
    url: str, durability: str
) -> None:
    """Right after the consume (before any node ran, before LangGraph stored a write),
    the head holds the command's update and goto, and the interrupt is consumed."""
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = routed(saver), config()
        graph.invoke(START_ORDER, cfg, durability=durability)
        assert null_writes(saver, cfg) == {}

        def doomed() -> None:
            failpoints.arm("interrupt.after_consume", "kill")
            graph.invoke(COMMAND, cfg, durability=durability)

        killed(doomed)
        thread = cfg["configurable"]["thread_id"]
        assert [i.status for i in saver.remit.interrupts(thread)] == ["consumed"]
        held = null_writes(saver, cfg)
        assert held.get("amount") == 9 and held.get("log") == ["update"], held
        assert "branch:to:skip" in held, held
        out = graph.invoke(None, cfg, durability=durability)
        assert out["log"] == ["update", "ask", "skip 9", "charge 9"], out
        assert out["who"] == "dan"
    finally:
        saver.remit.close()


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_resumer_killed_inside_the_consume_leaves_neither(url: str, durability: str) -> None:
    """SIGKILL inside the consume's transaction: the interrupt is still pending and no
    write of the command is stored; the same command sent again runs it whole."""
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = routed(saver), config()
        graph.invoke(START_ORDER, cfg, durability=durability)

        def doomed() -> None:
            failpoints.arm("interrupt.in_consume", "kill")
            graph.invoke(COMMAND, cfg, durability=durability)

        killed(doomed)
        thread = cfg["configurable"]["thread_id"]
        assert [i.status for i in saver.remit.interrupts(thread)] == ["pending"]
        assert null_writes(saver, cfg) == {}
        out = graph.invoke(COMMAND, cfg, durability=durability)
        assert out["log"] == ["update", "ask", "skip 9", "charge 9"], out
    finally:
        saver.remit.close()


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_kill_after_the_charge_pays_once_and_applies_the_update_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The resumer dies right after the charge paid (in "exit" durability nothing of
    the run was stored by LangGraph): the recovery pays nothing again, and the update
    to the reducer key `log` is in the state once."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = routed(saver, world), config()
        graph.invoke(START_ORDER, cfg, durability=durability)

        def doomed() -> None:
            failpoints.arm("effect.after_outcome", "kill")
            graph.invoke(COMMAND, cfg, durability=durability)

        killed(doomed)
        assert len(world.applications("pay")) == 1
        out = graph.invoke(None, cfg, durability=durability)
        assert out["log"] == ["update", "ask", "skip 9", "charge 9"], out
        assert len(world.applications("pay")) == 1
    finally:
        saver.remit.close()


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_second_command_at_the_same_pause_is_numbered_after_the_first(
    url: str, durability: str
) -> None:
    """A node asks twice: each answer comes with an update. The second command's
    writes go on the checkpoint that holds the first's, after them; killed after its
    consume, the recovery has both updates (the second's not dropped as a slot the
    first took)."""
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = twice(saver), config()
        graph.invoke(START_ORDER, cfg, durability=durability)
        first = Command(resume="a", update={"amount": 2, "log": ["u1"]})
        out = graph.invoke(first, cfg, durability=durability)
        assert [i.value for i in out["__interrupt__"]] == ["second?"]
        # (Both commands' updates apply at this step: a second "amount" would be two
        # values for one key in a step, which LangGraph refuses.)
        second = Command(resume="b", update={"log": ["u2"]})

        def doomed() -> None:
            failpoints.arm("interrupt.after_consume", "kill")
            graph.invoke(second, cfg, durability=durability)

        killed(doomed)
        out = graph.invoke(None, cfg, durability=durability)
        assert out["who"] == "a+b", out
        assert out["amount"] == 2 and out["log"] == ["u1", "u2", "ask 2"], out
    finally:
        saver.remit.close()


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_map_by_id_with_an_update_killed_after_the_consume(url: str, durability: str) -> None:
    """Two Send branches ask; one is answered by id with an update, and its resumer
    dies after the consume. The recovery gives the branch its answer, applies the
    update once and asks the other branch alone."""
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fan(saver), config()
        out = graph.invoke({"n": 3, "amount": 1, "log": []}, cfg, durability=durability)
        ids = {i.value: i.id for i in out["__interrupt__"]}
        command = Command(resume={ids["ok 0?"]: "zoe"}, update={"amount": 7, "log": ["u"]})

        def doomed() -> None:
            failpoints.arm("interrupt.after_consume", "kill")
            graph.invoke(command, cfg, durability=durability)

        killed(doomed)
        out = graph.invoke(None, cfg, durability=durability)
        assert [i.value for i in out["__interrupt__"]] == ["ok 1?"]
        out = graph.invoke(Command(resume="xi"), cfg, durability=durability)
        assert out["amount"] == 7
        assert sorted(out["log"]) == sorted(["u", "0:zoe", "1:xi", "2:auto"]), out
        assert out["log"].count("u") == 1
    finally:
        saver.remit.close()


# -- unkilled, against LangGraph's own saver -----------------------------------------------


def _sequences() -> dict[str, tuple[Callable[[Any], Any], list[Callable[[Any], Any]]]]:
    """Per case: the graph, and the inputs in turn (each may read the last output)."""

    def by_id(question: str, value: str, **update: Any) -> Callable[[Any], Any]:
        def make(out: Any) -> Any:
            (asked,) = [i for i in out["__interrupt__"] if i.value == question]
            return Command(resume={asked.id: value}, update=update)

        return make

    return {
        "routed": (routed, [lambda _: START_ORDER, lambda _: COMMAND]),
        "twice": (
            twice,
            [
                lambda _: START_ORDER,
                lambda _: Command(resume="a", update={"amount": 2, "log": ["u1"]}),
                lambda _: Command(resume="b", update={"log": ["u2"]}, goto="ask"),
            ],
        ),
        "fan": (
            fan,
            [
                lambda _: {"n": 3, "amount": 1, "log": []},
                by_id("ok 0?", "zoe", amount=4, log=["u1"]),
                by_id("ok 1?", "xi", log=["u2"]),
            ],
        ),
    }


@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("case", ["routed", "twice", "fan"])
def test_unkilled_commands_end_as_with_langgraphs_own_saver(
    url: str, tmp_path: Path, case: str, durability: str
) -> None:
    """Each output, the final state and the pending tasks match SqliteSaver's."""
    build, inputs = _sequences()[case]
    conn = sqlite3.connect(tmp_path / "own.db", check_same_thread=False)
    saver = RemitSaver(url, lease=LEASE)
    try:
        runs = []
        for chosen in (SqliteSaver(conn), saver):
            graph, cfg = build(chosen), config()
            outs: list[Any] = []
            last = None
            for make in inputs:
                last = graph.invoke(make(last), cfg, durability=durability)
                outs.append({k: v for k, v in last.items() if k != "__interrupt__"})
            state = graph.get_state(cfg)
            runs.append((outs, state.values, state.next))
        assert runs[1] == runs[0]
    finally:
        saver.remit.close()
        conn.close()


# -- an answer refused inside a subgraph -------------------------------------------------


class Bounded(TypedDict, total=False):
    amount: Annotated[int, Ge(0)]
    who: str
    log: Annotated[list[str], operator.add]


def nested_asker(saver: Any) -> Any:
    """A subgraph (added as a node) whose node asks who, then the amount, and writes
    the amount to a key that must be >= 0."""

    def ask(state: Bounded) -> dict[str, Any]:
        who = interrupt("who?")
        return {"who": who, "amount": interrupt("amount?"), "log": [f"by {who}"]}

    inner = StateGraph(Bounded)
    inner.add_node("ask", ask)
    inner.add_edge(START, "ask")
    inner.add_edge("ask", END)
    builder = StateGraph(Bounded)
    builder.add_node("sub", inner.compile())
    builder.add_edge(START, "sub")
    builder.add_edge("sub", END)
    return builder.compile(checkpointer=saver)


def test_an_answer_refused_inside_a_subgraph_keeps_the_earlier_one(url: str) -> None:
    """The subgraph's node had its first answer; the second leads it to an output the
    schema refuses (`CheckpointInvalid`). The question is asked again (not refused as
    consumed), the next answer is taken, and the first answer stands."""
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = nested_asker(saver), config()
        graph.invoke({"amount": 0, "log": []}, cfg)
        out = graph.invoke(Command(resume="ada"), cfg)
        assert [i.value for i in out["__interrupt__"]] == ["amount?"]
        with pytest.raises(CheckpointInvalid, match="amount"):
            graph.invoke(Command(resume=-5), cfg)
        again = graph.invoke(None, cfg)
        assert [i.value for i in again["__interrupt__"]] == ["amount?"]
        out = graph.invoke(Command(resume=5), cfg)
        assert (out["who"], out["amount"], out["log"]) == ("ada", 5, ["by ada"])
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume=6), cfg)
    finally:
        saver.remit.close()


def test_racing_answers_after_a_refusal_inside_a_subgraph_take_one(url: str) -> None:
    """After the refusal, 4 processes answer at once: one proceeds, the others get
    `ResumeConflict`, and the state holds the winner's amount."""
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = nested_asker(saver), config()
        graph.invoke({"amount": 0, "log": []}, cfg)
        graph.invoke(Command(resume="ada"), cfg)
        with pytest.raises(CheckpointInvalid):
            graph.invoke(Command(resume=-5), cfg)
        outcomes = race_answers(graph, cfg, [1, 2, 3, 4])
        won = [out["amount"] for kind, out in outcomes if kind == "ok"]
        assert len(won) == 1 and sorted(k for k, _ in outcomes).count("conflict") == 3
        assert graph.get_state(cfg).values["amount"] == won[0]
    finally:
        saver.remit.close()
