"""What a client says happened is what the group did (issue 36, item 6), against the session's
real dev server and control worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

from timeslice.protocol.group import (
    GroupUpdate,
    LeaseOutcome,
    LeaseReturn,
    ReturnAnswer,
    group_workflow_id,
)
from timeslice.transport.connection import connect, connect_config
from timeslice.transport.updates import send_update

from tests.helpers import REPO


def test_a_release_the_group_took_is_no_revocation_whatever_the_renewals_met(
    group: str, make_client: Callable[..., Any]
) -> None:
    """In a storm (control worker killed, server restarted) a holder's renewals go unanswered
    until its local validity runs out, and its heartbeat gives the lease up; the group may
    still hold it, and then takes its release. The release used to raise LeaseRevokedError
    while the group counted the lease released."""
    client = make_client(job_id=f"storm-{uuid.uuid4().hex[:6]}")
    lease = client.acquire(group, timeout=60)
    # What the heartbeat sets when no renewal was answered before the TTL ran out here.
    lease.revoked_reason = "could not renew before the TTL ran out (the storm)"
    assert not lease.valid
    assert client.release(lease) is False  # released, not revoked
    status = client.group_status(group)
    assert status.stats.released == 1 and status.stats.expired == 0
    assert [r.outcome for r in status.history] == [LeaseOutcome.RELEASED]


def test_close_during_an_acquire_leaves_no_stray_traceback(address: str) -> None:
    """A client closed while its acquire is parked at a group that will not take the request
    back: the acquire ends in ClientClosedError and nothing else is printed (the cancelled
    ask's poll used to end in an error that asyncio printed as 'never retrieved')."""
    ran = subprocess.run(
        [sys.executable, "-m", "tests.close_during_acquire", address],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "ended: ClientClosedError", ran.stdout + ran.stderr
    assert "never retrieved" not in ran.stderr and "Traceback" not in ran.stderr, ran.stderr


def test_a_release_sent_again_with_its_update_id_is_answered_as_it_was(
    address: str, group: str, make_client: Callable[..., Any]
) -> None:
    """A release whose answer was lost is sent again with the same update id (the lease
    session does so for every attempt): the server answers it with the first one's outcome and
    the group handles it once. So a retry answered "not valid" was never taken, and the
    eviction reports riding on it are kept for the next message, not dropped."""
    client = make_client(job_id=f"resend-{uuid.uuid4().hex[:6]}")
    lease = client.acquire(group, timeout=60)
    client._session.forget(lease)  # this test sends the release itself
    ret = LeaseReturn(request_id=lease.request_id, token=lease.token, key=lease.key)

    async def release_twice(update_id: str) -> list[ReturnAnswer]:
        temporal = await connect(connect_config(address))
        answers = []
        for _ in range(2):
            answer = await send_update(
                temporal,
                group_workflow_id(group),
                GroupUpdate.RELEASE,
                ret,
                ReturnAnswer,
                update_id=update_id,
            )
            answers.append(answer)
        return answers

    first, again = asyncio.run(release_twice(f"release-{uuid.uuid4().hex}"))
    assert first.valid and first.released
    assert again == first
    status = client.group_status(group)
    assert status.stats.released == 1 and status.stats.stale_messages == 0, status.stats
    # A fresh id is a new message (a run since continued as new never saw the first id): the
    # group knows the lease was released by its holder and answers so, counting it once.
    fresh = asyncio.run(release_twice(f"release-{uuid.uuid4().hex}"))
    assert [(a.valid, a.released, a.evict) for a in fresh] == [(True, True, False)] * 2
    assert client.group_status(group).stats.released == 1
