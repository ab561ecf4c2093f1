"""The ``vllm`` backend: vLLM's sleep mode for a sampler built on ``vllm.LLM``.

Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both, and the
job re-provisions the weights after wake-up (e.g. the trainer's fresh ones) through
``reprovision``. With ``wake_tags`` the wake-up is staged: those tags first, then
``reprovision``, then the remaining tags (vLLM's pattern for loading new weights before the KV
cache takes its memory). The engine must be built with ``LLM(..., enable_sleep_mode=True)``;
the constructor checks that its ``sleep`` / ``wake_up`` take the keywords this backend passes.
This module imports nothing from vLLM: it drives the engine object it is given, so the package
works without vLLM installed.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotError, SnapshotRequest, move_report
from timeslice.snapshot.gpu_env import package_version, version_tuple

# The vLLM releases whose sleep-mode API this backend was checked against (pyproject's `vllm`
# extra pins the same range): `LLM.wake_up(tags=...)` arrived in 0.8.3 (vllm-project/vllm#15500);
# 0.33 is the newest release line read. Both calls keep these keyword names throughout.
VLLM_MIN = (0, 8, 3)
VLLM_BELOW = (0, 34)
VLLM_REQUIREMENT = f"vllm>={'.'.join(map(str, VLLM_MIN))},<{'.'.join(map(str, VLLM_BELOW))}"
# What this backend passes to the engine, by keyword: `llm.sleep(level=...)`,
# `llm.wake_up(tags=...)`.
SLEEP_KEYWORDS = {"sleep": ("level",), "wake_up": ("tags",)}
# The memory tags vLLM's sleep mode allocates under; a staged wake-up must cover all of them.
MEMORY_TAGS = ("weights", "kv_cache")


def _device_free_bytes() -> int | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info()[0])
    except Exception:  # no torch, or a driver that fails: nothing can be measured
        return None


def _engine_config_flag(llm: Any) -> bool | None:
    """The engine's enable_sleep_mode setting, where this vLLM version exposes it."""
    engine = getattr(llm, "llm_engine", None)
    # V0 and V1 engines keep model_config on the engine; later V1 releases also on vllm_config.
    for config in (
        getattr(engine, "model_config", None),
        getattr(getattr(engine, "vllm_config", None), "model_config", None),
    ):
        value = getattr(config, "enable_sleep_mode", None)
        if value is not None:
            return bool(value)
    return None


def missing_keywords(method: Callable[..., Any], names: tuple[str, ...]) -> list[str]:
    """The keyword arguments in ``names`` that ``method`` does not accept."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return []  # not inspectable (a C extension): the call itself will tell
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    accepted = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return [n for n in names if n not in accepted]


def vllm_in_range(version: str) -> bool:
    release = version_tuple(version)
    return release >= VLLM_MIN and release[: len(VLLM_BELOW)] < VLLM_BELOW


def vllm_version_note(llm: Any) -> str:
    """The installed vLLM version and whether it is in the range this backend was checked on."""
    version = package_version("vllm")
    if version is None:
        return f"vLLM not installed, driving a {type(llm).__name__}"
    if vllm_in_range(version):
        return f"vLLM {version}"
    return f"vLLM {version}, outside the checked range {VLLM_REQUIREMENT}"


class VllmSleepBackend:
    """Puts a ``vllm.LLM`` to sleep to evict its state, and wakes it to restore it.

    Args:
        llm: The engine, built with ``enable_sleep_mode=True``.
        level: 1 offloads the weights to host memory and drops the KV cache; 2 drops both
            (``reprovision`` then loads the weights).
        wake_tags: Memory tags to wake first (say ``["weights"]``), before ``reprovision``
            and the remaining tags; None wakes everything at once.
        reprovision: Called with the engine after a level-2 wake-up, to load its weights.

    Raises:
        TypeError: ``llm`` has no sleep mode, or its calls lack the keywords this backend uses.
        SnapshotError: The engine was built without sleep mode.
        ValueError: An unknown level or tag, or level 2 without ``reprovision``.
    """

    name = "vllm"
    capabilities: frozenset[Capability] = frozenset()

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
        for method, names in SLEEP_KEYWORDS.items():
            missing = missing_keywords(getattr(llm, method), names)
            if missing:
                raise TypeError(
                    f"{type(llm).__name__}.{method}() takes no {missing} argument: this "
                    f"backend drives vLLM's sleep mode as in {VLLM_REQUIREMENT}"
                )
        if _engine_config_flag(llm) is False:
            raise SnapshotError("this vllm.LLM was built without enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard), not {level}")
        unknown = sorted(set(wake_tags or ()) - set(MEMORY_TAGS))
        if unknown:
            raise ValueError(f"wake_tags {unknown} are not vLLM memory tags {list(MEMORY_TAGS)}")
        if level == 2 and reprovision is None:
            raise ValueError(
                "level 2 discards the weights: pass reprovision= to load them after wake-up"
            )
        self.llm = llm
        self.level = level
        self.wake_tags = wake_tags
        self.reprovision = reprovision

    def health(self) -> Health:
        """Able whenever built (the constructor checked the engine); says the sleep level, whether
        the engine sleeps now, and vLLM's version.

        Returns:
            ``Health(ok=True)``; its detail warns when no CUDA device is visible (bytes read 0).
        """
        # Where LLM itself has no is_sleeping(), its engine may.
        sleeping = getattr(self.llm, "is_sleeping", None) or getattr(
            getattr(self.llm, "llm_engine", None), "is_sleeping", None
        )
        state = ""
        if callable(sleeping):
            try:
                state = ", asleep" if sleeping() else ", awake"
            except Exception as err:  # a health check reports; it never stops the worker
                state = f", sleep state unknown ({type(err).__name__}: {err})"
        device = (
            ""
            if _device_free_bytes() is not None
            else "; no CUDA device visible to torch, so bytes moved read 0"
        )
        return Health(
            self.name,
            True,
            f"sleep level {self.level}{state}; {vllm_version_note(self.llm)}{device}",
        )

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Put the engine to sleep at ``level``, in a worker thread.

        Args:
            request: The job; only its id is reported.

        Returns:
            Mode ``sleep-1`` or ``sleep-2``: the device memory the sleep released, as the driver
            reports free memory (0 without CUDA).
        """
        return await asyncio.to_thread(self._sleep, request.job_id)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """Wake the engine (staged by ``wake_tags``, with ``reprovision`` after a level-2 sleep).

        Args:
            request: As for :meth:`snapshot`.

        Returns:
            Mode ``wake-up``: the device memory the engine took back.
        """
        return await asyncio.to_thread(self._wake, request.job_id)

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
        # A staged wake-up (weights first, so new weights load before the KV cache takes its
        # memory) must end with every tag awake, or the next step runs on released memory.
        rest = [t for t in MEMORY_TAGS if self.wake_tags is not None and t not in self.wake_tags]
        if rest:
            self.llm.wake_up(tags=rest)
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
        return move_report(self.name, job_id, mode, moved, started)
