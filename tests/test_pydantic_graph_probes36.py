"""Outside probes of `RemitStatePersistence`, round 36: a graph whose state, nodes or
result hold a type pydantic cannot store, and a state of the common value types
(datetime, UUID, Decimal, Enum, bytes, nested dataclasses, optional unions). The codec
decides alone, so these run on SQLite; the engines share it.

Found:

- Errors: a graph whose state, node or result declares a type pydantic has no schema for
  (a client or a lock kept in the state) raised pydantic's `PydanticSchemaGenerationError`
  naming the type alone ("Unable to generate pydantic-core schema for Conn") and advising
  `arbitrary_types_allowed`, which would not store it either. It now names the field
  (`state.conn`, `state.items.lock`, `node.lock` of node `Hold`, `result.data`) and says to
  keep such an object in `deps`; still a `PydanticSchemaGenerationError`, before anything
  is read or written.
- P4: in a state model that allows arbitrary types (`arbitrary_types_allowed=True`), an
  object of such a type was refused with `CheckpointInvalid.field` `state`, not its path:
  the search for the bad part built each field's type alone, which pydantic refuses for
  an arbitrary type, and stopped. It is now built as the model builds it: `state.conn`,
  `state.conns.0`, `state.by.a`, `state.inner.conn`, `result.data`.
- Errors: the state's dataclasses made in a function with `from __future__ import
  annotations` (a name their annotations use is the function's local) raised, at the
  run's first write, pydantic's "`TypeAdapter[...]` is not fully defined; call
  `.rebuild()` on the instance", of an adapter the user never sees. It is now a
  `PydanticUndefinedAnnotation` at `set_graph_types`, naming the name and the field
  (`state.items`).

Held: a state of datetimes (aware, naive), a date, a time, a timedelta, a UUID, Decimals
(`-0`, `1.000`), an Enum, bytes, a tuple, nested and optional dataclasses and an
`int | str | None` union reads back as itself, type for type, in another instance; a
value of another type in any of them is refused at its path, and nothing is stored.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import uuid
from dataclasses import dataclass, field, fields
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
import pytest
from conftest import engine_url
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core import Remit
from remit_core.errors import CheckpointInvalid
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def url(tmp_path: Path) -> str:
    return engine_url("sqlite", tmp_path)


class Conn:
    """A client, a lock, a socket: what pydantic has no schema for."""


# -- a type pydantic has no schema for ---------------------------------------------------


@dataclass
class Held:
    lock: Conn | None = None


@dataclass
class WithConn:
    n: int = 0
    conn: Conn | None = None


@dataclass
class WithHeld:
    n: int = 0
    items: list[Held] = field(default_factory=list)


@dataclass
class Tree:
    children: list[Tree] = field(default_factory=list)
    conn: Conn | None = None


@dataclass
class Plain:
    n: int = 0


@dataclass
class Ping(BaseNode[Any, None, Any]):
    async def run(self, ctx: GraphRunContext[Any]) -> End[Any]:
        return End(1)


@dataclass
class Hold(BaseNode[Any, None, Any]):
    lock: Conn | None = None

    async def run(self, ctx: GraphRunContext[Any]) -> End[Any]:
        return End(1)


def _graph(state: type, node: type = Ping, result: Any = int) -> Graph[Any, Any, Any]:
    return Graph(nodes=(node,), state_type=state, run_end_type=result)


@pytest.mark.parametrize(
    ("graph", "where"),
    [
        (_graph(WithConn), "state.conn"),
        (_graph(WithHeld), "state.items.lock"),
        (_graph(Tree), "state.conn"),
        (_graph(Plain, Hold), "node.lock of node Hold"),
        (_graph(Plain, result=Conn), "result.data"),
    ],
    ids=["state", "nested", "recursive", "node", "result"],
)
def test_a_type_pydantic_has_no_schema_for_is_named_at_its_field(
    url: str, run_id: str, graph: Graph[Any, Any, Any], where: str
) -> None:
    """Errors: a graph that declares a type pydantic cannot store raises pydantic's
    `PydanticSchemaGenerationError` (a `TypeError`) naming the field that declares it
    and saying to keep the object in `deps`; from `graph.run`, before anything is read
    or written (pydantic named the type alone, and advised `arbitrary_types_allowed`)."""
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, run_id)
    start = next(iter(graph.node_defs.values())).node()
    with pytest.raises(pydantic.PydanticSchemaGenerationError) as raised:
        asyncio.run(graph.run(start, state=graph.inferred_types[0](), persistence=p))
    message = str(raised.value)
    assert f"Conn, the type of {where}." in message, message
    assert "deps" in message
    assert isinstance(raised.value, TypeError)
    assert Remit(url).head(run_id) is None


# -- an arbitrary type in a model that allows it ------------------------------------------


@dataclass
class Wrapped:
    conn: Conn | None = None


class Session(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    n: int = 0
    conn: Conn | None = None
    conns: list[Conn] = []
    by: dict[str, Conn] = {}
    inner: Wrapped = Wrapped()


SET_CONN = {
    "state.conn": lambda s: setattr(s, "conn", Conn()),
    "state.conns.0": lambda s: setattr(s, "conns", [Conn()]),
    "state.by.a": lambda s: setattr(s, "by", {"a": Conn()}),
    "state.inner.conn": lambda s: setattr(s, "inner", Wrapped(Conn())),
}


@dataclass
class Open(BaseNode[Session, None, Any]):
    where: str

    async def run(self, ctx: GraphRunContext[Session]) -> Close | End[Any]:
        if self.where == "result.data":
            return End(Conn())
        SET_CONN[self.where](ctx.state)
        return Close()


@dataclass
class Close(BaseNode[Session, None, Any]):
    async def run(self, ctx: GraphRunContext[Session]) -> End[Any]:
        return End(1)


SESSION = Graph(nodes=(Open, Close), run_end_type=Any)


@pytest.mark.parametrize("where", [*SET_CONN, "result.data"])
def test_an_arbitrary_type_in_a_model_that_allows_it_is_refused_at_its_path(
    url: str, run_id: str, where: str
) -> None:
    """P4: a model that allows arbitrary types holds one (a connection a node kept):
    pydantic cannot write it, so it is refused with `CheckpointInvalid` at its own path
    (was `state`), the node that left it is marked `error`, and nothing follows it."""
    p = persistence(url, run_id, SESSION)
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(SESSION.run(Open(where), state=Session(), persistence=p))
    assert refused.value.field == where, refused.value
    assert shape(asyncio.run(persistence(url, run_id, SESSION).load_all())) == [("Open", "error")]


# -- a name that does not resolve ---------------------------------------------------------


def test_a_name_that_does_not_resolve_is_named_at_its_field(url: str, run_id: str) -> None:
    """Errors: classes made in a function under `from __future__ import annotations` (a
    name a dataclass's annotation uses is the function's local) raise
    `PydanticUndefinedAnnotation` naming the name and the field, from `set_graph_types`
    (was pydantic's "not fully defined; call `.rebuild()`" of Remit's own adapter, at
    the first write)."""

    @dataclass
    class Line:
        qty: int = 0

    @dataclass
    class Basket:
        lines: list[Line] = field(default_factory=list)

    @dataclass
    class Fill(BaseNode[Basket, None, int]):
        async def run(self, ctx: GraphRunContext[Basket]) -> End[int]:
            ctx.state.lines.append(Line(1))
            return End(1)

    graph = Graph(nodes=(Fill,))
    assert asyncio.run(graph.run(Fill(), state=Basket())).output == 1  # in memory, it runs
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, run_id)
    with pytest.raises(pydantic.PydanticUndefinedAnnotation) as raised:
        p.set_graph_types(graph)
    assert raised.value.name == "Line"
    assert "'Line', in the annotation of state.lines, is not defined" in str(raised.value)
    with pytest.raises(pydantic.PydanticUndefinedAnnotation):
        asyncio.run(graph.run(Fill(), state=Basket(), persistence=p))
    assert Remit(url).head(run_id) is None


# -- the common value types ---------------------------------------------------------------


class Tier(enum.Enum):
    GOLD = "gold"
    BASIC = 2


@dataclass
class Entry:
    at: dt.datetime
    amount: Decimal
    tag: int | str | None = None


@dataclass
class Ledger:
    id: uuid.UUID = field(default_factory=uuid.uuid4)
    at: dt.datetime = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    day: dt.date = dt.date(2024, 2, 29)
    time: dt.time = dt.time(1, 2, 3, 4)
    wait: dt.timedelta = dt.timedelta(days=1, microseconds=5)
    price: Decimal = Decimal("10.10")
    tier: Tier = Tier.BASIC
    blob: bytes = b"abc"
    last: Entry | None = None
    entries: list[Entry] = field(default_factory=list)
    note: int | str | None = None
    pair: tuple[int, str] = (1, "a")


BAD: dict[str, tuple[str, Any]] = {
    "state.price": ("price", "10.10"),
    "state.id": ("id", "not-a-uuid"),
    "state.tier": ("tier", "gold"),
    "state.at": ("at", "2024-01-01"),
    "state.pair": ("pair", [1, "a"]),
    "state.entries.1.at": ("entries", None),
    "state.last.tag": ("last", None),
}


@dataclass
class Book(BaseNode[Ledger, None, int]):
    bad: str = ""

    async def run(self, ctx: GraphRunContext[Ledger]) -> Settle:
        s = ctx.state
        india = dt.timezone(dt.timedelta(hours=5, minutes=30))
        s.last = Entry(dt.datetime(2024, 3, 3, 1, 2, 3, 999999, india), Decimal("1.000"), "7")
        s.entries.append(Entry(dt.datetime(2020, 1, 1), Decimal("-0"), 7))
        s.note, s.tier, s.blob = "8", Tier.GOLD, b"\x00text"
        if self.bad == "state.entries.1.at":
            s.entries.append(Entry("yesterday", Decimal(1)))  # type: ignore[arg-type]
        elif self.bad == "state.last.tag":
            s.last.tag = 1.5  # type: ignore[assignment]
        elif self.bad:
            name, value = BAD[self.bad]
            setattr(s, name, value)
        return Settle()


@dataclass
class Settle(BaseNode[Ledger, None, int]):
    async def run(self, ctx: GraphRunContext[Ledger]) -> End[int]:
        return End(len(ctx.state.entries))


LEDGER = Graph(nodes=(Book, Settle))


def test_common_value_types_read_back_as_themselves(url: str, run_id: str) -> None:
    """P1 / P4 (held): the state a node left, of every common value type, reads back in
    another instance equal and of the same type, field for field, nested ones too."""

    async def step() -> Ledger:
        state = Ledger()
        async with LEDGER.iter(
            Book(), state=state, persistence=persistence(url, run_id, LEDGER)
        ) as run:
            assert isinstance(await run.next(), Settle)
        return state

    ours = asyncio.run(step())
    read = asyncio.run(persistence(url, run_id, LEDGER).load_next())
    assert read is not None and isinstance(read.node, Settle)
    for f in fields(Ledger):
        mine, back = getattr(ours, f.name), getattr(read.state, f.name)
        assert back == mine and type(back) is type(mine), f.name
    assert read.state.last is not None and ours.last is not None
    assert read.state.last.at.utcoffset() == ours.last.at.utcoffset()
    assert str(read.state.entries[0].amount) == "-0" and str(read.state.last.amount) == "1.000"


@pytest.mark.parametrize("where", list(BAD))
def test_a_value_of_another_type_is_refused_at_its_path(url: str, run_id: str, where: str) -> None:
    """P4 (held): a value of another type in a typed field, nested or in a union, is
    refused at its path; the node is marked `error` and nothing follows it."""
    p = persistence(url, run_id, LEDGER)
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(LEDGER.run(Book(where), state=Ledger(), persistence=p))
    assert refused.value.field == where, refused.value
    assert shape(asyncio.run(persistence(url, run_id, LEDGER).load_all())) == [("Book", "error")]
