"""Validation on write (P4) and numbered state-schema migrations.

`StateSchema(OrderState)` accepts a Pydantic model, a TypedDict, a dataclass,
any type pydantic's `TypeAdapter` understands, or a JSON Schema dict. It
raises `CheckpointInvalid` naming the first failing field before anything is
written. `Migrations` upgrades a decoded state from the version it was
written with to the reader's, step by step, or refuses with `VersionMismatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from remit_core.errors import CheckpointInvalid, VersionMismatch

Migration = Callable[[Any], Any]

#: Core-schema node types that validate plain data into plain data: a value
#: validated by a schema made of these alone has nothing the second, plain-form
#: pass of `StateSchema.validate` could find (no instance taken as it is).
_PLAIN_NODES = frozenset(
    {
        "any", "none", "bool", "int", "float", "decimal", "str", "bytes", "date", "time",
        "datetime", "timedelta", "uuid", "literal", "list", "tuple", "set", "frozenset",
        "dict", "nullable", "union", "default", "typed-dict", "typed-dict-field",
    }
)  # fmt: skip


def _plain_only(node: Any) -> bool:
    """Whether every schema node under `node` is one of `_PLAIN_NODES` (a dict
    with another "type", a model's or a validator function's, says no)."""
    if isinstance(node, Mapping):
        kind = node.get("type")
        if isinstance(kind, str) and kind not in _PLAIN_NODES:
            return False
        return all(_plain_only(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return all(_plain_only(v) for v in node)
    return True


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


class Migrations:
    """Registered steps `n -> n + 1` between state-schema versions."""

    def __init__(self) -> None:
        self._steps: dict[int, Migration] = {}

    def register(self, from_version: int) -> Callable[[Migration], Migration]:
        """Decorator: `@migrations.register(1)` upgrades a version-1 state to version 2."""

        def deco(fn: Migration) -> Migration:
            if from_version in self._steps:
                raise ValueError(f"a migration from version {from_version} is already registered")
            self._steps[from_version] = fn
            return fn

        return deco

    def migrate(self, value: Any, from_version: int, to_version: int, **ids: Any) -> Any:
        """Apply steps from `from_version` up to `to_version`, or raise `VersionMismatch`."""
        if from_version > to_version:
            raise VersionMismatch(
                f"state was written with schema version {from_version}, newer than this "
                f"reader's {to_version}",
                **ids,
            )
        for v in range(from_version, to_version):
            step = self._steps.get(v)
            if step is None:
                raise VersionMismatch(
                    f"state has schema version {from_version}, reader expects {to_version}, and "
                    f"no migration from version {v} is registered",
                    **ids,
                )
            value = step(value)
        return value


class StateSchema:
    """A run's declared state type, its version, and the migrations that lead to it."""

    def __init__(
        self,
        type_: Any,
        *,
        version: int = 1,
        strict: bool = False,
        migrations: Migrations | None = None,
    ) -> None:
        self.type_ = type_
        self.version = version
        self.strict = strict
        self.migrations = migrations or Migrations()
        if isinstance(type_, Mapping):
            self._adapter: TypeAdapter[Any] | None = None
            self._json_schema: Mapping[str, Any] | None = type_
        else:
            self._adapter = TypeAdapter(type_)
            self._json_schema = None
        self._plain = self._adapter is not None and _plain_only(self._adapter.core_schema)

    def validate(self, value: Any, **ids: Any) -> Any:
        """Return the validated value, or raise `CheckpointInvalid` naming the field.

        Pydantic accepts model and dataclass instances as they are, nested ones
        included, so a value built with `model_construct` or changed by an
        assignment without `validate_assignment` would pass unchecked. The
        value's plain form (what a checkpoint stores) is therefore validated
        too; that second pass is lax, since strict mode wants instances.
        """
        if self._json_schema is not None:
            _validate_json_schema(self._json_schema, value, ids)
            return value
        assert self._adapter is not None
        if (
            isinstance(value, BaseModel)
            and isinstance(self.type_, type)
            and not isinstance(value, self.type_)
        ):
            # Another model class with the same fields: validate its field values.
            value = {k: getattr(value, k) for k in type(value).model_fields if hasattr(value, k)}
        try:
            validated = self._adapter.validate_python(value, strict=self.strict)
            if self._plain:
                return validated  # plain data validated into plain data: no second pass
            try:
                plain = self._adapter.dump_python(
                    validated, round_trip=True, by_alias=True, warnings=False
                )
            except PydanticSerializationError:
                return validated  # no plain form: the instance check above is all there is
            self._adapter.validate_python(plain)
        except ValidationError as exc:
            raise _invalid(exc, ids) from exc
        return validated

    def upgrade(self, value: Any, written_version: int, **ids: Any) -> Any:
        """Migrate a state read at `written_version` to this schema's version."""
        if written_version == self.version:
            return value
        return self.migrations.migrate(value, written_version, self.version, **ids)


def _invalid(exc: ValidationError, ids: Mapping[str, Any]) -> CheckpointInvalid:
    first = exc.errors()[0]
    path = _field_path(tuple(first.get("loc", ())))
    return CheckpointInvalid(
        f"state does not satisfy its schema at {path}: {first.get('msg')}", field=path, **ids
    )


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def _validate_json_schema(schema: Mapping[str, Any], value: Any, ids: Mapping[str, Any]) -> None:
    """A small JSON Schema subset: type, properties, required, items, enum, minimum,
    maximum, minLength, maxLength."""

    def fail(path: str, msg: str) -> None:
        raise CheckpointInvalid(
            f"state does not satisfy its schema at {path or '<root>'}: {msg}",
            field=path or "<root>",
            **ids,
        )

    def check(s: Mapping[str, Any], v: Any, path: str) -> None:
        types = s.get("type")
        if types is not None:
            names = [types] if isinstance(types, str) else list(types)
            ok = any(
                isinstance(v, _JSON_TYPES[n]) and not (n in ("integer", "number") and v is True)
                and not (n in ("integer", "number") and v is False)
                for n in names
            )
            if not ok:
                fail(path, f"expected {' or '.join(names)}, got {type(v).__name__}")
        if "enum" in s and v not in s["enum"]:
            fail(path, f"value {v!r} is not one of {s['enum']!r}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if "minimum" in s and v < s["minimum"]:
                fail(path, f"{v} is less than the minimum {s['minimum']}")
            if "maximum" in s and v > s["maximum"]:
                fail(path, f"{v} is more than the maximum {s['maximum']}")
        if isinstance(v, str):
            if "minLength" in s and len(v) < s["minLength"]:
                fail(path, f"string is shorter than {s['minLength']} characters")
            if "maxLength" in s and len(v) > s["maxLength"]:
                fail(path, f"string is longer than {s['maxLength']} characters")
        if isinstance(v, dict):
            for req in s.get("required", ()):
                if req not in v:
                    fail(f"{path}.{req}" if path else req, "field required")
            for key, sub in s.get("properties", {}).items():
                if key in v:
                    check(sub, v[key], f"{path}.{key}" if path else key)
        if isinstance(v, (list, tuple)) and "items" in s:
            for i, item in enumerate(v):
                check(s["items"], item, f"{path}[{i}]")

    check(schema, value, "")
