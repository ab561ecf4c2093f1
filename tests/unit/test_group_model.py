"""The group's protocol against a model: Hypothesis drives random sequences of requests,
releases (genuine, forged, and carried into the holder's next phase by the grant policy),
renewals, cancels, time passing, holders that die, and continue-as-new through ``GroupBook``,
and checks the invariants after every step (one lease at most; no waiter held off by more
carries than the grant policy's bound).

The driver does what ``GpuGroupWorkflow``'s main loop does with the book: after each message,
while the group is free and someone waits, take the best waiter and grant it (these jobs have
no state to move), and expire what is due when time passes.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)
from timeslice.protocol.group import (
    AcquireRequest,
    GroupConfig,
    GroupInput,
    GroupState,
    GroupStats,
    LeaseOutcome,
    LeaseReturn,
    NextPhase,
    RenewRequest,
    lease_key_hash,
)
from timeslice.workflows.group_book import GroupBook, SwitchDone

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def key(rid: str) -> str:
    """The key only the requester of ``rid`` knows (here: derived from it)."""
    return f"key-of-{rid}-0123456789abcdef"


JOBS = ("a", "b", "c", "d")


class GroupModel(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.config = GroupConfig(
            group_id="model", default_ttl_s=10, grant_ack_timeout_s=5, max_carries=2,
            carry_limit_s=5,
        )  # fmt: skip
        self.book = GroupBook(self.config, GroupState(stats=GroupStats(created_at=T0)))
        self.now = T0
        self.seq = 0
        # The model: what each request is, and what may still happen to it.
        self.withdrawn: set[str] = set()
        self.granted: list[tuple[str, int]] = []  # (request id, token), in grant order
        self.enqueued_at: dict[str, tuple[int, datetime, int]] = {}  # rid -> priority, t, seq
        # rid -> (grants, carries past waiters) when it was queued: the starvation bound.
        self.queued_after: dict[str, tuple[int, int]] = {}

    # ------------------------------------------------------------------ the driver

    def _grant_while_free(self) -> None:
        book = self.book
        while book.state.holder is None and book.state.queue:
            waiter = book.take_next(self.now)
            assert waiter is not None
            rid = waiter.request.request_id
            # FIFO within a priority, higher priority first, ageing aside: nobody waiting
            # has a better score than the one taken.
            score = self._score(rid)
            for other in book.state.queue:
                assert self._score(other.request.request_id) <= score
            plan = book.residency.plan_switch(waiter.request)
            book.finish_switch(
                SwitchDone(plan, waiter.request, self.now, self.now, 0, waited_for=None)
            )
            notice = book.grant(waiter, self.now, parked=True)
            assert rid not in self.withdrawn, "granted a request that was withdrawn"
            grants, carries = self.queued_after.pop(rid)
            # The grant policy's bound: each lease it waited behind (the one held when it was
            # queued, and each granted since) crossed at most max_carries boundaries past it.
            carried = book.state.stats.carried - carries
            ahead = len(self.granted) - grants + 1
            assert carried <= self.config.max_carries * ahead, (carried, ahead)
            self.granted.append((rid, notice.token))

    def _score(self, rid: str) -> tuple[float, int]:
        priority, at, seq = self.enqueued_at[rid]
        waited = (self.now - at).total_seconds()
        return (priority + waited / self.config.aging_s, -seq)

    # ------------------------------------------------------------------ messages

    @rule(
        target=requests,
        job=st.sampled_from(JOBS),
        priority=st.integers(min_value=-2, max_value=2),
        timeout=st.one_of(st.none(), st.floats(min_value=0.5, max_value=60)),
    )
    def request(self, job: str, priority: int, timeout: float | None) -> str:
        self.seq += 1
        rid = f"{job}:{self.seq}"
        request = AcquireRequest(
            request_id=rid, key_hash=lease_key_hash(key(rid)), job_id=job,
            reply_task_queue=f"q-{job}", priority=priority, timeout_s=timeout,
        )  # fmt: skip
        assert self.book.enqueue(request, self.now)
        assert not self.book.enqueue(request, self.now), "a retried request queued twice"
        self.enqueued_at[rid] = (priority, self.now, self.book.state.next_seq - 1)
        self.queued_after[rid] = (len(self.granted), self.book.state.stats.carried)
        self._grant_while_free()
        return rid

    @rule(rid=requests)
    def release(self, rid: str) -> None:
        holder = self.book.state.holder
        token = holder.token if holder and holder.request.request_id == rid else 10**6
        answer = self.book.release(LeaseReturn(request_id=rid, key=key(rid), token=token), self.now)
        assert answer.valid == (token != 10**6)
        self._grant_while_free()

    @rule(rid=requests, expected_s=st.floats(min_value=0, max_value=10))
    def carry_release(self, rid: str, expected_s: float) -> None:
        """The holder's next GPU phase follows at once: kept or released by the policy."""
        holder = self.book.state.holder
        held = holder is not None and holder.request.request_id == rid
        token = holder.token if held and holder else 10**6
        carries = holder.carries if held and holder else 0
        before = self.book.state.stats.carried
        answer = self.book.release(
            LeaseReturn(
                request_id=rid, key=key(rid), token=token, keep_if_uncontended=True,
                carry_into=NextPhase(name="sample", expected_s=expected_s),
            ),
            self.now,
        )  # fmt: skip
        assert answer.valid == held
        others = [w for w in self.book.state.queue if w.request.job_id != rid.split(":")[0]]
        if held and not answer.released:
            if self.book.state.stats.carried > before:  # kept past waiters: within bounds
                assert others and carries < self.config.max_carries and expected_s <= 5
            else:
                assert not others
        self._grant_while_free()

    @rule(rid=requests)
    def forged_release(self, rid: str) -> None:
        """The right request id with a wrong token, or the right token with a wrong id."""
        holder = self.book.state.holder
        before = holder.token if holder else None
        self.book.release(
            LeaseReturn(request_id=rid, key=key(rid), token=(before or 0) + 1), self.now
        )
        if holder is not None:
            rid_held = holder.request.request_id
            for forged in (
                LeaseReturn(request_id=rid_held, key=key("someone else"), token=holder.token),
                LeaseReturn(request_id=rid + "-x", key=key(rid_held), token=holder.token),
            ):
                self.book.release(forged, self.now)
            self.book.cancel(rid_held, key("someone else"), self.now)
        after = self.book.state.holder
        assert (after.token if after else None) == before, "a forged release ended the lease"

    @rule(rid=requests)
    def renew(self, rid: str) -> None:
        holder = self.book.state.holder
        token = holder.token if holder and holder.request.request_id == rid else 10**6
        self.book.renew(RenewRequest(request_id=rid, key=key(rid), token=token), self.now)
        self._grant_while_free()

    @rule(rid=consumes(requests))
    def cancel(self, rid: str) -> None:
        self.withdrawn.add(rid)
        self.book.cancel(rid, key(rid), self.now)
        assert not self.book.leases.holds(rid)
        assert all(w.request.request_id != rid for w in self.book.state.queue)
        self._grant_while_free()

    @rule(seconds=st.floats(min_value=0.01, max_value=30))
    def time_passes(self, seconds: float) -> None:
        """Nothing arrives: waiters time out, unconfirmed or unrenewed holders are revoked."""
        self.now += timedelta(seconds=seconds)
        deadline = self.book.next_deadline()
        while deadline is not None and deadline <= self.now:
            self.book.expire(deadline)
            self._grant_while_free()
            nxt = self.book.next_deadline()
            if nxt == deadline:
                break
            deadline = nxt
        self.book.expire(self.now)
        self._grant_while_free()

    @rule()
    def continue_as_new(self) -> None:
        """The carried state is all there is: a new book from its JSON behaves the same."""
        carried = GroupInput(config=self.config, state=self.book.state).model_dump(mode="json")
        restored = GroupInput.model_validate(carried)
        self.book = GroupBook(restored.config, restored.state or self.book.state)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def one_lease_at_most_and_tokens_increase(self) -> None:
        tokens = [t for _, t in self.granted]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
        holder = self.book.state.holder
        if holder is not None:
            assert (holder.request.request_id, holder.token) == self.granted[-1]
            assert holder.request.request_id not in (
                w.request.request_id for w in self.book.state.queue
            )

    @invariant()
    def leases_never_overlap(self) -> None:
        history = self.book.state.history
        for before, after in itertools.pairwise(history):
            assert before.end <= after.start
        for record in history:
            assert record.outcome in LeaseOutcome

    @invariant()
    def accounting_adds_up_to_the_wall(self) -> None:
        status = self.book.status(self.now)
        busy = status.held_share * status.wall_s
        assert busy + status.stats.switching_s + status.idle_s == status.wall_s or (
            abs(busy + status.stats.switching_s + status.idle_s - status.wall_s) < 1e-6
        )


GroupModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_group_protocol_model = GroupModel.TestCase
