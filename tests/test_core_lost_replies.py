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

import threading
import uuid
from collections.abc import Iterator

import pytest
from conftest import PG_URL, REDIS_URL
from store_cuts import Relay

from remit_core import Remit, ResumeConflict, StoreUnavailable

ENGINES = {"postgresql": PG_URL, "redis": REDIS_URL}


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
