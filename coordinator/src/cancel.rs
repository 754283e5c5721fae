//! Cancelling a turn: the frontend that submitted a turn asks to stop it (a caller who
//! barged in, a stop button, a client that went away), and the turn ends at once with
//! one `final` in which every call without a result is `cancelled`.
//!
//! Owns the cancel subject's requests and their answers ([`CancelReply`]). The `CANCEL`
//! script (`store/redis.rs`) decides, atomically with every result's `RECORD`, whether the
//! turn was still open: a cancel racing the last result ends the turn once, either way.
//! Workers are told on `<p>.cancelled.<turn_id>` before the `final` is built, so running
//! calls see their cancellation token fire and jobs not yet started are skipped; results
//! that still arrive count as late. Only the frontend that submitted the turn (and, when
//! the request names one, only for that tenant) may cancel it.
//!
//! Never records a result; ends a turn only through `finalize.rs`.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use toolfleet_common::turn::{valid_turn_id, CancelOutcome, CancelReply, CancelRequest};
use tracing::{debug, warn};

use crate::callers::Reply;
use crate::events::{self, Notice};
use crate::finalize::{finish, TurnEnd};
use crate::replica::Replica;
use crate::store::redis::Cancelled;

/// Handles one request on the cancel subject.
pub(crate) async fn handle_cancel_message(replica: Arc<Replica>, message: async_nats::Message) {
    let received = Instant::now();
    let Some((caller, reply)) = replica.caller_of(&message, "cancel") else {
        return;
    };
    let request = match serde_json::from_slice::<CancelRequest>(&message.payload) {
        Ok(request) if valid_turn_id(&request.turn_id) => request,
        Ok(_) | Err(_) => {
            let answer = CancelReply {
                turn_id: String::new(),
                outcome: CancelOutcome::InvalidRequest,
                ended: None,
            };
            return answer_with(&replica, &reply, &answer).await;
        }
    };
    let caller = caller.frontend.unwrap_or_default();
    let turn_id = request.turn_id;
    let tenant = request.tenant_id.as_deref().filter(|t| !t.is_empty());
    let (outcome, ended) = match replica.join.cancel(&turn_id, &caller, tenant).await {
        Ok(Cancelled::UnknownTurn) => (CancelOutcome::UnknownTurn, None),
        Ok(Cancelled::AlreadyEnded(how)) => (CancelOutcome::AlreadyEnded, Some(how)),
        Ok(Cancelled::Ended(closing)) => {
            // Workers first: running calls stop while the final is being built.
            let notice = Notice::Cancelled(&turn_id);
            if let Err(error) =
                events::notify(&replica.nats, &replica.names, notice, Bytes::new()).await
            {
                debug!(%turn_id, %error, "cancel notice to workers not sent");
            }
            let end = TurnEnd::Cancelled {
                turn_id: turn_id.clone(),
                closing,
            };
            let ending = &replica;
            replica
                .turns
                .gated(&turn_id, |gate| async move {
                    let _ending = gate.recording.write().await;
                    let _publishing = gate.publishing.lock().await;
                    finish(ending, end).await;
                })
                .await;
            replica
                .metrics
                .turn_cancelled(received.elapsed().as_secs_f64());
            (CancelOutcome::Cancelled, Some("cancelled".to_string()))
        }
        Err(error) => {
            replica.metrics.redis_error("cancel");
            warn!(%turn_id, %error, "cancel failed");
            (CancelOutcome::Unavailable, None)
        }
    };
    let answer = CancelReply {
        turn_id,
        outcome,
        ended,
    };
    answer_with(&replica, &reply, &answer).await;
}

async fn answer_with(replica: &Replica, reply: &Reply, answer: &CancelReply) {
    if let Ok(body) = serde_json::to_vec(answer) {
        events::answer(&replica.nats, reply, body.into()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::Unpublished;
    use crate::testing::{self, finals, ok_result, open, stored, REPLY};

    fn cancel_message(subject: String, request: serde_json::Value) -> async_nats::Message {
        async_nats::Message {
            subject: subject.into(),
            reply: Some(format!("{REPLY}.cancel").into()),
            payload: serde_json::to_vec(&request).unwrap_or_default().into(),
            headers: None,
            status: None,
            description: None,
            length: 0,
        }
    }

    #[tokio::test]
    async fn a_cancel_racing_the_last_result_ends_the_turn_once() {
        let (store, replica) = testing::store_and_replica().await;
        open(&store, "t1").await;
        let last = Unpublished {
            turn_id: "t1".into(),
            tenant: "acme".into(),
            key: "c2".into(),
            result: ok_result("c2"),
        };
        crate::results::record_unpublished(
            &replica,
            vec![Unpublished {
                key: "c1".into(),
                result: ok_result("c1"),
                ..last.clone()
            }],
        )
        .await;
        let subject = replica.names.turn_cancel();
        let request = serde_json::json!({"turn_id": "t1"});
        futures::join!(
            handle_cancel_message(Arc::clone(&replica), cancel_message(subject, request)),
            crate::results::record_unpublished(&replica, vec![last]),
        );
        let turn = stored(&store, "t1");
        assert!(matches!(
            turn.ended.as_deref(),
            Some("complete" | "cancelled")
        ));
        assert_eq!((finals(&turn), turn.published), (1, 1));
    }

    #[tokio::test]
    async fn only_the_frontend_that_submitted_a_turn_may_cancel_it_for_its_tenant() {
        let (store, replica) = testing::store_and_replica().await;
        open(&store, "t1").await;
        // The turn is the unidentified frontend's; an identified one does not see it.
        let mallory = replica.names.turn_cancel_as("mallory");
        let reply = "_INBOX_mallory.cancel";
        let mut message = cancel_message(mallory, serde_json::json!({"turn_id": "t1"}));
        message.reply = Some(reply.into());
        handle_cancel_message(Arc::clone(&replica), message).await;
        // The right frontend naming another tenant does not see it either.
        let other_tenant = serde_json::json!({"turn_id": "t1", "tenant_id": "globex"});
        let subject = replica.names.turn_cancel();
        handle_cancel_message(Arc::clone(&replica), cancel_message(subject, other_tenant)).await;
        assert_eq!(stored(&store, "t1").state, "open");

        let subject = replica.names.turn_cancel();
        let request = serde_json::json!({"turn_id": "t1", "tenant_id": "acme"});
        handle_cancel_message(Arc::clone(&replica), cancel_message(subject, request)).await;
        let turn = stored(&store, "t1");
        assert_eq!(turn.ended.as_deref(), Some("cancelled"));
        assert_eq!(finals(&turn), 1);
        let last = turn.events.last().cloned().unwrap_or_default();
        assert_eq!(last.matches(r#""state":"cancelled""#).count(), 2, "{last}");
    }
}
