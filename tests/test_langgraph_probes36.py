"""Round 36 probes of RemitSaver: a reducer key whose type bounds its whole value
(`Annotated[int, Ge(0), operator.add]`, a stock that nodes take from). A write to it
was checked alone, against the key's type without its bounds, so a node's output,
two parallel outputs together, a `Command(update=...)` or a new input that took the
key below its bound was stored; the next checkpoint was then refused, and every later
`invoke(None, config)` applied the stored write again and was refused again: the
thread could not go on (and a resume value sent with such an update was consumed).
Such a write is now refused as it is made, by the value it would give the key, with
nothing of it stored, and the thread goes on from its last valid checkpoint. Real
LangGraph, real stores on every engine."""

from __future__ import annotations

import asyncio
import operator
import uuid
from typing import Annotated, Any

import pytest
from annotated_types import Ge, MaxLen
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid
from remit_langgraph import RemitSaver


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}


class Stock(TypedDict):
    stock: Annotated[int, Ge(0), operator.add]
    order: int
    log: Annotated[list[str], operator.add]


def take(name: str) -> Any:
    def node(state: Stock) -> dict[str, Any]:
        return {"stock": -state["order"], "log": [name]}

    return node


def line(saver: RemitSaver) -> Any:
    """take -> restock: `take` subtracts the order from the stock."""
    builder = StateGraph(Stock)
    builder.add_node("take", take("take"))
    builder.add_node("restock", lambda state: {"stock": 1, "log": ["restock"]})
    builder.add_edge(START, "take")
    builder.add_edge("take", "restock")
    builder.add_edge("restock", END)
    return builder.compile(checkpointer=saver)


def refused_stock(error: pytest.ExceptionInfo[CheckpointInvalid]) -> None:
    assert error.value.field == "stock"
    assert "would make its value" in str(error.value)


@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_node_output_that_takes_a_bounded_key_below_its_bound_is_refused_as_made(
    url: str, durability: str, api: str
) -> None:
    """5 in stock, an order of 10: the node's -10 is valid alone but makes -5. It is
    refused as the node returns it, the head stays at 5 with `take` next, and once
    the order is edited the thread goes on (it was stuck: the write was stored and
    every later run re-applied it and was refused)."""
    graph = line(RemitSaver(url))
    cfg = config()

    def run(given: Any) -> Any:
        if api == "async":
            return asyncio.run(graph.ainvoke(given, cfg, durability=durability))
        return graph.invoke(given, cfg, durability=durability)

    with pytest.raises(CheckpointInvalid) as error:
        run({"stock": 5, "order": 10, "log": []})
    refused_stock(error)
    state = graph.get_state(cfg)
    assert state.values == {"stock": 5, "order": 10, "log": []}
    assert state.next == ("take",)
    with pytest.raises(CheckpointInvalid):
        run(None)  # the same output again: refused again, still nothing stored
    assert graph.get_state(cfg).values["stock"] == 5
    graph.update_state(cfg, {"order": 4})
    out = run(None)
    assert out == {"stock": 2, "order": 4, "log": ["take", "restock"]}
    assert all(s.values.get("stock", 0) >= 0 for s in graph.get_state_history(cfg))


def test_parallel_outputs_valid_alone_but_not_together_store_only_the_first(url: str) -> None:
    """Two branches each take 3 of 5: the second output to come makes -1 and is
    refused; the first is kept (it is not run again), the stored state stays valid."""
    builder = StateGraph(Stock)
    builder.add_node("a", take("a"))
    builder.add_node("b", take("b"))
    builder.add_edge(START, "a")
    builder.add_edge(START, "b")
    builder.add_edge("a", END)
    builder.add_edge("b", END)
    graph = builder.compile(checkpointer=RemitSaver(url))
    cfg = config()
    with pytest.raises(CheckpointInvalid) as error:
        graph.invoke({"stock": 5, "order": 3, "log": []}, cfg, durability="sync")
    refused_stock(error)
    state = graph.get_state(cfg)
    assert state.values["stock"] == 2 and len(state.values["log"]) == 1
    assert len(state.next) == 1 and state.next[0] not in state.values["log"]
    with pytest.raises(CheckpointInvalid):
        graph.invoke(None, cfg)
    graph.update_state(cfg, {"order": 1})  # (an edit runs the step's tasks again)
    assert graph.invoke(None, cfg)["stock"] == 3


def asking(saver: RemitSaver) -> Any:
    builder = StateGraph(Stock)
    builder.add_node("ask", lambda state: {"log": [f"ask:{interrupt('how many?')}"]})
    builder.add_node("take", take("take"))
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "take")
    builder.add_edge("take", END)
    return builder.compile(checkpointer=saver)


def test_a_command_update_below_the_bound_is_refused_before_its_value_is_consumed(
    url: str,
) -> None:
    """`Command(resume=..., update={"stock": -10})` at 5 in stock: refused before its
    value is consumed (the interrupt stays pending, nothing is stored); a valid
    command then answers it once and the thread goes on."""
    graph = asking(RemitSaver(url))
    cfg = config()
    graph.invoke({"stock": 5, "order": 0, "log": []}, cfg)
    pending = graph.get_state(cfg).interrupts
    with pytest.raises(CheckpointInvalid) as error:
        graph.invoke(Command(resume="ten", update={"stock": -10}), cfg)
    refused_stock(error)
    state = graph.get_state(cfg)
    assert state.values == {"stock": 5, "order": 0, "log": []}
    assert state.next == ("ask",) and state.interrupts == pending
    out = graph.invoke(Command(resume="two", update={"stock": -2, "order": 1}), cfg)
    assert out == {"stock": 2, "order": 1, "log": ["ask:two", "take"]}


def test_a_new_input_below_the_bound_is_refused_and_the_thread_keeps_its_state(
    url: str,
) -> None:
    """A finished thread at 4 in stock given `{"stock": -10}` as new input: refused,
    nothing stored; a valid input after it runs from the state as it was."""
    graph = line(RemitSaver(url))
    cfg = config()
    assert graph.invoke({"stock": 5, "order": 2, "log": []}, cfg)["stock"] == 4
    with pytest.raises(CheckpointInvalid) as error:
        graph.invoke({"stock": -10}, cfg)
    refused_stock(error)
    assert graph.get_state(cfg).values["stock"] == 4 and graph.get_state(cfg).next == ()
    assert graph.invoke({"stock": 1, "order": 5}, cfg)["stock"] == 1


def extend(into: list[str], more: list[str]) -> list[str]:
    """A reducer that changes its first argument in place."""
    into.extend(more)
    return into


class Bag(TypedDict):
    items: Annotated[list[str], MaxLen(3), extend]


def test_a_bounded_key_whose_reducer_changes_its_value_in_place_gets_each_write_once(
    url: str,
) -> None:
    """The check of a bounded key applies a write to a copy of its value: a reducer
    that extends its first argument in place leaves the run's value as LangGraph's own
    saver leaves it (each write once), and the write past the bound is refused."""

    def run(saver: Any, first: list[str]) -> Any:
        builder = StateGraph(Bag)
        builder.add_node("a", lambda state: {"items": ["a"]})
        builder.add_node("b", lambda state: {"items": ["b"]})
        builder.add_edge(START, "a")
        builder.add_edge("a", "b")
        builder.add_edge("b", END)
        graph = builder.compile(checkpointer=saver)
        return graph.invoke({"items": first}, config())

    assert run(RemitSaver(url), ["s"]) == run(InMemorySaver(), ["s"]) == {"items": ["s", "a", "b"]}
    with pytest.raises(CheckpointInvalid) as error:
        run(RemitSaver(url), ["s", "t"])
    assert error.value.field == "items"


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_a_new_threads_input_below_the_bound_stores_nothing(url: str, durability: str) -> None:
    """`{"stock": -5}` as a new thread's first input: refused before the input checkpoint
    is stored (the thread stays empty, with no `__start__` task left that would refuse
    every `invoke(None)`); a valid first input then runs as on a new thread."""
    graph = line(RemitSaver(url))
    cfg = config()
    with pytest.raises(CheckpointInvalid) as error:
        graph.invoke({"stock": -5, "order": 1, "log": []}, cfg, durability=durability)
    refused_stock(error)
    assert list(graph.get_state_history(cfg)) == []
    out = graph.invoke({"stock": 5, "order": 2, "log": []}, cfg, durability=durability)
    assert out == {"stock": 4, "order": 2, "log": ["take", "restock"]}
