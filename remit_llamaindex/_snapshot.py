"""What one Remit checkpoint of a LlamaIndex run holds, and what it says about the run.

A checkpoint body is the run's `SerializedContext` (broker state plus the
state store's in-memory payload), encoded with Remit's plain-data codec.
Everything here is pure: no store, no event loop.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError
from workflows._event_matching import event_matches, step_accepts_event
from workflows.context.context_types import SerializedContext
from workflows.context.serializers import BaseSerializer, JsonSerializer, PickleSerializer
from workflows.context.state_store import decode_seed_state
from workflows.errors import ContextSerdeError, WorkflowCancelledByUser
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StopEvent
from workflows.runtime.types.commands import CommandCompleteRun, CommandFailWorkflow, CommandHalt
from workflows.runtime.types.internal_state import BrokerState
from workflows.runtime.types.results import AddWaiter, StepWorkerWaiter
from workflows.runtime.types.step_id import StepId
from workflows.runtime.types.ticks import TickStepResult, TickWaiterTimeout, WorkflowTick
from workflows.workflow import Workflow

from remit_core import codec
from remit_core.errors import CheckpointInvalid, CorruptRecord, RemitError, VersionMismatch
from remit_core.records import CheckpointRecord

#: Store-type tag of the state payload a Remit-backed context serializes to.
HANDLE_TYPE = "remit"

RUNNING = "running"
WAITING = "waiting"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})


def require_json(serializer: BaseSerializer, run_id: str | None = None) -> JsonSerializer:
    """Remit stores plain JSON only: a serializer that could unpickle on read is refused."""
    if isinstance(serializer, PickleSerializer) or not isinstance(serializer, JsonSerializer):
        raise RemitError(
            f"Remit persists workflow state as JSON and never unpickles; "
            f"{type(serializer).__name__} is not supported: use JsonSerializer",
            run_id=run_id,
        )
    return serializer


@dataclass(frozen=True)
class Waiter:
    """One `ctx.wait_for_event` waiter of a run, under its Remit interrupt id."""

    interrupt_id: str
    step: str
    waiter_id: str
    event_type: str
    resolved_event: Event | None
    timed_out: bool
    requirements: dict[str, Any]

    @property
    def pending(self) -> bool:
        return self.resolved_event is None and not self.timed_out


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def walk_brokers(
    state: BrokerState, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], BrokerState]]:
    yield path, state
    for key, child in sorted(state.children.items()):
        yield from walk_brokers(child, (*path, key))


class _Located(NamedTuple):
    """A waiter of the run, where it lives, and its interrupt id (which names step,
    waiter and work item)."""

    interrupt_id: str
    path: tuple[str, ...]
    broker: BrokerState
    step_id: StepId
    waiter: StepWorkerWaiter


def _located(state: BrokerState) -> Iterator[_Located]:
    for path, broker in walk_brokers(state):
        for step_id, worker in sorted(broker.workers.items(), key=lambda kv: str(kv[0])):
            step = "/".join((*path, str(step_id)))
            for w in worker.collected_waiters:
                yield _Located(
                    f"{step}:{w.waiter_id}@{w.work_item_id or ''}", path, broker, step_id, w
                )


def _collected(state: BrokerState) -> Iterator[tuple[str, str, StepWorkerWaiter]]:
    """(interrupt id, step, waiter) for every waiter of the run."""
    for found in _located(state):
        yield found.interrupt_id, "/".join((*found.path, str(found.step_id))), found.waiter


def waiters(state: BrokerState) -> list[Waiter]:
    """Every waiter of the run, under its interrupt id."""
    return [
        Waiter(
            interrupt_id=interrupt_id,
            step=step,
            waiter_id=w.waiter_id,
            event_type=_qualname(w.waiting_for_event),
            resolved_event=w.resolved_event,
            timed_out=w.timed_out,
            requirements=dict(w.requirements),
        )
        for interrupt_id, step, w in _collected(state)
    ]


def waiter_deadlines(
    before: BrokerState, after: BrokerState, tick: WorkflowTick
) -> dict[str, float]:
    """The deadlines of the waiters a reduced step result added with a `timeout`, by
    interrupt id, in alive time (`elapsed_alive` of the waiter's broker). The
    framework schedules such a timeout in memory only: a restored waiter has none."""
    if not isinstance(tick, TickStepResult):
        return {}
    timeouts = {
        r.waiter_id: r.timeout
        for r in tick.result
        if isinstance(r, AddWaiter) and r.timeout is not None
    }
    seen = {found.interrupt_id for found in _located(before)}
    return {
        found.interrupt_id: found.broker.elapsed_alive + timeouts[found.waiter.waiter_id]
        for found in _located(after)
        if found.interrupt_id not in seen
        and found.waiter.waiter_id in timeouts
        and (found.path, found.step_id) == (tuple(tick.invocation_namespace), tick.step_id)
    }


def rearmed_timeouts(
    state: BrokerState, deadlines: dict[str, float]
) -> dict[str, tuple[float, TickWaiterTimeout]]:
    """For each pending waiter of a restored `state` with a deadline: the alive seconds
    it has left (downtime is not counted, as for the workflow's own timeout) and the
    tick that times it out, by interrupt id."""
    return {
        found.interrupt_id: (
            max(0.0, deadlines[found.interrupt_id] - found.broker.elapsed_alive),
            TickWaiterTimeout(
                step_id=found.step_id,
                waiter_id=found.waiter.waiter_id,
                invocation_namespace=found.path,
            ),
        )
        for found in _located(state)
        if found.interrupt_id in deadlines
        and found.waiter.resolved_event is None
        and not found.waiter.timed_out
    }


def requirements(state: BrokerState) -> dict[str, dict[str, Any]]:
    """The `requirements` of the waiters, by interrupt id, where plain data can hold
    them. The framework's snapshot drops them: a restored waiter would take any
    event of its type until its step ran again, so one answer would resolve every
    waiter of that type. A resolved waiter keeps its step's earlier answer (a step
    that waits again, for another answer, finds it there when it runs again): without
    its requirements, the next answer would resolve it too, and the framework would
    run its step once more for it, beside a re-run of that step still in flight."""
    kept = {}
    for w in waiters(state):
        if w.requirements:
            try:
                codec.dumps(w.requirements)
            except TypeError:  # the framework's re-run of the step restores these
                continue
            kept[w.interrupt_id] = w.requirements
    return kept


def restore_requirements(state: BrokerState, stored: dict[str, dict[str, Any]]) -> None:
    """Give the restored waiters of `state` their stored `requirements` back (the
    framework then has no step to re-run for them)."""
    for interrupt_id, _, w in _collected(state):
        if interrupt_id in stored and w.has_requirements and not w.requirements:
            w.requirements = dict(stored[interrupt_id])


@dataclass(frozen=True)
class Ask:
    """An `InputRequiredEvent` a step returned for the outside: the classic human in the
    loop, answered by a `HumanResponseEvent` that some step takes (no waiter involved)."""

    interrupt_id: str
    event_type: str

    def prompt(self) -> dict[str, Any]:
        return {"kind": "ask", "event_type": self.event_type}


def new_asks(before: BrokerState, after: BrokerState) -> list[Ask]:
    """The asks a reduced step result opened: `InputRequiredEvent`s it put on their way
    out. Named by the emission key, the same in every process that reduces the journal
    (the "-" keeps the name apart from a waiter's, which starts with a step name)."""
    seen = {key for _, broker in walk_brokers(before) for key in broker.deliveries}
    return [
        Ask(
            interrupt_id=f"input-required:{key.invocation_id}#{key.index}",
            event_type=_qualname(type(delivery.event)),
        )
        for _, broker in walk_brokers(after)
        for key, delivery in broker.deliveries.items()
        if key not in seen and isinstance(delivery.event, InputRequiredEvent)
    ]


def is_answer(event: Event) -> bool:
    """Whether `event` answers an ask (the framework's human-response type)."""
    return isinstance(event, HumanResponseEvent)


def event_types(event: Event) -> set[str]:
    """Qualified names of an event's class and its bases (what a waiter may wait for)."""
    return {_qualname(c) for c in type(event).__mro__}


def waiter_prompt(w: Waiter) -> dict[str, Any]:
    """What a waiter's interrupt stores about it: its step, waiter id, the event type it
    waits for and, where plain data can hold them, its `requirements`."""
    prompt: dict[str, Any] = {"step": w.step, "waiter_id": w.waiter_id, "event_type": w.event_type}
    if w.requirements:
        try:
            codec.dumps(w.requirements)
        except TypeError:  # (then the event type alone names what it waited for)
            return prompt
        prompt["requirements"] = w.requirements
    return prompt


def would_answer(prompt: dict[str, Any], event: Event, state: BrokerState | None = None) -> bool:
    """Whether `event` answers the waiter an interrupt's `prompt` describes: of the type
    it waits for, and meeting its stored `requirements` (the reducer's matching). A
    refusal of an event for a consumed interrupt names that waiter's, not another
    one's of the same type.

    The type is matched as the reducer matches it: exactly, unless the waiter's step
    (in `state`) takes subclasses (`accept_event_subclasses`). An event of a subclass
    answers no waiter of its base type otherwise, and is delivered to the steps that
    take it: taken for an answer to a consumed waiter, it would be refused every time."""
    if prompt.get("kind") == "ask":
        return False
    if _takes_subclasses(state, prompt.get("step")):
        if prompt.get("event_type") not in event_types(event):
            return False
    elif prompt.get("event_type") != _qualname(type(event)):
        return False
    wanted = prompt.get("requirements") or {}
    return all(getattr(event, k, None) == v for k, v in wanted.items())


def _takes_subclasses(state: BrokerState | None, step: object) -> bool:
    """Whether `step` (a waiter's step, as its prompt names it) of `state`'s workflow
    takes subclasses of the events it waits for (False when it is not known)."""
    if state is None:
        return False
    return any(
        config.accept_event_subclasses
        for step_id, config in state.config.steps.items()
        if str(step_id) == step
    )


def takes(state: BrokerState, event: Event, step: StepId | None = None) -> bool:
    """Whether the control loop does anything with `event` sent from outside (to `step`,
    or to every step): a pending waiter of the run waits for it, or a step accepts it.

    The framework drops any other event (it only publishes an `UnhandledEvent`): an
    answer sent before the step that waits for it has asked is lost, not kept for it.
    The matching is the reducer's: the framework's own rule, and a waiter's
    `requirements`."""
    for step_id, config in state.config.steps.items():
        subclasses = config.accept_event_subclasses
        for w in state.workers[step_id].collected_waiters:
            if (
                w.resolved_event is None
                and not w.timed_out
                and event_matches(event, w.waiting_for_event, allow_subclasses=subclasses)
                and all(getattr(event, k, None) == v for k, v in w.requirements.items())
            ):
                return True
        targeted = step is None or step == step_id
        if targeted and step_accepts_event(
            event, config.accepted_events, allow_subclasses=subclasses
        ):
            return True
    return False


def busy_steps(state: BrokerState) -> list[str]:
    """Steps with queued or in-flight work: the steps a resume would run next."""
    steps = set()
    for path, broker in walk_brokers(state):
        for step_id, worker in broker.workers.items():
            if worker.queue or worker.in_progress:
                steps.add("/".join((*path, str(step_id))))
    return sorted(steps)


def answered_earlier(
    state: BrokerState,
    interrupt_id: str,
    prompt: dict[str, Any],
    event: Event,
    step: StepId | None = None,
) -> bool:
    """Whether a consumed waiter's interrupt is of an earlier round of a run that has
    work in flight: its step has completed, while a step is still queued or running and
    may wait again (a loop asking each round). An `event` no step takes is then not an
    answer to that interrupt but one sent before the run waits again, refused all the
    same (`check_awaited`, saying a step is in flight). A classic ask, answered by a step
    that takes the event, stays consumed whatever runs."""
    return (
        prompt.get("kind") != "ask"
        and bool(busy_steps(state))
        and not takes(state, event, step)
        and all(w.interrupt_id != interrupt_id for w in waiters(state))
    )


def is_idle(state: BrokerState) -> bool:
    """Running with nothing left to do: the run waits for an event from outside.

    An `InputRequiredEvent` still on its way out does not count as work: it is the
    question the run waits on, so a step that returns one parks the run at once."""
    if not state.is_running:
        return False
    outbound = (
        delivery.event
        for _, broker in walk_brokers(state)
        for delivery in broker.deliveries.values()
    )
    return all(isinstance(e, InputRequiredEvent) for e in outbound) and not busy_steps(state)


def status_of(state: BrokerState, exit_command: object | None) -> str:
    """The run's status after a tick, from the reducer's exit command if it ended."""
    if isinstance(exit_command, CommandCompleteRun):
        return COMPLETED
    if isinstance(exit_command, CommandFailWorkflow):
        return FAILED
    if isinstance(exit_command, CommandHalt):
        cancelled = isinstance(exit_command.exception, WorkflowCancelledByUser)
        return CANCELLED if cancelled else FAILED
    return WAITING if is_idle(state) else RUNNING


def encode(
    state: BrokerState,
    state_payload: dict[str, Any],
    serializer: BaseSerializer,
    meta: dict[str, Any],
) -> bytes:
    """The checkpoint body: the serialized context with the state store's payload, the
    waiters' requirements, and a copy of the checkpoint's metadata."""
    ctx = state.to_serialized(serializer)
    ctx.state = state_payload
    return body(ctx.model_dump(mode="json"), requirements(state), meta)


class Body(NamedTuple):
    """What a checkpoint body holds."""

    ctx: dict[str, Any]
    requirements: dict[str, dict[str, Any]]
    meta: dict[str, Any] | None


def body(
    ctx: dict[str, Any], waiter_requirements: dict[str, dict[str, Any]], meta: dict[str, Any]
) -> bytes:
    """A checkpoint body. The metadata (the run's status, result, open interrupts) is
    copied in because the record's checksum covers the body only."""
    data: dict[str, Any] = {"ctx": ctx, "meta": meta}
    if waiter_requirements:
        data["requirements"] = waiter_requirements
    return codec.dumps(data)


def decode_body(data: bytes, **ids: Any) -> Body:
    """The parts of a checkpoint body (`meta` is None in bodies written without it)."""
    try:
        loaded = codec.loads(data)
        found = Body(loaded["ctx"], loaded.get("requirements", {}), loaded.get("meta"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRecord(f"checkpoint body is not a LlamaIndex context ({exc})", **ids) from exc
    if not isinstance(found.ctx, dict) or not isinstance(found.requirements, dict):
        raise CorruptRecord("checkpoint body is not a LlamaIndex context", **ids)
    return found


def decode(data: bytes, **ids: Any) -> dict[str, Any]:
    """The serialized context a checkpoint body holds (a plain dict)."""
    return decode_body(data, **ids).ctx


def check_metadata(record: CheckpointRecord) -> None:
    """Refuse a checkpoint whose metadata differs from the copy sealed in its body."""
    ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
    sealed = decode_body(record.state, **ids).meta
    if sealed is not None and {k: record.metadata.get(k) for k in sealed} != sealed:
        raise CorruptRecord(
            "checkpoint metadata (status, result, open interrupts) does not match the "
            "copy sealed in its body",
            **ids,
        )


def _why_undecodable(exc: BaseException) -> BaseException:
    """The first error in `exc`'s chain that says the reading code changed (a class it
    cannot resolve, a value its class refuses), else `exc`: the framework wraps those
    in a `ValueError` or its `ContextSerdeError`."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ImportError, AttributeError, ValidationError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def _refused_by_serializer(exc: BaseException) -> BaseException | None:
    """The error in `exc`'s chain raised by the serializer refusing a class its
    `allowed_types` do not list (the reader's choice, not altered bytes), else None."""
    check = getattr(JsonSerializer, "_validate_qualified_name", None)
    refusing = getattr(check, "__code__", None)
    if refusing is None:  # (a release of the framework without the check)
        return None
    seen: BaseException | None = exc
    while seen is not None:
        if any(frame.f_code is refusing for frame, _ in traceback.walk_tb(seen.__traceback__)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def decoding(what: str, **ids: Any) -> Iterator[None]:
    """Raise the framework's failure to decode `what` (part of a stored checkpoint) as
    Remit's, naming the run and checkpoint (P4). A class the record names that this
    process cannot resolve, or a stored value its class no longer accepts, means the
    record was written by another version of the workflow's code (an event or state
    class renamed, moved, removed or given a new required field since):
    `VersionMismatch`, as is a class the reading workflow's serializer does not allow
    (`JsonSerializer(allowed_types=...)`). Anything else that does not decode:
    `CorruptRecord`."""
    try:
        yield
    except RemitError:
        raise
    except (ImportError, AttributeError, ContextSerdeError, ValueError, TypeError, KeyError) as exc:
        refused = _refused_by_serializer(exc)
        if refused is not None:
            raise VersionMismatch(
                f"{what} names a class the reading workflow's serializer does not allow"
                f" ({refused})",
                **ids,
            ) from exc
        why = _why_undecodable(exc)
        if isinstance(why, ValidationError):
            first = why.errors()[0]
            field = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
            raise VersionMismatch(
                f"{what} holds a {why.title} its class no longer accepts (at {field}: "
                f"{first.get('msg')}): it was written by another version of the workflow's "
                "code; continue it with the code that wrote it, or give the field a default",
                field=f"{why.title}.{field}",
                **ids,
            ) from exc
        if isinstance(why, (ImportError, AttributeError)):
            raise VersionMismatch(
                f"{what} names a class this process cannot resolve ({why}): it was written "
                "by another version of the workflow's code (a class renamed, moved or "
                "removed since); continue it with the code that wrote it, or keep the class "
                "importable under its old name",
                **ids,
            ) from exc
        raise CorruptRecord(f"{what} does not decode ({exc})", **ids) from exc


def broker_state(
    ctx: dict[str, Any], workflow: Workflow, serializer: BaseSerializer, **ids: Any
) -> BrokerState:
    """The broker state a serialized context describes, for `workflow`.

    The framework drops, without a word, the work of a stored step the workflow
    has no step for (another workflow, or another shape of it): its waiters and
    queued events would be lost, so such a context is refused (`VersionMismatch`,
    naming the steps). A step it has that no longer takes the event of its stored work
    would be run on that event all the same, and fail on it for good: refused so too
    (`_untaken_work`). A stored step without work left is only history."""
    with decoding("the checkpoint's context", **ids):
        parsed = SerializedContext.from_dict_auto(ctx, serializer)
        state = BrokerState.from_serialized(parsed, workflow, serializer)
    known = {str(step_id) for step_id in state.workers}
    missing = sorted(
        name
        for name, worker in parsed.workers.items()
        if name not in known
        and (
            worker.queue
            or worker.in_progress
            or worker.collected_waiters
            or any(worker.collected_events.values())
            or worker.static_collect_events
        )
    )
    missing += sorted(
        {d.step_id for d in parsed.deliveries if d.step_id is not None and d.step_id not in known}
        - set(missing)
    )
    if missing:
        raise VersionMismatch(
            f"the checkpoint holds work of step(s) {', '.join(map(repr, missing))} that "
            f"workflow {type(workflow).__name__} has no step for (steps: "
            f"{', '.join(sorted(known)) or 'none'}): it was written by another workflow, or "
            "another shape of it; continue it with the workflow that wrote it (give each "
            "shape its own RemitRuntime(workflow_version=...))",
            **ids,
        )
    untaken = _untaken_work(state)
    if untaken is not None:
        step_id, event, accepted = untaken
        raise VersionMismatch(
            f"the checkpoint holds work of step {step_id!r} on event "
            f"{type(event).__name__}, which that step of workflow {type(workflow).__name__} "
            f"does not take (it takes {', '.join(sorted(map(_name, accepted))) or 'none'}): "
            "it was written by another shape of the workflow; continue it with the workflow "
            "that wrote it (give each shape its own RemitRuntime(workflow_version=...))",
            step=step_id,
            **ids,
        )
    return state


def _name(accepted: Any) -> str:
    return getattr(accepted, "__name__", None) or repr(accepted)


def _untaken_work(state: BrokerState) -> tuple[str, Event, list[Any]] | None:
    """The first piece of pending work (a queued, in-flight or waiting step invocation)
    whose event its step no longer takes, with the step and what it takes: the framework
    would call the step with it all the same. A collection's release is an event the
    framework makes for the step, not one routed to it, and is left out. An event on its
    way to a named step (`ctx.send_event(ev, step=...)`, stored before it arrived) is
    that step's work too: re-sent on restore, a step that no longer takes it drops it,
    and the run would wait for ever for what that event was to start."""
    for step_id, worker in state.workers.items():
        config = worker.config
        items = [
            *((a.event, a.collection_release_payload) for a in worker.queue),
            *((p.event, p.shared_state.collection_release_payload) for p in worker.in_progress),
            *((w.event, w.collection_release_payload) for w in worker.collected_waiters),
        ]
        for event, payload in items:
            if payload is None and not step_accepts_event(
                event, config.accepted_events, allow_subclasses=config.accept_event_subclasses
            ):
                return str(step_id), event, list(config.accepted_events)
    workers = {str(step_id): worker for step_id, worker in state.workers.items()}
    for delivery in state.deliveries.values():
        target = workers.get(str(delivery.step_id)) if delivery.step_id is not None else None
        if target is not None and not step_accepts_event(
            delivery.event,
            target.config.accepted_events,
            allow_subclasses=target.config.accept_event_subclasses,
        ):
            return str(delivery.step_id), delivery.event, list(target.config.accepted_events)
    return None


class _NotLoaded(Exception):
    """A record names a class whose module this process has not loaded."""

    def __init__(self, qualified_name: str) -> None:
        super().__init__(qualified_name)
        self.qualified_name = qualified_name


class LoadedClassesSerializer(JsonSerializer):
    """The framework's `JsonSerializer`, resolving only event (and exception) classes of
    modules already loaded: a record that names a class of another module is refused
    (`_NotLoaded`), never imported, and one that names any other class (which decoding
    would build, running its validators) is refused too, so reading a record runs no
    code of its choosing."""

    def resolve_class(self, qualified_name: str) -> type[Any]:
        module = qualified_name.rpartition(".")[0]
        if module not in sys.modules:
            raise _NotLoaded(qualified_name)
        found = super().resolve_class(qualified_name)
        if not issubclass(found, (Event, BaseException)):
            raise ValueError(f"{qualified_name} is not an event class; Remit does not build it")
        return found


def _named_class(data: Any, serializer: JsonSerializer) -> type[Any] | None:
    """The class an encoded value (a pydantic model, a component) names, resolved (not
    built), or None."""
    encoded = isinstance(data, dict) and (data.get("__is_pydantic") or data.get("__is_component"))
    if encoded and data.get("qualified_name"):
        named = serializer.resolve_class(data["qualified_name"])
        return named if isinstance(named, type) else None
    return None


def stop_event(result: str | None, serializer: JsonSerializer, **ids: Any) -> StopEvent:
    """The `StopEvent` a completed checkpoint records as the run's result."""
    if result is None:
        return StopEvent()
    try:
        data = json.loads(result)
        named = _named_class(data, serializer)
        if named is not None and not issubclass(named, StopEvent):
            raise CorruptRecord(
                f"the run's stored result names class {named.__name__} of module "
                f"{named.__module__}, which is not a StopEvent; Remit does not build it",
                **ids,
            )
        stop = serializer.deserialize_value(data)
    except _NotLoaded as exc:
        module, _, name = exc.qualified_name.rpartition(".")
        raise CorruptRecord(
            f"the run's stored result names class {name} of module {module}, which this "
            "process has not loaded; Remit does not import modules a record names: import "
            f"{module} (the module of the workflow that ran) before reading the result",
            **ids,
        ) from None
    except (ValueError, TypeError, KeyError, ImportError, AttributeError) as exc:
        raise CorruptRecord(f"the run's stored result does not decode ({exc})", **ids) from exc
    if not isinstance(stop, StopEvent):
        raise CorruptRecord(
            f"the run's stored result is a {type(stop).__name__}, not a StopEvent", **ids
        )
    return stop


def is_handle(payload: dict[str, Any] | None) -> bool:
    return bool(payload) and payload.get("store_type") == HANDLE_TYPE  # type: ignore[union-attr]


#: The fields of a handle (`is_handle`), and whether a context must give each.
_HANDLE_FIELDS = (
    ("run_id", True),
    ("checkpoint_id", False),
    ("branch", False),
    ("fork_token", False),
)


def carried_handle(handle: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """The handle of a run that has ended, with the live state of its context: what a run
    started from that context begins with (the state written to the context after the
    run ended included, as the framework's contexts carry it); the ended run is only
    named, never continued, by it."""
    return {**handle, "state": state}


def carried_state(handle: dict[str, Any]) -> dict[str, Any] | None:
    """The state payload a handle carries (`carried_handle`), or None."""
    state = handle.get("state")
    return state if isinstance(state, dict) else None


def check_handle(payload: dict[str, Any], **ids: Any) -> None:
    """Refuse a handle (`is_handle`) whose fields a restore cannot read, naming the field:
    a snapshot edited or written by hand would otherwise fail deep in the restore with a
    bare `KeyError`, or read as another outcome (a checkpoint id that is no string is
    "not the head", a fork). Each given field is a non-empty string; `run_id` is given."""
    for key, required in _HANDLE_FIELDS:
        value = payload.get(key)
        if value is None and not required:
            continue
        if not isinstance(value, str) or not value:
            found = "missing" if value is None else f"{type(value).__name__} {value!r:.60}"
            raise CheckpointInvalid(
                f"the context's state is a Remit handle whose {key!r} is not a non-empty "
                f"string ({found}); nothing was restored or stored: restore a snapshot as "
                "ctx.to_dict() gave it, or use RemitRuntime.context(workflow, run_id)",
                field=f"state.{key}",
                **ids,
            )
    if "state" in payload and carried_state(payload) is None:
        found = payload["state"]
        raise CheckpointInvalid(
            "the context's state is a Remit handle whose carried 'state' is not a state "
            f"payload ({type(found).__name__} {found!r:.60}); nothing was restored or "
            "stored: restore a snapshot as ctx.to_dict() gave it",
            field="state.state",
            **ids,
        )


def state_fields(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The plain field values of a typed-state payload, or None for `DictState` payloads."""
    data = payload.get("state_data")
    if isinstance(data, str):
        try:
            parsed = json.loads(data)
        except ValueError:
            return None
        if isinstance(parsed, dict) and parsed.get("__is_pydantic") and "value" in parsed:
            value = parsed["value"]
            return value if isinstance(value, dict) else None
    return None


def seed_state(payload: dict[str, Any], serializer: JsonSerializer, **ids: Any) -> BaseModel:
    """The state a context of the framework's own (`ctx.to_dict()`, or a dict written by
    hand) carries, decoded; one that does not decode (a `PickleSerializer` value, which
    Remit never unpickles, or no state payload at all) is `CheckpointInvalid` naming the
    key that fails, rather than the framework's bare decoding error."""
    try:
        return decode_seed_state(payload, serializer)
    except (ValueError, TypeError) as exc:
        failed = exc
    data = payload.get("state_data")
    values = data.get("_data") if isinstance(data, dict) else None
    for key, value in values.items() if isinstance(values, dict) else ():
        if not isinstance(value, str):
            continue
        try:
            serializer.deserialize(value)
        except (ValueError, TypeError):
            pickled = _is_pickle(value)
            raise CheckpointInvalid(
                f"the context's state value {key!r} does not decode as JSON"
                + (
                    " (it was written by PickleSerializer, and Remit never unpickles)"
                    if pickled
                    else f" ({failed})"
                )
                + "; nothing was stored",
                field=str(key),
                **ids,
            ) from failed
    raise CheckpointInvalid(
        f"the context's state does not decode ({failed}); nothing was stored", **ids
    ) from failed


def _is_pickle(value: str) -> bool:
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return False
    return raw[:1] == b"\x80"  # (the opcode that opens every pickle since protocol 2)
