"""The one place that says how workflows run in Temporal's sandbox (workers and the Replayer).

Modules passed through are imported once per worker process instead of once per workflow run:
the protocol's pydantic models and the group's decision core are deterministic, hold no global
state that changes, and are the bulk of what a workflow imports. Everything else a workflow
module imports is re-imported inside the sandbox on every run, so it must stay small
(tests/test_sandbox.py lists what loads there).
"""

from __future__ import annotations

from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

PASSED_THROUGH = (
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "timeslice.protocol.group",
    "timeslice.protocol.rl_job",
    "timeslice.workflows.group_book",
)


def workflow_runner() -> SandboxedWorkflowRunner:
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSED_THROUGH)
    )
