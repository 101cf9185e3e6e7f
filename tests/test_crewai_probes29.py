"""Probes of round 29: async flows with parallel branches, an `and_` join, a router loop
and an `or_` listener on a dict state, SIGKILLed at each step in turn; cancelled async
kickoffs among others sharing one persistence; and state values of many types.

Written from the contract (P1: a restart enters again only what was in flight; P2: every
effect applied once; P4: a state is stored exactly or refused when it is saved; P6: the
restart ends in the state an uninterrupted run ends in) against real CrewAI flows in
forked children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from test_crewai_flows import child

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_core.effects import effect
from remit_crewai import RemitFlowPersistence

# -- an async flow with parallel branches killed at each step in turn --------------------

#: How often an uninterrupted run enters each step of `async_mesh` (12 steps in all).
ASYNC_STEPS = {
    "begin": 1,
    "left": 1,
    "right": 1,
    "join": 1,
    "check": 3,
    "redo": 2,
    "finish": 1,
    "tail": 1,
    "either": 1,
}


def async_mesh(url: str, world: Path, kill_at: int | None = None) -> type[Any]:
    """Async steps on a dict state: begin -> left, right (side by side on the loop, each
    yielding to the other after its effect) -> join (`and_`) and either (`or_`) ->
    check (a router over `or_(join, redo)`: "again" twice, then "done") -> "again" ->
    redo -> check ...; "done" -> finish -> tail (`or_(finish, "never")`). Each step
    applies its own effect and notes the receipt in a nested dict of the state (once:
    a receipt already there is not added again); the `kill_at`-th step this process
    enters is SIGKILLed right after its effect."""
    import os
    import signal

    from crewai.flow.flow import Flow, and_, listen, or_, router, start
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    counter = itertools.count(1)

    async def step(flow: Any, name: str) -> None:
        journal.record("enter", name)
        nth = next(counter)
        receipt = await effects[name]()
        if nth == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0)
        # A change that gives the same state when made twice (as the README asks of
        # methods run side by side): a sibling's checkpoint may already hold this
        # receipt when the process dies before this step's own save, and the restart
        # runs the step again, its effect returning the same receipt.
        receipts = flow.state["book"].setdefault(name, [])
        if receipt not in receipts:
            receipts.append(receipt)

    def applying(name: str) -> Any:
        async def apply(*, idempotency_key: str) -> str:
            journal.record("apply", name)
            await asyncio.sleep(0)
            return sink.apply(name, idempotency_key)

        return effect(apply, name=name, reconcile=sink.reconcile)

    effects = {name: applying(name) for name in ASYNC_STEPS}

    @persist(RemitFlowPersistence(url, lease=1.0))
    class AsyncMesh(Flow):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        async def begin(self) -> None:
            self.state["book"] = {}
            self.state["rounds"] = 0
            await step(self, "begin")

        @listen(begin)
        async def left(self) -> None:
            await step(self, "left")

        @listen(begin)
        async def right(self) -> None:
            await step(self, "right")

        @listen(and_(left, right))
        async def join(self) -> None:
            await step(self, "join")

        @listen(or_(left, right))
        async def either(self) -> None:
            await step(self, "either")

        @router(or_(join, "redo"))
        async def check(self) -> str:
            await step(self, "check")
            return "again" if self.state["rounds"] < 2 else "done"

        @listen("again")
        async def redo(self) -> None:
            await step(self, "redo")
            self.state["rounds"] += 1

        @listen("done")
        async def finish(self) -> None:
            await step(self, "finish")

        @listen(or_(finish, "never"))
        async def tail(self) -> None:
            await step(self, "tail")

    return AsyncMesh


def kickoff_async(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        flow = flow_class(suppress_flow_events=True)
        await flow.kickoff_async(**kwargs)
        return {"id": flow.flow_id, "state": dict(flow.state)}

    return asyncio.run(main())


def journalled(world: Path, kind: str) -> Counter[str]:
    return Counter(e.name for e in Journal(WorldDB(world)).entries() if e.kind == kind)


def test_an_async_flow_killed_at_each_step_in_turn_restarts_to_the_same_end(
    url: str, tmp_path: Path
) -> None:
    """P1, P2, P6: an async flow whose parallel branches interleave on the loop is
    SIGKILLed after the effect of its k-th step, for every k; each restart (async too)
    ends with the uninterrupted run's state (two rounds, each step's receipts once),
    enters again only what was in flight, and applies every effect once."""
    reference = child(lambda: kickoff_async(async_mesh(url, tmp_path / "world-ref"))).wait(120)
    assert reference.ok, reference.error_text()
    assert journalled(tmp_path / "world-ref", "enter") == Counter(ASYNC_STEPS)
    book = reference.value["state"]["book"]
    assert {k: len(v) for k, v in book.items()} == ASYNC_STEPS
    total = sum(ASYNC_STEPS.values())
    worlds = {k: tmp_path / f"world-{k}" for k in range(1, total + 1)}
    ids = {k: f"amesh-{k}-{uuid.uuid4().hex}" for k in worlds}
    crashed = {
        k: child(
            lambda k=k: kickoff_async(async_mesh(url, worlds[k], kill_at=k), inputs={"id": ids[k]})
        )
        for k in worlds
    }
    for k, worker in crashed.items():
        outcome = worker.wait(timeout=120)
        assert outcome.status == "killed", (k, outcome.summary())
    time.sleep(1.2)  # the dead kickoffs' claims run out
    restarted = {
        k: child(lambda k=k: kickoff_async(async_mesh(url, worlds[k]), inputs={"id": ids[k]}))
        for k in worlds
    }
    for k, worker in restarted.items():
        outcome = worker.wait(timeout=120)
        assert outcome.ok, (k, outcome.error_text())
        state = outcome.value["state"]
        assert state["rounds"] == 2, (k, state)
        counts = {name: len(receipts) for name, receipts in state["book"].items()}
        assert counts == ASYNC_STEPS, (k, state)
        entered = journalled(worlds[k], "enter")
        assert not Counter(ASYNC_STEPS) - entered, (k, entered)
        extra = entered - Counter(ASYNC_STEPS)
        assert sum(extra.values()) <= 2, (k, entered)
        assert dict(EffectSink(WorldDB(worlds[k])).counts()) == ASYNC_STEPS, k


# -- an async kickoff cancelled inside an effect, beside others on one persistence -------


def test_an_async_kickoff_cancelled_inside_its_effect_beside_others_is_retried_once(
    url: str,
) -> None:
    """P2, P5: three async kickoffs share one persistence in one loop; one is cancelled
    while its effect's call has reached the outside world but was not recorded (in
    doubt). The two others finish; the cancelled flow is given back, and kicked off
    again on its instance it reconciles the effect (not applied again) and finishes as
    an uncancelled run does."""

    def main() -> dict[str, Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        from remit_core import NOT_APPLIED

        applied: Counter[str] = Counter()
        done: dict[str, str] = {}
        holds: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}

        async def reconcile(key: str) -> Any:
            return done.get(key, NOT_APPLIED)

        @effect(reconcile=reconcile)
        async def pay(who: str, *, idempotency_key: str) -> str:
            applied[who] += 1
            done[idempotency_key] = f"paid {who}"
            if who in holds:
                reached, never = holds[who]
                reached.set()
                await never.wait()
            return done[idempotency_key]

        class Bill(BaseModel):
            who: str = ""
            receipt: str = ""
            log: list[str] = []

        @persist(RemitFlowPersistence(url))
        class BillFlow(Flow[Bill]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            async def begin(self) -> None:
                self.state.log.append("begin")

            @listen(begin)
            async def charge(self) -> None:
                self.state.log.append("charge")
                self.state.receipt = await pay(self.state.who)

            @listen(charge)
            async def end(self) -> None:
                self.state.log.append("end")

        async def go() -> dict[str, Any]:
            flows = {w: BillFlow(suppress_flow_events=True) for w in "abc"}
            holds["b"] = (asyncio.Event(), asyncio.Event())
            tasks = {
                w: asyncio.create_task(f.kickoff_async(inputs={"who": w})) for w, f in flows.items()
            }
            await holds["b"][0].wait()
            tasks["b"].cancel()
            results = await asyncio.gather(*tasks.values(), return_exceptions=True)
            del holds["b"]
            await flows["b"].kickoff_async()
            return {
                "results": [type(r).__name__ for r in results],
                "states": {w: f.state.model_dump() for w, f in flows.items()},
                "applied": dict(applied),
            }

        return asyncio.run(go())

    outcome = child(main).wait(timeout=120)
    assert outcome.ok, outcome.error_text()
    value = outcome.value
    assert value["results"] == ["NoneType", "CancelledError", "NoneType"], value
    assert value["applied"] == {"a": 1, "b": 1, "c": 1}, value
    for who, state in value["states"].items():
        assert state["receipt"] == f"paid {who}", value
        assert state["log"][-1] == "end" and state["log"].count("end") == 1, value


# -- the second of a repeated local hour -------------------------------------------------


def test_a_datetime_of_a_repeated_hour_reads_back_as_itself_not_an_hour_early(
    url: str,
) -> None:
    """P4: a step stores `datetime.fromtimestamp(t)` for a t in a fall-back hour (a naive
    datetime with `fold=1`: the second 01:30), in a dict state and in a model state. A
    restart reads the second 01:30 back, its timestamp the one stored. Before, the
    stored form kept no fold and the value came back as the first 01:30, an hour early."""

    def main() -> dict[str, Any]:
        import datetime as dt
        import os

        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        os.environ["TZ"] = "America/New_York"
        time.tzset()
        second = 1636266600.0  # 2021-11-07 01:30 EST, after 01:30 EDT
        store = RemitFlowPersistence(url)

        class Stamp(BaseModel):
            at: dt.datetime | None = None
            n: int = 0

        def flow_class(base: Any) -> type[Any]:
            @persist(store)
            class Clock(base):  # type: ignore[misc,valid-type]
                _skip_auto_memory = True

                @start()
                def first(self) -> None:
                    if isinstance(self.state, dict):
                        self.state["n"] = 1
                    else:
                        self.state.n = 1

                @listen(first)
                def stamp(self) -> None:
                    at = dt.datetime.fromtimestamp(second)
                    assert at.fold == 1
                    if isinstance(self.state, dict):
                        self.state["at"] = at
                    else:
                        self.state.at = at

            return Clock

        out: dict[str, Any] = {}
        for name, base in (("dict", Flow), ("model", Flow[Stamp])):
            flow = flow_class(base)(suppress_flow_events=True)
            try:
                flow.kickoff()
                out[name] = {"error": None}
            except Exception as exc:  # CrewAI wraps the refused save
                chain, cause = [], exc
                while cause is not None:
                    chain.append(f"{type(cause).__name__}: {cause}")
                    cause = cause.__cause__ or cause.__context__
                out[name] = {"error": chain}
            saved = store.load_state(flow.flow_id)
            at = saved.get("at") if saved else None
            out[name]["saved_at"] = (
                None if at is None else [at.isoformat(), at.timestamp(), at.fold, type(at).__name__]
            )
            out[name]["saved_n"] = saved and saved.get("n")
        return out

    outcome = child(main).wait(timeout=120)
    assert outcome.ok, outcome.error_text()
    for name, got in outcome.value.items():
        assert got["error"] is None, (name, got)
        assert got["saved_at"] == ["2021-11-07T01:30:00", 1636266600.0, 1, "datetime"], (name, got)
        assert got["saved_n"] == 1, (name, got)
