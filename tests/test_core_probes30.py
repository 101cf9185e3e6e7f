"""Round 30 of the core probes: run ids too long for a store's records.

PostgreSQL keeps the ids of a record's key in one index entry of at most 2704 bytes
(compressed when they compress). A run id that fits the claim's entry but not a step
write's or a checkpoint's used to pass the claim and fail at the first write, after the
run's first step had run. It is now refused at the claim, with nothing stored; ids that
fit (short ones, long ones that compress) work as before, and SQLite and Redis, which
hold ids of any length, are unchanged. Real SQLite files, PostgreSQL and Redis."""

from __future__ import annotations

import random
import secrets
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from remit_core import Remit
from remit_core.records import WriteRecord


@pytest.fixture
def remit(store_url: str) -> Iterator[Remit]:
    r = Remit(store_url)
    yield r
    r.close()


def _random_text(n_chars: int, alphabet: str) -> str:
    """`n_chars` characters drawn at random: text that does not compress."""
    rng = random.Random(secrets.randbits(64))
    return "".join(rng.choice(alphabet) for _ in range(n_chars))


#: Ids a claim's index entry holds on PostgreSQL, but a step write's does not.
TOO_LONG = {
    "hex": lambda: secrets.token_hex(1340),  # 2680 bytes
    "cjk": lambda: _random_text(893, "".join(map(chr, range(0x4E00, 0x4E00 + 2000)))),  # 2679
}

#: Ids every engine holds, whatever their length in characters.
HELD = {
    "short": lambda: f"run-{uuid.uuid4().hex}",
    "at the tried length": lambda: secrets.token_hex(1200),  # 2400 bytes: no try
    "past it, with room": lambda: secrets.token_hex(1250),  # 2500 bytes: tried, fits
    "long, compressing": lambda: f"{uuid.uuid4().hex}-" + "ab" * 5000,
}


def _full_cycle(remit: Remit, run_id: str) -> None:
    """Claim at the head, commit with blobs and writes under the fence, read it all
    back, release; claim again and find the head."""
    handle, head, writes = remit.claim_at_head(run_id)
    assert (head, writes) == (None, [])
    try:
        remit.commit(
            run_id=run_id,
            checkpoint_id=str(uuid.uuid4()),
            parent_id=None,
            state=b"{}",
            blobs={f"{uuid.uuid4()}:channel": b"v"},
            fence=handle.fence,
        )
        ckpt = remit.head(run_id)
        assert ckpt is not None
        remit.put_writes(
            [WriteRecord(run_id, ckpt.checkpoint_id, str(uuid.uuid4()), 0, "ch", b"w")],
            fence=handle.fence,
        )
        assert [w.value for w in remit.writes(run_id, ckpt.checkpoint_id)] == [b"w"]
    finally:
        handle.release()
    again, head, writes = remit.claim_at_head(run_id)
    try:
        assert head is not None and head.checkpoint_id == ckpt.checkpoint_id
        assert [w.value for w in writes] == [b"w"]
    finally:
        again.release()


@pytest.mark.parametrize("kind", sorted(TOO_LONG))
@pytest.mark.parametrize("how", ["claim", "claim_at_head"])
def test_an_id_too_long_for_the_run_is_refused_at_the_claim_with_nothing_stored(
    remit: Remit, store_url: str, kind: str, how: str
) -> None:
    run_id = TOO_LONG[kind]()
    take: Callable[[], Any] = getattr(remit, how)
    if not store_url.startswith("postgresql"):
        # SQLite and Redis hold it: the whole run works.
        got = take(run_id)
        (got[0] if isinstance(got, tuple) else got).release()
        _full_cycle(remit, run_id)
        return
    with pytest.raises(ValueError, match="too long for the PostgreSQL store") as refused:
        take(run_id)
    assert "nothing was stored" in str(refused.value)
    assert remit.store.get_claim(run_id, "main") is None
    assert remit.head(run_id) is None
    # The try left no step write behind (its key is the one tried).
    assert remit.store.get_writes(run_id, "", "0" * 64) == []
    # Refused again the same way: nothing half-taken blocks or changes the answer.
    with pytest.raises(ValueError, match="too long"):
        take(run_id)


@pytest.mark.parametrize("kind", sorted(HELD))
def test_ids_that_fit_run_as_before_on_every_engine(remit: Remit, kind: str) -> None:
    _full_cycle(remit, HELD[kind]())


def test_a_refused_id_leaves_the_claims_of_other_runs_as_they_were(remit: Remit) -> None:
    """The try runs in a transaction of its own: a claim held on another run keeps its
    fence and its holder, and the next claim of a good id works at once."""
    other = f"run-{uuid.uuid4().hex}"
    held = remit.claim(other)
    try:
        before = remit.store.get_claim(other, "main")
        run_id = TOO_LONG["hex"]()
        try:
            remit.claim(run_id).release()
        except ValueError:
            pass  # (PostgreSQL)
        after = remit.store.get_claim(other, "main")
        assert before is not None and after is not None
        assert (after.holder, after.fence) == (before.holder, before.fence)
    finally:
        held.release()
    _full_cycle(remit, f"run-{uuid.uuid4().hex}")
