//! The turn's trace: the `turn` span that lasts from accept to `final`, on whichever
//! replica finishes the turn, and the coordinator's spans that are not one step's own.
//!
//! Owns [`TurnTrace`]: the turn span's ids and start, fixed at intake
//! ([`TurnTrace::begin`]), stored with the turn in the join (`trace` field, one JSON
//! value written by the `CREATE` script and returned by `RECORD`/`FINALIZE` — no extra
//! round trip) and exported by the replica that marks the turn's `final` sent first
//! ([`TurnTrace::end`]; `finalize.rs` decides when), the moment it ends
//! (`toolfleet_common::prompt_export`). Every coordinator span of a turn is parented
//! under [`TurnTrace::parent`] before the `turn` span exists, so a replica killed
//! mid-turn leaves no child without its parent. Also owns what the `turn` span says of
//! a failed turn ([`worst_outcome`]) and of a turn another replica took over
//! ([`EndedBy`]), and the spans of refused calls, of each result received (CONSUMER,
//! under the worker's span) and of the join's scripts.
//!
//! Never decides how a turn ends (`finalize.rs` does) and never publishes anything.

use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::KeyValue;
use serde::{Deserialize, Serialize};
use toolfleet_common::call::codes;
use toolfleet_common::deferred::DeferredSpan;
use toolfleet_common::names::{concat, spans, HEADER_TENANT_ID};
use toolfleet_common::telemetry;
use toolfleet_common::tool::{canonical_tool_name, provider_tool_name};
use toolfleet_common::{CallError, CallResult, CallState, Summary};
use tracing::info_span;

use crate::registry::Snapshot;

/// The turn span's identity and what it says, stored with the turn.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TurnTrace {
    /// The span's ids, remote parent and start.
    #[serde(flatten)]
    pub span: DeferredSpan,
    /// The tenant.
    #[serde(rename = "tenant")]
    pub tenant: String,
    /// The session, when the request named one.
    #[serde(rename = "session", default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Calls in the decision.
    #[serde(rename = "calls", default)]
    pub calls: usize,
    /// `service.instance.id` of the replica that took the turn (empty when a replica
    /// that did not store it took the turn).
    #[serde(rename = "owner", default, skip_serializing_if = "String::is_empty")]
    pub owner: String,
}

/// How the replica exporting the turn span came to end the turn: the path that ended
/// it (`toolfleet.turn.ended_by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndedBy {
    /// Intake: the request was refused, or no call could run, or none was asked for.
    Intake,
    /// The completing result was recorded here.
    Result,
    /// The replica that took the turn saw its deadline pass.
    Deadline,
    /// A sweeper found the turn open past its deadline plus the grace: the replica that
    /// took it did not end it (gone, or stalled).
    Sweeper,
    /// The caller cancelled the turn.
    Cancel,
    /// Another replica ended the turn and died before storing its `final`; it was
    /// ended again here.
    Recovery,
    /// The turn's `final` was stored but never marked sent (its replica died between
    /// the two); a sweeper sent it again.
    Resend,
    /// The same: a frontend re-attaching (or resubmitting the turn) was sent the
    /// stored `final`.
    Replay,
}

/// The event on `turn` when a replica other than its owner ended it for its owner.
pub(crate) const TAKEN_OVER: &str = "toolfleet.turn.taken_over";

impl EndedBy {
    /// Whether a replica ending the turn this way did what the owner should have done
    /// (a sweeper, a recovery, a resent or replayed `final`), rather than sharing the
    /// work as replicas do (the last result recorded here).
    fn takes_over(self) -> bool {
        matches!(
            self,
            Self::Sweeper | Self::Recovery | Self::Resend | Self::Replay
        )
    }

    /// The attribute value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Intake => "intake",
            Self::Result => "result",
            Self::Deadline => "deadline",
            Self::Sweeper => "sweeper",
            Self::Cancel => "cancel",
            Self::Recovery => "recovery",
            Self::Resend => "resend",
            Self::Replay => "replay",
        }
    }
}

/// How the turn ended, as its span tells it.
pub(crate) struct TurnOutcome<'a> {
    /// The turn.
    pub turn_id: &'a str,
    /// How it ended: `complete`, `deadline`, `cancelled`, `no_tools` or `rejected`.
    pub outcome: &'static str,
    /// The per-state counts, when calls ran.
    pub summary: Option<&'a Summary>,
    /// The turn's deadline passed before every result was in.
    pub deadline_hit: bool,
    /// Why the turn failed, when it did: a rejection, the deadline, or the worst
    /// outcome of a call that did not succeed ([`worst_outcome`]).
    pub error: Option<&'a CallError>,
    /// The path that ended the turn here.
    pub ended_by: EndedBy,
}

/// What a turn whose calls ran reports as its error (`turn` and `join`): the deadline
/// when it passed; else, of the calls that did not succeed, the worst: a timeout, an
/// error, a call never dispatched, a cancelled call, in that order, with the count of
/// calls that did not succeed. `None` when every call succeeded.
pub(crate) fn worst_outcome(results: &[CallResult], deadline_hit: bool) -> Option<CallError> {
    let failed = results
        .iter()
        .filter(|r| r.state != CallState::Done)
        .count();
    if deadline_hit {
        let missing = results
            .iter()
            .filter(|r| r.state == CallState::Timeout)
            .count();
        let message = format!("the turn's deadline passed with {missing} call(s) unanswered");
        return Some(CallError::retryable(codes::DEADLINE_EXCEEDED, message));
    }
    let rank = |state: CallState| match state {
        CallState::Timeout => 0,
        CallState::Error => 1,
        CallState::Skipped => 2,
        CallState::Cancelled => 3,
        _ => 4,
    };
    let worst = results
        .iter()
        .filter(|r| r.state != CallState::Done)
        .min_by_key(|r| rank(r.state))?;
    let (code, what) = match &worst.error {
        Some(error) => (error.code.clone(), error.message.clone()),
        None => (worst.state.as_str().to_string(), String::new()),
    };
    let message = format!(
        "{failed} of {} call(s) did not succeed; {} {}: {what}",
        results.len(),
        worst.tool_call_id,
        worst.state.as_str()
    );
    Some(CallError::fatal(code, message))
}

impl TurnTrace {
    /// Fixes the turn span's ids and start now, under the frontend's trace context in
    /// `headers`. `None` when spans are not recorded in this process.
    pub(crate) fn begin(headers: Option<&async_nats::HeaderMap>) -> Option<Self> {
        DeferredSpan::begin(headers).map(|span| Self {
            span,
            tenant: String::new(),
            session: None,
            calls: 0,
            owner: telemetry::service_instance_id().to_string(),
        })
    }

    /// Parents `span` under the turn span.
    pub(crate) fn parent(&self, span: &tracing::Span) {
        self.span.parent(span);
    }

    /// The value stored in the join.
    pub(crate) fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// What the join stores of `trace`: its W3C `traceparent` and [`TurnTrace::encode`]
    /// (both empty when the turn is not traced).
    pub(crate) fn stored(trace: Option<&Self>) -> (String, String) {
        match trace {
            Some(t) => (t.span.traceparent(), t.encode()),
            None => (String::new(), String::new()),
        }
    }

    /// The stored value (`None` when the turn was not traced, or was created by a
    /// replica that did not store one).
    pub(crate) fn decode(stored: &str) -> Option<Self> {
        serde_json::from_str(stored).ok()
    }

    /// Exports the turn span, ending now.
    pub(crate) fn end(&self, outcome: &TurnOutcome<'_>) {
        let mut attributes = vec![
            KeyValue::new("toolfleet.turn.calls", self.calls as i64),
            KeyValue::new("toolfleet.turn.deadline_hit", outcome.deadline_hit),
            KeyValue::new("toolfleet.turn.outcome", outcome.outcome),
        ];
        // A request refused before its ids were read has neither.
        if !outcome.turn_id.is_empty() {
            attributes.push(KeyValue::new(
                "toolfleet.turn.id",
                outcome.turn_id.to_string(),
            ));
        }
        if !self.tenant.is_empty() {
            attributes.push(KeyValue::new("toolfleet.tenant.id", self.tenant.clone()));
        }
        if let Some(session) = &self.session {
            attributes.push(KeyValue::new("toolfleet.session.id", session.clone()));
        }
        if let Some(s) = outcome.summary {
            attributes.extend([
                KeyValue::new("toolfleet.summary.ok", s.ok as i64),
                KeyValue::new("toolfleet.summary.errors", s.errors as i64),
                KeyValue::new("toolfleet.summary.timeouts", s.timeouts as i64),
                KeyValue::new("toolfleet.summary.skipped", s.skipped as i64),
                KeyValue::new("toolfleet.summary.cancelled", s.cancelled as i64),
            ]);
        }
        let status = match outcome.error {
            Some(error) => {
                attributes.push(KeyValue::new("error.type", error.code.clone()));
                Status::error(telemetry::bounded_message(&error.message))
            }
            None => Status::Unset,
        };
        attributes.push(KeyValue::new(
            "toolfleet.turn.ended_by",
            outcome.ended_by.label(),
        ));
        let mut events = Vec::new();
        if !self.owner.is_empty() {
            let here = telemetry::service_instance_id();
            // Another replica ended the turn its owner should have ended (not merely
            // recorded its last result, as any replica does): the moment and the
            // reason, on the span.
            let taken_over = self.owner != here && outcome.ended_by.takes_over();
            attributes.push(KeyValue::new("toolfleet.turn.owner", self.owner.clone()));
            attributes.push(KeyValue::new("toolfleet.turn.taken_over", taken_over));
            if taken_over {
                events.push(opentelemetry::trace::Event::new(
                    TAKEN_OVER,
                    std::time::SystemTime::now(),
                    vec![
                        KeyValue::new("toolfleet.turn.owner", self.owner.clone()),
                        KeyValue::new("toolfleet.turn.ended_by", outcome.ended_by.label()),
                        KeyValue::new("service.instance.id", here.to_string()),
                    ],
                    0,
                ));
            }
        }
        self.span
            .end(spans::TURN, SpanKind::Server, attributes, events, status);
    }
}

/// What a refused call's span name says of a tool the registry does not hold: the
/// model's name for it is only in `gen_ai.tool.name` (a made-up name in the span name
/// would be a new operation in Jaeger for every name a model makes up). The same as the
/// metric label of such calls.
const UNKNOWN_TOOL: &str = "_unknown";

/// The name of the span of a call to `tool` (canonical spelling, as the model wrote it
/// otherwise) refused before dispatch: `refuse_tool <tool>` for a tool in `registry`
/// (its name bounded by the registry), else `refuse_tool _unknown`.
fn refused_span_name(tool: &str, as_written: &str, registry: &Snapshot) -> String {
    let known = registry.get(tool).is_some() || registry.get(as_written).is_some();
    let tool = if known { tool } else { UNKNOWN_TOOL };
    concat(&[spans::REFUSE_TOOL, " ", tool])
}

/// The span of a call refused before dispatch: ERROR, with the call id, both tool
/// names and the refusal's code and message. Ends at once. Named after the tool only
/// when `registry` holds it ([`refused_span_name`]).
pub(crate) fn refused_call(
    trace: Option<&TurnTrace>,
    turn_id: &str,
    tenant: &str,
    call_id: &str,
    tool: &str,
    error: &CallError,
    registry: &Snapshot,
) {
    let as_written = tool;
    let tool = canonical_tool_name(tool);
    let span = info_span!(
        "refuse_tool",
        otel.name = refused_span_name(&tool, as_written, registry).as_str(),
        otel.kind = "internal",
        gen_ai.tool.name = tool.as_str(),
        gen_ai.tool.call.id = call_id,
        toolfleet.tool.provider_name = provider_tool_name(&tool).as_str(),
        toolfleet.turn.id = turn_id,
        toolfleet.tenant.id = tenant,
        error.type = tracing::field::Empty,
    );
    if let Some(trace) = trace {
        trace.parent(&span);
    }
    telemetry::set_error(&span, &error.code, &error.message);
}

/// Where a result message came from and was taken: the NATS server (first URL) and
/// the durable consumer.
pub(crate) struct ResultSource<'a> {
    /// `server.address`, `server.port`.
    pub server: (&'a str, i64),
    /// The results consumer (`messaging.consumer.group.name`).
    pub group: &'a str,
}

/// The CONSUMER span of one result message: under the turn span, linked to the worker
/// span that published it (both contexts are in the message headers). Its template is
/// `template` (`<p>.results.{turn_id}`), with `.{tool}` when the subject names the
/// call's tool, as workers' result subjects do.
pub(crate) fn result_received(
    template: &str,
    subject: &str,
    headers: Option<&async_nats::HeaderMap>,
    turn_id: &str,
    source: &ResultSource<'_>,
) -> tracing::Span {
    let tenant = headers
        .and_then(|h| h.get(toolfleet_common::headers::name(HEADER_TENANT_ID)))
        .map(|v| v.to_string());
    let tool_in_subject = subject
        .strip_suffix(turn_id)
        .is_none_or(|head| !head.ends_with(".results."));
    let template = if tool_in_subject {
        concat(&[template, ".{tool}"])
    } else {
        template.to_string()
    };
    let span = info_span!(
        "process",
        otel.name = concat(&[spans::PROCESS, " ", &template]).as_str(),
        otel.kind = "consumer",
        messaging.system = "nats",
        messaging.operation.name = spans::PROCESS,
        messaging.operation.type = "process",
        messaging.destination.name = subject,
        messaging.destination.template = template.as_str(),
        messaging.consumer.group.name = source.group,
        messaging.message.id = tracing::field::Empty,
        server.address = source.server.0,
        server.port = source.server.1,
        gen_ai.tool.call.id = tracing::field::Empty,
        gen_ai.tool.name = tracing::field::Empty,
        toolfleet.turn.id = turn_id,
        toolfleet.tenant.id = tracing::field::Empty,
        toolfleet.result.outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if let Some(tenant) = tenant {
        span.record("toolfleet.tenant.id", tenant.as_str());
    }
    telemetry::set_consumer_parent(&span, headers);
    span
}

/// A CLIENT span around one of the join's Lua scripts (`CREATE`, `RECORD`,
/// `FINALIZE`), a child of the current span.
pub(crate) fn join_script(script: &'static str, turn_id: &str, tenant: &str) -> tracing::Span {
    let name = concat(&["EVALSHA ", script]);
    info_span!(
        "redis",
        otel.name = name.as_str(),
        otel.kind = "client",
        db.system.name = "redis",
        db.operation.name = "EVALSHA",
        db.query.summary = name.as_str(),
        toolfleet.turn.id = turn_id,
        toolfleet.tenant.id = tenant,
        error.type = tracing::field::Empty,
    )
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::{Context, SubscriberExt};

    use super::*;
    use crate::registry::Registry;

    /// The `otel.name` of every span opened under it, in order.
    #[derive(Clone, Default)]
    struct SpanNames(Arc<Mutex<Vec<String>>>);

    struct OtelName(Option<String>);

    impl Visit for OtelName {
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "otel.name" {
                self.0 = Some(value.to_string());
            }
        }
        fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
    }

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for SpanNames {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: Context<'_, S>,
        ) {
            let mut name = OtelName(None);
            attrs.record(&mut name);
            if let (Some(name), Ok(mut names)) = (name.0, self.0.lock()) {
                names.push(name);
            }
        }
    }

    /// A model that makes up a tool name per call would make as many operations in
    /// Jaeger: a refused call's span is named after its tool only when the registry
    /// holds the tool, whatever spelling the model used and whatever the refusal.
    #[test]
    fn refused_calls_are_named_after_registry_tools_only() {
        let definition =
            serde_json::json!({"name": "test.behave", "description": "d", "input_schema": {}});
        let registry = Registry::holding(&[("test.behave", definition.to_string())]).snapshot();
        let names = SpanNames::default();
        let subscriber = tracing_subscriber::registry().with(names.clone());
        let unknown = CallError::fatal(codes::UNKNOWN_TOOL, "no tool named it");
        let invalid = CallError::fatal(codes::INVALID_ARGUMENTS, "not an object");
        tracing::subscriber::with_default(subscriber, || {
            for (tool, error) in [
                ("hallucinated.tool_a8f3e2c91b", &unknown),
                ("hallucinated__tool_77c1", &unknown),
                ("test.behave", &invalid),
                ("test__behave", &invalid),
                // Refused before its tool was looked up (a repeated id, say).
                ("made_up.other_9d2e", &invalid),
            ] {
                refused_call(None, "t1", "acme", "c1", tool, error, &registry);
            }
        });
        let names = names.0.lock().map(|n| n.clone()).unwrap_or_default();
        assert_eq!(
            names,
            [
                "refuse_tool _unknown",
                "refuse_tool _unknown",
                "refuse_tool test.behave",
                "refuse_tool test.behave",
                "refuse_tool _unknown",
            ]
        );
    }
}
