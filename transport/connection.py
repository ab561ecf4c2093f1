"""Connecting to Temporal the way the ``temporal`` CLI does (env vars, config profiles)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
from typing import Any

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes
from temporalio.envconfig import ClientConfig
from temporalio.runtime import Runtime
from timeslice.errors import InvalidArgumentError, ServerUnreachableError
from timeslice.protocol.group import CONTROL_TASK_QUEUE
from timeslice.transport.codec import PayloadEncryptionCodec
from timeslice.transport.telemetry import client_interceptors, configure_tracing

DEFAULT_TARGET = "localhost:7233"
_PROBE_TIMEOUT_S = 5.0
_TARGET_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def connect_config(
    target: str | None = None,
    namespace: str | None = None,
    *,
    profile: str | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Resolve settings: explicit arguments, then TEMPORAL_* env / profile, then defaults."""
    try:
        config: dict[str, Any] = dict(ClientConfig.load_client_connect_config(profile=profile))
    except Exception as err:  # the envconfig loader raises plain errors for bad files / profiles
        raise InvalidArgumentError(f"cannot load the Temporal client configuration: {err}") from err
    if target is not None:
        config["target_host"] = target
    config.setdefault("target_host", DEFAULT_TARGET)
    if not _TARGET_RE.fullmatch(str(config["target_host"])):
        raise InvalidArgumentError(
            f"invalid Temporal address {config['target_host']!r}: "
            "use HOST:PORT, e.g. localhost:7233"
        )
    if namespace is not None:
        if not namespace.strip():
            raise InvalidArgumentError("namespace must not be empty")
        config["namespace"] = namespace
    if api_key is not None:
        config["api_key"] = api_key
    return config


def data_converter() -> DataConverter:
    """Pydantic payloads, encrypted when TIMESLICE_PAYLOAD_KEY is set (timeslice.transport.codec).

    Every process connects through :func:`connect`, so all of them encrypt the same way. With a
    key, failure messages and stack traces are encoded too: they name jobs, files and values,
    and would otherwise sit in the history in clear text (docs/security.md)."""
    codec = PayloadEncryptionCodec.from_env()
    if codec is None:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


def _uses_tls(config: dict[str, Any]) -> str | None:
    """Why the connection uses TLS, or None: explicit TLS settings, or an API key (the SDK
    turns TLS on with one, so the key never crosses the network in clear text)."""
    tls = config.get("tls")
    if config.get("api_key") is not None and tls in (None, True):
        return "an API key is set (TEMPORAL_API_KEY, a profile's api_key or api_key=)"
    if tls:
        return "TLS is on (TEMPORAL_TLS*, a profile's tls settings or tls=)"
    return None


async def _speaks_plaintext(config: dict[str, Any]) -> bool:
    """Whether the server answers without TLS. Probed *without* the API key, which must never
    travel unencrypted."""
    probe = {k: v for k, v in config.items() if k not in ("api_key", "tls", "rpc_metadata")}
    try:
        # Bounded: this only refines an error message, it must not double a long wait.
        await asyncio.wait_for(Client.connect(**probe, tls=False), _PROBE_TIMEOUT_S)
    except (RuntimeError, TimeoutError):
        return False
    return True


async def connect(config: dict[str, Any], *, runtime: Runtime | None = None) -> Client:
    """Connect with tracing (workers built on the client inherit its interceptors).

    ``runtime``: e.g. a metrics endpoint's (``timeslice.transport.telemetry``); default: the SDK's.
    """
    configure_tracing()
    converter = data_converter()
    try:
        return await Client.connect(
            **config,
            data_converter=converter,
            interceptors=client_interceptors(),
            runtime=runtime,
        )
    except RuntimeError as err:
        why_tls = _uses_tls(config)
        if why_tls is not None and await _speaks_plaintext(config):
            # Not unreachable: reachable, but only in plaintext (e.g. `timeslice server`).
            raise ServerUnreachableError(
                f"Temporal at {config['target_host']} speaks plaintext, but this client "
                f"connects with TLS because {why_tls}. For a local server without "
                "authentication (such as `timeslice server`) drop the API key / TLS settings; "
                "for a cluster that checks API keys, use its TLS endpoint"
            ) from err
        target = config["target_host"]
        from_env = os.environ.get("TEMPORAL_ADDRESS")
        # An explicit address (target= or --address) wins over the environment: say so when
        # both are set, or the advice to set TEMPORAL_ADDRESS would change nothing.
        ignored = (
            f" (TEMPORAL_ADDRESS={from_env} is set, but an address given to the client or "
            "with --address wins over it)"
            if from_env and from_env != target
            else ""
        )
        raise ServerUnreachableError(
            f"cannot reach Temporal at {target} ({err}){ignored}; start one with "
            "`timeslice server`, or give the address of a running cluster: --address or "
            "target=, or TEMPORAL_ADDRESS when neither is given"
        ) from err


# A live worker's long poll lasts up to a minute, and the server lists each poller with the
# time its last poll came in: one listed as last seen longer ago than this has stopped.
POLLER_FRESH_S = 90.0


async def pollers(
    client: Client, task_queue: str, *, activities: bool = False, fresh_s: float = POLLER_FRESH_S
) -> int:
    """How many workers poll ``task_queue`` (its workflow tasks, or with ``activities`` its
    activity tasks) in the client's namespace, as the server lists them: Temporal's own record
    of who serves a queue. A worker that stopped stays listed for a while; one not seen for
    ``fresh_s`` seconds is not counted."""
    described = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY
            if activities
            else TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
    )
    now = time.time()
    return sum(
        1
        for p in described.pollers
        if not p.HasField("last_access_time") or now - p.last_access_time.ToSeconds() <= fresh_s
    )


async def control_workers_polling(client: Client) -> int:
    """How many control workers poll the groups' task queue in the client's namespace (with
    none, no group or RL job ever answers)."""
    described = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=CONTROL_TASK_QUEUE),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
    )
    return len(described.pollers)
