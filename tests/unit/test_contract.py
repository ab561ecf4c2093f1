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
from timeslice.protocol.group import GRANT_SIGNAL, GroupQuery, GroupSignal, GroupUpdate
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


@pytest.mark.parametrize("job_workflow", [RLJobWorkflow, AsyncRLJobWorkflow])
def test_rl_job_workflow_handles_exactly_the_job_messages(job_workflow: type) -> None:
    defn = workflow._Definition.must_from_class(job_workflow)
    # GRANT_SIGNAL is registered at run time by GroupLeases (workflow.set_signal_handler).
    assert _names(defn.signals) == {m.value for m in JobSignal}
    assert GRANT_SIGNAL not in {m.value for m in JobSignal}
    assert _names(defn.queries) == {m.value for m in JobQuery}
    assert _names(defn.updates) == set()


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
