"""RemitSaver probed where the earlier rounds stopped: values of classes LangGraph's
encoding cannot bring back as they were stored (a class defined in a function or in
another class, a dataclass field with `init=False`, a required model field excluded
from its dump, an enum member whose value is a tuple). Such a write was accepted, and
the thread then read back another class of the same name (a wrong state) or could not
be read or resumed at all; it is now refused at write time, naming the field and why,
and the thread stays as it was. Real LangGraph, real stores on every engine."""

# (No `from __future__ import annotations`: the state types of `parcel_graph` must name
# its local class, as they do in code that does not defer its annotations.)
import dataclasses
import enum
import operator
import uuid
from typing import Annotated, Any

import pytest
from langgraph.graph import START, StateGraph
from langgraph.types import interrupt
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from remit_core.errors import CheckpointInvalid
from remit_langgraph import RemitSaver


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}"}}


# -- a class its module and name do not lead to ----------------------------------------


class Parcel(BaseModel):
    """The module's own `Parcel`: another class than the one `parcel_graph` stores."""

    label: str
    weight: int = 0


def parcel_graph(saver: RemitSaver) -> tuple[Any, type[BaseModel]]:
    """A graph built in a function, as tests and app factories do, whose state holds a
    `Parcel` of its own (local: `__main__`-style lookup by name finds the module's)."""

    class Parcel(BaseModel):
        label: str
        weight: int
        fragile: bool

    class Shipment(TypedDict):
        parcel: Parcel | None
        log: Annotated[list[str], operator.add]

    def pack(state: Shipment) -> dict[str, Any]:
        return {"parcel": Parcel(label="vase", weight=3, fragile=True), "log": ["pack"]}

    def approve(state: Shipment) -> dict[str, Any]:
        return {"log": [f"approve:{interrupt('ship it?')}"]}

    builder = StateGraph(Shipment)
    builder.add_node("prepare", lambda state: {"log": ["prepare"]})
    builder.add_node("pack", pack)
    builder.add_node("approve", approve)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "pack")
    builder.add_edge("pack", "approve")
    return builder.compile(checkpointer=saver), Parcel


def test_a_value_of_a_class_defined_in_a_function_is_refused_not_read_back_as_another(
    url: str,
) -> None:
    """A node returns an instance of a class defined in the function that built the
    graph. LangGraph's encoding names it `<module>.Parcel`; the module's own `Parcel`
    is another class, so the stored value read back as that one (a wrong state: the
    `fragile` flag gone), and a module without one made the thread unreadable. The
    write is refused with `CheckpointInvalid` naming the key and saying to define the
    class at module level; the head stays at the last valid checkpoint, readable."""
    saver = RemitSaver(url)
    graph, local = parcel_graph(saver)
    cfg = config()
    with pytest.raises(CheckpointInvalid) as refused:
        graph.invoke({"parcel": None, "log": []}, cfg)
    assert "parcel" in str(refused.value.field)
    assert "module level" in str(refused.value)
    state = graph.get_state(cfg)
    assert state.values == {"parcel": None, "log": ["prepare"]}
    assert state.next == ("pack",)
    # Nothing read back anywhere is the module's `Parcel` taken for the local one.
    for snapshot in graph.get_state_history(cfg):
        assert not isinstance(snapshot.values.get("parcel"), (Parcel, local))

    # Continuing runs `pack` again and is refused the same way, never a read failure.
    with pytest.raises(CheckpointInvalid):
        graph.invoke(None, cfg)
    assert graph.get_state(cfg).next == ("pack",)


# -- classes LangGraph's encoding cannot rebuild ----------------------------------------


class Holder:
    class Inner(BaseModel):  # `__name__` Inner: `<module>.Inner` names nothing
        size: int


@dataclasses.dataclass
class Stamped:
    body: str
    digest: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.digest = len(self.body)


class Secret(BaseModel):
    user: str
    token: str = Field(exclude=True)


class Size(enum.Enum):
    SMALL = (1, "s")
    LARGE = (9, "l")


def local_dataclass() -> Any:
    @dataclasses.dataclass
    class Note:
        text: str

    return Note(text="hi")


#: (a value of the class, words the refusal must hold).
UNREADABLE = [
    pytest.param(Holder.Inner(size=1), "module level", id="nested-class"),
    pytest.param(local_dataclass(), "module level", id="local-dataclass"),
    pytest.param(Stamped("abc"), "init=False", id="init-false-field"),
    pytest.param(Secret(user="u", token="t"), "exclude=True", id="excluded-required-field"),
    pytest.param(Size.SMALL, "tuple values", id="enum-of-tuples"),
]


class Box(TypedDict):
    thing: Any
    log: Annotated[list[str], operator.add]


@pytest.mark.parametrize(("value", "why"), UNREADABLE)
def test_a_value_its_class_cannot_rebuild_is_refused_at_write_and_the_thread_stays_readable(
    url: str, value: Any, why: str
) -> None:
    """Each class is allowlisted, so its values passed the write check and were stored;
    each then failed to rebuild on the next read (`CorruptRecord`: a resume, a
    `get_state`, the listing all failed, the thread lost). Now the write is refused,
    naming the key and the reason; the thread reads and resumes from where it stood."""
    saver = RemitSaver(url, allowlist=[type(value)])
    builder = StateGraph(Box)
    builder.add_node("first", lambda state: {"log": ["first"]})
    builder.add_node("put", lambda state: {"thing": value, "log": ["put"]})
    builder.add_edge(START, "first")
    builder.add_edge("first", "put")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    with pytest.raises(CheckpointInvalid) as refused:
        graph.invoke({"thing": None, "log": []}, cfg)
    assert "thing" in str(refused.value.field)
    assert why in str(refused.value)
    assert graph.get_state(cfg).values == {"thing": None, "log": ["first"]}
    assert len(list(graph.get_state_history(cfg))) == 3
