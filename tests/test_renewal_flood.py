"""A raw update flood past Temporal's in-flight limit costs a holder nothing (issue 36).

Temporal admits a few updates in flight per workflow (10 on the dev server,
``history.maxInFlightUpdates``) and refuses the rest with ``RESOURCE_EXHAUSTED`` before any
validator runs. A caller that keeps more than that on their way into a group — raw RPCs, no
client, ignoring every refusal — got the holder's ``renew`` updates refused too, and the holder
lost its lease (BENCHMARKS.md, "Neighbours"). The holder now renews by signal when its update is
refused for capacity, and learns the outcome from the group's ``holder`` query.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from temporalio.api.common.v1 import Payloads, WorkflowExecution
from temporalio.api.enums.v1 import UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import Input, Meta, Request, WaitPolicy
from temporalio.api.workflowservice.v1 import UpdateWorkflowExecutionRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import GroupNotAnsweringError
from timeslice.protocol.group import (
    AcquireCall,
    AcquireRequest,
    GroupUpdate,
    RenewRequest,
    RenewResult,
    group_workflow_id,
    lease_key_hash,
)
from timeslice.transport.renewals import renew_by_signal

from tests.conftest import ARTIFACTS
from tests.helpers import wait_for

# Temporal admits 10 updates in flight per workflow on the dev server. The flood keeps it
# full as cheaply as it can: PARKED acquires that the group keeps waiting (its most, so a
# holder's renewals would have room) and TRY_LOCKS try-locks at a time for the rest, each sent
# again as soon as it is answered or refused.
PARKED = 8
TRY_LOCKS = 4
# The flood lasts this long (past the holder's TTL of 10 s) and until the server has refused
# it for capacity this often: a condition, not a length (a slow machine floods longer).
FLOOD_S = 20.0
FULL_REFUSALS = 50
_ACCEPTED = UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ACCEPTED
_COMPLETED = (
    UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_COMPLETED
)


async def _raw_flood(
    address: str, group: str, stop: threading.Event, seen: Counter, said: dict[str, str]
) -> None:
    """A hostile caller's acquires as raw RPCs, no client, no resends, refusals ignored."""
    client = await Client.connect(address)
    execution = WorkflowExecution(workflow_id=group_workflow_id(group))

    async def send(park: bool) -> None:
        rid = f"noisy:{uuid.uuid4().hex}"
        request = AcquireRequest(
            request_id=rid,
            job_id="noisy",
            reply_task_queue="noisy-queue",
            key_hash=lease_key_hash(f"key-of-{rid}-0123456789"),
        )
        call = AcquireCall(request=request, park=park, only_if_free=not park)
        payloads = await client.data_converter.encode([call])
        update = UpdateWorkflowExecutionRequest(
            namespace=client.namespace,
            workflow_execution=execution,
            request=Request(
                meta=Meta(update_id=str(uuid.uuid4()), identity="noisy"),
                input=Input(name=GroupUpdate.ACQUIRE, args=Payloads(payloads=payloads)),
            ),
            wait_policy=WaitPolicy(lifecycle_stage=_ACCEPTED if park else _COMPLETED),
        )
        try:
            response = await client.workflow_service.update_workflow_execution(
                update, retry=False, timeout=timedelta(seconds=10)
            )
        except RPCError as err:
            if err.status == RPCStatusCode.RESOURCE_EXHAUSTED:
                seen["full"] += 1
                said.setdefault("full", err.message)
            else:
                seen[f"rpc {err.status.name}"] += 1
                said.setdefault(err.status.name, err.message)
            return
        if response.outcome.HasField("failure"):
            seen["refused"] += 1
            said.setdefault("refused", response.outcome.failure.message)
        else:
            seen["parked" if park and not response.HasField("outcome") else "answered"] += 1

    async def spin() -> None:
        while not stop.is_set():
            await send(park=False)

    for _ in range(PARKED):
        await send(park=True)
    await asyncio.gather(*(spin() for _ in range(TRY_LOCKS)))


@pytest.mark.long  # ~50 s of a flood that starves whatever shares the cores with it
def test_a_raw_flood_past_the_in_flight_limit_costs_holders_at_ttl_1_and_10_s_nothing(
    address: str, make_client: Callable[..., Any]
) -> None:
    tag = uuid.uuid4().hex[:6]
    # The server drops the group's workflow tasks while it refuses the flood, so the answers to
    # the renewals do not come within a second; the TTL-1 s holder keeps its lease because
    # the server's word that it recorded a renewal signal in time is enough (the group's
    # renewal rule, transport.renewals.counted_from_signal).
    groups = {1.0: f"raw-flood-1s-{tag}", 10.0: f"raw-flood-10s-{tag}"}
    holders = {
        ttl: make_client(job_id=f"holder-{int(ttl)}s-{tag}", lease_ttl=ttl) for ttl in groups
    }
    for ttl, group in groups.items():
        holders[ttl].create_group(group, max_parked_waits=PARKED)
    leases = {ttl: holders[ttl].acquire(group, timeout=60) for ttl, group in groups.items()}
    seen = {ttl: Counter() for ttl in groups}
    said: dict[str, str] = {}
    stop = threading.Event()

    async def flood_both() -> None:
        await asyncio.gather(
            *(_raw_flood(address, group, stop, seen[ttl], said) for ttl, group in groups.items())
        )

    flood = threading.Thread(target=lambda: asyncio.run(flood_both()), daemon=True)
    valid = Counter()  # lease.valid, sampled every 50 ms while the flood lasts

    def flooded_long_enough() -> bool:
        valid.update(ttl for ttl, lease in leases.items() if lease.valid)
        valid["samples"] += 1
        revoked = any(lease.revoked_reason is not None for lease in leases.values())
        return revoked or (
            time.monotonic() - started >= FLOOD_S
            and all(counts["full"] >= FULL_REFUSALS for counts in seen.values())
        )

    started = time.monotonic()
    flood.start()
    try:
        wait_for(
            flooded_long_enough,
            timeout=FLOOD_S + 90,
            what="the flood's length and its refusals for capacity",
        )
    finally:
        stop.set()
        flood.join(30)
    # Still held after the flood (valid again if an answer came slow at its end).
    wait_for(
        lambda: all(lease.valid or lease.revoked_reason for lease in leases.values()),
        timeout=30,
        what="the leases' state",
    )
    try:
        statuses = {ttl: holders[ttl].group_status(group) for ttl, group in groups.items()}
    except GroupNotAnsweringError:
        for group in groups.values():
            known = asyncio.run(_known_sdk_wedge(address, group))
            if known is not None:
                pytest.xfail(f"group {group} wedged by the SDK's known ordering bug: {known}")
        raise
    print(
        f"\nraw flood beside holders at TTL 1 s and 10 s: {seen} {said}; leases locally valid "
        f"in {dict(valid)} samples ({time.monotonic() - started:.1f} s)"
    )
    for counts in seen.values():  # the flood did keep Temporal's limit full
        assert counts["parked"] == PARKED and counts["full"] >= FULL_REFUSALS, seen
    # The flooder is told why (Temporal's limit; what reaches the group is refused past its
    # rate, as tests/test_caller_fairness.py shows).
    assert "in-flight updates" in said["full"], said
    for ttl, lease in leases.items():
        assert lease.revoked_reason is None, (ttl, lease.revoked_reason)
        # Kept is the claim (above and below: never revoked, never expired at the group).
        # How much of the flood it stayed locally usable is a figure, in BENCHMARKS.md
        # ("Neighbours"): 83-100% of the samples in the runs seen (an answer that came late
        # lets the local validity lapse until it comes; 323 of 389 in one CI run); the bound
        # here only says it was usable most of the time. Before, renewals refused for
        # capacity were sent again until one got in, and over 20 s the group revoked it.
        assert valid[ttl] >= 0.5 * valid["samples"], valid
        status = statuses[ttl]
        assert status.holder is not None and status.holder.token == lease.token, status.holder
        assert status.stats.expired == 0, (ttl, status.stats)
        assert holders[ttl].release(lease) is False  # released, never revoked
        assert holders[ttl]._session._renewal_rules == {groups[ttl]: True}


def test_a_renewal_by_signal_after_the_lease_expired_renews_nothing(
    address: str, group: str, make_client: Callable[..., Any]
) -> None:
    """The one-holder rule holds on the signal path: a renewal that reaches the group after
    the lease ran out is answered "not held", and the group keeps it ended."""
    from timeslice.transport.connection import connect, connect_config

    holder = make_client(job_id="late-renewer", lease_ttl=1.0)
    lease = holder.acquire(group, timeout=60)
    holder._session.forget(lease)  # this process stops renewing (a pause, a lost network)
    # Expired, or ended as dead if no renewal had confirmed its grant yet.
    wait_for(
        lambda: holder.group_status(group).holder is None,
        timeout=60,
        what="the group to end the unrenewed lease",
    )
    renew = RenewRequest(request_id=lease.request_id, token=lease.token, key=lease.key)

    async def renew_late() -> RenewResult:
        client = await connect(connect_config(address))
        return await renew_by_signal(client, group, renew, every_s=0.3, give_up_after_s=30)

    result = asyncio.run(renew_late())
    assert not result.valid and "no longer held" in result.reason, result
    status = holder.group_status(group)
    assert status.holder is None and status.stats.leases == 1, status


def test_a_group_that_states_no_renewal_rule_is_not_trusted_on_a_signal(address: str) -> None:
    """A group of a release before the ``renewal_rule`` query (here a workflow standing in for
    one, under a group's workflow id) is taken as ending a lease whose renewal it handles
    late: the holder then counts its lease only from the group's answers."""
    from temporalio.worker import Worker
    from timeslice.transport.connection import connect, connect_config
    from timeslice.transport.renewals import group_renewal_rule
    from timeslice.workers.sandbox import workflow_runner

    from tests.requester_workflows import GroupWithoutRenewalRule

    group = f"older-{uuid.uuid4().hex[:8]}"
    queue = f"older-group-{uuid.uuid4().hex[:8]}"

    async def ask() -> bool | None:
        client = await connect(connect_config(address))
        async with Worker(
            client,
            task_queue=queue,
            workflows=[GroupWithoutRenewalRule],
            workflow_runner=workflow_runner(),
        ):
            handle = await client.start_workflow(
                GroupWithoutRenewalRule.run, id=group_workflow_id(group), task_queue=queue
            )
            try:
                return await group_renewal_rule(client, group)
            finally:
                await handle.terminate("test done")

    assert asyncio.run(ask()) is False


# The SDK's ordering bug that wedges a flooded group (tests/test_replay.py stores two
# reproductions as strict xfails): a workflow task that recorded the main loop's timer before
# an update's acceptance fails every replay with this nondeterminism error. Its other form, a
# patch marker an update handler recorded after that timer ("UpsertWorkflowSearchAttributes
# Machine does not handle ..."), cannot happen to a group that asks its patches at start
# (workflows/group_patches.py, PATCHES_AT_START), so here it fails the test.
_KNOWN_WEDGE = "Update machine does not handle"


async def _known_sdk_wedge(address: str, group: str) -> str | None:
    """The message of a workflow task of the group that failed with the known SDK ordering
    error (then the group's task fails from there on, whatever the test asks), or None. The
    group's history is kept in ``test-artifacts/flood/`` either way (what it held before the
    wedge, a timed-out workflow task for one, is what the upstream issue turns on)."""
    client = await Client.connect(address)
    history = await client.get_workflow_handle(group_workflow_id(group)).fetch_history()
    kept = ARTIFACTS / "flood" / f"{group}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(history.to_json())
    for event in history.events:
        if event.HasField("workflow_task_failed_event_attributes"):
            message = event.workflow_task_failed_event_attributes.failure.message
            wedged = "Nondeterminism error" in message and "TimerStarted" in message
            if wedged and _KNOWN_WEDGE in message:
                return message
    return None
