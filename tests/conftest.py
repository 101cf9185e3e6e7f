"""Shared fixtures: real stores on SQLite files, PostgreSQL and Redis."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_URL = os.environ.get("REMIT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REMIT_TEST_REDIS", "redis://127.0.0.1:6379/0")

ENGINES = ["sqlite", "postgresql", "redis"]


def engine_url(engine: str, tmp_path: object) -> str:
    """A store URL for `engine`; SQLite gets a fresh file under `tmp_path`."""
    if engine == "sqlite":
        return f"sqlite:///{tmp_path}/remit-{uuid.uuid4().hex[:8]}.db"
    if engine == "postgresql":
        return PG_URL
    if engine == "redis":
        return REDIS_URL
    raise ValueError(engine)


@pytest.fixture(params=ENGINES)
def store_url(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[str]:
    """One URL per engine; every test uses fresh run ids, so servers need no cleanup."""
    yield engine_url(request.param, tmp_path)


@pytest.fixture
def run_id() -> str:
    return f"run-{uuid.uuid4().hex}"


@pytest.fixture(params=ENGINES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL per engine, for the tests of a shim (a test file may define its own)."""
    return engine_url(request.param, tmp_path)


@pytest.fixture
def world(tmp_path: Path) -> Path:
    """The file of the world database the tests' effects and journals are kept in."""
    return tmp_path / "world.db"


@pytest.fixture(autouse=True)
def _close_named_stores() -> Iterator[None]:
    """After each test, close the stores of URLs that name their connections
    (`?application_name=` / `?client_name=`, for tests that cut a store's own
    connections): each such URL is a test's own, and its pool would otherwise stay
    open for the rest of the session (one per URL and process) and use up the
    server's connection slots."""
    yield
    from remit_core import stores

    with stores._cache_lock:
        named = [
            key
            for key in stores._cache
            if "application_name=" in key[0] or "client_name=" in key[0]
        ]
        closing = [stores._cache.pop(key) for key in named]
    for store in closing:
        store.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files holding a `slow` test first, the rest in their order: `--dist loadfile`
    (with `--no-loadscope-reorder`, README.md) hands whole files to the workers in this
    order, so a long file starts early instead of running alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)
