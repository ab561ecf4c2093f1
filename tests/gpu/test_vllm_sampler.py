"""hf-grpo with the vLLM sampler, on a real GPU (skipped without CUDA or without vLLM).

The policy is the locally made tiny Qwen2 (no download); the engine is built from it saved in
Hub format. Checks: the engine samples digits only, it holds the trainer's latest weights after
each epoch's sync, the `vllm` backend puts it to sleep and wakes it between epochs (device
memory released and sampling intact), and the job learns.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from timeslice.snapshot.base import SnapshotRequest  # noqa: E402
from timeslice.snapshot.vllm_backend import VllmSleepBackend  # noqa: E402
from timeslice.workloads.base import JobSpec, PhaseContext  # noqa: E402
from timeslice.workloads.hf_grpo import create  # noqa: E402


def _embedding_sum(worker: Any) -> float:
    """Run on the vLLM worker: a checksum of its model's token embedding."""
    for name, param in worker.model_runner.model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            return float(param.detach().float().sum().item())
    raise AssertionError("the engine's model has no embed_tokens.weight")


def test_vllm_sampler_syncs_weights_sleeps_and_learns() -> None:
    w = create()
    spec = JobSpec(
        job_id="vllm-sampler",
        seed=0,
        batch_size=16,
        group_size=8,
        options={"sampler": "vllm", "device": "cuda"},
    )
    w.setup(spec)
    assert w.sampler_kind == "vllm"
    backend = w.snapshot_backends()["sampler"]
    assert isinstance(backend, VllmSleepBackend)

    rewards = []
    sample_s = []
    for e in range(12):
        started = time.perf_counter()
        w.sample(e, PhaseContext(e, "sample"))
        sample_s.append(time.perf_counter() - started)
        ro = w._rollout
        assert ro is not None and ro.completions.shape == (16 * 8, w.opts.seq_len)
        assert int(ro.completions.min()) >= 0 and int(ro.completions.max()) <= 9  # digits only
        rewards.append(w.compute_rewards(e, PhaseContext(e, "rewards"))["reward_mean"])
        w.train(e, PhaseContext(e, "train"))
        if e % 4 == 3:  # a switch: the engine sleeps (weights to host memory) and wakes
            moved = asyncio.run(backend.snapshot(SnapshotRequest(spec.job_id)))
            assert moved.bytes > 0
            asyncio.run(backend.restore(SnapshotRequest(spec.job_id)))

    # After the next sync the engine holds the trainer's weights (cast to the engine's dtype).
    w._sync_engine()
    engine_sums = w._llm.collective_rpc(_embedding_sum)
    want = float(w.pending["lm.model.embed_tokens.weight"].to(torch.bfloat16).float().sum())
    assert all(abs(s - want) <= 1e-3 * max(1.0, abs(want)) for s in engine_sums)

    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(
        f"vllm sampler: rewards {first:.3f} -> {last:.3f}; sample phase "
        f"p50 {sorted(sample_s)[len(sample_s) // 2]:.3f} s (incl. the weight sync)"
    )
    assert last > first
