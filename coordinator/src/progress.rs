//! Progress notices: workers announce that a call started (on their tool's progress
//! subject); coordinators announce that they ended a turn another replica owns (on a
//! subject only coordinators may publish).
//!
//! Owns acting on notices for the turns this replica owns: relaying `running` to the
//! frontend and forgetting a turn another replica ended. Notices are best effort: a
//! lost one delays nothing but a `running` event or forgetting a turn (its timer finds
//! the turn ended).
//!
//! Never records a result and never ends a turn.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::CallState;

use toolfleet_common::call::unix_ms;

use crate::events;
use crate::replica::{Outbox, Replica};
use crate::turns::{OwnedTurns, Started};

/// Relays notices until `shutdown`: `started` notices from workers on
/// `<p>.progress.<turn>.<tool>` and `ended` notices from coordinators on
/// `<p>.ended.<turn>`. A notice on another subject than its kind's is ignored, so a
/// worker (which may publish only its own tools' progress subjects) can neither end
/// another replica's timer nor announce a call of another tool.
pub(crate) async fn relay(
    replica: Arc<Replica>,
    mut progress: async_nats::Subscriber,
    mut ended: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = progress.next() => match m { Some(m) => m, None => break },
            m = ended.next() => match m { Some(m) => m, None => break },
        };
        let names = &replica.names;
        if let Some(turn_id) = names.ended_subject_turn(&message.subject) {
            replica.turns.release(turn_id);
            continue;
        }
        let Some((turn_id, tool)) = names.progress_subject_parts(&message.subject) else {
            continue;
        };
        let Ok(ProgressNotice::Started {
            tool_call_id,
            name,
            attempt,
            worker_id,
            started_unix_ms,
        }) = serde_json::from_slice::<ProgressNotice>(&message.payload)
        else {
            continue;
        };
        if name != tool || !replica.turns.owns(turn_id) {
            continue;
        }
        let started = Started {
            unix_ms: started_unix_ms.unwrap_or_else(unix_ms),
            attempt,
            worker_id,
        };
        replica.turns.note_started(turn_id, &tool_call_id, started);
        let (replica, turn_id) = (Arc::clone(&replica), turn_id.to_string());
        replica.tasks.clone().spawn(Box::pin(async move {
            relay_running(
                &replica.turns,
                replica.outbox(),
                &turn_id,
                &tool_call_id,
                &name,
            )
            .await;
        }));
    }
    let _ = progress.unsubscribe().await;
    let _ = ended.unsubscribe().await;
}

/// Publishes `running` for a call of an owned turn unless the call's result is already
/// recorded (its terminal state was then published first) or the turn has ended: the
/// `EMIT` script stores it only then, in one step with the check. The store and the
/// publish run under the turn's publishing lock, which this replica also holds while
/// publishing terminal states and the turn's end, so `running` never follows `done`.
async fn relay_running(
    turns: &OwnedTurns,
    outbox: Outbox<'_>,
    turn_id: &str,
    tool_call_id: &str,
    name: &str,
) {
    turns
        .gated(turn_id, |gate| async move {
            let _publishing = gate.publishing.lock().await;
            if turns.running_target(turn_id, tool_call_id, name).is_none() {
                return;
            }
            let running = events::tool_state(turn_id, tool_call_id, name, CallState::Running, None);
            events::emit(outbox, turn_id, Some(tool_call_id), &[running]).await;
        })
        .await;
}
