"""A grant's local validity: from the grant's own time, never past the group's deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.testing import ActivityEnvironment
from timeslice.protocol.group import GrantNotice, lease_key_hash, prove_notice
from timeslice.session.grants import (
    CLOCK_SKEW_S,
    LATE_GRANT_S,
    Delivery,
    Grant,
    GrantInbox,
    _grant_from_activity,
    delivery_margin,
    grant_from_update,
    local_time_of,
    validity_if_fresh,
    with_ask_bound,
)

WALL = datetime(2026, 1, 1, tzinfo=UTC)
KEY = "k" * 32


def _notice(**fields: object) -> GrantNotice:
    base: dict[str, object] = {
        "group_id": "g",
        "request_id": "r",
        "job_id": "j",
        "token": 3,
        "ttl_s": 20.0,
        "waited_s": 0.0,
    }
    return GrantNotice.model_validate({**base, **fields})


def test_a_server_time_reads_earlier_by_the_skew_allowance():
    assert local_time_of(WALL - timedelta(seconds=7), wall_now=WALL, mono_now=100.0) == (
        100.0 - 7 - CLOCK_SKEW_S
    )
    # A grant time that seems to lie ahead (the local clock is behind): taken as now.
    assert local_time_of(WALL + timedelta(seconds=3), wall_now=WALL, mono_now=100.0) == (
        100.0 - CLOCK_SKEW_S
    )


def test_a_fresh_parked_grant_is_valid_from_its_own_time_up_to_its_confirm_deadline():
    grant = grant_from_update(
        _notice(granted_at=datetime.now(UTC), confirm_within_s=15.0, ttl_s=60.0)
    )
    assert grant.granted_at is not None and grant.confirm_by is not None
    valid_until = validity_if_fresh(grant, 60.0)
    # Bounded by the group's 15-s confirm deadline, not by the 60-s TTL.
    assert valid_until == grant.confirm_by
    assert valid_until <= time.monotonic() + 15.0 - CLOCK_SKEW_S + 0.01
    short = grant_from_update(_notice(granted_at=datetime.now(UTC), confirm_within_s=15.0))
    assert validity_if_fresh(short, 5.0) == short.granted_at + 5.0  # type: ignore[operator]


def test_a_grant_taken_late_or_of_unknown_time_must_be_confirmed():
    late = grant_from_update(
        _notice(
            granted_at=datetime.now(UTC) - timedelta(seconds=LATE_GRANT_S + 1.0),
            confirm_within_s=15.0,
        )
    )
    assert late.age_s is not None and late.age_s > LATE_GRANT_S
    assert validity_if_fresh(late, 20.0) is None
    # An older group's notice carries no grant time.
    assert validity_if_fresh(grant_from_update(_notice(confirm_within_s=15.0)), 20.0) is None
    # A notice from asking again, of a grant that travels by activity: no confirm deadline.
    no_deadline = grant_from_update(_notice(granted_at=datetime.now(UTC)))
    assert validity_if_fresh(no_deadline, 20.0) is None


def test_the_inbox_hands_a_grant_over_once_and_ends_waits_on_close():
    def proven(**fields: object) -> GrantNotice:
        return prove_notice(_notice(**fields), lease_key_hash(KEY))

    async def scenario() -> None:
        inbox = GrantInbox()
        waiting = inbox.expect("r", KEY)
        grant = Grant(notice=proven(), taken_at=1.0, granted_at=1.0, confirm_by=16.0)
        assert inbox.accept(grant) is Delivery.TAKEN
        # Delivered again: the same grant, still taken.
        assert inbox.accept(grant) is Delivery.TAKEN
        assert inbox.withdraw("r") is grant and waiting.done()
        other = inbox.expect("other", KEY)
        inbox.lose("other", "too late")
        try:
            inbox.withdraw("other")
        except Exception as err:
            assert "too late" in str(err)
        else:
            raise AssertionError("a lost grant was handed over")
        pending = inbox.expect("pending", KEY)
        inbox.close(RuntimeError("closed"))
        assert isinstance(pending.exception(), RuntimeError)
        assert isinstance(inbox.expect("later", KEY).exception(), RuntimeError)
        assert other.done()

    asyncio.run(scenario())


def test_the_ask_bounds_the_grant_time_without_any_clock_agreement():
    """A request created by this acquire was queued after it was asked: granted no earlier than
    asked + waited_s, even if the local wall clock is far behind the group's."""
    asked = time.monotonic() - 10.0  # asked 10 s ago, granted after waiting 4 s
    # The local wall clock 30 s behind the group's: its grant time seems to lie ahead.
    ahead = datetime.now(UTC) + timedelta(seconds=30 - 6)
    grant = grant_from_update(_notice(granted_at=ahead, confirm_within_s=15.0, waited_s=4.0))
    bounded = with_ask_bound(grant, asked)
    assert bounded.granted_at == asked + 4.0
    assert bounded.confirm_by == asked + 4.0 + 15.0
    assert validity_if_fresh(bounded, 20.0) is None  # 6 s old: confirmed before use
    # An older group's notice (no grant time) gets a deadline from the ask alone.
    old = with_ask_bound(grant_from_update(_notice(confirm_within_s=15.0, waited_s=2.0)), asked)
    assert old.granted_at == asked + 2.0 and old.confirm_by == asked + 17.0
    # When the group's time is the earlier bound, it stays.
    early = grant_from_update(_notice(granted_at=datetime.now(UTC), confirm_within_s=15.0))
    assert with_ask_bound(early, time.monotonic() + 5.0) is early


def test_a_grant_by_activity_is_bounded_by_its_confirmation_window_too():
    """The group may end a grant taken by activity when the activity times out, and, once an
    outcome anyone could send left it unconfirmed, when the grant is confirm_within_s old: the
    process's bound is the earlier of the two (bounded-grant-delivery)."""
    now = datetime.now(UTC)
    info: activity.Info = ActivityEnvironment().info
    info = dataclasses.replace(
        info,
        current_attempt_scheduled_time=now,
        started_time=now,
        start_to_close_timeout=timedelta(seconds=30),
    )
    granted_at = now - timedelta(seconds=2)
    grant = _grant_from_activity(_notice(granted_at=granted_at, confirm_within_s=4.0), info)
    assert grant.granted_at is not None and grant.confirm_by is not None
    assert grant.confirm_by - grant.granted_at == 4.0  # the window, not the 30-s activity
    assert delivery_margin(grant) == 4.0 / 3  # a short window's margin is a third of it
    legacy = _grant_from_activity(_notice(granted_at=granted_at), info)  # no window told
    assert legacy.confirm_by is not None and legacy.confirm_by - legacy.granted_at > 29
