"""Round 47 of the LangGraph probes: two runs read in turn by one thread of code
(`zip` of two `stream`s), one of which is taken over by another resumer.

Found: LangGraph asks the saver for each channel's next version between steps, and
the saver stops a run there whose write was refused or whose claim was taken over.
It found the run by the context's mark, which two streams read in turn share: the
run that started last. Once that run was taken over, the other run, innocent,
raised its `Fenced` at its own next step and stopped. Now the run asking is found
from LangGraph's loop that asks (the mark only when none is found): the run taken
over stops, the other ends with each effect once. Real LangGraph, real stores on
every engine."""

from __future__ import annotations

import asyncio
import operator
import threading
import time
import uuid
from collections import Counter
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

import remit_core
from remit_core import failpoints
from remit_core.errors import Fenced
from remit_core.records import MAIN_BRANCH
from remit_langgraph import RemitSaver


class Trail(TypedDict, total=False):
    who: str
    trail: Annotated[list[str], operator.add]


def config(who: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg47-{who}-{uuid.uuid4().hex}"}}


@pytest.fixture(autouse=True)
def _disarmed() -> Any:
    """No failpoint armed by a test outlives it."""
    yield
    failpoints.disarm()


def taking_over(url: str, saver: RemitSaver) -> Any:
    """A function that hands `thread`'s claim to another resumer (as one does once the
    first's lease ran out): the next write of `saver`'s run is refused. The run's
    writes in flight are stored first, and its later writes are slowed (until
    `refused` has seen one refused), so that the node's step is handed to the reader
    before the run hears of the takeover, however loaded the machine."""
    other = RemitSaver(url, lease=30.0)

    def take_over(thread: str) -> None:
        for run in [r for r in list(saver._runs._open.values()) if r.thread == thread]:
            run.settle()
        failpoints.arm("writes.before", "sleep:0.3")
        failpoints.arm("checkpoint.before_commit", "sleep:0.3")
        held = other.remit.store.get_claim(thread, MAIN_BRANCH)
        assert held is not None
        other.remit.store.release_claim(held)
        other.remit.claim(thread, MAIN_BRANCH, lease=30.0, heartbeat=False)

    return take_over


def line(saver: Any, applied: Counter[tuple[str, str]], hook: Any = None) -> Any:
    """Nodes a, b, c in a line, each charging once for its step; `hook(state, name)`
    runs in each node after its charge."""

    @remit_core.effect(name="charge", idempotent=True)
    def charge(who: str, step: str) -> str:
        applied[(who, step)] += 1
        return f"{who}:{step}"

    def node(name: str) -> Any:
        def run(state: Trail) -> dict[str, Any]:
            charged = charge(state["who"], name)
            if hook is not None:
                hook(state, name)
            return {"trail": [charged]}

        return run

    builder = StateGraph(Trail)
    for name in "abc":
        builder.add_node(name, node(name))
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


def one_taken_over(url: str) -> tuple[Any, RemitSaver, Counter[tuple[str, str]], Any, Any]:
    """The line graph, its saver, its charges, and the configs of runs `one` and `two`:
    `one` is taken over by another resumer in its node `a`, after its charge."""
    applied: Counter[tuple[str, str]] = Counter()
    saver = RemitSaver(url, lease=30.0)
    take_over = taking_over(url, saver)
    one, two = config("one"), config("two")

    def hook(state: Trail, name: str) -> None:
        if state["who"] == "one" and name == "a":
            take_over(one["configurable"]["thread_id"])

    return line(saver, applied, hook), saver, applied, one, two


def refused(saver: RemitSaver, thread: str, timeout: float = 10.0) -> None:
    """Wait until the open run on `thread` knows its write was refused."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            runs = [r for r in list(saver._runs._open.values()) if r.thread == thread]
            if runs and all(r.failed is not None for r in runs):
                return
            time.sleep(0.01)
    finally:
        failpoints.disarm()
    raise AssertionError(f"the run on {thread} was not refused within {timeout}s")


def test_a_run_taken_over_stops_alone_when_another_stream_is_read_in_turn(url: str) -> None:
    """Run `two` starts first, run `one` second (its mark is the context's). `one` is
    taken over in its first node (after its charge); its checkpoint after `a` is refused in the
    background ("async" durability). `two`, read next, goes on to its end with each
    of its effects once; `one` raises `Fenced` and stores nothing after the takeover."""
    graph, saver, applied, one, two = one_taken_over(url)
    victim = one["configurable"]["thread_id"]
    s_two = graph.stream({"who": "two", "trail": []}, two, durability="async")
    s_one = graph.stream({"who": "one", "trail": []}, one, durability="async")
    next(s_two)  # `two` starts: its mark is set
    next(s_one)  # `one` starts (its mark is now the context's), is taken over in `a`
    refused(saver, victim)
    rest = list(s_two)  # `two` reads on: its steps are its own
    assert len(rest) == 2
    with pytest.raises(Fenced):
        list(s_one)
    assert graph.get_state(two).values == {"who": "two", "trail": ["two:a", "two:b", "two:c"]}
    assert applied[("two", "a")] == applied[("two", "b")] == applied[("two", "c")] == 1
    assert ("one", "b") not in applied
    stored = saver.get_tuple(one)
    assert stored is None or "one:b" not in stored.checkpoint["channel_values"].get("trail", [])


def test_the_run_taken_over_still_stops_at_its_own_next_step(url: str) -> None:
    """The lookup does not spare the run taken over: read alone after the takeover,
    it stops before its next node runs (nothing charged for `b`)."""
    applied: Counter[tuple[str, str]] = Counter()
    saver = RemitSaver(url, lease=30.0)
    take_over = taking_over(url, saver)
    one = config("one")
    victim = one["configurable"]["thread_id"]
    taken = threading.Event()

    def hook(state: Trail, name: str) -> None:
        if name == "a" and not taken.is_set():
            taken.set()
            take_over(victim)

    graph = line(saver, applied, hook)
    stream = graph.stream({"who": "one", "trail": []}, one, durability="async")
    next(stream)
    refused(saver, victim)
    with pytest.raises(Fenced):
        list(stream)
    assert applied == Counter({("one", "a"): 1})


def test_async_streams_read_in_turn_in_one_task_stop_only_the_run_taken_over(url: str) -> None:
    """The same with `astream`s read by `anext` in one asyncio task."""
    graph, saver, applied, one, two = one_taken_over(url)

    async def main() -> None:
        s_two = graph.astream({"who": "two", "trail": []}, two, durability="async")
        s_one = graph.astream({"who": "one", "trail": []}, one, durability="async")
        await anext(s_two)
        await anext(s_one)
        await asyncio.to_thread(refused, saver, one["configurable"]["thread_id"])
        assert len([item async for item in s_two]) == 2
        with pytest.raises(Fenced):
            async for _ in s_one:
                pass

    asyncio.run(main())
    assert graph.get_state(two).values["trail"] == ["two:a", "two:b", "two:c"]
    assert sum(n for (who, _), n in applied.items() if who == "two") == 3
    assert ("one", "b") not in applied
