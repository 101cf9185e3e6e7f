"""Outside probes of `RemitStatePersistence`, round 16: a step retried after its end was
cut short, and a loop reusing a chosen snapshot id, recovered from copies of one store;
datetimes in zones with daylight-saving time; deeply nested values; and large states
of many small dataclasses; on SQLite, PostgreSQL and Redis, in real forked processes
where the item is about them.

- P6: a driver whose `run.next()` was cut short as its node's end was being stored, and
  that retried the step, stored the node in hand under the random id pydantic-graph gave
  it, where any other recovery of that store names it after the node it follows: two
  copies of one store, one continued by the cut driver and one by a fresh process,
  stored that node, and applied its effects, under two ids. The retry names it as every
  recovery does now (and runs it under that id).
- P6: a node handed an id the user chose that is stored already (`set_snapshot_id` with
  one id for every tick of a loop) is a new snapshot, and got a new random id: copies
  of one store, continued each in its own process, stored the loop's ticks (and keyed
  their effects) under other ids. It is named after the node it follows now.
- P4: a datetime in a zone whose offset changes with the date (`ZoneInfo("Europe/Paris")`)
  was stored and read back as the equal instant at a fixed offset: the zone was lost, so
  a resumed run computed other wall times across a daylight-saving change
  (`FullStatePersistence.dump_json` / `load_json` loses it as silently). It is refused
  now naming the field, as other values that would read back as another are; fixed
  offsets, UTC and `ZoneInfo("UTC")` read back as themselves. A time in such a zone read
  back naive: refused too.
- P4 / errors: a value nested deeper than pydantic's JSON reader reads back (a document
  from an API, 250 levels deep) was refused at `<root>`, naming no field. It is refused
  at the nested value's path now.
- Behaves worse than the framework: writing a state of many small dataclasses resolved
  each instance's annotations again (`typing.get_type_hints` per instance and per field):
  a 1 MB state took seconds per snapshot, each node of a run. Each class's are read once
  now.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import test_pydantic_graph_persistence as order
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from pydantic_graph.persistence.in_mem import FullStatePersistence
from test_pydantic_graph_persistence import World, in_child
from test_pydantic_graph_probes13 import cut_short

from remit_core import CheckpointInvalid
from remit_core.conformance.adapter import Target
from remit_core.conformance.storage import copy_remit_run, discard_copy
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


def ids(snapshots: list[Any]) -> list[tuple[str, str]]:
    """Each snapshot's id and status (an End: "end")."""
    return [(s.id, s.status if isinstance(s, NodeSnapshot) else "end") for s in snapshots]


# -- a step retried after a cut, and a fresh recovery of a copy of the same store ------------------


def test_a_step_retried_after_a_cut_names_its_node_as_any_recovery_does(
    url: str, run_id: str, tmp_path: Path
) -> None:
    """P6: `Answer` ran; its `success` was being stored when the driver's timeout cut
    `run.next()` short (nothing follows Answer yet, the claim is given back). The store
    is copied. The cut driver retries its step on the original (`Pay` stored with
    `snapshot_node_if_new`); a fresh process recovers the copy (Answer again, then Pay).
    Both store Pay under one id and charge under one idempotency key. Before, the retry
    stored Pay under the random id pydantic-graph gave it."""
    for name in ("ours", "theirs"):
        (tmp_path / name).mkdir()
    ours, theirs = World(tmp_path / "ours"), World(tmp_path / "theirs")
    source = Target(url, "remit", url, tmp_path, "source")
    copy = source.relocated(tmp_path / "copy", f"pg16{uuid.uuid4().hex[:8]}", 3)

    def recover_copy() -> list[tuple[str, str]]:
        p = order.persistence(copy.url, run_id)
        assert asyncio.run(order.drive(p, theirs)) == "paid 0"
        return ids(asyncio.run(order.persistence(copy.url, run_id).load_all()))

    def pairs(found: Any) -> list[tuple[str, str]]:
        return [(a, b) for a, b in found]

    async def cut_copy_retry() -> Any:
        async with cut_short(url, run_id, ours) as run:
            copy_remit_run(source, copy, run_id)
            recovered = in_child(recover_copy)
            assert recovered.status == "ok", recovered.summary()
            assert isinstance(await run.next(), order.Done)  # the retried step: Pay
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "paid 0"
        return recovered.value

    try:
        copied = asyncio.run(cut_copy_retry())
        retried = ids(asyncio.run(order.persistence(url, run_id).load_all()))
        assert [s for _, s in retried] == ["success", "success", "success", "end"]
        assert retried == pairs(copied)
        assert ours.entered() == {"answer": 1, "pay": 1, "pay.after_effect": 1, "done": 1}
        keys = [[(name, key) for name, key, _ in w.sink.applications()] for w in (ours, theirs)]
        assert keys[0] == keys[1] and [name for name, _ in keys[0]] == ["charge"]
    finally:
        discard_copy(copy, run_id)


@dataclass
class Tick(BaseNode[None, None, int]):
    """Counts to 3, handing each next tick the id the user chose for all: "tick"."""

    n: int = 0

    async def run(self, ctx: GraphRunContext[None]) -> Tick | End[int]:
        if self.n == 3:
            return End(self.n)
        following = Tick(self.n + 1)
        following.set_snapshot_id("tick")
        return following


TICKS = Graph(nodes=(Tick,), name="ticks")


def make_ticks(url: str, run_id: str) -> RemitStatePersistence[None, int]:
    p: RemitStatePersistence[None, int] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(TICKS)
    return p


def test_copies_of_a_run_reusing_a_chosen_id_recover_alike(
    url: str, run_id: str, tmp_path: Path
) -> None:
    """P6: a node hands its next node an id the user chose (`set_snapshot_id("tick")`),
    stored already. That snapshot is a new one and gets a new id: it was a random one,
    so two copies of one store, each continued in its own process, stored (and keyed
    the effects of) the same ticks under other ids. It is named after the node it
    follows now, as a generated id is."""
    first = Tick()
    first.set_snapshot_id("tick")
    asyncio.run(TICKS.initialize(first, make_ticks(url, run_id)))
    source = Target(url, "remit", url, tmp_path, "source")
    tag = uuid.uuid4().hex[:8]
    copies = [
        source.relocated(tmp_path / n, f"pg16{n}{tag}", slot) for n, slot in (("a", 4), ("b", 5))
    ]

    def recover(copy_url: str) -> list[list[str]]:
        async def go() -> list[list[str]]:
            async with TICKS.iter_from_persistence(make_ticks(copy_url, run_id)) as run:
                async for _ in run:
                    pass
            assert run.result is not None and run.result.output == 3
            return [list(pair) for pair in ids(await make_ticks(copy_url, run_id).load_all())]

        return asyncio.run(go())

    try:
        for copy in copies:
            copy_remit_run(source, copy, run_id)
        outcomes = [in_child(lambda c=c: recover(c.url)) for c in copies]
        assert [o.status for o in outcomes] == ["ok", "ok"], [o.summary() for o in outcomes]
        a, b = (o.value for o in outcomes)
        assert [s for _, s in a] == ["success"] * 4 + ["end"]
        assert a[0][0] == "tick" and len({i for i, _ in a}) == 5
        assert a == b
    finally:
        for copy in copies:
            discard_copy(copy, run_id)


# -- datetimes in zones ---------------------------------------------------------------------------


@dataclass
class Meeting:
    at: datetime | None = None
    daily: time | None = None
    by_day: dict[datetime, str] = field(default_factory=dict)


MCtx = GraphRunContext[Meeting]

PARIS = ZoneInfo("Europe/Paris")
#: Aware datetimes that read back as themselves: fixed offsets, and zones that have one.
FIXED = {
    "utc": datetime(2026, 3, 1, 9, tzinfo=timezone.utc),
    "offset": datetime(2026, 3, 1, 9, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    "zoneinfo-utc": datetime(2026, 3, 1, 9, tzinfo=ZoneInfo("UTC")),
}


@dataclass
class Plan(BaseNode[Meeting, None, datetime | None]):
    """Sets the meeting in a zone (`how`), or puts a zoned datetime in its result."""

    how: str = ""

    async def run(self, ctx: MCtx) -> Hold | End[datetime | None]:
        at = datetime(2026, 3, 1, 9, tzinfo=PARIS)
        if self.how == "field":
            ctx.state.at = at
        elif self.how == "daily":
            ctx.state.daily = time(9, tzinfo=PARIS)
        elif self.how == "key":
            ctx.state.by_day[at] = "kickoff"
        elif self.how == "result":
            return End(at)
        else:
            ctx.state.at = FIXED[self.how]
            ctx.state.by_day[FIXED[self.how]] = self.how
        return Hold()


@dataclass
class Hold(BaseNode[Meeting, None, datetime | None]):
    async def run(self, ctx: MCtx) -> End[datetime | None]:
        return End(ctx.state.at)


MEETINGS = Graph(nodes=(Plan, Hold), name="meetings")


def meetings(url: str, run_id: str) -> RemitStatePersistence[Meeting, datetime | None]:
    p: RemitStatePersistence[Meeting, datetime | None] = RemitStatePersistence(
        url, run_id, lease=LEASE
    )
    p.set_graph_types(MEETINGS)
    return p


def test_a_datetime_in_a_daylight_saving_zone_is_refused_naming_the_field(
    url: str, run_id: str
) -> None:
    """P4: a datetime in Europe/Paris, in a field, as a dict key or as the run's result,
    would read back at a fixed +01:00: equal now, but 60 days on it is 09:00+01:00 where
    the run had 09:00+02:00; a time in Europe/Paris would read back naive. It is refused
    at its path; nothing follows Plan, which is marked `error`, and the run can still be
    loaded. The framework's own `FullStatePersistence` reads it back with the zone lost."""
    at = datetime(2026, 3, 1, 9, tzinfo=PARIS)
    full = FullStatePersistence()
    full.set_graph_types(MEETINGS)
    asyncio.run(full.snapshot_node(Meeting(at=at), Hold()))
    lost = FullStatePersistence()
    lost.set_graph_types(MEETINGS)
    lost.load_json(full.dump_json())
    back = lost.history[0].state.at
    assert back == at and back + timedelta(days=60) != at + timedelta(days=60)

    where = {
        "field": "state.at",
        "daily": "state.daily",
        "key": f"state.by_day.{at}",
        "result": "result.data",
    }
    for how, path in where.items():
        rid = f"{run_id}-{how}"
        with pytest.raises(CheckpointInvalid) as refused:
            asyncio.run(MEETINGS.run(Plan(how), state=Meeting(), persistence=meetings(url, rid)))
        assert refused.value.field == path, how
        assert refused.value.run_id == rid
        assert "Europe/Paris')) would read back as datetime." in str(refused.value)
        stored = asyncio.run(meetings(url, rid).load_all())
        assert [(type(s.node).__name__, s.status) for s in stored] == [("Plan", "error")], how
        assert stored[0].state == Meeting()


def test_fixed_offset_datetimes_read_back_as_themselves(url: str, run_id: str) -> None:
    """P4, the other side: UTC, a fixed offset and `ZoneInfo("UTC")` are stored and read
    back, in another process, with their offset and their wall times 200 days on."""
    for how, at in FIXED.items():
        rid = f"{run_id}-{how}"
        result = asyncio.run(
            MEETINGS.run(Plan(how), state=Meeting(), persistence=meetings(url, rid))
        )
        assert result.output == at

        def read(rid: str = rid) -> list[list[str]]:
            stored = asyncio.run(meetings(url, rid).load_all())
            assert isinstance(stored[-1], EndSnapshot)
            got = [s.state.at for s in stored[1:]] + [stored[-1].result.data]
            got += [next(iter(s.state.by_day)) for s in stored[1:]]
            return [[d.isoformat(), (d + timedelta(days=200)).isoformat()] for d in got]

        outcome = in_child(read)
        assert outcome.status == "ok", outcome.summary()
        day_on = at + timedelta(days=200)
        assert outcome.value == [[at.isoformat(), day_on.isoformat()]] * 5, how


# -- large states of many small dataclasses -------------------------------------------------------

#: How many times the annotation `Counted[int]` was evaluated.
EVALUATED = [0]


class Counted:
    """`Counted[int]` is `int`; evaluating the annotation is counted (`EVALUATED`)."""

    def __class_getitem__(cls, item: Any) -> Any:
        EVALUATED[0] += 1
        return item


@dataclass
class Item:
    sku: str
    qty: Counted[int]
    tags: list[str] = field(default_factory=list)


@dataclass
class Stock:
    items: list[Item] = field(default_factory=list)


SCtx = GraphRunContext[Stock]
ITEMS = 3000


@dataclass
class Fill(BaseNode[Stock, None, int]):
    async def run(self, ctx: SCtx) -> Count:
        ctx.state.items = [Item(f"sku-{i}", i, ["x" * 100, "y" * 100]) for i in range(ITEMS)]
        return Count()


@dataclass
class Count(BaseNode[Stock, None, int]):
    async def run(self, ctx: SCtx) -> End[int]:
        ctx.state.items.append(Item("last", -1))
        return End(sum(item.qty for item in ctx.state.items))


STOCK = Graph(nodes=(Fill, Count), name="stock")


def test_a_large_state_of_small_dataclasses_resolves_their_annotations_once(
    url: str, run_id: str
) -> None:
    """A state of 3000 dataclass items (about 700 kB), written three times: each write
    checks that the state reads back as itself, field by field. It resolved each item's
    annotations again (for each instance and each field): seconds per snapshot for a
    1 MB state. Each class's annotations are resolved once now (counted here through an
    annotation whose evaluation is counted), and the state reads back whole in another
    process."""
    p: RemitStatePersistence[Stock, int] = RemitStatePersistence(url, run_id, lease=LEASE)
    EVALUATED[0] = 0
    result = asyncio.run(STOCK.run(Fill(), state=Stock(), persistence=p))
    assert result.output == sum(range(ITEMS)) - 1
    assert EVALUATED[0] < 20, EVALUATED[0]

    def read() -> list[Any]:
        q: RemitStatePersistence[Stock, int] = RemitStatePersistence(url, run_id, lease=LEASE)
        q.set_graph_types(STOCK)
        stored = asyncio.run(q.load_all())
        items = stored[-1].state.items
        return [len(items), sum(i.qty for i in items), [type(s).__name__ for s in stored]]

    outcome = in_child(read)
    assert outcome.status == "ok", outcome.summary()
    assert outcome.value == [
        ITEMS + 1,
        sum(range(ITEMS)) - 1,
        ["NodeSnapshot"] * 2 + ["EndSnapshot"],
    ]


# -- deeply nested values ------------------------------------------------------------------------


def nested(depth: int) -> dict[str, Any]:
    """A JSON document `depth` levels deep, as an API hands one out."""
    doc: dict[str, Any] = {"leaf": True}
    for level in range(depth):
        doc = {"level": level, "child": doc}
    return doc


@dataclass
class Page:
    doc: dict[str, Any] = field(default_factory=dict)


@dataclass
class Fetch(BaseNode[Page, None, int]):
    depth: int = 0

    async def run(self, ctx: GraphRunContext[Page]) -> End[int]:
        ctx.state.doc = nested(self.depth)
        return End(self.depth)


PAGES = Graph(nodes=(Fetch,), name="pages")


def test_a_value_nested_too_deeply_to_read_back_is_refused_naming_it(url: str, run_id: str) -> None:
    """P4 / errors: a document nested deeper than pydantic's JSON reader reads back was
    refused at `<root>`, naming no field. It is refused at the nested value's path now;
    one nested less deeply is stored and reads back equal."""
    p: RemitStatePersistence[Page, int] = RemitStatePersistence(url, run_id, lease=LEASE)
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(PAGES.run(Fetch(250), state=Page(), persistence=p))
    assert refused.value.field.startswith("state.doc.child.child.child."), refused.value.field
    assert "nested too deeply" in str(refused.value)
    q: RemitStatePersistence[Page, int] = RemitStatePersistence(url, run_id, lease=LEASE)
    q.set_graph_types(PAGES)
    stored = asyncio.run(q.load_all())
    assert [(type(s.node).__name__, s.status) for s in stored] == [("Fetch", "error")]

    rid = f"{run_id}-shallow"
    r: RemitStatePersistence[Page, int] = RemitStatePersistence(url, rid, lease=LEASE)
    assert asyncio.run(PAGES.run(Fetch(60), state=Page(), persistence=r)).output == 60
    r2: RemitStatePersistence[Page, int] = RemitStatePersistence(url, rid, lease=LEASE)
    r2.set_graph_types(PAGES)
    assert asyncio.run(r2.load_all())[-1].state.doc == nested(60)
