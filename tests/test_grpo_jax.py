"""The grpo-jax workload: GRPO in JAX + optax on the digits task, its state moved by the jax
backend. It learns on the CPU, it is bit-for-bit deterministic across snapshots, restores,
revokes and a save / load into a fresh process state, and it checks its inputs and phase order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

jax = pytest.importorskip("jax", reason="the grpo-jax workload needs JAX: timeslice[jax]")
pytest.importorskip("optax", reason="the grpo-jax workload needs optax: timeslice[jax]")

import numpy as np  # noqa: E402
from timeslice.snapshot import SnapshotError  # noqa: E402
from timeslice.snapshot.base import SnapshotRequest  # noqa: E402
from timeslice.workloads.base import JobSpec, PhaseContext, PhaseStopped  # noqa: E402
from timeslice.workloads.grpo_jax import GrpoJaxWorkload, create  # noqa: E402
from timeslice.workloads.registry import load_workload  # noqa: E402

#: The learning test's bar: mean reward of the last 5 of 30 epochs minus that of the first 5.
#: Seeds 0-3 measure +0.40 .. +0.44 (from about 0.14), so this leaves a wide margin.
REWARD_RISE = 0.2


def spec(seed: int = 0, **options) -> JobSpec:
    return JobSpec(job_id=f"jax-{seed}", seed=seed, batch_size=16, group_size=8, options=options)


def make(s: JobSpec) -> GrpoJaxWorkload:
    w = create()
    w.setup(s)
    return w


def ctx(epoch: int, phase: str) -> PhaseContext:
    return PhaseContext(epoch, phase)


def run_epoch(w: GrpoJaxWorkload, epoch: int) -> dict[str, dict[str, float]]:
    return {
        "sample": w.sample(epoch, ctx(epoch, "sample")),
        "rewards": w.compute_rewards(epoch, ctx(epoch, "rewards")),
        "train": w.train(epoch, ctx(epoch, "train")),
    }


def host(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def trainer_state(w: GrpoJaxWorkload) -> list[bytes]:
    return host((w.policy.value, w.reference.value, w.adam.value))


def sampler_state(w: GrpoJaxWorkload) -> list[bytes]:
    return host((w.sampler.value, w.pending))


class StopAt(PhaseContext):
    """A context whose lease is revoked once the phase reports progress ``step``."""

    def __init__(self, epoch: int, phase: str, step: int) -> None:
        super().__init__(epoch, phase)
        self.at = step

    def progress(self, **details) -> None:
        super().progress(**details)
        if details.get("step") == self.at:
            self.stop("revoked")


def test_reward_rises_over_30_epochs() -> None:
    w = make(spec(0))
    rewards = [run_epoch(w, e)["rewards"]["reward_mean"] for e in range(30)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert min(rewards) >= 0.0 and max(rewards) <= 1.0
    assert last - first >= REWARD_RISE, f"first-5 {first:.3f} -> last-5 {last:.3f}: {rewards}"


def test_bit_identical_across_snapshots_revokes_and_a_checkpoint(tmp_path: Path) -> None:
    epochs, s = 5, spec(3)
    straight = make(s)
    metrics_a = [run_epoch(straight, e) for e in range(epochs)]

    w = make(s)
    backends = w.snapshot_backends()

    def hold(group: str) -> None:
        """The other group's state goes off the device, as when another job holds it."""
        other = "trainer" if group == "sampler" else "sampler"
        backends[other].snapshot_sync(SnapshotRequest(s.job_id))
        backends[group].restore_sync(SnapshotRequest(s.job_id))

    def cycle() -> None:
        for b in backends.values():
            b.snapshot_sync(SnapshotRequest(s.job_id))
        for b in backends.values():
            b.restore_sync(SnapshotRequest(s.job_id))

    def phase(run: Callable[[PhaseContext], dict[str, float]], e: int, name: str, stop: int):
        with pytest.raises(PhaseStopped, match="revoked"):  # revoked part-way, then run again
            run(StopAt(e, name, stop))
        cycle()
        return run(ctx(e, name))

    metrics_b = []
    for e in range(epochs):
        cycle()
        hold("sampler")
        sampled = phase(lambda c, e=e, w=w: w.sample(e, c), e, "sample", stop=2)
        for b in backends.values():
            b.snapshot_sync(SnapshotRequest(s.job_id))  # rewards need no device state at all
        rewards = w.compute_rewards(e, ctx(e, "rewards"))
        hold("trainer")
        trained = phase(lambda c, e=e, w=w: w.train(e, c), e, "train", stop=2)
        cycle()
        metrics_b.append({"sample": sampled, "rewards": rewards, "train": trained})
        if e == 2:
            w.save(tmp_path / "ckpt")
            backends["sampler"].restore_sync(SnapshotRequest(s.job_id))
            w = make(s)  # a fresh process state: setup, then load
            w.load(tmp_path / "ckpt")
            backends = w.snapshot_backends()

    assert metrics_b == metrics_a
    assert trainer_state(w) == trainer_state(straight)
    assert sampler_state(w) == sampler_state(straight)
    assert host(straight.policy.value) != host(straight.reference.value)  # it really trained


def test_each_phase_runs_with_the_other_groups_state_off_the_device() -> None:
    w = make(spec(1))
    run_epoch(w, 0)
    backends = w.snapshot_backends()
    assert backends is w.snapshot_backends()  # built once
    assert set(backends) == {*w.sampler_backends, *w.trainer_backends}
    trainer, sampler = backends["trainer"], backends["sampler"]
    names = trainer.selected_names()
    assert "policy.head.w" in names and "reference.layers.1.b" in names
    assert any(n.startswith("adam.") and n.endswith(".nu.head.w") for n in names)
    assert w.state_bytes() == trainer.registered_bytes + sampler.registered_bytes

    old = jax.tree_util.tree_leaves(w.policy.value)
    report = trainer.snapshot_sync(SnapshotRequest("job"))
    assert report.bytes == trainer.registered_bytes > 0
    assert all(x.is_deleted() for x in old)
    with pytest.raises(SnapshotError, match="is off the device"):
        w.train(0, ctx(0, "train"))  # a phase that needs evicted state says so
    # The sampler's phase and the rewards never touch the trainer's arrays.
    w.sample(1, ctx(1, "sample"))
    w.compute_rewards(1, ctx(1, "rewards"))
    sampler.snapshot_sync(SnapshotRequest("job"))
    trainer.restore_sync(SnapshotRequest("job"))
    w.train(1, ctx(1, "train"))
    trainer.snapshot_sync(SnapshotRequest("job"))
    sampler.restore_sync(SnapshotRequest("job"))
    w.sample(2, ctx(2, "sample"))


def test_phase_order_is_enforced_and_a_stopped_train_rolls_back() -> None:
    w = make(spec(2))
    with pytest.raises(RuntimeError, match=r"compute_rewards\(0\) needs sample\(0\)"):
        w.compute_rewards(0, ctx(0, "rewards"))
    with pytest.raises(RuntimeError, match=r"train\(0\) needs compute_rewards\(0\)"):
        w.train(0, ctx(0, "train"))
    w.sample(0, ctx(0, "sample"))
    w.compute_rewards(0, ctx(0, "rewards"))
    before, pending = trainer_state(w), host(w.pending)
    with pytest.raises(PhaseStopped, match="revoked"):
        w.train(0, StopAt(0, "train", 1))  # after the first optimizer step
    assert trainer_state(w) == before and host(w.pending) == pending
    w.train(0, ctx(0, "train"))
    assert trainer_state(w) != before
    with pytest.raises(RuntimeError, match="setup"):
        create().sample(0, ctx(0, "sample"))
    with pytest.raises(RuntimeError, match="setup"):
        create().snapshot_backends()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"learning_rate": 1e-3}, r"unknown option\(s\) 'learning_rate'; allowed: .*'lr'"),
        ({"lr": "fast"}, r"option 'lr' must be float, not str"),
        ({"lr": -1.0}, r"option 'lr' = -1.0 is invalid; allowed: a float in \(0, 1\]"),
        ({"layers": True}, r"option 'layers' must be int"),
        ({"task": "juggle"}, r"option 'task' = 'juggle' is invalid; allowed: one of \['sort'"),
        ({"temperature": float("nan")}, r"option 'temperature' = nan is invalid"),
    ],
)
def test_invalid_options_are_rejected(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create().state_names(options)
    with pytest.raises(ValueError, match=message):
        create().setup(spec(0, **options))


def test_checkpoint_mismatch_is_refused_and_loses_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        create().setup(JobSpec("j", 0, batch_size=4, group_size=0))
    w = make(spec(0))
    run_epoch(w, 0)
    w.save(tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "meta.json",
        "pending.npz",
        "trainer.npz",
    ]
    with pytest.raises(ValueError, match="seed"):
        make(spec(1)).load(tmp_path / "c")
    with pytest.raises(ValueError, match="options"):
        make(spec(0, lr=1e-3)).load(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="lacks"):
        make(spec(0)).load(tmp_path / "empty")
    other = make(spec(0, hidden=64))
    (tmp_path / "c" / "meta.json").write_text((tmp_path / "c" / "meta.json").read_text()
                                              .replace('{}', '{"hidden": 64}'))  # fmt: skip
    before = trainer_state(other)
    with pytest.raises(ValueError, match="does not fit this model"):
        other.load(tmp_path / "c")
    assert trainer_state(other) == before


def test_the_registry_builds_it() -> None:
    w = load_workload("grpo-jax")
    assert isinstance(w, GrpoJaxWorkload)
    assert w.state_names({}) == (("sampler",), ("trainer",))
