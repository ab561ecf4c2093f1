"""send_update against a real server and a worker of our own, speaking the task protocol raw.

The worker here completes its first workflow task for an update without processing the update,
so the server rejects it as ``UnprocessedUpdate`` (safe to send again: a rejection leaves no
trace). send_update must send it again under the same update id, not give up.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from google.protobuf.any_pb2 import Any as AnyProto
from temporalio.api.command.v1 import Command, ProtocolMessageCommandAttributes
from temporalio.api.common.v1 import Payloads
from temporalio.api.enums.v1 import CommandType
from temporalio.api.protocol.v1 import Message
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.update.v1 import Acceptance, Outcome, Request, Response
from temporalio.api.workflowservice.v1 import (
    PollWorkflowTaskQueueRequest,
    RespondWorkflowTaskCompletedRequest,
)
from temporalio.client import Client
from timeslice import VersionMismatchError
from timeslice.protocol.group import ReturnAnswer
from timeslice.transport.connection import connect, connect_config
from timeslice.transport.updates import send_update

IGNORED_DELIVERIES = 2


async def _raw_worker(client: Client, task_queue: str, seen: list[str]) -> None:
    """Complete every workflow task; ignore the first deliveries of an update (no message back),
    then accept it and answer with its argument."""
    service = client.workflow_service
    while True:
        task = await service.poll_workflow_task_queue(
            PollWorkflowTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=task_queue),
                identity="raw-test-worker",
            ),
            timeout=timedelta(seconds=70),
        )
        if not task.task_token:
            continue  # the long poll ended empty
        messages: list[Message] = []
        commands: list[Command] = []
        for incoming in task.messages:
            request = Request()
            if not incoming.body.Unpack(request):
                continue
            update_id = request.meta.update_id
            seen.append(update_id)
            if len(seen) <= IGNORED_DELIVERIES:
                continue  # not processed: the server rejects it as UnprocessedUpdate
            accept = AnyProto()
            accept.Pack(
                Acceptance(
                    accepted_request_message_id=incoming.id,
                    accepted_request_sequencing_event_id=incoming.event_id,
                    accepted_request=request,
                )
            )
            respond = AnyProto()
            respond.Pack(
                Response(
                    meta=request.meta,
                    outcome=Outcome(success=Payloads(payloads=list(request.input.args.payloads))),
                )
            )
            for suffix, body in (("accept", accept), ("complete", respond)):
                message_id = f"{update_id}/{suffix}"
                messages.append(Message(id=message_id, protocol_instance_id=update_id, body=body))
                commands.append(
                    Command(
                        command_type=CommandType.COMMAND_TYPE_PROTOCOL_MESSAGE,
                        protocol_message_command_attributes=ProtocolMessageCommandAttributes(
                            message_id=message_id
                        ),
                    )
                )
        await service.respond_workflow_task_completed(
            RespondWorkflowTaskCompletedRequest(
                namespace=client.namespace,
                task_token=task.task_token,
                identity="raw-test-worker",
                commands=commands,
                messages=messages,
            )
        )


def test_unprocessed_update_is_sent_again_under_the_same_id(address: str) -> None:
    async def scenario() -> tuple[str, list[str]]:
        client = await connect(connect_config(address))
        task_queue = f"raw-{uuid.uuid4().hex[:8]}"
        workflow_id = f"raw-{uuid.uuid4().hex[:8]}"
        seen: list[str] = []
        worker = asyncio.create_task(_raw_worker(client, task_queue, seen))
        try:
            await client.start_workflow("RawWorkflow", id=workflow_id, task_queue=task_queue)
            answer = await asyncio.wait_for(
                send_update(client, workflow_id, "echo", "hello", str), timeout=60
            )
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            await client.get_workflow_handle(workflow_id).terminate("test over")
        return answer, seen

    answer, seen = asyncio.run(scenario())
    assert answer == "hello"
    assert len(seen) == IGNORED_DELIVERIES + 1, seen
    assert len(set(seen)) == 1, f"sent again under other update ids: {seen}"


def test_an_answer_from_another_release_is_a_version_mismatch_not_a_pydantic_error(
    address: str,
) -> None:
    """A control worker of a newer release answers with a field this client does not know
    (seen in a soak whose control worker restarted onto newer code): the caller gets a typed
    error that says what to do, not a raw ValidationError."""

    async def scenario() -> BaseException | None:
        client = await connect(connect_config(address))
        task_queue = f"raw-{uuid.uuid4().hex[:8]}"
        workflow_id = f"raw-{uuid.uuid4().hex[:8]}"
        worker = asyncio.create_task(_raw_worker(client, task_queue, []))
        newer = {"valid": True, "released": True, "added_in_a_newer_release": "x"}
        try:
            await client.start_workflow("RawWorkflow", id=workflow_id, task_queue=task_queue)
            await asyncio.wait_for(
                send_update(client, workflow_id, "release_lease", newer, ReturnAnswer),
                timeout=60,
            )
        except Exception as err:  # the error itself is what is checked
            return err
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            await client.get_workflow_handle(workflow_id).terminate("test over")
        return None

    err = asyncio.run(scenario())
    assert isinstance(err, VersionMismatchError), repr(err)
    assert "added_in_a_newer_release" in str(err) and "upgrade" in str(err)
    assert "ReturnAnswer" in str(err)


def test_an_update_the_workflow_is_slow_to_take_is_sent_less_and_less_often(address: str) -> None:
    """Nothing takes the workflow's tasks for 8 s (a control plane past its capacity looks the
    same from here): each attempt that times out doubles the next one's time, so the update is
    sent a handful of times, not every quarter second (more RPCs the later the answer came)."""

    async def scenario() -> tuple[str, int, float]:
        client = await connect(connect_config(address))
        task_queue = f"raw-{uuid.uuid4().hex[:8]}"
        workflow_id = f"raw-{uuid.uuid4().hex[:8]}"
        service = client.workflow_service
        real = service.update_workflow_execution
        sent: list[float] = []

        async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            sent.append(asyncio.get_running_loop().time())
            return await real(*args, **kwargs)

        service.update_workflow_execution = counted  # type: ignore[method-assign]
        await client.start_workflow("RawWorkflow", id=workflow_id, task_queue=task_queue)
        seen: list[str] = []
        sending = asyncio.ensure_future(send_update(client, workflow_id, "echo", "late", str))
        try:
            await asyncio.sleep(8.0)  # no worker yet: every attempt times out
            before_worker = len(sent)
            worker = asyncio.create_task(_raw_worker(client, task_queue, seen))
            answer = await asyncio.wait_for(sending, timeout=60)
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        finally:
            await client.get_workflow_handle(workflow_id).terminate("test over")
        return answer, before_worker, sent[-1] - sent[0]

    answer, attempts, _ = asyncio.run(scenario())
    assert answer == "late"
    # 0.25 + 0.5 + 1 + 2 + 4 s of attempts and their pauses fill the 8 s: at most 6 (every
    # 0.25 s, with the pauses, was 15-20).
    assert attempts <= 6, f"{attempts} attempts in 8 s"
