"""How LangGraph's checkpoints, channel values and writes map onto Remit records.

A LangGraph thread is a Remit run (`run_id = thread_id`) and a checkpoint
namespace is a Remit namespace. A checkpoint record holds the checkpoint's
frame (ids, versions, timestamps) as msgpack behind a marker (format 1, still
read, was tagged JSON); each channel value is a
blob stored once per (channel, version), as LangGraph's PostgreSQL saver does,
so a checkpoint that changes one channel writes one blob. Values are encoded
with the saver's serializer and framed as `type NUL bytes`.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import ormsgpack
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint
from langgraph.checkpoint.serde.base import SerializerProtocol

from remit_core import codec
from remit_core.core import checked_id
from remit_core.errors import CorruptRecord, RemitError

#: Marks a checkpoint body as LangGraph's (other shims share the store). Format 2
#: is this marker and a msgpack map; format 1 was tagged JSON, `{"lg":1,...}`.
BODY_FORMAT = 2
_BODY_MARK = b"RLG" + bytes([BODY_FORMAT])
#: Plain data only: a type msgpack would turn into something else is refused.
_BODY_OPTIONS = (
    ormsgpack.OPT_PASSTHROUGH_DATACLASS
    | ormsgpack.OPT_PASSTHROUGH_DATETIME
    | ormsgpack.OPT_PASSTHROUGH_ENUM
    | ormsgpack.OPT_PASSTHROUGH_UUID
)
#: The Remit run whose step writes index LangGraph run ids -> threads.
RUN_INDEX = "remit-langgraph:run-index"
#: The Remit run whose step writes mark each deletion of a thread (thread -> marks):
#: a thread id used again after `delete_thread` keys its effects apart (`Run.life`).
THREAD_LIVES = "remit-langgraph:thread-lives"
#: Runs of the saver's own: no thread may have their ids.
_RESERVED = frozenset({RUN_INDEX, THREAD_LIVES})


def thread_id(value: Any, what: str = "thread_id") -> str:
    """A thread id as stored (`str` of it); the ids of the saver's own runs are refused:
    a thread with one would read, or `delete_thread` wipe, the saver's records. None
    is refused too: as "None" it would be one thread (and one effect ledger) shared by
    every config that lacks a thread id."""
    if value is None:
        raise RemitError(
            f"config has no configurable.{what} (or it is None): Remit stores runs by thread"
        )
    thread = checked_id(what, str(value))  # (the error names the key, not the core's run_id)
    if thread in _RESERVED:
        raise ValueError(f"{what} {thread!r} is reserved for Remit's own records; use another id")
    return thread


#: The config keys that name a stored record, besides `thread_id`.
_ID_KEYS = ("checkpoint_ns", "checkpoint_id", "fork_token")


def checked_conf(conf: dict[str, Any]) -> dict[str, Any]:
    """`conf` (a config's `configurable`), once each id key it sets (`checkpoint_ns`,
    `checkpoint_id`, `fork_token`) is text a store can hold: else a `TypeError` or
    `ValueError` naming the key as a LangGraph user writes it (not a str, a NUL, a
    lone surrogate), before anything is read or stored. Empty is LangGraph's "not set"."""
    for key in _ID_KEYS:
        value = conf.get(key)
        if value is not None and (isinstance(value, str) or key != "checkpoint_ns"):
            checked_id(key, value, empty=True)  # (a namespace not a str: `RemitError`, where read)
    return conf


def pack(typed: tuple[str, bytes]) -> bytes:
    """Frame a serializer result: its type name, NUL, its bytes."""
    type_, data = typed
    return type_.encode() + b"\x00" + data


def unpack(raw: bytes, **ids: Any) -> tuple[str, bytes]:
    """Split a framed value back into (type name, bytes)."""
    type_, sep, data = bytes(raw).partition(b"\x00")
    if not sep:
        raise CorruptRecord("stored value has no type frame", **ids)
    return type_.decode(), data


def is_own_version(version: str) -> bool:
    """Whether `version` has the form `RemitSaver.get_next_version` makes, 32 digits
    of counter, a dot and a random salt (so it names one value only)."""
    return len(version) > 33 and version[32] == "." and version[:32].isdigit()


def migrated_versions(
    versions: Mapping[str, Any],
    written: Mapping[str, Any],
    migrated: Mapping[str, Any],
    record: Any,
) -> dict[str, Any]:
    """`versions` of a checkpoint whose `written` values a state migration made into
    `migrated`: a key it added or changed (a value that is not the one read) gets the
    next version, named by the checkpoint, the key and the schema version read, so every
    reader of the checkpoint gives it the same; a key it dropped has none."""
    out = dict(versions)
    for key in written.keys() - migrated.keys():
        out.pop(key, None)
    for key, value in migrated.items():
        if key in written and written[key] is value:
            continue
        try:
            n = int(str(out[key]).split(".", 1)[0]) + 1
        except (KeyError, ValueError):  # (a key the migration added; a version of no count)
            n = 1
        salt = hashlib.sha256(
            "\0".join(
                (record.run_id, record.ns, record.checkpoint_id, key, str(record.schema_version))
            ).encode("utf-8", "surrogatepass")
        ).hexdigest()[:16]
        out[key] = f"{n:032}.{salt}"
    return out


def blob_key(channel: str, version: Any) -> str:
    """The blob a channel's value at one version is stored under."""
    return f"{version}:{channel}"


def encode_body(checkpoint: Checkpoint, inline: Mapping[str, bytes]) -> bytes:
    """The checkpoint record's body: everything but the blob-stored channel values."""
    body = {
        "v": checkpoint.get("v", 1),
        "ts": checkpoint.get("ts", ""),
        "channel_versions": dict(checkpoint.get("channel_versions") or {}),
        "versions_seen": {k: dict(v) for k, v in (checkpoint.get("versions_seen") or {}).items()},
        "updated_channels": checkpoint.get("updated_channels"),
        "inline": dict(inline),
    }
    try:
        return _BODY_MARK + ormsgpack.packb(body, option=_BODY_OPTIONS)
    except (TypeError, ormsgpack.MsgpackEncodeError) as exc:
        raise RemitError(
            f"checkpoint has a field Remit cannot store: {exc}", checkpoint_id=checkpoint.get("id")
        ) from exc


def decode_body(raw: bytes, **ids: Any) -> dict[str, Any]:
    """Parse a checkpoint body; `CorruptRecord` if it is not a LangGraph checkpoint."""
    raw = bytes(raw)
    if raw.startswith(_BODY_MARK):
        try:
            body = ormsgpack.unpackb(raw[len(_BODY_MARK) :])
        except (ValueError, ormsgpack.MsgpackDecodeError) as exc:
            raise CorruptRecord(f"checkpoint body does not decode: {exc}", **ids) from exc
        if not isinstance(body, dict) or not _BODY_KEYS <= body.keys():
            raise CorruptRecord("checkpoint body lacks LangGraph's fields", **ids)
        return body
    try:
        body = codec.loads(raw)
    except ValueError as exc:
        raise CorruptRecord(f"checkpoint body does not decode: {exc}", **ids) from exc
    if not isinstance(body, dict) or body.get("lg") != 1:
        raise CorruptRecord("record is not a LangGraph checkpoint written by Remit", **ids)
    return body


def restamped(raw: bytes, ts: str, **ids: Any) -> bytes:
    """The checkpoint body `raw` with the timestamp `ts`: a copy of a checkpoint
    committed later (a fork's first checkpoint) is created when it is committed."""
    body = decode_body(raw, **ids)
    body.pop("lg", None)  # (a body of format 1 is written again as format 2)
    body["ts"] = ts
    return _BODY_MARK + ormsgpack.packb(body, option=_BODY_OPTIONS)


_BODY_KEYS = frozenset(
    {"v", "ts", "channel_versions", "versions_seen", "updated_channels", "inline"}
)


def is_langgraph_body(raw: bytes) -> bool:
    """Cheap check used when listing a store other shims also write to."""
    head = bytes(raw[:16])
    return head.startswith(_BODY_MARK) or head.startswith(b'{"lg":1')


def build_checkpoint(
    checkpoint_id: str, body: Mapping[str, Any], values: dict[str, Any]
) -> Checkpoint:
    return Checkpoint(
        v=body["v"],
        id=checkpoint_id,
        ts=body["ts"],
        channel_values=values,
        channel_versions=body["channel_versions"],
        versions_seen=body["versions_seen"],
        updated_channels=body["updated_channels"],
    )


def run_config(thread_id: str, ns: str, checkpoint_id: str) -> RunnableConfig:
    return {
        "configurable": {
            "thread_id": thread_id,
            "checkpoint_ns": ns,
            "checkpoint_id": checkpoint_id,
        }
    }


def decode_value(serde: SerializerProtocol, raw: bytes, **ids: Any) -> Any:
    return serde.loads_typed(unpack(raw, **ids))


class _Stored:
    """A blob known stored whose bytes the cache does not keep (see `BlobCache`)."""

    __slots__ = ()


_STORED = _Stored()


class BlobCache:
    """The channel-value blobs this process wrote or read lately, by thread and key.

    A blob key names one version of one channel and its bytes never change,
    so a cached blob is always the stored one; the checkpoint record itself is
    still read (and verified) on every `get_tuple`. A key can also be known
    absent (None): a version this saver made whose channel had no value when
    it was saved (an emptied channel) never gets one later.

    Entries are kept per (thread, ns), least recently used threads dropped
    first, at most `size` entries in all: a checkpoint adds one entry per
    changed channel, and one thread's entries are looked up together. The
    bytes kept are at most `max_bytes` in all (a state of MB-sized values
    would otherwise hold every version it ever wrote): past it, the oldest
    blobs' bytes are dropped first, their keys still known stored, so a put
    does not send an unchanged value again, and a read fetches it.
    """

    def __init__(self, size: int = 4096, max_bytes: int = 32 * 1024 * 1024) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._count = 0
        self._bytes = 0
        self._threads: OrderedDict[tuple[str, str], dict[str, bytes | _Stored | None]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, thread: str, ns: str, keys: Iterable[str]) -> dict[str, bytes | None]:
        """The known keys among `keys`: their bytes, or None if known absent."""
        with self._lock:
            known = self._threads.get((thread, ns))
            if known is None:
                return {}
            found: dict[str, bytes | None] = {}
            for key in keys:
                value = known.get(key, _STORED)
                if not isinstance(value, _Stored):
                    found[key] = value
            return found

    def holds(self, thread: str, ns: str, key: str) -> bool:
        """Whether `key`'s bytes are known stored (not merely known absent)."""
        known = self._threads.get((thread, ns))  # (a dict read needs no lock)
        return known is not None and known.get(key) is not None

    def drop(self, thread: str) -> None:
        """Forget a thread (deleted: its blobs are gone from the store)."""
        with self._lock:
            for key in [k for k in self._threads if k[0] == thread]:
                self._forget(self._threads.pop(key))

    def put(self, thread: str, ns: str, blobs: Mapping[str, bytes | None]) -> None:
        with self._lock:
            threads = self._threads
            known = threads.get((thread, ns))
            if known is None:
                known = threads[thread, ns] = {}
            else:
                threads.move_to_end((thread, ns))
            before = len(known)
            size = 0  # (counted inline: a put of every checkpoint comes here)
            for key, value in blobs.items():
                if key in known:
                    size -= _held(known[key])
                if value is not None:
                    if len(value) > self._max_bytes:
                        known[key] = _STORED  # larger than the whole budget: known stored
                        continue
                    size += len(value)
                known[key] = value
            self._bytes += size
            self._count += len(known) - before
            while self._count > self._size:
                oldest = next(iter(threads.values()))
                if oldest is known:  # one thread over the budget: drop its oldest half
                    dropped = list(known)[: len(known) // 2 + 1]
                    self._forget({key: known.pop(key) for key in dropped})
                else:
                    self._forget(threads.popitem(last=False)[1])
            if self._bytes > self._max_bytes:
                self._shed()

    def _forget(self, entries: Mapping[str, bytes | _Stored | None]) -> None:
        self._count -= len(entries)
        self._bytes -= sum(_held(value) for value in entries.values())

    def _shed(self) -> None:
        """Drop the oldest blobs' bytes (least recently used threads first) down to
        half the byte budget, so that a put of large values does not shed at each."""
        for known in self._threads.values():
            for key, value in known.items():
                if self._bytes <= self._max_bytes // 2:
                    return
                if isinstance(value, bytes):
                    known[key] = _STORED
                    self._bytes -= len(value)


def _held(value: bytes | _Stored | None) -> int:
    """The bytes a cache entry holds."""
    return len(value) if isinstance(value, bytes) else 0


def own_blobs(
    new_versions: Mapping[str, Any], blobs: Mapping[str, bytes]
) -> dict[str, bytes | None]:
    """The blobs of a put whose versions this saver made (see `is_own_version`),
    and None for each such new version of a channel that had no value (emptied)."""
    own: dict[str, bytes | None] = {}
    for channel, version in new_versions.items():
        if isinstance(version, str) and is_own_version(version):
            key = blob_key(channel, version)
            own[key] = blobs.get(key)
    for key, value in blobs.items():  # and blobs of channels the put did not change
        if key not in own and is_own_version(key.partition(":")[0]):
            own[key] = value
    return own
