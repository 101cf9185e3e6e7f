"""Effects a fork shares with the branch it forked from (P2, P3).

A task pending at a fork's base (paused at `interrupt()`, or finished beside a
sibling that paused) runs again on the fork, from its top: LangGraph's fork
keeps none of the base's task writes. The effects it called before the base
belong to the prefix the fork shares: the fork's run of the task finds their
recorded outcomes under the keys of the branch that made them, and applies
only its later calls, under its own keys.

So the first write set a top-level task stores on a checkpoint comes with a
write of Remit's own (`CALLS`): how many calls of each effect the task's
execution had made by then, and which of its first calls earlier branches
made. The store keeps the first such write: a later execution on the same
branch (one that took a resume value) makes calls a fork of that checkpoint
asks for anew. A run continuing a fork's branch, or starting one, gives the
tasks of its first step these calls by the task's place (node and task
path): a fork moves step numbers by one and gives its tasks new ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from remit_core import codec
from remit_core.records import WriteRecord

#: The channel of a task's effect calls on a checkpoint (never shown to LangGraph).
CALLS = "__remit_effect_calls__"
#: Its write index: apart from LangGraph's own (task writes >= 0, special ones > -10).
CALLS_IDX = -100

#: Calls of each effect by name, under the step key of the branch that made them.
Made = list[tuple[str, dict[str, int]]]


@dataclass
class TaskCalls:
    """The effect calls of one task execution: its place (node and task path), its
    step key, how many calls of each effect it made, and those shared with earlier
    branches (their step key, and how many of each effect's first calls they made)."""

    place: str
    key: str
    counts: dict[str, int] = field(default_factory=dict)
    shared: Made = field(default_factory=list)

    def made(self) -> Made:
        """The calls a later run of this task may find recorded: earlier branches', its own."""
        return [*self.shared, (self.key, self.counts)]

    def write(self, template: WriteRecord) -> WriteRecord:
        """This record as a write beside the task's writes (`template`'s ids)."""
        body = {"place": self.place, "key": self.key, "counts": self.counts, "shared": self.shared}
        return replace(template, idx=CALLS_IDX, channel=CALLS, value=codec.dumps(body))

    @classmethod
    def read(cls, write: WriteRecord) -> TaskCalls:
        body: dict[str, Any] = codec.loads(write.value)
        return cls(
            place=body["place"],
            key=body["key"],
            counts=dict(body["counts"]),
            shared=[(key, dict(counts)) for key, counts in body["shared"]],
        )
