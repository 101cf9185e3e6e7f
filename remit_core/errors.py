"""One exception class per contract outcome, all under `RemitError`.

Each error carries the ids it is about (run, checkpoint, interrupt, effect)
as attributes, so callers can act on them without parsing the message.
"""

from __future__ import annotations

from typing import Any


class RemitError(Exception):
    """Base of every error Remit raises on purpose."""

    def __init__(self, message: str, **ids: Any) -> None:
        self.message = message
        self.ids = {k: v for k, v in ids.items() if v is not None}
        suffix = ", ".join(f"{k}={v!r}" for k, v in self.ids.items())
        super().__init__(f"{message} ({suffix})" if suffix else message)
        self.run_id: str | None = ids.get("run_id")
        self.checkpoint_id: str | None = ids.get("checkpoint_id")
        self.interrupt_id: str | None = ids.get("interrupt_id")
        self.effect_key: str | None = ids.get("effect_key")


class ResumeConflict(RemitError):
    """Another resumer holds the run, or the interrupt was already consumed (P5)."""


class ForkWithoutIntent(RemitError):
    """Continuing from a checkpoint that is not its branch head needs a fork token (P3)."""


class HeadMoved(RemitError):
    """A compare-and-set of a branch head lost: the head is no longer the expected one."""


class CheckpointInvalid(RemitError, ValueError):
    """A write does not satisfy the declared state schema; nothing was committed (P4).

    A `ValueError`, as a validation error of pydantic is: retry policies that leave
    bad values alone (LangGraph's default) do not run the step again for it.
    """

    def __init__(self, message: str, *, field: str | None = None, **ids: Any) -> None:
        super().__init__(message, field=field, **ids)
        self.field = field


class EffectInDoubt(RemitError):
    """An effect may have been applied but its outcome was never recorded (P2)."""


class EffectInFlight(EffectInDoubt):
    """Another caller recorded the effect's intent under a claim it still holds and has
    not recorded the outcome yet: it may be applying it now (P2). Nothing was applied
    here; run again once that caller has finished or its lease has lapsed."""


class Fenced(RemitError):
    """A write carried a fencing token that is no longer current (L2)."""


class CorruptRecord(RemitError):
    """A stored record failed to decode or verify its checksum (P4)."""


class VersionMismatch(RemitError):
    """A stored record has a schema or workflow version the reader does not accept (P4)."""


class StoreUnavailable(RemitError):
    """The store could not be reached or answered with an engine error."""


class UnknownRecord(RemitError, LookupError):
    """A run, checkpoint, interrupt or branch that a call names does not exist."""


class WriteConflict(RemitError):
    """An expected-sequence append found its slot already taken; nothing was written."""
