"""Round 27 probes of RemitSaver: long and heavy threads. A thread whose state holds
MB-sized values must not leave every version it ever wrote in the saver's memory; a
thread with hundreds of pauses must not make each resume read its whole history; and
`prune(keep_latest)` must leave a pause edited with `update_state` answerable, as it was
before the prune. Real LangGraph, real stores on every engine."""

from __future__ import annotations

import gc
import operator
import tracemalloc
import uuid
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_langgraph import RemitSaver


def _config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"p27-{uuid.uuid4().hex}"}, "recursion_limit": 1000}


class Heavy(TypedDict):
    n: int
    blob: str


_STEPS = 64
_MB = 1_000_000


def test_a_thread_of_mb_sized_values_keeps_a_bounded_cache_not_every_version(url: str) -> None:
    """A node that writes a new 1 MB value at each of 64 steps: the saver kept every
    version it wrote in its blob cache (bounded by entries only, 4096 of them), so a
    thread of a 1 MB state held 64 MB after its run, and a server of such threads
    grew without bound. The cache now keeps a byte budget; the state still reads back
    whole, from this saver and from a fresh one."""

    def step(state: Heavy) -> dict[str, Any]:
        return {"n": state["n"] + 1, "blob": f"{state['n']:08d}" * (_MB // 8)}

    builder = StateGraph(Heavy)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_conditional_edges("step", lambda s: "step" if s["n"] < _STEPS else END)
    saver = RemitSaver(url)
    graph = builder.compile(checkpointer=saver)
    cfg = _config()
    tracemalloc.start()
    try:
        graph.invoke({"n": 0, "blob": ""}, cfg)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 44 * _MB, f"the saver holds {held / _MB:.0f} MB after the run"
    last = f"{_STEPS - 1:08d}" * (_MB // 8)
    assert graph.get_state(cfg).values == {"n": _STEPS, "blob": last}
    fresh = RemitSaver(url).get_tuple(cfg)
    assert fresh is not None and fresh.checkpoint["channel_values"]["blob"] == last


class Asked(TypedDict):
    n: int
    log: Annotated[list[str], operator.add]


def _asking_graph(saver: RemitSaver, entered: list[str], rounds: int = 1) -> Any:
    """prepare -> ask (interrupt) -> tick -> ask ... `rounds` times -> end."""

    def prepare(state: Asked) -> dict[str, Any]:
        entered.append("prepare")
        return {"log": ["prepare"]}

    def ask(state: Asked) -> dict[str, Any]:
        entered.append("ask")
        return {"n": state["n"] + 1, "log": [f"ask:{interrupt('ok?')}:{state['n']}"]}

    builder = StateGraph(Asked)
    builder.add_node("prepare", prepare)
    builder.add_node("ask", ask)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "ask")
    builder.add_conditional_edges("ask", lambda s: "ask" if s["n"] < rounds else END)
    return builder.compile(checkpointer=saver)


def test_keep_latest_leaves_a_pause_edited_with_update_state_answerable(url: str) -> None:
    """Paused at `ask`, then `update_state` (the README: the next `Command(resume=v)`
    answers the edited pause, once). `prune(keep_latest)` deleted the paused checkpoint
    under the edit, where the pause's question is read: the resume was refused with
    "the thread is not paused", though `get_state` showed it waiting at `ask`."""
    entered: list[str] = []
    saver = RemitSaver(url)
    graph = _asking_graph(saver, entered)
    cfg = _config()
    graph.invoke({"n": 0, "log": []}, cfg)
    graph.update_state(cfg, {"n": 5})
    saver.prune([cfg["configurable"]["thread_id"]])
    assert graph.get_state(cfg).next == ("ask",)

    done = graph.invoke(Command(resume="alice"), cfg)
    assert done["log"] == ["prepare", "ask:alice:5"]
    assert entered == ["prepare", "ask", "ask"]
    # Pruned again once finished: only the head stays.
    saver.prune([cfg["configurable"]["thread_id"]])
    assert [s.values["log"] for s in graph.get_state_history(cfg)] == [done["log"]]


def test_a_resume_reads_no_more_checkpoints_after_hundreds_of_pauses(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each resume listed the thread's whole history (every namespace) to look for
    edits of paused subgraphs, so a thread's resumes cost more with every pause it had
    made: 52 checkpoints read at the 50th, 202 at the 200th. It now reads a page of
    what is newer than its head: the same at the 200th resume as at the 50th."""
    rounds = 200
    saver = RemitSaver(url)
    graph = _asking_graph(saver, [], rounds=rounds)
    cfg = _config()
    graph.invoke({"n": 0, "log": []}, cfg)
    read: list[int] = []
    store = saver.remit.store
    real = store.list_checkpoints

    def listing(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        read[-1] += len(found)
        return found

    monkeypatch.setattr(store, "list_checkpoints", listing)
    for i in range(rounds):
        read.append(0)
        graph.invoke(Command(resume=i), cfg)
    assert read[-1] == read[49], f"checkpoints read by resume 50: {read[49]}, by 200: {read[-1]}"
    assert graph.get_state(cfg).values["n"] == rounds
