"""What the LlamaIndex probe workflows leave in the folder `LLAMAINDEX_PROBE_DIR` names:
each step entered (with its process id), and each application of the `pay` effect.
Shared by the probe rounds and the processes they start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from remit_core import NOT_APPLIED, effect

DIR_VAR = "LLAMAINDEX_PROBE_DIR"
#: The point (`die_at`) at which a process started by `in_process` kills itself.
KILL_VAR = "LLAMAINDEX_PROBE_KILL"


def _dir() -> Path:
    return Path(os.environ[DIR_VAR])


def enter(name: str) -> None:
    with (_dir() / "journal.txt").open("a") as f:
        f.write(f"{name} {os.getpid()}\n")


def entered(tmp: Path) -> list[str]:
    path = tmp / "journal.txt"
    return [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []


def payments(tmp: Path) -> list[str]:
    """Every application of `pay`, as "<idempotency key> <what>"."""
    path = tmp / "sink.txt"
    return path.read_text().splitlines() if path.exists() else []


def applied(tmp: Path) -> list[str]:
    """Every application of `pay`, as what it paid for."""
    return [line.split()[1] for line in payments(tmp)]


def _reconcile(key: str) -> Any:
    hits = [line for line in payments(_dir()) if line.split()[0] == key]
    return hits[0].split()[1] if hits else NOT_APPLIED


@effect(reconcile=_reconcile)
def pay(what: str, *, idempotency_key: str) -> str:
    with (_dir() / "sink.txt").open("a") as f:
        f.write(f"{idempotency_key} {what}\n")
    return what


def die_at(point: str) -> None:
    """SIGKILL this process if it was started to die at `point`."""
    if os.environ.get(KILL_VAR) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def in_process(code: str, tmp: Path, kill: str = "") -> subprocess.CompletedProcess[str]:
    """Run `code` in a new Python process journalling to `tmp`, dying at `kill`."""
    env = {**os.environ, DIR_VAR: str(tmp), KILL_VAR: kill}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
