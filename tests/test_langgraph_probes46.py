"""Round 46 of the LangGraph probes: an answer that leads the asking node to an output
the state schema refuses, as a user hits it with a plain `interrupt()` whose value the
node writes to a bounded key (`amount: Annotated[int, Ge(0)]`, answered with -5).

Found: the resumer got `CheckpointInvalid` (rejected, nothing of the output stored),
but the value stayed consumed and the node's answer stayed stored: `get_state` showed
the question pending, every next `Command(resume=v)` got `ResumeConflict` ("already
consumed"), and every `invoke(None, config)` handed the node the refused value again
and failed the same way (contract cell 21: rejected, but not pending and resumable).
Now such a refusal opens the question again, as a `response_schema` refusal does: the
task's error is stored (it shows in `get_state(config).tasks`), its answer is not, the
next answer is taken once, and `invoke(None, config)` asks again.

Also probed and held: a `GraphRecursionError` mid-run continued with `invoke(None)` in
every durability; a `retry_policy` node whose effect raised after it applied; a resume
map by an id no interrupt has; a `checkpoint_id` of another thread; a `copy_thread` of a
thread with a fork, each line of the copy answered once. Real LangGraph (beside its own
`InMemorySaver` where the answer is LangGraph's), real stores on every engine, real
forked processes racing behind a barrier."""

from __future__ import annotations

import asyncio
import operator
import sqlite3
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, RetryPolicy, interrupt
from test_langgraph_probes10 import race
from typing_extensions import TypedDict

import remit_core
from remit_core import NOT_APPLIED, CheckpointInvalid, EffectInDoubt, ResumeConflict
from remit_core.errors import UnknownRecord
from remit_langgraph import RemitSaver

DURABILITIES = ("sync", "async", "exit")


class Order(TypedDict, total=False):
    amount: Annotated[int, Ge(0)]
    log: Annotated[list[str], operator.add]


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg46-{uuid.uuid4().hex}"}}


class Sink:
    """Charges applied, counted in a SQLite file every process shares."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        with sqlite3.connect(self.path) as db:
            db.execute("CREATE TABLE IF NOT EXISTS applied (key TEXT, amount INTEGER)")

    def apply(self, key: str, amount: int) -> int:
        with sqlite3.connect(self.path) as db:
            db.execute("INSERT INTO applied VALUES (?, ?)", (key, amount))
        return amount

    def amounts(self) -> list[int]:
        with sqlite3.connect(self.path) as db:
            return [a for (a,) in db.execute("SELECT amount FROM applied")]


def ordering(saver: Any, sink: Sink, *, asks: int = 1) -> Any:
    """ask (its last answer is the amount, which the schema bounds) -> charge (effect)."""

    @remit_core.effect(name="charge", idempotent=True)
    def charge(amount: int, *, idempotency_key: str) -> int:
        return sink.apply(idempotency_key, amount)

    def ask(state: Order) -> dict[str, Any]:
        answers = [interrupt(f"question {n}") for n in range(asks)]
        return {"amount": answers[-1], "log": [f"ask:{answers}"]}

    def pay(state: Order) -> dict[str, Any]:
        return {"log": [f"charged:{charge(state['amount'])}"]}

    builder = StateGraph(Order)
    builder.add_node("ask", ask)
    builder.add_node("pay", pay)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "pay")
    builder.add_edge("pay", END)
    return builder.compile(checkpointer=saver)


def outcome(fn: Callable[[], Any]) -> Any:
    """What `fn` returned (its log and open questions), or its error's class name."""
    try:
        out = fn()
    except Exception as exc:  # the class is the outcome the contract names
        return type(exc).__name__
    return (out.get("log"), [i.value for i in out.get("__interrupt__", ())])


# -- an answer whose output the schema refuses --------------------------------------------


@pytest.mark.parametrize("durability", DURABILITIES)
def test_an_answer_the_schema_refuses_leaves_the_question_answerable_once(
    url: str, durability: str, world: Path
) -> None:
    """-5 is refused with `CheckpointInvalid` naming the key; the question stays pending
    (the task shows the error), 7 answers it once, 8 is then refused; charged once."""
    sink = Sink(world)
    graph, cfg = ordering(RemitSaver(url), sink), config()
    graph.invoke({"amount": 0, "log": []}, cfg, durability=durability)
    with pytest.raises(CheckpointInvalid) as refused:
        graph.invoke(Command(resume=-5), cfg, durability=durability)
    assert refused.value.field == "amount"
    state = graph.get_state(cfg)
    assert state.values == {"amount": 0, "log": []}
    assert state.next == ("ask",)
    assert [i.value for i in state.interrupts] == ["question 0"]
    assert "CheckpointInvalid" in str(state.tasks[0].error)
    out = graph.invoke(Command(resume=7), cfg, durability=durability)
    assert out == {"amount": 7, "log": ["ask:[7]", "charged:7"]}
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume=8), cfg, durability=durability)
    assert graph.get_state(cfg).values == out
    assert sink.amounts() == [7]


def test_continuing_after_a_refused_answer_asks_again(url: str, world: Path) -> None:
    """`invoke(None, config)` asks the question again (same id) instead of handing the
    node the refused value, from another saver too; then the answer goes through."""
    sink = Sink(world)
    graph, cfg = ordering(RemitSaver(url), sink), config()
    first = graph.invoke({"amount": 0, "log": []}, cfg)["__interrupt__"][0].id
    assert outcome(lambda: graph.invoke(Command(resume=-5), cfg)) == "CheckpointInvalid"
    again = ordering(RemitSaver(url), sink).invoke(None, cfg)
    assert [i.id for i in again["__interrupt__"]] == [first]
    assert outcome(lambda: graph.invoke(Command(resume={first: 3}), cfg)) == (
        ["ask:[3]", "charged:3"],
        [],
    )
    assert sink.amounts() == [3]


def test_refused_answers_in_turn_then_one_taken_async(url: str, world: Path) -> None:
    """Two refused answers in turn, through `ainvoke`, then a good one: each refusal
    opens the question again, the good one is taken once."""
    sink = Sink(world)
    graph, cfg = ordering(RemitSaver(url), sink), config()

    async def main() -> list[Any]:
        await graph.ainvoke({"amount": 0, "log": []}, cfg)
        got = []
        for value in (-1, -2, 4, 5):
            try:
                out = await graph.ainvoke(Command(resume=value), cfg)
                got.append(out["log"])
            except Exception as exc:  # the class is the outcome the contract names
                got.append(type(exc).__name__)
        return got

    assert asyncio.run(main()) == [
        "CheckpointInvalid",
        "CheckpointInvalid",
        ["ask:[4]", "charged:4"],
        "ResumeConflict",
    ]
    assert sink.amounts() == [4]


def test_a_refused_second_answer_keeps_the_first(url: str, world: Path) -> None:
    """A node with two questions: the first answer stays the node's, the refused second
    one is asked again and answered; the first question is not asked again."""
    sink = Sink(world)
    graph, cfg = ordering(RemitSaver(url), sink, asks=2), config()
    graph.invoke({"amount": 0, "log": []}, cfg)
    assert outcome(lambda: graph.invoke(Command(resume=1), cfg)) == ([], ["question 1"])
    assert outcome(lambda: graph.invoke(Command(resume=-9), cfg)) == "CheckpointInvalid"
    assert [i.value for i in graph.get_state(cfg).interrupts] == ["question 1"]
    assert outcome(lambda: graph.invoke(Command(resume=9), cfg)) == (
        ["ask:[1, 9]", "charged:9"],
        [],
    )
    assert sink.amounts() == [9]


def test_a_refused_answer_beside_a_taken_one_in_a_map(url: str) -> None:
    """Two nodes ask at once and a map answers both: the refused one is asked again,
    the other one's answer stays taken (a map naming it again is refused)."""

    class Two(TypedDict, total=False):
        a: Annotated[int, Ge(0)]
        b: Annotated[int, Ge(0)]

    builder = StateGraph(Two)
    builder.add_node("ask_a", lambda s: {"a": interrupt("a?")})
    builder.add_node("ask_b", lambda s: {"b": interrupt("b?")})
    builder.add_edge(START, "ask_a")
    builder.add_edge(START, "ask_b")
    builder.add_edge("ask_a", END)
    builder.add_edge("ask_b", END)
    graph, cfg = builder.compile(checkpointer=RemitSaver(url)), config()
    ids = {i.value: i.id for i in graph.invoke({"a": 0, "b": 0}, cfg)["__interrupt__"]}
    with pytest.raises(CheckpointInvalid):
        graph.invoke(Command(resume={ids["a?"]: -1, ids["b?"]: 2}), cfg)
    assert [i.value for i in graph.get_state(cfg).interrupts] == ["a?"]
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume={ids["a?"]: 1, ids["b?"]: 3}), cfg)
    assert graph.invoke(Command(resume={ids["a?"]: 1}), cfg) == {"a": 1, "b": 2}


def test_racing_answers_after_a_refused_one(url: str, world: Path) -> None:
    """Four processes answer the reopened question at once, each with its own valid
    amount: exactly one proceeds, the others get `ResumeConflict`; charged once (P5)."""
    sink = Sink(world)
    graph, cfg = ordering(RemitSaver(url), sink), config()
    graph.invoke({"amount": 0, "log": []}, cfg)
    assert outcome(lambda: graph.invoke(Command(resume=-5), cfg)) == "CheckpointInvalid"
    amounts = [10, 20, 30, 40]

    def resume(i: int) -> Any:
        return ordering(RemitSaver(url), sink).invoke(Command(resume=amounts[i]), cfg)

    got = [o for _, _, o in race(len(amounts), resume, outcome)]
    won = [g for g in got if g != "ResumeConflict"]
    assert len(won) == 1, got
    assert len(sink.amounts()) == 1
    paid = sink.amounts()[0]
    assert won[0] == ([f"ask:[{paid}]", f"charged:{paid}"], [])
    assert graph.get_state(cfg).values == {"amount": paid, "log": won[0][0]}


def test_a_refused_output_of_a_node_that_asked_nothing_is_not_stored(url: str) -> None:
    """A node with no question whose output is refused stores no error (as before):
    the thread continues from its last valid checkpoint once the state is edited."""
    builder = StateGraph(Order)
    builder.add_node("bad", lambda s: {"amount": s["amount"] - 10})
    builder.add_edge(START, "bad")
    builder.add_edge("bad", END)
    graph, cfg = builder.compile(checkpointer=RemitSaver(url)), config()
    with pytest.raises(CheckpointInvalid):
        graph.invoke({"amount": 3, "log": []}, cfg)
    state = graph.get_state(cfg)
    assert state.next == ("bad",) and state.tasks[0].error is None
    graph.update_state(cfg, {"amount": 12})
    assert graph.invoke(None, cfg) == {"amount": 2, "log": []}


def test_a_refused_answer_inside_a_subgraph(url: str) -> None:
    """The same question asked by a subgraph's node (a compiled graph added as a node):
    the refusal is `CheckpointInvalid`, and the next answer is taken (it was refused as
    consumed before round 50)."""
    inner = StateGraph(Order)
    inner.add_node("ask", lambda s: {"amount": interrupt("amount?")})
    inner.add_edge(START, "ask")
    inner.add_edge("ask", END)
    builder = StateGraph(Order)
    builder.add_node("sub", inner.compile())
    builder.add_edge(START, "sub")
    builder.add_edge("sub", END)
    graph, cfg = builder.compile(checkpointer=RemitSaver(url)), config()
    graph.invoke({"amount": 0, "log": []}, cfg)
    with pytest.raises(CheckpointInvalid):
        graph.invoke(Command(resume=-5), cfg)
    assert graph.invoke(Command(resume=5), cfg)["amount"] == 5


# -- what held -------------------------------------------------------------------------


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_recursion_limit_hit_mid_run_continues_where_it_stopped(
    url: str, durability: str
) -> None:
    """`GraphRecursionError` after 3 steps of a loop: the state is LangGraph's own
    saver's, and `invoke(None)` (another saver) finishes with each step's effect once."""
    applied: Counter[int] = Counter()

    @remit_core.effect(name="tick", idempotent=True)
    def tick(n: int) -> str:
        applied[n] += 1
        return f"t{n}"

    def looping(saver: Any, effect: bool) -> Any:
        builder = StateGraph(Order)
        builder.add_node(
            "step",
            lambda s: {
                "amount": s["amount"] + 1,
                "log": [tick(s["amount"]) if effect else f"t{s['amount']}"],
            },
        )
        builder.add_edge(START, "step")
        builder.add_conditional_edges("step", lambda s: END if s["amount"] >= 6 else "step")
        return builder.compile(checkpointer=saver)

    seen = []
    for graph, again in (
        (looping(InMemorySaver(), False), None),
        (looping(RemitSaver(url), True), looping(RemitSaver(url), True)),
    ):
        cfg = config()
        with pytest.raises(GraphRecursionError):
            graph.invoke(
                {"amount": 0, "log": []}, {**cfg, "recursion_limit": 3}, durability=durability
            )
        state = graph.get_state(cfg)
        done = (again or graph).invoke(None, cfg, durability=durability)
        seen.append((state.values, state.next, done))
    assert seen[0] == seen[1]
    assert seen[1][0] == {"amount": 3, "log": ["t0", "t1", "t2"]}
    assert applied == Counter(range(6))


@pytest.mark.parametrize("declared", ["reconcile", "idempotent", "neither"])
def test_a_retried_node_whose_effect_raised_after_applying(url: str, declared: str) -> None:
    """The payment API charges, then times out; the node's `retry_policy` runs it again:
    with `reconcile=` the charge is found and not re-sent, with `idempotent=True` it is
    re-sent under the same key, with neither it is `EffectInDoubt` (P2)."""
    payments: dict[str, int] = {}
    sent: list[str] = []
    options: dict[str, Any] = {
        "reconcile": {"reconcile": lambda key: payments.get(key, NOT_APPLIED)},
        "idempotent": {"idempotent": True},
        "neither": {},
    }[declared]

    @remit_core.effect(name="pay", **options)
    def pay(amount: int, *, idempotency_key: str) -> int:
        sent.append(idempotency_key)
        payments.setdefault(idempotency_key, amount)
        if len(sent) == 1:
            raise TimeoutError("the gateway timed out after charging")
        return payments[idempotency_key]

    policy = RetryPolicy(retry_on=TimeoutError, initial_interval=0.01, jitter=False)
    builder = StateGraph(Order)
    builder.add_node("pay", lambda s: {"log": [f"paid:{pay(42)}"]}, retry_policy=policy)
    builder.add_edge(START, "pay")
    builder.add_edge("pay", END)
    graph, cfg = builder.compile(checkpointer=RemitSaver(url)), config()
    if declared == "neither":
        with pytest.raises(EffectInDoubt):
            graph.invoke({"log": []}, cfg)
    else:
        assert graph.invoke({"log": []}, cfg) == {"log": ["paid:42"]}
    assert len(payments) == 1 and len(set(sent)) == 1
    assert len(sent) == {"reconcile": 1, "idempotent": 2, "neither": 1}[declared]


def test_a_resume_map_by_an_unknown_interrupt_id_consumes_nothing(url: str) -> None:
    """A map naming an id no interrupt has (alone, or beside a real one) raises
    `UnknownRecord` naming it; both questions stay pending and are answered after."""
    builder = StateGraph(Order)
    builder.add_node("a", lambda s: {"log": [f"a:{interrupt('a?')}"]})
    builder.add_node("b", lambda s: {"log": [f"b:{interrupt('b?')}"]})
    builder.add_edge(START, "a")
    builder.add_edge(START, "b")
    builder.add_edge("a", END)
    builder.add_edge("b", END)
    graph, cfg = builder.compile(checkpointer=RemitSaver(url)), config()
    ids = [i.id for i in graph.invoke({"log": []}, cfg)["__interrupt__"]]
    bogus = "0" * 32
    for resume in ({bogus: "x"}, {ids[0]: "x", bogus: "y"}):
        with pytest.raises(UnknownRecord) as unknown:
            graph.invoke(Command(resume=resume), cfg)
        assert unknown.value.interrupt_id == bogus
        assert sorted(i.id for i in graph.get_state(cfg).interrupts) == sorted(ids)
    out = graph.invoke(Command(resume=dict.fromkeys(ids, "ok")), cfg)
    assert sorted(out["log"]) == ["a:ok", "b:ok"]


def test_a_checkpoint_id_of_another_thread(url: str) -> None:
    """Another thread's `checkpoint_id`: a run or a resume with it is `UnknownRecord`,
    nothing stored; a state read gives what LangGraph's own saver gives (nothing)."""

    def asking(saver: Any) -> Any:
        builder = StateGraph(Order)
        builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('ok?')}"]})
        builder.add_edge(START, "ask")
        builder.add_edge("ask", END)
        return builder.compile(checkpointer=saver)

    reads = []
    for saver in (InMemorySaver(), RemitSaver(url)):
        graph, mine, other = asking(saver), config(), config()
        graph.invoke({"log": []}, mine)
        graph.invoke({"log": []}, other)
        theirs = graph.get_state(other).config["configurable"]["checkpoint_id"]
        wrong = {"configurable": {**mine["configurable"], "checkpoint_id": theirs}}
        state = graph.get_state(wrong)
        reads.append((state.values, state.next, list(graph.get_state_history(wrong))))
        if isinstance(saver, RemitSaver):
            for command in (None, Command(resume="x")):
                with pytest.raises(UnknownRecord):
                    graph.invoke(command, wrong)
            assert graph.invoke(Command(resume="y"), mine) == {"log": ["ask:y"]}
            assert graph.invoke(Command(resume="z"), other) == {"log": ["ask:z"]}
    assert reads[0] == reads[1] == ({}, (), [])


def test_a_copy_of_a_thread_with_a_fork_answers_each_line_once(url: str, world: Path) -> None:
    """`copy_thread` of a paused thread with a paused fork: the copy's main line and
    its fork (by token) each take one answer; the source's lines are untouched."""
    sink = Sink(world)
    saver = RemitSaver(url)
    graph, cfg = ordering(saver, sink), config()
    graph.invoke({"amount": 0, "log": []}, cfg)
    paused = graph.get_state(cfg).config["configurable"]
    graph.invoke(None, {"configurable": {**paused, "fork_token": "f"}})
    source = cfg["configurable"]["thread_id"]
    copy = f"{source}-copy"
    saver.copy_thread(source, copy)
    lines = {
        "main": {"configurable": {"thread_id": copy}},
        "fork": {"configurable": {"thread_id": copy, "fork_token": "f"}},
    }
    for amount, line in enumerate(lines.values(), start=1):
        assert graph.get_state(line).next == ("ask",)
        assert graph.invoke(Command(resume=amount), line)["amount"] == amount
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume=99), line)
    assert graph.get_state(cfg).next == ("ask",)
    assert graph.get_state({"configurable": {**cfg["configurable"], "fork_token": "f"}}).next == (
        "ask",
    )
    assert sorted(sink.amounts()) == [1, 2]
