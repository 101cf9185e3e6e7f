"""Remit's core: the Resume Contract, once, over SQLite, PostgreSQL and Redis.

Shims call `Remit`; users meet `effect`, the errors, and `StateSchema`.
"""

from remit_core.codec import dumps, loads
from remit_core.core import DEFAULT_LEASE, ClaimHandle, Remit
from remit_core.effects import (
    NOT_APPLIED,
    StepScope,
    arun_effect,
    current_idempotency_key,
    current_scope,
    effect,
    register_scope_resolver,
    run_effect,
    step_scope,
)
from remit_core.errors import (
    CheckpointInvalid,
    CorruptRecord,
    EffectInDoubt,
    EffectInFlight,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    RemitError,
    ResumeConflict,
    StoreUnavailable,
    UnknownRecord,
    VersionMismatch,
    WriteConflict,
)
from remit_core.records import (
    MAIN_BRANCH,
    BranchRecord,
    CheckpointRecord,
    Claim,
    EffectRecord,
    FenceRef,
    InterruptRecord,
    WriteRecord,
)
from remit_core.schema import Migrations, StateSchema
from remit_core.stores import Store, open_store


def connect(url: str, **options: float) -> Remit:
    """A `Remit` over the store at `url`: sqlite:///file.db, postgresql://..., redis://..."""
    return Remit(open_store(url), **options)  # type: ignore[arg-type]


__all__ = [
    "DEFAULT_LEASE",
    "MAIN_BRANCH",
    "NOT_APPLIED",
    "BranchRecord",
    "CheckpointInvalid",
    "CheckpointRecord",
    "Claim",
    "ClaimHandle",
    "CorruptRecord",
    "EffectInDoubt",
    "EffectInFlight",
    "EffectRecord",
    "FenceRef",
    "Fenced",
    "ForkWithoutIntent",
    "HeadMoved",
    "InterruptRecord",
    "Migrations",
    "Remit",
    "RemitError",
    "ResumeConflict",
    "StateSchema",
    "StepScope",
    "Store",
    "StoreUnavailable",
    "UnknownRecord",
    "VersionMismatch",
    "WriteConflict",
    "WriteRecord",
    "arun_effect",
    "connect",
    "current_idempotency_key",
    "current_scope",
    "dumps",
    "effect",
    "loads",
    "open_store",
    "register_scope_resolver",
    "run_effect",
    "step_scope",
]
