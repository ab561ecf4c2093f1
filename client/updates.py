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
from datetime import timedelta
from typing import Any, TypeVar

from opentelemetry import propagate, trace
from temporalio.api.common.v1 import Header, Payloads, WorkflowExecution
from temporalio.api.enums.v1 import UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import Input as UpdateInput
from temporalio.api.update.v1 import Meta as UpdateMeta
from temporalio.api.update.v1 import Request as UpdateRequest
from temporalio.api.update.v1 import WaitPolicy
from temporalio.api.workflowservice.v1 import UpdateWorkflowExecutionRequest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.converter import PayloadConverter
from temporalio.service import RPCError, RPCStatusCode
from timeslice.telemetry import tracer

T = TypeVar("T")
log = logging.getLogger("timeslice.updates")
# Where temporalio's tracing interceptor reads the caller's trace context from, so the update's
# handling in the workflow joins the caller's trace as it does for the SDK's own calls.
TRACE_HEADER = "_tracer-data"

# How long one attempt may take before it is sent again, and the pauses between attempts.
UPDATE_ATTEMPT_S = 0.25
_RESEND_DELAYS_S = (0.005, 0.02, 0.05, 0.1, 0.2, 0.5)
_RESENDABLE = {
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.ABORTED,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.CANCELLED,
}


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
) -> T:
    """Send an update to the workflow's current run and return its result.

    Sent by hand, without the SDK's own retries: an attempt that fails transiently, or is not
    accepted within ``UPDATE_ATTEMPT_S``, is sent again after a short pause, with the same
    update id. With ``wait_for_completion`` False an attempt waits only until the update is
    accepted, and the result is then awaited without a limit (an update that parks)."""
    update_id = str(uuid.uuid4())
    with tracer().start_as_current_span(
        f"StartWorkflowUpdate:{name}",
        kind=trace.SpanKind.CLIENT,
        attributes={"temporalWorkflowID": workflow_id, "temporalUpdateID": update_id},
    ):
        return await _send(client, workflow_id, name, arg, result_type, update_id,
                           wait_for_completion, give_up_after_s)  # fmt: skip


async def _send(
    client: Client,
    workflow_id: str,
    name: str,
    arg: Any,
    result_type: type[T],
    update_id: str,
    wait_for_completion: bool,
    give_up_after_s: float,
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
    deadline = time.monotonic() + give_up_after_s
    attempt = 0
    while True:
        try:
            response = await client.workflow_service.update_workflow_execution(
                request, retry=False, timeout=timedelta(seconds=UPDATE_ATTEMPT_S)
            )
            if response.stage >= _ACCEPTED:
                break
        except RPCError as err:
            if err.status not in _RESENDABLE or time.monotonic() >= deadline:
                raise
            log.debug(
                "update %s of %s: %s (%s); sending it again", name, workflow_id, err, err.status
            )
        # Transient, or only admitted so far (the run was closing): send it again.
        await asyncio.sleep(_RESEND_DELAYS_S[min(attempt, len(_RESEND_DELAYS_S) - 1)])
        attempt += 1
    if not response.HasField("outcome"):  # accepted, still running (a parked acquire)
        update = client.get_workflow_handle(
            workflow_id, run_id=response.update_ref.workflow_execution.run_id
        ).get_update_handle(update_id, result_type=result_type)
        return await update.result()
    outcome = response.outcome
    if outcome.HasField("failure"):
        raise WorkflowUpdateFailedError(await client.data_converter.decode_failure(outcome.failure))
    (result,) = await client.data_converter.decode(outcome.success.payloads, [result_type])
    return result
