"""The client's surface: decorators, context managers, the asyncio twin, the CLI's env handling."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import pytest
from timeslice import (
    AcquireTimeoutError,
    AsyncTimeSliceOrchestratorClient,
    Lease,
    NoControlWorkerError,
    TimeSliceOrchestratorClient,
)

from tests.helpers import new_namespace, wait_for


def test_decorator_on_sync_and_async_functions(group, make_client):
    client = make_client(group_id=group)

    @client.on_accelerators()
    def phase(x: int) -> tuple[int, bool]:
        return x * 2, group in client.held and client.held[group].valid

    @client.on_accelerators(group_id=group)
    async def async_phase(x: int) -> tuple[int, bool]:
        await asyncio.sleep(0)
        return x + 1, group in client.held

    assert phase(21) == (42, True)
    assert asyncio.run(async_phase(1)) == (2, True)
    assert client.held == {}
    assert phase.__name__ == "phase"  # functools.wraps keeps the identity
    assert client.group_status(group).stats.released == 2


def test_context_manager_and_yield_alias(group, make_client):
    client = make_client()
    with client.on_accelerators(group_id=group) as lease:
        assert isinstance(lease, Lease) and lease.valid and lease.group_id == group
    assert not lease.valid  # released on exit
    again = client.acquire(group)
    assert again.token > lease.token
    client.yield_(again)
    with pytest.raises(RuntimeError, match="boom"), client.on_accelerators(group_id=group):
        raise RuntimeError("boom")  # the body's error wins; the lease is still released
    assert client.held == {}
    assert client.group_status(group).holder is None


def test_async_client(address, group):
    async def scenario() -> list[int]:
        async with AsyncTimeSliceOrchestratorClient(target=address, job_id="asyncjob") as client:
            tokens = []
            lease = await client.acquire(group, timeout=30)
            tokens.append(lease.token)
            await client.release()
            async with client.on_accelerators(group_id=group) as held:
                tokens.append(held.token)

            @client.on_accelerators(group_id=group)
            async def phase() -> int:
                return client.held[group].token

            tokens.append(await phase())
            status = await client.group_status(group)
            assert status.stats.released == 3
            return tokens

    tokens = asyncio.run(scenario())
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


def test_async_client_rejects_sync_functions(address):
    client = AsyncTimeSliceOrchestratorClient(target=address)
    with pytest.raises(TypeError, match="not `async def`"):
        client.on_accelerators(group_id="g")(lambda: None)


def test_cli_honours_temporal_address(address, group, make_client):
    holder = make_client(job_id="cli-check")
    holder.release(holder.acquire(group))
    env = {**os.environ, "TEMPORAL_ADDRESS": address}
    result = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", "status", group],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"group {group}" in result.stdout and "leases:      1" in result.stdout
    setup = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", "setup"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert setup.returncode == 0 and "already registered" in setup.stdout
    # The session's control worker serves this namespace: setup counts it.
    assert re.search(r"control workers on task queue 'timeslice': [1-9]\d* polling", setup.stdout)


def test_timeout_zero_is_a_try_lock(group, make_client):
    holder, other = make_client(job_id="trylock-holder"), make_client(job_id="trylock-other")
    lease = holder.acquire(group)
    with pytest.raises(AcquireTimeoutError, match="timeout=0 only takes a free group"):
        other.acquire(group, timeout=0)
    status = holder.group_status(group)
    assert status.holder is not None and status.holder.job_id == "trylock-holder"
    assert status.queue == [], "a try-lock that failed left nothing queued"
    holder.release(lease)
    taken = other.acquire(group, timeout=0)  # free now: granted at once
    assert taken.valid and other.held == {group: taken}
    other.release(taken)


def test_no_control_worker_is_a_clear_error(server, group):
    """In a namespace no control worker serves, nothing would ever answer: say so."""
    namespace = new_namespace(server.address, "unserved")

    def acquire_fails() -> str | None:
        client = TimeSliceOrchestratorClient(target=server.address, namespace=namespace)
        try:
            client.acquire(group, timeout=60)
        except NoControlWorkerError as err:
            return str(err)
        finally:
            client.close()
        return None

    started = time.monotonic()
    message = wait_for(acquire_fails, timeout=60, what="the acquire's error")
    assert time.monotonic() - started < 30, "told within seconds, not after the RPC time-outs"
    assert "no control worker serves task queue 'timeslice'" in message
    assert f"namespace {namespace!r}" in message and "timeslice worker" in message
