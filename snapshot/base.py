"""The one interface every snapshot backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from timeslice.workflows.protocol import SnapshotReport


class SnapshotError(RuntimeError):
    """A snapshot or restore could not be performed."""


@dataclass(frozen=True)
class Health:
    """Whether a backend can work here, and why not if it cannot."""

    backend: str
    ok: bool
    detail: str


@runtime_checkable
class SnapshotBackend(Protocol):
    name: str

    async def snapshot(self, job_id: str) -> SnapshotReport: ...

    async def restore(self, job_id: str) -> SnapshotReport: ...

    def health(self) -> Health: ...


def resolve_backends(
    requested: list[str], available: dict[str, SnapshotBackend]
) -> list[SnapshotBackend]:
    """Return the backends named in ``requested``, in order, or raise naming the missing ones."""
    missing = [name for name in requested if name not in available]
    if missing:
        raise SnapshotError(
            f"snapshot backend(s) {missing} are not registered in this process "
            f"(registered: {sorted(available) or 'none'})"
        )
    return [available[name] for name in requested]
