"""An async RL job's staleness rules, written once (docs/architecture.md, "Bounded staleness").

An async job's sampler samples with the newest weights the trainer published; the trainer
trains the batches in the order they were handed over. Three rules make ``max_staleness`` a
promise, and every place that applies them calls this module: the job's config
(``AsyncRLJobConfig``), the workflow's pipeline (``workflows/async_pipeline.py``), and the
planner (``plan/profile.py``'s async profiles, ``plan/simulator.py``'s async jobs).
``tests/unit/test_staleness_rules.py`` drives the workflow's pipeline and the simulator's with
the same random sequences and checks that they decide alike.

Pure: no I/O, nothing of Temporal, so workflows, the contract and the planner may all import it.
"""

from __future__ import annotations


def sync_every_problem(max_staleness: int, sync_every: int) -> str | None:
    """Why weights published every ``sync_every`` steps cannot serve a sampler held to
    ``max_staleness``, or None if they can.

    The sampler waits while the batch it would start is more than ``max_staleness`` steps
    ahead of the weights published; weights that come less often than every
    ``max_staleness + 1`` steps would leave it waiting for good.

    Args:
        max_staleness: The most steps a batch's weights may lag the step that trains it.
        sync_every: The steps between two publications of the trainer's weights.

    Returns:
        A sentence naming both values and the bound to respect, or None.
    """
    if sync_every <= max_staleness + 1:
        return None
    return (
        f"sync_every={sync_every} with max_staleness={max_staleness}: the sampler would wait "
        f"for weights that come only every {sync_every} steps; use sync_every <= "
        f"max_staleness + 1 ({max_staleness + 1})"
    )


def trained_by(steps_done: int, *, training: bool, queued: int, in_flight: int) -> int:
    """The step at which a batch started now is trained at the latest: batches are trained in
    the order they were handed over, after the one in training, those queued and those still
    being sampled or scored.

    Args:
        steps_done: Training steps done.
        training: A batch is in the trainer's hands.
        queued: Batches handed over and not yet taken by the trainer.
        in_flight: Batches being sampled or scored.

    Returns:
        That step (0-based).
    """
    return steps_done + int(training) + queued + in_flight


def may_sample(step: int, *, published: int, max_staleness: int, limit: int) -> bool:
    """The staleness gate: may the sampler start a batch that is trained at ``step`` at the
    latest (``trained_by``), sampling with weights no older than version ``published``?

    Args:
        step: The step the batch is trained at, at the latest.
        published: The newest weights version published to the sampler.
        max_staleness: The most steps a batch's weights may lag the step that trains it.
        limit: The first step no batch is sampled for (the run's or the job's last, + 1).

    Returns:
        True if the batch would be trained before ``limit`` and at most ``max_staleness``
        steps after its weights.
    """
    return step < limit and step - published <= max_staleness


def publishes_after(steps_done: int, *, sync_every: int, steps: int) -> bool:
    """The ``sync_every`` rule: does the step that brings the job to ``steps_done`` publish its
    weights to the sampler? Every ``sync_every`` steps, except after the last step (no batch
    is sampled after it).

    Args:
        steps_done: Training steps done once the step is trained (1-based).
        sync_every: The steps between two publications.
        steps: The job's steps in all.

    Returns:
        True if that step publishes its weights.
    """
    return steps_done % sync_every == 0 and steps_done < steps


def staleness(step: int, weights_version: int) -> int:
    """How many steps the weights a batch was sampled with lag the ``step`` that trains it."""
    return step - weights_version


__all__ = ["may_sample", "publishes_after", "staleness", "sync_every_problem", "trained_by"]
