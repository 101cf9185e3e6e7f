"""Round 52 of the LangGraph probes: static breakpoints (`interrupt_before` /
`interrupt_after`, given at compile or to `invoke`) in front of a fan-out whose one
branch pays, and what a user does at such a stop.

Probed, each held: racing processes, and `ainvoke`s gathered in one event loop, that
continue the stop with `invoke(None)` (the branch pays once, the thread ends as on
LangGraph's own `SqliteSaver`); a continuation SIGKILLed right after the payment, past
a breakpoint given to `invoke` only, past a subgraph's own breakpoint (then racers),
past a breakpoint before a `Send` fan-out (then racers), and in a branch retried by a
`RetryPolicy` between its attempts, in each durability; a branch cached by a node
cache (`CachePolicy`) killed after paying, then a second thread served from the cache;
an edit `as_node` of one or both pending branches (`update_state`, `bulk_update_state`)
and an edit racing a continuation (one of them takes effect, never both); a
continuation given a breakpoint of its own; listings by `filter=`, `before=` and
`limit=`; a `stream` with every stream mode and subgraphs across the stop and its
continuation; an `astream(None)` cancelled inside the paying branch. Compared with
`SqliteSaver` where the answer is LangGraph's. Real LangGraph, real stores on every
engine, real processes killed with SIGKILL; no mocks."""

from __future__ import annotations

import asyncio
import operator
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.cache.sqlite import SqliteCache
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import CachePolicy, Command, RetryPolicy, Send, StateUpdate
from test_langgraph_probes49 import CTX, DURABILITIES, LEASE, in_child, killed, pay_with
from test_langgraph_support import World
from typing_extensions import TypedDict

from remit_core import HeadMoved, ResumeConflict
from remit_langgraph import AsyncRemitSaver, RemitSaver


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg52-{uuid.uuid4().hex}"}}


class Fan(TypedDict):
    n: int
    log: Annotated[list[str], operator.add]


def payment(world: World, saver: Any) -> Callable[[], str]:
    """A node's payment: an effect on Remit, a plain call on LangGraph's own saver (an
    effect needs a Remit run)."""
    if isinstance(saver, SqliteSaver):
        return lambda: world.apply("pay", uuid.uuid4().hex)
    return pay_with(world, "pay")  # type: ignore[no-any-return]


def paying_node(world: World, name: str, pay: Callable[[], str]) -> Any:
    """Node `name`: pays, passes its kill point `<name>.paid`, logs the outcome and `n`."""

    def node(state: Fan) -> dict[str, Any]:
        world.enter(name)
        outcome = pay()
        world.point(f"{name}.paid")
        return {"log": [f"{name}:{outcome}:{state['n']}"]}

    return node


def fan(world: World, saver: Any, cache: Path | None = None, **compile_kwargs: Any) -> Any:
    """START -> a -> (b pays, c logs) -> d -> END. On LangGraph's own saver the payment
    is a plain call (an effect needs a Remit run). With `cache`, `b` is cached (by its
    input) in a node cache in that file."""

    def a(state: Fan) -> dict[str, Any]:
        world.enter("a")
        return {"n": state["n"] + 1, "log": ["a"]}

    b = paying_node(world, "b", payment(world, saver))

    def c(state: Fan) -> dict[str, Any]:
        world.enter("c")
        return {"log": [f"c:{state['n']}"]}

    def d(state: Fan) -> dict[str, Any]:
        world.enter("d")
        return {"n": state["n"] * 10, "log": ["d"]}

    builder = StateGraph(Fan)
    for name, fn in (("a", a), ("b", b), ("c", c), ("d", d)):
        builder.add_node(name, fn, cache_policy=CachePolicy() if cache and name == "b" else None)
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("a", "c")
    builder.add_edge(["b", "c"], "d")
    builder.add_edge("d", END)
    if cache is not None:
        compile_kwargs["cache"] = SqliteCache(path=str(cache))
    return builder.compile(checkpointer=saver, **compile_kwargs)


def theirs(tmp_path: Path) -> SqliteSaver:
    conn = sqlite3.connect(tmp_path / f"langgraph-{uuid.uuid4().hex}.db", check_same_thread=False)
    return SqliteSaver(conn)


def sorted_log(values: dict[str, Any]) -> dict[str, Any]:
    """The state with its log sorted: b and c run in one step, in either order."""
    return {**values, "log": sorted(values["log"])}


INPUT: Fan = {"n": 1, "log": []}


def race_continuations(graph: Any, cfg: Any, k: int = 3, **kwargs: Any) -> list[str]:
    """Continue the thread's stop with `invoke(None, cfg, **kwargs)` from `k` forked
    processes at once, behind a barrier: "ok", "conflict" (`ResumeConflict`) or
    "error ..." per process."""
    barrier, results = CTX.Barrier(k), CTX.Queue()

    def racer() -> None:
        barrier.wait(60)
        try:
            graph.invoke(None, cfg, **kwargs)
            results.put("ok")
        except ResumeConflict:
            results.put("conflict")
        except BaseException as exc:  # noqa: BLE001 (handed to the parent)
            results.put(f"error {exc!r}")

    procs = [CTX.Process(target=racer) for _ in range(k)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(k)]
    for p in procs:
        p.join(60)
    return got


# -- racing continuations of a static breakpoint ------------------------------------------


@pytest.mark.parametrize("where", ["before", "after"])
def test_racing_continuations_of_a_breakpoint_pay_once_and_end_as_langgraphs_own(
    url: str, tmp_path: Path, where: str
) -> None:
    """A thread stopped at a compiled breakpoint (before the fan-out, or after `a`) is
    continued by three processes at once with `invoke(None)`: `b` pays once, `d` runs
    once, no racer fails otherwise than with `ResumeConflict`, and the thread ends
    where LangGraph's own saver ends it with one continuation."""
    breakpoint = (
        {"interrupt_before": ["b", "c"]} if where == "before" else {"interrupt_after": ["a"]}
    )
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fan(world, saver, **breakpoint), config()
        graph.invoke(INPUT, cfg)
        assert set(graph.get_state(cfg).next) == {"b", "c"}
        got = race_continuations(graph, cfg)
        assert "ok" in got and set(got) <= {"ok", "conflict"}, got
        assert len(world.applications("pay")) == 1
        assert len(world.entries("d")) == 1
        ours = graph.get_state(cfg)

        (tmp_path / "theirs").mkdir()
        other = fan(World(tmp_path / "theirs"), theirs(tmp_path), **breakpoint)
        other_cfg = config()
        other.invoke(INPUT, other_cfg)
        other.invoke(None, other_cfg)
        expected = other.get_state(other_cfg)
        assert sorted_log(ours.values) == sorted_log(expected.values)
        assert ours.next == expected.next == ()
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="late"), cfg)
        assert len(world.applications("pay")) == 1
    finally:
        saver.remit.close()


# -- a breakpoint given to invoke, its continuation killed after the payment ---------------


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_continuation_killed_after_paying_past_an_invoke_breakpoint_pays_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The breakpoint is given to `invoke` only (the compiled graph has none). The
    process that continues is SIGKILLed right after `b` paid; another process
    continues with `invoke(None)` (no breakpoint now): `b`'s payment applies once, and
    the thread ends as an unkilled continuation ends on LangGraph's own saver."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fan(world, saver), config()
        graph.invoke(INPUT, cfg, interrupt_before=["b"], durability=durability)
        assert set(graph.get_state(cfg).next) == {"b", "c"}

        def doomed() -> None:
            world.armed["b.paid"] = "kill"
            graph.invoke(None, cfg, durability=durability)

        killed(doomed)
        kind, out = in_child(lambda: graph.invoke(None, cfg, durability=durability))
        assert kind == "ok", out
        assert len(world.applications("pay")) == 1

        (tmp_path / "theirs").mkdir()
        other = fan(World(tmp_path / "theirs"), theirs(tmp_path))
        other_cfg = config()
        other.invoke(INPUT, other_cfg, interrupt_before=["b"], durability=durability)
        expected = other.invoke(None, other_cfg, durability=durability)
        assert sorted_log(out) == sorted_log(expected)
        assert sorted_log(graph.get_state(cfg).values) == sorted_log(expected)
        assert graph.get_state(cfg).next == ()
    finally:
        saver.remit.close()


# -- an edit as one of two pending branches -------------------------------------------------


def history(graph: Any, cfg: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The thread's listing, newest first, as (source, step, next, sorted log, n)."""
    return [
        (
            s.metadata.get("source"),
            s.metadata.get("step"),
            tuple(sorted(s.next)),
            tuple(sorted(s.values.get("log", []))),
            s.values.get("n"),
        )
        for s in graph.get_state_history(cfg)
    ]


def edit(graph: Any, cfg: dict[str, Any], how: str) -> None:
    """Edit the thread as `b`, as `c`, as `c` then as `b`, or as both in one superstep."""
    if how == "bulk b+c":
        graph.bulk_update_state(
            cfg, [[StateUpdate({"log": ["edit-b"]}, "b"), StateUpdate({"log": ["edit-c"]}, "c")]]
        )
        return
    for as_node in how.split(" then "):
        graph.update_state(cfg, {"log": [f"edit-{as_node}"]}, as_node=as_node)


@pytest.mark.parametrize("how", ["b", "c", "c then b", "bulk b+c"])
def test_an_edit_as_pending_branches_goes_as_langgraphs_own(
    url: str, tmp_path: Path, how: str
) -> None:
    """Paused before `b` and `c` (a compiled breakpoint), the thread is edited as one of
    them, as each in turn, or as both in one superstep (`bulk_update_state`): its state,
    next tasks and history read as on LangGraph's own saver, the continuation runs what
    LangGraph runs, and `b` pays as often as it does there."""
    world = World(tmp_path)
    (tmp_path / "theirs").mkdir()
    other_world = World(tmp_path / "theirs")
    saver = RemitSaver(url, lease=LEASE)
    try:
        pair = [
            (world, fan(world, saver, interrupt_before=["b", "c"]), config()),
            (
                other_world,
                fan(other_world, theirs(tmp_path), interrupt_before=["b", "c"]),
                config(),
            ),
        ]
        seen = []
        for w, graph, cfg in pair:
            graph.invoke(INPUT, cfg)
            edit(graph, cfg, how)
            state = graph.get_state(cfg)
            before = (sorted_log(state.values), tuple(sorted(state.next)), history(graph, cfg))
            final = graph.invoke(None, cfg)
            after = graph.get_state(cfg)
            seen.append(
                (
                    before,
                    sorted_log(final),
                    after.next,
                    history(graph, cfg),
                    len(w.applications("pay")),
                    sorted(s for _, s in w.entries()),
                )
            )
        assert seen[0] == seen[1]
    finally:
        saver.remit.close()


# -- every stream mode across a breakpoint and its continuation ---------------------------


def plain(mode: str, chunk: Any) -> Any:
    """A stream item with what differs between two savers (ids, times, configs) set aside."""
    if mode in ("updates", "values", "custom", "messages"):
        if isinstance(chunk, dict):
            return {
                k: (sorted_log(v) if isinstance(v, dict) and "log" in v else v)
                for k, v in sorted(chunk.items())
                if k != "__interrupt__"
            } | ({"__interrupt__": len(chunk["__interrupt__"])} if "__interrupt__" in chunk else {})
        return chunk
    if mode == "checkpoints":
        return (
            sorted_log(chunk["values"]),
            tuple(sorted(chunk["next"])),
            chunk["metadata"].get("source"),
            chunk["metadata"].get("step"),
            tuple(sorted(t["name"] for t in chunk["tasks"])),
        )
    if mode == "tasks":
        kept = {k: v for k, v in chunk.items() if k not in ("id", "triggers")}
        if isinstance(kept.get("result"), dict) and "log" in kept["result"]:
            kept["result"] = sorted_log(kept["result"])
        if isinstance(kept.get("input"), dict) and "log" in kept["input"]:
            kept["input"] = sorted_log(kept["input"])
        return tuple(sorted((k, repr(v)) for k, v in kept.items()))
    if mode == "debug":
        kind = "checkpoints" if chunk["type"] == "checkpoint" else "tasks"
        return (chunk["type"], chunk["step"], plain(kind, chunk["payload"]))
    return chunk


@pytest.mark.parametrize("shape", ["fan", "nested"])
@pytest.mark.parametrize("durability", DURABILITIES)
def test_every_stream_mode_across_a_breakpoint_reads_as_langgraphs_own(
    url: str, tmp_path: Path, durability: str, shape: str
) -> None:
    """A `stream` with every mode (and subgraphs) to a breakpoint (before the fan-out,
    or the subgraph's own before `pay`), then its continuation, then one more: the
    items, ids and times aside and `b`/`c` taken as one step, are LangGraph's own
    saver's, and the payment is made once."""
    modes = ["updates", "values", "checkpoints", "tasks", "debug"]
    world = World(tmp_path)
    (tmp_path / "theirs").mkdir()
    other_world = World(tmp_path / "theirs")
    saver = RemitSaver(url, lease=LEASE)

    def build(w: World, checkpointer: Any) -> Any:
        if shape == "nested":
            return nested(w, checkpointer)
        return fan(w, checkpointer, interrupt_before=["b", "c"])

    try:
        seen = []
        for graph, cfg in (
            (build(world, saver), config()),
            (build(other_world, theirs(tmp_path)), config()),
        ):
            runs = []
            for given in (INPUT, None, None):
                items = graph.stream(
                    given, cfg, stream_mode=modes, subgraphs=True, durability=durability
                )
                runs.append(
                    sorted(
                        repr((tuple(p.split(":")[0] for p in ns), m, plain(m, c)))
                        for ns, m, c in items
                    )
                )
            seen.append(runs)
        assert seen[0] == seen[1]
        assert any("subgraph" in r or "'sub'" in r for r in seen[0][0]) == (shape == "nested")
        assert len(world.applications("pay")) == 1
    finally:
        saver.remit.close()


# -- a breakpoint inside a subgraph -------------------------------------------------------


def nested(world: World, saver: Any) -> Any:
    """START -> prep -> sub (s1 -> [breakpoint] pay) -> after -> END; the subgraph has
    its own compiled breakpoint before `pay` and runs on the parent's saver."""

    def s1(state: Fan) -> dict[str, Any]:
        world.enter("s1")
        return {"n": state["n"] + 1, "log": ["s1"]}

    paying = paying_node(world, "pay", payment(world, saver))

    inner = StateGraph(Fan)
    inner.add_node("s1", s1)
    inner.add_node("pay", paying)
    inner.add_edge(START, "s1")
    inner.add_edge("s1", "pay")
    inner.add_edge("pay", END)

    outer = StateGraph(Fan)
    outer.add_node("prep", lambda s: world.enter("prep") or {"log": ["prep"]})
    outer.add_node("sub", inner.compile(interrupt_before=["pay"]))
    outer.add_node("after", lambda s: world.enter("after") or {"log": ["after"]})
    outer.add_edge(START, "prep")
    outer.add_edge("prep", "sub")
    outer.add_edge("sub", "after")
    outer.add_edge("after", END)
    return outer.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_subgraphs_breakpoint_continued_by_a_killed_process_then_racers(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Paused at the subgraph's breakpoint, a process continues and is SIGKILLed right
    after `pay` paid; then three processes continue at once: `pay` applies once, `after`
    runs once, and the thread ends as an unkilled continuation does on LangGraph's own
    saver; the subgraph's stored state is gone from the pending tasks."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = nested(world, saver), config()
        graph.invoke(INPUT, cfg, durability=durability)
        paused = graph.get_state(cfg, subgraphs=True)
        assert paused.next == ("sub",)
        assert paused.tasks[0].state.next == ("pay",)

        def doomed() -> None:
            world.armed["pay.paid"] = "kill"
            graph.invoke(None, cfg, durability=durability)

        killed(doomed)
        got = race_continuations(graph, cfg, durability=durability)
        assert "ok" in got and set(got) <= {"ok", "conflict"}, got
        assert len(world.applications("pay")) == 1
        assert len(world.entries("after")) == 1

        (tmp_path / "theirs").mkdir()
        other = nested(World(tmp_path / "theirs"), theirs(tmp_path))
        other_cfg = config()
        other.invoke(INPUT, other_cfg, durability=durability)
        expected = other.invoke(None, other_cfg, durability=durability)
        assert graph.get_state(cfg).values == expected
        assert graph.get_state(cfg).next == ()
        assert [s.next for s in graph.get_state_history(cfg)] == [
            s.next for s in other.get_state_history(other_cfg)
        ]
    finally:
        saver.remit.close()


# -- a new breakpoint given to the continuation --------------------------------------------


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_continuation_with_its_own_breakpoint_stops_there_as_langgraphs_own(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Paused by a breakpoint given to `invoke`, the thread is continued with another
    breakpoint (`interrupt_after=["b", "c"]`), then with none: each stop, the state
    and the history read as on LangGraph's own saver, and `b` pays once."""
    world = World(tmp_path)
    (tmp_path / "theirs").mkdir()
    other_world = World(tmp_path / "theirs")
    saver = RemitSaver(url, lease=LEASE)
    try:
        seen = []
        for w, graph, cfg in (
            (world, fan(world, saver), config()),
            (other_world, fan(other_world, theirs(tmp_path)), config()),
        ):
            stops = []
            for given, kwargs in (
                (INPUT, {"interrupt_before": ["b"]}),
                (None, {"interrupt_after": ["b", "c"]}),
                (None, {}),
                (None, {}),
            ):
                out = graph.invoke(given, cfg, durability=durability, **kwargs)
                state = graph.get_state(cfg)
                stops.append((sorted_log(out), tuple(sorted(state.next))))
            seen.append((stops, history(graph, cfg), len(w.applications("pay"))))
        assert seen[0] == seen[1]
        assert seen[0][2] == 1
    finally:
        saver.remit.close()


# -- a cached paying branch past a breakpoint, killed after paying -------------------------


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_cached_branch_killed_after_paying_pays_once_and_serves_the_next_thread(
    url: str, tmp_path: Path, durability: str
) -> None:
    """`b` is cached in a node cache file. Past a breakpoint, the process that runs `b`
    is SIGKILLed right after it paid (nothing cached yet); another process continues:
    `b` runs again and pays nothing new. A second thread with the same input then gets
    `b` from the cache (not run, nothing paid). Each run ends as an unkilled one does on
    LangGraph's own saver with its own cache. Each process opens the cache itself."""
    world = World(tmp_path)
    cache = tmp_path / "cache.db"
    saver = RemitSaver(url, lease=LEASE)
    try:
        cfg, second = config(), config()
        fan(world, saver, cache).invoke(INPUT, cfg, interrupt_before=["b"], durability=durability)

        def doomed() -> None:
            world.armed["b.paid"] = "kill"
            fan(world, saver, cache).invoke(None, cfg, durability=durability)

        killed(doomed)
        kind, out = in_child(
            lambda: fan(world, saver, cache).invoke(None, cfg, durability=durability)
        )
        assert kind == "ok", out
        assert len(world.applications("pay")) == 1 and len(world.entries("b")) == 2
        kind, out2 = in_child(
            lambda: fan(world, saver, cache).invoke(INPUT, second, durability=durability)
        )
        assert kind == "ok", out2
        assert len(world.applications("pay")) == 1 and len(world.entries("b")) == 2

        (tmp_path / "theirs").mkdir()
        other_world = World(tmp_path / "theirs")
        other = fan(other_world, theirs(tmp_path), tmp_path / "theirs" / "cache.db")
        other_cfg, other_second = config(), config()
        other.invoke(INPUT, other_cfg, interrupt_before=["b"], durability=durability)
        expected = other.invoke(None, other_cfg, durability=durability)
        expected2 = other.invoke(INPUT, other_second, durability=durability)
        assert len(other_world.applications("pay")) == 1
        assert (sorted_log(out), sorted_log(out2)) == (sorted_log(expected), sorted_log(expected2))
        assert history(fan(world, saver), second) == history(other, other_second)
    finally:
        saver.remit.close()


# -- an edit racing a continuation at a breakpoint ------------------------------------------


def test_an_edit_as_a_pending_branch_racing_a_continuation_takes_effect_alone_or_not(
    url: str, tmp_path: Path
) -> None:
    """Paused before `b` and `c`, one process continues with `invoke(None)` while
    another edits the thread `as_node="b"` (which would finish `b` without paying),
    behind a barrier: either the continuation runs (`b` pays once, the edit is refused
    with `ResumeConflict`, or `HeadMoved` when the run moved the head after the edit
    read it, and stored nowhere) or the edit is stored (nothing pays, the continuation runs
    nothing after it); never both, never a fork."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fan(world, saver, interrupt_before=["b", "c"]), config()
        graph.invoke(INPUT, cfg)
        barrier, results = CTX.Barrier(2), CTX.Queue()

        def continuing() -> None:
            barrier.wait(60)
            try:
                graph.invoke(None, cfg)
                results.put("continued")
            except ResumeConflict:
                results.put("continue refused")
            except BaseException as exc:  # noqa: BLE001 (handed to the parent)
                results.put(f"error {exc!r}")

        def editing() -> None:
            barrier.wait(60)
            try:
                graph.update_state(cfg, {"log": ["edit"]}, as_node="b")
                results.put("edited")
            except (ResumeConflict, HeadMoved):
                # In flight: refused; moved on under the edit's read: read again.
                results.put("edit refused")
            except BaseException as exc:  # noqa: BLE001 (handed to the parent)
                results.put(f"error {exc!r}")

        procs = [CTX.Process(target=continuing), CTX.Process(target=editing)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
        assert not any(g.startswith("error") for g in got), got
        log = graph.get_state(cfg).values["log"]
        pays = len(world.applications("pay"))
        if "edited" in got:
            assert (pays, sorted(log)) == (0, ["a", "edit"]), (got, log)
        else:
            assert "continued" in got and pays == 1 and "edit" not in log, (got, log)
        sources = [s.metadata["source"] for s in graph.get_state_history(cfg)]
        assert sources.count("update") == ("edited" in got)
        assert [s.config for s in graph.get_state_history(cfg)][1:] == [
            s.parent_config for s in graph.get_state_history(cfg)
        ][:-1]
    finally:
        saver.remit.close()


# -- continuations in one event loop --------------------------------------------------------


@pytest.mark.parametrize("where", ["before", "after"])
def test_continuations_gathered_in_one_event_loop_run_the_breakpoint_once(
    url: str, tmp_path: Path, where: str
) -> None:
    """Three `ainvoke(None)` gathered in one event loop continue one breakpoint: one
    ends the run, the others get `ResumeConflict`; `b` pays once and `d` runs once."""
    world = World(tmp_path)
    breakpoint = (
        {"interrupt_before": ["b", "c"]} if where == "before" else {"interrupt_after": ["a"]}
    )

    async def scenario() -> list[Any]:
        async with AsyncRemitSaver.from_conn_string(url, lease=LEASE) as saver:
            graph, cfg = fan(world, saver, **breakpoint), config()
            await graph.ainvoke(INPUT, cfg)
            got = await asyncio.gather(
                *(graph.ainvoke(None, cfg) for _ in range(3)), return_exceptions=True
            )
            assert (await graph.aget_state(cfg)).next == ()
            return got

    got = asyncio.run(scenario())
    ends = [g for g in got if not isinstance(g, BaseException)]
    assert len(ends) == 1, got
    assert all(isinstance(g, ResumeConflict) for g in got if isinstance(g, BaseException)), got
    assert sorted(ends[0]["log"]) == ["a", "b:pay-done:2", "c:2", "d"]
    assert len(world.applications("pay")) == 1 and len(world.entries("d")) == 1


# -- listings of an edited breakpoint thread ------------------------------------------------


def test_listings_of_an_edited_breakpoint_thread_by_filter_before_and_limit(
    url: str, tmp_path: Path
) -> None:
    """A thread paused twice by breakpoints, edited at each pause, then finished: its
    listings by `filter=`, `before=` and `limit=` (sync and async) hold the checkpoints
    LangGraph's own saver lists, in its order."""
    (tmp_path / "theirs").mkdir()
    saver = RemitSaver(url, lease=LEASE)
    try:
        listings = []
        for checkpointer, w in (
            (saver, World(tmp_path)),
            (theirs(tmp_path), World(tmp_path / "theirs")),
        ):
            graph, cfg = fan(w, checkpointer), config()
            graph.invoke(INPUT, cfg, interrupt_before=["b"])
            graph.update_state(cfg, {"n": 4})
            graph.invoke(None, cfg, interrupt_after=["b", "c"])
            graph.update_state(cfg, {"log": ["edit"]}, as_node="c")
            graph.invoke(None, cfg)
            every = list(checkpointer.list(cfg))
            middle = every[3].config

            def row(t: Any) -> tuple[Any, ...]:
                return (
                    t.metadata.get("source"),
                    t.metadata.get("step"),
                    sorted(t.checkpoint["channel_values"].get("log", [])),
                )

            got = [
                [row(t) for t in every],
                [row(t) for t in checkpointer.list(cfg, filter={"source": "update"})],
                [row(t) for t in checkpointer.list(cfg, filter={"step": 2})],
                [row(t) for t in checkpointer.list(cfg, before=middle)],
                [row(t) for t in checkpointer.list(cfg, before=middle, limit=2)],
                [row(t) for t in checkpointer.list(cfg, limit=3)],
            ]
            if checkpointer is saver:

                async def alist(cfg: Any, middle: Any) -> list[Any]:
                    return [row(t) async for t in saver.alist(cfg, before=middle, limit=2)]

                assert asyncio.run(alist(cfg, middle)) == got[4]
            listings.append(got)
        assert listings[0] == listings[1]
        assert len(listings[0][1]) == 2
    finally:
        saver.remit.close()


# -- a retried branch past a breakpoint, killed between attempts --------------------------


class Flaky(Exception):
    pass


def retried_fan(world: World, saver: Any) -> Any:
    """START -> a -> (b: pays, then fails its first two attempts; c logs) -> d -> END,
    `b` retried on `Flaky`. On LangGraph's own saver the payment is a plain call."""
    pay = payment(world, saver)

    def b(state: Fan) -> dict[str, Any]:
        world.enter("b")
        attempt = len(world.entries("b"))
        outcome = pay()
        world.point(f"b.{attempt}")
        if attempt < 3:
            raise Flaky(f"attempt {attempt}")
        return {"log": [f"b:{outcome}:{state['n']}"]}

    builder = StateGraph(Fan)
    builder.add_node("a", lambda s: world.enter("a") or {"n": s["n"] + 1, "log": ["a"]})
    builder.add_node(
        "b", b, retry_policy=RetryPolicy(initial_interval=0.05, jitter=False, retry_on=Flaky)
    )
    builder.add_node("c", lambda s: world.enter("c") or {"log": [f"c:{s['n']}"]})
    builder.add_node("d", lambda s: world.enter("d") or {"n": s["n"] * 10, "log": ["d"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("a", "c")
    builder.add_edge(["b", "c"], "d")
    builder.add_edge("d", END)
    return builder.compile(checkpointer=saver, interrupt_before=["b", "c"])


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_retried_branch_killed_between_attempts_pays_once_and_ends_as_langgraphs_own(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Past a breakpoint, `b` pays in each attempt and fails the first two; the process
    is SIGKILLed after the second attempt paid. Another process continues: `b`'s
    payment applies once over its three attempts and the recovery, `c` runs again only
    where LangGraph's own saver (killed the same way) runs it again, and the thread
    ends with the same state."""
    (tmp_path / "theirs").mkdir()
    saver = RemitSaver(url, lease=LEASE)
    db = tmp_path / "theirs" / "langgraph.db"
    try:
        seen = []
        for w, make in (
            (World(tmp_path), lambda: saver),
            # LangGraph's own saver: each process opens the file itself.
            (
                World(tmp_path / "theirs"),
                lambda: SqliteSaver(sqlite3.connect(db, check_same_thread=False)),
            ),
        ):
            cfg = config()
            retried_fan(w, make()).invoke(INPUT, cfg, durability=durability)

            def doomed(w: World = w, make: Any = make, cfg: Any = cfg) -> None:
                w.armed["b.2"] = "kill"
                retried_fan(w, make()).invoke(None, cfg, durability=durability)

            def recover(w: World = w, make: Any = make, cfg: Any = cfg) -> Any:
                return retried_fan(w, make()).invoke(None, cfg, durability=durability)

            killed(doomed)
            kind, out = in_child(recover)
            assert kind == "ok", out
            seen.append((sorted_log(out), len(w.entries("b")), len(w.entries("c"))))
            if w.sink.parent == tmp_path:
                assert len(w.applications("pay")) == 1
        assert seen[0] == seen[1]
    finally:
        saver.remit.close()


# -- a breakpoint before a `Send` fan-out ---------------------------------------------------


class Orders(TypedDict):
    items: list[int]
    log: Annotated[list[str], operator.add]


def sends(world: World, saver: Any) -> Any:
    """START -> plan -> worker per item (`Send`, each pays; item 2 has a kill point)
    -> done -> END, with a breakpoint before `worker`."""
    pay = (
        (lambda i: world.apply("pay", f"{i}-{uuid.uuid4().hex}"))
        if isinstance(saver, SqliteSaver)
        else (lambda i: pay_with(world, "pay")())
    )

    def worker(item: dict[str, Any]) -> dict[str, Any]:
        world.enter(f"worker{item['i']}")
        outcome = pay(item["i"])
        world.point(f"worker{item['i']}.paid")
        return {"log": [f"w{item['i']}:{outcome}"]}

    builder = StateGraph(Orders)
    builder.add_node("plan", lambda s: {"log": ["plan"]})
    builder.add_node("worker", worker)
    builder.add_node("done", lambda s: world.enter("done") or {"log": ["done"]})
    builder.add_edge(START, "plan")
    builder.add_conditional_edges(
        "plan", lambda s: [Send("worker", {"i": i}) for i in s["items"]], ["worker"]
    )
    builder.add_edge("worker", "done")
    builder.add_edge("done", END)
    return builder.compile(checkpointer=saver, interrupt_before=["worker"])


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_breakpoint_before_a_send_fan_out_killed_mid_way_pays_each_item_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Paused before three `Send` workers, the continuation is SIGKILLed after worker 2
    paid; then three processes continue at once: each item pays once, `done` runs once,
    and the thread ends as an unkilled continuation does on LangGraph's own saver."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = sends(world, saver), config()
        graph.invoke({"items": [1, 2, 3], "log": []}, cfg, durability=durability)
        assert graph.get_state(cfg).next == ("worker", "worker", "worker")

        def doomed() -> None:
            world.armed["worker2.paid"] = "kill"
            graph.invoke(None, cfg, durability=durability)

        killed(doomed)
        got = race_continuations(graph, cfg, durability=durability)
        assert "ok" in got and set(got) <= {"ok", "conflict"}, got
        assert len(set(world.applications("pay"))) == len(world.applications("pay")) == 3
        assert len(world.entries("done")) == 1

        (tmp_path / "theirs").mkdir()
        other = sends(World(tmp_path / "theirs"), theirs(tmp_path))
        other_cfg = config()
        other.invoke({"items": [1, 2, 3], "log": []}, other_cfg, durability=durability)
        expected = other.invoke(None, other_cfg, durability=durability)
        assert sorted_log(graph.get_state(cfg).values) == sorted_log(expected)
        assert graph.get_state(cfg).next == ()
    finally:
        saver.remit.close()


# -- an astream of a continuation cancelled inside the paying branch ------------------------


def gated_fan(world: World, saver: Any, gate: asyncio.Event, where: str) -> Any:
    """START -> a -> (b: pays, then waits for `gate`; c logs) -> d -> END, async nodes,
    with a breakpoint before the fan-out or after `a`."""
    pay = pay_with(world, "pay")

    async def b(state: Fan) -> dict[str, Any]:
        world.enter("b")
        outcome = pay()
        await gate.wait()
        return {"log": [f"b:{outcome}"]}

    async def c(state: Fan) -> dict[str, Any]:
        world.enter("c")
        return {"log": ["c"]}

    builder = StateGraph(Fan)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", b)
    builder.add_node("c", c)
    builder.add_node("d", lambda s: world.enter("d") or {"log": ["d"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("a", "c")
    builder.add_edge(["b", "c"], "d")
    builder.add_edge("d", END)
    breakpoint = (
        {"interrupt_before": ["b", "c"]} if where == "before" else {"interrupt_after": ["a"]}
    )
    return builder.compile(checkpointer=saver, **breakpoint)


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_continuation_cancelled_after_paying_frees_the_thread_and_pays_once(
    url: str, tmp_path: Path, durability: str, where: str
) -> None:
    """The task reading a breakpoint's continuation (`astream(None)`) is cancelled while
    `b` waits after its payment: the claim is given back at once (lease 30 s), the next
    `ainvoke(None)` runs `b` again without paying again and ends the run, `d` once."""
    world = World(tmp_path)

    async def scenario() -> tuple[Any, float, tuple[str, ...]]:
        async with AsyncRemitSaver.from_conn_string(url, lease=30.0) as saver:
            gate = asyncio.Event()
            graph, cfg = gated_fan(world, saver, gate, where), config()
            await graph.ainvoke(INPUT, cfg, durability=durability)

            async def consume() -> None:
                async for _ in graph.astream(None, cfg, durability=durability):
                    pass

            task = asyncio.create_task(consume())
            while not world.applications("pay"):
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            started = asyncio.get_running_loop().time()
            done = await graph.ainvoke(None, cfg, durability=durability)
            waited = asyncio.get_running_loop().time() - started
            return done, waited, (await graph.aget_state(cfg)).next

    done, waited, next_ = asyncio.run(scenario())
    assert sorted(done["log"]) == ["a", "b:pay-done", "c", "d"] and next_ == ()
    assert waited < 5
    assert len(world.applications("pay")) == 1
    assert len(world.entries("b")) == 2 and len(world.entries("d")) == 1
