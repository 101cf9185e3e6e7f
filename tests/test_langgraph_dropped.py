"""A run loop dropped without exiting (its `__enter__` failed after the run opened):
its claim is released, and the finalizer that notices takes no lock and makes no
round trip, since the garbage collector runs it wherever it runs, lock held or not."""

from __future__ import annotations

import gc
import threading
import uuid
from typing import Any

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from remit_langgraph import RemitSaver


class Count(TypedDict):
    n: int


class FailsAfterOpening(RemitSaver):
    """A saver whose run start fails after the run opened (its claim taken), as a
    failure later in LangGraph's `__enter__` would: the loop never unwinds."""

    failing = True

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        found = super().get_tuple(config)
        if self.failing:
            raise RuntimeError("run start failed after the claim")
        return found


def counter(saver: RemitSaver) -> Any:
    builder = StateGraph(Count)
    builder.add_node("add", lambda s: {"n": s["n"] + 1})
    builder.add_edge(START, "add")
    builder.add_edge("add", END)
    return builder.compile(checkpointer=saver)


def fail_once(graph: Any, cfg: dict[str, Any]) -> RuntimeError:
    """The run start's error; its traceback holds the loop until it is dropped."""
    with pytest.raises(RuntimeError) as err:
        graph.invoke({"n": 1}, cfg)
    return err.value


def test_a_dropped_loops_claim_is_released_by_the_next_run(store_url: str) -> None:
    saver = FailsAfterOpening(store_url)
    graph, cfg = counter(saver), {"configurable": {"thread_id": f"drop-{uuid.uuid4().hex}"}}
    fail_once(graph, cfg)  # (the loop goes with its error)
    gc.collect()
    saver.failing = False
    assert graph.invoke({"n": 1}, cfg) == {"n": 2}  # no ResumeConflict: released


def test_a_dropped_loops_finalizer_takes_no_lock_of_the_saver(store_url: str) -> None:
    """The garbage collector may run the finalizer in a thread that holds the saver's
    lock (it did, in a task write's lookup of its run): it must not wait for it."""
    saver = FailsAfterOpening(store_url)
    graph, cfg = counter(saver), {"configurable": {"thread_id": f"drop-{uuid.uuid4().hex}"}}
    error: RuntimeError | None = fail_once(graph, cfg)
    assert saver._runs._open  # (the loop is alive: its run is open)
    collected = threading.Event()

    def drop_holding_the_lock() -> None:
        nonlocal error
        with saver._runs._lock:
            error = None  # drops the loop: its finalizer runs here, in this thread
            gc.collect()
        collected.set()

    worker = threading.Thread(target=drop_holding_the_lock, daemon=True)
    worker.start()
    assert collected.wait(10), "the finalizer waited for a lock its own thread held"
    assert not saver._runs._open  # the dropped run is forgotten
    saver.failing = False
    assert graph.invoke({"n": 1}, cfg) == {"n": 2}


@pytest.mark.parametrize("lease", [3.0])  # (a beat at 1 s: room for a loaded machine)
def test_a_dropped_loops_claim_is_released_with_no_run_after_it(
    store_url: str, lease: float
) -> None:
    """With no later run in this process, the lease keeper releases it at its next beat
    (a third of the lease), before the lease runs out."""
    saver = FailsAfterOpening(store_url, lease=lease)
    graph, cfg = counter(saver), {"configurable": {"thread_id": f"drop-{uuid.uuid4().hex}"}}
    error = fail_once(graph, cfg)
    thread = cfg["configurable"]["thread_id"]
    claim = saver.remit.store.get_claim(thread, "main")
    assert claim is not None and claim.holder != ""
    del error  # drops the loop
    gc.collect()
    released = threading.Event()
    for _ in range(50):  # (a beat is lease / 3 = 1 s)
        current = saver.remit.store.get_claim(thread, "main")
        if current is not None and current.holder == "":
            released.set()
            break
        released.wait(0.05)
    assert released.is_set(), "the claim was not released by the lease keeper"
    assert saver.remit.clock() < claim.expires_at  # before its lease ran out
