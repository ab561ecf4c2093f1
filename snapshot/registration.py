"""How a job's process registers itself with the node agent on its node, and proves its job.

The agent checkpoints only processes that registered themselves: each connects to the agent's
Unix socket, names its job and presents the job's *token*. The kernel tells the agent who is on
the other end (``SO_PEERCRED``: the peer's PID, translated into the agent's PID namespace, and
its uid), so no request, remote or local, can make the agent act on a process that did not ask
for it. The token is the proof of the job: HMAC-SHA256 of the job id under the agent's key
(``agent.key`` beside the socket, or ``--key-file``), which only the agent and whoever may
read its key can compute (``timeslice agent-token JOB``); whoever launches job X's processes
hands them X's token in ``TIMESLICE_JOB_TOKEN``. A process that merely *says* it is X's (its
own ``TIMESLICE_JOB_ID``) is refused. The agent also checks, as a guard against mistakes, that
the peer was launched with ``TIMESLICE_JOB_ID`` naming the job, records its identity (PID +
start time), and forgets it when the connection closes (the process exited). A process keeps
its connection open for its lifetime and registers again if the agent restarts.

The socket is ``agent-<node>.sock`` in ``$TIMESLICE_AGENT_DIR``, else in ``/run/timeslice`` if
that folder exists (systemd's RuntimeDirectory for the agent; a hostPath volume shared by the
agent's and the jobs' pods on Kubernetes: deploy/), else in ``timeslice-agents`` in the
temporary directory. The agent uses a folder only if nobody else could have planted or swapped
what is in it (``prepare_agent_dir``), and a process sends its token only into a folder it can
trust the same way (``check_agent_dir``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
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
AGENT_KEY_ENV = "TIMESLICE_AGENT_KEY_FILE"
JOB_TOKEN_ENV = "TIMESLICE_JOB_TOKEN"
KEY_FILE_NAME = "agent.key"
_MAX_LINE = 4096
_REPLY_TIMEOUT_S = 10.0
_KEY_BYTES = 32
_TOKEN_CONTEXT = b"timeslice node-agent job token v1\0"
# Others must reach the socket (search), never put anything into the folder (write).
AGENT_DIR_MODE = 0o755
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


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


def key_path(folder: Path | None = None) -> Path:
    """The agent's key: ``$TIMESLICE_AGENT_KEY_FILE``, else ``agent.key`` in the agent folder."""
    configured = os.environ.get(AGENT_KEY_ENV)
    if configured:
        return Path(configured)
    return (folder or agent_dir()) / KEY_FILE_NAME


async def _answers(path: Path) -> bool:
    """Whether a live agent listens on the unix socket ``path`` (one left by an agent that
    died refuses connections)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 2.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class RegistrationError(Exception):
    """The process could not register with its node agent (the message says why)."""


class UnsafeAgentDirError(RegistrationError):
    """The agent's folder could have been planted or changed by someone else."""


# ------------------------------------------------------------------ the folder and the key


def _trusted_owners() -> set[int]:
    return {0, os.geteuid()}


def _check_parent(folder: Path) -> None:
    """Whoever may write the parent may rename the folder away and put their own in its place;
    a sticky parent (/tmp) lets only the folder's owner do that."""
    parent = os.stat(folder.parent)
    if parent.st_mode & _WRITABLE_BY_OTHERS and not parent.st_mode & stat.S_ISVTX:
        raise UnsafeAgentDirError(
            f"{folder.parent} may be written by others (mode {stat.filemode(parent.st_mode)}, "
            f"not sticky), so {folder} could be swapped; set {AGENT_DIR_ENV} to a folder in "
            "a parent only its owner may write"
        )


def _check_dir_stat(folder: Path, st: os.stat_result, owners: set[int]) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeAgentDirError(
            f"{folder} is a symbolic link; refusing it (someone may have planted it): remove "
            f"it, or set {AGENT_DIR_ENV} to a real folder"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeAgentDirError(f"{folder} exists and is not a folder; remove it")
    if st.st_uid not in owners:
        raise UnsafeAgentDirError(
            f"{folder} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()}) "
            f"or root: someone else made it; remove it, or set {AGENT_DIR_ENV} to a folder "
            "of your own"
        )
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise UnsafeAgentDirError(
            f"{folder} may be written by group or others (mode {stat.filemode(st.st_mode)}): "
            f"anyone could replace the agent's socket or key there; `chmod go-w {folder}`, "
            f"or set {AGENT_DIR_ENV} to a folder only its owner may write"
        )


def prepare_agent_dir(folder: Path) -> None:
    """The agent's side: create ``folder`` (mode 0755, so job processes of any uid can reach
    the socket in it) or accept an existing one only if it is a real folder of this uid or
    root that nobody else may write. Never follows a symlink, never chmods through one."""
    _check_parent(folder)
    try:
        os.mkdir(folder, AGENT_DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    _check_dir_stat(folder, os.lstat(folder), _trusted_owners())
    # Checked through the opened folder itself, so a swap after the lstat is caught too.
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _check_dir_stat(folder, os.fstat(fd), _trusted_owners())
        if created:  # the umask may have taken the search bits others need
            os.fchmod(fd, AGENT_DIR_MODE)
    finally:
        os.close(fd)


def check_agent_dir(folder: Path) -> None:
    """The job process's side, before it sends its token: the folder must be one only its
    owner may write, and that owner root, this process's uid, or someone root gave a folder
    in a parent only root may write (systemd's /run/timeslice for an agent user). A folder
    another user made in a shared temporary directory is refused."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return  # nothing listens there: connecting says so
    owners = _trusted_owners()
    parent = os.stat(folder.parent)
    if parent.st_uid == 0 and not parent.st_mode & _WRITABLE_BY_OTHERS:
        owners.add(st.st_uid)  # root placed it (or let its owner make it) there
    _check_dir_stat(folder, st, owners)
    _check_parent(folder)


def _create_key(path: Path) -> None:
    """Write a new key, whole or not at all: a second agent starting at the same time reads
    the first one's key, never a half-written file."""
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(_KEY_BYTES) + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(draft)


def load_agent_key(path: Path, *, create: bool = False) -> bytes:
    """The agent's key from ``path`` (hex, at least 32 bytes), created if ``create`` and
    missing. Refused unless a regular file of this uid or root that only its owner may read:
    a key others can read lets them make any job's token."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if not create:
            raise RegistrationError(
                f"no node-agent key at {path}: start the agent once (it creates it), or name "
                f"the agent's key file with --key-file / {AGENT_KEY_ENV}"
            ) from None
        _create_key(path)
        return load_agent_key(path)
    except OSError as err:
        raise RegistrationError(f"cannot read the node-agent key {path}: {err.strerror}") from err
    with os.fdopen(fd, "rb") as found:
        st = os.fstat(found.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeAgentDirError(f"the node-agent key {path} is not a regular file")
        if st.st_uid not in _trusted_owners():
            raise UnsafeAgentDirError(
                f"the node-agent key {path} belongs to uid {st.st_uid}, not to this process "
                f"(uid {os.geteuid()}) or root; refusing a key someone else may have made"
            )
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UnsafeAgentDirError(
                f"the node-agent key {path} may be read by group or others (mode "
                f"{stat.filemode(st.st_mode)}): they could make any job's token; "
                f"`chmod 600 {path}` (a Kubernetes Secret: defaultMode 0400)"
            )
        text = found.read(1024).decode(errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < _KEY_BYTES:
        raise RegistrationError(
            f"the node-agent key {path} is not {_KEY_BYTES} or more bytes in hex; make one "
            "with `python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return key


def job_token(key: bytes, job_id: str) -> str:
    """Job ``job_id``'s registration token under the agent key ``key``."""
    return hmac.new(key, _TOKEN_CONTEXT + job_id.encode(), hashlib.sha256).hexdigest()


def _chmod_socket(path: Path, mode: int) -> None:
    """chmod the socket just bound, never what a symlink in its place points to."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise UnsafeAgentDirError(f"{path} was replaced after the agent bound it; refusing")
        # chmod of an O_PATH descriptor's /proc link changes that very inode (as glibc's
        # fchmodat(AT_SYMLINK_NOFOLLOW) does); fchmod would change the socket, not its file.
        os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        os.close(fd)


def _peer(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """The connected process's PID (in this PID namespace; 0 if it is not visible here) and
    uid, from the kernel."""
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


class RegistrationServer:
    """The agent's side: a Unix socket where processes register for their job, proving it with
    the job's token."""

    def __init__(
        self,
        node: str,
        registry: PidRegistry,
        path: Path | None = None,
        key_file: Path | None = None,
    ) -> None:
        self.node = node
        self.registry = registry
        self.path = path or socket_path(node)
        self.key_file = key_file or key_path(self.path.parent)
        self._key = b""
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None  # the socket this agent made (another may replace it)

    async def start(self) -> None:
        try:
            self.path.parent.parent.mkdir(parents=True, exist_ok=True)
            prepare_agent_dir(self.path.parent)
            self._key = load_agent_key(self.key_file, create=True)
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    raise RegistrationError(f"{self.path} exists and is not a socket; remove it")
                if await _answers(self.path):
                    raise RegistrationError(
                        f"another node agent serves node {self.node!r} at {self.path}: stop it "
                        "first (two agents of one node would split its job processes)"
                    )
                self.path.unlink()  # left by an agent that did not exit cleanly
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
            self._inode = os.lstat(self.path).st_ino
            # Any local process may ask; what it may register is checked per connection.
            _chmod_socket(self.path, stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO)
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
                if os.lstat(self.path).st_ino == self._inode:  # not another agent's since
                    self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        identity: ProcessIdentity | None = None
        job_id = ""
        try:
            line = await asyncio.wait_for(reader.readline(), _REPLY_TIMEOUT_S)
            pid, uid = _peer(writer)
            job_id, identity = self._register(pid, line)
            await self._reply(writer, {"ok": True, "pid": identity.pid})
            log.info("job %s: process %d (uid %d) registered", job_id, identity.pid, uid)
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
            message = json.loads(line)
            job_id, token = message["job_id"], message.get("token")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError('send one JSON line: {"job_id": "...", "token": "..."}') from None
        if not isinstance(job_id, str) or not job_id:
            raise ValueError("job_id must be a non-empty string")
        if pid <= 0:
            raise ProcessMismatchError(
                "the registering process is not visible in the agent's PID namespace; run "
                "the agent in the host's PID namespace (or the job's)"
            )
        if not isinstance(token, str) or not token:
            raise ProcessMismatchError(
                f"process {pid} presented no token for job {job_id}: start it with "
                f"{JOB_TOKEN_ENV} set to the job's token (`timeslice agent-token {job_id}` "
                "where the agent's key is)"
            )
        if not hmac.compare_digest(token.encode(), job_token(self._key, job_id).encode()):
            raise ProcessMismatchError(
                f"process {pid} presented a token that is not job {job_id}'s (another job's, "
                f"or made with another agent key than {self.key_file})"
            )
        # Not a proof (a process can rewrite its own environment block), a guard against
        # launching a process for one job with another job's token.
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
    again (in the background) if the agent restarts. ``token`` proves the job
    (``$TIMESLICE_JOB_TOKEN``)."""

    def __init__(self, node: str, job_id: str, token: str, path: Path | None = None) -> None:
        self.node = node
        self.job_id = job_id
        self._token = token
        self.path = path or socket_path(node)
        self._writer: asyncio.StreamWriter | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register now; raise RegistrationError with what to do if that fails."""
        reader = await self._register()
        self._watch = asyncio.create_task(self._stay_registered(reader))

    async def _register(self) -> asyncio.StreamReader:
        try:
            # The token goes only into a folder no one but a trusted owner could have made.
            check_agent_dir(self.path.parent)
            reader, writer = await asyncio.open_unix_connection(str(self.path))
        except OSError as err:
            raise RegistrationError(
                f"no node agent listens at {self.path} ({err.strerror}): start "
                f"`timeslice agent --node {self.node}` on this node, with the same "
                f"{AGENT_DIR_ENV} as this process"
            ) from err
        writer.write(json.dumps({"job_id": self.job_id, "token": self._token}).encode() + b"\n")
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
