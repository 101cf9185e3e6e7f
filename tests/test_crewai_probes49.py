"""Round 49 of the CrewAI probes: an `and_` join one of whose inputs is a router's route,
SIGKILLed after the route was taken but before the other input completed; a very large
dict state carried through a crash; a model state of Decimal, aware datetime, Enum,
bytes, set and tuple fields restarted after a crash; a `Field(exclude=True)` field; a
dict state given values no restart could read back as they were; `@human_feedback(emit=,
llm=)` whose LLM (an OpenAI-compatible endpoint on this machine) would route the same
feedback otherwise on a second asking, or fails; what a process keeps after many flows;
and streaming flows (`stream = True`).

Found: a streaming kickoff of `restore_from_state_id=S` called inside `with
fork_token("t")` was refused with `ForkWithoutIntent` (asking for that very block) when
its frames were read after the block: CrewAI starts a streaming flow's run only then, in
a thread or task of the reading place's context. Now the run forks under the token of
the place the kickoff was called.

Written from the contract (P1, P2: nothing durably done is done again; P4: a state is
stored exactly or refused, the head staying where it was; P6: a recovery ends as an
uninterrupted run) and CrewAI's public API, against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import sink_effect
from test_crewai_flows import applied, entered, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB

#: The longest a restart waits for a killed process's claim (lease 1 s here) to lapse.
PATIENCE = 60.0
#: Rounds of flows one process runs in the leak probe.
ROUNDS = 15


def until_free(attempt: Any) -> Any:
    """`attempt()` again while another process holds the claim (a killed one's until it
    lapses)."""
    from remit_core import ResumeConflict

    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            return attempt()
        except ResumeConflict:
            continue
    raise AssertionError("the claim was never free")


def stored(url: str, flow_id: str) -> dict[str, Any]:
    from remit_crewai import RemitFlowPersistence

    store = RemitFlowPersistence(url)
    return {
        "state": store.load_state(flow_id),
        "methods": [c.method for c in store.checkpoints(flow_id)],
    }


# -- P1, P2, P6: an `and_` join of a route and a method, killed between the two ------------


def join_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """begin -> gate (a router: "go") -> picking (effect "pick", on "go") -> packing
    (`and_("go", picking)`, effect "pack"); a dict state."""
    from crewai.flow.flow import Flow, and_, listen, router, start
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    pick, pack = sink_effect(sink, "pick"), sink_effect(sink, "pack")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class JoinFlow(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True
        initial_state = {"log": []}

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")
            self.state["log"].append("begin")

        @router(begin)
        def gate(self) -> str:
            journal.record("enter", "gate")
            return "go"

        @listen("go")
        def picking(self) -> None:
            journal.record("enter", "picking")
            receipt = str(pick())
            point(at, "picking")
            self.state["log"].append(f"pick {receipt}")

        @listen(and_("go", picking))
        def packing(self) -> str:
            journal.record("enter", "packing")
            receipt = str(pack())
            point(at, "packing")
            self.state["log"].append(f"pack {receipt}")
            return "packed"

    return JoinFlow


def kick_dict(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff(**kwargs)
    return {"id": flow.flow_id, "state": dict(flow.state), "out": out}


@pytest.mark.parametrize("killed_at", ["picking", "packing"])
def test_a_join_of_a_route_and_a_method_killed_between_them_runs_once(
    url: str, world: Path, killed_at: str
) -> None:
    """P1, P2, P6: `packing` waits for `and_("go", picking)`, where "go" is a route
    `gate` took. Killed in `picking` (the route taken, `picking` in flight) or in
    `packing` (both inputs in), the flow restarted by id runs the join once, ends in the
    state of an uninterrupted run, each effect applied once; a second restart runs
    nothing and returns what `packing` returned."""
    flow_id = f"join-{uuid.uuid4().hex}"
    died = run(
        lambda: kick_dict(join_flow(url, world, points={killed_at: "kill"}), inputs={"id": flow_id})
    )
    assert died.status == "killed", died.summary()
    done = run(lambda: until_free(lambda: kick_dict(join_flow(url, world), inputs={"id": flow_id})))
    assert done.ok, done.summary()
    log = done.value["state"]["log"]
    assert [line.split(" ")[0] for line in log] == ["begin", "pick", "pack"], log
    assert done.value["out"] == "packed"
    assert applied(world) == {"pick": 1, "pack": 1}
    once = {"begin": 1, "gate": 1, "picking": 1, "packing": 1}
    assert entered(world) == {**once, killed_at: 2}
    again = run(lambda: kick_dict(join_flow(url, world), inputs={"id": flow_id}))
    assert again.ok, again.summary()
    assert again.value["state"] == done.value["state"] and again.value["out"] == "packed"
    assert entered(world) == {**once, killed_at: 2}


# -- P4, P1: a very large dict state through a crash ---------------------------------------


def big_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """fill (a state of about 6 MB: a 2 MB str, 2 MB of bytes, 20 000 small dicts) ->
    grow (doubles the list) -> seal (effect "seal"); a dict state."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    seal = sink_effect(sink, "seal")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class BigFlow(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def fill(self) -> None:
            journal.record("enter", "fill")
            self.state["text"] = "é\u2603x" * (2 << 19)
            self.state["blob"] = bytes(range(256)) * (2 << 12)
            self.state["rows"] = [{"n": i, "name": f"row {i}"} for i in range(20_000)]

        @listen(fill)
        def grow(self) -> None:
            journal.record("enter", "grow")
            self.state["rows"].extend({"n": -i} for i in range(20_000))
            point(at, "grow")

        @listen(grow)
        def close(self) -> None:
            journal.record("enter", "close")
            self.state["receipt"] = str(seal())
            point(at, "close")

    return BigFlow


def big_digest(state: dict[str, Any]) -> dict[str, Any]:
    import hashlib

    from remit_core import codec

    return {
        "keys": sorted(state),
        "rows": len(state.get("rows", [])),
        "digest": hashlib.sha256(
            codec.dumps({k: v for k, v in state.items() if k not in ("id", "receipt")})
        ).hexdigest(),
        "receipt": state.get("receipt"),
    }


@pytest.mark.parametrize("killed_at", ["grow", "close"])
def test_a_large_state_is_kept_exactly_through_a_crash(
    url: str, world: Path, killed_at: str
) -> None:
    """P4, P1, P2: a dict state of several MB (text with non-ASCII characters, bytes,
    tens of thousands of rows) is saved by every step; killed in `grow` or after the
    effect of `close`, the restart continues from what was saved and ends with exactly
    the state an uninterrupted run ends with; the effect applies once and `load_state`
    reads back the same state."""
    flow_id = f"big-{uuid.uuid4().hex}"
    died = run(
        lambda: kick_dict(big_flow(url, world, points={killed_at: "kill"}), inputs={"id": flow_id})
    )
    assert died.status == "killed", died.summary()

    def restart() -> dict[str, Any]:
        out = kick_dict(big_flow(url, world), inputs={"id": flow_id})
        return big_digest(out["state"])

    done = run(lambda: until_free(restart))
    assert done.ok, done.summary()
    clean = run(lambda: big_digest(kick_dict(big_flow(url, world))["state"]))
    assert clean.ok, clean.summary()
    assert done.value["rows"] == 40_000
    assert {k: v for k, v in done.value.items() if k != "receipt"} == {
        k: v for k, v in clean.value.items() if k != "receipt"
    }
    assert applied(world) == {"seal": 2}  # one for the restarted flow, one for the clean one
    assert entered(world) == {
        "fill": 2,
        "grow": 2 + (killed_at == "grow"),
        "close": 2 + (killed_at == "close"),
    }
    read = run(lambda: big_digest(stored(url, flow_id)["state"]))
    assert read.ok and read.value == done.value, read.summary()


# -- P4, P1: a model state of Decimal, datetime, Enum, bytes, set and tuple fields ----------


def typed_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """price (sets every typed field) -> bill (effect "bill", appends to the tuple and the
    set) -> done; a model state whose fields are of types JSON lacks."""
    import datetime as dt
    import enum
    from decimal import Decimal
    from uuid import UUID

    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    bill = sink_effect(sink, "bill")

    class Tier(enum.Enum):
        FREE = "free"
        GOLD = "gold"

    class Level(enum.IntEnum):
        LOW = 1
        HIGH = 2

    class Invoice(BaseModel):
        total: Decimal = Decimal("0")
        due: dt.datetime = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
        day: dt.date = dt.date(2000, 1, 1)
        span: dt.timedelta = dt.timedelta(0)
        tier: Tier = Tier.FREE
        level: Level = Level.LOW
        blob: bytes = b""
        ref: UUID = UUID(int=0)
        tags: set[str] = set()
        lines: tuple[str, ...] = ()
        receipt: str = ""

    @persist(RemitFlowPersistence(url, lease=1.0))
    class TypedFlow(Flow[Invoice]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def price(self) -> None:
            journal.record("enter", "price")
            self.state.total = Decimal("19.990")
            zone = dt.timezone(dt.timedelta(hours=-3, minutes=-30))
            self.state.due = dt.datetime(2030, 5, 6, 7, 8, 9, 123456, tzinfo=zone)
            self.state.day = dt.date(2030, 5, 6)
            self.state.span = dt.timedelta(days=3, microseconds=7)
            self.state.tier = Tier.GOLD
            self.state.level = Level.HIGH
            self.state.blob = b"\x00\xff\x80"
            self.state.ref = UUID("12345678-1234-5678-1234-567812345678")
            self.state.tags = {"a", "b"}
            self.state.lines = ("one",)

        @listen(price)
        def billing(self) -> None:
            journal.record("enter", "billing")
            self.state.receipt = str(bill())
            point(at, "billing")
            self.state.lines = (*self.state.lines, "two")
            self.state.tags.add("c")

        @listen(billing)
        def done(self) -> dict[str, str]:
            journal.record("enter", "done")
            point(at, "done")
            return {name: type(value).__name__ for name, value in self.state}

    return TypedFlow


def typed(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff(**kwargs)
    state = flow.state
    return {
        "types": {name: type(value).__name__ for name, value in state},
        # (a set's repr follows its strings' hashes, which differ between processes)
        "values": {
            name: repr(sorted(value) if isinstance(value, set) else value)
            for name, value in state
            if name != "id"
        },
        "out": out,
    }


@pytest.mark.parametrize("killed_at", ["billing", "done"])
def test_a_model_state_of_types_json_lacks_restarts_with_the_same_values_and_types(
    url: str, world: Path, killed_at: str
) -> None:
    """P4, P1, P2: a model state's Decimal (with its trailing zero), aware datetime (an
    odd offset, microseconds), date, timedelta, Enum and IntEnum, bytes, UUID, set and
    tuple fields, killed after the effect of `billing` or in `done`, are restored by the
    restart with their values and types: the restart ends with the state an
    uninterrupted run ends with, the effect applied once."""
    flow_id = f"typed-{uuid.uuid4().hex}"
    died = run(
        lambda: typed(typed_flow(url, world, points={killed_at: "kill"}), inputs={"id": flow_id})
    )
    assert died.status == "killed", died.summary()
    done = run(lambda: until_free(lambda: typed(typed_flow(url, world), inputs={"id": flow_id})))
    assert done.ok, done.summary()
    clean = run(lambda: typed(typed_flow(url, world)))
    assert clean.ok, clean.summary()
    receipt = "receipt"
    assert {k: v for k, v in done.value["values"].items() if k != receipt} == {
        k: v for k, v in clean.value["values"].items() if k != receipt
    }
    assert done.value["types"] == clean.value["types"]
    assert done.value["out"] == clean.value["out"] == clean.value["types"]
    assert done.value["types"]["tier"] == "Tier" and done.value["types"]["total"] == "Decimal"
    assert done.value["values"]["total"] == "Decimal('19.990')"
    assert applied(world) == {"bill": 2}
    assert entered(world) == {
        "price": 2,
        "billing": 2 + (killed_at == "billing"),
        "done": 2 + (killed_at == "done"),
    }


# -- P4: a field the model excludes from its dumps ------------------------------------------


def excluded_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """connect (sets the excluded `session` and a kept `count`) -> work (kill point) ->
    report (returns both); a model state with `session: str = Field("fresh",
    exclude=True)`."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    from remit_crewai import RemitFlowPersistence

    journal, at = Journal(WorldDB(world)), points or {}

    class Job(BaseModel):
        session: str = Field(default="fresh", exclude=True)
        count: int = 0

    @persist(RemitFlowPersistence(url, lease=1.0))
    class ExcludedFlow(Flow[Job]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def connect(self) -> None:
            journal.record("enter", "connect")
            self.state.session = "used"
            self.state.count = 1

        @listen(connect)
        def work(self) -> None:
            journal.record("enter", "work")
            point(at, "work")
            self.state.count += 1

        @listen(work)
        def report(self) -> list[Any]:
            journal.record("enter", "report")
            return [self.state.session, self.state.count]

    return ExcludedFlow


def test_an_excluded_field_is_left_out_and_a_restart_continues_with_its_default(
    url: str, world: Path
) -> None:
    """P4 as the README states it: a `Field(exclude=True)` field is left out of the
    stored state (the saves succeed), and a restart after a crash continues with its
    default while the kept fields continue from the checkpoint."""
    flow_id = f"excluded-{uuid.uuid4().hex}"
    died = run(
        lambda: kick_model(
            excluded_flow(url, world, points={"work": "kill"}), inputs={"id": flow_id}
        )
    )
    assert died.status == "killed", died.summary()
    saved = run(lambda: stored(url, flow_id))
    assert saved.ok, saved.summary()
    assert "session" not in saved.value["state"] and saved.value["state"]["count"] == 1
    done = run(
        lambda: until_free(lambda: kick_model(excluded_flow(url, world), inputs={"id": flow_id}))
    )
    assert done.ok, done.summary()
    assert done.value["out"] == ["fresh", 2], done.value
    assert entered(world) == {"connect": 1, "work": 2, "report": 1}


def kick_model(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff(**kwargs)
    return {"id": flow.flow_id, "state": flow.state.model_dump(), "out": out}


# -- P4: dict state values no restart could read back ---------------------------------------


def odd_flow(url: str, world: Path, value: str) -> type[Any]:
    """begin (keeps `items`) -> add (appends a value of kind `value` to `items`) -> end;
    a dict state."""
    import collections
    import enum

    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal = Journal(WorldDB(world))

    class Color(enum.Enum):
        RED = "red"

    class Point(collections.namedtuple("Point", "x y")):
        pass

    odd = {
        "enum": lambda: Color.RED,
        "namedtuple": lambda: Point(1, 2),
        "bytearray": lambda: bytearray(b"ab"),
        "object": lambda: object(),
        "nested-key": lambda: {"k": {Color.RED: 1}},
    }[value]

    @persist(RemitFlowPersistence(url, lease=1.0))
    class OddFlow(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")
            self.state["items"] = ["first"]

        @listen(begin)
        def add(self) -> None:
            journal.record("enter", "add")
            self.state["items"].append(odd())

        @listen(add)
        def end(self) -> None:
            journal.record("enter", "end")

    return OddFlow


@pytest.mark.parametrize("value", ["enum", "namedtuple", "bytearray", "object", "nested-key"])
def test_a_dict_state_value_no_restart_reads_back_is_refused_naming_it(
    url: str, world: Path, value: str
) -> None:
    """P4: a value in a dict state's list that would come back as another type (an Enum,
    a namedtuple, a bytearray, an Enum dict key) or not at all (an object) is refused
    with `CheckpointInvalid` naming `items[1]`: nothing is saved for `add`, the head
    keeps the state after `begin`, and `end` never runs."""
    flow_id = f"odd-{uuid.uuid4().hex}"
    bad = run(lambda: kick_dict(odd_flow(url, world, value), inputs={"id": flow_id}))
    assert bad.raised("CheckpointInvalid"), bad.summary()
    text = bad.message_of("CheckpointInvalid") or ""
    assert "items[1]" in text and flow_id in text, text
    saved = run(lambda: stored(url, flow_id))
    assert saved.ok, saved.summary()
    assert saved.value["methods"] == ["begin"]
    assert saved.value["state"]["items"] == ["first"]
    assert entered(world) == {"begin": 1, "add": 1}


# -- P1, P2: an `and_` join of siblings killed after one completed, an `or_` listener ------


def sibling_flow(
    url: str, world: Path, flow_id: str, *, points: dict[str, str] | None = None
) -> type[Any]:
    """begin -> left (effect "left") and right (effect "right") side by side; `right`,
    armed, first waits until `left`'s completion is in the store -> both
    (`and_(left, right)`, effect "both") and either (`or_(left, right)`, effect
    "either"); a model state."""
    from crewai.flow.flow import Flow, and_, listen, or_, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    effects = {k: sink_effect(sink, k) for k in ("left", "right", "both", "either")}

    def left_saved() -> None:
        deadline = time.monotonic() + PATIENCE
        while "left" not in stored(url, flow_id)["methods"]:
            assert time.monotonic() < deadline, "left was never saved"
            time.sleep(0.02)

    class Pair(BaseModel):
        left: str = ""
        right: str = ""
        both: str = ""
        either: str = ""

    @persist(RemitFlowPersistence(url, lease=1.0))
    class SiblingFlow(Flow[Pair]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")

        @listen(begin)
        def left(self) -> None:
            journal.record("enter", "left")
            self.state.left = str(effects["left"]())

        @listen(begin)
        def right(self) -> None:
            journal.record("enter", "right")
            if "right" in at:
                left_saved()
            receipt = str(effects["right"]())
            point(at, "right")
            self.state.right = receipt

        @listen(and_(left, right))
        def both(self) -> None:
            journal.record("enter", "both")
            receipt = str(effects["both"]())
            point(at, "both")
            self.state.both = receipt

        @listen(or_(left, right))
        def either(self) -> None:
            journal.record("enter", "either")
            self.state.either = str(effects["either"]())

    return SiblingFlow


@pytest.mark.parametrize("killed_at", ["right", "both"])
def test_an_and_join_killed_after_one_sibling_completed_runs_once(
    url: str, world: Path, killed_at: str
) -> None:
    """P1, P2: `left` and `right` run side by side after `begin`; `both` waits for
    `and_(left, right)`, `either` for `or_(left, right)`. Killed in `right` once `left`'s
    completion is saved (only one input of the join durable), or in `both` after its
    effect, the restart runs `left` no more, runs the join once, the `or_` listener no
    more than once per run, and each effect applies once; a second restart runs nothing."""
    flow_id = f"pair-{uuid.uuid4().hex}"
    died = run(
        lambda: kick_model(
            sibling_flow(url, world, flow_id, points={killed_at: "kill"}), inputs={"id": flow_id}
        )
    )
    assert died.status == "killed", died.summary()
    done = run(
        lambda: until_free(
            lambda: kick_model(sibling_flow(url, world, flow_id), inputs={"id": flow_id})
        )
    )
    assert done.ok, done.summary()
    state = done.value["state"]
    assert all(state[k] for k in ("left", "right", "both", "either")), state
    assert applied(world) == {"left": 1, "right": 1, "both": 1, "either": 1}
    seen = entered(world)
    assert seen["begin"] == 1 and seen["left"] == 1, seen
    assert seen["right"] == 1 + (killed_at == "right"), seen
    assert seen["both"] == 1 + (killed_at == "both"), seen
    again = run(lambda: kick_model(sibling_flow(url, world, flow_id), inputs={"id": flow_id}))
    assert again.ok and again.value["state"] == state, again.summary()
    assert entered(world) == seen


# -- P1, P2, P6: a router with an effect, looping, killed in the router ---------------------


def routed_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """start -> step (appends a round) -> decide (a router with effect "decide" each
    round; "again" -> step, up to 3 rounds, then "done") -> finish; killed in `decide`
    after its effect in a given round."""
    from crewai.flow.flow import Flow, listen, or_, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    decide = sink_effect(sink, "decide")

    class Loop(BaseModel):
        rounds: int = 0
        receipts: list[str] = []
        finished: bool = False

    @persist(RemitFlowPersistence(url, lease=1.0))
    class RoutedFlow(Flow[Loop]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")

        @listen(or_(begin, "again"))
        def step(self) -> None:
            journal.record("enter", "step")
            self.state.rounds += 1

        @router(step)
        def deciding(self) -> str:
            journal.record("enter", "deciding")
            self.state.receipts.append(str(decide()))
            point(at, f"deciding.{self.state.rounds}")
            return "again" if self.state.rounds < 3 else "done"

        @listen("done")
        def finish(self) -> str:
            journal.record("enter", "finish")
            self.state.finished = True
            return "finished"

    return RoutedFlow


@pytest.mark.parametrize("killed_round", [1, 2, 3])
def test_a_router_killed_after_its_effect_takes_the_same_route_once(
    url: str, world: Path, killed_round: int
) -> None:
    """P1, P2, P6: a router that applies an effect each round of a loop is killed after
    the effect of round 1, 2 or 3; the restart replays the completed rounds, runs the
    killed round's router again (its effect returns the recorded outcome: the receipt is
    the same, applied once), takes the route, and ends as an uninterrupted run: 3 rounds,
    3 receipts, `finish` once."""
    flow_id = f"routed-{uuid.uuid4().hex}"
    died = run(
        lambda: kick_model(
            routed_flow(url, world, points={f"deciding.{killed_round}": "kill"}),
            inputs={"id": flow_id},
        )
    )
    assert died.status == "killed", died.summary()
    done = run(
        lambda: until_free(lambda: kick_model(routed_flow(url, world), inputs={"id": flow_id}))
    )
    assert done.ok, done.summary()
    state = done.value["state"]
    assert state["rounds"] == 3 and state["finished"] and done.value["out"] == "finished", state
    assert len(state["receipts"]) == 3 and len(set(state["receipts"])) == 3, state
    assert applied(world) == {"decide": 3}
    assert EffectSink(WorldDB(world)).repeats() == {}
    assert entered(world) == {"begin": 1, "step": 3, "deciding": 4, "finish": 1}


# -- P6, P5: feedback an LLM turns into a route (`emit=` with `llm=`) -----------------------


class Judge:
    """An OpenAI-compatible chat endpoint on this machine (a thread of the test's own
    process) that answers its n-th call, over every process of a test, with
    `answers[n]` (the last one past the end; "fail" answers HTTP 400): an LLM need not
    answer the same twice. CrewAI stores the LLM's settings with a pause and makes the
    LLM again from them on a resume, so the LLM is CrewAI's own OpenAI one."""

    def __init__(self, answers: list[str]) -> None:
        import http.server
        import json
        import threading

        self.answers, self.calls = answers, 0
        judge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                self.rfile.read(int(self.headers.get("content-length", 0)))
                n, judge.calls = judge.calls, judge.calls + 1
                answer = judge.answers[min(n, len(judge.answers) - 1)]
                status, body = (
                    (400, {"error": {"message": "down"}})
                    if answer == "fail"
                    else (
                        200,
                        {
                            "id": f"c{n}",
                            "object": "chat.completion",
                            "created": 0,
                            "model": "judge",
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {
                                        "role": "assistant",
                                        "content": json.dumps({"outcome": answer}),
                                    },
                                }
                            ],
                            "usage": {
                                "prompt_tokens": 1,
                                "completion_tokens": 1,
                                "total_tokens": 2,
                            },
                        },
                    )
                )
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge() -> Any:
    made: list[Judge] = []

    def make(answers: list[str]) -> Judge:
        made.append(Judge(answers))
        return made[-1]

    yield make
    for one in made:
        one.close()


def triage_flow(
    url: str, world: Path, judge: str, *, points: dict[str, str] | None = None
) -> type[Any]:
    """prepare -> review (`@human_feedback(emit=["ship", "hold"], llm=...)`: the LLM at
    the URL `judge`; pauses) ->
    "ship": pack (effect "pack") / "hold": park (effect "park"); a model state."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai.llm import LLM
    from crewai_parts import Later
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    pack, park = sink_effect(sink, "pack"), sink_effect(sink, "park")
    os.environ["OPENAI_API_KEY"] = "test"  # (the child's own environment)
    llm = LLM(model="openai/judge", base_url=judge, api_key="test", max_retries=0)

    class Ticket(BaseModel):
        route: str = ""
        receipt: str = ""

    @persist(RemitFlowPersistence(url, lease=1.0))
    class TriageFlow(Flow[Ticket]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship?", emit=["ship", "hold"], llm=llm, provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "ticket"

        @listen("ship")
        def packing(self) -> None:
            journal.record("enter", "packing")
            receipt = str(pack())
            point(at, "packing")
            self.state.route, self.state.receipt = "ship", receipt

        @listen("hold")
        def parking(self) -> None:
            journal.record("enter", "parking")
            receipt = str(park())
            point(at, "parking")
            self.state.route, self.state.receipt = "hold", receipt

    return TriageFlow


def pause(flow_class: type[Any]) -> str:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff()
    assert type(out).__name__ == "HumanFeedbackPending", out
    return str(flow.flow_id)


def answer(flow_class: type[Any], flow_id: str, feedback: str) -> dict[str, Any]:
    flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
    flow.resume(feedback)
    return flow.state.model_dump()


def test_a_route_an_llm_chose_is_kept_by_the_recovery_of_a_crash(
    url: str, world: Path, judge: Any
) -> None:
    """P6, P2: the resume's feedback goes to an LLM that picks "ship" (it would pick
    "hold" if asked again); killed in `packing` after its effect, the flow restarted by id
    follows the route it took ("ship", as the ledger records it), not a new answer: the
    same state as an uninterrupted run, `pack` applied once, `park` never."""
    llm = judge(["ship", "hold"])
    answers = llm.url
    paused = run(lambda: pause(triage_flow(url, world, answers)))
    assert paused.ok, paused.summary()
    flow_id = paused.value
    died = run(
        lambda: answer(
            triage_flow(url, world, answers, points={"packing": "kill"}), flow_id, "send it"
        )
    )
    assert died.status == "killed", died.summary()
    done = run(
        lambda: until_free(
            lambda: kick_model(triage_flow(url, world, answers), inputs={"id": flow_id})
        )
    )
    assert done.ok, done.summary()
    assert done.value["state"]["route"] == "ship", done.value
    assert applied(world) == {"pack": 1}
    assert entered(world) == {"prepare": 1, "review": 1, "packing": 2}
    assert llm.calls == 1  # the restart did not ask the LLM again


def test_an_llm_that_fails_to_route_the_feedback_leaves_it_recoverable(
    url: str, world: Path, judge: Any
) -> None:
    """P5, liveness: the LLM fails as the resume collapses the feedback. The resume
    raises; afterwards the flow is not stuck: either the pause is still pending (a retry
    resume proceeds) or the feedback was taken and a restart by id routes it. Either
    way the flow ends on the route the working LLM picks, each effect applied once."""
    llm = judge(["fail", "fail", "ship"])  # (CrewAI asks twice before it fails)
    answers = llm.url
    paused = run(lambda: pause(triage_flow(url, world, answers)))
    assert paused.ok, paused.summary()
    flow_id = paused.value
    failed = run(lambda: answer(triage_flow(url, world, answers), flow_id, "send it"))
    assert not failed.ok, failed.summary()

    def retry() -> dict[str, Any]:
        from remit_core import ResumeConflict

        flow_class = triage_flow(url, world, answers)
        try:
            return {"how": "resume", "state": answer(flow_class, flow_id, "send it")}
        except (ResumeConflict, ValueError) as e:
            out = kick_model(flow_class, inputs={"id": flow_id})
            return {"how": f"restart after {type(e).__name__}: {e}", "state": out["state"]}

    done = run(lambda: until_free(retry))
    assert done.ok, done.summary()
    assert done.value["state"]["route"] == "ship", done.value
    assert applied(world) == {"pack": 1}
    assert llm.calls == 3, done.value
    print(done.value["how"])


# -- liveness: what one process keeps after many flows ---------------------------------------


def resources() -> dict[str, int]:
    """What this process holds now: threads, open file descriptors, live Remit sessions
    and kickoffs, live flow instances."""
    import gc
    import threading

    from crewai.flow.flow import Flow

    from remit_crewai._session import Execution, Session

    gc.collect()
    live = gc.get_objects()
    return {
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "sessions": sum(1 for o in live if isinstance(o, Session)),
        "executions": sum(1 for o in live if isinstance(o, Execution)),
        "flows": sum(1 for o in live if isinstance(o, Flow)),
    }


def test_a_process_that_runs_many_flows_keeps_nothing_of_those_that_ended(
    url: str, world: Path
) -> None:
    """Liveness (a leak): one process (a server) runs flows to their end, flows that
    fail in a step, flows that pause and are resumed, and flows loaded with
    `from_pending` but refused (wrong feedback type) and then resumed. After a warm-up
    round, ROUNDS more rounds leave it holding fewer than ROUNDS more threads, file
    descriptors, Remit sessions or kickoffs, or flow instances than after the warm-up."""
    from test_crewai_flows import order_flow, review_flow

    def one_round(orders: type[Any], bad: type[Any], reviews: type[Any]) -> None:
        from remit_core import CheckpointInvalid

        orders(suppress_flow_events=True).kickoff()
        failing = bad(suppress_flow_events=True)
        try:
            failing.kickoff(inputs={"note": "bad"})
        except (CheckpointInvalid, RuntimeError):
            pass
        else:
            raise AssertionError("a state the model refuses was saved")
        paused = reviews(suppress_flow_events=True)
        paused.kickoff()
        persistence = reviews.__flow_persistence_config__.persistence
        flow = reviews.from_pending(paused.flow_id, persistence)
        try:
            flow.resume(7)  # not a str: refused, the flow given back
        except TypeError:
            pass
        else:
            raise AssertionError("feedback of another type was taken")
        flow.resume("alice")

    def server() -> dict[str, Any]:
        orders, reviews = order_flow(url, world), review_flow(url, world)
        one_round(orders, orders, reviews)
        warm = resources()
        for _ in range(ROUNDS):
            one_round(orders, orders, reviews)
        return {"warm": warm, "after": resources()}

    out = run(server)
    assert out.ok, out.summary()
    warm, after = out.value["warm"], out.value["after"]
    # A leak keeps at least one of something per round (three flows run in each); pools
    # (CrewAI's threads, a store's connections) may grow to their size under load.
    for what in ("threads", "fds", "sessions", "executions", "flows"):
        assert after[what] - warm[what] < ROUNDS, out.value


# -- P3, P1: a streaming flow (`stream = True`) ------------------------------------------------


def streaming_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """A flow with `stream = True` (CrewAI's streaming: `kickoff` returns a session
    whose frames are read as the flow runs): begin -> pay (effect "pay") -> end; a model
    state."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    pay = sink_effect(sink, "pay")

    class Bill(BaseModel):
        rounds: int = 0
        receipt: str = ""

    @persist(RemitFlowPersistence(url, lease=1.0))
    class StreamingFlow(Flow[Bill]):  # type: ignore[misc]
        _skip_auto_memory = True
        stream = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")
            self.state.rounds += 1

        @listen(begin)
        def paying(self) -> None:
            journal.record("enter", "paying")
            receipt = str(pay())
            point(at, "paying")
            self.state.receipt = receipt

        @listen(paying)
        def end(self) -> str:
            journal.record("enter", "end")
            return "paid"

    return StreamingFlow


def streamed(flow: Any, session: Any) -> dict[str, Any]:
    """Read every frame of `session` (a `kickoff` of a streaming flow) and what it gave."""
    frames = sum(1 for _ in session)
    return {
        "id": flow.flow_id,
        "state": flow.state.model_dump(),
        "out": session.result,
        "frames": frames,
    }


def test_a_streaming_flow_killed_mid_stream_restarts_once(url: str, world: Path) -> None:
    """P1, P2: a streaming flow's run (in CrewAI's own thread, as its frames are read) is
    killed after the effect of `paying`; a streaming restart by id runs `paying` again
    (its effect returns its recorded outcome) and `end`, not `begin`."""
    flow_id = f"stream-{uuid.uuid4().hex}"

    def first() -> dict[str, Any]:
        flow = streaming_flow(url, world, points={"paying": "kill"})(suppress_flow_events=True)
        return streamed(flow, flow.kickoff(inputs={"id": flow_id}))

    died = run(first)
    assert died.status == "killed", died.summary()

    def restart() -> dict[str, Any]:
        flow = streaming_flow(url, world)(suppress_flow_events=True)
        return streamed(flow, flow.kickoff(inputs={"id": flow_id}))

    done = run(lambda: until_free(restart))
    assert done.ok, done.summary()
    assert done.value["out"] == "paid" and done.value["state"]["rounds"] == 1, done.value
    assert done.value["frames"] > 0
    assert applied(world) == {"pay": 1}
    assert entered(world) == {"begin": 1, "paying": 2, "end": 1}


@pytest.mark.parametrize("kickoff", ["kickoff", "kickoff_async"])
def test_a_streaming_kickoff_made_inside_fork_token_forks_when_its_frames_are_read(
    url: str, world: Path, kickoff: str
) -> None:
    """P3: `kickoff(restore_from_state_id=S)` of a streaming flow (or `await
    kickoff_async(...)`), called inside `with fork_token("t")`, returns a session; CrewAI
    runs the flow only when its frames are read, which a caller (a web handler returning
    the stream) does after the block. The run is the fork the kickoff asked for: the
    token's fork of S (`S@fork-...`), its past not run again, S's head left as it was;
    the same token later continues the same fork. It was refused with
    `ForkWithoutIntent` asking for the `fork_token` block the kickoff was made in."""
    import asyncio

    from remit_crewai import fork_token

    source = run(
        lambda: streamed(
            flow := streaming_flow(url, world)(suppress_flow_events=True), flow.kickoff()
        )
    )
    assert source.ok, source.summary()
    flow_id = source.value["id"]

    def fork_then_read() -> dict[str, Any]:
        flow = streaming_flow(url, world)(suppress_flow_events=True)
        if kickoff == "kickoff":
            with fork_token("t"):
                session = flow.kickoff(restore_from_state_id=flow_id)
            return streamed(flow, session)

        async def read() -> dict[str, Any]:
            with fork_token("t"):
                session = await flow.kickoff_async(restore_from_state_id=flow_id)
            frames = 0
            async for _ in session:
                frames += 1
            return {
                "id": flow.flow_id,
                "state": flow.state.model_dump(),
                "out": session.result,
                "frames": frames,
            }

        return asyncio.run(read())

    forked = run(fork_then_read)
    assert forked.ok, forked.summary()
    assert forked.value["id"].startswith(f"{flow_id}@fork-"), forked.value
    assert forked.value["state"]["receipt"] == source.value["state"]["receipt"]
    assert applied(world) == {"pay": 1}
    again = run(fork_then_read)
    assert again.ok and again.value["id"] == forked.value["id"], again.summary()
    kept = run(lambda: stored(url, flow_id))
    assert kept.ok and kept.value["state"]["id"] == flow_id, kept.summary()
    assert applied(world) == {"pay": 1}


def streaming_review_flow(url: str, world: Path) -> type[Any]:
    """A streaming flow (`stream = True`): prepare -> review (`@human_feedback`, pauses)
    -> ship (effect "ship"); a model state."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai_parts import Later
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    ship = sink_effect(sink, "ship")

    class Parcel(BaseModel):
        by: str = ""
        receipt: str = ""

    @persist(RemitFlowPersistence(url, lease=1.0))
    class StreamingReviewFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True
        stream = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen(review)
        def shipping(self) -> None:
            journal.record("enter", "shipping")
            assert self.last_human_feedback is not None
            self.state.by = self.last_human_feedback.feedback
            self.state.receipt = str(ship())

    return StreamingReviewFlow


def test_a_streaming_flow_that_pauses_is_resumed_once_from_another_process(
    url: str, world: Path
) -> None:
    """P5, P1, P2: a streaming flow pauses at `@human_feedback` (the session's result is
    CrewAI's `HumanFeedbackPending`); another process resumes it with `from_pending`,
    a third one's `from_pending` after that gets `ResumeConflict`, and a streaming restart
    by id runs nothing again: `ship` applied once."""

    def paused() -> dict[str, Any]:
        flow = streaming_review_flow(url, world)(suppress_flow_events=True)
        session = flow.kickoff()
        for _ in session:
            pass
        return {"id": flow.flow_id, "out": type(session.result).__name__}

    first = run(paused)
    assert first.ok and first.value["out"] == "HumanFeedbackPending", first.summary()
    flow_id = first.value["id"]

    def resume(feedback: str) -> dict[str, Any]:
        flow_class = streaming_review_flow(url, world)
        persistence = flow_class.__flow_persistence_config__.persistence
        flow = flow_class.from_pending(flow_id, persistence)
        flow.resume(feedback)
        return flow.state.model_dump()

    done = run(lambda: resume("ann"))
    assert done.ok and done.value["by"] == "ann", done.summary()
    late = run(lambda: resume("bob"))
    assert not late.ok, late.summary()
    assert late.raised("ResumeConflict"), late.summary()

    def restart() -> dict[str, Any]:
        flow = streaming_review_flow(url, world)(suppress_flow_events=True)
        return streamed(flow, flow.kickoff(inputs={"id": flow_id}))

    again = run(restart)
    assert again.ok and again.value["state"]["by"] == "ann", again.summary()
    assert applied(world) == {"ship": 1}
    assert entered(world) == {"prepare": 1, "review": 1, "shipping": 1}


def test_streaming_kickoffs_of_one_id_racing_in_processes_let_one_run(
    url: str, world: Path
) -> None:
    """P5, P2: four processes start streaming kickoffs of one new flow id behind a
    barrier; the one that claims it is held in `paying` until the other three have ended.
    Each of those gets `ResumeConflict` as it reads the frames (raised from CrewAI's
    stream thread, its class kept) and runs nothing; the flow then ends once, `pay`
    applied once."""
    from test_crewai_flows import child

    from remit_core.conformance.processes import Barrier

    flow_id = f"stream-race-{uuid.uuid4().hex}"
    gate = world.parent / "gate"
    barrier = Barrier(4)

    def racer() -> dict[str, Any]:
        flow = streaming_flow(url, world, points={"paying": f"wait:{gate}"})(
            suppress_flow_events=True
        )
        barrier.wait()
        return streamed(flow, flow.kickoff(inputs={"id": flow_id}))

    workers = [child(racer, barrier=barrier) for _ in range(4)]
    barrier.release()
    ended: dict[int, Any] = {}
    deadline = time.monotonic() + 120
    while len(ended) < 3:
        assert time.monotonic() < deadline, f"only {len(ended)} racers ended"
        for i, w in enumerate(workers):
            if i not in ended and (o := w.poll()) is not None:
                ended[i] = o
        time.sleep(0.01)
    for lost in ended.values():
        assert lost.raised("ResumeConflict"), lost.summary()
    gate.touch()
    (winner,) = (w for i, w in enumerate(workers) if i not in ended)
    won = winner.wait(timeout=120)
    assert won.ok and won.value["out"] == "paid", won.summary()
    assert applied(world) == {"pay": 1}
    assert entered(world) == {"begin": 1, "paying": 1, "end": 1}
