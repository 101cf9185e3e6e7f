"""Round 35 probes of RemitSaver: thread upkeep (`copy_thread`, `prune`) under
concurrency and crashes. Two processes copying into one new thread id at once each
found it unused and both copied, so the target held two threads' lines and
ledgers; a copy killed between its records and its source's life marks handed the
copy effect keys its ledger did not hold, so resuming the copy paid again (P2), and
one killed before its run index entries was out of `delete_for_runs`'s reach; a
`keep_latest` prune while a run committed deleted what a `DeltaChannel` key is
rebuilt from, and the key read short (P4). Real LangGraph, real processes behind a
barrier and SIGKILLs, real stores on every engine."""

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
from langgraph.channels.delta import DeltaChannel
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core import RemitError, failpoints
from remit_langgraph import RemitSaver

CTX = mp.get_context("fork")
LEASE = 1.0
NODES, ROUNDS = 12, 4


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def _thread() -> str:
    return f"p35-{uuid.uuid4().hex}"


def _cfg(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}


def _steps(saver: RemitSaver, tag: str, n: int = 6) -> Any:
    """n nodes in a line, each logging `tag` and its index."""
    builder = StateGraph(Log)
    previous = START
    for i in range(n):
        builder.add_node(f"n{i}", lambda state, i=i: {"log": [f"{tag}{i}"]})
        builder.add_edge(previous, f"n{i}")
        previous = f"n{i}"
    builder.add_edge(previous, END)
    return builder.compile(checkpointer=saver)


def test_copies_into_one_new_thread_id_at_once_copy_one_thread_into_it(url: str) -> None:
    """Four processes behind a barrier copy four threads into one new id: one copy
    is made, the three others raise `RemitError` naming the target, and the target
    holds exactly one source's line (it held up to all four, mixed: its history
    four times as long, its branches and ledgers a mixture)."""
    saver = RemitSaver(url)
    k = 4
    sources = {}
    # (Long enough lines that a copy is still being made while the others check.)
    for i in range(k):
        source = _thread()
        for _ in range(ROUNDS):
            _steps(saver, f"s{i}-", NODES).invoke({"log": []}, _cfg(source), durability="sync")
        sources[source] = list(saver.list(_cfg(source)))
    target = _thread()
    barrier, results = CTX.Barrier(k), CTX.Queue()

    def copier(source: str) -> None:
        mine = RemitSaver(url)
        mine.remit.history(target, limit=1, verify=False)  # connected before the race
        barrier.wait(timeout=30)
        try:
            mine.copy_thread(source, target)
            results.put((source, "copied"))
        except RemitError as refused:
            results.put((source, f"refused:{refused.run_id}"))

    procs = [CTX.Process(target=copier, args=(source,)) for source in sources]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * k
    outcomes = dict(results.get(timeout=10) for _ in range(k))
    copied = [s for s, outcome in outcomes.items() if outcome == "copied"]
    assert len(copied) == 1, outcomes
    assert sorted(outcomes.values()) == ["copied"] + [f"refused:{target}"] * (k - 1)

    fresh = RemitSaver(url)
    listed = list(fresh.list(_cfg(target)))
    expected = sources[copied[0]]
    assert [t.checkpoint["id"] for t in listed] == [t.checkpoint["id"] for t in expected]
    assert _steps(fresh, "?").get_state(_cfg(target)).values == {
        "log": [f"s{list(sources).index(copied[0])}-{i}" for i in range(NODES)] * ROUNDS
    }


def _pay_then_ask(world: World, saver: RemitSaver) -> Any:
    """pay: charges, then asks; the answer is logged."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(*, idempotency_key: str) -> str:
        world.apply("charge", idempotency_key)
        return "charged"

    def pay(state: Log) -> dict[str, Any]:
        paid = charge()
        return {"log": [f"{paid}:{interrupt('ok?')}"]}

    builder = StateGraph(Log)
    builder.add_node("pay", pay)
    builder.add_edge(START, "pay")
    builder.add_edge("pay", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("point", ["writes.before", "writes.after", "writes.before@2"])
def test_a_copy_killed_midway_is_copied_again_and_pays_nothing_again(
    url: str, tmp_path: Path, point: str
) -> None:
    """P2: a thread id used again after `delete_thread` keys its effects by its new
    life. Its copy, SIGKILLed after its records were copied and before that life's
    mark was, was left complete to the eye but keyed by no life: resuming the copy
    ran the paused node again and paid a second time. Killed after its records and
    before its run index entries, its checkpoints were out of `delete_for_runs`'s
    reach. Now both are written before the records (which are copied in one
    transaction): a killed copy holds no checkpoint, copying again to the same id
    completes it, the copy resumes with the source's recorded payment, paying
    nothing, and `delete_for_runs` of the source's run deletes it in the copy too."""
    world = World(tmp_path)
    saver = RemitSaver(url)
    graph = _pay_then_ask(world, saver)
    source = _thread()
    _steps(saver, "old").invoke({"log": []}, _cfg(source))
    saver.delete_thread(source)  # the id's second life: its effects keyed apart
    lg_run = str(uuid.uuid4())
    paused = {"configurable": {"thread_id": source, "run_id": lg_run}}
    assert "__interrupt__" in graph.invoke({"log": []}, paused)
    assert len(world.applications("charge")) == 1
    target = _thread()

    def doomed() -> None:
        name, _, nth = point.partition("@")
        failpoints.arm(name, f"kill@{nth or 1}")  # around the copy's writes of step records
        RemitSaver(url, lease=LEASE).copy_thread(source, target)

    proc = CTX.Process(target=doomed)
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    time.sleep(LEASE + 0.2)  # the dead copier's claim on the target runs out (L1)

    fresh = RemitSaver(url, lease=LEASE)
    if fresh.get_tuple(_cfg(target)) is None:
        fresh.copy_thread(source, target)  # nothing of the thread copied yet: again
    copied = _pay_then_ask(world, fresh)
    assert copied.invoke(Command(resume="yes"), _cfg(target))["log"] == ["charged:yes"]
    assert len(world.applications("charge")) == 1  # the source's payment, not a new one
    assert copied.invoke(Command(resume="yes"), _cfg(source))["log"] == ["charged:yes"]
    assert len(world.applications("charge")) == 1

    def runs_of(thread: str) -> set[str]:
        return {str(t.metadata.get("run_id")) for t in RemitSaver(url).list(_cfg(thread))}

    assert lg_run in runs_of(target)
    RemitSaver(url).delete_for_runs([lg_run])
    assert lg_run not in runs_of(target) | runs_of(source)


def _extend(state: list[int], writes: list[list[int]]) -> list[int]:
    return [*state, *(x for w in writes for x in w)]


class Counted(TypedDict):
    log: Annotated[list[int], DeltaChannel(_extend, snapshot_frequency=50)]
    n: int


def _counting(saver: RemitSaver, upto: int) -> Any:
    """One node, looping: each round appends `n` to the delta key `log` and counts up.
    (No snapshot within a run: each checkpoint's key is rebuilt from all its writes.)"""
    builder = StateGraph(Counted)
    builder.add_node("step", lambda state: {"log": [state["n"]], "n": state["n"] + 1})
    builder.add_edge(START, "step")
    builder.add_conditional_edges("step", lambda state: END if state["n"] >= upto else "step")
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("call", ["prune", "aprune"])
def test_keep_latest_while_a_run_commits_keeps_what_its_delta_key_is_rebuilt_from(
    url: str, call: str
) -> None:
    """P4: `prune(ids, strategy="keep_latest")` listed a thread's checkpoints, then its
    branches. A checkpoint a run committed in between was a head the list lacked, so
    nothing under it was kept: its parent (the head when listed) was deleted with the
    writes its `DeltaChannel` key is rebuilt from, and the key read short or empty
    (`[37, 38, 39]` for `[0, ..., 39]`), a wrong state, with no error. Pruned over and
    over while a run in another process commits 40 checkpoints, the thread reads whole."""
    upto = 40
    cfg = _cfg(_thread())
    thread = cfg["configurable"]["thread_id"]
    run_cfg = {**cfg, "recursion_limit": 2 * upto}

    def runner() -> None:
        _counting(RemitSaver(url), upto).invoke({"n": 0, "log": []}, run_cfg, durability="sync")

    proc = CTX.Process(target=runner)
    proc.start()
    pruner = RemitSaver(url)
    rounds = 0
    while proc.is_alive() or rounds == 0:
        if call == "prune":
            pruner.prune([thread], strategy="keep_latest")
        else:
            asyncio.run(pruner.aprune([thread], strategy="keep_latest"))
        rounds += 1
    proc.join(60)
    assert proc.exitcode == 0
    whole = {"log": list(range(upto)), "n": upto}
    assert _counting(RemitSaver(url), upto).get_state(cfg).values == whole
    pruner.prune([thread], strategy="keep_latest")
    assert _counting(RemitSaver(url), upto).get_state(cfg).values == whole
