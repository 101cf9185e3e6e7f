"""Outside probes of `RemitStatePersistence`: the store's server ending its connections in
the middle of a run (PostgreSQL backends terminated, Redis clients killed, at the core's
failpoints), and a long-lived run that loops through a pause 300 times; on SQLite,
PostgreSQL and Redis.

Faults found:

- Behaves worse than the framework: a wrong answer (`resume(node)` with a node the pause
  does not lead to, no `pause_id`) read the snapshot of every pause the run had answered,
  to tell a late answer from a wrong one: in a loop through a pause, the 12th round's wrong
  answer made 29 store calls and the 288th's 581, growing with every round. Each answered
  pause now names its node where it is recorded: one read of the answered pauses, and none
  when no node leads to the answer.

Held: connections ended at every failpoint from the answer to the run's end, on
PostgreSQL and Redis, gave `StoreUnavailable` or a transparent retry, never a driver's
error; the run, continued, started once, took its answer once and charged once. The calls
of a loop's rounds (`resume`, `load_next`, `record_run`, `snapshot_node`, `paused`) cost
as many store calls and records in round 300 as in round 10.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence
from store_cuts import cut_at, tagged
from test_pydantic_graph_persistence import (
    GRAPH,
    Answer,
    Ask,
    World,
    to_pause,
)
from test_pydantic_graph_persistence import persistence as order_persistence

from remit_core import StoreUnavailable
from remit_core.conformance.processes import fork
from remit_pydantic_graph import RemitStatePersistence

# -- cutting the persistence's connections at a failpoint -----------------------------------


@pytest.fixture
def cutting(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, int, str, str], list[int]]:
    """Arm: at the `nth` hit of failpoint `point`, end the persistence's connections."""

    def arm(point: str, nth: int, engine: str, name: str) -> list[int]:
        return cut_at(monkeypatch, point, engine, name, nth)

    return arm


POINTS = [
    "claim.in_acquire",
    "claim.after_acquire",
    "checkpoint.before_commit",
    "checkpoint.in_commit",
    "checkpoint.after_commit",
    "writes.before",
    "writes.in_txn",
    "writes.after",
    "interrupt.before_consume",
    "interrupt.in_consume",
    "interrupt.after_consume",
    "effect.before_intent",
    "effect.in_intent",
    "effect.after_intent",
    "effect.after_apply",
    "effect.in_outcome",
    "effect.after_outcome",
]

CUTS = [
    pytest.param(e, p, n, id=f"{e}-{p}-{n}")
    for e in ("postgresql", "redis")
    for p in POINTS
    for n in ((1, 2, 3) if p.split(".")[0] in ("claim", "checkpoint", "writes") else (1,))
    if (e, p) != ("redis", "effect.in_intent")
]


async def answer_and_finish(
    url: str, run_id: str, world: World, errors: list[BaseException]
) -> Any:
    """Answer the pause with "ann", then continue the run to its end, as a user would:
    every error on the way is kept and the call tried again (the same answer node, the
    same instance)."""
    p = order_persistence(url, run_id)
    answer = Answer("ann")
    for _ in range(6):
        try:
            await p.resume(answer)
            break
        except Exception as exc:  # noqa: BLE001 - the test sorts them
            errors.append(exc)
            if (await p.paused()) is None:
                break  # taken (or the run moved on): go on with the run
    for _ in range(8):
        try:
            async with GRAPH.iter_from_persistence(p, deps=world) as run:
                async for node in run:
                    assert not isinstance(node, Ask), "the pause came back"
            assert run.result is not None
            return run.result.output
        except Exception as exc:  # noqa: BLE001 - the test sorts them
            errors.append(exc)
    raise AssertionError(f"the run never ended; errors: {errors!r}")


@pytest.mark.parametrize(("engine", "point", "nth"), CUTS)
def test_connections_ended_mid_run_are_store_unavailable_and_the_run_goes_on_once(
    engine: str,
    point: str,
    nth: int,
    tmp_path: Path,
    cutting: Callable[[str, int, str, str], list[int]],
) -> None:
    """From the answer on, the persistence's server connections are ended at the `nth`
    hit of `point`. Every error the user sees on the way is `StoreUnavailable`; the run,
    continued to its end, started once, took "ann" as its answer once, charged once, and
    its history is that of an uninterrupted run."""
    url, name = tagged(engine)
    world = World(tmp_path)
    run_id = f"pg27-{uuid.uuid4().hex}"
    asyncio.run(to_pause(url, run_id, world))
    done = cutting(point, nth, engine, name)
    errors: list[BaseException] = []
    out = asyncio.run(answer_and_finish(url, run_id, world, errors))
    assert done, f"{point} was hit fewer than {nth} times"
    assert done[0] >= 1, f"{point} was reached with no connection open"
    for exc in errors:
        assert isinstance(exc, StoreUnavailable), f"{type(exc).__module__}: {exc!r}"
    assert out == "paid 100"
    assert world.entered()["start"] == 1
    assert world.entered()["answer"] <= 1 + len(errors)  # re-run only where a call failed
    assert world.sink.counts() == {"charge": 1}
    line = asyncio.run(order_persistence(url, run_id).load_all())
    kinds = [type(getattr(s, "node", s)).__name__ for s in line]
    assert kinds == ["Start", "Ask", "Answer", "Pay", "Done", "End"]
    assert line[-1].state["approved_by"] == "ann"
    assert line[-1].state["log"] == ["start", "answer", "pay", "done"]


# -- a long-lived run: a loop through a pause, answered hundreds of times -------------------

ROUNDS = 300
#: Rounds at which a wrong answer comes before the right one.
WRONG_AT = (12, ROUNDS - 12)


@dataclass
class Loop:
    rounds: int = 0
    last: str = ""


@dataclass
class Begin(BaseNode[Loop, None, int]):
    async def run(self, ctx: GraphRunContext[Loop]) -> Wait:
        return Wait()


@dataclass
class Wait(BaseNode[Loop, None, int]):
    """The pause: drivers stop before it; the answer comes as `Reply(value)`."""

    async def run(self, ctx: GraphRunContext[Loop]) -> Reply:
        raise AssertionError("the pause never runs")


@dataclass
class Reply(BaseNode[Loop, None, int]):
    value: str

    async def run(self, ctx: GraphRunContext[Loop]) -> Wait | End[int]:
        ctx.state.rounds += 1
        ctx.state.last = self.value
        return End(ctx.state.rounds) if ctx.state.rounds >= ROUNDS else Wait()


LOOP = Graph(nodes=(Begin, Wait, Reply), name="loop")


class Reads:
    """Store calls (and the records they return), counted by the persistence call that
    made them."""

    def __init__(self, p: RemitStatePersistence[Any, Any]) -> None:
        self.calling: str | None = None
        self.calls: dict[str, list[tuple[int, int]]] = {}
        self.wrong: list[int] = []  # which of the resume calls raised ValueError
        self._now = [0, 0]
        store = p.remit.store
        for name in dir(type(store)):
            if name.startswith("_") or not callable(getattr(store, name)):
                continue
            if name == "renew_claim":
                continue  # (the lease keeper's thread renews whenever it is due)
            setattr(store, name, self._counted(getattr(store, name)))
        for name in ("resume", "load_next", "snapshot_node", "snapshot_node_if_new", "paused"):
            setattr(p, name, self._measured(name, getattr(p, name)))
        record_run = p.record_run

        @asynccontextmanager
        async def measured_run(snapshot_id: str) -> AsyncIterator[None]:
            self._begin("record_run")
            async with record_run(snapshot_id):
                yield
            self._end()

        p.record_run = measured_run  # type: ignore[method-assign]

    def _counted(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            out = method(*args, **kwargs)
            self._now[0] += 1
            self._now[1] += len(out) if isinstance(out, (list, tuple, dict)) else 1
            return out

        return counted

    def _begin(self, name: str) -> None:
        self.calling, self._now = name, [0, 0]

    def _end(self) -> None:
        assert self.calling is not None
        self.calls.setdefault(self.calling, []).append((self._now[0], self._now[1]))
        self.calling = None

    def _measured(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        async def measured(*args: Any, **kwargs: Any) -> Any:
            self._begin(name)
            try:
                return await method(*args, **kwargs)
            except ValueError:
                self.wrong.append(len(self.calls.get(name, [])))
                raise
            finally:
                self._end()

        return measured


def answer_elsewhere(url: str, run_id: str, value: str) -> None:
    """Answer the loop's pause from a process of its own."""

    async def go() -> None:
        p = persistence(url, run_id, LOOP)
        pause = await p.paused()
        assert pause is not None
        await p.resume(Reply(value), pause_id=pause.id)

    asyncio.run(go())


def test_a_loop_through_a_pause_answered_300_times_costs_the_same_each_round(url: str) -> None:
    """A run loops through a pause 300 times, each round answered (every tenth from another
    process), and driven by one instance. The store calls each `resume`, `load_next`,
    `record_run`, `snapshot_node` and `paused` makes, and the records they read, are as
    many in the last rounds as in the first; `load_all()` then lists every round in order."""
    run_id = f"pg27-loop-{uuid.uuid4().hex}"
    p = persistence(url, run_id, LOOP)
    reads = Reads(p)

    async def go() -> int:
        async with LOOP.iter(Begin(), state=Loop(), persistence=p) as run:
            async for node in run:
                if isinstance(node, Wait):
                    break
        for i in range(ROUNDS):
            if i % 10 == 9:
                assert fork(partial(answer_elsewhere, url, run_id, f"r{i}")).wait(60).ok
            else:
                pause = await p.paused()
                assert pause is not None and isinstance(pause.node, Wait)
                if i in WRONG_AT:
                    # An answer the pause does not lead to, with no pause named: refused
                    # as wrong (no answered pause leads to it either), nothing stored.
                    with pytest.raises(ValueError, match="leads only to Reply"):
                        await p.resume(Wait())
                await p.resume(Reply(f"r{i}"), pause_id=pause.id)
            async with LOOP.iter_from_persistence(p) as run:
                async for node in run:
                    if isinstance(node, Wait):
                        break
            if i == ROUNDS - 1:
                assert run.result is not None
                return int(run.result.output)
        raise AssertionError("the loop never ended")

    assert asyncio.run(go()) == ROUNDS
    assert set(reads.calls) >= {"resume", "load_next", "record_run", "snapshot_node", "paused"}
    wrong = [reads.calls["resume"][n] for n in reads.wrong]
    assert wrong[-1][0] <= wrong[0][0], f"store calls of a wrong answer: {wrong}"
    for name, costs in reads.calls.items():
        if name == "resume":
            costs = [c for n, c in enumerate(costs) if n not in reads.wrong]
        if len(costs) < 100:
            continue  # (a call a run makes once or twice)
        early, late = costs[5:25], costs[-20:]
        assert max(late) <= max(early), f"{name}: {early} at first, {late} at last"
    line = asyncio.run(persistence(url, run_id, LOOP).load_all())
    kinds = [type(getattr(s, "node", s)).__name__ for s in line]
    assert kinds == ["Begin"] + ["Wait", "Reply"] * ROUNDS + ["End"]
    assert [s.node.value for s in line if isinstance(getattr(s, "node", None), Reply)] == [
        f"r{i}" for i in range(ROUNDS)
    ]
    assert line[-1].state == Loop(ROUNDS, f"r{ROUNDS - 1}")
    assert len({s.id for s in line}) == len(line)
