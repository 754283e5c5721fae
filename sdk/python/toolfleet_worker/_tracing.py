"""Trace context for the worker: the job's `traceparent` (the coordinator's publish) and
`Fleet-Turn-Traceparent` (the turn) carried onto its result, and, when OpenTelemetry is
installed (`pip install 'toolfleet-worker[otel]'`), a CONSUMER `process` span under the
turn (linked to the publish) with an `execute_tool` span inside, as the Rust worker
makes. OTLP export is set up from `OTEL_EXPORTER_OTLP_ENDPOINT` unless the application
installed a tracer provider itself. Never required: without OpenTelemetry the context is
passed through and no span is made."""

import contextlib
import os
import sys

try:
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the optional dependency is not installed
    trace = None

TRACEPARENT = "traceparent"
TURN_TRACEPARENT = "Fleet-Turn-Traceparent"


def setup():
    """Installs OTLP/HTTP span export when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; the
    provider to shut down at exit, or None. Refuses to start (as the Rust worker does)
    when export is asked for and the packages are missing, rather than drop spans."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        sys.exit("OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry's SDK and OTLP "
                 "exporter are not installed: pip install 'toolfleet-worker[otel]'")
    service = os.environ.get("OTEL_SERVICE_NAME", "").strip() or "toolfleet-python-worker"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def _header(headers, name):
    for key, value in (headers or {}).items():
        if key.lower() == name.lower():
            return value
    return None


def _remote(traceparent):
    if trace is None or not traceparent:
        return None
    context = TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return context if span_context.is_valid else None


@contextlib.contextmanager
def process(subject, job, attempt, worker_id, headers):
    """The `process` span of one delivery (None without OpenTelemetry): under the turn's
    span, linked to the coordinator's publish span."""
    if trace is None:
        yield None
        return
    producer = _remote(_header(headers, TRACEPARENT))
    turn = _remote(_header(headers, TURN_TRACEPARENT))
    links = []
    if turn is not None and producer is not None:
        links.append(Link(trace.get_current_span(producer).get_span_context()))
    call = job["call"]
    attributes = {
        "messaging.system": "nats", "messaging.operation.name": "process",
        "messaging.operation.type": "process", "messaging.destination.name": subject,
        "gen_ai.tool.name": call["name"], "gen_ai.tool.call.id": call["id"],
        "toolfleet.turn.id": job["turn_id"], "toolfleet.tenant.id": job.get("tenant_id") or "",
        "toolfleet.attempt": attempt, "toolfleet.worker.id": worker_id,
    }
    tracer = trace.get_tracer("toolfleet_worker")
    with tracer.start_as_current_span(f"process {subject}", context=turn or producer,
                                      kind=SpanKind.CONSUMER, links=links,
                                      attributes=attributes) as span:
        yield span


@contextlib.contextmanager
def execute(name, call_id, job):
    """The `execute_tool` span around the tool's own code (None without OpenTelemetry)."""
    if trace is None:
        yield None
        return
    attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                  "gen_ai.tool.call.id": call_id, "gen_ai.tool.type": "function",
                  "toolfleet.turn.id": job["turn_id"],
                  "toolfleet.tenant.id": job.get("tenant_id") or ""}
    tracer = trace.get_tracer("toolfleet_worker")
    with tracer.start_as_current_span(f"execute_tool {name}", attributes=attributes,
                                      record_exception=False,
                                      set_status_on_exception=False) as span:
        yield span


def failed(spans, code, message):
    """Marks `spans` (those that exist) failed with the error's code."""
    for span in spans:
        if span is not None:
            span.set_attribute("error.type", code)
            span.set_status(Status(StatusCode.ERROR, message[:256]))


def result_headers(span, job_headers):
    """The trace headers of a result: the turn's traceparent as the job carried it, and
    the `process` span's context, or without one the job's own `traceparent`."""
    out = {}
    turn = _header(job_headers, TURN_TRACEPARENT)
    if turn:
        out[TURN_TRACEPARENT] = turn
    if span is not None and span.get_span_context().is_valid:
        carrier = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        out.update(carrier)
    else:
        parent = _header(job_headers, TRACEPARENT)
        if parent:
            out[TRACEPARENT] = parent
    return out
