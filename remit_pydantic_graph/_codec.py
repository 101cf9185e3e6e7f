"""P4 for pydantic-graph snapshots: their bytes, through the graph's own type adapter.

A snapshot is written only if it serializes under the graph's types without
a warning (by field name, or by alias for a model that reads its fields by
alias), validates back, and reads back equal to the snapshot the run holds
(fields excluded from dumps aside): a value JSON cannot carry (`inf` in a
`float | None` field, which pydantic writes as null; a datetime in a zone
whose offset changes with the date, which it writes as a fixed offset) is
refused, never stored as another value. A refusal names the bad value by its
full path from the snapshot (`state.inner.amount`, `state.items.1`,
`node.value`, `result.data`), in the same form whichever check found it, and says
why where pydantic's own words would not (a secret, which pydantic writes masked; an
int too large for its JSON reader; a node field named `node_id`; a value that holds
itself, named where the cycle closes). It is
written in pydantic's round-trip form: a `Json[...]` field as the JSON text it
reads, and no computed field (one that a model forbidding or keeping extra keys
would not read back as itself); reading recomputes them. No I/O here.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math
import re
import types
import typing
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

import pydantic
import pydantic_core
from pydantic.fields import FieldInfo
from pydantic_core import PydanticSerializationError
from pydantic_graph import End
from pydantic_graph.persistence import NodeSnapshot, RunEndT, Snapshot, StateT
from typing_extensions import is_typeddict

__all__ = ["ForeignNode", "NotASnapshot", "SnapshotCodec", "Unfit", "Unreadable", "foreign_node"]

_Path = tuple[str | int, ...]
_V = TypeVar("_V")
#: How deep `_unfit` looks for the bad part of a value.
_DEEPEST = 32

#: Values pydantic writes masked (`**********`), which never read back as themselves.
_SECRETS = (pydantic.SecretStr, pydantic.SecretBytes, pydantic.Secret)

#: Types whose values `_difference` compares by `==` alone (no subclass, no enum).
_SCALARS = frozenset((int, float, str, bool, bytes, type(None)))

_UNEXPECTED = re.compile(
    r"Expected `([^`]+)`[^\[]*\[(?:field_name='[^']*', )?input_value=(.*?), input_type=(\w+)\]"
)


class Unfit(ValueError):
    """A snapshot that may not be written: where (`field`, a dotted path) and why."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


class ForeignNode(ValueError):
    """A stored node snapshot whose node (`node_id`) is not one of the graph's (`node_ids`)."""

    def __init__(self, node_id: object, node_ids: Collection[str]) -> None:
        super().__init__(f"node {node_id!r} is not one of {sorted(node_ids)}")
        self.node_id, self.node_ids = node_id, node_ids


class NotASnapshot(ValueError):
    """Stored bytes that are no snapshot at all (`problem`: why): not JSON, not an object
    of kind node or end, or one whose node is named by no name (what another framework's
    run under this id, or another program, writes)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class Unreadable(ValueError):
    """Stored bytes that a validator of the graph's types refused by raising something other
    than a `ValueError` (a `TypeError`, a `KeyError`), which pydantic lets through as it is
    instead of a `ValidationError` naming the field (`problem`: what it raised)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class SnapshotCodec(Generic[StateT, RunEndT]):
    """The graph's snapshot adapter and the types it was built from.

    Build it inside the graph's node-type context (`set_types`); `node_ids`
    are the graph's nodes, whose tags pydantic puts in a validation path, and
    `node_types` their classes, where known.
    """

    def __init__(
        self,
        state_type: type[StateT],
        run_end_type: type[RunEndT],
        node_ids: Collection[str],
        node_types: Mapping[str, type] | None = None,
    ) -> None:
        self.state_type, self.run_end_type = state_type, run_end_type
        self.node_ids = frozenset(node_ids)
        self.node_types: Mapping[str, type] = dict(node_types or {})
        snapshot = Snapshot[state_type, run_end_type]  # type: ignore[valid-type]
        self.declared: Any = snapshot
        try:
            self.adapter: pydantic.TypeAdapter[Snapshot[StateT, RunEndT]] = pydantic.TypeAdapter(
                Annotated[snapshot, pydantic.Discriminator("kind")]
            )
            if not getattr(self.adapter, "pydantic_complete", True):
                # A name a dataclass's annotation uses that does not resolve (classes made
                # in a function): pydantic would say so at the first write, asking for a
                # `rebuild()` of this adapter, which the user never sees.
                self.adapter.rebuild(raise_errors=True)
        except pydantic.PydanticSchemaGenerationError as exc:
            raise self._schemaless(exc) from exc
        except pydantic.PydanticUndefinedAnnotation as exc:
            raise self._undefined(exc) from exc

    def _declared_parts(self) -> list[tuple[_Path, str, Any]]:
        """The graph's types, each with its path in a snapshot (and, for a node, its name)."""
        parts: list[tuple[_Path, str, Any]] = [(("state",), "", self.state_type)]
        parts += [(("node",), f" of node {n}", t) for n, t in sorted(self.node_types.items())]
        parts.append((("result", "data"), "", self.run_end_type))
        return parts

    def _schemaless(
        self, exc: pydantic.PydanticSchemaGenerationError
    ) -> pydantic.PydanticSchemaGenerationError:
        """`exc` (pydantic has no schema for a type of the graph's), naming the field
        whose type it is: pydantic names the type alone."""
        for path, of, declared in self._declared_parts():
            found = _schemaless(declared, path)
            if found is not None:
                where, kind = found
                return pydantic.PydanticSchemaGenerationError(
                    f"the graph's types cannot be stored: pydantic has no schema for "
                    f"{getattr(kind, '__qualname__', kind)!s}, the type of {_dotted(where)}{of}. "
                    "Keep such an object in the graph's deps, which are never stored, or "
                    "give its class a pydantic schema (`__get_pydantic_core_schema__`); "
                    "`arbitrary_types_allowed` would not store it either"
                )
        return exc

    def _undefined(
        self, exc: pydantic.PydanticUndefinedAnnotation
    ) -> pydantic.PydanticUndefinedAnnotation:
        """`exc` (a name in the graph's types does not resolve), naming the field whose
        annotation uses it: pydantic names the name alone."""
        name = exc.name or ""
        where = next(
            (
                f"{_dotted(found)}{of}"
                for path, of, declared in self._declared_parts()
                if name and (found := _naming(declared, name, path)) is not None
            ),
            "a field of the graph's types",
        )
        return pydantic.PydanticUndefinedAnnotation(
            name,
            f"the graph's types cannot be stored: {name!r}, in the annotation of "
            f"{where}, is not defined where that class was (a class made in a function, "
            "with `from __future__ import annotations`). Define the classes the state and "
            "the nodes use at module level",
        )

    def decode(self, body: bytes) -> Snapshot[StateT, RunEndT]:
        """A stored snapshot: `NotASnapshot` if its bytes are none, `ForeignNode` if its
        node is not one of the graph's (a graph of one node class would take any node
        whose fields fit), else `pydantic.ValidationError` if it does not fit these types."""
        try:
            stored = pydantic_core.from_json(body)
        except ValueError as exc:
            raise NotASnapshot(f"its bytes are not JSON ({exc})") from exc
        if not isinstance(stored, dict) or stored.get("kind") not in ("node", "end"):
            # Every snapshot pydantic-graph writes is an object of kind node or end.
            raise NotASnapshot(f"it is no object of kind 'node' or 'end' ({_glimpse(stored)})")
        node = stored.get("node")
        if isinstance(node, dict) and "node_id" in node:
            node_id = node["node_id"]
            if not isinstance(node_id, str):
                raise NotASnapshot(f"its node is named by {node_id!r}, not by a node id")
            if self.node_ids and node_id not in self.node_ids:
                raise ForeignNode(node_id, self.node_ids)
        try:
            return self.adapter.validate_json(body)
        except pydantic.ValidationError:
            raise
        except Exception as exc:  # a validator that raised past pydantic (see `Unreadable`)
            raise Unreadable(_raised(exc)) from exc

    def dropped(self, body: bytes, snapshot: Snapshot[StateT, RunEndT]) -> str | None:
        """The dotted path of the first key of the stored `body` that `snapshot`, read
        from it, has not kept (`node.value`): a field of the graph's types removed or
        renamed since the snapshot was written, whose value pydantic ignores as it reads.
        None if every stored key is kept (a field gained since is no loss). Written again
        as it was written, a snapshot of unchanged types gives its bytes back; else each
        writing is looked through (also with computed fields, which a snapshot stored by
        an earlier release of Remit holds)."""
        kept: list[Any] = []
        for round_trip, by_alias in ((True, False), (True, True), (False, False), (False, True)):
            try:
                again = self.adapter.dump_json(
                    snapshot, warnings=False, by_alias=by_alias, round_trip=round_trip
                )
            except PydanticSerializationError:
                continue
            if again == body:
                return None
            kept.append(pydantic_core.from_json(again))
        path = _lost_key(pydantic_core.from_json(body), kept, ())
        return None if path is None else _dotted(path)

    def encode(self, snapshot: Snapshot[StateT, RunEndT]) -> bytes:
        """The snapshot's bytes, or `Unfit` if they would not read back as this snapshot."""
        self._check_node(snapshot)
        try:
            body = self.adapter.dump_json(snapshot, warnings="error", round_trip=True)
        except PydanticSerializationError as exc:
            path, problem = (
                self._unserializable(snapshot)
                or _narrowest(self._unfit_in_snapshot(snapshot), self._unreadable(snapshot))
                or ((), _problem(str(exc)))
            )
            unfit = Unfit(_dotted(path), f"does not fit the graph's types: {problem}")
            raise self._secret_unfit(snapshot, unfit) from exc
        refused = self._read_back(snapshot, body)
        if refused is None:
            return body
        # A model whose fields have aliases reads them by alias only (unless it allows
        # names too): written by name, it would not read back. By alias, it may.
        aliased = self.adapter.dump_json(snapshot, warnings="error", by_alias=True, round_trip=True)
        if aliased != body:
            also = self._read_back(snapshot, aliased)
            if also is None:
                return aliased
            # Report the writing that got further: the other wrote fields under names the
            # model does not read (it found them missing, or read back their defaults).
            refused = also if _rank(also) < _rank(refused) else refused
        unfit, cause, _ = refused
        raise self._secret_unfit(snapshot, unfit) from cause

    def _huge_int(self, snapshot: Snapshot[StateT, RunEndT]) -> _Path | None:
        """The path to the first int in `snapshot` that JSON written by pydantic does not
        read back (too many digits), if any."""
        for key, value, declared in self._parts_of(snapshot):
            for path, part in _walk(value, declared, (key,)):
                if isinstance(part, int) and _unreadable_int(part):
                    return path
        return None

    def _secret_unfit(self, snapshot: Snapshot[StateT, RunEndT], unfit: Unfit) -> Unfit:
        """`unfit`, said plainly if the value it names is a secret (`SecretStr`, `SecretBytes`,
        `Secret[...]`): pydantic writes a secret masked, so it reads back as the mask (or,
        for a `Secret[int]`, not at all), which the refusal alone shows as a secret read back
        as itself. Looked for only once a snapshot is refused."""
        for key, value, declared in self._parts_of(snapshot):
            for path, part in _walk(value, declared, (key,), toward=unfit.field):
                where = _dotted(path)
                if isinstance(part, _SECRETS):
                    return Unfit(
                        where,
                        f"is a secret ({type(part).__name__}), which pydantic writes masked "
                        "as '**********': it would read back as the mask, not its value. "
                        "Keep secrets out of the run's state and nodes (pass them in deps, "
                        "which are not stored), or declare a serializer that writes the value",
                    )
        return unfit

    def _read_back(
        self, snapshot: Snapshot[StateT, RunEndT], body: bytes
    ) -> tuple[Unfit, Exception | None, int] | None:
        """None if `body` reads back as `snapshot`; else the refusal, its cause and how
        many fields the reading found missing."""
        try:
            back = self.adapter.validate_json(body)
        except pydantic.ValidationError as exc:
            errors = exc.errors()
            path = self._path_of(errors[0].get("loc", ()))
            problem = f"does not satisfy the graph's types: {errors[0].get('msg')}"
            huge = None
            if not path and errors[0]["type"] == "json_invalid":
                huge = self._huge_int(snapshot)
            if huge is not None:
                # pydantic writes any int, but its JSON reader reads none of more digits
                # than Python converts from text, and says so of the whole document.
                path = huge
                problem = (
                    "is an integer too large to be read back: pydantic's JSON reader refuses "
                    f"it ({errors[0].get('msg')}); store it as a str"
                )
            elif not path and errors[0]["type"] == "json_invalid":
                # pydantic's JSON reader reads only so many levels of nesting, and says so
                # of the whole document: name the value nested that deep.
                path = _deepest(snapshot)
                problem = f"is nested too deeply to be read back ({errors[0].get('msg')})"
            unfit = Unfit(_dotted(path), problem)
            return unfit, exc, sum(e["type"] == "missing" for e in errors)
        except Exception as exc:  # pydantic lets through what a validator raised, but a
            # ValueError or an AssertionError (a TypeError, a KeyError): find where it raised.
            problem = f"does not read back: a validator raised {_raised(exc)}"
            return Unfit(_dotted(self._raising(snapshot)), problem), exc, 0
        # Walked also when equal: an enum member in an `Any` field reads back as its plain
        # value, which a `StrEnum` or an `IntEnum` member equals; a datetime in a zone with
        # daylight-saving time as the equal instant at a fixed offset.
        found = _difference(snapshot, back, (), self.declared)
        if found is None:
            return None
        path, ours, read = found
        problem = f"{ours!r} would read back as {read!r}"
        if path == ("node", "node_id"):
            # A node's JSON carries its class's name under `node_id` (its tag in the graph's
            # union of nodes), which a field of that name is written over by.
            problem = (
                f"is a node field named node_id, the key pydantic-graph writes the node's "
                f"class under, so {problem}: rename the field"
            )
        return Unfit(_dotted(path), problem), None, 0

    def _check_node(self, snapshot: Snapshot[StateT, RunEndT]) -> None:
        """`Unfit` at `node` for a node of another graph: pydantic would only say which of
        the graph's nodes it expected, at the snapshot's root (or, in a graph of one node
        class, take any node whose fields fit), or, for another class of the same name as
        one of the graph's, that it was "unable to extract tag"."""
        if not isinstance(snapshot, NodeSnapshot) or not self.node_ids:
            return
        problem = foreign_node(snapshot.node, self.node_ids, self.node_types)
        if problem is not None:
            raise Unfit("node", problem)

    def where(self, loc: Sequence[int | str]) -> str:
        """A pydantic validation path as a snapshot's dotted path (`state.inner.amount`)."""
        return _dotted(self._path_of(loc))

    def _path_of(self, loc: Sequence[int | str]) -> _Path:
        """A pydantic validation path without its union tags (`kind`, then the node's id)."""
        parts = tuple(loc)
        if parts and parts[0] in ("node", "end"):
            parts = parts[1:]
        if len(parts) > 1 and parts[0] == "node" and parts[1] in self.node_ids:
            parts = parts[:1] + parts[2:]
        return parts

    def _unreadable(self, snapshot: Snapshot[StateT, RunEndT]) -> tuple[_Path, str] | None:
        """Where `snapshot`, written in spite of the serializer's warnings, fails to read
        back. A TypedDict missing a required key serializes alone without a warning, so
        `_unserializable` cannot find it; only the whole snapshot's serializer warns,
        naming neither the key nor where the TypedDict is."""
        try:
            body = self.adapter.dump_json(snapshot, warnings=False, round_trip=True)
        except PydanticSerializationError:
            return None
        try:
            self.adapter.validate_json(body)
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            return self._path_of(error.get("loc", ())), str(error.get("msg"))
        except Exception as exc:  # a validator that raised past pydantic (`_read_back`)
            return self._raising(snapshot), f"a validator raised {_raised(exc)}"
        return None

    def _parts_of(self, snapshot: Snapshot[StateT, RunEndT]) -> list[tuple[str, Any, Any]]:
        """The snapshot's state and node (or result), each with its declared type."""
        parts: list[tuple[str, Any, Any]] = [("state", snapshot.state, self.state_type)]
        if isinstance(snapshot, NodeSnapshot):
            parts.append(("node", snapshot.node, type(snapshot.node)))
        else:
            parts.append(("result", snapshot.result, End[self.run_end_type]))  # type: ignore[name-defined]
        return parts

    def _raising(self, snapshot: Snapshot[StateT, RunEndT]) -> _Path:
        """Where in `snapshot` a validator raises past pydantic as it is read back (the
        deepest part that does); the root if no part does alone."""
        for key, value, declared in self._parts_of(snapshot):
            found = _raises(value, declared, (key,))
            if found is not None:
                return found
        return ()

    def _unserializable(self, snapshot: Snapshot[StateT, RunEndT]) -> tuple[_Path, str] | None:
        """The first part of `snapshot` that fails to serialize, looked for field by field."""
        parts = self._parts_of(snapshot)
        for key, value, declared in parts:
            found = _unfit(value, declared, (key,))
            if found is not None:
                return found
        for key, value, declared in parts:
            found = _misclassed(value, declared, (key,))
            if found is not None:
                return found
        return None

    def _unfit_in_snapshot(self, snapshot: Snapshot[StateT, RunEndT]) -> tuple[_Path, str] | None:
        """The first part of `snapshot` that fails to serialize as the snapshot serializes
        it (`_dump_problem`'s `in_union`), where it fails alone without a warning."""
        for key, value, declared in self._parts_of(snapshot):
            found = _unfit(value, declared, (key,), in_union=True)
            if found is not None:
                return found
        return None


def foreign_node(
    node: Any, node_ids: Collection[str], node_types: Mapping[str, type]
) -> str | None:
    """Why `node` is not a node of the graph of `node_ids` (classes `node_types`, where
    known); None if it is one. A class of another module or graph that has the name of
    one of the graph's nodes is not that node: its fields and its `run` are another's."""
    node_id = node.get_node_id()
    if node_id not in node_ids:
        return f"{node_id} is not a node of this graph ({', '.join(sorted(node_ids))})"
    declared = node_types.get(node_id)
    ours = typing.get_origin(declared) or declared  # a generic node given as `Hold[int]`
    if ours is not None and type(node) is not ours:
        return (
            f"{_qualified(type(node))} is not this graph's {node_id} ({_qualified(ours)}): a "
            "node of another graph or module that has the same name, which this graph "
            "would read back as its own"
        )
    return None


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _glimpse(value: Any) -> str:
    """A short view of stored JSON that is no snapshot: its keys, or its start."""
    if isinstance(value, dict):
        return f"an object of keys {', '.join(sorted(map(str, value))[:8]) or 'none'}"
    return f"{type(value).__name__} {str(value)[:60]}"


def _rank(refused: tuple[Unfit, Exception | None, int]) -> tuple[int, bool]:
    """How far a refused writing got: fields found missing, then a value read back as
    another (a field read back as its default) behind a value the types refuse."""
    _, cause, missing = refused
    return missing, cause is None


def _lost_key(stored: Any, kept: list[Any], path: _Path) -> _Path | None:
    """The path of the first key of stored JSON that none of its writings again (`kept`,
    by name and by alias) has, if any: only keys are looked for, not changed values.

    A list's item is matched with the item at its position, or else with any item of
    the list written again that has its keys: a set is written in its iteration order,
    which differs in another process (another hash seed) and in a set built afresh as
    it is read, so a set of several kinds of model (`set[Email | Phone]`) comes back
    with an `Email` where a `Phone` was written."""
    if isinstance(stored, dict):
        mappings = [k for k in kept if isinstance(k, dict)]
        if not mappings:
            return None
        for key, value in stored.items():
            has = [k[key] for k in mappings if key in k]
            if not has:
                return (*path, key)
            found = _lost_key(value, has, (*path, key))
            if found is not None:
                return found
    elif isinstance(stored, list):
        lists = [k for k in kept if isinstance(k, list) and len(k) == len(stored)]
        for i, value in enumerate(stored):
            found = _lost_key(value, [k[i] for k in lists], (*path, i))
            if found is not None:
                found = _lost_in_list(value, [item for k in lists for item in k], (*path, i))
            if found is not None:
                return found
    return None


def _lost_in_list(stored: Any, written: list[Any], path: _Path) -> _Path | None:
    """`_lost_key` of a list's item `stored` against the items of the list written again:
    None if one of them keeps all its keys, else its loss against the item most like it
    (of objects, the one sharing the most of its keys: its own writing again)."""
    closest: tuple[int, _Path] | None = None
    for item in written:
        found = _lost_key(stored, [item], path)
        if found is None:
            return None
        both = isinstance(stored, dict) and isinstance(item, dict)
        shared = len(stored.keys() & item.keys()) if both else 0
        if closest is None or shared > closest[0]:
            closest = (shared, found)
    return None if closest is None else closest[1]


def _narrowest(
    unfit: tuple[_Path, str] | None, unreadable: tuple[_Path, str] | None
) -> tuple[_Path, str] | None:
    """Where a snapshot that fails to serialize is refused: at the value its serializer
    warns of (`unfit`), or where it fails to read back (`unreadable`) if that is inside
    the value (a TypedDict's missing key; the serializer names only the TypedDict).
    Elsewhere, a read-back failure is the warned value's doing, written as something else."""
    if unfit is None:
        return unreadable
    if unreadable is not None and unreadable[0][: len(unfit[0])] == unfit[0]:
        return unreadable
    return unfit


def _dotted(path: _Path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _problem(text: str) -> str:
    """What pydantic's serializer complained of, without its union tries' noise."""
    found = _UNEXPECTED.search(text)
    if found is None:
        return text.replace("\n", " ")[:300]
    expected, value, kind = found.groups()
    return f"expected {expected}, got {kind} {value}"


@dataclasses.dataclass
class _Held(Generic[_V]):
    """A value held as a snapshot holds its parts: inside a tagged union (`_dump_problem`)."""

    value: _V
    kind: Literal["held"] = "held"


@dataclasses.dataclass
class _Unheld:
    kind: Literal["unheld"] = "unheld"


def _dump_problem(value: Any, declared: Any, *, in_union: bool = False) -> str | None:
    """Why `value` does not serialize as `declared`; None if it does or cannot be told.

    `in_union`: as inside the snapshot's tagged union (node or end), where pydantic first
    serializes every value strictly: a `Decimal` in a `float` field is written alone
    without a warning, and warns there only."""
    adapter: pydantic.TypeAdapter[Any]
    try:
        if in_union:
            held: Any = _Held[declared]  # type: ignore[valid-type]
            declared = Annotated[held | _Unheld, pydantic.Discriminator("kind")]
            value = _Held(value)
        try:
            adapter = pydantic.TypeAdapter(declared)
        except pydantic.PydanticSchemaGenerationError:
            # A type of a model that allows arbitrary types, which pydantic refuses alone:
            # built as a field of such a model (`config` is refused on a class of its own).
            arbitrary = pydantic.ConfigDict(arbitrary_types_allowed=True)
            adapter = pydantic.TypeAdapter(_Held[declared], config=arbitrary)  # type: ignore[valid-type]
            value = _Held(value)
    except Exception:  # a type pydantic cannot build alone (an unresolved name)
        return None
    try:
        adapter.dump_json(value, warnings="error", round_trip=True)
    except PydanticSerializationError as exc:
        return _problem(str(exc))
    return None


def _schemaless(
    declared: Any, path: _Path, above: frozenset[type] = frozenset()
) -> tuple[_Path, Any] | None:
    """The deepest field of `declared` (a dataclass's, a TypedDict's, in a union or a
    container) whose type pydantic has no schema for, with that type; None if it has one.
    A class it is inside (`above`) is not looked into again. Only after pydantic refused
    the graph's types: it builds an adapter for each type."""
    try:
        pydantic.TypeAdapter(declared)
    except pydantic.PydanticSchemaGenerationError:
        pass
    except Exception:  # another refusal (an unresolved name): not this one
        return None
    else:
        return None
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    origin, args = typing.get_origin(declared) or declared, typing.get_args(declared)
    if origin in above:
        return None
    if isinstance(origin, type) and (dataclasses.is_dataclass(origin) or is_typeddict(origin)):
        above |= {origin}
        hints = _hints(origin, args)
        names = (
            [f.name for f in dataclasses.fields(origin)]
            if hints and dataclasses.is_dataclass(origin)
            else list(hints)
        )
        inner: list[tuple[_Path, Any]] = [((*path, n), hints[n]) for n in names if n in hints]
    else:  # a union's members, a container's items: at the same path
        inner = [(path, arg) for arg in args]
    for where, kind in inner:
        found = _schemaless(kind, where, above)
        if found is not None:
            return found
    return None if inner else (path, declared)  # a part refused only as a class it is in


def _naming(
    declared: Any, name: str, path: _Path, above: frozenset[type] = frozenset()
) -> _Path | None:
    """The path to the field of `declared` (a dataclass's, a TypedDict's, in a union or a
    container) whose annotation, as written, uses `name` (a name that does not resolve).
    A class it is inside (`above`) is not looked into again."""
    origin, args = typing.get_origin(declared) or declared, typing.get_args(declared)
    if origin in above:
        return None
    if not (
        isinstance(origin, type) and (dataclasses.is_dataclass(origin) or is_typeddict(origin))
    ):
        return next((p for arg in args if (p := _naming(arg, name, path, above)) is not None), None)
    above |= {origin}
    hints = _hints(origin, args)
    if dataclasses.is_dataclass(origin):
        annotations = {f.name: f.type for f in dataclasses.fields(origin)}
    else:
        annotations = dict(getattr(origin, "__annotations__", {}))
    for field, written in annotations.items():
        if field in hints:
            found = _naming(hints[field], name, (*path, field), above)
            if found is not None:
                return found
        elif isinstance(written, str) and re.search(rf"\b{re.escape(name)}\b", written):
            return (*path, field)
    return None


def _unfit(
    value: Any,
    declared: Any,
    path: _Path,
    above: tuple[tuple[Any, _Path], ...] = (),
    *,
    in_union: bool = False,
) -> tuple[_Path, str] | None:
    """The deepest part of `value` that does not serialize as `declared`, and why; a part
    that is one of the values it is inside (`above`, with their paths) closes a cycle.
    `in_union`: serialized as inside the snapshot (`_dump_problem`)."""
    problem = _dump_problem(value, declared, in_union=in_union)
    if problem is None:
        return None
    if len(path) > _DEEPEST:
        return path, problem
    above = (*above, (value, path))
    for key, child, child_type in _parts(value, declared):
        holder = next((where for outer, where in above if outer is child), None)
        if holder is not None:
            return (*path, key), (
                f"is {_dotted(holder)} itself, which holds it: a circular reference, which "
                "JSON cannot hold"
            )
        found = _unfit(child, child_type, (*path, key), above, in_union=in_union)
        if found is not None:
            return found
    if isinstance(value, bytes) and not _utf8(value):
        problem = (
            f"{problem}: pydantic writes bytes as UTF-8 text, and these are binary data. "
            "Declare the field pydantic.Base64Bytes, or set ser_json_bytes='base64' and "
            "val_json_bytes='base64' in its model's config, to store them"
        )
    return path, problem


def _misclassed(value: Any, declared: Any, path: _Path) -> tuple[_Path, str] | None:
    """The first model in `value` that is not of the model class its field declares, and
    why. A generic model built without its parameters (`Box(...)` in a `Box[Item]` field)
    is another class: pydantic writes it without a warning inside its own model's dump,
    but warns inside a snapshot's, at the snapshot's root."""
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    if (
        isinstance(value, pydantic.BaseModel)
        and isinstance(declared, type)
        and issubclass(declared, pydantic.BaseModel)
        and not isinstance(value, declared)
    ):
        problem = (
            f"is a {type(value).__qualname__}, not the {declared.__qualname__} its field "
            "declares, so pydantic would not write it as that"
        )
        if declared.__pydantic_generic_metadata__["origin"] is type(value):
            problem += (
                f": a generic model built without its parameters is another class; build "
                f"it as {declared.__qualname__}(...)"
            )
        return path, problem
    if len(path) <= _DEEPEST:
        for key, child, child_type in _parts(value, declared):
            found = _misclassed(child, child_type, (*path, key))
            if found is not None:
                return found
    return None


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _raised(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _raises_alone(value: Any, declared: Any) -> bool:
    """Whether `value`, written as `declared`, raises past pydantic as it is read back."""
    try:
        adapter = pydantic.TypeAdapter(declared)
        body = adapter.dump_json(value, warnings=False, round_trip=True)
    except Exception:  # a type pydantic cannot build alone, or a value it cannot write
        return False
    try:
        adapter.validate_json(body)
    except pydantic.ValidationError:
        return False
    except Exception:
        return True
    return False


def _raises(value: Any, declared: Any, path: _Path) -> _Path | None:
    """The deepest part of `value` whose validator raises past pydantic (`_raises_alone`)."""
    if not _raises_alone(value, declared):
        return None
    if len(path) > _DEEPEST:
        return path
    for key, child, child_type in _parts(value, declared):
        found = _raises(child, child_type, (*path, key))
        if found is not None:
            return found
    return path


def _parts(value: Any, declared: Any) -> Iterator[tuple[str | int, Any, Any]]:
    """`value`'s fields or items, each with its declared type (Any where none is known)."""
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    if declared is Any or isinstance(declared, typing.TypeVar):
        declared = type(value)
    origin, args = typing.get_origin(declared) or declared, typing.get_args(declared)
    if (
        isinstance(origin, type)
        and type(value) is not origin
        and (dataclasses.is_dataclass(value) or isinstance(value, pydantic.BaseModel))
        and _is_instance(value, origin)
    ):
        # A node declared as `BaseNode[...]`: its own class has the fields.
        origin, args = type(value), ()
    if origin in (Union, types.UnionType):
        member = next((m for m in args if _is_instance(value, m)), None)
        if member is not None:
            yield from _parts(value, member)
        return
    if not isinstance(origin, type):
        return
    if dataclasses.is_dataclass(origin) and isinstance(value, origin):
        hints = _hints(origin, args)
        for f in dataclasses.fields(origin):
            yield f.name, getattr(value, f.name, None), hints.get(f.name, Any)
    elif issubclass(origin, pydantic.BaseModel) and isinstance(value, origin):
        for name, info in origin.model_fields.items():
            yield name, getattr(value, name, None), info.annotation
    elif is_typeddict(origin) and isinstance(value, dict):
        hints = _hints(origin, ())
        for key, item in value.items():
            yield key, item, hints.get(key, Any)
    elif issubclass(origin, Mapping) and isinstance(value, Mapping):
        item_type = args[1] if len(args) == 2 else Any
        for key, item in value.items():
            yield key, item, item_type
    elif origin is tuple and isinstance(value, (list, tuple)):
        fixed = args and not (len(args) == 2 and args[1] is Ellipsis)
        for i, item in enumerate(value):
            yield i, item, (args[i] if fixed and i < len(args) else args[0] if args else Any)
    elif issubclass(origin, Collection) and isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            yield i, item, args[0] if args else Any


def _unreadable_int(number: int) -> bool:
    """Whether pydantic's JSON reader refuses `number` as pydantic writes it (one of
    thousands of digits: tried only past a thousand bits)."""
    if abs(number).bit_length() < 1000:
        return False
    try:
        pydantic_core.from_json(pydantic_core.to_json(number))
    except ValueError:
        return True
    return False


def _walk(
    value: Any, declared: Any, path: _Path, toward: str | None = None
) -> Iterator[tuple[_Path, Any]]:
    """`value` and its parts, each with its path, at most `_DEEPEST` steps down; with
    `toward` (a dotted path), only the parts on the way to it."""
    where = _dotted(path)
    if toward is not None and toward != where and not toward.startswith(f"{where}."):
        return
    yield path, value
    if len(path) <= _DEEPEST:
        for key, child, child_type in _parts(value, declared):
            yield from _walk(child, child_type, (*path, key), toward)


def _deepest(value: Any, steps: int = _DEEPEST) -> _Path:
    """The path to `value`'s most deeply nested part, at most `steps` steps long."""
    seen: dict[tuple[int, int], _Path] = {}  # a part shared by several parents: walked once

    def below(part: Any, left: int) -> _Path:
        if left == 0:
            return ()
        if (id(part), left) not in seen:
            paths = [(key, *below(child, left - 1)) for key, child, _ in _parts(part, Any)]
            seen[id(part), left] = max(paths, key=len, default=())
        return seen[id(part), left]

    return below(value, steps)


def _is_instance(value: Any, declared: Any) -> bool:
    origin = typing.get_origin(declared) or declared
    try:
        return isinstance(value, origin)
    except TypeError:  # Literal, Annotated and the like
        return False


#: Each class's resolved field types (`_class_hints`), read once: a snapshot holds many
#: instances of one class, and resolving annotations is slow (a 1 MB state of small
#: dataclasses took seconds to write when each instance's were resolved anew).
_HINTS: weakref.WeakKeyDictionary[type, dict[str, Any]] = weakref.WeakKeyDictionary()


def _class_hints(cls: type) -> dict[str, Any]:
    """`cls`'s field types (none known if an annotation does not resolve)."""
    try:
        return _HINTS[cls]
    except (KeyError, TypeError):
        pass
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # an annotation that does not resolve here: types unknown
        return {}
    try:
        _HINTS[cls] = hints
    except TypeError:  # a class that takes no weak reference: resolved each time
        pass
    return hints


def _hints(cls: type, args: tuple[Any, ...]) -> dict[str, Any]:
    """`cls`'s field types, with its type parameters bound to `args` (as in `End[int]`)."""
    hints = _class_hints(cls)
    if not hints:
        return {}
    params: tuple[Any, ...] = getattr(cls, "__parameters__", ())
    if not args or len(args) != len(params):
        return hints
    bound = dict(zip(params, args, strict=True))
    return {name: _bind(hint, bound) for name, hint in hints.items()}


def _bind(hint: Any, bound: Mapping[Any, Any]) -> Any:
    if isinstance(hint, typing.TypeVar):  # (an `Annotated` hint may not be hashable)
        return bound.get(hint, hint)
    inner = getattr(hint, "__parameters__", ())
    return hint[tuple(bound.get(p, p) for p in inner)] if inner else hint


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an __eq__ that refuses to answer
        return False


def _difference(
    ours: Any, read: Any, path: _Path, declared: Any = Any
) -> tuple[_Path, Any, Any] | None:
    """The first place where `read` (a round trip) differs from `ours`, by value.

    Objects are compared field by field (so a class compared by identity is
    compared by its data), sequences item by item, NaN equals NaN; anything
    else by `==`. A tuple read back as a list (or a list as a tuple) is equal
    only where its `declared` type makes it one (a tuple in a `list[int]`
    field); in an `Any` field it would come back as another type. So is a
    mapping read back as a plain dict (a `defaultdict` in an `Any` field), and a set
    read back as a frozenset, or a frozenset as a set.
    """
    children: Callable[[Any], Mapping[Any, Any]] | None = None
    if dataclasses.is_dataclass(ours) and not isinstance(ours, type):
        children = _dataclass_fields
    elif isinstance(ours, pydantic.BaseModel):
        children = _model_fields
    elif isinstance(ours, Mapping) and isinstance(read, Mapping):
        if type(ours) is not type(read) and not _declares(declared, type(read)):
            # A `defaultdict`, `Counter` or `OrderedDict` in an `Any` field reads back as a
            # plain dict: equal, but one whose missing keys raise `KeyError` on resume.
            return path, ours, read
        children = dict
    elif isinstance(ours, (list, tuple)) and isinstance(read, (list, tuple)):
        if type(ours) is not type(read) and not _declares(declared, type(read)):
            return path, ours, read
        children = _indexed
    elif isinstance(ours, (set, frozenset)) and isinstance(read, (set, frozenset)):
        if type(ours) is not type(read) and not _declares(declared, type(read)):
            # A set in a `frozenset[str] | set[str]` field reads back as a frozenset (no
            # `add` on resume), a frozenset in `set[str] | frozenset[str]` as a set.
            return path, ours, read
        return _set_difference(ours, read, path, declared)
    if children is None:
        if isinstance(ours, float) and isinstance(read, float) and math.isnan(ours):
            return None if math.isnan(read) else (path, ours, read)
        if not _equal(ours, read) or _demoted(ours, read, declared) or _zone_lost(ours, read):
            return path, ours, read
        if isinstance(ours, (datetime.datetime, datetime.time)) and ours.fold != read.fold:
            # The second of a repeated local hour (`fromtimestamp` as clocks go back): its
            # ISO form keeps no fold, and `==` of naive values ignores it.
            return path, ours, read
        return None
    if type(ours) is not type(read) and not isinstance(ours, (Mapping, list, tuple)):
        return path, ours, read
    if children in (dict, _indexed) and _plain(ours) and _equal(ours, read):
        return None  # builtin scalars only: equal is the same (a large list, at C speed)
    mine, theirs = children(ours), children(read)
    if mine.keys() != theirs.keys():
        return path, ours, read
    if children is dict:
        read_keys = {key: key for key in theirs}
        key_type = _key_type(declared)
        for key in mine:
            if _demoted(key, read_keys[key], key_type) or _zone_lost(key, read_keys[key]):
                return (*path, key), key, read_keys[key]
    declared_parts = {key: part for key, _, part in _parts(ours, declared)}
    for key, value in mine.items():
        found = _difference(value, theirs[key], (*path, key), declared_parts.get(key, Any))
        if found is not None:
            return found
    return None


def _set_difference(
    ours: Collection[Any], read: Collection[Any], path: _Path, declared: Any
) -> tuple[_Path, Any, Any] | None:
    """Where the set `read` differs from the set `ours`: a set is equal when its members
    are, by `==`, which an enum member and its value, or a datetime and the same instant at
    another offset, pass. Each member is compared with the member it equals, as a mapping's
    keys are (a `StrEnum` member in a `set[Any]` reads back as its str). Named at the set:
    its members have no path of their own."""
    if not _equal(ours, read):
        return path, ours, read
    if _plain(ours):
        return None
    member_type = next((part for _, _, part in _parts(ours, declared)), Any)
    members = {member: member for member in read}
    for member in ours:
        if _difference(member, members.get(member, member), path, member_type) is not None:
            return path, ours, read
    return None


def _zone_lost(ours: Any, read: Any) -> bool:
    """Whether `read`, a datetime (or time) equal to `ours`, lost `ours`'s time zone.
    pydantic writes an aware datetime with its UTC offset only, and reads it back in that
    fixed offset: one in a zone whose offset changes with the date (a `ZoneInfo` with
    daylight-saving time) would then give other wall times (`+ timedelta(days=180)`) and
    another `tzname()`. A time in such a zone has no offset: it reads back naive."""
    moments = (datetime.datetime, datetime.time)
    if not isinstance(ours, moments) or not isinstance(read, moments):
        return False
    zone = ours.tzinfo
    return zone is not None and read.tzinfo is not zone and zone.utcoffset(None) is None


def _plain(items: Collection[Any]) -> bool:
    """Whether `items` (a mapping's keys and values) are all builtin scalars, which read
    back equal only as themselves, or as the type their field declares."""
    if isinstance(items, Mapping):
        return _plain(items.keys()) and _plain(items.values())
    return all(type(item) in _SCALARS for item in items)


def _demoted(ours: Any, read: Any, declared: Any) -> bool:
    """Whether `read`, equal to the enum member `ours`, came back as another type that
    `declared` does not make it (a `StrEnum` member in an `Any` field reads back as its
    str). A member read back as what its field declares (a `str` field) follows the
    declared type, unless the field also names the member's enum (`Color | str`): pydantic
    keeps the member there, and reads its JSON value back as the `str`."""
    if not isinstance(ours, enum.Enum) or type(read) is type(ours):
        return False
    return _names_enum(declared, ours) or not _admits(declared, read)


def _names_enum(declared: Any, member: enum.Enum) -> bool:
    """Whether `declared` names `member`'s enum: is it, or has it as a union's member, or
    is a `Literal` holding `member` itself."""
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    origin = typing.get_origin(declared) or declared
    if origin in (Union, types.UnionType):
        return any(_names_enum(m, member) for m in typing.get_args(declared))
    if origin is typing.Literal:
        return any(v is member for v in typing.get_args(declared))
    return isinstance(origin, type) and issubclass(origin, enum.Enum) and isinstance(member, origin)


def _admits(declared: Any, value: Any) -> bool:
    """Whether `declared` names `value`'s type (a class it is an instance of, a union
    member that does, or a `Literal` holding it); `Any` and unknown types do not."""
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    origin = typing.get_origin(declared) or declared
    if origin in (Union, types.UnionType):
        return any(_admits(m, value) for m in typing.get_args(declared))
    if origin is typing.Literal:
        return any(type(v) is type(value) and _equal(v, value) for v in typing.get_args(declared))
    return (
        isinstance(origin, type)
        and origin is not object
        and origin is not Any
        and isinstance(value, origin)
    )


def _key_type(declared: Any) -> Any:
    """The key type a mapping type declares (`Any` if none)."""
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    origin, args = typing.get_origin(declared) or declared, typing.get_args(declared)
    if isinstance(origin, type) and issubclass(origin, Mapping) and len(args) == 2:
        return args[0]
    return Any


def _declares(declared: Any, kind: type) -> bool:
    """Whether every type `declared` allows for a sequence or a mapping reads it back as
    `kind` (`list[int]`, `Sequence[int]` for a list; `dict[str, int]` for a dict): then a
    round trip that gives a `kind` follows the declared type. `Any`, or a union that also
    allows another sequence type, would not have changed it."""
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    origin = typing.get_origin(declared) or declared
    if origin in (Union, types.UnionType):
        members = [m for m in typing.get_args(declared) if m is not type(None)]
        return all(_declares(m, kind) for m in members)
    if not isinstance(origin, type) or origin is object:
        return False
    try:
        return issubclass(kind, origin)
    except TypeError:  # a TypedDict takes no class checks: it reads back as a plain dict
        return is_typeddict(origin) and kind is dict


def _dataclass_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's stored data: its fields, less those excluded from dumps (as a model's)."""
    cls = type(obj)
    return {
        f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj) if not _excluded(cls, f)
    }


def _excluded(cls: type, f: dataclasses.Field[Any]) -> bool:
    """Whether pydantic leaves `f` out of dumps (`Field(exclude=True)`): not stored, so a
    read back holds its default, as a model's excluded field does."""
    infos = getattr(cls, "__pydantic_fields__", None)  # a pydantic dataclass
    if isinstance(infos, Mapping) and f.name in infos:
        return bool(infos[f.name].exclude)
    hint = _hints(cls, ()).get(f.name)
    metadata = typing.get_args(hint)[1:] if typing.get_origin(hint) is Annotated else ()
    return any(isinstance(m, FieldInfo) and m.exclude is True for m in (*metadata, f.default))


def _model_fields(model: pydantic.BaseModel) -> dict[str, Any]:
    """A model's stored data: its fields (those not excluded from dumps) and extras."""
    fields = {
        name: getattr(model, name)
        for name, info in type(model).model_fields.items()
        if not info.exclude
    }
    return {**fields, **(model.model_extra or {})}


def _indexed(items: Sequence[Any]) -> dict[int, Any]:
    return dict(enumerate(items))
