"""Observability: a worker's Prometheus endpoint, and the span tree of acquire → phase → release.

Each test runs its own dev server, so every workflow task lands on the worker under test (the
session's control worker would otherwise take some of them).
"""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from timeslice import AsyncTimeSliceOrchestratorClient, TimeSliceOrchestratorClient
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.cli.stack import Stack
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import (
    GROUP_WORKFLOW_TYPE,
    REQUEST_GROUP_ACTIVITY,
    SNAPSHOT_ACTIVITY,
    GroupUpdate,
    ReleaseRequest,
    RenewRequest,
    RenewResult,
    group_workflow_id,
)
from timeslice.protocol.rl_job import SAMPLE_ACTIVITY
from timeslice.snapshot.simulated import SimulatedBackend
from timeslice.transport.connection import connect, connect_config
from timeslice.transport.telemetry import otlp_tracing_requested, start_metrics_endpoint
from timeslice.workers.control import build_control_worker
from timeslice.workers.job import build_job_runtime, build_job_worker

from tests.conftest import start_service, stop_process
from tests.helpers import events, run_cli, spawn_contender, wait_for

MiB = 1 << 20
GROUP_METRICS = (
    "timeslice_queue_depth",
    "timeslice_acquire_wait_seconds_count",
    "timeslice_hold_seconds_count",
    "timeslice_switch_seconds_count",
    "timeslice_moved_bytes_total",
    "timeslice_group_held_share",
    "timeslice_leases_revoked_total",
    "timeslice_stale_releases_total",
)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    with Stack(tmp_path / "temporal").start() as stack:
        assert stack.server is not None
        yield stack.server


# ---------------------------------------------------------------- metrics


Samples = list[tuple[str, dict[str, str], float]]


def scrape(url: str, keep: Path | None = None) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    if keep is not None:
        keep.write_text(text)
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples carrying ``labels`` (None: no such series)."""
    found = [
        v
        for n, have, v in samples
        if n == name and all(have.get(k) == want for k, want in labels.items())
    ]
    return sum(found) if found else None


def test_worker_serves_group_and_sdk_metrics(own_server: EmbeddedServer, tmp_path: Path):
    address = own_server.address
    port = free_port()
    worker = start_service(
        ["worker", "--address", address, "--metrics-port", f"127.0.0.1:{port}"],
        "control worker on task queue",
        tmp_path / "worker.log",
    )
    url = f"http://127.0.0.1:{port}/metrics"
    group = f"g-{uuid.uuid4().hex[:8]}"

    def metric(name: str, **labels: str) -> float | None:
        return value(scrape(url), name, group=group, **labels)

    def backends() -> list:
        return [SimulatedBackend(nbytes=MiB)]

    a = TimeSliceOrchestratorClient(target=address, job_id="tel-a", snapshot_backends=backends())
    b = TimeSliceOrchestratorClient(target=address, job_id="tel-b", snapshot_backends=backends())
    victim = None
    try:
        a.connect()
        b.connect()
        lease = a.acquire(group, timeout=60)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(b.acquire, group, timeout=60)
            wait_for(lambda: metric("timeslice_queue_depth") == 1, what="queue depth 1")
            a.release(lease)
            b.release(waiting.result(timeout=60))  # b's grant evicted a
        a.release(a.acquire(group, timeout=60))  # evicts b, restores a
        # A holder that dies mid-lease: its lease expires unrenewed and is revoked.
        log = tmp_path / "victim.jsonl"
        victim = spawn_contender(address, group, "tel-victim", log, "--ttl", "1", "--hold-forever")
        wait_for(lambda: events(log, "acquired", "tel-victim"), what="the victim holds the group")

        def ttl_running() -> bool:
            # The TTL runs once the group knows the grant was taken (a holder killed before
            # that is skipped as dead, not revoked).
            holder = a.group_status(group).holder
            return holder is not None and holder.expires_in_s is not None

        wait_for(ttl_running, what="the victim's lease confirmed")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        wait_for(lambda: metric("timeslice_leases_revoked_total") == 1, what="a revoked lease")

        async def stale_messages() -> None:
            client = await connect(connect_config(address))
            handle = client.get_workflow_handle(group_workflow_id(group))
            key = "a-key-nobody-was-given"
            await handle.signal(
                "release", ReleaseRequest(request_id="never-issued", token=999, key=key)
            )
            renewed = await handle.execute_update(
                "renew",
                RenewRequest(request_id="never-issued", token=999, key=key),
                result_type=RenewResult,
            )
            assert not renewed.valid

        asyncio.run(stale_messages())
        wait_for(lambda: metric("timeslice_stale_releases_total") == 1, what="a stale release")
        status = a.group_status(group)

        def complete() -> Samples | None:
            s = scrape(url, keep=tmp_path / "metrics.txt")  # the last scrape, for a look
            present = all(value(s, name, group=group) is not None for name in GROUP_METRICS)
            return s if present and value(s, "timeslice_queue_depth", group=group) == 0 else None

        samples = wait_for(complete, what="every group metric")
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
        a.close()
        b.close()
        stop_process(worker)

    def got(name: str, **labels: str) -> float | None:
        return value(samples, name, group=group, **labels)

    # Four leases: a, b, a again, the victim; three released, one revoked.
    assert got("timeslice_acquire_wait_seconds_count") == 4
    assert got("timeslice_acquire_wait_seconds_sum") > 0  # b waited for a
    assert got("timeslice_hold_seconds_count", outcome="released") == 3
    assert got("timeslice_hold_seconds_count", outcome="expired") == 1
    assert got("timeslice_hold_seconds_sum", outcome="expired") >= 1.0  # at least the TTL
    assert got("timeslice_leases_revoked_total") == 1 == status.stats.expired
    # Switches: b evicts a; a evicts b and is restored; the victim evicts a.
    assert got("timeslice_switch_seconds_count") == 3 == status.stats.switches
    assert got("timeslice_moved_bytes_total", direction="evict") == 3 * MiB
    assert got("timeslice_moved_bytes_total", direction="restore") == 1 * MiB
    assert got("timeslice_moved_bytes_total") == status.stats.bytes_moved
    assert 0 < got("timeslice_group_held_share") <= 1
    # Held time is held share; "utilization" names GPU-phase time only (docs/report.md).
    assert got("timeslice_group_utilization") is None
    assert got("timeslice_queue_depth") == 0
    assert got("timeslice_stale_releases_total") == 1
    assert got("timeslice_stale_renewals_total") >= 1
    assert got("timeslice_acquire_wait_seconds_bucket", le="+Inf") == 4
    # Every recording keeps its own labels (none strays onto another series).
    ours = [(n, labels) for n, labels, _ in samples if n.startswith("timeslice_")]
    assert ours and all(
        labels.get("group") == group and labels.get("workflow_type") == "GpuGroupWorkflow"
        for _, labels in ours
    ), [x for x in ours if x[1].get("group") != group]
    # Temporal's own SDK metrics come out of the same endpoint.
    assert value(samples, "temporal_worker_start_total", task_queue="timeslice") >= 1
    assert value(samples, "temporal_request_total") > 0
    assert value(samples, "temporal_workflow_task_execution_latency_milliseconds_count") > 0


def test_activity_metrics_reach_the_endpoint():
    """Job workers and agents record phases and snapshots through the OpenTelemetry API."""
    from timeslice.activities import job_runtime
    from timeslice.session import snapshot_activities

    endpoint = start_metrics_endpoint("127.0.0.1", free_port(), "activity-check")
    try:
        job_runtime._PHASE_SECONDS.record(0.3, {"phase": "sample", "job": "j"})
        snapshot_activities._SECONDS.record(0.02, {"action": "snapshot", "backend": "torch"})
        samples = scrape(endpoint.url)
    finally:
        endpoint.close()
    assert value(samples, "timeslice_phase_seconds_count", phase="sample", job="j") == 1
    assert value(samples, "timeslice_phase_seconds_bucket", phase="sample", le="0.5") == 1
    assert value(samples, "timeslice_phase_seconds_bucket", phase="sample", le="0.25") == 0
    assert value(samples, "timeslice_snapshot_seconds_count", backend="torch") == 1


def test_metrics_port_is_validated():
    result = run_cli("worker", "--metrics-port", "nine", timeout=60)
    assert result.returncode == 2
    assert "invalid metrics address 'nine'" in result.stderr


# ---------------------------------------------------------------- traces


def test_spans_go_out_by_otlp_when_the_endpoint_is_set():
    """configure_tracing (what connect() and the workers call) exports by OTLP/HTTP."""
    received: list[tuple[str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    code = (
        "from timeslice.transport import telemetry\n"
        "assert telemetry.configure_tracing('otlp-check')\n"
        "assert not telemetry.configure_tracing('again')  # idempotent\n"
        "with telemetry.span('timeslice.check', {'timeslice.job_id': 'j1'}):\n"
        "    pass\n"
        "telemetry.flush()\n"
    )
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}"}
    env.pop("OTEL_SERVICE_NAME", None)
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        collector.shutdown()
    assert result.returncode == 0, result.stderr
    assert [path for path, _ in received] == ["/v1/traces"]
    body = received[0][1]
    assert b"timeslice.check" in body and b"otlp-check" in body and b"j1" in body


def test_otlp_is_opt_in():
    assert not otlp_tracing_requested({})
    assert otlp_tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert otlp_tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    disabled = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}
    assert not otlp_tracing_requested(disabled)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Spans of this process, kept in memory (the global provider is set once per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # its processor stays, dropping what comes later


def test_acquire_phase_release_span_tree(
    own_server: EmbeddedServer, tmp_path: Path, spans: InMemorySpanExporter
):
    """Workers in this process (one exporter sees every side): a client's lease, and an RL job's
    acquire → phase → release, each one trace under the caller's span."""
    address = own_server.address
    group = f"g-{uuid.uuid4().hex[:8]}"
    job = f"tel-job-{uuid.uuid4().hex[:6]}"
    tracer = trace.get_tracer("tests")

    async def scenario() -> None:
        client = await connect(connect_config(address))
        runtime = build_job_runtime(job, 0, "simulated", tmp_path / "checkpoints")
        async with build_control_worker(client), build_job_worker(client, runtime):
            a = AsyncTimeSliceOrchestratorClient(
                target=address, job_id="tr-a", snapshot_backends=["noop"]
            )
            b = AsyncTimeSliceOrchestratorClient(
                target=address, job_id="tr-b", snapshot_backends=["noop"]
            )
            async with a, b:
                with tracer.start_as_current_span("train-step"):
                    lease = await a.acquire(group, timeout=60)
                    with tracer.start_as_current_span("user-phase"):
                        await asyncio.sleep(0.01)
                    await a.release(lease)
                # b takes the group: a's state is evicted by a snapshot on a's queue
                await b.release(await b.acquire(group, timeout=60))
            with tracer.start_as_current_span("run-rl-job"):
                config = parse_job_config(
                    {
                        "job_id": job,
                        "workload": "simulated",
                        "workload_options": {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05},
                        "sampler_group": f"{group}-rl",
                        "epochs": 1,
                    }
                )
                handle = await start_rl_job(client, config)
            result = await handle.result()
            assert result.epochs_done == 1

    asyncio.run(scenario())
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}

    def named(name: str, **attributes: object) -> list[ReadableSpan]:
        return [
            s
            for s in finished
            if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
        ]

    def one(name: str, **attributes: object) -> ReadableSpan:
        found = named(name, **attributes)
        assert len(found) == 1, (
            f"{len(found)} spans {name} {attributes}: {[s.name for s in finished]}"
        )
        return found[0]

    def parent(span: ReadableSpan) -> ReadableSpan | None:
        return by_id.get(span.parent.span_id) if span.parent is not None else None

    def children(span: ReadableSpan) -> list[str]:
        return sorted(
            s.name for s in finished if s.parent and s.parent.span_id == span.context.span_id
        )

    # -- a client's lease: train-step → lease → {acquire, hold}; the user's phase between
    step = one("train-step")
    lease = one("timeslice.lease", **{"timeslice.job_id": "tr-a"})
    acquire = one("timeslice.acquire", **{"timeslice.job_id": "tr-a"})
    hold = one("timeslice.hold", **{"timeslice.job_id": "tr-a"})
    user_phase = one("user-phase")
    assert parent(lease) is step and parent(user_phase) is step
    assert parent(acquire) is lease and parent(hold) is lease
    trace_id = step.context.trace_id
    assert {s.context.trace_id for s in (lease, acquire, hold, user_phase)} == {trace_id}
    assert acquire.end_time <= hold.start_time <= user_phase.start_time
    assert user_phase.end_time <= hold.end_time <= lease.end_time
    assert acquire.attributes["timeslice.token"] == hold.attributes["timeslice.token"]
    # the interceptor's client spans hang under ours
    assert f"SignalWithStartWorkflow:{GROUP_WORKFLOW_TYPE}" in children(acquire)
    assert f"StartWorkflowUpdate:{GroupUpdate.RELEASE}" in children(hold)
    # the group is started outside the requester's trace: nothing of it joins this one
    assert not [s.name for s in finished if s.context.trace_id == trace_id and "Run" in s.name]

    # -- activity side: the eviction of a is its own trace, RunActivity → timeslice.snapshot
    snapshot = one("timeslice.snapshot", **{"timeslice.job_id": "tr-a"})
    run_snapshot = parent(snapshot)
    assert run_snapshot is not None and run_snapshot.name == f"RunActivity:{SNAPSHOT_ACTIVITY}"
    assert run_snapshot.attributes["temporalWorkflowID"] == group_workflow_id(group)
    assert snapshot.attributes["timeslice.group_id"] == group
    assert snapshot.attributes["timeslice.bytes"] == 0
    assert [e.name for e in snapshot.events] == ["noop snapshot"]

    # -- an RL job: run-rl-job → StartWorkflow → {request the group, sample, release}
    rl_root = one("run-rl-job")
    rl_trace = [s for s in finished if s.context.trace_id == rl_root.context.trace_id]
    names = {s.name for s in rl_trace}
    start = one("StartWorkflow:RLJobWorkflow")
    assert parent(start) is rl_root
    assert "RunWorkflow:RLJobWorkflow" in children(start)
    phase = one("timeslice.phase.sample", **{"timeslice.job_id": job})
    run_phase = parent(phase)
    assert run_phase is not None and run_phase.name == f"RunActivity:{SAMPLE_ACTIVITY}"
    assert parent(run_phase).name == f"StartActivity:{SAMPLE_ACTIVITY}"
    assert parent(parent(run_phase)) is start
    assert phase in rl_trace
    assert phase.attributes["timeslice.group_id"] == f"{group}-rl"
    assert phase.attributes["timeslice.token"] >= 1

    def within(span: ReadableSpan, ancestor: ReadableSpan) -> bool:
        while (span := parent(span)) is not None:  # type: ignore[assignment]
            if span is ancestor:
                return True
        return False

    # The phase's process asked for its lease, ran the phase, then released it: updates sent
    # from inside the phase's activity.
    asked = [
        s
        for s in rl_trace
        if s.name == f"StartWorkflowUpdate:{GroupUpdate.ACQUIRE}" and within(s, run_phase)
    ]
    released = [
        s
        for s in rl_trace
        if s.name == f"StartWorkflowUpdate:{GroupUpdate.RELEASE}" and within(s, run_phase)
    ]
    assert asked and released
    assert max(s.end_time for s in asked) <= phase.start_time < phase.end_time
    assert phase.end_time <= min(s.start_time for s in released)
    # Preparing took the job's groups through the workflow's own requests (an activity).
    assert f"StartActivity:{REQUEST_GROUP_ACTIVITY}" in names
    assert "timeslice.phase.prepare" in names and "timeslice.phase.train" in names
