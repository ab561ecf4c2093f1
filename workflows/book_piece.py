"""What GroupBook's pieces share: the group's config and state (one ``GroupState``; each piece
keeps its own part of it), and the observer they report what metrics count to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from timeslice.protocol.group import GroupConfig, GroupState, LeaseOutcome

__all__ = ["BookPiece", "Observer", "SilentObserver"]


class Observer(Protocol):
    """Where the book reports what metrics count (the workflow's metric meter)."""

    def granted(self, waited_s: float) -> None: ...
    def lease_ended(self, outcome: LeaseOutcome, held_s: float) -> None: ...
    def stale(self, kind: str) -> None: ...
    def moved(self, direction: str, nbytes: int) -> None: ...
    def switched(self, seconds: float) -> None: ...


class SilentObserver:
    """An observer that counts nothing (a book without metrics: tests, the planner)."""

    def granted(self, waited_s: float) -> None:
        """Count nothing."""

    def lease_ended(self, outcome: LeaseOutcome, held_s: float) -> None:
        """Count nothing."""

    def stale(self, kind: str) -> None:
        """Count nothing."""

    def moved(self, direction: str, nbytes: int) -> None:
        """Count nothing."""

    def switched(self, seconds: float) -> None:
        """Count nothing."""


@dataclass(eq=False)
class BookPiece:
    """One of :class:`~timeslice.workflows.group_book.GroupBook`'s pieces."""

    config: GroupConfig
    state: GroupState
    observer: Observer = field(default_factory=SilentObserver)
