"""Round 44 of the LangGraph probes: code that reads a run's `stream` (or `astream`)
and does something else between two of its items, as a UI or a supervisor loop does;
and the functional API's `entrypoint.final`.

Found: an `update_state` of the thread made between two items of its run's stream was
stored as the run's own write, under its claim (a generator runs in its consumer's
context, where the run's mark is set): in "sync" durability the edit became the head
and the run then failed with `ForkWithoutIntent`, its later steps lost; in "exit" the
edit was stored in the middle of the run; in "async" it was refused, but as
`HeadMoved` (read again and retry), which a retry meets again. Now such an edit is one
beside the run, refused with `ResumeConflict` and stored nowhere, and the run keeps
its result (P5), sync and async.
Found: an `@entrypoint` annotated `-> entrypoint.final[R, S]` in a module with `from
__future__ import annotations` had its run refused (`CheckpointInvalid`: R not in the
allowlist) as it returned: the hint was taken as one type, not as R and S. Now both
are the entrypoint's types, and `previous` gives back what was saved.
Held, compared with LangGraph's own `InMemorySaver`: a stream with several modes and
subgraphs left after two items (closed, or dropped) leaves the thread free and
continued where it stood. Real LangGraph, real stores on every engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import operator
import uuid
from typing import Annotated, Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from pydantic import BaseModel
from typing_extensions import TypedDict

from remit_core import ResumeConflict
from remit_langgraph import RemitSaver


class Log(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def line(saver: Any) -> Any:
    """a -> b -> c, each appending its name."""
    builder = StateGraph(Log)
    for name in "abc":
        builder.add_node(name, lambda state, name=name: {"log": [name]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg44-{uuid.uuid4().hex}"}}


def history(graph: Any, cfg: dict[str, Any]) -> list[tuple[str, list[str]]]:
    return [(s.metadata["source"], s.values.get("log")) for s in graph.get_state_history(cfg)]


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
def test_an_edit_made_between_two_items_of_a_runs_stream_is_refused(
    url: str, durability: str
) -> None:
    """`update_state` of the thread while its run's stream is read is refused with
    `ResumeConflict`; nothing of it is stored, the run goes on to its end and keeps
    its result, and the same edit is taken once the run has ended."""
    graph, cfg = line(RemitSaver(url)), config()
    stream = graph.stream({"log": []}, cfg, durability=durability)
    assert next(stream) == {"a": {"log": ["a"]}}
    with pytest.raises(ResumeConflict):
        graph.update_state(cfg, {"log": ["edit"]})
    assert list(stream) == [{"b": {"log": ["b"]}}, {"c": {"log": ["c"]}}]
    assert graph.get_state(cfg).values == {"log": ["a", "b", "c"]}
    assert all(source != "update" for source, _ in history(graph, cfg))
    graph.update_state(cfg, {"log": ["edit"]})
    assert graph.get_state(cfg).values == {"log": ["a", "b", "c", "edit"]}


def test_an_async_edit_made_between_two_items_of_a_runs_astream_is_refused(url: str) -> None:
    """The same with `astream` and `aupdate_state` in one task."""
    graph, cfg = line(RemitSaver(url)), config()

    async def main() -> list[Any]:
        seen: list[Any] = []
        async with contextlib.aclosing(graph.astream({"log": []}, cfg)) as stream:
            async for item in stream:
                seen.append(item)
                if len(seen) == 1:
                    with pytest.raises(ResumeConflict):
                        await graph.aupdate_state(cfg, {"log": ["edit"]})
        await graph.aupdate_state(cfg, {"log": ["edit"]})
        return seen

    assert len(asyncio.run(main())) == 3
    assert graph.get_state(cfg).values == {"log": ["a", "b", "c", "edit"]}
    assert [source for source, _ in history(graph, cfg)][:2] == ["update", "loop"]


def asking_subgraph(saver: Any) -> Any:
    """a -> sub (s1, then s2 asks) -> c."""
    sub = StateGraph(Log)
    sub.add_node("s1", lambda state: {"log": ["s1"]})
    sub.add_node("s2", lambda state: {"log": [f"s2:{interrupt('ok?')}"]})
    sub.add_edge(START, "s1")
    sub.add_edge("s1", "s2")
    sub.add_edge("s2", END)
    builder = StateGraph(Log)
    builder.add_node("a", lambda state: {"log": ["a"]})
    builder.add_node("sub", sub.compile())
    builder.add_node("c", lambda state: {"log": ["c"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "sub")
    builder.add_edge("sub", "c")
    builder.add_edge("c", END)
    return builder.compile(checkpointer=saver)


def left_after_two_items(saver: Any, close: bool) -> list[Any]:
    """A stream of several modes with subgraphs, left after two items (closed or
    dropped); then the thread continued, answered, and its state read."""
    graph, cfg = asking_subgraph(saver), config()
    modes = ["updates", "values", "custom"]
    stream = graph.stream({"log": []}, cfg, stream_mode=modes, subgraphs=True)
    seen: list[Any] = [next(stream)[1:], next(stream)[1:]]
    if close:
        stream.close()
    del stream
    gc.collect()
    more = graph.stream(None, cfg, stream_mode=modes, subgraphs=True)
    seen.append([(len(ns), mode) for ns, mode, _ in more])
    snapshot = graph.get_state(cfg, subgraphs=True)
    seen.append((snapshot.next, [i.value for i in snapshot.interrupts]))
    seen.append(graph.invoke(Command(resume="yes"), cfg))
    return seen


@pytest.mark.parametrize("close", [True, False])
def test_a_stream_left_after_two_items_frees_the_thread(url: str, close: bool) -> None:
    """Its claim is given back as the generator closes (or is collected): the thread
    continues where it stood, as with LangGraph's own saver, and its question takes
    one answer."""
    own = left_after_two_items(InMemorySaver(), close)
    assert left_after_two_items(RemitSaver(url), close) == own


@dataclasses.dataclass
class Tally:
    rounds: int
    answers: list[str]


class Total(BaseModel):
    rounds: int


def tallying(saver: Any) -> Any:
    @task
    def greet(name: str) -> str:
        return f"hi {name}"

    @entrypoint(checkpointer=saver)
    def workflow(name: str, *, previous: Tally | None = None) -> entrypoint.final[Total, Tally]:
        tally = previous or Tally(0, [])
        answer = interrupt(greet(name).result())
        tally = Tally(tally.rounds + 1, [*tally.answers, f"{name}:{answer}"])
        return entrypoint.final(value=Total(rounds=tally.rounds), save=tally)

    return workflow


def two_rounds(saver: Any) -> list[Any]:
    workflow, cfg = tallying(saver), config()
    seen: list[Any] = []
    for name in ("x", "y"):
        seen.append([i.value for i in workflow.invoke(name, cfg)["__interrupt__"]])
        seen.append(workflow.invoke(Command(resume=name.upper()), cfg))
    seen.append(workflow.get_state(cfg).values)
    return seen


def test_an_entrypoints_final_value_and_saved_value_round_trip(url: str) -> None:
    """`entrypoint.final(value=..., save=...)` of a model and a dataclass, annotated
    `entrypoint.final[Total, Tally]` under `from __future__ import annotations`: both
    are stored, and the next run gets the saved value as `previous`, as with
    LangGraph's own saver."""
    own = two_rounds(InMemorySaver())
    assert own[-2:] == [Total(rounds=2), Total(rounds=2)]
    assert two_rounds(RemitSaver(url)) == own
