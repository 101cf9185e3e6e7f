"""Round 45 of the CrewAI probes: conversational flows (`conversational = True`) further,
as a server's workers would drive them: `handle_turn(message, session_id=S)` on a new
flow instance per turn, in processes of their own.

Probed: turns of one conversation raced by several processes; a turn whose reply CrewAI
saves after the turn's run ended (`_record_kickoff_output`: a handler that only returns
its reply) while another process takes the next turn; a plain `kickoff(inputs={"id": S})`
(no message) of a conversation whose last turn was SIGKILLed in its handler; a new turn
while a `@human_feedback` pause of an earlier turn waits for its answer.

Found: (1) CrewAI saves such a reply after EXECUTION_END, where Remit gave the claim up:
another process could take the conversation and run its turn meanwhile, and the late
reply save then wrote the older turn's state over it, that turn's message and reply
lost from the history (lost data; the save also counted the replying method as
completed a second time). Now the turn keeps its claim until its kickoff returns, and
that save completes nothing. (2) A plain restart replayed the conversation's first
turn, not its last: the handler in flight when its process died never ran again, and
the restart returned the route's label (P1: the head's frontier skipped). Now the
ledger records where the current turn began, and a restart continues that turn.
Written from the contract and CrewAI's public API, against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, child, entered, point, run

from remit_core.conformance.processes import Barrier, fork
from remit_core.conformance.world import EffectSink, Journal, WorldDB

TRIES = 3000  # (a bound on the attempts refused while a dead claim's lease runs out)
#: What CrewAI's built-in `converse` route replies without an LLM.
NO_LLM = "I can continue the conversation once an LLM is configured."


def shop_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """A conversational flow: "order" goes to `take_order`, which pays (effect "charge")
    and returns the receipt, which CrewAI saves as the reply after the turn's run ended;
    "refund" asks a reviewer (`@human_feedback`, pauses), then `give_refund`; any other
    message goes to CrewAI's built-in `converse`. A one-second lease. Built in a child.
    Crash points: `take_order.paid`, and `reply` (as CrewAI appends a returned reply:
    `ready:<file>` creates the file, then waits for `<file>.go`)."""
    from crewai.flow.conversational import ConversationState
    from crewai.flow.flow import Flow, listen
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, at = Journal(WorldDB(world)), points or {}
    charge = sink_effect(EffectSink(WorldDB(world)), "charge")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class Shop(Flow[ConversationState]):  # type: ignore[misc]
        _skip_auto_memory = True
        conversational = True

        def route_turn(self, context: dict[str, Any]) -> str | None:
            said = self.state.current_user_message or ""
            return next((r for r in ("order", "refund") if r in said), None)

        @listen("order")
        def take_order(self) -> str:
            journal.record("enter", "take_order")
            receipt = str(charge())
            point(at, "take_order.paid")
            return receipt

        @listen("refund")
        @human_feedback(message="Refund this order?", provider=Later())
        def review_refund(self) -> str:
            journal.record("enter", "review_refund")
            return "refund request"

        @listen(review_refund)
        def give_refund(self) -> str:
            journal.record("enter", "give_refund")
            return f"refunded by {self.last_human_feedback.feedback}"

        def append_assistant_message(self, content: Any) -> None:
            ready = at.get("reply", "")
            if ready.startswith("ready:"):
                Path(ready[6:]).touch()
                point({"reply": f"wait:{ready[6:]}.go"}, "reply")
            super().append_assistant_message(content)

    return Shop


def said(flow: Any) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in flow.state.messages]


def turn(url: str, world: Path, session: str, message: str, **points: str) -> dict[str, Any]:
    """`handle_turn(message, session_id=session)` on a new instance: reply, conversation."""
    flow = shop_flow(url, world, points=points)(suppress_flow_events=True)
    reply = flow.handle_turn(message, session_id=session)
    return {"reply": reply if isinstance(reply, str) else type(reply).__name__, "said": said(flow)}


def until_free(attempt: Any) -> Any:
    """`attempt()` again while another process holds the claim (a killed one's until it
    lapses)."""
    from remit_core import ResumeConflict

    for _ in range(TRIES):
        try:
            return attempt()
        except ResumeConflict:
            continue
    raise AssertionError("the claim was never free")


def history(url: str, session: str) -> list[list[str]]:
    """The conversation as a new persistence reads it."""
    from remit_crewai import RemitFlowPersistence

    state = RemitFlowPersistence(url).load_state(session)
    assert state is not None
    return [[m["role"], m["content"]] for m in state["messages"]]


def test_a_turn_keeps_its_claim_until_crewai_saved_its_reply(
    url: str, world: Path, tmp_path: Path
) -> None:
    """No message lost: a turn whose handler returns its reply (CrewAI appends and saves it
    after the turn's run ended) holds the conversation until that save. Another process's
    turn meanwhile gets `ResumeConflict` and changes nothing; sent again afterwards, it
    runs, and the history holds both turns, each message once, each with its reply."""
    session, ready = f"chat-{uuid.uuid4().hex}", tmp_path / "reply"
    first = child(lambda: turn(url, world, session, "order one", reply=f"ready:{ready}"))
    try:
        while not ready.exists():  # (its handler paid; CrewAI is about to save the reply)
            assert first.poll() is None, first.outcome
            time.sleep(0.02)
        meanwhile = run(lambda: turn(url, world, session, "hi"))
    finally:
        Path(f"{ready}.go").touch()
    assert meanwhile.raised("ResumeConflict"), meanwhile.summary()
    done = first.wait(timeout=120)
    assert done.ok, done.summary()
    receipt = done.value["reply"]
    assert receipt.startswith("charge:"), done.summary()
    again = run(lambda: turn(url, world, session, "hi"))
    assert again.ok, again.summary()
    expected = [
        ["user", "order one"],
        ["assistant", receipt],
        ["user", "hi"],
        ["assistant", NO_LLM],
    ]
    assert run(lambda: history(url, session)).value == expected
    assert applied(world) == {"charge": 1}


@pytest.mark.parametrize("url", ["sqlite"], indirect=True)
def test_a_plain_restart_continues_the_turn_that_crashed(url: str, world: Path) -> None:
    """P1, P2: the second turn is SIGKILLed in `take_order` after it paid. A kickoff of the
    conversation's id without a message continues that turn (not the first): the handler
    runs again at the occurrence that was in flight, its payment reconciled, not made
    again, and the kickoff returns its receipt. Another such kickoff runs nothing."""
    session = f"chat-{uuid.uuid4().hex}"
    assert run(lambda: turn(url, world, session, "hi")).ok
    died = run(lambda: turn(url, world, session, "order one", **{"take_order.paid": "kill"}))
    assert died.status == "killed", died.summary()

    def restart() -> Any:
        flow_class = shop_flow(url, world)
        return str(until_free(lambda: flow_class().kickoff(inputs={"id": session})))

    restarted = run(restart)
    assert restarted.ok, restarted.summary()
    assert restarted.value.startswith("charge:"), restarted.summary()
    assert entered(world) == {"take_order": 2}
    assert applied(world) == {"charge": 1}
    assert EffectSink(WorldDB(world)).repeats() == {}
    assert run(restart).value == restarted.value
    assert entered(world) == {"take_order": 2}


def test_racing_turns_of_one_conversation_run_one_at_a_time(url: str, world: Path) -> None:
    """k processes send a turn of one conversation at once: each either runs its turn or
    gets `ResumeConflict` having stored nothing; sent again until each ran, every
    message is in the history once, followed by its own reply, and each order paid once."""
    k = 4
    session = f"chat-{uuid.uuid4().hex}"
    assert run(lambda: turn(url, world, session, "hi")).ok
    barrier = Barrier(k)

    def sender(i: int) -> Any:
        def body() -> Any:
            flow_class = shop_flow(url, world)
            barrier.wait()
            return until_free(lambda: flow_class().handle_turn(f"order {i}", session_id=session))

        return body

    workers = [fork(sender(i), barrier=barrier) for i in range(k)]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    assert all(o.ok for o in outcomes), [o.summary() for o in outcomes]
    pairs = run(lambda: history(url, session)).value[2:]
    turns = [(pairs[n][1], pairs[n + 1][1]) for n in range(0, len(pairs), 2)]
    assert sorted(turns) == sorted((f"order {i}", o.value) for i, o in enumerate(outcomes))
    assert [role for role, _ in pairs] == ["user", "assistant"] * k
    assert applied(world) == {"charge": k}
    assert entered(world) == {"take_order": k}


@pytest.mark.parametrize("url", ["sqlite"], indirect=True)
def test_a_new_turn_leaves_a_pending_question_to_its_one_answer(url: str, world: Path) -> None:
    """P5: a turn pauses at its `@human_feedback` question; the next turn is answered while
    the question waits (it neither answers nor drops it). The question is then answered
    once, on the conversation as it is now (the later turn kept); a second answer is
    refused; and a plain restart afterwards asks nothing again."""
    session = f"chat-{uuid.uuid4().hex}"
    paused = run(lambda: turn(url, world, session, "refund please"))
    assert paused.ok and paused.value["reply"] == "HumanFeedbackPending", paused.summary()
    ordered = run(lambda: turn(url, world, session, "order one"))
    assert ordered.ok and ordered.value["reply"].startswith("charge:"), ordered.summary()

    def answer(who: str) -> Any:
        flow_class = shop_flow(url, world)
        flow = flow_class.from_pending(session, flow_class.__flow_persistence_config__.persistence)
        return {"out": flow.resume(who), "said": said(flow)}

    answered = run(lambda: answer("alice"))
    assert answered.ok, answered.summary()
    assert answered.value == {"out": "refunded by alice", "said": ordered.value["said"]}
    assert run(lambda: answer("bob")).raised("ResumeConflict")

    def restart() -> Any:
        return str(shop_flow(url, world)().kickoff(inputs={"id": session}))

    assert run(restart).ok
    assert entered(world) == {"review_refund": 1, "take_order": 1, "give_refund": 1}
