//! Publishing a turn's events to the frontend's reply subject.

use toolfleet_common::{CallError, CallState, TurnEvent};
use tracing::warn;

/// Publishes `event` to `reply` (core NATS, fire-and-forget).
pub(crate) async fn publish(nats: &async_nats::Client, reply: &str, event: &TurnEvent) {
    let body = match serde_json::to_vec(event) {
        Ok(b) => b,
        Err(error) => {
            warn!(%error, kind = event.kind(), "event does not serialize");
            return;
        }
    };
    if let Err(error) = nats.publish(reply.to_string(), body.into()).await {
        warn!(%error, kind = event.kind(), "event publish failed");
    }
}

/// A `tool_state` event.
pub(crate) fn tool_state(
    turn_id: &str,
    tool_call_id: &str,
    name: &str,
    state: CallState,
    error: Option<CallError>,
) -> TurnEvent {
    TurnEvent::ToolState {
        turn_id: turn_id.to_string(),
        tool_call_id: tool_call_id.to_string(),
        name: name.to_string(),
        state,
        error,
    }
}

/// A turn-level `error` event.
pub(crate) fn turn_error(turn_id: Option<&str>, error: CallError) -> TurnEvent {
    TurnEvent::Error {
        turn_id: turn_id.map(String::from),
        error,
    }
}
