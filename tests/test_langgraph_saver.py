"""RemitSaver beyond the conformance suite: async, serialization, corruption, versions, schemas."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import pickle
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import pytest
from annotated_types import Ge, MinLen
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, RemoveMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    computed_field,
    field_validator,
    model_validator,
)
from typing_extensions import TypedDict

from remit_core import (
    CheckpointInvalid,
    CorruptRecord,
    RemitError,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
    WriteRecord,
    effect,
    failpoints,
)
from remit_langgraph import AsyncRemitSaver, RemitSaver


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}


def one_node(state_type: Any, node: Any, saver: RemitSaver) -> Any:
    builder = StateGraph(state_type)
    builder.add_node("node", node)
    builder.add_edge(START, "node")
    builder.add_edge("node", END)
    return builder.compile(checkpointer=saver)


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Free(TypedDict, total=False):
    value: Any
    n: int


class Located(TypedDict, total=False):
    at: Point


# -- claims ---------------------------------------------------------------------------


def counting_releases(saver: RemitSaver, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The claims released by a call of their own (not with a commit)."""
    store = saver.remit.store
    released: list[Any] = []
    real = store.release_claim

    def release_claim(claim: Any) -> None:
        released.append(claim)
        real(claim)

    monkeypatch.setattr(store, "release_claim", release_claim)
    return released


def test_a_graphs_edit_takes_the_claim_and_a_put_of_code_driving_the_saver_does_not(
    store_url: str,
) -> None:
    """`update_state` is refused while a run holds the thread, so it takes the claim;
    a put made by code that drives the saver itself has the head's compare-and-set."""
    saver = RemitSaver(store_url)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"n": 1}
    checkpoint["channel_versions"] = {"n": saver.get_next_version(None, None)}
    stored = saver.put(cfg, checkpoint, {"source": "input", "step": -1}, {})
    assert saver.remit.store.get_claim(thread, "main") is None
    graph = one_node(Free, lambda s: {"n": s["n"] + 1}, saver)
    graph.update_state(stored, {"n": 3})
    claim = saver.remit.store.get_claim(thread, "main")
    assert claim is not None and claim.holder == "" and claim.fence == 1
    assert graph.get_state(cfg).values["n"] == 3


@pytest.mark.parametrize("durability", ["exit", "sync", "async"])
def test_a_finished_exit_mode_run_gives_its_claim_up_with_its_last_commit(
    store_url: str, durability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = RemitSaver(store_url)
    released = counting_releases(saver, monkeypatch)
    graph = one_node(Free, lambda s: {"n": s["n"] + 1}, saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    assert graph.invoke({"n": 1}, cfg, durability=durability)["n"] == 2
    claim = saver.remit.store.get_claim(thread, "main")
    assert claim is not None and claim.holder == "" and claim.fence == 1
    # Redis gives the claim up after the commit, in a call of its own.
    with_commit = durability == "exit" and not store_url.startswith("redis")
    assert len(released) == (0 if with_commit else 1)
    # The thread is free as soon as the run returns.
    assert graph.invoke({"n": 5}, cfg, durability=durability)["n"] == 6
    assert saver.get_tuple(cfg).checkpoint["channel_values"]["n"] == 6  # type: ignore[union-attr]


def test_an_async_exit_mode_run_gives_its_claim_up_with_its_last_commit(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = AsyncRemitSaver(store_url)
    released = counting_releases(saver, monkeypatch)
    graph = one_node(Free, lambda s: {"n": s["n"] + 1}, saver)
    cfg = config()
    assert asyncio.run(graph.ainvoke({"n": 1}, cfg, durability="exit"))["n"] == 2
    claim = saver.remit.store.get_claim(cfg["configurable"]["thread_id"], "main")
    assert claim is not None and claim.holder == ""
    assert len(released) == (1 if store_url.startswith("redis") else 0)


@pytest.mark.parametrize("lease", [0, -5, float("nan")])
def test_a_lease_that_would_end_mutual_exclusion_is_refused_before_the_store_opens(
    tmp_path: Any, lease: float
) -> None:
    path = tmp_path / "never.db"
    with pytest.raises(ValueError, match="lease"):
        RemitSaver(f"sqlite:///{path}", lease=lease)
    assert not path.exists()


class LoggingSaver(RemitSaver):
    """A user's subclass: overrides that log, then call `super()`."""

    calls: list[str]

    def get_tuple(self, config: Any) -> Any:
        self.calls.append("get_tuple")
        return super().get_tuple(config)

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        self.calls.append("put")
        return super().put(config, checkpoint, metadata, new_versions)


def test_a_subclass_that_calls_super_keeps_claims_schemas_and_the_last_commits_release(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = LoggingSaver(store_url)
    saver.calls = []
    released = counting_releases(saver, monkeypatch)
    graph = one_node(Priced, lambda s: {"amount": s.amount + 1}, saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    assert graph.invoke({"amount": 1}, cfg, durability="exit")["amount"] == 2
    assert saver.calls == ["get_tuple", "put"]
    claim = saver.remit.store.get_claim(thread, "main")
    assert claim is not None and claim.holder == "" and claim.fence == 1
    assert len(released) == (1 if store_url.startswith("redis") else 0)
    # Outside a run too, the graph above the override is found: its schema applies.
    with pytest.raises(CheckpointInvalid) as err:
        graph.update_state(cfg, {"amount": -5})
    assert err.value.field == "amount"
    assert graph.get_state(cfg).values["amount"] == 2


@pytest.mark.parametrize("how", ["ainvoke", "astream"])
def test_an_update_after_an_async_run_in_the_same_task_is_not_the_runs_write(
    store_url: str, how: str
) -> None:
    """LangGraph's async loop unwinds its exit stack in a task of its own: the caller's
    context still names the finished run, whose claim is given up."""
    saver = AsyncRemitSaver(store_url)
    graph = one_node(Free, lambda s: {"n": s["n"] + 1}, saver)
    cfg = config()

    async def run_then_update() -> Any:
        if how == "ainvoke":
            await graph.ainvoke({"n": 1}, cfg)
        else:
            async for _ in graph.astream({"n": 1}, cfg):
                pass
        await graph.aupdate_state(cfg, {"n": 7})
        await graph.ainvoke({"n": 10}, cfg)  # and the next run in the task claims anew
        return (await graph.aget_state(cfg)).values["n"]

    assert asyncio.run(run_then_update()) == 11
    updates = [s for s in graph.get_state_history(cfg) if s.metadata["source"] == "update"]
    assert [s.values["n"] for s in updates] == [7]


@pytest.mark.parametrize("durability", ["exit", "sync"])
def test_a_run_on_a_thread_starts_from_the_claim_read_alone(
    store_url: str, durability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New input on a thread: the claim brings the head and its writes; the channel
    values this saver wrote (or knows empty) and the interrupts are not read again."""
    saver = RemitSaver(store_url)
    builder = StateGraph(Free)
    builder.add_node("a", lambda s: {"n": s["n"] + 1})
    builder.add_node("b", lambda s: {"value": [s["n"]]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    graph.invoke({"n": 1}, cfg, durability=durability)
    reads: list[str] = []
    store = saver.remit.store
    for name in ("get_blobs", "list_interrupts"):
        real = getattr(store, name)

        def read(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            reads.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, name, read)
    out = graph.invoke({"n": 10}, cfg, durability=durability)
    assert out == {"n": 11, "value": [11]} and reads == []
    # Another saver (no cache) reads the same state back from the store.
    fresh = RemitSaver(store_url).get_tuple(cfg)
    assert fresh is not None and fresh.checkpoint["channel_values"]["value"] == [11]


def test_an_interrupted_exit_mode_run_keeps_its_claim_until_its_writes_are_stored(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = RemitSaver(store_url)
    released = counting_releases(saver, monkeypatch)
    graph = one_node(Free, lambda s: {"value": interrupt("?")}, saver)
    cfg = config()
    graph.invoke({"n": 1}, cfg, durability="exit")
    assert len(released) == 1  # after the interrupt's writes, not with the commit
    state = graph.get_state(cfg)
    assert state.next == ("node",) and [i.value for i in state.interrupts] == ["?"]
    assert graph.invoke(Command(resume="a"), cfg, durability="exit")["value"] == "a"


# -- async --------------------------------------------------------------------------


def test_async_run_keeps_the_contract_and_never_blocks_the_loop(store_url: str) -> None:
    applied: list[str] = []

    @effect(idempotent=True)
    async def send(*, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "sent"

    async def ask(state: Free) -> dict[str, Any]:
        answer = interrupt("go?")
        return {"value": [answer, await send()]}

    saver = AsyncRemitSaver(store_url)
    graph = one_node(Free, ask, saver)
    cfg = config()

    async def main() -> tuple[list[float], list[str]]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        failpoints.arm("checkpoint.before_commit", "sleep:0.5")
        try:
            await graph.ainvoke({"n": 1}, cfg)
            outcomes = await asyncio.gather(
                graph.ainvoke(Command(resume="yes"), cfg),
                graph.ainvoke(Command(resume="no"), cfg),
                return_exceptions=True,
            )
        finally:
            failpoints.disarm()
            stop.set()
            await tick
        return gaps, [type(o).__name__ for o in outcomes]

    gaps, outcomes = asyncio.run(main())
    assert sorted(outcomes) == ["ResumeConflict", "dict"]
    assert len(applied) == 1
    # Each commit slept 500 ms in a worker thread; had one run on the event loop, the
    # ticker would have seen a gap of at least that long.
    assert len(gaps) > 20 and max(gaps) < 0.45, max(gaps)
    assert asyncio.run(graph.aget_state(cfg)).values["value"][1] == "sent"


# -- serialization ------------------------------------------------------------------


def test_an_unknown_type_is_refused_at_write_time(store_url: str) -> None:
    saver = RemitSaver(store_url)
    graph = one_node(Free, lambda s: {"value": Point(1, 2)}, saver)
    cfg = config()
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"n": 1}, cfg)
    assert err.value.field == "value"
    assert "Point" in str(err.value)
    assert graph.get_state(cfg).values.get("value") is None

    allowed = one_node(
        Free, lambda s: {"value": Point(1, 2)}, RemitSaver(store_url, allowlist=[Point])
    )
    assert allowed.invoke({"n": 1}, config())["value"] == Point(1, 2)


def test_the_graphs_schema_types_are_allowed_and_read_back_typed(store_url: str) -> None:
    saver = RemitSaver(store_url)
    graph = one_node(Located, lambda s: {"at": Point(3, 4)}, saver)
    cfg = config()
    graph.invoke({}, cfg)
    assert graph.get_state(cfg).values["at"] == Point(3, 4)
    stranger = RemitSaver(store_url)  # knows no graph: the type is not allowed to load
    with pytest.raises(CorruptRecord) as err:
        stranger.get_tuple(cfg)
    assert "Point" in str(err.value)


class Aliased(BaseModel):
    user_name: str = Field(alias="userName")


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def double(self) -> int:
        return self.a * 2


class InOut(BaseModel):
    x: int = Field(validation_alias="x_in", serialization_alias="x_out")


class Pair(NamedTuple):
    left: int
    right: str


class Records(TypedDict, total=False):
    aliased: Aliased
    closed: Closed
    in_out: InOut
    pair: Pair


def test_models_with_aliases_or_computed_fields_are_stored_and_read_back_validated(
    store_url: str,
) -> None:
    made = {
        "aliased": Aliased(userName="bo"),
        "closed": Closed(a=2),
        "in_out": InOut(x_in=3),
        "pair": Pair(1, "r"),
    }
    cfg = config()
    one_node(Records, lambda s: made, RemitSaver(store_url)).invoke({}, cfg)
    # A fresh saver reads it back, as a process that restarts does.
    values = one_node(Records, lambda s: {}, RemitSaver(store_url)).get_state(cfg).values
    assert values == made
    assert [type(v) for v in values.values()] == [type(v) for v in made.values()]
    with pytest.raises(CheckpointInvalid):  # still checked on write
        one_node(
            Records, lambda s: {"closed": Closed.model_construct(a="x")}, RemitSaver(store_url)
        ).invoke({}, config())


def test_an_array_field_numpy_cannot_describe_to_pydantic_is_stored_and_read_back(
    store_url: str,
) -> None:
    np = pytest.importorskip("numpy")

    # (Built at run time: the module postpones annotations, and numpy is imported here.)
    Arrays = TypedDict("Arrays", {"grid": np.ndarray, "n": int}, total=False)  # type: ignore[misc]  # noqa: UP013

    cfg = config()
    graph = one_node(Arrays, lambda s: {"grid": np.arange(6).reshape(2, 3)}, RemitSaver(store_url))
    graph.invoke({"n": 1}, cfg)
    grid = graph.get_state(cfg).values["grid"]
    assert isinstance(grid, np.ndarray) and grid.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(CheckpointInvalid):  # the other keys are still checked
        one_node(Arrays, lambda s: {"n": "many"}, RemitSaver(store_url)).invoke({"n": 1}, config())


class Verdict(BaseModel):
    ok: bool
    by: str


class Judged(TypedDict, total=False):
    verdict: Verdict
    n: int


def test_a_resume_may_be_an_instance_of_the_interrupts_response_schema(store_url: str) -> None:
    graph = one_node(
        Judged,
        lambda s: {"verdict": interrupt("ok?", response_schema=Verdict)},
        RemitSaver(store_url),
    )
    cfg = config()
    graph.invoke({"n": 0}, cfg)
    with pytest.raises(CheckpointInvalid):
        graph.invoke(Command(resume={"ok": True}), cfg)
    done = graph.invoke(Command(resume=Verdict(ok=True, by="me")), cfg)
    assert done["verdict"] == Verdict(ok=True, by="me")


def test_a_stream_left_early_and_closed_lets_the_next_run_continue(store_url: str) -> None:
    async def scenario() -> tuple[list[Any], Any]:
        graph = three_steps(AsyncRemitSaver(store_url))
        cfg = config()
        seen = []
        stream = graph.astream({"big": [], "n": 0}, cfg, durability="sync")
        async with contextlib.aclosing(stream) as s:
            async for event in s:
                seen.append(event)
                break
        return seen, await graph.ainvoke(None, cfg)

    seen, final = asyncio.run(scenario())
    assert len(seen) == 1 and final["n"] == 3


def test_pickle_is_never_loaded(store_url: str) -> None:
    saver = RemitSaver(store_url)
    graph = one_node(Free, lambda s: {"n": 2}, saver)
    cfg = config()
    graph.invoke({"n": 1}, cfg)
    head = saver.get_tuple(cfg)
    assert head is not None
    thread = cfg["configurable"]["thread_id"]
    saver.remit.put_writes(
        [WriteRecord(thread, head.checkpoint["id"], "task", 0, "n", b"pickle\x00\x80\x04K\x07.")]
    )
    with pytest.raises(CorruptRecord) as err:
        saver.get_tuple(cfg)
    assert "pickle" in str(err.value)


class Explosive:
    """Unpickling it runs code: it touches a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def test_a_serializer_passed_in_is_held_to_the_allowlist_and_never_pickles(
    store_url: str, tmp_path: Any
) -> None:
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    marker = tmp_path / "unpickled"
    saver = RemitSaver(store_url, serde=JsonPlusSerializer(pickle_fallback=True))
    # Plain values go through the user's serializer and read back.
    graph = one_node(Free, lambda s: {"value": {"k": [1, "a"]}}, saver)
    cfg = config()
    graph.invoke({"n": 1}, cfg)
    assert graph.get_state(cfg).values == {"n": 1, "value": {"k": [1, "a"]}}
    # A type outside the allowlist is refused at write time, pickle fallback or not.
    bad = one_node(Free, lambda s: {"value": Explosive(str(marker))}, saver)
    with pytest.raises(CheckpointInvalid) as err:
        bad.invoke({"n": 1}, config())
    assert err.value.field == "value"
    # A pickled record is refused on read, wrapped or not, and nothing runs.
    for tag in (b"pickle", b"pickle+aes"):
        cfg = config()
        graph.invoke({"n": 1}, cfg)
        head = saver.get_tuple(cfg)
        assert head is not None
        payload = tag + b"\x00" + pickle.dumps(Explosive(str(marker)))
        thread = cfg["configurable"]["thread_id"]
        saver.remit.put_writes([WriteRecord(thread, head.checkpoint["id"], "t", 0, "n", payload)])
        with pytest.raises(CorruptRecord, match="never loads pickle"):
            saver.get_tuple(cfg)
    assert not marker.exists()


# -- records that do not verify ----------------------------------------------------------


def corrupt(saver: RemitSaver, thread: str, checkpoint_id: str) -> None:
    """Flip the last byte of a stored checkpoint, below the core (test only)."""
    store: Any = saver.remit.store
    raw = store.get_checkpoint(thread, "", checkpoint_id).state
    altered = raw[:-1] + bytes([raw[-1] ^ 0xFF])
    if store.url.startswith("redis"):
        from remit_core.stores.redis import _join, run_prefix

        key, field = run_prefix(thread) + "ck", _join(checkpoint_id, "")
        stored = store._client().hget(key, field)
        store._client().hset(key, field, stored[:-1] + bytes([stored[-1] ^ 0xFF]))
        return
    with store._txn() as txn:
        txn.execute(
            "UPDATE remit_checkpoints SET state = ? WHERE run_id = ? AND checkpoint_id = ?",
            (altered, thread, checkpoint_id),
        )


def test_a_checkpoint_body_of_format_1_still_reads(store_url: str) -> None:
    """Bodies were tagged JSON before the msgpack format; such records keep reading."""
    from remit_core import codec
    from remit_langgraph import _records as rec

    saver = RemitSaver(store_url)
    thread = f"t-{uuid.uuid4().hex}"
    inline = {"n": rec.pack(saver.serde.dumps_typed(5))}
    body = {
        "lg": 1,
        "v": 4,
        "ts": "2026-11-30T00:00:00+00:00",
        "channel_versions": {"n": "1"},
        "versions_seen": {"node": {"n": "1"}},
        "updated_channels": ["n"],
        "inline": inline,
    }
    saver.remit.commit(run_id=thread, checkpoint_id="c1", parent_id=None, state=codec.dumps(body))
    got = saver.get_tuple({"configurable": {"thread_id": thread}})
    assert got is not None
    assert got.checkpoint["channel_values"] == {"n": 5}
    assert got.checkpoint["versions_seen"] == {"node": {"n": "1"}}
    listed = saver.list({"configurable": {"thread_id": thread}})
    assert [c.config["configurable"]["checkpoint_id"] for c in listed] == ["c1"]
    saver.delete_thread(thread)


def test_a_corrupt_checkpoint_is_a_clear_error(store_url: str) -> None:
    saver = RemitSaver(store_url)
    graph = one_node(Free, lambda s: {"n": s["n"] + 1}, saver)
    cfg = config()
    graph.invoke({"n": 1}, cfg)
    thread = cfg["configurable"]["thread_id"]
    head = graph.get_state(cfg).config["configurable"]["checkpoint_id"]
    corrupt(saver, thread, head)
    for attempt in (lambda: graph.get_state(cfg), lambda: graph.invoke(None, cfg)):
        with pytest.raises(CorruptRecord) as err:
            attempt()
        assert (err.value.run_id, err.value.checkpoint_id) == (thread, head)


def test_a_listing_of_the_whole_store_skips_another_shims_damaged_run(tmp_path: Path) -> None:
    """Other frameworks' runs may share the store: one of theirs that fails to verify
    is theirs to report; a damaged LangGraph checkpoint still is an error here.
    (A listing of the whole store: on a file only this test writes.)"""
    from remit_core import codec

    saver = RemitSaver(f"sqlite:///{tmp_path}/shared.db")
    saver.remit.commit(run_id="other", checkpoint_id="c1", parent_id=None, state=codec.dumps({}))
    corrupt(saver, "other", "c1")
    graph = one_node(Free, lambda s: {"n": s["n"] + 1}, saver)
    cfg = config()
    graph.invoke({"n": 1}, cfg)
    listed = list(saver.list(None))
    assert {c.config["configurable"]["thread_id"] for c in listed} == {
        cfg["configurable"]["thread_id"]
    }
    corrupt(
        saver, cfg["configurable"]["thread_id"], listed[0].config["configurable"]["checkpoint_id"]
    )
    with pytest.raises(CorruptRecord):
        list(saver.list(None))


def test_another_workflow_version_is_refused(store_url: str) -> None:
    node = lambda s: {"n": s["n"] + 1}  # noqa: E731
    cfg = config()
    one_node(Free, node, RemitSaver(store_url, workflow_version="v1")).invoke({"n": 1}, cfg)
    v2 = one_node(Free, node, RemitSaver(store_url, workflow_version="v2"))
    with pytest.raises(VersionMismatch) as err:
        v2.invoke(None, cfg)
    assert err.value.run_id == cfg["configurable"]["thread_id"]
    both = RemitSaver(store_url, workflow_version="v2", accept_versions=["v1", "v2"])
    assert one_node(Free, node, both).get_state(cfg).values["n"] == 2


# -- schemas --------------------------------------------------------------------------


class Priced(BaseModel):
    amount: int = Field(default=0, ge=0)
    note: str = ""


def test_a_pydantic_state_is_checked_with_its_constraints(store_url: str) -> None:
    saver = RemitSaver(store_url)
    cfg = config()
    bad = one_node(Priced, lambda s: {"amount": -3}, saver)
    with pytest.raises(CheckpointInvalid) as err:
        bad.invoke({"amount": 1}, cfg)
    assert err.value.field == "amount"
    good = one_node(Priced, lambda s: {"amount": s.amount + 1}, saver)
    assert good.invoke(None, cfg)["amount"] == 2


def test_an_explicit_state_schema_applies_to_any_graph(store_url: str) -> None:
    class Strict(TypedDict):
        n: int
        value: str

    saver = RemitSaver(store_url, state_schema=Strict)
    graph = one_node(Free, lambda s: {"value": 12}, saver)
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"n": 1}, config())
    assert err.value.field == "value"


class Answers(TypedDict):
    answers: Annotated[list[str], operator.add]


class Unlisted:
    """A type no serializer allowlist names."""


def test_a_resume_map_with_one_refused_value_consumes_none_of_its_interrupts(
    store_url: str,
) -> None:
    builder = StateGraph(Answers)
    for name in ("n1", "n2"):
        builder.add_node(name, lambda s, name=name: {"answers": [f"{name}={interrupt(name)}"]})
        builder.add_edge(START, name)
    saver = RemitSaver(store_url)
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    graph.invoke({"answers": []}, cfg)
    ids = {i.value: i.id for i in graph.get_state(cfg).interrupts}
    with pytest.raises(CheckpointInvalid):
        graph.invoke(Command(resume={ids["n1"]: "ok", ids["n2"]: Unlisted()}), cfg)
    thread = cfg["configurable"]["thread_id"]
    assert {i.status for i in saver.remit.interrupts(thread)} == {"pending"}
    # Nothing was taken: a corrected map answers both, with its own values.
    out = graph.invoke(Command(resume={ids["n1"]: "ok2", ids["n2"]: "fine"}), cfg)
    assert sorted(out["answers"]) == ["n1=ok2", "n2=fine"]


class Logged(TypedDict):
    amount: int
    log: Annotated[list[str], operator.add]


@pytest.mark.parametrize("bad", [[1, 2], "notalist", None], ids=["ints", "str", "none"])
@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_refused_reducer_write_is_not_stored_and_the_thread_stays_readable(
    store_url: str, bad: Any, durability: str
) -> None:
    saver = RemitSaver(store_url)
    builder = StateGraph(Logged)
    builder.add_node("ok", lambda s: {"log": ["ok"]})
    builder.add_node("bad", lambda s: {"log": bad})
    builder.add_edge(START, "ok")
    builder.add_edge("ok", "bad")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    with pytest.raises((CheckpointInvalid, TypeError)):  # (the reducer may raise first)
        graph.invoke({"amount": 1, "log": []}, cfg, durability=durability)
    head = saver.get_tuple(cfg)
    assert head is not None and head.pending_writes == []
    state = graph.get_state(cfg)
    assert state.values == {"amount": 1, "log": ["ok"]} and state.next == ("bad",)


class Tally(TypedDict):
    counts: Annotated[list[Annotated[int, Ge(0)]], operator.add]


class Ints(list):  # type: ignore[type-arg]
    """A list of another class: joined by `operator.add`, it makes a plain list."""


@pytest.mark.parametrize(
    "bad", [["1"], [True], [-1], (1, 2), [1.5]], ids=["str", "bool", "negative", "tuple", "float"]
)
@pytest.mark.parametrize("durability", ["exit", "sync"])
def test_a_list_appended_by_its_reducer_is_checked_item_by_item(
    store_url: str, bad: Any, durability: str
) -> None:
    """A key that `operator.add` appends to is checked as it is written: an item
    that is not of the list's item type, or breaks its constraint, is refused (no
    conversion), a list of another class that holds is taken."""
    saver = RemitSaver(store_url)
    builder = StateGraph(Tally)
    builder.add_node("good", lambda s: {"counts": Ints([1, 2])})
    builder.add_node("bad", lambda s: {"counts": bad})
    builder.add_edge(START, "good")
    builder.add_edge("good", "bad")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"counts": [0]}, cfg, durability=durability)
    assert str(err.value.field).startswith("counts")
    state = graph.get_state(cfg)
    assert state.values == {"counts": [0, 1, 2]} and state.next == ("bad",)


class Counted(TypedDict):
    log: Annotated[list[str], MinLen(2), operator.add]
    messages: Annotated[list[AnyMessage], add_messages]


def test_a_reducer_write_is_checked_as_a_part_not_as_the_whole(store_url: str) -> None:
    """One write of a list that must hold two items, and the removal of a message,
    are parts of the new value: neither is refused for what holds of the whole."""
    saver = RemitSaver(store_url)
    builder = StateGraph(Counted)
    builder.add_node("one", lambda s: {"log": ["c"], "messages": [RemoveMessage(id="m1")]})
    builder.add_edge(START, "one")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    start = {"log": ["a", "b"], "messages": [HumanMessage("hi", id="m1"), AIMessage("yo", id="m2")]}
    out = graph.invoke(start, cfg, durability="sync")
    assert out["log"] == ["a", "b", "c"] and [m.id for m in out["messages"]] == ["m2"]


class Large(TypedDict):
    big: list[str]
    n: int


def three_steps(saver: RemitSaver) -> Any:
    builder = StateGraph(Large)
    for name in ("a", "b", "c"):
        builder.add_node(name, lambda s: {"n": s["n"] + 1})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_a_channel_value_is_stored_once_per_version_not_with_every_checkpoint(
    store_url: str, durability: str
) -> None:
    """A channel no step writes keeps its version: later checkpoints name its one
    stored value, and a saver that never saw it (another process) reads it back."""
    big = [f"{i:04d}" + "x" * 996 for i in range(20)]  # 20 kB
    cfg = config()
    thread = cfg["configurable"]["thread_id"]
    three_steps(RemitSaver(store_url)).invoke({"big": big, "n": 0}, cfg, durability=durability)
    # A second run on the thread, by a saver with nothing cached.
    three_steps(RemitSaver(store_url)).invoke({"n": 10}, cfg, durability=durability)
    saver = RemitSaver(store_url)
    records = saver.remit.history(thread, verify=False)
    assert len(records) >= (10 if durability == "sync" else 2)
    assert max(len(r.state) for r in records) < 5_000  # no checkpoint carries the 20 kB value
    history = list(three_steps(RemitSaver(store_url)).get_state_history(cfg))
    with_big = [h for h in history if "big" in h.values]
    # All but the first run's input checkpoint (exit mode stores none).
    assert len(with_big) == len(history) - (durability == "sync")
    assert all(h.values["big"] == big for h in with_big)
    assert history[0].values == {"big": big, "n": 13}


def extend(state: list[int], writes: list[list[int]]) -> list[int]:
    return [*state, *(x for w in writes for x in w)]


class Deltas(TypedDict):
    log: Annotated[list[int], DeltaChannel(extend, snapshot_frequency=2)]
    n: int


def logging_steps(saver: Any, state: Any = Deltas) -> Any:
    """Two nodes, each appending the state's `n` to its `log` and counting `n` up."""
    builder = StateGraph(state)
    for name in ("a", "b"):
        builder.add_node(name, lambda s: {"log": [s["n"]], "n": s["n"] + 1})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["sync", "exit", "async", "ainvoke"])
def test_a_delta_channel_is_stored_and_rebuilt_as_langgraphs_own_saver_does(
    store_url: str, durability: str
) -> None:
    """`DeltaChannel` keys store snapshots every few updates and are rebuilt from the
    writes between them, also by a saver that never saw the thread."""
    cfg, reference = config(), InMemorySaver()
    for i in range(5):
        start = {"n": 10 * i}
        graph = logging_steps(RemitSaver(store_url))  # nothing cached: a new process
        if durability == "ainvoke":
            out = asyncio.run(graph.ainvoke(start, cfg))
        else:
            out = graph.invoke(start, cfg, durability=durability)
        mode = "async" if durability == "ainvoke" else durability
        expected = logging_steps(reference).invoke(start, cfg, durability=mode)
        assert out == expected
    assert out["log"] == [0, 1, 10, 11, 20, 21, 30, 31, 40, 41]
    reread = logging_steps(RemitSaver(store_url))
    assert reread.get_state(cfg).values == expected
    ours = [h.values for h in reread.get_state_history(cfg)]
    assert ours == [h.values for h in logging_steps(reference).get_state_history(cfg)]


def test_a_write_a_delta_channel_cannot_hold_is_refused_and_the_thread_stays_readable(
    store_url: str,
) -> None:
    saver = RemitSaver(store_url)
    cfg = config()
    logging_steps(saver).invoke({"n": 0}, cfg)
    builder = StateGraph(Deltas)
    builder.add_node("bad", lambda s: {"log": ["not a number"]})
    builder.add_edge(START, "bad")
    with pytest.raises(CheckpointInvalid) as refused:
        builder.compile(checkpointer=saver).invoke({"n": 5}, cfg, durability="sync")
    assert refused.value.field == "log[0]"
    # The head is the run's input checkpoint: the refused write is not in it.
    assert logging_steps(RemitSaver(store_url)).get_state(cfg).values == {"log": [0, 1], "n": 5}
    assert logging_steps(saver).invoke({"n": 7}, cfg)["log"] == [0, 1, 7, 8]


def test_a_copy_of_a_paused_thread_resumes_like_its_source(store_url: str) -> None:
    saver = RemitSaver(store_url)
    graph = one_node(Free, lambda s: {"value": interrupt("?")}, saver)
    source, copy = config(), config()
    graph.invoke({"n": 1}, source)
    saver.copy_thread(source["configurable"]["thread_id"], copy["configurable"]["thread_id"])
    assert graph.invoke(Command(resume="to-the-copy"), copy)["value"] == "to-the-copy"
    assert graph.invoke(Command(resume="to-the-source"), source)["value"] == "to-the-source"
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="again"), copy)


def test_a_run_cancelled_while_its_claim_is_taken_gives_the_claim_back(store_url: str) -> None:
    """`ainvoke` cancelled while the claim is taken in a worker thread: the thread takes
    it all the same, and the claim is given back then, not held by a heartbeat."""
    saver = AsyncRemitSaver(store_url, lease=30)
    graph = one_node(Free, lambda s: {"value": interrupt("?")}, saver)
    cfg = config()
    thread = cfg["configurable"]["thread_id"]

    async def cancel_then_recover() -> Any:
        await graph.ainvoke({"n": 1}, cfg)
        failpoints.arm("claim.after_acquire", "sleep:0.3")
        try:
            task = asyncio.ensure_future(graph.ainvoke(Command(resume="R"), cfg))
            await asyncio.sleep(0.1)  # the worker is inside the claim now
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            failpoints.disarm()
        for _ in range(50):  # given back within moments, far inside the 30 s lease
            claim = saver.remit.store.get_claim(thread, "main")
            if claim is not None and claim.holder == "":
                break
            await asyncio.sleep(0.05)
        return await graph.ainvoke(None, cfg)  # the accepted value is re-delivered

    assert asyncio.run(cancel_then_recover())["value"] == "R"


class Inner(TypedDict):
    x: int
    trail: Annotated[list[str], operator.add]


class Outer(TypedDict):
    x: int
    log: Annotated[list[str], operator.add]


def with_a_persistent_subgraph(saver: RemitSaver) -> Any:
    """p1 -> call_sub (a subgraph with a line of its own, `checkpointer=True`, that
    asks at s2) -> END."""

    def ask(state: Inner) -> dict[str, Any]:
        return {"trail": [f"s2:{interrupt('sub?')}"]}

    inner = StateGraph(Inner)
    inner.add_node("s1", lambda s: {"trail": ["s1"]})
    inner.add_node("s2", ask)
    inner.add_edge(START, "s1")
    inner.add_edge("s1", "s2")
    sub = inner.compile(checkpointer=True)

    def call_sub(state: Outer) -> dict[str, Any]:
        out = sub.invoke({"x": state["x"], "trail": []})
        return {"log": [",".join(out["trail"])]}

    outer = StateGraph(Outer)
    outer.add_node("p1", lambda s: {"log": ["p1"]})
    outer.add_node("call_sub", call_sub)
    outer.add_edge(START, "p1")
    outer.add_edge("p1", "call_sub")
    return outer.compile(checkpointer=saver)


@pytest.mark.parametrize("first", ["fork", "main"])
def test_a_fork_has_its_own_line_of_a_persistent_subgraph(store_url: str, first: str) -> None:
    """Each branch answers the subgraph's question with its own value (L3, P5)."""
    graph = with_a_persistent_subgraph(RemitSaver(store_url))
    main = config()
    graph.invoke({"x": 0, "log": []}, main)  # main asks inside the subgraph
    base = next(h for h in graph.get_state_history(main) if h.next == ("p1",))
    fork = {"configurable": {**base.config["configurable"], "fork_token": "again"}}
    graph.invoke(None, fork)  # the fork asks too
    answers = {"fork": (fork, "F"), "main": (main, "M")}
    order = [first, "main" if first == "fork" else "fork"]
    for name in order:
        cfg, value = answers[name]
        assert graph.invoke(Command(resume=value), cfg)["log"] == ["p1", f"s1,s2:{value}"]
    assert graph.get_state(main).values["log"] == ["p1", "s1,s2:M"]
    assert graph.get_state(fork).values["log"] == ["p1", "s1,s2:F"]


def test_a_fork_of_a_finished_run_restores_the_subgraph_line_as_it_stood_then(
    store_url: str,
) -> None:
    """A new input on a fork of run 1's end: the subgraph continues its line from
    where run 1 left it, not from what main's run 2 added since, and the fork's
    answer reaches the fork (L3)."""
    graph = with_a_persistent_subgraph(RemitSaver(store_url))
    main = config()
    for answer in ("M1", "M2"):  # two runs on main, each asked inside the subgraph
        graph.invoke({"x": 0, "log": []}, main)
        graph.invoke(Command(resume=answer), main)
    assert graph.get_state(main).values["log"][-1] == "s1,s2:M1,s1,s2:M2"
    run_1_end = [h for h in graph.get_state_history(main) if not h.next][-1]
    assert run_1_end.values["log"] == ["p1", "s1,s2:M1"]
    fork = {"configurable": {**run_1_end.config["configurable"], "fork_token": "redo"}}
    graph.invoke({"x": 0, "log": []}, fork)
    done = graph.invoke(Command(resume="F"), fork)
    assert done["log"] == ["p1", "s1,s2:M1", "p1", "s1,s2:M1,s1,s2:F"]
    assert graph.get_state(main).values["log"][-1] == "s1,s2:M1,s1,s2:M2"
    # The fork's history is its own line: the fork's run, then run 1's.
    by_token = {
        "configurable": {"thread_id": main["configurable"]["thread_id"], "fork_token": "redo"}
    }
    logs = [h.values.get("log") or [] for h in graph.get_state_history(by_token)]
    assert logs[0] == done["log"] and ["p1", "s1,s2:M1"] in logs
    assert not any("s1,s2:M1,s1,s2:M2" in log for log in logs)  # nothing of main's run 2


def test_a_resume_after_the_run_finished_is_refused(store_url: str) -> None:
    graph = one_node(Free, lambda s: {"value": interrupt("?")}, RemitSaver(store_url))
    cfg = config()
    graph.invoke({"n": 1}, cfg)
    assert graph.invoke(Command(resume="a"), cfg)["value"] == "a"
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="b"), cfg)


def test_a_resume_on_a_thread_with_no_checkpoint_is_refused_and_stores_nothing(
    store_url: str,
) -> None:
    saver = RemitSaver(store_url)
    graph = one_node(Free, lambda s: {"value": interrupt("?")}, saver)
    cfg = config()
    with pytest.raises(UnknownRecord, match="nothing to resume"):
        graph.invoke(Command(resume="a"), cfg)
    assert saver.get_tuple(cfg) is None
    graph.invoke({"n": 1}, cfg)  # the claim was given back: the thread starts as usual
    assert graph.invoke(Command(resume="b"), cfg)["value"] == "b"


def test_a_resume_by_id_after_the_run_finished_is_refused_as_consumed(store_url: str) -> None:
    graph = one_node(Free, lambda s: {"value": interrupt("?")}, RemitSaver(store_url))
    cfg = config()
    asked = graph.invoke({"n": 1}, cfg)["__interrupt__"][0]
    graph.invoke(Command(resume={asked.id: "a"}), cfg)
    with pytest.raises(ResumeConflict, match="already consumed"):
        graph.invoke(Command(resume={asked.id: "b"}), cfg)


def test_an_empty_resume_map_is_refused_and_the_interrupt_stays_pending(store_url: str) -> None:
    graph = one_node(Free, lambda s: {"value": interrupt("?")}, RemitSaver(store_url))
    cfg = config()
    graph.invoke({"n": 1}, cfg)
    with pytest.raises(ResumeConflict, match="empty resume map"):
        graph.invoke(Command(resume={}), cfg)
    assert graph.invoke(Command(resume="real"), cfg)["value"] == "real"


def test_a_run_with_a_fork_token_that_names_no_branch_is_refused(store_url: str) -> None:
    """A token without a checkpoint names a branch; a run with a token no branch has
    (a typo) is refused instead of writing to main. (A read gets the thread's latest
    checkpoint, as LangGraph itself asks with such a config.)"""
    graph = three_steps(RemitSaver(store_url))
    cfg = config()
    graph.invoke({"big": [], "n": 0}, cfg)
    typo = {"configurable": {**cfg["configurable"], "fork_token": "no-such-fork"}}
    with pytest.raises(UnknownRecord, match="no-such-fork"):
        graph.invoke({"big": [], "n": 100}, typo)
    assert graph.get_state(cfg).values["n"] == 3


def test_a_checkpoint_ns_that_is_not_a_string_is_a_clear_error(store_url: str) -> None:
    saver = RemitSaver(store_url)
    graph = one_node(Free, lambda s: {"n": 2}, saver)
    cfg = config()
    graph.invoke({"n": 1}, cfg)
    bad = {"configurable": {**cfg["configurable"], "checkpoint_ns": 5}}
    with pytest.raises(RemitError, match="checkpoint_ns must be a string, got 5"):
        saver.get_tuple(bad)
    with pytest.raises(RemitError, match="checkpoint_ns must be a string"):
        list(saver.list(bad))
    assert graph.get_state(cfg).values == {"n": 2}


class Typed(TypedDict, total=False):
    amount: Annotated[int, Ge(0)]
    ratio: float
    flag: bool
    tags: list[int]


@pytest.mark.parametrize(
    "write",
    [{"amount": "5"}, {"amount": 5.0}, {"amount": True}, {"flag": 1}, {"tags": ["1"]}],
    ids=["str-for-int", "float-for-int", "bool-for-int", "int-for-bool", "str-in-list"],
)
def test_a_value_valid_only_once_converted_is_refused(store_url: str, write: Any) -> None:
    """P4: LangGraph stores what a node returns, so a value the schema accepts only by
    converting it ("5" for an int) would be stored as the wrong type."""
    cfg = config()
    graph = one_node(Typed, lambda s: write, RemitSaver(store_url))
    with pytest.raises(CheckpointInvalid) as err:
        graph.invoke({"amount": 1}, cfg)
    assert err.value.field is not None and err.value.field.split(".")[0] in write
    with pytest.raises(CheckpointInvalid):
        graph.update_state(cfg, write)
    ok = one_node(Typed, lambda s: {"ratio": 2, "tags": [1]}, RemitSaver(store_url))
    assert ok.invoke({"amount": 1, "flag": False}, config())["ratio"] == 2  # an int is a float


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_refused_update_with_a_resume_leaves_the_interrupt_pending_and_the_thread_free(
    store_url: str, mode: str
) -> None:
    """The update is checked before the resume value is consumed, and the claim is
    given back at once (lease 30 s: a later run does not wait for it)."""
    graph = one_node(Typed, lambda s: {"amount": interrupt("how much?")}, RemitSaver(store_url))
    cfg = config()
    graph.invoke({"amount": 0}, cfg)
    bad = Command(resume=5, update={"amount": -1})
    with pytest.raises(CheckpointInvalid, match="amount"):
        graph.invoke(bad, cfg) if mode == "sync" else asyncio.run(graph.ainvoke(bad, cfg))
    assert graph.get_state(cfg).next == ("node",)  # still paused, nothing consumed
    assert graph.invoke(Command(resume=7, update={"ratio": 0.5}), cfg) == {
        "amount": 7,
        "ratio": 0.5,
    }


@pytest.mark.parametrize("durability", ["exit", "async", "sync"])
def test_refused_input_runs_no_node_and_stores_nothing(store_url: str, durability: str) -> None:
    entered: list[Any] = []
    graph = one_node(Typed, lambda s: entered.append(s) or {"flag": True}, RemitSaver(store_url))
    cfg = config()
    with pytest.raises(CheckpointInvalid, match="amount"):
        graph.invoke({"amount": "seven"}, cfg, durability=durability)
    assert entered == [] and graph.get_state(cfg).values == {}
    assert graph.invoke({"amount": 7}, cfg, durability=durability)["flag"] is True


def test_an_edit_while_a_run_is_in_flight_is_refused_and_the_run_keeps_its_result(
    store_url: str,
) -> None:
    started, edits = threading.Event(), []

    def slow(state: Typed) -> dict[str, Any]:
        started.set()
        time.sleep(0.5)
        return {"amount": state["amount"] + 1}

    graph = one_node(Typed, slow, RemitSaver(store_url))
    cfg = config()

    def edit() -> None:
        started.wait(10)
        try:
            graph.update_state(cfg, {"ratio": 9.0})
        except ResumeConflict as refused:
            edits.append(refused)

    editor = threading.Thread(target=edit)
    editor.start()
    assert graph.invoke({"amount": 1}, cfg) == {"amount": 2}  # not refused by the edit
    editor.join()
    assert len(edits) == 1 and "the edit was not stored" in str(edits[0])
    graph.update_state(cfg, {"ratio": 9.0})  # the run has ended: the edit is taken
    assert graph.get_state(cfg).values == {"amount": 2, "ratio": 9.0}


def test_a_continue_after_one_of_two_questions_asks_the_second_again(store_url: str) -> None:
    """`invoke(None)` on a node paused at its second `interrupt()` re-asks it: the
    first answer is not handed to the second question (nor to any later one)."""

    class Got(TypedDict):
        got: Annotated[list[str], operator.add]

    def two_questions(state: Got) -> dict[str, Any]:
        return {"got": [f"amount={interrupt('amount?')}", f"payee={interrupt('payee?')}"]}

    graph = one_node(Got, two_questions, RemitSaver(store_url))
    cfg = config()
    graph.invoke({"got": []}, cfg)
    asked = graph.invoke(Command(resume="100"), cfg)["__interrupt__"]
    assert [i.value for i in asked] == ["payee?"]
    again = graph.invoke(None, cfg)
    assert [i.value for i in again["__interrupt__"]] == ["payee?"] and again["got"] == []
    assert graph.invoke(Command(resume="bob"), cfg)["got"] == ["amount=100", "payee=bob"]


class Ranged(BaseModel):
    """A state with checks of its own: a field validator and a model validator."""

    name: str = "x"
    lo: int = 0
    hi: int = 10

    @field_validator("name")
    @classmethod
    def lowercase(cls, value: str) -> str:
        if value != value.lower():
            raise ValueError("name must be lowercase")
        return value

    @model_validator(mode="after")
    def ordered(self) -> Ranged:
        if self.lo > self.hi:
            raise ValueError("lo > hi")
        return self


@pytest.mark.parametrize(
    ("write", "named"), [({"name": "UPPER"}, "lowercase"), ({"lo": 11}, "lo > hi")]
)
def test_a_model_states_own_validators_refuse_a_write_and_the_thread_stays_usable(
    store_url: str, write: dict[str, Any], named: str
) -> None:
    graph = one_node(Ranged, lambda s: write, RemitSaver(store_url))
    cfg = config()
    with pytest.raises(CheckpointInvalid, match=named):
        graph.invoke({"name": "ok"}, cfg, durability="sync")
    assert graph.get_state(cfg).values == {"name": "ok"}
    with pytest.raises(CheckpointInvalid, match=named):
        graph.update_state(cfg, write)
    graph.update_state(cfg, {"hi": 20}, as_node="node")  # a valid edit is taken
    assert graph.get_state(cfg).values == {"name": "ok", "hi": 20}


def test_input_refused_by_the_states_own_validator_leaves_the_thread_free(store_url: str) -> None:
    """Refused as the run starts (LangGraph's own check of a model's input may come
    first): the claim is given back at once, not when its 30 s lease runs out."""
    graph = one_node(Ranged, lambda s: {"name": "ok"}, RemitSaver(store_url, lease=30.0))
    cfg = config()
    with pytest.raises((CheckpointInvalid, ValidationError), match="lo > hi"):
        graph.invoke({"lo": 11}, cfg, durability="sync")
    assert graph.invoke({"lo": 1}, cfg) == {"name": "ok", "lo": 1}


class Rounds(TypedDict):
    n: int


def test_a_resume_reads_the_interrupts_of_its_pause_not_of_every_round(store_url: str) -> None:
    """A loop that asks a human each round: answering round 40 reads the interrupts
    raised at the pause it answers, not the 40 the thread raised before."""

    def ask(state: Rounds) -> Rounds:
        return {"n": state["n"] + interrupt({"round": state["n"]})}

    builder = StateGraph(Rounds)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_conditional_edges("ask", lambda s: "ask" if s["n"] < 100 else END)
    saver = RemitSaver(store_url)
    graph = builder.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    graph.invoke({"n": 0}, config)
    store = saver.remit.store
    listed = store.list_interrupts
    read: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        found = listed(*args, **kwargs)
        read.append(len(found))
        return found

    store.list_interrupts = counted  # type: ignore[method-assign]
    for _ in range(40):
        read.clear()
        graph.invoke(Command(resume=1), config)
    assert graph.get_state(config).values == {"n": 40}
    assert read and max(read) <= 1, read
    assert len(saver.remit.interrupts(config["configurable"]["thread_id"])) == 41
