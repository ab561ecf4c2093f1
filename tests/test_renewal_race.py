"""A renewal that reaches the group after the process's own release is no revocation.

A lease's heartbeat may send its renewal while the release of the same lease is on its way: the
group then ends the lease first and answers the renewal "no longer held". Before this was
told apart, a healthy run logged ``ERROR ... lease on G revoked`` for it, and ``release`` raised
``LeaseRevokedError`` although the group had taken its release.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import pytest
from timeslice.protocol.group import GroupUpdate
from timeslice.transport.renewals import send_renewal


def test_a_renewal_crossing_its_own_release_is_no_revocation(
    group: str, make_client: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    client = make_client(job_id="crossing", lease_ttl=1.5)  # renewals every 0.5 s
    session = client._session
    # The real updates, in an order forced here: the release reaches the group, then the
    # heartbeat's next renewal does, and only then does the release's answer come back.
    modules = {
        sys.modules[type(session)._heartbeat.__module__],
        sys.modules[type(session).release_lease.__module__],
        sys.modules[send_renewal.__module__],  # the heartbeat's renewals go through it
    }
    real = next(iter(modules)).send_update
    release_sent = False
    renewals_after: list[Any] = []
    renewed = asyncio.Event()

    async def ordered(*args: Any, **kwargs: Any) -> Any:
        nonlocal release_sent
        name = args[2]
        if name == GroupUpdate.RELEASE:
            release_sent = True
            answer = await real(*args, **kwargs)
            await asyncio.wait_for(renewed.wait(), 60)
            return answer
        answer = await real(*args, **kwargs)
        if name == GroupUpdate.RENEW and release_sent:
            renewals_after.append(answer)
            renewed.set()
        return answer

    for module in modules:
        monkeypatch.setattr(module, "send_update", ordered)
    caplog.set_level(logging.DEBUG, logger="timeslice")
    lease = client.acquire(group)
    assert client.release(lease) is False  # released, not kept; no LeaseRevokedError
    assert renewals_after and not renewals_after[0].valid  # the race did happen
    assert lease.revoked_reason is None and not lease.valid
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert any("crossed its release" in r.getMessage() for r in caplog.records)
