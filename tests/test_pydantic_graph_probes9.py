"""Outside probes of `RemitStatePersistence`, round 9: refusals that say what to do.

- P5: a refused `update_state` says the edit was not stored (it said "the value");
  one refused because a driver loaded the pause and stopped there says how the claim
  comes back (`release()`, or the lease), for answers too.
- P3: starting an ended run again without a token (a parent node running a child
  graph again after a crash) says the run has ended and where its result is; its
  advice (a fork token, `iter_from_persistence()`) could not go on after an End.
- P1 / P6: the child-graph recipe: a parent node killed after its child graph ended
  reads the child's End on recovery; the child's nodes and effects are not run again.

On SQLite, PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot
from test_pydantic_graph_persistence import (
    GRAPH,
    LEASE,
    Answer,
    Ask,
    Start,
    World,
    charge,
    drive,
    fresh,
    in_child,
    persistence,
    to_pause,
)

from remit_core import ForkWithoutIntent, ResumeConflict
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- P5: what a refused edit or answer says -------------------------------------------------


async def _answered(url: str, run_id: str, world: World) -> str:
    await to_pause(url, run_id, world)
    await persistence(url, run_id).resume(Answer("ann"))
    return "the run was already resumed"


async def _ended(url: str, run_id: str, world: World) -> str:
    await _answered(url, run_id, world)
    assert await drive(persistence(url, run_id), world) == "paid 100"
    return "the run has ended"


async def _other_pause(url: str, run_id: str, world: World) -> str:
    await to_pause(url, run_id, world)
    return "the edit is for pause"


@pytest.mark.parametrize("why", ["answered", "ended", "other_pause"])
def test_a_refused_edit_says_the_edit_was_not_stored(
    store_url: str, run_id: str, world: World, why: str
) -> None:
    """`update_state` refused (the pause was answered, the run ended, the edit names
    another pause) said "the value was not stored", the words of a refused answer."""
    arrange = {"answered": _answered, "ended": _ended, "other_pause": _other_pause}[why]

    async def go() -> None:
        said = await arrange(store_url, run_id, world)
        before = await persistence(store_url, run_id).load_all()
        pause_id = "Ask:not-this-runs" if why == "other_pause" else None
        with pytest.raises(ResumeConflict) as refused:
            await persistence(store_url, run_id).update_state(fresh(), pause_id=pause_id)
        assert said in str(refused.value) and "the edit was not stored" in str(refused.value)
        assert "value" not in str(refused.value)
        assert await persistence(store_url, run_id).load_all() == before

    asyncio.run(go())


def test_a_pause_a_driver_loaded_and_left_says_how_it_comes_back(
    store_url: str, run_id: str, world: World
) -> None:
    """A driver continues a paused run with `iter_from_persistence` and stops at the
    pause it is handed (`break`): it holds the claim `load_next` took. An answer or an
    edit from another process is refused, saying so and how the claim comes back
    (`release()`, or its lease); after `release()` both are taken."""

    async def go() -> None:
        await to_pause(store_url, run_id, world)
        driver = persistence(store_url, run_id, lease=30.0)
        async with GRAPH.iter_from_persistence(driver, deps=world) as run:
            async for node in run:
                assert isinstance(node, Ask)
                break
        for call, lost in (("answer", "the value"), ("edit", "the edit")):
            other = persistence(store_url, run_id)
            with pytest.raises(ResumeConflict) as refused:
                if call == "answer":
                    await other.resume(Answer("ann"))
                else:
                    await other.update_state(fresh())
            text = str(refused.value)
            assert "persistence.release()" in text and "lease" in text, text
            assert f"{lost} was not stored" in text, text
        driver.release()
        question = await persistence(store_url, run_id).paused()
        assert question is not None
        await persistence(store_url, run_id).update_state(
            {**question.state, "amount": 7}, pause_id=question.id
        )
        await persistence(store_url, run_id).resume(Answer("ann"), pause_id=question.id)
        assert await drive(persistence(store_url, run_id), world) == "paid 7"

    asyncio.run(go())
    assert world.sink.counts() == {"charge": 1}


# -- P3: starting an ended run again -----------------------------------------------------------


def test_starting_an_ended_run_again_says_it_ended_and_where_its_result_is(
    store_url: str, run_id: str, world: World
) -> None:
    """`graph.run(Start(), persistence=...)` on a run id that has ended (a job retried,
    a parent node running its child graph again) is refused with `ForkWithoutIntent`.
    Without a token it said the run had "a head" and advised a fork token or
    `iter_from_persistence()`: with a token the start is refused again, and
    `iter_from_persistence()` raises `GraphRuntimeError`. It says the run ended and
    where its result is now; nothing is written."""

    async def go() -> None:
        await _ended(store_url, run_id, world)
        before = await persistence(store_url, run_id).load_all()
        with pytest.raises(ForkWithoutIntent) as refused:
            await GRAPH.run(
                Start(), state=fresh(), deps=world, persistence=persistence(store_url, run_id)
            )
        text = str(refused.value)
        assert "the run has ended" in text and "load_all()" in text, text
        assert "pass fork_token" not in text and "to continue it" not in text, text
        assert await persistence(store_url, run_id).load_all() == before

    asyncio.run(go())
    assert world.entered()["start"] == 1


# -- P1 / P6: a child graph run by a node ------------------------------------------------------


@dataclass
class Box:
    items: int = 0


@dataclass
class Pack(BaseNode[Box, World, int]):
    async def run(self, ctx: GraphRunContext[Box, World]) -> Seal:
        ctx.deps.enter("pack")
        ctx.state.items = 3
        return Seal()


@dataclass
class Seal(BaseNode[Box, World, int]):
    async def run(self, ctx: GraphRunContext[Box, World]) -> End[int]:
        ctx.deps.enter("seal")
        await charge(ctx)  # type: ignore[arg-type]
        return End(ctx.state.items)


CHILD = Graph(nodes=(Pack, Seal), name="child")


async def run_child(url: str, run_id: str, world: World) -> int:
    """The recipe: run a child graph to its end once under `run_id`, whatever a crash
    left of it: read its End, continue it, or start it."""
    child: RemitStatePersistence[Box, int] = RemitStatePersistence(url, run_id, lease=LEASE)
    child.set_graph_types(CHILD)
    history = await child.load_all()
    if history and isinstance(history[-1], EndSnapshot):
        return history[-1].result.data
    if history:
        async with CHILD.iter_from_persistence(child, deps=world) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output
    return (await CHILD.run(Pack(), state=Box(), deps=world, persistence=child)).output


@dataclass
class Parent(BaseNode[Any, World, str]):
    """Runs the child graph under a run id of its own snapshot (the same on recovery)."""

    async def run(self, ctx: GraphRunContext[Any, World]) -> End[str]:
        ctx.deps.enter("parent")
        items = await run_child(ctx.state["url"], f"child/{self.get_snapshot_id()}", ctx.deps)
        ctx.deps.enter("parent.after_child")
        return End(f"{items} items")


PARENT = Graph(nodes=(Parent,), name="parent")


def test_a_parent_killed_after_its_child_graph_ended_reads_the_childs_end(
    store_url: str, run_id: str, world: World
) -> None:
    """SIGKILL in the parent node after its child graph ended: the recovered parent
    node reads the child's End (the child run id comes from the parent node's snapshot
    id, the same on recovery); the child's nodes and effect are not run again."""
    world.kill_at = "parent.after_child"

    def crash() -> None:
        p = RemitStatePersistence(store_url, run_id, lease=LEASE)
        asyncio.run(PARENT.run(Parent(), state={"url": store_url}, deps=world, persistence=p))

    assert in_child(crash).status == "killed"
    time.sleep(LEASE + 0.2)
    world.kill_at = None

    async def recover() -> Any:
        p = RemitStatePersistence(store_url, run_id, lease=LEASE)
        async with PARENT.iter_from_persistence(p, deps=world) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    assert asyncio.run(recover()) == "3 items"
    assert world.entered() == {"parent": 2, "parent.after_child": 2, "pack": 1, "seal": 1}
    assert world.sink.counts() == {"charge": 1}


# -- P2: an edited node that raised after its effect ------------------------------------------


@dataclass
class Bill(BaseNode[Any, World, str]):
    """Charges, then raises the first time it runs (a receipt printer jammed)."""

    async def run(self, ctx: GraphRunContext[Any, World]) -> End[str]:
        ctx.deps.enter("bill")
        await charge(ctx)
        if ctx.deps.entered()["bill"] == 1:
            raise RuntimeError("receipt printer jammed")
        return End(f"billed {ctx.state['amount']}")


BILLS = Graph(nodes=(Bill,), name="bills")


def test_an_edited_node_that_raised_after_its_effect_applies_it_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P2: a node that raised after its effect is the run's pause (README: a head node
    that raised); an operator edits its state (`update_state`, twice) and the run goes
    on. The edit commits the node again under a new snapshot id, and its effects were
    keyed by that id: the charge was applied a second time. They are keyed by the node
    the edit was made to, so the recorded charge is returned, not applied again."""

    async def go() -> Any:
        p = RemitStatePersistence(store_url, run_id, lease=LEASE)
        with pytest.raises(RuntimeError, match="jammed"):
            await BILLS.run(Bill(), state=fresh(), deps=world, persistence=p)
        operator = RemitStatePersistence(store_url, run_id, lease=LEASE)
        operator.set_graph_types(BILLS)
        question = await operator.paused()
        assert question is not None and question.status == "error"
        for amount in (7, 8):
            await operator.update_state({**question.state, "amount": amount}, pause_id=question.id)
        driver = RemitStatePersistence(store_url, run_id, lease=LEASE)
        async with BILLS.iter_from_persistence(driver, deps=world) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    assert asyncio.run(go()) == "billed 8"
    assert world.entered() == {"bill": 2}
    assert world.sink.counts() == {"charge": 1}
