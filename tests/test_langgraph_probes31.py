"""RemitSaver when the server ends its connections in the middle of a run: PostgreSQL
backends terminated and Redis clients killed at the core's failpoints (before and
inside a commit, a write, a resume's consume, an effect's outcome). The user gets
`StoreUnavailable` or a transparent retry, never a raw driver error, and continuing
the thread afterwards loses no committed step, applies no effect twice and consumes
no resume value twice. Also the async saver under many threads at once against
LangGraph's own `InMemorySaver`. Real LangGraph, real servers, no mocks."""

from __future__ import annotations

import asyncio
import operator
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Interrupt, interrupt
from store_cuts import cut_at, tagged
from test_langgraph_support import INITIAL, World, build
from typing_extensions import TypedDict

from remit_core import StoreUnavailable
from remit_langgraph import AsyncRemitSaver, RemitSaver

# -- cutting the saver's connections at a failpoint -------------------------------------


@pytest.fixture
def cutting(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, str], list[int]]:
    """Arm: the next time the core reaches point `point`, end the saver's connections."""

    def arm(point: str, engine: str, name: str) -> list[int]:
        return cut_at(monkeypatch, point, engine, name)

    return arm


POINTS = [
    "claim.in_acquire",
    "claim.after_acquire",
    "checkpoint.before_commit",
    "checkpoint.in_commit",
    "checkpoint.after_commit",
    "writes.before",
    "writes.in_txn",
    "writes.after",
    "interrupt.before_consume",
    "interrupt.in_consume",
    "interrupt.after_consume",
    "effect.before_intent",
    "effect.in_intent",
    "effect.after_intent",
    "effect.after_apply",
    "effect.in_outcome",
    "effect.after_outcome",
]


def invoke(graph: Any, value: Any, cfg: dict[str, Any], api: str) -> Any:
    if api == "sync":
        return graph.invoke(value, cfg)
    return asyncio.run(graph.ainvoke(value, cfg))


def state(graph: Any, cfg: dict[str, Any], api: str) -> Any:
    return graph.get_state(cfg) if api == "sync" else asyncio.run(graph.aget_state(cfg))


def drive(
    graph: Any, cfg: dict[str, Any], first: Any, api: str = "sync"
) -> tuple[Any, list[BaseException]]:
    """Run `first`, then continue the thread (resuming its pause with "ann", or with
    `None`) until it ends; every error on the way is kept and the run continued."""
    errors: list[BaseException] = []
    step: Any = first
    for _ in range(8):
        try:
            out = invoke(graph, step, cfg, api)
        except Exception as exc:  # noqa: BLE001 - the test sorts them below
            errors.append(exc)
        else:
            snap = state(graph, cfg, api)
            if not snap.next:
                return out, errors
        snap = state(graph, cfg, api)
        pending = [i for t in snap.tasks for i in t.interrupts]
        step = Command(resume="ann") if pending else None
    raise AssertionError(f"the thread never ended; errors: {errors!r}")


# Redis records an effect's intent in one script, with no point inside it.
CUTS = [
    (e, p)
    for e in ("postgresql", "redis")
    for p in POINTS
    if (e, p) != ("redis", "effect.in_intent")
]


@pytest.mark.parametrize(("engine", "point"), CUTS)
@pytest.mark.parametrize("api", ["sync", "async"])
def test_connections_ended_mid_run_are_store_unavailable_and_the_thread_continues_once(
    api: str,
    engine: str,
    point: str,
    tmp_path: Path,
    cutting: Callable[[str, str, str], list[int]],
) -> None:
    """The saver's server connections are ended when the run reaches `point`, from the
    resume of the pause on: every error on the way is `StoreUnavailable`, and the thread
    then continued to its end ran prepare once, took "ann" as the answer, and applied
    each effect once."""
    url, name = tagged(engine)
    world = World(tmp_path)
    saver = RemitSaver(url) if api == "sync" else AsyncRemitSaver(url)
    try:
        graph = build(world, saver)
        cfg = {"configurable": {"thread_id": f"cut-{uuid.uuid4().hex}"}}
        invoke(graph, dict(INITIAL), cfg, api)  # paused at approve
        assert [i.value for t in state(graph, cfg, api).tasks for i in t.interrupts] == [
            "approve #0"
        ]
        done = cutting(point, engine, name)
        out, errors = drive(graph, cfg, Command(resume="ann"), api)
        assert done and done[0] >= 1, f"{point} was never reached with a connection open"
        for exc in errors:
            assert isinstance(exc, StoreUnavailable), f"{type(exc).__module__}: {exc!r}"
        assert out["approved_by"] == "ann"
        assert out["log"] == ["prepare", "approve", "charge-done", "notify-done"]
        assert len(world.applications("charge")) == 1
        assert len(world.applications("notify")) == 1
        assert [s for _, s in world.entries("prepare")] == ["prepare"]
        assert state(graph, cfg, api).values == out
    finally:
        saver.remit.close()


# -- the async saver under many threads at once -----------------------------------------


class Tally(TypedDict):
    n: int
    log: Annotated[list[str], operator.add]


def tally_graph(checkpointer: Any) -> Any:
    async def first(state: Tally) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"n": state["n"] + 1, "log": [f"first:{state['n']}"]}

    async def ask(state: Tally) -> dict[str, Any]:
        got = interrupt(f"how many after {state['n']}?")
        return {"n": state["n"] + int(got), "log": [f"ask:{got}"]}

    async def last(state: Tally) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"log": [f"last:{state['n']}"]}

    builder = StateGraph(Tally)
    builder.add_node("first", first)
    builder.add_node("ask", ask)
    builder.add_node("last", last)
    builder.add_edge(START, "first")
    builder.add_edge("first", "ask")
    builder.add_edge("ask", "last")
    builder.add_edge("last", END)
    return builder.compile(checkpointer=checkpointer)


async def tally_script(graph: Any, threads: list[str]) -> dict[str, Any]:
    """Per thread: start, resume, start again (a new input on an ended thread), resume,
    and the streams of each; 10 threads at once, 5 calls each (50 in all)."""

    async def one(i: int, thread: str) -> Any:
        cfg = {"configurable": {"thread_id": thread}}
        seen: list[Any] = []
        seen.append(await graph.ainvoke({"n": i, "log": []}, cfg))
        async for chunk in graph.astream(
            Command(resume=str(i)), cfg, stream_mode=["updates", "values"]
        ):
            seen.append(chunk)
        seen.append(await graph.ainvoke({"n": 100 + i, "log": []}, cfg))
        events = [
            e["event"]
            async for e in graph.astream_events(Command(resume="1"), cfg, version="v2")
            if e["event"] in ("on_chain_start", "on_chain_end") and e.get("name") in ("ask", "last")
        ]
        seen.append(events)
        state = await graph.aget_state(cfg)
        seen.append(state.values)
        seen.append(len([s async for s in graph.aget_state_history(cfg)]))
        return seen

    results = await asyncio.gather(*(one(i, t) for i, t in enumerate(threads)))
    return dict(zip(range(len(threads)), plain(results), strict=True))


def plain(value: Any) -> Any:
    """`value` with each interrupt as its value (their ids come from checkpoint ids)."""
    if isinstance(value, Interrupt):
        return ("interrupt", value.value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def test_fifty_async_calls_on_ten_threads_match_the_in_memory_saver(url: str) -> None:
    """Ten threads at once on one async saver, each started, resumed (streamed with two
    modes), started again and resumed under `astream_events`: every output, stream
    chunk, state and history length equals LangGraph's own saver's for that thread."""
    threads = [f"many-{uuid.uuid4().hex}" for _ in range(10)]
    expected = asyncio.run(tally_script(tally_graph(InMemorySaver()), threads))

    async def with_remit() -> dict[str, Any]:
        async with AsyncRemitSaver.from_conn_string(url) as saver:
            return await tally_script(tally_graph(saver), threads)

    assert asyncio.run(with_remit()) == expected


# -- bulk edits of an old checkpoint, sync and async ---------------------------------------


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def two_steps(checkpointer: Any) -> Any:
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", lambda s: {"log": ["b"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return builder.compile(checkpointer=checkpointer)


async def bulk_script(graph: Any, thread: str, token: str | None, api: str) -> Any:
    """Run the thread, edit the checkpoint after "a" in two supersteps (with `token`),
    then continue the edit; what each read shows."""
    from langgraph.types import StateUpdate

    cfg = {"configurable": {"thread_id": thread}}
    steps = [[StateUpdate({"log": ["e1"]}, "a")], [StateUpdate({"log": ["e2"]}, "a")]]
    if api == "sync":
        graph.invoke({"log": []}, cfg)
        old = next(s for s in graph.get_state_history(cfg) if s.next == ("b",))
    else:
        await graph.ainvoke({"log": []}, cfg)
        old = [s async for s in graph.aget_state_history(cfg) if s.next == ("b",)][0]
    at = {"configurable": {**old.config["configurable"]}}
    if token is not None:
        at["configurable"]["fork_token"] = token
    if api == "sync":
        edited = graph.bulk_update_state(at, steps)
    else:
        edited = await graph.abulk_update_state(at, steps)
    reread = {"configurable": {"thread_id": thread}}
    if token is not None:
        reread["configurable"]["fork_token"] = token
    else:
        reread = edited
    if api == "sync":
        fork_state = graph.get_state(reread)
        main_state = graph.get_state(cfg)
        out = graph.invoke(None, reread)
        history = [s.values for s in graph.get_state_history(reread)]
    else:
        fork_state = await graph.aget_state(reread)
        main_state = await graph.aget_state(cfg)
        out = await graph.ainvoke(None, reread)
        history = [s.values async for s in graph.aget_state_history(reread)]
    if token is None:
        # One line in LangGraph's own saver: the newest checkpoint's parents.
        history, snap = [], graph.get_state(cfg) if api == "sync" else await graph.aget_state(cfg)
        while snap is not None:
            history.append(snap.values)
            parent = snap.parent_config
            if parent is None:
                break
            snap = graph.get_state(parent) if api == "sync" else await graph.aget_state(parent)
    return {
        "fork": (fork_state.values, fork_state.next),
        "main": main_state.values if token is not None else None,
        "out": out,
        "history": history,
    }


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_bulk_edit_of_an_old_checkpoint_with_a_fork_token_is_one_branch(
    url: str, api: str
) -> None:
    """Two supersteps of edits on the checkpoint after "a", with a fork token: one branch
    holding them, main untouched, and the branch read, run and listed as LangGraph's own
    saver shows the same edit of its one line."""
    thread = f"bulk-{uuid.uuid4().hex}"
    expected = asyncio.run(bulk_script(two_steps(InMemorySaver()), thread, None, api))
    saver = RemitSaver(url) if api == "sync" else AsyncRemitSaver(url)
    try:
        got = asyncio.run(bulk_script(two_steps(saver), thread, "bulk-fork", api))
        assert got["fork"] == expected["fork"]
        assert got["out"] == expected["out"] == {"log": ["a", "e1", "e2", "b"]}
        assert got["main"] == {"log": ["a", "b"]}
        # The fork's line: its own checkpoints, then those it continues from.
        assert got["history"] == expected["history"]
        branches = [b for b in saver.remit.branches(thread) if b.fork_token == "bulk-fork"]
        assert len(branches) == 1
    finally:
        saver.remit.close()


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_bulk_edit_of_an_old_checkpoint_without_a_token_stores_nothing(
    url: str, api: str
) -> None:
    """Without a fork token the edit is refused (`ForkWithoutIntent`) and the thread keeps
    its four checkpoints and no branch."""
    from langgraph.types import StateUpdate

    from remit_core import ForkWithoutIntent

    saver = RemitSaver(url) if api == "sync" else AsyncRemitSaver(url)
    graph = two_steps(saver)
    cfg = {"configurable": {"thread_id": f"bulk-{uuid.uuid4().hex}"}}
    steps = [[StateUpdate({"log": ["e1"]}, "a")], [StateUpdate({"log": ["e2"]}, "a")]]

    async def run() -> list[Any]:
        if api == "sync":
            graph.invoke({"log": []}, cfg)
            old = next(s for s in graph.get_state_history(cfg) if s.next == ("b",))
            with pytest.raises(ForkWithoutIntent):
                graph.bulk_update_state(old.config, steps)
            return [s.config for s in graph.get_state_history(cfg)]
        await graph.ainvoke({"log": []}, cfg)
        old = [s async for s in graph.aget_state_history(cfg) if s.next == ("b",)][0]
        with pytest.raises(ForkWithoutIntent):
            await graph.abulk_update_state(old.config, steps)
        return [s.config async for s in graph.aget_state_history(cfg)]

    try:
        configs = asyncio.run(run())
        assert len(configs) == 4
        branches = saver.remit.branches(cfg["configurable"]["thread_id"])
        assert all(b.fork_token is None for b in branches), branches
    finally:
        saver.remit.close()


# -- reading a thread while another process is in the middle of it -------------------------


def test_a_state_read_while_another_process_runs_the_thread_is_its_committed_head(
    url: str, tmp_path: Path
) -> None:
    """The other process is held inside "charge" (after approve's answer was consumed
    and its step committed): a read in this process sees that committed state, with
    "charge" next and no pending question, sync and async, and takes no claim: a
    resumer here is refused (`ResumeConflict`) and runs nothing, and the holder then
    finishes the run alone, with one charge."""
    import multiprocessing

    from remit_core import ResumeConflict

    ctx = multiprocessing.get_context("fork")
    inside, go = ctx.Event(), ctx.Event()
    world = World(tmp_path)
    saver = RemitSaver(url)
    graph = build(world, saver)
    cfg = {"configurable": {"thread_id": f"mid-{uuid.uuid4().hex}"}}
    graph.invoke(dict(INITIAL), cfg)

    def holder() -> None:
        held = World(tmp_path)
        original = held.point

        def point(name: str) -> None:
            if name == "charge.before_effect":
                inside.set()
                go.wait(60)
            original(name)

        held.point = point  # type: ignore[method-assign]
        other = build(held, RemitSaver(url))
        other.invoke(Command(resume="ann"), cfg, durability="sync")

    proc = ctx.Process(target=holder)
    proc.start()
    try:
        assert inside.wait(60)
        snap = graph.get_state(cfg)
        assert snap.values == {"amount": 100, "approved_by": "ann", "log": ["prepare", "approve"]}
        assert snap.next == ("charge",)
        assert [i for t in snap.tasks for i in t.interrupts] == []
        asnap = asyncio.run(AsyncRemitSaver(url).aget_tuple(cfg))
        assert asnap is not None
        assert asnap.checkpoint["id"] == snap.config["configurable"]["checkpoint_id"]
        with pytest.raises(ResumeConflict):
            graph.invoke(None, cfg)
        assert [s for _, s in world.entries("charge")] == ["charge"]
    finally:
        go.set()
        proc.join(60)
    assert proc.exitcode == 0
    final = graph.get_state(cfg)
    assert final.next == ()
    assert final.values["log"] == ["prepare", "approve", "charge-done", "notify-done"]
    assert len(world.applications("charge")) == 1
