"""Round 52 of the CrewAI probes: a flow instance given its past by CrewAI's public
`Flow.reload(execution_data)` (the completed methods and state of an execution kept
elsewhere: a flow moved from another backend, or rebuilt from an execution record)
and kicked off by its id, then SIGKILLed and restarted, or paused for feedback, resumed
from another process and SIGKILLed there; `reload` beside the flow's own
checkpoints in Remit; and forks streamed with `astream` and `stream_events` whose
frames are read after the `fork_token` block.

Found: CrewAI skips the methods `reload` says completed (`kickoff(inputs={"id": X})`
keeps them and resumes), and its own backend does so. Remit, which had no checkpoint
of X, replaced them with X's empty ledger: the reloaded flow ran `prepare` and `charge`
again on a state that already held their work (its log got each twice; the card was
charged again under the new keys), unlike the run on CrewAI's own backend (the
drop-in promise; P1, P2 as the user declared the past). Now a kickoff by its own id of
an instance told its past, for a flow the store has no checkpoint of, skips those
methods as CrewAI does and records them as completed with the first save (a step's or
a pause's), as for a flow restored from a CrewAI checkpoint (round 42): a restart after
a SIGKILL runs only what was in flight. Killed before that first save, the flow has
nothing in Remit and is reloaded again, as a CrewAI fork killed before its first save
is restored from its checkpoint again. Held: for a flow Remit has checkpoints of, the
flow's ledger is its past, whatever `reload` said (a method `reload` claims completed
but that was in flight runs, and one it leaves out is not run again); an `astream` or
`stream_events` fork is the token's one branch where it was called, also when read
after the block.

Written from the contract and CrewAI's public API, against real CrewAI flows in forked
children SIGKILLed mid-step, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from test_crewai_flows import applied, entered, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence, fork_token


def shop_flow(world: Path, persistence: Any, *, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> charge (effect) -> ship (effect) -> notify, a model state with a log, persisted by
    `persistence` (a `RemitFlowPersistence`, or CrewAI's own backend, whose steps apply
    their effects to the sink unrecorded); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_core import effect

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    remit = isinstance(persistence, RemitFlowPersistence)

    def recorded(kind: str) -> Any:
        def apply(*, idempotency_key: str) -> str:
            return sink.apply(kind, idempotency_key)

        return effect(apply, name=kind, reconcile=sink.reconcile) if remit else apply

    charge_card, ship_parcel = recorded("charge"), recorded("ship")

    def call(fn: Any) -> str:
        return str(fn() if remit else fn(idempotency_key=f"plain-{len(sink.counts())}"))

    class Shop(BaseModel):
        amount: int = 0
        receipt: str | None = None
        log: list[str] = []

    @persist(persistence)
    class ShopFlow(Flow[Shop]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.amount = 100
            self.state.log.append("prepare")

        @listen(prepare)
        def charge(self) -> None:
            journal.record("enter", "charge")
            point(at, "charge.before")
            self.state.receipt = call(charge_card)
            self.state.log.append("charge")

        @listen(charge)
        def ship(self) -> None:
            journal.record("enter", "ship")
            point(at, "ship.before")
            call(ship_parcel)
            point(at, "ship.after")
            self.state.log.append("ship")

        @listen(ship)
        def notify(self) -> None:
            journal.record("enter", "notify")
            point(at, "notify.before")
            self.state.log.append("notify")

    return ShopFlow


def execution_data(flow_id: str, completed: list[str], state: dict[str, Any]) -> dict[str, Any]:
    """What CrewAI's `Flow.reload` takes: the flow's id, the methods that completed, and
    the state the last of them ended with."""
    return {
        "id": flow_id,
        "completed_methods": [{"flow_method": {"name": m}} for m in completed],
        "execution_methods": [
            {"flow_method": {"name": m}, "started_at": f"{i:04d}", "final_state": state}
            for i, m in enumerate(completed)
        ],
    }


#: The past an execution record holds of an order: prepared and charged, not shipped.
PAST = {"amount": 100, "receipt": "receipt-elsewhere", "log": ["prepare", "charge"]}


def reloaded_kickoff(flow_class: type[Any], flow_id: str, data: dict[str, Any]) -> Any:
    """A new instance of `flow_class` given `data` by `reload`, kicked off by its id."""
    flow = flow_class(suppress_flow_events=True)
    flow.reload(data)
    out = flow.kickoff(inputs={"id": flow_id})
    return {"out": type(out).__name__, "state": flow.state.model_dump(exclude={"id"})}


def kill_at(url: str, world: Path, flow_id: str, point: str) -> None:
    """Kick flow `flow_id` off in a child SIGKILLed at `point` (a lease of 1 s)."""

    def killed() -> Any:
        flow_class = shop_flow(world, RemitFlowPersistence(url, lease=1.0), points={point: "kill"})
        flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id})

    crashed = run(killed)
    assert crashed.status == "killed", crashed.summary()


def test_a_reloaded_flow_skips_what_reload_says_completed_also_after_a_crash(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1, P2 against CrewAI's own backend: an instance given by `reload` an execution
    that completed `prepare` and `charge`, kicked off by its id (a flow Remit has no
    checkpoint of), runs only `ship` and `notify`, as on CrewAI's own backend, with the
    reloaded state. SIGKILLed in `ship` after its effect, before any save, Remit holds
    nothing of it (as for a CrewAI fork killed before its first save): reloaded and
    kicked off again, it runs `ship` again, whose effect is reconciled, not applied
    again. SIGKILLed next in `notify`, it is restarted by its id alone: the first save
    recorded the reloaded methods as completed, so only `notify` runs. It ends as on
    CrewAI's own backend; kicked off again once finished, it runs nothing. Before, Remit
    ran `prepare` and `charge` again: the log held each twice and the card was charged
    again."""
    from crewai.flow.persistence import SQLiteFlowPersistence

    plain_world = tmp_path / "plain-world.db"
    plain_id, flow_id = f"order-{uuid.uuid4().hex}", f"order-{uuid.uuid4().hex}"
    past = execution_data(flow_id, ["prepare", "charge"], PAST)

    def on_crewai() -> Any:
        crewai = SQLiteFlowPersistence(db_path=str(tmp_path / "crewai.db"))
        data = execution_data(plain_id, ["prepare", "charge"], PAST)
        return reloaded_kickoff(shop_flow(plain_world, crewai), plain_id, data)

    plain = run(on_crewai)
    assert plain.ok, plain.summary()
    assert entered(plain_world) == {"ship": 1, "notify": 1}
    assert plain.value["state"]["log"] == ["prepare", "charge", "ship", "notify"]

    def killed_at(where: str) -> Any:
        flow_class = shop_flow(world, RemitFlowPersistence(url, lease=1.0), points={where: "kill"})
        return reloaded_kickoff(flow_class, flow_id, past)

    crashed = run(lambda: killed_at("ship.after"))
    assert crashed.status == "killed", crashed.summary()
    assert entered(world) == {"ship": 1}, "reload's completed methods ran again"
    assert applied(world) == {"ship": 1}
    assert RemitFlowPersistence(url).load_state(flow_id) is None

    time.sleep(1.2)  # (the dead kickoff's lease)
    crashed = run(lambda: killed_at("notify.before"))
    assert crashed.status == "killed", crashed.summary()
    assert entered(world) == {"ship": 2, "notify": 1}
    assert applied(world) == {"ship": 1}
    saved = RemitFlowPersistence(url).checkpoints(flow_id)
    assert {"prepare", "charge", "ship"} <= set(saved[0].completed), saved[0]

    def restarted() -> Any:
        flow = shop_flow(world, RemitFlowPersistence(url, lease=1.0))(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return flow.state.model_dump(exclude={"id"})

    time.sleep(1.2)
    done = run(restarted)
    assert done.ok, done.summary()
    assert done.value == plain.value["state"]
    assert entered(world) == {"ship": 2, "notify": 2}
    assert applied(world) == {"ship": 1}

    again = run(
        lambda: reloaded_kickoff(
            shop_flow(world, RemitFlowPersistence(url)), flow_id, execution_data(flow_id, [], {})
        )
    )
    assert again.ok, again.summary()
    assert again.value["state"] == plain.value["state"]
    assert entered(world) == {"ship": 2, "notify": 2} and applied(world) == {"ship": 1}


def reviewed_flow(world: Path, url: str, *, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> charge (effect) -> review (human feedback: pauses) -> ship (effect);
    built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai_parts import Later, sink_effect
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    charge_card, ship_parcel = sink_effect(sink, "charge"), sink_effect(sink, "ship")

    class Shop(BaseModel):
        log: list[str] = []
        approved_by: str | None = None

    @persist(RemitFlowPersistence(url, lease=1.0))
    class ReviewedFlow(Flow[Shop]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.log.append("prepare")

        @listen(prepare)
        def charge(self) -> None:
            journal.record("enter", "charge")
            charge_card()
            self.state.log.append("charge")

        @listen(charge)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen(review)
        def ship(self) -> None:
            journal.record("enter", "ship")
            assert self.last_human_feedback is not None
            self.state.approved_by = self.last_human_feedback.feedback
            ship_parcel()
            point(at, "ship.after")
            self.state.log.append("ship")

    return ReviewedFlow


def test_a_reloaded_flow_whose_first_save_is_a_pause_keeps_its_past(url: str, world: Path) -> None:
    """P1, P2, P5: a flow reloaded with `prepare` and `charge` completed, kicked off by its
    id, pauses at `review` (its first save is the pause). Resumed from another process by
    `from_pending`, SIGKILLed in `ship` after its effect, and restarted by id: `prepare`
    and `charge` never run, the feedback is consumed once and reaches `ship`, each effect
    is applied once (the card never, as `reload` said it was charged). Before, the
    reloaded kickoff ran `prepare` and `charge` again and charged the card."""
    flow_id = f"order-{uuid.uuid4().hex}"
    past = execution_data(flow_id, ["prepare", "charge"], {"log": ["prepare", "charge"]})

    paused = run(lambda: reloaded_kickoff(reviewed_flow(world, url), flow_id, past))
    assert paused.ok and paused.value["out"] == "HumanFeedbackPending", paused.summary()
    assert entered(world) == {"review": 1} and applied(world) == {}

    def resumed() -> None:
        flow_class = reviewed_flow(world, url, points={"ship.after": "kill"})
        store = flow_class.__flow_persistence_config__.persistence
        flow_class.from_pending(flow_id, store).resume("alice")

    crashed = run(resumed)
    assert crashed.status == "killed", crashed.summary()
    assert applied(world) == {"ship": 1}

    def restarted() -> Any:
        flow = reviewed_flow(world, url)(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return flow.state.model_dump(exclude={"id"})

    time.sleep(1.2)  # (the dead resumer's lease)
    done = run(restarted)
    assert done.ok, done.summary()
    assert done.value == {"log": ["prepare", "charge", "ship"], "approved_by": "alice"}
    assert entered(world) == {"review": 1, "ship": 2}
    assert applied(world) == {"ship": 1}
    late = run(lambda: reviewed_flow(world, url).from_pending(flow_id, RemitFlowPersistence(url)))
    assert late.raised("ResumeConflict"), late.summary()


def test_reload_of_a_flow_remit_has_checkpoints_of_continues_its_head(
    url: str, world: Path
) -> None:
    """P1, P2: for a flow Remit has checkpoints of, the flow's head is its past, not what
    `reload` says. A flow SIGKILLed in `charge` before its effect (`prepare` saved),
    continued by an instance whose `reload` claims `charge` completed with another
    receipt: `charge` runs (it was in flight), charges once, and the state is the
    head's, not the reloaded one. Then an instance whose `reload` says nothing completed,
    kicked off by the id of the finished flow, runs nothing and applies nothing."""
    flow_id = f"order-{uuid.uuid4().hex}"

    kill_at(url, world, flow_id, "charge.before")
    assert entered(world) == {"prepare": 1, "charge": 1} and applied(world) == {}

    def continued() -> Any:
        flow_class = shop_flow(world, RemitFlowPersistence(url, lease=1.0))
        return reloaded_kickoff(
            flow_class, flow_id, execution_data(flow_id, ["prepare", "charge"], PAST)
        )

    time.sleep(1.2)  # (the dead kickoff's lease)
    done = run(continued)
    assert done.ok, done.summary()
    assert entered(world) == {"prepare": 1, "charge": 2, "ship": 1, "notify": 1}
    assert applied(world) == {"charge": 1, "ship": 1}
    state = done.value["state"]
    assert state["log"] == ["prepare", "charge", "ship", "notify"], state
    assert state["receipt"] not in (None, PAST["receipt"]), state

    again = run(
        lambda: reloaded_kickoff(
            shop_flow(world, RemitFlowPersistence(url)), flow_id, execution_data(flow_id, [], {})
        )
    )
    assert again.ok, again.summary()
    assert again.value["state"] == state
    assert entered(world) == {"prepare": 1, "charge": 2, "ship": 1, "notify": 1}
    assert applied(world) == {"charge": 1, "ship": 1}


def test_forks_streamed_by_astream_and_stream_events_read_after_the_token_block(
    url: str, world: Path
) -> None:
    """P3, P2: a flow SIGKILLed in `ship` before its effect is forked by `astream(
    restore_from_state_id=S)` and by `stream_events(...)`, each called inside `with
    fork_token(t)` and read after the block. Each token makes one fork (`S@fork-...`),
    the same token read again gives the same fork and runs nothing more; each fork
    ships once on its own branch and never charges again (the shared prefix's charge
    is recorded); S's head is left as it was, and S's own restart ships once."""
    source = f"order-{uuid.uuid4().hex}"

    kill_at(url, world, source, "ship.before")
    assert applied(world) == {"charge": 1}

    def forks() -> Any:
        flow_class = shop_flow(world, RemitFlowPersistence(url, lease=1.0))
        seen: list[Any] = []

        async def by_astream(token: str) -> None:
            flow = flow_class(suppress_flow_events=True)
            with fork_token(token):
                frames = flow.astream(restore_from_state_id=source)
            async for _ in frames:
                pass
            seen.append([token, flow.flow_id, flow.state.model_dump(exclude={"id"})])

        for _ in range(2):
            asyncio.run(by_astream("streamed-a"))
            flow = flow_class(suppress_flow_events=True)
            with fork_token("streamed-b"):
                frames = flow.stream_events(restore_from_state_id=source)
            for _ in frames:
                pass
            seen.append(["streamed-b", flow.flow_id, flow.state.model_dump(exclude={"id"})])
        return seen

    made = run(forks)
    assert made.ok, made.summary()
    a1, b1, a2, b2 = made.value
    assert a1[1] == a2[1] and b1[1] == b2[1] and a1[1] != b1[1], made.value
    for _, fork_id, state in made.value:
        assert fork_id.startswith(f"{source}@fork-"), fork_id
        assert state["log"] == ["prepare", "charge", "ship", "notify"], state
    assert applied(world) == {"charge": 1, "ship": 2}
    assert entered(world) == {"prepare": 1, "charge": 1, "ship": 3, "notify": 2}
    store = RemitFlowPersistence(url)
    assert store.load_state(source)["log"] == ["prepare", "charge"]

    def restarted() -> Any:
        flow = shop_flow(world, RemitFlowPersistence(url, lease=1.0))(suppress_flow_events=True)
        flow.kickoff(inputs={"id": source})
        return flow.state.model_dump(exclude={"id"})

    time.sleep(1.2)  # (the dead kickoff's lease)
    done = run(restarted)
    assert done.ok, done.summary()
    assert done.value["log"] == ["prepare", "charge", "ship", "notify"]
    assert applied(world) == {"charge": 1, "ship": 3}
    assert entered(world) == {"prepare": 1, "charge": 1, "ship": 4, "notify": 3}
