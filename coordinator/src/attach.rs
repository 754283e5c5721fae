//! Attaching to a turn: a frontend that lost events (a reconnect, a resubmission of the
//! same turn id, a restart of its own) asks for the turn by id and gets every stored
//! event after the `seq` it holds, then the turn's later events.
//!
//! Owns the attach subject's messages and [`replay`], which intake also uses when the
//! same frontend submits a turn id again. The turn's event list in Redis (`store/redis.rs`) is
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

use crate::callers::Reply;
use crate::events;
use crate::replica::{Outbox, Replica};
use crate::store::redis::Attached;

/// Handles one message on the attach subject.
pub(crate) async fn handle_attach_message(replica: Arc<Replica>, message: async_nats::Message) {
    let Some((caller, reply)) = replica.caller_of(&message, "attach") else {
        return;
    };
    let request = match serde_json::from_slice::<AttachRequest>(&message.payload) {
        Ok(request) if valid_turn_id(&request.turn_id) => request,
        Ok(_) | Err(_) => {
            let error = CallError::fatal(turn_codes::INVALID_REQUEST, "not an attach request");
            let event = events::turn_error(None, error);
            return events::publish_unstored(&replica.nats, &reply, &event).await;
        }
    };
    let caller = caller.frontend.unwrap_or_default();
    let tenant = request.tenant_id.as_deref().filter(|t| !t.is_empty());
    replay(
        replica.outbox(),
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
    outbox: Outbox<'_>,
    turn_id: &str,
    (caller, tenant): (&str, Option<&str>),
    reply: &Reply,
    after_seq: u64,
) {
    let error = match outbox
        .store
        .attach(turn_id, caller, tenant, reply.as_str(), after_seq)
        .await
    {
        Ok(Attached::Events(stored)) => {
            events::publish_stored(outbox.nats, reply, after_seq + 1, &stored).await;
            // The frontend now holds the `final`: marked sent, and the turn span
            // exported when the replica that stored it died before sending it.
            if stored.last().is_some_and(|e| crate::sent::is_final(e)) {
                crate::sent::replayed_final(outbox.store, outbox.metrics, turn_id).await;
            }
            return;
        }
        Ok(Attached::OtherTenant) => CallError::fatal(
            turn_codes::TENANT_NOT_ALLOWED,
            format!("turn {turn_id} belongs to another tenant"),
        ),
        Ok(Attached::UnknownTurn) => CallError::fatal(
            turn_codes::UNKNOWN_TURN,
            format!("no turn {turn_id} is stored for this frontend"),
        ),
        Err(error) => {
            outbox.metrics.redis_error("attach");
            warn!(%turn_id, %error, "attach failed");
            CallError::retryable(turn_codes::UNAVAILABLE, "the turn store is unavailable")
        }
    };
    let event = events::turn_error(Some(turn_id), error);
    events::publish_unstored(outbox.nats, reply, &event).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::StoredFinal;
    use crate::store::TurnStore;
    use crate::testing::{self, open, stored, REPLY};

    fn reply(name: &str) -> Reply {
        Reply::kept(&format!("_INBOX.test.{name}")).expect("an inbox subject")
    }

    /// Stores a `final` for the open turn `turn_id`, as a replica that died before
    /// sending it leaves it.
    async fn final_stored_unsent(store: &dyn TurnStore, turn_id: &str) {
        let closing = [r#"{"type":"final"}"#.to_string()];
        let stored = store.store_final(turn_id, &closing).await;
        assert!(
            matches!(stored, Ok(StoredFinal::Stored { .. })),
            "{stored:?}"
        );
    }

    #[tokio::test]
    async fn attaching_to_an_ended_turn_moves_its_events_and_marks_its_final_sent() {
        let (store, replica) = testing::store_and_replica().await;
        open(&store, "t1").await;
        final_stored_unsent(&*store, "t1").await;
        assert_eq!(stored(&store, "t1").published, 0);

        let again = reply("again");
        replay(replica.outbox(), "t1", ("", None), &again, 0).await;
        let turn = stored(&store, "t1");
        assert_eq!((turn.reply.as_str(), turn.published), (again.as_str(), 1));
    }

    #[tokio::test]
    async fn another_frontend_or_tenant_changes_nothing_by_attaching() {
        let (store, replica) = testing::store_and_replica().await;
        open(&store, "t1").await;
        final_stored_unsent(&*store, "t1").await;

        let other = reply("other");
        replay(replica.outbox(), "t1", ("mallory", None), &other, 0).await;
        replay(replica.outbox(), "t1", ("", Some("globex")), &other, 0).await;
        replay(replica.outbox(), "t2", ("", None), &other, 0).await;
        let turn = stored(&store, "t1");
        assert_eq!((turn.reply.as_str(), turn.published), (REPLY, 0));
        assert!(store.turn("t2").is_none());
    }
}
