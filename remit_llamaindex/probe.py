"""The contract's probe workflow in LlamaIndex Workflows, on Remit and on vanilla snapshots.

One `ProbeFlow` serves both targets: the workflow code is the same, only the
runtime differs. On Remit it runs on `RemitRuntime`; on vanilla it runs on the
framework's own asyncio runtime and persists the way the framework documents:
`handler.ctx.to_dict()` saved when the run pauses and when it ends, restored
with `Context.from_dict` (snapshot files in the target's folder; LlamaIndex
core has no database backend of its own).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)
from workflows.handler import WorkflowHandler
from workflows.plugins.basic import BasicRuntime
from workflows.runtime.runtime_decorators import (
    BaseInternalRunAdapterDecorator,
    BaseRuntimeDecorator,
)
from workflows.runtime.types.plugin import InternalRunAdapter, Runtime
from workflows.runtime.types.results import StepWorkerResult
from workflows.runtime.types.ticks import TickStepResult, WorkflowTick

from remit_core.conformance.adapter import (
    CheckpointRef,
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    RunResult,
    RunStatus,
    Snapshot,
    Target,
    initial_state,
)
from remit_core.conformance.storage import copy_remit_run, corrupt_remit_checkpoint
from remit_core.records import MAIN_BRANCH
from remit_llamaindex import _snapshot as snap
from remit_llamaindex._run import split_run_id
from remit_llamaindex.runtime import RemitRuntime


class OrderState(BaseModel):
    """The probe's state (`remit_core.conformance.adapter.ProbeState` as a model)."""

    order_id: str = ""
    amount: int = Field(default=0, ge=0)
    approved_by: str | None = None
    charged: bool = False
    log: list[str] = Field(default_factory=list)


class OrderStart(StartEvent):
    order_id: str
    amount: int
    approved_by: str | None = None
    charged: bool = False
    log: list[str] = Field(default_factory=list)


class Prepared(Event):
    pass


class AskAgain(Event):
    """MULTI-INTERRUPT: the first answer, carried to approve's second question."""

    first: str


class Approved(Event):
    pass


class Charged(Event):
    pass


class ApprovalRequest(InputRequiredEvent):
    pass


class Approval(HumanResponseEvent):
    """The resume value: a non-empty str (`ResumeValue`)."""

    response: str = Field(min_length=1)


class ProbeFlow(Workflow):
    """prepare -> approve (waits for `Approval`) -> charge -> notify."""

    def __init__(self, env: ProbeEnv, **kwargs: Any) -> None:
        super().__init__(timeout=None, **kwargs)
        self.env = env

    @step
    async def prepare(self, ctx: Context[OrderState], ev: OrderStart) -> Prepared:
        self.env.enter("prepare")
        async with ctx.store.edit_state() as state:
            state.order_id = ev.order_id
            state.amount = -5 if self.env.variant.invalid_step_write else 100
            state.log = [*state.log, "prepare"]
        return Prepared()

    @step
    async def approve(
        self, ctx: Context[OrderState], ev: Prepared | AskAgain
    ) -> Approved | AskAgain:
        answer = await ctx.wait_for_event(
            Approval,
            # An event takes fields it does not declare (the framework's `prefix` here).
            waiter_event=ApprovalRequest(prefix="approve?"),  # type: ignore[call-arg]
            timeout=None,
        )
        value = answer.response
        if isinstance(ev, AskAgain):
            value = f"{ev.first}+{value}"
        elif self.env.variant.multi_interrupt:
            return AskAgain(first=value)
        self.env.enter("approve")
        self.env.point("resume.after_accept")
        async with ctx.store.edit_state() as state:
            state.approved_by = value
            state.log = [*state.log, "approve"]
        return Approved()

    @step
    async def charge(self, ctx: Context[OrderState], ev: Approved) -> Charged:
        self.env.enter("charge")
        self.env.point("charge.before_effect")
        await self.env.aeffect("charge")
        self.env.point("charge.after_effect")
        async with ctx.store.edit_state() as state:
            state.charged = True
            state.log = [*state.log, "charge"]
        return Charged()

    @step
    async def notify(self, ctx: Context[OrderState], ev: Charged) -> StopEvent:
        self.env.enter("notify")
        self.env.point("notify.before_effect")
        await self.env.aeffect("notify")
        async with ctx.store.edit_state() as state:
            state.log = [*state.log, "notify"]
        return StopEvent(result="done")


class _AfterStep(BaseInternalRunAdapterDecorator):
    """Hits `charge.after_step` once charge's completion tick reached the backend."""

    def __init__(self, decorated: InternalRunAdapter, env: ProbeEnv) -> None:
        super().__init__(decorated)
        self._env = env

    async def on_tick(self, tick: WorkflowTick) -> None:
        await super().on_tick(tick)
        if (
            isinstance(tick, TickStepResult)
            and str(tick.step_id) == "charge"
            and any(isinstance(r, StepWorkerResult) for r in tick.result)
        ):
            self._env.point("charge.after_step")


class _Points(BaseRuntimeDecorator):
    def __init__(self, decorated: Runtime, env: ProbeEnv) -> None:
        super().__init__(decorated)
        self._env = env

    def get_internal_adapter(self, workflow: Workflow) -> InternalRunAdapter:
        return _AfterStep(self._decorated.get_internal_adapter(workflow), self._env)


def _approval(value: Any) -> Approval:
    """The event a user sends. An invalid value is assigned after construction (pydantic
    does not validate assignment), as a value that slipped past the model, so that the
    backend, not the event's constructor, decides whether to accept it."""
    if isinstance(value, str) and value:
        return Approval(response=value)
    event = Approval(response="unset")
    event.response = value
    return event


async def _settle(handler: WorkflowHandler) -> str:
    """Run until the workflow pauses for approval ("paused") or ends ("done")."""

    async def paused() -> bool:
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                return True
        return False  # the stream ended: the run did

    watch = asyncio.ensure_future(paused())
    result = asyncio.ensure_future(handler.stop_event_result())
    done, _ = await asyncio.wait({watch, result}, return_when=asyncio.FIRST_COMPLETED)
    if result in done or not watch.result():
        watch.cancel()
        await result
        return "done"
    return "paused"


def _plain(state: BaseModel | dict[str, Any]) -> dict[str, Any]:
    data = state.model_dump(mode="json") if isinstance(state, BaseModel) else dict(state)
    return {k: data.get(k) for k in OrderState.model_fields}


# -- Remit ----------------------------------------------------------------------------


class RemitProbe(ProbeSession):
    """The probe on `RemitRuntime`; a fork's runs are "<run>@<branch>"."""

    def __init__(self, target: Target, env: ProbeEnv) -> None:
        self.target, self.env = target, env
        self.rt = RemitRuntime(
            target.url, lease=env.lease, workflow_version=env.variant.workflow_version
        )

    def _run(self, run: str, branch: str | None = None) -> str:
        return run if branch is None or branch == MAIN_BRANCH else f"{run}@{branch}"

    def _flow(self) -> ProbeFlow:
        return ProbeFlow(self.env, runtime=_Points(self.rt, self.env))

    def _result(self, key: str, status: str) -> RunResult:
        state = self.rt.get_state(self._flow(), key)
        return RunResult(status, _plain(state), split_run_id(key)[1])  # type: ignore[arg-type]

    def start(self, run: str) -> RunResult:
        async def go() -> RunResult:
            handler = self._flow().run(
                run_id=self._run(run), start_event=OrderStart(**initial_state())
            )
            return self._result(self._run(run), await _settle(handler))

        return asyncio.run(go())

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        async def go() -> RunResult:
            key = self._run(run, branch)
            handler = await self.rt.respond(self._flow(), key, _approval(value))
            return self._result(key, await _settle(handler))

        return asyncio.run(go())

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        return self._continue(self._run(run, branch))

    def _continue(self, key: str) -> RunResult:
        async def go() -> RunResult:
            handler = self.rt.recover(self._flow(), key)
            if handler is not None:
                return self._result(key, await _settle(handler))
            status = self.rt.status(key)
            return self._result(
                key,
                "paused"
                if status == snap.WAITING
                else ("done" if status == snap.COMPLETED else "other"),
            )

        return asyncio.run(go())

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        if token is not None:
            return self._continue(self.rt.fork(self._run(run), checkpoint, token))

        async def go() -> RunResult:
            flow = self._flow()
            ctx = self.rt.context(flow, self._run(run), checkpoint_id=checkpoint)
            return self._result(self._run(run), await _settle(flow.run(ctx=ctx)))

        return asyncio.run(go())

    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        asyncio.run(self.rt.update_state(self._flow(), self._run(run), patch))

    def corrupt_head(self, run: str) -> str:
        head = self.rt.remit.branch(run)
        assert head is not None and head.head_id is not None
        corrupt_remit_checkpoint(self.target, run, head.head_id)
        return head.head_id

    def inspect(self, run: str, *, branch: str | None = None) -> Snapshot:
        key = self._run(run, branch)
        remit_run, branch_name = split_run_id(key)
        head = self.rt.remit.branch(remit_run, branch=branch_name)
        if head is None:
            return Snapshot(state=None, head=None, branches=0)
        interrupts = self.rt.remit.interrupts(remit_run)
        return Snapshot(
            state=_plain(self.rt.get_state(self._flow(), key)),
            head=head.head_id,
            branches=len(self.rt.remit.branches(remit_run, ns="")),
            checkpoints=[
                CheckpointRef(c.checkpoint_id, c.next_steps)
                for c in self.rt.checkpoints(remit_run)
                if c.branch == branch_name
            ],
            pending_interrupts=sum(
                1 for i in interrupts if i.branch == branch_name and i.status == "pending"
            ),
            resume_values=[
                json.loads(i.value.decode())["value"]["response"]
                for i in interrupts
                if i.value is not None
            ],
        )

    def copy_store(self, run: str, dest: Target) -> None:
        copy_remit_run(self.target, dest, run)


# -- vanilla: context snapshots in files --------------------------------------------------


class VanillaProbe(ProbeSession):
    """The documented pattern: `ctx.to_dict()` at each pause and at the end, one file per run.

    Each saved snapshot is appended to `<folder>/runs/<run>.jsonl` with the
    snapshot it was restored from as its parent, so `inspect` can list them.
    """

    def __init__(self, target: Target, env: ProbeEnv) -> None:
        self.target, self.env = target, env
        self.runtime = BasicRuntime()

    def _file(self, run: str, folder: Path | None = None) -> Path:
        path = (folder or self.target.folder) / "runs" / f"{run}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _snapshots(self, run: str) -> list[dict[str, Any]]:
        path = self._file(run)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def _save(self, run: str, ctx: dict[str, Any], parent: str | None, status: str) -> str:
        snapshot_id = f"{len(self._snapshots(run)) + 1:06d}"
        with self._file(run).open("a") as f:
            f.write(
                json.dumps({"id": snapshot_id, "parent": parent, "status": status, "ctx": ctx})
                + "\n"
            )
        return snapshot_id

    def _flow(self) -> ProbeFlow:
        return ProbeFlow(self.env, runtime=_Points(self.runtime, self.env))

    async def _drive(self, run: str, handler: WorkflowHandler, parent: str | None) -> RunResult:
        status = await _settle(handler)
        ctx = handler.ctx.to_dict()
        self._save(run, ctx, parent, status)
        if status == "paused":
            await handler.cancel_run()
        return RunResult(status, _plain(_state_of(ctx)))  # type: ignore[arg-type]

    def _head(self, run: str, snapshot_id: str | None = None) -> dict[str, Any]:
        found = [s for s in self._snapshots(run) if snapshot_id in (None, s["id"])]
        if not found:
            raise LookupError(f"no snapshot {snapshot_id!r} of run {run!r}")
        return found[-1]

    def start(self, run: str) -> RunResult:
        async def go() -> RunResult:
            handler = self._flow().run(start_event=OrderStart(**initial_state()))
            return await self._drive(run, handler, None)

        return asyncio.run(go())

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        async def go() -> RunResult:
            head = self._head(run, branch)
            flow = self._flow()
            handler = flow.run(ctx=Context.from_dict(flow, head["ctx"]))
            handler.ctx.send_event(_approval(value))
            return await self._drive(run, handler, head["id"])

        return asyncio.run(go())

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        return self.fork(run, self._head(run, branch)["id"], None)

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        async def go() -> RunResult:
            base = self._head(run, checkpoint)
            if base["status"] == "done" or _waiting(base["ctx"]):
                status: RunStatus = "done" if base["status"] == "done" else "paused"
                return RunResult(status, _plain(_state_of(base["ctx"])), base["id"])
            flow = self._flow()
            handler = flow.run(ctx=Context.from_dict(flow, base["ctx"]))
            result = await self._drive(run, handler, base["id"])
            result.branch = self._snapshots(run)[-1]["id"]
            return result

        return asyncio.run(go())

    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        async def go() -> None:
            head = self._head(run)
            ctx = Context.from_dict(self._flow(), head["ctx"])
            for path, value in patch.items():
                await ctx.store.set(path, value)
            self._save(run, ctx.to_dict(), head["id"], head["status"])

        asyncio.run(go())

    def corrupt_head(self, run: str) -> str:
        path = self._file(run)
        lines = path.read_text().splitlines()
        head = json.loads(lines[-1])
        lines[-1] = lines[-1].replace('\\"amount\\": 100', '\\"amount\\": 1O0', 1)
        path.write_text("\n".join(lines) + "\n")
        return str(head["id"])

    def inspect(self, run: str, *, branch: str | None = None) -> Snapshot:
        snapshots = self._snapshots(run)
        if not snapshots:
            return Snapshot(state=None, head=None, branches=0)
        head = self._head(run, branch)
        parents = {s["parent"] for s in snapshots}
        waiters = [w for w in _waiters(head["ctx"]) if w.get("resolved_event") is None]
        return Snapshot(
            state=_plain(_state_of(head["ctx"])),
            head=head["id"],
            branches=sum(1 for s in snapshots if s["id"] not in parents),
            checkpoints=[
                CheckpointRef(s["id"], tuple(_next_steps(s["ctx"]))) for s in reversed(snapshots)
            ],
            pending_interrupts=len(waiters),
        )

    def copy_store(self, run: str, dest: Target) -> None:
        shutil.copyfile(self._file(run), self._file(run, dest.folder))


def _state_of(ctx: dict[str, Any]) -> dict[str, Any]:
    payload = ctx.get("state") or {}
    fields = snap.state_fields(payload)
    return fields if fields is not None else {}


def _waiters(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        w for worker in ctx.get("workers", {}).values() for w in worker.get("collected_waiters", [])
    ]


def _waiting(ctx: dict[str, Any]) -> bool:
    """Nothing to run: the snapshot only waits for a resume value."""
    return (
        not _next_steps(ctx)
        and not ctx.get("deliveries")
        and any(w.get("resolved_event") is None for w in _waiters(ctx))
    )


def _next_steps(ctx: dict[str, Any]) -> list[str]:
    return sorted(
        name
        for name, worker in ctx.get("workers", {}).items()
        if worker.get("queue") or worker.get("in_progress")
    )


class LlamaIndexProbe(ProbeAdapter):
    framework = "llamaindex"

    def preload(self) -> None:
        ProbeFlow  # noqa: B018 - the framework is imported with this module

    def describe(self, target: Target) -> str:
        if target.kind == "vanilla":
            return "LlamaIndex ctx snapshots"
        return f"Remit ({target.engine})"

    def unsupported(self, target: Target) -> str | None:
        if target.kind == "vanilla" and target.engine != "sqlite":
            return (
                "LlamaIndex Workflows core persists by ctx.to_dict() snapshots the user "
                "stores; it has no database backend of its own"
            )
        return None

    def session(self, target: Target, env: ProbeEnv) -> ProbeSession:
        if target.kind == "vanilla":
            return VanillaProbe(target, env)
        return RemitProbe(target, env)


adapter = LlamaIndexProbe()

__all__ = ["OrderState", "ProbeFlow", "adapter"]
