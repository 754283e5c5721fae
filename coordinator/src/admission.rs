//! Admitting a turn to the join: storing it (or replaying the stored turn of the same id
//! to the same caller) and the first events stored with it.
//!
//! Owns [`Taken`] (who asked for a turn and where its events go), [`admit`] and its
//! [`Admission`] (new, replayed, or refused with `duplicate_turn`, `turn_id_conflict` or
//! `unavailable`), and [`first_events`] (the `ack` and one state per call). Shared by
//! `intake.rs` for a turn with calls and `finalize.rs` for a no-tool answer, so neither
//! imports the other. Never publishes anything but a replay (`attach.rs`).

use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::turn::{turn_codes, AckCall};
use toolfleet_common::{CallError, CallState, TurnEvent};
use toolfleet_decision::ack::compose_acknowledgement;
use tracing::warn;

use crate::attach;
use crate::callers::Reply;
use crate::events;
use crate::replica::Outbox;
use crate::store::redis::{Created, NewTurn};
use crate::store::TurnStore;
use crate::validate::{PlannedCall, Verdict};

/// Who asked for a turn and where its events go.
pub(crate) struct Taken {
    /// The turn id.
    pub turn_id: String,
    /// The frontend's reply subject.
    pub reply: Reply,
    /// The submitting frontend's NATS user ('' when unidentified).
    pub caller: String,
    /// What a resubmission of the turn id must repeat (`intake::request_digest`).
    pub digest: String,
}

/// What storing a new turn came to.
pub(crate) enum Admission {
    /// Stored: the turn runs.
    New,
    /// The same frontend and tenant submitted this id before (its acceptance was lost
    /// or late): its stored events were sent again; nothing runs twice.
    Replayed,
    /// Refused: the id is another frontend's or tenant's, or the store is unreachable.
    Refused(CallError),
}

/// Stores the turn in the join, or replays the existing turn of the same id to this
/// caller, or says why neither.
pub(crate) async fn admit(outbox: Outbox<'_>, turn: NewTurn<'_>, reply: &Reply) -> Admission {
    let (turn_id, caller) = (turn.turn_id.to_string(), turn.caller.to_string());
    match create(outbox.store, outbox.metrics, turn).await {
        Ok(Created::New) => Admission::New,
        Ok(Created::Exists {
            same_caller: true,
            same_request: true,
        }) => {
            attach::replay(outbox, &turn_id, (&caller, None), reply, 0).await;
            Admission::Replayed
        }
        Ok(Created::Exists {
            same_caller: true,
            same_request: false,
        }) => Admission::Refused(CallError::fatal(
            turn_codes::TURN_ID_CONFLICT,
            format!(
                "turn {turn_id} was submitted before with another decision; a resubmission must carry the same request, a new turn a new id"
            ),
        )),
        Ok(Created::Exists {
            same_caller: false, ..
        }) => Admission::Refused(CallError::fatal(
            turn_codes::DUPLICATE_TURN,
            format!("turn {turn_id} already exists"),
        )),
        Err(error) => Admission::Refused(error),
    }
}

/// Creates the turn in the join; an unreachable store refuses the turn.
async fn create(
    join: &dyn TurnStore,
    metrics: &FleetMetrics,
    turn: NewTurn<'_>,
) -> Result<Created, CallError> {
    match join.create(turn).await {
        Ok(created) => Ok(created),
        Err(error) => {
            warn!(%error, "could not create the turn");
            metrics.redis_error("create_turn");
            Err(CallError::retryable(
                turn_codes::UNAVAILABLE,
                "the turn store is unavailable",
            ))
        }
    }
}

/// The turn's first events, stored with the turn and sent before any job leaves: `ack`
/// (the model's own text, or one composed from the tools' waiting hints), then one state
/// per call (`pending`, or the refusal).
pub(crate) fn first_events(
    turn_id: &str,
    planned: &[PlannedCall],
    model_text: Option<String>,
    budget_ms: u64,
) -> Vec<String> {
    let text = model_text.unwrap_or_else(|| {
        let hints: Vec<&str> = planned
            .iter()
            .filter_map(|p| match &p.verdict {
                Verdict::Dispatch { tool, .. } => tool.definition.waiting_hint.as_deref(),
                Verdict::Refuse(_) => None,
            })
            .collect();
        compose_acknowledgement(&hints)
    });
    let calls = planned
        .iter()
        .map(|p| AckCall {
            tool_call_id: p.call.id.clone(),
            name: p.call.name.clone(),
        })
        .collect();
    let ack = TurnEvent::Ack {
        turn_id: turn_id.to_string(),
        text,
        calls,
        deadline_ms: Some(budget_ms),
    };
    let states = planned.iter().map(|p| {
        let (state, error) = match &p.verdict {
            Verdict::Dispatch { .. } => (CallState::Pending, None),
            Verdict::Refuse(e) => (CallState::Error, Some(e.clone())),
        };
        events::tool_state(turn_id, &p.call.id, &p.call.name, state, error)
    });
    std::iter::once(ack)
        .chain(states)
        .filter_map(|event| events::encode(&event))
        .collect()
}

#[cfg(test)]
mod tests {
    use toolfleet_common::call::unix_ms;

    use super::*;
    use crate::testing::{self, open_turn, stored};

    fn reply(name: &str) -> Reply {
        Reply::kept(&format!("_INBOX.test.{name}")).expect("an inbox subject")
    }

    fn refusal(admission: Admission) -> CallError {
        match admission {
            Admission::Refused(error) => error,
            Admission::New | Admission::Replayed => panic!("admitted"),
        }
    }

    #[tokio::test]
    async fn a_turn_id_submitted_again_is_replayed_to_its_frontend_and_refused_to_others() {
        let (store, replica) = testing::store_and_replica().await;
        let deadline = unix_ms() + 60_000;
        let first = reply("first");
        let turn = open_turn("t1", 2, deadline);
        let admitted = admit(replica.outbox(), turn, &first).await;
        assert!(matches!(admitted, Admission::New));

        // The same frontend with the same request: its events go to the new subject.
        let again = reply("again");
        let turn = open_turn("t1", 2, deadline);
        let admitted = admit(replica.outbox(), turn, &again).await;
        assert!(matches!(admitted, Admission::Replayed));
        assert_eq!(stored(&store, "t1").reply, again.as_str());

        // The same frontend with another request, and another frontend: refused, and
        // the stored turn is left as it is.
        let changed = NewTurn {
            digest: "another request",
            ..open_turn("t1", 2, deadline)
        };
        let mallory = NewTurn {
            caller: "mallory",
            ..open_turn("t1", 2, deadline)
        };
        for (turn, code) in [
            (changed, turn_codes::TURN_ID_CONFLICT),
            (mallory, turn_codes::DUPLICATE_TURN),
        ] {
            let error = refusal(admit(replica.outbox(), turn, &reply("other")).await);
            assert_eq!((error.code.as_str(), error.retryable), (code, false));
        }
        let turn = stored(&store, "t1");
        assert_eq!(
            (turn.reply.as_str(), turn.events.len()),
            (again.as_str(), 1)
        );
    }

    #[tokio::test]
    async fn an_unreachable_store_refuses_the_turn_for_now_and_stores_nothing() {
        let (store, replica) = testing::store_and_replica().await;
        store.set_unavailable(true);
        let turn = open_turn("t1", 2, unix_ms() + 60_000);
        let error = refusal(admit(replica.outbox(), turn, &reply("first")).await);
        assert_eq!(
            (error.code.as_str(), error.retryable),
            (turn_codes::UNAVAILABLE, true)
        );
        store.set_unavailable(false);
        assert!(store.turn("t1").is_none());
    }
}
