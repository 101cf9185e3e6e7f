"""A restarted flow replays its past occurrence by occurrence, routes included.

CrewAI restarts a flow by running its graph again from the start methods,
skipping every method in `_completed_methods`. That alone goes wrong twice.
A skipped router has no outcome (CrewAI takes None), so no route fires and
nothing behind the router ever runs: the flow is stuck for good. And in a
loop, a method that completed once is skipped at every later meeting too, so
the occurrence that was in flight never runs again. The ledger records how
often each method completed and the route each router took each time; for
a Remit-backed flow being restarted, the wrappers `install` puts on CrewAI's
two method runners let `Replay` decide each meeting: replayed (a router
fires the route it took at that occurrence) or run for real. A replayed
router hands its route back to CrewAI's caller as if it had returned it, so
the route is followed where CrewAI follows it: after the plain listeners of
the router's own trigger, as in the run being recovered (P6). CrewAI has no
hook there; other flows, and flows not being restarted, run CrewAI's code
unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Coroutine
from typing import Any

from crewai.flow import runtime
from crewai.flow.flow import Flow
from crewai.flow.types import FlowMethodName

from remit_crewai.persistence import RemitFlowPersistence


def install() -> None:
    """Wrap CrewAI's method runners (once per process, from `_hooks.install`)."""
    engine = runtime.Flow  # the engine's methods live here; the public `Flow` derives from it
    run_listener = engine._execute_single_listener
    run_start = engine._execute_start_method

    @functools.wraps(run_listener)
    async def execute_single_listener(
        self: Flow[Any],
        listener_name: FlowMethodName,
        result: Any,
        triggering_event_id: str | None = None,
    ) -> tuple[Any, str | None]:
        meeting = _meet(self, listener_name)
        if meeting is not None:
            replayed, route = meeting
            if not replayed:
                self._completed_methods.discard(listener_name)  # its next occurrence runs
            elif self._is_router(listener_name):
                # Its own listeners now; its route is its caller's to follow (below).
                await self._execute_listeners(listener_name, None)
                return route, None
        return await run_listener(self, listener_name, result, triggering_event_id)

    @functools.wraps(run_start)
    def execute_start_method(
        self: Flow[Any], start_method_name: FlowMethodName
    ) -> Coroutine[Any, Any, None]:
        # A plain function that hands CrewAI a coroutine: a loop through a start (a route
        # back to it) nests one call of this per round, and a frame of its own on each
        # would let a flow loop only half the rounds Python's recursion limit lets it.
        # CrewAI clears its resuming flag to run a start that a route loops back to; a
        # restart walks on through it as through the rest of its past.
        meeting = _meet(self, start_method_name, restarting=True)
        if meeting is None:
            return run_start(self, start_method_name)
        replayed, route = meeting
        if not replayed:
            self._completed_methods.discard(start_method_name)
        resuming = self._is_execution_resuming
        self._is_execution_resuming = True  # (a replayed start goes on with its listeners)
        started = run_start(self, start_method_name)
        if route is None:
            # (Every caller that runs a start with the flag clear sets it back itself.)
            return started
        return _then_route(self, started, route, resuming)

    engine._execute_single_listener = execute_single_listener  # type: ignore[assignment]
    engine._execute_start_method = execute_start_method  # type: ignore[assignment]


def _meet(
    flow: Flow[Any], method: FlowMethodName, *, restarting: bool = False
) -> tuple[bool, FlowMethodName | None] | None:
    """How a restart meets completed `method`: (replayed, route) or None (CrewAI decides).
    `restarting`: ask even while CrewAI's resuming flag is clear (see the start wrapper)."""
    persistence = flow.persistence
    if not (
        isinstance(persistence, RemitFlowPersistence)
        and (restarting or flow._is_execution_resuming)
        and method in flow._completed_methods
    ):
        return None
    meeting = persistence._meet(flow, str(method))
    if meeting is None:
        return None
    replayed, route = meeting
    return replayed, None if route is None else FlowMethodName(route)


async def _then_route(
    flow: Flow[Any], started: Coroutine[Any, Any, None], route: FlowMethodName, resuming: bool
) -> None:
    """Run replayed router start `started`, then follow the route it took at that
    occurrence (`_take`), CrewAI's resuming flag set back as it was between the two."""
    try:
        await started
    finally:
        flow._is_execution_resuming = resuming
    await _take(flow, route)


async def _take(flow: Flow[Any], route: FlowMethodName) -> None:
    """Run what listens to `route`, with the input CrewAI gives a route's listeners.

    As CrewAI does for a route a router emits, `or_` listeners that already fired
    and wait for `route` are re-armed first, so a replayed loop goes round again.
    """
    flow._rearm_or_listeners_for_trigger(route)
    feedback = flow.last_human_feedback
    await flow._execute_listeners(route, feedback if feedback is not None else route)
