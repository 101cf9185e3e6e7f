"""Outside probes of `RemitStatePersistence`, round 29: sets, and enum members in fields
that also admit their value, in a run's state, its nodes and its `End`; on SQLite,
PostgreSQL and Redis.

Faults found:

- P4: a set and a frozenset are equal by `==`, so the round-trip check let one read back
  as the other. A set in a field declared `frozenset[str] | set[str]` was stored and read
  back as a frozenset (a resumed node's `tags.add(...)` raised `AttributeError`); a
  frozenset in `set[str] | frozenset[str]` read back as a set (no longer hashable). A
  tuple in `list[int] | tuple[int, ...]` was already refused; these are now too, at their
  path.
- P4: a set's members were compared by `==` alone, so a member that reads back as another
  passed: a `StrEnum` member in a `set[Any]` read back as its str, a datetime in a zone
  with daylight-saving time in a `frozenset[datetime]` at a fixed offset, and a naive
  datetime of the repeated hour (`fold=1`) an hour early. Refused as they are in a field
  or as a mapping's key, naming the set.
- P4: an enum member in a field declared with its enum and its value's type
  (`Color | str`, `Rank | int`) stays a member under pydantic's own validation, but its
  JSON value reads back as the `str` (the `int`): a resumed node's
  `isinstance(choice, Color)` turned false. It was stored because the `str` admits what
  is read back, as in a field declared `str` alone (where pydantic makes it a `str` too,
  and it still is stored). Refused at its path, in the state and in a node.

Held: sets whose members read back as themselves (ints and strs in `set[Any]`, members
of a `set[Color]` field, UTC datetimes, tuples in a `frozenset[tuple[int, int]]`) are
stored and read back equal and of their type, in another instance; a set in a field
declared `set[str]` alone, and a frozenset in `frozenset[str]`, keep their type; a str
in a `Color | str` field, an int in `Rank | int` and a member in `Color | None` read back
as themselves.
"""

from __future__ import annotations

import asyncio
import datetime
import enum
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core import CheckpointInvalid


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


class Rank(enum.IntEnum):
    HIGH = 3


@dataclass
class Tags:
    """A state of sets. Each field's default reads back as itself."""

    tags: frozenset[str] | set[str] = frozenset()
    frozen: set[str] | frozenset[str] = field(default_factory=set)
    anything: set[Any] = field(default_factory=set)
    colors: set[Color] = field(default_factory=set)
    moments: frozenset[datetime.datetime] = frozenset()
    pairs: frozenset[tuple[int, int]] = frozenset()
    plain: set[str] = field(default_factory=set)
    fixed: frozenset[str] = frozenset()
    choice: Color | str = ""
    rank: Rank | int = 0
    known: Color | None = None


@dataclass
class Label(BaseNode[Tags, None, Any]):
    choice: Color | str = ""

    async def run(self, ctx: GraphRunContext[Tags]) -> Review:
        return Review()


@dataclass
class Review(BaseNode[Tags, None, Any]):
    """The pause: a driver stops before it; a resumed run adds a tag."""

    async def run(self, ctx: GraphRunContext[Tags]) -> End[Any]:
        tags = ctx.state.plain if ctx.state.plain else ctx.state.frozen
        if isinstance(tags, set):
            tags.add("reviewed")
        return End(sorted(ctx.state.plain))


TAGS = Graph(nodes=(Label, Review), name="tags")


@dataclass
class Pick(BaseNode[Tags, None, frozenset[Any]]):
    async def run(self, ctx: GraphRunContext[Tags]) -> End[frozenset[Any]]:
        return End(frozenset({Color.BLUE}))


COLORS = Graph(nodes=(Pick,), name="colors")

PARIS = ZoneInfo("Europe/Paris")
#: The second 02:30 of the night Paris clocks go back, naive (as `fromtimestamp` gives it).
REPEATED = datetime.datetime(2026, 10, 25, 2, 30, fold=1)


async def to_review(url: str, run_id: str, state: Tags) -> None:
    """Run `TAGS` from `Label` with `state` until it pauses before `Review`."""
    async with TAGS.iter(Label(), state=state, persistence=persistence(url, run_id, TAGS)) as run:
        async for node in run:
            if isinstance(node, Review):
                break


@pytest.mark.parametrize(
    ("state", "path", "read"),
    [
        (Tags(tags={"a"}), "state.tags", "frozenset({'a'})"),
        (Tags(frozen=frozenset({"a"})), "state.frozen", "{'a'}"),
    ],
    ids=["set-as-frozenset", "frozenset-as-set"],
)
def test_a_set_that_would_read_back_as_a_frozenset_is_refused_at_its_path(
    store_url: str, run_id: str, state: Tags, path: str, read: str
) -> None:
    """P4: a set in a `frozenset[str] | set[str]` field read back as a frozenset, equal by
    `==`, so it was stored; the resumed run's node then had no `add`. The mirror (a
    frozenset in `set[str] | frozenset[str]`, read back unhashable) too. Refused at the
    field's path, as a tuple in `list[int] | tuple[int, ...]` is; nothing is written."""

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as caught:
            await to_review(store_url, run_id, state)
        assert caught.value.field == path, caught.value
        assert f"would read back as {read}" in str(caught.value)
        assert await persistence(store_url, run_id, TAGS).load_all() == []

    asyncio.run(go())


@pytest.mark.parametrize(
    ("state", "path"),
    [
        (Tags(anything={Color.RED, "x"}), "state.anything"),
        (
            Tags(moments=frozenset({datetime.datetime(2026, 7, 1, 12, tzinfo=PARIS)})),
            "state.moments",
        ),
        (Tags(moments=frozenset({REPEATED})), "state.moments"),
    ],
    ids=["enum-member-in-any", "daylight-saving-zone", "repeated-hour"],
)
def test_a_set_whose_members_would_read_back_as_others_is_refused(
    store_url: str, run_id: str, state: Tags, path: str
) -> None:
    """P4: a set is equal to another whose members are equal by `==`: a `StrEnum` member
    and its str, a datetime in Paris and the same instant at a fixed offset, the second
    02:30 and the first. Each read back as the other, and was stored. Refused at the set's
    path, as such a value is in a field or as a mapping's key; nothing is written."""

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as caught:
            await to_review(store_url, run_id, state)
        assert caught.value.field == path, caught.value
        assert "would read back as" in str(caught.value)
        assert await persistence(store_url, run_id, TAGS).load_all() == []

    asyncio.run(go())


def test_an_end_holding_a_set_of_enum_members_is_refused_and_the_node_marked_error(
    store_url: str, run_id: str
) -> None:
    """P4: the run's result (an `End` of run-end type `frozenset[Any]`) is a set of
    `StrEnum` members, which would read back as strs. Refused at `result.data`; no `End` is stored,
    and the node that returned it is marked `error`."""

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as caught:
            await COLORS.run(
                Pick(), state=Tags(), persistence=persistence(store_url, run_id, COLORS)
            )
        assert caught.value.field == "result.data", caught.value
        line = await persistence(store_url, run_id, COLORS).load_all()
        assert shape(line) == [("Pick", "error")]

    asyncio.run(go())


@pytest.mark.parametrize(
    ("node", "state", "path"),
    [
        (Label(), Tags(choice=Color.RED), "state.choice"),
        (Label(), Tags(rank=Rank.HIGH), "state.rank"),
        (Label(choice=Color.BLUE), Tags(), "node.choice"),
    ],
    ids=["str-enum-or-str", "int-enum-or-int", "node-field"],
)
def test_an_enum_member_in_a_field_of_its_enum_or_str_is_refused(
    store_url: str, run_id: str, node: Label, state: Tags, path: str
) -> None:
    """P4: a field declared `Color | str` keeps a `Color` member as a member (pydantic's
    own validation does), but its JSON value reads back as the `str`: a resumed node's
    `isinstance(choice, Color)` turned false. It was stored, as the `str` alone admits the
    value read back. Refused at its path, in the state and in a node; nothing is written."""

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as caught:
            await TAGS.initialize(node, persistence(store_url, run_id, TAGS), state=state)
        assert caught.value.field == path, caught.value
        assert "would read back as" in str(caught.value)
        assert await persistence(store_url, run_id, TAGS).load_all() == []

    asyncio.run(go())


def test_sets_whose_members_read_back_as_themselves_are_stored(store_url: str, run_id: str) -> None:
    """P4 holds for sets that round-trip: ints and strs in `set[Any]`, members of a
    `set[Color]`, UTC datetimes, tuples in `frozenset[tuple[int, int]]`, a set in
    `set[str]`, a frozenset in `frozenset[str]` and in `frozenset[str] | set[str]`. Read by
    another instance, each is equal and of its type, and the resumed node adds its tag."""
    utc = datetime.datetime(2026, 7, 1, 10, tzinfo=datetime.timezone.utc)
    state = Tags(
        tags=frozenset({"a"}),
        anything={1, "x"},
        colors={Color.RED},
        moments=frozenset({utc}),
        pairs=frozenset({(1, 2)}),
        plain={"p"},
        fixed=frozenset({"f"}),
        choice="free",
        rank=7,
        known=Color.BLUE,
    )

    async def go() -> None:
        await to_review(store_url, run_id, state)
        later = persistence(store_url, run_id, TAGS)
        (_, paused) = await later.load_all()
        read = paused.state
        assert read == state
        names = ("tags", "anything", "colors", "moments", "pairs", "plain", "fixed", "choice")
        for name in (*names, "rank", "known"):
            assert type(getattr(read, name)) is type(getattr(state, name)), name
        assert [type(c) for c in read.colors] == [Color]
        assert [type(p) for p in read.pairs] == [tuple]
        async with TAGS.iter_from_persistence(later) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == ["p", "reviewed"]
        assert run.result.state.plain == {"p", "reviewed"}

    asyncio.run(go())
