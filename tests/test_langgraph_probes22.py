"""RemitSaver probed where the earlier rounds stopped: a config whose ids a store cannot
hold (an empty thread id, a NUL, a lone surrogate, an id that is not a str) gets an
error naming the config key a LangGraph user wrote; a run SIGKILLed inside a
subgraph's node after its effect, or with a `Send` fan-out half done, recovered twice
from copies of the one crashed store (P6). Real LangGraph, real stores on every engine,
real forked processes where the property is about processes."""

from __future__ import annotations

import asyncio
import operator
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import ormsgpack
import pytest
from langgraph.checkpoint.serde import jsonplus
from langgraph.checkpoint.serde.base import CipherProtocol
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import START, StateGraph
from langgraph.types import Send
from pydantic import BaseModel, field_validator
from test_langgraph_probes4 import CTX, LEASE, config
from test_langgraph_support import World
from typing_extensions import TypedDict

import remit_core
from remit_core.errors import CorruptRecord
from remit_core.records import WriteRecord
from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def one_step(saver: RemitSaver) -> Any:
    builder = StateGraph(Log)
    builder.add_node("a", lambda state: {"log": ["a"]})
    builder.add_edge(START, "a")
    return builder.compile(checkpointer=saver)


# -- config ids a store cannot hold -------------------------------------------------------

#: (configurable keys added to a good thread's config, the key the error must name, type).
BAD_IDS = [
    ({"thread_id": ""}, "thread_id", ValueError),
    ({"thread_id": "a\x00b"}, "thread_id", ValueError),
    ({"thread_id": "a\ud800"}, "thread_id", ValueError),
    ({"checkpoint_ns": "sub\x00"}, "checkpoint_ns", ValueError),
    ({"checkpoint_id": "1f0\x00"}, "checkpoint_id", ValueError),
    ({"checkpoint_id": 7}, "checkpoint_id", TypeError),
    ({"fork_token": "tok\x00"}, "fork_token", ValueError),
    ({"fork_token": "tok\udc80"}, "fork_token", ValueError),
    ({"fork_token": 7}, "fork_token", TypeError),
    ({"fork_token": 7, "checkpoint_id": "no-such-checkpoint"}, "fork_token", TypeError),
]


@pytest.mark.parametrize(("bad", "key", "error"), BAD_IDS)
def test_a_config_id_a_store_cannot_hold_is_refused_naming_its_config_key(
    url: str, bad: dict[str, Any], key: str, error: type[Exception]
) -> None:
    """Each way in (invoke, ainvoke, get_state, aget_state, get_state_history,
    update_state) refuses the config with a `TypeError`/`ValueError` whose message starts
    with the config key as LangGraph users write it (`thread_id`, not the core's
    `run_id`; `checkpoint_ns`, not `ns`; a `fork_token` that is not a str is not taken
    for a typo of a branch), before any node runs; the thread beside it is untouched."""
    saver = RemitSaver(url)
    graph = one_step(saver)
    good = config()
    graph.invoke({"log": []}, good)
    cfg = {"configurable": {**good["configurable"], **bad}}

    def history() -> Any:
        return list(graph.get_state_history(cfg))

    async def both_async() -> None:
        for call in (graph.ainvoke({"log": []}, cfg), graph.aget_state(cfg)):
            with pytest.raises(error) as raised:
                await call
            assert str(raised.value).startswith(f"{key} must "), str(raised.value)

    uses = {
        "invoke": lambda: graph.invoke({"log": []}, cfg),
        "get_state": lambda: graph.get_state(cfg),
        "get_state_history": history,
    }
    if "checkpoint_ns" not in bad:  # (LangGraph itself looks an edit's namespace up first)
        uses["update_state"] = lambda: graph.update_state(cfg, {"log": ["x"]})
    if "checkpoint_ns" in bad:  # (a top-level run takes no namespace from its config)
        del uses["invoke"]
    for name, use in uses.items():
        with pytest.raises(error) as raised:
            use()
        assert str(raised.value).startswith(f"{key} must "), (name, str(raised.value))
    if "checkpoint_ns" not in bad:
        asyncio.run(both_async())
    assert graph.get_state(good).values == {"log": ["a"]}
    assert len(list(graph.get_state_history(good))) == 3


# -- recovery from copies of one crashed store (P6) ------------------------------------------


def sub_paying(world: World, saver: RemitSaver) -> Any:
    """a -> sub (a compiled subgraph: s1 -> pay, which pays "charge" and may be killed
    after it) -> z."""

    @remit_core.effect(name="charge", reconcile=world.reconcile("charge"))
    def charge(*, idempotency_key: str) -> str:
        return world.apply("charge", idempotency_key)

    def pay(state: Log) -> dict[str, Any]:
        world.enter("pay")
        done = charge()
        world.point("pay.after_effect")
        return {"log": [done]}

    inner = StateGraph(Log)
    inner.add_node("s1", lambda state: world.enter("s1") or {"log": ["s1"]})
    inner.add_node("pay", pay)
    inner.add_edge(START, "s1")
    inner.add_edge("s1", "pay")
    outer = StateGraph(Log)
    outer.add_node("a", lambda state: world.enter("a") or {"log": ["a"]})
    outer.add_node("sub", inner.compile())
    outer.add_node("z", lambda state: world.enter("z") or {"log": ["z"]})
    outer.add_edge(START, "a")
    outer.add_edge("a", "sub")
    outer.add_edge("sub", "z")
    return outer.compile(checkpointer=saver)


def fan_paying(world: World, saver: RemitSaver) -> Any:
    """a -> three `Send` branches to `ship` (each pays "ship" for its item; the third
    is killed after its effect) -> z."""

    @remit_core.effect(name="ship", reconcile=world.reconcile("ship"))
    def ship_item(item: str, *, idempotency_key: str) -> str:
        return world.apply("ship", idempotency_key)  # (a key per branch: its task path)

    def ship(state: Log) -> dict[str, Any]:
        item = state["log"][-1]
        world.enter(f"ship {item}")
        ship_item(item)
        world.point(f"ship {item}.after_effect")
        return {"log": [f"shipped {item}"]}

    builder = StateGraph(Log)
    builder.add_node("a", lambda state: world.enter("a") or {"log": ["a"]})
    builder.add_node("ship", ship)
    builder.add_node("z", lambda state: world.enter("z") or {"log": ["z"]})
    builder.add_edge(START, "a")
    builder.add_conditional_edges(
        "a", lambda state: [Send("ship", {"log": [f"item{i}"]}) for i in range(3)]
    )
    builder.add_edge("ship", "z")
    return builder.compile(checkpointer=saver)


def copy_world(source: Path, target: Path) -> None:
    """A copy of a crashed store's folder: the SQLite file with its journal files, and
    the journal and effect sink (the outside world, as it stood at the crash)."""
    target.mkdir()
    for path in source.iterdir():
        shutil.copy2(path, target / path.name)


def run_in_process(fn: Any, *, killed: bool) -> None:
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(60)
    assert proc.exitcode == (-signal.SIGKILL if killed else 0)


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
@pytest.mark.parametrize(
    ("make", "kill_at", "effect"),
    [(sub_paying, "pay.after_effect", "charge"), (fan_paying, "ship item1.after_effect", "ship")],
)
def test_a_crash_inside_a_subgraph_or_a_half_done_fan_out_recovers_the_same_twice(
    tmp_path: Path, durability: str, make: Any, kill_at: str, effect: str
) -> None:
    """P6, P2: a run SIGKILLed after an effect inside a subgraph's node (or in one branch
    of a `Send` fan-out, the others finished or not), in each durability mode; two
    copies of the crashed store (and of the outside world) each recovered by
    `invoke(None, config)` in a process of its own reach the same final state and the
    same effect keys, each applied once; nothing is left claimed. (In "exit" durability
    nothing is durable before the run returns: the recovery starts it again from its
    input, and the effect ledger still holds what the dead run paid.)"""
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    url = f"sqlite:///{crashed}/remit.db"
    cfg = config()

    def first() -> None:
        world = World(crashed)
        world.armed[kill_at] = "kill"
        make(world, RemitSaver(url, lease=LEASE)).invoke({"log": []}, cfg, durability=durability)

    run_in_process(first, killed=True)
    outcomes = []
    for copy in ("one", "two"):
        folder = tmp_path / copy
        copy_world(crashed, folder)

        def recover(folder: Path = folder) -> None:
            graph = make(World(folder), RemitSaver(f"sqlite:///{folder}/remit.db", lease=LEASE))
            # (in "exit" durability nothing was durable: the run starts again from its input)
            graph.invoke({"log": []} if durability == "exit" else None, cfg, durability=durability)

        time.sleep(LEASE + 0.2)  # (the copied claim of the dead run expires: L1)
        run_in_process(recover, killed=False)
        world = World(folder)
        saver = RemitSaver(f"sqlite:///{folder}/remit.db", lease=LEASE)
        graph = make(world, saver)
        state = graph.get_state(cfg)
        assert state.next == ()
        keys = world.applications(effect)
        assert len(keys) == len(set(keys))
        # Nothing is left claimed: another run proceeds at once.
        graph.invoke({"log": []}, {"configurable": {**cfg["configurable"]}}, durability="sync")
        outcomes.append((sorted(state.values["log"]), sorted(keys)))
    assert outcomes[0] == outcomes[1]
    assert "z" in outcomes[0][0]
    expected = 1 if effect == "charge" else 3
    assert len(outcomes[0][1]) == expected


# -- a run start cancelled while its claim is being taken -------------------------------------


#: (inside, gate, armed): an armed `Item` read back stops its reader at `gate`.
HOLD = (threading.Event(), threading.Event(), threading.Event())


class Item(BaseModel):
    name: str

    @field_validator("name")
    @classmethod
    def hold(cls, value: str) -> str:
        inside, gate, armed = HOLD
        if armed.is_set():  # (read back by the cancelled run's start, in its worker thread)
            armed.clear()
            inside.set()
            gate.wait(10)
        return value


class Held(TypedDict):
    item: Item
    log: Annotated[list[str], operator.add]


def test_a_run_cancelled_while_its_start_takes_the_claim_gives_it_back_as_its_loop_closes(
    url: str,
) -> None:
    """L1 without waiting for a lease: an `ainvoke` cancelled while its start (in a
    worker thread: the claim, the input check) is still running, in an event loop that
    then closes (`asyncio.run` returning while the run's task is cancelled, as a timed
    out script's does), runs no node and leaves nothing claimed: the next run on the
    thread proceeds at once, though the lease is long."""
    saver = RemitSaver(url, lease=30.0)
    inside, gate, armed = HOLD
    gate.clear()  # (set by the test's run on another engine)
    entered: list[str] = []

    builder = StateGraph(Held)
    builder.add_node("a", lambda state: entered.append("a") or {"log": ["a"]})
    builder.add_edge(START, "a")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    graph.invoke({"item": Item(name="x"), "log": []}, cfg)

    async def main() -> None:
        armed.set()
        task = asyncio.create_task(graph.ainvoke({"log": ["hold"]}, cfg))
        assert await asyncio.to_thread(inside.wait, 10)
        inside.clear()
        task.cancel()
        # The start finishes only as the event loop closes, its run's task cancelled.
        threading.Timer(0.2, gate.set).start()

    asyncio.run(main())
    assert entered == ["a"]
    assert graph.invoke({"log": ["next"]}, cfg)["log"] == ["a", "next", "a"]


# -- a serializer of the user's own, reading a value written into the store by hand ---------


class XorCipher(CipherProtocol):
    """A toy cipher (the key a byte): enough to wrap values as `EncryptedSerializer` does."""

    def encrypt(self, plaintext: bytes) -> tuple[str, bytes]:
        return "xor", bytes(b ^ 0x5A for b in plaintext)

    def decrypt(self, ciphername: str, ciphertext: bytes) -> bytes:
        assert ciphername == "xor"
        return bytes(b ^ 0x5A for b in ciphertext)


#: Stored values that call something outside the allowlist: (extension code, what it
#: names, with a folder to make in place of `{marker}`, the name a refusal gives).
CALLS = [
    (jsonplus.EXT_CONSTRUCTOR_SINGLE_ARG, ("os", "mkdir", "{marker}"), "os.mkdir"),
    (  # (a class that is no data type: constructing it runs a command)
        jsonplus.EXT_CONSTRUCTOR_POS_ARGS,
        ("subprocess", "Popen", [["mkdir", "{marker}"]]),
        "subprocess.Popen",
    ),
]


def _filled(named: Any, marker: Path) -> Any:
    if isinstance(named, str):
        return named.format(marker=marker)
    return [_filled(x, marker) for x in named]


@pytest.mark.parametrize(("code", "named", "what"), CALLS, ids=["function", "class"])
@pytest.mark.parametrize(
    "serde",
    [JsonPlusSerializer, lambda: EncryptedSerializer(XorCipher())],
    ids=["jsonplus", "encrypted"],
)
def test_a_users_serializer_never_runs_a_callable_a_stored_value_names(
    url: str, tmp_path: Path, serde: Any, code: int, named: Any, what: str
) -> None:
    """P4 and safe serialization: with `serde=` LangGraph's `JsonPlusSerializer`, or an
    `EncryptedSerializer` over it (which reads a value that is not encrypted as it
    stands, so its key does not help), a value written into the store by hand that
    names a callable outside the allowlist (a function, or a class that is no data
    type) is a `CorruptRecord` naming it; it is never called. What the saver stored
    itself, an allowlisted model included, reads back as it was."""
    saver = RemitSaver(url, serde=serde())
    builder = StateGraph(Held)
    builder.add_node("a", lambda state: {"log": ["a"]})
    builder.add_edge(START, "a")
    graph = builder.compile(checkpointer=saver)
    cfg = config()
    graph.invoke({"item": Item(name="kept"), "log": []}, cfg)
    assert graph.get_state(cfg).values == {"item": Item(name="kept"), "log": ["a"]}
    marker = tmp_path / "made-by-a-stored-value"
    payload = ormsgpack.packb(ormsgpack.Ext(code, ormsgpack.packb(_filled(named, marker))))
    head = saver.get_tuple(cfg)
    assert head is not None
    thread = cfg["configurable"]["thread_id"]
    saver.remit.put_writes(
        [WriteRecord(thread, head.checkpoint["id"], "t", 0, "n", b"msgpack\x00" + payload)]
    )
    with pytest.raises(CorruptRecord, match=what):
        saver.get_tuple(cfg)
    with pytest.raises(CorruptRecord, match=what):
        graph.get_state(cfg)
    time.sleep(0.2)  # (a command, had one started, has made its folder by now)
    assert not marker.exists()
