"""What a workflow's history costs: events, workflow tasks, timers and billable actions, counted
per lease (a GpuGroupWorkflow) or per epoch (an RLJobWorkflow) from the history itself.

Used by bench/scale.py and by the tests that hold the group and the RL job to their budgets
(tests/test_history_cost.py). A history here is temporalio's ``WorkflowHistory`` (fetched from
the server, or read from a stored JSON file with ``WorkflowHistory.from_json``); several runs of
one workflow (continue-as-new) are summed by passing them all.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from timeslice.protocol.group import DELIVER_GRANT_ACTIVITY, GroupUpdate
from timeslice.protocol.rl_job import SAMPLE_ACTIVITY

# The events Temporal Cloud bills as an action (docs/architecture.md, "Scale", says which are
# left out): a workflow started or continued, a timer, an activity scheduled, a signal sent or
# received, an update accepted, a search-attribute upsert, a marker (local activity, patch).
_BILLED = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
    EventType.EVENT_TYPE_TIMER_STARTED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
    EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED,
    EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES,
    EventType.EVENT_TYPE_MARKER_RECORDED,
}


@dataclasses.dataclass(frozen=True)
class HistoryCost:
    """Counts over one or more histories, and the unit they are divided by."""

    units: int  # leases granted (a group) or epochs sampled (an RL job)
    events: int
    workflow_tasks: int
    timers_started: int
    upserts: int
    actions: int
    by_type: dict[str, int]

    def per_unit(self, count: int) -> float:
        return count / self.units if self.units else float("nan")

    @property
    def events_per_unit(self) -> float:
        return self.per_unit(self.events)

    @property
    def timers_per_unit(self) -> float:
        return self.per_unit(self.timers_started)

    @property
    def tasks_per_unit(self) -> float:
        return self.per_unit(self.workflow_tasks)

    @property
    def upserts_per_unit(self) -> float:
        return self.per_unit(self.upserts)

    @property
    def actions_per_unit(self) -> float:
        return self.per_unit(self.actions)


def _count(units: int, kinds: Counter[int]) -> HistoryCost:
    by_type = {
        EventType.Name(kind).removeprefix("EVENT_TYPE_").lower(): n for kind, n in kinds.items()
    }
    return HistoryCost(
        units=units,
        events=sum(kinds.values()),
        workflow_tasks=kinds[EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED],
        timers_started=kinds[EventType.EVENT_TYPE_TIMER_STARTED],
        upserts=kinds[EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES],
        actions=sum(n for kind, n in kinds.items() if kind in _BILLED),
        by_type=dict(sorted(by_type.items())),
    )


def _json(data: bytes) -> Any:
    """A payload as the pydantic converter writes it (None if it is not JSON: a codec's)."""
    try:
        return json.loads(data)
    except ValueError:
        return None


def _token(payloads: Any) -> int | None:
    """The fencing token of the GrantNotice (or AcquireAnswer holding one) in ``payloads``."""
    if not payloads:
        return None
    value = _json(payloads[0].data)
    if isinstance(value, dict) and isinstance(value.get("notice"), dict):
        if value.get("outcome") != "granted":
            return None
        value = value["notice"]
    token = value.get("token") if isinstance(value, dict) else None
    return token if isinstance(token, int) else None


def acquire_answers(history: WorkflowHistory) -> dict[str, Any]:
    """Each ``acquire`` update a group's run accepted, by update id: its answer's payloads, or
    None while it is unanswered."""
    answers: dict[str, Any] = {}
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            accepted = event.workflow_execution_update_accepted_event_attributes
            if accepted.accepted_request.input.name == GroupUpdate.ACQUIRE:
                answers[accepted.accepted_request.meta.update_id] = None
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED:
            completed = event.workflow_execution_update_completed_event_attributes
            if completed.meta.update_id in answers:
                answers[completed.meta.update_id] = completed.outcome.success.payloads
    return answers


def group_cost(histories: Iterable[WorkflowHistory]) -> HistoryCost:
    """A group's cost per lease. A lease is a fencing token handed out: as a parked acquire's
    answer, as a grant delivered by activity or signalled to a requester workflow (a token
    answered twice, to an acquire asked again, or carried into the next phase, is one lease).
    A group's runs must carry its workflow id (``fetch_history`` gives it; a stored file, the
    id it is read under)."""
    kinds: Counter[int] = Counter()
    tokens: set[tuple[str, int]] = set()  # each group counts its own tokens
    for history in histories:
        for answer in acquire_answers(history).values():
            token = _token(answer)
            if token is not None:
                tokens.add((history.workflow_id, token))
        for event in history.events:
            kinds[event.event_type] += 1
            token = None
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                scheduled = event.activity_task_scheduled_event_attributes
                if scheduled.activity_type.name == DELIVER_GRANT_ACTIVITY:
                    token = _token(scheduled.input.payloads)
            elif (
                event.event_type
                == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
            ):
                signal = event.signal_external_workflow_execution_initiated_event_attributes
                token = _token(signal.input.payloads)  # the group signals only grants
            if token is not None:
                tokens.add((history.workflow_id, token))
    return _count(len(tokens), kinds)


def rl_job_cost(histories: Iterable[WorkflowHistory]) -> HistoryCost:
    """An RL job's cost per epoch (an epoch is one sample activity)."""
    kinds: Counter[int] = Counter()
    epochs = 0
    for history in histories:
        for event in history.events:
            kinds[event.event_type] += 1
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                name = event.activity_task_scheduled_event_attributes.activity_type.name
                epochs += name == SAMPLE_ACTIVITY
    return _count(epochs, kinds)


def update_names(histories: Iterable[WorkflowHistory]) -> Counter[str]:
    """How many updates of each name the histories accepted."""
    names: Counter[str] = Counter()
    for history in histories:
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
                accepted = event.workflow_execution_update_accepted_event_attributes
                names[accepted.accepted_request.input.name] += 1
    return names


def steady_epochs(histories: Iterable[WorkflowHistory]) -> list[Counter[str]]:
    """An RL job's events from one sample's scheduling to the next's, within a run: an epoch
    past the job's preparing and before its end, by event type."""
    epochs: list[Counter[str]] = []
    for history in histories:
        current: Counter[str] | None = None
        for event in history.events:
            scheduled = event.activity_task_scheduled_event_attributes
            if (
                event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                and scheduled.activity_type.name == SAMPLE_ACTIVITY
            ):
                if current is not None:
                    epochs.append(current)
                current = Counter()
            if current is not None:
                current[event_name(event)] += 1
    return epochs


def event_name(event: Any) -> str:
    """The event's type in lower case; an upsert's also names the attributes it sets."""
    name = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_").lower()
    if event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
        fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes
        name += ":" + ",".join(sorted(fields.indexed_fields))
    return name
