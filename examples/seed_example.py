"""The seed example: time-slice two phases of a training loop over two GPU groups.

Run `timeslice server` and `timeslice worker`, then two (or more) of these at once:

    .venv/bin/python examples/seed_example.py & .venv/bin/python examples/seed_example.py; wait

The client finds the server the way the `temporal` CLI does (TEMPORAL_ADDRESS and the rest of
its conventions), else at localhost:7233. Each process registers a snapshot backend: whenever
the other process takes a group, the group moves this one's state off the device, and back
before its next phase (`timeslice status trainer-group` counts the switches and the bytes).
Here the state is a `simulated` one of 256 MiB, as the model is a stand-in; a real loop
registers its model with a `TorchBackend` (README, "Use it in a training loop"). The statements
from `state = ...` to `generate_phase` are the seed example; the rest is a tiny stand-in model
and loop so the file runs as is (set TIMESLICE_EXAMPLE_LOG to log hold intervals as JSON).
"""

import json
import os
import time

from timeslice import TimeSliceOrchestratorClient
from timeslice.snapshot.simulated import SimulatedBackend

state = SimulatedBackend(nbytes=256 << 20, snapshot_s=0.02)  # the device state a switch moves
orchestrator = TimeSliceOrchestratorClient(snapshot_backends=[state])


@orchestrator.on_accelerators(group_id="trainer-group")
def train_phase(model, trajectories):
    return model.update(trajectories)


@orchestrator.on_accelerators(group_id="sampler-group")
def generate_phase(model, prompts):
    return model.generate(prompts)


class TinyModel:
    """Stands in for a policy: 'generates' by scoring prompts, 'trains' by moving one weight."""

    def __init__(self, name: str, log_path: str | None) -> None:
        self.name = name
        self.weight = 0.0
        self.log_path = log_path

    def _log(self, group: str, start: float) -> None:
        if self.log_path:
            with open(self.log_path, "a") as log:
                record = {"job": self.name, "group": group, "start": start, "end": time.monotonic()}
                log.write(json.dumps(record) + "\n")

    def generate(self, prompts: list[int]) -> list[float]:
        start = time.monotonic()
        time.sleep(0.1)  # the GPU phase
        out = [p * self.weight for p in prompts]
        self._log("sampler-group", start)
        return out

    def update(self, trajectories: list[float]) -> float:
        start = time.monotonic()
        time.sleep(0.1)
        self.weight += 0.1
        self._log("trainer-group", start)
        return self.weight


if __name__ == "__main__":
    model = TinyModel(orchestrator.job_id, os.environ.get("TIMESLICE_EXAMPLE_LOG"))
    for epoch in range(int(os.environ.get("TIMESLICE_EXAMPLE_EPOCHS", "30"))):
        trajectories = generate_phase(model, prompts=[1, 2, 3])
        time.sleep(0.1)  # reward computation: no GPU needed, the group serves someone else
        weight = train_phase(model, trajectories)
        print(f"{orchestrator.job_id} epoch {epoch}: weight {weight:.1f}", flush=True)
    orchestrator.close()
