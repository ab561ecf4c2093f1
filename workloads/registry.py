"""Find a workload by built-in name or ``MODULE:FACTORY``."""

from __future__ import annotations

import importlib

from timeslice.workloads.base import Workload

BUILTIN: dict[str, str] = {
    "grpo-dp": "timeslice.workloads.grpo_dp:create",
    "grpo-jax": "timeslice.workloads.grpo_jax:create",
    "grpo-toy": "timeslice.workloads.grpo_toy:create",
    "hf-grpo": "timeslice.workloads.hf_grpo:create",
    "simulated": "timeslice.workloads.simulated:create",
}


def load_workload(ref: str) -> Workload:
    """Build the workload ``ref`` names; ValueError saying what to fix if it cannot."""
    target = BUILTIN.get(ref, ref)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown workload {ref!r}: use a built-in ({', '.join(sorted(BUILTIN))}) "
            "or MODULE:FACTORY, e.g. my_project.rl:make_workload"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"workload {ref!r}: cannot import {module_name!r} ({err})") from err
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"workload {ref!r}: {module_name} has no callable {attr!r}")
    workload = factory()
    if not isinstance(workload, Workload):
        raise ValueError(
            f"workload {ref!r}: {attr}() returned {type(workload).__name__}, "
            "not a timeslice.workloads.Workload"
        )
    return workload
