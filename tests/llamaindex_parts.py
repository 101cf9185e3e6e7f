"""Parts the LlamaIndex runtime probes share."""

from __future__ import annotations

import asyncio

from remit_core.errors import UnknownRecord
from remit_llamaindex import RemitRuntime


async def until_parked(rt: RemitRuntime, run: str) -> None:
    """Until the stored head of `run` waits for an answer."""
    for _ in range(400):
        try:
            if await asyncio.to_thread(rt.status, run) == "waiting":
                return
        except UnknownRecord:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} never parked")
