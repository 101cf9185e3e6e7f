"""Parts the conformance probe tests share: the real adapters, one scenario run on one
target, and sessions that pass every operation to a real one so that a test can
break one of them the way a backend could."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remit_core.conformance import scenarios
from remit_core.conformance.adapter import (
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    RunResult,
    Target,
)
from remit_core.conformance.runner import discover
from remit_core.conformance.scenarios import Context


def adapter(framework: str) -> ProbeAdapter:
    adapters, notes = discover([framework])
    assert [a.framework for a in adapters] == [framework], notes
    return adapters[0]


def run_scenario(adapter: ProbeAdapter, spec: str, folder: Path, scenario: str) -> dict[int, Any]:
    ctx = Context(adapter, spec, folder, lease=0.5)
    try:
        return scenarios.RUNNERS[scenario](ctx)
    finally:
        ctx.close()


class Passthrough(ProbeSession):
    """A session that passes every operation to a real one (subclasses break one)."""

    def __init__(self, inner: ProbeSession, env: ProbeEnv) -> None:
        self.inner, self.env = inner, env

    def start(self, run: str) -> RunResult:
        return self.inner.start(run)

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        return self.inner.resume(run, value, branch=branch)

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        return self.inner.recover(run, branch=branch)

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        return self.inner.fork(run, checkpoint, token)

    def edit_state(self, run: str, patch: Any) -> None:
        self.inner.edit_state(run, patch)

    def corrupt_head(self, run: str) -> str:
        return self.inner.corrupt_head(run)

    def inspect(self, run: str, *, branch: str | None = None) -> Any:
        return self.inner.inspect(run, branch=branch)

    def copy_store(self, run: str, dest: Target) -> None:
        self.inner.copy_store(run, dest)

    def close(self) -> None:
        self.inner.close()


class Wrapped(ProbeAdapter):
    """An adapter whose sessions `wrap` wraps (the framework and store are real)."""

    def __init__(self, inner: ProbeAdapter, wrap: Any) -> None:
        self.inner, self.wrap, self.framework = inner, wrap, inner.framework

    def describe(self, target: Target) -> str:
        return self.inner.describe(target)

    def session(self, target: Target, env: ProbeEnv) -> ProbeSession:
        return self.wrap(self.inner.session(target, env), env)  # type: ignore[no-any-return]
