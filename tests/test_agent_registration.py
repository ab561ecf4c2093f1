"""The node agent's registration socket, its folder and its key, without Temporal: what the
agent refuses to use, and what a job process refuses to send its token into.

Real folders, a real Unix socket and real registering processes. Another uid's folder is
made with ``os.chown`` (these tests run as root where they need it, and skip otherwise).
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice.snapshot.processes import JOB_ENV, PidRegistry
from timeslice.snapshot.registration import (
    KEY_FILE_NAME,
    AgentRegistration,
    RegistrationError,
    RegistrationServer,
    UnsafeAgentDirError,
    _chmod_socket,
    check_agent_dir,
    job_token,
    load_agent_key,
    prepare_agent_dir,
)

OTHER_UID = 54321
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def shared_tmp(tmp_path: Path) -> Path:
    """A stand-in for the shared temporary directory: world-writable and sticky, as /tmp."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)
    yield
    os.umask(old)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_agent_creates_its_folder_0755_whatever_the_umask(shared_tmp, umask_077):
    folder = shared_tmp / "timeslice-agents"
    prepare_agent_dir(folder)
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert mode_of(folder) == 0o755  # others may reach the socket, never write beside it
    prepare_agent_dir(folder)  # its own folder is accepted again (a restarted agent)


@needs_root
def test_agent_refuses_a_folder_another_uid_made(shared_tmp):
    folder = shared_tmp / "timeslice-agents"
    folder.mkdir(mode=0o755)
    os.chown(folder, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeAgentDirError, match=f"belongs to uid {OTHER_UID}.*someone else"):
        prepare_agent_dir(folder)
    assert os.lstat(folder).st_uid == OTHER_UID  # left as it was


def test_agent_refuses_a_folder_others_may_write_and_leaves_its_mode(shared_tmp):
    folder = shared_tmp / "timeslice-agents"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafeAgentDirError, match=r"written by group or others \(mode drwxrwxrwx"):
        prepare_agent_dir(folder)
    assert mode_of(folder) == 0o777  # refused, not "fixed" with a chmod
    folder.chmod(0o775)
    with pytest.raises(UnsafeAgentDirError, match="chmod go-w"):
        prepare_agent_dir(folder)


def test_agent_refuses_a_symlink_planted_as_its_folder(shared_tmp, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    folder = shared_tmp / "timeslice-agents"
    folder.symlink_to(target)
    with pytest.raises(UnsafeAgentDirError, match="is a symbolic link; refusing it"):
        prepare_agent_dir(folder)
    assert mode_of(target) == 0o700 and list(target.iterdir()) == []  # never followed


def test_agent_refuses_a_folder_in_a_parent_others_may_swap(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)  # world-writable, not sticky: anyone may rename the folder away
    with pytest.raises(UnsafeAgentDirError, match="not sticky"):
        prepare_agent_dir(parent / "timeslice-agents")
    assert not (parent / "timeslice-agents").exists()


def test_agent_refuses_a_file_in_place_of_its_folder(shared_tmp):
    (shared_tmp / "timeslice-agents").write_text("")
    with pytest.raises(UnsafeAgentDirError, match="is not a folder"):
        prepare_agent_dir(shared_tmp / "timeslice-agents")


def test_socket_chmod_never_follows_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("")
    victim.chmod(0o600)
    planted = tmp_path / "agent-n.sock"
    planted.symlink_to(victim)
    with pytest.raises(UnsafeAgentDirError, match="was replaced after the agent bound it"):
        _chmod_socket(planted, 0o777)
    assert mode_of(victim) == 0o600


def test_agent_key_is_made_private_and_refused_when_others_can_read_it(tmp_path, umask_077):
    path = tmp_path / KEY_FILE_NAME
    with pytest.raises(RegistrationError, match="no node-agent key at"):
        load_agent_key(path)
    key = load_agent_key(path, create=True)
    assert len(key) == 32 and mode_of(path) == 0o600
    assert load_agent_key(path, create=True) == key  # kept across restarts
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE_NAME]  # no draft left behind
    path.chmod(0o640)
    with pytest.raises(UnsafeAgentDirError, match="may be read by group or others"):
        load_agent_key(path)
    path.chmod(0o600)
    path.write_text("abcd\n")
    with pytest.raises(RegistrationError, match="not 32 or more bytes in hex"):
        load_agent_key(path)


@needs_root
def test_agent_key_of_another_uid_is_refused(tmp_path):
    path = tmp_path / KEY_FILE_NAME
    load_agent_key(path, create=True)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeAgentDirError, match=f"belongs to uid {OTHER_UID}"):
        load_agent_key(path)


def test_tokens_differ_per_job_and_per_key():
    a, b = b"a" * 32, b"b" * 32
    assert job_token(a, "j1") == job_token(a, "j1")
    assert len({job_token(a, "j1"), job_token(a, "j2"), job_token(b, "j1")}) == 3


@needs_root
def test_job_process_sends_no_token_into_a_folder_another_uid_made_in_shared_tmp(shared_tmp):
    """A squatter who made the agent's folder in /tmp before the agent could listen there and
    collect tokens: the job process refuses to connect."""
    folder = shared_tmp / "timeslice-agents"
    folder.mkdir(mode=0o755)
    os.chown(folder, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeAgentDirError, match=f"belongs to uid {OTHER_UID}"):
        check_agent_dir(folder)
    registration = AgentRegistration("n", "j", "token", path=folder / "agent-n.sock")
    with pytest.raises(UnsafeAgentDirError):
        asyncio.run(registration.start())
    # Root placed it in a folder only root may write (systemd's /run/timeslice for an agent
    # user): that owner is trusted.
    os.chmod(shared_tmp, 0o755)
    check_agent_dir(folder)


def test_job_process_sends_no_token_into_a_writable_or_symlinked_folder(shared_tmp, tmp_path):
    folder = shared_tmp / "timeslice-agents"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafeAgentDirError, match="written by group or others"):
        check_agent_dir(folder)
    folder.rmdir()
    folder.symlink_to(tmp_path)
    with pytest.raises(UnsafeAgentDirError, match="symbolic link"):
        check_agent_dir(folder)


REGISTER = """
import asyncio, sys
from pathlib import Path
from timeslice.snapshot.registration import AgentRegistration, RegistrationError

async def main():
    registration = AgentRegistration("n", sys.argv[2], sys.argv[3], path=Path(sys.argv[1]))
    try:
        await registration.start()
    except RegistrationError as err:
        print("refused:", err, flush=True)
        return
    print("registered", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await registration.close()

asyncio.run(main())
"""


def test_registration_over_a_real_socket_needs_the_jobs_token(shared_tmp, umask_077):
    """The agent in its own folder in a shared temp dir; real processes register, each
    launched for job "j1": only the one with j1's token is recorded, and it is forgotten when
    it exits."""
    folder = shared_tmp / "timeslice-agents"
    registry = PidRegistry()

    async def scenario() -> tuple[list[str], list[str | None], str | None]:
        server = RegistrationServer("n", registry, path=folder / "agent-n.sock")
        await server.start()
        try:
            assert mode_of(folder) == 0o755 and mode_of(server.path) == 0o777
            assert mode_of(folder / KEY_FILE_NAME) == 0o600
            key = load_agent_key(folder / KEY_FILE_NAME)
            env = {**os.environ, JOB_ENV: "j1"}
            answers, owners = [], []
            for token in ("forged", job_token(key, "j2"), job_token(key, "j1")):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", REGISTER, str(server.path), "j1", token,
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                )  # fmt: skip
                assert proc.stdout is not None and proc.stdin is not None
                answers.append((await proc.stdout.readline()).decode().strip())
                owners.append(registry.owner_of(proc.pid))  # while it is alive
                proc.stdin.close()
                await proc.wait()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while registry.owner_of(proc.pid) is not None and loop.time() < deadline:
                await asyncio.sleep(0.05)  # until the agent reads the closed connection
            return answers, owners, registry.owner_of(proc.pid)
        finally:
            await server.close()

    answers, owners, after_exit = asyncio.run(scenario())
    assert answers[0].startswith("refused:") and "is not job j1's" in answers[0]
    assert answers[1].startswith("refused:") and "is not job j1's" in answers[1]
    assert answers[2] == "registered"
    assert owners == [None, None, "j1"] and after_exit is None


def test_a_second_agent_of_a_node_is_refused_and_never_removes_the_firsts_socket(shared_tmp):
    """Two agents of one node started on one host (an overlapping restart): the second is
    refused while the first serves; a socket left by an agent that died is taken over; and an
    agent that closes removes its own socket only, never one another agent made since."""
    import socket as sockets

    folder = shared_tmp / "timeslice-agents"
    path = folder / "agent-n.sock"

    async def scenario() -> None:
        first = RegistrationServer("n", PidRegistry(), path=path)
        await first.start()
        second = RegistrationServer("n", PidRegistry(), path=path)
        with pytest.raises(RegistrationError, match="another node agent serves node 'n'"):
            await second.start()
        assert path.exists()  # the first's socket is still there
        await first.close()
        assert not path.exists()
        # A socket with nobody listening: what an agent that died leaves behind.
        stale = sockets.socket(sockets.AF_UNIX)
        stale.bind(str(path))
        stale.close()
        await second.start()  # takes it over
        # Its socket removed by hand while it runs, and a new agent started: the older one's
        # exit leaves the new one's socket in place.
        path.unlink()
        third = RegistrationServer("n", PidRegistry(), path=path)
        await third.start()
        await second.close()
        assert path.exists()
        await third.close()
        assert not path.exists()

    asyncio.run(scenario())
