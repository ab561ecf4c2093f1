"""Where an RL job's phase boundaries go: each step from one phase's end to the next one's start.

A **phase boundary** is the gap between two consecutive phase activities of one RL job (sample →
rewards, rewards → train, train → the next epoch's sample; a checkpoint between train and sample
is a phase of its own here). It is cut into the steps it is made of, read from the job's
history (server times) and from the phases' own results (the job process's monotonic clock,
placed on the wall clock by ``wall_offset_s``; server and processes share one host here):

1. **completion**: the phase's work ends → its ``ActivityTaskCompleted`` (the process hands the
   lease back as ordered, answers, and the server records it);
2. **task wait**: → the job's workflow task that learns it starts (``WorkflowTaskStarted``);
3. **task run**: → the next activity is scheduled (``ActivityTaskScheduled``, written when that
   task completes);
4. **dispatch**: → the next activity starts on the job's process (``ActivityTaskStarted``);
5. **lease**: → its lease is granted or found (a carried lease and a grant asked ahead that came
   before the activity started cost nothing here; no lease, nothing);
6. **start**: → the phase's work starts (the state's restore, the lease's checks).

The **overhead** of a boundary is its gap less what is not the boundary's: the time its lease
waited for another job's phase (the group's own ``waited_s`` for the request, from the grant
notice, where it falls inside the gap) and the state it restored. The group's histories give
each request's ``waited_s``.

Used by bench/replay.py (``--boundaries``) and bench/scale.py; ``python bench/boundary.py DIR``
reads histories written by ``--histories DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from timeslice.protocol.rl_job import (  # noqa: E402
    CHECKPOINT_ACTIVITY,
    REWARDS_ACTIVITY,
    SAMPLE_ACTIVITY,
    TRAIN_ACTIVITY,
)

from bench.handoff import percentile  # noqa: E402
from bench.history_cost import acquire_answers  # noqa: E402

PHASE_OF = {
    SAMPLE_ACTIVITY: "sample",
    REWARDS_ACTIVITY: "rewards",
    TRAIN_ACTIVITY: "train",
    CHECKPOINT_ACTIVITY: "checkpoint",
}
STEPS = ("completion", "task wait", "task run", "dispatch", "lease", "start")


@dataclasses.dataclass
class _Activity:
    name: str
    scheduled: float
    request_id: str | None = None
    started: float | None = None
    completed: float | None = None
    result: dict[str, Any] | None = None
    task_started_after: float | None = None  # the workflow task that learnt of its completion


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One phase boundary of one job: its steps (seconds) and its overhead."""

    job: str
    kind: str  # "sample→rewards", ...
    steps: dict[str, float]
    gap_s: float
    waited_s: float  # for another job's phase, inside the gap
    restore_s: float

    @property
    def overhead_s(self) -> float:
        return self.gap_s - self.waited_s - self.restore_s


def _time(event: Any) -> float:
    return event.event_time.ToMicroseconds() / 1e6


def _payload(payloads: Any) -> Any:
    if not payloads:
        return None
    try:
        return json.loads(payloads[0].data)
    except ValueError:
        return None  # an encrypted payload: nothing to read


def _activities(history: WorkflowHistory) -> list[_Activity]:
    """The job's phase and checkpoint activities, in the order they were scheduled."""
    by_id: dict[int, _Activity] = {}
    order: list[_Activity] = []
    completed_waiting: list[_Activity] = []
    for event in history.events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            name = attrs.activity_type.name
            if name not in PHASE_OF:
                continue
            inp = _payload(attrs.input.payloads) or {}
            lease = inp.get("lease") if isinstance(inp, dict) else None
            act = _Activity(
                name=name,
                scheduled=_time(event),
                request_id=lease.get("request_id") if isinstance(lease, dict) else None,
            )
            by_id[event.event_id] = act
            order.append(act)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            act = by_id.get(event.activity_task_started_event_attributes.scheduled_event_id)
            if act is not None:
                act.started = _time(event)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            attrs = event.activity_task_completed_event_attributes
            act = by_id.get(attrs.scheduled_event_id)
            if act is not None:
                act.completed = _time(event)
                act.result = _payload(attrs.result.payloads)
                completed_waiting.append(act)
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            for act in completed_waiting:
                act.task_started_after = _time(event)
            completed_waiting = []
    return order


def _waits(group_histories: Iterable[WorkflowHistory]) -> dict[str, float]:
    """request id -> the group's ``waited_s`` for it (queued to granted, the group's clock)."""
    waits: dict[str, float] = {}
    for history in group_histories:
        for payloads in acquire_answers(history).values():
            answer = _payload(payloads)
            notice = answer.get("notice") if isinstance(answer, dict) else None
            if isinstance(notice, dict) and notice.get("token") is not None:
                waits[notice["request_id"]] = float(notice.get("waited_s") or 0.0)
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                notice = _payload(event.activity_task_scheduled_event_attributes.input.payloads)
                if isinstance(notice, dict) and "waited_s" in notice and "request_id" in notice:
                    waits[notice["request_id"]] = float(notice["waited_s"] or 0.0)
    return waits


def _wall(result: dict[str, Any], field: str) -> float | None:
    value, offset = result.get(field), result.get("wall_offset_s")
    return None if value is None or offset is None else value + offset


def boundaries(
    job_histories: Iterable[WorkflowHistory], group_histories: Iterable[WorkflowHistory] = ()
) -> list[Boundary]:
    """Every phase boundary in the jobs' histories (each run of a job on its own: a boundary
    across continue-as-new is not counted)."""
    waits = _waits(group_histories)
    found: list[Boundary] = []
    for history in job_histories:
        acts = _activities(history)
        for before, after in itertools.pairwise(acts):
            b = _boundary(history.workflow_id, before, after, waits)
            if b is not None:
                found.append(b)
    return found


def _boundary(
    job: str, before: _Activity, after: _Activity, waits: dict[str, float]
) -> Boundary | None:
    if before.result is None or after.result is None or after.started is None:
        return None  # failed, or a checkpoint's result (no interval)
    if before.completed is None or before.task_started_after is None:
        return None
    ended = _wall(before.result, "mono_end")
    started = _wall(after.result, "mono_start")
    if ended is None or started is None or after.scheduled < before.completed:
        return None
    granted = _wall(after.result, "granted_mono")
    lease_at = after.started if granted is None else max(after.started, granted)
    marks = [
        ended,
        before.completed,
        before.task_started_after,
        after.scheduled,
        after.started,
        lease_at,
        started,
    ]
    # Each step from the one before it (clocks of one host; a step read a hair early counts 0).
    steps = {}
    for name, (t0, t1) in zip(STEPS, itertools.pairwise(marks), strict=True):
        steps[name] = max(0.0, t1 - t0)
    waited = 0.0
    # The request the phase ran under: a v6 sample may run under its or_else, not the order
    # its input names first. A lease carried from the phase before was granted before this
    # boundary: its wait (for the group's answer to the carry) is the boundary's own.
    ran_under = after.result.get("request_id") or after.request_id
    carried = ran_under is not None and ran_under == before.request_id
    if granted is not None and not carried and ran_under in waits:
        # The group's wait for this request, ending at the grant, clipped to the gap.
        wait_from = granted - waits[ran_under]
        waited = max(0.0, granted - max(wait_from, ended))
    restore = sum(float(r.get("seconds") or 0.0) for r in after.result.get("restored") or [])
    kind = f"{PHASE_OF[before.name]}→{PHASE_OF[after.name]}"
    return Boundary(
        job=job,
        kind=kind,
        steps=steps,
        gap_s=started - ended,
        waited_s=min(waited, started - ended),
        restore_s=restore,
    )


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(1000 * statistics.median(values), 1),
        "p99": round(1000 * percentile(values, 0.99), 1),
    }


def summary(found: list[Boundary]) -> dict[str, Any]:
    """p50 / p99 (ms) of each step and of the overhead, over all boundaries and by kind."""
    if not found:
        return {"boundaries": 0}

    def of(bs: list[Boundary]) -> dict[str, Any]:
        return {
            "boundaries": len(bs),
            "overhead_ms": _ms([b.overhead_s for b in bs]),
            "gap_ms": _ms([b.gap_s for b in bs]),
            "steps_ms": {step: _ms([b.steps[step] for b in bs]) for step in STEPS},
            "waited_ms_mean": round(1000 * statistics.mean(b.waited_s for b in bs), 1),
            "restore_ms_mean": round(1000 * statistics.mean(b.restore_s for b in bs), 1),
        }

    kinds = sorted({b.kind for b in found})
    return {**of(found), "by_kind": {k: of([b for b in found if b.kind == k]) for k in kinds}}


def table(summed: dict[str, Any]) -> str:
    """The summary as a text table: one row per kind and one for all, p50 / p99 in ms."""
    if not summed.get("boundaries"):
        return "no phase boundaries"
    head = ["boundary", "n", *STEPS, "overhead", "gap"]
    rows = [head]

    def row(name: str, s: dict[str, Any]) -> list[str]:
        cells = [f"{s['steps_ms'][k]['p50']:.0f} / {s['steps_ms'][k]['p99']:.0f}" for k in STEPS]
        over, gap = s["overhead_ms"], s["gap_ms"]
        return [
            name,
            str(s["boundaries"]),
            *cells,
            f"{over['p50']:.0f} / {over['p99']:.0f}",
            f"{gap['p50']:.0f} / {gap['p99']:.0f}",
        ]

    for kind, s in summed["by_kind"].items():
        rows.append(row(kind, s))
    rows.append(row("all", summed))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "phase boundaries, p50 / p99 ms (each step from the one before):\n" + "\n".join(lines)


async def fetch(address: str, stamp: str, keep: Path | None = None) -> tuple[list, list]:
    """Every run of the RL job and group workflows whose id holds ``stamp``: (jobs, groups);
    each history is also written to ``keep`` when given."""
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))

    async def histories(kind: str) -> list[WorkflowHistory]:
        found = []
        async for wf in client.list_workflows(f"WorkflowType = '{kind}'"):
            if stamp in wf.id:
                history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
                found.append(history)
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"{wf.id}.{wf.run_id}.json").write_text(history.to_json())
        return found

    return await histories("RLJobWorkflow"), await histories("GpuGroupWorkflow")


def read(folder: Path) -> tuple[list[WorkflowHistory], list[WorkflowHistory]]:
    """Histories written by ``fetch(keep=...)``: (jobs, groups), by workflow id prefix."""
    jobs, groups = [], []
    for path in sorted(folder.glob("*.json")):
        workflow_id = path.name.split(".", 1)[0]
        history = WorkflowHistory.from_json(workflow_id, path.read_text())
        (groups if workflow_id.startswith("gpu-group-") else jobs).append(history)
    return jobs, groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("histories", type=Path, help="a folder of histories (--histories DIR)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON too")
    args = p.parse_args()
    jobs, groups = read(args.histories)
    summed = summary(boundaries(jobs, groups))
    print(table(summed))
    if args.json:
        print(json.dumps(summed, indent=2))


if __name__ == "__main__":
    main()
