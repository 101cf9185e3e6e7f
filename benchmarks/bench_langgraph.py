"""RemitSaver against LangGraph's own savers on the same engine, side by side in one run.

Two workloads, each on SQLite (RemitSaver vs `SqliteSaver`) and PostgreSQL
(RemitSaver vs `PostgresSaver`):

  cycles: `put` of a checkpoint whose state is 10 chat messages (one channel,
          a new version each time, as a node appending to the chat does), then
          `get_tuple` of it; reported as cycles per second;
  invoke: one `invoke` of a 20-node linear graph (each node appends to a list),
          in each durability mode (`--invokes` of each, ten times as many in
          exit mode, whose invokes are a fifth as long and vary the most); reported in milliseconds.

The ratio is LangGraph's time over RemitSaver's: >= 1.0 means RemitSaver is at
least as fast while it enforces the contract (claims, fences, schema checks).
Measurements alternate between the two savers (cycles in blocks of 20,
invokes one by one, in the order A B B A) so that a machine whose speed
drifts slows both alike and neither always runs first; medians are
reported. Both SQLite savers run in WAL mode with each saver's default
`synchronous` setting (LangGraph's: SQLite's default FULL; Remit's: NORMAL,
which survives a killed process; pass `--sqlite-sync FULL` to run Remit with
FULL too).

    python benchmarks/bench_langgraph.py [--cycles 400] [--invokes 40]
        [--engines sqlite,postgresql] [--modes async,sync,exit] [--sqlite-sync NORMAL|FULL]

PostgreSQL comes from REMIT_BENCH_PG (default: the local test server). Every
thread this run writes is deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import operator
import os
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import BaseCheckpointSaver, empty_checkpoint
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from remit_langgraph import RemitSaver

PG_URL = os.environ.get("REMIT_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
BLOCK = 20
NODES = 20


def ten_messages() -> list[Any]:
    text = "lorem ipsum dolor sit amet " * 8
    return [
        (HumanMessage if i % 2 == 0 else AIMessage)(content=f"message {i}: {text}", id=f"m{i}")
        for i in range(10)
    ]


class Chat(TypedDict):
    messages: list[Any]


class Trail(TypedDict):
    trail: Annotated[list[str], operator.add]


def twenty_nodes(saver: BaseCheckpointSaver) -> Any:
    builder = StateGraph(Trail)
    names = [f"n{i:02d}" for i in range(NODES)]
    for name in names:
        builder.add_node(name, lambda state, name=name: {"trail": [name]})
    builder.add_edge(START, names[0])
    for a, b in zip(names, names[1:], strict=False):
        builder.add_edge(a, b)
    builder.add_edge(names[-1], END)
    return builder.compile(checkpointer=saver)


class Cycles:
    """put + get_tuple of a 10-message checkpoint on one thread."""

    def __init__(self, saver: BaseCheckpointSaver, threads: list[str]) -> None:
        self.saver = saver
        self.thread = f"bench-{uuid.uuid4().hex}"
        threads.append(self.thread)
        self.config: dict[str, Any] = {
            "configurable": {"thread_id": self.thread, "checkpoint_ns": ""}
        }
        self.messages = ten_messages()
        self.version: str | None = None

    def once(self) -> None:
        checkpoint = empty_checkpoint()
        self.version = self.saver.get_next_version(self.version, None)
        checkpoint["channel_values"] = {"messages": self.messages}
        checkpoint["channel_versions"] = {"messages": self.version}
        stored = self.saver.put(
            self.config, checkpoint, {"source": "loop", "step": 1}, {"messages": self.version}
        )
        assert self.saver.get_tuple(stored) is not None
        self.config = stored


class Invokes:
    """One invoke of the 20-node graph per call, each on a fresh thread."""

    def __init__(self, saver: BaseCheckpointSaver, durability: str, threads: list[str]) -> None:
        self.graph = twenty_nodes(saver)
        self.durability = durability
        self.threads = threads

    def once(self) -> None:
        thread = f"bench-{uuid.uuid4().hex}"
        self.threads.append(thread)
        out = self.graph.invoke(
            {"trail": []}, {"configurable": {"thread_id": thread}}, durability=self.durability
        )
        assert len(out["trail"]) == NODES


def alternate(
    ours: Callable[[], None], theirs: Callable[[], None], total: int, block: int
) -> tuple[list[float], list[float]]:
    """Per-call seconds of each side, measured in alternating blocks, in the order
    ours-theirs then theirs-ours (ABBA): neither side always runs first, in a
    process (and on caches) the other side has just used."""
    a: list[float] = []
    b: list[float] = []
    ours()
    theirs()  # warm both up
    sides = ((ours, a), (theirs, b))
    while len(a) < total:
        for fn, out in sides:
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        sides = sides[::-1]
    return a, b


@contextlib.contextmanager
def stock_saver(engine: str, folder: str) -> Iterator[BaseCheckpointSaver]:
    if engine == "sqlite":
        conn = sqlite3.connect(os.path.join(folder, "langgraph.db"), check_same_thread=False)
        saver = SqliteSaver(conn)
        saver.setup()
        try:
            yield saver
        finally:
            conn.close()
    else:
        with PostgresSaver.from_conn_string(PG_URL) as saver:
            saver.setup()
            yield saver


def remit_url(engine: str, folder: str, sqlite_sync: str) -> str:
    if engine == "sqlite":
        return f"sqlite:///{folder}/remit.db?synchronous={sqlite_sync}"
    return PG_URL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=400)
    parser.add_argument("--invokes", type=int, default=40)
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument("--modes", default="async,sync,exit", help="durability modes to invoke in")
    parser.add_argument("--sqlite-sync", default="NORMAL", choices=["NORMAL", "FULL"])
    args = parser.parse_args()
    rows: list[tuple[str, str, float, float, str]] = []
    with tempfile.TemporaryDirectory() as folder:
        for engine in args.engines.split(","):
            stock_label = {"sqlite": "SqliteSaver", "postgresql": "PostgresSaver"}[engine]
            remit = RemitSaver(remit_url(engine, folder, args.sqlite_sync))
            with stock_saver(engine, folder) as stock:
                ours_threads: list[str] = []
                theirs_threads: list[str] = []
                a, b = alternate(
                    Cycles(remit, ours_threads).once,
                    Cycles(stock, theirs_threads).once,
                    args.cycles,
                    BLOCK,
                )
                rows.append(
                    (
                        engine,
                        "put+get_tuple (cycles/s)",
                        1 / statistics.median(a),
                        1 / statistics.median(b),
                        stock_label,
                    )
                )
                for mode in args.modes.split(","):
                    # An exit-mode invoke is a fifth as long, and varies the most.
                    count = args.invokes * (10 if mode == "exit" else 1)
                    a, b = alternate(
                        Invokes(remit, mode, ours_threads).once,
                        Invokes(stock, mode, theirs_threads).once,
                        count,
                        1,
                    )
                    rows.append(
                        (
                            engine,
                            f"20-node invoke, {mode} (ms)",
                            1000 * statistics.median(a),
                            1000 * statistics.median(b),
                            stock_label,
                        )
                    )
                for thread in ours_threads:
                    remit.delete_thread(thread)
                for thread in theirs_threads:
                    stock.delete_thread(thread)
    print(f"{'engine':<11} {'workload':<28} {'RemitSaver':>11} {'LangGraph':>11}  ratio  vs")
    for engine, workload, ours, theirs, label in rows:
        per_second = workload.endswith("(cycles/s)")
        ratio = ours / theirs if per_second else theirs / ours
        print(f"{engine:<11} {workload:<28} {ours:>11.1f} {theirs:>11.1f}  {ratio:5.2f}  {label}")


if __name__ == "__main__":
    main()
