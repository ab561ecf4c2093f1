"""The RL job's lease ledger and policy without Temporal: JobLeases driven with a hand-set
clock and hand-made phase results."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from timeslice.protocol.group import MAX_LEASE_TTL_S, GrantNotice, NextPhase
from timeslice.protocol.rl_job import (
    EpochRecord,
    LeaseOrder,
    PhaseResult,
    RLJobConfig,
)
from timeslice.workflows.job_leases import (
    CARRY_MEASURED_PHASES,
    AfterPhase,
    JobLeases,
    coming_sample,
    process_lease_source,
    process_prefetches,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def config(**fields: object) -> RLJobConfig:
    base: dict[str, object] = {
        "job_id": "j",
        "workload": "simulated",
        "sampler_group": "g",
        "epochs": 10,
        "checkpoint_every": 5,
    }
    return RLJobConfig.model_validate({**base, **fields})


def ledger(protocol: int = 4, **fields: object) -> JobLeases:
    return JobLeases(config(**fields), protocol=protocol)


def order(leases: JobLeases, rid: str, group: str = "g") -> LeaseOrder:
    return leases.new_order(group, request_id=rid, key=f"key-of-{rid}-0123456789", state_bytes=7)


def result(
    phase: str = "train", *, released: bool = False, kept: bool = False, token: int = 3
) -> PhaseResult:
    return PhaseResult.model_validate(
        {
            "epoch": 0,
            "phase": phase,
            "metrics": {},
            "seconds": 1.0,
            "mono_start": 0.0,
            "mono_end": 1.0,
            "group_id": "g",
            "token": token,
            "released": released,
            "kept": kept,
        }
    )


def notice(group: str = "g", rid: str = "j:w", token: int = 9) -> GrantNotice:
    return GrantNotice(
        group_id=group, request_id=rid, job_id="j", token=token, ttl_s=20.0, waited_s=0.0
    )


def sampled(seconds: float, epoch: int = 0) -> EpochRecord:
    return EpochRecord(epoch=epoch, reward_mean=None, phase_s={"sample": seconds})


# ---------------------------------------------------------------- orders


def test_a_new_order_carries_the_jobs_settings_and_is_recorded():
    leases = ledger(priority=7, lease_ttl_s=30.0, acquire_timeout_s=60.0)
    made = order(leases, "j:1")
    assert (made.priority, made.ttl_s, made.timeout_s, made.state_bytes) == (7, 30.0, 60.0, 7)
    assert (made.token, made.held_by) == (None, "process")
    assert leases.orders == {"j:1": made}
    leases.ended(made)
    assert leases.orders == {}


# ---------------------------------------------------------------- after a phase


@pytest.mark.parametrize(
    ("outcome", "keep", "left", "carried", "ends"),
    [
        # the process released it itself: forgotten, nothing to end
        (result(released=True), False, False, False, False),
        # kept (a checkpoint follows, or the next phase): its token noted
        (result(kept=True), False, True, False, False),
        # kept for the next sample (release if_contended, nobody waited): carried
        (result(kept=True), True, True, True, False),
        # the phase failed: the workflow ends the order
        (None, False, True, False, True),
        # neither released nor kept (the process lost it): the workflow ends it
        (result(), False, True, False, True),
    ],
    ids=["released", "kept", "carried", "failed", "lost"],
)
def test_after_a_process_phase(outcome, keep, left, carried, ends):
    leases = ledger()
    made = order(leases, "j:1")
    after = leases.after_phase(made, outcome, keep=keep)
    assert ("j:1" in leases.orders) is left
    assert (leases.carried is not None) is carried
    assert after.release is None
    assert after.end == (made if ends else None)
    if outcome is not None and outcome.kept:
        assert leases.orders["j:1"].token == 3
        if carried:
            assert leases.carried == leases.orders["j:1"]


def test_an_order_already_ended_needs_nothing_more():
    leases = ledger()
    made = order(leases, "j:1")
    leases.ended(made)
    assert leases.after_phase(made, None) == AfterPhase()


def test_after_a_phase_under_the_workflows_lease_the_workflow_releases_it():
    leases = ledger(ranks=2)
    leases.asking("g", T0)
    leases.hold(notice(), key="k" * 32, now=T0)
    held = leases.held_order("g")
    assert held is not None and held.held_by == "workflow" and held.token == 9
    assert leases.after_phase(held, result()) == AfterPhase(release=notice())
    leases.released("g")
    assert leases.after_phase(held, result()) == AfterPhase()
    assert leases.held_order("g") is None


# ---------------------------------------------------------------- the workflow's own leases


def test_a_held_lease_times_its_wait_and_is_an_order_under_its_key():
    leases = ledger(ranks=2)
    leases.asking("g", T0)
    waited = leases.hold(notice(), key="k" * 32, now=T0 + timedelta(seconds=2.5))
    assert waited == 2.5
    assert leases.held_keys() == {"g": "k" * 32}
    assert [o.key for o in leases.held_orders()] == ["k" * 32]


def test_hand_back_ends_every_order_and_the_workflows_leases_last_taken_first():
    leases = ledger()
    first = order(leases, "j:1")
    leases.after_phase(first, result(kept=True), keep=True)
    ahead = order(leases, "j:2")
    leases.epoch_ended(ahead)
    for group, rid in (("a", "j:a"), ("b", "j:b")):
        leases.asking(group, T0)
        leases.hold(notice(group, rid), key="k" * 32, now=T0)
    everything = leases.hand_back()
    assert [o.request_id for o in everything.orders] == ["j:1", "j:2"]
    assert [lease.group_id for lease in everything.leases] == ["b", "a"]
    assert leases.carried is None and leases.next_sample is None
    assert leases.sample_lease().order is None


# ---------------------------------------------------------------- the sample's lease


@pytest.mark.parametrize(
    ("carry", "ahead", "runs_under", "needless"),
    [
        (False, False, None, None),
        (False, True, "j:ahead", None),
        (True, False, "j:kept", None),
        # kept *and* asked ahead (the group kept it past the ask): the ask is ended
        (True, True, "j:kept", "j:ahead"),
    ],
    ids=["new", "asked-ahead", "carried", "carried-over-an-ask"],
)
def test_the_sample_runs_under_the_carried_lease_before_one_asked_ahead(
    carry, ahead, runs_under, needless
):
    leases = ledger()
    if carry:
        kept = order(leases, "j:kept")
        leases.after_phase(kept, result(kept=True), keep=True)
    leases.epoch_ended(order(leases, "j:ahead") if ahead else None)
    lease = leases.sample_lease()
    assert (lease.order.request_id if lease.order else None) == runs_under
    assert lease.carried is carry
    assert (lease.needless.request_id if lease.needless else None) == needless
    # taken once: the next epoch starts from what this one leaves
    assert leases.sample_lease().order is None


@pytest.mark.parametrize(
    ("protocol", "sent", "carry", "runs_under", "needless"),
    [
        # the train kept the lease and its process never sent the ask: forgotten, not ended
        (5, False, True, "j:kept", None),
        # sent after all (it lost the group between its release and the ask): ended
        (5, True, True, "j:kept", "j:ahead"),
        # a process that does not say: ended, as before v5
        (5, None, True, "j:kept", "j:ahead"),
        # before v5 a process's answer is not acted on
        (4, False, True, "j:kept", "j:ahead"),
        # the carry was refused: the sample runs under the order, sent or not
        (5, True, False, "j:ahead", None),
        (5, False, False, "j:ahead", None),
    ],
    ids=["unsent", "sent", "unsaid", "v4", "refused-sent", "refused-unsent"],
)
def test_an_order_the_process_never_sent_is_forgotten_not_ended(
    protocol, sent, carry, runs_under, needless
):
    leases = ledger(protocol=protocol)
    train = order(leases, "j:kept")
    ahead = order(leases, "j:ahead")
    leases.after_phase(train, result(kept=carry, released=not carry), keep=carry)
    leases.asked_ahead(ahead, sent)
    leases.epoch_ended(ahead)
    lease = leases.sample_lease()
    assert lease.order is not None and lease.order.request_id == runs_under
    assert (lease.needless.request_id if lease.needless else None) == needless
    # what is left to end on a failure: the lease in use, and the order only if still live
    assert ("j:ahead" in leases.orders) is (needless is not None or runs_under == "j:ahead")


def test_an_order_a_checkpoint_asked_for_after_an_unsent_answer_is_ended():
    """A train kept its lease without asking ahead, then a stop made it checkpoint, whose
    process releases and then asks: the order may be out, so it is not forgotten."""
    leases = ledger(protocol=5)
    train = order(leases, "j:kept")
    ahead = order(leases, "j:ahead")
    leases.after_phase(train, result(kept=True), keep=True)
    leases.asked_ahead(ahead, False)
    leases.asked_ahead(ahead, None)  # the checkpoint's, which does not say
    leases.epoch_ended(ahead)
    lease = leases.sample_lease()
    assert lease.needless is not None and lease.needless.request_id == "j:ahead"


def test_an_unsent_answer_lasts_one_sample():
    leases = ledger(protocol=5)
    ahead = order(leases, "j:ahead")
    leases.asked_ahead(ahead, False)
    leases.hand_back()
    kept = order(leases, "j:kept")
    leases.after_phase(kept, result(kept=True), keep=True)
    leases.epoch_ended(ahead)
    assert leases.sample_lease().needless is not None


def test_a_checkpoint_under_a_carried_lease_uncarries_it():
    leases = ledger()
    kept = order(leases, "j:kept")
    leases.after_phase(kept, result(kept=True), keep=True)
    under = leases.checkpoint_lease(kept)
    assert under is not None and under.token == 3
    leases.checkpointed(under)
    assert leases.carried is None and "j:kept" not in leases.orders


def test_no_checkpoint_lease_once_the_process_released_it():
    leases = ledger()
    made = order(leases, "j:1")
    leases.after_phase(made, result(released=True))
    assert leases.checkpoint_lease(made) is None


# ---------------------------------------------------------------- how train releases


@pytest.mark.parametrize(
    ("fields", "done", "stop", "this_run", "release", "checkpoint", "ahead"),
    [
        # one group, nobody needs a checkpoint: kept unless contended, next sample asked ahead
        ({}, 1, False, 0, "if_contended", False, True),
        # a checkpoint is due: kept for it
        ({}, 5, False, 4, "never", True, True),
        # the last epoch: checkpoint, nothing ahead
        ({}, 10, False, 9, "never", True, False),
        # a stop: released, nothing ahead
        ({}, 1, True, 0, "always", False, False),
        # two groups: released, the sample asked ahead on the other
        ({"trainer_group": "t"}, 1, False, 0, "always", False, True),
        # the run continues as new after this epoch: the next run asks for its own
        ({"continue_as_new_every": 2}, 1, False, 1, "if_contended", False, False),
        # several ranks: the workflow holds and releases
        ({"ranks": 2}, 1, False, 0, "never", False, False),
    ],
    ids=["carry", "checkpoint", "last", "stop", "two-groups", "continue-as-new", "ranks"],
)
def test_plan_train(fields, done, stop, this_run, release, checkpoint, ahead):
    plan = ledger(**fields).plan_train(
        done, stop_requested=stop, epochs_this_run=this_run, records=[], current=sampled(2.0)
    )
    assert (plan.release, plan.checkpoint_due, plan.asks_ahead) == (release, checkpoint, ahead)
    carries = release == "if_contended"
    assert plan.carry_into == (NextPhase(name="sample", expected_s=2.0) if carries else None)


def test_a_protocol_before_v4_tells_no_carry():
    plan = ledger(protocol=3).plan_train(
        1, stop_requested=False, epochs_this_run=0, records=[], current=sampled(2.0)
    )
    assert plan.release == "if_contended" and plan.carry_into is None


@pytest.mark.parametrize(
    ("past", "current", "expected"),
    [
        ([], None, None),  # nothing measured yet
        ([], 4.0, 4.0),
        ([1.0, 9.0], None, 5.0),  # even count: the mean of the middle two
        ([1.0, 2.0, 100.0], 3.0, 2.5),  # one slow phase does not decide
        ([50.0, 50.0, 1.0, 1.0, 1.0, 1.0], 1.0, 1.0),  # only the last five count
        ([], MAX_LEASE_TTL_S * 2, MAX_LEASE_TTL_S),  # within what a group accepts
    ],
)
def test_the_coming_sample_is_the_median_of_the_last_samples(past, current, expected):
    records = [sampled(s, epoch=i) for i, s in enumerate(past)]
    now = sampled(current) if current is not None else EpochRecord(epoch=9, reward_mean=None)
    told = coming_sample(records, now)
    assert (told.expected_s if told else None) == expected
    assert CARRY_MEASURED_PHASES == 5


# ---------------------------------------------------------------- the process's side


@pytest.mark.parametrize(
    ("fields", "prefetched", "source"),
    [
        (None, False, "none"),
        ({"held_by": "workflow", "token": 4}, False, "workflow"),
        ({"token": 4}, False, "carried"),
        ({}, True, "prefetched"),
        ({}, False, "ask"),
    ],
)
def test_where_a_phase_activity_gets_its_lease(fields, prefetched, source):
    made = None
    if fields is not None:
        made = order(ledger(), "j:1").model_copy(update=fields)
    assert process_lease_source(made, prefetched=prefetched) == source


@pytest.mark.parametrize(
    ("token", "asked", "holds", "asks"),
    [
        (None, False, False, True),
        (None, True, False, False),  # not twice
        (4, False, False, False),  # already held
        (None, False, True, False),  # the process kept the group: the next phase carries it
    ],
)
def test_when_the_process_asks_ahead(token, asked, holds, asks):
    made = order(ledger(), "j:1").model_copy(update={"token": token})
    assert process_prefetches(made, asked=asked, holds_group=holds) is asks
