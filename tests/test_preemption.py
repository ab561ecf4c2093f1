"""Preempting a holder that never yields: its lease runs out, the node agent takes it off the
device with cuda-checkpoint, the next job runs, and the holder comes back only under a new lease.

Job A holds the group and is frozen with SIGSTOP (a hung process: no renewal, no release). At
its TTL the group revokes the lease, and B's grant evicts A through A's snapshot target: the
node agent locks and checkpoints A's registered process. B runs its hold while A is still
frozen; then A is let go (SIGCONT): its stale lease is refused, and its next acquire is granted
under a new token, restored through the agent, with its data intact.

On CPU (``test_a_frozen_holder_is_preempted_and_comes_back_under_a_new_lease``) the node agent
is the real one (tests/fake_cuda_agent.py runs ``build_node_agent``) with only the CUDA driver
call faked (tests/fake_cuda_driver.py: per-PID states as the driver documents them, every call
written to a JSON-lines file). The `gpu` test does the same with the real driver and a process
holding 4 GiB of device memory (tests/gpu/run.sh); it has never run on a device yet.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from timeslice.protocol.group import (
    CONTROL_TASK_QUEUE,
    GroupStatus,
    LeaseOutcome,
    QueueTarget,
    SnapshotJobInput,
    SnapshotTarget,
    job_task_queue,
    node_task_queue,
)
from timeslice.snapshot.processes import JOB_ENV
from timeslice.snapshot.registration import (
    JOB_TOKEN_ENV,
    job_token,
    key_path,
    load_agent_key,
    socket_path,
)
from timeslice.transport.connection import connect, connect_config
from timeslice.workflows.snapshot_job import SNAPSHOT_JOB_WORKFLOW_TYPE

from tests.helpers import run_cli

from .conftest import start_service, stop_process
from .fake_cuda_driver import read_calls, scheduler_state
from .helpers import CONTENDER, REPO, events, read_log, wait_for

TTL_S = 4.0  # A's lease: long enough that a loaded machine renews it, short for the test
DEADLINE_S = 120.0  # for each wait: generous, the machine may be loaded


def token_for(node: str, job_id: str) -> str:
    return job_token(load_agent_key(key_path(socket_path(node).parent)), job_id)


@pytest.fixture
def fake_agent(server, worker, tmp_path) -> Iterator[tuple[str, Path]]:
    """The real node agent with a recording fake driver: (its node name, the driver's log)."""
    node = f"p{uuid.uuid4().hex[:6]}"
    calls = tmp_path / "driver.jsonl"
    log = tmp_path / "agent.log"
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_cuda_agent", "--address", server.address,
         "--node", node, "--calls", str(calls)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert agent.stdout is not None
    line = agent.stdout.readline()
    if "node agent on task queue" not in line:
        agent.kill()
        raise AssertionError(f"the fake-driver agent did not start: {line!r}; see {log}")
    yield node, calls
    stop_process(agent)


def spawn_job(
    address: str, group: str, job: str, log: Path, *extra: str, node: str | None = None
) -> subprocess.Popen:
    """A contender process for ``job``; with ``node``, launched for the job with its token
    and registered with that node's agent for cuda-checkpoint."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    on_node: list[str] = []
    if node is not None:
        env |= {JOB_ENV: job, JOB_TOKEN_ENV: token_for(node, job)}
        on_node = ["--node", node, "--node-backend", "cuda-checkpoint"]
    cmd = [sys.executable, str(CONTENDER), "--address", address, "--group", group,
           "--job-id", job, "--log", str(log), *on_node, *extra]  # fmt: skip
    stderr = log.with_suffix(f".{job}.stderr").open("wb")
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stderr=stderr)


@dataclass
class Preemption:
    a: subprocess.Popen
    b: subprocess.Popen
    a_log: list[dict]
    b_log: list[dict]
    stopped_at: float  # time.monotonic() just before SIGSTOP
    continued_at: float  # just before SIGCONT
    status: GroupStatus


def only(records: list[dict], event: str, job: str, token: int | None = None) -> dict:
    found = [
        r
        for r in records
        if r["event"] == event and r["job"] == job and (token is None or r["token"] == token)
    ]
    assert len(found) == 1, f"expected one {event!r} of {job} (token {token}) in {records}"
    return found[0]


def preempt_a_frozen_holder(
    address: str,
    group: str,
    node: str,
    tmp_path: Path,
    make_client: Callable,
    *,
    a_extra: tuple[str, ...] = (),
    b_node: str | None = None,
    while_frozen: Callable[[], None] = lambda: None,
    before_stop: Callable[[], None] = lambda: None,
) -> Preemption:
    """Run the scenario (module docstring); ``while_frozen`` runs once B holds, A frozen."""
    log = tmp_path / "jobs.jsonl"
    # A: its first hold would last 600 s; it ends it early only once its lease is no longer
    # valid (as a fenced job does), which it can learn only after it is let go.
    a = spawn_job(
        address, group, "pa", log, "--ttl", str(TTL_S), "--iterations", "2",
        "--first-hold", "600", "--hold", "0.2", "--until-revoked", *a_extra, node=node,
    )  # fmt: skip
    b = None
    try:
        wait_for(lambda: events(log, "data-ok", "pa"), timeout=DEADLINE_S, what="A holds the group")
        observer = make_client(job_id="observer")

        def confirmed() -> bool:
            # A grant taken from a parked update runs its TTL once a renewal confirms it; a
            # holder frozen before that is taken for one that never took its grant (DEAD, at
            # grant_ack_timeout_s), which is not a preemption.
            holder = observer.group_status(group).holder
            return holder is not None and holder.job_id == "pa" and holder.expires_in_s is not None

        wait_for(confirmed, timeout=DEADLINE_S, what="the group to confirm A's lease")
        before_stop()
        stopped_at = time.monotonic()
        os.kill(a.pid, signal.SIGSTOP)
        wait_for(lambda: scheduler_state(a.pid) == "T", timeout=DEADLINE_S, what="A stopped")
        # B stays registered (--linger) after its hold, so A's return evicts it too.
        b = spawn_job(
            address, group, "pb", log, "--ttl", "30", "--hold", "2", "--linger", node=b_node
        )
        wait_for(lambda: events(log, "acquired", "pb"), timeout=DEADLINE_S, what="B granted")
        while_frozen()
        wait_for(lambda: events(log, "releasing", "pb"), timeout=DEADLINE_S, what="B's hold")
        assert scheduler_state(a.pid) == "T", "A was let go before the test let it go"
        continued_at = time.monotonic()
        os.kill(a.pid, signal.SIGCONT)
        assert a.wait(timeout=DEADLINE_S) == 0, f"A exited with {a.returncode}; see {log}"
        status = observer.group_status(group)
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        if b is not None:
            b.communicate(timeout=DEADLINE_S)  # closes its stdin: it leaves
        if a.poll() is None:
            a.kill()
            a.wait()
    records = read_log(log)
    return Preemption(
        a=a,
        b=b,
        a_log=[r for r in records if r["job"] == "pa"],
        b_log=[r for r in records if r["job"] == "pb"],
        stopped_at=stopped_at,
        continued_at=continued_at,
        status=status,
    )


def check_the_group_and_the_jobs(run: Preemption) -> tuple[int, int, int]:
    """What holds whatever the driver: A's first lease expired, B held while A was frozen,
    A's stale release was refused and its next lease has a newer token than B's. Returns the
    three tokens (A's first, B's, A's second)."""
    a_log, b_log = run.a_log, run.b_log
    [first, second] = [r["token"] for r in a_log if r["event"] == "acquired"]
    b_token = only(b_log, "acquired", "pb")["token"]
    assert first < b_token < second, (first, b_token, second)
    # A's stale lease: its release is refused (the contender logs it and goes on).
    revoked = only(a_log, "revoked", "pa", first)
    assert "was revoked while held" in revoked["reason"], revoked
    assert [r["event"] for r in a_log][-4:] == ["acquired", "data-ok", "releasing", "done"]
    assert only(a_log, "data-ok", "pa", second)  # its data intact under the new lease
    # B's whole hold, on the processes' own monotonic clocks, lies inside A's frozen time.
    b_start = only(b_log, "acquired", "pb")["t"]
    b_end = only(b_log, "releasing", "pb")["t"]
    assert run.stopped_at < b_start < b_end < run.continued_at
    # The group's own record: A's lease ended EXPIRED before B's began; A's next came after.
    leases = {(r.job_id, r.token): r for r in run.status.history}
    a_lease, b_lease = leases[("pa", first)], leases[("pb", b_token)]
    assert a_lease.outcome is LeaseOutcome.EXPIRED
    assert (a_lease.end - a_lease.start).total_seconds() >= TTL_S
    assert a_lease.end <= b_lease.start
    assert leases[("pa", second)].outcome is LeaseOutcome.RELEASED
    stats = run.status.stats
    assert stats.expired == 1 and stats.preemptions == 1, stats
    assert stats.snapshot_failures == 0 and run.status.faulted_jobs == {}
    return first, b_token, second


def test_a_frozen_holder_is_preempted_and_comes_back_under_a_new_lease(
    address, group, fake_agent, tmp_path, make_client
):
    node, calls = fake_agent
    run = preempt_a_frozen_holder(
        address, group, node, tmp_path, make_client, a_extra=("--data-mb", "1"), b_node=node
    )
    check_the_group_and_the_jobs(run)
    a_pid, b_pid = run.a.pid, run.b.pid
    driver = [(c["call"], c["pid"], c["state"]) for c in read_calls(calls)]
    # The agent locked and checkpointed A (frozen), B was never touched while A was frozen;
    # A's return checkpointed B (which had yielded) and restored A.
    assert driver == [
        ("lock", a_pid, "LOCKED"),
        ("checkpoint", a_pid, "CHECKPOINTED"),
        ("lock", b_pid, "LOCKED"),
        ("checkpoint", b_pid, "CHECKPOINTED"),
        ("restore", a_pid, "LOCKED"),
        ("unlock", a_pid, "RUNNING"),
    ], driver
    by_call = {(c["call"], c["pid"]): c for c in read_calls(calls)}
    b_start = only(run.b_log, "acquired", "pb")["t"]
    for step in ("lock", "checkpoint"):
        made = by_call[(step, a_pid)]
        assert made["proc"] == "T", f"A was not stopped at its {step}: {made}"
        assert run.stopped_at < made["t"] < b_start, "A was not taken off before B's grant"
    a_second = [r for r in run.a_log if r["event"] == "acquired"][-1]["t"]
    assert run.continued_at < by_call[("restore", a_pid)]["t"] < a_second
    stats = run.status.stats
    # Two evictions by the group (A, preempted; B, which had yielded), one restore (A).
    assert (stats.evictions, stats.preemptions, stats.restores) == (2, 1, 1), stats
    shown = run_cli("status", group, "--address", address, timeout=DEADLINE_S)
    assert shown.returncode == 0, shown.stderr
    assert "expired 1, preemptions 1," in shown.stdout, shown.stdout
    report = run_cli(
        "report", "--group", group, "--text-only", "--address", address, timeout=DEADLINE_S
    )
    assert report.returncode == 0, report.stderr
    assert f"{group}: 1 preempted (a lease ran out without yielding" in report.stdout, report.stdout


GPU_MIB = int(os.environ.get("TIMESLICE_GPU_PREEMPT_MIB", str(4 * 1024)))


@pytest.fixture
def real_agent(server, worker, tmp_path) -> Iterator[str]:
    """`timeslice agent` with the real cuda-checkpoint driver: its node name."""
    node = f"g{uuid.uuid4().hex[:6]}"
    agent = start_service(
        ["agent", "--node", node, "--address", server.address, "--lock-timeout", "10"],
        "node agent on task queue",
        tmp_path / "agent.log",
    )
    yield node
    stop_process(agent)


@pytest.mark.gpu
def test_real_cuda_holder_frozen_is_preempted_and_its_device_memory_freed(
    address, group, real_agent, tmp_path, make_client
):
    """Never run on a device yet (tests/gpu/run.sh, step pytest-preemption). A holds
    GPU_MIB of device memory and is frozen; the real driver locks and checkpoints it.

    Open: whether cuCheckpointProcessLock succeeds on a SIGSTOPped process at all
    (docs/architecture.md, "Preemption"); this test is what answers it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    free: dict[str, int] = {}

    def held() -> None:  # this process is not A: the device's free memory, as others see it
        free["held"] = torch.cuda.mem_get_info()[0]

    def frozen() -> None:
        free["frozen"] = torch.cuda.mem_get_info()[0]

    # B holds no device memory (and registers no process with the agent, which the real
    # driver could not lock): the memory freed is A's.
    run = preempt_a_frozen_holder(
        address, group, real_agent, tmp_path, make_client,
        a_extra=("--cuda-mb", str(GPU_MIB)), before_stop=held, while_frozen=frozen,
    )  # fmt: skip
    if run.status.faulted_jobs:  # the open question's answer, in report.txt
        faults = "; ".join(run.status.faulted_jobs.values())
        print(f"preemption of a frozen {GPU_MIB} MiB CUDA holder failed: {faults}")
    first, b_token, second = check_the_group_and_the_jobs(run)
    freed = free["frozen"] - free["held"]
    assert freed >= GPU_MIB * 1024**2, f"only {freed} bytes of device memory were freed"
    b_start = only(run.b_log, "acquired", "pb")["t"]
    switches = [s for s in run.status.switch_history if s.from_job == "pa" and s.to_job == "pb"]
    took = (switches[0].end - switches[0].start).total_seconds() if switches else float("nan")
    print(
        f"preemption of a frozen {GPU_MIB} MiB CUDA holder (TTL {TTL_S:g} s): "
        f"{freed / 1024**3:.2f} GiB freed; eviction (lock + checkpoint) {took:.2f} s; "
        f"B's phase began {b_start - run.stopped_at:.2f} s after A froze; "
        f"tokens {first} -> {b_token} -> {second}"
    )


def test_a_frozen_holder_with_state_of_its_own_too_is_evicted_not_forgotten(
    address, group, fake_agent, tmp_path, make_client
):
    """A also moves state itself (an in-process backend: its own snapshot queue) besides
    being registered with its node agent. Frozen, it takes nothing from its own queue, while
    the agent finds it alive and checkpoints it whole: the group counts A evicted (a
    preemption), not gone, and A's return is restored through the agent, which unlocks it.
    Before, the own queue's silence read as "A's processes are gone": the group forgot A
    while the agent had it locked, and nothing unlocked it again."""
    node, calls = fake_agent
    run = preempt_a_frozen_holder(
        address, group, node, tmp_path, make_client,
        a_extra=("--backend", "noop", "--data-mb", "1"), b_node=node,
    )  # fmt: skip
    check_the_group_and_the_jobs(run)
    a_pid = run.a.pid
    driver = [(c["call"], c["pid"], c["state"]) for c in read_calls(calls)]
    a_moves = [(call, state) for call, pid, state in driver if pid == a_pid]
    assert a_moves == [
        ("lock", "LOCKED"),
        ("checkpoint", "CHECKPOINTED"),
        ("restore", "LOCKED"),
        ("unlock", "RUNNING"),
    ], driver


def test_a_standalone_move_of_a_job_with_both_kinds_of_queue_runs_them_apart(
    address, group, fake_agent, tmp_path
):
    """A standalone snapshot of a job with state of its own besides its node agent runs the
    job's own queue first and the agent's after it (the agent's lock would block the process's
    own CUDA calls), and a restore the agent's first; both read from the workflow's history."""
    node, calls = fake_agent
    log = tmp_path / "jobs.jsonl"
    job = "sa"
    proc = spawn_job(address, group, job, log, "--backend", "noop", "--linger", node=node)
    own, agent = job_task_queue(job), node_task_queue(node)
    target = SnapshotTarget(
        queues=[
            QueueTarget(task_queue=own, backends=["noop"]),
            QueueTarget(task_queue=agent, backends=["cuda-checkpoint"]),
        ]
    )

    async def move(action: str) -> dict[str, tuple[int, int]]:
        client = await connect(connect_config(address))
        handle = await client.start_workflow(
            SNAPSHOT_JOB_WORKFLOW_TYPE,
            SnapshotJobInput(job_id=job, action=action, target=target).model_dump(mode="json"),
            id=f"snapshot-{job}-{action}-{uuid.uuid4().hex[:8]}",
            task_queue=CONTROL_TASK_QUEUE,
        )
        await handle.result()
        scheduled: dict[int, str] = {}
        spans: dict[str, tuple[int, int]] = {}
        async for event in handle.fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                queue = event.activity_task_scheduled_event_attributes.task_queue.name
                scheduled[event.event_id] = queue
            elif event.HasField("activity_task_completed_event_attributes"):
                at = event.activity_task_completed_event_attributes.scheduled_event_id
                spans[scheduled[at]] = (at, event.event_id)
        return spans  # queue -> (its scheduled event, its completed event)

    try:
        wait_for(lambda: events(log, "done", job), timeout=DEADLINE_S, what="the job's one hold")
        evicted = asyncio.run(move("snapshot"))
        restored = asyncio.run(move("restore"))
    finally:
        proc.communicate(timeout=DEADLINE_S)  # closes its stdin: it leaves
    assert evicted[own][1] < evicted[agent][0], evicted
    assert restored[agent][1] < restored[own][0], restored
    moves = [(c["call"], c["state"]) for c in read_calls(calls) if c["pid"] == proc.pid]
    assert moves == [("lock", "LOCKED"), ("checkpoint", "CHECKPOINTED"),
                     ("restore", "LOCKED"), ("unlock", "RUNNING")]  # fmt: skip
