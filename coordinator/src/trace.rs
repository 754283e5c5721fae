//! The turn's trace: the `turn` span that lasts from accept to `final`, on whichever
//! replica finishes the turn, and the coordinator's spans that are not one step's own.
//!
//! Owns [`TurnTrace`]: the turn span's ids and start, fixed at intake
//! ([`TurnTrace::begin`]), stored with the turn in the join (`trace` field, one JSON
//! value written by the `CREATE` script and returned by `RECORD`/`FINALIZE` — no extra
//! round trip) and exported by the replica that publishes the turn's end
//! ([`TurnTrace::end`]). Every coordinator span of a turn is parented under
//! [`TurnTrace::parent`] before the `turn` span exists, so a replica killed mid-turn
//! leaves no child without its parent. Also owns the spans of refused calls, of each
//! result received (CONSUMER, under the worker's span) and of the join's scripts.
//!
//! Never decides how a turn ends (`finalize.rs` does) and never publishes anything.

use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::KeyValue;
use serde::{Deserialize, Serialize};
use toolfleet_common::deferred::DeferredSpan;
use toolfleet_common::names::{concat, spans, HEADER_TENANT_ID};
use toolfleet_common::telemetry;
use toolfleet_common::tool::{canonical_tool_name, provider_tool_name};
use toolfleet_common::{CallError, Summary};
use tracing::info_span;

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
    /// Why the turn failed, when it did (a rejection or the deadline).
    pub error: Option<&'a CallError>,
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
        self.span
            .end(spans::TURN, SpanKind::Server, attributes, status);
    }
}

/// The span of a call refused before dispatch: ERROR, with the call id, both tool
/// names and the refusal's code and message. Ends at once.
pub(crate) fn refused_call(
    trace: Option<&TurnTrace>,
    turn_id: &str,
    tenant: &str,
    call_id: &str,
    tool: &str,
    error: &CallError,
) {
    let tool = canonical_tool_name(tool);
    let span = info_span!(
        "refuse_tool",
        otel.name = format!("{} {tool}", spans::REFUSE_TOOL).as_str(),
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

/// The CONSUMER span of one result message: under the turn span, linked to the worker
/// span that published it (both contexts are in the message headers).
pub(crate) fn result_received(
    template: &str,
    subject: &str,
    headers: Option<&async_nats::HeaderMap>,
    turn_id: &str,
) -> tracing::Span {
    let tenant = headers
        .and_then(|h| h.get(toolfleet_common::headers::name(HEADER_TENANT_ID)))
        .map(|v| v.to_string());
    let span = info_span!(
        "process",
        otel.name = concat(&[spans::PROCESS, " ", template]).as_str(),
        otel.kind = "consumer",
        messaging.system = "nats",
        messaging.operation.name = spans::PROCESS,
        messaging.operation.type = "process",
        messaging.destination.name = subject,
        messaging.destination.template = template,
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
