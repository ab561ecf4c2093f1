"""The timeline in Chrome's trace-event format, which Perfetto and chrome://tracing open.

One process for the jobs and one for the groups; a thread (track) per job and per group; every
span a complete ("X") event, in microseconds from the report's first span.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from timeslice.report.model import Report

JOBS_PID, GROUPS_PID = 1, 2


def trace_events(report: Report) -> dict[str, Any]:
    origin = report.window[0]
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": JOBS_PID, "args": {"name": "RL jobs"}},
        {"ph": "M", "name": "process_name", "pid": GROUPS_PID, "args": {"name": "GPU groups"}},
    ]
    for tid, lane in enumerate(report.lanes, start=1):
        pid = JOBS_PID if lane.kind == "job" else GROUPS_PID
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane.name}}
        )
        for span in lane.spans:
            args: dict[str, Any] = {"what": span.label}
            for key in ("job_id", "group_id", "epoch"):
                value = getattr(span, key)
                if value is not None:
                    args[key] = value
            events.append(
                {
                    "ph": "X",
                    "name": span.kind if lane.kind == "job" else (span.job_id or span.kind),
                    "cat": span.kind,
                    "pid": pid,
                    "tid": tid,
                    "ts": round((span.start - origin).total_seconds() * 1e6, 1),
                    "dur": round(max(span.seconds, 0.0) * 1e6, 1),
                    "args": args,
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generated_at": report.generated_at.isoformat(),
            "origin": origin.isoformat(),
        },
    }


def write_trace(report: Report, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace_events(report)))
    return path
