"""Round 28 of the core probes: the conformance harness's forked workers.

Found: once a worker had exited, the parent read its result pipe until end of file,
which never came while a process the worker had forked (and which inherited the
pipe's write end) lived on: `Worker.wait(timeout=...)` spun past its timeout for as
long as that process lived, a test hung with no child of its own left. Now the
parent reads what the ended worker wrote and stops there. Real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from remit_core.conformance.processes import fork

#: How long the worker's own child lives on (the parent must not wait for it).
LINGER = 30.0


def test_a_worker_whose_child_outlives_it_is_waited_for_as_it_ends(tmp_path: Path) -> None:
    """The worker forks a child that sleeps on, writes its pid down, and returns at
    once: `wait` gives the worker's value within its timeout, long before the child
    ends (it is killed here after)."""
    pid_file = tmp_path / "child.pid"

    def lingering() -> None:
        pid_file.write_text(str(os.getpid()))
        time.sleep(LINGER)

    def worker() -> str:
        fork(lingering)
        deadline = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return "done"

    started = time.monotonic()
    try:
        outcome = fork(worker).wait(timeout=10)
        took = time.monotonic() - started
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert (outcome.status, outcome.value) == ("ok", "done")
    assert took < LINGER / 2, took


def test_a_large_result_still_comes_back_whole() -> None:
    """A value larger than a pipe holds (the worker blocks writing it until the parent
    reads) comes back whole."""
    big = "x" * 1_000_000
    outcome = fork(lambda: big).wait(timeout=30)
    assert (outcome.status, outcome.value) == ("ok", big)
