"""RL workloads: what a job process runs for each phase (see :mod:`timeslice.workloads.base`)."""

from timeslice.workloads.base import AsyncWorkload, JobSpec, PhaseContext, PhaseStopped, Workload

__all__ = ["AsyncWorkload", "JobSpec", "PhaseContext", "PhaseStopped", "Workload"]
