"""LlamaIndex probes, round 16, on SQLite, PostgreSQL and Redis.

Reading a stored record must never run code of the record's choosing. `rt.result`
decoded a run's `StopEvent` through the class the stored result names, importing
that class's module when the reading process had not loaded it: the import ran the
module's top-level code in a process that only asked for a result (a record written
by another program, or by a writer of the store, chose what ran). A result naming a
class whose module is not loaded is now `CorruptRecord` naming the run and the
checkpoint, and the module is not imported; a process that loaded the workflow's
module (a real user's) reads the same result as before.

Also pinned (this held): `handler.cancel_run()` while a step is inside an async
effect that has applied ends the run cancelled; `rt.recover` of it then runs nothing
and applies nothing again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from llamaindex_sink import DIR_VAR, enter, entered, payments
from workflows import Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import Event, StartEvent, StopEvent

from remit_core import NOT_APPLIED, effect
from remit_core.errors import CorruptRecord
from remit_llamaindex import RemitRuntime

TESTS = str(Path(__file__).parent)
ROOT = str(Path(__file__).parent.parent)

#: A workflow module whose import leaves a mark: one line per importing process.
FLOW_MODULE = textwrap.dedent(
    """
    import os

    from workflows import Workflow, step
    from workflows.events import StartEvent, StopEvent

    with open(__file__ + ".imported", "a") as mark:
        mark.write(f"{os.getpid()}\\n")


    class Done(StopEvent):
        total: int


    class Adder(Workflow):
        @step
        async def add(self, ev: StartEvent) -> Done:
            return Done(total=ev.get("a") + ev.get("b"))
    """
)


def new_run() -> str:
    return f"probe16-{uuid.uuid4().hex[:12]}"


def _module_on_disk(tmp_path: Path) -> str:
    """Write the workflow module under a name no process has loaded; its name."""
    name = f"probe16_flow_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(FLOW_MODULE)
    return name


def _complete_elsewhere(tmp_path: Path, module: str, url: str, run: str) -> None:
    """Complete one run of the module's workflow in another process."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path[:0] = [{str(tmp_path)!r}, {ROOT!r}]
        from remit_llamaindex import RemitRuntime
        import {module} as flow

        async def main():
            rt = RemitRuntime({url!r})
            await flow.Adder(runtime=rt, timeout=None).run(run_id={run!r}, a=1, b=2)

        asyncio.run(main())
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd=ROOT)


def _importers(tmp_path: Path, module: str) -> list[str]:
    mark = tmp_path / f"{module}.py.imported"
    return mark.read_text().split() if mark.exists() else []


def test_result_naming_a_module_not_loaded_is_refused_unimported(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reading process can import the module (it is on its path) but never loaded
    it: `rt.result` refuses with `CorruptRecord` naming run and checkpoint, and the
    module's code does not run here."""
    module, run = _module_on_disk(tmp_path), new_run()
    _complete_elsewhere(tmp_path, module, store_url, run)
    assert len(_importers(tmp_path, module)) == 1
    monkeypatch.syspath_prepend(str(tmp_path))
    rt = RemitRuntime(store_url)
    head = rt.checkpoints(run)[0].checkpoint_id
    with pytest.raises(CorruptRecord) as refused:
        rt.result(run)
    assert (refused.value.run_id, refused.value.checkpoint_id) == (run, head)
    assert module in str(refused.value)
    assert module not in sys.modules
    assert len(_importers(tmp_path, module)) == 1  # only the writer imported it
    assert rt.status(run) == "completed"


def test_result_of_a_loaded_workflow_module_reads_as_before(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that loaded the workflow's module (as a user who runs it has) reads
    the result its handler gave: the `StopEvent` subclass, with its fields."""
    module, run = _module_on_disk(tmp_path), new_run()
    _complete_elsewhere(tmp_path, module, store_url, run)
    monkeypatch.syspath_prepend(str(tmp_path))
    flow = __import__(module)
    try:
        got = RemitRuntime(store_url).result(run)
        assert type(got) is flow.Done and got.total == 3
    finally:
        sys.modules.pop(module, None)


def test_result_of_a_run_in_this_process_reads_as_before(store_url: str) -> None:
    """A plain `StopEvent` result and a subclass defined here read as awaiting gave."""

    class Plain(Workflow):
        @step
        async def go(self, ev: StartEvent) -> StopEvent:
            return StopEvent(result={"n": 1})

    run = new_run()

    async def go() -> object:
        return await Plain(runtime=RemitRuntime(store_url), timeout=None).run(run_id=run)

    assert asyncio.run(go()) == {"n": 1}
    assert RemitRuntime(store_url).result(run) == {"n": 1}


def _paid(key: str) -> object:
    hits = [
        line.split()[1] for line in payments(Path(os.environ[DIR_VAR])) if line.split()[0] == key
    ]
    return hits[0] if hits else NOT_APPLIED


class _Gate:
    """The effect tells the test it applied, then waits for a release that never comes."""

    inside: asyncio.Event
    release: asyncio.Event


@effect(reconcile=_paid)
async def pay_and_hold(what: str, *, idempotency_key: str) -> str:
    with (Path(os.environ[DIR_VAR]) / "sink.txt").open("a") as sink:
        sink.write(f"{idempotency_key} {what}\n")
    _Gate.inside.set()
    await _Gate.release.wait()
    return what


class Prepared(Event):
    pass


class Shop(Workflow):
    @step
    async def prepare(self, ev: StartEvent) -> Prepared:
        enter("prepare")
        return Prepared()

    @step
    async def charge(self, ev: Prepared) -> StopEvent:
        enter("charge")
        return StopEvent(result=await pay_and_hold("order"))


def test_cancel_inside_an_effect_then_recover_runs_nothing(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run ends cancelled with the effect applied once; recovering a cancelled run
    runs no step and applies no effect again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        _Gate.inside, _Gate.release = asyncio.Event(), asyncio.Event()
        rt = RemitRuntime(store_url)
        handler = Shop(runtime=rt, timeout=None).run(run_id=run)
        await _Gate.inside.wait()
        await handler.cancel_run()
        with pytest.raises(WorkflowCancelledByUser):
            await handler
        _Gate.release.set()
        assert rt.status(run) == "cancelled"
        assert rt.recover(Shop(runtime=rt, timeout=None), run) is None

    asyncio.run(go())
    assert entered(tmp_path) == ["prepare", "charge"]
    assert len(payments(tmp_path)) == 1
