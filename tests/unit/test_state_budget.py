"""Every carried state fits: a group's and an RL job's continue-as-new input, built at every
bound (each list full, each string at its longest, in the characters that encode longest),
measured as the real data converter encodes it, stays within its budget, and the budget under
Temporal's 2 MiB payload limit (issue 20: a group and an RL job wedged for good past it)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice.protocol import group as g
from timeslice.protocol import rl_job as r
from timeslice.protocol.group import (
    AcquireRequest,
    GroupConfig,
    GroupInput,
    GroupState,
    GroupStats,
    HeldLease,
    LeaseOutcome,
    LeaseRecord,
    LeaseReturn,
    MovedReport,
    ProcessRef,
    QueueTarget,
    ResidentJob,
    SnapshotReport,
    SnapshotTarget,
    SwitchRecord,
    Waiter,
    encoded_size,
    lease_key_hash,
)
from timeslice.protocol.rl_job import (
    MAX_CARRY_REASON,
    CheckpointRef,
    EpochRecord,
    EpochTotals,
    PhaseResult,
    RLJobConfig,
    RLJobInput,
    RLJobState,
    bound_record,
    carried_rl_job_input,
)
from timeslice.transport.codec import PayloadEncryptionCodec
from timeslice.workflows.grant_policy import record_wait, remember_job
from timeslice.workflows.group_book import GroupBook, SwitchDone

# A control character: six bytes as JSON ("\u0001"), the most any character takes. Task queue
# names must be printable: for them, a character of four bytes in UTF-8.
WORST = "\x01"
WIDE = "\U0001f600"
# The latest time a group accepts, with the longest offset: the longest timestamp.
LATE = datetime(2999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone(timedelta(hours=23, minutes=59)))
HUGE = -1.7976931348623157e308  # the longest float
BIG = -(2**63)  # the longest integer a counter reaches
T0 = datetime(2026, 1, 1, tzinfo=UTC)
# The longest phases a lease keeps: its bound, each at the latest offset, to the millisecond.
PHASES = [(g.MAX_PHASE_OFFSET_S - 0.001, g.MAX_PHASE_OFFSET_S - 0.001)] * g.MAX_LEASE_PHASES


def converted(value: Any) -> int:
    """Bytes of the payload the real data converter makes of ``value``."""
    [payload] = pydantic_data_converter.payload_converter.to_payloads([value])
    return payload.ByteSize()


def encrypted(value: Any) -> int:
    """... and once Timeslice's encrypting codec has wrapped it."""
    payloads = pydantic_data_converter.payload_converter.to_payloads([value])
    [payload] = asyncio.run(PayloadEncryptionCodec([b"k" * 32]).encode(payloads))
    return payload.ByteSize()


def job(i: int) -> str:
    return f"{i:08d}" + "j" * 92


def key(i: int) -> str:
    return f"key-{i:012d}-0123456789abcdef"


def _queue(q: int, backends: int = g.MAX_BACKENDS, processes: int = g.MAX_PROCESSES) -> QueueTarget:
    return QueueTarget(
        task_queue=f"{q:02d}" + WIDE * 298,
        backends=[f"{b:02d}" + WORST * 98 for b in range(backends)],
        processes=[ProcessRef(pid=2**31, start_time=2**63)] * processes,
    )


def request(
    i: int, *, pad: int = 0, queues: int = 0, tail: tuple[int, int] = (0, 0)
) -> AcquireRequest:
    """A request of job ``i``, its ids padded by ``pad`` six-byte characters, with ``queues``
    snapshot queues at their longest and one more of ``tail`` (backends, processes)."""
    target = None
    if queues:
        full = [_queue(q) for q in range(queues)]
        target = SnapshotTarget(queues=full + ([_queue(99, *tail)] if tail[0] else []))
    return AcquireRequest(
        request_id=f"{i:08d}" + WORST * min(pad, 192),
        job_id=job(i),
        reply_workflow_id=WORST * max(0, min(pad - 192, 1000)) or "w",
        key_hash=lease_key_hash(key(i)),
        priority=-100,
        ttl_s=1.2345678901234567,
        timeout_s=1.2345678901234567,
        snapshot=target,
        state_bytes=2**50,
        restores_itself=True,
    )


def largest_request(i: int) -> AcquireRequest:
    """The largest request a group takes: whole snapshot queues, a last one filled backend by
    backend and process by process, then padding, up to the limit."""
    book = GroupBook(GroupConfig(group_id="g"), GroupState(stats=GroupStats(created_at=T0)))

    def fits(**fields: Any) -> bool:
        return book.refusal(request(i, **fields)) is None

    queues = 1
    while fits(queues=queues + 1):
        queues += 1
    backends = processes = 0
    while backends < g.MAX_BACKENDS and fits(queues=queues, tail=(backends + 1, 0)):
        backends += 1
    while (
        backends
        and processes < g.MAX_PROCESSES
        and fits(queues=queues, tail=(backends, processes + 1))
    ):
        processes += 1
    pad = 0
    for step in (512, 64, 8, 1):
        while pad + step <= 1192 and fits(
            queues=queues, tail=(backends, processes), pad=pad + step
        ):
            pad += step
    best = request(i, pad=pad, queues=queues, tail=(backends, processes))
    assert book.refusal(best) is None
    return best


def _largest(fits: Callable[[int], bool], start: int) -> int:
    """The largest n >= start with fits(n), for fits true at start and false from some n on."""
    assert fits(start)
    step = 1
    while fits(start + step):
        start, step = start + step, step * 2
    while step > 1:  # fits(start), not fits(start + step)
        step //= 2
        if fits(start + step):
            start += step
    return start


def worst_group_input() -> GroupInput:
    config = GroupConfig(
        group_id="g" * 100,
        default_ttl_s=1.2345678901234567,
        aging_s=1.2345678901234567,
        grant_ack_timeout_s=1.2345678901234567,
        snapshot_timeout_s=1.2345678901234567,
        history_keep=g.MAX_HISTORY_KEEP,
        wait_samples_keep=g.MAX_WAIT_SAMPLES_KEEP,
        memory_bytes=2**50,
        max_parked_waits=8,
        carry_limit_s=1.2345678901234567,
        share_slack=0.12345678901234567,
    )
    counters = {
        name: BIG
        for name, field in GroupStats.model_fields.items()
        if field.annotation in (int, "int")
    }
    stats = GroupStats(
        created_at=LATE,
        **counters,
        busy_s=HUGE,
        switching_s=HUGE,
        wait_samples_s=[HUGE] * g.MAX_WAIT_SAMPLES_KEEP,
    )
    book = GroupBook(config, GroupState(stats=stats))
    state = book.state
    # The queue, filled through the group's own admission: as many waiters as it takes, each
    # as large as the byte bound lets them all be.
    per_request = g.MAX_QUEUE_BYTES // g.MAX_WAITERS
    base = encoded_size(request(0))
    pad = max(0, (per_request - base) // 6)
    for i in range(g.MAX_WAITERS - 1):
        state.queue.append(Waiter(request=request(i, pad=pad), seq=BIG, enqueued_at=LATE))
    last = g.MAX_WAITERS - 1
    # The last one takes what is left: the largest pad the group still admits. Found by
    # doubling then halving (each admission check sums the whole queue's bytes; one pad
    # character at a time took ~550 checks, 16 s).
    pad = _largest(lambda p: book.refusal(request(last, pad=p)) is None, pad)
    state.queue.append(Waiter(request=request(last, pad=pad), seq=BIG, enqueued_at=LATE))
    assert len(state.queue) == g.MAX_WAITERS
    assert book.refusal(request(g.MAX_WAITERS)) is not None
    big = [largest_request(10_000 + n) for n in range(3)]
    state.holder = HeldLease(
        request=big[0],
        token=BIG,
        granted_at=LATE,
        waited_s=HUGE,
        expires_at=LATE,
        confirm_by=LATE,
        phases=PHASES,
    )
    state.resident = ResidentJob(job_id=job(1), snapshot=big[1].snapshot, state_bytes=2**50)
    state.evicting = ResidentJob(job_id=job(2), snapshot=big[2].snapshot, state_bytes=2**50)
    state.evicting_key_hash = "f" * 64
    state.next_token = state.next_seq = BIG
    for i in range(g.EVICTED_JOBS_KEEP + 10):
        book.residency.evicted(job(i))
    for i in range(g.FAULTED_JOBS_KEEP + 10):
        book.residency.fault(job(i), WORST * 5000)
    for i in range(g.JOB_KEYS_KEEP + 10):
        book.leases.remember_key(job(i), "f" * 64, book._tracked_jobs)
    for i in range(g.RECENT_DONE_KEEP + 10):
        book.leases.remember_done(f"request-{i}")
    for i in range(g.WAIT_SHARE_JOBS_KEEP + 10):  # the grant policy's waiting shares
        for _ in range(g.WAIT_RECORDS_KEEP + 10):
            record_wait(remember_job(state.wait_shares, job(i)), HUGE, -HUGE)
    assert len(state.wait_shares) == g.WAIT_SHARE_JOBS_KEEP
    assert all(len(r) == 2 * g.WAIT_RECORDS_KEEP for r in state.wait_shares.values())
    state.history = [
        LeaseRecord(
            job_id=job(i),
            token=BIG,
            start=LATE,
            end=LATE,
            outcome=LeaseOutcome.CANCELLED,
            phases=PHASES,
        )
        for i in range(g.MAX_HISTORY_KEEP)
    ]
    state.switch_history = [
        SwitchRecord(
            from_job=job(i),
            to_job=job(i),
            start=LATE,
            end=LATE,
            bytes=BIG,
            overlapped=False,
            by_holder=False,
        )
        for i in range(g.MAX_HISTORY_KEEP)
    ]
    return GroupInput(config=config, state=state)


def test_each_group_entry_takes_at_most_what_the_budget_counts():
    lease = LeaseRecord(
        job_id=job(0), token=BIG, start=LATE, end=LATE, outcome="cancelled", phases=PHASES
    )
    switch = SwitchRecord(from_job=job(0), to_job=job(0), start=LATE, end=LATE, bytes=BIG)
    assert encoded_size(lease) + 1 <= g._LEASE_RECORD_BYTES
    assert encoded_size(switch) + 1 <= g._SWITCH_RECORD_BYTES
    req = request(0)
    waiter = Waiter(request=req, seq=BIG, enqueued_at=LATE)
    assert encoded_size(waiter) - encoded_size(req) + 1 <= g._WAITER_OVERHEAD_BYTES
    held = HeldLease(
        request=req,
        token=BIG,
        granted_at=LATE,
        waited_s=HUGE,
        expires_at=LATE,
        confirm_by=LATE,
        phases=PHASES,
    )
    assert encoded_size(held) - encoded_size(req) + 1 <= g._LEASE_OVERHEAD_BYTES
    target = largest_request(0).snapshot
    resident = ResidentJob(job_id=job(0), snapshot=target, state_bytes=2**50)
    assert encoded_size(resident) - encoded_size(target) + 1 <= g._LEASE_OVERHEAD_BYTES
    assert encoded_size(job(0)) + 1 <= g._ID_BYTES
    assert encoded_size(HUGE) + 1 <= g._FLOAT_BYTES
    book = GroupBook(GroupConfig(group_id="g"), GroupState(stats=GroupStats(created_at=T0)))
    text = book.residency.fault(job(0), WORST * 2000)
    assert encoded_size(text) <= g.MAX_FAULT_BYTES and text.endswith("(cut)")
    assert text.startswith(f"job {job(0)}: ")


def test_a_group_at_every_bound_fits_its_budget(capsys):
    carried = worst_group_input()
    state = carried.state
    assert state is not None
    assert len(state.evicted_jobs) == g.EVICTED_JOBS_KEEP
    assert len(state.faulted_jobs) == g.FAULTED_JOBS_KEEP
    assert len(state.job_keys) == g.JOB_KEYS_KEEP
    assert len(state.recent_done) == g.RECENT_DONE_KEEP
    assert encoded_size(state.holder.request) > g.MAX_REQUEST_BYTES - 1300  # type: ignore[union-attr]
    assert sum(encoded_size(w.request) for w in state.queue) > g.MAX_QUEUE_BYTES - 6
    dumped = carried.model_dump(mode="json")
    size = converted(dumped)
    budget = g.group_state_budget(g.MAX_HISTORY_KEEP, g.MAX_WAIT_SAMPLES_KEEP)
    with capsys.disabled():
        print(
            f"\ngroup at its bounds: {size} bytes encoded, {encrypted(dumped)} encrypted; "
            f"budget {budget}, limit {g.PAYLOAD_LIMIT_BYTES}"
        )
    assert size <= budget <= g.CARRIED_STATE_BUDGET_BYTES
    assert encrypted(dumped) <= g.CARRY_CEILING_BYTES < g.PAYLOAD_LIMIT_BYTES
    # The group would send it as it is, and the next run reads it back.
    book = GroupBook(carried.config, state)
    again, measured, shed = book.accounts.carried_input()
    assert shed == 0 and measured == encoded_size(dumped) and again == dumped
    assert GroupInput.model_validate(again).state == state


def test_history_keep_is_limited_to_what_fits():
    with pytest.raises(ValidationError, match=f"less than or equal to {g.MAX_HISTORY_KEEP}"):
        GroupConfig(group_id="g", history_keep=g.MAX_HISTORY_KEEP + 1)
    with pytest.raises(ValidationError, match=f"less than or equal to {g.MAX_WAIT_SAMPLES_KEEP}"):
        GroupConfig(group_id="g", wait_samples_keep=g.MAX_WAIT_SAMPLES_KEEP + 1)
    # A run carried from a release that allowed 4096 keeps what fits now, rather than failing.
    config = {"group_id": "g", "history_keep": 4096, "wait_samples_keep": 4096}
    state = GroupState(stats=GroupStats(created_at=T0)).model_dump(mode="json")
    carried = GroupInput.model_validate({"config": config, "state": state})
    assert carried.config.history_keep == g.MAX_HISTORY_KEEP
    assert carried.config.wait_samples_keep == g.MAX_WAIT_SAMPLES_KEEP


def test_a_state_over_the_budget_sheds_its_oldest_history():
    """A state from before the bounds (4,096 lease and switch records, a queue of 1 MiB) sheds
    its oldest records before continuing as new, and says so, instead of wedging."""
    config = GroupConfig(group_id="g", history_keep=g.MAX_HISTORY_KEEP)
    state = GroupState(stats=GroupStats(created_at=T0))
    for i in range(4096):
        start = T0 + timedelta(seconds=i)
        state.history.append(
            LeaseRecord(job_id=job(i), token=i, start=start, end=start, outcome="released")
        )
        state.switch_history.append(
            SwitchRecord(from_job=job(i), to_job=job(i + 1), start=start, end=start, bytes=BIG)
        )
    for i in range(1000):
        state.queue.append(Waiter(request=request(i, pad=120), seq=i, enqueued_at=T0))
    book = GroupBook(config, state)
    before = encoded_size(GroupInput(config=config, state=state))
    assert before > g.CARRY_CEILING_BYTES
    carried, size, shed = book.accounts.carried_input()
    assert size <= g.CARRIED_STATE_BUDGET_BYTES and converted(carried) < g.CARRY_CEILING_BYTES
    assert shed > 0 and state.stats.shed_records == shed
    assert carried["state"]["stats"]["shed_records"] == shed
    # The newest records stay; the queue is whole.
    assert state.history[-1].token == 4095 and state.switch_history[-1].to_job == job(4096)
    assert len(state.history) + len(state.switch_history) == 2 * 4096 - shed
    assert len(state.queue) == 1000


def test_the_testers_flood_leaves_the_group_within_its_bounds():
    """Issue 20's repro, through the group's own decisions: 650 new 100-character job ids, each
    acquiring, releasing and reporting a failed eviction of 2,000 characters; requests at the
    size limit; then thousands of jobs each answered evict whose evictions really fail."""
    config = GroupConfig(group_id="g", history_keep=g.MAX_HISTORY_KEEP)
    book = GroupBook(config, GroupState(stats=GroupStats(created_at=T0)))
    now = T0

    def grant(i: int) -> None:
        nonlocal now
        waiter = book.take_next(now)
        assert waiter is not None and waiter.request.job_id == job(i)
        plan = book.residency.plan_switch(waiter.request)
        book.finish_switch(SwitchDone(plan, waiter.request, now, now, 1, waited_for=None))
        book.leases.confirm(book.grant(waiter, now, parked=False).token, now)
        now += timedelta(seconds=1)

    for i in range(650):
        sent = request(i, pad=100)
        book.enqueue(sent, now)
        grant(i)
        token = book.state.next_token - 1
        book.release(LeaseReturn(request_id=sent.request_id, key=key(i), token=token), now)
        book.moved(MovedReport(job_id=job(i), key=key(i), evicted=[], error=WORST * 2000), now)
    assert book.state.stats.released == 650
    assert book.state.faulted_jobs == {} and book.state.stats.stale_messages == 650
    big = [largest_request(i) for i in range(650, 653)]
    for sent in big:
        assert book.refusal(sent) is None
        book.enqueue(sent, now)
    for i, sent in zip(range(650, 653), big, strict=True):
        grant(i)
        token = book.state.next_token - 1
        book.release(LeaseReturn(request_id=sent.request_id, key=key(i), token=token), now)
    assert book.state.stats.released == 653
    # Each job is answered evict (the next job waits) and reports its eviction failed.
    book.enqueue(request(653, queues=1), now)
    grant(653)
    for i in range(653, 3000):
        book.enqueue(request(i + 1, queues=1), now)
        answer = book.release(
            LeaseReturn(
                request_id=request(i).request_id,
                key=key(i),
                token=book.state.next_token - 1,
                evicts_itself=True,
            ),
            now,
        )
        assert answer.evict
        book.moved(MovedReport(job_id=job(i), key=key(i), evicted=[], error=WORST * 2000), now)
        grant(i + 1)
    state = book.state
    assert len(state.faulted_jobs) == g.FAULTED_JOBS_KEEP
    assert all(encoded_size(text) <= g.MAX_FAULT_BYTES for text in state.faulted_jobs.values())
    assert len(state.job_keys) <= g.JOB_KEYS_KEEP and len(state.recent_done) <= g.RECENT_DONE_KEEP
    assert len(state.history) == g.MAX_HISTORY_KEEP >= len(state.switch_history)
    # The jobs the group still tracks keep their keys: their reports are still obeyed.
    assert all(j in state.job_keys for j in state.faulted_jobs)
    assert state.stats.forgotten_jobs > 0
    size = converted(GroupInput(config=config, state=state).model_dump(mode="json"))
    assert size <= g.group_state_budget(config.history_keep, config.wait_samples_keep)


# ---------------------------------------------------------------------------- the RL job


def worst_hold(epoch: int, phase: str) -> PhaseResult:
    reports = [
        SnapshotReport(
            job_id=WORST * 100, backend=WORST * 100, mode=WORST * 100, bytes=2**50, seconds=86_400
        )
    ] * g.MAX_REPORTS
    return PhaseResult(
        epoch=epoch,
        phase=phase,  # type: ignore[arg-type]
        metrics={WORST * 100 + str(i): HUGE for i in range(4000)},
        seconds=HUGE,
        mono_start=HUGE,
        mono_end=HUGE,
        wall_offset_s=HUGE,
        group_id=WORST * 500,
        token=BIG,
        request_id=WORST * 500,
        waited_s=HUGE,
        asked_mono=HUGE,
        granted_mono=HUGE,
        released_mono=HUGE,
        released=True,
        kept=False,
        carry=WORST * MAX_CARRY_REASON,
        restored=reports,
        evicted=reports,
    )


def worst_record(epoch: int) -> EpochRecord:
    times = {f"{i}" + WORST * 31: HUGE for i in range(20)}
    return EpochRecord(
        epoch=epoch,
        reward_mean=HUGE,
        metrics={f"{i}." + WORST * 98: HUGE for i in range(4000)},
        wait_s=dict(times),
        phase_s=dict(times),
        holds=[worst_hold(epoch, "sample"), worst_hold(epoch, "train"), worst_hold(epoch, "train")],
    )


def test_one_record_is_cut_to_its_bounds_and_says_what_it_dropped():
    record = bound_record(worst_record(0))
    assert encoded_size(record) <= r.MAX_RECORD_BYTES
    assert len(record.metrics) <= r.MAX_RECORD_METRICS
    assert encoded_size(record.metrics) <= r.MAX_RECORD_METRICS_BYTES
    assert record.dropped_metrics == 4000 - len(record.metrics)
    assert len(record.holds) == r.MAX_RECORD_HOLDS and all(not h.metrics for h in record.holds)
    assert record.dropped_reports > 0
    # Names too long and values not finite are dropped; the rest kept in their order.
    plain = bound_record(
        EpochRecord(
            epoch=0, reward_mean=None, metrics={"a": 1.0, "x" * 101: 2.0, "nan": math.nan, "b": 3.0}
        )
    )
    assert plain.metrics == {"a": 1.0, "b": 3.0} and plain.dropped_metrics == 2


def worst_rl_job_input() -> RLJobInput:
    options = {"o": WORST * (r.MAX_OPTIONS_BYTES // 6 - 10)}
    config = RLJobConfig(
        job_id="j" * 100,
        workload="simulated",
        workload_options=options,
        sampler_group="s" * 100,
        trainer_group="t" * 100,
        epochs=1_000_000,
    )
    state = RLJobState(
        epochs_done=BIG,
        last_checkpoint=CheckpointRef(epochs_done=2**62, path=WORST * r.MAX_CHECKPOINT_PATH),
        rewinds=BIG,
        redone_epochs=BIG,
        runs=BIG,
        state_bytes=2**50,
        backend_bytes={f"{i:02d}" + WORST * 98: 2**50 for i in range(40)},
        failures=BIG,
        lease_secret="f" * 64,
        folded=EpochTotals(epochs=BIG, phase_s={f"{i}" + WORST * 31: HUGE for i in range(20)}),
    )
    kept_from = r.MAX_REWARDS + 100 - r.RECENT_EPOCH_RECORDS
    for epoch in range(r.MAX_REWARDS + 100):  # each one cut as it comes
        if epoch < kept_from:
            state.add_record(EpochRecord(epoch=epoch, reward_mean=HUGE))
        else:
            state.add_record(worst_record(epoch))
    state.unconfirmed = EpochTotals(
        epochs=BIG,
        phase_s={f"{i}" + WORST * 31: HUGE for i in range(r.MAX_RECORD_TIMES)},
        wait_s={f"{i}" + WORST * 31: HUGE for i in range(r.MAX_RECORD_TIMES)},
    )
    state.folded.wait_s = dict(state.unconfirmed.wait_s)
    return RLJobInput(config=config, state=state)


def test_an_rl_job_at_every_bound_fits_its_budget(capsys):
    carried = worst_rl_job_input()
    state = carried.state
    assert state is not None
    dumped, size, shed = carried_rl_job_input(carried.config, state)
    assert shed == 0 and len(state.records) == r.RECENT_EPOCH_RECORDS
    assert len(state.rewards) == r.MAX_REWARDS and len(state.backend_bytes) == g.MAX_BACKENDS
    converted_size = converted(dumped)
    with capsys.disabled():
        print(
            f"\nRL job at its bounds: {converted_size} bytes encoded, {encrypted(dumped)} "
            f"encrypted; budget {r.rl_job_state_budget()}, limit {g.PAYLOAD_LIMIT_BYTES}"
        )
    assert size < converted_size <= r.rl_job_state_budget() <= g.CARRIED_STATE_BUDGET_BYTES
    assert encrypted(dumped) <= g.CARRY_CEILING_BYTES
    assert RLJobInput.model_validate(dumped).state == state


def test_the_testers_rl_job_with_4000_metrics_a_phase_stays_small():
    """Issue 20: every epoch record kept the workload's whole metrics dict; with 4,000 metrics
    a phase the sixth continue-as-new input was 3.17 MB."""
    config = RLJobConfig(job_id="j", workload="simulated", sampler_group="g", epochs=1000)
    state = RLJobState()
    for epoch in range(600):
        metrics = {
            f"{phase}.metric_{i}": float(i) for phase in ("sample", "train") for i in range(4000)
        }
        state.add_record(EpochRecord(epoch=epoch, reward_mean=0.5, metrics=metrics))
    _, size, shed = carried_rl_job_input(config, state)
    assert shed == 0 and size < 512 * 1024, size
    assert all(rec.dropped_metrics == 8000 - len(rec.metrics) for rec in state.records)


def test_an_rl_state_from_before_the_bounds_is_cut_to_them():
    """A state from before the bounds (records since the checkpoint kept without limit, each
    with every metric) folds its oldest records into the totals, which lose nothing."""
    config = RLJobConfig(job_id="j", workload="simulated", sampler_group="g", epochs=10_000)
    state = RLJobState()
    for epoch in range(3000):
        metrics = {f"train.metric_{i}": float(i) for i in range(600)}
        state.records.append(
            EpochRecord(epoch=epoch, reward_mean=0.5, metrics=metrics, phase_s={"train": 1.0})
        )
    assert encoded_size(RLJobInput(config=config, state=state)) > g.PAYLOAD_LIMIT_BYTES
    _, size, shed = carried_rl_job_input(config, state)
    assert size <= r.rl_job_state_budget() and shed == 0
    assert len(state.records) == r.RECENT_EPOCH_RECORDS
    assert state.totals()[0] == {"train": 3000.0}


def test_an_rl_state_over_a_budget_sheds_its_oldest_records(monkeypatch):
    """Should the bounds ever not add up, the job folds records early rather than wedge."""
    monkeypatch.setattr(r, "CARRIED_STATE_BUDGET_BYTES", 10_000)
    config = RLJobConfig(job_id="j", workload="simulated", sampler_group="g", epochs=100)
    state = RLJobState()
    for epoch in range(32):
        metrics = {f"train.metric_{i}": float(i) for i in range(20)}
        state.add_record(
            EpochRecord(epoch=epoch, reward_mean=0.5, metrics=metrics, phase_s={"train": 1.0})
        )
    dumped, size, shed = carried_rl_job_input(config, state)
    assert size <= 10_000 and shed > 0 and state.shed_records == shed
    assert dumped["state"]["shed_records"] == shed
    assert state.records[-1].epoch == 31 and state.totals()[0] == {"train": 32.0}


def test_a_state_that_shedding_cannot_save_is_reported_over_the_ceiling():
    """A queue carried from a release that took 1 MiB of it, of requests up to 340 KB: shedding
    every record is not enough, and the group (gpu_group._carriable) then keeps serving in its
    run instead of sending an input the server refuses."""
    config = GroupConfig(group_id="g")
    state = GroupState(stats=GroupStats(created_at=T0))
    state.history = [
        LeaseRecord(job_id=job(i), token=i, start=T0, end=T0, outcome="released") for i in range(50)
    ]
    for i in range(1000):
        state.queue.append(Waiter(request=request(i, pad=330), seq=i, enqueued_at=T0))
    _, size, shed = GroupBook(config, state).accounts.carried_input()
    assert shed == 50 and state.history == [] and state.stats.shed_records == 50
    assert size > g.CARRY_CEILING_BYTES and len(state.queue) == 1000
