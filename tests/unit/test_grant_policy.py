"""The grant policy: carrying a lease into its holder's next phase, and each of its bounds.

``decide_carry`` alone, then through ``GroupBook.release`` (a hand-set clock, no Temporal);
and the default policy, written once."""

from __future__ import annotations

import ast
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError
from timeslice.plan.simulator import GroupSpec
from timeslice.protocol.group import (
    DEFAULT_AGING_S,
    DEFAULT_GRANT_POLICY,
    WAIT_RECORDS_KEEP,
    WAIT_SHARE_JOBS_KEEP,
    AcquireRequest,
    GrantPolicy,
    GroupConfig,
    GroupState,
    GroupStats,
    LeaseReturn,
    NextPhase,
    lease_key_hash,
)
from timeslice.workflows.grant_policy import (
    CarryLimits,
    decide_carry,
    record_wait,
    remember_job,
    waiting_share,
)
from timeslice.workflows.group_book import GroupBook

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SAMPLE = NextPhase(name="sample", expected_s=0.2)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# ------------------------------------------------------------------ the decision alone

PHASE = CarryLimits()
FIFO = CarryLimits(policy=GrantPolicy.FIFO)


@pytest.mark.parametrize(
    ("limits", "expected_s", "carries", "mine", "waiters", "keep", "contended", "why"),
    [
        # Nobody waits: kept under both policies (what keep_if_uncontended always did).
        (FIFO, 0.2, 0, 0.0, [], True, False, "carrying into sample"),
        (PHASE, 0.2, 0, 0.0, [], True, False, "carrying into sample"),
        # Someone waits: FIFO releases; phase_aware carries when every bound allows.
        (FIFO, 0.2, 0, 0.3, [("b", 0.0, 0)], False, False, "fifo: 1 waiting"),
        (PHASE, 0.2, 0, 0.0, [("b", 0.0, 0)], True, True, "carrying into sample"),
        # Starvation bound: one boundary per lease past waiters (max_carries=1) ...
        (PHASE, 0.2, 1, 0.5, [("b", 0.0, 0)], False, False, "carried 1 phase(s)"),
        (CarryLimits(max_carries=2), 0.2, 1, 0.5, [("b", 0.0, 0)], True, True, "carrying"),
        (CarryLimits(max_carries=0), 0.2, 0, 0.5, [("b", 0.0, 0)], False, False, "carried 0"),
        # ... and only into a phase stated no longer than carry_limit_s.
        (CarryLimits(carry_limit_s=5), 5.0, 0, 0.0, [("b", 0.0, 0)], True, True, "carrying"),
        (CarryLimits(carry_limit_s=5), 5.1, 0, 0.0, [("b", 0.0, 0)], False, False, "> carry limit"),
        # Fairness: a waiter that waited more than the holder (beyond the slack) goes first.
        (PHASE, 0.2, 0, 0.10, [("b", 0.15, 0)], True, True, "carrying"),
        (PHASE, 0.2, 0, 0.10, [("b", 0.16, 0)], False, False, "b waited more"),
        (PHASE, 0.2, 0, 0.10, [("b", 0.0, 0), ("c", 0.3, 0)], False, False, "c waited more"),
        (CarryLimits(share_slack=0), 0.2, 0, 0.1, [("b", 0.1, 0)], True, True, "carrying"),
        (CarryLimits(share_slack=0), 0.2, 0, 0.1, [("b", 0.11, 0)], False, False, "b waited"),
        # Priority: never past a waiter that asked higher than the holder; lower is fine.
        (PHASE, 0.2, 0, 0.5, [("b", 0.0, 1)], False, False, "b waits with a higher priority"),
        (PHASE, 0.2, 0, 0.0, [("b", 0.0, -1)], True, True, "carrying"),
    ],
)
def test_decide_carry(limits, expected_s, carries, mine, waiters, keep, contended, why):
    carry = decide_carry(
        limits,
        next_phase="sample",
        next_phase_s=expected_s,
        carries=carries,
        holder_share=mine,
        waiters=waiters,
    )
    assert (carry.keep, carry.contended) == (keep, contended)
    assert why in carry.reason


def test_waiting_share_is_time_waited_over_time_since_the_first_recorded_ask():
    records: list[float] = []
    assert waiting_share(records, 10.0) == 0.0
    record_wait(records, 0.0, 1.0)  # asked at 0, waited 1 s
    record_wait(records, 4.0, 2.0)  # asked at 4, waited 2 s
    assert waiting_share(records, 10.0) == pytest.approx(0.3)
    assert waiting_share(records, 0.0) == 0.0  # no time passed
    record_wait(records, 5.0, -3.0)  # a clock step back never counts as negative waiting
    assert records[-1] == 0.0
    for i in range(3 * WAIT_RECORDS_KEEP):
        record_wait(records, 10.0 + i, 0.5)
    assert len(records) == 2 * WAIT_RECORDS_KEEP  # the last grants only
    assert records[0] == 10.0 + 2 * WAIT_RECORDS_KEEP


def test_shares_are_kept_for_the_most_recently_granted_jobs():
    shares: dict[str, list[float]] = {}
    for i in range(WAIT_SHARE_JOBS_KEEP + 5):
        record_wait(remember_job(shares, f"j{i}"), float(i), 0.0)
    record_wait(remember_job(shares, "j5"), 99.0, 0.0)  # granted again: most recent now
    assert len(shares) == WAIT_SHARE_JOBS_KEEP
    assert "j0" not in shares and "j5" in shares and list(shares)[-1] == "j5"
    assert "j4" not in shares  # j5's refresh pushed the next oldest out


# ------------------------------------------------------------------ through the group book


def key(rid: str) -> str:
    return f"key-of-{rid}-0123456789abcdef"


def request(job: str, rid: str) -> AcquireRequest:
    return AcquireRequest(
        request_id=rid,
        key_hash=lease_key_hash(key(rid)),
        job_id=job,
        reply_task_queue=f"timeslice-job-{job}-0",
    )


def book(**config: object) -> GroupBook:
    return GroupBook(
        GroupConfig(group_id="g", **config),  # type: ignore[arg-type]
        GroupState(stats=GroupStats(created_at=T0)),
    )


def grant_next(b: GroupBook, now: datetime) -> int:
    waiter = b.take_next(now)
    assert waiter is not None
    notice = b.grant(waiter, now, parked=False)
    b.leases.confirm(notice.token, now)
    return notice.token


def release(b: GroupBook, rid: str, token: int, now: datetime, carry: NextPhase | None = SAMPLE):
    return b.release(
        LeaseReturn(
            request_id=rid, key=key(rid), token=token, keep_if_uncontended=True, carry_into=carry
        ),
        now,
    )


def test_a_contended_carry_keeps_the_lease_once_and_status_says_why():
    b = book()
    b.enqueue(request("a", "a:1"), at(0))
    token = grant_next(b, at(0))
    b.enqueue(request("b", "b:1"), at(1))
    answer = release(b, "a:1", token, at(2))  # train ends; b waits
    assert answer.valid and not answer.released and "carrying into sample" in answer.reason
    status = b.status(at(2))
    assert status.holder is not None and status.holder.carrying_into == "sample"
    assert status.stats.carried == 1
    # The carried phase ends with another carry ask: the bound says no, b is next.
    answer = release(b, "a:1", token, at(2.2))
    assert answer.released and "carried 1 phase(s) past waiters already" in answer.reason
    assert b.state.holder is None and b.waiters.peek_next(at(2.2)).request.job_id == "b"


def test_fifo_groups_and_unpatched_groups_release_to_a_waiter():
    for b in (book(grant_policy="fifo"), book()):
        if b.config.grant_policy is GrantPolicy.PHASE_AWARE:
            b.policy_gate = lambda: False  # a group that started before the policy
        b.enqueue(request("a", "a:1"), at(0))
        token = grant_next(b, at(0))
        b.enqueue(request("b", "b:1"), at(1))
        assert release(b, "a:1", token, at(2)).released
        assert b.state.stats.carried == 0


def test_an_uncontended_carry_never_asks_the_patch_gate():
    b = book()
    asked: list[bool] = []
    b.policy_gate = lambda: asked.append(True) or True
    b.enqueue(request("a", "a:1"), at(0))
    token = grant_next(b, at(0))
    answer = release(b, "a:1", token, at(1))
    assert not answer.released and asked == []  # the same decision FIFO makes


def test_the_holders_own_queued_request_is_not_a_waiter_it_must_yield_to():
    b = book(grant_policy="fifo")
    b.enqueue(request("a", "a:1"), at(0))
    token = grant_next(b, at(0))
    b.enqueue(request("a", "a:2"), at(0.5))  # another rank of the same job
    assert not release(b, "a:1", token, at(1)).released


def test_a_job_that_waited_less_cannot_hold_off_one_that_waited_more():
    for holder, waiter, kept in (("a", "b", False), ("b", "a", True)):
        b = book()
        # Over the last 10 s, a waited 0 s for its grants and b 3 s: shares 0.0 and 0.3.
        b.state.wait_shares = {"a": [0.0, 0.0], "b": [0.0, 3.0]}
        b.enqueue(request(holder, f"{holder}:1"), at(10))
        token = grant_next(b, at(10))
        b.enqueue(request(waiter, f"{waiter}:1"), at(10))
        assert b.accounts.waiting_share("a", at(10)) == 0.0  # its 0-s wait for this grant recorded
        assert b.accounts.waiting_share("b", at(10)) == pytest.approx(0.3)
        answer = release(b, f"{holder}:1", token, at(10))
        assert answer.released is not kept
        if not kept:
            assert "b waited more" in answer.reason
            assert b.waiters.peek_next(at(10)).request.job_id == "b"


def test_next_phase_is_validated():
    for bad in (
        {"name": "", "expected_s": 1},
        {"name": "a b", "expected_s": 1},
        {"name": "s", "expected_s": -1},
        {"name": "s", "expected_s": float("nan")},
        {"name": "s", "expected_s": 1e9},
    ):
        with pytest.raises(ValidationError):
            NextPhase.model_validate(bad)
    with pytest.raises(ValidationError):
        GroupConfig(group_id="g", grant_policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        GroupConfig(group_id="g", max_carries=5)


# ------------------------------------------------------------------ the default, named once

REPO = Path(__file__).resolve().parents[2]
# Every folder whose code may name a grant policy (the package, the benchmarks, the examples).
CODE = ("activities", "bench", "cli", "client", "examples", "integrations", "plan", "protocol",
        "report", "snapshot", "transport", "workers", "workflows", "workloads")  # fmt: skip
DEFAULT_MEMBER = DEFAULT_GRANT_POLICY.name


def _default_spelt_again(path: Path) -> list[str]:
    """Where ``path`` writes the default grant policy itself: its member
    (``GrantPolicy.PHASE_AWARE``) or any policy's value as a string, instead of naming
    ``DEFAULT_GRANT_POLICY`` (protocol/group.py defines both, once)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    values = {p.value for p in GrantPolicy}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == DEFAULT_MEMBER:
            found.append(f"{node.lineno}: GrantPolicy.{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in values and id(node) not in docstrings:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_the_default_policy_is_written_once() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{where}"
        for folder in CODE
        for path in sorted((REPO / folder).rglob("*.py"))
        for where in _default_spelt_again(path)
        if path != REPO / "protocol" / "group.py"
    ]
    assert not offenders, f"name DEFAULT_GRANT_POLICY (protocol/group.py) instead: {offenders}"
    assert GroupConfig(group_id="g").grant_policy is DEFAULT_GRANT_POLICY
    assert CarryLimits().policy is DEFAULT_GRANT_POLICY
    assert GroupSpec().grant_policy is DEFAULT_GRANT_POLICY
    assert GroupConfig(group_id="g").aging_s == GroupSpec().aging_s == DEFAULT_AGING_S


def test_the_checker_sees_the_default_spelt_again(tmp_path: Path) -> None:
    module = tmp_path / "elsewhere.py"
    module.write_text(
        '"""phase_aware is the default."""\n'
        "policy = GrantPolicy.PHASE_AWARE\n"
        'choices = ("phase_aware", "fifo")\n'
        "other = GrantPolicy.FIFO\n"
    )
    assert _default_spelt_again(module) == [
        "2: GrantPolicy.PHASE_AWARE",
        "3: 'phase_aware'",
        "3: 'fifo'",
    ]
