"""A stack of real processes on one Temporal server: the dev server (or one already running),
control workers and job workers, started together and stopped together, each logging to a file
in one folder.

What the benchmarks (bench/), the demo and the tests start, in one place: they import it as
``timeslice.cli.stack`` (beside ``services``, which starts one process), so a test needs no
bench script and no bench script copies another's start-up. Use it as a context manager::

    with Stack(workdir).start() as stack:
        stack.control_worker()
        stack.job_workers(JobWorker(("job-a",), "simulated"), JobWorker(("job-b",), "simulated"))
        ...  # stack.address is the server's

Everything it started is stopped on the way out, the last started first, then the server.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.cli.services import (
    Service,
    ServiceProcess,
    start_services,
    stop_service,
    stop_services,
)

#: What a control worker's first line says once it polls (`timeslice worker`).
CONTROL_WORKER_READY = "control worker on task queue"


def job_worker_ready(job: str, rank: int = 0) -> str:
    """What a job process's first line says once it serves ``job``'s rank ``rank``."""
    return f"job {job} rank {rank}"


@dataclass(frozen=True)
class JobWorker:
    """One `timeslice job worker` process: the jobs it serves (``--job-id`` each), its
    workload, and any further arguments (``--rank``, ``--threads``, ``--checkpoint-dir``...)."""

    jobs: tuple[str, ...]
    workload: str = "simulated"
    args: tuple[str, ...] = ()
    #: The log's file name in the stack's folder (default: the first job's, ``JOB.log``).
    log: str | None = None

    def __post_init__(self) -> None:
        if not self.jobs:
            raise ValueError("a job worker serves at least one job")


class Stack:
    """A Temporal server and the `timeslice` processes started on it.

    Args:
        workdir: the folder for the logs (``server.log``, ``worker.log``, ``JOB.log``), the
            server's database (``temporal.db``) and the job processes' checkpoints
            (``checkpoints/``); created if missing.
        server: the embedded server to start and stop (its own ports, Web UI, database);
            by default one on a free port, no Web UI, its database ``workdir/temporal.db``.
        address: a server already running instead: the stack starts none and stops none.
        dynamic_config: the default server's dynamic config values, over the embedded defaults.
        db: the default server's database file (default ``workdir/temporal.db``).
        cli_args: arguments before every command (``-v`` logs at debug level).
        append: append to existing logs (default) or truncate them.
        echo: print each process's ready line as it comes.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        server: EmbeddedServer | None = None,
        address: str | None = None,
        dynamic_config: dict[str, Any] | None = None,
        db: Path | None = None,
        cli_args: Sequence[str] = (),
        append: bool = True,
        echo: bool = False,
    ) -> None:
        self.workdir = workdir
        if (server is not None or address is not None) and (dynamic_config or db):
            raise ValueError("dynamic_config and db configure the stack's default server")
        if server is not None and address is not None:
            raise ValueError("a stack has one server: give server or address, not both")
        if server is None and address is None:
            server = EmbeddedServer(
                port=free_port(),
                ui_port=None,
                db=db or workdir / "temporal.db",
                log_path=workdir / "server.log",
                dynamic_config=dynamic_config,
            )
        self.server = server
        self._address = address
        self.cli_args = tuple(cli_args)
        self.append = append
        self.echo = echo
        self.procs: list[ServiceProcess] = []

    @property
    def address(self) -> str:
        """The server's ``host:port``."""
        return self.server.address if self.server is not None else str(self._address)

    @property
    def server_pid(self) -> int | None:
        """The embedded server's process id while it runs (None for a server not ours)."""
        process = None if self.server is None else self.server._process
        return None if process is None else process.pid

    def start(self) -> Stack:
        """Start the server (unless the stack was given one); returns the stack."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.server is not None:
            self.server.start()
        return self

    def control_worker(
        self, *args: str, log: str = "worker.log", sandboxed: bool = False
    ) -> ServiceProcess:
        """Start `timeslice worker` (with ``args``; ``--sandboxed`` with ``sandboxed``) and wait
        until it polls."""
        flags = ("--sandboxed",) if sandboxed else ()
        service = Service(
            (*self.cli_args, "worker", "--address", self.address, *args, *flags),
            CONTROL_WORKER_READY,
            self.workdir / log,
        )
        return self._start([service])[0]

    def job_workers(self, *workers: JobWorker) -> list[ServiceProcess]:
        """Start every one of ``workers`` at once and wait until each serves its first job
        (their start-ups overlap: importing torch and connecting take seconds each)."""
        services = []
        for worker in workers:
            rank = _rank(worker.args)
            args = [*self.cli_args, "job", "worker", "--address", self.address]
            for job in worker.jobs:
                args += ["--job-id", job]
            args += ["--workload", worker.workload]
            if "--checkpoint-dir" not in worker.args:
                args += ["--checkpoint-dir", str(self.workdir / "checkpoints")]
            args += worker.args
            log = self.workdir / (worker.log or f"{worker.jobs[0]}.log")
            services.append(Service(tuple(args), job_worker_ready(worker.jobs[0], rank), log))
        return self._start(services)

    def job_worker(self, job: str, workload: str = "simulated", *args: str) -> ServiceProcess:
        """Start one job process serving ``job`` and wait until it serves."""
        return self.job_workers(JobWorker((job,), workload, args))[0]

    def adopt(self, *procs: ServiceProcess) -> list[ServiceProcess]:
        """Stop ``procs`` (started some other way: clients, contenders) with the stack."""
        self.procs += procs
        return list(procs)

    def _start(self, services: list[Service]) -> list[ServiceProcess]:
        procs = start_services(services, append=self.append, echo=self.echo)
        self.procs += procs
        return procs

    def stop(self, proc: ServiceProcess) -> None:
        """Stop one process the stack started (SIGTERM, then SIGKILL after 20 s)."""
        stop_service(proc)
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        """Stop every process, the last started first, then the server (if the stack's)."""
        procs, self.procs = self.procs[::-1], []
        try:
            stop_services(procs)
        finally:
            if self.server is not None:
                self.server.stop()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rank(args: Sequence[str]) -> int:
    """The ``--rank`` among a job worker's arguments (default 0)."""
    for flag, value in itertools.pairwise(args):
        if flag == "--rank":
            return int(value)
    return 0
