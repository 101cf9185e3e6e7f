"""Outside probes of `RemitStatePersistence`, round 43: a charge left in doubt inside a
node (its process SIGKILLed after the card was charged, or the payment call raising
after it reached its target) and the code fixed before the run goes on; a rolling
upgrade (`workflow_version` / `accept_versions`) met by a crash after the charge and by
a worker of the old version; an effect with a key of its own (`key=`, one mail per
order) called on a fork and on its line; and history kept small with `Remit.prune`
while a node or a pause was edited; on SQLite, PostgreSQL and Redis, in real forked
processes.

Found:

- P2: a node edited by `update_state` (after it raised once its charge was recorded, or
  after its charge was left in doubt) keys its effects by the node edited, which the
  shim found by walking from the edit to its parents. `Remit.prune(keep_last=1)` deletes
  those parents: the walk stopped at the edit, the node ran under the edit's own id, and
  the card was charged a second time under another idempotency key (`reconcile=` truly
  answered "not applied" for that key). An edit now keeps the ids of the pause it
  edits (`pause_ids`), so its effects keep their key once history is pruned.
- P5 / liveness: after the same prune, an answer naming its pause by the id `paused()`
  gave when the question was asked (as the README asks, an edit keeps that id) was
  refused with `UnknownPause` ("no snapshot of this run") and the run stayed paused. It
  is taken now, from the ids the edit keeps.
- Errors: `load_all()` of a pruned run raised `UnknownRecord` at the first snapshot
  pruned, so the README's recipes that read a run's last snapshot (a child graph's
  result, a run that goes on from the last one's final state) failed once history was
  kept small. It returns the line as kept, oldest first.
- P2 (found here, fixed in the core: tests/test_core_probes31.py): an effect with a key
  of its own names one effect of the whole run, forks included, but what keeps two
  callers apart is the claim of a branch. A fork whose node called it while the line's
  live holder had recorded its intent and not yet sent (stopped there) took the intent
  for one in doubt, asked `reconcile` (which truly answered "not sent") and sent it;
  the line then sent it too. The fork now finds the intent in flight and is told to
  come back (`EffectInFlight`), having sent nothing.

Held: a charge in doubt (killed, or the payment call raising after it reached its
target) stops every later attempt with `EffectInDoubt`, gives the claim back, leaves
the node `error` and charges nothing; the code fixed with `reconcile=` ends the run with
the one charge. A new version recovering an old version's in-doubt charge reconciles it
under the old key. An old-version worker on a run the new version wrote gets
`VersionMismatch` from every entry point and holds no claim. A keyed mail on a fork of
an ended run hands back the line's receipt; stopped after sending, the line's mail is
not sent again by the fork. Two runs with one user key each mail once,
and one fork token used on two runs makes a branch of each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot
from test_pydantic_graph_persistence import (
    Answer,
    Start,
    World,
    drive,
    in_child,
    statuses,
    to_pause,
)
from test_pydantic_graph_persistence import persistence as order_persistence

from remit_core import EffectInDoubt, ResumeConflict, VersionMismatch, arun_effect, failpoints
from remit_core.conformance.processes import fork
from remit_pydantic_graph import RemitStatePersistence

#: A lease no test waits out: a claim left held shows as `ResumeConflict`.
LONG = 30.0
#: A lease a test waits out after a SIGKILL.
SHORT = 1.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- a shop: open, bill (the card), mail (keyed by the order), end ---------------------------


@dataclass
class Basket:
    order: str = "o-1"
    receipts: list[str] = field(default_factory=list)


ShopCtx = GraphRunContext[Basket, World]


@dataclass
class Open(BaseNode[Basket, World, str]):
    async def run(self, ctx: ShopCtx) -> Bill:
        ctx.deps.enter("open")
        return Bill()


@dataclass
class Bill(BaseNode[Basket, World, str]):
    """Charges the card. The world's folder says how the code of the day calls it:
    `reconcile` (the fixed code asks the payment API "did key K happen?"), `times-out`
    (the payment call reaches its target, then raises, once) and `fails-after` (the
    node raises once after the charge was recorded)."""

    async def run(self, ctx: ShopCtx) -> Mail:
        ctx.deps.enter("bill")
        sink, folder = ctx.deps.sink, ctx.deps.folder

        async def apply(key: str) -> str:
            receipt = sink.apply("bill", key)
            if (folder / "times-out").exists():
                (folder / "times-out").unlink()
                raise TimeoutError("payment API: no reply (the card was charged)")
            return receipt

        fixed = (folder / "reconcile").exists()
        receipt = await arun_effect("bill", apply, reconcile=sink.reconcile if fixed else None)
        if (folder / "fails-after").exists():
            (folder / "fails-after").unlink()
            raise RuntimeError("the ledger service is down (the card was charged)")
        ctx.state.receipts.append(receipt)
        return Mail()


@dataclass
class Mail(BaseNode[Basket, World, str]):
    """One mail per order, whichever line of the run sends it: a key of its own."""

    async def run(self, ctx: ShopCtx) -> End[str]:
        ctx.deps.enter("mail")
        sink = ctx.deps.sink

        async def send(key: str) -> str:
            return sink.apply("mail", key)

        receipt = await arun_effect(
            "mail", send, key=f"mail:{ctx.state.order}", reconcile=sink.reconcile
        )
        ctx.state.receipts.append(receipt)
        return End(" ".join(ctx.state.receipts))


SHOP = Graph(nodes=(Open, Bill, Mail), name="shop")


def shop(
    url: str, run_id: str, *, lease: float = LONG, fork_token: str | None = None
) -> RemitStatePersistence[Basket, str]:
    p: RemitStatePersistence[Basket, str] = RemitStatePersistence(
        url, run_id, lease=lease, fork_token=fork_token
    )
    p.set_graph_types(SHOP)
    return p


async def shop_on(p: RemitStatePersistence[Basket, str], world: World, start: Any = None) -> str:
    """Run the shop from `start` (or on from the stored head) to its End."""
    context = (
        SHOP.iter_from_persistence(p, deps=world)
        if start is None
        else SHOP.iter(start, state=Basket(), deps=world, persistence=p)
    )
    async with context as run:
        async for _ in run:
            pass
    assert run.result is not None
    return str(run.result.output)


def shop_line(url: str, run_id: str, fork_token: str | None = None) -> list[Any]:
    return asyncio.run(shop(url, run_id, fork_token=fork_token).load_all())


def after_lease(call: Callable[[], Any]) -> Any:
    """`call()` in a forked process, again while it gets `ResumeConflict` (a killed
    holder's claim, until its lease runs out); its last outcome."""
    deadline = time.monotonic() + 20 * SHORT
    while True:
        outcome = in_child(call)
        if not outcome.raised("ResumeConflict") or time.monotonic() > deadline:
            return outcome
        time.sleep(SHORT / 5)


# -- a charge in doubt, then the code fixed ---------------------------------------------------


@pytest.mark.parametrize("fault", ["killed", "raised"])
def test_a_charge_left_in_doubt_stops_the_run_until_the_code_can_tell(
    store_url: str, run_id: str, world: World, fault: str
) -> None:
    """P2/L1: `Bill` charges the card through an effect with neither `reconcile=` nor
    `idempotent=True` (the code of the day). Its process is SIGKILLed after the card was
    charged and before the outcome was recorded, or the payment call raises after it
    reached its target (a timeout): the charge is in doubt. Every later attempt to go on
    (`iter_from_persistence`, from two processes one after the other, each with a 30 s
    lease) raises `EffectInDoubt` and charges nothing; the second is not told
    `ResumeConflict` (the first gave its claim back), the node is left `error` and no
    `End` is written. The fixed code (`reconcile=` asking the payment API) then ends the
    run with the one charge's receipt: one charge, never a second attempt at the API."""
    if fault == "killed":

        def first() -> str:
            failpoints.arm("effect.after_apply", "kill")
            return asyncio.run(shop_on(shop(store_url, run_id, lease=SHORT), world, Open()))

        assert in_child(first).status == "killed"
    else:
        (world.folder / "times-out").touch()
        with pytest.raises(TimeoutError):
            asyncio.run(shop_on(shop(store_url, run_id), world, Open()))

    def go_on() -> str:
        return asyncio.run(shop_on(shop(store_url, run_id), World(world.folder)))

    tries = [after_lease(go_on), in_child(go_on)]
    assert [t.raised("EffectInDoubt") for t in tries] == [True, True], [t.summary() for t in tries]
    assert world.sink.counts() == {"bill": 1} and not world.sink.repeats()
    line = shop_line(store_url, run_id)
    assert [type(s.node).__name__ for s in line] == ["Open", "Bill"], line
    assert statuses(line) == ["success", "error"]
    with pytest.raises(EffectInDoubt):  # the instance's own error too, in this process
        asyncio.run(shop_on(shop(store_url, run_id), world))

    (world.folder / "reconcile").touch()  # the fixed code is deployed
    out = in_child(go_on)
    assert out.ok, out.summary()
    [(name, key, _)] = [a for a in world.sink.applications() if a[0] == "bill"]
    assert out.value.split()[0] == f"bill:{key}"
    assert world.sink.counts() == {"bill": 1, "mail": 1} and not world.sink.repeats()
    line = shop_line(store_url, run_id)
    assert statuses(line) == ["success"] * 3 + ["end"]
    assert world.entered()["bill"] == 5  # the first, two refusals, this process's, the fixed


# -- a rolling upgrade -------------------------------------------------------------------------


def test_a_new_version_recovering_an_old_versions_charge_keeps_its_key(
    store_url: str, run_id: str, world: World
) -> None:
    """P2/P6 across an upgrade: a run paused and answered under workflow version `v1`; the
    `v1` process is SIGKILLed after `Pay` charged the card and before the charge was
    recorded (in doubt). The `v2` deployment (`accept_versions={"v1"}`) recovers it: the
    charge is reconciled under the key `v1` charged with, not applied again, and the
    run ends as `v1` would have ended it."""

    async def paused() -> None:
        p = await to_pause(store_url, run_id, world)
        await p.resume(Answer("ann"))

    asyncio.run(paused())

    # (`to_pause` wrote under the default version ""; `v1` reads it.)
    def old_reads_it() -> Any:
        p = order_persistence(store_url, run_id, workflow_version="v1", accept_versions={""})
        failpoints.arm("effect.after_apply", "kill")
        return asyncio.run(drive(p, World(world.folder)))

    assert in_child(old_reads_it).status == "killed"
    [(_, key, _)] = list(world.sink.applications())

    def new() -> Any:
        p = order_persistence(store_url, run_id, workflow_version="v2", accept_versions={"", "v1"})
        return asyncio.run(drive(p, World(world.folder)))

    out = after_lease(new)
    assert out.ok and out.value == "paid 100", out.summary()
    assert world.sink.counts() == {"charge": 1} and not world.sink.repeats()
    assert [a[1] for a in world.sink.applications()] == [key]
    assert world.entered()["pay"] == 2 and world.entered()["done"] == 1


def test_an_old_version_worker_holds_no_claim_on_a_run_the_new_one_wrote(
    store_url: str, run_id: str, world: World
) -> None:
    """L1/P4 in a rolling upgrade: a run paused under `v1` is answered by the `v2`
    deployment (which reads `v1`). A `v1` worker still polling continues it with
    `iter_from_persistence`, answers it late, reads `paused()`: each raises
    `VersionMismatch` and leaves nothing behind, so a `v2` worker (30 s lease) goes on at
    once, not after a lease, and ends the run with one charge."""

    async def begin() -> None:
        p = order_persistence(store_url, run_id, workflow_version="v1")
        assert await drive(p, world, Start()) == "paused"
        q = order_persistence(store_url, run_id, workflow_version="v2", accept_versions={"v1"})
        await q.resume(Answer("ann"))

    asyncio.run(begin())
    before = asyncio.run(
        order_persistence(
            store_url, run_id, workflow_version="v2", accept_versions={"v1"}
        ).load_all()
    )

    def old_worker() -> list[str]:
        async def go() -> list[str]:
            seen = []
            p = order_persistence(store_url, run_id, workflow_version="v1", lease=LONG)
            for attempt in (
                lambda: drive(p, World(world.folder)),
                lambda: p.resume(Answer("bob")),
                lambda: p.paused(),
            ):
                try:
                    await attempt()
                    seen.append("ok")
                except VersionMismatch:
                    seen.append("VersionMismatch")
            return seen

        return asyncio.run(go())

    old = in_child(old_worker)
    assert old.ok and old.value == ["VersionMismatch"] * 3, old.summary()

    def new_worker() -> Any:
        p = order_persistence(
            store_url, run_id, workflow_version="v2", accept_versions={"v1"}, lease=LONG
        )
        return asyncio.run(drive(p, World(world.folder)))

    new = in_child(new_worker)
    assert new.ok and new.value == "paid 100", new.summary()
    assert world.sink.counts() == {"charge": 1}
    after = asyncio.run(
        order_persistence(
            store_url, run_id, workflow_version="v2", accept_versions={"v1"}
        ).load_all()
    )
    assert [s.id for s in after[: len(before)]] == [s.id for s in before]
    assert after[-1].state["approved_by"] == "ann"
    assert world.entered().get("answer") == 1


# -- a key of its own across a fork -----------------------------------------------------------


def test_a_keyed_mail_is_sent_once_across_a_fork_and_its_line(
    store_url: str, run_id: str, world: World
) -> None:
    """P2/P3: the run ends on its line, mailing once (`key="mail:o-1"`). A fork from `Bill`
    (an operator re-billing) runs `Bill` again as its own work (a second charge, under
    another key, as the README says) and `Mail` again: the mail is the run's one mail,
    its recorded receipt handed back, not sent again. Run again with the same token from
    another process, the fork gives the same outputs and applies nothing."""
    (world.folder / "reconcile").touch()
    main = asyncio.run(shop_on(shop(store_url, run_id), world, Open()))
    bill = next(s for s in shop_line(store_url, run_id) if isinstance(s.node, Bill))

    async def refork() -> str:
        q = await shop(store_url, run_id).fork(bill.id, "rebill")
        return await shop_on(q, World(world.folder))

    first = in_child(lambda: asyncio.run(refork()))
    assert first.ok, first.summary()
    mail = main.split()[1]
    assert first.value.split()[1] == mail and first.value.split()[0] != main.split()[0]
    assert world.sink.counts() == {"bill": 2, "mail": 1} and not world.sink.repeats()

    def again() -> Any:
        return asyncio.run(shop(store_url, run_id, fork_token="rebill").load_all())[-1].result.data

    second = in_child(again)
    assert second.ok and second.value == first.value, second.summary()
    assert world.sink.counts() == {"bill": 2, "mail": 1}
    assert isinstance(shop_line(store_url, run_id)[-1], EndSnapshot)


@pytest.mark.parametrize(
    "point",
    [
        "effect.after_intent",
        "effect.after_apply",
    ],
)
def test_a_keyed_mail_racing_on_a_fork_and_its_line_is_sent_once(
    store_url: str, run_id: str, world: World, point: str
) -> None:
    """P2 across forks: the line stops before `Mail`; a fork of `Bill` (its own token) is
    made. The line's process reaches the mail (`key="mail:o-1"`, with a `reconcile=` that
    asks the mail service) and is stopped (SIGSTOP) after recording its intent, before it
    sends (`effect.after_intent`), or after it sent, before recording that
    (`effect.after_apply`). Its claim, on the line, stays live (30 s): it is no zombie
    whose lease was taken over. The fork's process, on a branch and a claim of its own,
    runs `Bill` and `Mail`, and then the line's process goes on. The mail is one effect of
    the run: the service must be asked to send it once, and both lines end with that
    mail's receipt (or the fork is told to come back, having sent nothing).

    Found: stopped before sending, the line's mail was sent by the fork too (the
    service's key rule alone kept the second one out)."""
    (world.folder / "reconcile").touch()

    async def to_mail() -> None:
        p = shop(store_url, run_id)
        async with SHOP.iter(Open(), state=Basket(), deps=world, persistence=p) as run:
            async for node in run:
                if isinstance(node, Mail):
                    break

    asyncio.run(to_mail())
    bill = next(s for s in shop_line(store_url, run_id) if isinstance(s.node, Bill))
    asyncio.run(shop(store_url, run_id).fork(bill.id, "rebill"))

    def line() -> str:
        failpoints.arm(point, "stop")
        return asyncio.run(shop_on(shop(store_url, run_id), World(world.folder)))

    held = fork(line)
    try:
        stopped = held.wait(60, stopped_counts=True)
        assert stopped.status == "stopped", stopped.summary()
        on_fork = in_child(
            lambda: asyncio.run(
                shop_on(shop(store_url, run_id, fork_token="rebill"), World(world.folder))
            )
        )
        held.cont()
        done = held.wait(60)
    finally:
        held.kill()
        held.wait(10)
    seen = (on_fork.summary(), done.summary(), list(world.sink.applications()))
    assert world.sink.counts()["mail"] == 1, seen
    assert not world.sink.repeats(), seen  # the mail service was asked to send it once
    assert done.ok, seen
    if on_fork.ok:
        assert on_fork.value.split()[1] == done.value.split()[1], seen
    else:  # told to come back, not sent
        assert on_fork.raised("EffectInDoubt", "ResumeConflict"), seen


def test_one_key_in_two_runs_is_two_mails(store_url: str, run_id: str, world: World) -> None:
    """P2 isolation: two orders' runs share the effect key `mail:o-1` (a key unique in the
    run, as the README asks, not in the store): each run mails once, under an
    idempotency key of its own, and a second pass over both sends nothing."""
    (world.folder / "reconcile").touch()
    outs = [
        asyncio.run(shop_on(shop(store_url, rid), world, Open())) for rid in (run_id, run_id + "-b")
    ]
    assert world.sink.counts() == {"bill": 2, "mail": 2}
    mails = [o.split()[1] for o in outs]
    assert len(set(mails)) == 2, mails
    for rid, out in zip((run_id, run_id + "-b"), outs, strict=True):
        assert shop_line(store_url, rid)[-1].result.data == out
    assert world.sink.counts() == {"bill": 2, "mail": 2} and not world.sink.repeats()


# -- an edited node whose first snapshot was pruned ---------------------------------------------


@pytest.mark.parametrize("fault", ["raised", "killed"])
def test_a_node_edited_after_its_charge_keeps_its_key_once_history_is_pruned(
    store_url: str, run_id: str, world: World, fault: str
) -> None:
    """P2 with history upkeep: `Bill` charged the card and then raised (the charge
    recorded), or its process was SIGKILLed after the charge and before the record (in
    doubt; the code then gains `reconcile=`). An operator edits the state at the node
    (`update_state`, which stores the node again as a new snapshot: its effects stay keyed
    by the node edited), then the store is kept small with `Remit.prune(keep_last=1)`,
    which deletes every snapshot but the head: the node edited too. The run then goes
    on: the card was charged once, under one key; the service is never asked again."""
    if fault == "raised":
        (world.folder / "fails-after").touch()
        with pytest.raises(RuntimeError, match="ledger service"):
            asyncio.run(shop_on(shop(store_url, run_id), world, Open()))
    else:

        def first() -> str:
            failpoints.arm("effect.after_apply", "kill")
            return asyncio.run(shop_on(shop(store_url, run_id, lease=SHORT), world, Open()))

        assert in_child(first).status == "killed"
        again = after_lease(
            lambda: asyncio.run(shop_on(shop(store_url, run_id), World(world.folder)))
        )
        assert again.raised("EffectInDoubt"), again.summary()  # `Bill` is `error` now
    (world.folder / "reconcile").touch()

    async def edit() -> str:
        p = shop(store_url, run_id)
        pause = await p.paused()
        assert pause is not None and isinstance(pause.node, Bill), pause
        edited = await p.update_state(Basket(order="o-1", receipts=["edited"]), pause_id=pause.id)
        return edited.id

    edited = asyncio.run(edit())
    remit = shop(store_url, run_id).remit
    assert remit.prune([run_id], keep_last=1) >= 1
    out = in_child(lambda: asyncio.run(shop_on(shop(store_url, run_id), World(world.folder))))
    seen = (out.summary(), list(world.sink.applications()))
    assert out.ok, seen
    assert world.sink.counts() == {"bill": 1, "mail": 1}, seen
    [(_, key, _)] = [a for a in world.sink.applications() if a[0] == "bill"]
    assert out.value.split()[:2] == ["edited", f"bill:{key}"], seen
    assert not world.sink.repeats(), seen
    assert shop_line(store_url, run_id)[-1].result.data == out.value
    assert edited


@pytest.mark.parametrize("edits", [1, 2])
def test_an_answer_naming_its_pause_is_taken_after_the_edited_pause_was_pruned(
    store_url: str, run_id: str, world: World, edits: int
) -> None:
    """P5 with history upkeep: a client is handed the pause's id (`paused()`), an operator
    edits the state there (once, or twice, the second edit naming the first's id), and
    `Remit.prune(keep_last=1)` deletes every snapshot but the head, the pause as first
    asked among them. The client's answer, naming
    the pause by the id it was given when the question was asked, is taken at the edited
    pause, not refused as naming no snapshot of the run (`UnknownPause`, as it was), and
    the run ends with the edits and the answer, charging once; `load_all()` lists the
    line as kept (it raised `UnknownRecord` at the first snapshot pruned); an answer naming any of
    the pause's ids after that is late (`ResumeConflict`), and nothing is stored."""

    async def ask_and_edit() -> list[str]:
        await to_pause(store_url, run_id, world)
        ids = []
        for n in range(edits):
            p = order_persistence(store_url, run_id)
            pause = await p.paused()
            assert pause is not None
            ids.append(pause.id)
            state = {**pause.state, "log": [*pause.state["log"], f"edit{n}"]}
            await p.update_state(state, pause_id=pause.id)
        return ids

    ids = asyncio.run(ask_and_edit())
    remit = order_persistence(store_url, run_id).remit
    assert remit.prune([run_id], keep_last=1) == 1 + edits  # `Start`, the pause, its edits
    kept = asyncio.run(order_persistence(store_url, run_id).paused())
    assert kept is not None and type(kept.node).__name__ == "Ask"
    assert kept.state["log"] == ["start"] + [f"edit{n}" for n in range(edits)]

    def answer(pause_id: str) -> Any:
        async def go() -> Any:
            await order_persistence(store_url, run_id).resume(Answer("ann"), pause_id=pause_id)
            return await drive(order_persistence(store_url, run_id), World(world.folder))

        return asyncio.run(go())

    out = in_child(lambda: answer(ids[0]))  # the id the question was asked with
    assert out.ok and out.value == "paid 100", out.summary()
    line = asyncio.run(order_persistence(store_url, run_id).load_all())  # the line as kept
    assert [type(s.node).__name__ for s in line[:-1]] == ["Ask", "Answer", "Pay", "Done"]
    assert line[0].id == kept.id and statuses(line) == ["created"] + ["success"] * 3 + ["end"]
    for late in ids:  # after the answer: late, under each id the pause had
        # (an id pruned since is refused as `UnknownPause`, still a `ResumeConflict`)
        with pytest.raises(ResumeConflict):
            asyncio.run(order_persistence(store_url, run_id).resume(Answer("bob"), pause_id=late))
    again = asyncio.run(order_persistence(store_url, run_id).load_all())
    assert [s.id for s in again] == [s.id for s in line]  # nothing stored
    assert line[-1].state["approved_by"] == "ann"
    assert line[-1].state["log"][: 1 + edits] == kept.state["log"]
    assert world.sink.counts() == {"charge": 1}


def test_one_fork_token_on_two_runs_makes_a_branch_of_each(
    store_url: str, run_id: str, world: World
) -> None:
    """P3 isolation: an operator's tool names every re-bill fork `"rebill"`, on two orders'
    runs. Each token names a branch of its own run: each fork runs from its own run's
    `Bill` with that run's state, ends with its own receipts, and a token presented again
    on one run finds that run's fork, not the other's."""
    (world.folder / "reconcile").touch()
    runs = {run_id: "o-1", run_id + "-b": "o-2"}

    async def go() -> dict[str, str]:
        ends = {}
        for rid, order in runs.items():
            p = shop(store_url, rid)
            async with SHOP.iter(
                Open(), state=Basket(order=order), deps=world, persistence=p
            ) as run:
                async for _ in run:
                    pass
            bill = next(s for s in await p.load_all() if isinstance(s.node, Bill))
            ends[rid] = await shop_on(await p.fork(bill.id, "rebill"), world)
        return ends

    ends = asyncio.run(go())
    assert world.sink.counts() == {"bill": 4, "mail": 2}
    for rid, order in runs.items():
        line = shop_line(store_url, rid, fork_token="rebill")
        assert line[-1].result.data == ends[rid]
        assert [s.state.order for s in line] == [order] * len(line)
        assert shop_line(store_url, rid)[-1].result.data != ends[rid]  # the line's own End
    assert ends[run_id] != ends[run_id + "-b"]
