//! A turn by id: `GET /v1/turns/{turn_id}` (its stored events and, once it ended, its
//! `final`), `GET /v1/turns/{turn_id}/events` (the same as Server-Sent Events, resumed
//! after `Last-Event-ID` so a browser's `EventSource` reconnect loses nothing) and
//! `DELETE /v1/turns/{turn_id}` (cancel it), and `POST /v1/turns/{turn_id}/stream-token`
//! (a short-lived token with which a browser's `EventSource` reads that turn's events).
//!
//! Owns reading a stored turn through the client's attach (with the key's tenant, so a
//! key never reads or cancels another tenant's turn) and answering in JSON or SSE. The
//! path's id is the client's: the turn read is the one stored under that id scoped by
//! the key's tenant (`turn_scope`), so another tenant's id is just an id this tenant
//! never used, answered with the same 404 bytes. Never talks to Redis: the coordinators
//! do.

use std::sync::Arc;
use std::time::Duration;

use aide::generate::GenContext;
use aide::openapi::{Operation, Response, StatusCode as DocStatus};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use toolfleet_common::client::TurnStream;
use toolfleet_common::turn::{CancelOutcome, CancelReply};
use toolfleet_common::TurnEvent;

use crate::auth::{Caller, Reader};
use crate::error::{described, documented_responses, media, ApiError};
use crate::extract::ApiQuery;
use crate::sse::{ack_deadline_ms, event_stream, sse_event, EVENT_STREAM};
use crate::stream_token::StreamToken;
use crate::turn_scope::{self, ShownTurn};
use crate::Gateway;

/// How long the gateway waits for the first stored event of a turn it attaches to.
const FIRST_EVENT_WAIT: Duration = Duration::from_secs(5);
/// After this long without a further event, a turn read by `GET /v1/turns/{id}` counts
/// as still running (every stored event is replayed at once).
const REPLAY_IDLE: Duration = Duration::from_millis(250);
/// How long `DELETE /v1/turns/{id}` waits for a coordinator to answer.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// A turn id in the path.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
pub struct TurnPath {
    /// The turn id.
    pub turn_id: String,
}

/// Query of `GET /v1/turns/{turn_id}/events`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
pub struct EventsQuery {
    /// Resume after this event id (`seq`), as the `Last-Event-ID` header does (the header
    /// wins when both are given).
    #[serde(default)]
    pub after: Option<u64>,
    /// A stream token for this turn (from `POST /v1/turns` or
    /// `POST /v1/turns/{turn_id}/stream-token`), for a client that cannot send an API
    /// key header: a browser's `EventSource`.
    #[serde(default)]
    pub token: Option<String>,
}

/// `POST /v1/turns/{turn_id}/stream-token`: a token with which a client that cannot send
/// headers (a browser's `EventSource`) reads this turn's events. The turn need not exist
/// yet; the token reads only a turn of the key's tenant.
pub async fn stream_token(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path(path): Path<TurnPath>,
) -> Result<axum::Json<StreamToken>, ApiError> {
    if !toolfleet_common::turn::valid_turn_id(&path.turn_id) {
        return Err(turn_scope::invalid_turn_id(&path.turn_id));
    }
    Ok(axum::Json(StreamToken::mint(
        &gateway.stream_tokens,
        &path.turn_id,
        &caller.key_id,
        &caller.tenant,
        gateway.stream_tokens.ttl,
    )))
}

/// Whether a stored turn has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    /// Calls are still running; later events follow.
    Running,
    /// The turn ended: `final` holds its end.
    Ended,
}

/// A stored turn.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct StoredTurn {
    /// The turn id.
    pub turn_id: String,
    /// Running or ended.
    pub status: TurnStatus,
    /// Every event stored so far, in `seq` order (an event's `seq` is its position, from
    /// 1).
    pub events: Vec<TurnEvent>,
    /// The `final` event once the turn ended.
    #[serde(rename = "final", default, skip_serializing_if = "Option::is_none")]
    pub final_event: Option<TurnEvent>,
}

/// The next event of an attached stream, a turn-level `error` mapped to its HTTP status
/// (a turn this tenant does not hold: the one 404 of `turn_scope::unknown_turn`).
async fn next(
    stream: &mut TurnStream,
    wait: Duration,
    turn: &ShownTurn,
) -> Result<TurnEvent, ApiError> {
    let event = stream.next_event(wait).await.map_err(|e| turn.error(e))?;
    if let TurnEvent::Error { error, .. } = &event {
        return Err(turn.refusal(error));
    }
    Ok(event)
}

/// Attaches to `turn` of `tenant` from its first event.
async fn attach(gateway: &Gateway, turn: &ShownTurn, tenant: &str) -> Result<TurnStream, ApiError> {
    gateway
        .client
        .attach_from(&turn.stored, Some(tenant), 0)
        .await
        .map_err(|e| turn.error(e))
}

/// `GET /v1/turns/{turn_id}`.
pub async fn get(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path(path): Path<TurnPath>,
) -> Result<TurnJson<StoredTurn>, ApiError> {
    let turn = turn_scope::scope(&caller.tenant, &path.turn_id)?;
    gateway.nats_connected()?;
    let mut stream = attach(&gateway, &turn, &caller.tenant).await?;
    let mut events = vec![turn.show(next(&mut stream, FIRST_EVENT_WAIT, &turn).await?)];
    while !events.last().is_some_and(TurnEvent::is_last) {
        match stream.next_event(REPLAY_IDLE).await {
            Ok(TurnEvent::Error { error, .. }) => return Err(turn.refusal(&error)),
            Ok(event) => events.push(turn.show(event)),
            Err(_) => break,
        }
    }
    let final_event = events.last().filter(|e| e.is_last()).cloned();
    Ok(TurnJson(StoredTurn {
        turn_id: turn.shown,
        status: if final_event.is_some() {
            TurnStatus::Ended
        } else {
            TurnStatus::Running
        },
        events,
        final_event,
    }))
}

/// The JSON answer of an operation on a turn by id: `GET /v1/turns/{turn_id}` (a
/// [`StoredTurn`]) and `DELETE /v1/turns/{turn_id}` (what the cancel did, `cancelled`, or
/// `already_ended` with how the turn ended), documented with the errors of a turn by id.
pub struct TurnJson<T>(pub T);

impl<T: Serialize> IntoResponse for TurnJson<T> {
    fn into_response(self) -> axum::response::Response {
        axum::Json(self.0).into_response()
    }
}

impl<T: JsonSchema> aide::OperationOutput for TurnJson<T> {
    type Inner = T;

    fn operation_response(ctx: &mut GenContext, operation: &mut Operation) -> Option<Response> {
        <axum::Json<T> as aide::OperationOutput>::operation_response(ctx, operation)
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        documented_responses::<Self>(ctx, operation, Vec::new(), &TURN_ERRORS)
    }
}

/// The event id a reconnecting client holds: `Last-Event-ID`, else `?after=`.
fn resume_after(headers: &HeaderMap, query: &EventsQuery) -> Result<u64, ApiError> {
    match headers.get("last-event-id") {
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::invalid_request("Last-Event-ID must be an event's seq")),
        None => Ok(query.after.unwrap_or(0)),
    }
}

/// `GET /v1/turns/{turn_id}/events`.
pub async fn events(
    State(gateway): State<Arc<Gateway>>,
    caller: Reader,
    Path(path): Path<TurnPath>,
    headers: HeaderMap,
    ApiQuery(query): ApiQuery<EventsQuery>,
) -> Result<ResumedEvents, ApiError> {
    let after = resume_after(&headers, &query)?;
    let turn = turn_scope::scope(&caller.tenant, &path.turn_id)?;
    let slot = gateway.slots.try_take().ok_or_else(ApiError::overloaded)?;
    gateway.nats_connected()?;
    // The whole turn is replayed and what the client holds skipped here, so a client
    // that already has the `final` is told so (204) instead of waiting for nothing.
    let mut stream = attach(&gateway, &turn, &caller.tenant).await?;
    let mut event = next(&mut stream, FIRST_EVENT_WAIT, &turn).await?;
    // The replayed `ack` names the turn's own deadline: a long turn is waited for as
    // long as its submitter was, not for the default deadline.
    let wait = gateway.event_wait(ack_deadline_ms(&event));
    while stream.last_seq() <= after {
        if event.is_last() {
            return Ok(ResumedEvents::Done);
        }
        event = next(&mut stream, wait, &turn).await?;
    }
    Ok(ResumedEvents::Stream(event_stream(
        event, stream, wait, slot, None, turn,
    )))
}

/// What `GET /v1/turns/{turn_id}/events` answers.
pub enum ResumedEvents {
    /// The events after the client's last one, as SSE.
    Stream(axum::response::Response),
    /// The client holds every event, the `final` included: nothing more will come.
    Done,
}

impl IntoResponse for ResumedEvents {
    fn into_response(self) -> axum::response::Response {
        match self {
            Self::Stream(response) => response,
            Self::Done => StatusCode::NO_CONTENT.into_response(),
        }
    }
}

impl aide::OperationOutput for ResumedEvents {
    type Inner = ();

    fn operation_response(_: &mut GenContext, _: &mut Operation) -> Option<Response> {
        let mut response = described(
            "The turn's events after the client's last one as Server-Sent Events (`id:` the \
             event's seq, `event:` its type, `data:` its JSON), following the turn until \
             `final` or `error`.",
        );
        response
            .content
            .insert(EVENT_STREAM.into(), media(sse_event()));
        Some(response)
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        let done = described("The client holds every event of the ended turn.");
        documented_responses::<Self>(ctx, operation, vec![(204, done)], &TURN_ERRORS)
    }
}

/// The errors of an operation on a turn by id.
const TURN_ERRORS: [(u16, &str); 1] = [(
    404,
    "This key's tenant has no turn with this id (`unknown_turn`): never submitted, past \
     its retention, or another tenant's id (turn ids are scoped by tenant; the answer is \
     the same bytes whatever the reason).",
)];

/// `DELETE /v1/turns/{turn_id}`: cancels the turn.
pub async fn cancel(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path(path): Path<TurnPath>,
) -> Result<TurnJson<CancelReply>, ApiError> {
    let turn = turn_scope::scope(&caller.tenant, &path.turn_id)?;
    gateway.nats_connected()?;
    let mut reply = gateway
        .client
        .cancel(&turn.stored, Some(&caller.tenant), CANCEL_WAIT)
        .await
        .map_err(|e| turn.error(e))?;
    match reply.outcome {
        CancelOutcome::Cancelled | CancelOutcome::AlreadyEnded => {
            reply.turn_id = turn.shown;
            Ok(TurnJson(reply))
        }
        CancelOutcome::UnknownTurn => Err(turn_scope::unknown_turn()),
        CancelOutcome::InvalidRequest => Err(turn_scope::invalid_turn_id(&path.turn_id)),
        CancelOutcome::Unavailable => Err(ApiError::unavailable("the turn store is unavailable")),
    }
}
