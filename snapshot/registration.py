"""How a job's process registers itself with the node agent on its node.

The agent checkpoints only processes that registered themselves: each connects to the agent's
Unix socket and names its job. The kernel tells the agent who is on the other end
(``SO_PEERCRED``: the peer's PID, translated into the agent's PID namespace), so no request,
remote or local, can make the agent act on a process that did not ask for it: the agent
checks that the peer was launched for the job it names (``TIMESLICE_JOB_ID`` in its launch
environment), records its identity (PID + start time), and forgets it when the connection
closes (the process exited). A process keeps its connection open for its lifetime and
registers again if the agent restarts.

The socket is ``agent-<node>.sock`` in ``$TIMESLICE_AGENT_DIR``, else in ``/run/timeslice`` if
that folder exists (systemd's RuntimeDirectory for the agent; a hostPath volume shared by the
agent's and the jobs' pods on Kubernetes: deploy/), else in ``timeslice-agents`` in the
temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

from timeslice.snapshot.processes import (
    JOB_ENV,
    PidRegistry,
    ProcessIdentity,
    ProcessMismatchError,
    launched_for_job,
)

log = logging.getLogger("timeslice.snapshot.registration")

AGENT_DIR_ENV = "TIMESLICE_AGENT_DIR"
_MAX_LINE = 4096
_REPLY_TIMEOUT_S = 10.0


RUN_DIR = Path("/run/timeslice")


def agent_dir() -> Path:
    configured = os.environ.get(AGENT_DIR_ENV)
    if configured:
        return Path(configured)
    if RUN_DIR.is_dir():
        return RUN_DIR
    return Path(tempfile.gettempdir()) / "timeslice-agents"


def socket_path(node: str) -> Path:
    return agent_dir() / f"agent-{node}.sock"


class RegistrationError(Exception):
    """The process could not register with its node agent (the message says why)."""


def _peer_pid(writer: asyncio.StreamWriter) -> int:
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return pid


class RegistrationServer:
    """The agent's side: a Unix socket where processes register for their job."""

    def __init__(self, node: str, registry: PidRegistry, path: Path | None = None) -> None:
        self.node = node
        self.registry = registry
        self.path = path or socket_path(node)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_socket():
                self.path.unlink()  # left by an agent that did not exit cleanly
            elif self.path.exists():
                raise RegistrationError(f"{self.path} exists and is not a socket; remove it")
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
            # Any local process may ask; what it may register is checked per connection.
            os.chmod(self.path, stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO)
        except OSError as err:
            raise RegistrationError(
                f"cannot listen for job processes at {self.path}: {err.strerror}; set "
                f"{AGENT_DIR_ENV} to a writable folder the job processes share"
            ) from err

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            with contextlib.suppress(OSError):
                self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        identity: ProcessIdentity | None = None
        job_id = ""
        try:
            line = await asyncio.wait_for(reader.readline(), _REPLY_TIMEOUT_S)
            job_id, identity = self._register(_peer_pid(writer), line)
            await self._reply(writer, {"ok": True, "pid": identity.pid})
            log.info("job %s: process %d registered", job_id, identity.pid)
            while await reader.read(1024):  # until the process exits (or closes it)
                pass
        except (ProcessMismatchError, ValueError) as err:
            log.warning("refused a registration: %s", err)
            await self._reply(writer, {"ok": False, "error": str(err)})
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if identity is not None:
                self.registry.unregister(job_id, identity)
                log.info("job %s: process %d left", job_id, identity.pid)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _register(self, pid: int, line: bytes) -> tuple[str, ProcessIdentity]:
        if len(line) > _MAX_LINE:
            raise ValueError("registration too long")
        try:
            job_id = json.loads(line)["job_id"]
        except (ValueError, KeyError, TypeError):
            raise ValueError('send one JSON line: {"job_id": "..."}') from None
        if not isinstance(job_id, str) or not job_id:
            raise ValueError("job_id must be a non-empty string")
        launched_for = launched_for_job(pid)
        if launched_for != job_id:
            raise ProcessMismatchError(
                f"process {pid} was not launched for job {job_id} ({JOB_ENV}={launched_for!r})"
            )
        identity = ProcessIdentity.of(pid)
        self.registry.register(job_id, identity)
        return job_id, identity

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, answer: dict[str, object]) -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()


class AgentRegistration:
    """The process's side: registered with its node agent for as long as it lives; registered
    again (in the background) if the agent restarts."""

    def __init__(self, node: str, job_id: str, path: Path | None = None) -> None:
        self.node = node
        self.job_id = job_id
        self.path = path or socket_path(node)
        self._writer: asyncio.StreamWriter | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register now; raise RegistrationError with what to do if that fails."""
        reader = await self._register()
        self._watch = asyncio.create_task(self._stay_registered(reader))

    async def _register(self) -> asyncio.StreamReader:
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.path))
        except OSError as err:
            raise RegistrationError(
                f"no node agent listens at {self.path} ({err.strerror}): start "
                f"`timeslice agent --node {self.node}` on this node, with the same "
                f"{AGENT_DIR_ENV} as this process"
            ) from err
        writer.write(json.dumps({"job_id": self.job_id}).encode() + b"\n")
        await writer.drain()
        try:
            answer = json.loads(await asyncio.wait_for(reader.readline(), _REPLY_TIMEOUT_S))
        except (TimeoutError, ValueError) as err:
            writer.close()
            raise RegistrationError(f"the node agent at {self.path} did not answer") from err
        if not answer.get("ok"):
            writer.close()
            raise RegistrationError(f"the node agent refused this process: {answer.get('error')}")
        self._writer = writer
        return reader

    async def _stay_registered(self, reader: asyncio.StreamReader) -> None:
        delay = 0.5
        while True:
            while await reader.read(1024):  # until the agent goes away
                pass
            log.warning("node agent %s went away; registering again", self.node)
            while True:
                await asyncio.sleep(delay)
                try:
                    reader = await self._register()
                    delay = 0.5
                    break
                except RegistrationError as err:
                    delay = min(delay * 2, 10.0)
                    log.warning("%s; retrying in %.1f s", err, delay)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
