"""The scenarios behind the 39 cells: what to run, in which processes, and how to judge.

Each scenario runs on one target in its own folder, drives the adapter's
session operations in forked workers (`Context.ops`), and judges its cells
from observations only: the journal, the effect sink, the store as the
adapter's `inspect` reads it, and the exceptions workers raised. Nothing
here knows which target is expected to pass.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remit_core.conformance.adapter import (
    EFFECTS,
    STEPS,
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    Target,
)
from remit_core.conformance.processes import (
    Barrier,
    Outcome,
    Worker,
    describe_error,
    fork,
    reap,
    to_plain,
)
from remit_core.conformance.storage import discard_copy

STEPS_ONCE = Counter({s: 1 for s in STEPS})
#: How long a race waits for its k racers to reach the barrier before releasing those ready.
RACE_BARRIER_TIMEOUT = 60.0
EFFECTS_ONCE = Counter({e: 1 for e in EFFECTS})
VALUE = "alice"
OTHER_VALUE = "bob"
THIRD_VALUE = "carol"
FOURTH_VALUE = "dave"


@dataclass
class Verdict:
    """A cell's judgement on one run of its scenario."""

    passed: bool
    measured: str
    saturation: float | None = None
    #: The run proves nothing (a race whose racers were not in flight together): never PASS.
    inconclusive: bool = False


class ScenarioNotApplicable(Exception):
    """An operation raised the adapter's `NotApplicable`: the scenario's cells read N/A."""


class LateNotApplicable(Exception):
    """An operation raised `NotApplicable` after the scenario had shown the framework
    expresses it: the same operation went through earlier in the scenario, or this
    call entered a step or applied an effect before it raised. N/A is a framework's
    inability, not a way out of a verdict: the scenario's cells read ERROR."""


class WorkerCrashed(Exception):
    """A worker ended without an answer nobody asked for: timed out, exited without a
    result, or killed by a signal no crash point was armed to send (the OOM killer, a
    stray `kill`). Its operation neither returned nor raised, so no cell can be judged
    from it: the scenario's cells read ERROR, never a PASS or a FAIL of the target."""


Op = tuple[Any, ...]


def op(name: str, *args: Any, **kwargs: Any) -> Op:
    """One session operation for `Context.ops`."""
    return (name, args, kwargs)


class Context:
    """One scenario on one target: its folder, its world (journal and sink), its run."""

    def __init__(self, adapter: ProbeAdapter, spec: str, folder: Path, *, lease: float) -> None:
        self.adapter = adapter
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:12]
        self.target = Target.parse(spec, folder, tag)
        self.env = ProbeEnv(folder, self.target, lease)
        self.run = f"probe-{tag}"
        self.lease = lease
        self.workers: list[Worker] = []
        #: pid -> what its armed crash points do ("kill", "stop"): the ends it may meet.
        self.armed: dict[int, set[str]] = {}
        self.copies: list[Context] = []
        self.ready = 0
        #: Operations that went through (or were killed at an armed point) in this scenario.
        self.expressed: set[str] = set()
        #: pid -> the names of the operations its `start_ops` worker runs.
        self.op_names: dict[int, list[str]] = {}

    # -- processes -----------------------------------------------------------
    def spawn(
        self,
        script: Callable[[ProbeSession, ProbeEnv], Any],
        *,
        env: ProbeEnv | None = None,
        arm: Sequence[tuple[str, str]] = (),
        resumer: str | None = None,
        barrier: Barrier | None = None,
    ) -> Worker:
        """Fork a worker that opens a session and runs `script(session, env)`."""
        env = env or self.env
        run = self.run

        def body() -> Any:
            for point, action in arm:
                env.arm(point, action)  # type: ignore[arg-type]
            session = self.adapter.session(env.target, env)
            try:
                with env.operating(run, resumer):
                    if barrier is not None:
                        barrier.wait()
                    return script(session, env)
            finally:
                session.close()

        worker = fork(body, barrier=barrier)
        self.workers.append(worker)
        self.armed[worker.pid] = {action for _, action in arm}
        return worker

    def answered(self, worker: Worker, whole: Outcome) -> Outcome:
        """`whole`, unless the worker crashed in a way no crash point explains.

        Raises `WorkerCrashed` for a worker that timed out, exited without a
        result, or was killed (or stopped) though no point armed it to be.
        """
        armed = self.armed.get(worker.pid, set())
        expected = (whole.status == "killed" and "kill" in armed) or (
            whole.status == "stopped" and "stop" in armed
        )
        if whole.status in ("ok", "error") or expected:
            return whole
        raise WorkerCrashed(f"worker {worker.pid} gave no answer: {whole.summary()}")

    def start_ops(
        self, *ops: Op, stop_on_error: bool = True, timed: bool = False, **spawn: Any
    ) -> Worker:
        """Fork a worker running `ops` in turn; see `ops`.

        `timed`: journal when each operation begins and ends (kind "race"), so
        that a race's verdict can tell whether its racers were in flight together.
        """

        def script(session: ProbeSession, env: ProbeEnv) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for name, args, kwargs in ops:
                if timed:
                    env.journal.record("race", "begin")
                marks = (env.journal.last_seq(), env.sink.last_seq())
                try:
                    value = getattr(session, name)(*args, **kwargs)
                    out.append({"ok": True, "value": to_plain(value)})
                except Exception as exc:  # an operation's failure is an observation
                    # (What it did first tells a late N/A from an inability.)
                    out.append(
                        {"ok": False, "error": describe_error(exc), "traces": _traces(env, *marks)}
                    )
                    if stop_on_error:
                        break
                finally:
                    if timed:
                        env.journal.record("race", "end")
            return out

        worker = self.spawn(script, **spawn)
        self.op_names[worker.pid] = [name for name, _, _ in ops]
        return worker

    def finish_ops(self, worker: Worker, count: int, **wait: Any) -> list[Outcome]:
        """Wait for a `start_ops` worker; one outcome per operation."""
        whole = self.answered(worker, worker.wait(**wait))
        ran = self.op_names.get(worker.pid, [])
        if not whole.ok:
            # Killed or stopped at an armed point: the operation it ran got that far.
            self.expressed.update(ran[:1] if count == 1 else ())
            return [whole] * count
        results = [
            Outcome("ok", value=r["value"]) if r["ok"] else Outcome("error", error=r["error"])
            for r in whole.value
        ]
        results += [Outcome("skipped")] * (count - len(results))
        for i, (r, raw) in enumerate(zip(results, whole.value, strict=False)):
            name = ran[i] if i < len(ran) else f"operation {i + 1}"
            if r.raised("NotApplicable"):
                reason = r.error["message"] if r.error else ""
                if raw.get("traces"):
                    raise LateNotApplicable(
                        f"{name} declared N/A ({reason!r}) after it {raw['traces']}"
                    )
                if name in self.expressed:
                    raise LateNotApplicable(
                        f"{name} declared N/A ({reason!r}) though an earlier {name} of this "
                        "scenario went through"
                    )
                raise ScenarioNotApplicable(reason)
            if r.ok:
                self.expressed.add(name)
        return results

    def ops(self, *ops: Op, stop_on_error: bool = True, **spawn: Any) -> list[Outcome]:
        """Run session operations in turn in one new worker process; one outcome each."""
        worker = self.start_ops(*ops, stop_on_error=stop_on_error, **spawn)
        return self.finish_ops(worker, len(ops))

    def one(self, name: str, *args: Any, **kwargs: Any) -> Outcome:
        """One operation in a new worker process."""
        return self.ops(op(name, *args, **kwargs))[0]

    def race(
        self,
        k: int,
        make_ops: Callable[[int], Op],
        *,
        arm: Sequence[tuple[str, str]] = (),
        stopped_counts: bool = False,
    ) -> tuple[list[Worker], list[Outcome]]:
        """k workers, released at once by a barrier, each running one operation."""
        barrier = Barrier(k)
        workers = [
            self.start_ops(make_ops(i), arm=arm, resumer=f"r{i}", barrier=barrier, timed=True)
            for i in range(k)
        ]
        self.ready = barrier.release(RACE_BARRIER_TIMEOUT)
        wholes = [self.answered(w, w.wait(stopped_counts=stopped_counts)) for w in workers]
        # A racer's N/A is judged against every racer: one that went through shows
        # the framework expresses the operation, whichever racer was reaped first.
        for w, whole in zip(workers, wholes, strict=True):
            if whole.ok and any(r["ok"] for r in whole.value):
                self.expressed.update(self.op_names.get(w.pid, []))
        outcomes = []
        for w, whole in zip(workers, wholes, strict=True):
            if whole.ok:
                (outcome,) = self.finish_ops(w, 1)
            else:
                outcome = whole
            outcomes.append(outcome)
        return workers, outcomes

    def sub(self, name: str) -> Context:
        """A sibling context (own folder, world and run) on the same target spec."""
        return Context(
            self.adapter,
            self.target.spec,
            self.folder.parent / f"{self.folder.name}-{name}",
            lease=self.lease,
        )

    def copy(self, name: str, slot: int) -> Context:
        """A context for a copy of this store: relocated target, copied world, same run id.

        `slot` (1, 2, ...) keeps copies of one scenario apart on a server.
        """
        folder = self.folder.parent / f"{self.folder.name}-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        ctx = Context.__new__(Context)
        ctx.adapter, ctx.folder, ctx.lease = self.adapter, folder, self.lease
        ctx.target = self.target.relocated(folder, uuid.uuid4().hex[:12], slot)
        self.env.db.backup_to(folder / "world.db")
        ctx.env = ProbeEnv(folder, ctx.target, self.lease)
        ctx.run, ctx.workers, ctx.armed, ctx.copies = self.run, self.workers, self.armed, []
        ctx.expressed, ctx.op_names, ctx.ready = self.expressed, self.op_names, 0
        self.copies.append(ctx)
        return ctx

    def wait_lease(self) -> None:
        """Let a dead or stopped holder's claim lapse (L1: any recovery before is refused)."""
        time.sleep(self.lease + 0.5)

    def close(self) -> None:
        """Reap every worker; remove what copies left on a server."""
        reap(self.workers)
        for cp in self.copies:
            discard_copy(cp.target, cp.run)
            cp.env.db.close()
        self.env.db.close()

    # -- observations ----------------------------------------------------------
    def mark(self) -> int:
        return self.env.journal.last_seq()

    def entered(self, after: int = 0) -> Counter[str]:
        return self.env.journal.entered(after=after)

    def counts(self) -> Counter[str]:
        return self.env.sink.counts()

    def ledger(self) -> Counter[tuple[str, str | None]]:
        """Every application the sink counted, as (effect name, idempotency key)."""
        return Counter((name, key) for name, key, _ in self.env.sink.applications())

    def reached(self, point: str) -> bool:
        return any(e.kind == "point" and e.name == point for e in self.env.journal.entries())

    def race_gap(self, after: int, k: int, ready: int) -> str:
        """Why the race after journal seq `after` was not a race ('' if its racers overlapped).

        Every racer must have passed the barrier and begun its operation, and at
        least one besides the one that proceeded (entered a step) must have begun
        before that one had finished: racers that all began later met a settled
        run, which tests nothing concurrent. (One that began late on a loaded
        machine, while others overlapped, leaves the race a race.)
        """
        if ready < k:
            return f"only {ready} of {k} racers reached the barrier"
        entries = [e for e in self.env.journal.entries() if e.seq > after]
        begins = {e.resumer: e.t for e in entries if e.kind == "race" and e.name == "begin"}
        ends = {e.resumer: e.t for e in entries if e.kind == "race" and e.name == "end"}
        if len(begins) < k:
            return f"only {len(begins)} of {k} racers began their operation"
        winners = {e.resumer for e in entries if e.kind == "enter" and e.resumer in begins}
        if len(winners) != 1:
            return ""  # none or several proceeded: the verdict fails on its own
        (winner,) = winners
        finished = ends.get(winner, float("inf"))  # killed or stopped: still in flight
        late = sorted(str(r) for r, t in begins.items() if t > finished)
        if len(late) == k - 1:
            return f"every other racer ({', '.join(late)}) began after the winner finished"
        return ""

    def proceeders(self, after: int) -> set[str]:
        """The resumers that entered any step after journal seq `after`."""
        return {
            e.resumer or f"pid{e.pid}/tid{e.tid}"
            for e in self.env.journal.entries()
            if e.kind == "enter" and e.seq > after
        }

    def proceeded(self, after: int) -> int:
        """How many resumers entered any step after journal seq `after`."""
        return len(self.proceeders(after))


def _traces(env: ProbeEnv, journal_mark: int, sink_mark: int) -> str:
    """What this process did in the world since the marks: steps entered, effects applied."""
    pid = os.getpid()
    entered = Counter(
        e.name
        for e in env.journal.entries()
        if e.kind == "enter" and e.pid == pid and e.seq > journal_mark
    )
    applied = env.sink.applied_by(pid, after=sink_mark)
    return joined(
        "entered " + " ".join(f"{s}={n}" for s, n in sorted(entered.items())) if entered else "",
        "applied " + " ".join(f"{e}={n}" for e, n in sorted(applied.items())) if applied else "",
    )


# -- formatting observations ------------------------------------------------------


def steps_text(c: Counter[str]) -> str:
    return "entered " + " ".join(f"{s}={c.get(s, 0)}" for s in STEPS)


def effects_text(c: Counter[str]) -> str:
    return "applied " + " ".join(f"{e}={c.get(e, 0)}" for e in EFFECTS)


def failures(*outcomes: Outcome, names: Sequence[str] = ()) -> str:
    """The first failed operation, as text ('' if all ok)."""
    for i, o in enumerate(outcomes):
        if not o.ok:
            label = names[i] if i < len(names) else f"op {i + 1}"
            return f"{label}: {o.summary()}"
    return ""


def names(text: str, ident: str) -> bool:
    """`text` names `ident` as a whole token: a checkpoint id "2" is not named by the
    "2" of a timestamp or of another id ("12", "ck-2a")."""
    before, after = r"[A-Za-z0-9_.:-]", r"[A-Za-z0-9_:-]|\.[A-Za-z0-9]"
    found = re.search(rf"(?<!{before}){re.escape(ident)}(?!{after})", text)
    return bool(ident) and found is not None


def joined(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def state_of(o: Outcome) -> dict[str, Any] | None:
    """The state in an operation's RunResult or Snapshot (None if absent)."""
    return o.value.get("state") if o.ok and isinstance(o.value, dict) else None


def status_of(o: Outcome) -> str:
    return o.value.get("status", "?") if o.ok and isinstance(o.value, dict) else o.status


def complete(state: dict[str, Any] | None, value: str) -> bool:
    """The run reached the end with `value` approved and every step logged once."""
    return bool(
        state
        and state.get("charged") is True
        and state.get("approved_by") == value
        and list(state.get("log", ())) == list(STEPS)
    )


def same_store(a: Outcome, b: Outcome) -> bool:
    """Two snapshots agree on head, state, branches, interrupts and stored resume values."""
    if not (a.ok and b.ok):
        return False
    keys = ("head", "state", "branches", "pending_interrupts", "resume_values")
    return all(a.value.get(k) == b.value.get(k) for k in keys)


def store_diff(a: Outcome, b: Outcome) -> str:
    if not (a.ok and b.ok):
        return failures(a, b, names=("inspect before", "inspect after"))
    keys = ("head", "state", "branches", "pending_interrupts", "resume_values")
    changed = [
        f"{k} {a.value.get(k)!r} -> {b.value.get(k)!r}"
        for k in keys
        if a.value.get(k) != b.value.get(k)
    ]
    return "store changed: " + ", ".join(changed)[:300]


def checkpoint_before(snapshot: Outcome, step: str) -> str | None:
    """The newest stored checkpoint from which `step` runs next."""
    if not snapshot.ok:
        return None
    for ref in snapshot.value.get("checkpoints", ()):
        if list(ref.get("next", ())) == [step]:
            return str(ref["id"])
    return None


def acknowledged(proceeded: set[str], acked: set[str], k: int) -> tuple[str, bool]:
    """A race of k resumers judged: (measured text, passed).

    It passes when exactly one resumer entered a step and that one, and only
    it, was told its value was taken: a winner told it failed while a loser is
    told "ok" acknowledges a value the run never continued with (P5).
    """
    text = f"{len(proceeded)} of {k} proceeded, {len(acked)} acknowledged"
    ok = len(proceeded) == 1 and acked == proceeded
    if len(proceeded) == 1 and len(acked) == 1 and not ok:
        text += f", but the one that proceeded ({min(proceeded)}) was not the one acknowledged"
        text += f" ({min(acked)})"
    return text, ok


def saturation(fired: int, k: int) -> float:
    return max(0.0, (fired - 1) / (k - 1))


def raced(verdict: Verdict, gap: str) -> Verdict:
    """A race's verdict: a PASS whose racers did not overlap is no PASS (timing luck)."""
    if not verdict.passed or not gap:
        return verdict
    return Verdict(
        False, f"racers did not overlap ({gap}): {verdict.measured}", verdict.saturation, True
    )


# -- the scenarios ------------------------------------------------------------------


def seq(ctx: Context) -> dict[int, Verdict]:
    """SEQ: start and resume in one process."""
    start, resume = ctx.ops(op("start", ctx.run), op("resume", ctx.run, VALUE))
    failed = failures(start, resume, names=("start", "resume"))
    e, c = ctx.entered(), ctx.counts()
    return {
        1: Verdict(not failed and e == STEPS_ONCE, joined(steps_text(e), failed)),
        2: Verdict(not failed and c == EFFECTS_ONCE, joined(effects_text(c), failed)),
    }


def seq_xproc(ctx: Context) -> dict[int, Verdict]:
    """SEQ-XPROC: start in one process, resume in another."""
    start = ctx.one("start", ctx.run)
    resume = ctx.one("resume", ctx.run, VALUE)
    failed = failures(start, resume, names=("start", "resume"))
    e, c = ctx.entered(), ctx.counts()
    return {
        3: Verdict(not failed and e == STEPS_ONCE, joined(steps_text(e), failed)),
        4: Verdict(not failed and c == EFFECTS_ONCE, joined(effects_text(c), failed)),
    }


def resume_twice(ctx: Context) -> dict[int, Verdict]:
    """RESUME-TWICE: a second value to an interrupt the first one consumed."""
    start = ctx.one("start", ctx.run)
    first, before = ctx.ops(op("resume", ctx.run, VALUE), op("inspect", ctx.run))
    mark = ctx.mark()
    second, after = ctx.ops(
        op("resume", ctx.run, OTHER_VALUE), op("inspect", ctx.run), stop_on_error=False
    )
    ran = ctx.entered(after=mark)
    c = ctx.counts()
    failed = failures(start, first, names=("start", "first resume"))
    if failed:
        v5 = Verdict(False, failed)
    elif not complete(state_of(before), VALUE):
        # The second value goes to an interrupt the first consumed: a first value
        # acknowledged but never carried to the end left nothing consumed to refuse.
        v5 = Verdict(
            False,
            joined(
                f"the first value was acknowledged ({status_of(first)}) but the run did not "
                f"complete with it: state {state_of(before)!r}",
                failures(before, names=("inspect",)),
            ),
        )
    elif not second.raised():
        v5 = Verdict(
            False,
            joined(f"second value accepted ({status_of(second)})", steps_text(ran) if ran else ""),
        )
    elif not same_store(before, after) or ran:
        v5 = Verdict(
            False,
            joined(
                f"rejected ({second.summary()}) but",
                store_diff(before, after),
                steps_text(ran) if ran else "",
            ),
        )
    elif not names(second.error_text(), ctx.run):
        v5 = Verdict(False, f"rejected, but the error does not name the run: {second.summary()}")
    else:
        v5 = Verdict(True, f"rejected: {second.summary()}")
    return {5: v5, 6: Verdict(not failed and c == EFFECTS_ONCE, joined(effects_text(c), failed))}


def resume_value(ctx: Context) -> dict[int, Verdict]:
    """RESUME-VALUE: the state holds the value the resumer was acknowledged."""
    start = ctx.one("start", ctx.run)
    resume, snap = ctx.ops(op("resume", ctx.run, VALUE), op("inspect", ctx.run))
    failed = failures(start, resume, snap, names=("start", "resume", "inspect"))
    held = (state_of(snap) or {}).get("approved_by")
    return {
        7: Verdict(
            not failed and held == VALUE,
            joined(f"acknowledged {VALUE!r}, state holds {held!r}", failed),
        )
    }


def multi_interrupt(ctx: Context) -> dict[int, Verdict]:
    """MULTI-INTERRUPT: approve asks twice; each value reaches its own interrupt."""
    env = ctx.env.with_variant(multi_interrupt=True)
    start = ctx.ops(op("start", ctx.run), env=env)[0]
    r1, mid = ctx.ops(op("resume", ctx.run, VALUE), op("inspect", ctx.run), env=env)
    r2, end = ctx.ops(op("resume", ctx.run, OTHER_VALUE), op("inspect", ctx.run), env=env)
    failed = failures(
        start,
        r1,
        mid,
        r2,
        end,
        names=("start", "first resume", "inspect", "second resume", "inspect"),
    )
    want = f"{VALUE}+{OTHER_VALUE}"
    held = (state_of(end) or {}).get("approved_by")
    paused = status_of(r1) == "paused" and bool(mid.ok and mid.value["pending_interrupts"])
    approve = ctx.entered()["approve"]
    ok = not failed and paused and held == want and approve == 1
    return {
        8: Verdict(
            ok,
            joined(
                f"after the first value: {status_of(r1)}; approved_by {held!r}; "
                f"approve entered {approve}",
                failed,
            ),
        )
    }


def _crash(ctx: Context, point: str) -> str:
    """Start, then resume with `point` armed to SIGKILL; '' if it died there, else why not."""
    start = ctx.one("start", ctx.run)
    if not start.ok:
        return f"start: {start.summary()}"
    crash = ctx.ops(op("resume", ctx.run, VALUE), arm=[(point, "kill")])[0]
    if crash.status != "killed" or not ctx.reached(point):
        return f"no crash at {point} (resume: {crash.summary()})"
    return ""


def _recover(ctx: Context) -> tuple[Outcome, Outcome]:
    ctx.wait_lease()
    recover, snap = ctx.ops(op("recover", ctx.run), op("inspect", ctx.run))
    return recover, snap


def crash_before_effect(ctx: Context) -> dict[int, Verdict]:
    """CRASH-BEFORE-EFFECT: SIGKILL in charge before its effect, then recover."""
    no_crash = _crash(ctx, "charge.before_effect")
    if no_crash:
        return {9: Verdict(False, no_crash), 10: Verdict(False, no_crash)}
    recover, snap = _recover(ctx)
    failed = failures(recover, names=("recover",))
    e, c = ctx.entered(), ctx.counts()
    done = complete(state_of(snap), VALUE)
    # charge was in flight (entered, not completed): recovery runs it again, exactly once.
    prefix_once = all(e[s] == 1 for s in ("prepare", "approve", "notify")) and e["charge"] == 2
    state = "" if done else f"final state {state_of(snap)!r}"
    return {
        9: Verdict(not failed and done and prefix_once, joined(steps_text(e), state, failed)),
        10: Verdict(not failed and done and c == EFFECTS_ONCE, joined(effects_text(c), failed)),
    }


def crash_after_effect(ctx: Context) -> dict[int, Verdict]:
    """CRASH-AFTER-EFFECT: SIGKILL after the charge effect, before charge completes."""
    no_crash = _crash(ctx, "charge.after_effect")
    if no_crash:
        return {11: Verdict(False, no_crash), 12: Verdict(False, no_crash)}
    recover, snap = _recover(ctx)
    failed = failures(recover, names=("recover",))
    e, c = ctx.entered(), ctx.counts()
    done = complete(state_of(snap), VALUE)
    state = "" if done else f"final state {state_of(snap)!r}"
    # In doubt, the charge is reconciled (its hook asked "did K happen?"), never applied
    # again: a repeat under the same key is single only because this sink ignores it.
    rekeyed = ctx.env.sink.repeats()
    again = f"applied again under the same key: {dict(rekeyed)}" if rekeyed else ""
    return {
        11: Verdict(
            not failed and done and c == EFFECTS_ONCE and not rekeyed,
            joined(effects_text(c), again, failed),
        ),
        12: Verdict(
            not failed and done and e["prepare"] == 1 and e["approve"] == 1,
            joined(steps_text(e), state, failed),
        ),
    }


def crash_after_step(ctx: Context) -> dict[int, Verdict]:
    """CRASH-AFTER-STEP: SIGKILL after charge completed, before the next checkpoint."""
    no_crash = _crash(ctx, "charge.after_step")
    if no_crash:
        return {13: Verdict(False, no_crash), 14: Verdict(False, no_crash)}
    recover, snap = _recover(ctx)
    failed = failures(recover, names=("recover",))
    e, c = ctx.entered(), ctx.counts()
    done = complete(state_of(snap), VALUE)
    state = "" if done else f"final state {state_of(snap)!r}"
    once = all(e[s] == 1 for s in ("prepare", "approve", "charge"))
    return {
        13: Verdict(not failed and done and c == EFFECTS_ONCE, joined(effects_text(c), failed)),
        14: Verdict(not failed and done and once, joined(steps_text(e), state, failed)),
    }


def crash_during_resume(ctx: Context) -> dict[int, Verdict]:
    """CRASH-DURING-RESUME: SIGKILL right after the resume value was accepted."""
    no_crash = _crash(ctx, "resume.after_accept")
    if no_crash:
        return {15: Verdict(False, no_crash), 16: Verdict(False, no_crash)}
    recover, snap = _recover(ctx)
    recovered = ctx.counts()  # what the recovery applied, before anyone sends a second value
    mark = ctx.mark()
    again, after = ctx.ops(
        op("resume", ctx.run, OTHER_VALUE), op("inspect", ctx.run), stop_on_error=False
    )
    ran = ctx.entered(after=mark)
    c = ctx.counts()
    failed = failures(recover, names=("recover",))
    state = state_of(snap)
    if failed:
        v15 = Verdict(False, failed)
    elif not complete(state, VALUE):
        v15 = Verdict(
            False,
            f"recovery ended {status_of(recover)} with approved_by "
            f"{(state or {}).get('approved_by')!r}",
        )
    elif not again.raised():
        v15 = Verdict(False, f"a second value was accepted after recovery ({status_of(again)})")
    elif not same_store(snap, after) or ran:
        v15 = Verdict(
            False,
            joined(
                "second value rejected but",
                store_diff(snap, after) if not same_store(snap, after) else "",
                steps_text(ran) if ran else "",
            ),
        )
    else:
        v15 = Verdict(True, f"recovered with {VALUE!r}; second value: {again.summary()}")
    # The effects are the recovery's: once when it ends, and not again for a second value.
    done = complete(state, VALUE)
    v16 = Verdict(
        not failed and done and recovered == EFFECTS_ONCE and c == EFFECTS_ONCE,
        joined(
            f"after recovery {effects_text(recovered)}",
            "" if c == recovered else f"after a second value {effects_text(c)}",
            "" if done else f"recovery ended {status_of(recover)}",
            failed,
        ),
    )
    return {15: v15, 16: v16}


def recover_twice(ctx: Context) -> dict[int, Verdict]:
    """RECOVER-TWICE: recover two copies of one crashed store."""
    no_crash = _crash(ctx, "charge.after_effect")
    if no_crash:
        return {17: Verdict(False, no_crash)}
    copies = [ctx.copy("a", 1), ctx.copy("b", 2)]
    copied = ctx.ops(*(op("copy_store", ctx.run, cp.target) for cp in copies))
    failed = failures(*copied, names=("copy a", "copy b"))
    if failed:
        return {17: Verdict(False, failed)}
    ctx.wait_lease()
    workers = [cp.start_ops(op("recover", cp.run), op("inspect", cp.run)) for cp in copies]
    (ra, sa), (rb, sb) = (cp.finish_ops(w, 2) for cp, w in zip(copies, workers, strict=True))
    failed = failures(ra, rb, names=("recovery a", "recovery b"))
    ca, cb = copies[0].counts(), copies[1].counts()
    la, lb = copies[0].ledger(), copies[1].ledger()
    same = state_of(sa) == state_of(sb) and ca == cb and la == lb
    done = complete(state_of(sa), VALUE)
    text = f"a: {effects_text(ca)}; b: {effects_text(cb)}" if ca != cb else effects_text(ca)
    if ca == cb and la != lb:
        text = joined(text, f"idempotency keys differ: {sorted(la - lb)} vs {sorted(lb - la)}")
    if state_of(sa) != state_of(sb):
        text = joined(text, f"states differ: {state_of(sa)!r} vs {state_of(sb)!r}")
    elif not done:
        text = joined(text, f"final state {state_of(sa)!r}")
    return {17: Verdict(not failed and same and done, joined(text, failed))}


def recover_killed(ctx: Context) -> dict[int, Verdict]:
    """RECOVER-KILLED: the first recovery is SIGKILLed midway; the second completes."""
    ref = ctx.sub("ref")
    ref_start, ref_resume, ref_snap = ref.ops(
        op("start", ref.run), op("resume", ref.run, VALUE), op("inspect", ref.run)
    )
    failed = failures(
        ref_start, ref_resume, ref_snap, names=("reference start", "reference resume", "inspect")
    )
    if failed:
        return {18: Verdict(False, failed)}
    no_crash = _crash(ctx, "charge.after_effect")
    if no_crash:
        return {18: Verdict(False, no_crash)}
    ctx.wait_lease()
    mark = ctx.mark()
    first = ctx.ops(op("recover", ctx.run), arm=[("notify.before_effect", "kill")])[0]
    midway = [e.name for e in ctx.env.journal.entries() if e.kind == "point" and e.seq > mark]
    if first.status != "killed" or first.signal != signal.SIGKILL:
        return {18: Verdict(False, f"first recovery was not killed midway: {first.summary()}")}
    if "notify.before_effect" not in midway:
        # Died before it got midway (charge redone, notify begun): the second recovery
        # continued the same store as a plain recovery would, which proves nothing here.
        return {
            18: Verdict(
                False,
                f"first recovery died before notify.before_effect ({first.summary()}; "
                f"points reached: {', '.join(midway) or 'none'})",
            )
        }
    recover, snap = _recover(ctx)
    failed = failures(recover, names=("second recovery",))
    want, got = state_of(ref_snap), state_of(snap)
    ref_c, c = ref.counts(), ctx.counts()
    ok = not failed and got == want and c == ref_c
    text = effects_text(c) if c == ref_c else f"{effects_text(c)} vs uninterrupted {ref_c!r}"
    if got != want:
        text = joined(text, f"state {got!r} vs uninterrupted {want!r}")
    return {18: Verdict(ok, joined(text, failed))}


def invalid_step_write(ctx: Context) -> dict[int, Verdict]:
    """INVALID-STEP-WRITE: prepare returns amount=-5."""
    env = ctx.env.with_variant(invalid_step_write=True)
    start, snap = ctx.ops(
        op("start", ctx.run), op("inspect", ctx.run), env=env, stop_on_error=False
    )
    amount = (state_of(snap) or {}).get("amount")
    head_ok = snap.ok and (amount is None or amount >= 0)
    if not start.raised():
        return {
            19: Verdict(
                False, f"invalid write accepted ({status_of(start)}), head amount={amount!r}"
            )
        }
    if not head_ok:
        text = f"{start.summary()}; head amount={amount!r}" if snap.ok else snap.summary()
        return {19: Verdict(False, text)}
    refusal = start.message_of("CheckpointInvalid")
    if refusal is None:
        return {19: Verdict(False, f"not CheckpointInvalid: {start.summary()}")}
    if "amount" not in refusal:
        return {19: Verdict(False, f"error does not name the field amount: {start.summary()}")}
    return {19: Verdict(True, start.summary())}


def invalid_external_update(ctx: Context) -> dict[int, Verdict]:
    """INVALID-EXTERNAL-UPDATE: an operator edits amount to -5."""
    start, before = ctx.ops(op("start", ctx.run), op("inspect", ctx.run))
    if not start.ok:
        return {20: Verdict(False, f"start: {start.summary()}")}
    edit, after = ctx.ops(
        op("edit_state", ctx.run, {"amount": -5}), op("inspect", ctx.run), stop_on_error=False
    )
    if not edit.raised():
        return {20: Verdict(False, joined("invalid edit accepted", store_diff(before, after)))}
    if not same_store(before, after):
        return {
            20: Verdict(
                False, joined(f"rejected ({edit.summary()}) but", store_diff(before, after))
            )
        }
    refusal = edit.message_of("CheckpointInvalid")
    if refusal is None or "amount" not in refusal:
        return {
            20: Verdict(
                False, f"rejected, but not as CheckpointInvalid naming amount: {edit.summary()}"
            )
        }
    return {20: Verdict(True, f"rejected: {edit.summary()}")}


def invalid_resume_value(ctx: Context) -> dict[int, Verdict]:
    """INVALID-RESUME-VALUE: 12345 instead of a non-empty str."""
    start, before = ctx.ops(op("start", ctx.run), op("inspect", ctx.run))
    mark, prior = ctx.mark(), ctx.counts()
    bad, mid = ctx.ops(op("resume", ctx.run, 12345), op("inspect", ctx.run), stop_on_error=False)
    ran, applied = ctx.entered(after=mark), ctx.counts() - prior
    good, end = ctx.ops(op("resume", ctx.run, VALUE), op("inspect", ctx.run))
    failed = failures(start, before, names=("start", "inspect"))
    pending = mid.value.get("pending_interrupts", 0) if mid.ok else 0
    if failed:
        v = Verdict(False, failed)
    elif not bad.raised():
        v = Verdict(
            False,
            f"12345 accepted ({status_of(bad)}), approved_by "
            f"{(state_of(mid) or {}).get('approved_by')!r}",
        )
    elif not pending:
        v = Verdict(False, f"rejected ({bad.summary()}) but no interrupt left pending")
    elif ran or applied:
        v = Verdict(
            False,
            joined(
                f"rejected ({bad.summary()}) after the value reached a step",
                steps_text(ran) if ran else "",
                effects_text(applied) if applied else "",
            ),
        )
    elif not same_store(before, mid):
        v = Verdict(False, joined(f"rejected ({bad.summary()}) but", store_diff(before, mid)))
    elif not (good.ok and complete(state_of(end), VALUE)):
        v = Verdict(
            False, f"rejected, then a valid value failed: {good.summary()} {status_of(good)}"
        )
    else:
        v = Verdict(True, f"rejected: {bad.summary()}; then resumed")
    return {21: v}


def corrupt_record(ctx: Context) -> dict[int, Verdict]:
    """CORRUPT-RECORD: the head checkpoint's stored bytes are altered."""
    start, corrupt = ctx.ops(op("start", ctx.run), op("corrupt_head", ctx.run))
    failed = failures(start, corrupt, names=("start", "corrupt_head"))
    if failed:
        return {22: Verdict(False, failed)}
    checkpoint = str(corrupt.value)
    mark = ctx.mark()
    resume = ctx.one("resume", ctx.run, VALUE)
    ran = ctx.entered(after=mark)
    charged = ctx.counts()["charge"]
    if not resume.raised():
        return {
            22: Verdict(
                False,
                f"corrupt checkpoint read as a state: resume "
                f"{status_of(resume)}, charge applied {charged}",
            )
        }
    text = resume.error_text()
    named = names(text, ctx.run) and names(text, checkpoint)
    if not named:
        return {22: Verdict(False, f"error does not name run and checkpoint: {resume.summary()}")}
    # A record that fails to decode is never returned as a state: no step runs on it.
    return {
        22: Verdict(
            charged == 0 and not ran,
            joined(
                resume.summary()[:120],
                f"but the corrupt record was read as a state: {steps_text(ran)}" if ran else "",
                f"charge applied {charged}" if charged else "",
            ),
        )
    }


def version_mismatch(ctx: Context) -> dict[int, Verdict]:
    """VERSION-MISMATCH: a v1 run resumed by the v2 workflow."""
    start, before = ctx.ops(op("start", ctx.run), op("inspect", ctx.run))
    failed = failures(start, before, names=("start", "inspect"))
    if failed:
        return {23: Verdict(False, failed)}
    mark = ctx.mark()
    v2 = ctx.env.with_variant(workflow_version="v2")
    resume = ctx.ops(op("resume", ctx.run, VALUE), env=v2)[0]
    ran = ctx.entered(after=mark)
    after = ctx.one("inspect", ctx.run)
    if not resume.raised():
        return {
            23: Verdict(False, f"v2 resumed the v1 run ({status_of(resume)}); {steps_text(ran)}")
        }
    if ran:
        return {23: Verdict(False, f"refused after running steps: {steps_text(ran)}")}
    if not same_store(before, after):
        return {
            23: Verdict(
                False, joined(f"refused ({resume.summary()}) but", store_diff(before, after))
            )
        }
    text, head = resume.error_text(), str(before.value.get("head"))
    if not (names(text, ctx.run) and names(text, head)):
        return {
            23: Verdict(
                False,
                f"refused, but the error does not name the run and its head checkpoint "
                f"{head!r}: {resume.summary()}",
            )
        }
    return {23: Verdict(True, f"refused: {resume.summary()}")}


def _completed(ctx: Context) -> tuple[str, Outcome]:
    """A run taken to its end; returns (failure text, snapshot)."""
    start, resume, snap = ctx.ops(
        op("start", ctx.run), op("resume", ctx.run, VALUE), op("inspect", ctx.run)
    )
    return failures(start, resume, snap, names=("start", "resume", "inspect")), snap


def replay_no_token(ctx: Context) -> dict[int, Verdict]:
    """REPLAY-NO-TOKEN: continue from the checkpoint before charge without a token."""
    failed, before = _completed(ctx)
    base = checkpoint_before(before, "charge")
    if failed or base is None:
        return {24: Verdict(False, failed or "no stored checkpoint before charge")}
    mark = ctx.mark()
    replay, after = ctx.ops(
        op("fork", ctx.run, base, None), op("inspect", ctx.run), stop_on_error=False
    )
    ran = ctx.entered(after=mark)
    c = ctx.counts()
    if not replay.raised():
        return {
            24: Verdict(
                False,
                joined(
                    f"replayed without a token ({status_of(replay)})",
                    store_diff(before, after),
                    steps_text(ran),
                    effects_text(c),
                ),
            )
        }
    if not same_store(before, after) or ran:
        return {
            24: Verdict(
                False, joined(f"refused ({replay.summary()}) but", store_diff(before, after))
            )
        }
    return {24: Verdict(replay.raised("ForkWithoutIntent"), replay.summary())}


def fork_token(ctx: Context) -> dict[int, Verdict]:
    """FORK-TOKEN: continue from the checkpoint before charge with a token."""
    failed, before = _completed(ctx)
    base = checkpoint_before(before, "charge")
    if failed or base is None:
        return {25: Verdict(False, failed or "no stored checkpoint before charge")}
    forked, after = ctx.ops(op("fork", ctx.run, base, "fork-token-1"), op("inspect", ctx.run))
    if not (forked.ok and after.ok):
        return {25: Verdict(False, failures(forked, after, names=("fork", "inspect")))}
    grew = after.value["branches"] - before.value["branches"]
    intact = after.value["head"] == before.value["head"] and state_of(after) == state_of(before)
    text = f"{grew} new branch(es); original head {'intact' if intact else 'moved'}"
    return {25: Verdict(grew == 1 and intact, text)}


def fork_token_again(ctx: Context) -> dict[int, Verdict]:
    """FORK-TOKEN-AGAIN: the same token presented twice, from two processes."""
    failed, before = _completed(ctx)
    base = checkpoint_before(before, "charge")
    if failed or base is None:
        return {26: Verdict(False, failed or "no stored checkpoint before charge")}
    first = ctx.one("fork", ctx.run, base, "fork-token-2")
    applied, repeated, mark = ctx.counts(), ctx.env.sink.repeats(), ctx.mark()
    second, after = ctx.ops(op("fork", ctx.run, base, "fork-token-2"), op("inspect", ctx.run))
    failed = failures(first, second, after, names=("first fork", "second fork", "inspect"))
    if failed:
        return {26: Verdict(False, failed)}
    grew = after.value["branches"] - before.value["branches"]
    same_branch = first.value["branch"] == second.value["branch"]
    same_out = state_of(first) == state_of(second)
    # The same branch again: its steps are durably completed (P1) and its effects in
    # the ledger. None is run or applied a second time, not even under the same
    # idempotency keys (the sink ignores those, but a real system may not).
    reapplied = ctx.counts() - applied
    rekeyed = ctx.env.sink.repeats() - repeated
    rerun = ctx.entered(after=mark)
    text = (
        f"{grew} new branch(es); branch {'same' if same_branch else 'different'}; "
        f"outputs {'identical' if same_out else 'differ'}"
        + (f"; the second presentation {effects_text(reapplied)}" if reapplied else "")
        + (f"; the second presentation re-ran the fork: {steps_text(rerun)}" if rerun else "")
        + (
            f"; the second presentation applied again under the same keys: {dict(rekeyed)}"
            if rekeyed
            else ""
        )
    )
    ok = grew == 1 and same_branch and same_out and not (reapplied or rerun or rekeyed)
    return {26: Verdict(ok, text)}


def fork_effects(ctx: Context) -> dict[int, Verdict]:
    """FORK-EFFECTS: fork after charge; charge must not be applied again."""
    failed, before = _completed(ctx)
    base = checkpoint_before(before, "notify")
    if failed or base is None:
        return {27: Verdict(False, failed or "no stored checkpoint before notify")}
    mark = ctx.mark()
    forked = ctx.one("fork", ctx.run, base, "fork-token-3")
    c = ctx.counts()
    failed = failures(forked, names=("fork",))
    # The fork must really continue (to the end): a fork that runs nothing applies nothing.
    ran = complete(state_of(forked), VALUE)
    # Nor is charge applied again under its key (the sink ignores that; a real
    # system may not), or run again at all: it is in the shared prefix.
    rekeyed = ctx.env.sink.repeats()["charge"]
    rerun = ctx.entered(after=mark)["charge"]
    return {
        27: Verdict(
            not failed and ran and c["charge"] == 1 and not rekeyed and not rerun,
            joined(
                f"charge applied {c['charge']} after the fork",
                f"applied again under the same key {rekeyed} time(s)" if rekeyed else "",
                f"charge entered {rerun} time(s) by the fork" if rerun else "",
                "" if ran or failed else f"the fork ended {status_of(forked)}",
                failed,
            ),
        )
    }


def fork_vs_consume(ctx: Context) -> dict[int, Verdict]:
    """FORK-VS-CONSUME: fork a paused run twice; resume each line independently.

    The lines are resumed fork, main, fork (L3 both ways: a fork answered first
    must leave main's interrupt pending, and main answered first each fork's).
    Then each line's interrupt is consumed: a further value to any line is
    refused, leaves that line as it was and runs nothing ("consumed once").
    """
    start, before = ctx.ops(op("start", ctx.run), op("inspect", ctx.run))
    failed = failures(start, before, names=("start", "inspect"))
    if failed:
        return {28: Verdict(False, failed)}
    lines: list[tuple[str, str | None, str]] = []
    for name, token, value in (
        ("fork", "fork-token-4", OTHER_VALUE),
        ("fork 2", "fork-token-4b", FOURTH_VALUE),
    ):
        forked = ctx.one("fork", ctx.run, before.value["head"], token)
        if not forked.ok:
            return {28: Verdict(False, f"{name}: {forked.summary()}")}
        lines.append((name, forked.value["branch"], value))
    first, second = lines
    lines = [first, ("main", None, VALUE), second]
    answered = []
    for name, branch, value in lines:
        resumed, snap = ctx.ops(
            op("resume", ctx.run, value, branch=branch), op("inspect", ctx.run, branch=branch)
        )
        answered.append((name, value, resumed, snap))
    failed = failures(
        *(o for _, _, resumed, snap in answered for o in (resumed, snap)),
        names=tuple(f"{verb} {name}" for name, *_ in answered for verb in ("resume", "inspect")),
    )
    approve = ctx.entered()["approve"]
    ok = (
        not failed
        and all(complete(state_of(snap), value) for _, value, _, snap in answered)
        and approve == len(lines)
    )
    got = ", ".join(
        f"{name} approved_by {(state_of(snap) or {}).get('approved_by')!r}"
        for name, _, _, snap in answered
    )
    text = f"{got} (answered in that order), approve entered {approve}"
    if not ok:
        short = [
            f"{name} ended with log {(state_of(snap) or {}).get('log')!r}"
            for name, value, _, snap in answered
            if not complete(state_of(snap), value)
            and (state_of(snap) or {}).get("approved_by") == value
        ]
        return {28: Verdict(False, joined(text, *short, failed))}
    # (Snapshots of every line first: a store's resume values are the whole run's.)
    befores = ctx.ops(*(op("inspect", ctx.run, branch=branch) for _, branch, _ in lines))
    mark = ctx.mark()
    outcomes = ctx.ops(
        *(
            o
            for _, branch, _ in lines
            for o in (
                op("resume", ctx.run, THIRD_VALUE, branch=branch),
                op("inspect", ctx.run, branch=branch),
            )
        ),
        stop_on_error=False,
    )
    ran = ctx.entered(after=mark)
    again = [
        (name, outcomes[2 * i], befores[i], outcomes[2 * i + 1])
        for i, (name, _, _) in enumerate(lines)
    ]
    accepted = [f"{name} ({status_of(o)})" for name, o, _, _ in again if not o.raised()]
    changed = [f"{name}: {store_diff(b, a)}" for name, _, b, a in again if not same_store(b, a)]
    if accepted or changed or ran:
        return {
            28: Verdict(
                False,
                joined(
                    text,
                    f"a further value was accepted by {', '.join(accepted)}" if accepted else "",
                    f"a further value changed the store: {'; '.join(changed)}" if changed else "",
                    f"a further value {steps_text(ran)}" if ran else "",
                ),
            )
        }
    return {28: Verdict(True, joined(text, "a further value refused on every line"))}


def fork_race(ctx: Context) -> dict[int, Verdict]:
    """FORK-RACE: two processes fork with one token at once."""
    failed, before = _completed(ctx)
    base = checkpoint_before(before, "charge")
    if failed or base is None:
        return {29: Verdict(False, failed or "no stored checkpoint before charge")}
    mark = ctx.mark()
    _, outcomes = ctx.race(2, lambda i: op("fork", ctx.run, base, "fork-token-5"))
    # How many times the fork was run from its base: its most-entered step's count (two
    # racers may share the work of one run, one step each, without running any twice).
    ran = ctx.entered(after=mark)
    fired = max(ran.values(), default=0)
    gap = ctx.race_gap(mark, 2, ctx.ready)
    after = ctx.one("inspect", ctx.run)
    sat = saturation(max(fired, 1), 2)
    if not after.ok:
        return {29: Verdict(False, f"inspect: {after.summary()}", sat)}
    grew = after.value["branches"] - before.value["branches"]
    results = ", ".join(o.summary() if not o.ok else "ok" for o in outcomes)
    # One token, one branch, run once: the racers told "ok" were handed that branch.
    handed = {str(o.value.get("branch")) for o in outcomes if o.ok}
    ok = grew == 1 and fired == 1 and len(handed) <= 1
    text = f"{grew} new branch(es) ({results}); fork run {fired} time(s): {steps_text(ran)}"
    if len(handed) > 1:
        text += f"; handed different branches {sorted(handed)}"
    return {29: raced(Verdict(ok, text, sat), gap)}


def _k_proc(ctx: Context, k: int, p5: int, p2: int | None) -> dict[int, Verdict]:
    """K-PROC: k processes resume one paused run at once."""
    start = ctx.one("start", ctx.run)
    if not start.ok:
        text = f"start: {start.summary()}"
        return {p5: Verdict(False, text)} | ({p2: Verdict(False, text)} if p2 else {})
    mark = ctx.mark()
    _, outcomes = ctx.race(k, lambda i: op("resume", ctx.run, VALUE))
    fired = ctx.proceeded(mark)
    gap = ctx.race_gap(mark, k, ctx.ready)
    acked = {f"r{i}" for i, o in enumerate(outcomes) if o.ok}
    c = ctx.counts()
    sat = saturation(max(fired, 1), k)
    # Exactly one proceeds, and only that one is told its value was taken: the
    # others are refused (a loser acknowledged without running lost its value).
    text, p5_ok = acknowledged(ctx.proceeders(mark), acked, k)
    out = {p5: raced(Verdict(p5_ok, text, sat), gap)}
    if p2 is not None:
        out[p2] = raced(Verdict(c == EFFECTS_ONCE, effects_text(c), sat), gap)
    return out


def k2_proc(ctx: Context) -> dict[int, Verdict]:
    return _k_proc(ctx, 2, 30, 31)


def k4_proc(ctx: Context) -> dict[int, Verdict]:
    return _k_proc(ctx, 4, 32, None)


def k8_proc(ctx: Context) -> dict[int, Verdict]:
    return _k_proc(ctx, 8, 33, 34)


def k16_proc(ctx: Context) -> dict[int, Verdict]:
    return _k_proc(ctx, 16, 35, None)


def k8_threads(ctx: Context) -> dict[int, Verdict]:
    """K8-THREADS: 8 threads of one process resume at once (one session, like one app)."""
    k = 8
    start = ctx.one("start", ctx.run)
    if not start.ok:
        return {36: Verdict(False, f"start: {start.summary()}")}
    mark = ctx.mark()
    run = ctx.run

    def script(session: ProbeSession, env: ProbeEnv) -> list[dict[str, Any]]:
        barrier = threading.Barrier(k)
        results: list[dict[str, Any]] = [{} for _ in range(k)]

        def resumer(i: int) -> None:
            with env.operating(run, f"t{i}"):
                barrier.wait()
                env.journal.record("race", "begin")
                try:
                    session.resume(run, VALUE)
                    results[i] = {"ok": True}
                except Exception as exc:
                    results[i] = {"ok": False, "error": describe_error(exc)}
                finally:
                    env.journal.record("race", "end")

        threads = [threading.Thread(target=resumer, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    worker = ctx.spawn(script)
    whole = ctx.answered(worker, worker.wait())
    if not whole.ok:
        return {36: Verdict(False, f"worker: {whole.summary()}")}
    fired = ctx.proceeded(mark)
    gap = ctx.race_gap(mark, k, k)  # a threading.Barrier released all k threads
    acked = {f"t{i}" for i, r in enumerate(whole.value) if r.get("ok", False)}
    text, ok = acknowledged(ctx.proceeders(mark), acked, k)
    if not ok:  # what the resumers were told, to tell a refusal from a failure
        told = sorted(
            {f"{r['error']['class']}: {r['error']['message']}" for r in whole.value if "error" in r}
        )
        text += f"; errors: {told}"
    return {36: raced(Verdict(ok, text, saturation(max(fired, 1), k)), gap)}


def k8_values(ctx: Context) -> dict[int, Verdict]:
    """K8-VALUES: 8 processes deliver 8 different values."""
    k = 8
    start = ctx.one("start", ctx.run)
    if not start.ok:
        return {37: Verdict(False, f"start: {start.summary()}")}
    mark = ctx.mark()
    _, outcomes = ctx.race(k, lambda i: op("resume", ctx.run, f"value-{i}"))
    fired = ctx.proceeded(mark)
    gap = ctx.race_gap(mark, k, ctx.ready)
    snap = ctx.one("inspect", ctx.run)
    held = (state_of(snap) or {}).get("approved_by")
    acked = [f"value-{i}" for i, o in enumerate(outcomes) if o.ok]
    conflicts = sum(o.raised() for o in outcomes)
    ok = fired == 1 and len(acked) == 1 and conflicts == k - 1 and held == acked[0]
    text = f"{len(acked)} acknowledged, {conflicts} conflicts, state holds {held!r}"
    if len(acked) == 1 and held != acked[0]:
        text += f" but the winner was told {acked[0]!r}"
    return {37: raced(Verdict(ok, text, saturation(max(fired, 1), k)), gap)}


def k8_dead_winner(ctx: Context) -> dict[int, Verdict]:
    """K8-DEAD-WINNER: the winner is SIGKILLed in charge; after its lease k - 1 recover.

    The recoveries race behind the barrier. Between them the run's remaining
    steps (charge, in flight when the winner died, and notify) are entered once
    each: one recovery takes the run over (L1), or hands it on whole between two
    steps where a framework's driver holds no claim there.
    """
    k = 8
    start = ctx.one("start", ctx.run)
    if not start.ok:
        return {38: Verdict(False, f"start: {start.summary()}")}
    mark = ctx.mark()
    _, outcomes = ctx.race(
        k, lambda i: op("resume", ctx.run, VALUE), arm=[("charge.before_effect", "kill")]
    )
    fired = ctx.proceeded(mark)
    gap = ctx.race_gap(mark, k, ctx.ready)
    killed = sum(o.status == "killed" for o in outcomes)
    ctx.wait_lease()
    takeover = ctx.mark()
    _, recoveries = ctx.race(k - 1, lambda i: op("recover", ctx.run))
    took_over, rest = ctx.proceeded(takeover), ctx.entered(after=takeover)
    gap = gap or ctx.race_gap(takeover, k - 1, ctx.ready)
    snap = ctx.one("inspect", ctx.run)
    c = ctx.counts()
    done = complete(state_of(snap), VALUE)
    failed = failures(snap, names=("inspect",))
    ok = (
        fired == 1
        and killed == 1
        and rest == Counter({"charge": 1, "notify": 1})
        and done
        and c == EFFECTS_ONCE
        and not failed
    )
    text = joined(
        f"{fired} of {k} proceeded, {killed} killed in charge",
        f"after the lease {took_over} of {k - 1} recoveries entered steps, {steps_text(rest)}",
        "the run completed" if done else f"the run ended {status_of(snap)}",
        effects_text(c),
        failed,
    )
    if not ok:
        told = sorted({o.summary() for o in recoveries})
        text += f"; recoveries: {told}"
    return {38: raced(Verdict(ok, text, saturation(max(fired, 1), k)), gap)}


def k8_zombie(ctx: Context) -> dict[int, Verdict]:
    """K8-ZOMBIE: the winner is SIGSTOPped in charge past its lease, then continued."""
    k = 8
    start = ctx.one("start", ctx.run)
    if not start.ok:
        return {39: Verdict(False, f"start: {start.summary()}")}
    mark = ctx.mark()
    workers, outcomes = ctx.race(
        k,
        lambda i: op("resume", ctx.run, VALUE),
        arm=[("charge.before_effect", "stop")],
        stopped_counts=True,
    )
    fired = ctx.proceeded(mark)
    gap = ctx.race_gap(mark, k, ctx.ready)
    zombies = [w for w, o in zip(workers, outcomes, strict=True) if o.status == "stopped"]
    sat = saturation(max(fired, 1), k)
    if not zombies:
        return {39: Verdict(False, f"no resumer reached charge ({fired} proceeded)", sat)}
    recover, before = _recover(ctx)
    for z in zombies:
        z.cont()
    ends = [z.wait() for z in zombies]
    after = ctx.one("inspect", ctx.run)
    c = ctx.counts()
    done = complete(state_of(before), VALUE)
    failed = failures(recover, names=("recovery",))
    fenced = same_store(before, after)
    finals = [_zombie_end(ctx, z, e) for z, e in zip(zombies, ends, strict=True)]
    zombie_ends = ", ".join(f.summary() for f in finals)
    # Fenced means refused: no zombie, continued, may be told its work went through
    # ("ok"). (One that never ends is killed by the harness and wrote nothing: the
    # store comparison above tells; its end shows in the measured text.)
    refused = not any(f.ok for f in finals)
    ok = not failed and done and fenced and refused and c == EFFECTS_ONCE
    text = joined(
        f"{len(zombies)} zombie(s): {zombie_ends}",
        "" if fenced else store_diff(before, after),
        "" if refused else "a zombie was told its work went through",
        "" if done else f"recovery ended {status_of(recover)}",
        effects_text(c),
        failed,
    )
    return {39: raced(Verdict(ok, text, sat), gap)}


def _zombie_end(ctx: Context, worker: Worker, whole: Outcome) -> Outcome:
    """How a continued zombie's operation ended."""
    if not whole.ok:
        return whole
    (outcome,) = ctx.finish_ops(worker, 1)
    return outcome


#: Scenario name -> the function that runs and judges it.
RUNNERS: dict[str, Callable[[Context], dict[int, Verdict]]] = {
    "SEQ": seq,
    "SEQ-XPROC": seq_xproc,
    "RESUME-TWICE": resume_twice,
    "RESUME-VALUE": resume_value,
    "MULTI-INTERRUPT": multi_interrupt,
    "CRASH-BEFORE-EFFECT": crash_before_effect,
    "CRASH-AFTER-EFFECT": crash_after_effect,
    "CRASH-AFTER-STEP": crash_after_step,
    "CRASH-DURING-RESUME": crash_during_resume,
    "RECOVER-TWICE": recover_twice,
    "RECOVER-KILLED": recover_killed,
    "INVALID-STEP-WRITE": invalid_step_write,
    "INVALID-EXTERNAL-UPDATE": invalid_external_update,
    "INVALID-RESUME-VALUE": invalid_resume_value,
    "CORRUPT-RECORD": corrupt_record,
    "VERSION-MISMATCH": version_mismatch,
    "REPLAY-NO-TOKEN": replay_no_token,
    "FORK-TOKEN": fork_token,
    "FORK-TOKEN-AGAIN": fork_token_again,
    "FORK-EFFECTS": fork_effects,
    "FORK-VS-CONSUME": fork_vs_consume,
    "FORK-RACE": fork_race,
    "K2-PROC": k2_proc,
    "K4-PROC": k4_proc,
    "K8-PROC": k8_proc,
    "K16-PROC": k16_proc,
    "K8-THREADS": k8_threads,
    "K8-VALUES": k8_values,
    "K8-DEAD-WINNER": k8_dead_winner,
    "K8-ZOMBIE": k8_zombie,
}
