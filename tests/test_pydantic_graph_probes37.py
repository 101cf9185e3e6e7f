"""Outside probes of `RemitStatePersistence`, round 37: two graphs sharing one run id by
mistake, a driver handing `run.next()` nodes it built itself (a new start, the next node
rebuilt, a later node, an old node again), also on a run started with a job runner's
token, and a node that changes the state in place and then raises; on SQLite,
PostgreSQL and Redis.

Held: another graph (other nodes, or the same node names over another state) on a
paused run's id is refused with `VersionMismatch` by every entry point, and the run goes
on to its end; every node a driver builds for `run.next()` in place of the stored one is
refused with `ForkWithoutIntent`, nothing is written, no claim is kept, and the run goes
on with its effect applied once; a node that changed the state in place and raised is
run again by another process from the state stored with it, its effect not applied again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core import effect
from remit_core.errors import ForkWithoutIntent, VersionMismatch

#: The charges that reached the payment API, by idempotency key (this process only).
CHARGED: list[str] = []


@effect(idempotent=True)
async def charge(amount: int, *, idempotency_key: str) -> str:
    CHARGED.append(idempotency_key)
    return f"charged {amount}"


@dataclass
class Order:
    amount: int = 0
    log: list[str] = field(default_factory=list)


@dataclass
class Prepare(BaseNode[Order, None, str]):
    async def run(self, ctx: GraphRunContext[Order]) -> Charge:
        ctx.state.amount = 42
        ctx.state.log.append("prepare")
        return Charge(amount=ctx.state.amount)


@dataclass
class Charge(BaseNode[Order, None, str]):
    amount: int
    #: Raise after the charge (the first attempt in this process only).
    fail: bool = False

    async def run(self, ctx: GraphRunContext[Order]) -> Notify:
        ctx.state.log.append("charge")
        receipt = await charge(self.amount)
        ctx.state.amount = 0
        if self.fail and len(CHARGED) == 1:
            raise RuntimeError("the mail server is down")
        return Notify(receipt)


@dataclass
class Notify(BaseNode[Order, None, str]):
    text: str

    async def run(self, ctx: GraphRunContext[Order]) -> End[str]:
        ctx.state.log.append("notify")
        return End(self.text)


ORDERS = Graph(nodes=(Prepare, Charge, Notify))


@dataclass
class Profile:
    name: str = ""


@dataclass
class Open(BaseNode[Profile, None, str]):
    async def run(self, ctx: GraphRunContext[Profile]) -> Close:
        return Close()


@dataclass
class Close(BaseNode[Profile, None, str]):
    async def run(self, ctx: GraphRunContext[Profile]) -> End[str]:
        return End("closed")


#: Another graph of other nodes.
PROFILES = Graph(nodes=(Open, Close))


def _same_names() -> tuple[Graph[Any, Any, Any], type[BaseNode[Any, Any, Any]]]:
    """Another graph whose nodes have this graph's names, over another state (another
    module of the same application)."""

    @dataclass
    class Prepare(BaseNode[Profile, None, str]):
        async def run(self, ctx: GraphRunContext[Profile]) -> End[str]:
            raise AssertionError("another graph's node ran on this run")

    @dataclass
    class Charge(BaseNode[Profile, None, str]):
        amount: int

        async def run(self, ctx: GraphRunContext[Profile]) -> End[str]:
            raise AssertionError("another graph's node ran on this run")

    @dataclass
    class Notify(BaseNode[Profile, None, str]):
        text: str

        async def run(self, ctx: GraphRunContext[Profile]) -> End[str]:
            raise AssertionError("another graph's node ran on this run")

    return Graph(nodes=(Prepare, Charge, Notify)), Prepare


async def _continue(graph: Graph[Any, Any, Any], p: Any) -> Any:
    async with graph.iter_from_persistence(p) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return run.result


@pytest.fixture(autouse=True)
def _fresh_sink() -> None:
    CHARGED.clear()


@pytest.mark.parametrize("other", ["other nodes", "same names, other state"])
def test_another_graph_on_the_same_run_id_is_refused_and_the_run_goes_on(
    url: str, run_id: str, other: str
) -> None:
    """P4 / P3 (held): a paused run of one graph, and another graph given the same run id
    by mistake (other nodes; or nodes of the same names over another state). Starting it
    (`run`), continuing it (`iter_from_persistence`), reading it (`paused`, `load_all`),
    editing or answering it: each raises `VersionMismatch`, none runs a node or writes.
    The first graph then goes on to its end, its charge applied once."""
    if other == "other nodes":
        graph, start, answer = PROFILES, Open, Close()
    else:
        graph, start = _same_names()
        answer = None

    async def scenario() -> None:
        p = persistence(url, run_id, ORDERS)
        async with ORDERS.iter(Prepare(), state=Order(), persistence=p) as run:
            await run.next()  # Charge is stored: the run is paused before it
        before = shape(await p.load_all())

        def theirs() -> Any:
            return persistence(url, run_id, graph)

        attempts: list[Callable[[], Awaitable[Any]]] = [
            lambda: graph.run(start(), state=Profile(), persistence=theirs()),
            lambda: _continue(graph, theirs()),
            lambda: theirs().paused(),
            lambda: theirs().load_all(),
            lambda: theirs().update_state(Profile("bob")),
        ]
        if answer is not None:
            attempts.append(lambda: theirs().resume(answer))
        for attempt in attempts:
            with pytest.raises(VersionMismatch):
                await attempt()
        assert (
            shape(await p.load_all()) == before == [("Prepare", "success"), ("Charge", "created")]
        )
        result = await _continue(ORDERS, persistence(url, run_id, ORDERS))
        assert result.output == "charged 42"
        assert result.state.log == ["prepare", "charge", "notify"]
        assert len(CHARGED) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("token", [None, "job-1"], ids=["plain", "job-token"])
def test_nodes_a_driver_builds_for_run_next_are_refused_and_the_run_goes_on(
    url: str, run_id: str, token: str | None
) -> None:
    """P3 / P1 / P2 (held): a driver steps the run by hand and hands `run.next()` nodes it
    built: a new start node (skipping back), the next node rebuilt with another field, a
    later node (skipping its charge), and, once the run moved on, the node it ran before.
    Also on a run started with a job runner's token (a token names the run's line). Each
    raises `ForkWithoutIntent`; no second branch, no new snapshot, no claim kept: the
    driver's own next step goes on, and the charge is applied once."""

    async def scenario() -> None:
        p = persistence(url, run_id, ORDERS, fork_token=token)
        async with ORDERS.iter(Prepare(), state=Order(), persistence=p) as run:
            charge_node = await run.next()
            assert isinstance(charge_node, Charge)
            for built in (Prepare(), Charge(amount=1), Notify("free")):
                with pytest.raises(ForkWithoutIntent):
                    await run.next(built)
            assert shape(await p.load_all()) == [("Prepare", "success"), ("Charge", "created")]
            notify = await run.next(charge_node)
            with pytest.raises(ForkWithoutIntent):
                await run.next(charge_node)  # the node it ran: an old snapshot again
            with pytest.raises(ForkWithoutIntent):
                await run.next(Prepare())
            end = await run.next(notify)
        assert end == End("charged 42")
        assert run.state == Order(amount=0, log=["prepare", "charge", "notify"])
        assert shape(await p.load_all()) == [
            ("Prepare", "success"),
            ("Charge", "success"),
            ("Notify", "success"),
            ("End", "end"),
        ]
        assert len(CHARGED) == 1
        assert p.remit.branches(run_id) == [p.remit.branch(run_id)]

    asyncio.run(scenario())


def test_a_node_that_changed_the_state_in_place_and_raised_runs_again_from_the_stored_state(
    url: str, run_id: str
) -> None:
    """P1 / P2 / P6 (held): `Charge` appends to the state's log and zeroes its amount in
    place, applies its charge, then raises. The state stored with it is the state the
    node before returned (copied as it was stored), not the one the failed node left:
    another instance (a recovery) runs `Charge` again from it, and the charge, recorded
    under the node's snapshot id, is not applied again."""

    async def scenario() -> None:
        p = persistence(url, run_id, ORDERS)
        async with ORDERS.iter(Prepare(), state=Order(), persistence=p) as run:
            node = await run.next()
            assert isinstance(node, Charge)
            node.fail = True  # (an edit in place: not stored, the first attempt only)
            with pytest.raises(RuntimeError, match="mail server"):
                await run.next(node)
        assert run.state == Order(amount=0, log=["prepare", "charge"])
        stored = (await p.load_all())[-1]
        assert shape([stored]) == [("Charge", "error")]
        assert stored.state == Order(amount=42, log=["prepare"])
        result = await _continue(ORDERS, persistence(url, run_id, ORDERS))
        assert result.output == "charged 42"
        assert result.state == Order(amount=0, log=["prepare", "charge", "notify"])
        assert len(CHARGED) == 1

    asyncio.run(scenario())
