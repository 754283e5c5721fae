//! The deadline sweeper: every replica periodically ends turns past their deadline whose
//! owner did not (because it stopped or died). The join's script makes sure only one
//! replica ends each turn.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;
use tracing::warn;

use crate::intake::finalize_at_deadline;
use crate::Inner;

/// Turns ended per sweep at most.
const SWEEP_BATCH: usize = 200;

/// Sweeps until `shutdown`.
pub(crate) async fn sweep(inner: Arc<Inner>, shutdown: CancellationToken) {
    let grace = u64::try_from(inner.config.sweep_grace.as_millis()).unwrap_or(u64::MAX);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(inner.config.sweep_interval) => {}
        }
        let due = match inner
            .join
            .due(unix_ms().saturating_sub(grace), SWEEP_BATCH)
            .await
        {
            Ok(due) => due,
            Err(error) => {
                warn!(%error, "deadline sweep failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        for turn_id in due {
            finalize_at_deadline(&inner, &turn_id).await;
        }
    }
}
