"""One utilization everywhere: `timeslice status`, `timeslice report` and `timeslice plan profile
--group` print the same figure for the same run of embedded clients, each window labelled
(docs/report.md, "Utilization")."""

from __future__ import annotations

import re
import subprocess
import sys

WINDOWS = ("while jobs ran", "since the group was created")


def timeslice(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", *argv], capture_output=True, text=True, timeout=180
    )
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
