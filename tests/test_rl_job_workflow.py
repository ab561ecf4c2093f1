"""RLJobWorkflow in process, with its job process's activities mocked (as temporalio's samples
test their workflows), against the session's real dev server and a real group workflow.

The mocks answer as a one-rank job process does — a new order is "acquired" and released or
kept as the workflow asks — and record what the workflow handed them, so the test reads which
lease each phase ran under: the trainer lease carried into the next sample (and the order
asked ahead for it ended), the next sample asked ahead during a checkpoint, the trainer's
order asked for during the rewards, and the carry's expected length."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.activities.group_requests import draw_secret, renew_lease, request_group, start_group
from timeslice.protocol.group import GroupConfig, job_task_queue
from timeslice.protocol.rl_job import (
    CHECKPOINT_ACTIVITY,
    DESCRIBE_ACTIVITY,
    JOB_PROTOCOL_VERSION,
    PREPARE_ACTIVITY,
    REWARDS_ACTIVITY,
    RL_JOB_WORKFLOW_TYPE,
    SAMPLE_ACTIVITY,
    TRAIN_ACTIVITY,
    CheckpointInput,
    CheckpointRef,
    DescribeInput,
    DescribeResult,
    PhaseInput,
    PhaseResult,
    PrepareInput,
    PrepareResult,
    RLJobConfig,
    RLJobResult,
    rl_job_workflow_id,
)
from timeslice.transport.connection import connect, connect_config
from timeslice.workers.control import control_data_converter
from timeslice.workers.sandbox import workflow_runner
from timeslice.workflows.rl_job import RLJobWorkflow

# What the mocked sample phases take: the carry told to the group is their median so far.
SAMPLE_SECONDS = [3.0, 1.0, 2.0]


@dataclasses.dataclass
class MockJobProcess:
    """One rank's activities, answering as a job process would; what each got is kept."""

    prepared: list[PrepareInput] = dataclasses.field(default_factory=list)
    phases: list[PhaseInput] = dataclasses.field(default_factory=list)
    checkpoints: list[CheckpointInput] = dataclasses.field(default_factory=list)
    tokens: int = 100  # what the mocked group grants

    def granted(self, inp: PhaseInput) -> int | None:
        if inp.lease is None:
            return None
        if inp.lease.token is not None:  # carried, or the workflow's
            return inp.lease.token
        self.tokens += 1
        return self.tokens

    def activities(self) -> list[Any]:
        @activity.defn(name=DESCRIBE_ACTIVITY)
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
            self.prepared.append(inp)
            done = inp.checkpoint.epochs_done if inp.checkpoint else 0
            return PrepareResult(epochs_done=done, state_bytes=None)

        async def phase(inp: PhaseInput, seconds: float, metrics: dict[str, float]) -> PhaseResult:
            self.phases.append(inp)
            token = self.granted(inp)
            owned = inp.lease is not None and inp.lease.held_by == "process"
            released = owned and inp.release == "always"
            return PhaseResult(
                epoch=inp.epoch,
                phase=inp.phase,
                metrics=metrics,
                seconds=seconds,
                mono_start=0.0,
                mono_end=seconds,
                group_id=inp.group_id,
                token=token,
                request_id=inp.lease.request_id if inp.lease else None,
                waited_s=0.5 if owned and inp.lease and inp.lease.token is None else 0.0,
                released=released,
                # if_contended: nobody waits on the mocked group, so the lease is kept
                kept=owned and not released,
            )

        @activity.defn(name=SAMPLE_ACTIVITY)
        async def sample(inp: PhaseInput) -> PhaseResult:
            return await phase(inp, SAMPLE_SECONDS[inp.epoch], {})

        @activity.defn(name=REWARDS_ACTIVITY)
        async def compute_rewards(inp: PhaseInput) -> PhaseResult:
            return await phase(inp, 0.1, {"reward_mean": inp.epoch / 10})

        @activity.defn(name=TRAIN_ACTIVITY)
        async def train(inp: PhaseInput) -> PhaseResult:
            return await phase(inp, 0.2, {"loss": 1.0})

        @activity.defn(name=CHECKPOINT_ACTIVITY)
        async def save_checkpoint(inp: CheckpointInput) -> CheckpointRef:
            self.checkpoints.append(inp)
            return CheckpointRef(epochs_done=inp.epochs_done, path=f"/mock/{inp.epochs_done}")

        return [describe, prepare, sample, compute_rewards, train, save_checkpoint]

    def of(self, phase: str) -> list[PhaseInput]:
        return [p for p in self.phases if p.phase == phase]


async def run_job(client: Client, config: RLJobConfig, process: MockJobProcess) -> RLJobResult:
    queue = f"rl-job-in-process-{uuid.uuid4().hex[:8]}"
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
            workflows=[RLJobWorkflow],
            # the workflow's local activities run on its own worker
            activities=[request_group, draw_secret, renew_lease],
            workflow_runner=workflow_runner(),
        ),
        Worker(
            client, task_queue=job_task_queue(config.job_id, 0), activities=process.activities()
        ),
    ):
        handle = await client.start_workflow(
            RL_JOB_WORKFLOW_TYPE,
            config.model_dump(mode="json"),
            id=rl_job_workflow_id(config.job_id),
            task_queue=queue,
        )
        raw = await asyncio.wait_for(handle.result(), timeout=120)
    return RLJobResult.model_validate(raw)


def test_an_epochs_leases_are_carried_asked_ahead_and_checkpointed(address: str, group: str):
    config = RLJobConfig(
        job_id=f"inproc-{uuid.uuid4().hex[:8]}",
        workload="simulated",
        sampler_group=group,
        epochs=3,
        checkpoint_every=2,
    )
    process = MockJobProcess()

    async def main() -> RLJobResult:
        client = await connect(connect_config(address))
        await start_group(client, GroupConfig(group_id=group))
        return await run_job(client, config, process)

    result = asyncio.run(main())

    assert (result.epochs_done, result.stopped) == (3, False)
    assert result.last_checkpoint == CheckpointRef(epochs_done=3, path="/mock/3")
    assert result.rewards == [0.0, 0.1, 0.2]

    # Prepared under the workflow's own lease on the group, checkpointed there (epoch 0).
    (prepared,) = process.prepared
    (held,) = prepared.leases
    assert (held.group_id, held.held_by) == (group, "workflow") and held.token is not None
    assert prepared.lease_keys == {group: held.key}

    samples, rewards, trains = process.of("sample"), process.of("rewards"), process.of("train")
    assert [s.release for s in samples] == ["always"] * 3
    # Epoch 0's train: nothing due, the next sample on the same group: kept unless contended,
    # the group told the sample's expected length (the median so far), the sample asked ahead.
    # Epochs 1 and 2: a checkpoint is due, so the lease is kept for it.
    assert [t.release for t in trains] == ["if_contended", "never", "never"]
    assert trains[0].carry_into is not None and trains[0].carry_into.expected_s == 3.0
    assert [t.carry_into for t in trains[1:]] == [None, None]
    asked_ahead = trains[0].prefetch
    assert asked_ahead is not None and asked_ahead.token is None
    assert [t.prefetch for t in trains[1:]] == [None, None]
    # The trainer's order is asked for during the rewards, and train runs under it.
    assert [r.prefetch for r in rewards] == [t.lease for t in trains]
    assert all(r.lease is None for r in rewards)

    # Epoch 1 samples under epoch 0's kept trainer lease (its token), not the order asked
    # ahead (which the workflow took back from the group); its wait is 0.
    assert samples[0].lease is not None and samples[0].lease.token is None
    carried = samples[1].lease
    assert carried is not None and trains[0].lease is not None
    assert carried.request_id == trains[0].lease.request_id
    assert carried.token == 102  # granted to epoch 0's train
    assert carried.request_id != asked_ahead.request_id
    assert [r.wait_s.get("sample") for r in result.records] == [0.5, 0.0, 0.5]

    # The checkpoints: epoch 0 under the workflow's lease; after epochs 2 and 3 under the
    # trainer's kept lease, which the process releases, the first asking ahead for epoch 2's
    # sample — which epoch 2 then runs under.
    ckpt = [
        (c.epochs_done, c.lease.held_by if c.lease else None, c.release)
        for c in process.checkpoints
    ]
    assert ckpt == [(0, "workflow", False), (2, "process", True), (3, "process", True)]
    assert process.checkpoints[1].lease == trains[1].lease.model_copy(update={"token": 103})  # type: ignore[union-attr]
    ahead_of_2 = process.checkpoints[1].prefetch
    assert ahead_of_2 is not None and samples[2].lease == ahead_of_2
    assert process.checkpoints[2].prefetch is None
