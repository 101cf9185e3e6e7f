"""LlamaIndex probes, round 19, on SQLite, PostgreSQL and Redis.

`rt.update_state(workflow, run_id, {})`, or an edit setting the values the state
already holds, committed a new head all the same: the history grew for nothing, and
every parked copy of the run in another runtime, thread or process took the moved
head for the run answered elsewhere and ended with `ResumeConflict`, so a no-op edit
stopped the handler a user was about to answer. An edit that changes nothing now
commits nothing and returns the head's checkpoint id.

`rt.checkpoints(run_id)` listed the stored records unverified: a checkpoint whose
stored metadata was altered was listed with the status it was given (a parked
checkpoint as "completed"), and one of the wrong shape raised a bare `TypeError`.
It now verifies each record as the other reads do: `CorruptRecord` naming the run
and the checkpoint.

`RemitRuntime(accept_versions="v1")` took the string as the versions "v" and "1",
so checkpoints written by "v1" were refused and ones of "v" read, without a word;
versions that are not str matched nothing. A bad `lease`, `workflow_version` or
`schema` (and the server store's URL and lease) failed only at the first run or
write. Each is now refused where the runtime or store is made, naming the option.

`rt.update_state` of a run a step of this very process was running refused with
the core's "retry after its lease expires", which never comes while the process
renews the lease; the refusal now says the run is running in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from llamaindex_parts import until_parked
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.events import HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core import codec
from remit_core.errors import CorruptRecord, ResumeConflict, VersionMismatch
from remit_llamaindex import RemitRuntime

GUARD = 20.0


def new_run() -> str:
    return f"probe19-{uuid.uuid4().hex[:12]}"


class Count(BaseModel):
    n: int = 0


class Asks(Workflow):
    @step
    async def ask(self, ctx: Context[Count], ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=f"{answer.response}:{await ctx.store.get('n')}")


# -- an edit that changes nothing ----------------------------------------------------------


def test_an_edit_that_changes_nothing_commits_nothing_and_stops_no_parked_copy(
    url: str,
) -> None:
    """No values, or the values the state holds, from another runtime or through the
    parked copy: the head stays, the history does not grow, and the handler parked in
    the first runtime still takes its answer after the pace at which parked copies look
    at the stored head (a moved head would have ended it with `ResumeConflict`). An edit
    that changes a value still commits, and the handler goes on from it."""
    run = new_run()

    async def scenario() -> None:
        # Parked copies look at the head every lease / 3 = 1 s; a lease this long also
        # keeps the run's claim, once answered, through a loaded machine's pauses.
        rt = RemitRuntime(url, lease=3.0)
        flow = Asks(runtime=rt)
        handler = flow.run(run_id=run)
        await until_parked(rt, run)
        before = [c.checkpoint_id for c in rt.checkpoints(run)]
        other = RemitRuntime(url)
        for values in ({}, {"n": 0}):
            assert await other.update_state(Asks(runtime=other), run, values) == before[0]
        assert await rt.update_state(flow, run, {"n": 0}) == before[0]
        assert [c.checkpoint_id for c in rt.checkpoints(run)] == before
        await asyncio.sleep(2.5)
        assert not handler.is_done()
        edited = await rt.update_state(flow, run, {"n": 7})
        assert edited != before[0] and rt.checkpoints(run)[0].checkpoint_id == edited
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(handler, GUARD) == "ada:7"

    asyncio.run(scenario())


# -- rt.checkpoints of altered records -------------------------------------------------------


def _edit_metadata(url: str, run_id: str, checkpoint_id: str, **changes: Any) -> None:
    """Change a stored checkpoint's metadata in place, as a writer of the store could."""
    if url.startswith("redis://"):
        from redis import Redis

        from remit_core.stores.redis import run_prefix

        client = Redis.from_url(url)
        key, field = run_prefix(run_id) + "ck", f"{checkpoint_id}\x00"
        head, _, state = client.hget(key, field).partition(b"\n")
        header = codec.loads(head)
        header[5] = {**header[5], **changes}
        client.hset(key, field, codec.dumps(header, exact=False) + b"\n" + state)
        client.close()
        return
    where = "WHERE run_id = {0} AND checkpoint_id = {0}"
    if url.startswith("sqlite:///"):
        conn: Any = sqlite3.connect(url.removeprefix("sqlite:///"))
        mark = "?"
    else:
        conn = psycopg.connect(url, autocommit=True)
        mark = "%s"
    with contextlib.closing(conn):
        select = f"SELECT metadata FROM remit_checkpoints {where.format(mark)}"
        (text,) = conn.execute(select, (run_id, checkpoint_id)).fetchone()
        meta = {**codec.loads(text.encode()), **changes}
        update = f"UPDATE remit_checkpoints SET metadata = {mark} {where.format(mark)}"
        conn.execute(update, (codec.dumps(meta, exact=False).decode(), run_id, checkpoint_id))
        conn.commit()


@pytest.mark.parametrize(
    "changes", [{"status": "completed"}, {"next": 5}], ids=["status", "next-of-a-wrong-type"]
)
def test_checkpoints_of_an_altered_record_is_corrupt_record_naming_it(
    url: str, changes: dict[str, Any]
) -> None:
    """A checkpoint below the head whose stored metadata was altered is refused by the
    listing as by the other reads, naming run and checkpoint, rather than listed with
    the status it was given or failing with a bare `TypeError`."""
    run = new_run()

    async def scenario() -> None:
        rt = RemitRuntime(url)
        handler = Asks(runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(handler, GUARD) == "ada:0"
        parked = next(c for c in rt.checkpoints(run) if c.status == "waiting")
        _edit_metadata(url, run, parked.checkpoint_id, **changes)
        with pytest.raises(CorruptRecord) as refused:
            rt.checkpoints(run)
        assert (refused.value.run_id, refused.value.checkpoint_id) == (
            run,
            parked.checkpoint_id,
        )
        assert rt.status(run) == "completed"  # (the head itself is intact)

    asyncio.run(scenario())


# -- a runtime's or a store's configuration, refused where it is made -----------------------


class Once(Workflow):
    @step
    async def go(self, ev: StartEvent) -> StopEvent:
        return StopEvent(result="done")


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"accept_versions": "v1"}, TypeError, "accept_versions"),
        ({"accept_versions": [1]}, TypeError, "accept_versions"),
        ({"workflow_version": 2}, TypeError, "workflow_version"),
        ({"lease": 0}, ValueError, "lease"),
        ({"lease": "3"}, TypeError, "lease"),
        ({"schema": Count}, TypeError, "schema"),
    ],
    ids=[
        "versions-as-a-str",
        "versions-not-str",
        "version-not-str",
        "lease-0",
        "lease-str",
        "schema-a-model",
    ],
)
def test_a_runtime_configured_wrongly_is_refused_where_it_is_made_naming_the_option(
    tmp_path: Path, options: dict[str, Any], error: type[Exception], named: str
) -> None:
    """`accept_versions="v1"` was taken as the versions "v" and "1" (a checkpoint of "v1"
    then refused, one of "v" accepted), and a version that is not a str matched nothing,
    both without a word; a bad lease, version or schema failed only at the first run."""
    with pytest.raises(error, match=named):
        RemitRuntime(f"sqlite:///{tmp_path}/remit.db", **options)


def test_accepted_versions_given_as_a_collection_still_read_those_checkpoints(url: str) -> None:
    """A run written by "v1" is read by a runtime of "v2" that accepts ["v1"] (and refused
    by one that does not), as before."""
    run = new_run()

    async def scenario() -> None:
        rt = RemitRuntime(url, workflow_version="v1")
        assert await Once(runtime=rt).run(run_id=run) == "done"
        assert RemitRuntime(url, workflow_version="v2", accept_versions=["v1"]).status(run) == (
            "completed"
        )
        with pytest.raises(VersionMismatch):
            RemitRuntime(url, workflow_version="v2", accept_versions=("v0",)).status(run)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"url": "sqlte:///remit.db"}, ValueError),
        ({"lease": 0}, ValueError),
        ({"lease": "3"}, TypeError),
    ],
    ids=["url", "lease-0", "lease-str"],
)
def test_a_workflow_store_configured_wrongly_is_refused_where_it_is_made(
    options: dict[str, Any], error: type[Exception]
) -> None:
    """The server's store took any URL and lease, and failed at the server's first write."""
    from remit_llamaindex.server import RemitWorkflowStore

    with pytest.raises(error, match="url|URL|lease"):
        RemitWorkflowStore(**{"url": "sqlite:///remit.db", **options})


# -- an edit of a run this process drives ---------------------------------------------------


class Slow(Workflow):
    @step
    async def go(self, ctx: Context[Count], ev: StartEvent) -> StopEvent:
        await asyncio.sleep(1.0)
        return StopEvent(result=await ctx.store.get("n"))


def test_an_edit_of_a_run_a_step_of_this_process_runs_says_so(url: str) -> None:
    """The refusal told the user to retry once the run's lease ran out, which it never
    does while this very process renews it: it now says that a step of the run is
    running here, and nothing is written."""
    run = new_run()

    async def scenario() -> None:
        rt = RemitRuntime(url)
        flow = Slow(runtime=rt)
        handler = flow.run(run_id=run)
        await asyncio.sleep(0.3)
        before = [c.checkpoint_id for c in rt.checkpoints(run)]
        with pytest.raises(ResumeConflict, match="running in this process") as refused:
            await rt.update_state(flow, run, {"n": 5})
        assert refused.value.run_id == run
        assert [c.checkpoint_id for c in rt.checkpoints(run)] == before
        assert await asyncio.wait_for(handler, GUARD) == 0
        assert rt.get_state(flow, run) == Count(n=0)

    asyncio.run(scenario())
