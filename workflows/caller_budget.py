"""Per-caller fairness: how many updates each caller may send a group, as token buckets.

One of :class:`~timeslice.workflows.group_book.GroupBook`'s pieces, apart from the state it
carries: the buckets live in the workflow's memory for one run (a continue-as-new starts them
full). The group's validators ask :meth:`CallerBudgets.over` (reading, never changing) and
refuse an update whose caller has no token left, so a refused update leaves no history; its
handler spends one (:meth:`CallerBudgets.spend`), which a replay repeats exactly, at the same
``workflow.now()``. The buckets decide only what validators refuse, never a command, so they
need no patch. Who the caller is, and whether the message proves it, is the book's
(:meth:`GroupBook.caller_of`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from timeslice.protocol.group import (
    CALLER_UPDATE_BURST,
    CALLER_UPDATES_PER_S,
    UNPROVEN_UPDATE_BURST,
    UNPROVEN_UPDATES_PER_S,
)

__all__ = ["CALLERS_KEEP", "Caller", "CallerBudgets", "OverBudget"]

# Buckets kept; past it a full one (an idle caller's) goes first, so a caller that sends under
# many names cannot push out the bucket of one that spends.
CALLERS_KEEP = 256
_UNPROVEN = "unproven messages"


@dataclass(frozen=True)
class Caller:
    """Who sent an update, as far as the group can tell.

    Attributes:
        name: Its budget's name: ``job X`` (the message presents a key of X's), ``job X
            (claimed)`` (it names X and proves nothing), or ``unknown`` (it names a request
            the group does not know).
        proven: The message presented a lease key the group knows: no one else can spend
            this budget. Unproven messages also draw on the budget they all share.
    """

    name: str
    proven: bool


@dataclass(frozen=True)
class OverBudget:
    """Why an update is refused: its caller's budget is spent.

    Attributes:
        budget: The budget's name (a caller's, or the one unproven messages share).
        wait_s: Seconds until that budget has a token again.
        per_s: The budget's sustained rate.
        burst: The budget's burst.
    """

    budget: str
    wait_s: float
    per_s: float
    burst: float

    def explain(self, group_id: str) -> str:
        """The refusal's message: who, what limit, and when to send again."""
        return (
            f"group {group_id} refused this update: {self.budget} sent more than "
            f"{self.per_s:g} updates/s (bursts of {self.burst:g}) to it; nothing of it was "
            f"recorded. Send again in {self.wait_s * 1000:.0f} ms (docs/security.md, "
            "per-caller fairness)"
        )


@dataclass
class _Bucket:
    tokens: float
    at: datetime


class CallerBudgets:
    """Token buckets of the updates each caller may send (module docstring)."""

    def __init__(
        self,
        *,
        rate: float = CALLER_UPDATES_PER_S,
        burst: int = CALLER_UPDATE_BURST,
        unproven_rate: float = UNPROVEN_UPDATES_PER_S,
        unproven_burst: int = UNPROVEN_UPDATE_BURST,
    ) -> None:
        self.rate, self.burst = rate, burst
        self._shared = (unproven_rate, unproven_burst)
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def _limits(self, name: str) -> tuple[float, float]:
        return self._shared if name == _UNPROVEN else (self.rate, self.burst)

    def _tokens(self, name: str, now: datetime) -> float:
        rate, burst = self._limits(name)
        bucket = self._buckets.get(name)
        if bucket is None:
            return burst
        elapsed = max(0.0, (now - bucket.at).total_seconds())
        return min(burst, bucket.tokens + rate * elapsed)

    def _names(self, caller: Caller) -> list[str]:
        return [caller.name] if caller.proven else [caller.name, _UNPROVEN]

    def over(self, caller: Caller, now: datetime) -> OverBudget | None:
        """Whether ``caller``'s next update must wait, and how long (None: it may send now).

        Args:
            caller: The update's caller.
            now: The time it is judged at.

        Returns:
            The budget that makes it wait, or None.
        """
        for name in self._names(caller):
            tokens = self._tokens(name, now)
            if tokens < 1.0:
                rate, burst = self._limits(name)
                return OverBudget(name, (1.0 - tokens) / rate, rate, burst)
        return None

    def spend(self, caller: Caller, now: datetime) -> None:
        """Take one token of ``caller``'s (an update of its was accepted).

        Args:
            caller: The update's caller.
            now: When it was taken.
        """
        for name in self._names(caller):
            tokens = self._tokens(name, now)
            self._buckets.pop(name, None)
            self._buckets[name] = _Bucket(max(0.0, tokens - 1.0), now)  # most recent last
        while len(self._buckets) > CALLERS_KEEP:
            full = next(
                (n for n in self._buckets if self._tokens(n, now) >= self._limits(n)[1]), None
            )
            del self._buckets[full if full is not None else next(iter(self._buckets))]
