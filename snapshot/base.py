"""The one interface every snapshot backend implements, and the request it takes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from timeslice.protocol.group import SnapshotReport

if TYPE_CHECKING:  # processes.py builds on this module
    from timeslice.snapshot.processes import ProcessIdentity


class SnapshotError(RuntimeError):
    """A snapshot or restore could not be performed."""


@dataclass(frozen=True)
class Health:
    """Whether a backend can work here, and why not if it cannot."""

    backend: str
    ok: bool
    detail: str


class Capability(StrEnum):
    """What a backend declares it can do, so callers ask instead of probing attributes."""

    #: ``registered_bytes`` says how many bytes a snapshot would move, before it moves them
    #: (the job process reports it to the group as the state's declared size).
    KNOWS_SIZE = "knows-size"
    #: Moves whole processes from outside them (by PID): it runs in the node agent and acts on
    #: the request's ``processes``, which the agent fills from the processes that registered
    #: themselves there, never from what a caller claims.
    WHOLE_PROCESS = "whole-process"


@dataclass(frozen=True)
class SnapshotRequest:
    """One snapshot or restore: what a backend is asked to move, and why.

    A single object so the call stays stable as it grows: a new field reaches the backends that
    want it and leaves the others as they are."""

    job_id: str
    #: The group the move is for ("" for a standalone move or a job's own use).
    group_id: str = ""
    #: Why, in words ("evict for gpus-a", "restore for gpus-a", "move to gpus-b").
    reason: str = ""
    #: For a ``WHOLE_PROCESS`` backend: the job's processes on this node (a PID and its start
    #: time each, so a reused PID is never mistaken for the process that registered).
    processes: tuple[ProcessIdentity, ...] = ()


@runtime_checkable
class SnapshotBackend(Protocol):
    name: str
    capabilities: frozenset[Capability]

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport: ...

    async def restore(self, request: SnapshotRequest) -> SnapshotReport: ...

    def health(self) -> Health: ...


def registered_bytes(backend: SnapshotBackend) -> int | None:
    """What a snapshot would move, for a backend that declares ``KNOWS_SIZE``; else None."""
    if Capability.KNOWS_SIZE not in backend.capabilities:
        return None
    return int(backend.registered_bytes)  # type: ignore[attr-defined]


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
