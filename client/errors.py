"""Typed errors of the Timeslice client. Each message says what happened and what to do."""

from __future__ import annotations


class TimesliceError(Exception):
    """Base class of every error the Timeslice client raises."""


class InvalidArgumentError(TimesliceError, ValueError):
    """An id, size, timeout or other argument is malformed; nothing was sent."""


class ServerUnreachableError(TimesliceError, ConnectionError):
    """The Temporal server could not be reached."""


class NoControlWorkerError(TimesliceError):
    """No control worker serves the groups' task queue: nothing would ever answer."""


class UnknownGroupError(TimesliceError, LookupError):
    """No GPU group workflow exists under that id."""


class AcquireTimeoutError(TimesliceError, TimeoutError):
    """The group was not granted within the acquire time-out; the request was withdrawn."""


class NotHolderError(TimesliceError):
    """The client does not hold the lease it was asked to release or use."""


class LeaseRevokedError(TimesliceError):
    """The group revoked the lease (its TTL ran out without renewal)."""


class SnapshotFailedError(TimesliceError):
    """A standalone snapshot or restore failed on at least one of the job's queues."""


class JobFaultedError(TimesliceError):
    """The group marked this job faulted (a snapshot or restore of its state failed)."""


class GrantLostError(TimesliceError):
    """The group granted the request but gave the grant up before this process took it (the
    process was paused or did not answer in time): nothing is held; acquire again."""


class ClientClosedError(TimesliceError):
    """The client was closed (possibly by another thread while this call waited)."""


class VersionMismatchError(TimesliceError):
    """A group or job answered with a message this client cannot read: the two run different
    releases of Timeslice (docs/upgrading.md says which processes upgrade together)."""


class RateLimitedError(TimesliceError):
    """The group refused the call: this job (or whatever the call claimed to speak for) sent
    it more updates than its rate allows (docs/security.md, per-caller fairness). Nothing was
    recorded; the client waits ``retry_after_s`` before it sends this group anything that
    could be refused again, and a try-lock (``timeout=0``) raises this at once meanwhile."""

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GroupNotAnsweringError(TimesliceError):
    """The group's workflow took no update within the time allowed (its workflow task is
    failing, or no control worker runs it): see the control worker's log."""
