"""The stack harness (`timeslice.cli.stack`) the benchmarks and tests start processes with, and
what a job process pays at start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from timeslice.cli import warm_start
from timeslice.cli.services import ServiceStartError
from timeslice.cli.stack import JobWorker, Stack


def test_job_workers_start_side_by_side_and_one_that_fails_stops_them_all(
    address: str, tmp_path: Path
) -> None:
    good, bad = f"good-{uuid.uuid4().hex[:6]}", f"bad-{uuid.uuid4().hex[:6]}"
    with Stack(tmp_path, address=address).start() as stack:
        a, b = stack.job_workers(JobWorker((good,)), JobWorker((f"{good}-2",)))
        assert a.poll() is None and b.poll() is None and stack.procs == [a, b]
        stack.stop(a)
        assert a.returncode is not None and stack.procs == [b]
        with pytest.raises(ServiceStartError, match=f"see {tmp_path / bad}.log"):
            stack.job_workers(JobWorker((f"{good}-3",)), JobWorker((bad,), "no-such-workload"))
        assert stack.procs == [b]  # the one started beside the failure was stopped with it
        assert "unknown workload" in (tmp_path / f"{bad}.log").read_text()
    assert b.returncode is not None  # the stack stopped what it started


def test_a_stack_with_its_own_server_stops_it(tmp_path: Path) -> None:
    with Stack(tmp_path).start() as stack:
        worker = stack.control_worker()
        assert stack.server is not None and stack.server.running
        server = stack.server
    assert worker.returncode is not None and not server.running
    assert (tmp_path / "worker.log").exists() and (tmp_path / "server.log").exists()


@pytest.mark.parametrize("torch_first", [False, True], ids=["torch-later", "torch-already"])
def test_threads_limit_torch_without_importing_it(torch_first: bool) -> None:
    """`timeslice job worker --threads N` limits torch's threads whether the workload imported
    torch already or imports it later, and never imports it itself: a `simulated` job process
    does not pay torch's import."""
    probe = (
        "import sys\n"
        + ("import torch\n" if torch_first else "")
        + "from timeslice.cli.main import _limit_torch_threads\n"
        "_limit_torch_threads(1)\n"
        f"assert ('torch' in sys.modules) is {torch_first}\n"
        "import torch\n"
        "print(torch.get_num_threads())\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "1"


def test_a_warm_start_is_a_process_of_its_own_with_the_callers_environment(
    address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `timeslice.cli.warm_start` forks (the tests' services and contenders): its own pid,
    the environment and directory of the moment it is started, exit codes and signals as a
    subprocess has them."""
    if not warm_start.enabled():  # tests/conftest.py turns it on
        pytest.skip("TIMESLICE_TESTS_COLD=1: the tests start their processes cold")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIMESLICE_TEST_MARK", "seen")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys\n"
        "print(os.getpid(), os.getcwd(), os.environ['TIMESLICE_TEST_MARK'], sys.argv[1:])\n"
        "sys.exit(3)\n"
    )
    done = warm_start.WarmProcess(["a", "b"], tmp_path / "probe.log", script=probe)
    assert done.stdout is not None
    line = done.stdout.readline().strip().split(maxsplit=3)
    assert done.wait(60) == 3 and done.returncode == 3
    assert int(line[0]) == done.pid != os.getpid()
    assert line[1:] == [str(tmp_path), "seen", "['a', 'b']"]
    job = f"warm-{uuid.uuid4().hex[:6]}"
    with Stack(tmp_path, address=address).start() as stack:
        proc = stack.job_worker(job)
        assert isinstance(proc, warm_start.WarmProcess)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL


def test_a_warm_start_has_torch_imported_and_its_threads_work(tmp_path: Path) -> None:
    """The fork server imported torch (`timeslice.cli.warm_torch`) holding no other thread, so
    a forked child uses torch at once, on as many threads as it sets, without hanging on a pool
    copied half-alive; numpy's one-thread setting for the import is not left in its
    environment."""
    if not warm_start.enabled():
        pytest.skip("TIMESLICE_TESTS_COLD=1: the tests start their processes cold")
    pytest.importorskip("torch")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys\n"
        "print('torch' in sys.modules, 'OPENBLAS_NUM_THREADS' in os.environ)\n"
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "a = torch.ones(512, 512)\n"
        "print(torch.get_num_threads(), float((a @ a).sum()), len(os.listdir('/proc/self/task')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    done = warm_start.WarmProcess([], tmp_path / "probe.log", script=probe, env=env)
    assert done.wait(60) == 0, (tmp_path / "probe.log").read_text()
    assert done.stdout is not None
    preloaded, threads = done.stdout.read().split("\n")[:2]
    assert preloaded == "True False"
    count, total, tasks = threads.split()
    assert count == "2" and float(total) == 512.0**3 and int(tasks) >= 2
