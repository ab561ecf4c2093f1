"""One utilization everywhere: `timeslice status`, `timeslice report` and `timeslice plan profile
--group` print the same figure for the same run of embedded clients, each window labelled
(docs/report.md, "Utilization")."""

from __future__ import annotations

import asyncio
import json
import re

from timeslice.protocol.group import group_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.helpers import run_cli, wait_for

WINDOWS = ("while jobs ran", "since the group was created")


def timeslice(*argv: str) -> str:
    done = run_cli(*argv, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def figures(text: str, group: str) -> dict[str, tuple[float, float]]:
    """Each window's (share %, window s) on the utilization line of ``group``."""
    line = next(
        ln for ln in text.splitlines() if WINDOWS[1] in ln and (group in ln or "utilization:" in ln)
    )
    found = {}
    for window in WINDOWS:
        match = re.search(rf"([\d.]+)% of ([\d.]+) s {window}", line)
        assert match is not None, (window, line)
        found[window] = (float(match.group(1)), float(match.group(2)))
    return found


def test_status_report_and_plan_profile_agree(address, group, make_client, tmp_path) -> None:
    first, second = make_client(job_id="util-a"), make_client(job_id="util-b")
    for _ in range(3):  # the two take turns: a plain acquire / release is all phase
        first.release(first.acquire(group))
        second.release(second.acquire(group))
    status = timeslice("status", group, "--address", address)
    said = json.loads(timeslice("status", group, "--address", address, "--json"))
    report = timeslice(
        "report", "--address", address, "--group", group, "--job", "util-a", "--job", "util-b",
        "--text-only",
    )  # fmt: skip
    profile = timeslice(
        "plan", "profile", "util-a", "--group", group, "--address", address,
        "--out", str(tmp_path),
    )  # fmt: skip
    read = {name: figures(out, group) for name, out in
            (("status", status), ("report", report), ("plan profile", profile))}  # fmt: skip
    ran = {name: f[WINDOWS[0]] for name, f in read.items()}
    # The run is over: the window while jobs ran is the same for every reading, and so is the
    # figure (each rounds to 0.1 % and 0.1 s).
    shares = [share for share, _ in ran.values()]
    windows = [seconds for _, seconds in ran.values()]
    assert max(shares) - min(shares) <= 0.1 + 1e-9, read
    assert max(windows) - min(windows) <= 0.1 + 1e-9, read
    assert 0 < shares[0] <= 100
    # Since the group was created the window grows with the reading, never shrinks.
    life = [read[name][WINDOWS[1]][1] for name in ("status", "report", "plan profile")]
    assert life == sorted(life), read
    # Embedded clients' leases are their phases: status's held share, read at the same moment
    # as its utilization, is that utilization since the group was created.
    held = re.search(r"held: +([\d.]+)% of ([\d.]+) s since the group was created", status)
    assert held is not None, status
    share, seconds = read["status"][WINDOWS[1]]
    assert float(held.group(2)) == seconds, status
    assert abs(float(held.group(1)) - share) <= 0.1 + 1e-9, status  # two roundings to 0.1 %
    assert_json_says_the_report(said, read["report"])


def assert_json_says_the_report(said: dict, report: dict[str, tuple[float, float]]) -> None:
    """`status --json`'s ``utilization`` is the report's (GPU phases, not the held share): the
    same share while jobs ran, and the same phase time since the group was created (that
    window grows between the two readings; the report rounds to 0.1 % and 0.1 s)."""
    ran, _ = report[WINDOWS[0]]
    assert abs(100 * said["utilization_while_jobs_ran"] - ran) <= 0.5, (said, report)
    share, window = report[WINDOWS[1]]
    assert said["wall_s"] <= window + 0.05, (said, report)
    rounding = 0.0005 * window + share / 100 * 0.05
    phase_s = said["utilization"] * said["wall_s"]
    # In phase seconds, not as a share: the window is a second or two here (the commands run
    # warm), and its 0.1-s rounding alone moves a share by points.
    assert abs(phase_s - share / 100 * window) <= rounding + 1e-6, (said, report)
    assert said["utilization"] <= said["held_share"] + 1e-9, said


def status_figures(text: str) -> tuple[float, float, float]:
    """(held s of the holder, utilization % since created, its window s) from `status`."""
    held = re.search(r"\(token \d+, ([\d.]+) s\)", text)
    assert held is not None, text
    share, window = figures(text, "utilization:")[WINDOWS[1]]
    return float(held.group(1)), share, window


async def history_length(address: str, group: str) -> int:
    client = await connect(connect_config(address))
    history = await client.get_workflow_handle(group_workflow_id(group)).fetch_history()
    return len(history.events)


def test_status_moves_on_while_a_lease_is_held_with_no_new_message(
    address, group, make_client
) -> None:
    """A query answers as of the group's last workflow task; `timeslice status` is as of its
    own moment: read twice while one lease is held, and nothing reaches the group in between,
    the hold, the window and the utilization all grow."""
    holder = make_client(job_id="status-moves", lease_ttl=600)  # no renewal for minutes
    holder.release(holder.acquire(group))  # the group, then a second of it idle

    def idle_a_second() -> bool:
        return holder.group_status(group).idle_s >= 1.0

    wait_for(idle_a_second, timeout=60, what="the group to be idle a second")
    lease = holder.acquire(group)

    def confirmed() -> bool:
        # A grant taken from a parked update is confirmed by a first renewal (a message) soon
        # after; until then the group's next deadline is its confirmation's, not the expiry.
        status = holder.group_status(group)
        assert status.as_of is not None and status.next_deadline is not None
        return (status.next_deadline - status.as_of).total_seconds() > 300

    wait_for(confirmed, timeout=60, what="the grant to be confirmed (its lease expires in 600 s)")
    first = timeslice("status", group, "--address", address)
    before = asyncio.run(history_length(address, group))
    held, share, window = status_figures(first)

    def later() -> tuple[float, float, float] | None:
        read = status_figures(timeslice("status", group, "--address", address))
        return read if read[0] >= held + 1.0 else None

    _, share_later, window_later = wait_for(
        later, timeout=120, what="the hold `timeslice status` prints to grow by a second"
    )
    assert asyncio.run(history_length(address, group)) == before  # no workflow task since
    # Both readings print the hold and the window to 0.1 s, each rounded on its own: the
    # hold's printed second of growth can be the window's 0.9 (6.1 -> 7.0 once).
    assert window_later >= window + 1.0 - 0.1 - 1e-9
    # The holder is an embedded client: its lease is its phase, so the share rises.
    assert share < 100.0 and share_later > share
    holder.release(lease)
