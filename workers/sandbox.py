"""The one place that says how workflows run in Temporal's sandbox (workers and the Replayer).

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
