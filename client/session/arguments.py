"""Checks of what a lease call is given (time-outs, a release's next phase), shared by the
user API and the lease session: bad input fails at once, with a message that says what to
fix, and nothing is sent."""

from __future__ import annotations

import math
import re

from timeslice.errors import InvalidArgumentError
from timeslice.protocol.group import MAX_LEASE_TTL_S, NextPhase

# A phase name as NextPhase takes it (protocol/group.py).
_PHASE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def finite_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (a bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_next_phase(next_phase: str | None, expected_s: float | None) -> NextPhase | None:
    """What a release says of the holder's next phase, checked.

    Args:
        next_phase: The name of the holder's next GPU phase on the same group, or None.
        expected_s: That phase's expected length in seconds, or None when not known.

    Returns:
        A ``NextPhase`` when both are given; None when only the name is (or neither).

    Raises:
        InvalidArgumentError: A malformed name, a length out of range, or a length without a
            name; the message says what to fix.
    """
    if next_phase is None:
        if expected_s is not None:
            raise InvalidArgumentError(
                f"expected_s={expected_s!r} needs next_phase: name the phase it is the length of"
            )
        return None
    if not isinstance(next_phase, str) or not _PHASE_NAME.fullmatch(next_phase):
        raise InvalidArgumentError(
            f"next_phase must be a phase name of 1 to 64 letters, digits or '_.:-' "
            f"(e.g. 'sample', 'train'), not {next_phase!r}"
        )
    if expected_s is None:
        return None
    if not finite_number(expected_s) or not 0 <= expected_s <= MAX_LEASE_TTL_S:
        raise InvalidArgumentError(
            f"expected_s must be the next phase's expected length, a number of seconds from 0 "
            f"to {MAX_LEASE_TTL_S:g}, or None when it is not known yet, not {expected_s!r}"
        )
    return NextPhase(name=next_phase, expected_s=float(expected_s))


def check_timeout(
    timeout: float | None, what: str = "timeout", *, maximum: float | None = None
) -> float | None:
    """A number of seconds from 0 (to ``maximum``, if given), or None.

    Args:
        timeout: The value given.
        what: Its name, for the message.
        maximum: The most it may be.

    Returns:
        ``timeout`` as a float, or None.

    Raises:
        InvalidArgumentError: Not a finite number, negative, or over ``maximum``.
    """
    if timeout is None:
        return None
    if not finite_number(timeout):
        raise InvalidArgumentError(
            f"{what} must be a finite number of seconds or None, not {timeout!r}"
        )
    if timeout < 0:
        raise InvalidArgumentError(f"{what} must be >= 0 seconds, not {timeout}")
    if maximum is not None and timeout > maximum:
        raise InvalidArgumentError(
            f"{what} must be at most {maximum:.0f} s ({maximum / 86_400:.0f} days), not "
            f"{timeout}; pass None to wait without a limit"
        )
    return float(timeout)
