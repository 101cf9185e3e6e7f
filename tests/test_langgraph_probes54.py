"""Round 54 of the LangGraph probes: a `Send` map-reduce whose branches each ask,
answered by partial resume maps keyed by interrupt id, by racing processes, and after
a resumer that answered some of them died; and `copy_thread` of a thread while another
process holds its claim inside a node about to pay.

Found: a resumer answered two of three asking branches by id and was SIGKILLed after
one of them paid. A next `Command(resume={third_id: v})`, an answer to the one
question still open, was taken, but the two values the dead resumer had consumed were
not handed back: their branches asked again, `get_state` showed their questions
pending, and every answer to them was refused as "already consumed" (`invoke(None)`
alone recovered them). A plain value for the last open question was consumed and the
run then failed with LangGraph's "multiple pending interrupts" error. Now the values
a dead resumer consumed go back to their branches beside the new answers, by id: each
branch ends with its own answer and pays once (P5, P2). Real LangGraph, real stores on
every engine, real processes killed with SIGKILL; no mocks."""

from __future__ import annotations

import multiprocessing as mp
import operator
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from test_langgraph_probes49 import asking_sends, killed, pay_with
from test_langgraph_support import World
from typing_extensions import TypedDict

from remit_core import ResumeConflict
from remit_langgraph import RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg54-{uuid.uuid4().hex}"}}


# -- a map-reduce whose branches ask --------------------------------------------------


ASKING = (0, 1, 2)


def map_reduce(world: World, saver: Any) -> Any:
    """START sends branches 0..n-1; 0, 1 and 2 ask, then every branch ships once."""
    return asking_sends(world, saver, ASKING)


@pytest.mark.parametrize(
    ("how", "durability"),
    [("map", "sync"), ("map", "exit"), ("plain", "async"), ("plain", "exit")],
)
def test_an_answer_to_the_last_question_after_a_dead_resumer_gives_its_values_back(
    url: str, tmp_path: Path, how: str, durability: str
) -> None:
    """Three branches ask. A resumer answers two of them by id and dies after one of
    them paid; the next command answers the third question alone (by id, or with a
    plain value: it is the one still open). The two values the dead resumer consumed
    go back to their branches: the run ends with every branch's own answer, each
    branch ships once, as on LangGraph's own saver answered without a kill; the
    consumed questions are not shown as open, and no answer is taken again (P5)."""
    from langgraph.checkpoint.memory import InMemorySaver

    (tmp_path / "r").mkdir()
    (tmp_path / "m").mkdir()
    world, mworld = World(tmp_path / "r"), World(tmp_path / "m")
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = map_reduce(world, saver), config()
        out = graph.invoke({"n": 4, "done": []}, cfg, durability=durability)
        ids = {i.value: i.id for i in out["__interrupt__"]}
        assert sorted(ids) == ["ok 0?", "ok 1?", "ok 2?"]

        def doomed() -> None:
            world.armed["branch0.paid"] = "kill"
            answers = {ids["ok 0?"]: "ann", ids["ok 1?"]: "bob"}
            graph.invoke(Command(resume=answers), cfg, durability=durability)

        killed(doomed)
        last: Any = {ids["ok 2?"]: "cy"} if how == "map" else "cy"
        out = graph.invoke(Command(resume=last), cfg, durability=durability)
        assert "__interrupt__" not in out
        assert sorted(out["done"]) == ["0:ann", "1:bob", "2:cy", "3:auto"]
        assert len(world.applications("ship")) == 4
        entered = [s for _, s in world.entries()]
        assert entered.count("branch3") == 1
        assert graph.get_state(cfg).next == ()
        for iid in ids.values():
            with pytest.raises(ResumeConflict):
                graph.invoke(Command(resume={iid: "eve"}), cfg, durability=durability)

        memory, mcfg = map_reduce(mworld, InMemorySaver()), config()
        mout = memory.invoke({"n": 4, "done": []}, mcfg, durability=durability)
        mids = {i.value: i.id for i in mout["__interrupt__"]}
        memory.invoke(
            Command(resume={mids["ok 0?"]: "ann", mids["ok 1?"]: "bob"}),
            mcfg,
            durability=durability,
        )
        mlast: Any = {mids["ok 2?"]: "cy"} if how == "map" else "cy"
        expected = memory.invoke(Command(resume=mlast), mcfg, durability=durability)
        assert sorted(expected["done"]) == sorted(out["done"])
        assert len(mworld.applications("ship")) == 4
    finally:
        saver.remit.close()


def test_a_map_naming_a_question_a_dead_resumer_took_consumes_nothing(
    url: str, tmp_path: Path
) -> None:
    """After the resumer of questions 0 and 1 died, a map that answers 1 again beside
    the open 2 is refused whole (`ResumeConflict`), and so is an answer to 2 whose
    goto `Send` replaces branch 0 (LangGraph would hand branch 0's owed answer to the
    goto's branch): 2 stays open, nothing runs, and the next answer to it alone ends
    the run with the dead resumer's answers for 0 and 1."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = map_reduce(world, saver), config()
        out = graph.invoke({"n": 3, "done": []}, cfg, durability="sync")
        ids = {i.value: i.id for i in out["__interrupt__"]}

        def doomed() -> None:
            world.armed["branch0.paid"] = "kill"
            answers = {ids["ok 0?"]: "ann", ids["ok 1?"]: "bob"}
            graph.invoke(Command(resume=answers), cfg, durability="sync")

        killed(doomed)
        before = len(world.entries())
        with pytest.raises(ResumeConflict) as refused:
            graph.invoke(
                Command(resume={ids["ok 1?"]: "eve", ids["ok 2?"]: "eve"}), cfg, durability="sync"
            )
        assert refused.value.interrupt_id == ids["ok 1?"]
        assert len(world.entries()) == before
        # The goto keeps branches 1 and 2 (their packets at their indexes) and replaces
        # branch 0, which is owed "ann": LangGraph would run branch 9 in its place.
        goto = [Send("branch", {"i": 9}), Send("branch", {"i": 1}), Send("branch", {"i": 2})]
        with pytest.raises(ResumeConflict, match="goto replaces") as refused:
            graph.invoke(Command(resume={ids["ok 2?"]: "eve"}, goto=goto), cfg, durability="sync")
        assert refused.value.interrupt_id == ids["ok 0?"]
        assert len(world.entries()) == before
        out = graph.invoke(Command(resume={ids["ok 2?"]: "cy"}), cfg, durability="sync")
        assert sorted(out["done"]) == ["0:ann", "1:bob", "2:cy"]
        assert len(world.applications("ship")) == 3
    finally:
        saver.remit.close()


def test_racing_partial_maps_take_one_and_the_others_answer_later(url: str, tmp_path: Path) -> None:
    """Four processes answer overlapping subsets of three open questions by id at once:
    one proceeds, the others get `ResumeConflict` and run nothing (or, started after
    the winner's run ended, answer what is still open: no question is answered
    twice). The winners' branches end with their answers and the others ask again
    under their same ids; a loser's map that names a question answered is then
    refused whole, and one naming only open questions is taken. Each branch ships
    once."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = map_reduce(world, saver), config()
        out = graph.invoke({"n": 4, "done": []}, cfg, durability="sync")
        ids = {i.value: i.id for i in out["__interrupt__"]}
        q0, q1, q2 = ids["ok 0?"], ids["ok 1?"], ids["ok 2?"]
        maps = [{q0: "r0"}, {q1: "r1"}, {q0: "r2", q1: "r2"}, {q2: "r3", q0: "r3"}]
        barrier, results = CTX.Barrier(len(maps)), CTX.Queue()

        def racer(j: int) -> None:
            barrier.wait(60)
            try:
                graph.invoke(Command(resume=maps[j]), cfg, durability="sync")
                results.put(("ok", j))
            except ResumeConflict:
                results.put(("conflict", j))
            except BaseException as exc:  # noqa: BLE001 (handed to the parent)
                results.put(("error", repr(exc)))

        procs = [CTX.Process(target=racer, args=(j,)) for j in range(len(maps))]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in maps]
        for p in procs:
            p.join(60)
        # (A racer that starts only after a winner's run ended may answer what is still
        # open: winners never share a question.)
        winners = [maps[j] for kind, j in got if kind == "ok"]
        assert winners and all(kind in ("ok", "conflict") for kind, _ in got), got
        won = {iid: v for answers in winners for iid, v in answers.items()}
        assert len(won) == sum(len(answers) for answers in winners), got
        state = graph.get_state(cfg)
        assert {i.id for i in state.interrupts} == {q0, q1, q2} - set(won)
        answered = [f"{i}:{won[ids[f'ok {i}?']]}" for i in ASKING if ids[f"ok {i}?"] in won]
        assert sorted(state.values["done"]) == sorted([*answered, "3:auto"])
        assert len(world.applications("ship")) == 1 + len(won)
        for answers in maps:
            if answers not in winners and set(answers) & set(won):
                with pytest.raises(ResumeConflict):
                    graph.invoke(Command(resume=answers), cfg, durability="sync")
        rest = {iid: "z" for iid in (q0, q1, q2) if iid not in won}
        if rest:
            out = graph.invoke(Command(resume=rest), cfg, durability="sync")
            assert "__interrupt__" not in out
        assert len(graph.get_state(cfg).values["done"]) == 4
        assert len(world.applications("ship")) == 4
        entered = [s for _, s in world.entries()]
        assert entered.count("branch3") == 1
    finally:
        saver.remit.close()


# -- copy_thread while another process holds the source -------------------------------


class Order(TypedDict):
    who: str | None
    log: Annotated[list[str], operator.add]


def held_order(world: World, saver: Any, entered: Any, leave: Any) -> Any:
    """ask -> pay (ships once; waits on `leave` once `entered`, if given) -> END."""
    ship = pay_with(world, "ship")

    def ask(state: Order) -> dict[str, Any]:
        return {"who": interrupt("who?"), "log": ["ask"]}

    def pay(state: Order) -> dict[str, Any]:
        world.enter("pay")
        if entered is not None:
            entered.set()
            assert leave.wait(60)
        return {"log": [ship()]}

    builder = StateGraph(Order)
    builder.add_node("ask", ask)
    builder.add_node("pay", pay)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "pay")
    builder.add_edge("pay", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_a_copy_made_while_another_process_is_about_to_pay_is_a_thread_of_its_own(
    url: str, tmp_path: Path, durability: str
) -> None:
    """A process answers the source and waits in the node before its effect, holding
    the source's claim; `copy_thread` copies the source meanwhile. The copy does not
    inherit the claim (a run on it is not refused), holds the source as it stood (the
    answer consumed, in "exit" durability not yet: nothing of the run is stored), takes
    no new answer, and continues with the source's answer, shipping once under a key
    of its own; the source's run then ends as it would have, shipping once."""
    world = World(tmp_path)
    entered, leave = CTX.Event(), CTX.Event()
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph, cfg = held_order(world, saver, entered, leave), config()
        copy_cfg = config()
        graph.invoke({"who": None, "log": []}, cfg, durability=durability)
        results = CTX.Queue()

        def resumer() -> None:
            try:
                out = graph.invoke(Command(resume="al"), cfg, durability=durability)
                results.put(("ok", out))
            except BaseException as exc:  # noqa: BLE001 (handed to the parent)
                results.put(("error", repr(exc)))

        proc = CTX.Process(target=resumer)
        proc.start()
        try:
            assert entered.wait(60)
            saver.copy_thread(
                cfg["configurable"]["thread_id"], copy_cfg["configurable"]["thread_id"]
            )
        finally:
            leave.set()
        plain = held_order(world, saver, None, None)
        with pytest.raises(ResumeConflict):
            plain.invoke(Command(resume="bo"), copy_cfg, durability=durability)
        out = plain.invoke(None, copy_cfg, durability=durability)
        assert out == {"who": "al", "log": ["ask", "ship-done"]}
        kind, source = results.get(timeout=120)
        proc.join(60)
        assert kind == "ok", source
        assert source == out
        ships = world.applications("ship")
        assert len(ships) == len(set(ships)) == 2
        assert [s for _, s in world.entries()].count("pay") == 2
        assert graph.get_state(cfg).values == plain.get_state(copy_cfg).values == out
        with pytest.raises(ResumeConflict):
            plain.invoke(Command(resume="bo"), cfg, durability=durability)
    finally:
        saver.remit.close()


class Outer(TypedDict):
    n: int
    done: Annotated[list[str], operator.add]


@pytest.mark.parametrize(("durability", "api"), [("sync", "sync"), ("exit", "async")])
def test_a_subgraphs_map_reduce_after_a_dead_resumer_gives_its_values_back(
    url: str, tmp_path: Path, durability: str, api: str
) -> None:
    """The same map-reduce as a subgraph added as a node (its branches ask through the
    parent's pause), answered through `invoke` or `ainvoke`: after the resumer of two
    questions died, an answer to the third ends the run with every branch's own
    answer, each branch shipping once."""
    import asyncio

    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    try:
        builder = StateGraph(Outer)
        builder.add_node("sub", map_reduce(world, None))
        builder.add_edge(START, "sub")
        builder.add_edge("sub", END)
        graph, cfg = builder.compile(checkpointer=saver), config()

        def run(command: Any) -> Any:
            if api == "async":
                return asyncio.run(graph.ainvoke(command, cfg, durability=durability))
            return graph.invoke(command, cfg, durability=durability)

        out = run({"n": 4, "done": []})
        ids = {i.value: i.id for i in out["__interrupt__"]}

        def doomed() -> None:
            world.armed["branch0.paid"] = "kill"
            run(Command(resume={ids["ok 0?"]: "ann", ids["ok 1?"]: "bob"}))

        killed(doomed)
        out = run(Command(resume={ids["ok 2?"]: "cy"}))
        assert "__interrupt__" not in out
        assert sorted(out["done"]) == ["0:ann", "1:bob", "2:cy", "3:auto"]
        assert len(world.applications("ship")) == 4
        with pytest.raises(ResumeConflict):
            run(Command(resume={ids["ok 0?"]: "eve"}))
    finally:
        saver.remit.close()
