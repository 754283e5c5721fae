//! A turn's stored `final` once it has been sent: marking it sent, and exporting the
//! turn span from what the join stored when this replica marked it first.
//!
//! Owns [`mark_sent`], [`send_stored_again`] (the sweeper's resend of a `final` stored by a
//! replica that died before sending it), [`replayed_final`] (after an attach sent a
//! frontend the stored events up to the `final`) and reading a stored event's kind
//! ([`is_final`]). Used by `finalize.rs` and `attach.rs`, which therefore need not import
//! each other. Never ends a turn.

use toolfleet_common::TurnEvent;
use tracing::warn;

use crate::events;
use crate::replica::Replica;
use crate::store::redis::StoredTurn;
use crate::store::TurnStore;
use crate::trace::{worst_outcome, EndedBy, TurnOutcome, TurnTrace};
use toolfleet_common::metrics::FleetMetrics;

/// Marks the turn's stored `final` sent; whether this call marked it first (and so
/// exports the turn span). A failure is logged: the sweeper sends the `final` again and
/// marks it then.
pub(crate) async fn mark_sent(join: &dyn TurnStore, metrics: &FleetMetrics, turn_id: &str) -> bool {
    match join.mark_published(turn_id).await {
        Ok(first) => first,
        Err(error) => {
            metrics.redis_error("mark_sent");
            warn!(%turn_id, %error, "could not mark the final sent; the sweeper sends it again");
            false
        }
    }
}

/// Sends every stored event of an ended turn again and marks its `final` sent; the
/// replica that marks it first exports the turn span from the stored turn.
pub(crate) async fn send_stored_again(replica: &Replica, turn_id: &str) {
    match replica.join.stored_events(turn_id).await {
        Ok(stored) if !stored.reply.is_empty() && !stored.events.is_empty() => {
            events::publish_kept(&replica.nats, &stored.reply, 1, &stored.events).await;
            if mark_sent(&*replica.join, &replica.metrics, turn_id).await {
                export_stored(turn_id, &stored, EndedBy::Resend);
            }
        }
        Ok(_) => {}
        Err(error) => {
            replica.metrics.redis_error("read_stored");
            warn!(%turn_id, %error, "could not read the stored final; the sweeper retries")
        }
    }
}

/// After a frontend was sent the stored events of `turn_id` up to its `final`
/// (`attach.rs`): the `final` is marked sent, and when that was not done before (the
/// replica that stored it died first) the turn span is exported from the stored turn.
pub(crate) async fn replayed_final(join: &dyn TurnStore, metrics: &FleetMetrics, turn_id: &str) {
    if !mark_sent(join, metrics, turn_id).await {
        return;
    }
    match join.stored_events(turn_id).await {
        Ok(stored) => export_stored(turn_id, &stored, EndedBy::Replay),
        Err(error) => {
            metrics.redis_error("read_stored");
            warn!(%turn_id, %error, "could not read the stored turn; its span is lost")
        }
    }
}

/// Whether the stored event `event` is a `final`.
pub(crate) fn is_final(event: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct Kind<'a> {
        #[serde(rename = "type", borrow)]
        kind: &'a str,
    }
    serde_json::from_str::<Kind<'_>>(event).is_ok_and(|k| k.kind == "final")
}

/// Exports the turn span of an ended turn from what the join stored: its identity, how
/// it ended and its `final`.
fn export_stored(turn_id: &str, stored: &StoredTurn, ended_by: EndedBy) {
    let Some(trace) = stored.trace.as_deref().and_then(TurnTrace::decode) else {
        return;
    };
    let fin = stored
        .events
        .iter()
        .rev()
        .find_map(|e| match serde_json::from_str::<TurnEvent>(e) {
            Ok(TurnEvent::Final(fin)) => Some(fin),
            _ => None,
        });
    let summary = fin.as_ref().map(|f| f.summary);
    let deadline_hit = fin.as_ref().is_some_and(|f| f.deadline_hit);
    let error = fin
        .as_ref()
        .and_then(|f| worst_outcome(&f.results, f.deadline_hit));
    let outcome = match stored.ended.as_str() {
        "complete" => "complete",
        "deadline" => "deadline",
        "cancelled" => "cancelled",
        "no_tools" => "no_tools",
        _ if deadline_hit => "deadline",
        _ => "complete",
    };
    trace.end(&TurnOutcome {
        turn_id,
        outcome,
        summary: summary.as_ref().filter(|_| outcome != "no_tools"),
        deadline_hit,
        error: error.as_ref(),
        ended_by,
    });
}
