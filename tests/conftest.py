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
