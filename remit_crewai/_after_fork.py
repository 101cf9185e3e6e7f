"""A forked child gets fresh locks, and a CrewAI event bus of its own.

A lock that another thread of the parent held at the fork (a save looking up its
session, a first use of a store) stays held in the child, where no thread will ever
release it: the child's first flow would wait for it for good. So the child gets new
ones for this package's process-wide locks, and for those of CrewAI's event bus.

CrewAI's event bus is one per process. Its first event starts a pool of handler
threads and a thread that runs an event loop. A child forked after that (a pre-fork
server's worker, `multiprocessing` with fork, a test's forked child) has none of those
threads but inherits their bookkeeping: the pool counts the parent's idle threads as
its own and hands them the child's next handlers, which then never run; a flow that
pauses waits, without a timeout, for the handlers of its pause event, so its kickoff
hangs for good. Handlers queued on the loop never run either, and `flush` waits its
full timeout for the handlers that were running in the parent.

So the child's bus also forgets the parent's pending handlers and is marked as not
started: its next event builds a pool and a loop of its own, as CrewAI builds them in
a new process. Registered handlers are kept. The parent's loop is kept referenced and
never closed: the child shares its selector with the parent, and closing it would
unregister the parent's wake-up pipe. The bus's attributes are looked up, not assumed,
so another CrewAI version is renewed as far as it has them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from crewai.events import event_bus

from remit_crewai import _session, persistence

_installed = False
#: The loops of the buses this process inherited, never to be closed here (see above).
_inherited: list[Any] = []


def install() -> None:
    """Renew the locks and the event bus in every child forked from now on (once per
    process)."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=renew_locks)
        os.register_at_fork(after_in_child=renew_event_bus)
        _installed = True


def renew_locks() -> None:
    """In a forked child: new process-wide locks of this package (the sessions' registry,
    the cache of stores' cores), none of them held."""
    _session.sessions.lock = threading.RLock()
    persistence._cores_lock = threading.Lock()


def renew_event_bus() -> None:
    """In a forked child: give CrewAI's event bus fresh locks, no pending handlers, and
    no pool or loop, so that its next event starts its own."""
    bus = getattr(event_bus, "crewai_event_bus", None)
    if bus is None:
        return
    bus_class = type(bus)
    if hasattr(bus_class, "_instance_lock"):
        bus_class._instance_lock = threading.RLock()
    if hasattr(bus, "_futures_lock"):
        bus._futures_lock = threading.Lock()
    if isinstance(getattr(bus, "_pending_futures", None), set):
        bus._pending_futures = set()
    rwlock = getattr(bus, "_rwlock", None)
    if rwlock is not None:
        try:
            bus._rwlock = type(rwlock)()
        except TypeError:  # a lock type that takes arguments: keep the inherited one
            pass
    if hasattr(bus, "_has_pending_events"):
        bus._has_pending_events = False
    started = getattr(bus, "_executor_initialized", None) is True
    if started and callable(getattr(bus, "_ensure_executor_initialized", None)):
        _inherited.append(getattr(bus, "_loop", None))
        bus._executor_initialized = False
