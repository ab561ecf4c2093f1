"""Connection settings that cannot work say what is wrong, not just "cannot reach"."""

from __future__ import annotations

import os

import pytest
from timeslice import ServerUnreachableError, TimeSliceOrchestratorClient
from timeslice.cli.server import free_port

from tests.helpers import run_cli

API_KEY = "not-a-real-key-0123456789"


def test_api_key_against_a_plaintext_server_says_so(server, group):
    """The SDK turns TLS on with an API key; the dev server speaks plaintext."""
    client = TimeSliceOrchestratorClient(target=server.address, api_key=API_KEY)
    try:
        with pytest.raises(ServerUnreachableError) as caught:
            client.acquire(group, timeout=5)
    finally:
        client.close()
    message = str(caught.value)
    assert f"Temporal at {server.address} speaks plaintext" in message
    assert "an API key is set" in message and "drop the API key" in message
    assert "cannot reach" not in message
    assert API_KEY not in message


def test_api_key_from_the_environment_in_the_cli(server, group):
    env = {**os.environ, "TEMPORAL_API_KEY": API_KEY}
    env.pop("TEMPORAL_TLS", None)
    status = run_cli("status", group, "--address", server.address, timeout=120, env=env)
    assert status.returncode == 2, status.stderr
    assert "speaks plaintext" in status.stderr and "TEMPORAL_API_KEY" in status.stderr
    assert "Traceback" not in status.stderr and API_KEY not in status.stderr


def test_api_key_with_nothing_listening_is_still_cannot_reach():
    client = TimeSliceOrchestratorClient(target=f"127.0.0.1:{free_port()}", api_key=API_KEY)
    try:
        with pytest.raises(ServerUnreachableError, match="cannot reach Temporal"):
            client.acquire("g", timeout=5)
    finally:
        client.close()
