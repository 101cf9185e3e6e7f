"""`RemitSaver`'s options, checked where the saver is made.

A mistyped option must fail at once, naming itself: taken as it stands, a
single string of versions reads as its characters (the saver refuses its own
checkpoints at the next read), a state type with no keys checks nothing (P4
silently off), and a wrong `store` or `serde` fails deep inside the first
run, after its nodes ran.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from remit_core import Remit
from remit_core.core import checked_id
from remit_langgraph._schema import StateCheck


def checked_store(store: object) -> None:
    """`TypeError` unless `store` is a store URL or a `remit_core.Remit`."""
    if not isinstance(store, (str, Remit)):
        raise TypeError(
            "store must be a Remit store URL (sqlite:///file.db, postgresql://..., "
            f"redis://...) or a remit_core.Remit, got {type(store).__name__} {store!r:.60}"
        )


def checked_versions(workflow_version: object, accept_versions: object) -> set[str] | None:
    """The workflow versions the saver reads (None: any), or `TypeError` naming the
    option. A saver always reads what it writes: listing older versions in
    `accept_versions` (a rolling upgrade) must not make it refuse its own."""
    version = checked_id("workflow_version", workflow_version, empty=True)
    if accept_versions is None:
        return {version} if version else None
    if isinstance(accept_versions, (str, bytes)) or not isinstance(accept_versions, Iterable):
        raise TypeError(
            "accept_versions must be a collection of str (e.g. ['v1', 'v2']), got "
            f"{type(accept_versions).__name__} {accept_versions!r:.60}"
        )
    versions = set(accept_versions)
    for odd in versions:
        if not isinstance(odd, str):
            raise TypeError(
                f"accept_versions must hold str only, got {type(odd).__name__} {odd!r:.60}"
            )
    return versions | {version}


def checked_allowlist(allowlist: object) -> tuple[Any, ...]:
    """`allowlist` as a tuple of classes and (module, name, ...) tuples of str, or
    `TypeError` naming the entry that is neither."""
    if isinstance(allowlist, (str, bytes)) or not isinstance(allowlist, Iterable):
        raise TypeError(
            "allowlist must be a collection of classes or (module, name) tuples, got "
            f"{type(allowlist).__name__} {allowlist!r:.60}"
        )
    entries = tuple(allowlist)
    for entry in entries:
        if isinstance(entry, type):
            continue
        if (
            not isinstance(entry, tuple)
            or len(entry) < 2
            or not all(isinstance(part, str) and part for part in entry)
        ):
            raise TypeError(
                "allowlist entries must be classes or (module, name) tuples of str, got "
                f"{type(entry).__name__} {entry!r:.60}"
            )
    return entries


def checked_state_schema(state_schema: object) -> None:
    """`TypeError` unless `state_schema` is None or declares state keys to check (a
    TypedDict, Pydantic model or dataclass, or a `StateSchema` of one)."""
    if state_schema is not None and StateCheck.of(state_schema) is None:
        raise TypeError(
            "state_schema must be a state type with keys (a TypedDict, Pydantic model or "
            "dataclass) or a remit_core.StateSchema of one, got "
            f"{type(state_schema).__name__} {state_schema!r:.60}: nothing would be checked"
        )


def checked_serde(serde: object) -> None:
    """`TypeError` unless `serde` is None or has LangGraph's serializer methods."""
    if serde is None:
        return
    missing = [m for m in ("dumps_typed", "loads_typed") if not callable(getattr(serde, m, None))]
    if missing:
        raise TypeError(
            "serde must be a LangGraph serializer (SerializerProtocol: dumps_typed and "
            f"loads_typed), got {type(serde).__name__} without {', '.join(missing)}"
        )
