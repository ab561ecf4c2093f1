"""Remake the README's Web UI screenshots from a real run.

    .venv/bin/python docs/screenshots.py

Starts the embedded Temporal server with its Web UI, the control worker and two
``timeslice job worker`` processes, runs two ``grpo-toy`` jobs that share one GPU group, and
photographs the UI with headless Chromium (Debian's ``chromium`` package, driven by Playwright):

* ``docs/images/ui-timeline.png``: a finished job's Timeline tab, one row per phase activity
  with its summary (``epoch 3 · train · g-...``); the gaps are the turns of the other job.
* ``docs/images/ui-group.png``: the GPU group workflow's User Metadata tab while both jobs run:
  its current details (holder, resident, queue, leases, the share held so far).

Everything runs in a temporary directory, removed afterwards (kept, with its logs, on failure).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.cli.services import ServiceStartError, start_service, stop_service
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import group_workflow_id
from timeslice.protocol.rl_job import RLJobProgress, RLJobResult, rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

IMAGES = Path(__file__).resolve().parent / "images"
GROUP = "g-demo"
JOBS = ("grpo-a", "grpo-b")
TIMEOUT_MS = 60_000


def start(args: list[str], ready: str, log: Path) -> subprocess.Popen[str]:
    try:
        return start_service(args, ready, log)
    except ServiceStartError as err:
        raise SystemExit(str(err)) from None


class Jobs:
    """The two jobs, driven from an event loop in a thread of its own (Playwright's sync API
    keeps one in the main thread)."""

    def __init__(self, address: str, workload: str, epochs: int) -> None:
        self.workload = workload
        self.epochs = epochs
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._loop = asyncio.new_event_loop()
        self._pool.submit(self._loop.run_forever)
        self.client: Client = self.call(connect(connect_config(address)))

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def start(self) -> None:
        for seed, job in enumerate(JOBS):
            config = {
                "job_id": job,
                "workload": self.workload,
                "sampler_group": GROUP,
                "epochs": self.epochs,
                "batch_size": 8,
                "group_size": 4,
                "seed": seed,
            }
            self.call(start_rl_job(self.client, parse_job_config(config)))

    def progress(self, job: str) -> RLJobProgress:
        handle = self.client.get_workflow_handle(rl_job_workflow_id(job))
        return self.call(handle.query("progress", result_type=RLJobProgress))

    def closed(self, job: str) -> bool:
        handle = self.client.get_workflow_handle(rl_job_workflow_id(job))
        return self.call(handle.describe()).status != WorkflowExecutionStatus.RUNNING

    def finish(self, job: str) -> tuple[RLJobResult, str]:
        handle = self.client.get_workflow_handle(rl_job_workflow_id(job), result_type=RLJobResult)
        result = self.call(handle.result())
        return result, self.call(handle.describe()).run_id

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pool.shutdown()


def wait_until(
    ok: Callable[[], bool], what: str, procs: list[subprocess.Popen[str]], timeout: float = 600.0
) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"{shlex.join(proc.args[3:])} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def shoot_group(page: Any, ui: str, path: Path) -> None:
    """The group's current details, taken when one job holds it and the other waits."""
    from playwright.sync_api import expect

    page.goto(f"{ui}/namespaces/default/workflows/{group_workflow_id(GROUP)}")
    page.get_by_role("tab", name="User Metadata").click()
    # The details are markdown, rendered in a sandboxed frame; the last one is Current Details.
    details = page.frame_locator("iframe").last
    for _ in range(100):
        expect(details.get_by_text("held so far")).to_be_visible(timeout=TIMEOUT_MS)
        text = details.locator("body").inner_text()
        if "holder: none" not in text and "queue: empty" not in text:
            break
        page.keyboard.press("r")  # the UI's own key for fresh current details
        page.wait_for_timeout(300)
    page.evaluate("document.activeElement?.blur()")  # no focus ring from the key press
    box = page.frame_locator("iframe").last.owner.bounding_box()
    page.screenshot(
        path=str(path),
        clip={"x": 0, "y": 0, "width": 1400, "height": box["y"] + box["height"] + 24},
    )


def shoot_timeline(page: Any, ui: str, result: RLJobResult, run_id: str, path: Path) -> None:
    """The job's Timeline tab, phase activities only, oldest first; cropped to the timeline."""
    from playwright.sync_api import expect

    url = f"{ui}/namespaces/default/workflows/{rl_job_workflow_id(result.job_id)}/{run_id}"
    page.goto(f"{url}/history")
    page.get_by_role("tab", name="Timeline").click()
    expect(page.get_by_text("epoch 0 · sample").first).to_be_visible(timeout=TIMEOUT_MS)
    # Filter: activities only (no timers, signals, grant requests), then oldest first.
    page.get_by_role("button", name="Filter").click()
    page.get_by_text("None", exact=True).last.click()
    page.get_by_role("checkbox", name="Activity", exact=True).click(force=True)
    page.keyboard.press("Escape")
    page.get_by_role("button", name="Descending").click()
    expect(page).to_have_url(re.compile(r"category=activity.*sort=ascending"), timeout=TIMEOUT_MS)
    last = page.get_by_text(f"checkpoint · after epoch {result.epochs_done - 1} ·").first
    expect(last).to_be_visible(timeout=TIMEOUT_MS)
    expect(page.get_by_text("timeslice_grant")).to_have_count(0, timeout=TIMEOUT_MS)
    title = page.get_by_text("Back to Workflows")
    heading = page.get_by_role("heading", name="Timeline", exact=True)
    chart_bottom = _timeline_bottom(page)
    top = title.first.bounding_box()["y"] - 8
    left = heading.bounding_box()["x"] - 12
    width = page.viewport_size["width"] - left
    page.screenshot(
        path=str(path), clip={"x": left, "y": top, "width": width, "height": chart_bottom - top}
    )


def _timeline_bottom(page: Any) -> float:
    """The bottom of the timeline's chart, its time axis labels included."""
    return float(
        page.evaluate(
            """() => {
                const heading = [...document.querySelectorAll('h2')]
                    .find(h => h.textContent.trim().startsWith('Timeline'));
                const top = heading.getBoundingClientRect().top;
                let bottom = heading.getBoundingClientRect().bottom;
                for (const el of document.querySelectorAll('svg line, svg rect, .tick-label')) {
                    const box = el.getBoundingClientRect();
                    if (box.top > top && box.height > 0) bottom = Math.max(bottom, box.bottom);
                }
                return bottom + 16;
            }"""
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workload", default="grpo-toy", help="grpo-toy (default) or simulated")
    parser.add_argument("--out", type=Path, default=IMAGES)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(chromium, os.X_OK):
        raise SystemExit("Chromium was not found: `apt-get install -y chromium`")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="timeslice-screenshots-"))
    try:
        shoot(args, chromium, tmp)
    except BaseException:
        print(f"failed; the server's and the workers' logs are in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp)


def shoot(args: argparse.Namespace, chromium: str, tmp: Path) -> None:
    from playwright.sync_api import sync_playwright

    server = EmbeddedServer(
        port=free_port(), ui_port=free_port(), db=tmp / "temporal.db", log_path=tmp / "server.log"
    ).start()
    assert server.ui_url is not None
    procs: list[subprocess.Popen[str]] = []
    jobs: Jobs | None = None
    try:
        worker = ["worker", "--address", server.address]
        procs.append(start(worker, "control worker on task queue", tmp / "worker.log"))
        for job in JOBS:
            procs.append(
                start(
                    [
                        "job", "worker", "--address", server.address, "--job-id", job,
                        "--workload", args.workload, "--checkpoint-dir", str(tmp / "ckpt"),
                        "--threads", "1",
                    ],
                    f"job {job} rank 0",
                    tmp / f"{job}.log",
                )
            )  # fmt: skip
        jobs = Jobs(server.address, args.workload, args.epochs)
        jobs.start()
        print(f"Web UI at {server.ui_url}; two {args.workload} jobs on {GROUP}", flush=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=chromium,
                headless=True,
                args=["--no-sandbox", "--disable-dev-shm-usage"],
            )
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            wait_until(lambda: all(jobs.progress(j).epoch >= 2 for j in JOBS), "epoch 2", procs)
            shoot_group(page, server.ui_url, args.out / "ui-group.png")
            print(f"saved {args.out / 'ui-group.png'}", flush=True)
            wait_until(lambda: all(jobs.closed(j) for j in JOBS), "the jobs' end", procs)
            finished = [jobs.finish(job) for job in JOBS]
            for result, _ in finished:
                print(f"{result.job_id}: {result.epochs_done} epochs", flush=True)
            result, run_id = finished[0]
            # Tall enough that the timeline renders every row (it draws only those near the
            # viewport).
            page.set_viewport_size({"width": 1400, "height": 2400})
            shoot_timeline(page, server.ui_url, result, run_id, args.out / "ui-timeline.png")
            print(f"saved {args.out / 'ui-timeline.png'}", flush=True)
            browser.close()
    finally:
        if jobs is not None:
            jobs.close()
        for proc in procs:
            stop_service(proc)
        server.stop()


if __name__ == "__main__":
    main()
