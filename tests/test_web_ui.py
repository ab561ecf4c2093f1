"""The Temporal Web UI shows an RL job's phases: a real browser reads the job's Timeline tab.

Headless Chromium (Debian's ``chromium`` package, driven by Playwright through
``executable_path``; ``playwright install`` is never needed) opens the embedded server's Web UI
for a finished job and finds every phase activity with its summary on the timeline. The page
is saved to ``test-artifacts/web-ui/`` whether the test passes or fails.

Where Chromium or Playwright is missing the test is skipped, except in CI (``CI`` set, as
``.ci/run`` does), where it fails: it must never be silently skipped there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.rl_job import rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.conftest import ARTIFACTS, start_service, start_worker, stop_process

SCREENSHOTS = ARTIFACTS / "web-ui"
FAST = {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05}
EPOCHS = 2
# Generous: the UI, the dev server and the browser share a small, busy CI machine.
UI_TIMEOUT_MS = 60_000
# The timeline renders only the rows near the viewport: a tall one keeps all of a short job's
# rows on the page (and in the screenshot).
VIEWPORT = {"width": 1400, "height": 2400}


def _unavailable(what: str, fix: str) -> NoReturn:
    message = f"{what}; {fix}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: the Web UI test must run here, not be skipped)")
    pytest.skip(message)


def chromium_executable() -> str:
    """Debian's Chromium: $TIMESLICE_CHROMIUM, `chromium` on PATH, or /usr/bin/chromium."""
    for candidate in (
        os.environ.get("TIMESLICE_CHROMIUM"),
        shutil.which("chromium"),
        "/usr/bin/chromium",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    _unavailable(
        "Chromium was not found", "install Debian's package: `apt-get install -y chromium`"
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = chromium_executable()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed", "`pip install -e '.[dev]'` installs it")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable,
            headless=True,
            # CI runs as root, where Chromium's sandbox cannot start; containers have a small
            # /dev/shm.
            args=["--no-sandbox", "--disable-dev-shm-usage"],
        )
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A dev server of its own with the Web UI on (the session's server is headless)."""
    tmp = tmp_path_factory.mktemp("web-ui")
    srv = EmbeddedServer(
        port=free_port(), ui_port=free_port(), db=tmp / "temporal.db", log_path=tmp / "server.log"
    ).start()
    worker = start_worker(srv.address, tmp / "worker.log")
    yield srv
    stop_process(worker)
    srv.stop()


def run_job(address: str, job: str, group: str, checkpoints: Path, log: Path) -> str:
    """Run a short simulated job in a real job process to completion; return its run id."""
    proc = start_service(
        [
            "job", "worker", "--address", address, "--job-id", job, "--workload", "simulated",
            "--checkpoint-dir", str(checkpoints), "--threads", "1",
        ],
        f"job {job} rank 0",
        log,
    )  # fmt: skip
    config = {
        "job_id": job,
        "workload": "simulated",
        "workload_options": FAST,
        "sampler_group": group,
        "epochs": EPOCHS,
    }

    async def go() -> str:
        client = await connect(connect_config(address))
        handle = await start_rl_job(client, parse_job_config(config))
        result = await handle.result()
        assert result.epochs_done == EPOCHS
        return (await handle.describe()).run_id

    try:
        # In a thread of its own: Playwright's sync API keeps an event loop in this one.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, go()).result()
    finally:
        stop_process(proc)


def test_timeline_tab_shows_the_jobs_phase_activities_with_their_summaries(
    browser: Any, ui_server: EmbeddedServer, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    job, group = f"ui-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    run_id = run_job(ui_server.address, job, group, tmp_path / "checkpoints", tmp_path / "job.log")
    workflow_id = rl_job_workflow_id(job)
    page_url = f"{ui_server.ui_url}/namespaces/default/workflows/{workflow_id}/{run_id}"
    # Activity type and summary, as the timeline labels its rows.
    phases = [
        ("timeslice.job.prepare", "prepare · from "),
        *(
            (f"timeslice.job.{activity}", f"epoch {epoch} · {phase} · {where}")
            for epoch in range(EPOCHS)
            for activity, phase, where in (
                ("sample", "sample", group),
                ("compute_rewards", "rewards", "no GPU"),
                ("train", "train", group),
            )
        ),
        ("timeslice.job.save_checkpoint", f"checkpoint · after epoch {EPOCHS - 1} · {group}"),
    ]

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(UI_TIMEOUT_MS)
    try:
        page.goto(f"{page_url}/history")
        wait = {"timeout": UI_TIMEOUT_MS}
        expect(page.get_by_text(workflow_id, exact=True).first).to_be_visible(**wait)
        expect(page.get_by_role("status").first).to_have_text("Completed", **wait)
        tab = page.get_by_role("tab", name="Timeline")
        tab.click()
        expect(tab).to_have_attribute("aria-selected", "true", **wait)
        expect(page).to_have_url(re.compile(rf"/workflows/{workflow_id}/{run_id}/timeline"), **wait)
        for activity, summary in phases:
            # A timeline row: a button named by the event and its status, showing the summary.
            row = page.get_by_role("button", name=f"Event {activity}: Completed")
            row = row.filter(has_text=summary)
            expect(row.first).to_be_visible(**wait)
    finally:
        page.screenshot(path=str(SCREENSHOTS / "job-timeline.png"), full_page=True)
        page.close()


def test_interactive_report_shows_a_lane_per_job_and_a_phase_on_hover(
    browser: Any, tmp_path: Path
) -> None:
    """`timeslice report`'s page, opened from a file with no network (plotly.js from its own
    folder): the timeline draws a lane per job and per group, and hovering a phase shows its
    job, epoch and duration."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    from playwright.sync_api import expect
    from timeslice.report import write_html

    from tests.unit.test_report_figures import report

    page_path = write_html(report(), tmp_path / "report.html")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    page.set_default_timeout(UI_TIMEOUT_MS)
    # Nothing may come from the network: any request but the file itself, and the plotly.js
    # written once beside it, fails the test.
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(page_path.as_uri())
        wait = {"timeout": UI_TIMEOUT_MS}
        chart = page.locator("#timeline")
        expect(chart.locator(".main-svg").first).to_be_visible(**wait)
        lanes = chart.locator(".ytick text").all_text_contents()
        assert set(lanes) == {"a (job)", "g (group)"}
        # Move the mouse over each bar of the main plot (plotly listens on a layer above the
        # bars) until the sampling phase's: plotly shows the span's details.
        bars = chart.locator(".cartesianlayer .barlayer .point path")
        expect(bars.first).to_be_visible(**wait)

        def sampling_hover() -> str | None:
            # Bar positions are read afresh each pass: plotly may still re-lay the chart out
            # (it fits the window once it has drawn), moving every bar after a first reading.
            for i in range(bars.count()):
                where = bars.nth(i).bounding_box()
                if where is None or where["width"] < 2:
                    continue
                x, y = where["x"] + where["width"] / 2, where["y"] + where["height"] / 2
                page.mouse.move(x, y, steps=2)
                hover = chart.locator(".hoverlayer .hovertext").first
                try:
                    hover.wait_for(state="visible", timeout=5_000)
                except PlaywrightTimeoutError:
                    continue  # no bar under the pointer after all
                if "sample on g" in (hover.text_content() or ""):
                    return hover.text_content()
            page.mouse.move(0, 0)  # off the chart: the next pass starts from no hover
            return None

        box = None
        for _ in range(3):
            box = sampling_hover()
            if box is not None:
                break
        assert box is not None, "no hover text for the sampling phase"
        assert "job a" in box and "epoch 0" in box and "1.000 s" in box
        script = page_path.with_name("plotly.min.js").as_uri()
        assert requests == [page_path.as_uri(), script], requests
    finally:
        page.screenshot(path=str(SCREENSHOTS / "report-timeline.png"), full_page=True)
        page.close()
