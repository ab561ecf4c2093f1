"""Workflows that forge what only a group may send (for tests/test_grant_proofs.py).

A caller with write access to the namespace can run these: schedule the grant-delivery activity
on a client process's task queue, or stand at a group's workflow id and answer its updates.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from timeslice.protocol.group import (
    DELIVER_GRANT_ACTIVITY,
    AcquireAnswer,
    AcquireCall,
    AcquireOutcome,
    CancelRequest,
    GrantAck,
    GrantNotice,
    GroupUpdate,
)


@workflow.defn(name="GrantForgerWorkflow")
class GrantForgerWorkflow:
    """Delivers ``notices`` to ``task_queue`` as a group would, and returns the answers."""

    @workflow.run
    async def run(self, task_queue: str, notices: list[GrantNotice]) -> list[GrantAck]:
        acks = []
        for notice in notices:
            acks.append(
                await workflow.execute_activity(
                    DELIVER_GRANT_ACTIVITY,
                    notice,
                    task_queue=task_queue,
                    result_type=GrantAck,
                    start_to_close_timeout=timedelta(seconds=30),
                    retry_policy=RetryPolicy(maximum_attempts=1),
                )
            )
        return acks


@workflow.defn(name="RogueGroupWorkflow")
class RogueGroupWorkflow:
    """Stands at a group's workflow id and answers every acquire with a grant it made up (it
    cannot sign one it was not sent: here it sends none)."""

    def __init__(self) -> None:
        self.answered = 0

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.update(name=GroupUpdate.ACQUIRE)
    def acquire(self, call: AcquireCall) -> AcquireAnswer:
        self.answered += 1
        request = call.request
        notice = GrantNotice(
            group_id=workflow.info().workflow_id.removeprefix("gpu-group-"),
            request_id=request.request_id,
            job_id=request.job_id,
            reply_task_queue=request.reply_task_queue,
            token=1,
            ttl_s=20.0,
            waited_s=0.0,
        )
        return AcquireAnswer(outcome=AcquireOutcome.GRANTED, notice=notice)

    @workflow.update(name=GroupUpdate.CANCEL)
    def cancel_request(self, cancel: CancelRequest) -> None:
        del cancel

    @workflow.query(name="answered")
    def answered_acquires(self) -> int:
        return self.answered


@workflow.defn(name="SilentGroupWorkflow")
class SilentGroupWorkflow:
    """Stands at a group's workflow id, takes every acquire and never answers it, and refuses
    every cancel: a group that a closing client cannot withdraw its request from."""

    def __init__(self) -> None:
        self.asked = 0

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.update(name=GroupUpdate.ACQUIRE)
    async def acquire(self, call: AcquireCall) -> AcquireAnswer:
        del call
        self.asked += 1
        await workflow.wait_condition(lambda: False)
        raise AssertionError("unreachable")

    @workflow.query(name="asked")
    def acquires_parked(self) -> int:
        return self.asked

    @workflow.update(name=GroupUpdate.CANCEL)
    def cancel_request(self, cancel: CancelRequest) -> None:
        raise ApplicationError(f"not cancelling {cancel.request_id}", non_retryable=True)
