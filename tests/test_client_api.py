"""The client's surface: decorators, context managers, the asyncio twin, the CLI's env handling."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from temporalio.client import Client
from timeslice import (
    AcquireTimeoutError,
    AsyncTimeSliceOrchestratorClient,
    ClientClosedError,
    GroupNotAnsweringError,
    InvalidArgumentError,
    Lease,
    NoControlWorkerError,
    TimeSliceOrchestratorClient,
)
from timeslice.cli.services import start_service
from timeslice.protocol.group import CONTROL_TASK_QUEUE, LeaseOutcome, group_workflow_id
from timeslice.transport.connection import connect, connect_config, control_workers_polling

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


def test_close_ends_an_acquire_waiting_in_another_thread(group, make_client):
    """close() from one thread while another waits in acquire(): the waiting call ends at once
    with ClientClosedError (its request withdrawn), and close() does not wait 10 s for it."""
    holder = make_client(job_id="close-holder")
    lease = holder.acquire(group)
    waiter = make_client(job_id="close-waiter")
    ended: dict[str, BaseException] = {}

    def wait_in_acquire() -> None:
        try:
            waiter.acquire(group)
        except BaseException as err:  # recorded for the assertion below
            ended["error"] = err

    thread = threading.Thread(target=wait_in_acquire, daemon=True)
    thread.start()
    wait_for(
        lambda: [w.job_id for w in holder.group_status(group).queue] == ["close-waiter"],
        what="the waiter queued",
    )
    started = time.monotonic()
    waiter.close()
    closing_s = time.monotonic() - started
    thread.join(timeout=30)
    assert not thread.is_alive(), "the waiting acquire never ended"
    assert isinstance(ended.get("error"), ClientClosedError), ended
    assert "closed" in str(ended["error"])
    assert closing_s < 8, f"close() took {closing_s:.1f} s"
    wait_for(lambda: holder.group_status(group).queue == [], what="the request withdrawn")
    holder.release(lease)


def test_bad_release_and_acquire_arguments_are_clear_errors(group, make_client):
    client = make_client(job_id="bad-args")
    with pytest.raises(InvalidArgumentError, match="release takes the Lease acquire returned"):
        client.release(group)  # a group id, not the lease
    with pytest.raises(InvalidArgumentError, match=r"at most 31622400 s \(366 days\)"):
        client.acquire(group, timeout=400 * 86_400)
    assert client.held == {}


def test_acquire_right_after_the_control_worker_stopped(server, group, tmp_path):
    """A worker that stopped answering is still listed as a poller (here it is stopped with
    SIGSTOP, which keeps its polls open, so it stays listed for sure): the acquire keeps to
    its time-out and says that no control worker took the request."""
    namespace = new_namespace(server.address, "stopped")
    worker = start_service(
        ["worker", "--address", server.address, "--namespace", namespace],
        "control worker on task queue",
        tmp_path / "worker.log",
    )

    async def pollers() -> int:
        return await control_workers_polling(
            await connect(connect_config(server.address, namespace))
        )

    wait_for(lambda: asyncio.run(pollers()) > 0, what="the worker listed as a poller")
    os.kill(worker.pid, signal.SIGSTOP)
    client = TimeSliceOrchestratorClient(target=server.address, namespace=namespace)
    try:
        started = time.monotonic()
        with pytest.raises(NoControlWorkerError) as caught:
            client.acquire(group, timeout=10)
        took = time.monotonic() - started
    finally:
        client.close()
        worker.kill()
        worker.wait()
    assert took < 10 + 8, f"acquire(timeout=10) took {took:.0f} s"
    message = str(caught.value)
    assert "the group took no request in 10.0 s" in message and "timeslice worker" in message


def test_release_on_a_wedged_group_says_the_group_is_not_answering(address, group, make_client):
    """The group's workflow task fails every time: release says so, not a raw RPCError."""
    client = make_client(job_id="wedged", lease_ttl=60)
    lease = client.acquire(group)

    async def wedge() -> None:
        raw = await Client.connect(address)
        workflow_id = group_workflow_id(group)
        await raw.get_workflow_handle(workflow_id).terminate("wedged by the test")
        # A workflow type the control worker does not know: each of its tasks fails.
        # (On a loaded machine this start once met a GpuGroupWorkflow again: the client's
        # acquire, granted by activity while its parked ask was still in flight, saw the ask
        # end NOT_FOUND and created the group anew. An ask whose acquire was granted now ends.)
        await raw.start_workflow("NotAGpuGroup", id=workflow_id, task_queue=CONTROL_TASK_QUEUE)

    asyncio.run(wedge())
    started = time.monotonic()
    with pytest.raises(GroupNotAnsweringError, match="the group is not answering") as caught:
        client.release(lease)
    assert time.monotonic() - started < 40
    assert "control worker's log" in str(caught.value)
    assert client.held == {}


def test_an_acquire_told_no_control_worker_withdraws_its_request_once_one_runs(
    server, group, tmp_path
):
    """The request an acquire sent before it raised NoControlWorkerError is queued at the
    group (a new group's start signal carries it): once a control worker runs, the client
    withdraws it, so no grant goes to a request nobody waits for (the 30-minute soak saw one
    hold the group for grant_ack_timeout_s after a server restart's NoControlWorkerError)."""
    namespace = new_namespace(server.address, "orphan")
    client = TimeSliceOrchestratorClient(target=server.address, namespace=namespace)
    worker = None
    try:
        with pytest.raises(NoControlWorkerError):
            client.acquire(group, timeout=60)
        worker = start_service(
            ["worker", "--address", server.address, "--namespace", namespace],
            "control worker on task queue",
            tmp_path / "worker.log",
        )
        other = TimeSliceOrchestratorClient(
            target=server.address, namespace=namespace, job_id="next"
        )
        try:
            lease = other.acquire(group, timeout=120)
            other.release(lease)
            status = other.group_status(group)
        finally:
            other.close()
    finally:
        client.close()
        if worker is not None:
            worker.kill()
            worker.wait()
    outcomes = [(r.job_id, r.outcome) for r in status.history]
    assert status.stats.dead_waiters == 0, outcomes  # nobody was granted in vain
    assert outcomes[-1] == ("next", LeaseOutcome.RELEASED), outcomes
