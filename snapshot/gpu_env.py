"""What GPU stack this machine has, and what to install for it.

The NVIDIA driver is probed without cuda-python (``/proc/driver/nvidia/version`` for the kernel
module, ``cuDriverGetVersion`` from ``libcuda.so.1`` through ctypes), so a missing or mismatched
cuda-bindings can still be explained in terms of the driver that is there. Package versions come
from installed metadata, without importing the packages (importing vLLM takes seconds).

``python -m timeslice.snapshot.gpu_env`` prints one ``key: value`` line per fact
(``tests/gpu/run.sh`` records it first).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

# The checkpoint API (cuCheckpointProcess*) first shipped with CUDA 12.8, driver 570.
MIN_CUDA_VERSION = 12080
# cuda-bindings' major version is the CUDA major it is built for: 12.x works on any driver from
# 570 on (drivers run older CUDA majors), 13.x needs a CUDA 13 driver (580.65 or newer).
CUDA_EXTRAS = {
    "cuda": "cuda-bindings>=12.8,<13",
    "cuda13": "cuda-bindings>=13,<14",
}


@dataclass(frozen=True)
class DriverInfo:
    """The NVIDIA driver as seen without cuda-python."""

    kernel_module: str | None  # e.g. "570.86.15"; None where /proc does not show one
    cuda_version: int | None  # cuDriverGetVersion: 1000 * major + 10 * minor, e.g. 12080
    error: str | None  # why libcuda could not be loaded or asked

    @property
    def cuda(self) -> str | None:
        return None if self.cuda_version is None else cuda_text(self.cuda_version)

    def describe(self) -> str:
        if self.cuda_version is None:
            module = f" (kernel module {self.kernel_module})" if self.kernel_module else ""
            return f"no usable NVIDIA driver{module}: {self.error}"
        return f"NVIDIA driver {self.kernel_module or '(version unknown)'} (CUDA {self.cuda})"


def cuda_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def kernel_module_version() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return found.group(1) if found else None


def probe_driver() -> DriverInfo:
    kernel = kernel_module_version()
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return DriverInfo(kernel, None, str(err))
    version = ctypes.c_int(0)
    # cuDriverGetVersion needs no cuInit: it only reads what the library supports.
    status = libcuda.cuDriverGetVersion(ctypes.byref(version))
    if status != 0:
        return DriverInfo(kernel, None, f"cuDriverGetVersion returned CUresult {status}")
    return DriverInfo(kernel, version.value, None)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: "12.9.10" -> (12, 9, 10)."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in found.group(0).split(".")) if found else ()


def install_advice(driver: DriverInfo, bindings: str | None = None) -> str:
    """What to install for the cuda-checkpoint backend, given the driver and bindings there."""
    release = version_tuple(bindings) if bindings else ()
    if driver.cuda_version is None:
        if release[:1] == (12,) and release[:2] >= (12, 8):
            return f"install the NVIDIA driver 570 or newer (cuda-bindings {bindings} is ready)"
        if release[:1] == (13,):
            return (
                f"install the NVIDIA driver 580.65 or newer for cuda-bindings {bindings}, or "
                "a driver 570 or newer with pip install 'timeslice[cuda]'"
            )
        return (
            "install the NVIDIA driver 570 or newer, then pip install 'timeslice[cuda]' "
            "(or 'timeslice[cuda13]' with a driver 580.65 or newer)"
        )
    if driver.cuda_version < MIN_CUDA_VERSION:
        return (
            f"this driver supports CUDA {driver.cuda} and has no checkpoint API: upgrade the "
            "NVIDIA driver to 570 (CUDA 12.8) or newer"
        )
    if driver.cuda_version < 13000:
        return (
            f"pip install 'timeslice[cuda]' ({CUDA_EXTRAS['cuda']}; cuda-bindings 13 needs a "
            "driver 580.65 or newer)"
        )
    return (
        f"pip install 'timeslice[cuda]' ({CUDA_EXTRAS['cuda']}) or 'timeslice[cuda13]' "
        f"({CUDA_EXTRAS['cuda13']})"
    )


def bindings_misfit(bindings: str, driver: DriverInfo) -> str | None:
    """Why this cuda-bindings version cannot drive the checkpoint API here, or None."""
    release = version_tuple(bindings)
    if release[:2] < (12, 8):
        return f"cuda-bindings {bindings} predates the checkpoint API (12.8)"
    if driver.cuda_version is not None and release[0] > driver.cuda_version // 1000:
        return (
            f"cuda-bindings {bindings} needs a CUDA {release[0]} driver, and this driver "
            f"supports CUDA {driver.cuda}"
        )
    return None


def checkpoint_blockers(bindings: str | None, driver: DriverInfo) -> list[str]:
    """What stands between this machine and the checkpoint API; empty when nothing does."""
    blockers = []
    if driver.cuda_version is None:
        blockers.append(driver.describe())
    elif driver.cuda_version < MIN_CUDA_VERSION:
        blockers.append(f"{driver.describe()} has no checkpoint API")
    if bindings is None:
        blockers.append("cuda-bindings is not installed")
    else:
        misfit = bindings_misfit(bindings, driver)
        if misfit:
            blockers.append(misfit)
    return blockers


def stack_report() -> dict[str, str]:
    """One line per fact about the GPU stack, for people and for tests/gpu/run.sh."""
    driver = probe_driver()
    bindings = package_version("cuda-bindings")
    report = {
        "nvidia kernel module": driver.kernel_module or "none",
        "driver CUDA version": driver.cuda or f"none ({driver.error})",
        "cuda-bindings": bindings or "not installed",
        "cuda-python": package_version("cuda-python") or "not installed",
        "torch": package_version("torch") or "not installed",
        "vllm": package_version("vllm") or "not installed",
    }
    if report["torch"] != "not installed":
        try:
            import torch

            report["torch CUDA build"] = str(torch.version.cuda)
            report["torch CUDA available"] = str(torch.cuda.is_available())
            if torch.cuda.is_available():
                report["device"] = torch.cuda.get_device_name(0)
        except Exception as err:  # a broken torch install is a fact to report, not a crash
            report["torch error"] = f"{type(err).__name__}: {err}"
    blockers = checkpoint_blockers(bindings, driver)
    report["cuda-checkpoint"] = (
        f"unavailable: {'; '.join(blockers)}. To use it: {install_advice(driver, bindings)}"
        if blockers
        else "driver and bindings fit"
    )
    return report


def main() -> None:
    for key, value in stack_report().items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
