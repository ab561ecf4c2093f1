"""JAX jobs time-slicing one group, their state moved by the jax backend, against the
session's Temporal dev server: two grpo-jax jobs under RLJobWorkflow (real `timeslice job
worker` processes), and the README's training loop through the client API.

The RL job of seed 7 also runs alone on a group of its own, at the same time, as the
reference: the time-sliced one must end with the very bytes of that one.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jax", reason="grpo-jax jobs need JAX: timeslice[jax]")
pytest.importorskip("optax", reason="grpo-jax jobs need optax: timeslice[jax]")

import numpy as np
from temporalio.client import Client
from timeslice.cli.stack import JobWorker, Stack
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import GroupStatus, group_workflow_id
from timeslice.protocol.rl_job import RLJobResult
from timeslice.snapshot.jax_backend import JaxBackend
from timeslice.transport.connection import connect, connect_config
from timeslice.workloads.base import JobSpec
from timeslice.workloads.grpo_jax import create

from tests.helpers import Interval, assert_no_overlap

EPOCHS = 6


def config(job: str, group: str, seed: int) -> dict[str, Any]:
    return {
        "job_id": job,
        "workload": "grpo-jax",
        "sampler_group": group,
        "epochs": EPOCHS,
        "batch_size": 8,
        "group_size": 4,
        "seed": seed,
        "checkpoint_every": 2,
    }


def run_jobs(address: str, configs: list[dict[str, Any]], group: str):
    async def go() -> tuple[list[RLJobResult], GroupStatus]:
        client: Client = await connect(connect_config(address))
        handles = [await start_rl_job(client, parse_job_config(c)) for c in configs]
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        status = await client.get_workflow_handle(group_workflow_id(group)).query(
            "status", result_type=GroupStatus
        )
        return results, status

    return asyncio.run(go())


def final_state(result: RLJobResult) -> dict[str, np.ndarray]:
    assert result.last_checkpoint is not None
    assert result.last_checkpoint.epochs_done == result.epochs_done == EPOCHS
    rank0 = Path(result.last_checkpoint.path) / "rank-0"
    state = {}
    for name in ("trainer.npz", "pending.npz"):
        with np.load(rank0 / name) as saved:
            state.update({f"{name}:{key}": saved[key] for key in saved.files})
    return state


def test_two_jax_jobs_time_slice_one_group_and_end_bit_identical_to_one_alone(
    address: str, stack: Stack, group: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    a, b, alone = f"ja-{tag}", f"jb-{tag}", f"jalone-{tag}"
    stack.job_workers(*(JobWorker((job,), "grpo-jax") for job in (a, b, alone)))
    results, status = run_jobs(
        address,
        [config(a, group, 7), config(b, group, 8), config(alone, f"g-{alone}", 7)],
        group,
    )
    for result in results:
        assert [r.epoch for r in result.records] == list(range(EPOCHS))
        assert result.rewinds == 0

    # No overlapping phases: the GPU phases' own monotonic-clock intervals on the shared group.
    holds = sorted(
        ((result.job_id, hold) for result in results[:2] for record in result.records
         for hold in record.holds if hold.group_id == group),
        key=lambda jh: jh[1].mono_start,
    )  # fmt: skip
    assert len(holds) == 2 * 2 * EPOCHS  # sample + train per epoch per job
    assert_no_overlap([Interval(job, h.token or 0, h.mono_start, h.mono_end) for job, h in holds])

    # Every switch moved the state: each phase that follows the other job's on the group began
    # by restoring, through the jax backend, the states it uses (a phase brings in its own
    # first, the job's others come in behind it): some of the bytes the same workload built
    # here registers for its whole state, never more (the two jobs' models are the same size).
    state_bytes = _state_bytes()
    used: set[str] = set()
    switches = checked = 0
    for (before, _), (job, hold) in itertools.pairwise(holds):
        if before != job:
            switches += 1
            if job in used:  # it ran here before, then the other job took the group
                assert {r.backend for r in hold.restored} == {"jax"}, hold
                assert 0 < sum(r.bytes for r in hold.restored) <= state_bytes, hold.restored
                checked += 1
        used.add(job)
    # Unchecked: at most each job's first phase (its state was built on the device).
    assert switches >= 4 and checked >= switches - 2, "the two jobs hardly took turns"
    assert status.stats.snapshot_failures == 0 and not status.faulted_jobs
    assert status.stats.bytes_moved > 0

    # Convergence untouched: job a, snapshotted and restored at every switch, ends with the
    # very parameters, optimizer state and rewards of the same job run alone.
    shared, reference = final_state(results[0]), final_state(results[2])
    assert set(shared) == set(reference)
    for key, array in reference.items():
        assert shared[key].dtype == array.dtype and shared[key].shape == array.shape, key
        assert shared[key].tobytes() == array.tobytes(), f"{key} differs"
    assert results[0].rewards == results[2].rewards
    assert results[1].rewards != results[0].rewards  # job b is another run, not a copy


def _state_bytes() -> int:
    workload = create()
    workload.setup(JobSpec("size", 7, batch_size=8, group_size=4))
    size = workload.state_bytes()
    assert size is not None
    return size


def test_the_readme_loop_trains_through_switches_like_a_loop_alone(group: str, make_client) -> None:
    """Two clients in one process share a group; each keeps its JAX state in jax-backend holders
    and trains only under a lease, as the README shows. Every turn of the other job evicts this
    one's arrays (deleted on the device) and the next grant restores them into the holders; the
    result is the very bytes of the same loop run without any switch."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(w: jax.Array, m: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        grad = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        m = 0.9 * m + grad
        return w - 0.01 * m, m

    def batch(i: int) -> jax.Array:
        return jax.random.normal(jax.random.key(i), (8, 16))

    def start() -> tuple[jax.Array, jax.Array]:
        return jax.random.normal(jax.random.key(0), (16, 16)), jnp.zeros((16, 16))

    alone_w, alone_m = start()
    backends, holders, clients = [], [], []
    for job in ("jax-a", "jax-b"):
        backend = JaxBackend()
        w, m = start()
        holders.append((backend.register("w", w), backend.register("m", m)))
        backends.append(backend)
        clients.append(make_client(job_id=f"{job}-{group}", snapshot_backends=[backend]))
    (w_a, m_a), _ = holders
    for i in range(4):
        for client, (w, m) in zip(clients, holders, strict=True):
            with client.on_accelerators(group_id=group):
                assert not w.evicted
                w.value, m.value = step(w.value, m.value, batch(i))
        assert w_a.evicted  # b took the group: a's arrays are off the device
        alone_w, alone_m = step(alone_w, alone_m, batch(i))
    with clients[0].on_accelerators(group_id=group):
        final_w, final_m = np.asarray(w_a.value), np.asarray(m_a.value)
    assert final_w.tobytes() == np.asarray(alone_w).tobytes()
    assert final_m.tobytes() == np.asarray(alone_m).tobytes()
    status = clients[0].group_status(group)
    assert status.stats.evictions >= 7 and status.stats.snapshot_failures == 0
