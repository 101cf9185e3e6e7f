"""RemitSaver probed with LangGraph's editing API in shapes the earlier rounds left out:
`update_state(..., as_node="__copy__")` with and without a fork token, a
`bulk_update_state` that loses a race between its supersteps, and state reads by a fork
token that names no branch yet. Real LangGraph, on every engine."""

from __future__ import annotations

import asyncio
import operator
import sys
import threading
import uuid
from typing import Annotated, Any

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, StateUpdate, interrupt
from typing_extensions import TypedDict

from remit_core import ForkWithoutIntent, HeadMoved, ResumeConflict, UnknownRecord
from remit_langgraph import RemitSaver


def config(thread: str | None = None, **more: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or f"lg-{uuid.uuid4().hex}", **more}}


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def asking(saver: RemitSaver) -> Any:
    """`a` logs "a", then `ask` pauses at `q?` and logs the answer."""
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("ask", lambda s: {"log": [interrupt("q?")]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def main_ids(saver: RemitSaver, thread: str) -> list[str]:
    return [r.checkpoint_id for r in saver.remit.history(thread) if r.branch == "main"]


# -- update_state(..., as_node="__copy__") -----------------------------------------------


def test_a_copy_with_a_fork_token_makes_the_one_fork_it_names_and_leaves_main_alone(
    url: str,
) -> None:
    """LangGraph stores a copy under the copied checkpoint's parent, by a config without
    the token: it was refused as a fork without intent though a token was given (P3)."""
    saver = RemitSaver(url)
    graph = asking(saver)
    cfg = config()
    graph.invoke({"log": []}, cfg)
    main_before = main_ids(saver, cfg["configurable"]["thread_id"])
    fork = config(cfg["configurable"]["thread_id"], fork_token="copy")
    made = graph.update_state(fork, None, as_node="__copy__")
    again = graph.update_state(fork, None, as_node="__copy__")  # one token, one branch
    assert again["configurable"]["checkpoint_id"] == made["configurable"]["checkpoint_id"]
    copy = graph.get_state(fork)
    assert copy.values == {"log": ["a"]} and copy.next == ("ask",)
    assert copy.config["configurable"]["checkpoint_id"] == made["configurable"]["checkpoint_id"]
    assert main_ids(saver, cfg["configurable"]["thread_id"]) == main_before
    # The copy asks nothing until it runs; then it asks again, on its own branch (L3).
    with pytest.raises(ResumeConflict, match="a copy of a checkpoint"):
        graph.invoke(Command(resume="F"), fork)
    assert [i.value for i in graph.invoke(None, fork)["__interrupt__"]] == ["q?"]
    assert graph.invoke(Command(resume="F"), fork) == {"log": ["a", "F"]}
    assert graph.invoke(Command(resume="M"), cfg) == {"log": ["a", "M"]}
    assert graph.get_state(fork).values == {"log": ["a", "F"]}


def test_a_copy_with_a_token_already_forked_elsewhere_is_refused(url: str) -> None:
    saver = RemitSaver(url)
    graph = asking(saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    graph.invoke({"log": []}, cfg)
    head, older = main_ids(saver, thread)[:2]
    graph.update_state(config(thread, checkpoint_id=older, fork_token="t"), None, "__copy__")
    stored = len(list(saver.remit.history(thread)))
    with pytest.raises(ForkWithoutIntent, match="already forked"):
        graph.update_state(config(thread, checkpoint_id=head, fork_token="t"), None, "__copy__")
    assert len(list(saver.remit.history(thread))) == stored


@pytest.mark.parametrize("which", ["head", "root"])
def test_a_copy_without_a_token_is_refused_and_a_copy_of_the_root_never_resets_main(
    url: str, which: str
) -> None:
    """A copy of the thread's first checkpoint has no parent: it was stored as main's new
    head, dropping main's whole line (its state back to the empty input) with no token."""
    saver = RemitSaver(url)
    graph = asking(saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    graph.invoke({"log": []}, cfg)
    history = [s.config for s in graph.get_state_history(cfg)]
    copied = history[0] if which == "head" else history[-1]
    main_before = main_ids(saver, thread)
    with pytest.raises(ForkWithoutIntent, match="__copy__"):
        graph.update_state(copied, None, as_node="__copy__")
    if which == "root":
        with pytest.raises(ForkWithoutIntent, match="no parent"):
            graph.update_state(
                {"configurable": {**copied["configurable"], "fork_token": "r"}},
                None,
                as_node="__copy__",
            )
    assert main_ids(saver, thread) == main_before
    state = graph.get_state(cfg)
    assert state.values == {"log": ["a"]} and state.next == ("ask",)
    assert graph.invoke(Command(resume="M"), cfg) == {"log": ["a", "M"]}


def test_an_async_copy_with_a_fork_token_forks_too(url: str) -> None:
    async def main() -> None:
        saver = RemitSaver(url)
        graph = asking(saver)
        cfg = config()
        await graph.ainvoke({"log": []}, cfg)
        fork = config(cfg["configurable"]["thread_id"], fork_token="acopy")
        await graph.aupdate_state(fork, None, as_node="__copy__")
        await graph.ainvoke(None, fork)
        assert await graph.ainvoke(Command(resume="F"), fork) == {"log": ["a", "F"]}
        assert (await graph.aget_state(cfg)).next == ("ask",)

    asyncio.run(main())


# -- bulk_update_state losing a race between its supersteps ---------------------------------


def two_nodes(saver: RemitSaver) -> Any:
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", lambda s: {"log": ["b"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return builder.compile(checkpointer=saver)


class RacedSaver(RemitSaver):
    """Lets another writer update the thread (from another thread) just as a later
    superstep of a bulk update reads the checkpoint the one before it committed."""

    other: Any = None

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        caller = sys._getframe(1)
        if self.other is not None and caller.f_locals.get("is_first") is False:
            other, self.other = self.other, None
            done = threading.Thread(target=other)
            done.start()
            done.join(60)
        return super().get_tuple(config)


def test_a_bulk_update_that_loses_a_race_between_supersteps_gets_head_moved(url: str) -> None:
    """The second superstep continues the checkpoint the first committed, which another
    write has moved past: `HeadMoved` (not `ForkWithoutIntent`), and nothing of that
    superstep is stored, its writes on the checkpoint it continued included."""
    saver = RacedSaver(url)
    graph = two_nodes(saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    graph.invoke({"log": []}, cfg)
    saver.other = lambda: graph.update_state(cfg, {"log": ["other"]}, as_node="b")
    steps = [
        [StateUpdate({"log": ["s1"]}, "a")],
        [StateUpdate({"log": ["s2a"]}, "a"), StateUpdate({"log": ["s2b"]}, "b")],
    ]
    with pytest.raises(HeadMoved, match="supersteps before this one were stored"):
        graph.bulk_update_state(cfg, steps)
    assert saver.other is None  # (the race ran)
    assert graph.get_state(cfg).values == {"log": ["a", "b", "s1", "other"]}
    stored = [
        saver._decode(w.value)
        for r in saver.remit.history(thread)
        for w in saver.remit.writes(thread, r.checkpoint_id)
        if w.channel == "log"
    ]
    assert not any(v in (["s2a"], ["s2b"]) for v in stored), stored
    graph.bulk_update_state(cfg, steps[1:])  # the rest, applied again by the user
    assert graph.get_state(cfg).values["log"][-2:] == ["s2a", "s2b"]


def test_a_bulk_update_with_no_race_applies_every_superstep(url: str) -> None:
    saver = RemitSaver(url)
    graph = two_nodes(saver)
    cfg = config()
    graph.invoke({"log": []}, cfg)
    graph.bulk_update_state(
        cfg, [[StateUpdate({"log": ["s1"]}, "a")], [StateUpdate({"log": ["s2"]}, "b")]]
    )
    assert graph.get_state(cfg).values == {"log": ["a", "b", "s1", "s2"]}


# -- reads by a fork token no branch has ---------------------------------------------------


def test_state_reads_by_a_fork_token_that_names_no_branch_are_refused(url: str) -> None:
    """`get_state` showed main's head and `get_state_history` every branch's checkpoints
    under a token that names no branch (a typo, or a fork not made yet), as if they were
    the fork's; a run with it is refused. Refused too (`UnknownRecord`); an edit with a new
    token still forks main's head, and the token then reads its branch."""
    saver = RemitSaver(url)
    graph = two_nodes(saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    graph.invoke({"log": []}, cfg)
    graph.update_state(config(thread, fork_token="made"), {"log": ["f"]}, as_node="b")
    unknown = config(thread, fork_token="not-made")
    with pytest.raises(UnknownRecord, match="'not-made'"):
        graph.get_state(unknown)
    with pytest.raises(UnknownRecord, match="'not-made'"):
        list(graph.get_state_history(unknown))
    with pytest.raises(UnknownRecord, match="'not-made'"):
        graph.invoke(None, unknown)

    async def reads() -> None:
        with pytest.raises(UnknownRecord, match="'not-made'"):
            await graph.aget_state(unknown)
        with pytest.raises(UnknownRecord, match="'not-made'"):
            _ = [s async for s in graph.aget_state_history(unknown)]

    asyncio.run(reads())
    made = config(thread, fork_token="made")
    assert graph.get_state(made).values == {"log": ["a", "b", "f"]}
    assert [s.values["log"] for s in graph.get_state_history(made)][0] == ["a", "b", "f"]
    assert graph.get_state(cfg).values == {"log": ["a", "b"]}
    graph.update_state(unknown, {"log": ["g"]}, as_node="b")  # its first use forks main's head
    assert graph.get_state(unknown).values == {"log": ["a", "b", "g"]}
    assert graph.get_state(cfg).values == {"log": ["a", "b"]}
