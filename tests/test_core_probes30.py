"""Round 30 of the core probes: run ids too long for a store's records, and forks.

PostgreSQL keeps the ids of a record's key in one index entry of at most 2704 bytes
(compressed when they compress). A run id that fits the claim's entry but not a step
write's or a checkpoint's used to pass the claim and fail at the first write, after the
run's first step had run. It is now refused at the claim, with nothing stored; ids that
fit (short ones, long ones that compress) work as before, and SQLite and Redis, which
hold ids of any length, are unchanged.

Forks: a process forked while another thread of its parent was opening a store (its
set-up, a round trip, runs under the lock of the process's cache of stores) inherited
that lock held, and its own first store waited for good; it now gets a lock of its own.
An effect called in processes forked inside a step was numbered there as the step
numbers its calls, the same in every child: the second child's call (other arguments)
was never applied and got the first's recorded outcome. It is now refused with
`RemitError` naming `key=`; a key of the user's applies each call once. Real SQLite
files, PostgreSQL and Redis; real forked processes."""

from __future__ import annotations

import multiprocessing as mp
import random
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from remit_core import Remit, effect, step_scope, stores
from remit_core.records import WriteRecord

CTX = mp.get_context("fork")


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


# -- forks ------------------------------------------------------------------------------


def _in_child(fn: Callable[[], Any], timeout: float = 20.0) -> tuple[str, Any]:
    """Run `fn` in a forked child: ("ok", its result) or ("error", "Type: message");
    ("hung", None) if it has not answered within `timeout` (the child is killed)."""
    results = CTX.Queue()

    def body() -> None:
        try:
            results.put(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 (handed to the parent)
            results.put(("error", f"{type(exc).__name__}: {exc}"))

    proc = CTX.Process(target=body)
    proc.start()
    try:
        return results.get(timeout=timeout)
    except Exception:
        return ("hung", None)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_a_child_forked_while_a_thread_opens_a_store_opens_its_own(store_url: str) -> None:
    """A thread of this process holds the lock of its cache of stores (as while it sets
    a store up) when a child is forked: the child opens its store and commits at once."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with stores._cache_lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        run_id = f"run-{uuid.uuid4().hex}"

        def child() -> str:
            remit = Remit(store_url)
            remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"{}")
            return remit.head(run_id).checkpoint_id  # type: ignore[union-attr]

        assert _in_child(child) == ("ok", "c1")
    finally:
        release.set()
        thread.join(10)


class _Sink:
    """Applications, one line each in a file, so forked children can append."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.path.touch()

    def apply(self, item: str, key: str) -> str:
        with open(self.path, "a") as f:
            f.write(f"{item} {key}\n")
        return f"receipt-{item}"

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines()


@pytest.mark.parametrize("own_keys", [False, True])
def test_effects_called_in_processes_forked_inside_a_step(
    remit: Remit, tmp_path: Any, own_keys: bool
) -> None:
    """Two children forked inside one step each charge an item. Without a key of the
    user's, each call is refused (`RemitError` naming `key=`) and nothing is applied;
    with one, each item is charged once, and a replay of the step in the parent returns
    both recorded outcomes without charging again. The step's own calls are numbered as
    if the children had made none."""
    sink = _Sink(tmp_path / "sink.txt")
    run_id = f"run-{uuid.uuid4().hex}"

    def apply(item: str, *, idempotency_key: str) -> str:
        return sink.apply(item, idempotency_key)

    charge = (
        effect(apply, name="charge", key=lambda item: f"charge:{item}")
        if own_keys
        else effect(apply, name="charge")
    )
    with step_scope(remit, run_id, "step-1"):
        outcomes = [_in_child(lambda item=item: charge(item)) for item in ("a", "b")]
        own = charge("c")
    if own_keys:
        assert outcomes == [("ok", "receipt-a"), ("ok", "receipt-b")]
        with step_scope(remit, run_id, "step-1"):
            assert (charge("a"), charge("b")) == ("receipt-a", "receipt-b")
        assert sorted(line.split()[0] for line in sink.lines()) == ["a", "b", "c"]
    else:
        assert [kind for kind, _ in outcomes] == ["error", "error"], outcomes
        for _, message in outcomes:
            assert message.startswith("RemitError") and "forked from its step" in message
            assert "key=" in message
        assert [line.split()[0] for line in sink.lines()] == ["c"]
    assert own == "receipt-c"
    # The parent's call is the step's first of "charge" (or keyed by the user's key).
    entry = remit.store.get_effect(run_id, "charge:c" if own_keys else "step-1/charge#0")
    assert entry is not None and entry.status == "done"
