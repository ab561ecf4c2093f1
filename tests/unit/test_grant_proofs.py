"""Grant and fault notices carry the proof of the group their request went to (issue 20).

``status`` shows every waiting request id and the holder's token, so a notice naming them is
no proof of anything; what is, is an HMAC under the request's key hash, which only the group
and the requester know. These tests check the proof itself, the notices the group makes, the
client's grant inbox, and that no view of the group shows what the proof is keyed by.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime, timedelta

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import ActivityEnvironment
from timeslice.protocol.group import (
    AcquireRequest,
    GrantAck,
    GrantNotice,
    GroupConfig,
    GroupState,
    GroupStats,
    GroupStatus,
    HolderView,
    LeaseRecord,
    WaiterView,
    lease_key_hash,
    notice_is_proven,
    notice_proof,
    prove_notice,
)
from timeslice.session.grants import Delivery, GrantInbox, grant_from_update
from timeslice.workflows.group_book import GroupBook

T0 = datetime(2026, 1, 1, tzinfo=UTC)
KEY = "the-requesters-own-key-0123456789"
OTHER_KEY = "somebody-elses-key-0123456789abcd"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def request(job: str, key: str = KEY, rid: str | None = None) -> AcquireRequest:
    return AcquireRequest(
        request_id=rid or f"{job}:r",
        key_hash=lease_key_hash(key),
        job_id=job,
        reply_task_queue=f"timeslice-job-{job}-0",
    )


def new_book() -> GroupBook:
    return GroupBook(GroupConfig(group_id="g"), GroupState(stats=GroupStats(created_at=T0)))


def granted(b: GroupBook, req: AcquireRequest, now: datetime, *, parked: bool = False):
    b.enqueue(req, now)
    waiter = b.take_next(now)
    assert waiter is not None
    return b.grant(waiter, now, parked=parked)


def forged_like(notice: GrantNotice, **changes: object) -> GrantNotice:
    """What a caller who read ``status`` can send: the real ids and token, no valid proof."""
    return notice.model_copy(update={"proof": None, **changes})


# ---------------------------------------------------------------- the proof


def test_every_notice_the_group_makes_is_proven_under_its_requests_key_hash() -> None:
    b = new_book()
    grant = granted(b, request("a"), at(0), parked=True)
    assert grant.proof is not None and notice_is_proven(grant, lease_key_hash(KEY))
    again = b.leases.holder_notice()
    assert again is not None and notice_is_proven(again, lease_key_hash(KEY))
    b.enqueue(request("b", OTHER_KEY), at(1))
    waiter = b.take_next(at(2))
    assert waiter is not None
    fault = b.refuse(waiter, "job b: restore failed", at(2))
    assert fault.fault is not None and notice_is_proven(fault, lease_key_hash(OTHER_KEY))
    # ... and under no other request's key hash.
    assert not notice_is_proven(grant, lease_key_hash(OTHER_KEY))
    assert not notice_is_proven(fault, lease_key_hash(KEY))


@pytest.mark.parametrize(
    "change",
    [
        {"token": 99},
        {"request_id": "a:other"},
        {"job_id": "b"},
        {"group_id": "h"},
        {"ttl_s": 3600.0},
        {"fault": "job a: forged fault"},
        {"waited_s": 0.5},
        {"confirm_within_s": None},
        {"reply_task_queue": "timeslice-job-b-0"},
    ],
)
def test_a_notice_altered_in_any_field_loses_its_proof(change: dict[str, object]) -> None:
    grant = granted(new_book(), request("a"), at(0), parked=True)
    altered = grant.model_copy(update=change)
    assert not notice_is_proven(altered, lease_key_hash(KEY))


def test_a_notice_without_or_with_a_made_up_proof_is_not_proven() -> None:
    grant = granted(new_book(), request("a"), at(0))
    assert not notice_is_proven(forged_like(grant), lease_key_hash(KEY))
    assert not notice_is_proven(forged_like(grant, proof="0" * 64), lease_key_hash(KEY))
    # A proof made with the key hash of another request (say, the forger's own) neither.
    assert not notice_is_proven(prove_notice(grant, lease_key_hash(OTHER_KEY)), lease_key_hash(KEY))


def test_the_proof_survives_the_trip_through_temporals_converter() -> None:
    grant = granted(new_book(), request("a"), at(0), parked=True)
    grant = grant.model_copy(update={"waited_s": 0.1 + 0.2})  # a float with a long repr
    grant = prove_notice(grant, lease_key_hash(KEY))
    converter = pydantic_data_converter.payload_converter
    [payload] = converter.to_payloads([grant])
    [back] = converter.from_payloads([payload], [GrantNotice])
    assert back == grant and notice_is_proven(back, lease_key_hash(KEY))
    # As plain JSON too (a `temporal workflow signal --input`, the group's carried state).
    raw = GrantNotice.model_validate(json.loads(grant.model_dump_json()))
    assert notice_is_proven(raw, lease_key_hash(KEY))
    assert notice_proof(raw, lease_key_hash(KEY)) == grant.proof


def test_checking_a_notice_with_out_of_range_numbers_never_raises() -> None:
    """A forged signal may carry NaN or infinity (JSON allows them through pydantic): the
    check must answer False, not raise inside the receiving workflow's signal handler."""
    raw = (
        '{"group_id":"g","request_id":"a:r","job_id":"a","token":1,"ttl_s":1e400,'
        f'"waited_s":NaN,"proof":"{"0" * 64}"}}'
    )
    notice = GrantNotice.model_validate_json(raw)
    assert not notice_is_proven(notice, lease_key_hash(KEY))


# ---------------------------------------------------------------- what status shows


def test_no_view_of_the_group_shows_a_key_or_its_hash() -> None:
    """The proof is keyed by the request's key hash: nothing a caller can query shows it."""
    b = new_book()
    granted(b, request("a"), at(0))
    b.enqueue(request("b", OTHER_KEY, rid="b:r"), at(1))
    shown = "\n".join(
        [
            b.status(at(2)).model_dump_json(),
            b.holder_view(at(2)).model_dump_json(),  # type: ignore[union-attr]
            b.details(at(2)),
        ]
    )
    for secret in (KEY, OTHER_KEY, lease_key_hash(KEY), lease_key_hash(OTHER_KEY)):
        assert secret not in shown
    # Nor can a later field show one: no model a query answers has a field named for a key.
    for model in (GroupStatus, HolderView, WaiterView, LeaseRecord, GroupStats):
        assert not [f for f in model.model_fields if "key" in f or "secret" in f], model


# ---------------------------------------------------------------- the client's inbox


def take(inbox: GrantInbox, notice: GrantNotice) -> Delivery:
    """Hand ``notice`` to the inbox as an ``acquire`` update's answer would."""
    return inbox.accept(grant_from_update(notice))


async def _deliver(inbox: GrantInbox, notice: GrantNotice) -> GrantAck:
    """Run the inbox's delivery activity as the worker would: scheduled and started just now,
    with the group's start-to-close time, so the grant is on time."""
    env = ActivityEnvironment()
    now = datetime.now(UTC)
    env.info = dataclasses.replace(
        env.info,
        current_attempt_scheduled_time=now,
        started_time=now,
        start_to_close_timeout=timedelta(seconds=30),
    )
    return await env.run(inbox.deliver_grant, notice)


def test_the_inbox_drops_a_forged_grant_and_still_takes_the_real_one() -> None:
    real = granted(new_book(), request("a"), at(0))

    async def go() -> None:
        inbox = GrantInbox()
        waiting = inbox.expect(real.request_id, KEY)
        assert take(inbox, forged_like(real)) is Delivery.FORGED
        assert take(inbox, forged_like(real, proof="f" * 64)) is Delivery.FORGED
        assert take(inbox, forged_like(real, fault="forged fault")) is Delivery.FORGED
        assert not waiting.done() and inbox.forged == 3
        assert take(inbox, real) is Delivery.TAKEN
        assert waiting.done() and waiting.result().notice == real
        # The same grant again (a group that continued as new) is taken; a copy without its
        # proof is not, and neither is a notice for a request nobody waits for.
        assert take(inbox, real) is Delivery.TAKEN
        assert take(inbox, forged_like(real)) is Delivery.FORGED
        assert take(inbox, forged_like(real, request_id="a:nobody")) is Delivery.UNWANTED
        taken = inbox.withdraw(real.request_id)
        assert taken is not None and taken.notice == real
        assert inbox.forged == 4

    asyncio.run(go())


def fresh_grant() -> GrantNotice:
    """A grant made just now (a delivery checks it against its window from the grant's time)."""
    now = datetime.now(UTC)
    b = GroupBook(GroupConfig(group_id="g"), GroupState(stats=GroupStats(created_at=now)))
    return granted(b, request("a"), now)


def test_the_inbox_activity_declines_a_forged_grant() -> None:
    real = fresh_grant()

    async def go() -> None:
        inbox = GrantInbox()
        waiting = inbox.expect(real.request_id, KEY)
        ack = await _deliver(inbox, forged_like(real))
        assert not ack.accepted and not waiting.done() and inbox.forged == 1
        ack = await _deliver(inbox, real)
        assert ack.accepted and waiting.result().notice == real

    asyncio.run(go())


def test_the_inbox_answers_with_the_key_only_a_notice_its_group_made() -> None:
    """The key makes an answer the process's own; a forger must never learn it from one."""
    real = fresh_grant()

    async def go() -> None:
        inbox = GrantInbox()
        inbox.expect(real.request_id, KEY)
        forged = await _deliver(inbox, forged_like(real))
        assert forged.key is None and not forged.accepted
        taken = await _deliver(inbox, real)
        assert taken.accepted and taken.key == KEY
        inbox.withdraw(real.request_id)
        # Given up: a grant that raced it is declined with the key (the group ends it at
        # once), a forged copy without.
        late = prove_notice(real.model_copy(update={"token": real.token + 1}), lease_key_hash(KEY))
        declined = await _deliver(inbox, late)
        assert not declined.accepted and declined.key == KEY
        assert (await _deliver(inbox, forged_like(late))).key is None

    asyncio.run(go())


def test_a_grant_answered_without_its_key_waits_for_the_holders_renewal() -> None:
    b = new_book()
    grant = granted(b, request("a"), at(0))
    assert grant.confirm_within_s == b.config.grant_ack_timeout_s  # the process renews soon
    assert not b.leases.answer_is_proven(grant.token, None)
    assert not b.leases.answer_is_proven(grant.token, OTHER_KEY)
    assert not b.leases.answer_is_proven(grant.token + 1, KEY)
    assert b.leases.answer_is_proven(grant.token, KEY)
    b.leases.unconfirmed(grant.token, at(1))
    holder = b.state.holder
    assert holder is not None and not holder.delivered
    assert b.next_deadline() == at(1 + b.config.grant_ack_timeout_s)
    b.expire(at(1 + b.config.grant_ack_timeout_s - 0.1))
    assert b.state.holder is holder  # still held: its renewal may be on its way
    b.expire(at(1 + b.config.grant_ack_timeout_s))
    assert b.state.holder is None and b.state.history[-1].outcome.value == "dead"
