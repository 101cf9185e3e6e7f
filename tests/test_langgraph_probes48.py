"""Round 48 of the LangGraph probes: a first run that dies after an effect, in every
durability, then run again with its input or continued with `invoke(None)`; a new run
on a finished thread, and new input on a paused one (their effects are new ones, not
the old run's replayed); a loop that pays once a round, killed in a later round; K
`ainvoke`s in one event loop on one thread, with input or answers; an `@entrypoint`
whose task charges then asks, killed after the answer; an int thread id beside its str
name; edits `as_node` of the head by its id, of an older checkpoint with and without a
fork token, and of a node the graph lacks.

Found: a resume map whose one answer breaks its interrupt's `response_schema` was
refused whole (good) with the message "state does not satisfy its schema at <root>",
which points at the thread's state, not at the answer. Now the `CheckpointInvalid`
says it is the resume value for that interrupt that breaks the `response_schema`, and
that nothing was stored. Real LangGraph, real stores, real processes killed with
SIGKILL; no mocks."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import operator
import signal
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import EmptyInputError, InvalidUpdateError
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import CheckpointInvalid, ForkWithoutIntent, ResumeConflict
from remit_langgraph import AsyncRemitSaver, RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")
DURABILITIES = ["async", "sync", "exit"]


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg48-{uuid.uuid4().hex}"}}


def killed(fn: Any) -> None:
    """Run `fn` in a forked process that must die by SIGKILL; then let its lease lapse."""
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.2)


class Order(TypedDict):
    amount: int
    who: str | None
    log: Annotated[list[str], operator.add]


def order_graph(world: World, saver: Any) -> Any:
    """pay (effect "pay", keyed by the task; its outcome names the amount) -> ask
    (interrupt) -> END."""

    def apply(amount: int, *, idempotency_key: str) -> str:
        world.apply("pay", idempotency_key)
        return f"paid-{amount}"

    # On LangGraph's own saver the payment is a plain call (a Remit effect needs a run).
    pay = (
        (lambda amount: apply(amount, idempotency_key=uuid.uuid4().hex))
        if isinstance(saver, InMemorySaver)
        else remit_core.effect(name="pay", reconcile=world.reconcile("pay"))(apply)
    )

    def pay_step(state: Order) -> dict[str, Any]:
        world.enter("pay")
        paid = pay(state["amount"])
        world.point("pay.after_effect")
        return {"log": [paid]}

    def ask(state: Order) -> dict[str, Any]:
        world.enter("ask")
        return {"who": interrupt("who?"), "log": ["asked"]}

    builder = StateGraph(Order)
    builder.add_node("pay", pay_step)
    builder.add_node("ask", ask)
    builder.add_edge(START, "pay")
    builder.add_edge("pay", "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def test_a_first_exit_mode_run_killed_after_its_effect_run_again_with_its_input_pays_once(
    url: str, tmp_path: Path
) -> None:
    """In "exit" durability the thread's first run dies in pay after the charge; it
    left no checkpoint. Run again with the same input (from the parent), it pays
    nothing more (its pay step is the same step), pauses at ask, and the answer ends it
    with the charge's recorded outcome (P1, P2)."""
    durability = "exit"
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = order_graph(world, saver), config()

        def doomed() -> None:
            world.armed["pay.after_effect"] = "kill"
            graph.invoke({"amount": 7, "who": None, "log": []}, cfg, durability=durability)

        killed(doomed)
        assert len(world.applications("pay")) == 1
        out = graph.invoke({"amount": 7, "who": None, "log": []}, cfg, durability=durability)
        assert [i.value for i in out["__interrupt__"]] == ["who?"]
        out = graph.invoke(Command(resume="alice"), cfg, durability=durability)
        assert out == {"amount": 7, "who": "alice", "log": ["paid-7", "asked"]}
        assert len(world.applications("pay")) == 1
        assert graph.get_state(cfg).next == ()
    finally:
        saver.remit.close()


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_new_run_on_a_finished_thread_applies_its_own_effects(
    url: str, tmp_path: Path, durability: str
) -> None:
    """A thread that ended is run again with new input: its pay step is a new step,
    so its charge is a new one (a second application under another key), not the
    first run's outcome handed back (P2 keys effects by step)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = order_graph(world, saver), config()
        graph.invoke({"amount": 7, "who": None, "log": []}, cfg, durability=durability)
        graph.invoke(Command(resume="alice"), cfg, durability=durability)
        graph.invoke({"amount": 9, "who": None, "log": []}, cfg, durability=durability)
        out = graph.invoke(Command(resume="bob"), cfg, durability=durability)
        assert out["log"] == ["paid-7", "asked", "paid-9", "asked"]
        assert out["who"] == "bob" and out["amount"] == 9
        keys = [line.split(" ", 1)[1] for line in world.applications("pay")]
        assert len(keys) == 2 and keys[0] != keys[1]
    finally:
        saver.remit.close()


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_first_run_killed_then_continued_with_none_matches_a_fresh_thread(
    url: str, tmp_path: Path, durability: str
) -> None:
    """After the first run died, `invoke(None)` on the thread behaves as LangGraph's
    saver would for what was durable: with "exit", nothing was, and the thread is as
    a fresh one (no state; `invoke(None)` raises LangGraph's `EmptyInputError`, as
    LangGraph's own saver does for a thread it never saw); otherwise the run goes on from its input
    checkpoint with the charge's recorded outcome."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = order_graph(world, saver), config()

        def doomed() -> None:
            world.armed["pay.after_effect"] = "kill"
            graph.invoke({"amount": 7, "who": None, "log": []}, cfg, durability=durability)

        killed(doomed)
        if durability == "exit":
            assert graph.get_state(cfg).values == {}
            assert saver.get_tuple(cfg) is None
        if durability == "exit":  # as on LangGraph's own saver for a fresh thread
            with pytest.raises(EmptyInputError):
                graph.invoke(None, cfg, durability=durability)
            assert saver.get_tuple(cfg) is None
        else:
            out = graph.invoke(None, cfg, durability=durability)
            assert [i.value for i in out["__interrupt__"]] == ["who?"]
            out = graph.invoke(Command(resume="alice"), cfg, durability=durability)
            assert out == {"amount": 7, "who": "alice", "log": ["paid-7", "asked"]}
        assert len(world.applications("pay")) == 1
    finally:
        saver.remit.close()


class Rounds(TypedDict):
    n: int
    log: Annotated[list[str], operator.add]


def rounds_graph(world: World, saver: Any, rounds: int) -> Any:
    """A node `pay` in a loop: each round charges once (its own key) and counts."""

    @remit_core.effect(name="pay", reconcile=world.reconcile("pay"))
    def pay(*, idempotency_key: str) -> str:
        return world.apply("pay", idempotency_key)

    def pay_step(state: Rounds) -> dict[str, Any]:
        world.enter(f"pay{state['n']}")
        pay()
        world.point(f"pay{state['n']}.after_effect")
        return {"n": state["n"] + 1, "log": [f"r{state['n']}"]}

    builder = StateGraph(Rounds)
    builder.add_node("pay", pay_step)
    builder.add_edge(START, "pay")
    builder.add_conditional_edges("pay", lambda s: "pay" if s["n"] < rounds else END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_loop_killed_in_a_later_round_pays_each_round_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Five rounds, each charging once; the process dies in round 3 after its charge.
    Recovery (`invoke(None)`, or the input again when "exit" stored nothing) ends with
    exactly five charges under five keys, and the rounds in order."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = rounds_graph(world, saver, 5), config()

        def doomed() -> None:
            world.armed["pay3.after_effect"] = "kill"
            graph.invoke({"n": 0, "log": []}, cfg, durability=durability)

        killed(doomed)
        assert len(world.applications("pay")) == 4
        if saver.get_tuple(cfg) is None:
            assert durability == "exit"
            out = graph.invoke({"n": 0, "log": []}, cfg, durability=durability)
        else:
            out = graph.invoke(None, cfg, durability=durability)
        assert out == {"n": 5, "log": ["r0", "r1", "r2", "r3", "r4"]}
        keys = world.applications("pay")
        assert len(keys) == 5 and len(set(keys)) == 5
    finally:
        saver.remit.close()


def test_an_edit_as_a_node_the_graph_lacks_is_refused_and_stores_nothing(
    url: str, tmp_path: Path
) -> None:
    """`update_state(..., as_node="nope")`: LangGraph's `InvalidUpdateError`; the
    thread's history is as it was and the pause still takes one answer (P3, P5)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = order_graph(world, saver), config()
        graph.invoke({"amount": 7, "who": None, "log": []}, cfg)
        before = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(cfg)]
        with pytest.raises(InvalidUpdateError):
            graph.update_state(cfg, {"amount": 8}, as_node="nope")
        after = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(cfg)]
        assert after == before
        out = graph.invoke(Command(resume="alice"), cfg)
        assert out["who"] == "alice" and out["amount"] == 7
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="bob"), cfg)
    finally:
        saver.remit.close()


def test_new_input_while_paused_starts_a_new_run_as_langgraphs_own_saver(
    url: str, tmp_path: Path
) -> None:
    """Paused at ask, the thread gets new input: as with LangGraph's own saver, the
    pause is left, pay runs again as a new step (a second charge, its own key) and ask
    asks again. An answer by the old question's id is refused and stored nowhere; a
    plain answer takes the new question, once."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = order_graph(world, saver), config()
        (tmp_path / "m").mkdir()
        memory, mcfg = order_graph(World(tmp_path / "m"), InMemorySaver()), config()
        outs = []
        for g, c in ((graph, cfg), (memory, mcfg)):
            first = g.invoke({"amount": 7, "who": None, "log": []}, c)
            second = g.invoke({"amount": 9, "who": None, "log": []}, c)
            outs.append((first, second))
        (first, second), (mfirst, msecond) = outs
        assert {k: v for k, v in second.items() if k != "__interrupt__"} == {
            k: v for k, v in msecond.items() if k != "__interrupt__"
        }
        assert second["log"] == ["paid-7", "paid-9"] and second["amount"] == 9
        old_id = first["__interrupt__"][0].id
        new_id = second["__interrupt__"][0].id
        if old_id != new_id:
            with pytest.raises(ResumeConflict):
                graph.invoke(Command(resume={old_id: "mallory"}), cfg)
        out = graph.invoke(Command(resume="alice"), cfg)
        assert out["who"] == "alice" and out["log"] == ["paid-7", "paid-9", "asked"]
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="bob"), cfg)
        keys = world.applications("pay")
        assert len(keys) == 2 and len(set(keys)) == 2
        assert graph.get_state(cfg).values["who"] == "alice"
    finally:
        saver.remit.close()


K = 8


@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("what", ["input", "resume"])
def test_k_tasks_in_one_event_loop_on_one_thread_one_proceeds_and_pays_once(
    url: str, tmp_path: Path, durability: str, what: str
) -> None:
    """K `ainvoke`s gathered in one event loop on one thread, each with new input on a
    fresh thread (`input`) or each answering its pause (`resume`): exactly one
    proceeds, the others get `ResumeConflict` and enter no node; the charge applies
    once, and only the winner's answer is stored (P2, P5)."""
    world = World(tmp_path)
    saver = AsyncRemitSaver(url, lease=30.0)
    try:
        graph, cfg = order_graph(world, saver), config()
        if what == "resume":
            asyncio.run(graph.ainvoke({"amount": 7, "who": None, "log": []}, cfg))
        entered = len(world.entries())

        async def race() -> list[Any]:
            if what == "input":
                calls = [
                    graph.ainvoke({"amount": 7, "who": None, "log": []}, cfg, durability=durability)
                    for _ in range(K)
                ]
            else:
                calls = [
                    graph.ainvoke(Command(resume=f"r{i}"), cfg, durability=durability)
                    for i in range(K)
                ]
            return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = asyncio.run(race())
        won = [o for o in outcomes if not isinstance(o, BaseException)]
        lost = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(won) == 1, outcomes
        assert all(isinstance(o, ResumeConflict) for o in lost), lost
        steps = [s for _, s in world.entries()[entered:]]
        assert steps == (["pay", "ask"] if what == "input" else ["ask"])
        assert len(world.applications("pay")) == 1
        state = graph.get_state(cfg)
        if what == "resume":
            winner = won[0]["who"]
            assert state.values["who"] == winner and state.next == ()
            assert outcomes.index(won[0]) == int(winner[1:])
        else:
            assert state.next == ("ask",)
            assert graph.invoke(Command(resume="z"), cfg)["log"] == ["paid-7", "asked"]
        assert len(world.applications("pay")) == 1
    finally:
        saver.remit.close()


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def two_int_askers(saver: Any) -> Any:
    """start -> b1 and b2 in parallel, each asking for an int (`response_schema=int`)."""

    def asker(name: str) -> Any:
        def ask(state: Log) -> dict[str, Any]:
            return {"log": [f"{name}:{interrupt(name, response_schema=int)!r}"]}

        return ask

    builder = StateGraph(Log)
    builder.add_node("start", lambda s: {"log": ["start"]})
    builder.add_edge(START, "start")
    for name in ("b1", "b2"):
        builder.add_node(name, asker(name))
        builder.add_edge("start", name)
        builder.add_edge(name, END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_resume_map_with_one_answer_its_schema_refuses_consumes_none_and_says_so(
    url: str, api: str
) -> None:
    """Two questions asking for ints; a map answers one with 5 and the other with
    "nope": the whole command is refused before any value is consumed (LangGraph's own
    saver stores b1's answer and fails on b2's), with a `CheckpointInvalid` that names
    the answer's interrupt and says the answer, not the state, broke its
    `response_schema`. Both questions stay open and each is then answered once."""
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = two_int_askers(saver), config()
        out = graph.invoke({"log": []}, cfg)
        ids = {i.value: i.id for i in out["__interrupt__"]}
        bad = Command(resume={ids["b1"]: 5, ids["b2"]: "nope"})
        with pytest.raises(CheckpointInvalid) as refused:
            if api == "sync":
                graph.invoke(bad, cfg)
            else:
                asyncio.run(graph.ainvoke(bad, cfg))
        error = refused.value
        assert error.interrupt_id == ids["b2"] and error.field == "<root>"
        text = str(error)
        assert "resume value" in text and "response_schema" in text and "state" not in text
        assert "'nope' is not of type 'integer'" in text
        state = graph.get_state(cfg)
        assert sorted(state.next) == ["b1", "b2"] and state.values == {"log": ["start"]}
        assert sorted(i.id for i in state.interrupts) == sorted(ids.values())
        out = graph.invoke(Command(resume={ids["b1"]: 6}), cfg)
        assert [i.id for i in out["__interrupt__"]] == [ids["b2"]]
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume={ids["b1"]: 8}), cfg)
        out = graph.invoke(Command(resume={ids["b2"]: 7}), cfg)
        assert sorted(out["log"]) == ["b1:6", "b2:7", "start"]
    finally:
        saver.remit.close()


def tab_flow(world: World, saver: Any) -> Any:
    """An `@entrypoint` that keeps a running total (`previous`): each call runs the task
    `pay_and_ask`, which charges, then asks inside the task, then the total grows."""

    @remit_core.effect(name="pay", reconcile=world.reconcile("pay"))
    def pay(amount: int, *, idempotency_key: str) -> str:
        world.apply("pay", idempotency_key)
        return f"paid-{amount}"

    @task
    def pay_and_ask(amount: int) -> str:
        world.enter("pay_and_ask")
        paid = pay(amount)
        who = interrupt(f"ok {amount}?")
        world.point("after_answer")
        return f"{paid}:{who}"

    @entrypoint(checkpointer=saver)
    def tab(amount: int, *, previous: Any = None) -> Any:
        done = pay_and_ask(amount).result()
        total = (previous or {}).get("total", 0) + amount
        log = [*(previous or {}).get("log", []), done]
        return {"total": total, "log": log}

    return tab


@pytest.mark.parametrize("durability", DURABILITIES)
def test_an_entrypoint_killed_after_a_tasks_answer_ends_as_an_unkilled_one_and_pays_per_call(
    url: str, tmp_path: Path, durability: str
) -> None:
    """A task charges, then asks; the process that answers it dies after the answer
    (the task unfinished). `invoke(None)` from the parent ends the call with the
    answer it consumed, one charge, and a result equal to an unkilled thread's; a new
    value is refused. A second call on the thread (new input, `previous` carried)
    charges again under its own key (P1, P2, P5)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        tab, cfg, ref = tab_flow(world, saver), config(), config()
        for c in (cfg, ref):
            out = tab.invoke(3, c, durability=durability)
            assert [i.value for i in out["__interrupt__"]] == ["ok 3?"]
        expected = tab.invoke(Command(resume="alice"), ref, durability=durability)
        assert expected == {"total": 3, "log": ["paid-3:alice"]}

        def doomed() -> None:
            world.armed["after_answer"] = "kill"
            tab.invoke(Command(resume="alice"), cfg, durability=durability)

        killed(doomed)
        with pytest.raises(ResumeConflict):
            tab.invoke(Command(resume="mallory"), cfg, durability=durability)
        assert tab.invoke(None, cfg, durability=durability) == expected
        assert len(world.applications("pay")) == 2  # one per thread
        out = tab.invoke(4, cfg, durability=durability)
        assert [i.value for i in out["__interrupt__"]] == ["ok 4?"]
        out = tab.invoke(Command(resume="bob"), cfg, durability=durability)
        assert out == {"total": 7, "log": ["paid-3:alice", "paid-4:bob"]}
        keys = world.applications("pay")
        assert len(keys) == 3 and len(set(keys)) == 3
        with pytest.raises(ResumeConflict):
            tab.invoke(Command(resume="carol"), cfg, durability=durability)
    finally:
        saver.remit.close()


def test_an_int_thread_id_and_its_str_name_are_one_thread_as_in_langgraph(
    url: str, tmp_path: Path
) -> None:
    """LangGraph's savers take a thread id by its `str`: a pause made with
    `thread_id=<int>` is answered by the str id once (its charge not applied again), a
    second answer by the int id is refused, and both ids read the same state and
    history, as with LangGraph's own saver."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph = order_graph(world, saver)
        number = uuid.uuid4().int % 10**12
        as_int = {"configurable": {"thread_id": number}}
        as_str = {"configurable": {"thread_id": str(number)}}
        graph.invoke({"amount": 7, "who": None, "log": []}, as_int)
        assert graph.get_state(as_str).next == ("ask",)
        out = graph.invoke(Command(resume="alice"), as_str)
        assert out == {"amount": 7, "who": "alice", "log": ["paid-7", "asked"]}
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="bob"), as_int)
        ids = [
            [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(c)]
            for c in (as_int, as_str)
        ]
        assert ids[0] == ids[1] and len(ids[0]) == 4
        assert len(world.applications("pay")) == 1
    finally:
        saver.remit.close()


def test_an_edit_as_a_node_of_the_head_by_its_id_is_no_fork_and_of_an_older_one_needs_a_token(
    url: str, tmp_path: Path
) -> None:
    """Paused at ask: `update_state(head's config, ..., as_node="pay")` edits main (no
    token needed); the same edit of the checkpoint before pay raises
    `ForkWithoutIntent` and stores nothing; with a `fork_token` it makes one branch,
    whose history is its edits then its base's line, newest first, and main's state
    stays as it was (P3)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = order_graph(world, saver), config()
        graph.invoke({"amount": 7, "who": None, "log": []}, cfg)
        head = graph.get_state(cfg)
        older = next(s for s in graph.get_state_history(cfg) if s.next == ("pay",))
        edited = graph.update_state(head.config, {"amount": 8}, as_node="pay")
        main = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(cfg)]
        assert main[0] == edited["configurable"]["checkpoint_id"]
        assert graph.get_state(cfg).values["amount"] == 8
        with pytest.raises(ForkWithoutIntent):
            graph.update_state(older.config, {"amount": 9}, as_node="pay")
        assert [
            s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(cfg)
        ] == main
        token = f"tok-{uuid.uuid4().hex}"
        fork_cfg = {"configurable": {**older.config["configurable"], "fork_token": token}}
        forked = graph.update_state(fork_cfg, {"amount": 9}, as_node="pay")
        again = graph.update_state(fork_cfg, {"amount": 9}, as_node="pay")
        branch = {
            "configurable": {"thread_id": cfg["configurable"]["thread_id"], "fork_token": token}
        }
        line = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(branch)]
        assert line[0] == again["configurable"]["checkpoint_id"]
        assert forked["configurable"]["checkpoint_id"] in line
        base_at = line.index(older.config["configurable"]["checkpoint_id"])
        assert line[base_at:] == main[main.index(line[base_at]) :]
        assert line == sorted(line, reverse=True)
        # The thread's listing shows every branch's checkpoints, newest first, as
        # LangGraph's own savers list a thread with forks; main's state is its own.
        listed = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(cfg)]
        assert listed == sorted(set(main) | set(line), reverse=True)
        updates = list(graph.get_state_history(branch, filter={"source": "update"}))
        assert {u.config["configurable"]["checkpoint_id"] for u in updates} >= {
            forked["configurable"]["checkpoint_id"]
        }
        assert graph.get_state(branch).values["amount"] == 9
        assert graph.get_state(cfg).values["amount"] == 8
    finally:
        saver.remit.close()
