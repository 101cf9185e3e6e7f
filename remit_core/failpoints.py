"""Named crash points, armed by `REMIT_FAILPOINTS`, free when unarmed.

`REMIT_FAILPOINTS="effect.after_apply=kill,checkpoint.before_commit=raise"`
arms points at import; `arm()` arms them in a running (e.g. forked) process.
Actions: `kill` (SIGKILL this process), `stop` (SIGSTOP this process),
`raise` (`FailpointHit`), `sleep:SECONDS`. A point may carry a count
(`name=kill@3`: act on its third hit).

A `stop` waits until no other thread of the process is inside a store statement
(see `hold_at_stop`): a process stopped inside an SQLite write would keep every
other process from writing to the file, which is SQLite's locking at work, not
the zombie the point is there to make.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from remit_core.errors import RemitError

#: Every point the core and its stores hit, so a typo in an arming is caught.
POINTS = frozenset(
    {
        "checkpoint.before_commit",
        "checkpoint.in_commit",
        "checkpoint.after_commit",
        "writes.before",
        "writes.in_txn",
        "writes.after",
        "interrupt.before_consume",
        "interrupt.in_consume",
        "interrupt.after_consume",
        "claim.in_acquire",
        "claim.after_acquire",
        "fork.before_create",
        "fork.in_create",
        "copy.in_copy",
        "delete.before_move",
        "prune.after_list",
        "delete.in_delete",
        "effect.before_intent",
        "effect.in_intent",
        "effect.after_intent",
        "effect.after_apply",
        "effect.in_outcome",
        "effect.after_outcome",
        "step.before",
        "step.after",
    }
)


class FailpointHit(RemitError):
    """Raised by a failpoint armed with `raise`."""


_armed: dict[str, tuple[str, int]] = {}
_hits: dict[str, int] = {}
_held_at_stop: list[tuple[Callable[[], None], Callable[[], None]]] = []


def hold_at_stop(hold: Callable[[], None], release: Callable[[], None]) -> None:
    """Call `hold` before a `stop` and `release` once the process is continued."""
    _held_at_stop.append((hold, release))


def arm(name: str, action: str) -> None:
    """Arm point `name` with `action` (see the module doc)."""
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(POINTS))}")
    action, _, nth = action.partition("@")
    if action not in ("kill", "stop", "raise") and not action.startswith("sleep:"):
        raise ValueError(f"unknown failpoint action {action!r} for {name!r}")
    _armed[name] = (action, int(nth) if nth else 1)
    _hits[name] = 0


def disarm(name: str | None = None) -> None:
    """Disarm one point, or all."""
    if name is None:
        _armed.clear()
        _hits.clear()
    else:
        _armed.pop(name, None)
        _hits.pop(name, None)


def hits(name: str) -> int:
    """How often armed point `name` was hit since it was armed (0 when unarmed)."""
    return _hits.get(name, 0)


def arm_from_env(spec: str | None = None) -> None:
    """Arm the points listed in `spec` (default: `REMIT_FAILPOINTS`)."""
    spec = os.environ.get("REMIT_FAILPOINTS", "") if spec is None else spec
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, action = item.partition("=")
        arm(name.strip(), action.strip() or "kill")


def hit(name: str) -> None:
    """Act if `name` is armed; a dictionary miss otherwise."""
    if not _armed:
        return
    armed = _armed.get(name)
    if armed is None:
        return
    action, nth = armed
    _hits[name] += 1
    if _hits[name] != nth:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        for hold, _ in _held_at_stop:
            hold()
        try:
            # At this thread, so that it stops here, not a little later (see ProbeEnv.point).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        finally:
            for _, release in reversed(_held_at_stop):
                release()
    elif action == "raise":
        raise FailpointHit(f"failpoint {name} hit")
    else:
        time.sleep(float(action.split(":", 1)[1]))


arm_from_env()
