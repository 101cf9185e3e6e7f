"""What a CrewAI checkpoint holds besides the state, and how flow ids name Remit runs.

A flow id is a Remit run on its main branch; a fork made with a token is the
same run on the token's branch, named `<run>@fork-<16 hex>` so that CrewAI can
carry it as an ordinary flow id. Each checkpoint's sealed body holds the state
and the completion ledger: the methods that completed, how often each one
completed (the occurrence in effect keys), the route each router took, and
the human feedback the run accepted. A restarted flow replays the ledger
(`Replay`) instead of re-running its past.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from itertools import chain, count
from typing import Any, TypeVar

from remit_core import codec
from remit_core.core import checked_id
from remit_core.errors import CorruptRecord
from remit_core.records import MAIN_BRANCH

_T = TypeVar("_T")

_FORKED = re.compile(r"^(?P<run>.+)@(?P<branch>fork-[0-9a-f]{16})$")

#: The method name CrewAI gives the state checkpoint it takes before `ask()`.
ASK_CHECKPOINT = "_ask_checkpoint"


def locate(flow_id: str) -> tuple[str, str]:
    """The (run id, branch) a flow id names (`TypeError` naming it if not a str)."""
    match = _FORKED.match(checked_id("flow id (inputs['id'])", flow_id))
    if match is None:
        return flow_id, MAIN_BRANCH
    return match["run"], match["branch"]


def flow_id_of(run_id: str, branch: str) -> str:
    """The flow id of a run's branch (the run id itself for the main line)."""
    return run_id if branch == MAIN_BRANCH else f"{run_id}@{branch}"


@dataclass(frozen=True)
class Ledger:
    """The run's past as of one checkpoint.

    `completed`: methods that completed at least once. `counts`: completions
    per method; the next execution of `m` is occurrence `counts[m]`, unless runs
    of `m` at once completed out of order: `gaps[m]` are the occurrences below the
    highest one completed that have not completed (still in flight when the flow
    was saved, or lost with its process), and the next execution is the lowest,
    so that it keeps its effect keys.
    `routes`: per router, the route (outcome label) it took at each of its
    completions, None where it took none or the route was not recorded.
    `feedback`: accepted human feedback, oldest first, one dict per consumed
    interrupt or answer given at once (interrupt, method, feedback, outcome,
    timestamp, output, metadata).
    `turn`: per method, how often it had completed when the current turn of a
    conversational flow began (CrewAI runs each turn's graph anew): a restart without
    a new message continues that turn, so its replay begins there.
    `asked`: per occurrence (`m#n`) of a conversational flow's feedback method still
    waiting for its answer, how many pauses were saved at it; `reasked`: the same as
    the current turn began. A later turn that reaches that method runs the waiting
    occurrence again, as a question of its own: its effects are keyed by `reasked`
    (`again`), so that they apply for that turn, and the same each time that turn is
    continued or sent again.
    `joins`, `fired`, `running`: where CrewAI's joins stood when the flow last paused:
    per listener, the triggers its `and_`/`or_` condition has seen; the `or_`
    listeners that fired and completed; the methods still running then, each with
    the occurrence it ran as (a sibling of the paused method may complete after the
    pause was saved). A resume builds a new flow instance, which knows none of it: a
    join waiting on the paused method would never fire, and an `or_` listener that
    already ran would run again.
    """

    completed: tuple[str, ...] = ()
    counts: dict[str, int] = field(default_factory=dict)
    feedback: tuple[dict[str, Any], ...] = ()
    routes: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    joins: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fired: tuple[str, ...] = ()
    running: dict[str, int] = field(default_factory=dict)
    gaps: dict[str, tuple[int, ...]] = field(default_factory=dict)
    turn: dict[str, int] = field(default_factory=dict)
    asked: dict[str, int] = field(default_factory=dict)
    reasked: dict[str, int] = field(default_factory=dict)

    def completing(self, method: str, occurrence: int | None = None) -> Ledger:
        """Record a completion of `method`: of `occurrence` (the next free one if None)."""
        counts = dict(self.counts)
        counts[method] = counts.get(method, 0) + 1
        completed = self.completed if method in self.completed else (*self.completed, method)
        gaps = self.gaps.get(method, ())
        top = self.occurrence(method) + len(gaps)  # one past the highest completed
        if occurrence is None or (occurrence < top and occurrence not in gaps):
            occurrence = self.free(method)  # (one that completed already: the next free)
        gaps = tuple(g for g in gaps if g != occurrence) + tuple(range(top, occurrence))
        others = {m: g for m, g in self.gaps.items() if m != method}
        return replace(
            self,
            completed=completed,
            counts=counts,
            gaps={**others, method: gaps} if gaps else others,
        )

    def free(self, method: str, taken: Collection[int] = ()) -> int:
        """The lowest occurrence of `method` that has not completed and is not in `taken`
        (those running now)."""
        top = self.occurrence(method) + len(self.gaps.get(method, ()))
        return next(n for n in chain(self.gaps.get(method, ()), count(top)) if n not in taken)

    def pausing(
        self, joins: dict[str, tuple[str, ...]], fired: tuple[str, ...], running: dict[str, int]
    ) -> Ledger:
        """Record where CrewAI's joins stood as the flow paused (kept until the next pause)."""
        return replace(self, joins=joins, fired=fired, running=running)

    def completed_since_pause(self) -> set[str]:
        """Methods running when the flow paused whose occurrence completed afterwards."""
        return {m for m, at in self.running.items() if self.occurrence(m) > at}

    def unfinished_at_pause(self) -> set[str]:
        """Methods running when the flow paused whose occurrence has not completed since."""
        return {m for m, at in self.running.items() if self.occurrence(m) <= at}

    def routing(self, method: str, route: str | None) -> Ledger:
        """Record the route router `method` took at the completion just recorded."""
        before = self.occurrence(method) - 1
        taken = self.routes.get(method, ())[:before]
        taken += (None,) * (before - len(taken))
        return replace(self, routes={**self.routes, method: (*taken, route)})

    def route(self, method: str, occurrence: int) -> str | None:
        """The route router `method` took at `occurrence`, if it took one that was recorded."""
        taken = self.routes.get(method, ())
        return taken[occurrence] if occurrence < len(taken) else None

    def accepting(self, value: dict[str, Any]) -> Ledger:
        """Record consumed feedback; consuming it is what completes its method.

        The feedback's outcome is the route a feedback method with `emit=` takes.
        """
        if any(f["interrupt"] == value["interrupt"] for f in self.feedback):
            return self
        done = self.completing(value["method"]).routing(value["method"], value.get("outcome"))
        answered = value["interrupt"]
        return replace(
            done,
            feedback=(*self.feedback, value),
            asked={k: n for k, n in self.asked.items() if k != answered},
            reasked={k: n for k, n in self.reasked.items() if k != answered},
        )

    def asking(self, method: str) -> Ledger:
        """Record a pause saved at the waiting occurrence of feedback method `method`."""
        name = f"{method}#{self.occurrence(method)}"
        return replace(self, asked={**self.asked, name: self.asked.get(name, 0) + 1})

    def new_turn(self, waiting: Collection[str]) -> Ledger:
        """The ledger as a conversational flow's turn begins, `waiting` the feedback
        methods whose questions wait for their answers."""
        reasked = {k: n for k, n in self.asked.items() if k.rsplit("#", 1)[0] in waiting}
        return replace(self, turn=dict(self.counts), reasked=reasked)

    def again(self, name: str) -> int | None:
        """How many pauses were saved at occurrence `name` (`m#n`) before the current turn
        began, if this turn runs that waiting occurrence again as a question of its own."""
        return self.reasked.get(name)

    def noting(self, value: dict[str, Any]) -> Ledger:
        """Record feedback given at once (no pause) by the method whose completion
        this ledger has just recorded."""
        if any(f["interrupt"] == value["interrupt"] for f in self.feedback):
            return self
        return replace(self, feedback=(*self.feedback, value))

    def occurrence(self, method: str) -> int:
        return self.counts.get(method, 0)


@dataclass
class Replay:
    """A restart's walk through the past it continues from.

    CrewAI restarts a flow by running its graph again from the start methods.
    The first `counts[m]` times the walk meets method `m` replay occurrences
    that completed (a router takes the route it took then); after that, `m`
    runs for real: that is the occurrence that was in flight, or a later one
    in a loop.
    """

    past: Ledger
    met: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, past: Ledger) -> Replay:
        """The replay of `past` from its current turn's beginning (a flow that is not
        conversational has one turn)."""
        return cls(past, met=dict(past.turn))

    def meet(self, method: str) -> tuple[bool, str | None]:
        """Whether this meeting of `method` replays a completed occurrence, and its route."""
        seen = self.met.get(method, 0)
        if seen >= self.past.occurrence(method):
            return False, None
        self.met[method] = seen + 1
        return True, self.past.route(method, seen)


@dataclass(frozen=True)
class Body:
    """The decoded payload of one checkpoint.

    `output`: what `method` returned, encoded, for a step whose output the codec
    stores exactly (None otherwise): a finished flow kicked off again runs nothing
    and returns it, as its first kickoff did. `prompt`: a pause's context as its
    interrupt holds it, so that a pause whose process died before opening the
    interrupt can open it later. `before`: for the state `ask()` saves, the state the
    asking step started from (empty if nothing was saved before it), which a restart
    continues with: kept in the checkpoint itself, as the ones before it may have been
    pruned (None in checkpoints written before it was kept). `edited`: for an edit made
    on a pause or on its feedback method's completion (through earlier edits), that
    checkpoint's `kind`, `method` and id (`checkpoint`), for the same reason; an edit of
    a pause keeps its `prompt` too. `first`: for a fork's pause, or its feedback (or an
    edit made on them), the branch the paused occurrence first ran on, when that is not
    the fork's own (where its effects are keyed, `Session.keys_from`), for the same
    reason.
    """

    state: dict[str, Any]
    method: str
    kind: str
    ledger: Ledger
    output: bytes | None = None
    prompt: bytes | None = None
    before: dict[str, Any] | None = None
    edited: dict[str, str] | None = None
    first: str | None = None


def encode(body: Body) -> bytes:
    ledger = body.ledger
    return codec.dumps(
        {
            "state": body.state,
            "method": body.method,
            "kind": body.kind,
            "completed": list(ledger.completed),
            "counts": ledger.counts,
            "feedback": list(ledger.feedback),
            "routes": {m: _runs_of(taken) for m, taken in ledger.routes.items()},
            **(
                {} if not ledger.joins else {"joins": {k: list(v) for k, v in ledger.joins.items()}}
            ),
            **({} if not ledger.fired else {"fired": list(ledger.fired)}),
            **({} if not ledger.running else {"running": ledger.running}),
            **({} if not ledger.gaps else {"gaps": {m: list(g) for m, g in ledger.gaps.items()}}),
            **({} if not ledger.turn else {"turn": ledger.turn}),
            **({} if not ledger.asked else {"asked": ledger.asked}),
            **({} if not ledger.reasked else {"reasked": ledger.reasked}),
            **({} if body.output is None else {"output": body.output}),
            **({} if body.prompt is None else {"prompt": body.prompt}),
            **({} if body.before is None else {"before": body.before}),
            **({} if body.edited is None else {"edited": body.edited}),
            **({} if body.first is None else {"first": body.first}),
        }
    )


def decode(data: bytes, *, run_id: str, checkpoint_id: str) -> Body:
    """The body of a checkpoint, or `CorruptRecord` naming the run, the checkpoint and the
    part that is not what Remit writes: a ledger of another shape would make a restart
    run again what completed (a completion it cannot read) or fail deep inside CrewAI."""
    try:
        raw = codec.loads(data)
        if type(raw) is not dict:
            raise TypeError(f"a checkpoint body is a dict, not {type(raw).__name__}")
        counts = _mapping(raw["counts"], "counts", _count)
        completed = _strs(raw["completed"], "completed")
        if set(completed) != {m for m, n in counts.items() if n > 0}:
            raise ValueError("the completed methods do not match the completion counts")
        return Body(
            state=_mapping(raw["state"], "state", lambda value, _: value),
            method=_str(raw["method"], "method"),
            kind=_kind(raw["kind"]),
            ledger=Ledger(
                completed=completed,
                counts=counts,
                feedback=tuple(
                    _feedback(f, f"feedback[{i}]") for i, f in enumerate(_list(raw["feedback"]))
                ),
                # Checkpoints written before routes were recorded have none.
                routes=_mapping(
                    raw.get("routes", {}),
                    "routes",
                    lambda taken, where: _routes(taken, where, counts),
                ),
                # Checkpoints written before joins were recorded have none.
                joins=_mapping(raw.get("joins", {}), "joins", _strs),
                fired=_strs(raw.get("fired", []), "fired"),
                running=_mapping(raw.get("running", {}), "running", _count),
                gaps=_mapping(
                    raw.get("gaps", {}),
                    "gaps",
                    lambda gaps, where: tuple(_count(n, where) for n in _list(gaps, where)),
                ),
                turn=_mapping(raw.get("turn", {}), "turn", _count),
                asked=_mapping(raw.get("asked", {}), "asked", _count),
                reasked=_mapping(raw.get("reasked", {}), "reasked", _count),
            ),
            output=_bytes_or_none(raw.get("output")),
            prompt=_bytes_or_none(raw.get("prompt")),
            before=_before(raw, "before"),
            edited=_edited(raw, "edited"),
            first=_first(raw, "first"),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRecord(
            f"checkpoint is not a CrewAI flow checkpoint ({exc})",
            run_id=run_id,
            checkpoint_id=checkpoint_id,
        ) from exc


def accepted(data: bytes, *, run_id: str, interrupt_id: str) -> dict[str, Any]:
    """The accepted feedback a consumed interrupt holds, or `CorruptRecord` naming the run
    and the interrupt if it is not what Remit writes there: feedback for that interrupt,
    of the shape `Ledger.feedback` keeps (a restart rebuilds CrewAI's feedback from it)."""
    try:
        value = _feedback(codec.loads(data), "the consumed value")
        if value["interrupt"] != interrupt_id or value["method"] != interrupt_id.rsplit("#", 1)[0]:
            raise ValueError(
                f"the consumed value answers {value['interrupt']!r} of {value['method']!r}"
            )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRecord(
            f"consumed interrupt does not hold the feedback a CrewAI flow accepted ({exc})",
            run_id=run_id,
            interrupt_id=interrupt_id,
        ) from exc
    return value


#: The kinds of checkpoint a flow writes: a method's save, a consumed feedback, a
#: pause, the state `ask()` saves, an operator's edit.
_KINDS = frozenset({"step", "feedback", "pause", "ask", "edit"})

#: What each accepted feedback records (`persistence._feedback_entry`).
_FEEDBACK_KEYS = frozenset(
    {"interrupt", "method", "feedback", "outcome", "timestamp", "output", "metadata"}
)


def _list(value: Any, where: str = "feedback") -> list[Any]:
    if type(value) is not list:
        raise TypeError(f"{where} is a list, not {type(value).__name__}")
    return value


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise TypeError(f"{where} holds a str, not {type(value).__name__}")
    return value


def _strs(value: Any, where: str) -> tuple[str, ...]:
    return tuple(_str(item, where) for item in _list(value, where))


def _count(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where} holds a count, not {value!r}")
    return value


def _kind(value: Any) -> str:
    if value not in _KINDS:
        raise ValueError(f"kind is one of {sorted(_KINDS)}, not {value!r}")
    return str(value)


def _mapping(value: Any, where: str, item: Callable[[Any, str], _T]) -> dict[str, _T]:
    """`value`, a dict keyed by str, with each item checked by `item`."""
    if type(value) is not dict:
        raise TypeError(f"{where} is a dict, not {type(value).__name__}")
    return {_str(k, where): item(v, f"{where}.{k}") for k, v in value.items()}


def _feedback(value: Any, where: str) -> dict[str, Any]:
    """One accepted feedback as `Ledger.feedback` keeps it."""
    if type(value) is not dict or set(value) != _FEEDBACK_KEYS:
        raise ValueError(f"{where} is not an accepted feedback ({sorted(_FEEDBACK_KEYS)})")
    for key in ("interrupt", "method", "feedback"):
        _str(value[key], f"{where}.{key}")
    if value["outcome"] is not None:
        _str(value["outcome"], f"{where}.outcome")
    if type(value["metadata"]) is not dict:
        raise TypeError(f"{where}.metadata is a dict, not {type(value['metadata']).__name__}")
    return value


def _runs_of(taken: tuple[str | None, ...]) -> dict[str, list[list[Any]]]:
    """The routes a router took, stored as runs of one route (`[route, times]`): a loop's
    router takes the same route round after round, and the ledger is in every checkpoint
    of the run, so that a list of every route would make each save of an N-round loop
    grow with N (and the whole run's writes with N squared)."""
    runs: list[list[Any]] = []
    for route in taken:
        if runs and runs[-1][0] == route:
            runs[-1][1] += 1
        else:
            runs.append([route, 1])
    return {"runs": runs}


def _routes(taken: Any, where: str, counts: dict[str, int]) -> tuple[str | None, ...]:
    """The routes of one router (`where` is `routes.<router>`) as `_runs_of` stores them,
    at most one per completion `counts` records; or as a list of every route
    (checkpoints written before routes were stored as runs)."""
    if type(taken) is list:
        return tuple(None if r is None else _str(r, where) for r in taken)
    if type(taken) is not dict or set(taken) != {"runs"}:
        raise TypeError(f"{where} is a list of routes or their runs")
    runs = _list(taken["runs"], where)
    for run in runs:
        if type(run) is not list or len(run) != 2 or type(run[1]) is not int or run[1] < 1:
            raise ValueError(f"{where} holds runs of [route, times], not {run!r}")
    if sum(run[1] for run in runs) > counts.get(where.split(".", 1)[1], 0):
        raise ValueError(f"{where} holds more routes than the router completed")
    return tuple(
        route for r, times in runs for route in [None if r is None else _str(r, where)] * times
    )


def _before(raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The state an `ask` checkpoint keeps of the state before its step (`Body.before`)."""
    if key not in raw:
        return None
    if raw["kind"] != "ask":
        raise ValueError(f"only the state ask() saves keeps a {key!r} state")
    return _mapping(raw[key], key, lambda value, _: value)


def _edited(raw: dict[str, Any], key: str) -> dict[str, str] | None:
    """The pause or feedback an edit was made on (`Body.edited`)."""
    if key not in raw:
        return None
    if raw["kind"] != "edit":
        raise ValueError(f"only an edit keeps the {key!r} pause it was made on")
    edited = _mapping(raw[key], key, _str)
    if set(edited) != {"kind", "method", "checkpoint"} or edited["kind"] not in (
        "pause",
        "feedback",
    ):
        raise ValueError(f"{key} names the kind, method and checkpoint of a pause or feedback")
    return edited


def _first(raw: dict[str, Any], key: str) -> str | None:
    """The branch a fork's paused occurrence first ran on (`Body.first`)."""
    if key not in raw:
        return None
    if raw["kind"] not in ("pause", "feedback", "edit"):
        raise ValueError(f"only a pause, its feedback or an edit keeps a {key!r} branch")
    return _str(raw[key], key)


def _bytes_or_none(value: Any) -> bytes | None:
    if value is not None and not isinstance(value, bytes):
        raise TypeError(
            f"an output or a pause's context is stored as bytes, not {type(value).__name__}"
        )
    return value
