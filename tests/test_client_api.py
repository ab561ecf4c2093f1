"""The client's surface: decorators, context managers, the asyncio twin, the CLI's env handling."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from timeslice import AsyncTimeSliceOrchestratorClient, Lease


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
