//! Progress notices: workers announce that a call started; coordinators announce that
//! they ended a turn another replica owns.
//!
//! Owns acting on notices for the turns this replica owns: relaying `running` to the
//! frontend and forgetting a turn another replica ended. Notices are best effort: a
//! lost one delays nothing but a `running` event or forgetting a turn (its timer finds
//! the turn ended).
//!
//! Never records a result and never ends a turn.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::CallState;

use crate::events;
use crate::startup::{next_message, Replica};

/// Relays notices until `shutdown`.
pub(crate) async fn relay(
    replica: Arc<Replica>,
    mut subscriber: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    while let Some(message) = next_message(&mut subscriber, &shutdown).await {
        let Some(turn_id) = message.subject.rsplit('.').next().map(String::from) else {
            continue;
        };
        let Ok(notice) = serde_json::from_slice::<ProgressNotice>(&message.payload) else {
            continue;
        };
        match notice {
            ProgressNotice::Started {
                tool_call_id, name, ..
            } => {
                if replica.turns.owns(&turn_id) {
                    let replica = Arc::clone(&replica);
                    replica.tasks.clone().spawn(async move {
                        relay_running(&replica, &turn_id, &tool_call_id, &name).await;
                    });
                }
            }
            ProgressNotice::Ended => replica.turns.release(&turn_id),
        }
    }
    let _ = subscriber.unsubscribe().await;
}

/// Publishes `running` for a call of an owned turn unless the call's result is already
/// recorded (its terminal state was then published first) or the turn has ended: the
/// `EMIT` script stores it only then, in one step with the check. The store and the
/// publish run under the turn's publishing lock, which this replica also holds while
/// publishing terminal states and the turn's end, so `running` never follows `done`.
async fn relay_running(replica: &Replica, turn_id: &str, tool_call_id: &str, name: &str) {
    replica
        .turns
        .gated(turn_id, |gate| async move {
            let _publishing = gate.publishing.lock().await;
            if replica
                .turns
                .running_target(turn_id, tool_call_id)
                .is_none()
            {
                return;
            }
            let running = events::tool_state(turn_id, tool_call_id, name, CallState::Running, None);
            events::emit(replica, turn_id, Some(tool_call_id), &[running]).await;
        })
        .await;
}
