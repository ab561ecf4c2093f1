"""The node agent with a fake CUDA checkpoint driver, for machines without a GPU.

``python -m tests.fake_cuda_agent --address ADDR --node NODE --calls CALLS.jsonl`` runs what
``timeslice agent`` runs — ``build_node_agent``, its registration socket and its worker on
``timeslice-node-NODE`` — with one difference: the cuda-checkpoint backend's driver is
``tests.fake_cuda_driver.RecordingDriver``, which keeps each process's checkpoint state as the
CUDA driver documents it and writes every call to CALLS.jsonl. Its first line on stdout says
it serves (what ``timeslice.cli.services.start_service`` waits for); SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from timeslice.protocol.group import node_task_queue
from timeslice.transport.connection import connect, connect_config
from timeslice.workers.node_agent import build_node_agent

from tests.fake_cuda_driver import RecordingDriver


async def serve(address: str, node: str, calls: Path, lock_timeout_s: float) -> int:
    client = await connect(connect_config(address))
    agent = build_node_agent(
        client,
        node,
        backend_options={
            "cuda-checkpoint": {
                "driver": RecordingDriver(calls),
                "lock_timeout_s": lock_timeout_s,
            }
        },
    )
    await agent.registration.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with agent.worker:
            health = ", ".join(f"{h.backend}: {h.detail}" for h in agent.health())
            print(f"node agent on task queue {node_task_queue(node)!r} ({health})", flush=True)
            await stop.wait()
    finally:
        await agent.registration.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--calls", type=Path, required=True, help="the driver's JSON-lines log")
    p.add_argument("--lock-timeout", type=float, default=10.0)
    args = p.parse_args()
    return asyncio.run(serve(args.address, args.node, args.calls, args.lock_timeout))


if __name__ == "__main__":
    sys.exit(main())
