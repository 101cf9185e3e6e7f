"""Outside probes of `RemitStatePersistence`, round 31: node and state classes changed
between deployments under one workflow version (a field removed or renamed, also in a
nested dataclass, also on an answer a killed resumer took but did not store), and a paused
run's answer continued at once by processes that each use another entry point of the
Graph API (`iter_from_persistence`, `iter` and `run` from the stored head), the first to
apply the effect SIGKILLed; on SQLite, PostgreSQL and Redis, in real forked processes
where the item is about them.

Faults found:

- P4: a graph whose node or state lost a field (removed, or renamed with a default) read
  the runs stored before under the same workflow version without it: pydantic ignores a
  key its type does not have. An answer taken as `Answer(value="ann")`, read by a graph
  whose `Answer` calls the field `approver`, ran as `Answer(approver="nobody")`, and the
  run ended with the default in place of the person's answer; a removed state field, and a
  field renamed inside a list of dataclasses, were dropped the same way, and the loss was
  stored with the next snapshot. A stored key the graph's types do not read is now
  `VersionMismatch` naming it (`node.value`, `state.note`, `state.items.0.qty`) under the
  same workflow version; nothing is written, no claim is left, no branch is made. A graph
  given its own `workflow_version` that lists the old one in `accept_versions` vouches for
  the loss and reads such runs.

What held: four processes racing to continue an answered run through three entry points
(one proceeds at a time, the others get `ResumeConflict` or are told the node is taken and
run nothing); the first to apply the charge, SIGKILLed after it, is taken over once its
lease runs out, the charge is applied once and the run ends as an uninterrupted one does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphNodeStatusError, GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph_parts import LEASE, shape
from test_pydantic_graph_persistence import GRAPH, Answer, World, fresh, persistence, to_pause
from test_pydantic_graph_probes14 import raced

from remit_core import ForkWithoutIntent, ResumeConflict, VersionMismatch, failpoints
from remit_core.conformance.processes import fork
from remit_pydantic_graph import RemitStatePersistence

# -- classes changed between deployments, one workflow version -----------------------------


@dataclass
class Item:
    sku: str
    qty: int = 1


@dataclass
class Counted:
    """`Item` with `qty` renamed `count`."""

    sku: str
    count: int = 1


@dataclass
class Basket:
    items: list[Item] = field(default_factory=list)
    note: str = ""
    log: list[str] = field(default_factory=list)


@dataclass
class Unnoted:
    """`Basket` without its `note`."""

    items: list[Item] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


@dataclass
class Recounted:
    """`Basket` of `Counted` items."""

    items: list[Counted] = field(default_factory=list)
    note: str = ""
    log: list[str] = field(default_factory=list)


#: Each change of the next deployment: the state type it uses, and the path it loses.
CHANGES = {
    "node-field-renamed": (Basket, "node.value"),
    "state-field-removed": (Unnoted, "state.note"),
    "nested-field-renamed": (Recounted, "state.items.0.qty"),
}


def baskets(change: str | None = None) -> Graph[Any, None, str]:
    """Start -> Ask (the pause) -> Answer -> End, as deployed before (`change` None) or
    after one of `CHANGES`: the same node names, one workflow version."""

    @dataclass
    class Start(BaseNode[Any, None, str]):
        async def run(self, ctx: GraphRunContext[Any]) -> Ask:
            ctx.state.items.append(Item("tea", 2))
            ctx.state.log.append("start")
            return Ask()

    @dataclass
    class Ask(BaseNode[Any, None, str]):
        async def run(self, ctx: GraphRunContext[Any]) -> Answer:
            raise RuntimeError("answered with resume(Answer(...))")

    @dataclass
    class Before(BaseNode[Any, None, str]):
        value: str = ""

        async def run(self, ctx: GraphRunContext[Any]) -> End[str]:
            return End(done(ctx.state, self.value))

    @dataclass
    class Renamed(BaseNode[Any, None, str]):
        approver: str = "nobody"

        async def run(self, ctx: GraphRunContext[Any]) -> End[str]:
            return End(done(ctx.state, self.approver))

    Answer = Renamed if change == "node-field-renamed" else Before
    Answer.__name__ = Answer.__qualname__ = "Answer"
    state = Basket if change is None else CHANGES[change][0]
    return Graph(nodes=(Start, Ask, Answer), state_type=state, name="baskets")


def done(state: Any, who: str) -> str:
    state.log.append(f"answer:{who}")
    items = ", ".join(f"{i.sku} x{getattr(i, 'qty', getattr(i, 'count', 0))}" for i in state.items)
    return f"{who}: {getattr(state, 'note', '-')}; {items}"


def node(graph: Graph[Any, None, str], name: str) -> Any:
    return graph.node_defs[name].node


def on(graph: Graph[Any, None, str], url: str, run_id: str, **kw: Any) -> Any:
    p: RemitStatePersistence[Any, str] = RemitStatePersistence(url, run_id, lease=LEASE, **kw)
    p.set_graph_types(graph)
    return p


async def finish(graph: Graph[Any, None, str], url: str, run_id: str, **kw: Any) -> str:
    async with graph.iter_from_persistence(on(graph, url, run_id, **kw)) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return str(run.result.output)


async def paused_basket(old: Graph[Any, None, str], url: str, run_id: str) -> None:
    async with old.iter(
        node(old, "Start")(), state=Basket(note="leave at door"), persistence=on(old, url, run_id)
    ) as run:
        async for step in run:
            if isinstance(step, node(old, "Ask")):
                break


ANSWERED = "ann: leave at door; tea x2"


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_field_removed_or_renamed_under_one_version_is_a_version_mismatch(
    url: str, run_id: str, change: str
) -> None:
    """P4: a run paused and answered (`Answer(value="ann")`) by one deployment is read by
    the next, which removed or renamed a field of the answer node, of the state, or of a
    dataclass in a list in the state, under the same workflow version. Continuing it,
    reading it and forking it raise `VersionMismatch` naming the lost field and the run;
    nothing is written, no claim is held, no branch is made. The deployment that wrote
    the run ends it with the answer it took; a graph of its own version that accepts the
    old one reads it."""
    old, new = baskets(), baskets(change)
    lost = CHANGES[change][1]

    async def go() -> None:
        await paused_basket(old, url, run_id)
        await on(old, url, run_id).resume(node(old, "Answer")("ann"))
        before = await on(old, url, run_id).load_all()
        assert shape(before)[-1] == ("Answer", "created")
        for call in (
            lambda: finish(new, url, run_id),
            lambda: on(new, url, run_id).load_all(),
            lambda: on(new, url, run_id).paused(),
            lambda: on(new, url, run_id).fork(before[-1].id, "what-if"),
        ):
            with pytest.raises(VersionMismatch, match=rf"holds {lost}, which") as caught:
                await call()
            assert caught.value.run_id == run_id and "accept_versions" in str(caught.value)
        reader = on(old, url, run_id)
        assert [(s.id, s.status) for s in await reader.load_all()] == [  # type: ignore[union-attr]
            (s.id, s.status)  # type: ignore[union-attr]
            for s in before
        ]
        claim = reader.remit.store.get_claim(run_id, "main")
        assert claim is None or claim.holder == ""
        assert [b.branch for b in reader.remit.branches(run_id)] == ["main"]
        assert await finish(old, url, run_id) == ANSWERED
        vouched = on(new, url, run_id, workflow_version="v2", accept_versions={""})
        line = await vouched.load_all()
        assert isinstance(line[-1], EndSnapshot) and line[-1].result.data == ANSWERED

    asyncio.run(go())


def test_a_taken_answer_whose_field_was_renamed_is_kept_for_the_graph_that_reads_it(
    url: str, run_id: str
) -> None:
    """P5 / P4: a resumer is SIGKILLed right after its answer (`Answer(value="ann")`) was
    taken, before it stored it. The next deployment, whose `Answer` calls the field
    `approver` (same workflow version), does not run the answer as `approver="nobody"`:
    `VersionMismatch` names the kept answer and its field, nothing is written, and the
    deployment that took the answer ends the run with it."""
    old, new = baskets(), baskets("node-field-renamed")
    asyncio.run(paused_basket(old, url, run_id))
    pause = asyncio.run(on(old, url, run_id).load_all())[-1].id

    def answer_and_die() -> None:
        failpoints.arm("interrupt.after_consume", "kill")
        asyncio.run(on(old, url, run_id).resume(node(old, "Answer")("ann"), pause_id=pause))

    assert fork(answer_and_die).wait(60).status == "killed"
    time.sleep(LEASE + 0.2)  # the dead resumer's claim, if it took one, has lapsed

    async def go() -> None:
        before = shape(await on(old, url, run_id).load_all())
        with pytest.raises(VersionMismatch, match=r"answer taken at this pause.*holds node\.value"):
            await finish(new, url, run_id)
        assert shape(await on(old, url, run_id).load_all()) == before
        assert await finish(old, url, run_id) == ANSWERED

    asyncio.run(go())


# -- an answered run continued through three entry points at once, the payer killed -------


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def continue_through(entry: str, url: str, run_id: str, world: World) -> str:
    """Continue the answered run through `entry` until it has ended: one that loses the
    race, or finds the node held or taken, looks again. Returns the run's result."""
    while True:
        p = persistence(url, run_id)
        try:
            if entry == "iter_from_persistence":
                asyncio.run(drive_from(p, world))
            else:
                head = asyncio.run(p.load_all())[-1]
                if isinstance(head, NodeSnapshot):
                    asyncio.run(drive_head(entry, p, head, world))
        except (ResumeConflict, ForkWithoutIntent, GraphRuntimeError, GraphNodeStatusError):
            pass
        line = asyncio.run(persistence(url, run_id).load_all())
        if isinstance(line[-1], EndSnapshot):
            return str(line[-1].result.data)
        time.sleep(0.05)


async def drive_from(p: RemitStatePersistence[Any, str], world: World) -> None:
    async with GRAPH.iter_from_persistence(p, deps=world) as run:
        async for _ in run:
            pass


async def drive_head(
    entry: str, p: RemitStatePersistence[Any, str], head: NodeSnapshot[Any, Any], world: World
) -> None:
    """`Graph.iter` or `Graph.run` from the stored head node and state, as a user who read
    the run with `load_all()` writes it."""
    if entry == "run":
        await GRAPH.run(head.node, state=head.state, deps=world, persistence=p)
        return
    async with GRAPH.iter(head.node, state=head.state, deps=world, persistence=p) as run:
        async for _ in run:
            pass


def test_entry_points_racing_to_continue_an_answered_run_whose_payer_is_killed(
    url: str, run_id: str, world: World
) -> None:
    """P5 / P1 / P2 / L1 / P6: an answered run is continued at once, behind a barrier, by
    four processes: two with `iter_from_persistence`, one with `Graph.iter` and one with
    `Graph.run` from the head node `load_all()` gave them. The first to apply the charge
    is SIGKILLed right after it. No node runs twice but the killed one, the charge is
    applied once, and the run ends with the history and state an uninterrupted run has."""
    asyncio.run(to_pause(url, run_id, world))
    asyncio.run(persistence(url, run_id).resume(Answer("ann")))

    def kill_first_payer(step: str) -> None:
        if step == "pay.after_effect" and world.entered().get(step) == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    racer = World(world.folder, on_enter=kill_first_payer)
    entries = ["iter_from_persistence", "iter", "run", "iter_from_persistence"]
    outcomes = raced([lambda e=e: continue_through(e, url, run_id, racer) for e in entries])
    statuses = sorted(o.status for o in outcomes)
    assert statuses == ["killed", "ok", "ok", "ok"], [o.summary() for o in outcomes]
    assert {o.value for o in outcomes if o.ok} == {"paid 100"}
    line = asyncio.run(persistence(url, run_id).load_all())
    assert shape(line) == [
        ("Start", "success"),
        ("Ask", "created"),
        ("Answer", "success"),
        ("Pay", "success"),
        ("Done", "success"),
        ("End", "end"),
    ]
    uninterrupted = fresh()
    uninterrupted.update(amount=100, approved_by="ann", log=["start", "answer", "pay", "done"])
    assert line[-1].state == uninterrupted
    assert world.sink.counts() == {"charge": 1}
    entered = world.entered()
    assert entered == {"start": 1, "answer": 1, "pay": 2, "pay.after_effect": 2, "done": 1}
    assert [b.branch for b in persistence(url, run_id).remit.branches(run_id)] == ["main"]
