"""Round 26 probes of RemitSaver: its options. A saver of a new workflow version that
lists the older one in `accept_versions` (a rolling upgrade) must read the checkpoints
it writes itself; a mistyped option (`accept_versions="v1"`, a `workflow_version` that
is no str, an `allowlist` or `state_schema` that names nothing, a `store` or `serde` of
the wrong kind) must be refused where the saver is made, naming the option, before any
node runs. Real LangGraph, real stores on every engine."""

from __future__ import annotations

import operator
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from remit_core import VersionMismatch
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
    return {"configurable": {"thread_id": f"p26-{uuid.uuid4().hex}"}}


def test_a_saver_listing_an_older_version_reads_the_checkpoints_it_writes(url: str) -> None:
    """`RemitSaver(url, workflow_version="v2", accept_versions=["v1"])`: threads paused
    under v1 are resumed by v2. The saver took `accept_versions` as the whole set it
    reads, without its own version: right after resuming a v1 thread, `get_state` of it
    raised `VersionMismatch` for the v2 checkpoint it had just written, and a new
    thread it paused could never be resumed or read."""
    entered: list[str] = []
    old_thread, new_thread = _config(), _config()
    _graph(RemitSaver(url, workflow_version="v1"), entered).invoke({"log": []}, old_thread)
    upgraded = _graph(RemitSaver(url, workflow_version="v2", accept_versions=["v1"]), entered)

    done = upgraded.invoke(Command(resume="alice"), old_thread)
    assert done["log"] == ["prepare", "approved:alice"]
    assert upgraded.get_state(old_thread).values["log"] == ["prepare", "approved:alice"]

    upgraded.invoke({"log": []}, new_thread)
    assert upgraded.get_state(new_thread).next == ("approve",)
    done = upgraded.invoke(Command(resume="bob"), new_thread)
    assert done["log"] == ["prepare", "approved:bob"]
    # A version it does not list is still refused (P4).
    stranger = _graph(RemitSaver(url, workflow_version="v3", accept_versions=["v1"]), entered)
    with pytest.raises(VersionMismatch):
        stranger.get_state(new_thread)


class _NotASerializer:
    def dumps(self, value: Any) -> bytes:
        return b""


@pytest.mark.parametrize(
    ("option", "options"),
    [
        ("accept_versions", {"workflow_version": "v1", "accept_versions": "v1"}),
        ("accept_versions", {"accept_versions": [1]}),
        ("workflow_version", {"workflow_version": 2}),
        ("workflow_version", {"workflow_version": None}),
        ("allowlist", {"allowlist": "orders"}),
        ("allowlist", {"allowlist": [("orders",)]}),
        ("state_schema", {"state_schema": "Order"}),
        ("state_schema", {"state_schema": int}),
        ("serde", {"serde": _NotASerializer()}),
        ("store", {"store": None}),
        ("store", {"store": Path("orders.db")}),
    ],
)
def test_a_mistyped_option_is_refused_naming_it_before_any_node_runs(
    tmp_path: Path, option: str, options: dict[str, Any]
) -> None:
    """Each of these was taken as it stood: `accept_versions="v1"` as the versions "v"
    and "1" (the thread's next read raised `VersionMismatch` for "v1"), a
    `workflow_version` that is no str failed the first commit after a node had run, an
    `allowlist` string or one-part entry and a `state_schema` with no keys were
    silently ignored (nothing checked), and a wrong `store` or `serde` failed with an
    `AttributeError` that named neither."""
    entered: list[str] = []
    options = {"store": f"sqlite:///{tmp_path}/remit.db", **options}
    store = options.pop("store")
    config = _config()
    with pytest.raises(TypeError, match=option):
        graph = _graph(RemitSaver(store, **options), entered)
        graph.invoke({"log": []}, config)
        graph.invoke(Command(resume="alice"), config)
        graph.get_state(config)
    assert entered == []
