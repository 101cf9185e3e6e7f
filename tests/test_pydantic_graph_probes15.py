"""Outside probes of `RemitStatePersistence`, round 15: enum members in states, nodes and
results, snapshot ids a node hands out, and graphs whose state or answer node gained a
required field between a pause and its continuation (one answer taken by a resumer
SIGKILLed before it stored it); on SQLite, PostgreSQL and Redis, in a real forked
process where the item is about one.

- P4: a `StrEnum` or `IntEnum` member in an `Any` field (or as a key of a `dict[Any, ...]`,
  or as an `End[Any]`'s data) was stored and read back as its plain str or int: it equals
  its value, so the round trip looked equal. It is refused now naming the field, as a
  tuple in an `Any` field is; a member in a field that declares its enum, `str`, a
  `Literal` or `dict[str, ...]` keys reads back as what the field declares.
- P4 / errors: a node handed an id no engine stores (`set_snapshot_id` with a NUL or a
  lone surrogate) raised a bare `ValueError` about a "checkpoint_id", and the node that
  returned it was left `success` (not answerable, not run again at once). It is
  `CheckpointInvalid` at `id` now, nothing is written, and that node is marked `error`
  as for any result that is refused.
- P4 / errors: a taken answer that a resumer died before storing, read by a graph whose
  answer node gained a required field, raised pydantic's `ValidationError` from
  `iter_from_persistence` and `update_state` (no run, no pause named). It is
  `VersionMismatch` naming the pause and the field; the answer is kept, and the graph
  that took it continues with it, once.
- P4 / errors: a run read by a graph whose state gained a required field raised
  `VersionMismatch` saying only "Field required": it names the field's path now.
- P6: two copies of one store, whose run was SIGKILLed inside a node after its effect,
  recovered each in its own process, gave the node that follows it two snapshot ids
  (pydantic-graph names a new node with a random one), so its effect was applied under
  two idempotency keys: the copies' effect ledgers differed. The node that follows a
  node is named after it now: every recovery stores it, and keys its effects, alike.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import NodeSnapshot

from remit_core import (
    CheckpointInvalid,
    ResumeConflict,
    VersionMismatch,
    effect,
    failpoints,
)
from remit_core.conformance.adapter import Target
from remit_core.conformance.processes import fork
from remit_core.conformance.storage import copy_remit_run, discard_copy
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


class Tier(enum.StrEnum):
    GOLD = "gold"


class Level(enum.IntEnum):
    HIGH = 3


@dataclass
class Bag:
    anything: Any = None
    by_key: dict[Any, int] = field(default_factory=dict)
    tier: Tier = Tier.GOLD
    label: str = ""
    fixed: Literal["gold"] = "gold"
    tier_keys: dict[Tier, int] = field(default_factory=dict)
    names: dict[str, int] = field(default_factory=dict)
    level: Level | None = None


Ctx = GraphRunContext[Bag]


@dataclass
class Fill(BaseNode[Bag, None, Any]):
    """Puts `extra` in its result when it is "finish", else goes to `Done`."""

    extra: Any = None

    async def run(self, ctx: Ctx) -> Done | End[Any]:
        if self.extra == "finish":
            return End(Tier.GOLD)
        return Done()


#: Snapshot ids no engine stores (a NUL, a lone surrogate), by name.
BAD_IDS = {"nul": "Done:a\x00b", "surrogate": "Done:\udc80"}


@dataclass
class Hand(BaseNode[Bag, None, Any]):
    """Hands out its next node under the snapshot id `BAD_IDS[bad]`."""

    bad: str = ""

    async def run(self, ctx: Ctx) -> Done:
        done = Done()
        done.set_snapshot_id(BAD_IDS[self.bad])
        return done


@dataclass
class Done(BaseNode[Bag, None, Any]):
    async def run(self, ctx: Ctx) -> End[Any]:
        return End("done")


BAGS = Graph(nodes=(Fill, Hand, Done), name="bags")


def bags(url: str, run_id: str) -> RemitStatePersistence[Bag, Any]:
    p: RemitStatePersistence[Bag, Any] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(BAGS)
    return p


def shape(snapshots: list[Any]) -> list[tuple[str, str]]:
    return [(s.id, s.status if isinstance(s, NodeSnapshot) else "end") for s in snapshots]


# -- enum members --------------------------------------------------------------------------


def test_enum_members_read_back_as_enum_members_or_are_refused(url: str, run_id: str) -> None:
    """P4: a member in a field that declares it (or `str`, a `Literal`, `dict[str, ...]`
    keys) reads back as the field declares; one in an `Any` field, as a `dict[Any, ...]`
    key, in a node's `Any` field or as an `End[Any]`'s data is refused naming where,
    and nothing is written."""

    async def go() -> None:
        p = bags(url, run_id)
        declared = Bag(
            tier=Tier.GOLD,
            label=Tier.GOLD,
            fixed=Tier.GOLD,  # type: ignore[arg-type]
            tier_keys={Tier.GOLD: 1},
            names={Tier.GOLD: 2},
            level=Level.HIGH,
        )
        await BAGS.initialize(Fill(), p, state=declared)
        back = (await bags(url, run_id).load_all())[-1].state
        assert back == declared
        assert type(back.tier) is Tier and type(back.level) is Level
        assert [type(k) for k in back.tier_keys] == [Tier]
        assert type(back.label) is str and type(back.fixed) is str
        assert [type(k) for k in back.names] == [str]

        refused = [
            (Fill(), Bag(anything=Tier.GOLD), "state.anything"),
            (Fill(), Bag(anything=[1, Level.HIGH]), "state.anything.1"),
            (Fill(), Bag(by_key={Tier.GOLD: 1}), "state.by_key.gold"),
            (Fill(extra=Level.HIGH), Bag(), "node.extra"),
        ]
        for i, (node, state, where) in enumerate(refused):
            other = bags(url, f"{run_id}-{i}")
            with pytest.raises(CheckpointInvalid, match="would read back as") as caught:
                await BAGS.initialize(node, other, state=state)
            assert caught.value.field == where
            assert await bags(url, f"{run_id}-{i}").load_all() == []

        ending = bags(url, f"{run_id}-end")
        with pytest.raises(CheckpointInvalid) as caught:
            await BAGS.run(Fill("finish"), state=Bag(), persistence=ending)
        assert caught.value.field == "result.data"
        assert [s for _, s in shape(await bags(url, f"{run_id}-end").load_all())] == ["error"]

    asyncio.run(go())


# -- snapshot ids a node hands out -----------------------------------------------------------


@pytest.mark.parametrize("bad", sorted(BAD_IDS))
def test_a_node_handed_an_id_no_engine_stores_is_refused_typed(
    url: str, run_id: str, bad: str
) -> None:
    """P4 / errors: `CheckpointInvalid` at `id`; the node that returned it is `error`
    with nothing after it (the run is answerable, as after any refused result), and a
    run started at such a node stores nothing."""

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as caught:
            await BAGS.run(Hand(bad), state=Bag(), persistence=bags(url, run_id))
        assert caught.value.field == "id" and caught.value.run_id == run_id
        history = await bags(url, run_id).load_all()
        assert [s for _, s in shape(history)] == ["error"]

        p = bags(url, run_id)
        await p.resume(Done(), pause_id=history[0].id)
        async with BAGS.iter_from_persistence(p) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "done"
        assert [s for _, s in shape(await bags(url, run_id).load_all())] == [
            "error",
            "success",
            "end",
        ]

        start = Done()
        start.set_snapshot_id(BAD_IDS[bad])
        with pytest.raises(CheckpointInvalid) as caught:
            await BAGS.initialize(start, bags(url, f"{run_id}-start"), state=Bag())
        assert caught.value.field == "id"
        assert await bags(url, f"{run_id}-start").load_all() == []

    asyncio.run(go())


# -- a state or an answer node that gained a required field ----------------------------------


def orders(*, state_gained: bool = False, answer_gained: bool = False) -> Graph[Any, None, str]:
    """The order graph (`Wait` pauses, `Pay(who)` answers it), as it was, or a later
    version whose state or answer node gained a required field. Same node names."""

    @dataclass
    class Order:
        amount: int = 10
        log: list[str] = field(default_factory=list)

    @dataclass
    class Priced:
        currency: str
        amount: int = 10
        log: list[str] = field(default_factory=list)

    @dataclass
    class Wait(BaseNode[Any, None, str]):
        async def run(self, ctx: GraphRunContext[Any]) -> Pay:
            raise RuntimeError("answered with resume(Pay(...))")

    @dataclass
    class Paid(BaseNode[Any, None, str]):
        who: str

        async def run(self, ctx: GraphRunContext[Any]) -> End[str]:
            ctx.state.log.append(f"pay:{self.who}")
            return End(f"{self.who} paid {ctx.state.amount}")

    @dataclass
    class Routed(BaseNode[Any, None, str]):
        who: str
        channel: str

        async def run(self, ctx: GraphRunContext[Any]) -> End[str]:
            ctx.state.log.append(f"pay:{self.who}")
            return End(f"{self.who} paid {ctx.state.amount}")

    Pay = Routed if answer_gained else Paid
    Pay.__name__ = Pay.__qualname__ = "Pay"
    state = Priced if state_gained else Order
    return Graph(nodes=(Wait, Pay), state_type=state, name="orders")


def node(graph: Graph[Any, None, str], name: str) -> type[BaseNode[Any, None, str]]:
    return graph.node_defs[name].node


def on(graph: Graph[Any, None, str], url: str, run_id: str) -> RemitStatePersistence[Any, str]:
    p: RemitStatePersistence[Any, str] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(graph)
    return p


async def finish(graph: Graph[Any, None, str], url: str, run_id: str) -> Any:
    async with graph.iter_from_persistence(on(graph, url, run_id)) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return run.result


def test_a_state_that_gained_a_required_field_is_refused_naming_it(url: str, run_id: str) -> None:
    """P4 / errors: the later graph's reads raise `VersionMismatch` naming the paused
    snapshot and the field; nothing is written, and the graph that wrote the run
    answers and ends it."""
    old, new = orders(), orders(state_gained=True)

    async def go() -> None:
        await old.initialize(node(old, "Wait")(), on(old, url, run_id), state=old_state(old))
        before = shape(await on(old, url, run_id).load_all())
        for call in (
            lambda: finish(new, url, run_id),
            lambda: on(new, url, run_id).load_all(),
            lambda: on(new, url, run_id).resume(node(new, "Pay")("al")),
        ):
            with pytest.raises(
                VersionMismatch, match=r"at state\.currency \(Field required\)"
            ) as e:
                await call()
            assert e.value.checkpoint_id == before[-1][0]
        assert shape(await on(old, url, run_id).load_all()) == before
        await on(old, url, run_id).resume(node(old, "Pay")("al"))
        assert (await finish(old, url, run_id)).output == "al paid 10"

    asyncio.run(go())


def old_state(graph: Graph[Any, None, str]) -> Any:
    state_type, _ = graph.inferred_types
    return state_type()


def test_a_taken_answer_a_later_graph_cannot_read_is_kept_for_the_one_that_can(
    url: str, run_id: str
) -> None:
    """P5 / P4: a resumer SIGKILLed right after its answer was taken, before it stored it.
    A graph whose answer node gained a required field gets `VersionMismatch` naming the
    pause and the field from `iter_from_persistence` and `update_state` (not pydantic's
    `ValidationError`); a second answer is refused; nothing is written. The graph that
    took the answer continues with it, and runs the answer node once."""
    old, new = orders(), orders(answer_gained=True)
    asyncio.run(old.initialize(node(old, "Wait")(), on(old, url, run_id), state=old_state(old)))
    pause = asyncio.run(on(old, url, run_id).load_all())[-1].id

    def answer_and_die() -> None:
        failpoints.arm("interrupt.after_consume", "kill")
        asyncio.run(on(old, url, run_id).resume(node(old, "Pay")("al"), pause_id=pause))

    assert fork(answer_and_die).wait(60).status == "killed"

    async def go() -> None:
        before = shape(await on(old, url, run_id).load_all())
        reads = (
            lambda: finish(new, url, run_id),
            lambda: on(new, url, run_id).update_state(old_state(new), pause_id=pause),
        )
        for call in reads:
            with pytest.raises(VersionMismatch, match=r"at node\.channel \(Field required\)") as e:
                await call()
            assert e.value.checkpoint_id == pause and e.value.interrupt_id == pause
        with pytest.raises(ResumeConflict):
            await on(new, url, run_id).resume(node(new, "Pay")("bo", "mail"), pause_id=pause)
        assert shape(await on(old, url, run_id).load_all()) == before
        result = await finish(old, url, run_id)
        assert result.output == "al paid 10" and result.state.log == ["pay:al"]

    asyncio.run(go())


# -- recoveries of copies of one crashed store -----------------------------------------------

#: The idempotency keys this process applied its effects with, in order.
APPLIED: list[tuple[str, str]] = []


@effect(idempotent=True)
async def send(what: str, *, idempotency_key: str) -> str:
    APPLIED.append((what, idempotency_key))
    return what


@dataclass
class Charge(BaseNode[Bag, None, Any]):
    async def run(self, ctx: Ctx) -> Notify:
        await send("charge")
        return Notify()


@dataclass
class Notify(BaseNode[Bag, None, Any]):
    async def run(self, ctx: Ctx) -> End[Any]:
        await send("notify")
        return End("notified")


SENDING = Graph(nodes=(Charge, Notify), name="sending")


def sending(url: str, run_id: str) -> RemitStatePersistence[Bag, Any]:
    p: RemitStatePersistence[Bag, Any] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(SENDING)
    return p


def recover(url: str, run_id: str) -> dict[str, Any]:
    """Continue the run on `url`; what it stored and the keys its effects were applied with."""

    async def go() -> dict[str, Any]:
        async with SENDING.iter_from_persistence(sending(url, run_id)) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return {
            "output": run.result.output,
            "history": shape(await sending(url, run_id).load_all()),
            "applied": APPLIED,
        }

    return asyncio.run(go())


def test_copies_of_a_store_killed_after_an_effect_recover_alike(
    url: str, run_id: str, tmp_path: Path
) -> None:
    """P6: a run SIGKILLed inside `Charge` after its effect was applied, before it was
    recorded. Two copies of the store, each recovered in its own process, store the
    same history (the same id for the `Notify` that follows `Charge`) and apply the
    same effects under the same idempotency keys."""
    asyncio.run(SENDING.initialize(Charge(), sending(url, run_id), state=Bag()))

    def charge_and_die() -> None:
        failpoints.arm("effect.after_apply", "kill")
        recover(url, run_id)

    assert fork(charge_and_die).wait(60).status == "killed"
    time.sleep(LEASE + 0.2)  # the dead process's claim runs out (the contract's L1)
    source = Target(url, "remit", url, tmp_path, "source")
    tag = uuid.uuid4().hex[:8]
    copies = [
        source.relocated(tmp_path / n, f"pg15{n}{tag}", slot) for n, slot in (("a", 1), ("b", 2))
    ]
    for copy in copies:
        copy_remit_run(source, copy, run_id)
    try:
        outcomes = [fork(lambda c=c: recover(c.url, run_id)).wait(60) for c in copies]
        assert [o.status for o in outcomes] == ["ok", "ok"], [o.summary() for o in outcomes]
        a, b = (o.value for o in outcomes)
        assert a["output"] == b["output"] == "notified"
        assert a["history"] == b["history"]
        assert [s for _, s in a["history"]] == ["success", "success", "end"]
        assert a["applied"] == b["applied"]
        assert [what for what, _ in a["applied"]] == ["charge", "notify"]
    finally:
        for copy in copies:
            discard_copy(copy, run_id)
