"""Condense the files tests/gpu/run.sh wrote into report.txt: the figures, then what failed.

    python tests/gpu/report.py OUT_DIR

Standard library only, so it runs even where the project could not be installed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def env_lines(out: Path) -> list[str]:
    facts = dict(line.split(": ", 1) for line in read(out / "env.txt").splitlines() if ": " in line)
    keys = ("device", "nvidia kernel module", "driver CUDA version", "torch", "torch CUDA build")
    keys += ("cuda-bindings", "vllm", "cuda-checkpoint")
    return [f"{key}: {facts[key]}" for key in keys if key in facts]


def bandwidth_lines(out: Path) -> list[str]:
    lines = []
    for path in sorted(out.glob("snapshot-cuda-*gib.json"), key=lambda p: (len(p.name), p.name)):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            lines.append(f"{path.name}: unreadable ({err})")
            continue
        gib = r["bytes"] / 1024**3
        lines.append(
            f"torch {gib:g} GiB: offload {r['snapshot_GBps']} GB/s vs pinned copy_ "
            f"{r['plain_copy_GBps']} GB/s ({r['snapshot_vs_plain']}x); restore "
            f"{r['restore_GBps']} GB/s vs {r['plain_copy_back_GBps']} GB/s "
            f"({r['restore_vs_plain']}x); overlapped swap {r['overlapped_swap_s']} s "
            f"({r['swap_vs_larger_direction']}x the slower direction alone)"
        )
    return lines


def printed_lines(out: Path) -> list[str]:
    """The figures the gpu tests print (-s): cuda-checkpoint, preemption and vLLM timings."""
    # With -q, a print can follow the progress dots of earlier tests on the same line.
    wanted = re.compile(
        r"(cuda-checkpoint (of|health|rollback)|vllm (sleep|health)|preemption of a frozen).*"
    )
    found = []
    files = ("pytest-checkpoint.txt", "pytest-checkpoint-rollback.txt", "pytest-preemption.txt",
             "pytest-vllm.txt")  # fmt: skip
    for name in files:
        for line in read(out / name).splitlines():
            match = wanted.search(line)
            if match:
                found.append(match.group(0).strip())
    return found


def main() -> None:
    out = Path(sys.argv[1])
    lines = ["== environment", *env_lines(out), "== figures"]
    lines += bandwidth_lines(out) + printed_lines(out)
    steps = [line.split("\t") for line in read(out / "summary.txt").splitlines() if line]
    failed = [s for s in steps if len(s) > 1 and s[1] not in ("0", "skipped")]
    skipped = [s for s in steps if len(s) > 1 and s[1] == "skipped"]
    lines.append("== steps")
    lines.append(f"{len(steps)} steps: {len(failed)} failed, {len(skipped)} skipped")
    lines += [f"failed: {s[0]} (exit {s[1]}; see {s[0]}.txt)" for s in failed]
    lines += [f"skipped: {s[0]} ({s[-1]})" for s in skipped]
    missing = [ln for ln in read(out / "packages.txt").splitlines() if "MISSING" in ln]
    lines += [f"missing package: {ln}" for ln in missing]
    # A skipped gpu test exits 0: name it, or a run without figures would read as a pass.
    for path in sorted(out.glob("*.txt")):
        lines += [
            f"skipped test ({path.stem}): {ln.strip()[len('SKIPPED ') :]}"
            for ln in read(path).splitlines()
            if ln.startswith("SKIPPED ")
        ]
    text = "\n".join(lines) + "\n"
    (out / "report.txt").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
