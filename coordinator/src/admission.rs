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
use crate::join::{Created, NewTurn};
use crate::replica::Replica;
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
pub(crate) async fn admit(replica: &Replica, turn: NewTurn<'_>, reply: &Reply) -> Admission {
    let (turn_id, caller) = (turn.turn_id.to_string(), turn.caller.to_string());
    match create(&*replica.join, &replica.metrics, turn).await {
        Ok(Created::New) => Admission::New,
        Ok(Created::Exists {
            same_caller: true,
            same_request: true,
        }) => {
            attach::replay(replica, &turn_id, (&caller, None), reply, 0).await;
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
