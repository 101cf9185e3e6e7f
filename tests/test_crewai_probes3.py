"""A resume that fails gives the paused flow back whole: CrewAI flows on every engine.

Probes written from the contract (P5: a resume value is consumed once; a failed
resume consumes nothing and holds nothing) against real CrewAI flows in forked
children, with the fixtures and flows of `test_crewai_flows`.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_crewai_flows import (
    applied,
    child,
    entered,
    feedback_route_flow,
    kickoff,
    paused_review,
    resume,
    review_flow,
    run,
)

from remit_core.conformance.processes import Worker
from remit_crewai import RemitFlowPersistence, fork_token

ENGINES = ["sqlite", "postgresql", "redis"]
#: Where CrewAI looks for an LLM to classify feedback; unset, classifying fails at once.
LLM_SETTINGS = ("OPENAI_API_KEY", "MODEL", "MODEL_NAME", "OPENAI_MODEL_NAME")


def statuses(url: str, flow_id: str) -> list[str]:
    return [i.status for i in RemitFlowPersistence(url).remit.interrupts(flow_id)]


def wait_for(path: Path, worker: Worker) -> None:
    """Until `worker` creates `path` (or ends, which its outcome then shows)."""
    while not path.exists() and worker.poll() is None:
        time.sleep(0.02)


def error_names(exc: BaseException) -> list[str]:
    """The class names of `exc` and the errors it came from (a chain may loop)."""
    names: list[str] = []
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        names.append(type(cause).__name__)
        cause = cause.__cause__ or cause.__context__
    return names


def test_a_from_pending_that_fails_after_loading_gives_the_flow_back(url: str, world: Path) -> None:
    """The flow's model changed since the pause, so `from_pending` fails after it claimed
    the flow: the claim is given back (in this process and the store), the pause stays
    pending, and a resume with the right flow proceeds at once, not after the lease."""
    flow_id = paused_review(url, world)

    def changed_model_then(value: str | None) -> dict[str, Any]:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        flow_class = review_flow(url, world)
        persistence = flow_class.__flow_persistence_config__.persistence

        class Review(BaseModel):
            approved_by: int = 0  # was `str | None`: the stored None no longer fits

        @persist(persistence)
        class Changed(Flow[Review]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                pass

        try:
            Changed.from_pending(flow_id, persistence)
            refused: list[str] = []
        except Exception as exc:
            refused = error_names(exc)
        resumed = None if value is None else resume(flow_class, flow_id, value)
        return {"refused": refused, "resumed": resumed}

    first = run(lambda: changed_model_then(None))
    assert first.ok and first.value["refused"], first.summary()
    assert run(lambda: statuses(url, flow_id)).value == ["pending"]
    again = run(lambda: changed_model_then("ann"))  # fails again, then the right flow
    assert again.ok, again.summary()
    assert again.value["refused"] and again.value["resumed"]["approved_by"] == "ann"
    assert run(lambda: statuses(url, flow_id)).value == ["consumed"]
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


@pytest.mark.parametrize("rival", [False, True])
def test_a_resume_retried_on_its_instance_consumes_the_pause_once(
    url: str, world: Path, tmp_path: Path, rival: bool
) -> None:
    """CrewAI lets a resume that failed before its feedback was taken (free text that no
    LLM could classify into an `emit=` outcome) be retried on the same instance. The
    failure gave the claim back, so the retry claims the flow again: it consumes the
    pause once, or, if another process resumed in between, gets `ResumeConflict` and
    runs nothing. Either way the routed steps run once and nothing is applied twice."""
    started = run(lambda: kickoff(feedback_route_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    failed, go = tmp_path / "failed", tmp_path / "go"

    def body() -> dict[str, Any]:
        for name in LLM_SETTINGS:
            os.environ.pop(name, None)
        flow_class = feedback_route_flow(url, world)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        try:
            flow.resume("ship it, please")
            first: list[str] = []
        except Exception as exc:
            first = error_names(exc)
        failed.touch()
        while not go.exists():
            time.sleep(0.02)
        try:
            flow.resume("")  # the default outcome: "approved"
            return {"first": first, "retried": flow.state.log}
        except Exception as exc:
            return {"first": first, "retried": error_names(exc)}

    worker = child(body)
    wait_for(failed, worker)
    if rival:
        other = run(lambda: resume(feedback_route_flow(url, world), flow_id, ""))
        assert other.ok and other.value["log"] == ["ship", "notify"], other.summary()
    go.touch()
    out = worker.wait(timeout=120)
    assert out.ok, out.summary()
    assert out.value["first"][0] == "HumanFeedbackCollapseError", out.value
    if rival:
        assert out.value["retried"][0] == "ResumeConflict", out.value
    else:
        assert out.value["retried"] == ["ship", "notify"]
        late = run(lambda: resume(feedback_route_flow(url, world), flow_id, ""))
        assert late.raised("ResumeConflict") and "already given" in late.error_text()
    assert run(lambda: statuses(url, flow_id)).value == ["consumed"]
    assert entered(world) == {"prepare": 1, "review": 1, "ship": 1, "notify": 1}
    assert applied(world) == {"notify": 1}


def test_feedback_that_is_not_a_str_is_refused_naming_it(url: str, world: Path) -> None:
    """`resume(123)`: a `TypeError` naming the feedback, before anything runs; the claim
    is given back and the pause stays pending, so a resume with a str proceeds at once."""
    flow_id = paused_review(url, world)
    refused = run(lambda: resume(review_flow(url, world), flow_id, 123))
    assert refused.raised("TypeError"), refused.summary()
    assert "feedback must be a str, got int" in refused.error_text()
    assert run(lambda: statuses(url, flow_id)).value == ["pending"]
    done = run(lambda: resume(review_flow(url, world), flow_id, "ann"))
    assert done.ok and done.value["approved_by"] == "ann", done.summary()
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}


def test_a_fork_token_or_an_edit_of_the_wrong_type_is_refused_naming_it(url: str) -> None:
    """A fork token that is not a str is refused where it is given; edit changes that are
    not a mapping are refused as such (a str is not read as its letters); nothing is written."""
    with pytest.raises(TypeError, match="fork token must be a str, got int"):
        with fork_token(7):  # type: ignore[arg-type]
            pass
    persistence = RemitFlowPersistence(url)
    flow_id = f"edit-{uuid.uuid4().hex}"
    with pytest.raises(TypeError, match="changes must be a mapping of field to value, got str"):
        persistence.edit_state(flow_id, "amount")  # type: ignore[arg-type]
    assert persistence.load_state(flow_id) is None
