"""The RL job's leases, apart from Temporal: which exist, which is held, kept, carried or asked
for ahead, and what each phase's lease does next.

``JobLeases`` is ``RLJobWorkflow``'s ledger and policy. It records the lease orders the job
process fills itself (asked for, or held after a phase kept them), the leases the workflow holds
itself (preparing, final checkpoints, several ranks), the trainer lease carried into the next
epoch's sample and the next sample's order asked for ahead; and it answers what each step of an
epoch does with them — which lease the sample runs under, how ``train`` releases, whether the
process asks ahead, what to end after a phase — with the time passed in. It sends nothing:
the workflow sends the signals it is told to, then says so (``ended``, ``released``), so a
cancellation during a signal never loses a lease from the ledger.

``process_lease_source`` and ``process_prefetches`` are the job process's side of the same
orders (activities/job_runtime.py): which lease a phase's activity runs under, and whether it
asks ahead. It imports nothing of Temporal, so it is unit-tested in milliseconds
(tests/unit/test_job_leases.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from timeslice.protocol.group import MAX_LEASE_TTL_S, GrantNotice, NextPhase
from timeslice.protocol.rl_job import EpochRecord, LeaseOrder, PhaseResult, RLJobConfig

# The sample phases an expected length is measured over (their median): recent enough to
# follow a workload that changes, enough that one slow phase does not decide.
CARRY_MEASURED_PHASES = 5

Release = Literal["always", "if_contended", "never"]


@dataclass(frozen=True)
class SampleLease:
    """The lease an epoch's ``sample`` runs under."""

    # The trainer lease kept from the last epoch, or the order the process asked for as that
    # epoch ended; None: the workflow makes one now.
    order: LeaseOrder | None
    carried: bool
    # An order asked for ahead that the carried lease made needless, and that the process may
    # have sent to the group: the workflow ends it. One the process said it never sent is
    # forgotten instead (from protocol v5): there is nothing at the group to end.
    needless: LeaseOrder | None = None


@dataclass(frozen=True)
class TrainPlan:
    """How an epoch's ``train`` ends its lease."""

    release: Release
    checkpoint_due: bool
    # The next epoch's sample is asked for ahead (by the process, once train or the
    # checkpoint ends): a new order the workflow makes now.
    asks_ahead: bool
    # What the group's grant policy is told of the next phase (release if_contended only).
    carry_into: NextPhase | None


@dataclass(frozen=True)
class AfterPhase:
    """What the workflow must do with a GPU phase's lease once the phase ended (at most one of
    the two; neither: nothing is left to do)."""

    # A workflow-held lease: release it (with the phase's reports).
    release: GrantNotice | None = None
    # A process's order the process did not end (a failed phase): release or cancel it.
    end: LeaseOrder | None = None


@dataclass(frozen=True)
class HandBack:
    """Everything the job holds or has asked for, to end (a failure, a stop, continue-as-new)."""

    orders: list[LeaseOrder]
    leases: list[GrantNotice]  # the workflow's own, last taken first


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return (ordered[middle] + ordered[(len(ordered) - 1) // 2]) / 2


def coming_sample(records: list[EpochRecord], current: EpochRecord) -> NextPhase | None:
    """The next epoch's sample as a group's grant policy is told of it: its expected length,
    the median of the job's last CARRY_MEASURED_PHASES sample phases (``current``'s included),
    within [0, MAX_LEASE_TTL_S]; None with no sample measured yet."""
    recent = [r.phase_s["sample"] for r in records if "sample" in r.phase_s]
    if "sample" in current.phase_s:
        recent.append(current.phase_s["sample"])
    if not recent:
        return None
    expected = median(recent[-CARRY_MEASURED_PHASES:])
    return NextPhase(name="sample", expected_s=min(max(expected, 0.0), MAX_LEASE_TTL_S))


class JobLeases:
    """One run of one RL job's leases (nothing here crosses continue-as-new: every lease is
    handed back before it)."""

    def __init__(self, config: RLJobConfig, *, protocol: int) -> None:
        self.config = config
        # The job protocol the run speaks: a carry_into is told to groups from v4 on, and an
        # order asked ahead that the process did not send is forgotten, not cancelled, from v5.
        self.protocol = protocol
        # Leases the job process takes and releases itself, by request id: asked for (no
        # token yet) or held (a phase kept it, for its checkpoint or the next phase).
        self.orders: dict[str, LeaseOrder] = {}
        # Leases this workflow took and holds itself, by group.
        self.held: dict[str, GrantNotice] = {}
        self._keys: dict[str, str] = {}  # request id -> key, of the workflow's own leases
        self._asked: dict[str, datetime] = {}  # group -> when the workflow asked there
        # A trainer lease kept for the next epoch's sampling (same group, nobody waiting).
        self.carried: LeaseOrder | None = None
        # The next sampling's order, asked for by the process as the epoch's last step ended.
        self.next_sample: LeaseOrder | None = None
        # The request id of an order asked ahead that the process said it did not send (it
        # still held that group: the next phase carries the lease instead).
        self._unsent: str | None = None

    @property
    def solo(self) -> bool:
        """One rank: the process takes, releases and may keep its leases itself, and asks for
        the next GPU phase's lease as each step ends. Several: the workflow holds them, and
        releases once every rank is done."""
        return self.config.ranks == 1

    # ---------------------------------------------------------------- orders (one rank)

    def new_order(
        self, group_id: str, *, request_id: str, key: str, state_bytes: int | None
    ) -> LeaseOrder:
        """A lease the job process will ask for; kept here, to take it back if the phase
        never runs."""
        cfg = self.config
        order = LeaseOrder(
            group_id=group_id,
            request_id=request_id,
            key=key,
            timeout_s=cfg.acquire_timeout_s,
            priority=cfg.priority,
            ttl_s=cfg.lease_ttl_s,
            state_bytes=state_bytes,
        )
        self.orders[order.request_id] = order
        return order

    def ended(self, order: LeaseOrder) -> None:
        """The workflow released or cancelled ``order`` (its signal was sent)."""
        self.orders.pop(order.request_id, None)

    # ---------------------------------------------------------------- the workflow's own leases

    def asking(self, group_id: str, now: datetime) -> None:
        """The workflow asks ``group_id`` for a lease of its own at ``now``."""
        self._asked[group_id] = now

    def hold(self, lease: GrantNotice, *, key: str, now: datetime) -> float:
        """The workflow holds ``lease`` (under ``key``) from ``now``; returns the seconds it
        waited since ``asking``."""
        self.held[lease.group_id] = lease
        self._keys[lease.request_id] = key
        asked = self._asked.pop(lease.group_id, now)
        return (now - asked).total_seconds()

    def released(self, group_id: str) -> None:
        """The workflow released its lease on ``group_id`` (its signal was sent)."""
        lease = self.held.pop(group_id, None)
        if lease is not None:
            self._keys.pop(lease.request_id, None)

    def held_order(self, group_id: str) -> LeaseOrder | None:
        """The workflow's lease on ``group_id`` as an order a process runs under."""
        lease = self.held.get(group_id)
        if lease is None:
            return None
        return LeaseOrder(
            group_id=group_id,
            request_id=lease.request_id,
            key=self._keys[lease.request_id],
            token=lease.token,
            held_by="workflow",
            ttl_s=lease.ttl_s,
        )

    def held_orders(self) -> list[LeaseOrder]:
        return [order for group in self.held if (order := self.held_order(group))]

    def held_keys(self) -> dict[str, str]:
        """Group -> the key of the workflow's lease there."""
        return {g: self._keys[lease.request_id] for g, lease in self.held.items()}

    # ---------------------------------------------------------------- an epoch's story

    def sample_lease(self) -> SampleLease:
        """The lease the epoch's sample runs under: the trainer lease carried from the last
        epoch before the order asked for ahead (then never granted, so ended, unless the
        process never sent it: then only forgotten), before a new one."""
        carried, self.carried = self.carried, None
        prefetched, self.next_sample = self.next_sample, None
        unsent, self._unsent = self._unsent, None
        if carried is None:
            return SampleLease(order=prefetched, carried=False)
        if prefetched is not None and prefetched.request_id == unsent:
            # No acquire of it went out, and none will: no process has it any more.
            self.orders.pop(prefetched.request_id, None)
            prefetched = None
        return SampleLease(order=carried, carried=True, needless=prefetched)

    def sample_release(self) -> Release:
        return "always" if self.solo else "never"

    def plan_train(
        self,
        done: int,
        *,
        stop_requested: bool,
        epochs_this_run: int,
        records: list[EpochRecord],
        current: EpochRecord,
    ) -> TrainPlan:
        """How the train that completes epoch ``done - 1`` ends its lease.

        A checkpoint due after it keeps the lease for the checkpoint. Else, with the next
        sample on the same group, the lease is released only if contended: when nobody waits
        there is nothing to yield to, so it carries over (no release, no new grant); from
        protocol v4 the group is told the sample's expected length, and its grant policy may
        keep it past waiters too."""
        cfg = self.config
        checkpoint_due = done % cfg.checkpoint_every == 0 or done == cfg.epochs
        may_keep = cfg.sampler_group == cfg.trainer and done < cfg.epochs and self.solo
        release: Release = "always" if self.solo else "never"
        if checkpoint_due:
            release = "never"
        elif may_keep and not stop_requested:
            release = "if_contended"
        carry_into = None
        if release == "if_contended" and self.protocol >= 4:
            carry_into = coming_sample(records, current)
        # The next run asks for its own; so does a job that ends after this epoch.
        asks_ahead = (
            self.solo
            and done < cfg.epochs
            and not stop_requested
            and epochs_this_run + 1 < cfg.continue_as_new_every
        )
        return TrainPlan(
            release=release,
            checkpoint_due=checkpoint_due,
            asks_ahead=asks_ahead,
            carry_into=carry_into,
        )

    def after_phase(
        self, order: LeaseOrder, result: PhaseResult | None, *, keep: bool = False
    ) -> AfterPhase:
        """After a GPU phase under ``order`` (``result`` None: it failed): forget a lease the
        process released, note one it kept (``keep``: carried into the next sample), and say
        what the workflow must end (a failed phase's order, a workflow-held lease)."""
        if order.held_by == "workflow":
            return AfterPhase(release=self.held.get(order.group_id))
        rid = order.request_id
        if result is not None and result.released:
            self.orders.pop(rid, None)
        elif result is not None and result.kept and rid in self.orders:
            kept = order.model_copy(update={"token": result.token})
            self.orders[rid] = kept
            if keep:
                self.carried = kept
        elif rid in self.orders:
            return AfterPhase(end=self.orders[rid])
        return AfterPhase()

    def checkpoint_lease(self, order: LeaseOrder) -> LeaseOrder | None:
        """The held lease a checkpoint after a phase under ``order`` runs under (None: the
        phase's lease is no longer held)."""
        if order.held_by == "process":
            held = self.orders.get(order.request_id)
        else:
            held = self.held_order(order.group_id)
        return held if held is not None and held.token is not None else None

    def asked_ahead(self, order: LeaseOrder | None, sent: bool | None) -> None:
        """The process's answer for ``order``, the lease it was told to ask for ahead as its
        step ended: ``sent`` False, it did not (it still held that group, as a train does whose
        lease the group carries into the next sample); True or None (a checkpoint's, or a
        process before v5, which do not say), it may have. Only a process that says it did
        not lets the workflow skip ending the order (protocol v5)."""
        unsent = order is not None and sent is False and self.protocol >= 5
        self._unsent = order.request_id if unsent and order is not None else None

    def checkpointed(self, lease: LeaseOrder) -> None:
        """A checkpoint ran under ``lease``; a process's lease was released after it."""
        if lease.held_by != "process":
            return
        self.orders.pop(lease.request_id, None)
        if self.carried is not None and self.carried.request_id == lease.request_id:
            self.carried = None

    def epoch_ended(self, asked_ahead: LeaseOrder | None) -> None:
        self.next_sample = asked_ahead

    def hand_back(self) -> HandBack:
        """Everything to end; nothing is carried or asked ahead after it."""
        self.carried = self.next_sample = None
        self._unsent = None
        return HandBack(
            orders=list(self.orders.values()), leases=list(reversed(self.held.values()))
        )


# ---------------------------------------------------------------- the job process's side

LeaseSource = Literal["none", "workflow", "carried", "prefetched", "ask"]


def process_lease_source(order: LeaseOrder | None, *, prefetched: bool) -> LeaseSource:
    """Where a phase's activity gets its lease: none (no GPU), the workflow's (renewed and
    released by the workflow), the one this process kept (``order`` has its token), the one it
    asked for as the job's previous step ended, or a new ask now."""
    if order is None:
        return "none"
    if order.held_by == "workflow":
        return "workflow"
    if order.token is not None:
        return "carried"
    return "prefetched" if prefetched else "ask"


def process_prefetches(order: LeaseOrder, *, asked: bool, holds_group: bool) -> bool:
    """Whether the process asks for ``order`` ahead, as its step ends: not twice, not a lease
    already held, and not on a group it still holds (the next phase carries that lease)."""
    return not asked and order.token is None and not holds_group
