"""A task's interrupt write and the record Remit keeps of its question are two store
calls: a process SIGKILLed between them left a thread paused at a question (LangGraph
shows it) that every `Command(resume=...)` refused as "not paused at an interrupt()".
The resume now records the question before it consumes the value: it is answered once,
and a second value is refused (P5). Real LangGraph, real stores, a real killed process."""

from __future__ import annotations

import multiprocessing as mp
import operator
import os
import signal
import time
import uuid
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.serde.types import INTERRUPT
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_core import ResumeConflict
from remit_langgraph import RemitSaver
from remit_langgraph._runs import Runs

CTX = mp.get_context("fork")
LEASE = 1.0


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def asking(saver: RemitSaver) -> Any:
    """ask (interrupt) -> done."""

    def ask(state: Log) -> dict[str, list[str]]:
        return {"log": [f"ask:{interrupt('ok?')}"]}

    def done(state: Log) -> dict[str, list[str]]:
        return {"log": ["done"]}

    builder = StateGraph(Log)
    builder.add_node("ask", ask)
    builder.add_node("done", done)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "done")
    builder.add_edge("done", END)
    return builder.compile(checkpointer=saver)


def killed_before_the_record(url: str, cfg: dict[str, Any], durability: str) -> None:
    """In a forked process: run to the question and die once its write is stored,
    before Remit records it."""
    recorded = Runs.after_writes

    def die_first(
        self: Runs, run: Any, thread: str, ns: str, checkpoint_id: str, writes: Any
    ) -> None:
        if any(channel == INTERRUPT for channel, _ in writes):
            os.kill(os.getpid(), signal.SIGKILL)
        recorded(self, run, thread, ns, checkpoint_id, writes)

    Runs.after_writes = die_first  # type: ignore[method-assign]
    asking(RemitSaver(url, lease=LEASE)).invoke({"log": []}, cfg, durability=durability)


def test_a_question_a_killed_process_never_recorded_is_answered_once(url: str) -> None:
    """In "sync" durability the pause's checkpoint is stored before its task runs, so the
    kill leaves exactly the question's write without its record ("async" stores that
    checkpoint beside the task: the kill may come before it lands)."""
    durability = "sync"
    cfg = {"configurable": {"thread_id": f"lg41-{uuid.uuid4().hex}"}}
    proc = CTX.Process(target=killed_before_the_record, args=(url, cfg, durability))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.2)  # the dead process's claim runs out (L1)
    graph = asking(RemitSaver(url, lease=LEASE))
    paused = graph.get_state(cfg)
    assert paused.next == ("ask",)
    assert [i.value for i in paused.interrupts] == ["ok?"]
    out = graph.invoke(Command(resume="yes"), cfg, durability=durability)
    assert out["log"] == ["ask:yes", "done"]
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="no"), cfg, durability=durability)
    assert graph.get_state(cfg).values["log"] == ["ask:yes", "done"]
