"""A resume that fails before its feedback is consumed gives the flow back whole.

`from_pending` claims the paused flow in `load_pending_feedback` (the wrapper
marks the call as its: any other call of it is a read), then CrewAI
builds the flow and loads the state into it; if that fails (the state does not
fit the flow's model, a bad constructor argument), no hook runs and nothing
else would release the claim: a correct retry would get `ResumeConflict` until
the lease ran out. And a resume that failed before its feedback was consumed
(the feedback could not be classified into an `emit=` outcome) has given its
claim back at EXECUTION_END, while CrewAI lets the same instance `resume` again:
that retry must claim the flow again and consume the pause, not run past it.
The wrappers `install` puts on `from_pending` and `resume_async` do both, and
refuse feedback that is not a str by name before anything runs, a flow class
that no longer has the method the flow paused at, and one whose state model no
longer reads the paused state (`VersionMismatch` naming the field, where CrewAI
raises a bare `ValueError`). A resume also runs what was in flight beside the
paused method (`Session.leftovers`): CrewAI resumes only the paused method's
listeners, and a sibling step still running when the flow paused would never run
(or its listeners never would). The wrapper on `_execute_listeners` runs them
beside the resume's first listeners.
Other flows run CrewAI's code unchanged.
"""

from __future__ import annotations

import asyncio
import enum
import functools
from collections.abc import Coroutine
from typing import Any

from crewai.flow import runtime
from crewai.flow.flow import Flow
from crewai.flow.types import FlowMethodName

from remit_core.errors import VersionMismatch
from remit_crewai._ledger import locate
from remit_crewai._replay import _take
from remit_crewai._session import Session, current_from_pending, current_resumers
from remit_crewai.persistence import RemitFlowPersistence, _added_since, _refused_state


def install() -> None:
    """Wrap CrewAI's `from_pending` and `resume_async` (once per process, from `_hooks.install`)."""
    engine = runtime.Flow
    from_pending = engine.__dict__["from_pending"].__func__
    resume_async = engine.resume_async

    @functools.wraps(from_pending)
    def from_pending_releasing(cls: type[Flow[Any]], *args: Any, **kwargs: Any) -> Flow[Any]:
        before = current_resumers.get()
        args, kwargs = _with_class_persistence(cls, args, kwargs)
        claiming = current_from_pending.set(True)
        try:
            flow: Flow[Any] = from_pending(cls, *args, **kwargs)
            persistence = flow.persistence
            if isinstance(persistence, RemitFlowPersistence):
                _check_paused_method(flow)
                session = persistence._session_of(flow.flow_id, flow)
                if session is not None and not session.closed:
                    persistence._check_flow_class(session, flow)
                    _as_paused(flow, session)
            return flow
        except BaseException as exc:
            opened = [s for s in current_resumers.get() if s not in before and not s.closed]
            for session in opened:
                RemitFlowPersistence._release(session)
            for session in opened:
                refusal = _refused_state(cls, session, exc)
                if refusal is not None:
                    raise refusal from exc
            raise
        finally:
            current_from_pending.reset(claiming)

    @functools.wraps(resume_async)
    async def resume_async_claiming(self: Flow[Any], feedback: str = "") -> Any:
        persistence = self.persistence
        if isinstance(persistence, RemitFlowPersistence) and self.pending_feedback is not None:
            persistence._ready_to_resume(self, feedback)
        return await resume_async(self, feedback)

    run_listeners = engine._execute_listeners

    @functools.wraps(run_listeners)
    def execute_listeners(
        self: Flow[Any], trigger: FlowMethodName, result: Any, *args: Any, **kwargs: Any
    ) -> Coroutine[Any, Any, None]:
        # A plain function that hands CrewAI its own coroutine when there is nothing to
        # run beside it: a loop through a start nests a call of this per round, and a
        # frame of its own on each would halve the rounds Python's recursion limit allows.
        persistence = self.persistence
        leftovers = (
            persistence._take_leftovers(self)
            if isinstance(persistence, RemitFlowPersistence)
            else None
        )
        listeners = run_listeners(self, trigger, result, *args, **kwargs)
        if leftovers is None:
            return listeners
        return _beside(self, listeners, *leftovers)

    engine.from_pending = classmethod(from_pending_releasing)  # type: ignore[assignment]
    engine.resume_async = resume_async_claiming  # type: ignore[assignment]
    engine._execute_listeners = execute_listeners  # type: ignore[assignment,method-assign]


def _with_class_persistence(
    cls: type[Flow[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`from_pending`'s arguments, with the class's own `@persist` backend when it is a
    `RemitFlowPersistence` and none was given: CrewAI would look in its default backend,
    which never holds a pause such a class saved (a bare `ValueError`, "no pending
    feedback"). Any other call is left as it is."""
    given = args[1] if len(args) > 1 else kwargs.get("persistence")
    if given is not None or kwargs.get("definition") is not None:
        return args, kwargs
    config = getattr(cls, "__flow_persistence_config__", None)
    own = getattr(config, "persistence", None)
    if not isinstance(own, RemitFlowPersistence):
        return args, kwargs
    return args[:1], {**kwargs, "persistence": own}


def _check_paused_method(flow: Flow[Any]) -> None:
    """`VersionMismatch` naming the method the flow paused at if `flow`'s class has no
    such method (renamed or removed since the pause): CrewAI would fail its resume with
    a bare `KeyError` after taking the feedback. Raised in `from_pending`, whose claim is
    given back: the pause stays pending for the class it paused under."""
    context = flow.pending_feedback
    if context is None or context.method_name in flow._definition.methods:
        return
    raise VersionMismatch(
        f"flow {flow.flow_id!r} paused at method {context.method_name!r}, which "
        f"{type(flow).__name__} does not define (renamed or removed since the pause?): "
        "nothing was resumed, and the flow still waits for that feedback; resume it "
        "with a flow class that has the method",
        run_id=locate(flow.flow_id)[0],
    )


def _as_paused(flow: Flow[Any], session: Session) -> None:
    """Give the dict state of `flow`, loaded by `from_pending`, the keys it paused with
    and those its class's `initial_state` added since (`_added_since`), no others: CrewAI
    loads the paused state over a new flow's initial state, which would bring back a
    key a step deleted before the pause, with its default (P1: the resume continues
    the state the pause saved)."""
    state = flow.state
    if session.head is None or not isinstance(state, dict):
        return
    if not isinstance(flow.initial_state, dict):
        return  # (a dict state its class does not give, as a declared flow's, is CrewAI's)
    added = _added_since(flow, session.state, session.initial_keys)
    kept = {**added, **session.state, "id": flow.flow_id}
    state.clear()
    state.update(kept)


async def _beside(
    flow: Flow[Any],
    listeners: Coroutine[Any, Any, None],
    unfinished: frozenset[str],
    late: frozenset[str],
) -> None:
    """Run `listeners`, the resume's first, beside what was in flight when the flow
    paused (`Session.leftovers`): methods that did not complete run again, and the
    listeners of those that completed after the pause was saved run."""
    await asyncio.gather(
        listeners,
        *(_run_again(flow, FlowMethodName(m)) for m in sorted(unfinished)),
        *(flow._execute_listeners(FlowMethodName(m), None) for m in sorted(late)),
    )


async def _run_again(flow: Flow[Any], method: FlowMethodName) -> None:
    """Run `method`, in flight when the flow paused, and what follows it (a router's
    route too, which CrewAI follows only for routers it runs itself)."""
    if method in flow._start_method_names():
        await flow._execute_start_method(method)
        return
    result, _ = await flow._execute_single_listener(method, None)
    if flow._is_router(method) and result is not None:
        route = result.value if isinstance(result, enum.Enum) else result
        await _take(flow, FlowMethodName(str(route)))
