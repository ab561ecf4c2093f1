"""``timeslice groups``: every GPU group, and ``job start``'s word on a group nobody created.

Groups are found by a visibility query on their workflow type (running ``GpuGroupWorkflow``s),
then each answers its ``status`` query; utilization is the GPU-phase one the report and
``timeslice status`` print (docs/report.md), not the share the group was held.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from temporalio.client import Client
from timeslice.errors import TimesliceError
from timeslice.protocol.group import CONTROL_TASK_QUEUE, GroupStatus
from timeslice.protocol.rl_job import RLJobConfig
from timeslice.report.gather import read_group_status, running_groups, status_figures
from timeslice.report.text import table
from timeslice.transport.connection import pollers


@dataclass(frozen=True)
class GroupRow:
    """One group as ``timeslice groups`` lists it."""

    group_id: str
    holder: str | None
    queue: list[str]
    jobs: list[str]
    utilization: float | None
    utilization_while_jobs_ran: float | None
    window_s: float


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """``timeslice groups``."""
    groups = sub.add_parser(
        "groups",
        help="list the GPU groups: holder, queue, jobs and utilization (GPU phases)",
    )
    groups.add_argument("--json", action="store_true", help="one JSON object per group")
    return groups


async def require_control_worker(client: Client, flags: str = "") -> None:
    """Raise, naming the command, if no control worker polls: a group's query would wait for
    one in silence."""
    if not await pollers(client, CONTROL_TASK_QUEUE):
        raise TimesliceError(
            f"no control worker serves task queue {CONTROL_TASK_QUEUE!r} (namespace "
            f"{client.namespace!r}), so no group can answer: start one with "
            f"`timeslice worker{flags}`"
        )


async def group_row(client: Client, status: GroupStatus) -> GroupRow:
    """A group's row: its holder and queue now, the jobs that held it, its utilization."""
    figures = await status_figures(client, status)
    jobs = [r.job_id for r in reversed(status.history)]
    if status.holder is not None:
        jobs.insert(0, status.holder.job_id)
    return GroupRow(
        group_id=status.group_id,
        holder=status.holder.job_id if status.holder is not None else None,
        queue=[w.job_id for w in status.queue],
        jobs=list(dict.fromkeys(jobs)),  # the latest holder first, once each
        utilization=figures.since_created.share,
        utilization_while_jobs_ran=figures.while_jobs_ran.share,
        window_s=figures.while_jobs_ran.window_s,
    )


async def list_groups(client: Client) -> list[GroupRow]:
    """Every running group's row, the most recently created first."""
    ids = await running_groups(client)
    statuses = await asyncio.gather(*(read_group_status(client, g) for g in ids))
    now = datetime.now(UTC)  # a query answers as of the group's last task: bring it to now
    return [await group_row(client, status.advanced_to(now)) for status in statuses]


def format_groups(rows: list[GroupRow]) -> str:
    """The table ``timeslice groups`` prints."""
    if not rows:
        return (
            "no GPU groups yet: a group is created by its first lease (a job's, or an "
            "acquire), or by TimeSliceOrchestratorClient.create_group"
        )

    body = [
        (
            r.group_id,
            r.holder or "-",
            ", ".join(r.queue) or "-",
            ", ".join(r.jobs[:6]) + (f" (+{len(r.jobs) - 6})" if len(r.jobs) > 6 else "") or "-",
            f"{r.utilization_while_jobs_ran:.1%} of {r.window_s:.1f} s while jobs ran"
            if r.window_s and r.utilization_while_jobs_ran is not None
            else "-",
        )
        for r in rows
    ]
    headers = ("group", "holder", "queue", "jobs (latest first)", "utilization (GPU phases)")
    return "\n".join(table(headers, body))


async def run(args: argparse.Namespace, client: Client, flags: str) -> int:
    """``timeslice groups``."""
    await require_control_worker(client, flags)
    rows = await list_groups(client)
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
    else:
        print(format_groups(rows))
    return 0


async def new_group_notes(client: Client, config: RLJobConfig) -> list[str]:
    """A note for each of the job's groups that no running group workflow is: the job's first
    lease would create it, which a typo does silently. Names the closest existing group.

    Args:
        client: A connected client.
        config: The job's config.

    Returns:
        One line per group that does not exist yet.
    """
    if config.sampler_group is None:
        return []  # its pool places it, on the pool's groups
    existing = await running_groups(client)
    notes = []
    for group in dict.fromkeys([config.sampler_group, config.trainer]):
        if group in existing:
            continue
        close = difflib.get_close_matches(group, existing, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        notes.append(
            f"note: no group {group!r} exists yet: the job's first lease creates it, with "
            f"default settings.{hint} (`timeslice groups` lists the groups)"
        )
    return notes
