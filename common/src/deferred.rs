//! Spans whose trace id, span id and start time are fixed when the work starts and that
//! are exported when it ends — possibly by another process.
//!
//! Owns [`DeferredSpan`] (the ids, the remote parent and the start time: small, serde,
//! stored beside the work it describes), the context that parents the work's child
//! spans before the span itself exists, and [`DeferredSpan::end`], which exports it
//! through the global tracer provider with the preset ids ([`PresetIdGenerator`]).
//! A turn's span is one: whichever coordinator replica finishes the turn exports it.
//!
//! Never decides what the span says (the caller passes name, kind, attributes and
//! status) and never exports anything while no tracer provider is installed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use serde::{Deserialize, Serialize};

/// Whether spans are recorded in this process (re-exported from [`crate::telemetry`],
/// which installs the tracer provider).
pub use crate::telemetry::tracing_enabled;

/// Whether the SDK's sampler (from `OTEL_TRACES_SAMPLER`) keeps a root span of
/// `trace_id`, so that the children parented on a deferred root agree with the root
/// when it is finally built: the parent-based samplers decide a root by the root
/// sampler (the others ignore the parent and decide every span alike).
fn root_sampled(trace_id: TraceId) -> bool {
    let sampler = std::env::var("OTEL_TRACES_SAMPLER").unwrap_or_default();
    match sampler.trim() {
        "parentbased_always_off" => false,
        "parentbased_traceidratio" => {
            let ratio = std::env::var("OTEL_TRACES_SAMPLER_ARG")
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|r| (0.0..=1.0).contains(r))
                .unwrap_or(1.0);
            ratio_keeps(ratio, trace_id)
        }
        _ => true,
    }
}

/// The SDK's `TraceIdRatioBased` decision.
fn ratio_keeps(ratio: f64, trace_id: TraceId) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
    let bytes = trace_id.to_bytes();
    let mut low = [0u8; 8];
    low.copy_from_slice(&bytes[8..]);
    (u64::from_be_bytes(low) >> 1) < bound
}

/// A span started now and exported later by whoever ends the work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeferredSpan {
    /// Trace id, 32 hex digits.
    #[serde(rename = "t")]
    pub trace_id: String,
    /// This span's id, 16 hex digits.
    #[serde(rename = "s")]
    pub span_id: String,
    /// The remote parent's span id (the frontend's span), when there is one.
    #[serde(rename = "p", default, skip_serializing_if = "Option::is_none")]
    pub parent_span_id: Option<String>,
    /// Whether the trace is sampled.
    #[serde(rename = "f", default = "yes")]
    pub sampled: bool,
    /// Start, Unix nanoseconds.
    #[serde(rename = "n")]
    pub start_unix_ns: u64,
}

fn yes() -> bool {
    true
}

impl DeferredSpan {
    /// Fixes the ids and the start of a span now, as the child of the trace context in
    /// `headers` (a new trace without one). `None` when spans are not recorded here.
    pub fn begin(headers: Option<&HeaderMap>) -> Option<Self> {
        if !tracing_enabled() {
            return None;
        }
        let parent = crate::telemetry::extract(headers);
        let parent = parent.span().span_context().clone();
        let random = RandomIdGenerator::default();
        let (trace_id, parent_span_id, sampled) = if parent.is_valid() {
            (
                parent.trace_id(),
                Some(parent.span_id().to_string()),
                parent.is_sampled(),
            )
        } else {
            let trace_id = random.new_trace_id();
            (trace_id, None, root_sampled(trace_id))
        };
        let start_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        Some(Self {
            trace_id: trace_id.to_string(),
            span_id: random.new_span_id().to_string(),
            parent_span_id,
            sampled,
            start_unix_ns,
        })
    }

    fn flags(&self) -> TraceFlags {
        if self.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        }
    }

    fn ids(&self) -> Option<(TraceId, SpanId)> {
        let trace = TraceId::from_hex(&self.trace_id).ok()?;
        let span = SpanId::from_hex(&self.span_id).ok()?;
        Some((trace, span))
    }

    /// This span as a parent: children made before it is exported hang under it.
    pub fn context(&self) -> Context {
        match self.ids() {
            Some((trace, span)) => Context::new().with_remote_span_context(SpanContext::new(
                trace,
                span,
                self.flags(),
                true,
                TraceState::default(),
            )),
            None => Context::new(),
        }
    }

    /// Parents the `tracing` span `span` under this span.
    pub fn parent(&self, span: &tracing::Span) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let _ = span.set_parent(self.context());
    }

    /// The W3C `traceparent` of this span.
    pub fn traceparent(&self) -> String {
        let flags = if self.sampled { "01" } else { "00" };
        format!("00-{}-{}-{flags}", self.trace_id, self.span_id)
    }

    /// The context of the remote parent (empty for a root span).
    fn parent_context(&self) -> Context {
        let parent = self.parent_span_id.as_deref().map(SpanId::from_hex);
        match (TraceId::from_hex(&self.trace_id), parent) {
            (Ok(trace), Some(Ok(span))) => Context::new().with_remote_span_context(
                SpanContext::new(trace, span, self.flags(), true, TraceState::default()),
            ),
            _ => Context::new(),
        }
    }

    /// Exports the span now: its preset ids, parent and start, ending now, with
    /// `attributes`, `events` and `status`.
    pub fn end(
        &self,
        name: &'static str,
        kind: SpanKind,
        attributes: Vec<KeyValue>,
        events: Vec<opentelemetry::trace::Event>,
        status: Status,
    ) {
        let Some(ids) = self.ids() else {
            return;
        };
        if !tracing_enabled() {
            return;
        }
        let tracer = opentelemetry::global::tracer_with_scope(crate::telemetry::scope());
        let start = UNIX_EPOCH + Duration::from_nanos(self.start_unix_ns);
        let builder = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_start_time(start)
            .with_attributes(attributes)
            .with_events(events);
        let mut span = crate::telemetry::with_preset_ids(ids, || {
            tracer.build_with_context(builder, &self.parent_context())
        });
        use opentelemetry::trace::Span as _;
        span.set_status(status);
        span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deferred_span_round_trips_and_parents_under_the_frontend() {
        let span = DeferredSpan {
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            span_id: "00f067aa0ba902b7".into(),
            parent_span_id: Some("1111111111111111".into()),
            sampled: true,
            start_unix_ns: 42,
        };
        let json = serde_json::to_string(&span).unwrap_or_default();
        let back: Option<DeferredSpan> = serde_json::from_str(&json).ok();
        assert_eq!(back.as_ref(), Some(&span));
        assert_eq!(
            span.traceparent(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        let cx = span.context();
        assert_eq!(cx.span().span_context().span_id().to_string(), span.span_id);
        let parent = span.parent_context();
        assert_eq!(
            parent.span().span_context().span_id().to_string(),
            "1111111111111111"
        );
    }

    #[test]
    fn the_ratio_decision_follows_the_low_half_of_the_trace_id() {
        let low = TraceId::from_hex("ffffffffffffffff0000000000000001").unwrap_or(TraceId::INVALID);
        let high =
            TraceId::from_hex("0000000000000000ffffffffffffffff").unwrap_or(TraceId::INVALID);
        assert!(ratio_keeps(0.5, low));
        assert!(!ratio_keeps(0.5, high));
        assert!(!ratio_keeps(0.0, low));
        assert!(ratio_keeps(1.0, high));
    }
}
