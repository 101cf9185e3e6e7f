"""LangGraph's own checkpointer conformance suite, run against RemitSaver on every engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint

from remit_langgraph import RemitSaver


def test_conformance_full(store_url: str) -> None:
    """Base (put, put_writes, get_tuple, list, delete_thread) and extended
    (delete_for_runs, copy_thread, prune) capabilities all pass."""

    @checkpointer_test(name=f"RemitSaver[{store_url.split(':', 1)[0]}]")
    async def factory() -> AsyncIterator[RemitSaver]:
        yield RemitSaver(store_url)

    report = asyncio.run(validate(factory))
    failures = {cap: res.failures for cap, res in report.results.items() if not res.passed}
    assert not failures, failures
    assert set(report.results) == {c.value for c in ALL_CAPABILITIES}
    assert all(res.detected and res.tests_passed > 0 for res in report.results.values())
    assert report.conformance_level() == "FULL"


@pytest.mark.parametrize("strategy", ["keep_latest", "delete"])
def test_sync_prune_matches_async(store_url: str, strategy: str) -> None:
    """The sync methods are the same code as the async twins the suite drives."""
    saver = RemitSaver(store_url)
    thread = f"prune-{strategy}-{uuid.uuid4().hex}"
    parent = None
    for step in range(3):
        config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        if parent is not None:
            config["configurable"]["checkpoint_id"] = parent["configurable"]["checkpoint_id"]
        parent = saver.put(config, generate_checkpoint(), {"source": "loop", "step": step}, {})
    saver.prune([thread], strategy=strategy)
    left = [t.checkpoint["id"] for t in saver.list({"configurable": {"thread_id": thread}})]
    expected = [parent["configurable"]["checkpoint_id"]] if strategy == "keep_latest" else []
    assert left == expected
