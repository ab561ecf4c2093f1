"""Fixtures: a real Temporal dev server and a real control-worker process for the session, and
a stack for the processes a test starts on it (`timeslice.cli.stack`, as the benchmarks use)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice import TimeSliceOrchestratorClient
from timeslice.cli import warm_start
from timeslice.cli.server import EmbeddedServer
from timeslice.cli.services import start_service
from timeslice.cli.services import stop_service as stop_process  # noqa: F401 (the tests import it here)
from timeslice.cli.stack import CONTROL_WORKER_READY, Stack

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
_exit_status: list[int] = []


UNIT_TESTS = Path(__file__).resolve().parent / "unit"
# The longest files first, longest first: `--dist loadfile` hands a whole file to one worker,
# and a long file started last runs on alone while the other workers stand idle (xdist's own
# order, most tests first, put most of these last). Ranked by their tests' summed durations in
# `make test --durations` runs; a file not named here comes after them, the unit tests
# (milliseconds each, many small files) last, where they fill the workers' ends.
LONGEST_FILES = (
    "test_rl_jobs.py",
    "test_demo.py",
    "test_trl.py",
    "test_lease_fencing.py",
    "test_async_jobs.py",
    "test_soak.py",
    "test_carried_state_server.py",
    "test_pool_moves.py",
    "test_client_api.py",
    "test_late_grants.py",
    "test_group_protocol.py",
    "test_grpo_toy.py",
    "test_release_then_die.py",
    "test_status_utilization.py",
    "test_phase_aware_jobs.py",
    "unit/test_state_budget.py",
    "test_deploy_temporal.py",
    "test_grpo_toy_async.py",
    "test_plan_profile.py",
    "test_node_agent.py",
    "test_jax_jobs.py",
    "test_control_workers.py",
    "test_report.py",
    "test_workflow_requesters.py",
    "test_hf_grpo.py",
    "test_durability.py",
    "unit/test_group_model.py",
)
TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    # Keep the order below: xdist would otherwise reorder files by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # `timeslice` services (job workers, control workers, agents) forked from a process that
    # imported them: a second of CPU each saved, hundreds of times (timeslice.cli.warm_start).
    # TIMESLICE_TESTS_COLD=1 starts each as `python -m timeslice.cli`, as a user does.
    if os.environ.get("TIMESLICE_TESTS_COLD") != "1":
        warm_start.enable()


def _file_rank(item: pytest.Item) -> tuple[int, int]:
    path = Path(str(item.fspath))
    name = path.relative_to(TESTS).as_posix() if TESTS in path.parents else path.name
    if name in LONGEST_FILES:
        return (0, LONGEST_FILES.index(name))
    return (2 if UNIT_TESTS in path.parents else 1, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test `unit` (tests/unit: no server, no process, milliseconds) or `process`
    (real servers and processes), so either set runs alone (`pytest -m unit`); `gpu` tests run
    only where CUDA is present (tests/gpu/run.sh on a lent device). Order the files longest
    first (a stable sort: a file's tests stay together, in their order)."""
    items.sort(key=_file_rank)
    for item in items:
        unit = UNIT_TESTS in Path(str(item.fspath)).parents
        item.add_marker(pytest.mark.unit if unit else pytest.mark.process)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Torch in a pytest worker (the tests that train in-process) runs on one thread, as the
    job processes do (`--threads 1`). By default it takes a thread per core, and three
    workers beside their servers on two cores spin those threads against each other: the
    30-step async grpo-toy test took 21.8 CPU-s alone on two threads, 13.6 on one (and 35
    in the full suite). Set before the item's fixtures, module-scoped ones included."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit with pytest's status, skipping interpreter teardown.

    The Temporal SDK's native threads can crash a finished process during interpreter
    finalization (temporalio/sdk-python#300); the report is printed by now.
    """
    if _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def start_worker(address: str, log: Path) -> subprocess.Popen:
    """Start `timeslice worker` and wait until it says it is serving."""
    return start_service(["worker", "--address", address], CONTROL_WORKER_READY, log)


@pytest.fixture(scope="session")
def session_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """This pytest process's own server (each xdist worker has one)."""
    with Stack(tmp_path_factory.mktemp("temporal")).start() as stack:
        yield stack


@pytest.fixture(scope="session")
def server(session_stack: Stack) -> EmbeddedServer:
    assert session_stack.server is not None
    return session_stack.server


@pytest.fixture(scope="session")
def worker(session_stack: Stack) -> Iterator[None]:
    proc = session_stack.control_worker()
    yield
    session_stack.stop(proc)


@pytest.fixture
def address(server: EmbeddedServer, worker: None) -> str:
    return server.address


@pytest.fixture
def stack(address: str, tmp_path: Path) -> Iterator[Stack]:
    """The processes this test starts on the session's server (job workers, more control
    workers), their logs in its tmp_path; stopped when it ends."""
    with Stack(tmp_path, address=address).start() as test_stack:
        yield test_stack


@pytest.fixture
def group() -> str:
    return f"g-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_client(address: str) -> Iterator:
    made: list[TimeSliceOrchestratorClient] = []

    def make(**kwargs) -> TimeSliceOrchestratorClient:
        client = TimeSliceOrchestratorClient(target=address, **kwargs).connect()
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
