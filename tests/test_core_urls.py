"""Store URLs: a relative SQLite path names the file it names in the working directory
of the moment (a URL opened again after `os.chdir` is another store, not the first
one's), and a URL refused for a bad option shows no password."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from remit_core import Remit


def test_a_relative_sqlite_url_opened_after_a_chdir_names_the_new_directorys_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    with Remit("sqlite:///rel.db") as in_first:
        in_first.commit(run_id="r", checkpoint_id="c1", parent_id=None, state=b"first")
        monkeypatch.chdir(second)
        with Remit("sqlite:///rel.db") as in_second:
            assert in_second.head("r") is None  # another file: nothing of the first's
            in_second.commit(run_id="r", checkpoint_id="c1", parent_id=None, state=b"second")
        monkeypatch.chdir(first)
        with Remit("sqlite:///rel.db") as again:
            assert again.store is in_first.store  # the first directory's store, shared
            head = again.head("r")
            assert head is not None and head.state == b"first"
    assert sorted(os.listdir(second))[0] == "rel.db"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://remit:s3cr3t-pw@127.0.0.1:5432/test?no_such_option=1",
        "postgresql://remit@127.0.0.1:5432/test?password=s3cr3t-pw&no_such_option=1",
        "postgresql://remit:s3cr3t-pw@127.0.0.1:5432/test?min_size=9&max_size=2",
        "postgresql://remit:s3cr3t-pw@127.0.0.1:5432/test?max_size=many",
        "postgresql://remit:s3cr3t-pw@127.0.0.1:5432/test?max_size=1&max_size=2",
        "redis://:s3cr3t-pw@127.0.0.1:6379/0?no_such_option=1",
        "redis://:s3cr3t-pw@127.0.0.1:6379/0?retry_on_timeout=true",
        "redis://:s3cr3t-pw@127.0.0.1:6379/zero",
        "mysql://remit:s3cr3t-pw@127.0.0.1/test",
    ],
)
def test_a_url_refused_for_its_options_shows_no_password(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        Remit(url)
    message = str(refused.value)
    assert "s3cr3t-pw" not in message and "***" in message
