"""Cutting a store's own server connections, for tests of connection loss mid-run:
a URL whose connections carry a name of their own, and the end of every connection
of that name (PostgreSQL backends terminated, Redis clients killed); and a relay to
the real server that loses one reply (or one request) on the wire."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from conftest import PG_URL, REDIS_URL

from remit_core import failpoints


def tagged(engine: str) -> tuple[str, str]:
    """A URL of `engine` whose connections carry a name of their own, and that name."""
    name = f"remit-cut-{uuid.uuid4().hex[:12]}"
    if engine == "postgresql":
        return f"{PG_URL}?application_name={name}", name
    return f"{REDIS_URL}?client_name={name}", name


def cut(engine: str, name: str) -> int:
    """End every server connection named `name`; how many were ended."""
    if engine == "postgresql":
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                (name,),
            ).fetchall()
        return len(rows)
    server = redis.Redis.from_url(REDIS_URL)
    try:
        ids = [c["id"] for c in server.client_list() if c.get("name") == name]
        for client_id in ids:
            server.execute_command("CLIENT", "KILL", "ID", client_id)
        return len(ids)
    finally:
        server.close()


def cut_at(
    monkeypatch: pytest.MonkeyPatch, point: str, engine: str, name: str, nth: int = 1
) -> list[int]:
    """Arm: the `nth` time the core reaches failpoint `point`, in any thread, end every
    connection named `name`; the list returned gets how many were ended. Threads that
    reach it together (a step's writes run in parallel) count one at a time."""
    assert point in failpoints.POINTS
    real = failpoints.hit
    lock = threading.Lock()
    seen: list[int] = []
    done: list[int] = []

    def hit(at: str) -> None:
        if at == point:
            with lock:
                seen.append(1)
                if len(seen) == nth:
                    done.append(cut(engine, name))
        real(at)

    monkeypatch.setattr(failpoints, "hit", hit)
    return done


class _Doom:
    """What is to happen on one relayed connection once its trigger has passed."""

    def __init__(self) -> None:
        self.set = threading.Event()
        self.meanwhile: Callable[[], None] = lambda: None


class Relay:
    """A TCP relay to `url`'s server that can lose one reply, or one request."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._server = (parts.hostname or "127.0.0.1", parts.port or 0)
        self._listener = socket.create_server(("127.0.0.1", 0))
        at = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.url = urlunsplit(
            parts._replace(netloc=f"{parts.username}@{at}" if parts.username else at)
        )
        self._lock = threading.Lock()
        self._armed: tuple[bytes, bytes | None, str, Callable[[], None]] | None = None
        self.fired = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(
        self,
        marker: bytes,
        *,
        then: bytes | None = None,
        lose: str = "reply",
        meanwhile: Callable[[], None] = lambda: None,
    ) -> None:
        """Lose the reply to (with `lose="request"`: the request itself of) the first
        request carrying `marker`, or, with `then`, of the first request after it on
        the same connection that carries `then`; `meanwhile` runs before the
        connection is closed."""
        with self._lock:
            self._armed = (marker, then, lose, meanwhile)

    def close(self) -> None:
        self._listener.close()
        for s in self._sockets:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._server)
            self._sockets += [client, server]
            doom = _Doom()
            threading.Thread(target=self._up, args=(client, server, doom), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, doom), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, doom: _Doom) -> None:
        seen_marker = False
        while True:
            try:
                chunk = client.recv(65536)
            except OSError:
                return
            if not chunk:
                server.close()
                return
            fire: tuple[str, Callable[[], None]] | None = None
            with self._lock:
                if self._armed is not None:
                    marker, then, lose, meanwhile = self._armed
                    seen_marker = seen_marker or marker in chunk
                    if seen_marker and (then is None or then in chunk):
                        self._armed, fire = None, (lose, meanwhile)
            if fire is not None and fire[0] == "request":
                fire[1]()
                self._hang_up(client, server)
                return
            if fire is not None:
                doom.meanwhile = fire[1]
                doom.set.set()  # before it is sent: its reply is the next to come back
            try:
                server.sendall(chunk)
            except OSError:
                return

    def _down(self, server: socket.socket, client: socket.socket, doom: _Doom) -> None:
        while True:
            try:
                chunk = server.recv(65536)
            except OSError:
                return
            if not chunk:
                client.close()
                return
            if doom.set.is_set():  # the server has answered: it ran the request
                doom.meanwhile()
                self._hang_up(client, server)
                return
            try:
                client.sendall(chunk)
            except OSError:
                return

    def _hang_up(self, client: socket.socket, server: socket.socket) -> None:
        for s in (client, server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.fired.set()


def wait_blocked_by(backend: int, worker: threading.Thread) -> None:
    """Until `worker` is done or some session waits for a lock PostgreSQL backend
    `backend` holds."""
    with psycopg.connect(PG_URL, autocommit=True) as admin:
        while (
            worker.is_alive()
            and not admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                (backend,),
            ).fetchone()[0]
        ):
            time.sleep(0.01)
