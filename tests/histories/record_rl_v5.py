"""Record RLJobWorkflow histories that speak job protocol v5 (the `job-protocol-v5` patch).

    .venv/bin/python -m tests.histories.record_rl_v5

One `simulated` RL job alone on its group, four epochs, continuing as new every three: each
train's lease is carried into the next sample, and the order its process was told to ask ahead
is forgotten, not cancelled (it never sent it). Writes `rl_job_protocol_v5_run<N>.json`;
`tests/test_replay.py` replays them and checks the patch's marker is there. Re-record only when
the RL job workflow changes on purpose; the other recorders leave these files alone.
"""

from __future__ import annotations

from tests.histories.record_rl_states import record_one_job

PREFIX = "rl_job_protocol_v5_run"
GROUP = "recorded-rl-v5"
JOB = "v5-a"


def main() -> None:
    schedule = {"epochs": 4, "checkpoint_every": 4, "continue_as_new_every": 3}
    record_one_job(PREFIX, GROUP, JOB, schedule)


if __name__ == "__main__":
    main()
