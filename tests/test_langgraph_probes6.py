"""RemitSaver probed where a thread id outlives its records: `delete_thread`, then the
same thread id used again (a chat reset), and copies of such a thread. Real LangGraph
on every engine; the effect's target dedupes by idempotency key, as a payment API does."""

from __future__ import annotations

import uuid
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

import remit_core
from remit_core import NOT_APPLIED
from remit_langgraph import RemitSaver


class Bill(TypedDict):
    amount: int
    charged: int
    approved: str


class Payments:
    """A payment API: a repeated idempotency key returns the first charge, applies nothing."""

    def __init__(self) -> None:
        self.by_key: dict[str, int] = {}
        self.applied: list[int] = []

    def charge(self, amount: int, key: str) -> int:
        if key not in self.by_key:
            self.applied.append(amount)
        return self.by_key.setdefault(key, amount)


def billing(saver: RemitSaver, payments: Payments) -> Any:
    """charge (effect) then ask for approval, in one node: a resume runs it again."""

    @remit_core.effect(reconcile=lambda key: payments.by_key.get(key, NOT_APPLIED))
    def charge(amount: int, *, idempotency_key: str) -> int:
        return payments.charge(amount, idempotency_key)

    def bill(state: Bill) -> dict[str, Any]:
        charged = charge(state["amount"])
        return {"charged": charged, "approved": interrupt("approve?")}

    builder = StateGraph(Bill)
    builder.add_node("bill", bill)
    builder.add_edge(START, "bill")
    builder.add_edge("bill", END)
    return builder.compile(checkpointer=saver)


def config(thread: str | None = None) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or f"lg-{uuid.uuid4().hex}"}}


def test_a_thread_id_used_again_after_delete_thread_applies_its_new_effects(url: str) -> None:
    """The deleted life's ledger is gone: the next life's calls are new calls, under keys
    the target has never seen, and each is still applied once across its own resume."""
    saver, payments = RemitSaver(url), Payments()
    graph, cfg = billing(saver, payments), config()
    graph.invoke({"amount": 10, "charged": 0, "approved": ""}, cfg)
    assert graph.invoke(Command(resume="ann"), cfg)["charged"] == 10

    saver.delete_thread(cfg["configurable"]["thread_id"])
    assert graph.get_state(cfg).values == {}
    graph.invoke({"amount": 25, "charged": 0, "approved": ""}, cfg)
    done = graph.invoke(Command(resume="bob"), cfg)
    assert done["charged"] == 25 and done["approved"] == "bob"
    assert payments.applied == [10, 25]  # the resume ran the node again: no third charge

    saver.delete_thread(cfg["configurable"]["thread_id"])  # a third life
    graph.invoke({"amount": 7, "charged": 0, "approved": ""}, cfg)
    assert graph.invoke(Command(resume="cy"), cfg)["charged"] == 7
    assert payments.applied == [10, 25, 7]


def test_a_copy_of_a_thread_in_its_second_life_resumes_with_the_calls_it_copied(
    url: str,
) -> None:
    """A copy continues its source's life: the node that charged before it asked, run
    again on the copy, gets the copied outcome and charges nothing."""
    saver, payments = RemitSaver(url), Payments()
    graph, source = billing(saver, payments), config()
    graph.invoke({"amount": 10, "charged": 0, "approved": ""}, source)
    saver.delete_thread(source["configurable"]["thread_id"])
    graph.invoke({"amount": 25, "charged": 0, "approved": ""}, source)
    target = config()
    saver.copy_thread(source["configurable"]["thread_id"], target["configurable"]["thread_id"])

    assert graph.invoke(Command(resume="dee"), target)["charged"] == 25
    assert graph.invoke(Command(resume="eve"), source)["charged"] == 25
    assert payments.applied == [10, 25]
