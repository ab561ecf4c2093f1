"""Tenants of a pool (docs/pools.md, "Tenants"): quotas and weights in the placement rule
(plan/placement.py ``decide``) and the queue's order (``admission_order``), on the planner's
real simulator; no server, no process."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from timeslice.plan.placement import QuotaBelowDemand, decide
from timeslice.protocol.pool import (
    PlaceInput,
    Placement,
    PoolConfig,
    PoolJob,
    TenantLimits,
    admission_order,
    tenant_holds,
)
from timeslice.protocol.rl_job import RLJobConfig

from tests.unit.test_pool_placement import BOUND, HEAVY, LIGHT, groups


def on(job_id: str, group: str, tenant: str | None, demand: float | None) -> PoolJob:
    return PoolJob(
        job_id=job_id,
        tenant=tenant,
        demand=demand,
        placement=Placement(sampler_group=group, trainer_group=group),
    )


def ask(placed: list[PoolJob], job: PoolJob, **tenants: TenantLimits) -> PlaceInput:
    return PlaceInput(
        groups=groups("g1", "g2", "g3"), max_slowdown=BOUND, placed=placed, job=job,
        tenants=tenants,
    )  # fmt: skip


def test_a_tenant_at_its_quota_waits_though_a_group_is_free() -> None:
    placed = [on("a1", "g1", "team-a", 0.9)]
    quota = TenantLimits(quota=1.5)
    job = PoolJob(job_id="a2", profile=HEAVY, tenant="team-a", place_anyway=True)
    outcome = decide(ask(placed, job, **{"team-a": quota}))
    assert outcome.placement is None  # place_anyway does not pass a quota
    assert outcome.reason == (
        "queued a2: tenant team-a holds 0.90 of its quota 1.5 groups' worth and a2 needs 0.90"
    )
    # Another tenant's job goes on, and so does a lighter job of the same tenant.
    other = PoolJob(job_id="b1", profile=HEAVY, tenant="team-b")
    assert decide(ask(placed, other, **{"team-a": quota})).placement is not None
    light = PoolJob(job_id="a3", profile=LIGHT, tenant="team-a")
    assert decide(ask(placed, light, **{"team-a": quota})).placement is not None


def test_a_job_without_a_profile_counts_a_whole_group_until_it_measured_one() -> None:
    placed = [on("a1", "g1", "team-a", None)]
    assert tenant_holds(placed, "team-a") == 1.0
    job = PoolJob(job_id="a2", tenant="team-a")
    outcome = decide(ask(placed, job, **{"team-a": TenantLimits(quota=1.5)}))
    assert outcome.placement is None and "holds 1.00 of its quota 1.5" in outcome.reason
    assert PoolJob(job_id="x", mode="async").charged() == 2.0


def test_a_job_above_its_tenants_whole_quota_is_refused() -> None:
    with pytest.raises(QuotaBelowDemand, match=r"more than tenant team-a's whole quota 0\.5"):
        decide(ask([], PoolJob(job_id="a1", profile=HEAVY, tenant="team-a"),
                   **{"team-a": TenantLimits(quota=0.5)}))  # fmt: skip


def test_the_queue_admits_the_tenant_with_the_least_demand_per_weight_first() -> None:
    config = PoolConfig(
        pool="p",
        groups=groups("g1", "g2"),
        tenants={"team-a": TenantLimits(weight=1), "team-b": TenantLimits(weight=3)},
    )
    placed = [on("a1", "g1", "team-a", 1.0), on("b1", "g2", "team-b", 2.0)]
    waiting = [PoolJob(job_id="a2", tenant="team-a"), PoolJob(job_id="b2", tenant="team-b")]
    # team-a holds 1.0 / 1, team-b 2.0 / 3: team-b is owed more.
    assert admission_order(waiting, placed, config).job_id == "b2"
    placed[1].demand = 4.0  # 4.0 / 3 > 1.0 / 1
    assert admission_order(waiting, placed, config).job_id == "a2"
    # The same tenant, or equal shares: the earliest first.
    same = [PoolJob(job_id="a3", tenant="team-a"), PoolJob(job_id="a2", tenant="team-a")]
    assert admission_order(same, placed, config).job_id == "a3"
    # A tenant the config does not name, and jobs naming none, weigh 1 with no quota.
    assert config.limits("team-z") == TenantLimits() == config.limits(None)


def test_tenant_inputs_are_checked() -> None:
    assert TenantLimits.parse("team-a:1.5:2") == ("team-a", TenantLimits(quota=1.5, weight=2))
    assert TenantLimits.parse("team-a:-") == ("team-a", TenantLimits())
    for bad, why in [("team-a", "NAME:QUOTA"), ("team-a:x", "numbers"),
                     ("bad name:1", "invalid tenant"), ("team-a:0", "greater than 0"),
                     ("team-a:1:0", "greater than 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            TenantLimits.parse(bad)
    base = {"job_id": "j", "workload": "simulated", "epochs": 1}
    with pytest.raises(ValidationError, match="tenant are for a job started with pool"):
        RLJobConfig.model_validate({**base, "sampler_group": "g", "tenant": "team-a"})
    with pytest.raises(ValidationError, match="invalid tenant"):
        RLJobConfig.model_validate({**base, "pool": "p", "tenant": "a b"})
    pooled = RLJobConfig.model_validate({**base, "pool": "p"}).model_dump()
    assert "tenant" not in pooled  # as a pool job encoded before tenants
    assert RLJobConfig.model_validate({**base, "pool": "p", "tenant": "t"}).tenant == "t"
