"""Record an RLJobWorkflow history down the `labelled-lease-waits` patch.

    .venv/bin/python -m tests.histories.record_rl_labelled

One `simulated` RL job alone on its group, two epochs with a checkpoint after each: its prepare
and checkpoint leases are the workflow's own, and each wait for their grants passes the patch
(a labelled timer where the grant is not there yet). Writes `rl_job_labelled_waits_run<N>.json`;
`tests/test_replay.py` replays it and checks the patch's marker is there. Re-record only when
the RL job workflow changes on purpose; the other recorders leave these files alone.
"""

from __future__ import annotations

from tests.histories.record_rl_states import record_one_job

PREFIX = "rl_job_labelled_waits_run"
GROUP = "recorded-rl-labelled"
JOB = "labelled-a"


def main() -> None:
    schedule = {"epochs": 2, "checkpoint_every": 1}
    record_one_job(PREFIX, GROUP, JOB, schedule)


if __name__ == "__main__":
    main()
