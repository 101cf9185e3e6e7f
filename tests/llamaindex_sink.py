"""What the LlamaIndex probe workflows leave in the folder `LLAMAINDEX_PROBE_DIR` names:
each step entered (with its process id), and each application of the `pay` effect.
Shared by the probe rounds and the processes they start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from remit_core import NOT_APPLIED, effect

DIR_VAR = "LLAMAINDEX_PROBE_DIR"


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


def _reconcile(key: str) -> Any:
    hits = [line for line in payments(_dir()) if line.split()[0] == key]
    return hits[0].split()[1] if hits else NOT_APPLIED


@effect(reconcile=_reconcile)
def pay(what: str, *, idempotency_key: str) -> str:
    with (_dir() / "sink.txt").open("a") as f:
        f.write(f"{idempotency_key} {what}\n")
    return what
