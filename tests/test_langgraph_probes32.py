"""RemitSaver at corners of LangGraph's public API: an `astream` of a resume whose
task is cancelled between two steps, then continued; the "updates", "values" and
"debug" streams with `subgraphs=True` across a resume, against LangGraph's own saver;
a `Command(goto=[Send, ...])` fan-out where one branch asks and the process dies in
the other after its effect, in every durability mode; an `update_state(...,
as_node=...)` of one of several pending questions; and a subgraph that asks twice,
answered through the async API, whose consumed answers never reach a later question.
Real LangGraph, real stores, real processes killed with SIGKILL; no mocks."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import operator
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import ResumeConflict
from remit_langgraph import AsyncRemitSaver, RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg32-{uuid.uuid4().hex}"}}


def paying(world: World, name: str) -> Any:
    """An effect `name` that the world's sink counts and reconciles."""

    @remit_core.effect(name=name, reconcile=world.reconcile(name))
    def pay(*, idempotency_key: str) -> str:
        return world.apply(name, idempotency_key)

    return pay


def steps(world: World) -> list[str]:
    return [s for _, s in world.entries()]


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


# -- an astream of a resume cancelled between two steps -------------------------------


def asking(world: World, saver: Any) -> Any:
    """pre -> ask (interrupt) -> pay (effect "pay") -> post. On LangGraph's own saver
    the payment is a plain call (a Remit effect needs a Remit run)."""
    pay = (
        (lambda: world.apply("pay", "-"))
        if isinstance(saver, InMemorySaver)
        else paying(world, "pay")
    )

    def step(name: str, body: Any) -> Any:
        def run(state: Log) -> dict[str, Any]:
            world.enter(name)
            return {"log": [body()]}

        return run

    builder = StateGraph(Log)
    builder.add_node("pre", step("pre", lambda: "pre"))
    builder.add_node("ask", step("ask", lambda: f"ask:{interrupt('pay?')}"))
    builder.add_node("pay", step("pay", pay))
    builder.add_node("post", step("post", lambda: "post"))
    builder.add_edge(START, "pre")
    builder.add_edge("pre", "ask")
    builder.add_edge("ask", "pay")
    builder.add_edge("pay", "post")
    builder.add_edge("post", END)
    return builder.compile(checkpointer=saver)


async def cancelled_between_ask_and_pay(
    graph: Any, world: World, durability: str, *, remit: bool
) -> tuple[list[str], Any]:
    """Pause at ask; stream the answer and cancel the consuming task once ask's update
    arrived (the stream is held there, so pay has not started); then `ainvoke(None)`.
    Returns the steps the answer and the continuation entered, and the result. On
    Remit (`remit`) a second answer after it is refused; LangGraph's own saver has no
    consume-once, so it is not sent there."""
    cfg = config()
    await graph.ainvoke({"log": []}, cfg, durability=durability)
    before = len(world.entries())
    asked = asyncio.Event()

    async def consume() -> None:
        stream = graph.astream(
            Command(resume="yes"), cfg, stream_mode="updates", durability=durability
        )
        async with contextlib.aclosing(stream) as chunks:
            async for update in chunks:
                if "ask" in update:
                    asked.set()
                    await asyncio.Event().wait()  # held here until cancelled

    task = asyncio.create_task(consume())
    await asyncio.wait_for(asked.wait(), 60)
    assert steps(world)[before:] == ["ask"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    done = await graph.ainvoke(None, cfg, durability=durability)
    if remit:
        with pytest.raises(ResumeConflict):
            await graph.ainvoke(Command(resume="again"), cfg, durability=durability)
    return steps(world)[before:], done


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_an_astream_cancelled_between_two_steps_continues_without_rerunning_the_first(
    url: str, tmp_path: Path, durability: str
) -> None:
    """The answered step (ask) is not run again and its value is not asked for again,
    as with LangGraph's own saver; pay runs once and pays once; a second answer is
    refused (P1, P2, P5)."""
    (tmp_path / "own").mkdir()
    (tmp_path / "remit").mkdir()
    own_world, world = World(tmp_path / "own"), World(tmp_path / "remit")
    own_graph = asking(own_world, InMemorySaver())
    own, _ = asyncio.run(
        cancelled_between_ask_and_pay(own_graph, own_world, durability, remit=False)
    )

    async def scenario() -> tuple[list[str], Any]:
        async with AsyncRemitSaver.from_conn_string(url) as saver:
            graph = asking(world, saver)
            return await cancelled_between_ask_and_pay(graph, world, durability, remit=True)

    entered, done = asyncio.run(scenario())
    assert done == {"log": ["pre", "ask:yes", "pay-done", "post"]}
    assert entered == own == ["ask", "pay", "post"]
    assert len(world.applications("pay")) == 1


# -- the streams with subgraphs=True across a resume -----------------------------------


def nested(saver: Any) -> Any:
    """pre -> sub (ask: interrupt -> after) -> post."""
    sub = StateGraph(Log)
    sub.add_node("ask", lambda s: {"log": [f"ask:{interrupt('go?')}"]})
    sub.add_node("after", lambda s: {"log": ["after"]})
    sub.add_edge(START, "ask")
    sub.add_edge("ask", "after")
    sub.add_edge("after", END)
    builder = StateGraph(Log)
    builder.add_node("pre", lambda s: {"log": ["pre"]})
    builder.add_node("sub", sub.compile())
    builder.add_node("post", lambda s: {"log": ["post"]})
    builder.add_edge(START, "pre")
    builder.add_edge("pre", "sub")
    builder.add_edge("sub", "post")
    builder.add_edge("post", END)
    return builder.compile(checkpointer=saver)


#: What differs between two runs of one graph whatever the saver: ids and times.
_RUN_OWN = frozenset(
    {
        "id",
        "checkpoint_id",
        "thread_id",
        "run_id",
        "ts",
        "timestamp",
        "parents",
        "config",
        "parent_config",
        "checkpoint_ns",
        "langgraph_checkpoint_ns",
        "checkpoint_map",
    }
)


def comparable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in _RUN_OWN}
    if hasattr(value, "_asdict"):
        return comparable(value._asdict())
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if hasattr(value, "value") and type(value).__name__ == "Interrupt":
        return ("interrupt", value.value)
    return value


def streamed(saver: Any, api: str, durability: str) -> list[Any]:
    """Every chunk of the first run and of its resume, modes "updates", "values" and
    "debug" with `subgraphs=True`, as (namespace depth, mode, chunk without ids)."""
    graph, cfg = nested(saver), config()
    modes = ["updates", "values", "debug"]
    chunks: list[Any] = []

    async def run() -> None:
        for given in ({"log": []}, Command(resume="y")):
            if api == "sync":
                stream: Any = graph.stream(
                    given, cfg, stream_mode=modes, subgraphs=True, durability=durability
                )
                for ns, mode, chunk in stream:
                    chunks.append((len(ns), mode, comparable(chunk)))
            else:
                astream = graph.astream(
                    given, cfg, stream_mode=modes, subgraphs=True, durability=durability
                )
                async for ns, mode, chunk in astream:
                    chunks.append((len(ns), mode, comparable(chunk)))

    asyncio.run(run())
    return chunks


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
@pytest.mark.parametrize("api", ["sync", "async"])
def test_the_streams_with_subgraphs_across_a_resume_are_langgraphs_own(
    url: str, api: str, durability: str
) -> None:
    """The updates, values and debug chunks of the parent and of the subgraph, before
    the pause and after the answer, are those LangGraph's own saver streams."""
    own = streamed(InMemorySaver(), api, durability)
    saver = RemitSaver(url)
    try:
        got = streamed(saver, api, durability)
    finally:
        saver.remit.close()
    assert ("updates" in {m for _, m, _ in got}) and any(depth == 1 for depth, _, _ in got)
    assert got == own


# -- a Command(goto=[Send, ...]) fan-out: one branch asks, the process dies in the other --


class Fan(TypedDict):
    got: Annotated[list[str], operator.add]


def fanning(world: World, saver: Any) -> Any:
    """gate asks, then sends one branch to ship (effect "ship") and one to ask2 (which
    asks again) with `Command(goto=[Send, Send])`."""
    ship = paying(world, "ship")

    def gate(state: Fan) -> Command[Any]:
        world.enter("gate")
        answer = interrupt("go?")
        return Command(
            update={"got": [f"gate={answer}"]},
            goto=[Send("ship", {"got": []}), Send("ask2", {"got": []})],
        )

    def shipping(state: Fan) -> dict[str, Any]:
        world.enter("ship")
        outcome = ship()
        world.point("ship.after_effect")
        return {"got": [outcome]}

    def ask2(state: Fan) -> dict[str, Any]:
        world.enter("ask2")
        return {"got": [f"ask2={interrupt('more?')}"]}

    builder = StateGraph(Fan)
    builder.add_node("gate", gate)
    builder.add_node("ship", shipping)
    builder.add_node("ask2", ask2)
    builder.add_edge(START, "gate")
    builder.add_edge("ship", END)
    builder.add_edge("ask2", END)
    return builder.compile(checkpointer=saver)


def killed(fn: Any) -> None:
    """Run `fn` in a forked process that must die by SIGKILL; then let its lease lapse."""
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.2)  # the dead resumer's claim runs out (L1)


def wait_for_question(saver: RemitSaver, cfg: dict[str, Any]) -> None:
    """Wait (in a doomed process) until a question is stored on the thread's head."""
    thread = cfg["configurable"]["thread_id"]
    for _ in range(3000):
        head = saver.remit.head(thread)
        writes = [] if head is None else saver.remit.writes(thread, head.checkpoint_id)
        if any(w.channel == "__interrupt__" for w in writes):
            return
        time.sleep(0.01)
    raise AssertionError("the question was never stored")


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_goto_fan_out_killed_after_one_branchs_effect_once_the_other_asked(
    url: str, tmp_path: Path, durability: str
) -> None:
    """ask2's question is stored, then the process dies in ship after its effect: the
    thread is paused at ask2 with ship still to run. The answer to ask2 runs ship again
    (its effect is not applied again) and not gate; a second answer, to either
    question, is refused (P1, P2, P5)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fanning(world, saver), config()
        first = graph.invoke({"got": []}, cfg, durability=durability)
        (gate_question,) = first["__interrupt__"]

        def doomed() -> None:
            point = world.point

            def once_ask2_asked(name: str) -> None:
                if name == "ship.after_effect":
                    wait_for_question(saver, cfg)
                    os.kill(os.getpid(), signal.SIGKILL)
                point(name)

            world.point = once_ask2_asked  # type: ignore[method-assign]
            graph.invoke(Command(resume="yes"), cfg, durability=durability)

        killed(doomed)
        paused = graph.get_state(cfg)
        assert sorted(paused.next) == ["ask2", "ship"]
        assert [i.value for i in paused.interrupts] == ["more?"]
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume={gate_question.id: "no"}), cfg, durability=durability)
        entered = len(world.entries())
        out = graph.invoke(Command(resume="more"), cfg, durability=durability)
        assert sorted(out["got"]) == ["ask2=more", "gate=yes", "ship-done"]
        assert sorted(steps(world)[entered:]) == ["ask2", "ship"]
        assert len(world.applications("ship")) == 1
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="late"), cfg, durability=durability)
        assert graph.get_state(cfg).values == out
    finally:
        saver.remit.close()


def test_a_goto_fan_out_killed_in_exit_mode_redelivers_the_answer_it_consumed(
    url: str, tmp_path: Path
) -> None:
    """In "exit" durability the dying run stored nothing but the answer it consumed:
    a new value is refused, `invoke(None)` runs gate again with "yes", ships once and
    asks ask2, whose answer finishes the run (P1 for what was durable, P2, P5)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fanning(world, saver), config()
        graph.invoke({"got": []}, cfg, durability="exit")

        def doomed() -> None:
            world.armed["ship.after_effect"] = "kill"
            graph.invoke(Command(resume="yes"), cfg, durability="exit")

        killed(doomed)
        assert len(world.applications("ship")) == 1
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="other"), cfg, durability="exit")
        out = graph.invoke(None, cfg, durability="exit")
        assert [i.value for i in out["__interrupt__"]] == ["more?"]
        assert sorted(out["got"]) == ["gate=yes", "ship-done"]
        out = graph.invoke(Command(resume="more"), cfg, durability="exit")
        assert sorted(out["got"]) == ["ask2=more", "gate=yes", "ship-done"]
        assert graph.get_state(cfg).next == ()
        assert len(world.applications("ship")) == 1
        # gate: asked, ran with "yes" in the dead process, ran with it again here.
        assert steps(world).count("gate") == 3
    finally:
        saver.remit.close()


# -- update_state as one of several asking nodes ---------------------------------------


def two_askers(saver: Any) -> Any:
    """start -> b1 (asks once) -> c1 and start -> b2 (asks twice) -> c2, in parallel."""
    builder = StateGraph(Log)
    builder.add_node("start", lambda s: {"log": ["start"]})
    builder.add_node("b1", lambda s: {"log": [f"b1:{interrupt('q1')}"]})
    builder.add_node("b2", lambda s: {"log": [f"b2:{interrupt('q2')}{interrupt('q2b')}"]})
    builder.add_node("c1", lambda s: {"log": ["c1"]})
    builder.add_node("c2", lambda s: {"log": ["c2"]})
    builder.add_edge(START, "start")
    for branch in ("1", "2"):
        builder.add_edge("start", f"b{branch}")
        builder.add_edge(f"b{branch}", f"c{branch}")
        builder.add_edge(f"c{branch}", END)
    return builder.compile(checkpointer=saver)


async def edited_as_b1(saver: Any, api: str) -> tuple[Any, dict[str, Any], dict[str, str], Any]:
    """Pause at b1 and b2, then `update_state(..., as_node="b1")`. Returns the graph,
    the config, the questions' ids by prompt and the state after the edit."""
    graph, cfg = two_askers(saver), config()
    if api == "sync":
        out = graph.invoke({"log": []}, cfg)
        graph.update_state(cfg, {"log": ["edited-b1"]}, as_node="b1")
        return graph, cfg, {i.value: i.id for i in out["__interrupt__"]}, graph.get_state(cfg)
    out = await graph.ainvoke({"log": []}, cfg)
    await graph.aupdate_state(cfg, {"log": ["edited-b1"]}, as_node="b1")
    return graph, cfg, {i.value: i.id for i in out["__interrupt__"]}, await graph.aget_state(cfg)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_an_edit_as_one_of_two_asking_nodes_leaves_what_langgraph_leaves_and_takes_no_answer(
    url: str, api: str
) -> None:
    """LangGraph's edit as b1 ends that pause: c1 is next and neither question is
    pending (LangGraph's own saver shows the same). A value by either old id, or a
    plain one, is refused (`ResumeConflict`) and stored nowhere; `invoke(None)` runs
    c1 once (P5: no value is persisted unread)."""
    _, _, _, own = asyncio.run(edited_as_b1(InMemorySaver(), api))
    saver = RemitSaver(url)
    try:
        graph, cfg, ids, edited = asyncio.run(edited_as_b1(saver, api))
        assert sorted(ids) == ["q1", "q2"]
        assert edited.next == own.next == ("c1",)
        assert edited.values == own.values == {"log": ["start", "edited-b1"]}
        assert edited.interrupts == () and own.interrupts == ()
        head = edited.config["configurable"]["checkpoint_id"]
        for value in ({ids["q1"]: "late"}, {ids["q2"]: "late"}, "late"):
            with pytest.raises(ResumeConflict):
                graph.invoke(Command(resume=value), cfg)
        thread = cfg["configurable"]["thread_id"]
        assert [i for i in saver.remit.interrupts(thread) if i.value] == []
        assert graph.get_state(cfg).config["configurable"]["checkpoint_id"] == head
        assert graph.invoke(None, cfg) == {"log": ["start", "edited-b1", "c1"]}
        assert graph.get_state(cfg).next == ()
    finally:
        saver.remit.close()


# -- answers are never delivered twice: a subgraph asking twice, then its parent --------


def asking_twice_in_a_subgraph(world: World, saver: Any) -> Any:
    """sub (both: asks twice, then pays) -> last (asks once more)."""
    pay = paying(world, "pay")

    def both(state: Log) -> dict[str, Any]:
        world.enter("both")
        first, second = interrupt("first?"), interrupt("second?")
        return {"log": [f"{first}+{second}", pay()]}

    def last(state: Log) -> dict[str, Any]:
        world.enter("last")
        return {"log": [f"last:{interrupt('last?')}"]}

    sub = StateGraph(Log)
    sub.add_node("both", both)
    sub.add_edge(START, "both")
    sub.add_edge("both", END)
    builder = StateGraph(Log)
    builder.add_node("sub", sub.compile())
    builder.add_node("last", last)
    builder.add_edge(START, "sub")
    builder.add_edge("sub", "last")
    builder.add_edge("last", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["exit", "async"])
def test_a_consumed_answer_is_never_delivered_to_a_later_question_async(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Through the async API: after each answer, `ainvoke(None)` asks the next question
    again instead of answering it with the value already consumed (the first answer
    does not finish the node that asks twice); the subgraph pays once, after both
    answers; each answer is taken once."""
    world = World(tmp_path)

    async def scenario() -> list[Any]:
        async with AsyncRemitSaver.from_conn_string(url) as saver:
            graph, cfg = asking_twice_in_a_subgraph(world, saver), config()
            asked: list[Any] = []
            ids: dict[str, str] = {}

            async def run(given: Any) -> Any:
                out = await graph.ainvoke(given, cfg, durability=durability)
                questions = out.get("__interrupt__", ())
                ids.update({i.value: i.id for i in questions})
                asked.append([i.value for i in questions])
                return out

            await run({"log": []})
            await run(Command(resume="A"))
            await run(None)
            assert len(world.applications("pay")) == 0
            await run(Command(resume="B"))
            await run(None)
            for answered in ("first?", "second?"):
                with pytest.raises(ResumeConflict):
                    await graph.ainvoke(
                        Command(resume={ids[answered]: "stale"}), cfg, durability=durability
                    )
            out = await run(Command(resume="C"))
            asked.append(out["log"])
            return asked

    asked = asyncio.run(scenario())
    assert asked == [
        ["first?"],
        ["second?"],
        ["second?"],
        ["last?"],
        ["last?"],
        [],
        ["A+B", "pay-done", "last:C"],
    ]
    assert len(world.applications("pay")) == 1
