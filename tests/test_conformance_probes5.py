"""The matrix's cells check what CONTRACT.md says, on real processes and real stores.

Each case runs one scenario of the harness against a framework's own backend,
or against Remit behind an adapter deliberately broken the way a backend could
be, and shows that the cell no longer passes it:

- RESUME-TWICE (5): a refusal whose error does not name the run is not the
  "clear error" the cell asks for.
- INVALID-STEP-WRITE (19) and INVALID-EXTERNAL-UPDATE (20): a refusal that is
  not `CheckpointInvalid` naming the field (P4) is no PASS.
- INVALID-RESUME-VALUE (21): a value refused after it was stored (LangGraph's
  own saver keeps it as a pending write) is no PASS: nothing is committed.
- VERSION-MISMATCH (23): a refusal that changed the store, or whose error does
  not name the run and the checkpoint (P4), is no PASS.
- RECOVER-TWICE (17): the two recoveries' effect ledgers must agree on the
  idempotency keys too, not only on how many effects were applied.
- K8-DEAD-WINNER (38): after the dead winner's lease, k - 1 recoveries race,
  and between them the remaining steps are entered once each (L1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conformance_parts import Passthrough, Wrapped, adapter, run_scenario

from remit_core import CheckpointInvalid, VersionMismatch
from remit_core.conformance import adapter as probe_adapter
from remit_core.conformance.adapter import ProbeEnv, ProbeSession, RunResult

pytestmark = pytest.mark.slow


# -- INVALID-STEP-WRITE: the refusal names the field ------------------------------------


class _Unnamed(Passthrough):
    """Remit's refusals re-raised as the same class, naming no field, run or checkpoint."""

    def _bland(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except (CheckpointInvalid, VersionMismatch) as exc:
            raise type(exc)("refused") from None
        except Exception as exc:  # a framework's wrapper of Remit's refusal
            if not isinstance(exc.__cause__ or exc.__context__, CheckpointInvalid):
                raise
            raise CheckpointInvalid("refused") from None

    def start(self, run: str) -> RunResult:
        return self._bland(self.inner.start, run)  # type: ignore[no-any-return]

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        return self._bland(self.inner.resume, run, value, branch=branch)  # type: ignore[no-any-return]

    def edit_state(self, run: str, patch: Any) -> None:
        self._bland(self.inner.edit_state, run, patch)


def test_a_refusal_that_does_not_name_the_field_fails_19_and_20(tmp_path: Path) -> None:
    langgraph = adapter("langgraph")
    unnamed = Wrapped(langgraph, _Unnamed)
    step = run_scenario(unnamed, "sqlite", tmp_path / "step", "INVALID-STEP-WRITE")[19]
    assert not step.passed, step
    assert step.measured.startswith("error does not name the field amount"), step
    edit = run_scenario(unnamed, "sqlite", tmp_path / "edit", "INVALID-EXTERNAL-UPDATE")[20]
    assert not edit.passed, edit
    assert edit.measured.startswith("rejected, but not as CheckpointInvalid naming amount"), edit
    named = run_scenario(langgraph, "sqlite", tmp_path / "named", "INVALID-STEP-WRITE")[19]
    assert named.passed, named
    named = run_scenario(langgraph, "sqlite", tmp_path / "named-edit", "INVALID-EXTERNAL-UPDATE")[
        20
    ]
    assert named.passed, named


# -- RESUME-TWICE: the refusal names the run -----------------------------------------------


def test_a_refusal_that_does_not_name_the_run_fails_5(tmp_path: Path) -> None:
    """LlamaIndex's own context snapshots refuse a second value only because the
    workflow cannot make its start event again: an error about something else."""
    llamaindex = adapter("llamaindex")
    vanilla = run_scenario(llamaindex, "vanilla", tmp_path / "vanilla", "RESUME-TWICE")[5]
    assert not vanilla.passed, vanilla
    assert vanilla.measured.startswith("rejected, but the error does not name the run"), vanilla
    remit = run_scenario(llamaindex, "sqlite", tmp_path / "remit", "RESUME-TWICE")[5]
    assert remit.passed, remit


# -- INVALID-RESUME-VALUE: refused means not stored -------------------------------------


def test_a_value_refused_after_it_was_stored_fails_21(tmp_path: Path) -> None:
    """LangGraph's SqliteSaver stores the resume value as a pending write, then the node
    refuses it. The interrupt stays pending and a valid value goes on, which passed
    cell 21 before; the store holds the refused value now, so it fails."""
    langgraph = adapter("langgraph")
    vanilla = run_scenario(langgraph, "vanilla", tmp_path / "vanilla", "INVALID-RESUME-VALUE")[21]
    assert not vanilla.passed, vanilla
    assert "store changed: resume_values [] -> [12345]" in vanilla.measured
    remit = run_scenario(langgraph, "sqlite", tmp_path / "remit", "INVALID-RESUME-VALUE")[21]
    assert remit.passed, remit


# -- VERSION-MISMATCH: a refusal leaves the store as it was -------------------------------


class _DamagingRefusal(Passthrough):
    """A backend that refuses the other version's resume, but damages the head doing so
    (through a session of the version that wrote it)."""

    def __init__(self, inner: ProbeSession, env: ProbeEnv, writer: ProbeSession) -> None:
        super().__init__(inner, env)
        self.writer = writer

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        try:
            return self.inner.resume(run, value, branch=branch)
        except Exception:
            self.writer.corrupt_head(run)
            raise

    def close(self) -> None:
        self.writer.close()
        super().close()


def test_a_refusal_that_changed_the_store_fails_23(tmp_path: Path) -> None:
    langgraph = adapter("langgraph")

    def damaging_session(inner: ProbeSession, env: ProbeEnv) -> ProbeSession:
        v1 = env.with_variant(workflow_version="v1")
        return _DamagingRefusal(inner, env, langgraph.session(env.target, v1))

    damaging = run_scenario(
        Wrapped(langgraph, damaging_session), "sqlite", tmp_path / "damaging", "VERSION-MISMATCH"
    )[23]
    assert not damaging.passed, damaging
    assert damaging.measured.startswith("refused (VersionMismatch"), damaging
    unnamed = run_scenario(
        Wrapped(langgraph, _Unnamed), "sqlite", tmp_path / "unnamed", "VERSION-MISMATCH"
    )[23]
    assert not unnamed.passed, unnamed
    assert unnamed.measured.startswith("refused, but the error does not name the run"), unnamed
    clean = run_scenario(langgraph, "sqlite", tmp_path / "clean", "VERSION-MISMATCH")[23]
    assert clean.passed and clean.measured.startswith("refused: VersionMismatch"), clean


# -- RECOVER-TWICE: the same ledger, keys included ---------------------------------------


def test_recoveries_handing_out_different_keys_fail_17(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An effect key that depends on the recovering process (here: its pid) counts the
    same effects on both copies, which passed cell 17 before; the ledgers' keys differ."""
    real = probe_adapter.run_effect

    def per_process(name: str, apply: Any, **kwargs: Any) -> Any:
        return real(name, lambda key: apply(f"{key}-{os.getpid()}"), **kwargs)

    langgraph = adapter("langgraph")
    honest = run_scenario(langgraph, "sqlite", tmp_path / "honest", "RECOVER-TWICE")[17]
    assert honest.passed, honest
    monkeypatch.setattr(probe_adapter, "run_effect", per_process)  # forked workers inherit it
    keyed = run_scenario(langgraph, "sqlite", tmp_path / "keyed", "RECOVER-TWICE")[17]
    assert not keyed.passed, keyed
    assert keyed.measured.startswith("applied charge=1 notify=1; idempotency keys differ"), keyed


# -- K8-DEAD-WINNER: k - 1 recoveries, one takes over -------------------------------------


class _LoserRunsNotify(Passthrough):
    """A backend whose refused recoveries still run the last step (as one without a
    claim on recovery would)."""

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        try:
            return self.inner.recover(run, branch=branch)
        except Exception:
            self.env.enter("notify")
            raise


def test_dead_winner_is_taken_over_by_one_of_the_racing_recoveries(tmp_path: Path) -> None:
    langgraph = adapter("langgraph")
    remit = run_scenario(langgraph, "sqlite", tmp_path / "remit", "K8-DEAD-WINNER")[38]
    assert remit.passed, remit
    assert (
        "after the lease 1 of 7 recoveries entered steps, entered prepare=0 approve=0 "
        "charge=1 notify=1" in remit.measured
    ), remit
    loose = run_scenario(
        Wrapped(langgraph, _LoserRunsNotify), "sqlite", tmp_path / "loose", "K8-DEAD-WINNER"
    )[38]
    assert not loose.passed, loose
    assert "1 of 8 proceeded, 1 killed in charge" in loose.measured, loose
    assert "of 7 recoveries entered steps" in loose.measured, loose
    assert "entered prepare=0 approve=0 charge=1 notify=1" not in loose.measured, loose
