"""Outside probes of `RemitStatePersistence`, round 19: refusals that named the wrong
value or said nothing a user could act on; on SQLite, PostgreSQL and Redis.

- P4 / errors: a secret (`SecretStr`, `SecretBytes`, `Secret[int]`) in the state, a node
  or a run's result is written by pydantic masked as `'**********'`. It was refused, but
  saying `SecretStr('**********') would read back as SecretStr('**********')` (a value
  read back as itself), or, for a `Secret[int]`, that an integer was expected. It is
  refused at the secret's path now, saying it is a secret written masked.
- P4 / errors: an int of more digits than pydantic's JSON reader reads (`10**5000`) was
  refused as "nested too deeply", at the path of whichever value was nested deepest: it
  named another field (`state.notes.0.0`) than the one holding the int. It names the int's
  own path now, and says it is too large to read back.
- P4 / errors: a node with a field named `node_id` (the key pydantic-graph writes a node's
  class under) was refused as `'mine' would read back as 'Go'`. It says why now.
- Framework API / errors: a driver that edits its next node by building a new one
  (`dataclasses.replace` of a frozen node) and hands it to `run.next()` got
  `ForkWithoutIntent` saying the run "already has a head" and "starting a new node there"
  is a fork, naming neither the node it passed nor how to edit one. It names both ids now
  and says how (give the new node the stored id).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel, Secret, SecretBytes, SecretStr, field_serializer
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core import CheckpointInvalid, ForkWithoutIntent
from remit_pydantic_graph import RemitStatePersistence

# -- secrets --------------------------------------------------------------------------------


class Vault(BaseModel):
    """A state as users write it: a secret beside plain data."""

    owner: str = ""
    token: SecretStr | None = None
    pins: list[Secret[int]] = []
    shown: SecretStr | None = None

    @field_serializer("shown", when_used="json")
    def _reveal(self, value: SecretStr | None) -> str | None:
        return None if value is None else value.get_secret_value()


@dataclass
class Login(BaseNode[Vault, None, Any]):
    """Puts `what` into the state (or into its next node, or into the run's result)."""

    what: str = ""

    async def run(self, ctx: GraphRunContext[Vault]) -> Use | End[Any]:
        if self.what == "token":
            ctx.state.token = SecretStr("hunter2")
        if self.what == "pins":
            ctx.state.pins = [Secret[int](1234)]
        if self.what == "shown":
            ctx.state.shown = SecretStr("visible")
        if self.what == "result":
            return End(SecretStr("hunter2"))
        return Use(key=SecretBytes(b"k") if self.what == "node" else None)


@dataclass
class Use(BaseNode[Vault, None, Any]):
    key: SecretBytes | None = None

    async def run(self, ctx: GraphRunContext[Vault]) -> End[Any]:
        return End(ctx.state.owner)


VAULT = Graph(nodes=(Login, Use), name="vault")


async def stop_after_login(p: RemitStatePersistence, what: str) -> None:
    async with VAULT.iter(Login(what), state=Vault(owner="ann"), persistence=p) as run:
        async for node in run:
            if isinstance(node, Use):
                return


@pytest.mark.parametrize(
    ("what", "where", "kind"),
    [
        ("token", "state.token", "SecretStr"),
        ("pins", "state.pins.0", "Secret"),
        ("node", "node.key", "SecretBytes"),
        ("result", "result.data", "SecretStr"),
    ],
)
def test_a_secret_is_refused_at_its_path_saying_it_is_written_masked(
    store_url: str, run_id: str, what: str, where: str, kind: str
) -> None:
    """P4: a secret left in the state, in the next node or in the run's result is refused
    with `CheckpointInvalid` at its own path, saying it is a secret that pydantic writes
    masked (not that the mask would read back as the mask, or that an int was expected);
    nothing after the node is written and the node is marked `error`."""

    async def go() -> None:
        p = persistence(store_url, run_id, VAULT)
        with pytest.raises(CheckpointInvalid) as refused:
            await stop_after_login(p, what)
        error = refused.value
        assert error.field == where, str(error)
        assert f"is a secret ({kind})" in str(error) and "masked" in str(error), str(error)
        assert "read back as SecretStr" not in str(error) and "valid integer" not in str(error)
        assert error.run_id == run_id
        assert shape(await persistence(store_url, run_id, VAULT).load_all()) == [("Login", "error")]

    asyncio.run(go())


def test_a_secret_with_a_serializer_that_writes_its_value_is_stored(
    store_url: str, run_id: str
) -> None:
    """P4: a secret whose model declares a serializer writing its value reads back as
    itself, so it is stored (only a secret that would read back as its mask is refused)."""

    async def go() -> None:
        await stop_after_login(persistence(store_url, run_id, VAULT), "shown")
        line = await persistence(store_url, run_id, VAULT).load_all()
        assert shape(line) == [("Login", "success"), ("Use", "created")]
        shown = line[-1].state.shown
        assert isinstance(shown, SecretStr) and shown.get_secret_value() == "visible"

    asyncio.run(go())


# -- ints too large to read back ----------------------------------------------------------------


@dataclass
class Ledger:
    notes: list[list[str]] = field(default_factory=lambda: [["opened"]])
    total: int = 0
    extra: Any = None


@dataclass
class Book(BaseNode[Ledger, None, int]):
    """Books 10 to the power `digits` into the field `into`."""

    into: str = "total"
    digits: int = 0

    async def run(self, ctx: GraphRunContext[Ledger]) -> Close:
        amount = 10**self.digits
        if self.into == "extra":
            ctx.state.extra = {"carry": amount}
        else:
            setattr(ctx.state, self.into, amount)
        return Close()


@dataclass
class Close(BaseNode[Ledger, None, int]):
    async def run(self, ctx: GraphRunContext[Ledger]) -> End[int]:
        return End(1)


LEDGER = Graph(nodes=(Book, Close), name="ledger")


@pytest.mark.parametrize(
    ("into", "where"), [("total", "state.total"), ("extra", "state.extra.carry")]
)
def test_an_int_too_large_to_read_back_is_refused_at_its_own_path(
    store_url: str, run_id: str, into: str, where: str
) -> None:
    """P4: an int pydantic writes but its JSON reader refuses (more digits than it reads)
    is refused at the path of that int, saying it is too large, not as "nested too deeply"
    at the path of another field; nothing after the node is written; a value that fits is
    then stored by another run."""

    async def drive(run: str, digits: int) -> None:
        p = persistence(store_url, run, LEDGER)
        async with LEDGER.iter(Book(into, digits), state=Ledger(), persistence=p) as graph_run:
            async for node in graph_run:
                if isinstance(node, Close):
                    return

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as refused:
            await drive(run_id, 5000)
        error = refused.value
        assert error.field == where, str(error)
        assert "too large" in str(error) and "nested" not in str(error), str(error)
        assert shape(await persistence(store_url, run_id, LEDGER).load_all()) == [("Book", "error")]
        await drive(f"{run_id}-fits", 100)
        line = await persistence(store_url, f"{run_id}-fits", LEDGER).load_all()
        stored = line[-1].state
        assert (stored.total if into == "total" else stored.extra["carry"]) == 10**100

    asyncio.run(go())


# -- a node field that clashes with pydantic-graph's own key -------------------------------


@dataclass
class Route(BaseNode[Ledger, None, int]):
    """A node with a field named as the key pydantic-graph writes a node's class under."""

    node_id: str = "eu-1"

    async def run(self, ctx: GraphRunContext[Ledger]) -> End[int]:
        return End(0)


ROUTES = Graph(nodes=(Route,), name="routes")


def test_a_node_field_named_node_id_is_refused_saying_why(store_url: str, run_id: str) -> None:
    """P4 / errors: a node whose field `node_id` holds anything but its class's name is
    refused at `node.node_id`, saying the field clashes with the key pydantic-graph writes
    the node's class under; nothing is written."""

    async def go() -> None:
        p = persistence(store_url, run_id, ROUTES)
        with pytest.raises(CheckpointInvalid) as refused:
            await ROUTES.run(Route(), state=Ledger(), persistence=p)
        error = refused.value
        assert error.field == "node.node_id", str(error)
        assert "the key pydantic-graph writes the node's class under" in str(error)
        assert "rename the field" in str(error)
        assert await persistence(store_url, run_id, ROUTES).load_all() == []

    asyncio.run(go())


# -- a driver that rebuilds its next node ------------------------------------------------------


@dataclass(frozen=True)
class Raise(BaseNode[Ledger, None, int]):
    async def run(self, ctx: GraphRunContext[Ledger]) -> Cap:
        ctx.state.total += 7
        return Cap(limit=100)


@dataclass(frozen=True)
class Cap(BaseNode[Ledger, None, int]):
    """A frozen node: a driver edits it only by building a new one (`dataclasses.replace`)."""

    limit: int = 0

    async def run(self, ctx: GraphRunContext[Ledger]) -> End[int]:
        return End(min(ctx.state.total, self.limit))


CAPS = Graph(nodes=(Raise, Cap), name="caps")


def test_a_driver_handing_run_next_a_rebuilt_next_node_is_told_what_to_do(
    store_url: str, run_id: str
) -> None:
    """Framework API / errors: pydantic-graph's docs let a driver edit the next node before
    `run.next(node)`; a frozen node is edited with `dataclasses.replace`, which makes a new
    node with a new snapshot id. Running it would leave the stored node never run (P1), so
    it is refused with `ForkWithoutIntent`, which now says so: that the node passed is a new
    `Cap` in place of the stored one (named by its id), and how to edit it (give it the
    stored id). Nothing is written, and following the advice runs the edited node once."""

    async def go() -> None:
        p = persistence(store_url, run_id, CAPS)
        async with CAPS.iter(Raise(), state=Ledger(), persistence=p) as run:
            stored = await run.next()
            assert isinstance(stored, Cap)
            edited = dataclasses.replace(stored, limit=5)
            with pytest.raises(ForkWithoutIntent) as refused:
                await run.next(edited)
            message = str(refused.value)
            assert refused.value.checkpoint_id == stored.get_snapshot_id()
            assert f"run.next() got a new Cap node (snapshot id {edited.get_snapshot_id()!r})" in (
                message
            ), message
            assert f"node.set_snapshot_id({stored.get_snapshot_id()!r})" in message, message
            assert shape(await persistence(store_url, run_id, CAPS).load_all()) == [
                ("Raise", "success"),
                ("Cap", "created"),
            ]
            edited.set_snapshot_id(stored.get_snapshot_id())
            assert await run.next(edited) == End(5)
        line = await persistence(store_url, run_id, CAPS).load_all()
        assert shape(line) == [("Raise", "success"), ("Cap", "success"), ("End", "end")]

    asyncio.run(go())
