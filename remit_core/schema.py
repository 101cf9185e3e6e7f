"""Validation on write (P4) and numbered state-schema migrations.

`StateSchema(OrderState)` accepts a Pydantic model, a TypedDict, a dataclass,
any type pydantic's `TypeAdapter` understands, or a JSON Schema dict (all of
it: the `jsonschema` validator of its draft, 2020-12 by default). It
raises `CheckpointInvalid` naming the first failing field before anything is
written. `Migrations` upgrades a decoded state from the version it was
written with to the reader's, step by step, or refuses with `VersionMismatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import jsonschema
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from remit_core.errors import CheckpointInvalid, RemitError, VersionMismatch

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


def field_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """A validation error's location as a field path: `items[1].amount`, `<root>`."""
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
        if type(from_version) is not int:
            # A "1" would be registered and never found: reading would say none is.
            raise TypeError(
                f"a migration's from_version must be an int, got {type(from_version).__name__} "
                f"{from_version!r}"
            )

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
            try:
                value = step(value)
            except RemitError:
                raise
            except Exception as exc:  # noqa: BLE001 (the migration's own error, whatever it is)
                # Raised bare, it would name neither the record nor the step that failed.
                raise VersionMismatch(
                    f"state has schema version {from_version}, reader expects {to_version}, "
                    f"and the migration from version {v} failed: {type(exc).__name__}: {exc}",
                    **ids,
                ) from exc
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
        # Checkpoints store it as a non-negative int: any other would never match.
        if type(version) is not int:
            raise TypeError(
                f"a state schema's version must be an int, got {type(version).__name__} {version!r}"
            )
        if version < 0:
            raise ValueError(f"a state schema's version must be 0 or more, got {version}")
        self.type_ = type_
        self.version = version
        self.strict = strict
        self.migrations = migrations or Migrations()
        if isinstance(type_, Mapping):
            self._adapter: TypeAdapter[Any] | None = None
            self._json: jsonschema.protocols.Validator | None = _json_validator(type_)
        else:
            self._adapter = TypeAdapter(type_)
            self._json = None
        self._plain = self._adapter is not None and _plain_only(self._adapter.core_schema)

    def validate(self, value: Any, **ids: Any) -> Any:
        """Return the validated value, or raise `CheckpointInvalid` naming the field.

        Pydantic accepts model and dataclass instances as they are, nested ones
        included, so a value built with `model_construct` or changed by an
        assignment without `validate_assignment` would pass unchecked. The
        value's plain form (what a checkpoint stores) is therefore validated
        too; that second pass is lax, since strict mode wants instances.
        """
        if self._json is not None:
            invalid = _json_invalid(self._json, value, ids)
            if invalid is not None:
                raise invalid
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
                    validated, round_trip=True, by_alias=False, warnings=False
                )
            except PydanticSerializationError:
                return validated  # no plain form: the instance check above is all there is
            # (By field name both ways: a model's aliases may differ in and out.)
            self._adapter.validate_python(plain, by_name=True)
        except ValidationError as exc:
            raise _invalid(exc, ids) from exc
        except TypeError as exc:
            # A validator function's own `TypeError` (a callable discriminator given a
            # value of no kind it knows), which Pydantic lets through.
            only = next(iter(value)) if isinstance(value, Mapping) and len(value) == 1 else None
            where = f" at {only}" if isinstance(only, str) else ""
            raise CheckpointInvalid(
                f"state does not satisfy its schema{where}: {exc}",
                field=only if isinstance(only, str) else None,
                **ids,
            ) from exc
        return validated

    @property
    def plain(self) -> bool:
        """Whether the type validates plain data into plain data alone (no model or
        dataclass instance taken as it is): `validate` then needs no second pass."""
        return self._plain

    def holds_as_is(self, value: Any) -> bool:
        """Whether `value` is of this (plain) type as it stands: strict validation
        passes it, so validating would convert nothing in it. False says nothing
        (`validate` says what is wrong, if anything)."""
        if not self._plain or self._adapter is None:
            return False
        try:
            self._adapter.validate_python(value, strict=True)
        except (ValidationError, TypeError):  # (`TypeError`: see `validate`)
            return False
        return True

    def upgrade(self, value: Any, written_version: int, **ids: Any) -> Any:
        """Migrate a state read at `written_version` to this schema's version."""
        if written_version == self.version:
            return value
        return self.migrations.migrate(value, written_version, self.version, **ids)


def _invalid(exc: ValidationError, ids: Mapping[str, Any]) -> CheckpointInvalid:
    first = exc.errors()[0]
    path = field_path(tuple(first.get("loc", ())))
    return CheckpointInvalid(
        f"state does not satisfy its schema at {path}: {first.get('msg')}", field=path, **ids
    )


def _json_validator(schema: Mapping[str, Any]) -> jsonschema.protocols.Validator:
    """A validator for `schema` (its `$schema` draft, else 2020-12) whose arrays include
    tuples (a Python state holds either); `ValueError` if `schema` is not a JSON Schema."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(dict(schema))
    except jsonschema.SchemaError as exc:
        raise ValueError(f"state schema is not a valid JSON Schema: {exc.message}") from exc
    arrays = cls.TYPE_CHECKER.redefine("array", lambda _, v: isinstance(v, (list, tuple)))
    extended: Any = jsonschema.validators.extend(cls, type_checker=arrays)  # type: ignore[no-untyped-call]
    return cast(jsonschema.protocols.Validator, extended(schema))


def _json_invalid(
    validator: jsonschema.protocols.Validator, value: Any, ids: Mapping[str, Any]
) -> CheckpointInvalid | None:
    """`CheckpointInvalid` for the most relevant way `value` breaks the schema, naming
    the field (for a missing property, that property), or None if it holds."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    loc = tuple(error.absolute_path)
    if error.validator == "required" and isinstance(error.instance, Mapping):
        missing = [k for k in error.validator_value if k not in error.instance]
        loc += tuple(missing[:1])
    path = field_path(loc)
    return CheckpointInvalid(
        f"state does not satisfy its schema at {path}: {error.message}", field=path, **ids
    )
