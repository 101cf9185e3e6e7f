"""Round 34 probes of RemitSaver: what a run refuses as it starts must be refused
before anything is claimed or stored (P4, P5, P3). A resume value for a head the
saver cannot read (another `workflow_version`, a state schema version it cannot
migrate, stored values that fail to verify), a command LangGraph cannot map or
apply (a resume dict with a key that is no str, `graph=Command.PARENT` at the top,
a `goto` that is no node, an empty `Command()`, two values for a plain key), and a
str with a lone surrogate (LangGraph's encoding reads it back as "?") each leave
the interrupt pending and answerable; a fork whose base the saver cannot read
makes no branch and leaves its token free. A corrupt channel value's error names
the checkpoint read. Real LangGraph, real stores on every engine, sync and async."""

from __future__ import annotations

import asyncio
import operator
import uuid
from typing import Annotated, Any

import pytest
from langgraph.errors import EmptyInputError, InvalidUpdateError
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_core import Migrations, StateSchema, VersionMismatch
from remit_langgraph import RemitSaver


class Order(TypedDict):
    log: Annotated[list[str], operator.add]


def _graph(saver: RemitSaver, entered: list[str]) -> Any:
    """prepare -> approve (interrupt) -> end."""

    def prepare(state: Order) -> dict[str, Any]:
        entered.append("prepare")
        return {"log": ["prepare"]}

    def approve(state: Order) -> dict[str, Any]:
        entered.append("approve")
        return {"log": [f"approved:{interrupt('ok?')}"]}

    builder = StateGraph(Order)
    builder.add_node("prepare", prepare)
    builder.add_node("approve", approve)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "approve")
    builder.add_edge("approve", END)
    return builder.compile(checkpointer=saver)


def _config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"p34-{uuid.uuid4().hex}"}}


def _failing_migrations() -> Migrations:
    migrations = Migrations()

    @migrations.register(1)
    def broken(state: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("approver")

    return migrations


#: Savers that cannot read a head the default saver wrote, each for its own reason.
STRANGERS: dict[str, dict[str, Any]] = {
    "workflow_version": {"workflow_version": "v2"},
    "schema_version": {"state_schema": StateSchema(Order, version=2)},
    "failing_migration": {
        "state_schema": StateSchema(Order, version=2, migrations=_failing_migrations())
    },
}
OWN: dict[str, dict[str, Any]] = {
    "workflow_version": {"workflow_version": "v1"},
    "schema_version": {"state_schema": StateSchema(Order, version=1)},
    "failing_migration": {"state_schema": StateSchema(Order, version=1)},
}


@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("why", sorted(STRANGERS))
def test_a_resume_the_saver_cannot_read_the_head_for_is_refused_and_consumes_nothing(
    url: str, why: str, api: str
) -> None:
    """A saver of another workflow version (or state schema version) given a
    `Command(resume=v)` for a thread another version paused raised `VersionMismatch`,
    after it had consumed the interrupt with `v`: the value was stored though the
    resumer was refused, and the paused graph's own saver then got `ResumeConflict`
    ("already consumed") for its answer, or a later `invoke(None)` ran on with the
    refused value. Now the head is read before the interrupt is consumed."""
    entered: list[str] = []
    cfg = _config()
    own = _graph(RemitSaver(url, **OWN[why]), entered)
    own.invoke({"log": []}, cfg)
    stranger_saver = RemitSaver(url, **STRANGERS[why])
    stranger = _graph(stranger_saver, entered)
    thread = cfg["configurable"]["thread_id"]

    with pytest.raises(VersionMismatch) as err:
        if api == "sync":
            stranger.invoke(Command(resume="mallory"), cfg)
        else:
            asyncio.run(stranger.ainvoke(Command(resume="mallory"), cfg))
    assert err.value.run_id == thread
    assert err.value.checkpoint_id is not None

    (pending,) = stranger_saver.remit.interrupts(thread)
    assert pending.status == "pending" and pending.value is None
    assert entered == ["prepare", "approve"]  # nothing ran for the refused value

    done = own.invoke(Command(resume="alice"), cfg)
    assert done["log"] == ["prepare", "approved:alice"]
    assert entered == ["prepare", "approve", "approve"]
    (answered,) = stranger_saver.remit.interrupts(thread)
    assert answered.status == "consumed"


def _garble_blobs(saver: RemitSaver, thread: str) -> int:
    """Overwrite every stored channel value of `thread`, below the core (test only)."""
    store: Any = saver.remit.store
    garbage = b"\x00garbled"
    if store.url.startswith("redis"):
        from remit_core.stores.redis import run_prefix

        client = store._client()
        fields = list(client.hgetall(run_prefix(thread) + "bl"))
        for field in fields:
            client.hset(run_prefix(thread) + "bl", field, garbage)
        return len(fields)
    with store._txn() as txn:
        txn.execute("UPDATE remit_blobs SET value = ? WHERE run_id = ?", (garbage, thread))
        rows = txn.execute("SELECT COUNT(*) FROM remit_blobs WHERE run_id = ?", (thread,))
        return int(rows.fetchone()[0])


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_resume_of_a_head_whose_values_are_corrupt_is_refused_and_consumes_nothing(
    url: str, api: str
) -> None:
    """A resume value for a paused head whose stored channel values fail to verify
    raised `CorruptRecord` after the interrupt had been consumed with it: the value
    was stored though its resumer was refused. And the error (of `get_state` too)
    named the run and the blob, not the checkpoint read (P4: it names the run and the
    checkpoint). Now nothing is consumed, and the checkpoint is named."""
    from remit_core import CorruptRecord

    entered: list[str] = []
    cfg = _config()
    writer = _graph(RemitSaver(url), entered)
    writer.invoke({"log": []}, cfg)
    thread = cfg["configurable"]["thread_id"]
    head = writer.get_state(cfg).config["configurable"]["checkpoint_id"]
    reader = RemitSaver(url)  # another process's saver: nothing of the thread cached
    assert _garble_blobs(reader, thread) > 0
    graph = _graph(reader, entered)
    with pytest.raises(CorruptRecord) as err:
        if api == "sync":
            graph.invoke(Command(resume="alice"), cfg)
        else:
            asyncio.run(graph.ainvoke(Command(resume="alice"), cfg))
    assert (err.value.run_id, err.value.checkpoint_id) == (thread, head)
    with pytest.raises(CorruptRecord) as err:
        _graph(RemitSaver(url), entered).get_state(cfg)
    assert (err.value.run_id, err.value.checkpoint_id) == (thread, head)
    (pending,) = reader.remit.interrupts(thread)
    assert pending.status == "pending" and pending.value is None
    assert entered == ["prepare", "approve"]


@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("why", sorted(STRANGERS))
def test_a_fork_the_saver_cannot_read_the_base_of_is_refused_and_makes_no_branch(
    url: str, why: str, api: str
) -> None:
    """A run with a `fork_token` and the `checkpoint_id` of a checkpoint the saver
    cannot read (another workflow version, a state schema version it cannot migrate)
    raised `VersionMismatch` after it had made the token's branch: the token was
    spent on a fork that never ran, and the paused graph's own saver, forking another
    checkpoint with it, got `ForkWithoutIntent` ("already forked"). Now the base is
    read before the branch is made (P3: one branch, made by the fork that runs)."""
    entered: list[str] = []
    cfg = _config()
    own = _graph(RemitSaver(url, **OWN[why]), entered)
    own.invoke({"log": []}, cfg)
    thread = cfg["configurable"]["thread_id"]
    history = list(own.get_state_history(cfg))
    before_prepare, first = history[-2].config, history[-1].config
    stranger_saver = RemitSaver(url, **STRANGERS[why])
    stranger = _graph(stranger_saver, entered)
    forking = {"configurable": {**before_prepare["configurable"], "fork_token": "second"}}

    with pytest.raises(VersionMismatch) as err:
        if api == "sync":
            stranger.invoke(None, forking)
        else:
            asyncio.run(stranger.ainvoke(None, forking))
    assert err.value.run_id == thread
    assert [b.fork_token for b in stranger_saver.remit.branches(thread)] == [None]
    assert entered == ["prepare", "approve"]

    # The token is still free: the graph's own saver makes its one branch with it.
    own_fork = {"configurable": {**first["configurable"], "fork_token": "second"}}
    own.invoke(None, own_fork)
    assert entered == ["prepare", "approve", "prepare", "approve"]
    tokens = sorted(str(b.fork_token) for b in stranger_saver.remit.branches(thread))
    assert tokens == ["None", "second"]


#: Commands LangGraph cannot map to writes, and what it raises for each.
UNMAPPABLE: dict[str, tuple[Command[Any], type[Exception], str]] = {
    "int_key": (Command(resume={1: "alice"}), TypeError, "str keys"),
    "tuple_key": (Command(resume={(1, 2): "alice"}), TypeError, "str keys"),
    "id_then_int_key": (Command(resume={"0" * 32: "x", 7: "y"}), TypeError, "str keys"),
    "parent_at_top": (
        Command(resume="alice", graph=Command.PARENT),
        InvalidUpdateError,
        "no parent graph",
    ),
    "goto_int": (Command(resume="alice", goto=5), TypeError, "Command.goto"),  # type: ignore[arg-type]
    "empty": (Command(), EmptyInputError, "empty Command"),
}


@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("case", sorted(UNMAPPABLE))
def test_a_command_langgraph_cannot_map_is_refused_before_its_value_is_consumed(
    url: str, case: str, api: str
) -> None:
    """LangGraph checks a command as its run starts (a resume dict's keys tested as
    interrupt ids, `graph=Command.PARENT` with no parent, a `goto` that is no node
    name, an empty command) and raises. Remit had claimed the thread and consumed
    the interrupt with the command's value by then: the resumer got the error, yet
    the value was stored, and a right answer was refused, as "already consumed" or,
    the failed run's claim held until its loop was garbage-collected, as another
    holder's (`Command()` alone left that claim held). Now the command is refused
    before anything is claimed or stored, with LangGraph's error class (for
    `Command()`, the `EmptyInputError` LangGraph means to raise)."""
    command, error, says = UNMAPPABLE[case]
    entered: list[str] = []
    cfg = _config()
    saver = RemitSaver(url)
    graph = _graph(saver, entered)
    graph.invoke({"log": []}, cfg)
    thread = cfg["configurable"]["thread_id"]

    with pytest.raises(error, match=says):
        if api == "sync":
            graph.invoke(command, cfg)
        else:
            asyncio.run(graph.ainvoke(command, cfg))
    (pending,) = saver.remit.interrupts(thread)
    assert pending.status == "pending" and pending.value is None
    assert entered == ["prepare", "approve"]

    done = graph.invoke(Command(resume="alice"), cfg)
    assert done["log"] == ["prepare", "approved:alice"]


class Note(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    text: str


def _noting(saver: RemitSaver, text: str, entered: list[str], *, fail: bool = False) -> Any:
    """ask (interrupt) -> write (stores `text`, or raises an error that quotes it)."""

    def ask(state: Note) -> dict[str, Any]:
        entered.append("ask")
        return {"log": [f"asked:{interrupt('note?')}"]}

    def write(state: Note) -> dict[str, Any]:
        entered.append("write")
        if fail:
            raise RuntimeError(f"could not store {text!r}")
        return {"text": text}

    builder = StateGraph(Note)
    builder.add_node("ask", ask)
    builder.add_node("write", write)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "write")
    builder.add_edge("write", END)
    return builder.compile(checkpointer=saver)


def test_a_resume_value_with_a_lone_surrogate_is_refused_and_consumes_nothing(url: str) -> None:
    """LangGraph's encoding writes a lone surrogate as "?": a resume value "ok\\ud800"
    was consumed and stored as "ok?", so a recovery (or any later read) continued
    with another value than the one the live run and its resumer had. Now it is
    refused (`CheckpointInvalid` at `resume`), nothing stored; the pause takes a
    good value afterwards."""
    from remit_core import CheckpointInvalid

    entered: list[str] = []
    cfg = _config()
    saver = RemitSaver(url)
    graph = _noting(saver, "fine", entered)
    graph.invoke({"log": []}, cfg)
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke(Command(resume="ok\ud800"), cfg)
    assert err.value.field == "resume"
    (pending,) = saver.remit.interrupts(cfg["configurable"]["thread_id"])
    assert pending.status == "pending" and pending.value is None
    assert graph.invoke(Command(resume="ok"), cfg) == {"log": ["asked:ok"], "text": "fine"}


@pytest.mark.parametrize("text", ["x\udcff", "\ud83d alone", "pair \ud83d\ude00 split"])
def test_a_state_value_with_a_lone_surrogate_is_refused_not_read_back_as_question_marks(
    url: str, text: str
) -> None:
    """A node that returned a str with a lone surrogate (text decoded with
    `surrogateescape`, or half of a pair) had it stored as "?": every later read,
    in this process or another, returned another value than the node wrote (P4).
    Now the write is refused with `CheckpointInvalid` naming the key; the head
    stays, and the thread continues once the node writes a str it can store."""
    from remit_core import CheckpointInvalid

    entered: list[str] = []
    cfg = _config()
    graph = _noting(RemitSaver(url), text, entered)
    graph.invoke({"log": []}, cfg)
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke(Command(resume="ok"), cfg)
    assert err.value.field == "text"
    again = _noting(RemitSaver(url), "fine", entered)
    state = again.get_state(cfg)
    assert "text" not in state.values and state.next == ("write",)
    assert again.invoke(None, cfg) == {"log": ["asked:ok"], "text": "fine"}


def test_a_nodes_error_that_quotes_a_lone_surrogate_fails_the_run_with_that_error(
    url: str,
) -> None:
    """LangGraph stores a failed node's error with the checkpoint: one whose message
    quotes a lone surrogate is still stored (as its repr, which escapes it), so the
    refusal of lone surrogates never hides a node's own error: the run fails with
    it, and runs again."""
    entered: list[str] = []
    cfg = _config()
    graph = _noting(RemitSaver(url), "x\ud800", entered, fail=True)
    graph.invoke({"log": []}, cfg)
    with pytest.raises(RuntimeError, match="could not store"):
        graph.invoke(Command(resume="ok"), cfg)
    retry = _noting(RemitSaver(url), "fine", entered)
    assert retry.invoke(None, cfg) == {"log": ["asked:ok"], "text": "fine"}
    assert entered == ["ask", "ask", "write", "write"]


class Counted(TypedDict, total=False):
    n: int
    log: Annotated[list[str], operator.add]


def _counted(saver: RemitSaver, entered: list[str]) -> Any:
    """ask (interrupt) -> end, with a plain key `n` beside the log."""

    def ask(state: Counted) -> dict[str, Any]:
        entered.append("ask")
        return {"log": [f"asked:{interrupt('n?')}"]}

    builder = StateGraph(Counted)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("resume", ["alice", None])
def test_a_command_update_with_two_values_for_a_plain_key_is_refused_and_stores_nothing(
    url: str, resume: str | None
) -> None:
    """`Command(update=[("n", 1), ("n", 2)])` gives a plain key two values in one
    step, which LangGraph refuses (`InvalidUpdateError`) only as it applies the
    update, after storing it: with a resume value, the interrupt was consumed and
    the run's claim left held; after that every run of the thread (`invoke(None)`,
    a resume) failed applying the stored update again. Now the command is refused
    (`CheckpointInvalid` naming the key) before anything is claimed or stored."""
    from remit_core import CheckpointInvalid

    entered: list[str] = []
    cfg = _config()
    saver = RemitSaver(url)
    graph = _counted(saver, entered)
    graph.invoke({"log": []}, cfg)
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke(Command(resume=resume, update=[("n", 1), ("n", 2)]), cfg)
    assert err.value.field == "n"
    (pending,) = saver.remit.interrupts(cfg["configurable"]["thread_id"])
    assert pending.status == "pending" and pending.value is None
    assert graph.invoke(Command(resume="bob", update={"n": 3}), cfg) == {
        "n": 3,
        "log": ["asked:bob"],
    }
    assert entered == ["ask", "ask"]
