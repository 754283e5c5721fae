//! `POST /v1/turns`: a turn submitted over HTTP, answered as Server-Sent Events
//! (`Accept: text/event-stream`) or as one JSON body holding the `final` event (and,
//! with `?events=true`, every event), or, with `Prefer: respond-async`, `202` once the
//! turn is accepted with a stream token to follow it (a browser's `EventSource`).
//!
//! Owns turning an HTTP body into a [`TurnRequest`] for the key's tenant, following the
//! turn through [`toolfleet_common::FleetClient`], and writing its events in either mode.
//! Both modes serialize the same [`TurnEvent`] value, so the `final` object is the same
//! bytes in an SSE `data:` line and in the JSON body. The body's `turn_id` is the
//! client's name for the turn within its tenant: the fleet stores it under an id derived
//! from both (`turn_scope`), and the client sees its own id everywhere. Never talks to
//! Redis or the join: the coordinator does; never chooses the tenant from the body.

use std::sync::Arc;
use std::time::Duration;

use aide::generate::GenContext;
use aide::openapi::{Operation, ReferenceOr, Response, StatusCode as DocStatus};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::OwnedSemaphorePermit;
use toolfleet_common::client::TurnStream;
use toolfleet_common::turn::{normalize_tenant, valid_turn_id, TurnOptions};
use toolfleet_common::{TurnEvent, TurnRequest};

use crate::auth::Caller;
use crate::error::{described, documented_responses, media, string_header, ApiError};
use crate::extract::{ApiJson, ApiQuery};
use crate::sse::{ack_deadline_ms, event_stream, sse_event, CancelOnDrop, EVENT_STREAM};
use crate::stream_token::StreamToken;
use crate::turn_scope::{self, ShownTurn};
use crate::Gateway;

/// The longest a turn runs, whatever it asks: the coordinator's own cap
/// (`TOOLFLEET_MAX_DEADLINE_MS` is at most 300,000 ms, `coordinator::config::ranges`).
/// The gateway waits no longer than this (plus the grace) for an event, and a stream
/// token minted with a turn outlives it by no more than the grace.
pub const MAX_TURN_DEADLINE: Duration = Duration::from_secs(300);

/// A decision the demo pack runs: the simple form with two calls, as a model that was
/// asked "Show me my appointments and my billing" might decide.
pub fn example_decision() -> Value {
    json!({
        "type": "tool_calls",
        "calls": [
            {"id": "call_appts_01", "toolName": "crm.listUpcomingAppointments",
             "arguments": {"customerId": "cust_002"}},
            {"id": "call_bill_02", "toolName": "crm.getOpenInvoices",
             "arguments": {"customerId": "cust_002"}}
        ]
    })
}

/// A turn as an HTTP client submits it. The tenant is the API key's.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnBody {
    /// Turn id (`[A-Za-z0-9_-]{1,64}`); generated when absent. Scoped by the key's
    /// tenant: another tenant's turn of the same id is another turn.
    #[serde(default)]
    pub turn_id: Option<String>,
    /// The tenant; when given it must be the API key's tenant (the key decides).
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// The frontend's session id.
    #[serde(default)]
    pub session_id: Option<String>,
    /// What the user said.
    #[serde(default)]
    pub user_message: Option<String>,
    /// The model's decision in any supported shape (OpenAI Chat Completions or Responses,
    /// Anthropic Messages, the simple form, `parallel`).
    #[schemars(example = example_decision())]
    pub decision: Value,
    /// Budget for the whole turn in milliseconds, at least 1; leave it out for the
    /// default (0 or a negative number is refused with 400 `invalid_request`).
    #[serde(default)]
    #[schemars(range(min = 1))]
    pub deadline_ms: Option<u64>,
    /// Limits for this turn.
    #[serde(default)]
    pub options: TurnOptions,
    /// Context handed to every tool (customer id, caller phone, ...).
    #[serde(default)]
    pub context: Map<String, Value>,
}

/// Query of `POST /v1/turns`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
pub struct TurnQuery {
    /// In JSON mode, also return every event of the turn.
    #[serde(default)]
    pub events: bool,
}

/// The JSON answer to a turn.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct TurnAnswer {
    /// The turn id.
    pub turn_id: String,
    /// The `final` event, the same object an event stream sends as its last `data:`.
    #[serde(rename = "final")]
    pub final_event: TurnEvent,
    /// Every event in order, `final` last (with `?events=true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<TurnEvent>>,
}

impl TurnBody {
    /// The turn request for `caller`'s tenant, stored under the id scoped by that tenant,
    /// and the turn's two ids; a body naming another tenant, or a bad turn id, is refused.
    pub fn into_request(self, caller: &Caller) -> Result<(TurnRequest, ShownTurn), ApiError> {
        if let Some(named) = &self.tenant_id {
            if normalize_tenant(named) != caller.tenant {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    toolfleet_common::turn::turn_codes::TENANT_NOT_ALLOWED,
                    "the body names another tenant than the API key's",
                ));
            }
        }
        if self.deadline_ms == Some(0) {
            return Err(ApiError::invalid_request(
                "deadline_ms must be at least 1 (leave it out for the default)",
            ));
        }
        if let Some(id) = self.turn_id.as_deref().filter(|id| !valid_turn_id(id)) {
            return Err(turn_scope::invalid_turn_id(id));
        }
        let client_id = self.turn_id.unwrap_or_else(turn_scope::new_client_turn_id);
        let turn = turn_scope::scope(&caller.tenant, &client_id)?;
        let request = TurnRequest {
            turn_id: Some(turn.stored.clone()),
            tenant_id: caller.tenant.clone(),
            session_id: self.session_id,
            user_message: self.user_message,
            decision: self.decision,
            deadline_ms: self.deadline_ms,
            options: self.options,
            context: self.context,
        };
        Ok((request, turn))
    }
}

/// Whether the client asked for `202` once the turn is accepted (`Prefer: respond-async`,
/// RFC 7240).
fn wants_async(headers: &HeaderMap) -> bool {
    headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim().eq_ignore_ascii_case("respond-async"))
}

/// How the client asked to be answered.
fn wants_events(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains(EVENT_STREAM))
}

/// `POST /v1/turns`.
pub async fn submit(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    headers: HeaderMap,
    ApiQuery(query): ApiQuery<TurnQuery>,
    ApiJson(body): ApiJson<TurnBody>,
) -> Result<TurnReply, ApiError> {
    let (request, turn) = body.into_request(&caller)?;
    let wait = gateway.event_wait(request.deadline_ms);
    let slot = gateway.slots.try_take().ok_or_else(ApiError::overloaded)?;
    gateway.nats_connected()?;
    let mut stream = gateway
        .client
        .submit(request)
        .await
        .map_err(|e| turn.error(e))?;
    let first = stream.next_event(wait).await.map_err(|e| turn.error(e))?;
    if let TurnEvent::Error { error, .. } = &first {
        return Err(turn.error(ApiError::from_turn_error(error)));
    }
    // A token to follow this turn with, living past the deadline the coordinator
    // applied (its `ack` names it), never past the fleet's cap on any turn.
    let life = ack_deadline_ms(&first).map_or(wait, |applied| gateway.event_wait(Some(applied)));
    let token = StreamToken::mint(
        &gateway.stream_tokens,
        &turn.shown,
        &caller.key_id,
        &caller.tenant,
        life,
    );
    if wants_async(&headers) {
        return Ok(TurnReply::Accepted(token));
    }
    let reply = reply(
        &gateway, &caller, &headers, &query, first, stream, wait, slot, turn,
    )
    .await?;
    Ok(TurnReply::WithToken(Box::new(reply), token.token))
}

/// The stream or JSON answer of an accepted turn whose first event is `first`.
#[allow(clippy::too_many_arguments)]
async fn reply(
    gateway: &Arc<Gateway>,
    caller: &Caller,
    headers: &HeaderMap,
    query: &TurnQuery,
    first: TurnEvent,
    mut stream: TurnStream,
    wait: Duration,
    slot: OwnedSemaphorePermit,
    turn: ShownTurn,
) -> Result<TurnReply, ApiError> {
    if wants_events(headers) {
        // A client that goes away mid-stream cancels the turn when so configured;
        // otherwise the turn runs on and `GET /v1/turns/{id}/events` resumes it.
        let on_drop = gateway.config.cancel_on_disconnect.then(|| {
            CancelOnDrop::new(
                Arc::clone(gateway),
                stream.turn_id().to_string(),
                caller.tenant.clone(),
            )
        });
        return Ok(TurnReply::Events(event_stream(
            first, stream, wait, slot, on_drop, turn,
        )));
    }
    let answer = read_to_final(first, &mut stream, wait, query.events, &turn).await?;
    Ok(TurnReply::Json(answer))
}

impl Gateway {
    /// How long the gateway waits for any one event of a turn with `deadline_ms` (never
    /// past [`MAX_TURN_DEADLINE`], whatever the request asked, plus the grace); also the
    /// least life of a stream token minted with such a turn.
    pub fn event_wait(&self, deadline_ms: Option<u64>) -> Duration {
        let deadline = deadline_ms.map_or(self.config.default_deadline, Duration::from_millis);
        deadline.min(MAX_TURN_DEADLINE) + self.config.final_grace
    }
}

/// Reads the turn to its `final`, keeping every event when `keep` is set; the events as
/// the client sees them (its own turn id).
async fn read_to_final(
    first: TurnEvent,
    stream: &mut TurnStream,
    wait: Duration,
    keep: bool,
    turn: &ShownTurn,
) -> Result<TurnAnswer, ApiError> {
    let mut events = vec![turn.show(first)];
    loop {
        let last = events.last().cloned();
        match last {
            Some(TurnEvent::Error { error, .. }) => {
                return Err(turn.error(ApiError::from_turn_error(&error)))
            }
            Some(event @ TurnEvent::Final(_)) => {
                return Ok(TurnAnswer {
                    turn_id: turn.shown.clone(),
                    final_event: event,
                    events: keep.then_some(events),
                })
            }
            _ => {
                let event = stream.next_event(wait).await.map_err(|e| turn.error(e))?;
                events.push(turn.show(event));
            }
        }
    }
}

/// What `POST /v1/turns` answers: an event stream or the JSON answer.
pub enum TurnReply {
    /// `text/event-stream`.
    Events(axum::response::Response),
    /// `application/json`.
    Json(TurnAnswer),
    /// `202 Accepted` (`Prefer: respond-async`): the turn runs; follow it with the token.
    Accepted(StreamToken),
    /// Another reply with the `Toolfleet-Stream-Token` header.
    WithToken(Box<TurnReply>, String),
}

impl IntoResponse for TurnReply {
    fn into_response(self) -> axum::response::Response {
        match self {
            Self::Events(response) => response,
            Self::Json(answer) => axum::Json(answer).into_response(),
            Self::Accepted(token) => {
                let mut response = (StatusCode::ACCEPTED, axum::Json(token)).into_response();
                response.headers_mut().insert(
                    "preference-applied",
                    HeaderValue::from_static("respond-async"),
                );
                response
            }
            Self::WithToken(reply, token) => {
                let mut response = reply.into_response();
                if let Ok(value) = HeaderValue::from_str(&token) {
                    response
                        .headers_mut()
                        .insert(crate::stream_token::TOKEN_HEADER, value);
                }
                response
            }
        }
    }
}

/// The turn's errors beyond those of every authenticated operation.
const TURN_ERRORS: [(u16, &str); 4] = [
    (403, "The body names another tenant than the key's (`tenant_not_allowed`)."),
    (409, "A turn with this id exists already (`duplicate_turn`)."),
    (422, "The decision is in no supported shape (`invalid_decision`) or too large (`decision_too_large`)."),
    (502, "The fleet answered something unreadable (`bad_gateway`)."),
];

impl aide::OperationOutput for TurnReply {
    type Inner = TurnAnswer;

    fn operation_response(ctx: &mut GenContext, _: &mut Operation) -> Option<Response> {
        let json_schema = ctx.schema.subschema_for::<TurnAnswer>();
        let mut response = described(
            "The turn's `final` event (JSON), or every event as Server-Sent Events \
             (`Accept: text/event-stream`: `event:` the type, `data:` the event's JSON, \
             ending after `final` or `error`).",
        );
        response
            .content
            .insert("application/json".into(), media(json_schema));
        response
            .content
            .insert(EVENT_STREAM.into(), media(sse_event()));
        response.headers.insert(
            "traceparent".into(),
            ReferenceOr::Item(string_header(
                "W3C trace context of the gateway's server span (the turn's parent).",
                false,
            )),
        );
        response.headers.insert(
            "Toolfleet-Stream-Token".into(),
            ReferenceOr::Item(string_header(
                "A stream token for this turn: `GET /v1/turns/{turn_id}/events?token=…` \
                 reads its events without the API key (a browser's `EventSource`).",
                false,
            )),
        );
        Some(response)
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        let mut accepted = described(
            "With `Prefer: respond-async`: the turn was accepted and runs on; `events_url` \
             follows it (with the stream token, no API key needed).",
        );
        let json_schema = ctx.schema.subschema_for::<StreamToken>();
        accepted
            .content
            .insert("application/json".into(), media(json_schema));
        documented_responses::<Self>(ctx, operation, vec![(202, accepted)], &TURN_ERRORS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller() -> Caller {
        Caller {
            chat: Default::default(),
            key_id: "k".into(),
            tenant: "acme".into(),
        }
    }

    fn body(value: Value) -> TurnBody {
        serde_json::from_value(value).unwrap_or_else(|_| TurnBody {
            turn_id: None,
            tenant_id: Some("unparsed".into()),
            session_id: None,
            user_message: None,
            decision: Value::Null,
            deadline_ms: None,
            options: TurnOptions::default(),
            context: Map::new(),
        })
    }

    #[test]
    fn the_key_decides_the_tenant() {
        let request = body(json!({"decision": {}})).into_request(&caller());
        assert_eq!(request.map(|r| r.0.tenant_id).ok().as_deref(), Some("acme"));
        let same = body(json!({"decision": {}, "tenant_id": " ACME"})).into_request(&caller());
        assert!(same.is_ok());
        let other = body(json!({"decision": {}, "tenant_id": "globex"})).into_request(&caller());
        assert_eq!(other.err().map(|e| e.status), Some(StatusCode::FORBIDDEN));
        for deadline in [json!(0), json!(-5)] {
            let zero = serde_json::from_value::<TurnBody>(
                json!({"decision": {}, "deadline_ms": deadline}),
            )
            .map_err(|_| ApiError::invalid_request("unparsed"))
            .and_then(|b| b.into_request(&caller()));
            assert_eq!(zero.err().map(|e| e.status), Some(StatusCode::BAD_REQUEST));
        }
        let bad_id = body(json!({"decision": {}, "turn_id": "a.b"})).into_request(&caller());
        assert_eq!(
            bad_id.err().map(|e| e.status),
            Some(StatusCode::BAD_REQUEST)
        );
    }
}
