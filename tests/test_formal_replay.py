"""The model's behaviors replayed on the real core, on SQLite, PostgreSQL and Redis.

Through the refinement mapping of `spec.refinement` (store rows + process
memory + the effect target -> model state), after every step:

- random walks of the correct model must be matched step for step by
  `remit_core.Remit` and the effect protocol over each engine;
- the schedule of every TLC counterexample of a seeded bug, replayed on the
  real core, must follow the correct model and end with the broken property
  intact (the core does not have the bug); the lease bug's stuck schedule
  must complete on the core once the dead holder's lease lapses;
- the honest limit (a zombie against a target that does not deduplicate)
  must reproduce on the core: that is why effects get idempotency keys;
- a Hypothesis state machine with rules aimed at the claim owner (step,
  crash, pause past the lease, write a bad state) runs the core and the
  model in lock-step.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import ENGINES, engine_url  # noqa: E402

from spec import bfs, refinement, tlc  # noqa: E402
from spec.configs import BUGS, CONFIGS, Config  # noqa: E402
from spec.model import Model, State, from_tla  # noqa: E402

#: Walks per engine: SQLite is in-process and cheap; servers are shared.
WALKS = {"sqlite": 120, "postgresql": 30, "redis": 30}
WALK_LENGTH = 90


@pytest.fixture(params=ENGINES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return engine_url(request.param, tmp_path)


def _walks(engine: str) -> list[tuple[Config, bfs.Trace]]:
    rng = random.Random(f"formal-walks-{engine}")
    out = []
    for n in range(WALKS[engine]):
        cfg = CONFIGS["walk_ledger" if n % 2 == 0 else "walk_doubt"]
        out.append((cfg, bfs.random_walk(cfg, rng, WALK_LENGTH)))
    return out


def test_random_walks_of_the_model_are_what_the_core_does(url: str) -> None:
    engine = url.split(":", 1)[0]
    seen: Counter[str] = Counter()
    steps = 0
    for cfg, trace in _walks(engine):
        steps += refinement.replay(cfg, trace, url)
        seen.update(label.split("(")[0] for label, _ in trace[1:])
    assert steps >= 20 * WALKS[engine]
    # The walks reach every kind of step, fault and outcome the model has.
    for name in (
        "Claim",
        "Consume",
        "Commit",
        "Begin",
        "Apply",
        "Reconcile",
        "Finish",
        "Release",
        "Retry",
        "Crash",
        "BadWrite",
        "Expire",
        "ZombieExpire",
        "Fork",
    ):
        assert seen[name] > 0, f"no walk took {name}"


def _counterexample(name: str) -> list[str]:
    cfg = CONFIGS[name]
    res = tlc.run_named(name)
    assert res.violation == cfg.expect
    return [label for label, _ in bfs.label(cfg, [from_tla(s) for s in res.trace])[1:]]


def _correct(cfg: Config) -> Config:
    return replace(cfg, bugs=frozenset(), expect=None, liveness=False)


@pytest.mark.parametrize("bug", [b for b in BUGS if b != "lease_never_lapses"])
def test_counterexample_schedules_do_not_break_the_core(url: str, bug: str) -> None:
    name = f"bug_{bug}"
    cfg = _correct(CONFIGS[name])
    labels = _counterexample(name)
    final, done = refinement.schedule_replay(cfg, labels, url)
    assert len(done) >= 3
    invariants = Model(cfg).invariants()
    assert invariants[CONFIGS[name].expect](final)  # type: ignore[index]
    assert all(check(final) for check in invariants.values())


def test_a_dead_holder_does_not_block_the_run_on_the_core(url: str) -> None:
    name = "bug_lease_never_lapses"
    cfg = _correct(CONFIGS[name])
    labels = _counterexample(name)
    assert any(label.startswith("Crash") for label in labels)
    final = refinement.settle(cfg, labels, url)
    assert final.hpos[0] == cfg.effects + 1
    assert all(n == 1 for n in final.applied[0])


def test_a_zombie_against_a_target_without_dedup_applies_twice_on_the_core(url: str) -> None:
    name = "limit_zombie_no_dedup"
    cfg = _correct(CONFIGS[name])
    labels = _counterexample(name)
    final, done = refinement.schedule_replay(cfg, labels, url)
    assert done == labels
    assert max(final.applied[0]) == 2
    assert not Model(cfg).invariants()["EffectOnce"](final)


# -- lock-step with Hypothesis ---------------------------------------------------------

HYPO_CFG = CONFIGS["walk_doubt"]


class LockStep(RuleBasedStateMachine):
    """The real core and the model, one action at a time; rules aim at the claim owner."""

    url = ""
    #: The model's configuration (a seeded bug here must make the lock-step fail).
    cfg = HYPO_CFG
    taken: Counter[str] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(self.cfg)
        self.impl: refinement.Impl | None = None
        self.state: State | None = None

    @initialize()
    def start(self) -> None:
        self.impl = refinement.Impl(replace(self.cfg, bugs=frozenset()), self.url)
        self.state = self.impl.abstract()

    def _take(self, label: str) -> None:
        assert self.impl is not None and self.state is not None
        options = dict(self.model.successors(self.state))
        if label not in options:
            return
        self.impl.apply(label)
        got = self.impl.abstract()
        assert got == options[label], f"{label}: core {got} != model {options[label]}"
        self.state = got
        LockStep.taken[label.split("(")[0]] += 1

    def _owner(self, b: int) -> int:
        assert self.state is not None
        return self.state.c_holder[b - 1]

    def _step_label(self, r: int) -> str | None:
        assert self.state is not None
        moved = self.model.step(self.state, r)
        return None if moved is None else f"{moved[0]}({r})"

    @rule(b=st.sampled_from([1, 2]), times=st.integers(1, 8))
    def owner_steps(self, b: int, times: int) -> None:
        for _ in range(times):
            r = self._owner(b)
            label = self._step_label(r) if r else None
            if label:
                self._take(label)

    @rule(b=st.sampled_from([1, 2]))
    def owner_crashes(self, b: int) -> None:
        if self._owner(b):
            self._take(f"Crash({self._owner(b)})")

    @rule(b=st.sampled_from([1, 2]))
    def owner_crashes_inside_an_effect(self, b: int) -> None:
        """Between applying an effect and recording its outcome: the in-doubt window."""
        for _ in range(12):
            r = self._owner(b)
            label = self._step_label(r) if r else None
            if label is None:
                return
            assert self.state is not None
            if self.state.pc[r - 1] in ("finish", "reconcile"):
                self._take(f"Crash({r})")
                return
            self._take(label)

    @rule(b=st.sampled_from([1, 2]))
    def owner_pauses_past_its_lease(self, b: int) -> None:
        self._take(f"ZombieExpire({b})")

    @rule(b=st.sampled_from([1, 2]))
    def owner_writes_a_bad_state(self, b: int) -> None:
        if self._owner(b):
            self._take(f"BadWrite({self._owner(b)})")

    @rule(r=st.integers(1, HYPO_CFG.resumers))
    def resumer_steps(self, r: int) -> None:
        label = self._step_label(r)
        if label:
            self._take(label)

    @rule(b=st.sampled_from([1, 2]), pick=st.integers(0, 2), times=st.integers(1, 6))
    def another_resumer_takes_over(self, b: int, pick: int, times: int) -> None:
        """The owner's lease lapses if it is dead; another resumer of the branch moves on."""
        self._take(f"Expire({b})")
        others = [
            r
            for r in range(1, self.cfg.resumers + 1)
            if self.cfg.drive[r - 1] == b and r != self._owner(b)
        ]
        if not others:
            return
        r = others[pick % len(others)]
        for _ in range(times):
            label = self._step_label(r)
            if label is None:
                return
            self._take(label)

    @rule(from_head=st.booleans())
    def client_forks(self, from_head: bool) -> None:
        assert self.state is not None
        self._take(f"Fork({self.state.hpos[0] if from_head else 0})")

    @invariant()
    def contract_holds(self) -> None:
        if self.state is None:
            return
        for name, check in self.model.invariants().items():
            assert check(self.state), name

    def teardown(self) -> None:
        if self.impl is not None:
            self.impl.cleanup()


def _lock_step(url: str, cfg: Config, examples: int, *, shrink: bool = True) -> None:
    LockStep.url, LockStep.cfg = url, cfg
    LockStep.taken = Counter()
    run_state_machine_as_test(
        LockStep,
        settings=settings(
            max_examples=examples,
            stateful_step_count=50,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=list(Phase) if shrink else [Phase.generate],
        ),
    )


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_core_and_model_in_lock_step(engine: str, tmp_path: Path) -> None:
    _lock_step(engine_url(engine, tmp_path), HYPO_CFG, 60 if engine == "sqlite" else 40)
    for name in ("Commit", "Finish", "Reconcile", "Crash", "ZombieExpire", "Release"):
        assert LockStep.taken[name] > 0, f"the machine never took {name}"


def test_lock_step_against_a_blind_refire_model_finds_the_divergence(tmp_path: Path) -> None:
    """Aimed at the owner, the machine reaches the in-doubt effect and sees the core
    reconcile where the seeded model re-applies blindly."""
    buggy = replace(HYPO_CFG, bugs=frozenset({"blind_refire"}))
    with pytest.raises(AssertionError, match="core .* != model"):
        _lock_step(engine_url("sqlite", tmp_path), buggy, 200, shrink=False)
