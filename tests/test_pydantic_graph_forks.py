"""Forks and fork tokens of `RemitStatePersistence`, against the real pydantic-graph 1.x
on SQLite, PostgreSQL and Redis.

- A fork is made only from a snapshot the reader can read (P4 before P3).
- A fork token names its line for every instance that holds it, also one created
  before another instance or process made that line (P3).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic_graph.persistence import NodeSnapshot
from test_pydantic_graph_persistence import Answer, Ask, World, drive, persistence, to_pause

from remit_core import CorruptRecord, VersionMismatch
from remit_core.conformance.adapter import Target
from remit_core.conformance.storage import corrupt_remit_checkpoint


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_a_fork_from_a_snapshot_the_reader_cannot_read_makes_no_branch(
    store_url: str, run_id: str, world: World, tmp_path: Path
) -> None:
    """P4: `fork(snapshot_id, token)` from a snapshot of another workflow version, or
    with altered bytes, raises the error its reading would raise, naming run and
    snapshot, before the branch is made: no branch is stored and the token stays free."""

    async def go() -> None:
        p = await to_pause(store_url, run_id, world)
        first, pause = (s.id for s in await p.load_all())
        with pytest.raises(VersionMismatch) as other:
            await persistence(store_url, run_id, workflow_version="v2").fork(pause, "what-if")
        assert run_id in str(other.value) and pause in str(other.value)
        target = Target(store_url, "remit", store_url, tmp_path, "t")
        corrupt_remit_checkpoint(target, run_id, first)
        with pytest.raises(CorruptRecord) as bad:
            await p.fork(first, "from-start")
        assert run_id in str(bad.value) and first in str(bad.value)
        assert [b.branch for b in p.remit.branches(run_id)] == ["main"]
        forked = await p.fork(pause, "what-if")  # the token was not used up
        await forked.resume(Answer("eve"))
        assert await drive(forked, world) == "paid 100"

    asyncio.run(go())


def test_an_instance_follows_its_tokens_line_made_after_it_was_created(
    store_url: str, run_id: str, world: World
) -> None:
    """P3: an instance created with a fork token before that token's branch existed
    (a worker set up while another process forks) works on that branch once it is
    made: it reads it, answers it and continues it, and never runs the main line's
    paused node."""

    async def go() -> None:
        p = await to_pause(store_url, run_id, world)
        pause = await p.paused()
        assert pause is not None
        early = persistence(store_url, run_id, fork_token="what-if")
        forked = await p.fork(pause.id, "what-if")
        assert await early.paused() is not None
        await early.resume(Answer("eve"))
        assert await forked.paused() is None  # the answer went to the fork
        assert isinstance((await early.load_all())[-1].node, Answer)
        assert await drive(early, world) == "paid 100"
        assert early.branch == forked.branch
        main = await persistence(store_url, run_id).load_all()
        assert isinstance(main[-1], NodeSnapshot) and isinstance(main[-1].node, Ask)
        assert main[-1].status == "created"  # main's pause is still open, never run
        assert await persistence(store_url, run_id).paused() is not None

    asyncio.run(go())
    assert world.entered() == {"start": 1, "answer": 1, "pay": 1, "pay.after_effect": 1, "done": 1}
