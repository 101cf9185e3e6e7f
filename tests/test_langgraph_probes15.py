"""RemitSaver probed with LangGraph features the earlier rounds left out: deferred
nodes, node caches, a subgraph's `Command.PARENT`, retry policies, run context,
the checkpoint/task/debug streams, `astream` cancelled mid-node, racing resumers
of different `Send` branches, racing edits with one fork token, and a graph
recompiled without the node that asked. Real LangGraph (compared with its own
`InMemorySaver` where the answer is LangGraph's), real forked processes and
SIGKILLs, on every engine."""

from __future__ import annotations

import asyncio
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import CachePolicy, Command, RetryPolicy, Send, interrupt
from test_langgraph_probes10 import LEASE, config, killed, race
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import AsyncRemitSaver, RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def chain(builder: StateGraph[Any], *names: str) -> None:
    """Edges START -> names[0] -> ... -> names[-1] -> END."""
    for before, after in zip((START, *names), (*names, END), strict=True):
        builder.add_edge(before, after)


def charging(world: World, name: str = "charge") -> Any:
    """An effect `name` that records each application in the world's sink."""

    @remit_core.effect(name=name, reconcile=world.reconcile(name))
    def apply(*, idempotency_key: str) -> str:
        return world.apply(name, idempotency_key)

    return apply


def without_ids(value: Any, seen: dict[str, str]) -> Any:
    """`value` with its checkpoint and task ids, times and run ids made comparable:
    each long id becomes its place of first appearance, and an interrupt its value."""
    if isinstance(value, dict):
        return {
            k: without_ids(v, seen)
            for k, v in value.items()
            if k not in ("ts", "timestamp", "run_id", "thread_id", "created_at")
        }
    if isinstance(value, (list, tuple)) and not hasattr(value, "_asdict"):
        return [without_ids(v, seen) for v in value]
    if hasattr(value, "_asdict"):
        return without_ids(value._asdict(), seen)
    if type(value).__name__ == "Interrupt":
        return ("Interrupt", value.value)  # its id hashes a task id, new per checkpoint id
    if isinstance(value, str) and len(value) >= 32:
        return seen.setdefault(value, f"<id {len(seen)}>")
    return value


# -- a deferred join after a pause ------------------------------------------------------


def deferred(world: World | None, saver: Any) -> Any:
    """a -> b and ask (interrupt) in parallel -> join (defer=True, effect "notify")."""
    notify = charging(world, "notify") if world is not None else lambda: "notify-done"

    def join(state: Log) -> dict[str, Any]:
        if world is not None:
            world.enter("join")
        outcome = notify()
        if world is not None:
            world.point("join.after_effect")
        return {"log": [f"join:{outcome}"]}

    def step(name: str) -> Any:
        def run(state: Log) -> dict[str, Any]:
            if world is not None:
                world.enter(name)
            return {"log": [name if name != "ask" else f"ask:{interrupt('ok?')}"]}

        return run

    builder = StateGraph(Log)
    for name in ("a", "b", "ask"):
        builder.add_node(name, step(name))
    builder.add_node("join", join, defer=True)
    chain(builder, "a", "b", "join")
    for before, after in ((START, "ask"), ("ask", "join")):
        builder.add_edge(before, after)
    return builder.compile(checkpointer=saver)


def test_a_deferred_join_killed_after_its_effect_runs_once_as_langgraph_orders_it(
    url: str, tmp_path: Path
) -> None:
    """The deferred node waits for every branch, the pause included: it runs after the
    resume, as with LangGraph's own saver; a resumer killed after its effect is
    recovered with the effect once and no finished node entered again (P1, P2)."""
    own, own_cfg = deferred(None, InMemorySaver()), config()
    own.invoke({"log": []}, own_cfg)
    expected = own.invoke(Command(resume="yes"), own_cfg)

    world = World(tmp_path)
    graph, cfg = deferred(world, RemitSaver(url, lease=LEASE)), config()
    paused = graph.invoke({"log": []}, cfg, durability="sync")
    assert "join" not in str(paused["log"]) and graph.get_state(cfg).next == ("ask",)

    def doomed() -> None:
        world.armed["join.after_effect"] = "kill"
        deferred(world, RemitSaver(url, lease=LEASE)).invoke(
            Command(resume="yes"), cfg, durability="sync"
        )

    killed(doomed)
    done = graph.invoke(None, cfg, durability="sync")
    assert done == expected
    assert len(world.applications("notify")) == 1
    assert [s for _, s in world.entries()].count("join") == 2  # the killed run's, the recovery's
    assert {s: [x for _, x in world.entries()].count(s) for s in ("a", "b")} == {"a": 1, "b": 1}
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="again"), cfg)


# -- a node cache beside the saver ------------------------------------------------------


def cached(saver: Any, calls: list[str]) -> Any:
    """slow (cached) -> ask (interrupt)."""

    def slow(state: Log) -> dict[str, Any]:
        calls.append("slow")
        return {"log": ["slow"]}

    builder = StateGraph(Log)
    builder.add_node("slow", slow, cache_policy=CachePolicy())
    builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('ok?')}"]})
    builder.add_edge(START, "slow")
    builder.add_edge("slow", "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver, cache=InMemoryCache())


def test_a_cached_nodes_writes_stream_store_and_resume_as_with_langgraphs_own_saver(
    url: str,
) -> None:
    """A cache hit applies the cached writes without running the node: the second
    thread streams them marked cached, stores them as the node's, and resumes."""

    def two_threads(saver: Any) -> tuple[list[str], Any]:
        calls: list[str] = []
        graph, seen = cached(saver, calls), {}
        out = []
        for _ in range(2):
            cfg = config()
            out.append(list(graph.stream({"log": []}, cfg, stream_mode="updates")))
            out.append(graph.invoke(Command(resume="y"), cfg))
            out.append([s.values for s in graph.get_state_history(cfg)])
        return calls, without_ids(out, seen)

    assert two_threads(RemitSaver(url)) == two_threads(InMemorySaver())
    calls, out = two_threads(RemitSaver(url))
    assert calls == ["slow"] and out[3][0] == {
        "slow": {"log": ["slow"]},
        "__metadata__": {"cached": True},
    }


# -- a subgraph's Command.PARENT across a kill ------------------------------------------


def to_parent(world: World, saver: Any) -> Any:
    """ask (interrupt) -> sub (s0, then s1 pays and goes to the parent's `done`)."""
    charge = charging(world)

    def s0(state: Log) -> dict[str, Any]:
        world.enter("s0")
        return {"log": ["s0"]}

    def s1(state: Log) -> Command[Any]:
        world.enter("s1")
        outcome = charge()
        world.point("s1.after_effect")
        return Command(graph=Command.PARENT, goto="done", update={"log": [f"s1:{outcome}"]})

    inner = StateGraph(Log)
    inner.add_node("s0", s0)
    inner.add_node("s1", s1)
    chain(inner, "s0", "s1")

    def ask(state: Log) -> dict[str, Any]:
        world.enter("ask")
        return {"log": [f"ask:{interrupt('ok?')}"]}

    def done(state: Log) -> dict[str, Any]:
        world.enter("done")
        return {"log": ["done"]}

    builder = StateGraph(Log)
    builder.add_node("ask", ask)
    builder.add_node("sub", inner.compile(), destinations=("done",))
    builder.add_node("done", done)
    for before, after in ((START, "ask"), ("ask", "sub"), ("done", END)):
        builder.add_edge(before, after)  # `sub` goes on by its command alone
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["sync", "exit"])
def test_a_subgraphs_parent_command_killed_after_its_effect_pays_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The subgraph's node pays, then sends the parent to `done`; killed in between,
    the recovery goes there with the dead resumer's value, paying once (P2, P5), and
    in "sync" enters neither `ask` nor the subgraph's finished `s0` again (P1)."""
    world = World(tmp_path)
    graph, cfg = to_parent(world, RemitSaver(url, lease=LEASE)), config()
    graph.invoke({"log": []}, cfg, durability=durability)

    def doomed() -> None:
        world.armed["s1.after_effect"] = "kill"
        to_parent(world, RemitSaver(url, lease=LEASE)).invoke(
            Command(resume="yes"), cfg, durability=durability
        )

    killed(doomed)
    done = graph.invoke(None, cfg, durability=durability)
    assert done == {"log": ["ask:yes", "s1:charge-done", "done"]}
    assert len(world.applications("charge")) == 1
    steps = [s for _, s in world.entries()]
    if durability == "sync":
        assert steps == ["ask", "ask", "s0", "s1", "s1", "done"]
    assert steps.count("done") == 1
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume="no"), cfg)


# -- a retry policy across a kill -------------------------------------------------------


class Flaky(Exception):
    pass


def retrying(world: World, saver: Any, fails: int) -> Any:
    """ask (interrupt) -> pay: pays, then fails its first `fails` attempts (retried)."""
    charge = charging(world)

    def pay(state: Log) -> dict[str, Any]:
        world.enter("pay")
        outcome = charge()
        attempt = len(world.entries("pay"))
        world.point(f"pay.{attempt}")
        if attempt <= fails:
            raise Flaky(attempt)
        return {"log": [outcome]}

    policy = RetryPolicy(retry_on=Flaky, initial_interval=0.05, max_attempts=4, jitter=False)
    builder = StateGraph(Log)
    builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('ok?')}"]})
    builder.add_node("pay", pay, retry_policy=policy)
    chain(builder, "ask", "pay")
    return builder.compile(checkpointer=saver)


def test_a_retried_node_pays_once_across_its_attempts_and_a_kill_between_them(
    url: str, tmp_path: Path
) -> None:
    """Each attempt of a retried node calls the effect again: the attempts are one
    step, and the effect applies once, even when the process dies between two of them
    and a recovery makes the last attempt (P2)."""
    world = World(tmp_path)
    graph, cfg = retrying(world, RemitSaver(url, lease=LEASE), fails=2), config()
    graph.invoke({"log": []}, cfg, durability="sync")

    def doomed() -> None:
        world.armed["pay.2"] = "kill"
        retrying(world, RemitSaver(url, lease=LEASE), fails=2).invoke(
            Command(resume="y"), cfg, durability="sync"
        )

    killed(doomed)
    assert graph.invoke(None, cfg, durability="sync") == {"log": ["ask:y", "charge-done"]}
    assert len(world.entries("pay")) == 3
    assert len(world.applications("charge")) == 1


# -- run context across a pause ---------------------------------------------------------


@dataclass
class Caller:
    user: str


def with_context(saver: Any) -> Any:
    def greet(state: Log, runtime: Runtime[Caller]) -> dict[str, Any]:
        return {"log": [f"greet:{runtime.context.user}"]}

    def ask(state: Log, runtime: Runtime[Caller]) -> dict[str, Any]:
        answer = interrupt("ok?")
        return {"log": [f"ask:{runtime.context.user}:{answer}"]}

    builder = StateGraph(Log, context_schema=Caller)
    builder.add_node("greet", greet)
    builder.add_node("ask", ask)
    chain(builder, "greet", "ask")
    return builder.compile(checkpointer=saver)


def test_the_run_context_is_the_resumers_and_is_not_stored(url: str) -> None:
    """LangGraph does not persist a run's context: a resume (here from another saver,
    as another process would) runs with the resumer's, as with LangGraph's own saver,
    and the stored state holds no trace of it."""
    own, own_cfg = with_context(InMemorySaver()), config()
    own.invoke({"log": []}, own_cfg, context=Caller("ann"))
    expected = own.invoke(Command(resume="y"), own_cfg, context=Caller("bob"))

    cfg = config()
    with_context(RemitSaver(url)).invoke({"log": []}, cfg, context=Caller("ann"))
    graph = with_context(RemitSaver(url))
    assert graph.invoke(Command(resume="y"), cfg, context=Caller("bob")) == expected
    assert expected == {"log": ["greet:ann", "ask:bob:y"]}


# -- the checkpoint, task and debug streams ---------------------------------------------


def two_steps(saver: Any) -> Any:
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('ok?')}"]})
    chain(builder, "a", "ask")
    return builder.compile(checkpointer=saver)


def test_the_checkpoints_tasks_and_debug_streams_are_langgraphs_own(url: str) -> None:
    """What the streams report of each checkpoint (its parent, metadata, next tasks,
    their interrupts and results) and the history read after are what LangGraph's own
    saver reports, up to ids and times."""

    def streamed(saver: Any) -> Any:
        graph, cfg, seen = two_steps(saver), config(), {}
        out = []
        for given in ({"log": []}, Command(resume="y")):
            out += list(graph.stream(given, cfg, stream_mode=["checkpoints", "tasks", "debug"]))
        history = [s._asdict() for s in graph.get_state_history(cfg)]
        return without_ids(out, seen), without_ids(history, seen)

    own = streamed(InMemorySaver())
    assert len(own[0]) > 10 and len(own[1]) == 4
    assert streamed(RemitSaver(url)) == own


# -- astream cancelled mid-node ---------------------------------------------------------


def gated(world: World, saver: Any, gate: asyncio.Event) -> Any:
    """ask (interrupt) -> pay: pays, then waits for `gate`."""
    charge = charging(world)

    async def pay(state: Log) -> dict[str, Any]:
        world.enter("pay")
        outcome = charge()
        await gate.wait()
        return {"log": [outcome]}

    builder = StateGraph(Log)
    builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('ok?')}"]})
    builder.add_node("pay", pay)
    chain(builder, "ask", "pay")
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
def test_an_astream_cancelled_mid_node_frees_the_thread_and_pays_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The task is cancelled while the node waits after its effect: the claim is given
    back at once (lease 30 s), the next `ainvoke(None)` takes the answer the cancelled
    run consumed, pays nothing again, and a second answer is refused (P2, P5, L1)."""
    world = World(tmp_path)

    async def scenario() -> tuple[Any, float]:
        async with AsyncRemitSaver.from_conn_string(url, lease=30.0) as saver:
            gate = asyncio.Event()
            graph, cfg = gated(world, saver, gate), config()
            await graph.ainvoke({"log": []}, cfg, durability=durability)

            async def consume() -> None:
                async for _ in graph.astream(Command(resume="y"), cfg, durability=durability):
                    pass

            task = asyncio.create_task(consume())
            while not world.applications("charge"):
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            started = asyncio.get_running_loop().time()
            done = await graph.ainvoke(None, cfg, durability=durability)
            waited = asyncio.get_running_loop().time() - started
            with pytest.raises(ResumeConflict):
                await graph.ainvoke(Command(resume="z"), cfg)
            return done, waited

    done, waited = asyncio.run(scenario())
    assert done == {"log": ["ask:y", "charge-done"]} and waited < 5
    assert len(world.applications("charge")) == 1 and len(world.entries("pay")) == 2


# -- racing resumers of different Send branches -----------------------------------------


class Items(TypedDict):
    items: list[str]
    log: Annotated[list[str], operator.add]


def reviews(world: World, saver: Any) -> Any:
    """One `review` branch per item (Send): each asks, then ships (effect "ship")."""
    ship = charging(world, "ship")

    def review(state: dict[str, Any]) -> dict[str, Any]:
        answer = interrupt(f"ok {state['item']}?")
        return {"log": [f"{state['item']}:{answer}:{ship()}"]}

    builder = StateGraph(Items)
    builder.add_node("start", lambda s: {})
    builder.add_node("review", review)
    builder.add_edge(START, "start")
    builder.add_conditional_edges(
        "start", lambda s: [Send("review", {"item": i}) for i in s["items"]]
    )
    builder.add_edge("review", END)
    return builder.compile(checkpointer=saver)


def test_racing_resumers_of_different_branches_consume_only_the_winners_values(
    url: str, tmp_path: Path
) -> None:
    """k processes each answer another branch's interrupt by id, at once. A loser gets
    `ResumeConflict` and its interrupt stays pending, its value stored nowhere (P5);
    answered again after, every branch ships once with its own value (P2)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph, cfg = reviews(world, saver), config()
    items = ["a", "b", "c", "d"]
    paused = graph.invoke({"items": items, "log": []}, cfg)
    ids = {i.value.split()[1].rstrip("?"): i.id for i in paused["__interrupt__"]}

    def answer(i: int) -> None:
        reviews(world, RemitSaver(url, lease=LEASE)).invoke(
            Command(resume={ids[items[i]]: f"yes-{items[i]}"}), cfg
        )

    outcomes = {items[i]: outcome for i, _, outcome in race(len(items), answer)}
    assert set(outcomes.values()) <= {"ok", "ResumeConflict"} and "ok" in outcomes.values()
    thread = cfg["configurable"]["thread_id"]
    status = {i.interrupt_id: (i.status, i.value) for i in saver.remit.interrupts(thread)}
    for item, outcome in outcomes.items():
        assert status[ids[item]][0] == ("consumed" if outcome == "ok" else "pending")
        assert (status[ids[item]][1] is None) == (outcome != "ok")
    for item in [i for i, o in outcomes.items() if o != "ok"]:
        graph.invoke(Command(resume={ids[item]: f"yes-{item}"}), cfg)
    final = graph.get_state(cfg)
    assert sorted(final.values["log"]) == [f"{i}:yes-{i}:ship-done" for i in items]
    assert final.next == () and len(world.applications("ship")) == len(items)


# -- racing edits with one fork token ---------------------------------------------------


def three_steps(saver: Any) -> Any:
    builder = StateGraph(Log)
    for name in ("a", "b", "c"):
        builder.add_node(name, lambda s, name=name: {"log": [name]})
    chain(builder, "a", "b", "c")
    return builder.compile(checkpointer=saver)


def test_racing_edits_with_one_fork_token_make_one_branch_holding_the_accepted_edits(
    url: str,
) -> None:
    """k processes `update_state(..., as_node="b")` one old checkpoint with one fork
    token at once: one branch is made (P3); an edit that comes after the first is
    stored on that branch's head (the token names it), or refused (`HeadMoved`, or
    `ResumeConflict` while another edit holds the branch) and stored nowhere. The
    branch holds each accepted edit once; main is untouched."""
    saver = RemitSaver(url, lease=LEASE)
    graph, cfg = three_steps(saver), config()
    graph.invoke({"log": []}, cfg)
    base = next(s for s in graph.get_state_history(cfg) if s.next == ("b",))
    forking = {"configurable": {**base.config["configurable"], "fork_token": "edit"}}

    def edit(i: int) -> None:
        three_steps(RemitSaver(url, lease=LEASE)).update_state(
            forking, {"log": [f"x{i}"]}, as_node="b"
        )

    outcomes = race(4, edit)
    accepted = sorted(f"x{i}" for i, _, outcome in outcomes if outcome == "ok")
    assert accepted and {o for _, _, o in outcomes} - {"ok"} <= {"HeadMoved", "ResumeConflict"}
    thread = cfg["configurable"]["thread_id"]
    assert len(saver.remit.branches(thread)) == 2
    by_token = config(thread, token="edit")
    edits = graph.get_state(by_token).values["log"]
    assert edits[0] == "a" and sorted(edits[1:]) == accepted
    assert graph.invoke(None, by_token)["log"] == [*edits, "c"]
    assert graph.get_state(cfg).values == {"log": ["a", "b", "c"]}


# -- a graph recompiled without the node that asked -------------------------------------


def recompiled(saver: Any, *, asking: bool) -> Any:
    """a -> ask (interrupt) -> b; recompiled without `ask` (a -> b) when not `asking`."""
    builder = StateGraph(Log)
    builder.add_node("a", lambda s: {"log": ["a"]})
    builder.add_node("b", lambda s: {"log": ["b"]})
    builder.add_edge(START, "a")
    if asking:
        builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('ok?')}"]})
        builder.add_edge("a", "ask")
        builder.add_edge("ask", "b")
    else:
        builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("by_id", [False, True])
def test_a_resume_of_a_pause_whose_node_the_recompiled_graph_lacks_is_refused(
    url: str, by_id: bool
) -> None:
    """The paused thread is resumed by a graph recompiled without the node that asked:
    LangGraph has no task to hand the value to and ends the run, the value read by
    nothing. It was consumed all the same (acknowledged, stored, never read: P5). It
    is refused (`ResumeConflict` naming the node) and stored nowhere; the graph that
    has the node still answers the pause, once."""
    saver = RemitSaver(url)
    cfg = config()
    paused = recompiled(saver, asking=True).invoke({"log": []}, cfg)
    asked = paused["__interrupt__"][0].id
    value = {asked: "y"} if by_id else "y"
    with pytest.raises(ResumeConflict, match="'ask'"):
        recompiled(RemitSaver(url), asking=False).invoke(Command(resume=value), cfg)
    thread = cfg["configurable"]["thread_id"]
    assert [(i.status, i.value) for i in saver.remit.interrupts(thread)] == [("pending", None)]
    graph = recompiled(RemitSaver(url), asking=True)
    assert graph.invoke(Command(resume=value), cfg) == {"log": ["a", "ask:y", "b"]}
    with pytest.raises(ResumeConflict):
        graph.invoke(Command(resume=value), cfg)
