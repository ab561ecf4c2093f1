"""The README's quick paths run verbatim, in order, against a real server.

Every shell block the README marks ``<!-- readme-test: quick path -->`` (an HTML comment: the
rendered README does not show it) runs here as a user would run it, from a fresh folder that
has the repository's ``.venv`` and ``examples`` (links): the server, the control worker and
the job processes in the background (each "in a terminal of its own"), the rest to the end,
each block with ``bash -e``. What the test changes, and the reader never needs to: the server's
ports (the README's 7233 / 8233 may be taken here) and so TEMPORAL_ADDRESS for every other
block, and ``--epochs 30`` of ``job start`` (2 here, to stay lean). A block marked
``<!-- readme-test: output of the block above -->`` is that block's output, as printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from timeslice.cli.server import free_port

from tests.helpers import REPO, wait_for

README = REPO / "README.md"
QUICK_PATH = "<!-- readme-test: quick path -->"
OUTPUT = "<!-- readme-test: output of the block above -->"
# What each long-running command prints once it serves (its first lines).
SERVICES = {
    ("timeslice", "server"): "Temporal server ready",
    ("timeslice", "worker"): "control worker on task queue",
    ("timeslice", "job"): "rank 0: workload",  # `job worker`; `job start` is no service
}
EPOCHS_HERE = 2


@dataclass
class Block:
    code: str
    line: int
    output: str | None = None

    @property
    def words(self) -> list[str]:
        first = self.code.strip().splitlines()[0].split()
        return [Path(first[0]).name, *first[1:]]

    @property
    def service(self) -> str | None:
        words = self.words
        key = (words[0], words[1]) if len(words) > 1 else None
        if key == ("timeslice", "job") and words[2] != "worker":
            return None
        return SERVICES.get(key) if key else None  # type: ignore[arg-type]


def quick_path_blocks(text: str) -> list[Block]:
    """The marked blocks in the README's order, each with its shown output, if any."""
    fence = re.compile(r"```[a-z]*\n(.*?)```", re.S)
    blocks: list[Block] = []
    for mark in re.finditer(re.escape(QUICK_PATH) + "|" + re.escape(OUTPUT), text):
        found = fence.search(text, mark.end())
        assert found is not None and text[mark.end() : found.start()].strip() == "", (
            f"README line {text.count(chr(10), 0, mark.start()) + 1}: a mark not followed by "
            "a code block"
        )
        line = text.count("\n", 0, found.start()) + 1
        if mark.group() == OUTPUT:
            assert blocks, f"README line {line}: an output with no block above"
            blocks[-1].output = found.group(1)
        else:
            blocks.append(Block(found.group(1), line))
    return blocks


@dataclass
class Service:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)


def test_readme_quick_path_blocks_are_found() -> None:
    blocks = quick_path_blocks(README.read_text())
    commands = [" ".join(b.words[:3]) for b in blocks]
    for needed in ("timeslice server", "timeslice worker", "timeslice job worker",
                   "timeslice job start", "temporal workflow start", "timeslice groups",
                   "timeslice plan examples/profiles/"):  # fmt: skip
        assert any(c.startswith(needed) for c in commands), (needed, commands)


def test_the_readme_quick_paths_run_verbatim_in_order(tmp_path: Path) -> None:
    started = time.monotonic()
    port, ui_port = free_port(), free_port()
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"}
    env.pop("TEMPORAL_NAMESPACE", None)
    services: list[Service] = []
    try:
        for block in quick_path_blocks(README.read_text()):
            code = block.code
            if block.words[:2] == ["timeslice", "server"]:
                code = code.replace(
                    "timeslice server", f"timeslice server --port {port} --ui-port {ui_port}", 1
                )
            if block.words[:3] == ["timeslice", "job", "start"]:
                code = code.replace("--epochs 30", f"--epochs {EPOCHS_HERE}")
            ready = block.service
            if ready is not None:
                services.append(start(code, tmp_path, env, ready, block.line))
                continue
            ran = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", code],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            said = f"README line {block.line}:\n{code}\n{ran.stdout}{ran.stderr}"
            assert ran.returncode == 0, said
            print(said)
            if block.output is not None:
                assert_shown(block.output, ran.stdout, block.line)
            check_after(block, ran.stdout, services, tmp_path)
    finally:
        for service in reversed(services):
            stop(service)
    print(f"README quick paths: {time.monotonic() - started:.1f} s")


def start(code: str, cwd: Path, env: dict[str, str], ready: str, line: int) -> Service:
    proc = subprocess.Popen(
        ["bash", "-c", code], cwd=cwd, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    service = Service(proc)
    threading.Thread(target=service.read, daemon=True).start()
    wait_for(
        lambda: service.said(ready) or proc.poll() is not None,
        timeout=180,
        what=f"README line {line} to serve",
    )
    assert service.said(ready), f"README line {line}:\n{code}\n" + "\n".join(service.lines)
    return service


def stop(service: Service) -> None:
    if service.proc.poll() is None:
        os.killpg(service.proc.pid, signal.SIGTERM)
        try:
            service.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(service.proc.pid, signal.SIGKILL)
            service.proc.wait()


def assert_shown(shown: str, printed: str, line: int) -> None:
    """The README's copy of a block's output is what it prints, line for line, up to an
    elision (``...``); the search's own time varies and is not compared."""
    for want, got in zip(shown.splitlines(), printed.splitlines(), strict=False):
        if want.strip() == "...":
            break
        if want.startswith("searched "):
            want, got = want.rsplit(" in ", 1)[0], got.rsplit(" in ", 1)[0]
        assert want == got, f"README line {line}: shows\n{want}\nbut it prints\n{got}"


def check_after(block: Block, printed: str, services: list[Service], cwd: Path) -> None:
    """What the README says each block does, beyond running."""
    words = block.words
    if words[:3] == ["timeslice", "job", "start"]:
        assert f"job j1 completed after {EPOCHS_HERE} epochs" in printed, printed
        # Its job process exits once the run it served has ended, and says so.
        j1 = next(s for s in services if s.said("job j1 rank 0"))
        wait_for(lambda: j1.proc.poll() is not None, timeout=120, what="j1's process to exit")
        assert j1.said("every run this process served has ended: exiting"), j1.lines
    elif words[:3] == ["temporal", "workflow", "start"]:
        assert '"epoch"' in printed or "epoch" in printed, printed  # the progress query
        j2 = next(s for s in services if s.said("job j2 rank 0"))
        wait_for(lambda: j2.proc.poll() is not None, timeout=180, what="j2 to stop and exit")
        assert j2.said("workflow rl-job-j2 completed"), j2.lines
    elif words[:2] == ["timeslice", "groups"]:
        assert "gpus-0" in printed and "j1" in printed and "j2" in printed, printed
        assert (cwd / ".timeslice" / "report" / "report.html").exists()
        assert (cwd / ".timeslice" / "report" / "plotly.min.js").exists()


@pytest.mark.parametrize("doc", ["README.md", "docs/report.md", "docs/plan.md", "docs/pools.md"])
def test_python_snippets_compile_as_scripts(doc: str) -> None:
    """A snippet a reader pastes into a file runs as a script: no top-level ``await``."""
    text = (REPO / doc).read_text()
    for found in re.finditer(r"```python\n(.*?)```", text, re.S):
        line = text.count("\n", 0, found.start()) + 1
        try:
            compile(found.group(1), f"{doc}:{line}", "exec")
        except SyntaxError as err:
            raise AssertionError(f"{doc} line {line}: {err}") from None
