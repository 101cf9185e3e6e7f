"""Probes of the core and its engines, round 22: a store URL with a typo in it.

- A SQLite URL one slash short (`sqlite://data/x.db`) reads `data` as a host, which
  the store dropped: it opened (and created) `x.db` in the working directory, a file
  other than the one meant, and a restart that spelled the URL right found no run.
  A `#` in a SQLite URL ended its path there (`run#1.db` opened `run`). Both are now
  a `ValueError` naming the URL, before any file is made.
- A NUL in a store URL: SQLite raised Python's bare "embedded null byte", naming
  nothing; libpq ends every parameter at a NUL, so `.../test\\x00x` reached the
  database `test`. Any store URL holding a NUL is now refused, naming it.
- `remit conformance --target` with such a SQLite URL, or one with its scheme in
  capitals, ended in a traceback (`IndexError`) instead of a usage error or a run.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from pathlib import Path

import pytest
from conftest import ENGINES, PG_URL, REDIS_URL
from test_conformance_probes3 import _refused, _remit

from remit_core import Remit, open_store
from remit_core.conformance.adapter import Target


def _mistyped(tmp_path: Path) -> list[tuple[str, str]]:
    """SQLite URLs that named another file than the one meant, and what is said."""
    return [
        ("sqlite://data/remit.db", "names a host 'data'"),
        (f"sqlite://localhost{tmp_path}/remit.db", "names a host 'localhost'"),
        ("sqlite://user:pw@h/remit.db", "names a host"),
        (f"sqlite:///{tmp_path}/run#1.db", "holds a '#'"),
        (f"sqlite:///{tmp_path}/remit.db#", "holds a '#'"),
    ]


def test_a_sqlite_url_with_a_host_or_a_hash_is_refused_and_makes_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    for url, says in _mistyped(tmp_path):
        for open_it in (Remit, open_store):
            with pytest.raises(ValueError, match="sqlite URL") as refused:
                open_it(url)
            assert says in str(refused.value), url
            assert "pw" not in str(refused.value)  # (the password stays hidden)
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert made == ["data"], made


def test_sqlite_urls_that_name_a_file_rightly_still_open_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal above is of a host or a `#` only: three slashes and a relative path,
    four and an absolute one, a capital scheme and `:memory:` open what they name."""
    monkeypatch.chdir(tmp_path)
    run = f"run-{uuid.uuid4().hex}"
    for url in (
        "sqlite:///rel.db",
        f"sqlite:///{tmp_path}/abs.db",
        f"SQLite:///{tmp_path}/caps.db?synchronous=FULL",
        "sqlite:///:memory:",
    ):
        remit = Remit(url)
        remit.commit(run_id=run, checkpoint_id="c1", parent_id=None, state=b"s")
        assert remit.head(run) is not None
        remit.close()
    assert {p.name for p in tmp_path.glob("*.db")} == {"rel.db", "abs.db", "caps.db"}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_nul_in_a_store_url_is_refused_naming_it(engine: str, tmp_path: Path) -> None:
    url = {
        "sqlite": f"sqlite:///{tmp_path}/remit\x00other.db",
        # libpq reads the database name up to the NUL: `test`, a database that exists.
        "postgresql": PG_URL.replace("/test", "/test\x00other", 1),
        "redis": REDIS_URL + "?client_name=remit\x00other",
    }[engine]
    assert "\x00" in url
    for open_it in (Remit, open_store):
        with pytest.raises(ValueError, match="must not contain a NUL character") as refused:
            open_it(url)
        assert "store URL" in str(refused.value)
    assert os.listdir(tmp_path) == []


def test_a_conformance_target_whose_sqlite_url_is_refused_is_a_usage_error(
    tmp_path: Path,
) -> None:
    for spec, says in (
        ("sqlite://host/x.db", "names a host 'host'"),
        ("vanilla+sqlite://data/x.db", "names a host 'data'"),
        (f"sqlite:///{tmp_path}/run#1.db", "holds a '#'"),
    ):
        with pytest.raises(ValueError, match="sqlite URL"):
            Target.parse(spec, tmp_path, "t")
        done = _remit("--framework", "langgraph", "--target", spec, "--cells", "1", cwd=tmp_path)
        _refused(done, says)
    assert os.listdir(tmp_path) == []


def test_a_conformance_target_with_its_scheme_in_capitals_runs(tmp_path: Path) -> None:
    """The store takes `SQLite:///...`; the harness read the file's path by splitting
    on the lower-case scheme, and ended in a traceback."""
    spec = f"SQLite:///{tmp_path}/store.db"
    done = _remit(
        "--framework", "langgraph", "--target", spec, "--cells", "1", "--json",
        str(tmp_path / "m.json"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert " PASS" in done.stdout
    # The probe's store is where the target says: a real SQLite file of Remit's.
    with sqlite3.connect(tmp_path / "store.db") as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert "remit_checkpoints" in tables
