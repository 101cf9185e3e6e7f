"""Probes of the core and its engines, round 14: a relative SQLite path.

The SQLite store opens its file on first use (and again in a forked child). A
relative path was resolved then, against whatever the working directory had
become: a process that changed it between making the store and using it (a step
of a workflow may) wrote to another file, and its runs were no longer where its
other stores, or a restart, looked for them.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from remit_core import Remit
from remit_core.stores import open_store


def _commit_in_child(remit: Remit, elsewhere: str) -> None:
    os.chdir(elsewhere)
    remit.commit(run_id="r", checkpoint_id="c2", parent_id="c1", state=b"2")


def test_a_relative_sqlite_path_names_the_file_of_the_directory_the_store_was_made_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(home)
    remit = Remit(open_store("sqlite:///runs.db"))
    os.chdir(elsewhere)  # before the store's first use
    remit.commit(run_id="r", checkpoint_id="c1", parent_id=None, state=b"1")
    assert not (elsewhere / "runs.db").exists()
    assert (home / "runs.db").exists()
    os.chdir(home)
    again = Remit(open_store("sqlite:///runs.db"))
    assert again.head("r") is not None and again.head("r").checkpoint_id == "c1"
    # A forked child reopens the parent's store: the same file, whatever its directory.
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_commit_in_child, args=(remit, str(elsewhere)))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    head = again.head("r")
    assert head is not None and head.checkpoint_id == "c2"
    assert not (elsewhere / "runs.db").exists()
