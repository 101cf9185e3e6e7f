"""RemitSaver's `delete_for_runs` while the run it names is in flight, and the
interrupts an edited pause leaves behind. Real LangGraph, on every engine."""

from __future__ import annotations

import asyncio
import operator
import threading
import time
import uuid
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_core import Fenced, ResumeConflict
from remit_langgraph import RemitSaver


def config(thread: str | None = None, **more: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or f"lg-{uuid.uuid4().hex}", **more}}


# -- delete_for_runs under a running run --------------------------------------------------


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def blocking(saver: RemitSaver, entered: threading.Event, leave: threading.Event) -> Any:
    """a -> b (blocks until `leave`) -> c."""

    def slow(state: Log) -> dict[str, Any]:
        entered.set()
        leave.wait(60)
        return {"log": ["b"]}

    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", slow)
    builder.add_node("c", lambda s: {"log": ["c"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


def stored_writes(saver: RemitSaver, thread: str, checkpoint_ids: list[str]) -> list[Any]:
    return [w for c in checkpoint_ids for w in saver.remit.writes(thread, c)]


class ListedBeforeTheHead(RemitSaver):
    """A saver whose first listing of a run's checkpoints misses the thread's head, as
    one made just before the run's next commit landed does (in "async" durability a
    commit lands while the next node runs)."""

    stale = True

    def _written_by(self, thread: str, lg_run: str) -> dict[str, list[str]]:
        listed = super()._written_by(thread, lg_run)
        if self.stale:
            self.stale = False
            head = self.remit.store.get_head(thread, "", "main")
            assert head is not None and head.checkpoint_id in listed[""]
            listed[""].remove(head.checkpoint_id)
        return listed


@pytest.mark.parametrize("listing", [RemitSaver, ListedBeforeTheHead])
@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("call", ["delete_for_runs", "adelete_for_runs"])
def test_a_run_whose_checkpoints_are_deleted_under_it_stops_and_stores_nothing_more(
    url: str, durability: str, call: str, listing: type[RemitSaver]
) -> None:
    """The run's next commit was refused as a fork (`ForkWithoutIntent`: "pass a fork
    token"), though nothing was forked, and the blocked node's writes were stored on
    a checkpoint the delete had removed. The run now stops with `Fenced` naming the
    deleted run; nothing of it is left, the thread is back at the run before it, and
    goes on from there. So it does when the run's head landed after the delete
    listed the run's checkpoints (before: that run was not stopped, and finished on
    a thread whose earlier checkpoints of it were gone)."""
    entered, leave = threading.Event(), threading.Event()
    saver = listing(url)
    graph = blocking(saver, entered, leave)
    thread = f"lg-{uuid.uuid4().hex}"
    leave.set()
    assert graph.invoke({"log": ["one"]}, config(thread)) == {"log": ["one", "a", "b", "c"]}
    before = [
        s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(config(thread))
    ]
    entered.clear()
    leave.clear()
    doomed = str(uuid.uuid4())
    outcome: list[BaseException | dict[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(
                graph.invoke({"log": ["two"]}, config(thread, run_id=doomed), durability=durability)
            )
        except BaseException as exc:  # noqa: BLE001 (the outcome is asserted below)
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    try:
        assert entered.wait(60)
        # (in "async" durability the commits before the node may still be in flight)
        deadline = time.monotonic() + 60
        while not any(
            r.metadata.get("run_id") == doomed and r.metadata.get("source") == "loop"
            for r in saver.remit.history(thread)
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        written = [
            r.checkpoint_id
            for r in saver.remit.history(thread)
            if r.metadata.get("run_id") == doomed
        ]
        if call == "delete_for_runs":
            saver.delete_for_runs([doomed])
        else:
            asyncio.run(saver.adelete_for_runs([doomed]))
    finally:
        leave.set()
        runner.join(60)
    assert not runner.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], Fenced), outcome
    assert f"delete_for_runs deleted the checkpoints of LangGraph run {doomed!r}" in str(outcome[0])
    other = RemitSaver(url)  # (a new process: nothing cached)
    history = other.remit.history(thread)
    assert [r.checkpoint_id for r in history] == before
    assert all(r.metadata.get("run_id") != doomed for r in history)
    assert written and stored_writes(other, thread, written) == []
    assert blocking(other, entered, leave).get_state(config(thread)).values == {
        "log": ["one", "a", "b", "c"]
    }
    assert graph.invoke({"log": ["three"]}, config(thread)) == {
        "log": ["one", "a", "b", "c", "three", "a", "b", "c"]
    }


# -- the interrupts of an edited pause, asked again ---------------------------------------


class Ask(TypedDict, total=False):
    x: int
    ans: str


def asking(saver: Any) -> Any:
    builder = StateGraph(Ask)
    builder.add_node("ask", lambda s: {"ans": interrupt(f"ok {s['x']}?")})
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def surfaces(graph: Any, cfg: dict[str, Any]) -> list[Any]:
    """What a user sees of a thread's interrupts: now, by task, and by checkpoint."""
    state = graph.get_state(cfg)
    return [
        [i.value for i in state.interrupts],
        [[i.value for i in t.interrupts] for t in state.tasks],
        [
            (h.metadata.get("source"), [i.value for i in h.interrupts])
            for h in graph.get_state_history(cfg)
        ],
    ]


def test_an_edited_pause_asked_again_shows_only_its_new_interrupts_as_pending(url: str) -> None:
    """The first pause's interrupts stay pending in the store (`remit.interrupts`), but
    no LangGraph surface shows them as asked now: `get_state` and its tasks show the
    question asked again, history shows each on its own checkpoint, as LangGraph's own
    saver does; a resume by the old interrupt id is refused and stores nothing."""
    seen = []
    for saver in (InMemorySaver(), RemitSaver(url)):
        graph, cfg = asking(saver), config()
        graph.invoke({"x": 1}, cfg)
        old = graph.get_state(cfg).interrupts[0].id
        graph.update_state(cfg, {"x": 2})
        graph.invoke(None, cfg)
        seen.append(surfaces(graph, cfg))
        new = graph.get_state(cfg).interrupts[0].id
        assert new != old
    assert seen[1] == seen[0]
    assert seen[1][0] == ["ok 2?"] and seen[1][1] == [["ok 2?"]]
    head = graph.get_state(cfg).config["configurable"]["checkpoint_id"]
    with pytest.raises(ResumeConflict, match="earlier pause") as refused:
        graph.invoke(Command(resume={old: "yes"}), cfg)
    assert refused.value.interrupt_id == old
    assert graph.get_state(cfg).config["configurable"]["checkpoint_id"] == head
    assert surfaces(graph, cfg) == seen[1]
    assert graph.invoke(Command(resume={new: "yes"}), cfg) == {"x": 2, "ans": "yes"}
