"""Round 49 of the LangGraph probes: a node that asks three times, answered one by one
with a process killed between two answers; a `Send` fan-out where one branch asks and
the others pay, answered from another process and by racing processes; listings of a
fork by `filter=`, `before=` and `limit=`, sync and async, and `aget_state` of a fork;
a `delete_thread` from one process while another holds the run in a node about to pay;
a kill inside a store commit (checkpoint, writes, effect outcome) in each durability;
`batch` and `abatch` over threads whose effects share a user key; an async node
retried and killed between attempts; a fork listed before a checkpoint of main; a
fan-out where one branch asks and another fails; `Command(resume=, update=, goto=)`
whose resumer is killed; resumes whose goto is a `Send`.

Found: a `Command(resume=v, goto=Send(...))` at a pause a `Send` branch asked was
taken: LangGraph (its own savers too) runs the goto's packets in place of the step's
pending ones, so the asking branch was dropped and the branch now at its index (same
task id, same interrupt id) took `v` as the answer to its own question, or nothing
read it. The same happened to the value of a resumer that died, on a later
`Command(goto=Send(...))`. Both are now refused with `ResumeConflict` before anything
is consumed or run. The answer was consumed alone, and the command's update and goto
stored later by LangGraph, so a resumer killed between left the answer without them:
they are now stored in the consume's transaction. Real LangGraph, real stores, real
processes killed with SIGKILL; no mocks."""

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
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import Fenced, ResumeConflict, failpoints
from remit_langgraph import RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")
DURABILITIES = ["async", "sync", "exit"]


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg49-{uuid.uuid4().hex}"}}


def killed(fn: Any) -> None:
    """Run `fn` in a forked process that must die by SIGKILL; then let its lease lapse."""
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.2)


def in_child(fn: Any) -> Any:
    """Run `fn` in a forked process; return what it returned or the error it raised."""
    results = CTX.Queue()

    def body() -> None:
        try:
            results.put(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 (handed to the parent)
            results.put(("error", f"{type(exc).__name__}: {exc}"))

    proc = CTX.Process(target=body)
    proc.start()
    outcome = results.get(timeout=120)
    proc.join(60)
    assert proc.exitcode == 0
    return outcome


def shipping(world: World, saver: Any) -> Any:
    """A branch's shipment: a Remit effect, or on LangGraph's own saver a plain call
    (a Remit effect needs a run)."""
    from langgraph.checkpoint.memory import InMemorySaver

    if isinstance(saver, InMemorySaver):
        return lambda: world.apply("ship", uuid.uuid4().hex)
    return pay_with(world, "ship")


def pay_with(world: World, name: str) -> Any:
    @remit_core.effect(name=name, reconcile=world.reconcile(name))
    def pay(*, idempotency_key: str) -> str:
        return world.apply(name, idempotency_key)

    return pay


# -- a node that asks three times -----------------------------------------------------


class Asks(TypedDict):
    answers: list[str]
    log: Annotated[list[str], operator.add]


def three_questions(world: World, saver: Any) -> Any:
    """ask: q0 -> pay -> q1 -> pay -> q2 -> END; each pay is the node's n-th call."""
    pay = pay_with(world, "pay")

    def ask(state: Asks) -> dict[str, Any]:
        world.enter("ask")
        answers = []
        for i in range(3):
            answers.append(interrupt(f"q{i}"))
            if i < 2:
                pay()
                world.point(f"ask.paid{i}")
        return {"answers": answers, "log": ["ask"]}

    builder = StateGraph(Asks)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_three_questions_answered_in_turn_with_a_kill_between_end_as_an_unkilled_run(
    url: str, tmp_path: Path, durability: str
) -> None:
    """q0 is answered here; q1's answerer dies right after the node paid its second
    time. The consumed q1 answer is not taken again (`ResumeConflict`), `invoke(None)`
    asks q2 with both earlier answers in place, and the final state and the two
    payments match an unkilled run's (P1, P2, P5, P6)."""
    (tmp_path / "k").mkdir()
    (tmp_path / "c").mkdir()
    world, clean = World(tmp_path / "k"), World(tmp_path / "c")
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = three_questions(world, saver), config()
        graph.invoke({"answers": [], "log": []}, cfg, durability=durability)
        out = graph.invoke(Command(resume="a"), cfg, durability=durability)
        assert [i.value for i in out["__interrupt__"]] == ["q1"]

        def doomed() -> None:
            world.armed["ask.paid1"] = "kill"
            graph.invoke(Command(resume="b"), cfg, durability=durability)

        killed(doomed)
        assert len(world.applications("pay")) == 2
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="x"), cfg, durability=durability)
        out = graph.invoke(None, cfg, durability=durability)
        assert [i.value for i in out["__interrupt__"]] == ["q2"]
        out = graph.invoke(Command(resume="c"), cfg, durability=durability)
        assert len(world.applications("pay")) == 2

        plain, pcfg = three_questions(clean, saver), config()
        plain.invoke({"answers": [], "log": []}, pcfg, durability=durability)
        for answer in "abc":
            expected = plain.invoke(Command(resume=answer), pcfg, durability=durability)
        assert out == expected == {"answers": ["a", "b", "c"], "log": ["ask"]}
        assert len(clean.applications("pay")) == 2
        assert graph.get_state(cfg).next == ()
    finally:
        saver.remit.close()


# -- Send fan-out: one branch asks, the others pay ------------------------------------


class Fan(TypedDict):
    n: int
    done: Annotated[list[str], operator.add]


class Branch(TypedDict):
    i: int


def fanned(branch: Any, saver: Any) -> Any:
    """A graph that sends one `branch` per `i` below `n`, each ending the run."""

    def fan_out(state: Fan) -> list[Send]:
        return [Send("branch", {"i": i}) for i in range(state["n"])]

    builder = StateGraph(Fan)
    builder.add_node("branch", branch)
    builder.add_conditional_edges(START, fan_out, ["branch"])
    builder.add_edge("branch", END)
    return builder.compile(checkpointer=saver)


def fan_graph(world: World, saver: Any) -> Any:
    pay = shipping(world, saver)

    def branch(state: Branch) -> dict[str, Any]:
        world.enter(f"branch{state['i']}")
        who = interrupt(f"ok {state['i']}?") if state["i"] == 0 else "auto"
        pay()
        return {"done": [f"{state['i']}:{who}"]}

    return fanned(branch, saver)


def test_a_fan_out_answered_from_another_process_pays_each_branch_once(
    url: str, tmp_path: Path
) -> None:
    """Two branches pay and one asks; another process answers: the paying branches are
    not entered again, the asking branch pays once, the answer is consumed once."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fan_graph(world, saver), config()
        out = graph.invoke({"n": 3, "done": []}, cfg, durability="sync")
        assert [i.value for i in out["__interrupt__"]] == ["ok 0?"]
        assert len(world.applications("ship")) == 2
        kind, child = in_child(lambda: graph.invoke(Command(resume="ann"), cfg))
        assert kind == "ok", child
        assert sorted(child["done"]) == ["0:ann", "1:auto", "2:auto"]
        assert len(world.applications("ship")) == 3
        assert [s for _, s in world.entries()].count("branch1") == 1
        assert [s for _, s in world.entries()].count("branch2") == 1
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="bob"), cfg)
        assert sorted(graph.get_state(cfg).values["done"]) == sorted(child["done"])
    finally:
        saver.remit.close()


def test_racing_processes_answer_a_fan_out_once(url: str, tmp_path: Path) -> None:
    """Four processes answer the asking branch at once behind a barrier: one proceeds,
    three get `ResumeConflict`, and the thread holds the winner's answer."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = fan_graph(world, saver), config()
        graph.invoke({"n": 3, "done": []}, cfg)
        k = 4
        barrier, results = CTX.Barrier(k), CTX.Queue()

        def racer(name: str) -> None:
            barrier.wait(60)
            try:
                graph.invoke(Command(resume=name), cfg)
                results.put(("ok", name))
            except ResumeConflict:
                results.put(("conflict", name))
            except BaseException as exc:  # noqa: BLE001
                results.put(("error", repr(exc)))

        procs = [CTX.Process(target=racer, args=(f"r{j}",)) for j in range(k)]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in range(k)]
        for p in procs:
            p.join(60)
        winners = [name for kind, name in got if kind == "ok"]
        assert sorted(kind for kind, _ in got) == ["conflict"] * (k - 1) + ["ok"], got
        assert f"0:{winners[0]}" in graph.get_state(cfg).values["done"]
        assert len(world.applications("ship")) == 3
    finally:
        saver.remit.close()


# -- listings of a fork ------------------------------------------------------------------


class Order(TypedDict):
    amount: int
    who: str | None
    log: Annotated[list[str], operator.add]


def order_graph(saver: Any) -> Any:
    def prepare(state: Order) -> dict[str, Any]:
        return {"amount": 5, "log": ["prepare"]}

    def ask(state: Order) -> dict[str, Any]:
        return {"who": interrupt("who?"), "log": ["ask"]}

    def finish(state: Order) -> dict[str, Any]:
        return {"log": ["finish"]}

    builder = StateGraph(Order)
    builder.add_node("prepare", prepare)
    builder.add_node("ask", ask)
    builder.add_node("finish", finish)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "ask")
    builder.add_edge("ask", "finish")
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=saver)


def test_a_forks_history_by_filter_before_and_limit_is_its_own_line(url: str) -> None:
    """After a fork of the pause is answered, the fork's history (sync and async) lists
    its own line newest first; `filter=`, `before=` and `limit=` cut that line as they
    cut a thread's; `aget_state` of the fork is `get_state`'s; main is unchanged."""
    saver = RemitSaver(url)
    try:
        graph, cfg = order_graph(saver), config()
        graph.invoke({"amount": 0, "who": None, "log": []}, cfg)
        graph.invoke(Command(resume="alice"), cfg)
        main_ids = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(cfg)]
        paused = next(s for s in graph.get_state_history(cfg) if s.next == ("ask",))
        fork = {"configurable": {**paused.config["configurable"], "fork_token": "t1"}}
        graph.invoke(None, fork)
        graph.invoke(Command(resume="bob"), fork)
        by_token = {
            "configurable": {"thread_id": cfg["configurable"]["thread_id"], "fork_token": "t1"}
        }

        history = list(graph.get_state_history(by_token))
        ids = [s.config["configurable"]["checkpoint_id"] for s in history]
        assert ids == sorted(ids, reverse=True)
        assert history[0].values["who"] == "bob" and history[0].next == ()
        assert all(s.values.get("who") != "alice" for s in history)
        assert [s.metadata["source"] for s in history if s.metadata["source"] == "fork"]
        assert [
            s.config["configurable"]["checkpoint_id"]
            for s in graph.get_state_history(by_token, limit=2)
        ] == ids[:2]
        assert [
            s.config["configurable"]["checkpoint_id"]
            for s in graph.get_state_history(
                by_token, before={"configurable": {"checkpoint_id": ids[1]}}
            )
        ] == ids[2:]
        loops = [
            s.config["configurable"]["checkpoint_id"]
            for s in graph.get_state_history(by_token, filter={"source": "loop"})
        ]
        assert loops == [
            i for i, s in zip(ids, history, strict=True) if s.metadata["source"] == "loop"
        ]
        assert loops

        async def alisted() -> tuple[list[str], Any, Any]:
            listed = [
                s.config["configurable"]["checkpoint_id"]
                async for s in graph.aget_state_history(by_token, limit=3)
            ]
            return listed, await graph.aget_state(by_token), await graph.aget_state(fork)

        listed, astate, astate_base = asyncio.run(alisted())
        assert listed == ids[:3]
        state = graph.get_state(by_token)
        assert astate.values == state.values and astate.config == state.config
        assert astate.values["who"] == "bob"
        assert astate_base.values == state.values
        # A thread's listing holds every branch, as LangGraph's own savers list it.
        whole = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(cfg)]
        assert set(main_ids) <= set(whole) and set(ids) <= set(whole)
        assert graph.get_state(cfg).values["who"] == "alice"
    finally:
        saver.remit.close()


# -- delete_thread while another process holds the run ----------------------------------


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_thread_deleted_while_another_process_is_about_to_pay_pays_nothing(
    url: str, tmp_path: Path, durability: str
) -> None:
    """A process runs the thread and waits in a node just before its effect; another
    deletes the thread. The run then stops with `Fenced` at its effect: the payment is
    not applied, and nothing of the run is stored."""
    world = World(tmp_path)
    entered, leave = CTX.Event(), CTX.Event()
    saver = RemitSaver(url, lease=LEASE)
    try:
        pay = pay_with(world, "pay")

        def first(state: Log) -> dict[str, Any]:
            return {"log": ["first"]}

        def paying(state: Log) -> dict[str, Any]:
            entered.set()
            assert leave.wait(60)
            pay()
            return {"log": ["paid"]}

        builder = StateGraph(Log)
        builder.add_node("first", first)
        builder.add_node("paying", paying)
        builder.add_edge(START, "first")
        builder.add_edge("first", "paying")
        builder.add_edge("paying", END)
        graph, cfg = builder.compile(checkpointer=saver), config()
        thread = cfg["configurable"]["thread_id"]
        results = CTX.Queue()

        def runner() -> None:
            try:
                graph.invoke({"log": []}, cfg, durability=durability)
                results.put("finished")
            except BaseException as exc:  # noqa: BLE001
                results.put(type(exc).__name__)

        proc = CTX.Process(target=runner)
        proc.start()
        assert entered.wait(60)
        saver.delete_thread(thread)
        leave.set()
        outcome = results.get(timeout=120)
        proc.join(60)
        assert outcome == Fenced.__name__
        assert world.applications("pay") == []
        other = RemitSaver(url)
        try:
            assert other.remit.history(thread) == []
            assert graph.get_state(cfg).values == {}
        finally:
            other.remit.close()
    finally:
        saver.remit.close()


# -- a kill inside the store's commit ---------------------------------------------------


def chain(world: World, saver: Any) -> Any:
    pay = pay_with(world, "pay")

    def step(name: str) -> Any:
        def body(state: Log) -> dict[str, Any]:
            world.enter(name)
            if name == "b":
                pay()
            return {"log": [name]}

        return body

    builder = StateGraph(Log)
    for name in "abcd":
        builder.add_node(name, step(name))
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", "d")
    builder.add_edge("d", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("point", ["checkpoint.in_commit", "writes.in_txn", "effect.in_outcome"])
def test_a_kill_inside_a_store_commit_recovers_as_an_unkilled_run(
    url: str, tmp_path: Path, durability: str, nth: int, point: str
) -> None:
    """The process dies inside the store's n-th checkpoint commit (in "async"
    durability that commit runs in LangGraph's background executor). Recovery with
    `invoke(None)` (or the input again, if nothing was committed) ends as an unkilled
    run, pays once, and enters no step that a committed checkpoint holds twice."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = chain(world, saver), config()

        def doomed() -> None:
            failpoints.arm(point, f"kill@{nth}")
            graph.invoke({"log": []}, cfg, durability=durability)

        proc = CTX.Process(target=doomed)
        proc.start()
        proc.join(120)
        if proc.exitcode == 0:
            # The run made fewer such commits than `nth` ("exit" makes one checkpoint,
            # the chain one effect): it ended as it would have.
            assert durability == "exit" or point == "effect.in_outcome", proc.exitcode
            assert graph.get_state(cfg).values == {"log": ["a", "b", "c", "d"]}
            assert len(world.applications("pay")) == 1
            return
        assert proc.exitcode == -signal.SIGKILL
        time.sleep(LEASE + 0.2)
        done_before = [s for _, s in world.entries()]
        head = graph.get_state(cfg)
        out = graph.invoke(None if head.values else {"log": []}, cfg, durability=durability)
        assert out == {"log": ["a", "b", "c", "d"]}
        assert len(world.applications("pay")) == 1
        committed = head.values.get("log", [])
        entered = [s for _, s in world.entries()][len(done_before) :]
        assert not set(committed) & set(entered), (committed, entered)
    finally:
        saver.remit.close()


# -- batch over threads whose effects share a user key -----------------------------------


def keyed_graph(world: World, saver: Any) -> Any:
    @remit_core.effect(name="mail", key=lambda to: f"mail:{to}", reconcile=world.reconcile("mail"))
    def mail(to: str, *, idempotency_key: str) -> str:
        return world.apply("mail", idempotency_key)

    def ask(state: Order) -> dict[str, Any]:
        return {"who": interrupt("who?")}

    def send(state: Order) -> dict[str, Any]:
        return {"log": [mail(str(state["who"]))]}

    builder = StateGraph(Order)
    builder.add_node("ask", ask)
    builder.add_node("send", send)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "send")
    builder.add_edge("send", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_batch_over_threads_sharing_a_user_key_pays_each_thread_once(
    url: str, tmp_path: Path, api: str
) -> None:
    """Three threads, resumed by one `batch`/`abatch` with the same answer, each make
    the effect with one user key: each thread pays once under its own idempotency key,
    and a second batch of the answers is refused on every thread."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph = keyed_graph(world, saver)
        cfgs = [config() for _ in range(3)]
        graph.batch([{"amount": 1, "who": None, "log": []}] * 3, cfgs)
        resumes = [Command(resume="carol")] * 3
        if api == "sync":
            outs = graph.batch(resumes, cfgs)
            again = graph.batch(resumes, cfgs, return_exceptions=True)
        else:

            async def both() -> tuple[list[Any], list[Any]]:
                first = await graph.abatch(resumes, cfgs)
                return first, await graph.abatch(resumes, cfgs, return_exceptions=True)

            outs, again = asyncio.run(both())
        assert [o["log"] for o in outs] == [["mail-done"]] * 3
        keys = [line.split(" ", 1)[1] for line in world.applications("mail")]
        assert len(keys) == 3 and len(set(keys)) == 3
        assert all(isinstance(e, ResumeConflict) for e in again), again
        assert len(world.applications("mail")) == 3
    finally:
        saver.remit.close()


# -- a resume with an update and a goto, its resumer killed ---------------------------------


def routed_graph(world: World, saver: Any) -> Any:
    pay = pay_with(world, "pay")

    def ask(state: Order) -> dict[str, Any]:
        world.enter("ask")
        return {"who": interrupt("who?"), "log": ["ask"]}

    def charge(state: Order) -> dict[str, Any]:
        world.enter("charge")
        pay()
        world.point("charge.paid")
        return {"log": [f"charge {state['amount']}"]}

    def skip(state: Order) -> dict[str, Any]:
        world.enter("skip")
        return {"log": [f"skip {state['amount']}"]}

    builder = StateGraph(Order)
    builder.add_node("ask", ask)
    builder.add_node("charge", charge)
    builder.add_node("skip", skip)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "charge")
    builder.add_edge("charge", END)
    builder.add_edge("skip", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize(
    ("point", "durability"),
    [
        ("interrupt.after_consume", "async"),
        ("interrupt.after_consume", "sync"),
        ("interrupt.after_consume", "exit"),
        ("charge.paid", "async"),
        ("charge.paid", "sync"),
        ("charge.paid", "exit"),
    ],
)
def test_a_resume_with_update_and_goto_killed_recovers_as_an_unkilled_one(
    url: str, tmp_path: Path, durability: str, point: str
) -> None:
    """`Command(resume=, update=, goto=)`: its resumer dies after the answer was
    consumed (or after the charge). `invoke(None)` then ends where an unkilled run of
    the same command ends: the answer, the update and the goto all taken, or the answer
    not consumed at all; never the answer without the update (P5, P6)."""
    (tmp_path / "k").mkdir()
    (tmp_path / "c").mkdir()
    world, clean = World(tmp_path / "k"), World(tmp_path / "c")
    command = Command(resume="dan", update={"amount": 9}, goto="skip")
    saver = RemitSaver(url, lease=LEASE)
    try:
        plain, pcfg = routed_graph(clean, saver), config()
        plain.invoke({"amount": 1, "who": None, "log": []}, pcfg, durability=durability)
        expected = plain.invoke(command, pcfg, durability=durability)

        graph, cfg = routed_graph(world, saver), config()
        graph.invoke({"amount": 1, "who": None, "log": []}, cfg, durability=durability)

        def doomed() -> None:
            if point.startswith("interrupt."):
                failpoints.arm(point, "kill")
            else:
                world.armed[point] = "kill"
            graph.invoke(command, cfg, durability=durability)

        killed(doomed)
        try:
            out = graph.invoke(None, cfg, durability=durability)
        except ResumeConflict:
            out = None
        if out is None or "__interrupt__" in out:
            # The answer was not consumed: the command may be sent again.
            out = graph.invoke(command, cfg, durability=durability)
        assert out == expected, (out, expected)
        assert len(world.applications("pay")) == len(clean.applications("pay"))
    finally:
        saver.remit.close()


# -- a fan-out with two questions answered by id, a kill between -----------------------


def two_askers(world: World, saver: Any) -> Any:
    pay = pay_with(world, "ship")

    def branch(state: Branch) -> dict[str, Any]:
        world.enter(f"branch{state['i']}")
        who = interrupt(f"ok {state['i']}?") if state["i"] < 2 else "auto"
        pay()
        world.point(f"branch{state['i']}.paid")
        return {"done": [f"{state['i']}:{who}"]}

    return fanned(branch, saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_two_asking_branches_answered_in_turn_by_id_with_a_kill_between(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Branches 0 and 1 ask, branch 2 pays. A process answers branch 0 by id and dies
    after it paid; `invoke(None)` gives branch 0 its answer back (no new value for it
    is taken), pays nothing again, and asks branch 1 alone; another process answers
    branch 1 by id. Each branch pays once and the end matches an unkilled run."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = two_askers(world, saver), config()
        out = graph.invoke({"n": 3, "done": []}, cfg, durability=durability)
        ids = {i.value: i.id for i in out["__interrupt__"]}
        assert sorted(ids) == ["ok 0?", "ok 1?"]

        def doomed() -> None:
            world.armed["branch0.paid"] = "kill"
            graph.invoke(Command(resume={ids["ok 0?"]: "zoe"}), cfg, durability=durability)

        killed(doomed)
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume={ids["ok 0?"]: "yan"}), cfg, durability=durability)
        out = graph.invoke(None, cfg, durability=durability)
        assert [i.value for i in out["__interrupt__"]] == ["ok 1?"]
        later = out["__interrupt__"][0].id
        kind, done = in_child(
            lambda: graph.invoke(Command(resume={later: "xi"}), cfg, durability=durability)
        )
        assert kind == "ok", done
        assert sorted(done["done"]) == ["0:zoe", "1:xi", "2:auto"]
        assert len(world.applications("ship")) == 3
        assert [s for _, s in world.entries()].count("branch2") == 1
    finally:
        saver.remit.close()


# -- an async node retried, killed between its attempts ----------------------------------


class Flaky(Exception):
    pass


def async_retrying(world: World, saver: Any) -> Any:
    from langgraph.types import RetryPolicy

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    async def charge(*, idempotency_key: str) -> str:
        return world.apply("charge", idempotency_key)

    async def pay(state: Log) -> dict[str, Any]:
        world.enter("pay")
        attempt = len(world.entries("pay"))
        done = await charge()
        world.point(f"pay.{attempt}")
        if attempt < 3:
            raise Flaky(f"attempt {attempt}")
        return {"log": [done]}

    async def ask(state: Log) -> dict[str, Any]:
        return {"log": [f"ask:{interrupt('ok?')}"]}

    builder = StateGraph(Log)
    builder.add_node("ask", ask)
    builder.add_node(
        "pay",
        pay,
        retry_policy=RetryPolicy(initial_interval=0.01, jitter=False, retry_on=Flaky),
    )
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "pay")
    builder.add_edge("pay", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_an_async_retried_node_killed_between_attempts_pays_once(
    url: str, tmp_path: Path, durability: str
) -> None:
    """An async node whose attempts each call an async effect dies after its second
    attempt paid; another process's `ainvoke(None)` makes the last attempt: the charge
    applies once, with the recorded outcome (P2)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = async_retrying(world, saver), config()
        asyncio.run(graph.ainvoke({"log": []}, cfg, durability=durability))

        def doomed() -> None:
            world.armed["pay.2"] = "kill"
            asyncio.run(graph.ainvoke(Command(resume="y"), cfg, durability=durability))

        killed(doomed)
        kind, out = in_child(lambda: asyncio.run(graph.ainvoke(None, cfg, durability=durability)))
        assert kind == "ok", out
        assert out == {"log": ["ask:y", "charge-done"]}
        assert len(world.entries("pay")) == 3
        assert len(world.applications("charge")) == 1
    finally:
        saver.remit.close()


# -- a fork's listing bounded by a checkpoint of main --------------------------------------


def test_a_forks_listing_before_a_checkpoint_of_main_cuts_by_id(url: str) -> None:
    """`before=` names a checkpoint of main, not of the fork: the fork's listing is cut
    at that id, as LangGraph's savers cut a listing by id, and nothing of main shows."""
    saver = RemitSaver(url)
    try:
        graph, cfg = order_graph(saver), config()
        graph.invoke({"amount": 0, "who": None, "log": []}, cfg)
        paused = next(s for s in graph.get_state_history(cfg) if s.next == ("ask",))
        fork = {"configurable": {**paused.config["configurable"], "fork_token": "t2"}}
        graph.invoke(None, fork)
        graph.invoke(Command(resume="bob"), cfg)  # main moves on after the fork
        graph.invoke(Command(resume="eve"), fork)
        thread = cfg["configurable"]["thread_id"]
        by_token = {"configurable": {"thread_id": thread, "fork_token": "t2"}}
        fork_ids = [
            s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(by_token)
        ]
        main_ids = [
            s.config["configurable"]["checkpoint_id"]
            for s in graph.get_state_history(cfg)
            if s.config["configurable"]["checkpoint_id"] not in fork_ids
        ]
        assert main_ids and fork_ids
        for bound in main_ids:
            cut = [
                s.config["configurable"]["checkpoint_id"]
                for s in graph.get_state_history(
                    by_token, before={"configurable": {"checkpoint_id": bound}}
                )
            ]
            assert cut == [i for i in fork_ids if i < bound], bound
    finally:
        saver.remit.close()


# -- a fan-out where one branch asks and another fails -------------------------------------


def ask_and_fail(world: World, saver: Any, flag: Path) -> Any:
    from langgraph.checkpoint.memory import InMemorySaver

    def apply(*, idempotency_key: str) -> str:
        return world.apply("ship", idempotency_key)

    pay = (
        (lambda: apply(idempotency_key=uuid.uuid4().hex))
        if isinstance(saver, InMemorySaver)
        else remit_core.effect(name="ship", reconcile=world.reconcile("ship"))(apply)
    )

    def branch(state: Branch) -> dict[str, Any]:
        world.enter(f"branch{state['i']}")
        if state["i"] == 0:
            return {"done": [f"0:{interrupt('ok 0?')}"]}
        pay()
        if state["i"] == 1 and not flag.exists():
            flag.touch()
            raise RuntimeError("branch 1 fails once")
        return {"done": [f"{state['i']}:auto"]}

    return fanned(branch, saver)


def test_a_fan_out_with_one_branch_asking_and_one_failing_goes_as_langgraphs_own(
    url: str, tmp_path: Path
) -> None:
    """The first run fails in branch 1 (after it paid) while branch 0 asks. Whether the
    thread is then paused as well as failed depends on a LangGraph race, on its own
    saver too: it stores the asking branch's question from a callback that may run
    after the run shut its executor down, and then drops it. Both orders are taken:
    - paused: the answer is taken as LangGraph's own saver takes it, running branch 1
      again (which pays nothing again) beside the answered branch;
    - question dropped: the thread is not paused, so the answer is refused with
      `ResumeConflict` (naming the failed node, unless LangGraph dropped its error the
      same way), nothing stored (LangGraph's own saver stores it for the next
      question); `invoke(None)` asks again, and the answer is taken then.
    Either way the end is LangGraph's own, branch 1's shipment applies once, and a
    second answer is refused."""
    from langgraph.checkpoint.memory import InMemorySaver

    (tmp_path / "r").mkdir()
    (tmp_path / "m").mkdir()
    world, mworld = World(tmp_path / "r"), World(tmp_path / "m")
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = ask_and_fail(world, saver, tmp_path / "r" / "flag"), config()
        memory = ask_and_fail(mworld, InMemorySaver(), tmp_path / "m" / "flag")
        mcfg = config()
        for g, c in ((graph, cfg), (memory, mcfg)):
            with pytest.raises(RuntimeError, match="fails once"):
                g.invoke({"n": 3, "done": []}, c, durability="sync")
        asked = [i.value for i in graph.get_state(cfg).interrupts]
        assert asked in ([], ["ok 0?"])
        assert [i.value for i in memory.get_state(mcfg).interrupts] in ([], ["ok 0?"])
        expected = memory.invoke(Command(resume="al"), mcfg, durability="sync")
        if not asked:  # the question was dropped: the thread is failed, not paused
            state = graph.get_state(cfg)
            with pytest.raises(ResumeConflict, match="not paused at an interrupt"):
                graph.invoke(Command(resume="al"), cfg, durability="sync")
            assert graph.get_state(cfg).values == state.values
            assert graph.get_state(cfg).config == state.config
            out = graph.invoke(None, cfg, durability="sync")
            assert [i.value for i in out["__interrupt__"]] == ["ok 0?"]
        out = graph.invoke(Command(resume="al"), cfg, durability="sync")
        assert sorted(out["done"]) == sorted(expected["done"]) == ["0:al", "1:auto", "2:auto"]
        assert len(world.applications("ship")) == 2  # (LangGraph's own saver: 3)
        # (Branch 2 runs again if branch 1's error cancelled it before it finished;
        # branch 0 asks once more when its question was dropped.)
        entered = [s for _, s in world.entries()]
        assert entered.count("branch1") == 2
        assert entered.count("branch0") == (2 if asked else 3)
        assert entered.count("branch2") in (1, 2)
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="bo"), cfg, durability="sync")
        assert graph.get_state(cfg).next == memory.get_state(mcfg).next == ()
    finally:
        saver.remit.close()


# -- a resume whose goto is a Send -----------------------------------------------------------


def asking_sends(world: World, saver: Any, asking: tuple[int, ...]) -> Any:
    """START sends `n` branches; those in `asking` ask, then every branch ships (a
    point `branch<i>.paid` after it)."""
    pay = shipping(world, saver)

    def branch(state: Branch) -> dict[str, Any]:
        world.enter(f"branch{state['i']}")
        who = interrupt(f"ok {state['i']}?") if state["i"] in asking else "auto"
        pay()
        world.point(f"branch{state['i']}.paid")
        return {"done": [f"{state['i']}:{who}"]}

    return fanned(branch, saver)


@pytest.mark.parametrize("by_id", [False, True], ids=["plain", "map"])
def test_a_resume_whose_goto_send_replaces_the_asking_branch_is_refused(
    url: str, tmp_path: Path, by_id: bool
) -> None:
    """The asking branch is a `Send`; `Command(resume=..., goto=Send(...))` replaces the
    step's pending sends with the goto's, so LangGraph (its own saver included) drops
    the asking branch and hands its answer to the branch now at its index: here that
    branch asks another question, and would take this answer for it. Refused with
    `ResumeConflict` naming the interrupt; nothing is stored or run; the question stays
    open and a plain resume answers it, once (P5)."""
    from langgraph.checkpoint.memory import InMemorySaver

    (tmp_path / "r").mkdir()
    (tmp_path / "m").mkdir()
    world, mworld = World(tmp_path / "r"), World(tmp_path / "m")
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = asking_sends(world, saver, (0, 7)), config()
        out = graph.invoke({"n": 1, "done": []}, cfg, durability="sync")
        asked = out["__interrupt__"][0]
        answer: Any = {asked.id: "sue"} if by_id else "sue"
        command = Command(resume=answer, goto=Send("branch", {"i": 7}))

        # What LangGraph's own saver does: the answer to "ok 0?" answers "ok 7?".
        memory, mcfg = asking_sends(mworld, InMemorySaver(), (0, 7)), config()
        mout = memory.invoke({"n": 1, "done": []}, mcfg, durability="sync")
        mcommand = Command(
            resume={mout["__interrupt__"][0].id: "sue"} if by_id else "sue",
            goto=Send("branch", {"i": 7}),
        )
        assert memory.invoke(mcommand, mcfg, durability="sync")["done"] == ["7:sue"]

        before = len(world.entries())
        with pytest.raises(ResumeConflict, match="goto replaces") as refused:
            graph.invoke(command, cfg, durability="sync")
        assert refused.value.interrupt_id == asked.id
        with pytest.raises(ResumeConflict, match="goto replaces"):
            asyncio.run(graph.ainvoke(command, cfg, durability="sync"))
        assert len(world.entries()) == before and world.applications("ship") == []
        state = graph.get_state(cfg)
        assert [i.id for i in state.interrupts] == [asked.id]
        done = graph.invoke(Command(resume="sue"), cfg, durability="sync")
        assert done["done"] == ["0:sue"]
        assert len(world.applications("ship")) == 1
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="sue"), cfg, durability="sync")
    finally:
        saver.remit.close()


def test_a_goto_that_keeps_the_asking_send_first_is_taken_and_a_kill_pays_once(
    url: str, tmp_path: Path
) -> None:
    """A goto that gives the asking branch's own packet at its index first keeps the
    branch: the answer reaches it, the extra branch runs beside it, as on LangGraph's
    own saver; a resumer killed after the first shipment is recovered by
    `invoke(None)` with each branch shipping once."""
    from langgraph.checkpoint.memory import InMemorySaver

    (tmp_path / "r").mkdir()
    (tmp_path / "m").mkdir()
    world, mworld = World(tmp_path / "r"), World(tmp_path / "m")
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = asking_sends(world, saver, (0,)), config()
        memory, mcfg = asking_sends(mworld, InMemorySaver(), (0,)), config()
        command = Command(resume="sue", goto=[Send("branch", {"i": 0}), Send("branch", {"i": 7})])
        for g, c in ((graph, cfg), (memory, mcfg)):
            g.invoke({"n": 1, "done": []}, c, durability="sync")

        def doomed() -> None:
            failpoints.arm("effect.after_outcome", "kill")
            graph.invoke(command, cfg, durability="sync")

        killed(doomed)
        # (The two branches run at once: the other may have shipped before the kill.)
        assert len(world.applications("ship")) in (1, 2)
        with pytest.raises(ResumeConflict):
            graph.invoke(Command(resume="tom"), cfg, durability="sync")
        out = graph.invoke(None, cfg, durability="sync")
        expected = memory.invoke(command, mcfg, durability="sync")
        assert sorted(out["done"]) == sorted(expected["done"]) == ["0:sue", "7:auto"]
        assert len(world.applications("ship")) == len(mworld.applications("ship")) == 2
        assert graph.get_state(cfg).next == memory.get_state(mcfg).next == ()
    finally:
        saver.remit.close()


def test_a_goto_send_after_a_dead_resumer_does_not_hand_its_answer_to_another_branch(
    url: str, tmp_path: Path
) -> None:
    """A resumer consumed the answer to the `Send` branch's "ok 0?" and died. A
    `Command(goto=Send(...))` without a value, which LangGraph runs by giving the
    consumed answer to the branch the goto puts at that index (here one asking "ok
    7?"), is refused with `ResumeConflict`; nothing runs, and `invoke(None)` then
    gives the answer to its own branch, once (P5)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = asking_sends(world, saver, (0, 7)), config()
        out = graph.invoke({"n": 1, "done": []}, cfg, durability="sync")
        asked = out["__interrupt__"][0].id

        def doomed() -> None:
            failpoints.arm("interrupt.after_consume", "kill")
            graph.invoke(Command(resume="sue"), cfg, durability="sync")

        killed(doomed)
        before = len(world.entries())
        with pytest.raises(ResumeConflict, match="goto replaces") as refused:
            graph.invoke(Command(goto=Send("branch", {"i": 7})), cfg, durability="sync")
        assert refused.value.interrupt_id == asked
        assert len(world.entries()) == before
        done = graph.invoke(None, cfg, durability="sync")
        assert done["done"] == ["0:sue"]
        assert len(world.applications("ship")) == 1
    finally:
        saver.remit.close()
