"""Round 35 of the pydantic-graph probes: a run's state read in processes other than the
one that wrote it, where Python orders a set's members by a hash that each process seeds
anew; on SQLite, PostgreSQL and Redis, in real processes started with their own
`PYTHONHASHSEED`.

Found:

- P4 / liveness: a state holding a set of several kinds of model (a wallet's
  `set[Card | Account]` of frozen dataclasses) is written in the writer's iteration order,
  and a process of another hash seed reads the set back in another order (so, at times,
  does the writer itself: the set read is built afresh). The check for a field removed
  since the run was written (round 31) matched a set's members by position, so it found
  a `Card`'s `brand` where the reader writes an `Account` again, and raised
  `VersionMismatch` ("holds state.methods.2.brand, which this graph's types do not
  read"): before, `paused()`, `resume()`, `load_all()` and `iter_from_persistence` failed
  in every process whose order differed, most processes but the writer's, so a paused
  run could never be answered or resumed; after, a set's member is matched with any
  member written again that has its keys, and every process reads, answers and ends the
  run.

Held: a field removed from one kind of the set's members (a `Card` that lost `holder`)
is still refused under the same workflow version, naming the member's path.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence

from remit_core import VersionMismatch


@dataclass(frozen=True)
class Card:
    brand: str
    last4: str
    holder: str = ""


@dataclass(frozen=True)
class Account:
    iban: str


@dataclass
class Wallet:
    methods: set[Card | Account] = field(default_factory=set)
    paid_with: str | None = None


@dataclass
class Collect(BaseNode[Wallet, None, str]):
    async def run(self, ctx: GraphRunContext[Wallet]) -> Choose:
        ctx.state.methods |= {
            Card("visa", "4242", "ann"),
            Card("amex", "0005", "ann"),
            Account("DE89370400440532013000"),
            Account("FR1420041010050500013M02606"),
        }
        return Choose()


@dataclass
class Choose(BaseNode[Wallet, None, str]):
    """The pause: the customer picks a method; the answer comes as `Pay(choice)`."""

    async def run(self, ctx: GraphRunContext[Wallet]) -> Pay:
        raise RuntimeError("answered with resume(Pay(...))")


@dataclass
class Pay(BaseNode[Wallet, None, str]):
    choice: str

    async def run(self, ctx: GraphRunContext[Wallet]) -> End[str]:
        (method,) = [m for m in ctx.state.methods if self.choice == key(m)]
        ctx.state.paid_with = self.choice
        return End(f"paid with {method!r} of {len(ctx.state.methods)} methods")


def key(method: Card | Account) -> str:
    """How a customer names a method: a card by its last four digits, an account by IBAN."""
    return method.last4 if isinstance(method, Card) else method.iban


WALLETS = Graph(nodes=(Collect, Choose, Pay), name="wallets")


def kinds(wallet: Wallet) -> list[str]:
    """The kinds of the wallet's methods in the set's iteration order."""
    return [type(m).__name__ for m in wallet.methods]


async def _as(role: str, url: str, run_id: str) -> dict[str, Any]:
    """What one process does with the run: `pause` runs it to the pause, `read` reads it
    there, `answer` answers it and runs it to its end."""
    p = persistence(url, run_id, WALLETS)
    if role == "pause":
        async with WALLETS.iter(Collect(), state=Wallet(), persistence=p) as run:
            async for node in run:
                if isinstance(node, Choose):
                    break
        return {"kinds": kinds(run.state)}
    pause = await p.paused()
    assert pause is not None, "the run is not paused"
    line = await p.load_all()
    assert [s.state for s in line][-1] == pause.state
    if role == "read":
        return {"kinds": kinds(pause.state)}
    await p.resume(Pay("4242"), pause_id=pause.id)
    async with WALLETS.iter_from_persistence(p) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return {"kinds": kinds(pause.state), "output": run.result.output}


_CHILD = (
    "import asyncio, json, sys; sys.path.insert(0, sys.argv[1]); "
    "import test_pydantic_graph_probes35 as t; "
    "print(json.dumps(asyncio.run(t._as(*sys.argv[2:]))))"
)


def in_process(seed: int, role: str, url: str, run_id: str) -> dict[str, Any]:
    """`_as(role, ...)` in a new Python process whose hash seed is `seed`; its report, or
    the error it ended with."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(Path(__file__).parent), role, url, run_id],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": str(seed), "REMIT_FAILPOINTS": ""},
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_a_set_of_several_kinds_of_model_is_read_in_a_process_of_another_hash_seed(
    url: str,
) -> None:
    """P4 / liveness: a run paused in one process with a `set[Card | Account]` in its state
    is read at its pause, answered and run to its end by processes of other hash seeds,
    which iterate the set in other orders than the one it was written in."""
    run_id = f"pg35-{uuid.uuid4().hex}"
    written = in_process(1, "pause", url, run_id)
    assert "error" not in written, written
    readers = [in_process(seed, "read", url, run_id) for seed in (2, 3, 4)]
    assert all("error" not in r for r in readers), readers
    answered = in_process(5, "answer", url, run_id)
    assert "error" not in answered, answered
    # The case at issue: some process iterates the set in another order of kinds.
    orders = [r["kinds"] for r in (*readers, answered)]
    assert any(order != written["kinds"] for order in orders), (written, orders)
    assert sorted(written["kinds"]) == ["Account", "Account", "Card", "Card"]
    assert answered["output"] == (
        "paid with Card(brand='visa', last4='4242', holder='ann') of 4 methods"
    )
    line = asyncio.run(persistence(url, run_id, WALLETS).load_all())
    assert [s.kind for s in line] == ["node", "node", "node", "end"]
    assert line[-1].state.paid_with == "4242" and len(line[-1].state.methods) == 4


# -- a field removed from one kind of a set's members ----------------------------------------


@dataclass(frozen=True)
class PlainCard:
    """`Card` without its `holder`."""

    brand: str
    last4: str


@dataclass
class PlainWallet:
    """`Wallet` of `PlainCard`s."""

    methods: set[PlainCard | Account] = field(default_factory=set)
    paid_with: str | None = None


def without_holder() -> Graph[Any, None, str]:
    """The wallet graph as deployed next, whose cards lost `holder`: one workflow version."""
    return Graph(nodes=(Collect, Choose, Pay), state_type=PlainWallet, name="wallets")


def test_a_field_removed_from_one_kind_of_a_sets_members_is_still_refused(url: str) -> None:
    """P4: matched by keys, not by position, a set's members still tell a field the reader
    lost: a `Card` written with `holder`, read as a card without it, is `VersionMismatch`
    naming that member's `holder`; nothing is written and the run stays paused."""
    run_id = f"pg35-{uuid.uuid4().hex}"
    assert asyncio.run(_as("pause", url, run_id))["kinds"].count("Card") == 2
    reader = persistence(url, run_id, without_holder())
    with pytest.raises(VersionMismatch) as refused:
        asyncio.run(reader.load_all())
    assert refused.value.run_id == run_id
    text = str(refused.value)
    assert "state.methods." in text and ".holder, which this graph's types do not read" in text
    with pytest.raises(VersionMismatch):
        asyncio.run(reader.paused())
    line = asyncio.run(persistence(url, run_id, WALLETS).load_all())
    assert [s.kind for s in line] == ["node", "node"] and line[-1].status == "created"
