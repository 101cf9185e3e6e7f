"""Plain records that stores persist and the policy reasons about.

Byte payloads (`state`, `value`, `outcome`, ...) are sealed by the core
(`remit_core.codec.seal`) before they reach a store; stores never look inside.
Times are UTC seconds since the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

MAIN_BRANCH = "main"

InterruptStatus = Literal["pending", "consumed"]
EffectStatus = Literal["intent", "done"]
WriteMode = Literal["first", "overwrite", "expect_absent"]


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """An immutable committed state of one run, on one branch of one namespace."""

    run_id: str
    checkpoint_id: str
    branch: str
    parent_id: str | None
    state: bytes
    ns: str = ""
    seq: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    schema_version: int = 1
    workflow_version: str = ""
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class BranchRecord:
    """A named line of checkpoints; `head_id` is its newest checkpoint."""

    run_id: str
    branch: str
    head_id: str | None
    ns: str = ""
    head_seq: int = 0
    base_id: str | None = None
    fork_token: str | None = None
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class BlobRecord:
    """A value stored once under a caller-chosen key (e.g. one channel version)."""

    run_id: str
    key: str
    value: bytes
    ns: str = ""


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """One step write attached to a checkpoint (task output, journal entry, status)."""

    run_id: str
    checkpoint_id: str
    task_id: str
    idx: int
    channel: str
    value: bytes
    ns: str = ""
    task_path: str = ""


@dataclass(frozen=True, slots=True)
class InterruptRecord:
    """A pause waiting for one resume value; consumed at most once (P5)."""

    run_id: str
    branch: str
    interrupt_id: str
    checkpoint_id: str | None
    status: InterruptStatus = "pending"
    prompt: bytes | None = None
    value: bytes | None = None
    consumed_by: str | None = None
    created_at: float = 0.0
    consumed_at: float | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """An exclusive, leased right to drive one scope of a run; `fence` grows on takeover."""

    run_id: str
    scope: str
    holder: str
    fence: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class FenceRef:
    """What a write presents to prove its claim is still current (L2): the claim's
    fence and holder. The holder makes a fence unique even where a store lost a
    take it had not yet flushed and handed the same number out again."""

    run_id: str
    scope: str
    fence: int
    holder: str

    @classmethod
    def of(cls, claim: Claim) -> FenceRef:
        return cls(claim.run_id, claim.scope, claim.fence, claim.holder)


@dataclass(frozen=True, slots=True)
class EffectRecord:
    """The ledger entry of one effect: intent before applying, outcome after (P2)."""

    run_id: str
    effect_key: str
    idempotency_key: str
    status: EffectStatus
    outcome: bytes | None = None
    created_at: float = 0.0
    done_at: float | None = None
    #: The claim of the caller that recorded the intent (None: an unfenced caller,
    #: or an entry older than the record of it): while that claim is still held,
    #: the intent is in flight, not in doubt, to every other caller.
    claim: FenceRef | None = None
