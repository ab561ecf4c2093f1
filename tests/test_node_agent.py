"""The node agent: snapshots on task queue timeslice-node-<node>, and what it refuses to touch."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker
from timeslice import (
    InvalidArgumentError,
    TimesliceError,
    TimeSliceOrchestratorClient,
)
from timeslice.protocol.group import (
    AcquireRequest,
    ProcessRef,
    QueueTarget,
    SnapshotTarget,
    group_workflow_id,
    lease_key_hash,
)
from timeslice.snapshot.base import SnapshotRequest
from timeslice.snapshot.processes import JOB_ENV, process_start_time
from timeslice.snapshot.registration import (
    JOB_TOKEN_ENV,
    job_token,
    key_path,
    load_agent_key,
    socket_path,
)
from timeslice.workers.sandbox import workflow_runner

from tests.helpers import run_cli

from .conftest import start_service, stop_process
from .helpers import events, finish, read_log, spawn_contender, wait_for
from .requester_workflows import ImpostorWorkflow

SIMULATED_BYTES = 3 * 1024 * 1024


def token_for(node: str, job_id: str) -> str:
    """Job ``job_id``'s token from the key of ``node``'s agent, as `timeslice agent-token`
    prints it."""
    return job_token(load_agent_key(key_path(socket_path(node).parent)), job_id)


@pytest.fixture(scope="module")
def node(server, worker, tmp_path_factory) -> Iterator[str]:
    name = f"n{uuid.uuid4().hex[:6]}"
    agent = start_service(
        [
            "agent",
            "--node",
            name,
            "--address",
            server.address,
            "--simulated-bytes",
            str(SIMULATED_BYTES),
            "--simulated-seconds",
            "0.01",
        ],
        "node agent on task queue",
        tmp_path_factory.mktemp("agent") / "agent.log",
    )
    yield name
    stop_process(agent)


def test_switches_go_through_the_node_agent(address, group, node, tmp_path, make_client):
    log = tmp_path / "agent.jsonl"
    procs = [
        spawn_contender(
            address,
            group,
            job,
            log,
            "--iterations",
            "3",
            "--hold",
            "0.05",
            "--start-with",
            "2",  # both ready before either holds: they take turns
            "--node",
            node,
            "--node-backend",
            "simulated",
        )
        for job in ("na", "nb")
    ]
    finish(procs)
    stats = make_client().group_status(group).stats
    assert stats.evictions >= 2 and stats.restores >= 1
    assert stats.bytes_moved == (stats.evictions + stats.restores) * SIMULATED_BYTES
    assert stats.snapshot_failures == 0


def test_failed_checkpoint_faults_only_that_job(address, group, node, tmp_path, make_client):
    """On this CPU-only machine cuda-checkpoint cannot work: the job is marked faulted and
    the group goes on serving the other one."""
    log = tmp_path / "fault.jsonl"
    env = {**os.environ, JOB_ENV: "cuda-job", JOB_TOKEN_ENV: token_for(node, "cuda-job")}
    contender = str(Path(__file__).parent / "contender.py")
    cmd = [
        sys.executable,
        contender,
        "--address",
        address,
        "--group",
        group,
        "--job-id",
        "cuda-job",
        "--log",
        str(log),
        "--hold",
        "0.05",
        "--node",
        node,
    ]
    # Holds once, then stays alive (resident) until its stdin closes.
    cuda_job = subprocess.Popen([*cmd, "--linger"], env=env, stdin=subprocess.PIPE)
    try:
        wait_for(lambda: events(log, "done", "cuda-job"), what="cuda-job held the group once")
        other = make_client(job_id="other")
        for _ in range(2):  # the first grant must evict cuda-job through the agent: it fails
            other.release(other.acquire(group, timeout=60))
        status = other.group_status(group)
        assert "cuda-bindings" in status.faulted_jobs["cuda-job"]
        assert status.stats.snapshot_failures == 1
        assert status.stats.released == 3  # the group kept serving "other"
        # The faulted job's next acquire (from its rank 1) fails at once with the reason.
        finish([subprocess.Popen([*cmd, "--rank", "1"], env=env)])
        assert [r["event"] for r in read_log(log)][-3:] == ["ready", "faulted", "done"]
    finally:
        cuda_job.communicate(timeout=60)
    # Once its processes are gone the job departs, and with it the fault: a new launch
    # starts clean.
    wait_for(lambda: "cuda-job" not in other.group_status(group).faulted_jobs, what="departed")


def test_client_refuses_checkpointing_a_process_not_launched_for_the_job(address, monkeypatch):
    monkeypatch.delenv(JOB_TOKEN_ENV, raising=False)
    with pytest.raises(InvalidArgumentError, match=f"start this process with {JOB_ENV}=j1"):
        TimeSliceOrchestratorClient(target=address, job_id="j1", node="n1")
    monkeypatch.setenv(JOB_ENV, "j1")
    with pytest.raises(
        InvalidArgumentError, match=f"start this process with {JOB_TOKEN_ENV} set to the job's"
    ):
        TimeSliceOrchestratorClient(target=address, job_id="j1", node="n1")
    with pytest.raises(InvalidArgumentError, match="invalid node name"):
        TimeSliceOrchestratorClient(
            target=address, job_id="j1", node="bad node", node_backends=["simulated"]
        )


def test_agent_refuses_a_forged_process(address, group, node, make_client):
    """A request naming someone else's process (right PID and start time) is refused."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        forged = SnapshotTarget(
            queues=[
                QueueTarget(
                    task_queue=f"timeslice-node-{node}",
                    backends=["cuda-checkpoint"],
                    processes=[
                        ProcessRef(pid=bystander.pid, start_time=process_start_time(bystander.pid))
                    ],
                )
            ]
        )
        forger = make_client(job_id="forger")

        async def send() -> None:
            client = await Client.connect(address, data_converter=pydantic_data_converter)
            await client.start_workflow(
                "GpuGroupWorkflow",
                {"config": {"group_id": group}},
                id=group_workflow_id(group),
                task_queue="timeslice",
                start_signal="request",
                start_signal_args=[
                    AcquireRequest(
                        request_id=f"forged-{uuid.uuid4().hex}",
                        key_hash=lease_key_hash("the-forger's-own-key"),
                        job_id="forger",
                        reply_task_queue=forger.task_queue,
                        snapshot=forged,
                    )
                ],
            )

        asyncio.run(send())
        # The forged grant is declined (nobody waits for it), but "forger" became resident;
        # the next job's grant makes the group evict it through the agent, which refuses.
        honest = make_client(job_id="honest")
        honest.release(honest.acquire(group, timeout=60))
        faults = honest.group_status(group).faulted_jobs
        # The PIDs in a request are not used: only processes that registered themselves.
        assert "job forger registered no process on this node" in faults["forger"]
        assert bystander.poll() is None  # untouched
    finally:
        bystander.kill()
        bystander.wait()


def test_standalone_snapshot_and_restore_without_a_group(address, make_client):
    torch = pytest.importorskip("torch")
    from timeslice.snapshot.torch_backend import TorchBackend

    weights = torch.linspace(0, 1, 1 << 20)
    expected = weights.clone()
    backend = TorchBackend()
    backend.register_tensor("weights", weights)
    client = make_client(job_id="standalone", snapshot_backends=[backend])
    [report] = client.snapshot()
    assert (report.backend, report.bytes) == ("torch", 4 << 20)
    assert weights.untyped_storage().nbytes() == 0
    [report] = client.restore()
    assert report.bytes == 4 << 20
    assert torch.equal(weights, expected)


def test_standalone_needs_a_backend_and_reports_failures(address, node, make_client, monkeypatch):
    with pytest.raises(InvalidArgumentError, match="registered no snapshot backend"):
        make_client(job_id="bare").snapshot()
    # This process claims the job in its current environment, but it was not *launched* for
    # it: the agent reads the launch environment and refuses to register it.
    monkeypatch.setenv(JOB_ENV, "claimer")
    monkeypatch.setenv(JOB_TOKEN_ENV, token_for(node, "claimer"))
    claimer = TimeSliceOrchestratorClient(target=address, job_id="claimer", node=node)
    with pytest.raises(
        TimesliceError, match=r"refused this process: .* not launched for job claimer"
    ):
        claimer.connect()
    claimer.close()


def test_backends_report_their_health():
    from timeslice.snapshot import NoopBackend, SimulatedBackend
    from timeslice.snapshot.cuda_checkpoint import CudaCheckpointBackend

    assert NoopBackend().health().ok and SimulatedBackend(nbytes=5).health().ok
    ckpt = CudaCheckpointBackend().health()
    if importlib.util.find_spec("cuda") is None:  # no cuda-python here: a clear "why not"
        assert not ckpt.ok and "cuda-bindings" in ckpt.detail
    torch = pytest.importorskip("torch")
    from timeslice.snapshot.torch_backend import TorchBackend

    backend = TorchBackend()
    assert not backend.health().ok  # nothing registered yet
    backend.register_tensor("w", torch.ones(4))
    backend.snapshot_sync(SnapshotRequest("job"))
    health = backend.health()
    assert health.ok and "16 bytes" in health.detail and "evicted" in health.detail


def test_agent_reports_backend_health_at_start(address, tmp_path):
    agent = start_service(
        ["agent", "--node", "health-check", "--address", address, "--simulated-bytes", "1"],
        "node agent on task queue",
        tmp_path / "agent.log",
        drain=False,  # its next lines are read here
    )
    try:
        lines = [agent.stdout.readline() for _ in range(2)]
    finally:
        stop_process(agent)
    assert any(line.startswith("  simulated: ok") for line in lines)
    assert any(line.startswith("  cuda-checkpoint: ") for line in lines)


def test_agent_acts_only_for_group_and_snapshot_workflows(address, node):
    """A workflow of any other type that asks the agent for a snapshot is refused."""

    async def ask() -> str:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        queue = f"impostor-{uuid.uuid4().hex[:8]}"
        async with Worker(
            client,
            task_queue=queue,
            workflows=[ImpostorWorkflow],
            workflow_runner=workflow_runner(),
        ):
            return await client.execute_workflow(
                ImpostorWorkflow.run,
                args=[f"timeslice-node-{node}", "victim"],
                id=f"impostor-{uuid.uuid4().hex[:8]}",
                task_queue=queue,
            )

    answer = asyncio.run(ask())
    assert answer.startswith("refused:"), answer
    assert "acts only for ['GpuGroupWorkflow', 'SnapshotJobWorkflow'] workflows" in answer
    assert "not for ImpostorWorkflow" in answer


def _register_raw(node: str, job_id: str, env: dict[str, str], token: str | None) -> dict:
    """Register a fresh process (launched with ``env``) on the agent's socket, as a client
    would, presenting ``token``; return the agent's answer."""
    code = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect(sys.argv[1])\n"
        "message = {'job_id': sys.argv[2]}\n"
        "if len(sys.argv) > 3: message['token'] = sys.argv[3]\n"
        "s.sendall(json.dumps(message).encode() + b'\\n')\n"
        "print(s.makefile().readline(), end='')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(socket_path(node)), job_id,
         *([token] if token is not None else [])],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_agent_registers_only_processes_that_prove_their_job(node):
    """Launching a process with TIMESLICE_JOB_ID=victim is not enough to be victim's: it must
    present victim's token, which only the agent's key makes."""
    env = {k: v for k, v in os.environ.items() if k not in (JOB_ENV, JOB_TOKEN_ENV)}
    claims_victim = {**env, JOB_ENV: "victim"}
    refused = _register_raw(node, "victim", claims_victim, None)
    assert not refused["ok"] and "presented no token for job victim" in refused["error"]
    for wrong in (token_for(node, "mine"), job_token(b"k" * 32, "victim"), "0" * 64):
        refused = _register_raw(node, "victim", claims_victim, wrong)
        assert not refused["ok"] and "is not job victim's" in refused["error"], refused
    # The right token, but the process was launched for another job: a mistake, refused.
    refused = _register_raw(node, "victim", env, token_for(node, "victim"))
    assert not refused["ok"] and "was not launched for job victim" in refused["error"]
    accepted = _register_raw(node, "victim", claims_victim, token_for(node, "victim"))
    assert accepted["ok"] and accepted["pid"] > 0


def test_agent_token_prints_the_token_the_agent_accepts(node, tmp_path):
    done = run_cli("agent-token", "victim", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == token_for(node, "victim")
    missing = run_cli("agent-token", "victim", "--key-file", str(tmp_path / "none.key"), timeout=60)
    assert missing.returncode == 2
    assert "no node-agent key at" in missing.stderr and "Traceback" not in missing.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", "agent-token", "bad id"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "invalid job id 'bad id'" in bad.stderr


def test_client_without_a_node_agent_to_register_with_says_so(address, monkeypatch):
    monkeypatch.setenv(JOB_ENV, "lonely")
    monkeypatch.setenv(JOB_TOKEN_ENV, "any")
    lonely = TimeSliceOrchestratorClient(target=address, job_id="lonely", node="no-agent-here")
    with pytest.raises(
        TimesliceError, match=r"no node agent listens at .*agent-no-agent-here\.sock"
    ):
        lonely.connect()
    lonely.close()
