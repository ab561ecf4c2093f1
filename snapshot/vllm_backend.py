"""The ``vllm`` backend: vLLM's sleep mode for a sampler built on ``vllm.LLM``.

Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both, and the
job re-provisions the weights after wake-up (e.g. the trainer's fresh ones) through
``reprovision``. The engine must be built with ``LLM(..., enable_sleep_mode=True)``. This module
imports nothing from vLLM: it drives the engine object it is given, so the package works without
vLLM installed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from timeslice.snapshot.base import Health, SnapshotError
from timeslice.workflows.protocol import SnapshotReport


def _device_free_bytes() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])


def _sleep_mode_enabled(llm: Any) -> bool | None:
    """The engine's enable_sleep_mode setting, where this vLLM version exposes it."""
    engine = getattr(llm, "llm_engine", None)
    config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    value = getattr(config, "enable_sleep_mode", None)
    return None if value is None else bool(value)


class VllmSleepBackend:
    name = "vllm"

    def __init__(
        self,
        llm: Any,
        *,
        level: int = 1,
        wake_tags: list[str] | None = None,
        reprovision: Callable[[Any], None] | None = None,
    ) -> None:
        if not (callable(getattr(llm, "sleep", None)) and callable(getattr(llm, "wake_up", None))):
            raise TypeError(
                f"{type(llm).__name__} has no sleep() / wake_up(): pass a vllm.LLM built with "
                "enable_sleep_mode=True"
            )
        if _sleep_mode_enabled(llm) is False:
            raise SnapshotError("this vllm.LLM was built without enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard), not {level}")
        if level == 2 and reprovision is None:
            raise ValueError(
                "level 2 discards the weights: pass reprovision= to load them after wake-up"
            )
        self.llm = llm
        self.level = level
        self.wake_tags = wake_tags
        self.reprovision = reprovision

    def health(self) -> Health:
        sleeping = getattr(self.llm, "is_sleeping", None)
        state = "" if not callable(sleeping) else (" (asleep)" if sleeping() else " (awake)")
        return Health(self.name, True, f"sleep level {self.level}{state}")

    async def snapshot(self, job_id: str) -> SnapshotReport:
        return await asyncio.to_thread(self._sleep, job_id)

    async def restore(self, job_id: str) -> SnapshotReport:
        return await asyncio.to_thread(self._wake, job_id)

    def _sleep(self, job_id: str) -> SnapshotReport:
        started, free_before = time.perf_counter(), _device_free_bytes()
        self.llm.sleep(level=self.level)
        return self._report(job_id, f"sleep-{self.level}", started, free_before, released=True)

    def _wake(self, job_id: str) -> SnapshotReport:
        started, free_before = time.perf_counter(), _device_free_bytes()
        if self.wake_tags is None:
            self.llm.wake_up()
        else:
            self.llm.wake_up(tags=self.wake_tags)
        if self.reprovision is not None and self.level == 2:
            self.reprovision(self.llm)
        return self._report(job_id, "wake-up", started, free_before, released=False)

    def _report(
        self, job_id: str, mode: str, started: float, free_before: int | None, *, released: bool
    ) -> SnapshotReport:
        free_after = _device_free_bytes()
        # Bytes are the device memory the step released (or took back), as the driver reports
        # it; on a machine without CUDA nothing can be measured, and 0 is reported.
        moved = 0
        if free_before is not None and free_after is not None:
            moved = max(0, free_after - free_before if released else free_before - free_after)
        return SnapshotReport(
            job_id=job_id,
            backend=self.name,
            mode=mode,
            bytes=moved,
            seconds=time.perf_counter() - started,
        )
