"""Engines behind a URL: `connect("sqlite:///remit.db" | "postgresql://..." | "redis://...")`."""

from __future__ import annotations

import os
import threading

from remit_core.stores.base import Store

__all__ = ["Store", "open_store"]

_cache: dict[tuple[str, int], Store] = {}
_cache_lock = threading.Lock()


def _build(url: str) -> Store:
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        from remit_core.stores.sqlite import SQLiteStore

        return SQLiteStore(url)
    if scheme in ("postgresql", "postgres"):
        from remit_core.stores.postgres import PostgresStore

        return PostgresStore(url)
    if scheme in ("redis", "rediss"):
        from remit_core.stores.redis import RedisStore

        return RedisStore(url)
    raise ValueError(
        f"unsupported store URL {url!r}: use sqlite:///file.db, postgresql://... or redis://..."
    )


def open_store(url: str, *, setup: bool = True) -> Store:
    """The process-wide store for `url` (one pool per URL and process), set up once."""
    key = (url, os.getpid())
    with _cache_lock:
        store = _cache.get(key)
        if store is None:
            store = _build(url)
            if setup:
                store.setup()
            _cache[key] = store
    return store
