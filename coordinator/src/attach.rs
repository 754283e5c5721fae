//! Attaching to a turn: a frontend that lost events (a reconnect, a resubmission of the
//! same turn id, a restart of its own) asks for the turn by id and gets every stored
//! event after the `seq` it holds, then the turn's later events.
//!
//! Owns the attach subject's messages and [`replay`], which intake also uses when the
//! same frontend submits a turn id again. The turn's event list in Redis (`join.rs`) is
//! the source: events are stored before they are sent, so a replay holds everything the
//! frontend may have missed, `final` included once the turn ended. Only the frontend
//! that submitted a turn may attach to it; for any other, and for an id never seen or
//! past its retention, the answer is one `error` with `unknown_turn`.
//!
//! Never changes a turn's calls or results and never ends a turn; a replayed `final`
//! is marked sent (`sent::replayed_final`).

use std::sync::Arc;

use toolfleet_common::turn::{turn_codes, valid_turn_id, AttachRequest};
use toolfleet_common::CallError;
use tracing::warn;

use crate::callers::{Caller, Reply};
use crate::events;
use crate::join::Attached;
use crate::replica::Replica;

/// Handles one message on the attach subject.
pub(crate) async fn handle_attach_message(replica: Arc<Replica>, message: async_nats::Message) {
    let Some(subject) = message.reply.as_deref() else {
        return;
    };
    let caller = Caller::of(&replica.names, &message.subject);
    let own_inbox = replica.config.nats_credentials.inbox_prefix();
    let Some(reply) = caller.reply_to(subject, &own_inbox) else {
        replica.metrics.turn_refused(turn_codes::REPLY_NOT_ALLOWED);
        warn!(subject = %message.subject, reply = %subject, "attach dropped: reply outside the caller's inbox");
        return;
    };
    let request = match serde_json::from_slice::<AttachRequest>(&message.payload) {
        Ok(request) if valid_turn_id(&request.turn_id) => request,
        Ok(_) | Err(_) => {
            let error = CallError::fatal(turn_codes::INVALID_REQUEST, "not an attach request");
            let event = events::turn_error(None, error);
            return events::publish_unstored(&replica, &reply, &event).await;
        }
    };
    let caller = caller.frontend.unwrap_or_default();
    let tenant = request.tenant_id.as_deref().filter(|t| !t.is_empty());
    replay(
        &replica,
        &request.turn_id,
        (&caller, tenant),
        &reply,
        request.after_seq,
    )
    .await;
}

/// Points the turn's later events at `reply` and sends it the stored events after
/// `after_seq`; `unknown_turn` when the turn is not the caller's (the frontend, and the
/// tenant when one is named) or not stored, `tenant_not_allowed` when it is the
/// frontend's turn of another tenant.
pub(crate) async fn replay(
    replica: &Replica,
    turn_id: &str,
    (caller, tenant): (&str, Option<&str>),
    reply: &Reply,
    after_seq: u64,
) {
    match replica
        .join
        .attach(turn_id, caller, tenant, reply.as_str(), after_seq)
        .await
    {
        Ok(Attached::Events(stored)) => {
            events::publish_stored(replica, reply, after_seq + 1, &stored).await;
            // The frontend now holds the `final`: marked sent, and the turn span
            // exported when the replica that stored it died before sending it.
            if stored.last().is_some_and(|e| crate::sent::is_final(e)) {
                crate::sent::replayed_final(&*replica.join, &replica.metrics, turn_id).await;
            }
        }
        Ok(Attached::OtherTenant) => {
            let error = CallError::fatal(
                turn_codes::TENANT_NOT_ALLOWED,
                format!("turn {turn_id} belongs to another tenant"),
            );
            let event = events::turn_error(Some(turn_id), error);
            events::publish_unstored(replica, reply, &event).await;
        }
        Ok(Attached::UnknownTurn) => {
            let error = CallError::fatal(
                turn_codes::UNKNOWN_TURN,
                format!("no turn {turn_id} is stored for this frontend"),
            );
            let event = events::turn_error(Some(turn_id), error);
            events::publish_unstored(replica, reply, &event).await;
        }
        Err(error) => {
            replica.metrics.redis_error("attach");
            warn!(%turn_id, %error, "attach failed");
            let error =
                CallError::retryable(turn_codes::UNAVAILABLE, "the turn store is unavailable");
            let event = events::turn_error(Some(turn_id), error);
            events::publish_unstored(replica, reply, &event).await;
        }
    }
}
