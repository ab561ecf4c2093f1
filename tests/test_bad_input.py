"""Bad input fails fast with a clear error and loses nothing."""

from __future__ import annotations

import asyncio
import math
import os

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from timeslice import (
    InvalidArgumentError,
    NotHolderError,
    ServerUnreachableError,
    TimesliceError,
    TimeSliceOrchestratorClient,
    UnknownGroupError,
)
from timeslice.cli.server import free_port
from timeslice.protocol.group import CONTROL_TASK_QUEUE, GROUP_WORKFLOW_TYPE

from tests.helpers import run_cli


@pytest.mark.parametrize("bad", ["", "has space", "-leading-dash", "x" * 101, "slash/no", 7])
def test_malformed_group_ids_fail_fast(bad):
    client = TimeSliceOrchestratorClient(target="127.0.0.1:1")  # nothing is contacted
    with pytest.raises(InvalidArgumentError, match="invalid group id"):
        client.acquire(bad)
    with pytest.raises(InvalidArgumentError, match="invalid group id"):
        client.on_accelerators(group_id=bad)
    with pytest.raises(InvalidArgumentError, match="invalid group id"):
        client.group_status(bad)
    with pytest.raises(InvalidArgumentError, match="invalid group id"):
        TimeSliceOrchestratorClient(target="127.0.0.1:1", group_id=bad)


@pytest.mark.parametrize("bad", [-1, -0.001, math.nan, math.inf, "5", True])
def test_bad_timeouts_fail_fast(bad):
    client = TimeSliceOrchestratorClient(target="127.0.0.1:1")
    with pytest.raises(InvalidArgumentError, match="timeout"):
        client.acquire("g", timeout=bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"job_id": "bad id"}, "invalid job id"),
        ({"priority": 1000}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"lease_ttl": 0.1}, "lease_ttl"),
        ({"lease_ttl": -3}, "lease_ttl"),
        ({"rank": -1}, "rank"),
        ({"target": "no-port"}, "HOST:PORT"),
        ({"snapshot_backends": ["nonesuch"]}, "unknown snapshot backend"),
        ({"namespace": " "}, "namespace"),
    ],
)
def test_bad_client_settings_fail_fast(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        TimeSliceOrchestratorClient(**{"target": "127.0.0.1:1", **kwargs})


@pytest.mark.parametrize("bad", [0, -1, math.nan, 1e9, 0.5])
def test_bad_lease_ttl_per_acquire_fails_fast(bad):
    client = TimeSliceOrchestratorClient(target="127.0.0.1:1")  # nothing is contacted
    with pytest.raises(InvalidArgumentError, match="ttl"):
        client.acquire("g", ttl=bad)


def test_closed_client_says_so(address, group, make_client):
    client = make_client()
    client.release(client.acquire(group))
    client.close()
    with pytest.raises(TimesliceError, match="this client is closed"):
        client.acquire(group)
    with pytest.raises(TimesliceError, match="this client is closed"):
        client.group_status(group)


def test_missing_group_argument():
    client = TimeSliceOrchestratorClient(target="127.0.0.1:1")
    with pytest.raises(InvalidArgumentError, match="no group given"):
        client.acquire()


def test_unreachable_server_is_a_clear_error():
    client = TimeSliceOrchestratorClient(target=f"127.0.0.1:{free_port()}")
    with pytest.raises(ServerUnreachableError, match="cannot reach Temporal"):
        client.acquire("g", timeout=1)


def test_unknown_group_status(address, make_client):
    with pytest.raises(UnknownGroupError, match="no GPU group 'never-made'"):
        make_client().group_status("never-made")


def test_release_without_holding(address, group, make_client):
    client = make_client()
    with pytest.raises(NotHolderError, match="holds 0 leases"):
        client.release()
    lease = client.acquire(group)
    with pytest.raises(InvalidArgumentError, match="already holds group"):
        client.acquire(group)
    client.release(lease)
    with pytest.raises(NotHolderError, match="does not hold this lease"):
        client.release(lease)


def test_group_workflow_with_bad_input_fails_without_retrying(address):
    async def start_bad() -> None:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        handle = await client.start_workflow(
            GROUP_WORKFLOW_TYPE,
            {"config": {"group_id": "bad id!"}},
            id="gpu-group-bad-input-check",
            task_queue=CONTROL_TASK_QUEUE,
        )
        await handle.result()

    with pytest.raises(WorkflowFailureError) as info:
        asyncio.run(start_bad())
    cause = info.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.non_retryable and cause.type == "InvalidInput"
    assert "invalid group id" in cause.message


POOL_JOB = ["job", "start", "--job-id", "j", "--workload", "simulated", "--epochs", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["server", "--port", "70000"], "port must be a TCP port"),
        (["server", "--dynamic-config", "k=not json"], "value is not JSON"),
        (["status", "bad id!"], "invalid group id"),
        (["worker", "--address", "nope"], "HOST:PORT"),
        (["job", "start", "--job-id", "j", "--workload", "simulated"], "epochs: Field required"),
        (
            [
                "job",
                "start",
                "--job-id",
                "j",
                "--workload",
                "simulated",
                "--epochs",
                "0",
                "--sampler-group",
                "g",
            ],
            "epochs: Input should be greater than or equal to 1",
        ),
        (["job", "start", "--job-id", "bad id", "--epochs", "2"], "invalid job id"),
        (["job", "start", "--config", "/nonexistent.json"], "No such file"),
        (["job", "start", "--option", "lr=oops"], "value is not JSON"),
        (["job", "worker", "--job-id", "j", "--workload", "nope"], "unknown workload 'nope'"),
        (
            [
                "job",
                "start",
                "--job-id",
                "j",
                "--workload",
                "nope",
                "--epochs",
                "2",
                "--sampler-group",
                "g",
            ],
            "unknown workload 'nope': use a built-in",
        ),
        (["job", "worker", "--job-id", "j", "--workload", "os:getcwd"], "not a timeslice"),
        (["job", "progress", "bad id!"], "invalid job id"),
        (["job", "start", "--config", "/dev/zero"], "not a regular file"),
        # Pools: checked before any server is reached (docs/pools.md, "Bad input").
        (["pool", "create", "p"], "pool 'p' has no groups"),
        (["pool", "create", "p", "--group", "g:80Q"], "invalid memory size '80Q'"),
        (["pool", "create", "p", "--group", "g", "--group", "g"], "groups named twice"),
        (["pool", "create", "p", "--group", "g", "--max-slowdown", "0.5"], "max_slowdown"),
        (["pool", "status", "bad pool"], "invalid pool name"),
        (["pool", "create", "p", "--group", "g", "--move-every", "0"], "move_every_epochs"),
        (["pool", "create", "p", "--group", "g", "--move-horizon", "-1"], "move_horizon_s"),
        (["pool", "move", "p", "bad job", "g"], "invalid job id 'bad job'"),
        (["pool", "move", "p", "j", "bad/group"], "invalid group id 'bad/group'"),
        ([*POOL_JOB, "--pool", "p", "--job-profile", "/nonexistent.yaml"], "cannot read"),
        ([*POOL_JOB, "--sampler-group", "g", "--place-anyway"], "for a job started with pool"),
        (["job", "worker", "--job-id", "j", "--workload", "simulated", "--threads", "0"], ">= 1"),
        (["job", "worker", "--job-id", "j", "--workload", "simulated", "--rank", "-1"], ">= 0"),
        (["agent", "--node", "n1", "--lock-timeout", "0"], "must be > 0, not 0"),
        (["agent", "--node", "n1", "--lock-timeout", "nan"], "not a finite number"),
        (["agent", "--node", "n1", "--simulated-bytes", "-5"], "must be >= 0"),
        (["report", "--address", "127.0.0.1:1", "--out", "/proc/nope"], "cannot write there"),
        (["server", "--port", "0"], "port must be a TCP port"),
        # Workload options are checked before anything starts (no server is reached here).
        (
            [
                "job",
                "start",
                "--job-id",
                "j",
                "--workload",
                "grpo-toy",
                "--epochs",
                "2",
                "--sampler-group",
                "g",
                "--option",
                "reward_latency=1.5",
            ],
            "unknown option(s) 'reward_latency' (did you mean 'reward_latency_s'?)",
        ),
        (
            [
                "job",
                "start",
                "--job-id",
                "j",
                "--workload",
                "simulated",
                "--epochs",
                "2",
                "--sampler-group",
                "g",
                "--option",
                "sample_s=-1",
            ],
            "option 'sample_s' = -1.0 is invalid",
        ),
        (["job", "start", "--job-id", "j", "--process-wait", "0"], "must be > 0, not 0"),
        (["job", "options", "nope"], "unknown workload 'nope'"),
    ],
)
def test_cli_rejects_bad_arguments(argv, message):
    result = run_cli(*argv, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_job_options_lists_what_each_option_does():
    shown = run_cli("job", "options", "grpo-toy", timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "reward_latency_s (float, default 0.0)" in shown.stdout
    assert "external verifier" in shown.stdout  # what it stands for, not only its name
    helped = run_cli("job", "worker", "--help", timeout=60, env={**os.environ, "COLUMNS": "400"})
    from timeslice.workloads.registry import BUILTIN

    said = " ".join(helped.stdout.split())
    assert all(name in said for name in BUILTIN), said  # grpo-jax too
