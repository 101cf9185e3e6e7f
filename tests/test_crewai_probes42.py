"""Round 42 of the CrewAI probes: a Remit-backed flow that also writes CrewAI's own
checkpoints (`crewai.state`, `CheckpointConfig`), continued from one of them with
CrewAI's `Flow.fork(config)` and `kickoff(from_checkpoint=config)`.

Probed: a fork CrewAI makes from a checkpoint gets a new flow id and the checkpoint's
completed methods, which CrewAI skips; the fork is then SIGKILLed and restarted by id
(`kickoff(inputs={"id": fork})`), or kicked off again by id once finished. Found:
before, Remit's first save of the fork recorded only the methods the fork itself ran,
so a restart ran the methods the fork had carried over from the checkpoint again: a
charge made before the checkpoint was applied a second time (under the fork's effect
keys) and the state's log got a second entry of each (P1, P2, P6); a finished fork
kicked off again ran them too. After: the first save of such a fork records the
carried methods as completed, as often as the checkpoint counted them, and a restart
replays them. Held: the fork's own first run runs only what follows the checkpoint and
applies no effect of the shared past again; a crashed flow continued with
`kickoff(from_checkpoint=...)` of its latest checkpoint runs again only what was in
flight. Written from the contract and CrewAI's public API, against real CrewAI flows
in forked children SIGKILLed mid-step, with the helpers of `test_crewai_flows`, on
every engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crewai_parts import sink_effect
from test_crewai_flows import applied, entered, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence

TRIES = 3000  # (a bound on the restarts refused while a dead claim's lease runs out)
STEPS = ["prepare", "pack", "charge", "ship", "notify"]


def tally_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> pack -> charge (effect "charge") -> ship -> notify (effect "notify"),
    a model state whose `log` each step appends its name to; a one-second lease.
    Built in a child."""
    from crewai.events.event_bus import crewai_event_bus
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    charge, notify = sink_effect(sink, "charge"), sink_effect(sink, "notify")

    class Tally(BaseModel):
        log: list[str] = Field(default_factory=list)
        receipt: str | None = None

    @persist(RemitFlowPersistence(url, lease=1.0))
    class TallyFlow(Flow[Tally]):  # type: ignore[misc]
        _skip_auto_memory = True

        def _step(self, name: str) -> None:
            # CrewAI writes its checkpoints in event handlers, beside the steps: the one
            # after the previous method is written before this step changes the state.
            crewai_event_bus.flush()
            journal.record("enter", name)
            point(at, f"{name}.before")
            self.state.log.append(name)

        @start()
        def prepare(self) -> None:
            self._step("prepare")

        @listen(prepare)
        def pack(self) -> None:
            self._step("pack")

        @listen(pack)
        def charge(self) -> None:
            self._step("charge")
            self.state.receipt = charge()

        @listen(charge)
        def ship(self) -> None:
            self._step("ship")

        @listen(ship)
        def notify(self) -> None:
            self._step("notify")
            notify()

    return TallyFlow


def checkpointing(where: Path) -> Any:
    """CrewAI's checkpoint settings: a JSON checkpoint after each method that finished."""
    from crewai.state.checkpoint_config import CheckpointConfig

    return CheckpointConfig(location=str(where), on_events=["method_execution_finished"])


def checkpoint_after(where: Path, completed: set[str]) -> Path:
    """The checkpoint file in `where` written once exactly `completed` had completed."""
    for path in sorted(where.rglob("*.json")):
        for entity in json.loads(path.read_text())["entities"]:
            if set(entity.get("checkpoint_completed_methods") or ()) == completed:
                return path
    raise AssertionError(f"no checkpoint after {sorted(completed)} in {where}")


def kicked_off_with_checkpoints(url: str, world: Path, where: Path, **points: str) -> Any:
    """Kick a tally flow off, writing CrewAI checkpoints to `where` (in a child)."""

    def go() -> dict[str, Any]:
        from crewai.events.event_bus import crewai_event_bus

        flow = tally_flow(url, world, points=points)(checkpoint=checkpointing(where))
        try:
            flow.kickoff()
        except BaseException as exc:  # (pyo3's PanicException is no Exception)
            # CrewAI serializes its event record for a checkpoint while its event bus
            # still appends to it; once in a while the last checkpoint's write fails
            # so ("dictionary changed size during iteration"), after every step ran.
            # That is CrewAI's own race, not the flow's: the checkpoints asked for exist.
            raced = "dictionary changed size during iteration" in str(exc)
            if not (raced and flow.state.log == STEPS):
                raise
        crewai_event_bus.flush()
        return {"id": flow.flow_id, "state": flow.state.model_dump()}

    return run(go)


def restarted(url: str, world: Path, flow_id: str) -> Any:
    """`kickoff(inputs={"id": flow_id})` in a child, again while the claim of a killed
    run is still alive (`ResumeConflict`, until its lease runs out)."""

    def go() -> dict[str, Any]:
        from remit_core import ResumeConflict

        for _ in range(TRIES):
            flow = tally_flow(url, world)(suppress_flow_events=True)
            try:
                flow.kickoff(inputs={"id": flow_id})
            except ResumeConflict:
                continue
            return flow.state.model_dump()
        raise AssertionError("the killed run's claim never lapsed")

    return run(go)


def test_a_crewai_fork_restarted_after_a_crash_does_not_run_its_carried_past_again(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1, P2, P6: `Flow.fork` from the checkpoint written after `charge`; the fork runs
    `ship` (saved) and is SIGKILLed in `notify`. Its restart by id enters only `notify`
    again: `prepare`, `pack` and `charge` were carried over from the checkpoint and are
    not run again, the charge is not applied a second time, and the state ends as an
    uninterrupted run of the fork ends."""
    where = tmp_path / "checkpoints"
    first = kicked_off_with_checkpoints(url, world, where)
    assert first.ok, first.summary()
    source = checkpoint_after(where, {"prepare", "pack", "charge"})
    forked_id = tmp_path / "fork-id"

    def fork_and_die() -> None:
        from crewai.state.checkpoint_config import CheckpointConfig

        cls = tally_flow(url, world, points={"notify.before": "kill"})
        flow = cls.fork(CheckpointConfig(restore_from=str(source)), branch="again")
        forked_id.write_text(flow.flow_id)
        flow.kickoff()

    died = run(fork_and_die)
    assert died.status == "killed", died.summary()
    assert entered(world) == {"prepare": 1, "pack": 1, "charge": 1, "ship": 2, "notify": 2}
    assert applied(world) == {"charge": 1, "notify": 1}

    done = restarted(url, world, forked_id.read_text())
    assert done.ok, done.summary()
    assert entered(world) == {"prepare": 1, "pack": 1, "charge": 1, "ship": 2, "notify": 3}
    assert applied(world) == {"charge": 1, "notify": 2}  # the fork's own notify, once
    assert done.value["log"] == STEPS
    assert done.value["receipt"] == first.value["state"]["receipt"]
    # The source flow is untouched by its fork.
    assert (
        RemitFlowPersistence(url).load_state(first.value["id"])["log"]
        == first.value["state"]["log"]
    )


def test_a_crewai_fork_runs_only_what_follows_its_checkpoint(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1, P2: `Flow.fork` from the checkpoint written after `pack`, not killed: it runs
    `charge`, `ship` and `notify` under its own id (a fork's own effects), never
    `prepare` or `pack`; kicked off again by id, the finished fork runs nothing."""
    where = tmp_path / "checkpoints"
    first = kicked_off_with_checkpoints(url, world, where)
    assert first.ok, first.summary()
    source = checkpoint_after(where, {"prepare", "pack"})

    def fork() -> dict[str, Any]:
        from crewai.state.checkpoint_config import CheckpointConfig

        cls = tally_flow(url, world)
        flow = cls.fork(CheckpointConfig(restore_from=str(source)), branch="again")
        flow.kickoff()
        return {"id": flow.flow_id, "state": flow.state.model_dump()}

    forked = run(fork)
    assert forked.ok, forked.summary()
    assert forked.value["id"] != first.value["id"]
    assert forked.value["state"]["log"] == STEPS
    assert entered(world) == {"prepare": 1, "pack": 1, "charge": 2, "ship": 2, "notify": 2}
    assert applied(world) == {"charge": 2, "notify": 2}
    again = restarted(url, world, forked.value["id"])
    assert again.ok and again.value == forked.value["state"], again.summary()
    assert entered(world) == {"prepare": 1, "pack": 1, "charge": 2, "ship": 2, "notify": 2}
    assert applied(world) == {"charge": 2, "notify": 2}


def test_a_crashed_flow_continued_from_its_latest_crewai_checkpoint_runs_the_rest_once(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1, P2: a flow SIGKILLed in `ship`, continued with `kickoff(from_checkpoint=...)`
    of the checkpoint CrewAI wrote after `charge` (its latest): only `ship` runs again,
    then `notify`; the charge is applied once and the log holds each step once."""
    where = tmp_path / "checkpoints"
    died = kicked_off_with_checkpoints(url, world, where, **{"ship.before": "kill"})
    assert died.status == "killed", died.summary()
    source = checkpoint_after(where, {"prepare", "pack", "charge"})

    def go_on() -> dict[str, Any]:
        from crewai.state.checkpoint_config import CheckpointConfig

        from remit_core import ResumeConflict

        for _ in range(TRIES):
            # (what `kickoff(from_checkpoint=...)` runs, on an instance this can read)
            flow = tally_flow(url, world).from_checkpoint(
                CheckpointConfig(restore_from=str(source))
            )
            try:
                flow.kickoff()
            except ResumeConflict:
                continue
            return {"id": flow.flow_id, "state": flow.state.model_dump()}
        raise AssertionError("the killed run's claim never lapsed")

    done = run(go_on)
    assert done.ok, done.summary()
    assert entered(world) == {"prepare": 1, "pack": 1, "charge": 1, "ship": 2, "notify": 1}
    assert applied(world) == {"charge": 1, "notify": 1}
    assert done.value["state"]["log"] == STEPS
