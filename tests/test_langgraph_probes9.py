"""RemitSaver probed where the earlier rounds stopped: a fork's state read with its
subgraphs (`get_state(config, subgraphs=True)`) of a subgraph with a line of its own,
and `update_state` calls that race. Real LangGraph on every engine."""

from __future__ import annotations

import asyncio
import dataclasses
import operator
import threading
import uuid
from typing import Annotated, Any, NamedTuple

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from pydantic.v1 import BaseModel as V1Model
from typing_extensions import TypedDict

from remit_core import CheckpointInvalid, ForkWithoutIntent, HeadMoved, ResumeConflict
from remit_langgraph import RemitSaver


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


class Sub(TypedDict):
    log: Annotated[list[str], operator.add]
    y: int


def config(thread: str, token: str | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = {"thread_id": thread}
    if token is not None:
        conf["fork_token"] = token
    return {"configurable": conf}


def asks_then_sub(saver: RemitSaver, entered: list[str]) -> Any:
    """ask (interrupt) -> sub, a subgraph with a line of its own (`checkpointer=True`):
    s1 sets y=1, s2 asks and logs its answer with y."""

    def s1(state: Sub) -> dict[str, Any]:
        entered.append("s1")
        return {"y": 1}

    def s2(state: Sub) -> dict[str, Any]:
        entered.append("s2")
        return {"log": [f"s2:{interrupt('sub?')}:{state['y']}"]}

    sub_builder = StateGraph(Sub)
    sub_builder.add_node("s1", s1)
    sub_builder.add_node("s2", s2)
    sub_builder.add_edge(START, "s1")
    sub_builder.add_edge("s1", "s2")
    sub_builder.add_edge("s2", END)

    def ask(state: Log) -> dict[str, Any]:
        return {"log": [f"ask:{interrupt('top?')}"]}

    builder = StateGraph(Log)
    builder.add_node("ask", ask)
    builder.add_node("sub", sub_builder.compile(checkpointer=True))
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "sub")
    builder.add_edge("sub", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_forks_snapshot_with_subgraphs_shows_and_edits_the_forks_own_line(
    store_url: str, api: str
) -> None:
    """Main and a fork F both pause in the subgraph; main's line there was edited to
    y=7. `get_state(F, subgraphs=True)` shows F's line of the subgraph (y=1), not
    main's, and an `update_state` with that snapshot's config edits F's line: F's
    resume sees it, main's does not."""
    entered: list[str] = []
    graph = asks_then_sub(RemitSaver(store_url), entered)
    thread = f"lg-{uuid.uuid4().hex}"
    main, fork = config(thread), config(thread, "F")
    graph.invoke({"log": []}, main)
    head = graph.get_state(main).config
    graph.invoke(None, {"configurable": {**head["configurable"], "fork_token": "F"}})
    graph.invoke(Command(resume="main-top"), main)
    graph.update_state(graph.get_state(main, subgraphs=True).tasks[0].state.config, {"y": 7})
    graph.invoke(Command(resume="fork-top"), fork)

    async def edit_async() -> tuple[dict[str, Any], dict[str, Any]]:
        paused = (await graph.aget_state(fork, subgraphs=True)).tasks[0].state
        await graph.aupdate_state(paused.config, {"y": 42})
        return paused.values, (await graph.aget_state(main, subgraphs=True)).tasks[0].state.values

    if api == "sync":
        paused = graph.get_state(fork, subgraphs=True).tasks[0].state
        seen = paused.values
        graph.update_state(paused.config, {"y": 42})
        mains = graph.get_state(main, subgraphs=True).tasks[0].state.values
    else:
        seen, mains = asyncio.run(edit_async())
    assert seen == {"log": ["ask:fork-top"], "y": 1}
    assert mains == {"log": ["ask:main-top"], "y": 7}
    assert graph.get_state(fork, subgraphs=True).tasks[0].state.values["y"] == 42

    entered.clear()
    assert graph.invoke(Command(resume="fork"), fork)["log"][-1] == "s2:fork:42"
    assert entered == ["s2"]
    assert graph.invoke(Command(resume="main"), main)["log"][-1] == "s2:main:7"


def counter_graph(saver: RemitSaver) -> Any:
    builder = StateGraph(Log)
    builder.add_node("a", lambda state: {"log": ["a"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_racing_update_states_without_a_checkpoint_id_lose_with_head_moved(
    store_url: str, api: str
) -> None:
    """k `update_state(config, ...)` calls (no checkpoint_id) at once: each reads the
    head and commits after it. A loser whose read head was replaced by another's edit
    lost a race (`HeadMoved`: read again), it did not ask for a fork; and every
    accepted edit is in the final state. Naming an old checkpoint is still a fork
    without intent."""
    saver = RemitSaver(store_url)
    graph = counter_graph(saver)
    thread = f"lg-{uuid.uuid4().hex}"
    cfg = config(thread)
    graph.invoke({"log": []}, cfg)
    first = graph.get_state(cfg).config
    k = 6
    outcomes: list[str] = []
    accepted: list[str] = []

    def outcome(edit: str, error: BaseException | None) -> None:
        if error is None:
            accepted.append(edit)
            outcomes.append("ok")
        elif isinstance(error, (HeadMoved, ResumeConflict)):
            outcomes.append(type(error).__name__)
        else:
            outcomes.append(f"{type(error).__name__}: {error}")

    if api == "sync":
        gate = threading.Barrier(k)

        def editor(i: int) -> None:
            gate.wait()
            try:
                graph.update_state(cfg, {"log": [f"u{i}"]})
            except Exception as exc:  # noqa: BLE001 (reported by the assertion)
                outcome(f"u{i}", exc)
            else:
                outcome(f"u{i}", None)

        threads = [threading.Thread(target=editor, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    else:

        async def edits() -> None:
            results = await asyncio.gather(
                *(graph.aupdate_state(cfg, {"log": [f"u{i}"]}) for i in range(k)),
                return_exceptions=True,
            )
            for i, result in enumerate(results):
                outcome(f"u{i}", result if isinstance(result, BaseException) else None)

        asyncio.run(edits())
    assert len(outcomes) == k
    assert all(o in ("ok", "HeadMoved", "ResumeConflict") for o in outcomes), outcomes
    assert accepted
    assert sorted(graph.get_state(cfg).values["log"][1:]) == sorted(accepted)
    # Nothing holds the thread after the race, and an old checkpoint is still a fork.
    graph.update_state(cfg, {"log": ["after"]})
    with pytest.raises(ForkWithoutIntent):
        graph.update_state(first, {"log": ["old"]})
    assert len(saver.remit.branches(thread, ns="")) == 1


#: What the reducer of `Racy` runs before it takes the value ["slow"].
BEFORE_SLOW: list[Any] = []


def racing_add(left: list[str], right: list[str]) -> list[str]:
    if right == ["slow"]:
        for hook in BEFORE_SLOW:
            hook()
    return left + right


class Racy(TypedDict):
    log: Annotated[list[str], racing_add]


@pytest.mark.parametrize("api", ["sync", "async"])
def test_an_update_state_whose_read_head_moves_before_its_commit_gets_head_moved(
    store_url: str, api: str
) -> None:
    """The race made certain: the state's reducer, run by `update_state` between its
    read of the head and its commit, lets another `update_state` (another thread)
    commit first. The first update lost a race: `HeadMoved`, nothing stored, and the
    thread is free for the retry."""

    builder = StateGraph(Racy)
    builder.add_node("a", lambda state: {"log": ["a"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", END)
    saver = RemitSaver(store_url)
    graph = builder.compile(checkpointer=saver)
    thread = f"lg-{uuid.uuid4().hex}"
    cfg = config(thread)
    graph.invoke({"log": []}, cfg)
    other = threading.Thread(target=graph.update_state, args=(cfg, {"log": ["fast"]}))
    BEFORE_SLOW[:] = [lambda: (other.start(), other.join(30))]
    with pytest.raises(HeadMoved) as err:
        if api == "sync":
            graph.update_state(cfg, {"log": ["slow"]})
        else:
            asyncio.run(graph.aupdate_state(cfg, {"log": ["slow"]}))
    assert err.value.run_id == thread
    assert "read the state again" in str(err.value)
    assert graph.get_state(cfg).values["log"] == ["a", "fast"]
    graph.update_state(cfg, {"log": ["retry"]})
    assert graph.get_state(cfg).values["log"] == ["a", "fast", "retry"]
    assert len(saver.remit.branches(thread, ns="")) == 1


def test_an_update_state_from_a_snapshot_read_before_the_head_moved_is_a_fork(
    store_url: str,
) -> None:
    """The race rule applies only to an update that read the head itself: a config
    that names the checkpoint (`get_state(config).config`, kept while another edit
    moved the head) is a continuation of a non-head checkpoint, `ForkWithoutIntent`."""
    graph = counter_graph(RemitSaver(store_url))
    thread = f"lg-{uuid.uuid4().hex}"
    cfg = config(thread)
    graph.invoke({"log": []}, cfg)
    kept = graph.get_state(cfg).config
    graph.update_state(cfg, {"log": ["x"]})
    with pytest.raises(ForkWithoutIntent):
        graph.update_state(kept, {"log": ["y"]})
    assert graph.get_state(cfg).values["log"] == ["a", "x"]


class V1Item(V1Model):
    a: int


class V1State(TypedDict, total=False):
    one: V1Item
    many: Annotated[list[V1Item], operator.add]
    maybe: V1Item | None
    answer: str


def v1_graph(saver: RemitSaver, write: dict[str, Any]) -> Any:
    def ask(state: V1State) -> dict[str, Any]:
        return {"answer": interrupt("ok?")}

    builder = StateGraph(V1State)
    builder.add_node("write", lambda state: write)
    builder.add_node("ask", ask)
    builder.add_edge(START, "write")
    builder.add_edge("write", "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def test_pydantic_v1_models_in_a_typeddict_state_are_stored_and_checked(store_url: str) -> None:
    """A state key typed with a `pydantic.v1` model (LangChain code of the v1 era) is
    stored and read back as the framework's own savers do, across a pause; a write
    that is not such a model, or whose fields fail its validation, is refused naming
    the key (before: every write was refused with Pydantic's TypeError, since
    Pydantic 2 calls a v1 model's validator with arguments it does not take)."""
    saver = RemitSaver(store_url)
    good = {"one": V1Item(a=1), "many": [V1Item(a=2)], "maybe": None}
    graph = v1_graph(saver, good)
    cfg = config(f"lg-{uuid.uuid4().hex}")
    graph.invoke({}, cfg)
    done = graph.invoke(Command(resume="yes"), cfg)
    assert done == {**good, "answer": "yes"}
    assert type(graph.get_state(cfg).values["many"][0]) is V1Item

    bad_writes = {
        "one": {"one": {"a": 1}},
        "many[1]": {"many": [V1Item(a=1), 3]},
        "maybe": {"maybe": "s"},
        "one ": {"one": V1Item.construct(a="x")},
    }
    for field, write in bad_writes.items():
        cfg = config(f"lg-{uuid.uuid4().hex}")
        with pytest.raises(CheckpointInvalid) as err:
            v1_graph(saver, write).invoke({}, cfg)
        assert err.value.field == field.strip()
        assert "V1Item" in str(err.value) or "valid integer" in str(err.value)
        assert "write" not in graph.get_state(cfg).values


@dataclasses.dataclass
class Extra:
    v: int


class Pair(NamedTuple):
    a: int
    b: str


class AllowState(TypedDict, total=False):
    pair: Pair
    thing: Any
    answer: Any


def test_a_with_allowlist_clone_reads_and_resumes_what_it_stored(store_url: str) -> None:
    """`saver.with_allowlist([Extra])` (as LangGraph itself calls it under strict
    msgpack) compiled into a graph: a value of the extra type stored in the state, and
    one given as a resume value, are read back when the run resumes (before: the run
    start read the head with the original saver's serializer, `CorruptRecord`, after
    the resume value was consumed); and a type the graph's schema declares (a
    NamedTuple) is allowed on the clone, made before the saver met the graph."""
    saver = RemitSaver(store_url).with_allowlist([Extra])
    builder = StateGraph(AllowState)
    builder.add_node("write", lambda state: {"pair": Pair(1, "x"), "thing": Extra(1)})
    builder.add_node("ask", lambda state: {"answer": interrupt("?")})
    builder.add_node("again", lambda state: {"answer": [state["answer"], interrupt("again?")]})
    builder.add_edge(START, "write")
    builder.add_edge("write", "ask")
    builder.add_edge("ask", "again")
    builder.add_edge("again", END)
    graph = builder.compile(checkpointer=saver)
    cfg = config(f"lg-{uuid.uuid4().hex}")
    graph.invoke({}, cfg)
    assert graph.get_state(cfg).values == {"pair": Pair(1, "x"), "thing": Extra(1)}
    graph.invoke(Command(resume=Extra(2)), cfg)
    done = graph.invoke(Command(resume="ok"), cfg)
    assert done == {"pair": Pair(1, "x"), "thing": Extra(1), "answer": [Extra(2), "ok"]}


def test_a_graph_learned_by_the_saver_is_known_to_its_earlier_clones(store_url: str) -> None:
    """A clone made before the saver met a graph, running the same graph (a copy of the
    compiled graph, which shares its channels) after the saver did: the types the
    graph's schema declares are allowed on the clone too."""
    saver = RemitSaver(store_url)
    clone = saver.with_allowlist([Extra])
    builder = StateGraph(AllowState)
    builder.add_node("write", lambda state: {"pair": Pair(1, "x")})
    builder.add_edge(START, "write")
    builder.add_edge("write", END)
    graph = builder.compile(checkpointer=saver)
    assert graph.invoke({}, config(f"lg-{uuid.uuid4().hex}")) == {"pair": Pair(1, "x")}
    on_clone = graph.copy(update={"checkpointer": clone})
    assert on_clone.invoke({}, config(f"lg-{uuid.uuid4().hex}")) == {"pair": Pair(1, "x")}
