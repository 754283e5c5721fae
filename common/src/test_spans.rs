//! Ended spans and a collecting processor for the unit tests of this crate's span
//! processors (`keep_errors`, `prompt_export`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use opentelemetry::trace::TraceState;
use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId};
use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

/// The names of the spans that reached it, in order, as a processor (which is handed
/// only sampled spans) or as an exporter (`exported <name>`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Collected(Arc<Mutex<Vec<String>>>);

impl Collected {
    /// The names collected so far.
    pub(crate) fn names(&self) -> Vec<String> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn push(&self, name: String) {
        if let Ok(mut v) = self.0.lock() {
            v.push(name);
        }
    }
}

impl SpanProcessor for Collected {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}
    fn on_end(&self, span: SpanData) {
        assert!(span.span_context.is_sampled(), "handed on unsampled");
        self.push(span.name.to_string());
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

impl SpanExporter for Collected {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        for span in batch {
            self.push(format!("exported {}", span.name));
        }
        Ok(())
    }
}

/// An ended span `name` with id `id` in trace `trace`, child of the local span `parent`,
/// status unset, sampled or not; callers set what else a test needs (a remote parent,
/// an error status, attributes).
pub(crate) fn ended_span(trace: u128, id: u64, parent: u64, name: &str, sampled: bool) -> SpanData {
    let flags = match sampled {
        true => TraceFlags::SAMPLED,
        false => TraceFlags::default(),
    };
    SpanData {
        span_context: SpanContext::new(
            TraceId::from(trace),
            SpanId::from(id),
            flags,
            false,
            TraceState::default(),
        ),
        parent_span_id: SpanId::from(parent),
        parent_span_is_remote: false,
        span_kind: SpanKind::Internal,
        name: name.to_string().into(),
        start_time: SystemTime::now(),
        end_time: SystemTime::now(),
        attributes: Vec::new(),
        dropped_attributes_count: 0,
        events: Default::default(),
        links: Default::default(),
        status: Status::Unset,
        instrumentation_scope: Default::default(),
    }
}
