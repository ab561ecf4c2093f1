"""The lease session's one retry loop (``RpcRetries.after``, ``timeslice.session.retry``),
which every repeated call goes through (``RpcRetries.call`` and the parked ``acquire``): what
it retries, with what backoff, and the typed error that ends each kind of failure. No server:
the errors are the SDK's own."""

from __future__ import annotations

import asyncio
import threading
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


def test_a_parked_ask_whose_answer_was_lost_is_sent_again_as_the_same_update() -> None:
    """The acquire's ask is sent again with its update id after a failure that left no answer
    (the server hands back the update the group parked, whose result the grant becomes), and
    with a new one only after the group answered (a park that timed out: RETRY)."""
    from timeslice.protocol.group import AcquireAnswer, AcquireOutcome, AcquireRequest

    ids: list[str] = []

    class Recording(LeaseSession):
        async def _send_ask(self, group_id, call, accepted, update_id):  # type: ignore[override]
            ids.append(update_id)
            if len(ids) == 1:
                raise UNAVAILABLE  # the poll for its result gave up through an outage
            if len(ids) == 2:
                return AcquireAnswer(outcome=AcquireOutcome.RETRY)  # answered: parked too long
            granted.set_result(None)  # the grant came; this ask's own end does not matter
            raise UNAVAILABLE

    settings = SessionSettings(
        connect_config={"target_host": "localhost:1"}, job_id="j", task_queue="q", rpc_retry_s=30
    )
    session = Recording(settings)
    request = AcquireRequest(request_id="r", job_id="j", key_hash="0" * 64, reply_task_queue="q")

    async def scenario() -> None:
        nonlocal granted
        granted = asyncio.get_running_loop().create_future()
        await session._ask("g", request, granted, asyncio.Event(), time.monotonic())

    granted: asyncio.Future[None]
    asyncio.run(scenario())
    assert len(ids) == 3
    assert ids[0] == ids[1]  # no answer came: the same update again
    assert ids[2] != ids[1]  # answered: the next ask is a new update


def test_a_lease_the_group_kept_after_local_renewals_gave_up_is_valid_and_renewed_again() -> None:
    """The control worker was down past the TTL: this process's renewals gave up and marked the
    lease lost here. Its release with a next phase then reached the group before the group
    processed the expiry, and the group kept the lease: ``release`` says "go on under it", so
    the lease is valid again (from the release's sending) and renewed again."""
    from timeslice.protocol.group import ReturnAnswer
    from timeslice.session.lease import Lease

    renewing: list[Lease] = []

    class Kept(LeaseSession):
        async def _send_release(self, lease, ret):  # type: ignore[override]
            return ReturnAnswer(valid=True, released=False)

        async def _heartbeat(self, lease: Lease) -> None:  # type: ignore[override]
            renewing.append(lease)  # the renewals themselves go to a server; not here
            await asyncio.Event().wait()

    settings = SessionSettings(
        connect_config={"target_host": "localhost:1"}, job_id="j", task_queue="q", rpc_retry_s=30
    )
    session = Kept(settings)
    lease = Lease(
        group_id="g", job_id="j", token=3, request_id="r", ttl_s=5.0, waited_s=0.0,
        key="key-of-r-0123456789abcdef",
    )  # fmt: skip
    lease.revoked_reason = "could not renew before the TTL ran out (down)"
    session.held["g"] = lease

    async def scenario() -> bool:
        kept = await session.release(lease, next_phase="train")
        await asyncio.sleep(0)  # the renewals have started
        session._heartbeats["g"].cancel()
        return kept

    assert asyncio.run(scenario())
    assert lease.valid and lease.revoked_reason is None
    assert renewing == [lease]


def test_a_lease_whose_acquire_finished_as_its_caller_stopped_waiting_is_released() -> None:
    """``asyncio.wait_for`` around an acquire times out just as the grant comes: the caller
    gets ``TimeoutError`` and never sees the lease, so the client releases it rather than
    hold and renew it until it closes."""
    from timeslice.session.engine import Engine
    from timeslice.session.lease import Lease

    released: list[Lease] = []
    lease = Lease(group_id="g", job_id="j", token=1, request_id="r", ttl_s=5.0, waited_s=0.0)
    granted = threading.Event()
    settings = SessionSettings(
        connect_config={"target_host": "localhost:1"}, job_id="j", task_queue="q", rpc_retry_s=30
    )
    engine = Engine(settings, backends={})

    async def release(lease: Lease, **_: object) -> bool:
        released.append(lease)
        return False

    engine.session.release = release  # type: ignore[method-assign]

    finished = threading.Event()

    async def acquire() -> Lease:
        await asyncio.to_thread(granted.wait)
        finished.set()
        return lease

    async def noop() -> None:
        return None

    async def caller() -> None:
        waiting = asyncio.ensure_future(engine.run_async(acquire(), leases=True))
        await asyncio.sleep(0)  # submitted
        granted.set()
        # This loop stays blocked while the acquire finishes on the client's loop (and the
        # client's loop runs what followed it), so the result cannot reach the caller first.
        finished.wait(30)
        for _ in range(2):
            engine.thread.submit(noop()).result(30)
        waiting.cancel()  # the caller gives up just as the grant came
        with pytest.raises(asyncio.CancelledError):
            await waiting

    try:
        asyncio.run(caller())
        deadline = time.monotonic() + 30
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.thread.stop()
    assert released == [lease]
