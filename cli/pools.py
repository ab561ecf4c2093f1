"""``timeslice pool``: create a pool of GPU groups, and see what it placed and why
(docs/pools.md)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from temporalio.client import Client
from timeslice.cli.groups import require_control_worker
from timeslice.errors import InvalidArgumentError
from timeslice.pools import create_pool, move_pool_job, parse_pool_config, pool_status
from timeslice.protocol.group import check_id
from timeslice.protocol.pool import (
    DEFAULT_MAX_SLOWDOWN,
    DEFAULT_MOVE_EVERY_EPOCHS,
    DEFAULT_MOVE_HORIZON_S,
    PoolGroup,
    PoolStatus,
    TenantLimits,
    tenant_holds,
)
from timeslice.report.text import table

AddConnectionArgs = Callable[[argparse.ArgumentParser], None]


def add_parser(sub: argparse._SubParsersAction, connection: AddConnectionArgs) -> None:  # type: ignore[type-arg]
    """``timeslice pool create`` and ``timeslice pool status``."""
    pool = sub.add_parser("pool", help="pools of GPU groups that place the jobs sent to them")
    commands = pool.add_subparsers(dest="pool_command", required=True)
    create = commands.add_parser(
        "create",
        help="create a pool (a PoolWorkflow, id timeslice-pool-NAME)",
        description="Create a pool of GPU groups; jobs started with --pool NAME are placed on "
        "its groups (docs/pools.md). A group belongs to one pool.",
    )
    create.add_argument("name", help="the pool's name")
    create.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="NAME[:MEMORY[:NODE]]",
        help="a group of the pool, its device memory (80GiB, 16e9) and node (repeatable)",
    )
    create.add_argument(
        "--max-slowdown",
        type=float,
        default=DEFAULT_MAX_SLOWDOWN,
        help="no job is placed where it is predicted slower than this times its rate alone "
        f"(default {DEFAULT_MAX_SLOWDOWN})",
    )
    create.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME:QUOTA[:WEIGHT]",
        help="a tenant's quota (the most groups' worth of GPU demand its jobs may hold; '-': "
        "none) and weight (who is admitted first when jobs wait; default 1) (repeatable)",
    )
    create.add_argument(
        "--no-auto-move",
        action="store_true",
        help="never move a placed job by itself (moves by hand: timeslice pool move)",
    )
    create.add_argument(
        "--move-horizon",
        type=float,
        default=DEFAULT_MOVE_HORIZON_S,
        metavar="S",
        help="a move is made when its predicted gain over this many seconds exceeds its cost "
        f"(default {DEFAULT_MOVE_HORIZON_S:g})",
    )
    create.add_argument(
        "--move-every",
        type=int,
        default=DEFAULT_MOVE_EVERY_EPOCHS,
        metavar="EPOCHS",
        help="no job moves more than once in this many of its epochs "
        f"(default {DEFAULT_MOVE_EVERY_EPOCHS})",
    )
    connection(create)
    move = commands.add_parser(
        "move",
        help="move a placed job to another group of the pool",
        description="Move a job the pool placed to another of its groups; the job takes it at "
        "its next checkpoint boundary, prepared again there from that checkpoint "
        "(docs/pools.md).",
    )
    move.add_argument("name", help="the pool's name")
    move.add_argument("job", help="the job's id")
    move.add_argument("group", help="the group it moves to (an async job: its sampler's)")
    move.add_argument(
        "--trainer-group",
        metavar="GROUP",
        help="an async job: the group its trainer moves to (another than GROUP)",
    )
    connection(move)
    status = commands.add_parser("status", help="a pool's groups, jobs, queue and decisions")
    status.add_argument("name", help="the pool's name")
    status.add_argument("--json", action="store_true", help="the status as JSON")
    connection(status)


def pool_config_data(args: argparse.Namespace) -> dict[str, object]:
    """The pool's config from the command line, each ``--group`` checked."""
    groups = []
    for text in args.group:
        try:
            groups.append(PoolGroup.parse(text).model_dump())
        except ValidationError as err:
            problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in err.errors())
            raise InvalidArgumentError(f"--group {text!r}: {problems}") from None
        except ValueError as err:
            raise InvalidArgumentError(f"--group {text!r}: {err}") from None
    tenants: dict[str, object] = {}
    for text in args.tenant:
        try:
            name, limits = TenantLimits.parse(text)
        except ValidationError as err:
            problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in err.errors())
            raise InvalidArgumentError(f"--tenant {text!r}: {problems}") from None
        except ValueError as err:
            raise InvalidArgumentError(f"--tenant {text!r}: {err}") from None
        if name in tenants:
            raise InvalidArgumentError(f"--tenant {name!r} given twice")
        tenants[name] = limits.model_dump()
    return {
        "pool": args.name,
        "groups": groups,
        "tenants": tenants,
        "max_slowdown": args.max_slowdown,
        "auto_move": not args.no_auto_move,
        "move_horizon_s": args.move_horizon,
        "move_every_epochs": args.move_every,
    }


def format_status(status: PoolStatus) -> str:
    """What ``timeslice pool status`` prints."""
    config = status.config
    moves = (
        f"moves when a move gains more than it costs over {config.move_horizon_s:g} s, at most "
        f"once in {config.move_every_epochs} epochs a job"
        if config.auto_move
        else "moves by hand only"
    )
    lines = [
        f"pool {config.pool}: {len(config.groups)} groups, bound {config.max_slowdown:g}x; {moves}"
    ]
    rows = []
    for group in config.groups:
        on = [
            j
            for j in status.jobs
            if j.placement and group.name in (j.placement.sampler_group, j.placement.trainer_group)
        ]
        jobs = ", ".join(
            f"{j.job_id} ({'no profile' if j.demand is None else f'{j.demand:.2f}'}"
            f"{f', moving from {j.moving_from.sampler_group}' if j.moving_from else ''}"
            f"{f', moved {j.moves}x' if j.moves else ''})"
            for j in on
        )
        demand = sum(j.demand or 0.0 for j in on)
        memory = f"{group.memory_bytes / 2**30:.1f} GiB" if group.memory_bytes else "-"
        rows.append((group.name, memory, group.node or "-", f"{demand:.2f}", jobs or "-"))
    headers = ("group", "memory", "node", "predicted demand", "jobs (demand)")
    lines += table(headers, rows)
    tenants = sorted({j.tenant_name for j in status.jobs} | set(config.tenants))
    if config.tenants or len(tenants) > 1:
        rows = []
        for tenant in tenants:
            limits = config.limits(tenant)
            quota = "-" if limits.quota is None else f"{limits.quota:g}"
            jobs = [j for j in status.jobs if j.tenant_name == tenant]
            waiting = sum(1 for j in jobs if j.placement is None)
            held = f"{tenant_holds(status.jobs, tenant):.2f}"
            rows.append((tenant, quota, f"{limits.weight:g}", held, str(len(jobs) - waiting),
                         str(waiting)))  # fmt: skip
        lines += table(("tenant", "quota", "weight", "holds", "placed", "queued"), rows)
    queued = [j for j in status.jobs if j.placement is None]
    lines.append("queue: " + ("-" if not queued else ""))
    lines += [f"  {j.job_id}: {j.queued_because}" for j in queued]
    lines.append("last decisions:")
    lines += [f"  {d.reason}" for d in status.decisions[-10:]] or ["  -"]
    return "\n".join(lines)


async def run(
    args: argparse.Namespace, connect: Callable[[], Awaitable[Client]], flags: str
) -> int:
    """``timeslice pool create`` / ``move`` / ``status``: the input checked before any
    connection."""
    if args.pool_command == "create":
        config = parse_pool_config(pool_config_data(args))
        client = await connect()
        await require_control_worker(client, flags)
        handle = await create_pool(client, config)
        print(f"created pool {config.pool}: workflow {handle.id}, groups "
              + ", ".join(g.name for g in config.groups))  # fmt: skip
        return 0
    try:
        check_id("pool name", args.name)
        if args.pool_command == "move":
            check_id("job id", args.job)
            check_id("group id", args.group)
            if args.trainer_group is not None:
                check_id("trainer group id", args.trainer_group)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None
    client = await connect()
    await require_control_worker(client, flags)
    if args.pool_command == "move":
        decision = await move_pool_job(client, args.name, args.job, args.group, args.trainer_group)
        print(f"{decision.reason}: it moves at its next checkpoint boundary")
        return 0
    status = await pool_status(client, args.name)
    print(
        json.dumps(status.model_dump(mode="json"), indent=2) if args.json else format_status(status)
    )
    return 0
