"""One palette for the picture and the page: each span kind its colour, each job its own."""

from __future__ import annotations

from timeslice.report.model import Report

KIND_COLOURS = {
    "sample": "#1f77b4",
    "train": "#ff7f0e",
    "phase": "#5254a3",
    "rewards": "#2ca02c",
    "waiting": "#c7c7c7",
    "switching": "#d62728",
    "moved": "#000000",
    "idle": "#f0f0f0",
}
KIND_NAMES = {
    "sample": "sample (GPU)",
    "train": "train (GPU)",
    "phase": "client GPU phase",
    "rewards": "rewards (no GPU)",
    "waiting": "waiting for a group",
    "switching": "moving state",
    "moved": "moved to another group (pool)",
    "idle": "idle (nobody held it)",
}
JOB_PALETTE = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79")


def job_colours(report: Report) -> dict[str, str]:
    """Group lanes colour each lease by its holder."""
    jobs = [lane.name for lane in report.lanes if lane.kind == "job"]
    for span in report.spans:
        if span.kind == "lease" and span.job_id and span.job_id not in jobs:
            jobs.append(span.job_id)
    return {job: JOB_PALETTE[i % len(JOB_PALETTE)] for i, job in enumerate(jobs)}
