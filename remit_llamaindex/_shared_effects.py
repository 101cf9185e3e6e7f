"""Effects a fork shares with the branch it forked from (P2, P3).

A step that is in flight or waiting (`ctx.wait_for_event`) at a fork's base runs
again on the fork, from its top. The effects it called before the base belong to
the prefix the fork shares: the fork's run of the step finds their recorded
outcomes under the keys of the branch that applied them, and applies only its
later calls, under its own keys. So each checkpoint records, per work item the run
still holds (queued, in flight or waiting), how many calls of each effect its
executions made (`counts`) and which of its first calls an earlier branch made
(`shared`); a fork's session starts from its base's record (`restored`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workflows.runtime.types.internal_state import BrokerState

from remit_llamaindex import _snapshot as snap


@dataclass
class WorkItemEffects:
    """The effect calls of one work item: made by it (`counts`, per effect name) and
    shared with earlier branches (`shared`: their step key, and how many of each
    effect's first calls were made there)."""

    step: str
    item: str
    counts: dict[str, int] = field(default_factory=dict)
    shared: list[tuple[str, dict[str, int]]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A copy, not a view: the step's calls go on counting (other workers, threads)
        while the checkpoint holding this is written, and its stored metadata must stay
        the copy sealed in its body."""
        return {
            "step": self.step,
            "item": self.item,
            "counts": dict(self.counts),
            "shared": [[key, dict(counts)] for key, counts in self.shared],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkItemEffects:
        return cls(
            step=data["step"],
            item=data["item"],
            counts=dict(data["counts"]),
            shared=[(key, dict(counts)) for key, counts in data["shared"]],
        )


def live_items(state: BrokerState) -> set[str]:
    """The work items `state` still holds: queued, in flight or waiting for an event."""
    workers = [w for _, broker in snap.walk_brokers(state) for w in broker.workers.values()]
    items = [
        *(a.work_item_id for w in workers for a in w.queue),
        *(ip.work_item_id for w in workers for ip in w.in_progress),
        *(waiter.work_item_id for w in workers for waiter in w.collected_waiters),
    ]
    return {item for item in items if item is not None}


def restored(
    recorded: Mapping[str, Any],
    state: BrokerState,
    step_key: Callable[[str, str], str],
    *,
    forked: bool,
) -> dict[str, WorkItemEffects]:
    """The effect calls a session starts from, by step key: those its checkpoint
    recorded for the work items `state` holds. A fork at its base (`forked`) keys
    them with its own `step_key`, sharing every call the base's branch made."""
    live = live_items(state)
    found: dict[str, WorkItemEffects] = {}
    for key, data in recorded.items():
        entry = WorkItemEffects.from_json(data)
        if entry.item not in live:
            continue
        if forked:
            shared = [*entry.shared, (key, entry.counts)]
            found[step_key(entry.step, entry.item)] = WorkItemEffects(
                entry.step, entry.item, shared=shared
            )
        else:
            found[key] = entry
    return found
