"""Engines behind a URL: `connect("sqlite:///remit.db" | "postgresql://..." | "redis://...")`."""

from __future__ import annotations

import os
import threading

from remit_core.stores.base import Store, display_url

__all__ = ["Store", "check_url", "open_store"]

_cache: dict[tuple[str, int], Store] = {}
_cache_lock = threading.Lock()


def _renew_cache_lock() -> None:
    """In a forked child: a lock of its own. Another thread of the parent may have held
    it at the fork (it is held while a store is set up, a round trip), and would never
    release it in the child, whose first `open_store` would wait for good."""
    global _cache_lock
    _cache_lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_cache_lock)


def check_url(url: str) -> str:
    """`url` if it names an engine Remit has (`ValueError` naming it if not); connects to
    nothing, so a persistence made with a mistyped URL is refused where it is made."""
    if not isinstance(url, str) or url.split(":", 1)[0].lower() not in _SCHEMES:
        raise ValueError(
            f"unsupported store URL {display_url(url) if isinstance(url, str) else url!r}: "
            "use sqlite:///file.db, postgresql://... or redis://..."
        )
    if "\x00" in url:
        # A file name ends at a NUL, and libpq ends every parameter there: the store
        # reached would be another than the one named.
        raise ValueError(f"store URL {display_url(url)!r} must not contain a NUL character")
    return url


_SCHEMES = frozenset({"sqlite", "postgresql", "postgres", "redis", "rediss"})


def _build(url: str) -> Store:
    scheme = check_url(url).split(":", 1)[0].lower()
    if scheme == "sqlite":
        from remit_core.stores.sqlite import SQLiteStore

        return SQLiteStore(url)
    if scheme in ("postgresql", "postgres"):
        from remit_core.stores.postgres import PostgresStore

        return PostgresStore(url)
    from remit_core.stores.redis import RedisStore  # "redis" or "rediss"

    return RedisStore(url)


def _store_key(url: str) -> str:
    """What `url` names for the cache: a relative SQLite path resolved against the
    working directory now, so that a URL opened again after `os.chdir` names the
    file it names there, not the one it named first."""
    if not isinstance(url, str) or url.split(":", 1)[0].lower() != "sqlite":
        return url
    from remit_core.stores.sqlite import sqlite_path

    try:
        path = sqlite_path(url)
    except ValueError:
        return url  # (refused by the store, naming it)
    if path == ":memory:" or os.path.isabs(path):
        return url
    return f"sqlite:///{os.path.abspath(path)}?{url.partition('?')[2]}"


def open_store(url: str, *, setup: bool = True) -> Store:
    """The process-wide store for `url` (one pool per URL and process), set up once."""
    key = (_store_key(url), os.getpid())
    with _cache_lock:
        store = _cache.get(key)
        if store is None:
            store = _build(url)
            if setup:
                store.setup()
            _cache[key] = store
    return store
