"""hf-grpo: grpo-toy's GRPO on the locally made transformers policy, as an RLJobWorkflow.

The job runs in a real `timeslice job worker` process against the session's dev server; the
reference is the same workload driven phase by phase in this process.
"""

from __future__ import annotations

import asyncio
import importlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import start_service, stop_process
from tests.helpers import skip_unless_installed

skip_unless_installed("torch", "transformers")

import torch  # noqa: E402
from timeslice.jobs import parse_job_config, start_rl_job  # noqa: E402
from timeslice.protocol.rl_job import RLJobResult  # noqa: E402
from timeslice.transport.connection import connect, connect_config  # noqa: E402
from timeslice.workloads.base import JobSpec, PhaseContext  # noqa: E402
from timeslice.workloads.registry import load_workload  # noqa: E402


# The workload's modules, imported by the first test that uses them, not when the tests are
# collected (transformers: ~6 s of CPU in every pytest worker).
def hf_grpo() -> ModuleType:
    return importlib.import_module("timeslice.workloads.hf_grpo")


def hf_tiny() -> ModuleType:
    return importlib.import_module("timeslice.workloads.hf_tiny")


EPOCHS = 6
#: The learning test's bar: mean reward of the last 4 of 16 epochs minus that of the first 4.
#: Seeds 0 and 1 measure +0.22 and +0.23 (from about 0.13); runs are deterministic.
REWARD_RISE = 0.1


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The job process runs torch on one thread (--threads 1): so does the in-process
    reference, so both do the same arithmetic in the same order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_epochs(w: Any, epochs: int) -> list[float]:
    rewards = []
    for e in range(epochs):
        w.sample(e, PhaseContext(e, "sample"))
        rewards.append(w.compute_rewards(e, PhaseContext(e, "rewards"))["reward_mean"])
        w.train(e, PhaseContext(e, "train"))
    return rewards


def spec(seed: int, **options: Any) -> JobSpec:
    return JobSpec(job_id=f"hf-{seed}", seed=seed, batch_size=8, group_size=4, options=options)


def test_tokenizer_numbers_tokens_as_grpo_toy_and_round_trips() -> None:
    tokenizer = hf_tiny().build_tokenizer()
    task = hf_tiny().DigitTask("sort", 4)
    prompt = task.prompt([3, 1, 4, 2])
    ids = tokenizer(prompt)["input_ids"]
    assert ids == [10, 3, 1, 4, 2, 11]  # grpo-toy's BOS, digits, SEP
    assert tokenizer.decode(ids) == prompt == "^3142="
    eos = hf_tiny().vocabulary()["<eos>"]
    assert tokenizer.decode([1, 2, 3, 4, eos], skip_special_tokens=True) == "1234"
    assert task.score("1234", task.target([3, 1, 4, 2])) == 1.0
    assert task.score("12", "1234") == 0.5


def test_hf_grpo_checks_its_options() -> None:
    w = hf_grpo().create()
    with pytest.raises(ValueError, match="hf-grpo: option 'sampler'"):
        w.setup(spec(0, sampler="tensorrt"))
    with pytest.raises(ValueError, match="hf-grpo: option 'digits' must be 10"):
        w.setup(spec(0, digits=8))
    with pytest.raises(ValueError, match="hf-grpo: unknown option"):
        w.setup(spec(0, hidden=64))
    if not hf_grpo().vllm_available():
        with pytest.raises(ValueError, match="needs vLLM and a CUDA device"):
            w.setup(spec(0, sampler="vllm"))
    w.setup(spec(0))
    assert w.sampler_kind == ("vllm" if hf_grpo().vllm_available() else "torch")
    assert isinstance(load_workload("hf-grpo"), hf_grpo().HfGrpoWorkload)


def test_hf_grpo_learns_the_digit_task(one_thread: None) -> None:
    w = hf_grpo().create()
    w.setup(JobSpec(job_id="learn", seed=0, batch_size=16, group_size=8, options={}))
    rewards = run_epochs(w, 16)
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last - first >= REWARD_RISE, rewards


def test_hf_grpo_runs_as_an_rl_job_workflow(
    address: str, group: str, tmp_path: Path, one_thread: None
) -> None:
    job = f"hf-{uuid.uuid4().hex[:8]}"
    proc = start_service(
        [
            "job", "worker", "--address", address, "--job-id", job, "--workload", "hf-grpo",
            "--checkpoint-dir", str(tmp_path), "--threads", "1",
        ],
        f"job {job} rank 0",
        tmp_path / "worker.log",
    )  # fmt: skip
    config = {
        "job_id": job,
        "workload": "hf-grpo",
        "sampler_group": group,
        "epochs": EPOCHS,
        "batch_size": 8,
        "group_size": 4,
        "seed": 5,
        "checkpoint_every": 4,
        "workload_options": {"sampler": "torch"},
    }

    async def go() -> RLJobResult:
        client = await connect(connect_config(address))
        handle = await start_rl_job(client, parse_job_config(config))
        return await handle.result()

    try:
        result = asyncio.run(go())
    finally:
        stop_process(proc)
    assert [r.epoch for r in result.records] == list(range(EPOCHS))
    assert result.epochs_done == EPOCHS and result.rewinds == 0
    assert all(r.reward_mean is not None for r in result.records)
    assert {h.phase for r in result.records for h in r.holds} == {"sample", "train"}

    # The job's final checkpoint holds exactly the state of the same workload run here.
    reference = hf_grpo().create()
    reference.setup(spec(5, sampler="torch"))
    rewards = run_epochs(reference, EPOCHS)
    assert [r.reward_mean for r in result.records] == rewards
    assert result.last_checkpoint is not None
    saved = torch.load(Path(result.last_checkpoint.path) / "rank-0" / "trainer.pt")
    assert any(k.startswith("lm.model.layers.") for k in saved["policy"])  # the HF model
    for key, tensor in reference.policy.state_dict().items():
        assert torch.equal(saved["policy"][key], tensor), key
    for p, state in zip(reference.policy.parameters(), saved["optimizer"], strict=True):
        for key, tensor in reference.optimizer.state[p].items():
            assert torch.equal(state[key], tensor), key
