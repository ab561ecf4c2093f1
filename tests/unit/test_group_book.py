"""The group's decisions without Temporal: GroupBook driven with a hand-set clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from timeslice.protocol.group import (
    MAX_ACQUIRE_TIMEOUT_S,
    STATUS_SLACK_S,
    AcquireRequest,
    GroupConfig,
    GroupState,
    GroupStats,
    LeaseOutcome,
    LeaseReturn,
    MovedReport,
    QueueTarget,
    ReleaseRequest,
    RenewRequest,
    ResidentJob,
    SnapshotReport,
    SnapshotTarget,
    lease_key_hash,
)
from timeslice.workflows.group_book import GroupBook, SwitchDone

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def book(**config: object) -> GroupBook:
    return GroupBook(
        GroupConfig(group_id="g", **config),  # type: ignore[arg-type]
        GroupState(stats=GroupStats(created_at=T0)),
    )


def key(rid: str) -> str:
    """The lease key only the requester of ``rid`` knows (in these tests: derived from it)."""
    return f"key-of-{rid}-0123456789abcdef"


def request(job: str, rid: str | None = None, **fields: object) -> AcquireRequest:
    rid = rid or f"{job}:r"
    return AcquireRequest(
        request_id=rid,
        key_hash=lease_key_hash(key(rid)),
        job_id=job,
        reply_task_queue=f"timeslice-job-{job}-0",
        **fields,  # type: ignore[arg-type]
    )


def target(job: str) -> SnapshotTarget:
    return SnapshotTarget(queues=[QueueTarget(task_queue=f"q-{job}", backends=["x"])])


def report(job: str, nbytes: int = 100, seconds: float = 0.5) -> SnapshotReport:
    return SnapshotReport(job_id=job, backend="x", mode="t", bytes=nbytes, seconds=seconds)


def grant_next(b: GroupBook, now: datetime, *, parked: bool = False) -> str:
    waiter = b.take_next(now)
    assert waiter is not None
    plan = b.residency.plan_switch(waiter.request)
    b.finish_switch(SwitchDone(plan, waiter.request, now, now, moved_bytes=0, waited_for=None))
    notice = b.grant(waiter, now, parked=parked)
    if not parked:
        b.leases.confirm(notice.token, now)
    return waiter.request.job_id


# ---------------------------------------------------------------------------- who is next


@pytest.mark.parametrize(
    ("arrivals", "picks_at", "expected"),
    [
        # (job, priority, enqueued at s); FIFO among equals
        ([("a", 0, 0), ("b", 0, 1), ("c", 0, 2)], 3, ["a", "b", "c"]),
        # higher priority first, whatever the order of arrival
        ([("a", 0, 0), ("b", 5, 1), ("c", 1, 2)], 3, ["b", "c", "a"]),
        # ageing: 60 s of waiting is worth one level (aging_s 60)
        ([("old", 0, 0), ("new", 1, 119)], 120, ["old", "new"]),
        ([("old", 0, 0), ("new", 2, 119)], 120, ["new", "old"]),
        # priorities below zero wait for everyone else
        ([("low", -3, 0), ("mid", 0, 10)], 11, ["mid", "low"]),
    ],
)
def test_queue_order(arrivals, picks_at, expected):
    b = book()
    for job, priority, t in arrivals:
        assert b.enqueue(request(job, priority=priority), at(t))
    order = []
    while (w := b.take_next(at(picks_at))) is not None:
        order.append(w.request.job_id)
        b.switching_for = None
    assert order == expected


def test_enqueue_is_idempotent_by_request_id():
    b = book()
    assert b.enqueue(request("a"), at(0))
    assert not b.enqueue(request("a"), at(1))  # a retry across a dropped RPC
    assert len(b.state.queue) == 1
    grant_next(b, at(2))
    assert not b.enqueue(request("a"), at(3))  # the holder's own request
    b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(4))
    assert not b.enqueue(request("a"), at(5))  # done: a late duplicate is not a new request


# ---------------------------------------------------------------------------- deadlines


def test_holder_expires_at_its_ttl_unless_renewed():
    b = book(default_ttl_s=10)
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    assert b.next_deadline() == at(10)
    assert b.renew(RenewRequest(request_id="a:r", key=key("a:r"), token=1), at(8)).valid
    assert b.next_deadline() == at(18)
    b.expire(at(17.9))
    assert b.state.holder is not None
    b.expire(at(18))
    assert b.state.holder is None
    assert b.state.history[-1].outcome is LeaseOutcome.EXPIRED
    assert b.state.stats.expired == 1


def test_a_renewal_handled_before_the_expiry_is_processed_renews_the_lease():
    """The group's workflow task ran late (the control worker or the server was slow or down
    past the TTL): a renewal handled before the expiry renews the lease from its own time, and
    nobody else was granted meanwhile."""
    b = book(default_ttl_s=10)
    for job in ("a", "b"):
        b.enqueue(request(job), at(0))
    grant_next(b, at(0))
    result = b.renew(RenewRequest(request_id="a:r", key=key("a:r"), token=1), at(25))
    assert result.valid and result.ttl_s == 10
    assert b.next_deadline() == at(35)
    b.expire(at(30))
    assert b.state.holder is not None and b.state.holder.token == 1
    assert b.state.stats.expired == 0 and [w.request.job_id for w in b.state.queue] == ["b"]
    b.expire(at(35))  # processed expiry ends it: a renewal after that renews nothing
    assert b.state.holder is None and b.state.stats.expired == 1
    late = b.renew(RenewRequest(request_id="a:r", key=key("a:r"), token=1), at(36))
    assert not late.valid and "no longer held" in late.reason


def test_before_the_patch_a_late_renewal_ended_the_lease_as_expired():
    """Groups that started before LATE_RENEWAL_RENEWS replay as they ran."""
    b = book(default_ttl_s=10)
    b.late_renewal_gate = lambda: False
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    result = b.renew(RenewRequest(request_id="a:r", key=key("a:r"), token=1), at(25))
    assert not result.valid and "expired" in result.reason
    assert b.state.holder is None and b.state.stats.expired == 1


def test_a_parked_grant_is_confirmed_by_renewal_or_release_else_the_holder_is_dead():
    b = book(grant_ack_timeout_s=15, default_ttl_s=20)
    for job in ("a", "b"):
        b.enqueue(request(job), at(0))
    grant_next(b, at(0), parked=True)
    assert b.next_deadline() == at(15)  # until confirmed, the confirmation deadline
    assert b.renew(RenewRequest(request_id="a:r", key=key("a:r"), token=1), at(5)).valid
    assert b.state.holder is not None and b.state.holder.delivered
    assert b.next_deadline() == at(25)  # now the TTL runs
    b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(6))
    grant_next(b, at(6), parked=True)  # b never confirms
    b.expire(at(20.9))
    assert b.state.holder is not None
    b.expire(at(21))
    assert b.state.holder is None and b.state.stats.dead_waiters == 1
    assert b.state.history[-1].outcome is LeaseOutcome.DEAD


def test_waiters_time_out_and_the_longest_timeout_never_overflows():
    b = book()
    b.enqueue(request("quick", timeout_s=5), at(0))
    b.enqueue(request("patient", timeout_s=MAX_ACQUIRE_TIMEOUT_S), at(0))
    b.enqueue(request("forever"), at(0))
    assert b.next_deadline() == at(5)
    b.expire(at(5))
    assert [w.request.job_id for w in b.state.queue] == ["patient", "forever"]
    assert b.state.stats.timed_out == 1
    assert b.next_deadline() == at(MAX_ACQUIRE_TIMEOUT_S)
    # Longer than a datetime can hold, or not a number: refused before it reaches a group
    # (it used to fail every workflow task of the group, for good).
    for bad in (1e12, 3e11, float("inf"), float("nan"), -1):
        with pytest.raises(ValidationError):
            request("bad", timeout_s=bad)


# ---------------------------------------------------------------------------- releases


def test_release_is_fenced_by_token_and_request():
    b = book()
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    for rid, token in (("a:r", 2), ("forged", 1), ("a:r", 0)):
        answer = b.release(LeaseReturn(request_id=rid, key=key(rid), token=token), at(1))
        assert not answer.valid and not answer.released
    assert b.state.holder is not None and b.state.stats.stale_messages == 3
    assert b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(2)).released
    # The release sent again (its answer lost) is answered released, and counted once; with
    # another key it is not valid. Neither is counted as stale.
    again = b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(3))
    assert again.valid and again.released and not again.evict
    assert not b.release(LeaseReturn(request_id="a:r", key=key("b:r"), token=1), at(3)).valid
    assert b.state.stats.stale_messages == 3 and b.state.stats.released == 1


def test_a_release_of_a_lease_that_expired_is_not_valid_however_often_sent():
    b = book()
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    b.expire(at(1_000))
    assert b.state.holder is None
    for when in (1_001, 1_002):
        answer = b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(when))
        assert not answer.valid and not answer.released


def test_a_release_without_the_lease_key_is_refused_by_update_and_by_signal():
    b = book()
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    wrong = key("someone else")
    assert not b.release(LeaseReturn(request_id="a:r", key=wrong, token=1), at(1)).valid
    b.release_by_signal(ReleaseRequest(request_id="a:r", key=wrong, token=1), at(1))
    assert not b.renew(RenewRequest(request_id="a:r", key=wrong, token=1), at(1)).valid
    b.cancel("a:r", wrong, at(1))
    assert b.state.holder is not None and b.state.stats.forged_messages == 4
    assert b.state.stats.stale_messages == 0
    b.release_by_signal(ReleaseRequest(request_id="a:r", key=key("a:r"), token=1), at(2))
    assert b.state.holder is None and b.state.stats.released == 1


@pytest.mark.parametrize(
    ("waiting", "keep", "released"),
    [([], True, False), (["b"], True, True), ([], False, True), (["b"], False, True)],
)
def test_a_lease_is_kept_only_when_asked_and_nobody_waits(waiting, keep, released):
    b = book()
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    for job in waiting:
        b.enqueue(request(job), at(1))
    answer = b.release(
        LeaseReturn(request_id="a:r", key=key("a:r"), token=1, keep_if_uncontended=keep), at(2)
    )
    assert answer.valid and answer.released is released
    assert (b.state.holder is None) is released


def test_holder_evicts_itself_only_for_another_job_and_the_next_waits_unless_both_fit():
    b = book(memory_bytes=300)
    b.enqueue(request("a", snapshot=target("a"), state_bytes=200), at(0))
    grant_next(b, at(0))
    assert b.state.resident is not None and b.state.resident.job_id == "a"
    # Nobody waits: sticky residency, nothing moves.
    b.enqueue(request("a", "a:2", snapshot=target("a"), state_bytes=200), at(1))
    answer = b.release(
        LeaseReturn(request_id="a:r", key=key("a:r"), token=1, evicts_itself=True), at(1)
    )
    assert not answer.evict
    grant_next(b, at(1))
    big = request("big", snapshot=target("big"), state_bytes=200)
    small = request("small", snapshot=target("small"), state_bytes=100)
    b.enqueue(big, at(2))
    answer = b.release(
        LeaseReturn(request_id="a:2", key=key("a:2"), token=2, evicts_itself=True), at(3)
    )
    assert answer.evict and b.state.evicting is not None and b.state.resident is None
    assert b.residency.eviction_to_await(big) is not None  # 200 + 200 > 300: wait for the report
    assert b.residency.eviction_to_await(small) is None  # 200 + 100 fit: restore alongside
    # The evicting job itself asking again waits for its own state to be out first.
    assert b.residency.eviction_to_await(request("a", "a:3", snapshot=target("a"), state_bytes=200))
    b.moved(MovedReport(job_id="a", key=key("a:2"), evicted=[report("a", 200)]), at(3.2))
    assert b.state.evicting is None and b.residency.eviction_to_await(big) is None
    assert b.state.stats.bytes_moved == 200 and "a" in b.state.evicted_jobs


def _a_then_b_evict_themselves(b: GroupBook) -> None:
    """Memory for two of three 100-byte jobs: ``a`` holds, releases evicting itself with ``b``
    next (the two fit: ``b`` is granted beside ``a``'s eviction); then ``c`` waits and ``b``
    releases evicting itself before ``a``'s report came."""
    for job in ("a", "b"):
        b.enqueue(request(job, snapshot=target(job), state_bytes=100), at(0))
    grant_next(b, at(0))
    answer = b.release(
        LeaseReturn(request_id="a:r", key=key("a:r"), token=1, evicts_itself=True), at(1)
    )
    assert answer.evict
    assert b.residency.eviction_to_await(b.state.queue[0].request) is None  # a and b fit
    grant_next(b, at(1))
    b.enqueue(request("c", snapshot=target("c"), state_bytes=100), at(2))
    answer = b.release(
        LeaseReturn(request_id="b:r", key=key("b:r"), token=2, evicts_itself=True), at(3)
    )
    assert answer.evict and b.state.evicting is not None and b.state.evicting.job_id == "b"


def test_an_eviction_under_way_is_not_forgotten_when_another_holder_evicts_itself():
    """The reviewer's case: b's own eviction began while a's was still counted under way. c
    fits beside b, but not beside a and b: a stays on the books until it is confirmed, and
    nothing is staged meanwhile."""
    b = book(memory_bytes=200)
    _a_then_b_evict_themselves(b)
    assert [r.job_id for r in b.state.unconfirmed_evictions] == ["a"]
    assert b.residency.knows("a") and "a" in b.residency.tracked_jobs()
    c = b.state.queue[0].request
    assert b.residency.eviction_to_await(c) is None  # b and c fit: only a is in question
    staged = request("s", "s:1", snapshot=target("s"), state_bytes=1, restores_itself=True)
    b.state.evicted_jobs.append("s")
    b.residency.note_restore_time("s", 1.0)
    assert not b.residency.may_stage(staged, "c")
    # The switch to c confirms a first (the group's snapshot activity), and counts it no more.
    assert [r.job_id for r in b.residency.take_unconfirmed(c)] == ["a"]
    assert b.state.unconfirmed_evictions == []


def test_an_unconfirmed_eviction_ends_with_its_report_or_its_jobs_departure():
    b = book(memory_bytes=200)
    _a_then_b_evict_themselves(b)
    b.moved(MovedReport(job_id="a", key=key("a:r"), evicted=[report("a", 100)]), at(4))
    assert b.state.unconfirmed_evictions == []
    assert b.state.evicting is not None and b.state.evicting.job_id == "b"  # b's still runs
    b2 = book(memory_bytes=200)
    _a_then_b_evict_themselves(b2)
    assert b2.depart("a", key("a:r"))
    assert b2.state.unconfirmed_evictions == []


def test_an_unconfirmed_eviction_is_not_confirmed_for_its_own_job_or_in_host_memory():
    b = book(memory_bytes=200)
    _a_then_b_evict_themselves(b)
    # a itself asks again: its process restores only after its own eviction is done.
    assert b.residency.take_unconfirmed(request("a", "a:2", snapshot=target("a"))) == []
    b2 = book(memory_bytes=200)
    _a_then_b_evict_themselves(b2)
    b2.state.unconfirmed_evictions[0].snapshot = hosted("a")
    assert b2.residency.take_unconfirmed(request("c", "c:2", snapshot=hosted("c"))) == []


def test_before_the_patch_an_eviction_under_way_was_overwritten():
    """Groups that started before UNCONFIRMED_EVICTIONS_KEPT replay as they ran."""
    b = book(memory_bytes=200)
    b.residency.keeps_unconfirmed = False
    _a_then_b_evict_themselves(b)
    assert b.state.unconfirmed_evictions == []


# ---------------------------------------------------------------------------- cancel


def test_cancel_dequeues_or_ends_a_raced_grant():
    b = book()
    for job in ("a", "b", "c"):
        b.enqueue(request(job), at(0))
    grant_next(b, at(0))
    b.cancel("b:r", key("b:r"), at(1))  # queued
    assert [w.request.job_id for w in b.state.queue] == ["c"]
    b.cancel("a:r", key("a:r"), at(2))  # holding: the grant raced the give-up
    assert b.state.holder is None and b.state.history[-1].outcome is LeaseOutcome.CANCELLED
    waiter = b.take_next(at(3))
    assert waiter is not None
    b.cancel("c:r", key("c:r"), at(3))  # mid-switch: the switch finishes, the grant is dropped
    assert b.switch_cancelled and b.known("c:r")
    assert b.state.stats.cancelled == 3


# ---------------------------------------------------------------------------- switches


@pytest.mark.parametrize(
    ("resident", "evicted", "restores_itself", "memory", "expect"),
    [
        # (resident job, jobs evicted before, requester restores itself, memory, plan)
        ("b", [], False, None, {"evict": None, "restore": False, "overlapped": False}),
        ("a", [], False, None, {"evict": "a", "restore": False, "overlapped": False}),
        ("a", ["b"], False, None, {"evict": "a", "restore": True, "overlapped": False}),
        # both fit: the eviction runs beside the grant (nobody waits for it)
        ("a", ["b"], False, 1000, {"evict": "a", "restore": True, "overlapped": True}),
        ("a", ["b"], True, 1000, {"evict": "a", "restore": False, "overlapped": True}),
        ("a", [], False, 1000, {"evict": "a", "restore": False, "overlapped": True}),
        ("a", [], False, 700, {"evict": "a", "restore": False, "overlapped": False}),
        (None, ["b"], False, None, {"evict": None, "restore": True, "overlapped": False}),
    ],
)
def test_switch_plans(resident, evicted, restores_itself, memory, expect):
    b = book(memory_bytes=memory)
    if resident is not None:
        b.enqueue(request(resident, snapshot=target(resident), state_bytes=400), at(0))
        grant_next(b, at(0))
        b.release(LeaseReturn(request_id=f"{resident}:r", key=key(f"{resident}:r"), token=1), at(1))
    b.state.evicted_jobs.extend(evicted)
    req = request(
        "b", "b:2", snapshot=target("b"), state_bytes=400, restores_itself=restores_itself
    )
    plan = b.residency.plan_switch(req)
    assert (plan.evict.job_id if plan.evict else None) == expect["evict"]
    assert (plan.restore, plan.overlapped) == (expect["restore"], expect["overlapped"])
    assert plan.restores_itself == (restores_itself and "b" in evicted)
    if plan.overlapped:  # the evicting job is tracked until its eviction is done
        assert b.state.evicting is not None and b.state.resident is None
        bigger = request("c", "c:1", snapshot=target("c"), state_bytes=700)
        assert b.residency.eviction_to_await(bigger) is not None
        b.eviction_done("a", gone=False, ok=True, now=at(2))
        assert b.state.evicting is None and "a" in b.state.evicted_jobs


def test_one_eviction_beside_a_grant_at_a_time():
    b = book(memory_bytes=1000)
    for job in ("a", "b"):
        b.enqueue(request(job, snapshot=target(job), state_bytes=300), at(0))
        grant_next(b, at(0))
        b.release(
            LeaseReturn(request_id=f"{job}:r", key=key(f"{job}:r"), token=b.state.next_token - 1),
            at(0),
        )
    # b's grant evicted a beside it; a is still moving out when c takes the group from b
    assert b.state.evicting is not None and b.state.evicting.job_id == "a"
    plan = b.residency.plan_switch(request("c", snapshot=target("c"), state_bytes=300))
    assert plan.evict is not None and plan.evict.job_id == "b" and not plan.overlapped


# ---------------------------------------------------------------------------- staged restores


def _holder_and_waiter(
    memory: int | None, *, waiter_bytes: int = 400, restore_s: float = 0.1, **waiter: object
):
    """``a`` holds the group (400 bytes on the device); ``b``, evicted before (its last own
    restore took ``restore_s``), waits."""
    b = book(memory_bytes=memory)
    b.enqueue(request("a", snapshot=target("a"), state_bytes=400), at(0))
    grant_next(b, at(0))
    b.state.evicted_jobs.append("b")
    b.residency.note_restore_time("b", restore_s)
    fields: dict[str, object] = {
        "snapshot": target("b"), "state_bytes": waiter_bytes, "restores_itself": True, **waiter
    }  # fmt: skip
    b.enqueue(request("b", "b:2", **fields), at(1))
    return b, b.state.queue[0].request


@pytest.mark.parametrize(
    ("memory", "waiter", "stages"),
    [
        (800, {}, True),  # the holder's 400 and the waiter's 400 fit in 800
        (799, {}, False),  # one byte short
        (None, {}, False),  # no declared memory: the group cannot know it fits
        (800, {"restores_itself": False}, False),  # the group restores it at its grant
        (800, {"state_bytes": None}, False),  # undeclared bytes
        (800, {"snapshot": None}, False),  # nothing to move it with
        (800, {"restore_s": 0.049}, False),  # too quick to repay the activity it costs
        (800, {"restore_s": 0.05}, True),
    ],
)
def test_the_next_waiter_is_staged_only_when_it_fits_beside_the_holder(memory, waiter, stages):
    b, req = _holder_and_waiter(memory, **waiter)
    assert b.residency.may_stage(req, "a") is stages
    assert not b.residency.may_stage(req, None)  # a free group grants at once instead
    assert not b.residency.may_stage(req, "b")  # its own job holds


def test_an_eviction_under_way_counts_against_a_staged_restore():
    b, req = _holder_and_waiter(1200)
    b.state.evicting = ResidentJob(job_id="c", snapshot=target("c"), state_bytes=500)
    assert not b.residency.may_stage(req, "a")  # 400 + 500 + 400 > 1200
    b.residency.clear_evicting("c")
    assert b.residency.may_stage(req, "a")


def test_a_holders_own_restore_time_is_kept_from_its_release():
    b = book(memory_bytes=800)
    b.enqueue(request("a", snapshot=target("a"), state_bytes=400), at(0))
    grant_next(b, at(0))
    ret = LeaseReturn(request_id="a:r", key=key("a:r"), token=1, restored=[report("a", 400, 0.2)])
    b.release(ret, at(1))
    assert b.state.restore_s == {"a": 0.2}


@pytest.mark.parametrize("report_later", [False, True])
def test_a_waiter_still_evicting_itself_is_staged_only_if_its_report_comes_later(report_later):
    b, req = _holder_and_waiter(800)
    b.state.evicting = ResidentJob(job_id="b", snapshot=target("b"), state_bytes=400)
    b.state.evicting_report_later = report_later
    # Its process restores after its own eviction; its bytes count once (400 + 400 fit).
    assert b.residency.may_stage(req, "a") is report_later


def test_a_job_not_evicted_here_is_not_staged():
    b, req = _holder_and_waiter(800)
    b.state.evicted_jobs.remove("b")  # never here, or forgotten: where its state is is unknown
    assert not b.residency.may_stage(req, "a")


def test_a_staged_job_is_granted_without_a_restore_and_becomes_resident():
    b, req = _holder_and_waiter(800)
    b.residency.stage(req)
    assert not b.residency.may_stage(req, "a")  # one staged at a time
    assert b.status(at(1)).staged_job == "b" and "staged: b" in b.details(at(1))
    assert b.residency.knows("b") and "b" in b.residency.tracked_jobs()
    b.residency.staged_in("b")
    assert b.state.staged_ready and b.state.stats.staged_restores == 1
    assert "b" not in b.state.evicted_jobs
    b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1, evicts_itself=True), at(2))
    plan = b.residency.plan_switch(req)
    assert not plan.restore and not plan.restores_itself  # its state is already in
    b.finish_switch(SwitchDone(plan, req, at(2), at(2), moved_bytes=0, waited_for=None))
    assert b.residency.is_resident("b") and b.state.staged is None


def test_a_staged_state_taken_off_again_is_counted_and_restored_at_its_grant():
    b, req = _holder_and_waiter(800)
    b.residency.stage(req)
    b.residency.staged_in("b")
    b.residency.staged_left("b")  # another job was granted first
    assert b.state.staged is None and b.state.stats.staged_unused == 1
    assert "b" in b.state.evicted_jobs  # its next grant restores it again
    assert b.residency.plan_switch(req).restores_itself


@pytest.mark.parametrize("how", ["forget", "failed", "left"])
def test_a_staged_job_that_is_gone_failed_or_moved_out_is_no_longer_staged(how):
    b, req = _holder_and_waiter(800)
    b.residency.stage(req)
    b.residency.staged_in("b")
    if how == "forget":
        b.forget("b")
        assert "b" not in b.state.restore_s
    elif how == "failed":
        b.residency.move_failed("b", "restore failed")
    else:
        b.residency.left_device("b")
    assert b.state.staged is None and not b.residency.is_staged("b")
    assert ("b" in b.state.evicted_jobs) is (how == "left")


def test_a_faulted_job_is_refused_and_others_served():
    b = book()
    b.residency.fault("bad", "snapshot failed")
    b.enqueue(request("bad"), at(0))
    b.enqueue(request("good"), at(0))
    waiter = b.take_next(at(1))
    assert waiter is not None
    plan = b.residency.plan_switch(waiter.request)
    assert plan.fault is not None and "snapshot failed" in plan.fault
    notice = b.refuse(waiter, plan.fault, at(1))
    assert notice.fault is not None and b.state.holder is None
    assert grant_next(b, at(2)) == "good"


def test_moved_state_leaves_the_group():
    b = book()
    b.enqueue(request("a", snapshot=target("a")), at(0))
    grant_next(b, at(0))
    b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(1))
    # The job's next phase needs the state on another group's device.
    b.moved(MovedReport(job_id="a", key=key("a:r"), evicted=[report("a", 64)]), at(2))
    assert b.state.resident is None and b.state.evicted_jobs == ["a"]
    assert b.state.switch_history[-1].bytes == 64


def _answered_evict(b: GroupBook, job: str = "a") -> None:
    """``job`` holds, another job waits, and ``job`` releases with evicts_itself: answered evict."""
    b.enqueue(request(job, snapshot=target(job)), at(0))
    grant_next(b, at(0))
    b.enqueue(request("other"), at(0.5))
    answer = b.release(
        LeaseReturn(
            request_id=f"{job}:r", key=key(f"{job}:r"), token=b.state.next_token - 1,
            evicts_itself=True,
        ),
        at(1),
    )  # fmt: skip
    assert answer.evict and b.state.evicting is not None


def test_a_failed_eviction_the_group_asked_for_faults_the_job():
    b = book()
    _answered_evict(b)
    b.moved(MovedReport(job_id="a", key=key("a:r"), evicted=[], error="disk full"), at(3))
    assert "disk full" in b.state.faulted_jobs["a"]
    assert b.state.evicting is None and b.state.evicting_key_hash is None


def test_naming_a_job_in_a_failed_eviction_report_does_not_fault_it():
    """The tester's repro: acquire as the victim's job id, release (nobody waits, so the group
    asks for no eviction), then report a failed eviction with the key that release left."""
    b = book()
    b.enqueue(request("victim", "mallory:1", snapshot=target("victim")), at(0))
    grant_next(b, at(0))
    b.release(LeaseReturn(request_id="mallory:1", key=key("mallory:1"), token=1), at(1))
    report_ = MovedReport(job_id="victim", key=key("mallory:1"), evicted=[], error="x" * 2000)
    b.moved(report_, at(2))
    assert b.state.faulted_jobs == {} and b.state.stats.stale_messages == 1
    # The victim's own next acquire is granted, not refused.
    b.enqueue(request("victim", "victim:2", snapshot=target("victim")), at(3))
    assert grant_next(b, at(3)) == "victim" and b.state.holder is not None
    # Before this rule (runs recorded earlier replay with it), the same report faulted the job.
    old = book()
    old.enqueue(request("victim", "mallory:1"), at(0))
    grant_next(old, at(0))
    old.release(LeaseReturn(request_id="mallory:1", key=key("mallory:1"), token=1), at(1))
    old.moved(report_, at(2), faults_only_if_asked=False)
    assert "victim" in old.state.faulted_jobs


def test_only_the_lease_answered_evict_reports_its_failure():
    b = book(memory_bytes=1000)
    _answered_evict(b)
    # The key of another lease (here: forged) faults nothing and leaves the eviction awaited.
    b.moved(MovedReport(job_id="a", key=key("a:other"), evicted=[], error="no"), at(2))
    assert b.state.faulted_jobs == {} and b.state.evicting is not None
    # An eviction the group runs itself (both fit) awaits no report from the holder.
    c = book(memory_bytes=1000)
    c.enqueue(request("a", snapshot=target("a"), state_bytes=300), at(0))
    grant_next(c, at(0))
    c.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(1))
    c.enqueue(request("b", snapshot=target("b"), state_bytes=300), at(1))
    waiter = c.take_next(at(1))
    assert waiter is not None and c.residency.plan_switch(waiter.request).overlapped
    c.moved(MovedReport(job_id="a", key=key("a:r"), evicted=[], error="no"), at(2))
    assert c.state.faulted_jobs == {} and c.state.stats.stale_messages == 1


def test_a_gone_evictor_is_forgotten():
    """The holder answered evict died before reporting, and the group's own eviction found no
    process: its state went with its processes, so its next grant restores nothing."""
    b = book()
    _answered_evict(b)
    assert "a" in b.state.evicted_jobs
    b.residency.clear_evicting()
    b.evictor_gone("a")
    assert "a" not in b.state.evicted_jobs and b.state.evicting is None
    assert b.state.stats.departed == 1
    plan = b.residency.plan_switch(request("a", "a:2", snapshot=target("a")))
    assert not plan.restore and plan.fault is None


def test_depart_forgets_a_job_but_not_while_it_holds():
    b = book()
    b.enqueue(request("a", snapshot=target("a")), at(0))
    grant_next(b, at(0))
    assert not b.depart("a", key("a:r"))
    b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(1))
    assert not b.depart("a", key("someone-else")) and b.state.stats.forged_messages == 1
    assert b.depart("a", key("a:r")) and b.state.resident is None and b.state.stats.departed == 1
    assert not b.depart("never-seen", key("x"))


# ---------------------------------------------------------------------------- accounting


def test_busy_switching_and_idle_add_up_to_the_wall():
    b = book()
    b.enqueue(request("a", snapshot=target("a")), at(0))
    grant_next(b, at(0))
    # The holder restored itself for 0.5 s of its 4-s lease: switching, not busy.
    b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1, restored=[report("a")]), at(4))
    status = b.status(at(10))
    assert status.wall_s == 10
    assert status.stats.busy_s == pytest.approx(3.5)
    assert status.stats.switching_s == pytest.approx(0.5)
    assert status.idle_s == pytest.approx(6.0)
    assert status.held_share == pytest.approx(0.35)
    # A lease held now counts up to the query.
    b.enqueue(request("b"), at(10))
    grant_next(b, at(10))
    assert b.status(at(12)).held_share == pytest.approx(5.5 / 12)


def test_wait_samples_are_bounded_and_give_percentiles():
    b = book(wait_samples_keep=3)
    for i, job in enumerate(["a", "b", "c", "d"]):
        b.enqueue(request(job), at(0))
        grant_next(b, at(i + 1))
        b.release(LeaseReturn(request_id=f"{job}:r", key=key(f"{job}:r"), token=i + 1), at(i + 1))
    assert b.state.stats.wait_samples_s == [2.0, 3.0, 4.0]
    status = b.status(at(5))
    assert (status.wait_p50_s, status.wait_p99_s) == (3.0, 4.0)


# ---------------------------------------------------------------------------- a reader's clock


def test_status_read_on_a_clock_ahead_never_runs_past_the_next_deadline():
    """A group runs a workflow task by its next deadline (here the lease's expiry), so a status
    is stale at most until then: a reader an hour ahead sees the lease at its end, not 3,600 s
    held and "expires in -3,580 s"."""
    b = book(default_ttl_s=20.0)
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    status = b.status(at(0))
    assert status.next_deadline == at(20)
    ahead = status.advanced_to(at(3600))
    assert ahead.holder is not None
    assert ahead.holder.expires_in_s == 0.0
    assert ahead.holder.held_s == pytest.approx(20 + STATUS_SLACK_S)
    assert ahead.wall_s == pytest.approx(status.wall_s + 20 + STATUS_SLACK_S)
    assert 0.0 <= ahead.held_share <= 1.0
    # Within the deadline the figures advance exactly.
    soon = status.advanced_to(at(8))
    assert soon.holder is not None
    assert (soon.holder.held_s, soon.holder.expires_in_s) == (pytest.approx(8), pytest.approx(12))
    # A reader behind the group's clock sees the figures as of the query, never less.
    behind = status.advanced_to(at(-3600))
    assert behind.holder == status.holder and behind.wall_s == status.wall_s


def test_a_waiters_time_out_bounds_a_status_too():
    b = book(default_ttl_s=20.0)
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    b.enqueue(request("b", timeout_s=5.0), at(0))
    status = b.status(at(1))
    assert status.next_deadline == at(5)
    ahead = status.advanced_to(at(1000))
    assert ahead.queue[0].waited_s == pytest.approx(1 + 4 + STATUS_SLACK_S)
    assert ahead.holder is not None and ahead.holder.expires_in_s == pytest.approx(
        19 - 4 - STATUS_SLACK_S
    )


def test_an_idle_group_has_no_deadline_and_stays_idle_however_far_ahead():
    status = book().status(at(10))
    assert status.next_deadline is None
    ahead = status.advanced_to(at(3610))
    assert ahead.wall_s == pytest.approx(3610) and ahead.idle_s == pytest.approx(3610)


# ---------------------------------------------------------------------------- preemption


def switch_as_the_group_does(b: GroupBook, now: datetime) -> str:
    """Take the next waiter and switch to it as GpuGroupWorkflow._switch_to does: the
    resident's eviction (beside the grant when both fit) reports whether it preempted."""
    waiter = b.take_next(now)
    assert waiter is not None
    plan = b.residency.plan_switch(waiter.request)
    if plan.evict is not None:
        if plan.overlapped:
            b.eviction_done(
                plan.evict.job_id, gone=False, ok=True, now=now, preempted=plan.evict.lease_expired
            )
        else:
            b.residency.evicted(plan.evict.job_id, preempted=plan.evict.lease_expired)
    b.finish_switch(SwitchDone(plan, waiter.request, now, now, moved_bytes=0, waited_for=None))
    b.leases.confirm(b.grant(waiter, now, parked=False).token, now)
    return waiter.request.job_id


@pytest.mark.parametrize(
    ("how_a_ends", "memory", "preemptions"),
    [
        # a's lease runs out (the TTL passes, no renewal): b's grant evicts it by force
        ("expired", None, 1),
        ("expired", 1000, 1),  # both fit: the eviction beside b's grant is one too
        # before LATE_RENEWAL_RENEWS: the renewal itself found it expired
        ("renewed too late", None, 1),
        # a yields: evicting it is an ordinary switch
        ("released", None, 0),
        ("released", 1000, 0),
        ("cancelled", None, 0),
        # a's lease ran out, but a was granted again (nothing moved) and released before b came
        ("expired, granted again", None, 0),
    ],
)
def test_a_preemption_is_the_groups_eviction_of_a_holder_that_never_yielded(
    how_a_ends: str, memory: int | None, preemptions: int
) -> None:
    b = book(default_ttl_s=3, memory_bytes=memory)
    b.enqueue(request("a", "a:1", snapshot=target("a"), state_bytes=400), at(0))
    assert switch_as_the_group_does(b, at(0)) == "a"
    if how_a_ends.startswith("expired"):
        b.expire(at(3))
    elif how_a_ends == "renewed too late":
        b.late_renewal_gate = lambda: False
        renew = RenewRequest(request_id="a:1", key=key("a:1"), token=1)
        assert not b.renew(renew, at(3.5)).valid
    elif how_a_ends == "released":
        b.release(LeaseReturn(request_id="a:1", key=key("a:1"), token=1), at(1))
    else:
        b.cancel("a:1", key("a:1"), at(1))
    assert b.state.holder is None
    if how_a_ends == "expired, granted again":
        b.enqueue(request("a", "a:2", snapshot=target("a"), state_bytes=400), at(4))
        assert switch_as_the_group_does(b, at(4)) == "a"
        b.release(LeaseReturn(request_id="a:2", key=key("a:2"), token=2), at(5))
    b.enqueue(request("b", "b:1", snapshot=target("b"), state_bytes=400), at(6))
    assert switch_as_the_group_does(b, at(6)) == "b"
    stats = b.status(at(6)).stats
    assert (stats.evictions, stats.preemptions) == (1, preemptions)
    # b releases and a comes back: evicting b, which yielded, preempts nobody
    token = b.state.next_token - 1
    b.release(LeaseReturn(request_id="b:1", key=key("b:1"), token=token), at(7))
    b.enqueue(request("a", "a:3", snapshot=target("a"), state_bytes=400), at(8))
    assert switch_as_the_group_does(b, at(8)) == "a"
    assert (b.state.stats.evictions, b.state.stats.preemptions) == (2, preemptions)


# ---------------------------------------------------------------------------- streamed switches

ROOM = "0123456789abcdef0123456789abcdef"


def roomed(job: str, room: str | None = ROOM) -> SnapshotTarget:
    return SnapshotTarget(queues=[QueueTarget(task_queue=f"q-{job}", backends=["x"], room=room)])


def test_a_holder_evicting_itself_is_not_waited_for_when_both_jobs_stream_through_one_room():
    b = book(memory_bytes=400)  # room for one job's 400 bytes
    b.enqueue(request("a", snapshot=roomed("a"), state_bytes=400), at(0))
    grant_next(b, at(0))
    nxt = request("b", snapshot=roomed("b"), state_bytes=400, restores_itself=True)
    b.enqueue(nxt, at(1))
    answer = b.release(
        LeaseReturn(request_id="a:r", key=key("a:r"), token=1, evicts_itself=True), at(2)
    )
    assert answer.evict and b.state.evicting is not None
    # 400 + 400 > 400, but the restore takes only the room a's eviction frees: no wait.
    assert b.residency.eviction_to_await(nxt) is None
    plan = b.residency.plan_switch(nxt)
    assert plan.streamed and plan.evict is None
    b.finish_switch(SwitchDone(plan, nxt, at(2), at(2), moved_bytes=0, waited_for=None))
    assert b.state.stats.streamed_switches == 1
    # The grant tells the holder the memory its room is held to.
    waiter = b.take_next(at(2))
    assert waiter is not None and b.grant(waiter, at(2), parked=False).memory_bytes == 400
    # Not for another room, a queue of no room, a job too big for the device, or a group
    # that started before streamed switches (its gate says no).
    assert b.residency.eviction_to_await(request("c", snapshot=roomed("c", "f" * 32),
                                                 state_bytes=400)) is not None  # fmt: skip
    assert b.residency.eviction_to_await(request("c", snapshot=roomed("c", None),
                                                 state_bytes=400)) is not None  # fmt: skip
    assert b.residency.eviction_to_await(request("c", snapshot=roomed("c"),
                                                 state_bytes=500)) is not None  # fmt: skip
    b.residency.stream_gate = lambda: False
    assert b.residency.eviction_to_await(request("c", snapshot=roomed("c"),
                                                 state_bytes=400)) is not None  # fmt: skip


def test_the_groups_own_eviction_runs_beside_a_streamed_grant():
    b = book(memory_bytes=400)
    b.enqueue(request("a", snapshot=roomed("a"), state_bytes=400), at(0))
    grant_next(b, at(0))
    b.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(1))  # sticky
    plan = b.residency.plan_switch(request("b", snapshot=roomed("b"), state_bytes=400))
    assert plan.evict is not None and plan.evict.job_id == "a"
    assert plan.overlapped and plan.streamed and b.state.evicting is not None
    # Both fitting is no stream (and without a room, the grant waits for the eviction).
    wide = book(memory_bytes=800)
    wide.enqueue(request("a", snapshot=roomed("a"), state_bytes=400), at(0))
    grant_next(wide, at(0))
    wide.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(1))
    plan = wide.residency.plan_switch(request("b", snapshot=roomed("b"), state_bytes=400))
    assert plan.overlapped and not plan.streamed
    narrow = book(memory_bytes=400)
    narrow.enqueue(request("a", snapshot=target("a"), state_bytes=400), at(0))
    grant_next(narrow, at(0))
    narrow.release(LeaseReturn(request_id="a:r", key=key("a:r"), token=1), at(1))
    plan = narrow.residency.plan_switch(request("b", snapshot=roomed("b"), state_bytes=400))
    assert not plan.overlapped and not plan.streamed
    grant = narrow.leases.notice(request("b", snapshot=target("b")), 2, 0.0, None, parked=False)
    assert "memory_bytes" not in grant.model_dump(mode="json")  # encodes as before


def _release_offering(b: GroupBook, rid: str, token: int, now: datetime, **fields: object):
    return b.release(
        LeaseReturn(
            request_id=rid,
            key=key(rid),
            token=token,
            evicts_itself=True,
            reports_with_next=True,
            **fields,  # type: ignore[arg-type]
        ),
        now,
    )


@pytest.mark.parametrize(
    ("waiting", "later"),
    [
        pytest.param([("small", 100)], True, id="the-next-fits-beside"),
        pytest.param([("big", 200)], False, id="the-next-needs-the-room"),
        pytest.param([("small", 100), ("third", 100)], False, id="a-third-job-waits"),
    ],
)
def test_an_own_evictions_report_waits_for_the_next_release_only_when_nothing_needs_it(
    waiting: list[tuple[str, int]], later: bool
):
    b = book(memory_bytes=300)
    b.enqueue(request("a", snapshot=target("a"), state_bytes=200), at(0))
    grant_next(b, at(0))
    for i, (job, nbytes) in enumerate(waiting):
        b.enqueue(request(job, snapshot=target(job), state_bytes=nbytes), at(1 + i))
    answer = _release_offering(b, "a:r", 1, at(3))
    assert answer.evict and answer.report_with_next is later
    assert b.state.evicting is not None and b.state.evicting_report_later is later
    # Only a release that offered is answered the field (older clients refuse unknown fields).
    assert ("report_with_next" in answer.model_dump(mode="json")) is later


@pytest.mark.parametrize(
    ("third_restore_s", "gate", "later"),
    [
        pytest.param(0.1, True, False, id="a-third-job-could-be-staged"),
        pytest.param(0.01, True, True, id="its-restores-too-short-to-stage"),
        pytest.param(0.1, False, True, id="a-group-from-before-the-patch"),
    ],
)
def test_an_own_evictions_report_comes_at_once_where_a_third_job_could_be_staged(
    third_restore_s: float, gate: bool, later: bool
):
    """A report held back keeps the holder's eviction under way in the group's eyes until its
    next release, and no third job's state may be staged beside it meanwhile. So where the
    group knows a third job it could stage (evicted here, its own restores long enough), the
    report comes at once; not with only two jobs, nor for jobs whose restores are not staged."""
    b = book(memory_bytes=300)
    b.reports_for_staging = gate
    # c held the group, restored itself in third_restore_s, and was evicted.
    b.enqueue(request("c", snapshot=target("c"), state_bytes=100), at(0))
    grant_next(b, at(0))
    b.residency.note_restore_time("c", third_restore_s)
    b.enqueue(request("a", snapshot=target("a"), state_bytes=200), at(1))
    b.release(LeaseReturn(request_id="c:r", key=key("c:r"), token=1), at(2))
    grant_next(b, at(2))  # a: the group evicts c (sticky residency met another job)
    b.residency.clear_evicting("c")
    assert "c" in b.state.evicted_jobs
    b.enqueue(request("small", snapshot=target("small"), state_bytes=100), at(3))
    answer = _release_offering(b, "a:r", 2, at(4))
    assert answer.evict and answer.report_with_next is later
    assert b.state.evicting_report_later is later


def test_a_late_eviction_report_counts_its_bytes_and_leaves_the_state_where_it_is():
    b = book(memory_bytes=300)
    b.enqueue(request("a", snapshot=target("a"), state_bytes=200), at(0))
    grant_next(b, at(0))
    b.enqueue(request("small", snapshot=target("small"), state_bytes=100), at(1))
    assert _release_offering(b, "a:r", 1, at(2)).report_with_next
    grant_next(b, at(2))  # small: fits beside a's eviction under way
    b.enqueue(request("a", "a:2", snapshot=target("a"), restores_itself=True), at(3))
    b.release(LeaseReturn(request_id="small:r", key=key("small:r"), token=2), at(4))
    grant_next(b, at(4))  # a again: its process restores its state after its own eviction
    assert b.state.stats.bytes_moved == 0
    b.release(
        LeaseReturn(request_id="a:2", key=key("a:2"), token=3, late_evictions=[report("a", 200)]),
        at(5),
    )
    assert b.state.stats.bytes_moved == 200
    # Nobody else waited: a stays resident (the late report did not move it off the device).
    assert b.state.resident is not None and b.state.resident.job_id == "a"


def hosted(job: str, on_host: bool = True) -> SnapshotTarget:
    return SnapshotTarget(
        queues=[QueueTarget(task_queue=f"q-{job}", backends=["x"], on_host=on_host)]
    )


@pytest.mark.parametrize(
    ("holder_on_host", "next_on_host", "later"),
    [
        pytest.param(True, True, True, id="both-in-host-memory"),
        pytest.param(True, False, False, id="the-next-on-a-device"),
        pytest.param(False, True, False, id="the-holder-on-a-device"),
    ],
)
def test_with_no_memory_declared_host_resident_jobs_restore_beside_an_eviction(
    holder_on_host: bool, next_on_host: bool, later: bool
):
    """Jobs whose states live in host memory (torch on the CPU) free no device memory: the
    group, with no memory declared, restores the next beside the holder's eviction and lets
    the eviction's report come with the holder's next release; a job on a device still waits."""
    b = book()
    b.enqueue(request("a", snapshot=hosted("a", holder_on_host), state_bytes=200), at(0))
    grant_next(b, at(0))
    nxt = request("b", snapshot=hosted("b", next_on_host), state_bytes=200)
    b.enqueue(nxt, at(1))
    answer = _release_offering(b, "a:r", 1, at(2))
    assert answer.evict and answer.report_with_next is later
    assert (b.residency.eviction_to_await(nxt) is None) is later
    # A queue that is not on the host encodes as before (older groups refuse unknown fields).
    assert "on_host" not in hosted("c", False).model_dump(mode="json")["queues"][0]
    assert hosted("c").model_dump(mode="json")["queues"][0]["on_host"] is True


def test_a_grant_notice_given_again_tells_the_groups_memory_as_the_first_did():
    """A process that takes its grant by asking again (or from a delivery made again by a new
    run) sets its device room's capacity from the notice, as from the first one."""
    b = book(memory_bytes=1000)
    b.enqueue(request("a", snapshot=roomed("a"), state_bytes=100), at(0))
    waiter = b.take_next(at(0))
    assert waiter is not None
    first = b.grant(waiter, at(0), parked=True)
    again = b.holder_notice()
    assert first.memory_bytes == 1000 and again is not None and again.memory_bytes == 1000
    assert again.proof == first.proof and again.token == first.token
