"""An async job takes no field of an activity result it did not check (issue 36).

Anything that polls a job's task queue can answer its activities. An ``async_sample`` result
whose ``weights_version`` was below 0 or past what the trainer had published failed the
``AsyncRLJobWorkflow``'s *task* on every replay (a batch the pipeline's models refuse, a
negative staleness), and the job hung. Here the job's process is mocked in-process (as
temporalio's samples test workflows), against the session's real dev server and a real group:
each attempt's result carries one bad field, and the job rewinds past every one of them and
completes — or, allowed no failure, fails once — and no workflow task of it ever failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.worker import Worker
from timeslice.activities.group_requests import draw_secret, renew_lease, request_group
from timeslice.protocol.async_rl_job import (
    ASYNC_DESCRIBE_ACTIVITY,
    ASYNC_RL_JOB_WORKFLOW_TYPE,
    ASYNC_SAMPLE_ACTIVITY,
    ASYNC_SCORE_ACTIVITY,
    ASYNC_TRAIN_ACTIVITY,
    AsyncPhaseInput,
    AsyncPhaseResult,
    AsyncRLJobConfig,
    AsyncRLJobResult,
)
from timeslice.protocol.group import job_task_queue
from timeslice.protocol.rl_job import (
    CHECKPOINT_ACTIVITY,
    JOB_PROTOCOL_VERSION,
    PREPARE_ACTIVITY,
    CheckpointInput,
    CheckpointRef,
    DescribeInput,
    DescribeResult,
    PhaseResult,
    PrepareInput,
    PrepareResult,
    rl_job_workflow_id,
)
from timeslice.transport.connection import connect, connect_config
from timeslice.workers.control import control_data_converter
from timeslice.workers.sandbox import workflow_runner
from timeslice.workflows.async_rl_job import AsyncRLJobWorkflow

Spoil = Callable[[AsyncPhaseResult], AsyncPhaseResult]


def _with(**fields: Any) -> Spoil:
    return lambda result: result.model_copy(update=fields)


def _with_phase(**fields: Any) -> Spoil:
    return lambda result: result.model_copy(
        update={"phase": result.phase.model_copy(update=fields)}
    )


# (the activity whose next result is spoilt, and of which step or batch (None: the next),
# how, and what the job says about it)
BAD_FIELDS: list[tuple[str, int | None, Spoil, str]] = [
    ("sample", None, _with(weights_version=-1), "weights_version -1 is outside 0..0"),
    ("sample", None, _with(weights_version=7), "weights_version 7 is outside 0..0"),
    ("sample", None, _with(batch=999), "batch 999 is not the batch"),
    ("sample", None, _with(load_bytes=-5), "load_bytes -5 is not a size"),
    ("sample", None, _with(load_s=-1.0), "load_s -1.0 is not a time"),
    ("sample", None, _with(published_version=3), "published_version 3 is set"),
    ("sample", None, _with_phase(seconds=-2.0), "phase.seconds -2.0 is not a time"),
    ("rewards", None, _with_phase(epoch=42), "reports rewards 42"),
    ("train", None, _with(published_version=9), "published_version 9 is not the 1"),
    ("train", None, _with_phase(phase="sample"), "reports sample 0, not the train 0"),
    # Step 1, after step 0 was trained: the rewind undoes step 0, which no longer counts.
    ("train", 1, _with(sync_bytes=-1), "sync_bytes -1 is not a size"),
]


@dataclasses.dataclass
class SpoilingProcess:
    """A job process's async activities, answering as one would, except that the next result
    of each activity named in ``spoil`` (consumed in order) carries a bad field."""

    spoil: list[tuple[str, int | None, Spoil, str]]
    tokens: int = 100

    def _answer(self, phase: str, inp: AsyncPhaseInput, result: AsyncPhaseResult) -> Any:
        if self.spoil and self.spoil[0][0] == phase and self.spoil[0][1] in (None, inp.phase.epoch):
            _, _, spoil, _ = self.spoil.pop(0)
            result = spoil(result)
        # As the worker's converter would send it, unchecked (a rogue poller's answer).
        return result.model_dump(mode="json")

    def _phase(self, inp: AsyncPhaseInput, name: str) -> PhaseResult:
        lease = inp.phase.lease
        token = None
        if lease is not None:
            self.tokens += 1
            token = lease.token if lease.token is not None else self.tokens
        owned = lease is not None and lease.held_by == "process"
        return PhaseResult(
            epoch=inp.phase.epoch,
            phase=name,  # type: ignore[arg-type]
            metrics={"reward_mean": 0.5} if name == "rewards" else {},
            seconds=0.01,
            mono_start=0.0,
            mono_end=0.01,
            group_id=inp.phase.group_id,
            token=token,
            request_id=lease.request_id if lease else None,
            released=owned and inp.phase.release == "always",
            kept=owned and inp.phase.release != "always",
        )

    def activities(self) -> list[Any]:
        @activity.defn(name=ASYNC_DESCRIBE_ACTIVITY)
        async def describe(inp: DescribeInput) -> DescribeResult:
            return DescribeResult(
                workload="simulated",
                sampler_backends=[],
                trainer_backends=[],
                epochs_done=None,
                protocol=JOB_PROTOCOL_VERSION,
            )

        @activity.defn(name=PREPARE_ACTIVITY)
        async def prepare(inp: PrepareInput) -> PrepareResult:
            done = inp.checkpoint.epochs_done if inp.checkpoint else 0
            return PrepareResult(epochs_done=done, state_bytes=None)

        @activity.defn(name=ASYNC_SAMPLE_ACTIVITY)
        async def sample(inp: AsyncPhaseInput) -> Any:
            honest = AsyncPhaseResult(
                phase=self._phase(inp, "sample"),
                batch=inp.batch,
                weights_version=inp.weights_version,
            )
            return self._answer("sample", inp, honest)

        @activity.defn(name=ASYNC_SCORE_ACTIVITY)
        async def score(inp: AsyncPhaseInput) -> Any:
            honest = AsyncPhaseResult(phase=self._phase(inp, "rewards"), batch=inp.batch)
            return self._answer("rewards", inp, honest)

        @activity.defn(name=ASYNC_TRAIN_ACTIVITY)
        async def train(inp: AsyncPhaseInput) -> Any:
            honest = AsyncPhaseResult(
                phase=self._phase(inp, "train"),
                batch=inp.batch,
                published_version=inp.publish_version,
            )
            return self._answer("train", inp, honest)

        @activity.defn(name=CHECKPOINT_ACTIVITY)
        async def save_checkpoint(inp: CheckpointInput) -> CheckpointRef:
            return CheckpointRef(epochs_done=inp.epochs_done, path=f"/mock/{inp.epochs_done}")

        return [describe, prepare, sample, score, train, save_checkpoint]


async def _run(address: str, config: AsyncRLJobConfig, process: SpoilingProcess) -> Any:
    """The job's result (or its failure) and whether any of its workflow tasks failed."""
    client = await connect(connect_config(address))
    queue = f"async-in-process-{uuid.uuid4().hex[:8]}"
    workflow_client = Client(
        **{
            **client.config(),
            "data_converter": control_data_converter(client.config()["data_converter"]),
        }
    )
    async with (
        Worker(
            workflow_client,
            task_queue=queue,
            workflows=[AsyncRLJobWorkflow],
            activities=[request_group, draw_secret, renew_lease],
            workflow_runner=workflow_runner(),
        ),
        Worker(client, task_queue=job_task_queue(config.job_id), activities=process.activities()),
    ):
        handle: WorkflowHandle[Any, Any] = await client.start_workflow(
            ASYNC_RL_JOB_WORKFLOW_TYPE,
            config.model_dump(mode="json"),
            id=rl_job_workflow_id(config.job_id),
            task_queue=queue,
        )
        try:
            outcome: Any = AsyncRLJobResult.model_validate(
                await asyncio.wait_for(handle.result(), timeout=120)
            )
        except WorkflowFailureError as err:
            outcome = err
        task_failures = [
            e
            async for e in handle.fetch_history_events()
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        ]
    return outcome, task_failures


def _config(group: str, max_failures: int) -> AsyncRLJobConfig:
    return AsyncRLJobConfig(
        job_id=f"spoilt-{uuid.uuid4().hex[:8]}",
        workload="simulated",
        sampler_group=group,
        trainer_group=f"{group}-t",
        epochs=2,
        max_staleness=0,
        max_failures=max_failures,
    )


def test_every_bad_field_of_an_async_result_costs_a_rewind_never_a_wedge(
    address: str, group: str
) -> None:
    process = SpoilingProcess(spoil=list(BAD_FIELDS))
    config = _config(group, max_failures=len(BAD_FIELDS))
    result, task_failures = asyncio.run(_run(address, config, process))
    assert task_failures == []
    assert isinstance(result, AsyncRLJobResult), result
    assert process.spoil == []  # every spoilt result was sent ...
    assert result.epochs_done == 2 and result.rewinds == len(BAD_FIELDS)  # ... and cost a rewind
    # Two steps count, each at staleness 0; step 0 was trained twice, and the rewind to the
    # checkpoint before it undid the first (it used to count both: [3]).
    assert result.staleness_counts == [2]


def test_allowed_no_failure_the_job_fails_once_saying_what_was_wrong(
    address: str, group: str
) -> None:
    bad = BAD_FIELDS[0]
    process = SpoilingProcess(spoil=[bad])
    failure, task_failures = asyncio.run(_run(address, _config(group, max_failures=0), process))
    assert task_failures == []
    assert isinstance(failure, WorkflowFailureError), failure
    message = str(failure.cause)
    assert "JobFailed" in repr(failure.cause) or "failed 1 times" in message
    assert bad[3] in message and "InvalidResult" in message
