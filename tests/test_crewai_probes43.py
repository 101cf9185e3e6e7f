"""Round 43 of the CrewAI probes: `kickoff(from_checkpoint=...)` of one of CrewAI's own
checkpoints (`CheckpointConfig`) of a flow Remit already has checkpoints of.

Probed: a finished flow continued from an older CrewAI checkpoint (the one written after
`pack`), without and with a `fork_token`, and from its latest one. Found: before, without a
token the kickoff silently continued from Remit's head (ran nothing and dropped the
checkpoint's older state, where CrewAI's own backend runs again from it); with a token it
ran `charge`, `ship` and `notify` again under the flow's own id, on its main line: the
charge was applied a second time and the flow's head went back to a log of the checkpoint's
steps plus the new ones, a second history grown silently on one branch (P1, P2, P3). After:
without a token the kickoff is refused with `ForkWithoutIntent` naming what to do, before
anything runs or is claimed, and the flow is free; with a token it is the token's fork from
Remit's checkpoint where the same methods had completed, the original head intact, and the
same token continues the same fork, running nothing again. Held: the latest checkpoint
continues the flow (a finished flow runs nothing). Written from the contract and CrewAI's
public API, against real CrewAI flows in forked children, with the helpers of
`test_crewai_probes42`, on every engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_crewai_flows import applied, entered, run
from test_crewai_probes42 import checkpoint_after, kicked_off_with_checkpoints, tally_flow

from remit_crewai import RemitFlowPersistence, fork_token

EVERY_STEP = {"prepare": 1, "pack": 1, "charge": 1, "ship": 1, "notify": 1}


def continued_from(url: str, world: Path, source: Path, token: str | None = None) -> Any:
    """`kickoff(from_checkpoint=...)` of CrewAI checkpoint `source` on a new instance of the
    tally flow, inside `fork_token(token)` if given (in a child)."""

    def go() -> None:
        import contextlib

        from crewai.state.checkpoint_config import CheckpointConfig

        flow = tally_flow(url, world)(suppress_flow_events=True)
        config = CheckpointConfig(restore_from=str(source))
        with fork_token(token) if token is not None else contextlib.nullcontext():
            flow.kickoff(from_checkpoint=config)

    return run(go)


def finished_past_pack(
    url: str, world: Path, tmp_path: Path
) -> tuple[Any, Path, RemitFlowPersistence, list[str]]:
    """A tally flow run to its end with CrewAI checkpoints on: its outcome, the CrewAI
    checkpoint written after `pack`, a store, and the flow's Remit checkpoint ids."""
    where = tmp_path / "checkpoints"
    first = kicked_off_with_checkpoints(url, world, where)
    assert first.ok, first.summary()
    store = RemitFlowPersistence(url)
    before = [c.checkpoint_id for c in store.checkpoints(first.value["id"])]
    return first, checkpoint_after(where, {"prepare", "pack"}), store, before


def test_an_older_crewai_checkpoint_without_a_token_is_refused_and_runs_nothing(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P3, P1: continuing a finished flow from the CrewAI checkpoint written after `pack`
    is time travel: `ForkWithoutIntent` naming the way on, nothing entered or applied again,
    the head as it was, and the flow free: a kickoff by id right after runs nothing."""
    first, source, store, before = finished_past_pack(url, world, tmp_path)
    flow_id = first.value["id"]

    refused = continued_from(url, world, source)
    assert refused.status == "error", refused.summary()
    assert refused.error["class"] == "ForkWithoutIntent", refused.summary()
    assert "fork_token" in refused.error["message"] and flow_id in refused.error["message"]
    assert entered(world) == EVERY_STEP
    assert applied(world) == {"charge": 1, "notify": 1}
    assert [c.checkpoint_id for c in store.checkpoints(flow_id)] == before
    assert store.load_state(flow_id) == first.value["state"]

    def again() -> dict[str, Any]:
        flow = tally_flow(url, world)(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return dict(flow.state.model_dump())

    restarted = run(again)
    assert restarted.ok and restarted.value == first.value["state"], restarted.summary()
    assert entered(world) == EVERY_STEP


def test_an_older_crewai_checkpoint_with_a_token_is_one_fork_and_leaves_the_flow(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P3, P2: inside `fork_token("again")`, continuing from the checkpoint written after
    `pack` makes the token's fork: `charge`, `ship`, `notify` run once on it (the fork's own
    effects), never `prepare` or `pack`; the flow's own line and head are untouched. The same
    token presented again continues the same fork, which has finished: nothing runs."""
    first, source, store, before = finished_past_pack(url, world, tmp_path)
    flow_id = first.value["id"]

    done = continued_from(url, world, source, "again")
    assert done.ok, done.summary()
    assert entered(world) == {"prepare": 1, "pack": 1, "charge": 2, "ship": 2, "notify": 2}
    assert applied(world) == {"charge": 2, "notify": 2}
    assert [c.checkpoint_id for c in store.checkpoints(flow_id)] == before
    assert store.load_state(flow_id) == first.value["state"]
    # The token's fork, made from the checkpoint saved after `pack` (newest first).
    forked = store.fork(flow_id, fork_token="again", checkpoint_id=before[3])
    fork_state = store.load_state(forked)
    assert fork_state is not None
    assert fork_state["log"] == ["prepare", "pack", "charge", "ship", "notify"]
    assert fork_state["receipt"] != first.value["state"]["receipt"]  # the fork's own charge

    again = continued_from(url, world, source, "again")
    assert again.ok, again.summary()
    assert entered(world) == {"prepare": 1, "pack": 1, "charge": 2, "ship": 2, "notify": 2}
    assert applied(world) == {"charge": 2, "notify": 2}
    assert store.load_state(forked) == fork_state


def test_the_latest_crewai_checkpoint_continues_the_flow_without_a_token(
    url: str, tmp_path: Path
) -> None:
    """P1 (held): the checkpoint CrewAI wrote after the last step is the flow's head:
    `kickoff(from_checkpoint=...)` of it is no fork, runs nothing and applies nothing."""
    for attempt in range(3):
        # CrewAI serializes its event record for a checkpoint while its event bus still
        # appends to it: once in a while the last checkpoint's write fails (see
        # `kicked_off_with_checkpoints`). That is CrewAI's own race: run the flow again,
        # in a world and a folder of its own, until its last checkpoint was written.
        world = tmp_path / f"world{attempt}.db"
        where = tmp_path / f"checkpoints{attempt}"
        first = kicked_off_with_checkpoints(url, world, where)
        assert first.ok, first.summary()
        try:
            source = checkpoint_after(where, set(EVERY_STEP))
            break
        except AssertionError:
            if attempt == 2:
                raise
    done = continued_from(url, world, source)
    assert done.ok, done.summary()
    assert RemitFlowPersistence(url).load_state(first.value["id"]) == first.value["state"]
    assert entered(world) == EVERY_STEP
    assert applied(world) == {"charge": 1, "notify": 1}
