"""The one place that says how workflows run: in Temporal's sandbox (the Replayer, the tests'
workers, ``timeslice worker --sandboxed``) or outside it (the control worker by default).

Modules passed through are imported once per worker process instead of once per workflow run:
the protocol's pydantic models (the whole ``timeslice.protocol`` package) and the workflows'
helper modules, which define no workflow and hold no module state that changes. Everything
else a workflow module imports is re-imported inside the sandbox on every run — every start,
continue-as-new and replay after the worker's cache lost the run — so it must stay small
(tests/test_sandbox.py lists what loads there). Measured on the control worker at 100 jobs on
25 groups: re-importing the job workflow's modules, pydantic's model building among them, took
over half its CPU (BENCHMARKS.md, "Control-plane CPU").

What passing through gives up: the sandbox's checks (no ``time.time()``, no I/O) do not apply
to code in these modules, so they are held to the same rule by review and by the replay tests
(tests/histories) instead. The modules that define workflows, and those that make the
workflows' calls (group_lease, group_switch, pool_job), stay sandboxed.
"""

from __future__ import annotations

from temporalio.worker import UnsandboxedWorkflowRunner, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

# Workflow modules that define no workflow: the group's and the jobs' bookkeeping and helpers.
WORKFLOW_HELPERS = (
    "async_pipeline",
    "book_piece",
    "caller_budget",
    "deadline_timer",
    "grant_policy",
    "group_accounts",
    "group_book",
    "group_patches",
    "inputs",
    "job_failures",
    "job_leases",
    "lease_ledger",
    "residency",
    "snapshot_calls",
    "waiter_queue",
)
PASSED_THROUGH = (
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "timeslice.protocol",  # and every module under it
    *(f"timeslice.workflows.{name}" for name in WORKFLOW_HELPERS),
)


def workflow_runner() -> SandboxedWorkflowRunner:
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSED_THROUGH)
    )


def control_workflow_runner(*, sandboxed: bool = False) -> WorkflowRunner:
    """How the control worker runs its workflows: outside the sandbox unless ``sandboxed``.

    The sandbox's checks are kept where they find mistakes, not where they cost the most: every
    recorded history is replayed in the sandbox (tests/test_replay.py) and the tests' in-process
    workers run in it, so a workflow that reads the clock or does I/O fails there. In the
    control worker the sandbox costs every workflow task an ``exec`` per activation and per
    payload it decodes or encodes (its serialization context is asked inside the sandbox):
    measured, 30-45% of the control worker's CPU per GPU phase and ~8 ms of the job's workflow
    task at each RL job phase boundary (BENCHMARKS.md, "Phase boundaries: the control worker
    outside the sandbox"). Outside it, every run shares the worker's modules; the workflow and
    protocol modules hold no state a run could change (tests/test_sandbox.py checks them).
    """
    return workflow_runner() if sandboxed else UnsandboxedWorkflowRunner()
