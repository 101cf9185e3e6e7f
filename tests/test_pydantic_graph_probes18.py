"""Outside probes of `RemitStatePersistence`, round 18: validators that raise past
pydantic, and the `End` a run's history reads back; on SQLite, PostgreSQL and Redis.

- P4 / errors: a validator of the graph's types that refuses a value by raising something
  other than a `ValueError` or an `AssertionError` (a `TypeError`, a `KeyError`: `v.strip()`
  on None, a lookup) is let through by pydantic as it is. A node that left such a value in
  the state made `Graph.run` raise that bare `TypeError`, naming neither the run nor the
  field, and the node was left `success` (a refused result is marked `error` elsewhere);
  `resume()` and `update_state()` raised it too. It is `CheckpointInvalid` at the value's
  path now (`state.code`, `node.code`), nothing is written, and the node is `error`.
- P4: a run that a new version of the graph reads, whose validator raises so on the stored
  value, made `iter_from_persistence`, `load_all` and `paused` raise that bare error. It is
  `VersionMismatch` naming the run and the snapshot now; nothing is written.
- Framework API: the `End` of a run read back (`load_all()[-1].result`, also
  `EndSnapshot.node`) did not carry its snapshot's id: it made up a new random one at each
  read, as `FullStatePersistence` never does, so two reads of one stored run disagreed.
  It carries the stored id now.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any

import pytest
from pydantic import AfterValidator
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph.persistence.in_mem import FullStatePersistence

from remit_core import CheckpointInvalid, VersionMismatch
from remit_core.core import Remit
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


def upper_only(code: str) -> str:
    """A validator as users write them: it refuses with a TypeError, which pydantic does not
    turn into a ValidationError."""
    if not code.isupper():
        raise TypeError(f"code {code!r} must be upper case")
    return code


Code = Annotated[str, AfterValidator(upper_only)]


@dataclass
class Ticket:
    code: Code = "NEW"
    note: str = ""


@dataclass
class Lenient:
    """The state the first version of the graph kept: any code."""

    code: str = "NEW"
    note: str = ""


@dataclass
class Triage(BaseNode[Any, None, str]):
    """Writes the code a caller gave; the pause is `Review`."""

    code: str = "OK"

    async def run(self, ctx: GraphRunContext[Any]) -> Review:
        ctx.state.code = self.code
        return Review()


@dataclass
class Review(BaseNode[Any, None, str]):
    async def run(self, ctx: GraphRunContext[Any]) -> Close:
        raise RuntimeError("answer with resume(Close(...))")


@dataclass
class Close(BaseNode[Any, None, str]):
    code: Code = "DONE"

    async def run(self, ctx: GraphRunContext[Any]) -> End[str]:
        return End(self.code)


STRICT = Graph(nodes=(Triage, Review, Close), state_type=Ticket, run_end_type=str, name="t")
LENIENT = Graph(nodes=(Triage, Review, Close), state_type=Lenient, run_end_type=str, name="t")


def make(url: str, run_id: str, graph: Graph[Any, Any, str] = STRICT) -> RemitStatePersistence:
    p: RemitStatePersistence[Any, str] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(graph)
    return p


async def stop_at_review(p: RemitStatePersistence[Any, str], graph: Graph[Any, Any, str]) -> None:
    async with graph.iter(Triage("OK"), state=Ticket(), persistence=p) as run:
        async for node in run:
            if isinstance(node, Review):
                break


def stored_ids(url: str, run_id: str) -> list[str]:
    """The run's main line as the store holds it, newest first."""
    remit = Remit(url)
    line = remit.branch(run_id)
    out: list[str] = []
    cursor = None if line is None else line.head_id
    while cursor is not None:
        record = remit.checkpoint(run_id, cursor)
        assert record is not None
        out.append(record.checkpoint_id)
        cursor = record.parent_id
    return out


def shape(snapshots: list[Any]) -> list[tuple[str, str]]:
    return [
        (type(s.node).__name__, s.status if isinstance(s, NodeSnapshot) else "end")
        for s in snapshots
    ]


def test_a_validator_raising_a_type_error_is_refused_naming_the_field(
    url: str, run_id: str
) -> None:
    """P4 / errors: a node leaving a value that the state's validator refuses with a
    `TypeError`: `CheckpointInvalid` at `state.code` (before: the bare `TypeError`, and the
    node left `success`); nothing after the node, which is `error`; an answer and an edit
    that a validator refuses so are `CheckpointInvalid` too, and the run stays paused."""

    async def go() -> None:
        p = make(url, run_id)
        with pytest.raises(CheckpointInvalid) as caught:
            await STRICT.run(Triage("lower"), state=Ticket(), persistence=p)
        assert caught.value.field == "state.code" and caught.value.run_id == run_id
        assert "TypeError" in str(caught.value) and "must be upper case" in str(caught.value)
        assert shape(await make(url, run_id).load_all()) == [("Triage", "error")]
        assert len(stored_ids(url, run_id)) == 1

        paused_run = f"{run_id}-paused"
        await stop_at_review(make(url, paused_run), STRICT)
        before = stored_ids(url, paused_run)
        answer = make(url, paused_run)
        with pytest.raises(CheckpointInvalid) as bad_answer:
            await answer.resume(Close(code="done"))
        assert bad_answer.value.field == "node.code", bad_answer.value
        with pytest.raises(CheckpointInvalid) as bad_edit:
            await answer.update_state(Ticket(code="ok"))
        assert bad_edit.value.field == "state.code", bad_edit.value
        assert stored_ids(url, paused_run) == before
        paused = await answer.paused()
        assert paused is not None and isinstance(paused.node, Review)
        await answer.resume(Close(code="DONE"), pause_id=paused.id)
        async with STRICT.iter_from_persistence(make(url, paused_run)) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "DONE"

    asyncio.run(go())


def test_a_run_a_new_validator_raises_on_is_a_version_mismatch(url: str, run_id: str) -> None:
    """P4: a run stored by the graph's first version (any code), read by a version whose
    validator raises `TypeError` on the stored code: `VersionMismatch` naming the run and
    the snapshot, from every read (before: the bare `TypeError`); nothing is written."""

    async def go() -> None:
        first = make(url, run_id, LENIENT)
        state = Lenient()
        async with LENIENT.iter(Triage("lower"), state=state, persistence=first) as run:
            async for node in run:
                if isinstance(node, Review):
                    break
        before = stored_ids(url, run_id)
        head = before[0]

        async def continue_it() -> None:
            async with STRICT.iter_from_persistence(make(url, run_id)) as again:
                async for _ in again:
                    pass

        reads: dict[str, Any] = {
            "iter_from_persistence": continue_it,
            "load_all": lambda: make(url, run_id).load_all(),
            "paused": lambda: make(url, run_id).paused(),
            "resume": lambda: make(url, run_id).resume(Close()),
        }
        for name, read in reads.items():
            with pytest.raises(VersionMismatch) as caught:
                await read()
            assert caught.value.run_id == run_id, name
            assert caught.value.checkpoint_id == head, (name, caught.value)
            assert "TypeError" in str(caught.value), (name, caught.value)
        assert stored_ids(url, run_id) == before
        assert shape(await make(url, run_id, LENIENT).load_all()) == [
            ("Triage", "success"),
            ("Review", "created"),
        ]

    asyncio.run(go())


@dataclass
class Sum:
    total: int = 0


@dataclass
class Add(BaseNode[Sum, None, int]):
    async def run(self, ctx: GraphRunContext[Sum]) -> End[int]:
        ctx.state.total += 2
        return End(ctx.state.total)


ADDING = Graph(nodes=(Add,), name="adding")


def test_an_end_read_back_carries_its_snapshot_id(url: str, run_id: str) -> None:
    """Framework API: the `End` of `load_all()` carries its snapshot's id, as the one
    `FullStatePersistence` holds does; two reads, by two instances, agree (before: each
    read made up a new random id)."""

    async def go() -> None:
        full: FullStatePersistence[Sum, int] = FullStatePersistence()
        await ADDING.run(Add(), state=Sum(), persistence=full)
        end = full.history[-1]
        assert isinstance(end, EndSnapshot) and end.result.get_snapshot_id() == end.id

        p: RemitStatePersistence[Sum, int] = RemitStatePersistence(url, run_id)
        result = await ADDING.run(Add(), state=Sum(), persistence=p)
        assert result.output == 2
        reads = []
        for _ in range(2):
            reader: RemitStatePersistence[Sum, int] = RemitStatePersistence(url, run_id)
            reader.set_graph_types(ADDING)
            last = (await reader.load_all())[-1]
            assert isinstance(last, EndSnapshot)
            assert last.result.get_snapshot_id() == last.id == last.node.get_snapshot_id()
            reads.append(last.id)
        assert reads[0] == reads[1] == stored_ids(url, run_id)[0]

    asyncio.run(go())
