"""An async RL job's pipeline between its two loops, apart from Temporal.

``Pipeline`` is ``AsyncRLJobWorkflow``'s bookkeeping of one run's batches: those being sampled
or scored, those handed over to the trainer, the one in the trainer's hands. It decides with
``timeslice.protocol.staleness`` — the staleness gate (may the sampler start a batch now?) and
the ``sync_every`` rule (does this step publish its weights?) — as the planner's simulator does
(``plan/simulator.py``, ``_Gate``); ``tests/unit/test_staleness_rules.py`` drives both with the
same random sequences and checks that they agree. It sends nothing and awaits nothing, so the
workflow's loops read as their story and the rules are unit-tested in milliseconds.

Nothing here crosses continue-as-new: the gate admits no batch past the run's last step, so the
pipeline is empty when a run ends; a rewind or a stop drops what is in it (``drop``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from timeslice.protocol.async_rl_job import AsyncPhaseResult, AsyncRLJobState, QueuedBatch
from timeslice.protocol.group import MAX_STATE_BYTES
from timeslice.protocol.rl_job import Phase
from timeslice.protocol.staleness import may_sample, publishes_after, staleness, trained_by

# The longest a phase's (or a weights move's) time may read: a year, finite, not negative.
_MAX_SECONDS = 366 * 86_400.0


@dataclass
class Pipeline:
    """One run's batches between an async job's sampler loop and its trainer loop.

    Attributes:
        max_staleness: The job's staleness bound.
        sync_every: The steps between two publications of the trainer's weights.
        steps: The job's training steps in all (its ``epochs``).
        run_target: The step this run's loops stop at (the sampler admits no batch past it).
        queue: Batches sampled and scored, handed over, oldest first.
        in_flight: Batches being sampled or scored.
        training: A batch is in the trainer's hands.
        draining: The sampler starts no new batch (a loop ended or failed).
    """

    max_staleness: int
    sync_every: int
    steps: int
    run_target: int = 0
    queue: list[QueuedBatch] = field(default_factory=list)
    in_flight: int = 0
    training: bool = False
    draining: bool = False

    def may_sample(self, state: AsyncRLJobState) -> bool:
        """The staleness gate: a batch started now is trained by the step ``trained_by``
        says, with weights no older than ``state.published``.

        Args:
            state: The job's state (its steps done and the weights version published).

        Returns:
            True if the sampler may start a batch now.
        """
        step = trained_by(
            state.epochs_done,
            training=self.training,
            queued=len(self.queue),
            in_flight=self.in_flight,
        )
        return may_sample(
            step,
            published=state.published,
            max_staleness=self.max_staleness,
            limit=self.run_target,
        )

    def start_batch(self, state: AsyncRLJobState) -> tuple[int, int]:
        """The sampler starts a batch: it draws the batch's id (each id once, ever).

        Args:
            state: The job's state, whose batch counter it advances.

        Returns:
            The batch's id and the weights version the sampler is to sample it with.
        """
        batch = state.next_batch
        state.next_batch += 1
        self.in_flight += 1
        return batch, state.published

    def hand_over(self, batch: QueuedBatch) -> None:
        """The sampler hands a sampled and scored batch over to the trainer."""
        self.in_flight -= 1
        self.queue.append(batch)

    def take(self, state: AsyncRLJobState) -> tuple[QueuedBatch, int]:
        """The trainer takes the oldest batch handed over.

        Args:
            state: The job's state (its steps done: the step that trains the batch).

        Returns:
            The batch and its staleness at that step.
        """
        batch = self.queue.pop(0)
        self.training = True
        return batch, staleness(state.epochs_done, batch.weights_version)

    def discard(self) -> None:
        """The batch in the trainer's hands will not be trained (too stale: dropped)."""
        self.training = False

    def publishes(self, state: AsyncRLJobState) -> bool:
        """Whether the step in the trainer's hands publishes its weights once trained."""
        return publishes_after(state.epochs_done + 1, sync_every=self.sync_every, steps=self.steps)

    def trained(self, state: AsyncRLJobState, *, published: bool) -> None:
        """The step in the trainer's hands was trained (and its weights published if
        ``published``): the job is one step further."""
        self.training = False
        state.epochs_done += 1
        if published:
            state.published = state.epochs_done

    def sampled_problem(
        self, result: AsyncPhaseResult, state: AsyncRLJobState, *, batch: int, asked: int
    ) -> str | None:
        """What is wrong with a sample's result for ``batch``, asked with weights ``asked``,
        or None: checked before anything of it touches the pipeline or the state.

        The weights it was sampled with are no older than those asked for, and no newer than
        the newest the process can have: those published, or those the step in the trainer's
        hands publishes (the process may have them before the workflow hears of it).

        Args:
            result: The process's answer.
            state: The job's state now.
            batch: The batch asked for.
            asked: The weights version the sampler was told to sample with.

        Returns:
            The problem, or None.
        """
        newest = state.epochs_done + 1 if self.training and self.publishes(state) else None
        newest = max(state.published, newest or 0)
        version = result.weights_version
        return (
            _phase_problem(result, "sample", batch, batch)
            or _none_of(result, published_version=None, sync_s=0.0, sync_bytes=0)
            or _weights_problem(result.load_s, result.load_bytes, "load")
            or (
                None
                if version is None or asked <= version <= newest
                else f"weights_version {version} is outside {asked}..{newest} (asked for "
                f"{asked}; the newest the process can have is {newest})"
            )
        )

    def scored_problem(self, result: AsyncPhaseResult, *, batch: int) -> str | None:
        """What is wrong with the scoring of ``batch``'s result, or None.

        Args:
            result: The process's answer.
            batch: The batch asked for.

        Returns:
            The problem, or None.
        """
        return _phase_problem(result, "rewards", batch, batch) or _none_of(
            result,
            weights_version=None,
            published_version=None,
            load_s=0.0,
            load_bytes=0,
            sync_s=0.0,
            sync_bytes=0,
        )

    def trained_problem(
        self, result: AsyncPhaseResult, *, step: int, batch: int, publish: int | None
    ) -> str | None:
        """What is wrong with a training step's result, or None.

        Args:
            result: The process's answer.
            step: The step asked for.
            batch: The batch it was to train on.
            publish: The weights version it was to publish (None: none).

        Returns:
            The problem, or None.
        """
        return (
            _phase_problem(result, "train", step, batch)
            or _none_of(result, weights_version=None, load_s=0.0, load_bytes=0)
            or _weights_problem(result.sync_s, result.sync_bytes, "sync")
            or (
                None
                if result.published_version == publish
                else f"published_version {result.published_version} is not the {publish} "
                "it was asked to publish"
            )
        )

    def drop(self) -> int:
        """Empty the pipeline (a rewind, a stop): batches handed over or in flight, the one in
        the trainer's hands included, that no step will train. Returns how many."""
        dropped = len(self.queue) + self.in_flight + int(self.training)
        self.queue.clear()
        self.in_flight = 0
        self.training = False
        return dropped


def _phase_problem(result: AsyncPhaseResult, phase: Phase, epoch: int, batch: int) -> str | None:
    """The fields every async phase's result shares, against what was asked."""
    ran = result.phase
    if result.batch != batch:
        return f"batch {result.batch} is not the batch {batch} asked for"
    if ran.phase != phase or ran.epoch != epoch:
        return f"it reports {ran.phase} {ran.epoch}, not the {phase} {epoch} asked for"
    for name in ("seconds", "waited_s"):
        value = getattr(ran, name)
        if not (math.isfinite(value) and 0 <= value <= _MAX_SECONDS):
            return f"phase.{name} {value} is not a time (0..{_MAX_SECONDS:g} s)"
    return None


def _weights_problem(seconds: float, nbytes: int, what: str) -> str | None:
    """A weights move's time and size: counted into the state, so bounded."""
    if not (math.isfinite(seconds) and 0 <= seconds <= _MAX_SECONDS):
        return f"{what}_s {seconds} is not a time (0..{_MAX_SECONDS:g} s)"
    if not 0 <= nbytes <= MAX_STATE_BYTES:
        return f"{what}_bytes {nbytes} is not a size (0..{MAX_STATE_BYTES})"
    return None


def _none_of(result: AsyncPhaseResult, **expected: object) -> str | None:
    """Fields this phase never sets must be left at their defaults."""
    for name, value in expected.items():
        if getattr(result, name) != value:
            return f"{name} {getattr(result, name)!r} is set, which this phase never does"
    return None


__all__ = ["Pipeline"]
