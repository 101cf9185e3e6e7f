"""Real OS processes for the harness: forked workers, results as JSON over a pipe.

The parent has imported the framework once; `fork` gives each worker that
state for free, and a forked worker is still a real process to SIGKILL or
SIGSTOP. Results come back as JSON (never pickle). `Barrier` releases k
workers at once: each reports ready on one pipe and blocks reading another
until the parent closes it, so they really race.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: How long any worker may take before the harness kills it and records a timeout.
WORKER_TIMEOUT = 60.0


def describe_error(exc: BaseException) -> dict[str, Any]:
    """The exception chain as plain data: class names (with their bases) and messages."""
    chain: list[dict[str, Any]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(chain) < 10:
        seen.add(id(current))
        chain.append(
            {
                "class": type(current).__name__,
                "bases": [c.__name__ for c in type(current).__mro__],
                "message": str(current),
            }
        )
        # As a traceback shows it: `raise ... from None` hides the context.
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return {
        "class": chain[0]["class"],
        "message": chain[0]["message"],
        "chain": chain,
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
    }


def to_plain(value: Any) -> Any:
    """Dataclasses and containers as JSON-ready data (unknown objects as their repr)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


@dataclass
class Outcome:
    """How a worker ended: `status` is ok, error, killed, stopped, timeout or exited."""

    status: str
    value: Any = None
    error: dict[str, Any] | None = None
    signal: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raised(self, *class_names: str) -> bool:
        """True if it failed with an exception; with names, one of them is in the chain."""
        if self.status != "error" or self.error is None:
            return False
        if not class_names:
            return True
        return any(name in link["bases"] for link in self.error["chain"] for name in class_names)

    def message_of(self, class_name: str) -> str | None:
        """The message of the first exception in the chain that is a `class_name`."""
        if self.error is None:
            return None
        for link in self.error["chain"]:
            if class_name in link["bases"]:
                return str(link["message"])
        return None

    def error_text(self) -> str:
        """Every message of the exception chain, joined."""
        if self.error is None:
            return ""
        return " | ".join(link["message"] for link in self.error["chain"])

    def summary(self) -> str:
        if self.status == "error" and self.error is not None:
            message = self.error["message"].splitlines()[0] if self.error["message"] else ""
            return f"{self.error['class']}: {message[:160]}"
        if self.status == "killed":
            return f"killed by signal {self.signal}"
        return self.status


class Barrier:
    """Release k forked workers at the same instant."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._ready_r, self._ready_w = os.pipe()
        self._go_r, self._go_w = os.pipe()

    def child_side(self) -> None:
        """In a worker right after fork: drop the parent's ends."""
        os.close(self._ready_r)
        os.close(self._go_w)

    def wait(self) -> None:
        """In a worker: report ready, then block until the parent releases everyone."""
        os.write(self._ready_w, b"r")
        os.read(self._go_r, 1)

    def release(self, timeout: float = WORKER_TIMEOUT) -> int:
        """In the parent: wait until all parties are ready (or died), then release them.

        Returns how many reported ready.
        """
        os.close(self._ready_w)
        os.close(self._go_r)
        ready = 0
        deadline = time.monotonic() + timeout
        os.set_blocking(self._ready_r, False)
        while ready < self.parties and time.monotonic() < deadline:
            try:
                chunk = os.read(self._ready_r, self.parties)
            except BlockingIOError:
                time.sleep(0.005)
                continue
            if not chunk:  # every worker's write end is closed: the rest died
                break
            ready += len(chunk)
        os.close(self._go_w)
        os.close(self._ready_r)
        return ready


@dataclass
class Worker:
    """A forked worker process and the read end of its result pipe."""

    pid: int
    fd: int
    _buf: bytearray = field(default_factory=bytearray)
    _status: int | None = None
    outcome: Outcome | None = None

    def _drain(self) -> bool:
        """Read what the pipe holds; true once it reached end of file."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            self._buf.extend(chunk)

    def poll(self, *, stopped_counts: bool = False) -> Outcome | None:
        """The outcome if the worker ended (or, with `stopped_counts`, stopped)."""
        if self.outcome is not None:
            return self.outcome
        self._drain()
        pid, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED)
        if pid == 0:
            return None
        if os.WIFSTOPPED(status):
            return Outcome("stopped", signal=os.WSTOPSIG(status)) if stopped_counts else None
        self._status = status
        # Ended: all it wrote is in the pipe. Read that without waiting for end of
        # file, which a process it forked (holding the write end it inherited) would
        # put off for as long as that process lives.
        self._drain()
        os.close(self.fd)
        self.outcome = self._decode(status)
        return self.outcome

    def _decode(self, status: int) -> Outcome:
        if os.WIFSIGNALED(status):
            return Outcome("killed", signal=os.WTERMSIG(status))
        try:
            payload = json.loads(self._buf.decode()) if self._buf else None
        except ValueError:
            payload = None
        if payload is None:
            return Outcome("exited", error={"class": "exit", "message": str(status), "chain": []})
        if payload["ok"]:
            return Outcome("ok", value=payload["value"])
        return Outcome("error", error=payload["error"])

    def wait(self, timeout: float = WORKER_TIMEOUT, *, stopped_counts: bool = False) -> Outcome:
        """Block until the worker ends (or stops, with `stopped_counts`); kill it on timeout."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            outcome = self.poll(stopped_counts=stopped_counts)
            if outcome is not None:
                return outcome
            if time.monotonic() > deadline:
                self.kill()
                self.wait(10)
                self.outcome = Outcome(
                    "timeout", error={"class": "timeout", "message": f"{timeout:.0f}s", "chain": []}
                )
                return self.outcome
            self._pause(min(delay, max(0.0, deadline - time.monotonic()) + 0.001))
            delay = min(delay * 2, 0.05)

    def _pause(self, delay: float) -> None:
        """Sleep up to `delay`, waking as soon as the worker writes its result (it
        does so just before it exits) rather than a whole polling interval later."""
        try:
            readable, _, _ = select.select([self.fd], [], [], delay)
        except (OSError, ValueError):  # (no pipe to watch: a plain sleep)
            time.sleep(delay)
            return
        if readable and self._drain():
            # End of file: the worker is exiting (or a process it forked closed the
            # pipe); its exit status follows, so poll briefly rather than spin.
            time.sleep(0.001)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
            os.kill(self.pid, signal.SIGCONT)

    def cont(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


def fork(fn: Callable[[], Any], *, barrier: Barrier | None = None) -> Worker:
    """Run `fn()` in a forked child; its return value (or exception) comes back as JSON.

    With `barrier`, the child drops the parent's barrier ends first; `fn`
    calls `barrier.wait()` when it is ready to race.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 0
        # What the parent had stays out of this process's garbage collections: a full
        # collection would otherwise walk (and so copy, page by page) the parent's
        # whole heap, seconds of a loaded machine for every worker of a big parent.
        gc.freeze()
        try:
            os.close(read_fd)
            if barrier is not None:
                barrier.child_side()
            try:
                payload = {"ok": True, "value": to_plain(fn())}
            except BaseException as exc:  # every failure is an observation
                payload = {"ok": False, "error": describe_error(exc)}
            data = json.dumps(payload, default=repr).encode()
            view = memoryview(data)
            while view:
                written = os.write(write_fd, view)
                view = view[written:]
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    return Worker(pid, read_fd)


def reap(workers: list[Worker]) -> None:
    """Make sure no worker outlives its scenario (stopped ones are continued, then killed)."""
    for w in workers:
        if w.outcome is None:
            w.kill()
            with contextlib.suppress(ChildProcessError, OSError):
                w.wait(10)
    with contextlib.suppress(OSError):
        for w in workers:
            if w.outcome is None:
                os.close(w.fd)
