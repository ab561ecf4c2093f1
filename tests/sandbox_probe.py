"""A workflow that reports which ``timeslice`` modules the sandbox holds (tests/test_sandbox.py).

It imports the project's workflow modules the way a worker's sandbox does, then lists what got
loaded with them: module name -> id() of the module object, so the test can tell a module
passed through (the worker process's own object) from one imported again inside the sandbox.
"""

from __future__ import annotations

import sys

import timeslice.workflows.async_rl_job
import timeslice.workflows.gpu_group
import timeslice.workflows.pool
import timeslice.workflows.rl_job
import timeslice.workflows.snapshot_job  # noqa: F401
from temporalio import workflow


@workflow.defn(name="SandboxProbe")
class SandboxProbe:
    @workflow.run
    async def run(self) -> dict[str, int]:
        return {
            name: id(module) for name, module in sys.modules.items() if name.startswith("timeslice")
        }
