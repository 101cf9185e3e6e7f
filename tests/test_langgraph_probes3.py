"""RemitSaver probed from the contract: refused node outputs in every durability and
API, a fork whose checkpoints were deleted, a fork's history. Real LangGraph graphs
on every engine."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import operator
import sys
import typing
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic.dataclasses
import pytest
from annotated_types import Ge
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    AnyMessage,
    HumanMessage,
    RemoveMessage,
)
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, RetryPolicy
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, field_validator
from test_langgraph_support import INITIAL, World, build
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid, ResumeConflict
from remit_langgraph import AsyncRemitSaver, RemitSaver
from remit_langgraph._schema import StateCheck


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}


class Typed(TypedDict, total=False):
    amount: Annotated[int, Ge(0)]
    log: Annotated[list[str], operator.add]


class Modelled(BaseModel):
    amount: int = Field(0, ge=0)
    log: Annotated[list[str], operator.add] = []


@dataclasses.dataclass
class Plain:
    amount: Annotated[int, Ge(0)] = 0
    log: Annotated[list[str], operator.add] = dataclasses.field(default_factory=list)


def three_nodes(state: Any, saver: RemitSaver, bad: list[bool]) -> Any:
    """a -> b -> c; b writes a negative amount while `bad[0]`, and c, which reads the
    state, overwrites it: only a check of b's own output can see the refused value."""
    builder = StateGraph(state)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", lambda s: {"amount": -5 if bad[0] else 5, "log": ["b"]})
    builder.add_node("c", lambda s: {"amount": 2, "log": ["c"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def run_with(api: str, graph: Any, value: Any, cfg: dict[str, Any], durability: str) -> None:
    """One run through `api`: invoke, stream, ainvoke or astream."""
    if api == "invoke":
        graph.invoke(value, cfg, durability=durability)
    elif api == "stream":
        list(graph.stream(value, cfg, durability=durability))
    elif api == "ainvoke":
        asyncio.run(graph.ainvoke(value, cfg, durability=durability))
    else:
        asyncio.run(_drain(graph.astream(value, cfg, durability=durability)))


@pytest.mark.parametrize("api", ["invoke", "stream", "ainvoke", "astream"])
@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
@pytest.mark.parametrize(
    "state", [Typed, Modelled, Plain], ids=["typeddict", "pydantic", "dataclass"]
)
def test_a_refused_node_output_is_checkpoint_invalid_and_the_head_stays(
    store_url: str, state: Any, durability: str, api: str
) -> None:
    """Not LangGraph's own error from the next node's input, nor a run that ends well
    because a later node overwrote the value (both happened in "async" and "exit")."""
    bad = [True]
    saver = (AsyncRemitSaver if api.startswith("a") else RemitSaver).from_conn_string(store_url)
    with saver as opened:
        graph = three_nodes(state, opened, bad)
        cfg = config()
        with pytest.raises(CheckpointInvalid) as err:
            run_with(api, graph, {"amount": 1}, cfg, durability)
        assert err.value.field == "amount"
        assert err.value.run_id == cfg["configurable"]["thread_id"]
        # At the checkpoint before b, with nothing of b's output on it (in "exit"
        # durability too: a failed run saves where it got when it exits).
        head = opened.get_tuple(cfg)
        snapshot = graph.get_state(cfg)
        assert snapshot.next == ("b",)
        assert snapshot.values["log"] == ["a"]
        assert head is not None and all(w[1] != "amount" for w in head.pending_writes or [])
        bad[0] = False
        run_with(api, graph, None, cfg, durability)
        assert all(t.checkpoint["channel_values"].get("amount", 0) >= 0 for t in opened.list(cfg))
        final = graph.get_state(cfg).values
        assert dict(final if isinstance(final, dict) else vars(final))["log"] == ["a", "b", "c"]


@pytest.mark.parametrize("durability", ["sync", "exit"])
@pytest.mark.parametrize(
    ("key", "output"),
    [("amount", "5"), ("amount", True), ("log", ["b", 1]), ("log", "b"), ("log", [b"b"])],
    ids=["str-for-int", "bool-for-int", "int-in-list", "str-for-list", "bytes-in-list"],
)
def test_an_output_that_holds_only_once_converted_is_refused(
    store_url: str, durability: str, key: str, output: Any
) -> None:
    """Most node outputs hold as they stand and are let through by a quick test;
    one that passes only by conversion (or not at all) gets the full check."""
    builder = StateGraph(Typed)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", lambda s: {key: output})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    saver = RemitSaver(store_url)
    graph, cfg = builder.compile(checkpointer=saver), config()
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"amount": 1}, cfg, durability=durability)
    assert err.value.field is not None and err.value.field.split(".")[0].split("[")[0] == key
    snapshot = graph.get_state(cfg)
    assert snapshot.next == ("b",)
    assert snapshot.values == {"amount": 1, "log": ["a"]}


class Exact(TypedDict, total=False):
    text: str
    count: int
    ratio: float
    flag: bool
    raw: bytes
    short: Annotated[str, Field(max_length=3)]
    ints: Annotated[list[int], operator.add]
    words: Annotated[list[str], operator.add]


class Label(str):
    pass


class Small(enum.IntEnum):
    ONE = 1


def quick_tests_of(state: Any) -> tuple[StateCheck, Mapping[str, Callable[[Any], bool]]]:
    """The check of `state` and the quick tests of its keys, as a graph of it has them."""
    builder = StateGraph(state)
    builder.add_node("n", lambda s: {})
    builder.add_edge(START, "n")
    builder.add_edge("n", END)
    check = StateCheck.of(state)
    assert check is not None
    return check, check.with_channels(builder.compile().channels).quick_tests()[0]


@pytest.mark.parametrize(
    "value",
    [
        "abcd",
        Label("x"),
        1,
        True,
        Small.ONE,
        1.5,
        2**70,
        float("nan"),
        b"x",
        bytearray(b"x"),
        None,
        [],
        [1, 2],
        [1, True],
        [1, "2"],
        ["a", "b"],
        ["a", Label("b")],
        [Small.ONE],
        (1,),
    ],
    ids=repr,
)
def test_the_quick_test_of_a_key_says_what_strict_validation_says(value: Any) -> None:
    """A write of exactly a plain type (or a list of such) passes the quick test at
    once; it must answer as Pydantic's strict validation of the key's type would,
    constraints included, for every value, of any type."""
    _, quick = quick_tests_of(Exact)
    lists = {"ints": list[int], "words": list[str]}
    assert set(quick) == set(Exact.__annotations__)
    for key, test in quick.items():
        hint = lists.get(key) or typing.get_type_hints(Exact, include_extras=True)[key]
        expected = TypeAdapter(hint).validator.isinstance_python(value, strict=True)
        assert bool(test(value)) == (expected and (key not in lists or type(value) is list)), key


@pytest.mark.parametrize(
    ("output", "outcome"),
    [
        ([AIMessage(content="a", id="1")], "quick"),
        (AIMessage(content="a"), "quick"),
        ([HumanMessage(content="h"), AIMessageChunk(content="c")], "quick"),
        ([], "quick"),
        ([("user", "hi")], "full"),
        ({"role": "user", "content": "hi"}, "full"),
        ("hi", "full"),
        ([RemoveMessage(id="1")], "full"),
        ([AIMessage.model_construct(content=5)], "refused"),
        (AIMessage.model_construct(content="a", tool_calls=5), "refused"),
    ],
    ids=repr,
)
def test_the_quick_test_of_a_messages_key_passes_only_messages_as_they_stand(
    output: Any, outcome: str
) -> None:
    """An `add_messages` key's quick test passes a write of valid message instances of
    the key's type (a list of them, or one); a write the reducer converts (a tuple, a
    dict, a string) or that removes a message gets the full check, which takes it; a
    message built without validation, whose fields are not a message's, is refused."""
    check, quick = quick_tests_of(MessagesState)
    assert quick["messages"](output) is (outcome == "quick")
    if outcome == "refused":
        with pytest.raises(CheckpointInvalid) as err:
            check.writes([("messages", output)], run_id="t")
        assert err.value.field is not None and err.value.field.startswith("messages[0]")
    else:
        check.writes([("messages", output)], run_id="t")


class Inner(BaseModel):
    x: int = 0


class Capped(TypedDict, total=False):
    few: Annotated[list[Inner], Field(max_length=3), operator.add]
    many: Annotated[list[Inner], operator.add]


@pytest.mark.parametrize("key", ["few", "many"])
def test_a_list_of_models_built_without_validation_is_refused_with_or_without_a_cap(
    key: str,
) -> None:
    """An appended model built without validation passes strict validation as it
    stands; its plain form does not, whether the list's items are checked one by one
    (`many`) or the list is checked whole, its cap included (`few`)."""
    check, quick = quick_tests_of(Capped)
    bad = [Inner.model_construct(x="no")]
    assert key not in quick or quick[key](bad) is False
    with pytest.raises(CheckpointInvalid) as err:
        check.writes([(key, bad)], run_id="t")
    assert err.value.field is not None and err.value.field.startswith(f"{key}")
    check.writes([(key, [Inner(x=1)])], run_id="t")
    with pytest.raises(CheckpointInvalid):
        check.values({key: [Inner(x=1)] * (4 if key == "few" else 1) + bad}, run_id="t")


class Latest(TypedDict, total=False):
    last: AnyMessage


@pytest.mark.parametrize("durability", ["exit", "sync"])
def test_a_write_the_keys_discriminator_cannot_place_is_refused(
    store_url: str, durability: str
) -> None:
    """LangChain's message discriminator raises `TypeError` on a string, and Pydantic
    lets it through: it is still `CheckpointInvalid` naming the key, and the thread
    stays where it was."""
    builder = StateGraph(Latest)
    builder.add_node("n", lambda s: {"last": "hi"})
    builder.add_edge(START, "n")
    builder.add_edge("n", END)
    graph, cfg = builder.compile(checkpointer=RemitSaver(store_url)), config()
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"last": AIMessage(content="x", id="1")}, cfg, durability=durability)
    assert err.value.field == "last"
    with pytest.raises(CheckpointInvalid):
        graph.update_state(cfg, {"last": "hi"})
    snapshot = graph.get_state(cfg)
    assert snapshot.next == ("n",)
    assert snapshot.values == {"last": AIMessage(content="x", id="1")}


@pytest.mark.parametrize("durability", ["sync", "exit"])
@pytest.mark.parametrize("how", ["changed", "constructed"])
def test_a_chats_messages_are_checked_one_by_one_and_a_changed_one_again(
    store_url: str, durability: str, how: str
) -> None:
    """A chat's messages are checked message by message, and one that passed is not
    validated again while its plain form is as it was; a message changed in place
    since (no validation on assignment) is, and a node's message built without
    validation is checked too, before it is stored as the node's write: either is
    refused naming it, and nothing invalid is stored."""
    saver = RemitSaver(store_url)
    graph, cfg = one_reply(saver, how), config()
    graph.invoke({"messages": [HumanMessage(content="hi", id="h1")]}, cfg, durability=durability)
    before = graph.get_state(cfg).values["messages"]
    assert [m.content for m in before] == ["hi", "reply 1"]
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke(
            {"messages": [HumanMessage(content="bad", id="h2")]}, cfg, durability=durability
        )
    # (The changed message is the state's first; the built one, the write's first.)
    assert err.value.field is not None and err.value.field.startswith("messages[0].")
    stored = saver.get_tuple(cfg)  # readable: nothing invalid was stored, pending or not
    assert stored is not None
    pending = [v for _, ch, v in stored.pending_writes or () if ch == "messages"]
    kept = stored.checkpoint["channel_values"]["messages"] + [
        m for v in pending for m in (v if isinstance(v, list) else [v])
    ]
    assert kept[:2] == before and all(isinstance(m.content, str) for m in kept)


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_a_message_checked_in_this_run_then_changed_deep_inside_is_checked_again(
    store_url: str, durability: str
) -> None:
    """A message that passed the check is not checked again while its fields are as
    they were; one changed since, deep inside (a token count in its usage), is."""

    def answer(state: MessagesState) -> dict[str, Any]:
        usage = {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}
        return {"messages": [AIMessage(content="answer", id="a1", usage_metadata=usage)]}

    def tamper(state: MessagesState) -> dict[str, Any]:
        state["messages"][-1].usage_metadata["input_tokens"] = "many"  # no validation
        return {"messages": [AIMessage(content="done", id="a2")]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_node("tamper", tamper)
    builder.add_edge(START, "answer")
    builder.add_edge("answer", "tamper")
    builder.add_edge("tamper", END)
    saver, cfg = RemitSaver(store_url), config()
    graph = builder.compile(checkpointer=saver)
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"messages": [HumanMessage(content="q", id="h1")]}, cfg, durability=durability)
    field = err.value.field or ""  # (Pydantic names the union member: messages[1].ai.…)
    assert field.startswith("messages[1].") and field.endswith(".usage_metadata.input_tokens")
    stored = saver.get_tuple(cfg)
    if stored is not None:  # (in "exit" durability nothing was stored)
        kept = stored.checkpoint["channel_values"].get("messages", [])
        assert all(m.id != "a2" for m in kept)


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_a_loaded_message_changed_deep_inside_is_checked_again(
    store_url: str, durability: str
) -> None:
    """A message loaded with the thread is taken as checked only while its fields are
    those it was rebuilt from: one changed deep inside (a token count) is refused."""

    def answer(state: MessagesState) -> dict[str, Any]:
        if len(state["messages"]) == 1:
            usage = {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}
            return {"messages": [AIMessage(content="answer", id="a1", usage_metadata=usage)]}
        state["messages"][1].usage_metadata["input_tokens"] = "many"  # no validation
        return {"messages": [AIMessage(content="again", id="a2")]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    builder.add_edge("answer", END)
    saver, cfg = RemitSaver(store_url), config()
    graph = builder.compile(checkpointer=saver)
    graph.invoke({"messages": [HumanMessage(content="q", id="h1")]}, cfg, durability=durability)
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke(
            {"messages": [HumanMessage(content="q2", id="h2")]}, cfg, durability=durability
        )
    field = err.value.field or ""
    assert field.startswith("messages[1].") and field.endswith(".usage_metadata.input_tokens")
    stored = saver.get_tuple(cfg)
    assert stored is not None
    kept = stored.checkpoint["channel_values"]["messages"]
    assert [m.id for m in kept if m.id == "a2"] == []
    assert all(type(m.usage_metadata["input_tokens"]) is int for m in kept if m.id == "a1")


def one_reply(saver: RemitSaver, how: str) -> Any:
    """A chat graph whose node replies; to a message "bad" it either changes the first
    message in place into something no message is, or replies with a message built
    without validation."""

    def reply(state: MessagesState) -> dict[str, Any]:
        turn = sum(1 for m in state["messages"] if isinstance(m, HumanMessage))
        if state["messages"][-1].content != "bad":
            return {"messages": [AIMessage(content=f"reply {turn}", id=f"a{turn}")]}
        if how == "changed":
            state["messages"][0].content = 5  # no validation on assignment
            return {"messages": [AIMessage(content="ok", id="a2")]}
        return {"messages": [AIMessage.model_construct(content=5, id="a2", type="ai")]}

    builder = StateGraph(MessagesState)
    builder.add_node("reply", reply)
    builder.add_edge(START, "reply")
    builder.add_edge("reply", END)
    return builder.compile(checkpointer=saver)


class Note(BaseModel):
    text: str


class ShortNote(BaseModel):
    """`Note` as a later release declares it: its text is bounded."""

    text: str = Field(max_length=5)


class Notes(TypedDict):
    notes: Annotated[list[Note], operator.add]


class ShortNotes(TypedDict):
    notes: Annotated[list[ShortNote], operator.add]


def test_a_loaded_item_a_users_serializer_built_unvalidated_is_checked_in_full(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items of a list key of models are taken as checked when loaded only from
    Remit's own serializer, which validates each model it rebuilds. LangGraph's
    serializer, passed as `serde=`, builds a model its class refuses without
    validation: that item is checked in full at the next write, and refused."""
    serde = JsonPlusSerializer(allowed_msgpack_modules=True)
    cfg = config()
    first = StateGraph(Notes)
    first.add_node("n", lambda s: {"notes": [Note(text="seen")]})
    first.add_edge(START, "n")
    first.add_edge("n", END)
    first.compile(checkpointer=RemitSaver(store_url, serde=serde)).invoke(
        {"notes": [Note(text="a long note")]}, cfg, durability="sync"
    )
    # The next release bounds the text; the stored note no longer fits its class.
    monkeypatch.setattr(sys.modules[__name__], "Note", ShortNote)
    later = StateGraph(ShortNotes)
    later.add_node("n", lambda s: {"notes": [ShortNote(text="ok")]})
    later.add_edge(START, "n")
    later.add_edge("n", END)
    saver = RemitSaver(store_url, serde=serde)
    graph = later.compile(checkpointer=saver)
    loaded = saver.get_tuple(cfg)
    assert loaded is not None
    assert loaded.checkpoint["channel_values"]["notes"][0].text == "a long note"  # unvalidated
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"notes": [ShortNote(text="hi")]}, cfg, durability="sync")
    assert err.value.field == "notes[0].text"
    after = saver.get_tuple(cfg)  # what the refused write would have stored is not
    assert after is not None
    assert [n.text for n in after.checkpoint["channel_values"]["notes"]] == ["a long note", "seen"]


class Humans(TypedDict):
    said: list[HumanMessage]


def test_a_loaded_item_is_still_checked_against_its_keys_item_type() -> None:
    """An item taken as checked when loaded (its class validated it) is still checked
    against the key's item type at each write: a reply in a list of questions is refused."""
    check = StateCheck.of(Humans)
    assert check is not None
    values = {"said": [HumanMessage(content="hi", id="1"), AIMessage(content="x", id="2")]}
    noted = {id(m): (m, m.model_dump()) for m in values["said"]}  # (as if just rebuilt)
    check.loaded(values, noted)
    with pytest.raises(CheckpointInvalid) as err:
        check.values(values, run_id="t")
    assert err.value.field is not None and err.value.field.startswith("said[1]")
    check.loaded({"said": values["said"][:1]}, noted)
    check.values({"said": values["said"][:1]}, run_id="t")  # (the question holds)


class Bare(BaseModel):
    amount: int = Field(0, ge=0)


class Configured(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    ratio: float = 0.0


class Validated(BaseModel):
    amount: int = 0

    @field_validator("amount")
    @classmethod
    def even(cls, value: int) -> int:
        return value


class Private(BaseModel):
    amount: int = 0
    _seen: int = PrivateAttr(0)


class Cat(BaseModel):
    kind: Literal["cat"] = "cat"


class Dog(BaseModel):
    kind: Literal["dog"] = "dog"


class Tagged(BaseModel):
    pet: Cat | Dog = Field(Cat(), discriminator="kind")


@dataclasses.dataclass
class Checked:
    amount: int = 0

    def __post_init__(self) -> None:
        pass


@pydantic.dataclasses.dataclass
class PydanticData:
    amount: int = Field(0, ge=0)


@pytest.mark.parametrize(
    ("state", "whole"),
    [
        (Typed, False),
        (Bare, False),
        (Plain, False),
        (Configured, True),
        (Validated, True),
        (Private, True),
        (Tagged, True),
        (Checked, True),
        (PydanticData, True),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_a_whole_state_is_checked_where_its_type_checks_more_than_its_keys(
    state: Any, whole: bool
) -> None:
    """Each node's output of a state type with checks beyond its keys' types and
    constraints (validators, a post-init, a config of its own, a discriminated field,
    a Pydantic dataclass's `Field` defaults) takes the whole-state check; a plain
    model or dataclass, whose keys say it all, takes the quick key-by-key one."""
    check = StateCheck.of(state)
    assert check is not None and check.checks_whole is whole


def test_a_models_config_refuses_an_output_its_keys_types_take(store_url: str) -> None:
    """`allow_inf_nan=False` is the model's, not the key's type's: only the check of
    the whole state refuses a NaN, before anything of it is applied or stored."""
    builder = StateGraph(Configured)
    builder.add_node("a", lambda s: {"ratio": 0.5})
    builder.add_node("b", lambda s: {"ratio": float("nan")})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    graph, cfg = builder.compile(checkpointer=RemitSaver(store_url)), config()
    with pytest.raises(CheckpointInvalid):
        graph.invoke({"ratio": 0.0}, cfg, durability="exit")
    snapshot = graph.get_state(cfg)
    assert snapshot.next == ("b",) and snapshot.values == {"ratio": 0.5}


@pytest.mark.parametrize("durability", ["async", "exit"])
def test_a_retry_whose_output_is_valid_lets_the_run_go_on(store_url: str, durability: str) -> None:
    """A refused output fails its node: a retry policy that retries it runs it again,
    and the run keeps the output of the attempt that passes."""
    attempts: list[int] = []

    def flaky(state: Typed) -> dict[str, Any]:
        attempts.append(1)
        return {"amount": -1 if len(attempts) == 1 else 3}

    builder = StateGraph(Typed)
    builder.add_node(
        "flaky", flaky, retry_policy=RetryPolicy(initial_interval=0.01, retry_on=CheckpointInvalid)
    )
    builder.add_edge(START, "flaky")
    builder.add_edge("flaky", END)
    graph = builder.compile(checkpointer=RemitSaver(store_url))
    cfg = config()
    assert graph.invoke({"amount": 0}, cfg, durability=durability)["amount"] == 3
    assert len(attempts) == 2
    assert graph.get_state(cfg).values["amount"] == 3


def test_the_default_retry_policy_does_not_retry_a_refused_output(store_url: str) -> None:
    """`CheckpointInvalid` is a `ValueError`, which LangGraph's default `retry_on` leaves
    alone, as it does pydantic's own validation errors."""
    attempts: list[int] = []

    def bad(state: Typed) -> dict[str, Any]:
        attempts.append(1)
        return {"amount": -1}

    builder = StateGraph(Typed)
    builder.add_node("bad", bad, retry_policy=RetryPolicy())
    builder.add_edge(START, "bad")
    builder.add_edge("bad", END)
    graph = builder.compile(checkpointer=RemitSaver(store_url))
    with pytest.raises(CheckpointInvalid):
        graph.invoke({"amount": 0}, config())
    assert len(attempts) == 1


# -- a fork that asks nothing yet ---------------------------------------------------------


def forked(store_url: str, tmp_path: Path) -> tuple[World, RemitSaver, Any, str, Any]:
    """The probe graph paused at approve, and a fork of prepare's checkpoint (token
    "again") run to its own pause by LangGraph run "fork-run"."""
    world = World(tmp_path)
    saver = RemitSaver(store_url)
    graph = build(world, saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    graph.invoke(INITIAL, cfg)
    base = next(s for s in graph.get_state_history(cfg) if s.next == ("prepare",)).config
    at = {"configurable": {**base["configurable"], "fork_token": "again", "run_id": "fork-run"}}
    graph.invoke(None, at)
    return world, saver, graph, thread, base


def test_a_resume_of_a_fork_whose_run_was_deleted_says_so_and_stores_nothing(
    store_url: str, tmp_path: Path
) -> None:
    world, saver, graph, thread, base = forked(store_url, tmp_path)
    by_token = {"configurable": {"thread_id": thread, "fork_token": "again"}}
    assert graph.get_state(by_token).next == ("approve",)
    saver.delete_for_runs(["fork-run"])
    with pytest.raises(ResumeConflict, match="deleted") as err:
        graph.invoke(Command(resume="late"), by_token)
    assert err.value.run_id == thread
    assert err.value.checkpoint_id == base["configurable"]["checkpoint_id"]
    assert "fork first" not in str(err.value)
    stored = [saver._decode(i.value) for i in saver.remit.interrupts(thread) if i.value]
    assert "late" not in stored
    graph.invoke(None, by_token)  # the fork runs again and asks again (L3)
    assert graph.invoke(Command(resume="fresh"), by_token)["approved_by"] == "fresh"
    assert len(world.applications("charge")) == 1


def test_a_resume_with_the_token_that_makes_a_fork_says_it_has_not_run(
    store_url: str, tmp_path: Path
) -> None:
    world = World(tmp_path)
    graph = build(world, RemitSaver(store_url))
    cfg = config()
    graph.invoke(INITIAL, cfg)
    paused = graph.get_state(cfg).config
    at = {"configurable": {**paused["configurable"], "fork_token": "new"}}
    with pytest.raises(ResumeConflict, match="has not run yet") as err:
        graph.invoke(Command(resume="x"), at)
    assert err.value.checkpoint_id == paused["configurable"]["checkpoint_id"]
    graph.invoke(None, at)
    assert graph.invoke(Command(resume="y"), at)["approved_by"] == "y"


def test_a_forks_history_takes_filter_before_and_limit(store_url: str, tmp_path: Path) -> None:
    world, saver, graph, thread, base = forked(store_url, tmp_path)
    by_token = {"configurable": {"thread_id": thread, "fork_token": "again"}}
    graph.invoke(Command(resume="f"), by_token)
    line = list(graph.get_state_history(by_token))
    steps = [s.metadata["step"] for s in line]
    assert steps == sorted(steps, reverse=True) and steps[-1] == -1
    assert [s.metadata["source"] for s in line].count("fork") == 1
    assert [s.metadata["step"] for s in graph.get_state_history(by_token, limit=2)] == steps[:2]
    loops = [s.metadata["step"] for s in line if s.metadata["source"] == "loop"]
    only = graph.get_state_history(by_token, filter={"source": "loop"}, limit=3)
    assert [s.metadata["step"] for s in only] == loops[:3]
    older = graph.get_state_history(by_token, before=line[1].config, limit=2)
    assert [s.metadata["step"] for s in older] == steps[2:4]
    main = {"configurable": {"thread_id": thread}}
    assert graph.get_state(main).next == ("approve",)  # the fork left main where it was
