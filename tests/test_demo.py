"""`make demo`, short: the dedicated-vs-shared table comes from the two runs' own records."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from timeslice.cli.server import free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.long
def test_demo_compares_dedicated_and_shared_from_the_runs_records(tmp_path: Path) -> None:
    out = tmp_path / "report"
    demo = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--epochs", "2", "--batch-size",
         "8", "--port", str(free_port()), "--ui-port", str(free_port()), "--state",
         str(tmp_path / "state"), "--out", str(out)],
        capture_output=True, text=True, timeout=420, cwd=REPO,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    text = demo.stdout
    table = text[text.index("dedicated groups vs one shared group") :]
    # The shared group's utilization in the table, in both windows, is the one the shared
    # run's report computed (its "Utilization" lines).
    report = (out / "report.txt").read_text()
    line = next(
        ln
        for ln in report.splitlines()
        if ln.strip().startswith("shared-gpus: ") and "since the group was created" in ln
    )
    for window in ("since the group was created", "while jobs ran"):
        shared_share = re.search(rf"utilization {window} .*shared-gpus (\d+)%", table)
        assert shared_share is not None, window
        in_report = re.search(rf"([\d.]+)% of [\d.]+ s {window}", line)
        assert in_report is not None, (window, line)
        # The table prints the share to 1 %, the report to 0.1 %: 9.5 % in one can be 9 % in
        # the other (0.0949... rounded twice), so they agree within the two roundings.
        assert abs(float(in_report.group(1)) - int(shared_share.group(1))) <= 0.55
    # Each job: a completion time in both runs, the shared one as a multiple of the other, and
    # the same rewards either way (same seeds, deterministic jobs).
    for job in (1, 2):
        completion = re.search(
            rf"job {job}: completion +([\d.]+) s +([\d.]+) s \(([\d.]+)x\)", table
        )
        assert completion is not None
        alone, shared, ratio = (float(x) for x in completion.groups())
        # Times are printed to 0.1 s and the ratio (of the unrounded times) to 0.01.
        low, high = (shared - 0.05) / (alone + 0.05), (shared + 0.05) / (alone - 0.05)
        assert low - 0.005 <= ratio <= high + 0.005, (alone, shared, ratio)
        rewards = re.search(rf"job {job}: reward +\S+ (\S+ → \S+) +\S+ (\S+ → \S+)", table)
        assert rewards is not None and rewards.group(1) == rewards.group(2)
    # The shared run moved state at every switch; the dedicated runs never switched.
    switches = re.search(r"switches, bytes moved +0, 0 B +(\d+), ", table)
    assert switches is not None and int(switches.group(1)) > 0
    # Under the default policy, and said so; the per-epoch figure is the switch count's.
    assert "(grant policy phase_aware)" in text
    per_epoch = re.search(r"switches per job per epoch +0\.00 +([\d.]+)", table)
    assert per_epoch is not None
    assert abs(float(per_epoch.group(1)) - int(switches.group(1)) / 4) <= 0.005  # 2 jobs x 2
    assert re.search(r"leases carried past a waiter +0 +\d+", table) is not None
    for name in ("report.txt", "report.html", "timeline.png", "trace.json"):
        assert (out / name).stat().st_size > 0


BAD_OPTIONS = (
    ("d_model=4096", "option 'd_model' = 4096 is invalid; allowed: an int in 8..1024"),
    ("nope=1", "unknown option(s) 'nope'"),
    ("d_model", "expected KEY=VALUE, not 'd_model'"),
)


def test_demo_refuses_a_bad_workload_option_before_starting_anything(tmp_path: Path) -> None:
    """As the command: exit status 2, what to fix on stderr, nothing started."""
    state = tmp_path / "state"
    option, says = BAD_OPTIONS[0]
    demo = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--option", option,
         "--state", str(state)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert says in demo.stderr
    assert not state.exists()  # no server, database or log was started


@pytest.mark.parametrize(("option", "says"), BAD_OPTIONS, ids=[o for o, _ in BAD_OPTIONS])
def test_demo_says_what_is_wrong_with_each_bad_option(
    tmp_path: Path, option: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Each refusal's message, from the demo's own main() in this process (the command's
    start-up, torch's import, is paid once above, not once per option)."""
    state = tmp_path / "state"
    monkeypatch.setattr(sys, "argv", ["demo.py", "--option", option, "--state", str(state)])
    with pytest.raises(SystemExit) as exited:
        _demo_module().main()
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
    assert not state.exists()


def _demo_module() -> Any:
    name = "_timeslice_demo"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "demo.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_demo_help_says_what_it_does_in_whole_sentences(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(sys, "argv", ["demo.py", "--help"])
    with pytest.raises(SystemExit) as exited:
        _demo_module().main()
    assert exited.value.code == 0
    said = " ".join(capsys.readouterr().out.split("options:")[0].split())
    assert "then both sharing one, on the embedded Temporal server." in said, said
