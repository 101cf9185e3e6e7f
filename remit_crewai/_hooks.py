"""CrewAI interception hooks that carry the contract into the flow engine.

`FlowPersistence` never sees which methods completed, which flow instance
is running, or the feedback a resume delivers; CrewAI's global interception
hooks do. Installed once per process when `remit_crewai` is imported (before any
`RemitFlowPersistence` exists: CrewAI's default-persistence factory may make the first
one in the middle of `from_pending`), they act only on flows whose persistence is one:

- EXECUTION_START: a kickoff with `inputs["id"]` claims that flow and hands
  it its completion ledger, which `_replay` replays as CrewAI restarts it; so
  does a kickoff without an id of an instance whose flow has checkpoints. A
  kickoff without an id inside another workflow's Remit step gets an id made
  from that step's scope, so that the step run again continues that flow.
- PRE_STEP: the step runs under the flow's claim; the first step of a
  restart given inputs checks the state they made; the first step after a
  resume consumes the pending feedback; effects inside get a step scope
  keyed by branch, method and occurrence.
- POST_STEP: refuses a step that changed the flow's id; notes the route a
  router took, for the save that completes it; closes the step scope.
- EXECUTION_END: consumes feedback still owed, releases the claim (a
  conversational turn's once its kickoff returns, after CrewAI saved the reply). CrewAI
  dispatches none for a kickoff or resume stopped by cancellation (a
  timeout, a cancelled task, Ctrl-C), whose claim would then be renewed for
  as long as the process lives: the wrappers `install` puts on
  `kickoff_async` and `resume_async` end such a run as a failed one.
- A method `@persist`ed to another store is saved to the flow's own too (the
  wrapper `install` puts on CrewAI's per-method save), so that its completion
  is in the ledger a restart replays.

A flow awaited inside another's async step runs its hooks in that step's
context, so each hook puts back what it replaced (the outer step's scope,
the outer kickoff) instead of clearing it.

CrewAI swallows every exception a hook raises except `HookAborted`, so a
refusal from a hook is raised as its own Remit class that is also a
`HookAborted` (`aborting`): the step stops, and callers still catch e.g. `Fenced`.
"""

from __future__ import annotations

import functools
import sys
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from crewai.flow import runtime
from crewai.flow.persistence.decorators import PersistenceDecorator
from crewai.hooks.dispatch import HookAborted, InterceptionPoint, register
from pydantic import BaseModel

from remit_core.effects import StepScope, bind_step_scope, current_scope
from remit_core.errors import CheckpointInvalid, RemitError
from remit_crewai import _replay, _resume
from remit_crewai._session import (
    Execution,
    current_execution,
    current_fork_token,
    pausing,
    started_as,
    streamed_token,
    streaming_under,
)
from remit_crewai.persistence import RemitFlowPersistence

_installed = False
_install_lock = threading.Lock()
_aborts: dict[type[RemitError], type[RemitError]] = {}


def install() -> None:
    """Register the hooks, and the wrappers of `_replay` and `_resume`, once per process
    (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        register(InterceptionPoint.EXECUTION_START, _on_start)
        register(InterceptionPoint.PRE_STEP, _on_pre_step)
        register(InterceptionPoint.POST_STEP, _on_post_step)
        register(InterceptionPoint.EXECUTION_END, _on_end)
        _replay.install()
        _resume.install()
        _end_when_cancelled("kickoff_async")
        _end_when_cancelled("resume_async")
        _fork_where_called("stream_events")
        _fork_where_called("astream")
        _complete_on_own_store()
        _installed = True


def _end_when_cancelled(name: str) -> None:
    """Wrap CrewAI's `name` so that a Remit-backed run it stops by cancellation (or
    KeyboardInterrupt), for which CrewAI dispatches no EXECUTION_END, ends as a failed
    run does: its claim released, its context restored. A conversational turn's claim,
    kept past EXECUTION_END for CrewAI's save of the turn's reply, is released as it
    returns (`RemitFlowPersistence._end_turn`)."""
    engine = runtime.Flow
    run = getattr(engine, name)

    @functools.wraps(run)
    async def ending(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await run(self, *args, **kwargs)
        except Exception:
            raise
        except BaseException:
            if isinstance(getattr(self, "persistence", None), RemitFlowPersistence):
                _end(self, completed=False, output=None)
            raise
        finally:
            backend = getattr(self, "persistence", None)
            if isinstance(backend, RemitFlowPersistence):
                backend._end_turn(self)

    setattr(engine, name, ending)


def _fork_where_called(name: str) -> None:
    """Wrap CrewAI's `name` (`stream_events`, `astream`: what `kickoff` and `kickoff_async`
    of a streaming flow return) so that the run it makes forks under the `fork_token` of
    the place the kickoff was called: CrewAI starts that run only when the frames are
    read, maybe after the block (`streaming_under`)."""
    engine = runtime.Flow
    stream = getattr(engine, name)

    @functools.wraps(stream)
    def streaming(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(getattr(self, "persistence", None), RemitFlowPersistence):
            streaming_under(self, current_fork_token.get())
        return stream(self, *args, **kwargs)

    setattr(engine, name, streaming)


def _complete_on_own_store() -> None:
    """Wrap CrewAI's per-method save so that a method `@persist`ed to another store than
    its flow's Remit-backed persistence is saved to the flow's too: its completion goes
    in the ledger a restart replays, else the restart would run it again."""
    engine = runtime.Flow
    save = engine._persist_method_completion

    @functools.wraps(save)
    def persist_method_completion(self: Any, method_name: Any) -> None:
        save(self, method_name)
        own = self.persistence
        if isinstance(own, RemitFlowPersistence) and _saved_elsewhere(self, method_name):
            PersistenceDecorator.persist_state(self, method_name, own)

    engine._persist_method_completion = persist_method_completion  # type: ignore[method-assign]


def _saved_elsewhere(flow: Any, method_name: Any) -> bool:
    """Whether CrewAI saved `method_name` of `flow` to a store other than its flow's own."""
    if flow._instance_persistence:
        return False  # a persistence given to the flow saves every method
    definition = flow._definition.methods[str(method_name)].persist or flow._definition.persist
    if definition is None or not definition.enabled:
        return False
    backend = flow._persist_backend_for(definition)
    return not (isinstance(backend, RemitFlowPersistence) and backend._stores_for(flow))


@dataclass
class _MethodScope(StepScope):
    """The step scope of one method of one flow, and the scope it replaced."""

    flow: weakref.ref[Any] | None = None
    outer: StepScope | None = field(default=None, repr=False)
    #: The flow id the step runs under (its session's).
    flow_id: str = ""


def _close_scopes(flow: Any, *, all_of_them: bool) -> None:
    """Put back the scope the innermost open step of `flow` replaced (`all_of_them`:
    of every open step of `flow`, as when a failed step never reached POST_STEP)."""
    scope = current_scope()
    while isinstance(scope, _MethodScope) and scope.flow is not None and scope.flow() is flow:
        bind_step_scope(scope.outer)
        if not all_of_them:
            return
        scope = scope.outer


def aborting(error: RemitError) -> RemitError:
    """`error` as an exception CrewAI lets out of a hook: same class name and ids, and a
    `HookAborted`, so `except Fenced` (or any Remit class) still catches it."""
    cls = type(error)
    hybrid = _aborts.get(cls)
    if hybrid is None:
        hybrid = type(cls.__name__, (cls, HookAborted), {"__module__": cls.__module__})
        _aborts[cls] = hybrid
    out = hybrid.__new__(hybrid, *error.args)
    out.__dict__.update(error.__dict__)
    out.reason, out.source = str(error), "remit"  # type: ignore[attr-defined]
    return out


class _TooDeep(RecursionError, HookAborted):
    """A `RecursionError` CrewAI lets out of a hook (see `too_deep`)."""


def too_deep(method: str) -> RecursionError:
    """The error for a step of a flow whose calls went past Python's recursion limit as
    it was about to start: a `RecursionError` (what the same flow raises without Remit)
    that says whose limit it is, not a Remit failure. CrewAI runs a loop through a start
    (a router routing back to `@start("again")`) as nested calls, a few per round."""
    limit = sys.getrecursionlimit()
    reason = (
        f"step {method!r} did not start: the flow's calls went past Python's recursion "
        f"limit ({limit}). CrewAI runs a loop through a start as nested calls, a few per "
        "round, with or without Remit; raise the limit (sys.setrecursionlimit) or loop "
        "inside one method. The flow is saved up to its last completed step: a restart "
        "under a higher limit continues it"
    )
    error = _TooDeep(reason)
    error.reason, error.source = reason, "remit"
    return error


def _backend(ctx: Any) -> RemitFlowPersistence | None:
    persistence = getattr(ctx.flow, "persistence", None)
    return persistence if isinstance(persistence, RemitFlowPersistence) else None


def _on_start(ctx: Any) -> Any:
    backend = _backend(ctx)
    if backend is None:
        return None
    token = current_fork_token.get()
    if token is not None:
        # The token names this kickoff's fork only: a flow kicked off inside its steps
        # gets the step's id for it (`_nested_id`), not a fork's. Back at its end.
        current_fork_token.set(None)
    token = streamed_token(ctx.flow) or token
    inputs: Any = ctx.payload
    replaced: dict[str, Any] | None = None
    if (
        getattr(ctx.flow, "_restored_from_checkpoint", False)
        and (inputs is None or (isinstance(inputs, dict) and "id" not in inputs))
        and backend._has_run(ctx.flow.flow_id)
    ):
        # `kickoff(from_checkpoint=...)` of a flow Remit has checkpoints of: its head
        # continues it, an older checkpoint is a fork (refused without a token).
        try:
            given = inputs if isinstance(inputs, dict) else {}
            continued = backend._restored_continues(ctx.flow, _carried(ctx.flow), token, given)
        except RemitError as exc:
            raise aborting(exc) from exc
        inputs = replaced = {**(inputs or {}), "id": continued}
    unnamed = token is None and (
        inputs is None or (isinstance(inputs, dict) and "id" not in inputs)
    )
    nested = _nested_id(ctx.flow) if unnamed else None
    if nested is None and unnamed and backend._has_run(ctx.flow.flow_id):
        # An instance kicked off again keeps its flow id (CrewAI's own rule): that flow
        # continues, as by `inputs["id"]`; CrewAI would run its completed steps again.
        nested = ctx.flow.flow_id
    if nested is not None:
        # Kicked off again (by a step that runs again, or on its instance), the flow
        # continues, not starts anew.
        inputs = replaced = {**(inputs or {}), "id": nested}
    elif unnamed and isinstance(inputs, dict) and isinstance(ctx.flow.state, BaseModel):
        try:  # (a restart's inputs are checked against the state it restores)
            backend._check_new_inputs(ctx.flow.state, inputs, run_id=ctx.flow.flow_id)
        except RemitError as exc:
            raise aborting(exc) from exc
    if token is not None and (inputs is None or isinstance(inputs, dict)):
        # A fork names its run through inputs["id"] (`_hydrate_fork`): give CrewAI a dict
        # of its own to read it from, not the caller's, which may start another fork.
        inputs = replaced = dict(inputs or {})
    ex = Execution(
        flow=weakref.ref(ctx.flow),
        inputs=inputs if isinstance(inputs, dict) else None,
        fork_token=token,
        outer=current_execution.get(),
    )
    current_execution.set(ex)
    pausing(ctx.flow, False)  # (it paused before: this kickoff runs it again)
    if isinstance(inputs, dict) and "id" in inputs:
        ex.carried = _given_past(ctx.flow, str(inputs["id"]))
        backend._begin_restart(ex, ctx.flow, str(inputs["id"]))
    elif getattr(ctx.flow, "_restored_from_checkpoint", False):
        ex.carried = _carried(ctx.flow)
    return replaced


def _given_past(flow: Any, flow_id: str) -> dict[str, int] | None:
    """What CrewAI will skip of a kickoff of `flow` by its own id `flow_id`: the methods
    the instance was told completed before it (`Flow.reload(execution_data)`, or a CrewAI
    checkpoint), as `_carried` counts them; None if there are none, or if `inputs["id"]`
    names another flow than the instance's (its past is not that flow's). A store that
    has no checkpoint of the flow records them as completed with its first save, as for
    a flow restored from a CrewAI checkpoint; else the flow's ledger is its past
    (`RemitFlowPersistence._begin_restart`)."""
    if flow.flow_id != flow_id or not flow._completed_methods:
        return None
    return _carried(flow)


def _carried(flow: Any) -> dict[str, int]:
    """Per method, how often it completed before the CrewAI checkpoint `flow` was
    restored from (CrewAI skips these methods; at least once each it lists). No route is
    recorded for a router among them: CrewAI's run of the restored flow follows none
    either, and a restart goes as far as that run went."""
    counts = {str(m): int(n) for m, n in flow._method_execution_counts.items() if n > 0}
    return {**{str(m): 1 for m in flow._completed_methods}, **counts}


def _nested_id(flow: Any) -> str | None:
    """The id of a flow kicked off without one inside another workflow's Remit step: the
    same each time that step runs (after a crash, a recovery, on a fork that shares it),
    by the step's key and the kickoff's place among the step's kickoffs of its class,
    as an effect's key is. With a new id each time, the flow would run again from its
    start and apply its effects again (P1, P2). None outside a step."""
    scope = current_scope()
    if scope is None:
        return None
    key = scope.next_key(f"kickoff {type(flow).__module__}.{type(flow).__qualname__}")
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"remit:{scope.run_id}/{key}"))


def _on_pre_step(ctx: Any) -> None:
    backend = _backend(ctx)
    if backend is None or ctx.kind != "flow_method":
        return
    ex = current_execution.get()
    first = ex is not None and not ex.stepping and ex.flow() is ctx.flow
    if ex is not None:
        ex.stepping = True
    try:
        session = backend._step_session(ctx.flow)
        if first and ex is not None:
            backend._check_inputs(session, ctx.flow, ex)
        if session.pending is not None:
            backend._accept(session, ctx.flow)
    except RemitError as exc:
        raise aborting(exc) from exc
    except RecursionError as exc:
        raise too_deep(str(ctx.step_name)) from exc
    except Exception as exc:  # CrewAI would run the step all the same: stop the flow
        raise aborting(
            RemitError(f"Remit could not prepare step {ctx.step_name!r}: {exc!r}")
        ) from exc
    method = str(ctx.step_name)
    with session.lock:  # (a pause computes what runs under this lock: see `_rejoin`)
        try:
            backend._refuse_if_paused(ctx.flow)
        except RemitError as exc:
            raise aborting(exc) from exc
        occurrence = session.start_occurrence(method)
    started_as(session.flow_id, method, occurrence)
    bind_step_scope(
        _MethodScope(
            backend.remit,
            session.run_id,
            session.step_key(method, occurrence),
            session.fence,
            flow=weakref.ref(ctx.flow),
            outer=current_scope(),
            flow_id=session.flow_id,
        )
    )


def _on_post_step(ctx: Any) -> None:
    backend = _backend(ctx)
    if backend is None or ctx.kind != "flow_method":
        return
    method = str(ctx.step_name)
    _refuse_new_id(ctx.flow, method)
    if ctx.flow._is_router(method):
        backend._took_route(ctx.flow, method, ctx.payload)
    backend._answered_at_once(ctx.flow, method, ctx.payload)
    _close_scopes(ctx.flow, all_of_them=False)


def _runs(scope: _MethodScope, flow: Any) -> bool:
    """Whether `scope` is the scope of a step of `flow`."""
    return scope.flow is not None and scope.flow() is flow


def _refuse_new_id(flow: Any, method: str) -> None:
    """`CheckpointInvalid` naming `id` for a step of `flow` that changed the flow's id,
    before anything saves it: CrewAI would save the flow under the new id from then on,
    a second flow made silently from the first's past, while the first stays claimed
    and unfinished. The id is put back, so that the run ends (fails) as the flow it is."""
    scope = current_scope()
    if not isinstance(scope, _MethodScope) or not _runs(scope, flow):
        return
    changed = flow.flow_id
    if changed == scope.flow_id:
        return
    flow._stamp_state_id(scope.flow_id)
    _close_scopes(flow, all_of_them=False)
    raise aborting(
        CheckpointInvalid(
            f"step {method!r} changed the flow's id to {changed!r}: a flow keeps its id "
            "(CrewAI would go on saving it under the new one, a copy of this flow); "
            "nothing of the step was saved. To continue a flow under another id, fork it",
            field="id",
            run_id=scope.run_id,
        )
    )


def _on_end(ctx: Any) -> Any:
    if _backend(ctx) is None:
        return None
    return _end(ctx.flow, completed=ctx.status == "completed", output=ctx.payload)


def _end(flow: Any, *, completed: bool, output: Any) -> Any:
    """The run of `flow` ended: consume what it owes, release its claim, put back the
    kickoff it ran inside; what a restart that ran nothing returns, else None."""
    backend = flow.persistence
    _close_scopes(flow, all_of_them=True)
    ex = current_execution.get()
    mine = ex if ex is not None and ex.flow() is flow else None
    if mine is not None:
        mine.over = True  # a save still running in a worker thread claims for itself
    try:
        # A restart that ran nothing returns the output the finished run returned.
        restored = backend._restart_output(flow) if completed and output is None else None
        # The id the kickoff claimed: a kickoff that failed early (a fork refused) has
        # not given it to the flow yet.
        backend._finish(flow, completed=completed, flow_id=None if mine is None else mine.restart)
        return restored
    except RemitError as exc:
        raise aborting(exc) from exc
    finally:
        if mine is not None:
            current_execution.set(mine.outer)
            if mine.fork_token is not None:
                current_fork_token.set(mine.fork_token)
