"""The conformance probe on pydantic-graph 1.x: `FileStatePersistence` (vanilla) and Remit.

The probe is written the way pydantic-graph's human-in-the-loop docs write
one: the driver stops when the next node is `AwaitApproval` (the pause), and
the answer arrives later as the node that follows it, `Approve(value)`.
Vanilla follows the docs to the letter (`load_next()`, then
`graph.iter(Approve(value), state=snapshot.state)`; a fresh run when
`load_next()` finds nothing). Remit delivers the answer with
`RemitStatePersistence.resume(Approve(value))` and continues with
`iter_from_persistence`. Nodes get the probe's `ProbeEnv` as the graph's deps.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph, GraphRun
from pydantic_graph.persistence import (
    BaseStatePersistence,
    EndSnapshot,
    NodeSnapshot,
    Snapshot,
)
from pydantic_graph.persistence.file import FileStatePersistence

from remit_core.conformance.adapter import (
    CheckpointRef,
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    ProbeState,
    ResumeValue,
    RunResult,
    Target,
    initial_state,
)
from remit_core.conformance.adapter import Snapshot as ProbeSnapshot
from remit_core.conformance.storage import (
    copy_remit_run,
    corrupt_remit_checkpoint,
    flip_middle_byte,
)
from remit_core.core import Remit
from remit_pydantic_graph.persistence import RemitStatePersistence

Ctx = GraphRunContext[ProbeState, ProbeEnv]


@dataclass
class Prepare(BaseNode[ProbeState, ProbeEnv, str]):
    async def run(self, ctx: Ctx) -> AwaitApproval:
        ctx.deps.enter("prepare")
        ctx.state["amount"] = -5 if ctx.deps.variant.invalid_step_write else 100
        ctx.state["log"].append("prepare")
        return AwaitApproval()


@dataclass
class AwaitApproval(BaseNode[ProbeState, ProbeEnv, str]):
    """The pause: the driver stops before this node; the answer replaces it."""

    first: str | None = None

    async def run(self, ctx: Ctx) -> Approve:
        raise RuntimeError("approve waits for a resume value: deliver it as Approve(value)")


@dataclass
class Approve(BaseNode[ProbeState, ProbeEnv, str]):
    value: ResumeValue
    first: str | None = None

    async def run(self, ctx: Ctx) -> AwaitApproval | Charge:
        env = ctx.deps
        if env.variant.multi_interrupt and self.first is None:
            return AwaitApproval(first=self.value)  # ask a second time
        env.enter("approve")
        env.point("resume.after_accept")
        ctx.state["approved_by"] = (
            self.value if self.first is None else f"{self.first}+{self.value}"
        )
        ctx.state["log"].append("approve")
        return Charge()


@dataclass
class Charge(BaseNode[ProbeState, ProbeEnv, str]):
    async def run(self, ctx: Ctx) -> Notify:
        env = ctx.deps
        env.enter("charge")
        env.point("charge.before_effect")
        await env.aeffect("charge")
        env.point("charge.after_effect")
        ctx.state["charged"] = True
        ctx.state["log"].append("charge")
        return Notify()


@dataclass
class Notify(BaseNode[ProbeState, ProbeEnv, str]):
    async def run(self, ctx: Ctx) -> End[str]:
        env = ctx.deps
        env.enter("notify")
        env.point("notify.before_effect")
        await env.aeffect("notify")
        ctx.state["log"].append("notify")
        return End("done")


GRAPH = Graph(nodes=(Prepare, AwaitApproval, Approve, Charge, Notify), name="probe")
STEP_OF = {
    Prepare: "prepare",
    AwaitApproval: "approve",
    Approve: "approve",
    Charge: "charge",
    Notify: "notify",
}


class _ChargeStepPoint:
    """Hits `charge.after_step` once charge's completion is stored, before what follows it.

    FileStatePersistence completes a node with its `success`, stored when its
    body returns, and stores the next snapshot in a later write: the point
    sits between the two. Remit also stores `success` then, but a node is
    completed only by the commit that appends the next snapshot (until then,
    one whose process died runs again), so charge's completion is stored
    right after that commit.
    """

    env: ProbeEnv
    completion_with_next_snapshot = False

    async def snapshot_node(self, state: Any, next_node: BaseNode[Any, Any, Any]) -> None:
        after_charge = isinstance(next_node, Notify)
        if after_charge and not self.completion_with_next_snapshot:
            self.env.point("charge.after_step")
        await super().snapshot_node(state, next_node)  # type: ignore[misc]
        if after_charge and self.completion_with_next_snapshot:
            self.env.point("charge.after_step")


class _RemitProbePersistence(_ChargeStepPoint, RemitStatePersistence[Any, Any]):
    completion_with_next_snapshot = True


class _FileProbePersistence(_ChargeStepPoint, FileStatePersistence[Any, Any]):
    pass


def _next_steps(snapshot: Snapshot[Any, Any]) -> tuple[str, ...]:
    return (STEP_OF[type(snapshot.node)],) if isinstance(snapshot, NodeSnapshot) else ()


def _snapshot_of(snapshots: list[Snapshot[Any, Any]]) -> ProbeSnapshot:
    head = snapshots[-1] if snapshots else None
    return ProbeSnapshot(
        state=None if head is None else dict(head.state),
        head=None if head is None else head.id,
        branches=0,
        checkpoints=[CheckpointRef(s.id, _next_steps(s)) for s in reversed(snapshots)],
    )


async def _drive(run: GraphRun[Any, Any, Any], *, first_step: bool = False) -> RunResult:
    """Run until the pause or the end. `first_step`: run the start node even if it is the pause."""
    if first_step:
        await run.next()
    async for node in run:
        if isinstance(node, AwaitApproval):
            return RunResult("paused", dict(run.state))
    return RunResult("done", dict(run.state))


class _Session(ProbeSession):
    """What both targets share: starting, continuing and replaying the probe."""

    def __init__(self, target: Target, env: ProbeEnv) -> None:
        self.target, self.env = target, env

    @abstractmethod
    def _persistence(self, run: str, branch: str | None = None) -> BaseStatePersistence[Any, Any]:
        """The target's persistence for `run` (on the line `branch` names, if any)."""

    async def _continue(self, p: BaseStatePersistence[Any, Any]) -> RunResult:
        """Go on from the stored head: the end, the pause, or the node a crash left behind."""
        p.set_graph_types(GRAPH)
        snapshots = await p.load_all()
        if snapshots and isinstance(snapshots[-1], EndSnapshot):
            return RunResult("done", dict(snapshots[-1].state))
        async with GRAPH.iter_from_persistence(p, deps=self.env) as run:
            return await _drive(run)

    def start(self, run: str) -> RunResult:
        async def go() -> RunResult:
            p = self._persistence(run)
            async with GRAPH.iter(
                Prepare(), state=initial_state(), deps=self.env, persistence=p
            ) as r:
                return await _drive(r)

        return asyncio.run(go())

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        return asyncio.run(self._continue(self._persistence(run, branch)))

    def _stored(self, run: str, branch: str | None = None) -> list[Snapshot[Any, Any]]:
        p = self._persistence(run, branch)
        p.set_graph_types(GRAPH)
        return asyncio.run(p.load_all())

    async def _replay(self, p: BaseStatePersistence[Any, Any], checkpoint: str) -> RunResult:
        """What a user does to go back: run the stored snapshot's node from its state again."""
        p.set_graph_types(GRAPH)
        old = next((s for s in await p.load_all() if s.id == checkpoint), None)
        if not isinstance(old, NodeSnapshot):
            raise LookupError(f"no node snapshot {checkpoint!r} to continue from")
        async with GRAPH.iter(old.node, state=old.state, deps=self.env, persistence=p) as r:
            return await _drive(r, first_step=True)


class RemitSession(_Session):
    """The probe on `RemitStatePersistence`."""

    def __init__(self, target: Target, env: ProbeEnv) -> None:
        super().__init__(target, env)
        self.remit = Remit(target.url, lease=env.lease)

    def _persistence(self, run: str, branch: str | None = None) -> _RemitProbePersistence:
        p = _RemitProbePersistence(
            self.remit,
            run,
            fork_token=branch,
            lease=self.env.lease,
            workflow_version=self.env.variant.workflow_version,
        )
        p.env = self.env
        return p

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        async def go() -> RunResult:
            p = self._persistence(run, branch)
            try:
                p.set_graph_types(GRAPH)
                pause = await p.paused()
                first = (
                    pause.node.first if pause and isinstance(pause.node, AwaitApproval) else None
                )
                await p.resume(Approve(value=value, first=first))
                return await self._continue(p)
            finally:
                p.release()

        return asyncio.run(go())

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        p = self._persistence(run, branch)
        try:
            return asyncio.run(self._continue(p))
        finally:
            p.release()

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        async def go() -> RunResult:
            p = self._persistence(run)
            p.set_graph_types(GRAPH)
            if token is None:
                try:
                    return await self._replay(p, checkpoint)
                finally:
                    p.release()
            forked = await p.fork(checkpoint, token)
            try:
                result = await self._continue(forked)
            finally:
                forked.release()
            return replace(result, branch=token)

        return asyncio.run(go())

    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        async def go() -> None:
            p = self._persistence(run)
            p.set_graph_types(GRAPH)
            snapshots = await p.load_all()
            await p.update_state({**snapshots[-1].state, **patch})

        asyncio.run(go())

    def corrupt_head(self, run: str) -> str:
        head = self._stored(run)[-1]
        corrupt_remit_checkpoint(self.target, run, head.id)
        return head.id

    def inspect(self, run: str, *, branch: str | None = None) -> ProbeSnapshot:
        async def go() -> ProbeSnapshot:
            p = self._persistence(run, branch)
            p.set_graph_types(GRAPH)
            snap = _snapshot_of(await p.load_all())
            snap.branches = len(self.remit.branches(p.run_id))
            snap.pending_interrupts = int(await p.paused() is not None)
            snap.resume_values = [
                json.loads(i.value)["node"]["value"]
                for i in self.remit.interrupts(p.run_id)
                if i.value is not None
            ]
            return snap

        return asyncio.run(go())

    def copy_store(self, run: str, dest: Target) -> None:
        copy_remit_run(self.target, dest, run)


class FileSession(_Session):
    """The probe on pydantic-graph's own durable backend, used as its docs show."""

    def _path(self, run: str, target: Target | None = None) -> Path:
        return (target or self.target).folder / f"{run}.json"

    def _persistence(self, run: str, branch: str | None = None) -> _FileProbePersistence:
        p = _FileProbePersistence(self._path(run))
        p.env = self.env
        return p

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        async def go() -> RunResult:
            p = self._persistence(run)
            p.set_graph_types(GRAPH)
            start: BaseNode[ProbeState, ProbeEnv, str]
            if snapshot := await p.load_next():
                node = snapshot.node
                first = node.first if isinstance(node, AwaitApproval) else None
                state, start = snapshot.state, Approve(value, first)
            else:  # as in the docs: nothing to answer, so this is a new run
                state, start = initial_state(), Prepare()
            async with GRAPH.iter(start, state=state, deps=self.env, persistence=p) as r:
                return await _drive(r)

        return asyncio.run(go())

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        result = asyncio.run(self._replay(self._persistence(run), checkpoint))
        return replace(result, branch=None)

    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        async def go() -> None:
            p = self._persistence(run)
            p.set_graph_types(GRAPH)
            head = (await p.load_all())[-1]
            assert isinstance(head, NodeSnapshot)
            edited: ProbeState = {**head.state, **patch}  # type: ignore[typeddict-item]
            await GRAPH.initialize(head.node.deep_copy(), p, state=edited)

        asyncio.run(go())

    def corrupt_head(self, run: str) -> str:
        path = self._path(run)
        head = self._stored(run)[-1]
        data = path.read_bytes()
        at = data.rindex(b'"state"')  # the head is the file's last snapshot
        path.write_bytes(data[:at] + flip_middle_byte(data[at:]))
        return head.id

    def inspect(self, run: str, *, branch: str | None = None) -> ProbeSnapshot:
        snapshots = self._stored(run)
        snap = _snapshot_of(snapshots)
        snap.branches = 1 if snapshots else 0
        snap.pending_interrupts = sum(
            isinstance(s, NodeSnapshot)
            and isinstance(s.node, AwaitApproval)
            and s.status == "created"
            for s in snapshots
        )
        snap.resume_values = [
            s.node.value
            for s in snapshots
            if isinstance(s, NodeSnapshot) and isinstance(s.node, Approve)
        ]
        return snap

    def copy_store(self, run: str, dest: Target) -> None:
        dest.folder.mkdir(parents=True, exist_ok=True)
        if self._path(run).exists():
            shutil.copyfile(self._path(run), self._path(run, dest))


class PydanticGraphProbe(ProbeAdapter):
    """pydantic-graph 1.x: `FileStatePersistence` against `RemitStatePersistence`."""

    framework = "pydantic-graph"

    def describe(self, target: Target) -> str:
        if target.kind == "vanilla":
            return "pydantic-graph FileStatePersistence"
        return f"Remit ({target.engine})"

    def unsupported(self, target: Target) -> str | None:
        if target.kind == "vanilla" and not target.is_local:
            return "pydantic-graph 1.x ships only file and in-memory persistence"
        return None

    def session(self, target: Target, env: ProbeEnv) -> ProbeSession:
        return FileSession(target, env) if target.kind == "vanilla" else RemitSession(target, env)


adapter = PydanticGraphProbe()
