//! Everything the coordinator publishes that is not a job: turn events to a frontend's
//! reply subject and progress notices between replicas.
//!
//! Owns the two publishing functions ([`publish`] for frontend events, [`notify`] for
//! notices) and the small constructors of events several steps send. Core NATS,
//! fire-and-forget: a failed publish is logged, never retried, and never changes a
//! turn's state (the join in Redis decides that).
//!
//! Never decides *what* to say or *when*: the step that owns the moment does (`intake`
//! the ack, `results` a call's state, `progress` a relayed `running`, `finalize` the
//! narration and `final`). Never publishes a job (`dispatch.rs` does).

use toolfleet_common::job::ProgressNotice;
use toolfleet_common::{CallError, CallResult, CallState, TurnEvent};
use tracing::warn;

use crate::startup::Replica;

/// Publishes `event` to the frontend's `reply` subject.
pub(crate) async fn publish(replica: &Replica, reply: &str, event: &TurnEvent) {
    let body = match serde_json::to_vec(event) {
        Ok(b) => b,
        Err(error) => {
            warn!(%error, kind = event.kind(), "event does not serialize");
            return;
        }
    };
    if let Err(error) = replica.nats.publish(reply.to_string(), body.into()).await {
        warn!(%error, kind = event.kind(), "event publish failed");
    }
}

/// Publishes `notice` on the turn's progress subject, heard by every replica (the
/// turn's owner acts on it).
pub(crate) async fn notify(replica: &Replica, turn_id: &str, notice: &ProgressNotice) {
    if let Ok(body) = serde_json::to_vec(notice) {
        let subject = replica.names.progress_subject(turn_id);
        if let Err(error) = replica.nats.publish(subject, body.into()).await {
            warn!(%error, %turn_id, "progress notice publish failed");
        }
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

/// Publishes the terminal `tool_state` of `result`.
pub(crate) async fn publish_result_state(
    replica: &Replica,
    turn_id: &str,
    reply: &str,
    result: &CallResult,
) {
    let event = tool_state(
        turn_id,
        &result.tool_call_id,
        &result.name,
        result.state,
        result.error.clone(),
    );
    publish(replica, reply, &event).await;
}

/// A turn-level `error` event.
pub(crate) fn turn_error(turn_id: Option<&str>, error: CallError) -> TurnEvent {
    TurnEvent::Error {
        turn_id: turn_id.map(String::from),
        error,
    }
}
