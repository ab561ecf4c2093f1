"""The ``simulated`` workload: phases that hold their lease for configured times.

For benchmarks and utilization studies: nothing is computed, but each phase takes its configured
duration, and every switch moves a simulated state of configured size and time. Options (all
optional): ``sample_s`` 1.0, ``reward_s`` 1.5, ``train_s`` 0.5, ``state_bytes`` 0 (per state),
``snapshot_s`` 0.0, ``restore_s`` (default: ``snapshot_s``), ``shared_state`` false,
``chunk_bytes`` (a move's chunk, 64 MiB), ``residency_trace`` (a file each chunk's arrival on
and departure from a device is appended to, for tests: ``SimulatedBackend``'s ``trace``),
``state_on_host`` false (states that stand for host memory, as torch's on the CPU),
``gpu_scale_from`` 0 and ``gpu_scale`` 1.0 (from epoch ``gpu_scale_from`` on, when above 0,
the GPU phases take ``gpu_scale`` times their seconds: a job whose profile drifts, as an RL
job's sampling does when its responses lengthen).

It also runs as an async job (``"mode": "async"``): the sampler holds its lease ``sample_s`` per
batch, scoring takes ``reward_s``, the trainer holds its lease ``train_s`` per step; publishing
the weights takes ``sync_s`` (0.0) under the trainer lease and loading them ``load_s`` (0.0)
under the sampler lease, each moving ``sync_bytes`` (default: ``state_bytes``). Its checkpoint
lists every step applied (step, batch, weights version), which the tests read.

Like a real sampler + trainer pair, the job has two states by default — the sampler's (moved by
switches of the sampler group) and the trainer's (the trainer group's). ``shared_state: true``
keeps one state that both groups move, for studying workloads whose state follows the lease
from group to group.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from timeslice.snapshot.base import SnapshotBackend
from timeslice.snapshot.simulated import SimulatedBackend
from timeslice.workloads.base import AsyncWorkload, JobSpec, PhaseContext
from timeslice.workloads.options import SimulatedOptions


def parse_options(options: dict[str, Any]) -> dict[str, float]:
    """The options with their defaults (:class:`~timeslice.workloads.options.SimulatedOptions`
    lists them); ValueError naming an unknown option or a value that is not a number >= 0."""
    return SimulatedOptions.parse(options).seconds_and_bytes()


RESIDENCY_TRACE = "residency_trace"


class SimulatedWorkload(AsyncWorkload):
    """Phases that wait their configured seconds under their lease; states of configured size
    that switches move by :class:`~timeslice.snapshot.simulated.SimulatedBackend`."""

    name = "simulated"
    options_type = SimulatedOptions
    sampler_backends = ("sampler",)
    trainer_backends = ("trainer",)

    def __init__(self) -> None:
        self._options: dict[str, float] = {}
        self._backends: dict[str, SnapshotBackend] = {}
        self._spec: JobSpec | None = None
        self.epochs_trained = 0
        # Async mode: (step, batch, weights version) of every step the model holds; the
        # weights version published to host memory and the one the sampler runs; the batches
        # held (id -> the version each was sampled with).
        self.applied: list[list[int]] = []
        self.published = 0
        self.sampler_version = 0
        self.batches: dict[int, int] = {}
        self._lock = threading.Lock()  # the sampler's thread and the trainer's

    def state_names(self, options: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The sampler's state and the trainer's, or one shared by both groups.

        Args:
            options: The job's options (``shared_state`` decides).

        Returns:
            ``(("sampler",), ("trainer",))``, or ``(("simulated",), ("simulated",))`` shared.

        Raises:
            ValueError: An unknown option or a bad value (from :func:`parse_options`).
        """
        if SimulatedOptions.parse(options).shared_state:
            return ("simulated",), ("simulated",)
        return self.sampler_backends, self.trainer_backends

    def setup(self, spec: JobSpec) -> None:
        """One simulated backend per state, of ``state_bytes`` and the configured move times.

        Args:
            spec: The job; its options as :func:`parse_options` reads them.
        """
        self._options = parse_options(spec.options)
        self._spec = spec
        sampler, trainer = self.state_names(spec.options)
        trace = spec.options.get(RESIDENCY_TRACE)
        self._backends = {
            name: SimulatedBackend(
                nbytes=int(self._options["state_bytes"]),
                snapshot_s=self._options["snapshot_s"],
                restore_s=self._options["restore_s"],
                chunk_bytes=int(self._options["chunk_bytes"]),
                trace=Path(trace) if trace else None,
                state_on_host=SimulatedOptions.parse(spec.options).state_on_host,
            )
            for name in dict.fromkeys([*sampler, *trainer])
        }

    def _hold(self, ctx: PhaseContext, key: str, epoch: int | None = None) -> None:
        seconds = self._options[key]
        start = self._options["gpu_scale_from"]
        if epoch is not None and start > 0 and epoch >= start:  # a GPU phase, drifted
            seconds *= self._options["gpu_scale"]
        ctx.progress(phase=ctx.phase, seconds=seconds)
        ctx.wait(seconds)

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Hold the sampler's lease ``sample_s`` seconds.

        Args:
            epoch: The epoch (unused: nothing is drawn).
            ctx: Its stop check ends the wait early.

        Returns:
            ``completions``: batch size times group size.
        """
        self._hold(ctx, "sample_s", epoch)
        assert self._spec is not None
        return {"completions": float(self._spec.batch_size * self._spec.group_size)}

    def compute_rewards(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Wait ``reward_s`` seconds, holding no lease.

        Args:
            epoch: The epoch, which the stand-in reward curve follows.
            ctx: The stop check.

        Returns:
            ``reward_mean``: 1 - 0.5 * 0.9 ** epoch.
        """
        self._hold(ctx, "reward_s")
        # A stand-in learning curve, so progress displays have something to show.
        return {"reward_mean": 1.0 - 0.5 * 0.9**epoch}

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Hold the trainer's lease ``train_s`` seconds; the model counts the epoch trained.

        Args:
            epoch: The epoch trained.
            ctx: The stop check.

        Returns:
            ``loss``: 0.5 * 0.9 ** epoch.
        """
        self._hold(ctx, "train_s", epoch)
        self.epochs_trained = epoch + 1
        return {"loss": 0.5 * 0.9**epoch}

    # ---------------------------------------------------------------- async mode

    def sample_batch(self, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Hold the sampler's lease ``sample_s``; remember the weights version the batch saw.

        Args:
            batch: The batch's id.
            ctx: The stop check.

        Returns:
            ``completions``, as :meth:`sample`'s.
        """
        self._hold(ctx, "sample_s", batch)
        with self._lock:
            self.batches[batch] = self.sampler_version
        assert self._spec is not None
        return {"completions": float(self._spec.batch_size * self._spec.group_size)}

    def score_batch(self, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Wait ``reward_s``; the reward follows the weights that sampled the batch.

        Args:
            batch: A batch :meth:`sample_batch` made.
            ctx: The stop check.

        Returns:
            ``reward_mean`` of the batch's weights version.
        """
        with self._lock:
            version = self.batches[batch]
        self._hold(ctx, "reward_s")
        # The stand-in learning curve follows the weights that sampled the batch.
        return {"reward_mean": 1.0 - 0.5 * 0.9**version}

    def train_batch(self, step: int, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Hold the trainer's lease ``train_s``; record (step, batch, version) as applied.

        Args:
            step: The step; it must be the next one the model lacks.
            batch: A batch sampled and scored, dropped once trained.
            ctx: The stop check.

        Returns:
            ``loss``: 0.5 * 0.9 ** step.

        Raises:
            RuntimeError: ``step`` is not the model's next step.
        """
        with self._lock:
            if step != self.epochs_trained:
                raise RuntimeError(f"step {step} asked of a model after {self.epochs_trained}")
            version = self.batches.pop(batch)
        self._hold(ctx, "train_s", step)
        with self._lock:
            self.applied.append([step, batch, version])
            self.epochs_trained = step + 1
        return {"loss": 0.5 * 0.9**step}

    def publish_weights(self, version: int, ctx: PhaseContext) -> int:
        """Wait ``sync_s`` and mark ``version`` published.

        Args:
            version: The steps trained.
            ctx: The training step's context.

        Returns:
            ``sync_bytes``.
        """
        ctx.wait(self._options["sync_s"])
        with self._lock:
            self.published = version
        return int(self._options["sync_bytes"])

    def load_weights(self, version: int, ctx: PhaseContext) -> int:
        """Wait ``load_s`` and give the sampler ``version``.

        Args:
            version: The version published last.
            ctx: The sampling's context.

        Returns:
            ``sync_bytes``.

        Raises:
            RuntimeError: ``version`` is not the one published.
        """
        ctx.wait(self._options["load_s"])
        with self._lock:
            if version != self.published:
                raise RuntimeError(f"weights {version} asked, {self.published} published")
            self.sampler_version = version
        return int(self._options["sync_bytes"])

    def drop_batches(self) -> None:
        """Forget the batches held (the job rewound)."""
        with self._lock:
            self.batches.clear()

    # ---------------------------------------------------------------- checkpoints

    def save(self, directory: Path) -> None:
        """Write ``simulated.json``: the epochs trained and every async step applied.

        Args:
            directory: The checkpoint's folder.
        """
        with self._lock:
            saved = {"epochs": self.epochs_trained, "applied": list(self.applied)}
        (directory / "simulated.json").write_text(json.dumps(saved))

    def load(self, directory: Path) -> None:
        """Read ``simulated.json`` back; the sampler runs the trainer's weights, no batch held.

        Args:
            directory: A folder :meth:`save` wrote.
        """
        saved = json.loads((directory / "simulated.json").read_text())
        with self._lock:
            self.epochs_trained = saved["epochs"]
            self.applied = saved.get("applied", [])
            # The sampler starts again from the trainer's weights; no batch survives.
            self.published = self.sampler_version = self.epochs_trained
            self.batches.clear()

    def snapshot_backends(self) -> dict[str, SnapshotBackend]:
        """The simulated states' backends.

        Returns:
            Backends by state name (empty before :meth:`setup`).
        """
        return self._backends


def create() -> SimulatedWorkload:
    """The factory a job process calls to build this workload."""
    return SimulatedWorkload()
