"""An embedded client says its next phase: ``release(lease, next_phase=..., expected_s=...)``.

The group decides by its grant policy, the same rule RL jobs and the TRL integration go
through: kept when nobody waits; under ``phase_aware`` carried past a waiter within its bounds
(one phase boundary per lease by default), never under ``fifo``. ``timeslice status`` says why
the waiter waits.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from timeslice import (
    AsyncTimeSliceOrchestratorClient,
    InvalidArgumentError,
    Lease,
    TimeSliceOrchestratorClient,
)
from timeslice.protocol.group import GrantPolicy

from tests.helpers import run_cli, wait_for


class _Waiter:
    """Another job acquiring the group in a thread (a blocking acquire waits there)."""

    def __init__(self, client: TimeSliceOrchestratorClient, group: str) -> None:
        self.lease: Lease | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(client, group), daemon=True)
        self.thread.start()

    def _run(self, client: TimeSliceOrchestratorClient, group: str) -> None:
        try:
            self.lease = client.acquire(group, timeout=120)
        except BaseException as err:  # reported by the test
            self.error = err


@pytest.fixture
def waiting(make_client: Callable[..., TimeSliceOrchestratorClient]) -> Iterator[Any]:
    """Start a waiter on ``group`` behind ``holder``; returns once the group queues it."""
    waiters: list[_Waiter] = []

    def start(holder: TimeSliceOrchestratorClient, group: str, job: str) -> _Waiter:
        waiter = _Waiter(make_client(job_id=job), group)
        waiters.append(waiter)
        wait_for(
            lambda: any(w.job_id == job for w in holder.group_status(group).queue),
            what=f"{job} queued on {group}",
        )
        return waiter

    yield start
    for waiter in waiters:
        waiter.thread.join(timeout=60)


def _status_text(address: str, group: str) -> str:
    result = run_cli("status", "--address", address, group, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_next_phase_keeps_the_lease_when_nobody_waits(group, make_client):
    client = make_client(job_id="np-alone")
    lease = client.acquire(group)
    assert client.release(lease, next_phase="train", expected_s=0.5) is True
    assert lease.valid and client.held == {group: lease}
    # Without a measured length yet: kept all the same, nobody waiting.
    assert client.release(lease, next_phase="sample") is True
    status = client.group_status(group)
    assert status.holder is not None and status.holder.token == lease.token
    assert status.holder.carrying_into is None  # kept, but past nobody
    assert client.release(lease) is False  # a plain release releases
    assert client.held == {} and client.group_status(group).holder is None


@pytest.mark.parametrize("policy", [GrantPolicy.PHASE_AWARE, GrantPolicy.FIFO])
def test_next_phase_is_carried_past_a_waiter_once_under_phase_aware(
    address, group, make_client, waiting, policy
):
    holder = make_client(job_id="np-holder")
    holder.create_group(group, grant_policy=policy)
    lease = holder.acquire(group)
    waiter = waiting(holder, group, "np-waiter")
    kept = holder.release(lease, next_phase="train", expected_s=0.5)
    if policy is GrantPolicy.FIFO:
        assert kept is False and not lease.valid
        wait_for(lambda: waiter.lease or waiter.error, what="the waiter's grant")
        assert waiter.error is None and waiter.lease is not None
        assert holder.group_status(group).stats.carried == 0
        return
    assert kept is True and lease.valid
    status = holder.group_status(group)
    assert status.holder is not None and status.holder.job_id == "np-holder"
    assert status.holder.carrying_into == "train" and status.stats.carried == 1
    assert [w.job_id for w in status.queue] == ["np-waiter"]
    text = _status_text(address, group)
    assert "np-waiter (" in text and "held by np-holder: carrying into train" in text, text
    assert "carried 1" in text, text
    # One boundary per lease past a waiter (max_carries 1): the next one hands the group on.
    assert holder.release(lease, next_phase="sample", expected_s=0.5) is False
    wait_for(lambda: waiter.lease or waiter.error, what="the waiter's grant")
    assert waiter.error is None and waiter.lease is not None
    assert waiter.lease.token > lease.token


def test_a_phase_of_unknown_length_is_not_carried_past_a_waiter(group, make_client, waiting):
    holder = make_client(job_id="np-unknown")
    lease = holder.acquire(group)
    waiter = waiting(holder, group, "np-unknown-waiter")
    assert holder.release(lease, next_phase="train") is False
    wait_for(lambda: waiter.lease or waiter.error, what="the waiter's grant")
    assert waiter.error is None


def test_a_phase_longer_than_the_carry_limit_is_not_carried(group, make_client, waiting):
    holder = make_client(job_id="np-long")
    holder.create_group(group, carry_limit_s=1.0)
    lease = holder.acquire(group)
    waiting(holder, group, "np-long-waiter")
    assert holder.release(lease, next_phase="train", expected_s=5.0) is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"next_phase": "train", "expected_s": -1.0}, "expected_s must be"),
        ({"next_phase": "train", "expected_s": math.nan}, "expected_s must be"),
        ({"next_phase": "train", "expected_s": math.inf}, "expected_s must be"),
        ({"next_phase": "train", "expected_s": "0.5"}, "expected_s must be"),
        ({"next_phase": "train", "expected_s": True}, "expected_s must be"),
        ({"next_phase": "train", "expected_s": 1e9}, "expected_s must be"),
        ({"next_phase": "two words", "expected_s": 1.0}, "next_phase must be a phase name"),
        ({"next_phase": "", "expected_s": 1.0}, "next_phase must be a phase name"),
        ({"next_phase": 3, "expected_s": 1.0}, "next_phase must be a phase name"),
        ({"next_phase": "x" * 65}, "next_phase must be a phase name"),
        ({"expected_s": 1.0}, "needs next_phase"),
    ],
)
def test_bad_next_phase_is_a_clear_error_and_keeps_the_lease(group, make_client, kwargs, message):
    client = make_client(job_id="np-bad")
    lease = client.acquire(group)
    with pytest.raises(InvalidArgumentError, match=message):
        client.release(lease, **kwargs)
    assert lease.valid and client.held == {group: lease}  # nothing lost
    status = client.group_status(group)
    assert status.holder is not None and status.holder.token == lease.token
    client.release(lease)


def test_async_client_says_its_next_phase(address, group):
    async def scenario() -> tuple[bool, bool, bool]:
        async with AsyncTimeSliceOrchestratorClient(target=address, job_id="np-async") as client:
            lease = await client.acquire(group, timeout=30)
            kept = await client.release(lease, next_phase="train", expected_s=0.2)
            with pytest.raises(InvalidArgumentError, match="expected_s must be"):
                await client.release(lease, next_phase="train", expected_s=-0.1)
            still = lease.valid
            released = await client.release(lease)
            return kept, still, released

    assert asyncio.run(scenario()) == (True, True, False)
