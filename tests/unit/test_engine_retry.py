"""The lease session's one retry loop (``RpcRetries.after``, ``timeslice.session.retry``),
which every repeated call goes through (``RpcRetries.call`` and the parked ``acquire``): what
it retries, with what backoff, and the typed error that ends each kind of failure. No server:
the errors are the SDK's own."""

from __future__ import annotations

import asyncio
import time

import pytest
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import (
    GroupNotAnsweringError,
    NoControlWorkerError,
    ServerUnreachableError,
    TimesliceError,
)
from timeslice.session.lease_session import LeaseSession, SessionSettings
from timeslice.session.retry import TASK_FAILING_RETRY_S, Retrying, RpcRetries

TASK_FAILED = RPCError(
    "Update rejected due to unexpected workflow task failure.",
    RPCStatusCode.FAILED_PRECONDITION,
    b"",
)
UNAVAILABLE = RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")


def _retries() -> RpcRetries:
    """A session's retry policy, as the session builds it."""
    settings = SessionSettings(
        connect_config={"target_host": "localhost:1"}, job_id="j", task_queue="q", rpc_retry_s=30
    )
    return LeaseSession(settings).retries


def _step(err: RPCError, retrying: Retrying) -> None:
    asyncio.run(_retries().after(err, retrying))


def test_a_transient_failure_is_retried_with_a_doubling_capped_backoff() -> None:
    retrying = Retrying("call", give_up_at=time.monotonic() + 60, delay=0.001)
    _step(UNAVAILABLE, retrying)
    assert retrying.delay == 0.002
    retrying.delay = 1.5
    retrying.pause = _no_wait(retrying)  # type: ignore[method-assign]
    _step(UNAVAILABLE, retrying)
    assert retrying.delay == 2.0  # capped


def _no_wait(retrying: Retrying):  # the cap, without waiting out 1.5 s
    async def pause() -> None:
        retrying.delay = min(retrying.delay * 2, 2.0)

    return pause


def test_an_unreachable_server_ends_at_the_bound_with_a_typed_error() -> None:
    with pytest.raises(ServerUnreachableError, match="localhost:1 did not answer for 30 s"):
        _step(UNAVAILABLE, Retrying("create g", give_up_at=time.monotonic() - 1))


def test_without_a_bound_a_transient_failure_is_retried_however_long() -> None:
    retrying = Retrying("acquire g", group_id="g", quiet=True, delay=0.001)
    _step(UNAVAILABLE, retrying)
    assert retrying.delay == 0.002


def test_a_failing_group_is_given_up_after_its_window_counted_from_the_first_failure() -> None:
    retrying = Retrying("acquire g", delay=0.001)
    _step(TASK_FAILED, retrying)  # the first failure starts the window
    assert retrying.failing_since is not None
    retrying.failing_since -= TASK_FAILING_RETRY_S
    with pytest.raises(GroupNotAnsweringError, match="acquire g: the group is not answering"):
        _step(TASK_FAILED, retrying)


def test_a_bound_shortens_the_failing_groups_window() -> None:
    now = time.monotonic()
    retrying = Retrying("release g", give_up_at=now - 0.1, failing_since=now)
    with pytest.raises(GroupNotAnsweringError):
        _step(TASK_FAILED, retrying)


def test_no_control_worker_and_a_refusal_end_at_once() -> None:
    no_poller = RPCError("no poller seen for task queue", RPCStatusCode.FAILED_PRECONDITION, b"")
    with pytest.raises(NoControlWorkerError, match="start one with `timeslice worker`"):
        _step(no_poller, Retrying("status g"))
    refused = RPCError("bad argument", RPCStatusCode.INVALID_ARGUMENT, b"")
    with pytest.raises(RPCError) as raised:
        _step(refused, Retrying("status g", give_up_at=time.monotonic() + 60))
    assert raised.value is refused


def test_a_failing_update_of_a_named_group_says_why_it_is_not_answering() -> None:
    """An update of a group that keeps failing ends in what the session's diagnosis says."""
    asked: list[tuple[str, str]] = []

    async def not_answering(group_id: str, what: str) -> TimesliceError:
        asked.append((group_id, what))
        return NoControlWorkerError(f"{what}: no control worker took it")

    retries = RpcRetries(server=lambda: "localhost:1", bound_s=30, not_answering=not_answering)
    now = time.monotonic()
    retrying = Retrying("release g", group_id="g", failing_since=now - TASK_FAILING_RETRY_S)
    with pytest.raises(NoControlWorkerError, match="release g: no control worker took it"):
        asyncio.run(retries.after(TASK_FAILED, retrying))
    assert asked == [("g", "release g")]
