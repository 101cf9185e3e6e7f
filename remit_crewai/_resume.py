"""A resume that fails before its feedback is consumed gives the flow back whole.

`from_pending` claims the paused flow in `load_pending_feedback`, then CrewAI
builds the flow and loads the state into it; if that fails (the state does not
fit the flow's model, a bad constructor argument), no hook runs and nothing
else would release the claim: a correct retry would get `ResumeConflict` until
the lease ran out. And a resume that failed before its feedback was consumed
(the feedback could not be classified into an `emit=` outcome) has given its
claim back at EXECUTION_END, while CrewAI lets the same instance `resume` again:
that retry must claim the flow again and consume the pause, not run past it.
The wrappers `install` puts on `from_pending` and `resume_async` do both, and
refuse feedback that is not a str by name before anything runs; other flows
run CrewAI's code unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from crewai.flow import runtime
from crewai.flow.flow import Flow

from remit_crewai._session import current_resumers
from remit_crewai.persistence import RemitFlowPersistence


def install() -> None:
    """Wrap CrewAI's `from_pending` and `resume_async` (once per process, from `_hooks.install`)."""
    engine = runtime.Flow
    from_pending = engine.__dict__["from_pending"].__func__
    resume_async = engine.resume_async

    @functools.wraps(from_pending)
    def from_pending_releasing(cls: type[Flow[Any]], *args: Any, **kwargs: Any) -> Flow[Any]:
        before = current_resumers.get()
        try:
            return from_pending(cls, *args, **kwargs)  # type: ignore[no-any-return]
        except BaseException:
            for session in current_resumers.get():
                if session not in before and not session.closed:
                    RemitFlowPersistence._release(session)
            raise

    @functools.wraps(resume_async)
    async def resume_async_claiming(self: Flow[Any], feedback: str = "") -> Any:
        persistence = self.persistence
        if isinstance(persistence, RemitFlowPersistence) and self.pending_feedback is not None:
            persistence._ready_to_resume(self, feedback)
        return await resume_async(self, feedback)

    engine.from_pending = classmethod(from_pending_releasing)  # type: ignore[assignment]
    engine.resume_async = resume_async_claiming  # type: ignore[assignment]
