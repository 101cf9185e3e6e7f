"""Parts the CrewAI flow tests build their flows from."""

from __future__ import annotations

from typing import Any

from remit_core.conformance.world import EffectSink
from remit_core.effects import effect
from remit_crewai import RemitFlowPersistence


class Later:
    """A feedback provider that answers later: the flow pauses (CrewAI saves it and
    raises `HumanFeedbackPending`), to be resumed with the feedback."""

    def request_feedback(self, context: Any, flow: Any) -> str:
        from crewai.flow.async_feedback.types import HumanFeedbackPending

        raise HumanFeedbackPending(context=context)


def sink_effect(sink: EffectSink, kind: str) -> Any:
    """An effect named `kind` that applies `kind` to `sink` once per idempotency key."""

    def apply(*, idempotency_key: str) -> str:
        return sink.apply(kind, idempotency_key)

    return effect(apply, name=kind, reconcile=sink.reconcile)


def stored_flow(url: str, flow_id: str) -> dict[str, Any]:
    """What a new persistence reads of flow `flow_id`: its state and its checkpoints'
    kinds, newest first."""
    store = RemitFlowPersistence(url)
    return {
        "state": store.load_state(flow_id),
        "kinds": [c.kind for c in store.checkpoints(flow_id)],
    }
