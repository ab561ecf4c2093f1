"""Every snapshot backend Timeslice ships, in one table shared by the client, the node agent
and the CLI.

A backend's module is imported only when it is used: torch, JAX, vLLM and cuda-python stay
optional. What a backend can do is declared on its class (``capabilities``); this table says
where it runs, what it moves, which extra it needs and whether a client may ask for it by name
alone.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from timeslice.snapshot.base import Capability, SnapshotBackend, SnapshotError


class Placement(StrEnum):
    #: In the job's own process, on its task queue: it moves state the process holds.
    JOB_PROCESS = "job process"
    #: In the node agent (`timeslice agent`), on processes that registered themselves there.
    NODE_AGENT = "node agent"


@dataclass(frozen=True)
class BackendEntry:
    name: str
    placement: Placement
    moves: str
    #: ``MODULE:CLASS``, imported on first use.
    target: str
    #: The pip extra that brings what it imports (``timeslice[EXTRA]``), if any.
    extra: str | None = None
    #: A client may ask for it by name (it needs nothing of the job's to be built).
    by_name: bool = False
    #: The module it needs at work time (its own module may import without it).
    needs: str | None = None

    def load(self) -> type[SnapshotBackend]:
        module_name, _, attr = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            hint = f"; install timeslice[{self.extra}]" if self.extra else ""
            raise SnapshotError(f"snapshot backend {self.name!r} cannot load: {err}{hint}") from err
        return getattr(module, attr)  # type: ignore[no-any-return]

    def capabilities(self) -> frozenset[Capability]:
        return frozenset(self.load().capabilities)

    def missing(self) -> str | None:
        """Why it cannot work in this environment (what to install), or None if it can."""
        try:
            self.load()
            found = self.needs is None or importlib.util.find_spec(self.needs) is not None
        except (SnapshotError, ImportError) as err:
            return str(err)
        if found:
            return None
        hint = f": install timeslice[{self.extra}]" if self.extra else ""
        return f"{self.needs} is not installed{hint}"


BACKENDS: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry(
            "noop",
            Placement.JOB_PROCESS,
            "nothing; each call is still made and reported (CPU-only groups, tests)",
            "timeslice.snapshot.noop:NoopBackend",
            by_name=True,
        ),
        BackendEntry(
            "simulated",
            Placement.JOB_PROCESS,
            "nothing, reporting N bytes in S seconds per switch (benchmarks; the node agent "
            "serves it with --simulated-bytes)",
            "timeslice.snapshot.simulated:SimulatedBackend",
            by_name=True,
        ),
        BackendEntry(
            "collectives",
            Placement.JOB_PROCESS,
            "a job's collective communicators (a torch.distributed process group, NCCL's device "
            "buffers): torn down on eviction, rebuilt by the job at their next use",
            "timeslice.snapshot.collectives:CollectivesBackend",
        ),
        BackendEntry(
            "torch",
            Placement.JOB_PROCESS,
            "registered modules, optimizers and tensors, to pinned host memory and back",
            "timeslice.snapshot.torch_backend:TorchBackend",
            extra="torch",
            needs="torch",
        ),
        BackendEntry(
            "jax",
            Placement.JOB_PROCESS,
            "registered JAX pytrees (parameters, optimizer state), to pinned host memory and "
            "back with the same sharding; the new arrays go back through their holders",
            "timeslice.snapshot.jax_backend:JaxBackend",
            extra="jax",
            needs="jax",
        ),
        BackendEntry(
            "vllm",
            Placement.JOB_PROCESS,
            "a vLLM engine, through its sleep mode (weights to host memory, KV cache freed)",
            "timeslice.snapshot.vllm_backend:VllmSleepBackend",
            extra="vllm",
            needs="vllm",
        ),
        BackendEntry(
            "cuda-checkpoint",
            Placement.NODE_AGENT,
            "whole CUDA processes, through the driver's checkpoint API (driver 570 or newer)",
            "timeslice.snapshot.cuda_checkpoint:CudaCheckpointBackend",
            extra="cuda",
            needs="cuda.bindings",
        ),
    )
}


def entry(name: str) -> BackendEntry:
    """The registry's entry for ``name``, or SnapshotError naming the backends there are."""
    found = BACKENDS.get(name)
    if found is None:
        raise SnapshotError(
            f"unknown snapshot backend {name!r}: the backends are {', '.join(sorted(BACKENDS))}"
        )
    return found


def create(name: str, **options: Any) -> SnapshotBackend:
    """A new backend ``name``, built with ``options`` (its class's keyword arguments)."""
    return entry(name).load()(**options)


def node_agent_backends() -> list[str]:
    """The backends the node agent runs by default, in the registry's order."""
    return [e.name for e in BACKENDS.values() if e.placement is Placement.NODE_AGENT]
