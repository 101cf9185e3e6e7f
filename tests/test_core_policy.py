"""The contract's decisions as plain functions: commits and forks, claims, effects, retention."""

from __future__ import annotations

import itertools

import pytest

from remit_core import (
    MAIN_BRANCH,
    BranchRecord,
    CheckpointRecord,
    Claim,
    EffectRecord,
    ForkWithoutIntent,
    HeadMoved,
    InterruptRecord,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
    policy,
)


def main(head: str | None, seq: int = 1) -> BranchRecord:
    return BranchRecord("r", MAIN_BRANCH, head, head_seq=seq)


def fork(token: str, head: str, base: str, seq: int = 0) -> BranchRecord:
    return BranchRecord("r", policy.fork_branch_name(token), head, "", seq, base, token)


# -- commits and forks -------------------------------------------------------------------


def test_first_commit_creates_main() -> None:
    plan = policy.plan_commit("r", "", None, [], fork_token=None, now=1.0)
    assert (plan.branch, plan.expected_head, plan.seq, plan.fork) == (MAIN_BRANCH, None, 1, None)


def test_continuing_a_head_is_a_compare_and_set() -> None:
    plan = policy.plan_commit("r", "", "c3", [main("c3", 3)], fork_token=None, now=1.0)
    assert (plan.branch, plan.expected_head, plan.seq, plan.fork) == (MAIN_BRANCH, "c3", 4, None)
    # A token is ignored when the parent is a head: nothing is forked.
    plan = policy.plan_commit("r", "", "c3", [main("c3", 3)], fork_token="t", now=1.0)
    assert plan.fork is None and plan.branch == MAIN_BRANCH


def test_main_wins_over_a_fork_with_the_same_head() -> None:
    branches = [fork("t", "c3", "c3"), main("c3", 3)]
    plan = policy.plan_commit("r", "", "c3", branches, fork_token=None, now=1.0)
    assert plan.branch == MAIN_BRANCH
    # ...unless the fork's own token is presented.
    plan = policy.plan_commit("r", "", "c3", branches, fork_token="t", now=1.0)
    assert (plan.branch, plan.seq) == (policy.fork_branch_name("t"), 1)


def test_a_fork_still_at_its_base_is_not_anothers_to_continue() -> None:
    """Fork A made at c1 has no checkpoint of its own yet: token B from c1 makes B's
    branch, and no token from c1 is a fork of main, refused."""
    branches = [main("c2", 2), fork("A", "c1", "c1")]
    plan = policy.plan_commit("r", "", "c1", branches, fork_token="B", now=1.0)
    assert plan.fork is not None and plan.branch == policy.fork_branch_name("B")
    with pytest.raises(ForkWithoutIntent):
        policy.plan_commit("r", "", "c1", branches, fork_token=None, now=1.0)
    # Once A has a checkpoint of its own, its head is continued without a token...
    branches = [main("c2", 2), fork("A", "a1", "c1", 1)]
    plan = policy.plan_commit("r", "", "a1", branches, fork_token=None, now=1.0)
    assert (plan.branch, plan.seq, plan.fork) == (policy.fork_branch_name("A"), 2, None)
    # ...but never under another token: B forks from a1.
    plan = policy.plan_commit("r", "", "a1", branches, fork_token="B", now=1.0)
    assert plan.fork is not None and plan.branch == policy.fork_branch_name("B")


@pytest.mark.parametrize("parent", ["c1", None])
def test_non_head_without_token_is_refused(parent: str | None) -> None:
    with pytest.raises(ForkWithoutIntent) as err:
        policy.plan_commit("r", "", parent, [main("c3", 3)], fork_token=None, now=1.0)
    assert (err.value.run_id, err.value.checkpoint_id) == ("r", parent)


def test_non_head_with_new_token_plans_a_fork() -> None:
    plan = policy.plan_commit("r", "ns", "c1", [main("c3", 3)], fork_token="t", now=7.0)
    assert plan.fork == BranchRecord(
        "r", policy.fork_branch_name("t"), "c1", "ns", 0, "c1", "t", 7.0
    )
    assert (plan.branch, plan.expected_head, plan.seq) == (plan.fork.branch, "c1", 1)


def test_used_token_continues_its_branch_or_refuses_a_second_fork() -> None:
    branches = [main("c3", 3), fork("t", "f2", "c1", 2)]
    plan = policy.plan_commit("r", "", "f2", branches, fork_token="t", now=1.0)
    assert (plan.branch, plan.expected_head, plan.seq, plan.fork) == (
        policy.fork_branch_name("t"),
        "f2",
        3,
        None,
    )
    with pytest.raises(HeadMoved):
        policy.plan_commit("r", "", "c1", branches, fork_token="t", now=1.0)


def test_fork_branch_name_is_deterministic_and_distinct() -> None:
    names = {policy.fork_branch_name(f"token-{i}") for i in range(1000)}
    assert len(names) == 1000
    assert policy.fork_branch_name("x") == policy.fork_branch_name("x") != MAIN_BRANCH


def test_is_head_and_branch_of() -> None:
    branches = [main("c3"), fork("t", "f1", "c1")]
    assert policy.is_head("f1", branches) and not policy.is_head("c1", branches)
    record = CheckpointRecord("r", "f1", policy.fork_branch_name("t"), "c1", b"")
    assert policy.branch_of(record, branches) == branches[1]


# -- claims ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "holder", "now", "decision"),
    [
        (None, "A", 0.0, "grant_new"),
        (Claim("r", "s", "", 3, 0.0), "A", 0.0, "grant_new"),
        (Claim("r", "s", "B", 3, 10.0), "A", 10.0, "grant_new"),
        (Claim("r", "s", "B", 3, 10.0), "A", 9.9, "conflict"),
        (Claim("r", "s", "A", 3, 10.0), "A", 9.9, "keep"),
        (Claim("r", "s", "A", 3, 10.0), "A", 10.0, "grant_new"),
    ],
)
def test_decide_claim(current: Claim | None, holder: str, now: float, decision: str) -> None:
    assert policy.decide_claim(current, holder, now) == decision


def test_fence_is_current() -> None:
    assert policy.fence_is_current(Claim("r", "s", "A", 2, 1.0), 2, "A")
    assert not policy.fence_is_current(Claim("r", "s", "A", 3, 1.0), 2, "A")
    assert not policy.fence_is_current(None, 1, "A")
    # The same number under another holder (a lost take handed out again), or released.
    assert not policy.fence_is_current(Claim("r", "s", "B", 2, 1.0), 2, "A")
    assert not policy.fence_is_current(Claim("r", "s", "", 2, 0.0), 2, "A")


def test_check_consumable() -> None:
    pending = InterruptRecord("r", MAIN_BRANCH, "i", None)
    policy.check_consumable(pending, "r", "i")
    with pytest.raises(ResumeConflict):
        policy.check_consumable(InterruptRecord("r", MAIN_BRANCH, "i", None, "consumed"), "r", "i")
    with pytest.raises(UnknownRecord) as err:
        policy.check_consumable(None, "r", "i")
    assert err.value.interrupt_id == "i"


# -- effects -----------------------------------------------------------------------------


def test_effect_action_table() -> None:
    intent = EffectRecord("r", "k", "idem", "intent")
    done = EffectRecord("r", "k", "idem", "done", b"o")
    for has_reconcile, idempotent in itertools.product([False, True], repeat=2):
        flags = {"has_reconcile": has_reconcile, "idempotent": idempotent}
        assert policy.effect_action(None, **flags) == "apply"
        assert policy.effect_action(done, **flags) == "return_recorded"
        expected = "reconcile" if has_reconcile else "reapply" if idempotent else "in_doubt"
        assert policy.effect_action(intent, **flags) == expected


def test_idempotency_key_is_deterministic_per_run_and_effect() -> None:
    key = policy.idempotency_key("run-1", "charge/charge#0")
    assert key == policy.idempotency_key("run-1", "charge/charge#0")
    assert (
        len(
            {
                key,
                policy.idempotency_key("run-2", "charge/charge#0"),
                policy.idempotency_key("run-1", "charge/charge#1"),
                policy.idempotency_key("run-1c", "harge/charge#0"),
            }
        )
        == 4
    )


# -- versions and retention --------------------------------------------------------------


def test_check_workflow_version() -> None:
    record = CheckpointRecord("r", "c1", MAIN_BRANCH, None, b"", workflow_version="v1")
    policy.check_workflow_version(record, None)
    policy.check_workflow_version(record, iter(["v1"]))
    with pytest.raises(VersionMismatch) as err:
        policy.check_workflow_version(record, ["v2"])
    assert (err.value.run_id, err.value.checkpoint_id) == ("r", "c1")


def _line(ids: list[str], branch: str = MAIN_BRANCH, root: str | None = None):
    out, parent = [], root
    for cid in ids:
        out.append(CheckpointRecord("r", cid, branch, parent, b""))
        parent = cid
    return out


def test_prunable_keeps_heads_bases_and_recent_ancestry() -> None:
    checkpoints = _line(["c1", "c2", "c3", "c4", "c5"]) + _line(["f1", "f2"], "fk", root="c2")
    branches = [main("c5", 5), BranchRecord("r", "fk", "f2", "", 2, "c2", "t")]
    assert policy.prunable(checkpoints, branches) == ["c1", "c3", "c4", "f1"]
    assert policy.prunable(checkpoints, branches, keep_last=2) == ["c1", "c3"]
    assert policy.prunable(checkpoints, branches, keep_last=10) == []
    with pytest.raises(ValueError):
        policy.prunable(checkpoints, branches, keep_last=0)
    # A branch whose head was never committed (a fresh fork) pins its base only.
    fresh = [main("c5", 5), BranchRecord("r", "fk2", "c3", "", 0, "c3", "t2")]
    assert policy.prunable(_line(["c1", "c2", "c3", "c4", "c5"]), fresh) == ["c1", "c2", "c4"]
