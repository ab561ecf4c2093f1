"""What the GRPO workloads on the digit task share, whatever computes them.

``grpo-toy`` (torch), ``hf-grpo`` (its subclass, a transformers policy) and ``grpo-jax`` (JAX and
optax) learn one task with one recipe: the options of the task and of clipped GRPO, the order of
the phases (a rollout is sampled, then scored, then trained on, in this process), the
checkpoint's meta-data, and the summary of a train call's optimizer steps. This module holds that
part once; it imports neither torch nor JAX, so each workload keeps only its framework's work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from timeslice.snapshot.base import SnapshotBackend
from timeslice.workloads.base import JobSpec, Workload
from timeslice.workloads.options import TASKS, DigitGrpoOptions

# The task's names and the options' class, where they were first defined (kept for imports).
__all__ = ["TASKS", "DigitGrpoOptions", "DigitGrpoWorkload", "steps_summary"]


class DigitGrpoWorkload(Workload):
    """The framework-free half of a digit-task GRPO workload: the job's spec, its backends, the
    phases' order and the checkpoint's meta-data. A subclass sets ``spec``, ``_backends`` and
    ``_rollout`` in ``setup`` and ``_last_trained`` in ``train``."""

    #: The workload's options (``JobSpec.options`` parse as this class).
    options_type: ClassVar[type[DigitGrpoOptions]] = DigitGrpoOptions  # type: ignore[assignment]
    sampler_backends = ("sampler",)
    trainer_backends = ("trainer",)

    def __init__(self) -> None:
        self.opts = self.options_type()
        self.spec: JobSpec | None = None
        self._backends: dict[str, Any] | None = None
        self._rollout: Any = None  # the epoch's rollout: sampled, then scored, then trained on
        self._last_trained: int | None = None

    def state_names(self, options: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The sampler's backend and the trainer's, once the options are checked: a bad
        option ends the job when it first meets its process.

        Args:
            options: The job's ``workload_options``.

        Returns:
            ``(("sampler",), ("trainer",))``.

        Raises:
            ValueError: An option is bad (:meth:`DigitGrpoOptions.parse`).
        """
        self.options_type.parse(options)
        return super().state_names(options)

    def snapshot_backends(self) -> dict[str, SnapshotBackend]:
        """The sampler's and the trainer's backends.

        Returns:
            ``{"sampler": ..., "trainer": ...}``, made by ``setup``.

        Raises:
            RuntimeError: ``setup`` has not run.
        """
        if self._backends is None:
            raise RuntimeError(f"{self.name}: snapshot_backends() called before setup()")
        return self._backends

    def _configure(self, spec: JobSpec) -> Any:
        """``setup``'s first step: check the sizes, parse the options, keep both; the options."""
        if spec.batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1, not {spec.batch_size}")
        if spec.group_size < 1:
            raise ValueError(f"{self.name}: group_size must be >= 1, not {spec.group_size}")
        self.spec, self.opts = spec, self.options_type.parse(spec.options)
        return self.opts

    def _spec(self) -> JobSpec:
        if self.spec is None:
            raise RuntimeError(f"{self.name}: setup() has not run")
        return self.spec

    def _sampled(self, epoch: int) -> Any:
        """This epoch's rollout, which ``compute_rewards`` scores: ``sample`` made it here."""
        ro = self._rollout
        if ro is None or ro.epoch != epoch:
            have = "none" if ro is None else f"epoch {ro.epoch}"
            raise RuntimeError(
                f"{self.name}: compute_rewards({epoch}) needs sample({epoch}) to have run in this "
                f"process first (sampled rollouts held: {have})"
            )
        return ro

    def _scored(self, epoch: int) -> Any:
        """This epoch's rollout, which ``train`` trains on: scored here already."""
        ro = self._rollout
        if ro is None or ro.epoch != epoch or ro.rewards is None:
            have = (
                "none"
                if ro is None
                else f"epoch {ro.epoch}, {'scored' if ro.rewards is not None else 'unscored'}"
            )
            raise RuntimeError(
                f"{self.name}: train({epoch}) needs compute_rewards({epoch}) to have run in this "
                f"process first (rollouts held: {have})"
            )
        return ro

    def _score(self, ro: Any, ctx: Any) -> dict[str, float]:
        """Score rollout ``ro``: each completion's reward is the share of its digits that match
        the task's answer (after the stand-in verifier's ``reward_latency_s``)."""
        ctx.check()
        correct = ro.completions == self._targets(ro.prompts)
        if self.opts.reward_latency_s:
            ctx.wait(self.opts.reward_latency_s)
        ro.rewards, metrics = self._reward_metrics(correct)
        ctx.progress(step=1, of=1)
        return metrics

    def _targets(self, prompts: Any) -> Any:
        """The task's answer to each prompt (sorted, reversed or copied), in the framework's
        arrays."""
        raise NotImplementedError

    def _reward_metrics(self, correct: Any) -> tuple[Any, dict[str, float]]:
        """From ``correct`` (completion x digit, true where right): the rewards (each row's
        mean), and ``reward_mean``, ``reward_std``, ``group_std_mean`` (the spread within each
        prompt's group), ``accuracy`` (whole answers right) and ``digit_accuracy``."""
        raise NotImplementedError

    def _meta(self) -> dict[str, Any]:
        """What a checkpoint is of: the workload, the seed, the options, the last epoch."""
        spec = self._spec()
        return {
            "workload": self.name,
            "seed": spec.seed,
            "options": dict(spec.options),
            "last_trained_epoch": self._last_trained,
        }

    def _check_checkpoint(self, directory: Path, files: tuple[str, ...]) -> None:
        """Refuse a checkpoint folder that lacks one of ``files``."""
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{self.name}: checkpoint {directory} lacks {missing}")

    def _check_meta(self, directory: Path, meta: dict[str, Any]) -> None:
        """Refuse a checkpoint written for another workload, seed or options."""
        mine = self._meta()
        if meta.get("workload") != self.name or meta.get("seed") != mine["seed"]:
            raise ValueError(
                f"{self.name}: checkpoint {directory} is for {meta.get('workload')!r} with seed "
                f"{meta.get('seed')!r}, this job is {self.name!r} with seed {mine['seed']!r}"
            )
        if meta.get("options") != mine["options"]:
            raise ValueError(
                f"{self.name}: checkpoint {directory} was written with options "
                f"{meta.get('options')!r}, this job has {mine['options']!r}"
            )


def steps_summary(steps: list[dict[str, float]]) -> dict[str, float]:
    """A train call's metrics from its optimizer steps' (each ``loss``, ``kl``, ``grad_norm``,
    ``clip_frac``): the means, but the last step's KL to the reference."""
    n = len(steps)
    return {
        "loss": sum(s["loss"] for s in steps) / n,
        "kl": steps[-1]["kl"],
        "grad_norm": sum(s["grad_norm"] for s in steps) / n,
        "clip_frac": sum(s["clip_frac"] for s in steps) / n,
        "optimizer_steps": float(n),
    }
