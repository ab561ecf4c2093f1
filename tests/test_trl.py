"""TRL's GRPOTrainer time-sliced by ``timeslice.integrations.trl``: real TRL, real processes.

The jobs are ``examples/trl_grpo.py`` (plain TRL plus the integration's two lines) run as
separate processes against the session's dev server and control worker; the reference run is
the same script without ``--group``: plain TRL, no Temporal at all.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import os
import subprocess
import sys
import threading
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import (
    REPO,
    Interval,
    assert_no_overlap,
    finish,
    skip_unless_installed,
    wait_for,
)

skip_unless_installed("torch", "trl")
# Two TRL trainers time-sliced and one alone (its fixture: ~85 s on two cores): `make test-long`.
pytestmark = pytest.mark.long

import torch  # noqa: E402
from timeslice import TimeSliceOrchestratorClient  # noqa: E402
from timeslice.snapshot.base import SnapshotRequest  # noqa: E402


def trl_integration() -> ModuleType:
    """timeslice.integrations.trl, imported by the first test that uses it, not when the tests
    are collected (TRL and transformers: ~8 s of CPU in every pytest worker)."""
    return importlib.import_module("timeslice.integrations.trl")


EXAMPLE = REPO / "examples" / "trl_grpo.py"
#: Optimizer steps per job: 12 generations of 16 prompts x 8 completions, 4 steps each.
STEPS = 48
#: Mean reward of the last 3 generations minus that of the first 3. Measured with seeds 0 and
#: 1: +0.13 and +0.08 (from 0.08 and 0.07); runs are deterministic, the margin is for other CPUs'
#: arithmetic.
REWARD_RISE = 0.04


@dataclass
class Run:
    name: str
    report: dict[str, Any]
    weights: dict[str, torch.Tensor]


def start_example(address: str, tmp: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": address,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        str(STEPS),
        "--report",
        str(tmp / f"{name}.json"),
        "--save",
        str(tmp / f"{name}.pt"),
        *args,
    ]
    with (tmp / f"{name}.log").open("wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def load_run(tmp: Path, name: str) -> Run:
    return Run(
        name,
        json.loads((tmp / f"{name}.json").read_text()),
        torch.load(tmp / f"{name}.pt", weights_only=True),
    )


@pytest.fixture(scope="module")
def trl_runs(server: Any, worker: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Jobs a (seed 0) and b (seed 1) time-sliced on one group, and plain TRL with seed 0
    alone, all three at once; then the group's status."""
    tmp = tmp_path_factory.mktemp("trl")
    group = f"trl-{uuid.uuid4().hex[:8]}"
    jobs = {"a": f"trl-a-{uuid.uuid4().hex[:6]}", "b": f"trl-b-{uuid.uuid4().hex[:6]}"}
    procs = [
        start_example(server.address, tmp, "a", "--group", group, "--job-id", jobs["a"]),
        start_example(
            server.address, tmp, "b", "--group", group, "--job-id", jobs["b"], "--seed", "1"
        ),
        start_example(server.address, tmp, "alone"),
    ]
    try:
        finish(procs, timeout=540)
    except AssertionError:
        for name in ("a", "b", "alone"):
            tail = (tmp / f"{name}.log").read_text(errors="replace")[-3000:]
            print(f"--- {name}.log (tail)\n{tail}")
        raise
    with TimeSliceOrchestratorClient(target=server.address) as client:
        status = client.group_status(group)
    yield {name: load_run(tmp, name) for name in ("a", "b", "alone")}, status, jobs


def intervals(run: Run) -> list[Interval]:
    return [
        Interval(run.report["job_id"], p["token"], p["start"], p["end"])
        for p in run.report["phases"]
    ]


def test_two_trl_jobs_share_one_group_without_overlapping_gpu_phases(trl_runs: Any) -> None:
    runs, status, jobs = trl_runs
    a, b = runs["a"], runs["b"]
    assert a.report["job_id"] == jobs["a"] and b.report["job_id"] == jobs["b"]
    for run in (a, b):
        kinds = {p["phase"] for p in run.report["phases"]}
        assert {"generate", "train"} <= kinds, f"{run.name}: phases {kinds}"
        assert {p["group_id"] for p in run.report["phases"]} == {status.group_id}
    merged = intervals(a) + intervals(b)
    assert_no_overlap(merged)  # the phases' own monotonic-clock intervals, across processes
    ordered = [i.job for i in sorted(merged, key=lambda i: i.start)]
    handoffs = sum(1 for x, y in itertools.pairwise(ordered) if x != y)
    assert handoffs >= 6, f"the jobs hardly took turns ({handoffs} hand-offs): not time-sliced"
    assert status.holder is None and not status.queue
    assert status.stats.bytes_moved > 0 and status.stats.evictions >= 2


def test_status_report_and_plan_profile_agree_and_draw_a_lane_per_job(
    trl_runs: Any, server: Any, tmp_path: Path
) -> None:
    """The TRL jobs report their GPU phases with each release: the report draws a lane per job
    and its phase share is below its lease share; `timeslice status`, `timeslice report` and
    `timeslice plan profile --group` print one utilization while jobs ran (issue 25)."""
    from timeslice.report import collect_report
    from timeslice.transport.connection import connect, connect_config

    from tests.test_status_utilization import assert_json_says_the_report, figures, timeslice

    _, status, jobs = trl_runs
    group = status.group_id
    for job in jobs.values():
        mine = [r for r in status.history if r.job_id == job]
        assert mine and all(r.phases is not None for r in mine), job
        assert any(r.phases for r in mine), job

    async def read() -> Any:
        client = await connect(connect_config(server.address))
        return await collect_report(client, groups=[group], jobs=list(jobs.values()))

    report = asyncio.run(read())
    lanes = {lane.name: lane for lane in report.lanes if lane.kind == "job"}
    for job in jobs.values():
        assert lanes[job].spans and {s.kind for s in lanes[job].spans} == {"phase"}, job
    (g,) = report.groups
    assert 0 < g.utilization < g.fraction(g.phase_s + g.overhead_s)

    address = ["--address", server.address]
    # The JSON's utilization is the report's GPU-phase figure; the share of the group's life
    # it was held is held_share, and above it (the leases' overhead: 74.8 against 65.1 % once).
    as_json = json.loads(timeslice("status", group, "--json", *address))
    assert 0 < as_json["utilization"] < as_json["held_share"], as_json
    assert as_json["utilization"] * as_json["wall_s"] == pytest.approx(g.phase_s, abs=1e-3)
    assert as_json["utilization_while_jobs_ran"] == pytest.approx(g.while_jobs_ran.share)
    said = {
        "status": figures(timeslice("status", group, *address), group),
        "report": figures(
            timeslice("report", "--group", group, "--job", jobs["a"], "--job", jobs["b"],
                      "--text-only", *address),
            group,
        ),
        "plan profile": figures(
            timeslice("plan", "profile", jobs["a"], "--group", group, "--out", str(tmp_path),
                      *address),
            group,
        ),
    }  # fmt: skip
    ran = [share for share, _ in (f["while jobs ran"] for f in said.values())]
    assert max(ran) - min(ran) <= 0.5, said
    assert_json_says_the_report(as_json, said["report"])


def test_every_switch_moved_the_state_out_and_back(trl_runs: Any) -> None:
    """Each hand-off from one job to the other evicted the first (no memory_bytes declared:
    strictly evict, then restore), and everything evicted came back before its next use."""
    runs, _, _ = trl_runs
    a, b = runs["a"], runs["b"]
    merged = sorted(
        [(run.name, p) for run in (a, b) for p in run.report["phases"]],
        key=lambda item: item[1]["start"],
    )
    last_end = {run.name: max(p["end"] for p in run.report["phases"]) for run in (a, b)}
    # A hand-off after a job's very last phase needs no move: the job is leaving the group.
    expected = {"a": 0, "b": 0}
    for (job, phase), (nxt, _) in itertools.pairwise(merged):
        if job != nxt and phase["end"] != last_end[job]:
            expected[job] += 1
    for run in (a, b):
        assert run.report["snapshots"] == expected[run.name] >= 3, (run.name, expected)
        assert run.report["restores"] == run.report["snapshots"], run.name
        assert run.report["bytes_moved"] > 0


def test_both_trl_jobs_reward_rises(trl_runs: Any) -> None:
    runs, _, _ = trl_runs
    for name in ("a", "b"):
        rewards = runs[name].report["rewards"]
        assert len(rewards) == STEPS // 4  # one generation per 4 optimizer steps
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        assert last - first >= REWARD_RISE, f"{name}: rewards {rewards}"


def test_time_sliced_trl_job_ends_bit_identical_to_plain_trl_alone(trl_runs: Any) -> None:
    """Same seed: job a (time-sliced, its state moved out and back at every switch) and plain
    TRL without Temporal end with the very same weights, and took the same path there."""
    runs, _, _ = trl_runs
    a, alone = runs["a"], runs["alone"]
    assert a.report["snapshots"] >= 3
    assert "phases" not in alone.report  # the reference never touched the integration
    assert a.report["losses"] == alone.report["losses"]
    assert a.report["rewards"] == alone.report["rewards"]
    assert set(a.weights) == set(alone.weights)
    for name, tensor in alone.weights.items():
        assert torch.equal(a.weights[name], tensor), f"{name} differs"


# ---------------------------------------------------------------------------- versions


def test_trl_version_range_is_the_extras_pin() -> None:
    for ok in ("1.16.0", "1.16.7"):
        trl_integration().check_trl_version(ok)
    for bad in ("1.15.0", "1.17.0", "0.29.1", "2.0", "not-a-version"):
        with pytest.raises(
            trl_integration().UnsupportedTRLError, match=r"supports TRL >=1\.16,<1\.17"
        ):
            trl_integration().check_trl_version(bad)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert f"trl{trl_integration().TRL_SPECIFIER}" in extras["trl"]


def test_an_unsupported_trl_release_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    """A real TRL release outside the range, installed beside the supported one and found
    first on the path: importing the integration names the range and how to install it."""
    target = tmp_path / "old-trl"
    install = ["install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    pip = subprocess.run(
        [sys.executable, "-m", "pip", *install, "--target", str(target), "trl==1.15.0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if pip.returncode != 0:
        pytest.skip(f"cannot install trl 1.15.0 here (no package index?): {pip.stderr[-500:]}")
    probe = subprocess.run(
        [sys.executable, "-c", "import timeslice.integrations.trl"],
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode != 0
    assert "UnsupportedTRLError" in probe.stderr
    assert "supports TRL >=1.16,<1.17" in probe.stderr
    assert "this environment has trl 1.15.0" in probe.stderr
    assert "pip install 'timeslice[trl]'" in probe.stderr


# ---------------------------------------------------------------------------- what moves


def tiny_trainer(tmp: Path, **config: Any) -> Any:
    from datasets import Dataset
    from timeslice.workloads.hf_tiny import (
        DigitTask,
        build_model,
        build_tokenizer,
        reward_function,
    )
    from trl import GRPOConfig, GRPOTrainer

    task = DigitTask()
    peft_config = config.pop("peft_config", None)
    model = build_model(0)
    if config.get("beta"):
        # TRL builds the reference model from the policy's path: save it, and load from there.
        from timeslice.workloads.hf_tiny import save_pretrained
        from transformers import AutoModelForCausalLM

        path = save_pretrained(tmp / "policy", model, build_tokenizer())
        model = AutoModelForCausalLM.from_pretrained(path)
    args = GRPOConfig(
        output_dir=str(tmp),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=5,
        max_steps=2,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_function(task),
        args=args,
        train_dataset=Dataset.from_list(task.rows(64, 0)),
        processing_class=build_tokenizer(),
        peft_config=peft_config,
    )


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_lora_only_moves_the_adapters_and_optimizer_state(
    address: str, group: str, tmp_path: Path
) -> None:
    """With PEFT the frozen base stays on the device; the LoRA weights and Adam's moments
    (registered after the first step) move, and come back bit for bit."""
    from peft import LoraConfig

    trainer = tiny_trainer(
        tmp_path, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    slicing = trl_integration().time_slice(trainer, group=group, target=address)
    assert slicing.lora_only
    trainer.train()
    model = trainer.model
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert lora and all("lora_" in n for n in lora) and base
    selected = slicing.backend.selected_names()
    assert {f"policy.{n}" for n in lora} <= set(selected)
    optimizer_state = [n for n in selected if n.startswith("optimizer.state.")]
    assert len(optimizer_state) == 3 * len(lora)  # step, exp_avg, exp_avg_sq per adapter weight
    assert not any(n.removeprefix("policy.") in base for n in selected)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = slicing.backend.snapshot_sync(SnapshotRequest("lora-test"))
    assert all(storage_bytes(p) == 0 for p in lora.values())
    assert all(storage_bytes(p) > 0 for p in base.values())
    assert report.bytes == slicing.backend.registered_bytes > 0
    slicing.backend.restore_sync(SnapshotRequest("lora-test"))
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name


def test_reference_model_is_registered_and_groups_apart_need_a_remote_sampler(
    tmp_path: Path,
) -> None:
    trainer = tiny_trainer(tmp_path, beta=0.1)  # a KL penalty: TRL keeps a reference model
    with pytest.raises(ValueError, match="vLLM server mode"):
        trl_integration().time_slice(
            trainer, sampler_group="sampler-pool", trainer_group="trainer-pool"
        )
    slicing = trl_integration().time_slice(trainer, group="unused-group", target="localhost:1")
    names = slicing.backend.selected_names()
    assert not slicing.lora_only
    assert any(n.startswith("reference.") for n in names)
    assert any(n.startswith("policy.") for n in names)
    assert {n for n in names if n.startswith("reference.")} == {
        f"reference.{n}" for n, _ in trainer.ref_model.named_parameters()
    } | {f"reference.{n}" for n, _ in trainer.ref_model.named_buffers()}


# ---------------------------------------------------------------------------- grant policy


@pytest.mark.parametrize("policy", ["phase_aware", "fifo"])
def test_phase_boundaries_go_through_the_groups_grant_policy(
    address: str, group: str, tmp_path: Path, policy: str
) -> None:
    """At each phase boundary on its group the job asks the group to carry its lease into the
    next phase. Another job queues while this one trains: under phase_aware the group carries
    the lease past it into the next step's first phase once (max_carries), under fifo it hands
    the group on at that boundary."""
    from transformers import TrainerCallback

    contender = TimeSliceOrchestratorClient(target=address, job_id=f"contender-{policy}")
    contender.create_group(group, grant_policy=policy)
    served: list[int] = []

    def contend() -> None:
        lease = contender.acquire(group, timeout=120)
        served.append(lease.token)
        contender.release(lease)

    class QueueWhileTraining(TrainerCallback):
        def __init__(self) -> None:
            self.thread: threading.Thread | None = None

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.thread is None:  # the first step, under the train lease
                self.thread = threading.Thread(target=contend, daemon=True)
                self.thread.start()
                wait_for(lambda: contender.group_status(group).queue, what="the contender queued")

    trainer = tiny_trainer(tmp_path)
    queueing = QueueWhileTraining()
    trainer.add_callback(queueing)
    slicing = trl_integration().time_slice(
        trainer, group=group, target=address, job_id=f"trl-np-{policy}"
    )
    try:
        trainer.train()
        assert queueing.thread is not None
        queueing.thread.join(timeout=120)
        assert served, "the contender never got the group"
        status = contender.group_status(group)
    finally:
        contender.close()
    train = next(p for p in slicing.phases if p.phase == "train")
    after = slicing.phases[slicing.phases.index(train) + 1]  # the next step's first phase
    if policy == "phase_aware":
        assert status.stats.carried == 1
        assert after.token == train.token < served[0], (served, slicing.phases)
        assert slicing.kept_at_boundaries >= 1
    else:
        assert status.stats.carried == 0
        assert train.token < served[0] < after.token, (served, slicing.phases)
        assert slicing.yielded_at_boundaries >= 1
