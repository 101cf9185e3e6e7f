"""Process-level faults on workflow shapes other than the conformance probe, on SQLite,
PostgreSQL and Redis: a loop that pauses once per round (SIGKILLed mid-round, then
raced for by k processes), drivers paused (SIGSTOP) past their lease in a fan-out
worker, in a child run and in a fork of a fork, a SIGKILL during the resume of a
fork, racers for two parallel waiters, and a recovery overtaken by another process
between reading the head and claiming the run: `rt.recover` raised
`ForkWithoutIntent` (telling the user to pass a fork token) where a resumer that
lost the race gets `ResumeConflict`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, enter, entered, pay, payments
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from remit_llamaindex.probe import _settle as settle

GUARD = 20
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe10-{uuid.uuid4().hex[:12]}"


applied = payments


def crash_here(point: str) -> None:
    if os.environ.get("PROBE10_CRASH") == point:
        os.kill(os.getpid(), signal.SIGKILL)


async def stall_here(point: str) -> None:
    if os.environ.get("PROBE10_STALL") == point:
        enter(f"stalled:{point}")
        await asyncio.sleep(1.5)


# -- a loop that pauses once per round ------------------------------------------------


class Round(Event):
    n: int


class Loop(Workflow):
    """`ask` waits for an answer each round, pays for it, and loops for three rounds."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def begin(self, ctx: Context, ev: StartEvent) -> Round:
        enter("begin")
        await ctx.store.set("answers", [])
        return Round(n=1)

    @step
    async def ask(self, ctx: Context, ev: Round) -> Round | StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent,
            waiter_event=InputRequiredEvent(prefix=f"round {ev.n}"),
            timeout=None,
        )
        enter(f"ask:{ev.n}")
        pay(f"{ev.n}:{answer.response}")
        crash_here(f"paid:{ev.n}")
        await stall_here(f"paid:{ev.n}")
        answers = await ctx.store.get("answers")
        await ctx.store.set("answers", [*answers, answer.response])
        if ev.n == 3:
            return StopEvent(result=[*answers, answer.response])
        return Round(n=ev.n + 1)


async def until_parked(handler: Any) -> str:
    return await asyncio.wait_for(settle(handler), GUARD)


async def recovered(rt: RemitRuntime, flow: Workflow, run: str) -> Any:
    """`rt.recover` once the dead holder's lease has run out."""
    deadline = time.monotonic() + GUARD
    while True:
        try:
            return rt.recover(flow, run)
        except ResumeConflict:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)


LOOP_DRIVER = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from workflows.events import HumanResponseEvent
from test_llamaindex_probes10 import Loop, until_parked

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    rt.remit
    while time.time() < {at!r}:
        time.sleep(0.001)
    try:
        handler = await rt.respond(Loop(runtime=rt), {run!r}, HumanResponseEvent(response={who!r}))
    except ResumeConflict:
        print("CONFLICT", flush=True)
        return
    print("WON", await until_parked(handler), {who!r}, flush=True)

asyncio.run(main())
"""


def answer_in_processes(
    url: str, run: str, who: list[str], tmp: Path, crash: str = ""
) -> list[subprocess.CompletedProcess[str]]:
    """Each name answers `run` from its own process, all at the same instant."""
    env = {**os.environ, DIR_VAR: str(tmp), "PROBE10_CRASH": crash}
    at = time.time() + 2.5
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOOP_DRIVER.format(tests=TESTS, url=url, run=run, who=name, at=at),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in who
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def test_a_loop_crashed_mid_round_then_raced_pays_each_round_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 1 is answered here; round 2's answer is taken by a process SIGKILLed right
    after it paid; a recovery elsewhere finishes round 2 without asking again; 4
    processes race to answer round 3: one proceeds, 3 get `ResumeConflict` and enter
    no step. Each round pays once, with the answer that was acknowledged."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def first_round() -> None:
        rt = RemitRuntime(store_url, lease=1)
        assert await until_parked(Loop(runtime=rt).run(run_id=run)) == "paused"
        handler = await rt.respond(Loop(runtime=rt), run, HumanResponseEvent(response="ada"))
        assert await until_parked(handler) == "paused"

    asyncio.run(first_round())
    (dead,) = answer_in_processes(store_url, run, ["bob"], tmp_path, crash="paid:2")
    assert dead.returncode == -signal.SIGKILL, dead.stderr

    async def recover() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Loop(runtime=rt), run)
        assert handler is not None
        assert await until_parked(handler) == "paused"

    asyncio.run(recover())
    racers = answer_in_processes(store_url, run, [f"r{i}" for i in range(4)], tmp_path)
    outs = sorted(p.stdout.strip() for p in racers)
    assert outs[:3] == ["CONFLICT"] * 3, [(p.stdout, p.stderr) for p in racers]
    assert outs[3].startswith("WON done "), [(p.stdout, p.stderr) for p in racers]
    who = outs[3].split()[2]

    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed" and rt.result(run) == ["ada", "bob", who]
    assert entered(tmp_path) == ["begin", "ask:1", "ask:2", "ask:2", "ask:3"]
    paid = [line.split()[1] for line in applied(tmp_path)]
    assert paid == ["1:ada", "2:bob", f"3:{who}"]


# -- a fan-out whose driver is paused past its lease ----------------------------------


class Item(Event):
    name: str


class Shipped(Event):
    name: str


class Fan(Workflow):
    """`start` sends one `Item` per name; three `work` workers pay for each; `gather`
    collects them. The worker of the item named in `PROBE10_STALL` stalls before
    (or, with `PROBE10_STALL_AFTER`, after) it pays."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        enter("start")
        names = list(ev.get("names"))
        await ctx.store.set("count", len(names))
        for name in names:
            ctx.send_event(Item(name=name))
        return None

    @step(num_workers=3)
    async def work(self, ctx: Context, ev: Item) -> Shipped:
        enter(f"work:{ev.name}")
        stall = os.environ.get("PROBE10_STALL") == ev.name
        after = bool(os.environ.get("PROBE10_STALL_AFTER"))
        if stall and not after:
            enter(f"stalled:{ev.name}")
            await asyncio.sleep(1.5)
        pay(f"item:{ev.name}")
        crash_here(f"paid:{ev.name}")
        if stall and after:
            enter(f"stalled:{ev.name}")
            await asyncio.sleep(1.5)
        await ctx.store.set(f"done:{ev.name}", True)
        return Shipped(name=ev.name)

    @step
    async def gather(self, ctx: Context, ev: Shipped) -> StopEvent | None:
        got = ctx.collect_events(ev, [Shipped] * await ctx.store.get("count"))
        if got is None:
            return None
        enter("gather")
        return StopEvent(result=sorted(e.name for e in got))


FAN_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes10 import Fan

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    try:
        result = await Fan(runtime=rt).run(run_id={run!r}, names=["a", "b", "c"])
        print("RESULT", result, flush=True)
    except Exception as exc:
        print("STOPPED", type(exc).__name__, flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("after", [False, True], ids=["before-pay", "after-pay"])
def test_a_fan_out_driver_paused_past_its_lease_is_fenced(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: bool
) -> None:
    """L2, P2: the driver is SIGSTOPped while the worker of "c" is in flight (before or
    after it paid); another process takes the run over once the lease ran out and
    finishes it; the paused driver, continued, writes nothing more and pays nothing
    more. Each item is paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    env = {
        **os.environ,
        "PROBE10_STALL": "c",
        "PROBE10_STALL_AFTER": "1" if after else "",
    }
    code = FAN_DRIVER.format(tests=TESTS, url=store_url, run=run)
    zombie = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + GUARD
        while "stalled:c" not in entered(tmp_path):
            assert time.monotonic() < deadline and zombie.poll() is None
            time.sleep(0.02)
        os.kill(zombie.pid, signal.SIGSTOP)
        time.sleep(1.5)  # the paused holder's lease runs out

        async def take_over() -> Any:
            rt = RemitRuntime(store_url, lease=1)
            handler = await recovered(rt, Fan(runtime=rt), run)
            assert handler is not None
            return await asyncio.wait_for(handler, GUARD)

        assert asyncio.run(take_over()) == ["a", "b", "c"]
        rt = RemitRuntime(store_url)
        head = rt.checkpoints(run)[0]
        assert head.status == "completed"
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = zombie.communicate(timeout=GUARD)
    assert out.strip() == "STOPPED Fenced", (out, err)
    assert rt.checkpoints(run)[0] == head
    keys = [line.split()[0] for line in applied(tmp_path)]
    assert len(keys) == len(set(keys)) == 3, applied(tmp_path)
    assert entered(tmp_path).count("gather") == 1


# -- a SIGKILL during the resume of a fork --------------------------------------------

FORK_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from workflows.events import HumanResponseEvent
from test_llamaindex_probes10 import Loop, until_parked

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    fork = rt.fork({run!r}, {base!r}, {token!r})
    print("FORK", fork, flush=True)
    handler = await rt.respond(Loop(runtime=rt), fork, HumanResponseEvent(response={who!r}))
    print("ACK", flush=True)
    print("DONE", await until_parked(handler), flush=True)

asyncio.run(main())
"""


def test_a_fork_killed_during_its_resume_is_recovered_on_its_own_branch(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P2, P3, L3: a run paused in round 2 is forked with a token by a process that
    answers the fork and is SIGKILLed right after round 2 paid. Presenting the token again
    elsewhere names the same branch; recovering it finishes round 2 with the
    acknowledged answer, without paying again; the original branch's round 2 is still
    pending and is answered on its own. Round 1, paid before the fork, is paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def two_rounds_in() -> str:
        rt = RemitRuntime(store_url, lease=1)
        assert await until_parked(Loop(runtime=rt).run(run_id=run)) == "paused"
        handler = await rt.respond(Loop(runtime=rt), run, HumanResponseEvent(response="ada"))
        assert await until_parked(handler) == "paused"
        return rt.checkpoints(run)[0].checkpoint_id

    base = asyncio.run(two_rounds_in())
    code = FORK_DRIVER.format(tests=TESTS, url=store_url, run=run, base=base, token="t", who="eve")
    env = {**os.environ, "PROBE10_CRASH": "paid:2"}
    dead = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert dead.returncode == -signal.SIGKILL, dead.stderr
    assert dead.stdout.split()[2] == "ACK", dead.stdout
    fork = dead.stdout.split()[1]

    async def finish() -> None:
        rt = RemitRuntime(store_url, lease=1)
        assert rt.fork(run, base, "t") == fork
        handler = await recovered(rt, Loop(runtime=rt), fork)
        assert handler is not None
        assert await until_parked(handler) == "paused"
        for branch, who in ((fork, "eve3"), (run, "bob"), (run, "bob3")):
            handler = await rt.respond(Loop(runtime=rt), branch, HumanResponseEvent(response=who))
            await until_parked(handler)
        assert rt.result(fork) == ["ada", "eve", "eve3"]
        assert rt.result(run) == ["ada", "bob", "bob3"]

    asyncio.run(finish())
    paid = sorted(line.split()[1] for line in applied(tmp_path))
    assert paid == ["1:ada", "2:bob", "2:eve", "3:bob3", "3:eve3"], applied(tmp_path)
    keys = [line.split()[0] for line in applied(tmp_path)]
    assert len(keys) == len(set(keys))
    assert entered(tmp_path).count("ask:1") == 1 and entered(tmp_path).count("begin") == 1


# -- two waiters in parallel branches, raced for from many processes ------------------


class NeedA(Event):
    pass


class NeedB(Event):
    pass


class AnsA(HumanResponseEvent):
    pass


class AnsB(HumanResponseEvent):
    pass


class GotA(Event):
    who: str


class GotB(Event):
    who: str


class Pair(Workflow):
    """`begin` opens two branches; `left` waits for an `AnsA`, `right` for an `AnsB`;
    each pays with its answer; `end` joins them."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def begin(self, ctx: Context, ev: StartEvent) -> NeedA | NeedB | None:
        enter("begin")
        ctx.send_event(NeedA())
        ctx.send_event(NeedB())
        return None

    @step
    async def left(self, ctx: Context, ev: NeedA) -> GotA:
        answer = await ctx.wait_for_event(
            AnsA, waiter_event=InputRequiredEvent(prefix="a?"), timeout=None
        )
        enter("left")
        return GotA(who=pay(f"a:{answer.response}"))

    @step
    async def right(self, ctx: Context, ev: NeedB) -> GotB:
        answer = await ctx.wait_for_event(
            AnsB, waiter_event=InputRequiredEvent(prefix="b?"), timeout=None
        )
        enter("right")
        return GotB(who=pay(f"b:{answer.response}"))

    @step
    async def end(self, ctx: Context, ev: GotA | GotB) -> StopEvent | None:
        got = ctx.collect_events(ev, [GotA, GotB])
        if got is None:
            return None
        enter("end")
        return StopEvent(result=sorted(e.who for e in got))


PAIR_RACER = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes10 as t

async def main():
    rt = RemitRuntime({url!r}, lease=2)
    rt.remit
    answer = getattr(t, {kind!r})(response={who!r})
    while time.time() < {at!r}:
        time.sleep(0.001)
    try:
        handler = await rt.respond(t.Pair(runtime=rt), {run!r}, answer)
    except ResumeConflict:
        print("CONFLICT", flush=True)
        return
    print("WON", {who!r}, await t.until_parked(handler), flush=True)

asyncio.run(main())
"""


def test_racers_for_two_parallel_waiters_each_consume_at_most_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2: 3 processes answer the left waiter and 3 the right one, at once. Of each
    side at most one proceeds and its branch runs once; every other racer gets
    `ResumeConflict`; a side nobody won is still pending and its answer then finishes
    the run. Each branch pays once, with its winner's answer."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def start() -> None:
        rt = RemitRuntime(store_url, lease=2)
        assert await until_parked(Pair(runtime=rt).run(run_id=run)) == "paused"

    asyncio.run(start())
    at = time.time() + 2.5
    racers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                PAIR_RACER.format(tests=TESTS, url=store_url, run=run, kind=kind, who=who, at=at),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kind, side in (("AnsA", "a"), ("AnsB", "b"))
        for who in (f"{side}0", f"{side}1", f"{side}2")
    ]
    outs = [p.communicate(timeout=60) for p in racers]
    won = [o.split()[1] for o, _ in outs if o.startswith("WON")]
    assert len([o for o, _ in outs if o.startswith("CONFLICT")]) == 6 - len(won), outs
    assert 1 <= len(won) <= 2 and len({w[0] for w in won}) == len(won), outs

    async def finish() -> Any:
        rt = RemitRuntime(store_url, lease=2)
        for kind, side in ((AnsA, "a"), (AnsB, "b")):
            if not any(w.startswith(side) for w in won):
                handler = await rt.respond(Pair(runtime=rt), run, kind(response=f"{side}9"))
                await until_parked(handler)
                won.append(f"{side}9")
        return rt.result(run)

    assert asyncio.run(finish()) == sorted(f"{w[0]}:{w}" for w in won)
    assert sorted(entered(tmp_path)) == ["begin", "end", "left", "right"]
    assert sorted(line.split()[1] for line in applied(tmp_path)) == sorted(
        f"{w[0]}:{w}" for w in won
    )


# -- a fork of a fork whose resumer is paused past its lease --------------------------

FORK_ZOMBIE = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from workflows.events import HumanResponseEvent
from test_llamaindex_probes10 import Loop

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    try:
        handler = await rt.respond(Loop(runtime=rt), {run!r}, HumanResponseEvent(response="zed"))
        print("RESULT", await handler, flush=True)
    except Exception as exc:
        print("STOPPED", type(exc).__name__, flush=True)

asyncio.run(main())
"""


def test_a_paused_resumer_of_a_fork_of_a_fork_is_fenced(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2, P2, P3: a fork of a fork is answered by a process SIGSTOPped after round 3
    paid; another process takes that branch over and finishes it without paying again;
    the continued process writes nothing. The fork it came from and the original run
    still wait where they were."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def forks() -> tuple[str, str]:
        rt = RemitRuntime(store_url, lease=1)
        assert await until_parked(Loop(runtime=rt).run(run_id=run)) == "paused"
        handler = await rt.respond(Loop(runtime=rt), run, HumanResponseEvent(response="ada"))
        assert await until_parked(handler) == "paused"
        first = rt.fork(run, rt.checkpoints(run)[0].checkpoint_id, "t1")
        handler = await rt.respond(Loop(runtime=rt), first, HumanResponseEvent(response="eve"))
        assert await until_parked(handler) == "paused"
        return first, rt.fork(first, rt.checkpoints(first)[0].checkpoint_id, "t2")

    first, second = asyncio.run(forks())
    code = FORK_ZOMBIE.format(tests=TESTS, url=store_url, run=second)
    env = {**os.environ, "PROBE10_STALL": "paid:3"}
    zombie = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + GUARD
        while "stalled:paid:3" not in entered(tmp_path):
            assert time.monotonic() < deadline and zombie.poll() is None
            time.sleep(0.02)
        os.kill(zombie.pid, signal.SIGSTOP)
        time.sleep(1.5)

        async def take_over() -> Any:
            rt = RemitRuntime(store_url, lease=1)
            handler = await recovered(rt, Loop(runtime=rt), second)
            assert handler is not None
            return await asyncio.wait_for(handler, GUARD)

        assert asyncio.run(take_over()) == ["ada", "eve", "zed"]
        rt = RemitRuntime(store_url)
        head = rt.checkpoints(second)[0]
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = zombie.communicate(timeout=GUARD)
    assert out.strip() == "STOPPED Fenced", (out, err)
    assert rt.checkpoints(second)[0] == head and head.status == "completed"
    assert rt.status(first) == "waiting" and rt.status(run) == "waiting"
    paid = sorted(line.split()[1] for line in applied(tmp_path))
    assert paid == ["1:ada", "2:eve", "3:zed"], applied(tmp_path)


# -- a recoverer overtaken between reading the head and claiming the run --------------

FAN_RECOVER = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes10 import Fan, recovered

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = await recovered(rt, Fan(runtime=rt), {run!r})
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


def test_a_recoverer_overtaken_by_another_process_gets_resume_conflict(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, L1: the driver of a fan-out is SIGKILLed after item "b" paid. A recovery here
    reads the run's head; before it claims the run, another process recovers and
    finishes it. This one lost a race of resumers: `ResumeConflict`, no step entered
    here (it raised `ForkWithoutIntent`, telling the user to pass a fork token).
    Each item is paid once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = FAN_DRIVER.format(tests=TESTS, url=store_url, run=run)
    dead = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PROBE10_CRASH": "paid:b"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dead.returncode == -signal.SIGKILL, dead.stderr
    time.sleep(1.2)  # the dead driver's lease runs out

    rt = RemitRuntime(store_url, lease=1)
    read_head = rt.context

    def overtaken(workflow: Workflow, run_id: str, **kw: Any) -> Context[Any]:
        ctx = read_head(workflow, run_id, **kw)
        other = subprocess.run(
            [sys.executable, "-c", FAN_RECOVER.format(tests=TESTS, url=store_url, run=run)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.stdout.strip() == "RESULT ['a', 'b', 'c']", other.stderr
        return ctx

    monkeypatch.setattr(rt, "context", overtaken)
    with pytest.raises(ResumeConflict):
        rt.recover(Fan(runtime=rt), run)
    assert rt.status(run) == "completed" and rt.result(run) == ["a", "b", "c"]
    mine = str(os.getpid())
    journal = (tmp_path / "journal.txt").read_text().split("\n")
    assert not [line for line in journal if line.endswith(f" {mine}")]
    keys = [line.split()[0] for line in applied(tmp_path)]
    assert len(keys) == len(set(keys)) == 3, applied(tmp_path)
