"""Outside probes of `RemitStatePersistence`, round 8: edits, versions and missing keys.

- P4: a TypedDict (the state, one inside it, or a run's result) missing a required key
  is refused naming the key's full path, as every other misfit is.
- P4: an instance that accepts older workflow versions still reads what it writes.
- P5: an answer that races an operator's `update_state` of its pause is taken at the
  edited pause (the same question), not dropped as if the paused node had run; one
  that loses to an answer given at the edit gets `ResumeConflict`.
- P5: an edit names its pause (`pause_id`), as an answer does: a state read at a pause
  is never written over a later node once the run moved on.

On SQLite, PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from test_pydantic_graph_persistence import (
    GRAPH,
    Answer,
    Pay,
    Start,
    World,
    drive,
    opened,
    persistence,
    to_pause,
)
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid, ResumeConflict, failpoints
from remit_core.conformance.processes import fork
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- P4: a TypedDict missing a required key ------------------------------------------------


class Line(TypedDict):
    sku: str
    qty: int


@dataclass
class Basket:
    first: Line = field(default_factory=lambda: Line(sku="a", qty=1))
    lines: list[Line] = field(default_factory=list)


@dataclass
class Edit(BaseNode[Basket, None, Line]):
    """Leaves a TypedDict without `qty` where `where` says, or ends with one."""

    where: str

    async def run(self, ctx: GraphRunContext[Basket]) -> Close | End[Line]:
        if self.where == "state.first.qty":
            del ctx.state.first["qty"]  # type: ignore[misc]
        elif self.where == "state.lines.0.qty":
            ctx.state.lines.append({"sku": "b"})  # type: ignore[typeddict-item]
        else:
            return End({"sku": "c"})  # type: ignore[typeddict-item]
        return Close()


@dataclass
class Close(BaseNode[Basket, None, Line]):
    async def run(self, ctx: GraphRunContext[Basket]) -> End[Line]:
        return End(Line(sku="z", qty=0))


BASKETS = Graph(nodes=(Edit, Close), name="baskets")


@pytest.mark.parametrize("where", ["state.first.qty", "state.lines.0.qty", "result.data.qty"])
def test_a_typed_dict_missing_a_key_is_refused_naming_the_key(
    store_url: str, run_id: str, where: str
) -> None:
    """pydantic writes such a TypedDict (and warns only about the whole snapshot), but
    it would not read back: `CheckpointInvalid` names the missing key by its full path
    (it named `<root>`, saying "expected dict, got dict", or "expected NodeSnapshot,
    got EndSnapshot" for a result); nothing is written and the node is marked `error`."""

    async def go() -> None:
        p: RemitStatePersistence[Basket, Line] = RemitStatePersistence(store_url, run_id)
        with pytest.raises(CheckpointInvalid) as refused:
            await BASKETS.run(Edit(where), state=Basket(), persistence=p)
        assert refused.value.field == where, refused.value
        assert "Field required" in str(refused.value)
        stored = await p.load_all()
        assert [(type(s.node).__name__, getattr(s, "status", "")) for s in stored] == [
            ("Edit", "error")
        ]

    asyncio.run(go())


def test_an_edit_missing_a_key_is_refused_naming_the_key(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: `update_state` with a partial state (only the keys being changed, as some
    frameworks' state updates take) is refused naming the first missing key; the run
    stays paused as it was."""

    async def go() -> None:
        p = await to_pause(store_url, run_id, world)
        before = await p.load_all()
        partial: Any = {"amount": 7}
        with pytest.raises(CheckpointInvalid) as refused:
            await persistence(store_url, run_id).update_state(partial)
        assert refused.value.field == "state.approved_by", refused.value
        assert await p.load_all() == before
        assert await p.paused() is not None

    asyncio.run(go())


# -- P4: accepted versions and the instance's own ---------------------------------------------


def test_an_instance_that_accepts_older_versions_reads_its_own_writes(
    store_url: str, run_id: str, world: World
) -> None:
    """A v2 reader that also accepts v1 runs (`accept_versions={"v1"}`, the versions it
    migrates from) continues a v1 run: the snapshots it writes itself, as v2, are read
    back (they were refused with `VersionMismatch` right after being written)."""

    def v2() -> RemitStatePersistence[Any, str]:
        return persistence(store_url, run_id, workflow_version="v2", accept_versions={"v1"})

    async def go() -> None:
        p = persistence(store_url, run_id, workflow_version="v1")
        assert await drive(p, world, Start()) == "paused"
        await v2().resume(Answer("ann"))
        assert await drive(v2(), world) == "paid 100"
        line = await v2().load_all()
        assert line[-1].state["approved_by"] == "ann"

    asyncio.run(go())
    assert world.sink.counts() == {"charge": 1}


# -- P5: an answer racing an edit of its pause ------------------------------------------------


def test_an_answer_racing_an_edit_of_its_pause_is_taken_at_the_edit(
    store_url: str, run_id: str, world: World
) -> None:
    """The resumer read the pause, then an operator's `update_state` edited it before
    the value was consumed. The edit is the same question (README: it keeps its id), so
    the answer is acknowledged and taken there, once, with the edited state. It was
    refused with `HeadMoved`, saying another process ran the paused node (none did), and
    the run stayed paused."""
    asyncio.run(to_pause(store_url, run_id, world))
    question = asyncio.run(persistence(store_url, run_id).paused())
    assert question is not None

    def answer() -> None:
        failpoints.arm("interrupt.before_consume", "sleep:1.5")
        asyncio.run(persistence(store_url, run_id).resume(Answer("ann"), pause_id=question.id))

    resumer = fork(answer)
    opened(store_url, run_id, question.id)  # read and validated; not consumed yet
    asyncio.run(persistence(store_url, run_id).update_state({**question.state, "amount": 7}))
    outcome = resumer.wait(60)
    assert outcome.ok, outcome.summary()
    assert asyncio.run(persistence(store_url, run_id).paused()) is None
    assert asyncio.run(drive(persistence(store_url, run_id), world)) == "paid 7"
    final = asyncio.run(persistence(store_url, run_id).load_all())[-1]
    assert final.state["approved_by"] == "ann"
    assert world.entered()["answer"] == 1 and world.sink.counts() == {"charge": 1}


def test_an_answer_that_lost_to_an_answer_given_after_an_edit_gets_resume_conflict(
    store_url: str, run_id: str, world: World
) -> None:
    """P5: the first resumer read the pause; an edit and a second answer (at the edit)
    came before its value was consumed. The second answer is the one the run takes, and
    the first resumer gets `ResumeConflict`, as a racing resumer does (it got `HeadMoved`,
    saying another process ran the paused node)."""
    asyncio.run(to_pause(store_url, run_id, world))
    question = asyncio.run(persistence(store_url, run_id).paused())
    assert question is not None

    def answer() -> None:
        failpoints.arm("interrupt.before_consume", "sleep:1.5")
        asyncio.run(persistence(store_url, run_id).resume(Answer("ann")))

    resumer = fork(answer)
    opened(store_url, run_id, question.id)
    asyncio.run(persistence(store_url, run_id).update_state({**question.state, "amount": 7}))
    asyncio.run(persistence(store_url, run_id).resume(Answer("bob"), pause_id=question.id))
    outcome = resumer.wait(60)
    assert outcome.status == "error" and outcome.raised("ResumeConflict"), outcome.summary()
    assert asyncio.run(drive(persistence(store_url, run_id), world)) == "paid 7"
    final = asyncio.run(persistence(store_url, run_id).load_all())[-1]
    assert final.state["approved_by"] == "bob"
    assert world.entered()["answer"] == 1 and world.sink.counts() == {"charge": 1}


# -- P5: an edit is for one pause ---------------------------------------------------------------


def test_an_edit_for_a_pause_the_run_moved_on_from_is_refused(
    store_url: str, run_id: str, world: World
) -> None:
    """An operator read the pause's state, then the pause was answered and a driver ran
    the answer; its next node waits to run (a driver between two nodes holds no claim).
    The edit, made from the state read at the pause, names that pause (`pause_id`, as
    `resume` does) and is refused with `ResumeConflict`; nothing is stored and the run
    ends with the answer. Without a way to name the pause, the stale state was written
    over that next node, and the run ended with `approved_by` None though the answer
    had been acknowledged and run. Edits of the pause itself, by that id, are taken."""

    async def go() -> None:
        await to_pause(store_url, run_id, world)
        question = await persistence(store_url, run_id).paused()
        assert question is not None
        for amount in (50, 60):  # the second names the pause by its id before the first
            await persistence(store_url, run_id).update_state(
                {**question.state, "amount": amount}, pause_id=question.id
            )
        await persistence(store_url, run_id).resume(Answer("ann"), pause_id=question.id)
        async with GRAPH.iter_from_persistence(persistence(store_url, run_id), deps=world) as run:
            assert isinstance(await run.next(), Pay)  # Answer ran; Pay is stored, not run
        before = await persistence(store_url, run_id).load_all()
        with pytest.raises(ResumeConflict, match="the edit is for pause"):
            await persistence(store_url, run_id).update_state(
                {**question.state, "amount": 7}, pause_id=question.id
            )
        assert await persistence(store_url, run_id).load_all() == before
        assert await drive(persistence(store_url, run_id), world) == "paid 60"
        final = (await persistence(store_url, run_id).load_all())[-1]
        assert final.state["approved_by"] == "ann"
        assert final.state["log"] == ["start", "answer", "pay", "done"]

    asyncio.run(go())
    assert world.sink.counts() == {"charge": 1}
