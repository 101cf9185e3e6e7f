"""RemitSaver's serializer: LangGraph's wire format, the allowlist walk's shortcuts,
and models rebuilt by their own validation, through a real store on every engine."""

from __future__ import annotations

import collections
import dataclasses
import uuid
from typing import Any, ClassVar

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator

from remit_core.errors import CheckpointInvalid, CorruptRecord
from remit_langgraph import RemitSaver
from remit_langgraph._serde import StrictSerializer


@dataclasses.dataclass(frozen=True)
class Unlisted:
    """A type no allowlist names."""

    n: int = 1


Pair = collections.namedtuple("Pair", "left right")


class Tagged(dict):  # type: ignore[type-arg]
    """A dict subclass: stored as a dict."""


class Ticket(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    title: str
    extra: dict[str, Any] = Field(default_factory=dict)
    tags: list[str] = Field(default_factory=list)
    built: ClassVar[int] = 0

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        Ticket.built += 1


class Scores(RootModel[list[int]]):
    pass


class Positive(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def positive(cls, n: int) -> int:
        if n <= 0:
            raise ValueError("must be positive")
        return n


def chat() -> list[Any]:
    return [
        HumanMessage(content="hello", id="h1"),
        AIMessage(content="hi", id="a1", response_metadata={"model": "m", "tokens": 3}),
        AIMessage(content="", id="a2", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "c1"}]),
    ]


def test_a_chat_is_stored_byte_for_byte_as_langgraph_stores_it() -> None:
    messages = chat()
    ours = StrictSerializer().dumps_typed(messages)
    assert ours == JsonPlusSerializer().dumps_typed(messages)
    assert StrictSerializer().loads_typed(ours) == messages


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (Ticket(title="t", extra={"k": Unlisted()}), "<value>.extra.k"),
        (Ticket(title="t", tags=[], extra={"k": [1, Unlisted()]}), "<value>.extra.k[1]"),
        ({"a": "", "b": [], "c": {"d": Unlisted()}}, "<value>.c.d"),
        (["x", "", [], [Unlisted()]], "<value>[3][0]"),
        (Pair("x", Unlisted()), "<value>[1]"),
        ({"ok": 1, "bad": frozenset({Unlisted()})}, "<value>.bad[0]"),
    ],
)
def test_a_type_not_allowed_is_refused_where_it_sits(value: Any, where: str) -> None:
    serde = StrictSerializer(allowlist=[Ticket, Pair])
    with pytest.raises(CheckpointInvalid) as err:
        serde.dumps_typed(value)
    assert err.value.field == where
    assert "Unlisted" in str(err.value)


def test_plain_data_and_empty_containers_pass_the_walk_and_read_back_equal() -> None:
    serde = StrictSerializer(allowlist=[Ticket, Pair])
    value = {
        "ticket": Ticket(title="t", extra={}, tags=[]),
        "pair": Pair("a", ""),
        "empty": [[], {}, (), "", 0, None, False],
        "tagged": Tagged(a=1),
    }
    back = serde.loads_typed(serde.dumps_typed(value))
    assert back["ticket"] == value["ticket"]
    assert back["pair"] == value["pair"]
    assert back["empty"] == [[], {}, [], "", 0, None, False]
    assert back["tagged"] == {"a": 1}


def test_a_model_with_its_own_init_is_built_once_per_read_and_validated() -> None:
    serde = StrictSerializer(allowlist=[Ticket, Positive])
    stored = serde.dumps_typed([Ticket(title="a"), Ticket(title="b")])
    Ticket.built = 0
    assert [t.title for t in serde.loads_typed(stored)] == ["a", "b"]
    assert Ticket.built == 2
    # A stored model whose fields fail its validation is refused, not rebuilt.
    bad = JsonPlusSerializer().dumps_typed(Positive.model_construct(n=-1))
    with pytest.raises(CorruptRecord, match="Positive"):
        serde.loads_typed(bad)


def test_a_root_model_round_trips(store_url: str) -> None:
    saver = RemitSaver(store_url, allowlist=[Scores])
    config: Any = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}", "checkpoint_ns": ""}}
    checkpoint = empty_checkpoint()
    version = saver.get_next_version(None, None)
    checkpoint["channel_values"] = {"scores": Scores([3, 1]), "chat": chat()}
    checkpoint["channel_versions"] = {"scores": version, "chat": version}
    stored = saver.put(
        config, checkpoint, {"source": "input", "step": -1}, {"scores": version, "chat": version}
    )
    fresh = RemitSaver(store_url, allowlist=[Scores])  # nothing cached: read from the store
    found = fresh.get_tuple(stored)
    assert found is not None
    values = found.checkpoint["channel_values"]
    assert values["scores"] == Scores([3, 1])
    assert values["chat"] == chat()
