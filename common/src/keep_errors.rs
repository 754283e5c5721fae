//! Head sampling that still keeps every failed call.
//!
//! With `OTEL_TRACES_SAMPLER=parentbased_traceidratio` (say 0.1) most turns are not
//! exported, and neither would the turn whose call failed be. Here a trace the
//! configured sampler drops is still *recorded* ([`RecordDropped`]: `RecordOnly`
//! instead of `Drop`, the `sampled` flag still off, so other processes decide alike),
//! and [`KeepErrors`] holds each such trace's ended spans, by trace id, until the trace
//! ends in this process:
//!
//! - a span with status ERROR (a failed or timed-out call, a refused turn), or a turn's
//!   `join` or `turn` span counting failed calls (`toolfleet.summary.errors` or
//!   `toolfleet.summary.timeouts` above 0), keeps the trace: what is held is exported at
//!   once, marked sampled, and so is every later span of that trace in this process;
//! - the trace's closing span ending without any error drops what is held. The closing
//!   span is the one named [`KeepErrorsConfig::closing_span`] (`turn` on a coordinator,
//!   whose other spans are children of the turn's preset remote context), else a span
//!   with no parent in this process (a worker's `process` span, the gateway's request);
//! - a trace held longer than [`KeepErrorsConfig::hold`], or beyond
//!   [`KeepErrorsConfig::max_traces`] held at once (oldest first), is dropped: the
//!   memory held is bounded whatever the traffic.
//!
//! Every process decides for its own spans: a call that failed on a worker is kept by
//! that worker (its spans carry the error) and by the coordinator that ends the turn
//! (its `join` span carries it), so the SRE finds the failed call, its turn and its
//! worker in one trace. A replica that only took the turn and published its jobs, while
//! another ended it, drops its own spans of it (they carry no error).
//!
//! Sampled traces pass straight through; with the default sampler (everything
//! sampled) nothing is held.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use opentelemetry::trace::{Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    SamplingDecision, SamplingResult, ShouldSample, Span, SpanData, SpanProcessor,
};
use opentelemetry_sdk::Resource;

/// A sampler that records what `inner` drops (`RecordOnly`, not sampled) so that
/// [`KeepErrors`] can still export a failed trace.
#[derive(Debug, Clone)]
pub struct RecordDropped(pub Box<dyn ShouldSample>);

impl ShouldSample for RecordDropped {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let mut result =
            self.0
                .should_sample(parent_context, trace_id, name, span_kind, attributes, links);
        if result.decision == SamplingDecision::Drop {
            result.decision = SamplingDecision::RecordOnly;
        }
        result
    }
}

/// Settings of [`KeepErrors`].
#[derive(Debug, Clone)]
pub struct KeepErrorsConfig {
    /// The name of the span that ends a trace in this process; `None`: a span without
    /// a parent in this process.
    pub closing_span: Option<&'static str>,
    /// How long a trace's spans are held at most.
    pub hold: Duration,
    /// Traces held at once at most.
    pub max_traces: usize,
    /// Traces remembered as kept (their later spans exported) at most.
    pub max_kept: usize,
}

impl Default for KeepErrorsConfig {
    fn default() -> Self {
        Self {
            closing_span: None,
            hold: Duration::from_secs(60),
            max_traces: 4096,
            max_kept: 4096,
        }
    }
}

/// The span processor holding unsampled traces until they end, exporting through
/// `inner` those with an error (see the module docs).
#[derive(Debug)]
pub struct KeepErrors<P> {
    inner: P,
    config: KeepErrorsConfig,
    state: Mutex<Held>,
}

/// What [`KeepErrors`] holds.
#[derive(Debug, Default)]
struct Held {
    /// Unsampled traces not yet decided: their spans, oldest trace first in `order`.
    open: HashMap<TraceId, (Instant, Vec<SpanData>)>,
    order: VecDeque<(TraceId, Instant)>,
    /// Traces kept for an error, newest last in `kept_order`.
    kept: HashSet<TraceId>,
    kept_order: VecDeque<TraceId>,
}

impl<P: SpanProcessor> KeepErrors<P> {
    /// Holds unsampled traces as `config` says, exporting the failed ones to `inner`.
    pub fn new(inner: P, config: KeepErrorsConfig) -> Self {
        Self {
            inner,
            config,
            state: Mutex::new(Held::default()),
        }
    }

    fn closes(&self, span: &SpanData) -> bool {
        match self.config.closing_span {
            Some(name) => span.name == name,
            None => span.parent_span_is_remote || span.parent_span_id == SpanId::INVALID,
        }
    }

    /// The spans to export now for `span` (none while its trace is undecided).
    fn decide(&self, span: SpanData) -> Vec<SpanData> {
        let trace = span.span_context.trace_id();
        let failed = failed(&span);
        let closes = self.closes(&span);
        let now = Instant::now();
        let mut held = self.state.lock().unwrap_or_else(|p| p.into_inner());
        held.expire(now, &self.config);
        if held.kept.contains(&trace) {
            return vec![span];
        }
        if failed {
            let mut spans = held.open.remove(&trace).map(|(_, s)| s).unwrap_or_default();
            spans.push(span);
            held.keep(trace, self.config.max_kept);
            return spans;
        }
        if closes {
            held.open.remove(&trace);
            return Vec::new();
        }
        let entry = held.open.entry(trace).or_insert_with(|| (now, Vec::new()));
        let fresh = entry.1.is_empty();
        entry.1.push(span);
        if fresh {
            held.order.push_back((trace, now));
        }
        Vec::new()
    }
}

impl Held {
    /// Drops traces held past `hold` and the oldest beyond `max_traces`.
    fn expire(&mut self, now: Instant, config: &KeepErrorsConfig) {
        while let Some(&(trace, since)) = self.order.front() {
            let live = self.open.get(&trace).is_some_and(|(at, _)| *at == since);
            if live
                && now.duration_since(since) < config.hold
                && self.open.len() < config.max_traces
            {
                break;
            }
            self.order.pop_front();
            if live {
                self.open.remove(&trace);
            }
        }
    }

    /// Remembers `trace` as kept, forgetting the oldest beyond `max_kept`.
    fn keep(&mut self, trace: TraceId, max_kept: usize) {
        if self.kept.insert(trace) {
            self.kept_order.push_back(trace);
        }
        while self.kept_order.len() > max_kept {
            if let Some(old) = self.kept_order.pop_front() {
                self.kept.remove(&old);
            }
        }
    }
}

/// Attributes of a turn's `join` and `turn` spans counting its calls that failed.
const FAILED_CALLS: [&str; 2] = ["toolfleet.summary.errors", "toolfleet.summary.timeouts"];

/// Whether `span` failed (status ERROR) or reports failed calls (a turn's `join` and
/// `turn` spans: a call that failed on its worker is not an error of the coordinator's
/// own spans, but its summary counts it).
fn failed(span: &SpanData) -> bool {
    matches!(span.status, Status::Error { .. })
        || span.attributes.iter().any(|kv| {
            FAILED_CALLS.contains(&kv.key.as_str())
                && matches!(kv.value, opentelemetry::Value::I64(n) if n > 0)
        })
}

/// `span` marked sampled, so the exporting processor takes it.
fn sampled(mut span: SpanData) -> SpanData {
    let c = &span.span_context;
    span.span_context = SpanContext::new(
        c.trace_id(),
        c.span_id(),
        c.trace_flags() | TraceFlags::SAMPLED,
        c.is_remote(),
        c.trace_state().clone(),
    );
    span
}

impl<P: SpanProcessor> SpanProcessor for KeepErrors<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.inner.on_end(span);
            return;
        }
        for span in self.decide(span) {
            self.inner.on_end(sampled(span));
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_spans::{ended_span, Collected};

    fn span(trace: u128, id: u64, parent: u64, name: &str, sampled: bool, error: bool) -> SpanData {
        let mut span = ended_span(trace, id, parent, name, sampled);
        span.parent_span_is_remote = parent == 1;
        if error {
            span.status = Status::error("boom");
        }
        span
    }

    fn processor(closing: Option<&'static str>) -> (KeepErrors<Collected>, Collected) {
        let collected = Collected::default();
        let config = KeepErrorsConfig {
            closing_span: closing,
            ..KeepErrorsConfig::default()
        };
        (KeepErrors::new(collected.clone(), config), collected)
    }

    #[test]
    fn a_failed_unsampled_trace_is_exported_whole_and_a_clean_one_not_at_all() {
        let (p, out) = processor(Some("turn"));
        // Clean trace 7: held, then dropped when its turn span ends.
        p.on_end(span(7, 10, 1, "publish", false, false));
        p.on_end(span(7, 11, 1, "join", false, false));
        p.on_end(span(7, 12, 1, "turn", false, false));
        assert!(out.names().is_empty());
        // Failed trace 8: held until the error, then everything, later spans too.
        p.on_end(span(8, 20, 1, "publish", false, false));
        p.on_end(span(8, 21, 1, "join", false, true));
        assert_eq!(out.names(), ["publish", "join"]);
        p.on_end(span(8, 22, 1, "turn", false, false));
        p.on_end(span(8, 23, 1, "process late", false, false));
        assert_eq!(out.names(), ["publish", "join", "turn", "process late"]);
        // Sampled traces pass straight through.
        p.on_end(span(9, 30, 1, "turn", true, false));
        assert_eq!(out.names().len(), 5);
        assert!(p.state.lock().expect("lock").open.is_empty());
    }

    #[test]
    fn a_join_counting_failed_calls_keeps_the_trace() {
        let (p, out) = processor(Some("turn"));
        let mut join = span(4, 40, 1, "join", false, false);
        join.attributes = vec![
            KeyValue::new("toolfleet.summary.ok", 1i64),
            KeyValue::new("toolfleet.summary.errors", 0i64),
            KeyValue::new("toolfleet.summary.timeouts", 0i64),
        ];
        p.on_end(join.clone());
        p.on_end(span(4, 41, 1, "turn", false, false));
        assert!(out.names().is_empty());
        join.span_context = span(3, 30, 1, "join", false, false).span_context;
        join.attributes[1] = KeyValue::new("toolfleet.summary.errors", 1i64);
        p.on_end(span(3, 31, 1, "publish", false, false));
        p.on_end(join);
        assert_eq!(out.names(), ["publish", "join"]);
    }

    #[test]
    fn without_a_closing_name_the_local_root_ends_the_trace() {
        let (p, out) = processor(None);
        p.on_end(span(5, 50, 51, "execute_tool", false, false));
        p.on_end(span(5, 51, 1, "process", false, false));
        assert!(out.names().is_empty());
        p.on_end(span(6, 60, 61, "execute_tool", false, true));
        p.on_end(span(6, 61, 1, "process", false, false));
        assert_eq!(out.names(), ["execute_tool", "process"]);
    }

    #[test]
    fn what_is_held_is_bounded() {
        let collected = Collected::default();
        let config = KeepErrorsConfig {
            closing_span: Some("turn"),
            max_traces: 3,
            max_kept: 2,
            ..KeepErrorsConfig::default()
        };
        let p = KeepErrors::new(collected.clone(), config);
        for trace in 100..110u128 {
            p.on_end(span(trace, 1, 1, "publish", false, false));
        }
        assert!(p.state.lock().expect("lock").open.len() <= 3);
        // An old trace evicted unfinished: its error still keeps what comes after.
        p.on_end(span(100, 2, 1, "join", false, true));
        assert_eq!(collected.names(), ["join"]);
        for trace in 200..205u128 {
            p.on_end(span(trace, 1, 1, "join", false, true));
        }
        assert!(p.state.lock().expect("lock").kept.len() <= 2);

        let config = KeepErrorsConfig {
            closing_span: Some("turn"),
            hold: Duration::ZERO,
            ..KeepErrorsConfig::default()
        };
        let p = KeepErrors::new(Collected::default(), config);
        p.on_end(span(300, 1, 1, "publish", false, false));
        p.on_end(span(301, 1, 1, "publish", false, false));
        assert!(p.state.lock().expect("lock").open.len() <= 1);
    }

    #[test]
    fn dropped_traces_are_recorded_and_sampled_ones_untouched() {
        use opentelemetry_sdk::trace::Sampler;
        let never = RecordDropped(Box::new(Sampler::AlwaysOff));
        let always = RecordDropped(Box::new(Sampler::AlwaysOn));
        let decide = |s: &RecordDropped| {
            s.should_sample(
                None,
                TraceId::from(3u128),
                "turn",
                &SpanKind::Server,
                &[],
                &[],
            )
            .decision
        };
        assert_eq!(decide(&never), SamplingDecision::RecordOnly);
        assert_eq!(decide(&always), SamplingDecision::RecordAndSample);
    }
}
