"""The message contract: every signal, update, query and activity name the protocol modules
declare has a handler, and every handler a declared name — so a typo is a failing test, not a
silent no-op at run time."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest
from temporalio import activity, workflow
from timeslice.activities import async_job, group_requests, job_runtime
from timeslice.protocol import async_rl_job as async_protocol
from timeslice.protocol import group as protocol
from timeslice.protocol import rl_job as rl_protocol
from timeslice.protocol.group import (
    GRANT_SIGNAL,
    GROUP_MESSAGE_ABOUT,
    GroupQuery,
    GroupSignal,
    GroupUpdate,
)
from timeslice.protocol.rl_job import JobQuery, JobSignal
from timeslice.session import grants, snapshot_activities
from timeslice.workflows.async_rl_job import AsyncRLJobWorkflow
from timeslice.workflows.gpu_group import GpuGroupWorkflow
from timeslice.workflows.rl_job import RLJobWorkflow
from timeslice.workflows.snapshot_job import SnapshotJobWorkflow


def _names(handlers: dict) -> set[str]:
    return {str(name) for name in handlers}


def test_group_workflow_handles_exactly_the_group_messages() -> None:
    defn = workflow._Definition.must_from_class(GpuGroupWorkflow)
    assert _names(defn.signals) == {m.value for m in GroupSignal}
    assert _names(defn.updates) == {m.value for m in GroupUpdate}
    assert _names(defn.queries) == {m.value for m in GroupQuery}


def test_every_group_handler_says_what_it_does() -> None:
    """The Web UI and ``temporal workflow metadata`` show each handler's description: the
    contract's (``GROUP_MESSAGE_ABOUT``), for every message it declares."""
    defn = workflow._Definition.must_from_class(GpuGroupWorkflow)
    handlers = {**defn.signals, **defn.updates, **defn.queries}
    assert len(handlers) == 13
    assert set(GROUP_MESSAGE_ABOUT) == {str(name) for name in handlers}
    undescribed = sorted(str(name) for name, h in handlers.items() if not h.description)
    assert not undescribed, f"GpuGroupWorkflow handlers without a description: {undescribed}"
    assert all(h.description == GROUP_MESSAGE_ABOUT[name] for name, h in handlers.items())


@pytest.mark.parametrize("job_workflow", [RLJobWorkflow, AsyncRLJobWorkflow])
def test_rl_job_workflow_handles_exactly_the_job_messages(job_workflow: type) -> None:
    defn = workflow._Definition.must_from_class(job_workflow)
    # Besides the job's own, the groups' grant signal (the same for every requester workflow).
    assert _names(defn.signals) == {m.value for m in JobSignal} | {GRANT_SIGNAL}
    assert GRANT_SIGNAL not in {m.value for m in JobSignal}
    assert _names(defn.queries) == {m.value for m in JobQuery}
    assert _names(defn.updates) == set()


@pytest.mark.parametrize("job_workflow", [RLJobWorkflow, AsyncRLJobWorkflow])
def test_every_job_workflow_handler_says_what_it_does(job_workflow: type) -> None:
    """The Web UI and `temporal workflow metadata` show each handler's description."""
    defn = workflow._Definition.must_from_class(job_workflow)
    handlers = [*defn.signals.values(), *defn.queries.values(), *defn.updates.values()]
    assert handlers
    for handler in handlers:
        assert handler.description and len(handler.description) > 40, handler.name


def test_snapshot_job_workflow_takes_no_messages() -> None:
    defn = workflow._Definition.must_from_class(SnapshotJobWorkflow)
    assert not defn.signals and not defn.updates and not defn.queries


def _declared_activities(*modules: ModuleType) -> set[str]:
    return {
        value
        for module in modules
        for name, value in vars(module).items()
        if name.endswith("_ACTIVITY") and isinstance(value, str)
    }


def _defined_activities(*modules: ModuleType) -> set[str]:
    found: set[str] = set()
    for module in modules:
        for _, obj in inspect.getmembers(module):
            candidates = [obj]
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                candidates = [member for _, member in inspect.getmembers(obj)]
            for candidate in candidates:
                if callable(candidate):
                    defn = activity._Definition.from_callable(candidate)
                    if defn is not None and defn.name:
                        found.add(defn.name)
    return found


def test_every_declared_activity_is_defined_and_every_defined_one_declared() -> None:
    declared = _declared_activities(protocol, rl_protocol, async_protocol)
    defined = _defined_activities(
        grants, group_requests, job_runtime, async_job, snapshot_activities
    )
    assert declared == defined
