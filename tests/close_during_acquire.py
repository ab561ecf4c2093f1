"""Close a client while its acquire is parked at a group that will not take the request back
(for tests/test_client_outcomes.py, in a process of its own: pytest's log capture keeps
records, and with them the client's tasks, alive past the test).

    python -m tests.close_during_acquire ADDRESS

Prints what the acquire ended in; asyncio prints a task's unread failure (to stderr) when the
closed client's tasks are collected, which the caller looks for.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import uuid

from temporalio.worker import Worker
from timeslice import TimeSliceOrchestratorClient
from timeslice.protocol.group import group_workflow_id
from timeslice.transport.connection import connect, connect_config
from timeslice.workers.sandbox import workflow_runner

from tests.forger_workflows import SilentGroupWorkflow


def main(address: str) -> str:
    group = f"silent-{uuid.uuid4().hex[:8]}"
    queue = f"silent-{uuid.uuid4().hex[:8]}"
    clients = [
        TimeSliceOrchestratorClient(target=address, job_id=f"closing-{uuid.uuid4().hex[:6]}")
    ]
    clients[0].connect()

    def acquire() -> str:
        try:
            clients[0].acquire(group, timeout=60)
        except BaseException as err:  # what the acquire ends in is the caller's to check
            return type(err).__name__
        return "granted"

    async def stand_in() -> str:
        client = await connect(connect_config(address))
        async with Worker(
            client,
            task_queue=queue,
            workflows=[SilentGroupWorkflow],
            workflow_runner=workflow_runner(),
        ):
            handle = await client.start_workflow(
                SilentGroupWorkflow.run, id=group_workflow_id(group), task_queue=queue
            )
            try:
                acquiring = asyncio.create_task(asyncio.to_thread(acquire))
                while await handle.query("asked", result_type=int) < 1:
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(clients[0].close)
                return await asyncio.wait_for(acquiring, 60)
            finally:
                await handle.terminate()

    ended = asyncio.run(stand_in())
    clients.clear()
    gc.collect()
    return ended


if __name__ == "__main__":
    print(f"ended: {main(sys.argv[1])}", flush=True)
    sys.stderr.flush()
    os._exit(0)  # temporalio/sdk-python#300: no interpreter teardown
