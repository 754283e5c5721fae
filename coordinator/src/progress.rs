//! Progress notices: workers announce that a call started; coordinators announce that a
//! paced turn's call ended. The turn's owner relays `running` to the frontend and
//! dispatches the next queued call. Notices are best effort: a lost one delays nothing
//! but a `running` event.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::CallState;
use tracing::debug;

use crate::events;
use crate::intake::release_slot;
use crate::Inner;

/// Relays notices until `shutdown`.
pub(crate) async fn relay(
    inner: Arc<Inner>,
    mut subscriber: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = subscriber.next() => match m { Some(m) => m, None => break },
        };
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
                if inner.owns(&turn_id) {
                    let inner = Arc::clone(&inner);
                    inner.tasks.clone().spawn(async move {
                        relay_running(&inner, &turn_id, &tool_call_id, &name).await;
                    });
                }
            }
            ProgressNotice::Recorded { .. } => {
                if inner.owns(&turn_id) {
                    let inner = Arc::clone(&inner);
                    inner.tasks.clone().spawn(async move {
                        release_slot(&inner, &turn_id).await;
                    });
                }
            }
            ProgressNotice::Ended => inner.release(&turn_id),
        }
    }
    let _ = subscriber.unsubscribe().await;
}

/// Publishes `running` for a call of an owned turn unless the call's result is already
/// recorded (its terminal state was then published first) or the turn has ended. The
/// last check and the publish run under the turn's publishing lock, which this replica
/// also holds while publishing terminal states and the turn's end, so `running` never
/// follows `done`.
async fn relay_running(inner: &Inner, turn_id: &str, tool_call_id: &str, name: &str) {
    match inner.join.has_result(turn_id, tool_call_id).await {
        Ok(true) => return,
        Ok(false) => {}
        Err(error) => debug!(%turn_id, %error, "could not check for a result; relaying running"),
    }
    inner
        .gated(turn_id, |gate| async move {
            let _publishing = gate.publishing.lock().await;
            let Some(reply) = inner.running_target(turn_id, tool_call_id) else {
                return;
            };
            events::publish(
                &inner.nats,
                &reply,
                &events::tool_state(turn_id, tool_call_id, name, CallState::Running, None),
            )
            .await;
        })
        .await;
}
