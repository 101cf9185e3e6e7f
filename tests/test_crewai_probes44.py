"""Round 44 of the CrewAI probes: conversational flows (`conversational = True`), whose
every `handle_turn(message, session_id=S)` is a kickoff of flow S that CrewAI runs as a
new execution of the flow's graph on S's saved state (it clears what the last turn ran).

Probed: a conversation persisted by Remit, each turn answered by a new flow instance in
its own process (a server's workers), a turn routed to a handler that pays; a turn
SIGKILLed in that handler after its payment, then sent again; and CrewAI's `chat()` loop,
which runs every turn on one instance. Found: before, Remit took a
turn for a restart of the finished flow and replayed the first turn's route: every turn
after the first ran nothing and returned the first turn's reply; the handler never ran,
and the turn's message was lost (the next turn's state had neither it nor a reply), a
silent wrong answer (P1 replays only what the head holds, it never stands in for new
input). After: a turn runs the graph again, and each method's occurrences, the keys of
its effects, go on from the ledger's: a turn sent again after a crash runs the handler
at the occurrence that was in flight, so its payment is reconciled, not made twice (P2).
Written from the contract and CrewAI's public API, against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from crewai_parts import sink_effect
from test_crewai_flows import applied, entered, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB

TRIES = 3000  # (a bound on the turns refused while a dead claim's lease runs out)
#: What CrewAI's built-in `converse` route replies without an LLM.
NO_LLM = "I can continue the conversation once an LLM is configured."


def chat_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """A conversational flow: a message that asks to order goes to `take_order`, which
    pays (effect "charge") and returns the receipt as its reply; any other message goes
    to CrewAI's built-in `converse`. A one-second lease. Built in a child."""
    from crewai.flow.conversational import ConversationState
    from crewai.flow.flow import Flow, listen
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, at = Journal(WorldDB(world)), points or {}
    charge = sink_effect(EffectSink(WorldDB(world)), "charge")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class Shop(Flow[ConversationState]):  # type: ignore[misc]
        _skip_auto_memory = True
        conversational = True

        def route_turn(self, context: dict[str, Any]) -> str | None:
            return "order" if "order" in (self.state.current_user_message or "") else None

        @listen("order")
        def take_order(self) -> str:
            journal.record("enter", "take_order")
            receipt = str(charge())
            point(at, "take_order.paid")
            return receipt

    return Shop


def turn(url: str, world: Path, session: str, message: str, **points: str) -> Any:
    """`handle_turn(message, session_id=session)` on a new flow instance in a child, again
    while the claim of a killed turn is still alive; its reply and the conversation."""

    def go() -> dict[str, Any]:
        from remit_core import ResumeConflict

        for _ in range(TRIES):
            flow = chat_flow(url, world, points=points)(suppress_flow_events=True)
            try:
                reply = flow.handle_turn(message, session_id=session)
            except ResumeConflict:
                continue
            said = [(m.role, m.content) for m in flow.state.messages]
            return {"reply": reply, "messages": said}
        raise AssertionError("the killed turn's claim never lapsed")

    return run(go)


def test_each_turn_of_a_conversation_runs_and_keeps_its_messages(url: str, world: Path) -> None:
    """P1, P2: three turns of one conversation, each on a new instance in its own process.
    Each turn is answered by its own route: the second and third run `take_order`, each
    paying once under a key of its own, and the history holds every message and reply."""
    session = f"chat-{uuid.uuid4().hex}"
    first = turn(url, world, session, "hi")
    assert first.ok and first.value["reply"] == NO_LLM, first.summary()

    second = turn(url, world, session, "order one")
    assert second.ok, second.summary()
    assert second.value["reply"].startswith("charge:"), second.summary()

    third = turn(url, world, session, "order two")
    assert third.ok, third.summary()
    assert third.value["reply"].startswith("charge:"), third.summary()
    assert third.value["reply"] != second.value["reply"]  # a payment of its own
    assert third.value["messages"] == [
        ["user", "hi"],
        ["assistant", NO_LLM],
        ["user", "order one"],
        ["assistant", second.value["reply"]],
        ["user", "order two"],
        ["assistant", third.value["reply"]],
    ]
    assert entered(world) == {"take_order": 2}
    assert applied(world) == {"charge": 2}


def test_a_turn_killed_after_its_payment_and_sent_again_pays_once(url: str, world: Path) -> None:
    """P2, P1: the second turn is SIGKILLed in `take_order` after its payment. The same
    message sent again (a new process, once the dead turn's lease ran out) runs the
    handler again, at the occurrence that was in flight: the payment is reconciled, not
    made again, and the reply is its receipt. A next order pays once more."""
    session = f"chat-{uuid.uuid4().hex}"
    assert turn(url, world, session, "hi").ok
    died = turn(url, world, session, "order one", **{"take_order.paid": "kill"})
    assert died.status == "killed", died.summary()
    assert applied(world) == {"charge": 1}

    again = turn(url, world, session, "order one")
    assert again.ok, again.summary()
    assert entered(world) == {"take_order": 2}
    assert applied(world) == {"charge": 1}
    assert EffectSink(WorldDB(world)).repeats() == {}  # reconciled, never sent twice
    receipts = [text for role, text in again.value["messages"] if text.startswith("charge:")]
    assert receipts == [again.value["reply"]], again.summary()

    more = turn(url, world, session, "order two")
    assert more.ok and more.value["reply"] != again.value["reply"], more.summary()
    assert applied(world) == {"charge": 2}


def test_chat_on_one_instance_answers_every_turn(tmp_path: Path, world: Path) -> None:
    """P1: CrewAI's `chat()` loop runs every turn on one instance (SQLite only: the engine
    does not matter here). Each order is taken and paid once; no turn replays another."""
    url = f"sqlite:///{tmp_path}/chat.db"

    def go() -> list[tuple[str, str]]:
        flow = chat_flow(url, world)(suppress_flow_events=True)
        said = iter(["hi", "order one", "order two", "exit"])
        flow.chat(input_fn=lambda _prompt: next(said), output_fn=lambda _reply: None)
        return [(m.role, m.content) for m in flow.state.messages]

    done = run(go)
    assert done.ok, done.summary()
    replies = [text for role, text in done.value if role == "assistant"]
    assert [text for role, text in done.value if role == "user"] == ["hi", "order one", "order two"]
    assert replies[0] == NO_LLM and len(replies) == 3
    assert all(r.startswith("charge:") for r in replies[1:]) and replies[1] != replies[2]
    assert applied(world) == {"charge": 2}
