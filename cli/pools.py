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
from timeslice.pools import create_pool, parse_pool_config, pool_status
from timeslice.protocol.group import check_id
from timeslice.protocol.pool import DEFAULT_MAX_SLOWDOWN, PoolGroup, PoolStatus
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
    connection(create)
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
    return {"pool": args.name, "groups": groups, "max_slowdown": args.max_slowdown}


def format_status(status: PoolStatus) -> str:
    """What ``timeslice pool status`` prints."""
    config = status.config
    lines = [f"pool {config.pool}: {len(config.groups)} groups, bound {config.max_slowdown:g}x"]
    rows = []
    for group in config.groups:
        on = [
            j
            for j in status.jobs
            if j.placement and group.name in (j.placement.sampler_group, j.placement.trainer_group)
        ]
        jobs = ", ".join(
            f"{j.job_id} ({'no profile' if j.demand is None else f'{j.demand:.2f}'})" for j in on
        )
        demand = sum(j.demand or 0.0 for j in on)
        memory = f"{group.memory_bytes / 2**30:.1f} GiB" if group.memory_bytes else "-"
        rows.append((group.name, memory, group.node or "-", f"{demand:.2f}", jobs or "-"))
    headers = ("group", "memory", "node", "predicted demand", "jobs (demand)")
    lines += table(headers, rows)
    queued = [j for j in status.jobs if j.placement is None]
    lines.append("queue: " + ("-" if not queued else ""))
    lines += [f"  {j.job_id}: {j.queued_because}" for j in queued]
    lines.append("last decisions:")
    lines += [f"  {d.reason}" for d in status.decisions[-10:]] or ["  -"]
    return "\n".join(lines)


async def run(
    args: argparse.Namespace, connect: Callable[[], Awaitable[Client]], flags: str
) -> int:
    """``timeslice pool create`` / ``status``: the input checked before any connection."""
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
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None
    client = await connect()
    await require_control_worker(client, flags)
    status = await pool_status(client, args.name)
    print(
        json.dumps(status.model_dump(mode="json"), indent=2) if args.json else format_status(status)
    )
    return 0
