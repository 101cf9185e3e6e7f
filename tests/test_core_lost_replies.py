"""A consume whose reply is lost on the wire, through a relay to the real server.

The relay forwards every byte between Remit and a real PostgreSQL or Redis until it
is armed; then the first request that carries a marker (on PostgreSQL: the COMMIT
that follows it on the same connection) is either run and its reply dropped, or
dropped unsent, and the connection is closed. Remit sees what a network failure
at that instant shows: `StoreUnavailable`, though the server may have committed.

P5: the value the run continues with is the value acknowledged to its resumer. A
consume that landed was answered `StoreUnavailable`, and asked again, the same
resumer got `ResumeConflict`: its value was the run's, yet no resumer had it
acknowledged. The core now asks after a failed consume on a fresh connection.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from conftest import PG_URL, REDIS_URL

from remit_core import Remit, ResumeConflict, StoreUnavailable

ENGINES = {"postgresql": PG_URL, "redis": REDIS_URL}


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


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def relay(engine: str) -> Iterator[Relay]:
    relay = Relay(ENGINES[engine])
    yield relay
    relay.close()


@pytest.fixture
def remits(engine: str, relay: Relay) -> Iterator[tuple[Remit, Remit]]:
    """A Remit through the relay, and one straight to the server."""
    direct = Remit(ENGINES[engine])
    direct.store.setup()
    through = Remit(relay.url)
    yield through, direct
    through.close()
    direct.close()


def _lose_reply(relay: Relay, engine: str, value: bytes) -> None:
    """Lose the reply of the consume that carries `value`, after it landed (on
    PostgreSQL: the reply of the COMMIT that follows its UPDATE)."""
    relay.arm(value, then=b"COMMIT" if engine == "postgresql" else None)


def test_a_consume_that_landed_but_lost_its_reply_is_acknowledged(
    engine: str, relay: Relay, remits: tuple[Remit, Remit]
) -> None:
    through, direct = remits
    run_id = f"lost-{uuid.uuid4().hex}"
    direct.open_interrupts(run_id, {"approve": b"approve?"}, checkpoint_id="c1")
    value = f"yes-{uuid.uuid4().hex}".encode()
    _lose_reply(relay, engine, value)

    got = through.consume(run_id, "approve", value)

    assert relay.fired.is_set()  # the reply was lost: the consume was answered by the re-read
    assert (got.status, got.value, got.prompt) == ("consumed", value, b"approve?")
    stored = direct.interrupt(run_id, "approve")
    assert stored is not None and (stored.value, stored.consumed_by) == (value, got.consumed_by)
    with pytest.raises(ResumeConflict):
        direct.consume(run_id, "approve", b"second")
    direct.delete_run(run_id)


def test_a_consume_that_never_landed_stays_a_failure_and_a_retry_consumes(
    engine: str, relay: Relay, remits: tuple[Remit, Remit]
) -> None:
    """The re-read finds the interrupt pending: the failure stands, nothing is
    acknowledged that was not stored, and the same call made again consumes it."""
    through, direct = remits
    run_id = f"lost-{uuid.uuid4().hex}"
    direct.open_interrupts(run_id, {"approve": b"approve?"}, checkpoint_id="c1")
    value = f"yes-{uuid.uuid4().hex}".encode()
    relay.arm(value, lose="request")  # (PostgreSQL: the UPDATE never reaches the server)

    with pytest.raises(StoreUnavailable):
        through.consume(run_id, "approve", value)

    assert relay.fired.is_set()
    pending = direct.interrupt(run_id, "approve")
    assert pending is not None and (pending.status, pending.value) == ("pending", None)
    again = through.consume(run_id, "approve", value)
    assert (again.status, again.value) == ("consumed", value)
    direct.delete_run(run_id)


def test_a_lost_consume_is_not_taken_for_another_resumers_that_landed(
    engine: str, relay: Relay, remits: tuple[Remit, Remit]
) -> None:
    """Another resumer (here: another thread of the same Remit, the same holder)
    consumes while the first one's request is lost: the first gets the failure,
    not the other's acknowledgement."""
    through, direct = remits
    run_id = f"lost-{uuid.uuid4().hex}"
    direct.open_interrupts(run_id, {"approve": b"approve?"}, checkpoint_id="c1")
    mine, theirs = b"mine-" + uuid.uuid4().hex.encode(), b"theirs"

    def other_resumer() -> None:
        done: list[object] = []
        worker = threading.Thread(target=lambda: done.append(direct_same(run_id, theirs)))
        worker.start()
        worker.join(30)
        assert done and done[0] == theirs

    def direct_same(run: str, value: bytes) -> bytes | None:
        # A Remit with the through-instance's holder, straight to the server.
        other = Remit(direct.store, holder=through.holder)
        return other.consume(run, "approve", value).value

    relay.arm(mine, lose="request", meanwhile=other_resumer)

    with pytest.raises(StoreUnavailable):
        through.consume(run_id, "approve", mine)

    stored = direct.interrupt(run_id, "approve")
    assert stored is not None and (stored.status, stored.value) == ("consumed", theirs)
    with pytest.raises(ResumeConflict):
        through.consume(run_id, "approve", mine)
    direct.delete_run(run_id)
