//! A turn's events as Server-Sent Events: the frame of one event, the response that
//! follows a turn to its last event, the cancel of a turn whose client went away, and the
//! schema the OpenAPI document gives every event stream.
//!
//! Owns the SSE wire form only. `POST /v1/turns` (`turns`) and
//! `GET /v1/turns/{id}/events` (`stored`) both answer with [`event_stream`], so a
//! submitted turn and a resumed one write the same bytes; neither module imports the
//! other.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::IntoResponse;
use futures::StreamExt;
use schemars::Schema;
use tokio::sync::OwnedSemaphorePermit;
use toolfleet_common::client::TurnStream;
use toolfleet_common::{CallError, TurnEvent};

use crate::error::codes;
use crate::turn_scope::ShownTurn;
use crate::Gateway;

/// The content type of an event stream.
pub const EVENT_STREAM: &str = "text/event-stream";

/// One Server-Sent Event, the unit an event stream's schema describes: its `event`
/// type, `data` (a JSON document, or `[DONE]` at the end of a chat completion stream),
/// `id` and `retry`.
pub fn sse_event() -> Schema {
    schemars::json_schema!({
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0}
        }
    })
}

/// One event as Server-Sent Events text: `event:` its type, `data:` its JSON.
pub fn sse_frame(event: &TurnEvent, seq: Option<u64>) -> String {
    let data = serde_json::to_string(event).unwrap_or_else(|_| "{}".into());
    let id = seq.map(|seq| format!("id: {seq}\n")).unwrap_or_default();
    format!("{id}event: {}\ndata: {data}\n\n", event.kind())
}

/// The deadline an `ack` says the coordinator applied to its turn (a turn without calls
/// has no `ack`: its `final` follows at once).
pub fn ack_deadline_ms(event: &TurnEvent) -> Option<u64> {
    match event {
        TurnEvent::Ack { deadline_ms, .. } => *deadline_ms,
        _ => None,
    }
}

/// Cancels a turn when dropped before its last event went out: the HTTP client of its
/// event stream went away (`TOOLFLEET_GATEWAY_CANCEL_ON_DISCONNECT`).
pub struct CancelOnDrop {
    gateway: Arc<Gateway>,
    turn_id: String,
    tenant: String,
}

impl CancelOnDrop {
    /// Cancels `turn_id` of `tenant` through `gateway` when dropped before it is disarmed.
    pub fn new(gateway: Arc<Gateway>, turn_id: String, tenant: String) -> Self {
        Self {
            gateway,
            turn_id,
            tenant,
        }
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.turn_id.is_empty() {
            return;
        }
        let (gateway, turn_id, tenant) = (
            Arc::clone(&self.gateway),
            std::mem::take(&mut self.turn_id),
            std::mem::take(&mut self.tenant),
        );
        tokio::spawn(async move {
            let wait = Duration::from_secs(10);
            if let Err(error) = gateway.client.cancel(&turn_id, Some(&tenant), wait).await {
                tracing::warn!(%turn_id, %error, "could not cancel the turn of a client that went away");
            }
        });
    }
}

/// The event stream of a turn whose first event is `first`; the turn slot is held until
/// the stream ends or the client goes away, and `on_drop` (if any) cancels the turn when
/// the client goes away before its last event. Every event goes out as `turn`'s client
/// sees it (its own turn id).
pub fn event_stream(
    first: TurnEvent,
    stream: TurnStream,
    wait: Duration,
    slot: OwnedSemaphorePermit,
    on_drop: Option<CancelOnDrop>,
    turn: ShownTurn,
) -> axum::response::Response {
    // The seq handed out before the first event: the first's own when it was stored.
    let before = stream.last_seq().saturating_sub(1);
    let state = (Some(first), Some(stream), (slot, on_drop), before);
    let frames = futures::stream::unfold(state, move |(pending, stream, mut held, before)| {
        let turn = turn.clone();
        async move {
            let mut stream = stream?;
            let event = match pending {
                Some(event) => event,
                None => stream.next_event(wait).await.unwrap_or_else(|error| {
                    let code = match error.kind() {
                        toolfleet_common::client::ClientErrorKind::Timeout => codes::TIMEOUT,
                        _ => toolfleet_common::turn::turn_codes::UNAVAILABLE,
                    };
                    TurnEvent::Error {
                        turn_id: Some(stream.turn_id().to_string()),
                        error: CallError::retryable(code, error.to_string()),
                    }
                }),
            };
            // An event with a seq (stored with its turn) moved the stream's last seq on.
            let seq = (stream.last_seq() > before).then_some(stream.last_seq());
            let after = stream.last_seq();
            let next = (!event.is_last()).then_some(stream);
            if next.is_none() {
                // The last event goes out: nothing to cancel any more.
                if let Some(armed) = held.1.as_mut() {
                    armed.turn_id.clear();
                }
            }
            let frame = Ok::<_, std::convert::Infallible>(sse_frame(&turn.show(event), seq));
            Some((frame, (None, next, held, after)))
        }
    });
    let mut response = Body::from_stream(frames.boxed()).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(EVENT_STREAM));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_name_the_event_type() {
        let event = TurnEvent::Narration {
            turn_id: "t".into(),
            text: "hi".into(),
        };
        assert_eq!(
            sse_frame(&event, None),
            "event: narration\ndata: {\"type\":\"narration\",\"turn_id\":\"t\",\"text\":\"hi\"}\n\n"
        );
        assert!(sse_frame(&event, Some(4)).starts_with("id: 4\nevent: narration\n"));
    }
}
