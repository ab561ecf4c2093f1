"""Sending an update to a workflow so that a continue-as-new never costs a second.

An update that reaches a workflow while it continues as new is aborted by the server and must
be sent again; the SDK's own retry of that waits about a second (measured: one ~1-s hand-off
per continue-as-new of a busy group). Sent by hand instead, an attempt that fails transiently
or is not accepted soon is sent again after a short pause, with the same update id, so it is
applied once, on the new run.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from opentelemetry import propagate, trace
from pydantic import ValidationError
from temporalio.api.common.v1 import Header, Payloads, WorkflowExecution
from temporalio.api.enums.v1 import UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import Input as UpdateInput
from temporalio.api.update.v1 import Meta as UpdateMeta
from temporalio.api.update.v1 import Request as UpdateRequest
from temporalio.api.update.v1 import WaitPolicy
from temporalio.api.workflowservice.v1 import UpdateWorkflowExecutionRequest
from temporalio.client import (
    Client,
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.converter import PayloadConverter
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import VersionMismatchError
from timeslice.transport.telemetry import tracer

T = TypeVar("T")
log = logging.getLogger("timeslice.updates")
# Where temporalio's tracing interceptor reads the caller's trace context from, so the update's
# handling in the workflow joins the caller's trace as it does for the SDK's own calls.
TRACE_HEADER = "_tracer-data"

# How long one attempt may take before it is sent again, and the pauses between attempts.
UPDATE_ATTEMPT_S = 0.25
# An attempt that timed out gives the next one twice as long, up to this: an update waits for
# the workflow's next task, and a busy control plane takes longer to run one than 0.25 s. Sent
# every 0.25 s regardless, each waiting update cost the server an RPC per quarter second for as
# long as the overload lasted, more the later its answer came. An attempt that fails at once (a
# continue-as-new under way) is sent again just as soon as before.
UPDATE_ATTEMPT_MAX_S = 4.0
_RESEND_DELAYS_S = (0.005, 0.02, 0.05, 0.1, 0.2, 0.5)
# Pauses between polls for an accepted update's result after a poll failed (a server restart).
_REPOLL_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0)
_RESENDABLE = {
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.ABORTED,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.CANCELLED,
    # A connection that breaks mid-call ("transport error"): the server may have the update
    # already. Only the same update id is safe to send again — a new id would be a second
    # update, and a group that parked the first answers the second "queued" and later grants
    # through the first, which nobody awaits any more (found by bench/soak.py).
    RPCStatusCode.UNKNOWN,
}


# The server's rejection of an update the worker's workflow task left unprocessed (safe to send
# again: a rejection is not recorded), and how many times it is sent again.
UNPROCESSED_UPDATE = "UnprocessedUpdate"
MAX_UNPROCESSED_RESENDS = 5


def _unprocessed(response: Any) -> bool:
    return bool(
        response.HasField("outcome")
        and response.outcome.HasField("failure")
        and response.outcome.failure.application_failure_info.type == UNPROCESSED_UPDATE
    )


_ACCEPTED = UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ACCEPTED
_COMPLETED = (
    UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_COMPLETED
)


async def send_update(
    client: Client,
    workflow_id: str,
    name: str,
    arg: Any,
    result_type: type[T],
    *,
    wait_for_completion: bool = True,
    give_up_after_s: float = 60.0,
    on_slow: Callable[[], Awaitable[None]] | None = None,
    slow_after_s: float = 5.0,
    on_accepted: Callable[[], object] | None = None,
    resend_when_full: bool = True,
    update_id: str | None = None,
) -> T:
    """Send an update to the workflow's current run and return its result.

    Sent by hand, without the SDK's own retries: an attempt that fails transiently, or is not
    accepted within ``UPDATE_ATTEMPT_S`` (doubled after each attempt that timed out, up to
    ``UPDATE_ATTEMPT_MAX_S``), is sent again after a short pause, with the same update id.
    With ``wait_for_completion`` False an attempt waits only until the update is accepted, and
    the result is then awaited without a limit (an update that parks).
    ``on_slow`` runs once if the update is still not accepted after ``slow_after_s`` (it may
    raise, e.g. when no worker serves the workflow at all). ``on_accepted`` runs once the
    workflow took the update (a worker ran it). With ``resend_when_full`` False, an update the
    server refuses for capacity (``RESOURCE_EXHAUSTED``: the workflow has as many updates in
    flight as it admits) raises that ``RPCError`` at once, for the caller to take another way
    (transport/renewals.py). ``update_id`` (default: a fresh one) lets a caller that sends the
    same update again after this call failed keep one id: the server answers an id it already
    completed in the run with that outcome instead of running the update twice."""
    update_id = update_id or str(uuid.uuid4())
    with tracer().start_as_current_span(
        f"StartWorkflowUpdate:{name}",
        kind=trace.SpanKind.CLIENT,
        attributes={"temporalWorkflowID": workflow_id, "temporalUpdateID": update_id},
    ):
        return await _send(client, workflow_id, name, arg, result_type, update_id,
                           wait_for_completion, give_up_after_s, on_slow, slow_after_s,
                           on_accepted, resend_when_full)  # fmt: skip


async def _send(
    client: Client,
    workflow_id: str,
    name: str,
    arg: Any,
    result_type: type[T],
    update_id: str,
    wait_for_completion: bool,
    give_up_after_s: float,
    on_slow: Callable[[], Awaitable[None]] | None,
    slow_after_s: float,
    on_accepted: Callable[[], object] | None,
    resend_when_full: bool,
) -> T:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    header = Header(
        fields={TRACE_HEADER: PayloadConverter.default.to_payloads([carrier])[0]} if carrier else {}
    )
    payloads = await client.data_converter.encode([arg])
    request = UpdateWorkflowExecutionRequest(
        namespace=client.namespace,
        workflow_execution=WorkflowExecution(workflow_id=workflow_id),
        request=UpdateRequest(
            meta=UpdateMeta(update_id=update_id, identity=client.identity),
            input=UpdateInput(name=name, args=Payloads(payloads=payloads), header=header),
        ),
        wait_policy=WaitPolicy(lifecycle_stage=_COMPLETED if wait_for_completion else _ACCEPTED),
    )
    started = time.monotonic()
    deadline = started + give_up_after_s
    attempt = 0
    unprocessed = 0
    attempt_s = UPDATE_ATTEMPT_S
    while True:
        if on_slow is not None and time.monotonic() - started >= slow_after_s:
            await on_slow()
            on_slow = None
        sent = time.monotonic()
        try:
            response = await client.workflow_service.update_workflow_execution(
                request, retry=False, timeout=timedelta(seconds=attempt_s)
            )
            if response.stage >= _ACCEPTED and not _unprocessed(response):
                break
            if response.stage >= _ACCEPTED:
                # The server rejected it because the worker's workflow task did not process
                # it (e.g. the task raced a continue-as-new): a rejection leaves no trace, so
                # the same update id is sent again, a few times.
                unprocessed += 1
                if unprocessed > MAX_UNPROCESSED_RESENDS or time.monotonic() >= deadline:
                    break  # its failure is raised below
                log.debug("update %s of %s was not processed; sending it again", name, workflow_id)
        except RPCError as err:
            full = err.status == RPCStatusCode.RESOURCE_EXHAUSTED and not resend_when_full
            if err.status not in _RESENDABLE or time.monotonic() >= deadline or full:
                raise  # (full: refused for capacity; the caller takes another way)
            log.debug(
                "update %s of %s: %s (%s); sending it again", name, workflow_id, err, err.status
            )
            if time.monotonic() - sent >= attempt_s * 0.9:  # it timed out: the workflow is slow
                attempt_s = min(2 * attempt_s, UPDATE_ATTEMPT_MAX_S)
        # Transient, or only admitted so far (the run was closing): send it again.
        await asyncio.sleep(_RESEND_DELAYS_S[min(attempt, len(_RESEND_DELAYS_S) - 1)])
        attempt += 1
    if on_accepted is not None and not _unprocessed(response):
        on_accepted()
    if not response.HasField("outcome"):  # accepted, still running (a parked acquire)
        update = client.get_workflow_handle(
            workflow_id, run_id=response.update_ref.workflow_execution.run_id
        ).get_update_handle(update_id, result_type=result_type)
        return await _await_result(update, name, workflow_id, give_up_after_s, result_type)
    outcome = response.outcome
    if outcome.HasField("failure"):
        raise WorkflowUpdateFailedError(await client.data_converter.decode_failure(outcome.failure))
    try:
        (result,) = await client.data_converter.decode(outcome.success.payloads, [result_type])
    except ValidationError as err:
        raise _mismatch(name, workflow_id, result_type, err) from None
    return result


def _cancelling() -> bool:
    """Whether the task running this is being cancelled: the SDK ends a poll that its caller
    cancelled with its own timeout-or-cancelled error, which is then no reason to poll again."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _mismatch(name: str, workflow_id: str, result_type: type, err: ValidationError) -> Exception:
    first = err.errors()[0] if err.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ())) or "?"
    return VersionMismatchError(
        f"{workflow_id} answered {name} with a {result_type.__name__} this client cannot read "
        f"({where}: {first.get('msg', err)}): it runs another release of Timeslice; upgrade "
        "clients, job workers and control workers together (docs/upgrading.md)"
    )


async def _await_result(
    update: WorkflowUpdateHandle[T],
    name: str,
    workflow_id: str,
    give_up_after_s: float,
    result_type: type,
) -> T:
    """The result of an accepted update, polled for again — same update id — while polling
    fails transiently: a server that restarts ends the poll with a transport error, which the
    SDK does not retry. The workflow answers this update and no other, so sending a new one
    would lose the answer (a parked acquire's grant: see ``_RESENDABLE``). The SDK reports a
    poll that timed out or was cancelled by the server (``DEADLINE_EXCEEDED``, ``CANCELLED``)
    as its own error, not an ``RPCError``: that one is polled again too."""
    failing_since: float | None = None
    attempt = 0
    while True:
        try:
            return await update.result()
        except ValidationError as err:
            raise _mismatch(name, workflow_id, result_type, err) from None
        except (RPCError, WorkflowUpdateRPCTimeoutOrCancelledError) as err:
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            transient = not isinstance(err, RPCError) or err.status in _RESENDABLE
            if not transient or now - failing_since >= give_up_after_s or _cancelling():
                raise
            log.debug("update %s of %s: its result: %s; polling again", name, workflow_id, err)
        await asyncio.sleep(_REPOLL_DELAYS_S[min(attempt, len(_REPOLL_DELAYS_S) - 1)])
        attempt += 1
