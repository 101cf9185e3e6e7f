"""Probes of round 12: one store named by two URLs, out-of-order feedback, typed state.

Written from the contract against real CrewAI flows in forked children, with the
helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import sink_effect
from test_crewai_flows import applied, child, entered, kickoff, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence
from remit_crewai._ledger import Ledger, decode


def spelled_otherwise(url: str) -> str:
    """Another spelling of the store `url` names: the same SQLite file by a path through
    `.` with its default option spelt out, PostgreSQL without its default port, Redis
    without its default database."""
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///") :])
        return f"sqlite:///{path.parent}/./{path.name}?busy_timeout=30000"
    if url.startswith("postgresql://"):
        return url.replace(":5432/", "/")
    return url.rsplit("/", 1)[0]


def test_saves_through_two_spellings_of_one_store_take_turns(url: str) -> None:
    """Parallel listeners of a flow persisted per method, half of them through another
    spelling of the same store's URL: the saves of one flow take turns as with one
    spelling (none is refused by the other's claim), and all land in one ledger."""
    other = spelled_otherwise(url)
    assert other != url

    def body() -> dict[str, Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        one, two = RemitFlowPersistence(url), RemitFlowPersistence(other)
        together = threading.Barrier(4, timeout=30)  # the saves follow at once

        def branch(name: str, persistence: RemitFlowPersistence) -> Any:
            @listen("begin")
            @persist(persistence)
            def method(self: Any) -> None:
                self.state[name] = True
                together.wait()

            method.__name__ = name
            return method

        @start()
        @persist(one)
        def begin(self: Any) -> None:
            self.state["begun"] = True

        methods = {n: branch(n, p) for n, p in [("a", one), ("b", two), ("c", one), ("d", two)]}
        body = {"_skip_auto_memory": True, "begin": begin, **methods}
        fanned = kickoff(type("TwoSpellingsFlow", (Flow,), body))
        saved = two.checkpoints(fanned["id"])
        return {"completed": sorted(saved[0].completed), "count": len(saved)}

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value == {"completed": ["a", "b", "begin", "c", "d"], "count": 5}


# -- (3) one method run twice at once, then a crash ----------------------------------------------


def head_ledger(url: str, flow_id: str) -> Ledger | None:
    head = RemitFlowPersistence(url).remit.head(flow_id)
    if head is None:
        return None
    return decode(head.state, run_id=flow_id, checkpoint_id=head.checkpoint_id).ledger


def wait_for(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def pick_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """start_a -> go_a -> "go", start_b -> go_b -> "go": router `pick` runs twice at once;
    the run that counts first takes "left" (-> left_step, effect "left"), the other
    "right" (-> right_step, effect "right"). The two runs of `pick` (async) end in one
    turn of the event loop. Built in a child."""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    left, right = sink_effect(sink, "left"), sink_effect(sink, "right")
    counter, both = itertools.count(), asyncio.Event()

    class Picks(BaseModel):
        left: str | None = None
        right: str | None = None

    @persist(RemitFlowPersistence(url, lease=1.0))
    class PickFlow(Flow[Picks]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def start_a(self) -> None:
            pass

        @start()
        def start_b(self) -> None:
            pass

        @router(start_a)
        def go_a(self) -> str:
            return "go"

        @router(start_b)
        def go_b(self) -> str:
            return "go"

        @router("go")
        async def pick(self) -> str:
            journal.record("enter", "pick")
            first = next(counter) == 0
            if not first:
                both.set()
            await asyncio.wait_for(both.wait(), timeout=30)  # both runs end at once
            return "left" if first else "right"

        @listen("left")
        def left_step(self) -> None:
            journal.record("enter", "left_step")
            point(at, "left_step")
            self.state.left = left()

        @listen("right")
        def right_step(self) -> None:
            journal.record("enter", "right_step")
            point(at, "right_step")
            self.state.right = right()

    return PickFlow


def test_a_router_run_twice_at_once_keeps_both_routes_across_a_crash(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1: router `pick` runs twice at once (two routes lead to it) and both runs end
    together, taking "left" and "right". The process dies once both runs are saved,
    before either route's step completes: the ledger holds both routes, and the restart
    replays `pick` (entering it no more) and runs both routes' steps, each effect once."""
    flow_id = f"pick-{uuid.uuid4().hex}"
    never = str(tmp_path / "never")
    waiting = {"left_step": f"wait:{never}", "right_step": f"wait:{never}"}
    crashing = child(lambda: kickoff(pick_flow(url, world, points=waiting), inputs={"id": flow_id}))
    try:

        def both_picked() -> bool:
            ledger = head_ledger(url, flow_id)
            return ledger is not None and ledger.occurrence("pick") == 2

        wait_for(both_picked, "both runs of pick to be saved")
        wait_for(
            lambda: entered(world).get("left_step") and entered(world).get("right_step"),
            "both routes' steps to start",
        )
        ledger = head_ledger(url, flow_id)
        assert ledger is not None
        assert sorted(r or "" for r in ledger.routes["pick"]) == ["left", "right"], ledger.routes
    finally:
        crashing.kill()
    assert crashing.wait(timeout=60).status == "killed"
    time.sleep(1.2)  # the dead run's lease runs out
    done = run(lambda: kickoff(pick_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["left"] and done.value["state"]["right"], done.value
    assert entered(world) == {"pick": 2, "left_step": 2, "right_step": 2}
    assert applied(world) == {"left": 1, "right": 1}


def review_twice_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """start_a -> go_a -> "go", start_b -> go_b -> "go" -> review (human feedback, run
    twice at once; its provider answers at once, "ann" to the run that asks first, "bob"
    to the other, both in one turn of the event loop) -> heard (notes the feedback the
    flow holds). Built in a child."""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, at = Journal(WorldDB(world)), points or {}
    counter, both = itertools.count(), asyncio.Event()

    class AtOnce:
        def request_feedback(self, context: Any, flow: Any) -> Any:
            first = next(counter) == 0

            async def answer() -> str:
                if not first:
                    both.set()
                await asyncio.wait_for(both.wait(), timeout=30)
                return "ann" if first else "bob"

            return answer()

    class Heard(BaseModel):
        heard: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class ReviewTwiceFlow(Flow[Heard]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def start_a(self) -> None:
            pass

        @start()
        def start_b(self) -> None:
            pass

        @router(start_a)
        def go_a(self) -> str:
            return "go"

        @router(start_b)
        def go_b(self) -> str:
            return "go"

        @listen("go")
        @human_feedback(message="Ship it?", provider=AtOnce())
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen(review)
        def heard(self) -> None:
            journal.record("enter", "heard")
            point(at, "heard")
            self.state.heard = sorted(str(f.feedback) for f in self.human_feedback_history)

    return ReviewTwiceFlow


def test_feedback_given_to_two_runs_at_once_is_kept_for_a_restart(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1, P5: feedback method `review` runs twice at once and its provider answers both
    at once ("ann", "bob"). The process dies once both runs are saved: the ledger holds
    each answer under its own run, and the restart, which does not ask again, gives the
    flow both answers."""
    flow_id = f"twice-{uuid.uuid4().hex}"
    waiting = {"heard": f"wait:{tmp_path / 'never'}"}
    build = review_twice_flow
    crashing = child(lambda: kickoff(build(url, world, points=waiting), inputs={"id": flow_id}))
    try:

        def both_reviewed() -> bool:
            ledger = head_ledger(url, flow_id)
            return ledger is not None and ledger.occurrence("review") == 2

        wait_for(both_reviewed, "both runs of review to be saved")
        ledger = head_ledger(url, flow_id)
        assert ledger is not None
        given = sorted((f["interrupt"], f["feedback"]) for f in ledger.feedback)
        assert [g[1] for g in given] == ["ann", "bob"], given
        assert sorted(g[0] for g in given) == ["review#0", "review#1"], given
    finally:
        crashing.kill()
    assert crashing.wait(timeout=60).status == "killed"
    time.sleep(1.2)  # the dead run's lease runs out
    done = run(lambda: kickoff(build(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["heard"] == ["ann", "bob"], done.value
    assert entered(world)["review"] == 2


# -- (4) typed values in a model state ---------------------------------------------------------


def test_a_model_state_keeps_typed_values_beside_an_enum_or_refuses_naming_the_field(
    url: str,
) -> None:
    """P4: a model with an Enum field keeps a Decimal and a UUID in an `Any` field and bytes
    that are not UTF-8 exactly across a restart (before, the Enum made the whole state go
    through JSON: refused, naming the Enum field); a datetime with a `zoneinfo` zone in a
    model field is refused naming that field (before, it came back with a fixed offset)."""

    def body() -> dict[str, Any]:
        import datetime as dt
        import enum
        from decimal import Decimal
        from zoneinfo import ZoneInfo

        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        class Size(enum.IntEnum):
            ONE = 1

        class Typed(BaseModel):
            size: Size = Size.ONE
            anything: Any = None
            raw: bytes = b""
            when: dt.datetime | None = None

        persistence = RemitFlowPersistence(url)
        tag = uuid.UUID("12345678-1234-5678-1234-567812345678")
        values = {
            "anything": {"price": Decimal("1.10"), "tag": tag},
            "raw": b"\x00\xff",
            "when": dt.datetime(2024, 3, 1, tzinfo=ZoneInfo("Europe/Paris")),
        }
        out: dict[str, Any] = {}
        for field, value in values.items():

            @persist(persistence)
            class TypedFlow(Flow[Typed]):  # type: ignore[misc]
                _skip_auto_memory = True

                @start()
                def fill(self, field: str = field, value: Any = value) -> None:
                    setattr(self.state, field, value)

            flow = TypedFlow(suppress_flow_events=True)
            try:
                flow.kickoff()
            except RuntimeError as exc:
                cause = exc.__cause__
                out[field] = [type(cause).__name__, getattr(cause, "field", None)]
                out[field].append(persistence.load_state(flow.state.id))
                continue
            again = TypedFlow(suppress_flow_events=True)
            again.kickoff(inputs={"id": flow.state.id})
            back = getattr(again.state, field)
            out[field] = [repr(back), repr(again.state.size)]
        return out

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value == {
        "anything": [
            "{'price': Decimal('1.10'), 'tag': UUID('12345678-1234-5678-1234-567812345678')}",
            "<Size.ONE: 1>",
        ],
        "raw": ["b'\\x00\\xff'", "<Size.ONE: 1>"],
        "when": ["CheckpointInvalid", "when", None],
    }
