"""A job phase's first heartbeat waits for a quarter of its heartbeat time-out
(activities/job_runtime.py, ``_heartbeat``), run in the SDK's activity environment."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.testing import ActivityEnvironment
from timeslice.activities.job_runtime import FIRST_HEARTBEAT_AFTER, _heartbeat


@activity.defn
async def beats_once() -> None:
    _heartbeat({"step": 1})


def _sent(age: timedelta, timeout: timedelta | None) -> list[tuple]:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info, heartbeat_timeout=timeout, started_time=datetime.now(UTC) - age
    )
    sent: list[tuple] = []
    env.on_heartbeat = lambda *details: sent.append(details)
    asyncio.run(env.run(beats_once))
    return sent


def test_a_young_phase_sends_no_heartbeat():
    timeout = timedelta(seconds=30)
    assert _sent(timedelta(seconds=1), timeout) == []
    assert _sent(timeout * FIRST_HEARTBEAT_AFTER - timedelta(seconds=1), timeout) == []


def test_a_phase_past_a_quarter_of_its_time_out_heartbeats_with_its_details():
    timeout = timedelta(seconds=30)
    assert _sent(timeout * FIRST_HEARTBEAT_AFTER + timedelta(seconds=1), timeout) == [
        ({"step": 1},)
    ]


def test_an_activity_without_a_heartbeat_time_out_heartbeats_as_before():
    assert _sent(timedelta(0), None) == [({"step": 1},)]
