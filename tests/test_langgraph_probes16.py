"""RemitSaver's async side and its use inside one process: `AsyncRemitSaver.from_conn_string`
as an async context manager, the async methods called directly (against their sync
twins and LangGraph's own `InMemorySaver`), many threads gathered in one event loop,
`batch`/`abatch`, one saver under two graphs, a graph driven from several OS threads,
a resume cancelled after its value was consumed, an async effect killed after it
applied, a saver closed under a run in flight, and bad configs. Real LangGraph, real
stores on every engine, a real SIGKILL where the property is about processes."""

from __future__ import annotations

import asyncio
import operator
import threading
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from annotated_types import Ge
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_probes10 import LEASE, killed
from test_langgraph_probes14 import config
from test_langgraph_probes15 import chain
from test_langgraph_support import INITIAL, World, build
from typing_extensions import TypedDict

import remit_core
from remit_core import (
    CheckpointInvalid,
    RemitError,
    ResumeConflict,
    StoreUnavailable,
    failpoints,
)
from remit_langgraph import AsyncRemitSaver, RemitSaver


class Pay(TypedDict):
    amount: Annotated[int, Ge(0)]
    log: Annotated[list[str], operator.add]


def paying(world: World, saver: Any, gate: asyncio.Event | None = None) -> Any:
    """ask (async; interrupt: the amount) -> [wait for `gate`] -> pay (async; an async
    effect "charge" keyed by the amount, then the point "pay.after_effect")."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    async def charge(amount: int, *, idempotency_key: str) -> str:
        await asyncio.sleep(0)
        return world.apply("charge", f"{amount}:{idempotency_key}")

    async def ask(state: Pay) -> dict[str, Any]:
        world.enter("ask")
        amount = interrupt("amount?")
        return {"amount": amount, "log": [f"ask:{amount}"]}

    async def wait(state: Pay) -> dict[str, Any]:
        world.enter("wait")
        if gate is not None:
            await gate.wait()
        return {"log": ["waited"]}

    async def pay(state: Pay) -> dict[str, Any]:
        world.enter("pay")
        outcome = await charge(state["amount"])
        world.point("pay.after_effect")
        return {"log": [outcome]}

    builder = StateGraph(Pay)
    for name, fn in (("ask", ask), ("wait", wait), ("pay", pay)):
        builder.add_node(name, fn)
    chain(builder, "ask", "wait", "pay")
    return builder.compile(checkpointer=saver)


def thread_of(cfg: dict[str, Any]) -> str:
    return str(cfg["configurable"]["thread_id"])


def holder(saver: RemitSaver, cfg: dict[str, Any]) -> str | None:
    """Who holds the thread's main claim now ("" or None: nobody)."""
    claim = saver.remit.store.get_claim(thread_of(cfg), "main")
    return None if claim is None else claim.holder


# -- the async methods, called directly ------------------------------------------------


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def steps(saver: Any) -> Any:
    """a -> b -> ask (interrupt) -> c."""
    builder = StateGraph(Log)
    for name in "abc":
        builder.add_node(name, lambda s, name=name: {"log": [name]})
    builder.add_node("ask", lambda s: {"log": [f"ask:{interrupt('?')}"]})
    chain(builder, "a", "b", "ask", "c")
    return builder.compile(checkpointer=saver)


def shape(found: Any) -> Any:
    """What a listing says of each checkpoint, ids left out."""
    return [
        (
            t.metadata["source"],
            t.metadata["step"],
            t.checkpoint["channel_values"],
            sorted(w[1] for w in t.pending_writes or ()),
            t.parent_config is None,
        )
        for t in found
    ]


async def listings(saver: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """`alist` with filter, before and limit (and mixed), and `aget_tuple` at a checkpoint."""
    every = [t async for t in saver.alist(cfg)]
    asked = {
        "all": {},
        "loop": {"filter": {"source": "loop"}},
        "loop-2": {"filter": {"source": "loop"}, "limit": 2},
        "before": {"before": every[2].config},
        "before-1": {"before": every[2].config, "limit": 1},
        "step": {"filter": {"step": 2}},
        "none": {"limit": 0},
        "mixed": {"filter": {"source": "loop"}, "before": every[1].config, "limit": 3},
    }
    got = {}
    for name, kw in asked.items():
        got[name] = shape([t async for t in saver.alist(cfg, **kw)])
    got["at"] = shape([await saver.aget_tuple(every[3].config)])
    return got


def test_async_from_conn_string_and_the_direct_async_methods_answer_as_the_sync_ones(
    url: str,
) -> None:
    """The async twins answer as LangGraph's own saver and as their sync twins do, and
    the whole-thread ones (`acopy_thread`, `adelete_for_runs`, `aprune`,
    `adelete_thread`) do what theirs do; leaving the `async with` block closes the
    saver, and a direct async call after it is `StoreUnavailable`."""

    async def scenario() -> tuple[Any, dict[str, Any]]:
        own, own_cfg = InMemorySaver(), config()
        graph = steps(own)
        await graph.ainvoke({"log": []}, own_cfg)
        await graph.ainvoke(Command(resume="x"), own_cfg)
        expected = await listings(own, own_cfg)

        async with AsyncRemitSaver.from_conn_string(url) as saver:
            graph, cfg = steps(saver), config()
            await graph.ainvoke({"log": []}, cfg)
            resumed = f"run-{uuid.uuid4().hex}"  # LangGraph stores it in the metadata
            await graph.ainvoke(Command(resume="x"), config(thread_of(cfg), run_id=resumed))
            got = await listings(saver, cfg)
            assert got == expected
            for kw in ({}, {"filter": {"source": "loop"}, "limit": 2}, {"limit": 1}):
                assert [t async for t in saver.alist(cfg, **kw)] == list(saver.list(cfg, **kw))
            assert await saver.aget_tuple(cfg) == saver.get_tuple(cfg)

            head = await saver.aget_tuple(cfg)
            assert head is not None
            copy = config()
            await saver.acopy_thread(thread_of(cfg), thread_of(copy))
            assert shape([t async for t in saver.alist(copy)]) == got["all"]
            await saver.aprune([thread_of(copy)])
            assert shape([t async for t in saver.alist(copy)]) == got["all"][:1]
            await saver.adelete_thread(thread_of(copy))
            assert await saver.aget_tuple(copy) is None

            # The resume's run wrote the checkpoints after the pause: deleted, the head
            # is the pause, with the answered task's write on it (as `delete_for_runs`
            # leaves it): its value stays consumed, and a continuation runs `c` again.
            assert head.metadata["run_id"] == resumed
            await saver.adelete_for_runs([resumed])
            assert shape([t async for t in saver.alist(cfg)]) == got["all"][2:]
            assert (await graph.aget_state(cfg)).values == {"log": ["a", "b", "ask:x"]}
            with pytest.raises(ResumeConflict):
                await graph.ainvoke(Command(resume="y"), cfg)
            done = await graph.ainvoke(None, cfg)
        with pytest.raises(StoreUnavailable, match="is closed"):
            await saver.aget_tuple(cfg)
        with pytest.raises(StoreUnavailable, match="is closed"):
            [t async for t in saver.alist(cfg)]
        with pytest.raises(StoreUnavailable, match="is closed"):
            await saver.aput_writes(head.config, [("log", ["late"])], "task-1")
        return done, got

    done, got = asyncio.run(scenario())
    assert done == {"log": ["a", "b", "ask:x", "c"]}
    assert len(got["all"]) == 6 and got["none"] == []


# -- many threads in one event loop ------------------------------------------------------


def test_threads_gathered_in_one_event_loop_keep_their_claims_values_effects_and_errors(
    url: str, tmp_path: Path
) -> None:
    """Six threads paused and resumed at once in one loop (async nodes, an async
    effect): each ends with its own value and one charge of its own; thread 0's
    refused value fails only thread 0, and of two resumers of thread 1 one proceeds
    and the other gets `ResumeConflict` naming thread 1 (P4, P5, P2). No claim is
    left held."""
    world = World(tmp_path)

    async def scenario() -> tuple[list[Any], list[Any], list[dict[str, Any]]]:
        async with AsyncRemitSaver.from_conn_string(url) as saver:
            graph, cfgs = paying(world, saver), [config() for _ in range(6)]
            await asyncio.gather(*(graph.ainvoke({"amount": 0, "log": []}, c) for c in cfgs))
            values = [-1, *(10 + i for i in range(1, 6))]  # thread 0's value is refused
            resumes = [
                graph.ainvoke(Command(resume=v), c) for v, c in zip(values, cfgs, strict=True)
            ]
            resumes.append(graph.ainvoke(Command(resume=99), cfgs[1]))
            outcomes = await asyncio.gather(*resumes, return_exceptions=True)
            states = [(await graph.aget_state(c)).values for c in cfgs]
            assert all(holder(saver, c) in ("", None) for c in cfgs)
            return outcomes, states, cfgs

    outcomes, states, cfgs = asyncio.run(scenario())
    assert isinstance(outcomes[0], CheckpointInvalid) and outcomes[0].field == "amount"
    assert outcomes[0].run_id == thread_of(cfgs[0])
    assert states[0] == {"amount": 0, "log": []}
    ones = [outcomes[1], outcomes[6]]
    won = [o for o in ones if isinstance(o, dict)]
    lost = [o for o in ones if isinstance(o, ResumeConflict)]
    assert len(won) == 1 and len(lost) == 1 and lost[0].run_id == thread_of(cfgs[1])
    assert won[0]["amount"] in (11, 99) and states[1] == won[0]
    amounts = [won[0]["amount"], *(10 + i for i in range(2, 6))]
    for i, amount in enumerate(amounts, start=1):
        assert states[i] == {"amount": amount, "log": [f"ask:{amount}", "waited", "charge-done"]}
        assert i == 1 or outcomes[i] == states[i]
    charged = sorted(line.split()[1].split(":")[0] for line in world.applications("charge"))
    assert charged == sorted(str(a) for a in amounts)
    assert len({line.split(":")[1] for line in world.applications("charge")}) == 5


def test_batch_and_abatch_over_threads_let_one_resumer_of_each_thread_proceed(url: str) -> None:
    """`batch`/`abatch` run their inputs at once: each thread resumes with its own value,
    and a thread named twice in one batch is resumed by one of them; the other gets
    `ResumeConflict` and its value is stored nowhere (P5)."""
    saver = RemitSaver(url)
    graph = steps(saver)

    def check(outcomes: list[Any], cfgs: list[dict[str, Any]]) -> None:
        twice = [outcomes[0], outcomes[3]]
        assert sorted(type(o).__name__ for o in twice) == ["ResumeConflict", "dict"]
        winner = next(o for o in twice if isinstance(o, dict))
        assert winner["log"][2] in ("ask:v0", "ask:v3")
        assert graph.get_state(cfgs[0]).values == winner
        for i in (1, 2):
            assert outcomes[i] == {"log": ["a", "b", f"ask:v{i}", "c"]}
        assert all(holder(saver, c) in ("", None) for c in cfgs)

    cfgs = [config() for _ in range(3)]
    cfgs.append(cfgs[0])
    graph.batch([{"log": []}] * 3, cfgs[:3])
    resumes = [Command(resume=f"v{i}") for i in range(4)]
    check(graph.batch(resumes, cfgs, return_exceptions=True), cfgs)

    async def in_async() -> list[Any]:
        await graph.abatch([{"log": []}] * 3, acfgs[:3])
        return await graph.abatch(resumes, acfgs, return_exceptions=True)

    acfgs = [config() for _ in range(3)]
    acfgs.append(acfgs[0])
    check(asyncio.run(in_async()), acfgs)


# -- one saver, two graphs ---------------------------------------------------------------


class Label(TypedDict):
    amount: str
    log: Annotated[list[str], operator.add]


def asking_amount(state_type: Any, saver: RemitSaver, convert: Any) -> Any:
    builder = StateGraph(state_type)
    builder.add_node("ask", lambda s: {"amount": convert(interrupt("amount?")), "log": ["ask"]})
    chain(builder, "ask")
    return builder.compile(checkpointer=saver)


def test_one_saver_shared_by_two_graphs_checks_each_against_its_own_schema(url: str) -> None:
    """Two graphs with different state schemas on one saver, run and edited at once:
    each write is checked against its own graph's schema, never the other's (P4)."""
    saver = AsyncRemitSaver(url)
    counts = asking_amount(Pay, saver, int)
    labels = asking_amount(Label, saver, str)
    ccfg, lcfg = config(), config()

    async def scenario() -> list[Any]:
        await asyncio.gather(
            counts.ainvoke({"amount": 0, "log": []}, ccfg),
            labels.ainvoke({"amount": "0", "log": []}, lcfg),
        )
        outcomes = await asyncio.gather(
            counts.ainvoke(Command(resume=-5), ccfg),
            labels.ainvoke(Command(resume=-5), lcfg),
            return_exceptions=True,
        )
        edits = await asyncio.gather(
            counts.aupdate_state(ccfg, {"amount": "x"}),
            labels.aupdate_state(lcfg, {"amount": "x"}),
            return_exceptions=True,
        )
        return [*outcomes, *edits]

    refused, labelled, refused_edit, edited = asyncio.run(scenario())
    assert isinstance(refused, CheckpointInvalid) and refused.field == "amount"
    assert labelled == {"amount": "-5", "log": ["ask"]}
    assert isinstance(refused_edit, CheckpointInvalid) and refused_edit.field == "amount"
    assert isinstance(edited, dict)
    assert counts.get_state(ccfg).values == {"amount": 0, "log": []}
    assert labels.get_state(lcfg).values == {"amount": "x", "log": ["ask"]}


# -- several OS threads, one sync saver --------------------------------------------------


def test_a_graph_driven_from_several_os_threads_at_once_keeps_each_thread_apart(
    url: str, tmp_path: Path
) -> None:
    """Six OS threads each take one LangGraph thread through the probe workflow at once
    on one sync saver: every step entered once per thread, each charge and notice
    applied once per thread, each thread approved by its own value (P1, P2, P5)."""
    world = World(tmp_path)
    saver = RemitSaver(url)
    graph = build(world, saver)
    cfgs = [config() for _ in range(6)]
    barrier = threading.Barrier(len(cfgs))
    outcomes: dict[int, Any] = {}

    def drive(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            graph.invoke(INITIAL, cfgs[i])
            barrier.wait(timeout=30)  # every thread paused: the resumes race too
            outcomes[i] = graph.invoke(Command(resume=f"r{i}"), cfgs[i])
        except Exception as exc:  # the outcome is the assertion
            outcomes[i] = exc

    workers = [threading.Thread(target=drive, args=(i,)) for i in range(len(cfgs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    for i, cfg in enumerate(cfgs):
        assert outcomes[i]["approved_by"] == f"r{i}", outcomes[i]
        assert outcomes[i]["log"] == ["prepare", "approve", "charge-done", "notify-done"]
        assert graph.get_state(cfg).next == ()
    for step, count in (("prepare", 6), ("approve.top", 12), ("charge", 6), ("notify", 6)):
        assert len(world.entries(step)) == count, step
    assert len(set(world.applications("charge"))) == len(world.applications("charge")) == 6
    assert len(world.applications("notify")) == 6


# -- cancellation, a killed async effect, a saver closed under a run ---------------------


def test_a_resume_cancelled_after_its_value_was_consumed_is_redelivered_once(
    url: str, tmp_path: Path
) -> None:
    """`ainvoke(Command(resume=...))` cancelled after the store consumed its value: the
    claim is given back (lease 30 s), a second value is refused as consumed and stored
    nowhere, and `ainvoke(None)` continues with the consumed value, paying once (P5, P2)."""
    world = World(tmp_path)
    saver = AsyncRemitSaver(url, lease=30.0)
    graph, cfg = paying(world, saver), config()

    async def scenario() -> Any:
        await graph.ainvoke({"amount": 0, "log": []}, cfg)
        failpoints.arm("interrupt.after_consume", "sleep:0.4")
        try:
            task = asyncio.ensure_future(graph.ainvoke(Command(resume=7), cfg))
            await asyncio.sleep(0.15)  # the worker has consumed the value, and sleeps
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            failpoints.disarm()
        for _ in range(100):
            if holder(saver, cfg) in ("", None):
                break
            await asyncio.sleep(0.02)
        with pytest.raises(ResumeConflict, match="consumed") as err:
            await graph.ainvoke(Command(resume=8), cfg)
        assert err.value.interrupt_id is not None
        return await graph.ainvoke(None, cfg)

    done = asyncio.run(scenario())
    assert done == {"amount": 7, "log": ["ask:7", "waited", "charge-done"]}
    values = [saver._decode(i.value) for i in saver.remit.interrupts(thread_of(cfg)) if i.value]
    assert values == [7]
    assert len(world.applications("charge")) == 1


def test_an_async_effect_killed_after_it_applied_is_reconciled_once(
    url: str, tmp_path: Path
) -> None:
    """An async node's async effect applied, then the process SIGKILLed before the node
    returned: `ainvoke(None)` in another process runs only that node again, and the
    effect's reconcile answers it: applied once, under its one key (P1, P2, L1)."""
    world = World(tmp_path)
    saver = RemitSaver(url, lease=LEASE)
    graph, cfg = paying(world, saver), config()
    asyncio.run(graph.ainvoke({"amount": 0, "log": []}, cfg, durability="sync"))

    def doomed() -> None:
        world.armed["pay.after_effect"] = "kill"
        asyncio.run(graph.ainvoke(Command(resume=5), cfg, durability="sync"))

    killed(doomed)
    assert len(world.applications("charge")) == 1
    done = asyncio.run(graph.ainvoke(None, cfg, durability="sync"))
    assert done == {"amount": 5, "log": ["ask:5", "waited", "charge-done"]}
    assert len(world.applications("charge")) == 1
    assert [len(world.entries(s)) for s in ("ask", "wait", "pay")] == [2, 1, 2]


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
def test_a_run_in_flight_when_its_saver_closes_stops_with_store_unavailable(
    url: str, tmp_path: Path, durability: str
) -> None:
    """Leaving `async with from_conn_string(...)` while a resume runs gives its claim up:
    another saver takes the thread over at once (lease 30 s) with the consumed value,
    and the old run, let go on, stops with `StoreUnavailable` (its effect was refused
    as "called outside a Remit step", a `RemitError` that says to use a Remit backend)
    and applies and stores nothing more: one charge (P2, P5, L1)."""
    world = World(tmp_path)

    async def scenario() -> tuple[Any, Any, float]:
        gate = asyncio.Event()
        cfg = config()
        async with AsyncRemitSaver.from_conn_string(url, lease=30.0) as saver:
            graph = paying(world, saver, gate)
            await graph.ainvoke({"amount": 0, "log": []}, cfg, durability=durability)
            old = asyncio.create_task(graph.ainvoke(Command(resume=3), cfg, durability=durability))
            while not world.entries("wait"):
                await asyncio.sleep(0.01)
        async with AsyncRemitSaver.from_conn_string(url, lease=30.0) as other:
            graph = paying(world, other, gate)
            clock = asyncio.get_running_loop().time
            started = clock()
            gate.set()
            done = await graph.ainvoke(None, cfg, durability=durability)
            waited = clock() - started
            with pytest.raises(StoreUnavailable) as err:
                await old
            assert (await graph.aget_state(cfg)).values == done
        return done, err.value, waited

    done, error, waited = asyncio.run(scenario())
    assert done == {"amount": 3, "log": ["ask:3", "waited", "charge-done"]} and waited < 5
    assert url.split("://")[0] in str(error)
    assert len(world.applications("charge")) == 1


# -- bad configs -----------------------------------------------------------------------------


def test_a_thread_id_of_none_is_refused_before_any_node_runs(url: str) -> None:
    """`{"thread_id": None}` passes LangGraph's check (the key is there). It was taken as
    the thread "None": the run claimed it, its nodes ran (in "exit" durability to the
    end), its effect was recorded under "None", and only the first commit was refused,
    so the next run with a None id got the first one's recorded outcome instead of
    its own charge. Now it is a `RemitError` before any node runs, sync and async,
    and so are the saver's own methods; nothing is applied or stored."""
    applied: list[int] = []

    @remit_core.effect(name="charge", idempotent=True)
    def charge(amount: int, *, idempotency_key: str) -> int:
        applied.append(amount)
        return amount

    builder = StateGraph(Pay)
    builder.add_node("pay", lambda s: {"amount": charge(s["amount"]), "log": ["pay"]})
    chain(builder, "pay")
    saver = RemitSaver(url)
    graph = builder.compile(checkpointer=saver)
    nameless: Any = {"configurable": {"thread_id": None}}
    stored = saver.remit.history("None", verify=False)  # (a shared server's, if any)
    for amount in (1, 2):
        with pytest.raises(RemitError, match="thread_id"):
            graph.invoke({"amount": amount, "log": []}, nameless, durability="exit")
    with pytest.raises(RemitError, match="thread_id"):
        asyncio.run(graph.ainvoke({"amount": 3, "log": []}, nameless, durability="exit"))
    assert applied == []
    # No thread_id at all (LangGraph lets a checkpoint_ns alone through; its own
    # savers raise KeyError there).
    with pytest.raises(RemitError, match="thread_id"):
        graph.invoke({"amount": 4, "log": []}, {"configurable": {"checkpoint_ns": ""}})
    assert applied == []
    assert saver.remit.history("None", verify=False) == stored

    async def direct() -> None:
        with pytest.raises(RemitError, match="thread_id"):
            await saver.aget_tuple(nameless)
        with pytest.raises(RemitError, match="thread_id"):
            await saver.adelete_thread(None)  # type: ignore[arg-type]
        with pytest.raises(RemitError, match="thread_id"):
            await saver.acopy_thread(None, "elsewhere")  # type: ignore[arg-type]

    asyncio.run(direct())


def test_odd_thread_ids_unserializable_input_and_huge_metadata_through_the_async_api(
    url: str,
) -> None:
    """A non-str thread id is its `str`, as with LangGraph's SQL savers; input of a type
    the serializer may not store is `CheckpointInvalid` naming where it sits, with
    nothing stored and the thread free; a megabyte of config metadata is stored and
    read back, and filters a listing, as with LangGraph's own saver."""
    saver = AsyncRemitSaver(url)
    graph = steps(saver)
    own = steps(InMemorySaver())
    number = int(config()["configurable"]["thread_id"][3:15], 16)
    big = "m" * 1_000_000

    async def scenario() -> None:
        await graph.ainvoke({"log": []}, {"configurable": {"thread_id": number}})
        assert (await graph.aget_state(config(str(number)))).next == ("ask",)

        cfg = config()
        with pytest.raises(CheckpointInvalid) as err:
            await graph.ainvoke({"log": [object()]}, cfg)
        assert "log[0]" in str(err.value.field) and err.value.run_id == thread_of(cfg)
        assert (await graph.aget_state(cfg)).values == {}
        assert [t async for t in saver.alist(cfg)] == []
        assert (await graph.ainvoke({"log": []}, cfg))["log"] == ["a", "b"]

        tagged = {**config(), "metadata": {"note": big}}
        own_tagged = {**config(), "metadata": {"note": big}}
        await graph.ainvoke({"log": []}, tagged)
        await own.ainvoke({"log": []}, own_tagged)
        head = await saver.aget_tuple(tagged)
        own_head = await own.checkpointer.aget_tuple(own_tagged)
        assert head is not None and own_head is not None
        assert head.metadata["note"] == own_head.metadata["note"] == big
        found = [t async for t in saver.alist(tagged, filter={"note": big})]
        own_found = [t async for t in own.checkpointer.alist(own_tagged, filter={"note": big})]
        assert shape(found) == shape(own_found) and len(found) == 4

    asyncio.run(scenario())
