"""What an activity's failure, or its result, means for an RL job (sync or async).

A phase that fails for any reason — its process died (heartbeat or pick-up time-out), the
process restarted and lost its in-memory state, the lease was revoked, the user's code raised,
its result does not parse — fails the phase (``PhaseFailed``): the job rewinds to its last
checkpoint. A failure that waiting or rewinding would not change (``_ENDS_THE_JOB``) ends the
job at once, non-retryably (``ending_the_job``). Used by ``JobWorkflowBase``
(``workflows/job_base.py``) for every activity either job workflow runs.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError
from timeslice.protocol.group import explain_validation_error
from timeslice.protocol.rl_job import GRANT_NOT_HELD

# Failures that waiting or rewinding would not change (a phase's own acquire timing out, a
# faulted job, a bad config, a job process of another release): the job fails at once, with
# the workflow-side error type each activity-side type becomes.
_ENDS_THE_JOB = {
    "AcquireTimeoutError": "AcquireTimeout",
    "JobFaultedError": "JobFaulted",
    "InvalidConfig": "InvalidConfig",
    "WrongJob": "InvalidConfig",
    "ProcessTaken": "ProcessTaken",
    "ProtocolMismatch": "ProtocolMismatch",
}


def ending_the_job(err: ActivityError, job_id: str) -> ApplicationError | None:
    """The job's own non-retryable failure for an activity failure in ``_ENDS_THE_JOB``.

    Args:
        err: An activity's failure.
        job_id: The job's id, which the failure's message starts with.

    Returns:
        The error to fail the job with, or None if a rewind may still cure the failure.
    """
    cause = err.cause
    if not (isinstance(cause, ApplicationError) and cause.type in _ENDS_THE_JOB):
        return None
    return ApplicationError(
        f"job {job_id}: {cause.message}", type=_ENDS_THE_JOB[cause.type], non_retryable=True
    )


def failure_text(err: ActivityError) -> str:
    """An activity's failure in one line: its type and message (what a rewind logs and a
    ``JobFailed`` error quotes)."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type or 'error'}: {cause.message}"
    if isinstance(cause, TimeoutError):
        return f"{cause.type.name.lower() if cause.type else 'timed out'}: {cause.message}"
    return str(cause or err)


class PhaseFailed(Exception):
    """A phase (of an epoch, or of either async loop) failed; the job rewinds to its last
    checkpoint."""


class GrantRefused(PhaseFailed):
    """Every rank refused a lease of the workflow's before any work (``GrantNotHeld``): the
    group's holder is another. Nothing ran; the workflow asks the group again."""


def refused_grant(err: BaseException | None) -> bool:
    """Whether ``err`` is an activity's refusal of the lease it was handed, before any work
    (``GRANT_NOT_HELD``).

    Args:
        err: What an activity ended in (None: it completed).

    Returns:
        True for an ``ActivityError`` whose cause is a ``GrantNotHeld`` failure.
    """
    cause = err.cause if isinstance(err, ActivityError) else None
    return isinstance(cause, ApplicationError) and cause.type == GRANT_NOT_HELD


class InvalidResult(Exception):
    """An activity's result did not parse."""


R = TypeVar("R", bound=BaseModel)


def validated(model: type[R], raw: Any, what: str) -> R:
    """An activity's result as ``model``.

    Results are taken raw and validated here rather than by the data converter: a result that
    does not parse (a rogue poller on the job's queue, a job process of a release whose models
    differ) would otherwise fail the workflow *task* on every replay, and the job would hang.

    Args:
        model: The result's model.
        raw: The result as the activity returned it.
        what: Who answered, for the message.

    Returns:
        The parsed result.

    Raises:
        InvalidResult: It does not parse; the message says what was wrong.
    """
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise InvalidResult(
            f"{what} returned an invalid {model.__name__} ({explain_validation_error(err)}); "
            "is a process of another Timeslice release, or something that is no job process, "
            "polling the job's task queue?"
        ) from None


__all__ = [
    "GrantRefused",
    "InvalidResult",
    "PhaseFailed",
    "ending_the_job",
    "failure_text",
    "refused_grant",
    "validated",
]
