"""A small LangGraph workflow for the RemitSaver contract tests (helpers, not tests).

prepare -> approve (interrupt) -> charge (effect "charge") -> notify, with a
journal of node entries and an effect sink in files under a folder, so that
forked processes share them. `World.point` SIGKILLs or SIGSTOPs the process at
a named place when armed.
"""

from __future__ import annotations

import operator
import os
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt
from typing_extensions import TypedDict

import remit_core


class State(TypedDict):
    amount: Annotated[int, Ge(0)]
    approved_by: str | None
    log: Annotated[list[str], operator.add]


INITIAL: State = {"amount": 0, "approved_by": None, "log": []}


class World:
    """Journal and effect sink as append-only files (atomic line appends across processes)."""

    def __init__(self, folder: Path) -> None:
        self.journal = Path(folder) / "journal.txt"
        self.sink = Path(folder) / "sink.txt"
        self.journal.touch()
        self.sink.touch()
        self.armed: dict[str, str] = {}

    def _append(self, path: Path, line: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def enter(self, step: str) -> None:
        self._append(self.journal, f"{os.getpid()} {step}")

    def entries(self, step: str | None = None) -> list[tuple[int, str]]:
        rows = [line.split(" ", 1) for line in self.journal.read_text().splitlines()]
        return [(int(pid), s) for pid, s in rows if step is None or s == step]

    def apply(self, name: str, key: str) -> str:
        self._append(self.sink, f"{name} {key}")
        return f"{name}-done"

    def applications(self, name: str) -> list[str]:
        return [ln for ln in self.sink.read_text().splitlines() if ln.startswith(name + " ")]

    def reconcile(self, name: str) -> Any:
        def happened(key: str) -> Any:
            return (
                f"{name}-done"
                if f"{name} {key}" in self.applications(name)
                else (remit_core.NOT_APPLIED)
            )

        return happened

    def point(self, name: str) -> None:
        action = self.armed.get(name)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            # Let this process's background writes finish first: a writer stopped
            # inside a SQLite transaction would hold the file lock for everyone.
            # Then stop at this thread (a process-directed SIGSTOP lets it run on).
            time.sleep(0.2)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def build(world: World, checkpointer: Any, *, amount: int = 100, asks: int = 1) -> Any:
    """The probe graph on `checkpointer`; approve asks `asks` times; prepare writes `amount`."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(*, idempotency_key: str) -> str:
        world.point("charge.in_effect")
        return world.apply("charge", idempotency_key)

    @remit_core.effect(name="notify", reconcile=world.reconcile("notify"))
    def send_notice(*, idempotency_key: str) -> str:
        return world.apply("notify", idempotency_key)

    def prepare(state: State) -> dict[str, Any]:
        world.enter("prepare")
        return {"amount": amount, "log": ["prepare"]}

    def approve(state: State) -> dict[str, Any]:
        world.enter("approve.top")
        values = [interrupt(f"approve #{i}", response_schema=str) for i in range(asks)]
        world.point("approve.answered")
        world.enter("approve")
        return {"approved_by": "+".join(values), "log": ["approve"]}

    def charge_step(state: State) -> dict[str, Any]:
        world.enter("charge")
        world.point("charge.before_effect")
        outcome = charge()
        world.point("charge.after_effect")
        return {"log": [outcome]}

    def notify(state: State) -> dict[str, Any]:
        world.enter("notify")
        return {"log": [send_notice()]}

    builder = StateGraph(State)
    for name, fn in (
        ("prepare", prepare),
        ("approve", approve),
        ("charge", charge_step),
        ("notify", notify),
    ):
        builder.add_node(name, fn)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "approve")
    builder.add_edge("approve", "charge")
    builder.add_edge("charge", "notify")
    builder.add_edge("notify", END)
    return builder.compile(checkpointer=checkpointer)


def race_answers(graph: Any, config: Any, values: list[Any]) -> list[tuple[str, Any]]:
    """Answer the thread's pause with each of `values` at once, one forked process
    each behind a barrier: ("ok", the run's output) or ("conflict", the value) per process."""
    import multiprocessing as mp

    from langgraph.types import Command

    from remit_core import ResumeConflict

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(values))
    results = ctx.Queue()

    def answer(value: Any) -> None:
        barrier.wait(30)
        try:
            results.put(("ok", graph.invoke(Command(resume=value), config)))
        except ResumeConflict:
            results.put(("conflict", value))

    procs = [ctx.Process(target=answer, args=(value,)) for value in values]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    return outcomes
