"""Round 27 of the core probes: a checkpoint read with its writes, against a
concurrent delete of that checkpoint.

`Remit.checkpoint_and_writes` (LangGraph's `get_tuple` of a checkpoint by id, a
fork's base) reads a checkpoint and its writes. Before: the Redis engine read
them in two round trips, and a `delete_checkpoints` (LangGraph's `prune`,
`delete_for_runs`) landing between them returned the checkpoint without its
writes: a caller resumed or forked from a step whose finished tasks it did not
see, and ran them again. After: one script, one snapshot: the checkpoint and all
its writes, or nothing. The SQL engines read both in one statement (held here
too: the delete lands after the statement, as on Redis).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from test_store import chain, write

from remit_core import open_store
from remit_core.records import CheckpointRecord
from remit_core.stores import _sql
from remit_core.stores.redis import RedisStore


def test_a_delete_between_the_checkpoint_and_its_writes_leaves_both_read(
    store_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another client deletes the checkpoint the moment its record is decoded, which
    every engine does after its first read (Redis before: between its two)."""
    store = open_store(store_url)
    ids = chain(store, run_id, 3)
    writes = [write(run_id, ids[1], "t1", i, b"v%d" % i) for i in range(3)]
    store.put_writes(writes, mode="first")
    other = open_store(store.url)
    deleted: list[int] = []

    def then_delete(decode: Callable[..., CheckpointRecord]) -> Callable[..., CheckpointRecord]:
        def decoded(*args: Any) -> CheckpointRecord:
            record = decode(*args)
            if not deleted:
                deleted.append(other.delete_checkpoints(run_id, "", [ids[1]]))
            return record

        return decoded

    if isinstance(store, RedisStore):
        monkeypatch.setattr(store, "_checkpoint", then_delete(store._checkpoint))
    else:
        monkeypatch.setattr(_sql, "_ckpt", then_delete(_sql._ckpt))
    record, found = store.get_checkpoint_and_writes(run_id, "", ids[1])
    assert deleted == [1]  # (the delete landed, in the middle of the read)
    assert record is not None and record.checkpoint_id == ids[1]
    assert [(w.task_id, w.idx, w.value) for w in found] == [
        (w.task_id, w.idx, w.value) for w in writes
    ]
    monkeypatch.undo()
    assert store.get_checkpoint_and_writes(run_id, "", ids[1]) == (None, [])
