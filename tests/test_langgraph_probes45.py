"""Round 45 of the LangGraph probes: two runs read in turn by one thread of code, as a
server that multiplexes the streams of several conversations in one worker does
(`zip(graph.stream(a), graph.stream(b))`, or `anext` on two `astream`s in one task).

Found: a stream is a generator, which runs in its consumer's context, so both runs
saw the mark of the run that started (or ended) last. An `@effect` in a node of the
other run raised "called outside a Remit step" (nothing applied, the run stopped),
and in "exit" durability the other run's final checkpoint was taken as a write from
outside any run. Now a run is found from what LangGraph hands the saver and the
node (its loop, its task's config), not only from the context: each run keeps its
own steps, effects and checkpoints, in every durability, with subgraphs, sync and
async. Real LangGraph, real stores on every engine."""

from __future__ import annotations

import asyncio
import operator
import uuid
from collections import Counter
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

import remit_core
from remit_core import CheckpointInvalid
from remit_langgraph import RemitSaver


class Trail(TypedDict, total=False):
    who: str
    trail: Annotated[list[str], operator.add]


def charging(applied: Counter[tuple[str, str]]) -> Any:
    @remit_core.effect(name="charge", idempotent=True)
    def charge(who: str, step: str) -> str:
        applied[(who, step)] += 1
        return f"{who}:{step}"

    return charge


def line(saver: Any, applied: Counter[tuple[str, str]], names: str = "abc") -> Any:
    """One node per name, in a line; each charges once for its step."""
    charge = charging(applied)
    builder = StateGraph(Trail)
    for name in names:
        builder.add_node(name, lambda state, name=name: {"trail": [charge(state["who"], name)]})
    builder.add_edge(START, names[0])
    for a, b in zip(names, names[1:], strict=False):
        builder.add_edge(a, b)
    builder.add_edge(names[-1], END)
    return builder.compile(checkpointer=saver)


def with_subgraph(saver: Any, applied: Counter[tuple[str, str]]) -> Any:
    """a -> sub (s1, s2: each charges) -> c; the subgraph inherits the checkpointer."""
    charge = charging(applied)
    sub = StateGraph(Trail)
    sub.add_node("s1", lambda state: {"trail": [charge(state["who"], "s1")]})
    sub.add_node("s2", lambda state: {"trail": [charge(state["who"], "s2")]})
    sub.add_edge(START, "s1")
    sub.add_edge("s1", "s2")
    sub.add_edge("s2", END)
    builder = StateGraph(Trail)
    builder.add_node("a", lambda state: {"trail": [charge(state["who"], "a")]})
    builder.add_node("sub", sub.compile())
    builder.add_node("c", lambda state: {"trail": [charge(state["who"], "c")]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "sub")
    builder.add_edge("sub", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


def config(who: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg45-{who}-{uuid.uuid4().hex}"}}


def in_turn(*streams: Any) -> list[tuple[int, Any]]:
    """Read `streams` one item at a time each, in turn, until all have ended."""
    seen: list[tuple[int, Any]] = []
    live = dict(enumerate(streams))
    while live:
        for i, stream in list(live.items()):
            try:
                seen.append((i, next(stream)))
            except StopIteration:
                del live[i]
    return seen


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
def test_two_streams_read_in_turn_keep_their_own_runs(url: str, durability: str) -> None:
    """Each run's nodes charge once each under its own run, both end, and each thread's
    state is its own run's alone; again on the same threads, nothing is charged twice."""
    applied: Counter[tuple[str, str]] = Counter()
    graph = line(RemitSaver(url), applied)
    one, two = config("one"), config("two")
    seen = in_turn(
        graph.stream({"who": "one", "trail": []}, one, durability=durability),
        graph.stream({"who": "two", "trail": []}, two, durability=durability),
    )
    assert [i for i, _ in seen] == [0, 1, 0, 1, 0, 1]
    assert graph.get_state(one).values == {"who": "one", "trail": ["one:a", "one:b", "one:c"]}
    assert graph.get_state(two).values == {"who": "two", "trail": ["two:a", "two:b", "two:c"]}
    assert applied == Counter({(w, s): 1 for w in ("one", "two") for s in "abc"})
    assert graph.get_state(one).next == ()
    assert graph.get_state(two).next == ()


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_a_stream_that_ends_first_leaves_the_other_its_run(url: str, durability: str) -> None:
    """A short run ending between two items of a longer one (its mark reset in the
    shared context) leaves the longer run its effects and checkpoints."""
    applied: Counter[tuple[str, str]] = Counter()
    saver = RemitSaver(url)
    short, long = line(saver, applied, "a"), line(saver, applied, "abcd")
    one, two = config("one"), config("two")
    in_turn(
        long.stream({"who": "long", "trail": []}, two, durability=durability),
        short.stream({"who": "short", "trail": []}, one, durability=durability),
    )
    assert long.get_state(two).values["trail"] == ["long:a", "long:b", "long:c", "long:d"]
    assert short.get_state(one).values["trail"] == ["short:a"]
    assert sum(applied.values()) == 5 and set(applied.values()) == {1}


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_subgraphs_of_two_streams_read_in_turn_nest_in_their_own_runs(
    url: str, durability: str
) -> None:
    """A subgraph's loop and its nodes' effects belong to the run whose node runs it."""
    applied: Counter[tuple[str, str]] = Counter()
    graph = with_subgraph(RemitSaver(url), applied)
    one, two = config("one"), config("two")
    in_turn(
        graph.stream({"who": "one", "trail": []}, one, durability=durability, subgraphs=True),
        graph.stream({"who": "two", "trail": []}, two, durability=durability, subgraphs=True),
    )
    # (The subgraph hands back the whole state: the parent's reducer adds "a" again.)
    for who, cfg in (("one", one), ("two", two)):
        assert graph.get_state(cfg).values["trail"] == [
            f"{who}:{s}" for s in ("a", "a", "s1", "s2", "c")
        ]
    assert applied == Counter({(w, s): 1 for w in ("one", "two") for s in ("a", "s1", "s2", "c")})


def test_two_astreams_read_in_turn_in_one_task_keep_their_own_runs(url: str) -> None:
    """The same with `astream`, both advanced by `anext` in one asyncio task."""
    applied: Counter[tuple[str, str]] = Counter()
    graph = line(RemitSaver(url), applied)
    one, two = config("one"), config("two")

    async def main() -> int:
        streams = [
            graph.astream({"who": "one", "trail": []}, one),
            graph.astream({"who": "two", "trail": []}, two),
        ]
        items, live = 0, list(streams)
        while live:
            for stream in list(live):
                try:
                    await anext(stream)
                    items += 1
                except StopAsyncIteration:
                    live.remove(stream)
        return items

    assert asyncio.run(main()) == 6
    assert graph.get_state(one).values["trail"] == ["one:a", "one:b", "one:c"]
    assert graph.get_state(two).values["trail"] == ["two:a", "two:b", "two:c"]
    assert applied == Counter({(w, s): 1 for w in ("one", "two") for s in "abc"})


def test_a_refused_output_in_one_stream_leaves_the_other_running(url: str) -> None:
    """An invalid output of one run fails that run alone (P4), read in turn with
    another whose steps all commit."""

    class Strict(TypedDict):
        n: int

    builder = StateGraph(Strict)
    builder.add_node("a", lambda s: {"n": s["n"] + 1})
    builder.add_node("b", lambda s: {"n": "x" if s["n"] == 101 else s["n"] + 1})
    builder.add_node("c", lambda s: {"n": s["n"] + 1})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    graph = builder.compile(checkpointer=RemitSaver(url))
    bad, good = config("bad"), config("good")
    streams = [graph.stream({"n": 100}, bad), graph.stream({"n": 0}, good)]
    assert next(streams[0]) == {"a": {"n": 101}}
    assert next(streams[1]) == {"a": {"n": 1}}
    with pytest.raises(CheckpointInvalid):
        next(streams[0])
    assert list(streams[1]) == [{"b": {"n": 2}}, {"c": {"n": 3}}]
    assert graph.get_state(good).values == {"n": 3}
    assert graph.get_state(bad).values == {"n": 101}
    assert graph.get_state(bad).next == ("b",)


def test_a_resume_read_in_turn_with_a_new_run_consumes_its_own_question(url: str) -> None:
    """A resumed run read in turn with a fresh run of the same graph: the answer goes
    to its own question, the fresh run asks its own, each effect once."""
    applied: Counter[tuple[str, str]] = Counter()
    charge = charging(applied)
    builder = StateGraph(Trail)
    builder.add_node("ask", lambda s: {"trail": [f"ok:{interrupt('pay?')}"]})
    builder.add_node("pay", lambda s: {"trail": [charge(s["who"], "pay")]})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "pay")
    builder.add_edge("pay", END)
    graph = builder.compile(checkpointer=RemitSaver(url))
    one, two = config("one"), config("two")
    list(graph.stream({"who": "one", "trail": []}, one))
    in_turn(
        graph.stream(Command(resume="yes"), one),
        graph.stream({"who": "two", "trail": []}, two),
    )
    assert graph.get_state(one).values["trail"] == ["ok:yes", "one:pay"]
    assert graph.get_state(two).next == ("ask",)
    assert applied == Counter({("one", "pay"): 1})


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_main_and_a_fork_of_one_thread_read_in_turn_keep_their_branches(
    url: str, durability: str
) -> None:
    """A paused thread's main line and a fork of its pause, answered and read in turn:
    each branch keeps its own answer, steps and effects (P3, P2)."""
    applied: Counter[tuple[str, str]] = Counter()
    charge = charging(applied)
    builder = StateGraph(Trail)
    builder.add_node("ask", lambda s: {"who": interrupt("who?")})
    for name in "abc":
        builder.add_node(name, lambda s, name=name: {"trail": [charge(s["who"], name)]})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    graph = builder.compile(checkpointer=RemitSaver(url))
    main = config("main")
    list(graph.stream({"trail": []}, main))
    paused = graph.get_state(main).config
    list(graph.stream(None, {"configurable": {**paused["configurable"], "fork_token": "f"}}))
    fork = {"configurable": {**main["configurable"], "fork_token": "f"}}
    assert graph.get_state(fork).next == ("ask",)
    in_turn(
        graph.stream(Command(resume="main"), main, durability=durability),
        graph.stream(Command(resume="fork"), fork, durability=durability),
    )
    assert graph.get_state(main).values["trail"] == ["main:a", "main:b", "main:c"]
    assert graph.get_state(fork).values["trail"] == ["fork:a", "fork:b", "fork:c"]
    assert applied == Counter({(w, s): 1 for w in ("main", "fork") for s in "abc"})
