//! Everything the coordinator publishes that is not a job: turn events to a frontend's
//! reply subject and progress notices between replicas.
//!
//! Owns the publishing functions ([`publish_stored`] for events of a stored turn, each
//! with its `seq`; [`publish_unstored`] for the one `error` of a request whose turn was
//! never stored; [`answer`] for a request's one answer (catalog, cancel); [`emit`],
//! which stores events of a running turn and sends them; [`notify`] for notices between
//! coordinators and to workers) and the small constructors of events several steps
//! send. Everything bound for a frontend goes to a [`Reply`], which only the caller
//! checks of `callers.rs` make, and every notice to a subject built from `Names` by
//! [`Notice`]: no function here takes a subject as a string. Every event of
//! a stored turn is stored in the turn's event list before it is sent (`store/redis.rs`), so a
//! publish that is lost is only a gap the frontend fills by attaching; sending is core
//! NATS, fire-and-forget, and never changes a turn's state. Nor does it hold a turn up:
//! while the NATS connection is down its outgoing queue fills and a publish would wait
//! for the reconnection; an event that finds no room within [`PUBLISH_WAIT`] is dropped
//! (logged) and the step that sent it goes on, so a turn's `final` is stored on time
//! and any coordinator can replay it.
//!
//! Never decides *what* to say or *when*: the step that owns the moment does (`intake`
//! the ack, `results` a call's state, `progress` a relayed `running`, `finalize` the
//! narration and `final`, `attach` a replay). Never publishes a job (`dispatch.rs` does).

use std::time::Duration;

use async_nats::Client;
use bytes::Bytes;
use toolfleet_common::failover::{publish_within, PublishWithinError};
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::turn::with_seq;
use toolfleet_common::{CallError, CallResult, CallState, Names, TurnEvent};
use tracing::warn;

use crate::callers::Reply;
use crate::finals;
use crate::replica::Outbox;
use crate::store::redis::Emitted;

/// The longest an event or notice waits for room in the connection's outgoing queue.
/// The queue (2,048 commands) drains in microseconds while the connection is up; it
/// fills only while the connection is down.
pub(crate) const PUBLISH_WAIT: Duration = Duration::from_millis(250);

/// A notice the coordinator publishes on a subject of its own naming.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Notice<'a> {
    /// To every replica: the turn ended, its owner forgets it.
    Ended(&'a str),
    /// To the workers: the turn was cancelled.
    Cancelled(&'a str),
}

/// Publishes `body` on `subject`, waiting at most [`PUBLISH_WAIT`] for the connection
/// to take it. Private: callers name a [`Reply`] or a [`Notice`].
async fn send(nats: &Client, subject: String, body: Bytes) -> Result<(), PublishWithinError> {
    #[allow(clippy::disallowed_methods)] // the one publish of this module
    publish_within(nats, subject, body, PUBLISH_WAIT).await
}

/// Publishes `notice` with `body`.
pub(crate) async fn notify(
    nats: &Client,
    names: &Names,
    notice: Notice<'_>,
    body: Bytes,
) -> Result<(), PublishWithinError> {
    let subject = match notice {
        Notice::Ended(turn_id) => names.ended_subject(turn_id),
        Notice::Cancelled(turn_id) => names.turn_cancelled(turn_id),
    };
    send(nats, subject, body).await
}

/// Sends a request's one answer (a catalog, a cancel's outcome) to `reply`.
pub(crate) async fn answer(nats: &Client, reply: &Reply, body: Bytes) {
    if let Err(error) = send(nats, reply.to_string(), body).await {
        warn!(%error, "answer not sent");
    }
}

/// Sends stored events to the kept reply subject of a turn (see [`Reply::kept`]);
/// nothing, logged, when the store holds a subject outside the inbox namespace.
pub(crate) async fn publish_kept(nats: &Client, reply: &str, first_seq: u64, events: &[String]) {
    match Reply::kept(reply) {
        Some(reply) => publish_stored(nats, &reply, first_seq, events).await,
        None => warn!(%reply, "stored reply subject outside the inbox namespace; events not sent"),
    }
}

/// The JSON an event is stored and sent as (without its `seq`); `None` (logged) if it
/// does not serialize.
pub(crate) fn encode(event: &TurnEvent) -> Option<String> {
    match serde_json::to_string(event) {
        Ok(json) => Some(json),
        Err(error) => {
            warn!(%error, kind = event.kind(), "event does not serialize");
            None
        }
    }
}

/// Sends stored events to `reply`, the first with `first_seq`, the next with the next;
/// a stored `final` with its history (`finals.rs`).
pub(crate) async fn publish_stored(
    nats: &Client,
    reply: &Reply,
    first_seq: u64,
    events: &[String],
) {
    let limit = finals::limit(nats);
    for (seq, event) in (first_seq..).zip(events) {
        let body = with_seq(finals::sendable(event, limit).as_bytes(), seq);
        match send(nats, reply.to_string(), body.into()).await {
            Ok(()) => {}
            // The connection is down: the events after it would wait as long.
            Err(error @ PublishWithinError::QueueFull(_)) => {
                warn!(%error, seq, "event publish failed; the frontend fills the gap by attaching");
                return;
            }
            Err(error) => {
                warn!(%error, seq, "event publish failed; the frontend fills the gap by attaching");
            }
        }
    }
}

/// Sends the `error` of a request whose turn was never stored (no `seq`).
pub(crate) async fn publish_unstored(nats: &Client, reply: &Reply, event: &TurnEvent) {
    let Some(body) = encode(event) else { return };
    if let Err(error) = send(nats, reply.to_string(), body.into()).await {
        warn!(%error, kind = event.kind(), "event publish failed");
    }
}

/// Stores `events` of a turn that has not ended, then sends them; nothing when the turn
/// is unknown or has ended, or when `unless_result_of` names a call that has its result
/// (a `running` is never stored after its call's terminal state nor after `final`).
pub(crate) async fn emit(
    outbox: Outbox<'_>,
    turn_id: &str,
    unless_result_of: Option<&str>,
    events: &[TurnEvent],
) {
    let encoded: Vec<String> = events.iter().filter_map(encode).collect();
    match outbox.store.emit(turn_id, unless_result_of, &encoded).await {
        Ok(Emitted::Stored { reply, first_seq }) => {
            publish_kept(outbox.nats, &reply, first_seq, &encoded).await;
        }
        Ok(Emitted::Nothing) => {}
        Err(error) => {
            outbox.metrics.redis_error("emit");
            warn!(%turn_id, %error, "could not store events; not sent");
        }
    }
}

/// Tells every replica that `turn_id` ended (its owner forgets it), on the turn's
/// ended subject, which only coordinators may publish.
pub(crate) async fn notify_ended(nats: &Client, names: &Names, turn_id: &str) {
    if let Ok(body) = serde_json::to_vec(&ProgressNotice::Ended) {
        if let Err(error) = notify(nats, names, Notice::Ended(turn_id), body.into()).await {
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

/// The terminal `tool_state` of `result`.
pub(crate) fn result_state(turn_id: &str, result: &CallResult) -> TurnEvent {
    tool_state(
        turn_id,
        &result.tool_call_id,
        &result.name,
        result.state,
        result.error.clone(),
    )
}

/// A turn-level `error` event.
pub(crate) fn turn_error(turn_id: Option<&str>, error: CallError) -> TurnEvent {
    TurnEvent::Error {
        turn_id: turn_id.map(String::from),
        error,
    }
}
