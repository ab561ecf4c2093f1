"""Tracing and metrics: OpenTelemetry spans (OTLP) and a Prometheus endpoint on workers.

Tracing: every client made by :func:`timeslice.transport.connection.connect` carries temporalio's
``TracingInterceptor``, so client calls, workflows and activities propagate the trace context
and open spans; Timeslice adds its own (``timeslice.lease`` / ``acquire`` / ``hold`` in a job
process, ``timeslice.snapshot`` / ``restore`` and ``timeslice.phase.<name>`` in activities).
Spans leave the process by OTLP (HTTP) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set; an application that installed its own
TracerProvider keeps it, and Timeslice's spans go there.

Metrics: one OpenTelemetry SDK ``MeterProvider`` per worker process, read by a Prometheus
endpoint. Temporal's own SDK metrics and the group workflows' metrics (recorded through the
replay-safe ``workflow.metric_meter()``) reach it through a ``temporalio.runtime.MetricBuffer``
that :class:`TemporalMetricsBridge` drains into that provider; activities record through the
OpenTelemetry API directly. See docs/observability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.client import OutboundInterceptor, StartWorkflowInput, WorkflowHandle
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.runtime import (
    BUFFERED_METRIC_KIND_COUNTER,
    BUFFERED_METRIC_KIND_GAUGE,
    BUFFERED_METRIC_KIND_HISTOGRAM,
    BufferedMetricUpdate,
    MetricBuffer,
    Runtime,
    TelemetryConfig,
)
from timeslice.errors import TimesliceError
from timeslice.protocol.group import GROUP_WORKFLOW_TYPE

log = logging.getLogger("timeslice.telemetry")

INSTRUMENTATION_NAME = "timeslice"
DEFAULT_SERVICE_NAME = "timeslice"
# temporalio's TracingInterceptor carries the trace context in this workflow / activity header.
TRACE_HEADER = "_tracer-data"
METRICS_PATH = "/metrics"
DEFAULT_METRICS_HOST = "0.0.0.0"

# Bucket boundaries (seconds) for Timeslice's duration histograms: a hand-off takes
# milliseconds, a switch seconds, a wait or a hold up to an hour.
SECONDS_BUCKETS: Sequence[float] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)

_lock = threading.Lock()
_tracer = trace.get_tracer(INSTRUMENTATION_NAME)
_meter = metrics.get_meter(INSTRUMENTATION_NAME)


# ---------------------------------------------------------------- tracing


def tracer() -> trace.Tracer:
    """Timeslice's tracer (the global provider's; a no-op until one is installed)."""
    return _tracer


def meter() -> metrics.Meter:
    """Timeslice's meter for code outside workflows (activities), on the global provider."""
    return _meter


def otlp_tracing_requested(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _provider_installed(provider: object) -> bool:
    # Unset, the global provider is the API's proxy, which forwards to whatever is set later.
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _resource(service_name: str) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win over the default name.
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    return Resource.create({} if named else {SERVICE_NAME: service_name})


def configure_tracing(service_name: str = DEFAULT_SERVICE_NAME) -> bool:
    """Export spans by OTLP/HTTP if ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; True if installed.

    Idempotent, and never replaces a TracerProvider the application installed itself. The
    exporter reads the standard ``OTEL_EXPORTER_OTLP_*`` variables (endpoint, headers, ...).
    """
    if not otlp_tracing_requested():
        return False
    with _lock:
        if _provider_installed(trace.get_tracer_provider()):
            return False
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=_resource(service_name))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
    log.info("exporting traces by OTLP as service %r", service_name)
    return True


def client_interceptors() -> list[ClientInterceptor]:
    """The interceptors every Timeslice client carries (workers built on it inherit them)."""
    return [TracingInterceptor(), _UntracedGroupStarts()]


class _UntracedGroupStarts(ClientInterceptor):
    """Start GPU-group workflows outside the caller's trace.

    A group lives as long as the cluster does, and the tracing interceptor parents everything a
    workflow does under the trace that *started* it: the first acquire of a group would collect
    every switch of the group's life. Without the header the group opens no workflow spans,
    and each snapshot / restore / grant delivery it dispatches starts a trace of its own
    (tagged with the group's workflow id); the requester's client spans are unaffected.
    Sits after ``TracingInterceptor`` in the chain, so the client span is still recorded.
    """

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _StripGroupTraceHeader(next)


class _StripGroupTraceHeader(OutboundInterceptor):
    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        if input.workflow == GROUP_WORKFLOW_TYPE and TRACE_HEADER in input.headers:
            input.headers = {k: v for k, v in input.headers.items() if k != TRACE_HEADER}
        return await super().start_workflow(input)


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """No current span inside: for long-lived tasks (a worker) started from a traced call,
    which would otherwise parent everything they ever do under that call's span."""
    token = otel_context.attach(otel_context.Context())
    try:
        yield
    finally:
        otel_context.detach(token)


def end_span(span: Span, error: BaseException | None = None, *, message: str | None = None) -> None:
    """End ``span``, marking it failed with ``error`` or ``message`` when given."""
    if error is not None:
        if isinstance(error, Exception):
            span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    elif message is not None:
        span.set_status(Status(StatusCode.ERROR, message))
    span.end()


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """A span under the current one (in an activity: under the interceptor's RunActivity)."""
    with _tracer.start_as_current_span(
        name, attributes={k: v for k, v in (attributes or {}).items() if v is not None}
    ) as current:
        yield current


def flush(timeout_s: float = 5.0) -> None:
    """Push out buffered spans and metrics (the CLI exits with os._exit, skipping atexit)."""
    millis = int(timeout_s * 1000)
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        force_flush = getattr(provider, "force_flush", None)
        if force_flush is not None:
            try:
                force_flush(millis)
            except Exception as err:  # telemetry must never fail the caller
                log.debug("flushing %s: %s", type(provider).__name__, err)


# ---------------------------------------------------------------- metrics


def parse_metrics_address(value: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` -> (host, port); ValueError naming the rule."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        host = DEFAULT_METRICS_HOST
    host = host.strip("[]") or DEFAULT_METRICS_HOST
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(
            f"invalid metrics address {value!r}: use PORT or HOST:PORT, e.g. 9464"
        ) from None
    if not 0 < port < 65536:
        raise ValueError(f"invalid metrics port {port}: use 1-65535")
    return host, port


@dataclass
class MetricsEndpoint:
    """A worker process's Prometheus endpoint and what feeds it."""

    host: str
    port: int
    runtime: Runtime  # give it to Client.connect: Temporal's metrics come through its buffer
    buffer: MetricBuffer
    meter_provider: Any  # opentelemetry.sdk.metrics.MeterProvider
    server: Any

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}{METRICS_PATH}"

    @property
    def where(self) -> str:
        """Where the endpoint listens, as a user needs it: bound to every interface, it is
        reachable from other hosts too (the URL is the local way in)."""
        if self.host in ("0.0.0.0", "::", ""):
            return f"on all interfaces, port {self.port}: {self.url} from this host"
        return f"at {self.url}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.meter_provider.shutdown()


def start_metrics_endpoint(
    host: str, port: int, service_name: str = DEFAULT_SERVICE_NAME
) -> MetricsEndpoint:
    """Serve ``/metrics`` on ``host:port`` from a new OpenTelemetry SDK MeterProvider.

    The provider becomes the global one unless the process has one already, so activities'
    ``telemetry.meter()`` recordings land here too. Run a :class:`TemporalMetricsBridge` on the
    returned buffer (see :func:`worker_telemetry`) or Temporal's metrics stay in the buffer.
    """
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        start_http_server,
    )

    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    # No otel_scope_* labels: the metric names already say whose they are.
    reader = PrometheusMetricReader(registry=registry, scope_info_enabled=False)
    provider = MeterProvider(
        metric_readers=[reader],
        resource=_resource(service_name),
        views=[
            View(
                instrument_name="timeslice_*_seconds",
                aggregation=ExplicitBucketHistogramAggregation(SECONDS_BUCKETS),
            ),
        ],
    )
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        provider.shutdown()
        raise TimesliceError(f"cannot serve metrics on {host}:{port}: {err.strerror}") from err
    with _lock:
        # Unset, the global provider is the API's proxy (there is no public test for that).
        if type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider":
            metrics.set_meter_provider(provider)
    buffer = MetricBuffer(100_000)
    # No service_name="temporal-core-sdk" label on every series: target_info names the service.
    runtime = Runtime(telemetry=TelemetryConfig(metrics=buffer, attach_service_name=False))
    return MetricsEndpoint(host, port, runtime, buffer, provider, server)


class TemporalMetricsBridge:
    """Drains a Temporal runtime's :class:`MetricBuffer` into an OpenTelemetry meter provider.

    Like temporalio's ``contrib.opentelemetry.MetricsExporter``, with one difference that
    matters: that exporter caches converted attributes (and gauge values) by ``id()`` of the
    buffer's attribute objects, and an attribute set given per recording (``add(n, {...})``)
    is a new object that is freed once drained, so a later set can reuse its id and be
    exported under another series' labels (seen: ``timeslice_moved_bytes_total`` carrying
    ``operation="PollWorkflowTaskQueue"``). Here attributes are taken by value every time, and
    gauges are OpenTelemetry synchronous gauges (last value per attribute set).
    """

    def __init__(
        self, buffer: MetricBuffer, meter_provider: metrics.MeterProvider, *, interval_s: float = 1
    ) -> None:
        self._buffer = buffer
        self._meter = meter_provider.get_meter("temporalio")
        self._interval_s = interval_s
        self._instruments: dict[tuple[str, int], Any] = {}
        self._failures = 0

    def drain(self) -> int:
        """Apply every buffered update now; the number applied."""
        updates = self._buffer.retrieve_updates()
        for update in updates:
            try:
                self._apply(update)
            except Exception:  # one bad update must not stop the others
                self._failures += 1
                if self._failures <= 3:
                    log.exception("cannot export Temporal metric %s", update.metric.name)
        return len(updates)

    def _apply(self, update: BufferedMetricUpdate) -> None:
        metric = update.metric
        key = (metric.name, metric.kind)
        instrument = self._instruments.get(key)
        if instrument is None:
            unit, description = metric.unit or "", metric.description or ""
            create = {
                BUFFERED_METRIC_KIND_COUNTER: self._meter.create_counter,
                BUFFERED_METRIC_KIND_HISTOGRAM: self._meter.create_histogram,
                BUFFERED_METRIC_KIND_GAUGE: self._meter.create_gauge,
            }[metric.kind]
            instrument = self._instruments[key] = create(
                metric.name, unit=unit, description=description
            )
        attributes = dict(update.attributes)
        if metric.kind == BUFFERED_METRIC_KIND_COUNTER:
            instrument.add(update.value, attributes)
        elif metric.kind == BUFFERED_METRIC_KIND_HISTOGRAM:
            instrument.record(update.value, attributes)
        else:
            instrument.set(update.value, attributes)

    async def run(self, stop: asyncio.Event) -> None:
        """Drain every ``interval_s`` until ``stop`` is set, then once more."""
        while not stop.is_set():
            self.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval_s)
        self.drain()


@contextlib.asynccontextmanager
async def worker_telemetry(
    service_name: str, metrics_address: str | None = None
) -> AsyncIterator[MetricsEndpoint | None]:
    """Tracing (if OTLP is configured) and, given an address, the Prometheus endpoint.

    Yields the endpoint (connect with its ``runtime``) or None; flushes spans on the way out.
    """
    configure_tracing(service_name)
    endpoint: MetricsEndpoint | None = None
    stop = asyncio.Event()
    draining: asyncio.Task[None] | None = None
    try:
        if metrics_address is not None:
            host, port = parse_metrics_address(metrics_address)
            endpoint = start_metrics_endpoint(host, port, service_name)
            bridge = TemporalMetricsBridge(endpoint.buffer, endpoint.meter_provider)
            draining = asyncio.create_task(bridge.run(stop))
        yield endpoint
    finally:
        stop.set()
        if draining is not None:
            await asyncio.gather(draining, return_exceptions=True)
        flush()
        if endpoint is not None:
            endpoint.close()
