"""Outside probes of `RemitStatePersistence`, round 11: a resumer paused past its lease,
states and results that pydantic writes with computed fields or `Json` fields, and a
fork from a run's End, on SQLite, PostgreSQL and Redis, in real forked processes where
the item is about them.

- P5 / L2: a resumer whose answer was consumed, then stopped (SIGSTOP) past its lease
  before it stored the answer, got `Fenced` when continued, though the process that
  took the run over had stored that very answer and run on with it: the run went on
  with a value its resumer was told had failed. It is acknowledged now.
- P4: a snapshot was written with the model's computed fields. A model that forbids
  extra keys does not read them back (`CheckpointInvalid` at a field the node never
  set, `state.total`), one that keeps extra keys reads them back as extras (refused as
  "would read back as"), and a `Json[...]` field was written as the value, not the
  JSON text it reads: valid states and results were refused, and a run whose `End`
  holds such a model could never end. Snapshots are written in pydantic's round-trip
  form now.
- P3 / errors: `fork()` of a run's `End` made a branch nothing could run on, and spent
  its token: it is a `ValueError` now, and no branch is made.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Json, computed_field
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import (
    Answer,
    World,
    drive,
    in_child,
    persistence,
    to_pause,
)

from remit_core import CheckpointInvalid, ResumeConflict, arun_effect, failpoints
from remit_core.conformance.processes import fork, reap
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def ids(url: str, run_id: str) -> list[str]:
    return [s.id for s in asyncio.run(persistence(url, run_id).load_all())]


# -- a resumer paused past its lease after its answer was taken ------------------------------


def test_a_resumer_paused_before_storing_its_taken_answer_is_acknowledged(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/L2: the resumer's answer ("ann") is consumed, then the resumer is stopped right
    before it stores it, past its lease. Meanwhile another answer is refused, and another
    process takes the run over: it stores "ann" and runs to the end with it (charge once).
    Continued, the stopped resumer is told its answer was taken (it returns the answer's
    snapshot), not `Fenced`: the value the run went on with is the acknowledged one. It
    writes nothing more."""
    asyncio.run(to_pause(store_url, run_id, world))

    def answer() -> Any:
        failpoints.arm("checkpoint.before_commit", "stop")
        snapshot = asyncio.run(persistence(store_url, run_id).resume(Answer("ann")))
        return [snapshot.id, snapshot.node.value]

    zombie = fork(answer)
    try:
        assert zombie.wait(60, stopped_counts=True).status == "stopped"
        zombie.outcome = None
        time.sleep(LEASE + 0.5)
        with pytest.raises(ResumeConflict):
            asyncio.run(persistence(store_url, run_id).resume(Answer("bob")))
        assert asyncio.run(drive(persistence(store_url, run_id), world)) == "paid 100"
        before = ids(store_url, run_id)
        zombie.cont()
        late = zombie.wait(60)
    finally:
        reap([zombie])
    assert late.ok, late.summary()
    answer_id, value = late.value
    history = asyncio.run(persistence(store_url, run_id).load_all())
    assert [s.id for s in history] == before and value == "ann"
    assert [
        s.id for s in history if isinstance(s, NodeSnapshot) and isinstance(s.node, Answer)
    ] == [answer_id]
    assert isinstance(history[-1], EndSnapshot) and history[-1].state["approved_by"] == "ann"
    assert world.entered()["answer"] == 1 and world.sink.counts() == {"charge": 1}


# -- computed fields and Json fields --------------------------------------------------------


class Basket(BaseModel):
    """A strict state: extra keys forbidden, a computed total, settings kept as JSON text."""

    model_config = ConfigDict(extra="forbid")
    qty: int = 0
    price: Decimal = Decimal("0")
    settings: Json[dict[str, int]]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total(self) -> Decimal:
        return self.price * self.qty


class Receipt(BaseModel):
    """The run's result: a model that keeps extra keys, with a computed field."""

    model_config = ConfigDict(extra="allow")
    net: Decimal

    @computed_field  # type: ignore[prop-decorator]
    @property
    def gross(self) -> Decimal:
        return self.net * 2


BCtx = GraphRunContext[Basket, World]


@dataclass
class Fill(BaseNode[Basket, World, Receipt]):
    async def run(self, ctx: BCtx) -> Hold:
        ctx.deps.enter("fill")
        ctx.state.qty, ctx.state.price = 3, Decimal("2.50")
        return Hold()


@dataclass
class Hold(BaseNode[Basket, World, Receipt]):
    """The pause: the answer comes as `Bill(note)`."""

    async def run(self, ctx: BCtx) -> Bill:
        raise AssertionError("the pause never runs")


@dataclass
class Bill(BaseNode[Basket, World, Receipt]):
    note: str

    async def run(self, ctx: BCtx) -> End[Receipt]:
        ctx.deps.enter("bill")
        sink = ctx.deps.sink

        async def apply(key: str) -> str:
            return sink.apply("bill", key)

        await arun_effect("bill", apply, reconcile=sink.reconcile)
        return End(Receipt(net=ctx.state.total + ctx.state.settings["fee"], note=self.note))


BASKETS = Graph(nodes=(Fill, Hold, Bill), name="baskets")


def baskets(url: str, run_id: str) -> RemitStatePersistence[Basket, Receipt]:
    p: RemitStatePersistence[Basket, Receipt] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(BASKETS)
    return p


def test_models_with_computed_and_json_fields_are_stored_and_read_back(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: a state that forbids extra keys, has a computed field and a `Json` field, and
    an End result that keeps extra keys and has a computed field: the run is paused in
    one process, answered and ended in another; every snapshot reads back equal, the
    computed fields recomputed (not stored), and the effect is applied once."""

    def to_hold() -> Any:
        async def go() -> str:
            p = baskets(store_url, run_id)
            state = Basket(settings='{"fee": 1}')
            async with BASKETS.iter(Fill(), state=state, deps=world, persistence=p) as run:
                async for node in run:
                    if isinstance(node, Hold):
                        return "paused"
            return "not paused"

        return asyncio.run(go())

    paused = in_child(to_hold)
    assert paused.ok and paused.value == "paused", paused.summary()

    def finish() -> Any:
        async def go() -> Any:
            p = baskets(store_url, run_id)
            question = await p.paused()
            assert question is not None and question.state.total == Decimal("7.50")
            await p.resume(Bill("thanks"), pause_id=question.id)
            async with BASKETS.iter_from_persistence(p, deps=world) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            return [str(run.result.output.gross), run.result.output.model_extra]

        return asyncio.run(go())

    done = in_child(finish)
    assert done.ok and done.value == ["17.00", {"note": "thanks"}], done.summary()
    history = asyncio.run(baskets(store_url, run_id).load_all())
    assert [type(s.node).__name__ for s in history if isinstance(s, NodeSnapshot)] == [
        "Fill",
        "Hold",
        "Bill",
    ]
    end = history[-1]
    assert isinstance(end, EndSnapshot)
    assert end.state == Basket(qty=3, price=Decimal("2.50"), settings='{"fee": 1}')
    assert end.state.settings == {"fee": 1} and end.state.total == Decimal("7.50")
    assert end.result.data == Receipt(net=Decimal("8.50"), note="thanks")
    assert end.result.data.gross == Decimal("17.00")
    assert world.entered() == {"fill": 1, "bill": 1} and world.sink.counts() == {"bill": 1}


def test_a_strict_model_state_is_still_refused_naming_a_bad_field(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: writing in round-trip form refuses what it refused before: a node that leaves
    `qty` a str in the strict state gets `CheckpointInvalid` naming `state.qty`, and an
    edit with a `settings` value that is not JSON text of the declared type is refused at
    `state.settings`; nothing is written either time and the run stays paused."""

    @dataclass
    class Spoil(BaseNode[Basket, World, Receipt]):
        async def run(self, ctx: BCtx) -> Hold:
            ctx.state.qty = "many"  # type: ignore[assignment]
            return Hold()

    spoiled = Graph(nodes=(Spoil, Hold, Bill), name="spoiled")

    async def go() -> None:
        p: RemitStatePersistence[Basket, Receipt] = RemitStatePersistence(
            store_url, "s" + run_id, lease=LEASE
        )
        with pytest.raises(CheckpointInvalid) as bad:
            await spoiled.run(
                Spoil(), state=Basket(settings='{"fee": 1}'), deps=world, persistence=p
            )
        assert bad.value.field == "state.qty", bad.value

        p = baskets(store_url, run_id)
        async with BASKETS.iter(
            Fill(), state=Basket(settings='{"fee": 1}'), deps=world, persistence=p
        ) as run:
            async for node in run:
                if isinstance(node, Hold):
                    break
        question = await baskets(store_url, run_id).paused()
        assert question is not None
        edited = question.state.model_copy(update={"settings": {"fee": "high"}})
        with pytest.raises(CheckpointInvalid) as bad:
            await baskets(store_url, run_id).update_state(edited, pause_id=question.id)
        assert bad.value.field.startswith("state.settings"), bad.value
        after = await baskets(store_url, run_id).paused()
        assert after is not None and after.id == question.id

    asyncio.run(go())


# -- a fork from a run's End -----------------------------------------------------------------


def test_a_fork_from_a_runs_end_is_refused_and_its_token_stays_unused(
    store_url: str, run_id: str, world: World
) -> None:
    """P3/errors: `fork(end_id, token)` made a branch whose head is the End: nothing could
    run on it (`iter_from_persistence` found nothing to load, starting a node was refused
    as after an End) and the token was spent on it. It is a `ValueError` naming the End
    and the token now, no branch is made, and the same token then forks the paying node."""

    async def go() -> None:
        await to_pause(store_url, run_id, world)
        await persistence(store_url, run_id).resume(Answer("ann"))
        assert await drive(persistence(store_url, run_id), world) == "paid 100"
        p = persistence(store_url, run_id)
        history = await p.load_all()
        end, pay = history[-1], history[-3]
        assert isinstance(end, EndSnapshot) and type(pay.node).__name__ == "Pay"
        branches = len(p.remit.branches(run_id))
        with pytest.raises(ValueError, match=rf"{end.id}.*End.*'t1' is unused"):
            await p.fork(end.id, "t1")
        assert len(p.remit.branches(run_id)) == branches
        forked = await p.fork(pay.id, "t1")
        assert await drive(forked, world) == "paid 100"
        assert [s.id for s in await persistence(store_url, run_id).load_all()] == [
            s.id for s in history
        ]

    asyncio.run(go())
    assert world.entered()["pay"] == 2 and world.entered()["answer"] == 1
