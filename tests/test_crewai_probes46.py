"""Round 46 of the CrewAI probes: conversational flows (`conversational = True`) again: a
later turn that reaches a `@human_feedback` method whose earlier question still waits,
and forks of a conversation (`store.fork`, and CrewAI's own `restore_from_state_id`
passed to `handle_turn` and `chat` inside `fork_token`).

Found: (1) a later turn's run of a feedback method whose question still waited ran at
the waiting occurrence, with its effect keys: its effects returned the earlier turn's
recorded outcomes, never applied (the reviewer was never mailed about the second
question, and was asked it with the first one's receipt). Now a pause of a
conversational flow is counted in the ledger (`Ledger.asked`), and a turn that runs a
waiting occurrence again keys its effects by that count as the turn began: its own,
the same when the turn is continued or sent again after a crash. (2)
`handle_turn(message, restore_from_state_id=S)` (CrewAI's fork) inside `fork_token` was
refused with `ForkWithoutIntent` asking for no `inputs['id']`, which `handle_turn`
always passes (the instance's own id when no `session_id` is given), and `chat()`'s next
turn on the forked instance was refused again. Now such a turn forks S as a kickoff
without an id does, and the next turn continues the token's fork; a `session_id`
naming another flow is still refused, and the message says so.
Written from the contract and CrewAI's public API, against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, entered, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB

TRIES = 3000  # (a bound on the attempts refused while a dead claim's lease runs out)
#: What CrewAI's built-in `converse` route replies without an LLM.
NO_LLM = "I can continue the conversation once an LLM is configured."


def desk_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """A conversational help desk: "buy ..." goes to `take_order`, which pays (effect
    "charge") and returns the receipt; "refund ..." goes to `review_refund`, which mails the
    reviewer (effect "mail") and asks (`@human_feedback`, pauses), then `give_refund`
    pays back (effect "refund"); any other message goes to CrewAI's `converse`."""
    from crewai.flow.conversational import ConversationState
    from crewai.flow.flow import Flow, listen
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, at = Journal(WorldDB(world)), points or {}
    sink = EffectSink(WorldDB(world))
    charge, mail, refund = (sink_effect(sink, k) for k in ("charge", "mail", "refund"))

    @persist(RemitFlowPersistence(url, lease=1.0))
    class Desk(Flow[ConversationState]):  # type: ignore[misc]
        _skip_auto_memory = True
        conversational = True

        def route_turn(self, context: dict[str, Any]) -> str | None:
            said = self.state.current_user_message or ""
            if said.startswith("buy"):
                return "order"
            return "refund" if said.startswith("refund") else None

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
            mailed = str(mail())
            point(at, "review_refund.mailed")
            return f"{self.state.current_user_message} ({mailed})"

        @listen(review_refund)
        def give_refund(self) -> str:
            journal.record("enter", "give_refund")
            return f"refunded by {self.last_human_feedback.feedback}: {refund()}"

    return Desk


def said(flow: Any) -> list[list[str]]:
    return [[m.role, m.content] for m in flow.state.messages]


def turn(url: str, world: Path, session: str, message: str, **points: str) -> dict[str, Any]:
    """`handle_turn(message, session_id=session)` on a new instance: reply, conversation."""
    flow = desk_flow(url, world, points=points)(suppress_flow_events=True)
    reply = flow.handle_turn(message, session_id=session)
    return {"reply": reply if isinstance(reply, str) else type(reply).__name__, "said": said(flow)}


def answer(url: str, world: Path, session: str, who: str) -> dict[str, Any]:
    flow_class = desk_flow(url, world)
    flow = flow_class.from_pending(session, flow_class.__flow_persistence_config__.persistence)
    out = flow.resume(who)
    return {"out": out, "said": said(flow), "asked": flow.pending_feedback is not None}


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
    from remit_crewai import RemitFlowPersistence

    state = RemitFlowPersistence(url).load_state(session)
    assert state is not None
    return [[m["role"], m["content"]] for m in state["messages"]]


def pending_context(url: str, session: str) -> str:
    """What the reviewer is asked now: the waiting pause's method output."""
    from remit_crewai import RemitFlowPersistence

    loaded = RemitFlowPersistence(url).load_pending_feedback(session)
    assert loaded is not None
    return str(loaded[1].method_output)


def test_a_later_turn_that_asks_again_mails_the_reviewer_for_its_own_question(
    url: str, world: Path
) -> None:
    """P2: a turn pauses at `review_refund` (the reviewer is mailed, effect "mail"); the
    next turn asks for another refund while that question waits. Its run of the method is
    a question of its own: the reviewer is mailed again (the mail does not return the
    first turn's receipt), and the question waiting is the second one, with its own mail,
    as CrewAI's own backend keeps the newest pause. A plain restart of the paused
    conversation pauses again without mailing; the one answer refunds once."""
    session = f"desk-{uuid.uuid4().hex}"
    first = run(lambda: turn(url, world, session, "refund A"))
    assert first.ok and first.value["reply"] == "HumanFeedbackPending", first.summary()
    asked_first = run(lambda: pending_context(url, session)).value
    second = run(lambda: turn(url, world, session, "refund B"))
    assert second.ok and second.value["reply"] == "HumanFeedbackPending", second.summary()
    assert applied(world) == {"mail": 2}
    asked_second = run(lambda: pending_context(url, session)).value
    assert asked_second.startswith("refund B (mail:"), asked_second
    assert asked_second.split("(")[1] != asked_first.split("(")[1]  # a mail of its own

    def restart() -> str:
        return type(desk_flow(url, world)().kickoff(inputs={"id": session})).__name__

    assert run(restart).value == "HumanFeedbackPending"
    assert applied(world) == {"mail": 2}
    assert run(lambda: pending_context(url, session)).value == asked_second
    answered = run(lambda: answer(url, world, session, "alice"))
    assert answered.ok, answered.summary()
    assert answered.value["out"].startswith("refunded by alice: refund:"), answered.summary()
    assert run(lambda: answer(url, world, session, "bob")).raised("ResumeConflict")
    assert applied(world) == {"mail": 2, "refund": 1}
    assert entered(world) == {"review_refund": 3, "give_refund": 1}


def test_a_later_turn_killed_after_asking_again_and_sent_again_mails_once(
    url: str, world: Path
) -> None:
    """P2: the second refund turn is SIGKILLed in `review_refund` after it mailed the
    reviewer, before its pause was saved. Sent again, the turn runs the method at the
    same question: its mail is reconciled, not sent again; a third refund turn mails
    once more."""
    session = f"desk-{uuid.uuid4().hex}"
    assert run(lambda: turn(url, world, session, "refund A")).ok
    died = run(lambda: turn(url, world, session, "refund B", **{"review_refund.mailed": "kill"}))
    assert died.status == "killed", died.summary()
    assert applied(world) == {"mail": 2}
    again = run(lambda: until_free(lambda: turn(url, world, session, "refund B")))
    assert again.ok and again.value["reply"] == "HumanFeedbackPending", again.summary()
    assert applied(world) == {"mail": 2}
    assert EffectSink(WorldDB(world)).repeats() == {}
    third = run(lambda: turn(url, world, session, "refund C"))
    assert third.ok and third.value["reply"] == "HumanFeedbackPending", third.summary()
    assert applied(world) == {"mail": 3}
    answered = run(lambda: answer(url, world, session, "alice"))
    assert answered.ok, answered.summary()
    assert applied(world) == {"mail": 3, "refund": 1}


def fork_of(url: str, session: str, token: str, *, messages: int | None = None) -> str:
    """`store.fork(session, fork_token=token)`: at the head, or at the newest checkpoint
    whose conversation holds `messages` messages."""
    from remit_crewai import RemitFlowPersistence

    store = RemitFlowPersistence(url)
    at = None
    if messages is not None:
        at = next(
            c.checkpoint_id
            for c in store.checkpoints(session)
            if len(c.state["messages"]) == messages
        )
    return store.fork(session, fork_token=token, checkpoint_id=at)


def test_a_fork_of_a_conversation_keeps_its_past_and_pays_only_for_its_own_turns(
    url: str, world: Path
) -> None:
    """P3, P2: three turns (two paid orders); a fork at the head and a fork at the
    checkpoint after the first order (`store.fork`, a token each). A turn on each fork
    continues that fork's conversation: its history is the prefix it was forked at plus
    its own turn, its order pays once, and no order of the shared prefix pays again.
    The conversation forked from is unchanged, and the same token gives the same fork."""
    session = f"desk-{uuid.uuid4().hex}"
    for message in ("hi", "buy one", "buy two"):
        assert run(lambda m=message: turn(url, world, session, m)).ok
    main = run(lambda: history(url, session)).value
    assert [m[1] for m in main[::2]] == ["hi", "buy one", "buy two"]
    assert applied(world) == {"charge": 2}

    at_head = run(lambda: fork_of(url, session, "head")).value
    went = run(lambda: turn(url, world, at_head, "buy three"))
    assert went.ok and went.value["reply"].startswith("charge:"), went.summary()
    assert went.value["said"] == [*main, ["user", "buy three"], ["assistant", went.value["reply"]]]

    early = run(lambda: fork_of(url, session, "early", messages=4)).value
    assert run(lambda: history(url, early)).value == main[:4]
    again = run(lambda: turn(url, world, early, "buy again"))
    assert again.ok, again.summary()
    assert again.value["said"] == [
        *main[:4],
        ["user", "buy again"],
        ["assistant", again.value["reply"]],
    ]
    assert len({main[3][1], main[5][1], went.value["reply"], again.value["reply"]}) == 4
    assert applied(world) == {"charge": 4}
    assert entered(world) == {"take_order": 4}
    assert EffectSink(WorldDB(world)).repeats() == {}
    assert run(lambda: history(url, session)).value == main
    assert run(lambda: fork_of(url, session, "early")).value == early


def test_a_turn_that_forks_a_conversation_with_crewai_restore_from_state_id(
    url: str, world: Path
) -> None:
    """P3: `handle_turn(message, restore_from_state_id=S)` on a new instance (CrewAI's
    fork: no `session_id`, so the turn names the instance's own id) inside `fork_token`
    forks S's conversation: the turn runs on S's history under the token's fork id,
    and pays once; S is unchanged. The same token again continues that fork. A turn that
    names another conversation as its `session_id` is refused with `ForkWithoutIntent`
    saying so, and stores nothing; without a token, the fork is refused too."""
    session = f"desk-{uuid.uuid4().hex}"
    for message in ("hi", "buy one"):
        assert run(lambda m=message: turn(url, world, session, m)).ok
    main = run(lambda: history(url, session)).value

    def forking(message: str, token: str | None, **kwargs: Any) -> dict[str, Any]:
        from remit_crewai import fork_token

        flow = desk_flow(url, world)(suppress_flow_events=True)
        with fork_token(token) if token else contextlib.nullcontext():
            reply = flow.handle_turn(message, restore_from_state_id=session, **kwargs)
        return {"id": flow.flow_id, "reply": reply, "said": said(flow)}

    forked = run(lambda: forking("buy two", "what-if"))
    assert forked.ok, forked.summary()
    fork_id = forked.value["id"]
    assert fork_id.startswith(f"{session}@fork-"), forked.value
    assert forked.value["said"] == [
        *main,
        ["user", "buy two"],
        ["assistant", forked.value["reply"]],
    ]
    assert run(lambda: history(url, fork_id)).value == forked.value["said"]
    assert run(lambda: history(url, session)).value == main
    assert applied(world) == {"charge": 2}

    more = run(lambda: forking("buy three", "what-if"))
    assert more.ok and more.value["id"] == fork_id, more.summary()
    assert len(more.value["said"]) == len(forked.value["said"]) + 2
    assert applied(world) == {"charge": 3}

    other = f"desk-{uuid.uuid4().hex}"
    named = run(lambda: forking("buy four", "named", session_id=other))
    assert named.raised("ForkWithoutIntent"), named.summary()
    assert "session_id" in named.error_text(), named.error_text()
    unasked = run(lambda: forking("buy four", None))
    assert unasked.raised("ForkWithoutIntent"), unasked.summary()
    assert applied(world) == {"charge": 3}
    assert run(lambda: history(url, session)).value == main

    def stored(flow_id: str) -> Any:
        from remit_crewai import RemitFlowPersistence

        return RemitFlowPersistence(url).load_state(flow_id)

    assert run(lambda: stored(other)).value is None


def test_chat_that_forks_a_conversation_goes_on_on_its_fork(url: str, world: Path) -> None:
    """P3: CrewAI's `chat(restore_from_state_id=S)` inside `fork_token` runs every turn on
    one instance and passes `restore_from_state_id` with each: the first turn forks S,
    the next continues that same fork (the token's), keeping the first turn. Each order
    pays once; S is unchanged."""
    session = f"desk-{uuid.uuid4().hex}"
    for message in ("hi", "buy one"):
        assert run(lambda m=message: turn(url, world, session, m)).ok
    main = run(lambda: history(url, session)).value

    def chatting() -> dict[str, Any]:
        from remit_crewai import fork_token

        flow = desk_flow(url, world)(suppress_flow_events=True)
        replies: list[str] = []
        lines = iter(["buy two", "buy three", "exit"])
        with fork_token("chat"):
            flow.chat(
                input_fn=lambda _: next(lines),
                output_fn=replies.append,
                restore_from_state_id=session,
            )
        return {"id": flow.flow_id, "replies": replies, "said": said(flow)}

    out = run(chatting)
    assert out.ok, out.summary()
    assert out.value["id"].startswith(f"{session}@fork-"), out.value
    two, three = (r.removeprefix("\nAssistant: ") for r in out.value["replies"])
    assert out.value["said"] == [
        *main,
        ["user", "buy two"],
        ["assistant", two],
        ["user", "buy three"],
        ["assistant", three],
    ]
    assert run(lambda: history(url, out.value["id"])).value == out.value["said"]
    assert run(lambda: history(url, session)).value == main
    assert applied(world) == {"charge": 3}
