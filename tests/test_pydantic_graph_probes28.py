"""Outside probes of `RemitStatePersistence`, round 28: values that read back as others
and binary data, in a run's state and in its `End`; a node that changed the state in
place and then raised, continued in another process; on SQLite, PostgreSQL and Redis.

Faults found:

- P4: a `defaultdict`, `Counter` or `OrderedDict` in an `Any` field (`dict[str, Any]`,
  a run-end type of `Any`) was stored and read back as a plain dict: equal, so no check
  saw it, but a resumed node that relied on its default (`groups[key].append(...)`)
  raised `KeyError`, and a `Counter` lost `most_common()`. A tuple or a set there was
  already refused; such a mapping now is too, at its path. Declared as what it is
  (`defaultdict[str, list[str]]`), it reads back as itself.
- Errors: bytes that are not UTF-8 text (a file, an image) were refused with pydantic's
  words alone ("invalid utf-8 sequence"). The refusal now says why and how to store
  them (`pydantic.Base64Bytes`, or base64 in the model's config), which then round-trip.
- Errors: a graph that lives across runs (one run per visit, each going on from the state
  the last ended with), started again on the ended run's id, was refused with advice to
  read the result or fork; it now also says to start the next run under a run id of its
  own with the final state.

Held: a node that changed the state in place, applied its effect and then raised is
stored as `FullStatePersistence` holds it (the node `error`, with the state it was
stored with); continued in another process, it runs again from that state, not from
the changed one, and its effect applies once.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import Base64Bytes
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import NodeSnapshot
from pydantic_graph.persistence.in_mem import FullStatePersistence
from pydantic_graph_parts import persistence
from test_pydantic_graph_persistence import World, in_child

from remit_core import CheckpointInvalid, ForkWithoutIntent, arun_effect

# -- mappings that would read back as plain dicts -------------------------------------------


@dataclass
class Notes:
    groups: collections.defaultdict[str, list[str]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group(BaseNode[Notes, None, Any]):
    key: str

    async def run(self, ctx: GraphRunContext[Notes]) -> Group | Close:
        ctx.state.groups[self.key].append(self.key)  # a defaultdict: no KeyError
        return Close() if self.key == "b" else Group("b")


@dataclass
class Close(BaseNode[Notes, None, Any]):
    async def run(self, ctx: GraphRunContext[Notes]) -> End[Any]:
        return End(ctx.state.extra.get("result", "closed"))


NOTES = Graph(nodes=(Group, Close), name="notes")


@dataclass
class Count(BaseNode[Notes, None, Any]):
    async def run(self, ctx: GraphRunContext[Notes]) -> End[Any]:
        return End(collections.Counter(ctx.state.groups))


COUNTS = Graph(nodes=(Count,), name="counts")


@pytest.mark.parametrize(
    "value",
    [
        collections.defaultdict(int, {"seen": 1}),
        collections.Counter("aab"),
        collections.OrderedDict(first=1),
    ],
    ids=["defaultdict", "Counter", "OrderedDict"],
)
def test_a_mapping_that_would_read_back_as_a_plain_dict_is_refused_at_its_path(
    store_url: str, run_id: str, value: Any
) -> None:
    """P4: in an `Any` field, the mapping would read back as a plain dict. It was stored,
    and a resumed run had a dict where it had a `defaultdict` (`KeyError`) or a `Counter`.
    Refused at its path; nothing is written."""

    async def go() -> None:
        p = persistence(store_url, run_id, NOTES)
        with pytest.raises(CheckpointInvalid) as caught:
            await NOTES.run(Group("a"), state=Notes(extra={"tally": value}), persistence=p)
        assert caught.value.field == "state.extra.tally", caught.value
        assert "would read back as" in str(caught.value)
        assert await persistence(store_url, run_id, NOTES).load_all() == []

    asyncio.run(go())


def test_an_end_of_a_mapping_that_would_read_back_as_a_plain_dict_is_refused(
    store_url: str, run_id: str
) -> None:
    """P4: a node returns `End(Counter(...))` in a graph whose run-end type is `Any`: the
    run's result would read back as a plain dict. Refused at `result.data`; no `End` is
    stored and the node is marked `error`. A state whose `defaultdict` field declares
    itself (`defaultdict[str, list[str]]`) reads back as a `defaultdict` in another
    instance, which the continued node relies on."""

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as caught:
            await COUNTS.run(
                Count(), state=Notes(), persistence=persistence(store_url, run_id, COUNTS)
            )
        assert caught.value.field == "result.data", caught.value
        line = await persistence(store_url, run_id, COUNTS).load_all()
        assert [(type(s.node).__name__, s.status) for s in line] == [("Count", "error")]

        kept = f"{run_id}-kept"
        async with NOTES.iter(
            Group("a"), state=Notes(), persistence=persistence(store_url, kept, NOTES)
        ) as run:
            async for node in run:
                if isinstance(node, Group) and node.key == "b":
                    break
        later = persistence(store_url, kept, NOTES)
        (_, stored) = await later.load_all()
        assert isinstance(stored.state.groups, collections.defaultdict)
        async with NOTES.iter_from_persistence(later) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "closed"
        assert dict(run.result.state.groups) == {"a": ["a"], "b": ["b"]}

    asyncio.run(go())


# -- binary data --------------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff"


@dataclass
class Upload:
    name: str
    raw: bytes = b""
    data: Base64Bytes = b""


@dataclass
class Store(BaseNode[Upload, None, Base64Bytes]):
    async def run(self, ctx: GraphRunContext[Upload]) -> End[Base64Bytes]:
        return End(ctx.state.data)


UPLOADS = Graph(nodes=(Store,), name="uploads")


def test_binary_bytes_are_refused_saying_how_to_store_them(store_url: str, run_id: str) -> None:
    """P4 / errors: bytes that are not UTF-8 text are refused at their path (pydantic
    writes bytes as UTF-8 text), and the refusal says how to store them; it gave only
    pydantic's "invalid utf-8 sequence". Stored as it says (`Base64Bytes`), they read
    back as themselves, in the state and as the run's `End`."""

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as caught:
            await UPLOADS.run(
                Store(),
                state=Upload("logo.png", raw=PNG),
                persistence=persistence(store_url, run_id, UPLOADS),
            )
        assert caught.value.field == "state.raw", caught.value
        assert "Base64Bytes" in str(caught.value) and "base64" in str(caught.value)
        assert await persistence(store_url, run_id, UPLOADS).load_all() == []

        stored = f"{run_id}-b64"
        result = await UPLOADS.run(
            Store(),
            state=Upload("logo.png", data=PNG),
            persistence=persistence(store_url, stored, UPLOADS),
        )
        assert result.output == PNG
        (start, end) = await persistence(store_url, stored, UPLOADS).load_all()
        assert start.state.data == PNG and end.state.data == PNG
        assert end.result.data == PNG and isinstance(end.result.data, bytes)

    asyncio.run(go())


# -- a node that changed the state in place, then raised ---------------------------------------


@dataclass
class Tab:
    total: int = 0
    items: list[str] = field(default_factory=list)


TabCtx = GraphRunContext[Tab, World]


@dataclass
class Open(BaseNode[Tab, World, int]):
    async def run(self, ctx: TabCtx) -> Bill:
        ctx.deps.enter("open")
        ctx.state.total = 1
        ctx.state.items.append("open")
        return Bill()


@dataclass
class Bill(BaseNode[Tab, World, int]):
    async def run(self, ctx: TabCtx) -> End[int]:
        ctx.deps.enter("bill")
        sink = ctx.deps.sink

        async def apply(key: str) -> str:
            return sink.apply("bill", key)

        if ctx.deps.amount:  # (an in-memory run, `amount=0`, has no effect ledger)
            await arun_effect("bill", apply, reconcile=sink.reconcile)
        ctx.state.total += 5
        ctx.state.items.append("bill")
        ctx.deps.enter("bill.check")  # raises in the first run (`failing`)
        return End(ctx.state.total)


TABS = Graph(nodes=(Open, Bill), name="tabs")


def failing(node: str) -> None:
    if node == "bill.check":
        raise RuntimeError("the check failed after the state was changed")


def lines(snapshots: list[Any]) -> list[tuple[str, str, Any]]:
    return [
        (type(s.node).__name__, s.status, s.state)
        if isinstance(s, NodeSnapshot)
        else ("End", repr(s.result.data), s.state)
        for s in snapshots
    ]


def test_a_node_that_changed_the_state_and_raised_runs_again_from_its_stored_state(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """P1 / P4 / P2: `Bill` applied its effect, changed the state in place, then raised.
    What is stored is what `FullStatePersistence` holds for the same run: `Bill` marked
    `error`, with the state it was stored with, not the changed one. Continued in another
    process, `Bill` runs again from that state (the run ends at 6, not 11), `Open` does
    not, and the effect applies once."""
    world = World(tmp_path, on_enter=failing)
    (tmp_path / "full").mkdir()

    async def first() -> list[tuple[str, str, Any]]:
        full: FullStatePersistence[Tab, int] = FullStatePersistence()
        with pytest.raises(RuntimeError):
            await TABS.run(
                Open(),
                state=Tab(),
                deps=World(tmp_path / "full", amount=0, on_enter=failing),
                persistence=full,
            )
        with pytest.raises(RuntimeError):
            await TABS.run(
                Open(), state=Tab(), deps=world, persistence=persistence(store_url, run_id, TABS)
            )
        return lines(full.history)

    expected = asyncio.run(first())
    assert expected[-1] == ("Bill", "error", Tab(total=1, items=["open"]))
    assert lines(asyncio.run(persistence(store_url, run_id, TABS).load_all())) == expected

    async def go_on() -> Any:
        async with TABS.iter_from_persistence(
            persistence(store_url, run_id, TABS), deps=World(tmp_path)
        ) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output, run.result.state.total, run.result.state.items

    done = in_child(lambda: asyncio.run(go_on()))
    assert done.ok, done.summary()
    assert list(done.value) == [6, 6, ["open", "bill"]], done.value
    assert world.entered() == {"open": 1, "bill": 2, "bill.check": 2}
    assert world.sink.counts() == {"bill": 1}


# -- a graph that lives across runs --------------------------------------------------------------


@dataclass
class Visits:
    count: int = 0
    seen: list[str] = field(default_factory=list)


@dataclass
class Visit(BaseNode[Visits, None, int]):
    who: str

    async def run(self, ctx: GraphRunContext[Visits]) -> End[int]:
        ctx.state.count += 1
        ctx.state.seen.append(self.who)
        return End(ctx.state.count)


VISITS = Graph(nodes=(Visit,), name="visits")


def test_a_graph_that_lives_across_runs_is_told_how_to_go_on_from_its_end(
    store_url: str, run_id: str
) -> None:
    """Long-lived graphs: a customer's graph runs once per visit, each run going on from
    the state the last one ended with. A second run on the ended run's id is refused
    (`ForkWithoutIntent`, nothing written), and the refusal says how to go on: start the
    next run under a run id of its own with the last run's final state. It spoke of
    reading the result and of forks only. Done as it says, each visit goes on from the
    last one's state, and each run keeps its own history."""

    async def go() -> None:
        first = await VISITS.run(
            Visit("ann"), state=Visits(), persistence=persistence(store_url, run_id, VISITS)
        )
        again = persistence(store_url, run_id, VISITS)
        with pytest.raises(ForkWithoutIntent) as refused:
            await VISITS.run(Visit("bob"), state=first.state, persistence=again)
        text = str(refused.value)
        assert "the run has ended" in text and "run_id of its own" in text, text
        assert len(await persistence(store_url, run_id, VISITS).load_all()) == 2

        last = run_id
        for n, who in enumerate(("bob", "cy"), start=2):
            (*_, end) = await persistence(store_url, last, VISITS).load_all()
            last = f"{run_id}/{n}"
            result = await VISITS.run(
                Visit(who), state=end.state, persistence=persistence(store_url, last, VISITS)
            )
            assert result.output == n
        (*_, end) = await persistence(store_url, last, VISITS).load_all()
        assert end.state == Visits(count=3, seen=["ann", "bob", "cy"])
        (*_, end) = await persistence(store_url, run_id, VISITS).load_all()
        assert end.state == Visits(count=1, seen=["ann"])

    asyncio.run(go())
