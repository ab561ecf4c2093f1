"""Process identity on Linux: a PID plus its start time, so a reused PID is never mistaken."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from timeslice.snapshot.base import SnapshotError


class ProcessMismatchError(SnapshotError):
    """A registered PID is gone, or now belongs to another process."""


def process_start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"a PID is a positive integer, not {pid!r}")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        raise ProcessMismatchError(f"process {pid} is not running") from None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


JOB_ENV = "TIMESLICE_JOB_ID"


def launched_for_job(pid: int) -> str | None:
    """The job id the process was *launched* with (TIMESLICE_JOB_ID in /proc/PID/environ).

    The environment a process was started with cannot be changed by it afterwards, so this
    names the job that whoever launched the process meant it for.
    """
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        raise ProcessMismatchError(f"process {pid} is not running") from None
    except PermissionError as err:
        raise ProcessMismatchError(f"cannot read the environment of process {pid}: {err}") from err
    prefix = f"{JOB_ENV}=".encode()
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def resident_bytes(pid: int) -> int:
    """The process's resident set size (VmRSS) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ProcessMismatchError(f"process {pid} reports no VmRSS (a kernel thread or a zombie?)")


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity:
        return cls(pid, process_start_time(pid))


class PidRegistry:
    """The processes each job registered on this node; only these may be checkpointed."""

    def __init__(self) -> None:
        # job id -> each registered process and how many registrations (connections) it has:
        # one process may register twice (two clients of the job, say), and stays registered
        # until the last of them closes.
        self._by_job: dict[str, dict[ProcessIdentity, int]] = {}

    def register(self, job_id: str, identity: ProcessIdentity) -> None:
        owner = self.owner_of(identity.pid)
        if owner is not None and owner != job_id:
            raise ProcessMismatchError(
                f"process {identity.pid} is already registered by job {owner}, not {job_id}"
            )
        identities = self._by_job.setdefault(job_id, {})
        identities[identity] = identities.get(identity, 0) + 1

    def unregister(self, job_id: str, identity: ProcessIdentity) -> None:
        identities = self._by_job.get(job_id)
        if identities is None or identity not in identities:
            return
        identities[identity] -= 1
        if identities[identity] <= 0:
            del identities[identity]
        if not identities:
            del self._by_job[job_id]

    def owner_of(self, pid: int) -> str | None:
        for job_id, identities in self._by_job.items():
            if any(i.pid == pid for i in identities):
                return job_id
        return None

    def verified(self, job_id: str) -> list[ProcessIdentity]:
        """The job's processes, each checked to be the very process that was registered."""
        identities = sorted(self._by_job.get(job_id, ()), key=lambda i: i.pid)
        if not identities:
            raise ProcessMismatchError(f"job {job_id} registered no process on this node")
        for identity in identities:
            now = process_start_time(identity.pid)
            if now != identity.start_time:
                raise ProcessMismatchError(
                    f"PID {identity.pid} of job {job_id} now belongs to another process "
                    f"(started at tick {now}, registered at {identity.start_time}); refusing"
                )
        return identities
