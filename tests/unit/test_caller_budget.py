"""Per-caller fairness: who sent a group's update, and how many each caller may send."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from timeslice.protocol.group import (
    CALLER_UPDATE_BURST,
    CALLER_UPDATES_PER_S,
    AcquireCall,
    AcquireRequest,
    CancelRequest,
    DepartRequest,
    GroupConfig,
    GroupState,
    GroupStats,
    LeaseReturn,
    MovedReport,
    RenewRequest,
    lease_key_hash,
)
from timeslice.workflows.caller_budget import CALLERS_KEEP, Caller, CallerBudgets, OverBudget
from timeslice.workflows.group_book import GroupBook

T0 = datetime(2026, 1, 1, tzinfo=UTC)
KEY = "the-holders-own-key-0123456789"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def request(job: str, key: str = KEY) -> AcquireRequest:
    return AcquireRequest(
        request_id=f"{job}:r",
        job_id=job,
        reply_task_queue=f"q-{job}",
        key_hash=lease_key_hash(key),
    )


def test_a_caller_gets_its_burst_then_its_rate():
    budgets = CallerBudgets()
    noisy = Caller("job noisy", proven=True)
    for _ in range(CALLER_UPDATE_BURST):
        assert budgets.over(noisy, at(0)) is None
        budgets.spend(noisy, at(0))
    over = budgets.over(noisy, at(0))
    assert over == OverBudget(
        "job noisy", 1 / CALLER_UPDATES_PER_S, CALLER_UPDATES_PER_S, CALLER_UPDATE_BURST
    )
    assert "job noisy sent more than 20 updates/s (bursts of 40)" in over.explain("g")
    assert "Send again in 50 ms" in over.explain("g")
    assert budgets.over(noisy, at(over.wait_s)) is None  # a token back after that long
    assert budgets.over(Caller("job other", proven=True), at(0)) is None
    # Idle for long, a caller has its burst again, never more.
    for _ in range(CALLER_UPDATE_BURST):
        budgets.spend(noisy, at(3600))
    assert budgets.over(noisy, at(3600)) is not None


def test_unproven_callers_also_share_one_budget():
    """A caller that names a new job with every message gets a new budget of its own each
    time: the budget all unproven messages share bounds it."""
    budgets = CallerBudgets(unproven_rate=1.0, unproven_burst=3)
    for i in range(3):
        budgets.spend(Caller(f"job j{i} (claimed)", proven=False), at(0))
    over = budgets.over(Caller("job j9 (claimed)", proven=False), at(0))
    assert over is not None and (over.budget, over.wait_s) == ("unproven messages", 1.0)
    assert budgets.over(Caller("job j9", proven=True), at(0)) is None  # proven: its own


def test_past_its_bound_an_idle_callers_budget_goes_first():
    budgets = CallerBudgets()
    spender = Caller("job spender", proven=True)
    for _ in range(CALLER_UPDATE_BURST):
        budgets.spend(spender, at(0))
    for i in range(CALLERS_KEEP + 10):  # names enough to fill the bound, each used once
        budgets.spend(Caller(f"job n{i}", proven=True), at(100))
    # The spender's budget is full again by now (idle), so it may go; a spending one may not.
    assert budgets.over(spender, at(100)) is None
    assert len(budgets._buckets) <= CALLERS_KEEP


def test_a_message_is_its_jobs_only_when_it_presents_that_jobs_key():
    book = GroupBook(GroupConfig(group_id="g"), GroupState(stats=GroupStats(created_at=T0)))
    held = request("holder")
    book.enqueue(held, at(0))
    waiter = book.take_next(at(0))
    assert waiter is not None
    notice = book.grant(waiter, at(0), parked=False)
    queued = request("queued", key="the-waiters-own-key-0123456789")
    book.enqueue(queued, at(1))
    lease = {"request_id": held.request_id, "token": notice.token}
    # The holder's own renewal and release are never limited.
    assert book.caller_of(RenewRequest(**lease, key=KEY)) is None
    assert book.caller_of(LeaseReturn(**lease, key=KEY)) is None
    # A forger naming the holder's lease without its key spends no budget of the holder's.
    forged = book.caller_of(RenewRequest(**lease, key="a-forgers-guess-0123456789"))
    assert forged == Caller("unknown", proven=False)
    # The waiter's cancel with its key is the waiter's; a new acquire only claims its job.
    cancel = CancelRequest(request_id=queued.request_id, key="the-waiters-own-key-0123456789")
    assert book.caller_of(cancel) == Caller("job queued", proven=True)
    assert book.caller_of(AcquireCall(request=request("holder"))) == Caller(
        "job holder (claimed)", proven=False
    )
    # Reports and departures: the job's last lease's key proves the job.
    report = MovedReport(job_id="holder", key=KEY, evicted=[])
    assert book.caller_of(report) == Caller("job holder", proven=True)
    depart = DepartRequest(job_id="holder", key="a-forgers-guess-0123456789")
    assert book.caller_of(depart) == Caller("job holder (claimed)", proven=False)


def test_the_book_refuses_a_flooder_and_counts_it_never_the_holders_renewal():
    """What the group's validators ask: a flood past its budget is refused (and counted),
    while the holder's renewal, sent as often as you like, never is."""
    book = GroupBook(GroupConfig(group_id="g"), GroupState(stats=GroupStats(created_at=T0)))
    book.enqueue(request("holder"), at(0))
    waiter = book.take_next(at(0))
    assert waiter is not None
    notice = book.grant(waiter, at(0), parked=False)
    renew = RenewRequest(request_id="holder:r", token=notice.token, key=KEY)
    flood = AcquireCall(request=request("noisy", key="the-noisy-jobs-key-0123456789"))
    refused = 0
    for i in range(1000):  # 1000 updates in 1 s from the flooder, a renewal between each
        now = at(i / 1000)
        if book.over_budget(flood, now) is None:
            book.spend_budget(flood, now)
        else:
            refused += 1
        assert book.over_budget(renew, now) is None
        book.spend_budget(renew, now)
    taken = 1000 - refused
    assert CALLER_UPDATE_BURST <= taken <= CALLER_UPDATE_BURST + CALLER_UPDATES_PER_S + 1
    assert book.state.stats.rate_limited == refused
