"""Outside probes of `RemitStatePersistence`, round 17: stored records that are no
pydantic-graph snapshot at all; on SQLite, PostgreSQL and Redis.

- P4 / errors: a run id that another framework's run uses in the same store (a LangGraph
  thread `order-42` beside a pydantic-graph run `order-42`), or a record another program
  committed, was read as if it were a snapshot. Bytes that are not JSON made `load_next`,
  `load_all`, `paused`, `resume` and `Graph.run` raise pydantic's bare `ValueError`
  (`expected value at line 1 column 1`), naming neither the run nor the record; a node
  named by a list or an object raised `TypeError: unhashable type`. They raise
  `CorruptRecord` naming the run and the record now, and say what is wrong; nothing is
  written and the other framework's run is left as it was.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph

from remit_core import CorruptRecord, policy
from remit_core.core import Remit
from remit_langgraph import RemitSaver
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


@dataclass
class Tally:
    count: int = 0


@dataclass
class Count(BaseNode[Tally]):
    async def run(self, ctx: GraphRunContext[Tally]) -> Finish:
        ctx.state.count += 1
        return Finish()


@dataclass
class Finish(BaseNode[Tally, None, int]):
    async def run(self, ctx: GraphRunContext[Tally]) -> End[int]:
        return End(ctx.state.count)


GRAPH = Graph(nodes=(Count, Finish), name="tally")


def persistence(url: str, run_id: str) -> RemitStatePersistence[Tally, int]:
    p: RemitStatePersistence[Tally, int] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(GRAPH)
    return p


async def refusals(url: str, run_id: str) -> dict[str, BaseException | None]:
    """What each way a user reads, answers or starts the run raises (None: nothing)."""
    calls: dict[str, Any] = {
        "load_next": lambda p: p.load_next(),
        "load_all": lambda p: p.load_all(),
        "paused": lambda p: p.paused(),
        "resume": lambda p: p.resume(Finish()),
        "update_state": lambda p: p.update_state(Tally(5)),
        "run": lambda p: GRAPH.run(Count(), state=Tally(), persistence=p),
        "iter_from_persistence": lambda p: _continue(p),
    }
    out: dict[str, BaseException | None] = {}
    for name, call in calls.items():
        try:
            await call(persistence(url, run_id))
        except Exception as exc:
            out[name] = exc
        else:
            out[name] = None
    return out


async def _continue(p: RemitStatePersistence[Tally, int]) -> None:
    async with GRAPH.iter_from_persistence(p) as run:
        async for _ in run:
            pass


def records(url: str, run_id: str) -> list[tuple[str, bytes]]:
    """The run's checkpoints on its main line, newest first, as the store holds them."""
    remit = Remit(url)
    line = remit.branch(run_id)
    out: list[tuple[str, bytes]] = []
    cursor = None if line is None else line.head_id
    while cursor is not None:
        record = remit.checkpoint(run_id, cursor)
        assert record is not None
        out.append((record.checkpoint_id, record.state))
        cursor = record.parent_id
    return out


def assert_refused_loudly(
    refused: dict[str, BaseException | None], run_id: str, checkpoint_id: str, says: str
) -> None:
    for call, error in refused.items():
        assert isinstance(error, CorruptRecord), (call, type(error), error)
        assert error.run_id == run_id and error.checkpoint_id == checkpoint_id, (call, error)
        assert "not a pydantic-graph snapshot" in str(error) and says in str(error), (call, error)


class Counter(TypedDict):
    x: int


def test_a_run_id_another_frameworks_run_uses_is_refused_as_no_snapshot(url: str) -> None:
    """P4: a LangGraph thread stored under the same id in the same store is no pydantic-graph
    run: every call raises `CorruptRecord` naming the run and the record (before: a bare
    `ValueError` from the JSON reader), writes nothing, and the thread still reads back."""
    run_id = f"shared-{uuid.uuid4().hex}"
    builder = StateGraph(Counter)
    builder.add_node("add", lambda s: {"x": s["x"] + 1})
    builder.add_edge(START, "add")
    builder.add_edge("add", END)
    app = builder.compile(checkpointer=RemitSaver(url))
    config = {"configurable": {"thread_id": run_id}}
    assert app.invoke({"x": 1}, config) == {"x": 2}
    before = records(url, run_id)

    refused = asyncio.run(refusals(url, run_id))

    assert_refused_loudly(refused, run_id, before[0][0], "not JSON")
    assert records(url, run_id) == before
    assert app.get_state(config).values == {"x": 2}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\x00\x01 packed bytes", "not JSON"),
        (b'{"state": {"count": 1}, "node": {"node_id": "Count"}}', "kind 'node' or 'end'"),
        (b'[{"kind": "node"}]', "kind 'node' or 'end'"),
        (b'{"kind": "node", "state": {"count": 1}, "node": {"node_id": ["Count"]}}', "['Count']"),
        (b'{"kind": "node", "state": {}, "node": {"node_id": {"name": "Count"}}}', "'name'"),
    ],
)
def test_a_record_another_program_committed_is_refused_naming_it(
    url: str, body: bytes, says: str
) -> None:
    """P4: a record of the run that is no snapshot (committed by another program through
    the store, checksum and all) raises `CorruptRecord` naming the run, the record and
    what is wrong (before: `ValueError` or `TypeError: unhashable type`); nothing is
    written after it."""
    run_id = f"run-{uuid.uuid4().hex}"
    remit = Remit(url)
    claim = remit.claim(run_id, heartbeat=False)
    remit.commit(
        run_id=run_id,
        checkpoint_id="theirs",
        parent_id=None,
        state=body,
        fence=claim.fence,
        plan=policy.CommitPlan("main", None, 1),
    )
    claim.release()

    refused = asyncio.run(refusals(url, run_id))

    assert_refused_loudly(refused, run_id, "theirs", says)
    assert records(url, run_id) == [("theirs", body)]
