//! Where a turn's deadline is decided to have passed: the owner's clock, and the sweeper
//! every replica runs for turns whose owner is gone.
//!
//! Owns [`clock`] (one task per replica that sleeps until the earliest deadline of the
//! turns it owns, `turns.rs` keeping them in order, and ends those past it) and
//! [`sweep`] (periodically reads every bucket of the deadline index in Redis and ends every turn past its
//! deadline plus the grace). Both end the turn through `finalize::end_open_turn`; the
//! join's script makes sure only one replica ends each turn, however many try.
//!
//! Never computes the deadline (`limits.rs` does) and never publishes the end itself
//! (`finalize.rs` does). Next for a turn that times out: `finalize.rs`.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;
use tracing::warn;

use crate::finalize::{end_open_turn, sweep_turn};
use crate::limits::millis;
use crate::replica::Replica;

/// Turns ended per sweep at most.
const SWEEP_BATCH: usize = 200;

/// Ends each turn this replica owns once its deadline passes, until `stop`. One task
/// for every turn (`turns.rs` keeps them in deadline order): taking or ending a turn
/// costs no task, no timer and no wake-up of this one, except a turn whose deadline
/// comes before the one it sleeps until.
pub(crate) async fn clock(replica: Arc<Replica>, stop: CancellationToken) {
    while let Some(due) = replica.turns.past_deadline(&stop).await {
        for turn_id in due {
            let replica_for_turn = Arc::clone(&replica);
            replica.tasks.spawn(Box::pin(async move {
                end_open_turn(&replica_for_turn, &turn_id, true).await;
            }));
        }
    }
}

/// Ends turns past their deadline plus the sweep grace, until `shutdown`: every bucket
/// of the deadline index, one after the other, starting each sweep at another bucket.
pub(crate) async fn sweep(replica: Arc<Replica>, shutdown: CancellationToken) {
    let grace = millis(replica.config.sweep_grace);
    let buckets = replica.config.deadline_buckets.max(1);
    // Replicas start at different buckets, so through a backlog they end different
    // turns first instead of all racing for the same ones.
    let mut first = u32::try_from(unix_ms() % u64::from(buckets)).unwrap_or(0);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(replica.config.sweep_interval) => {}
        }
        first = (first + 1) % buckets;
        for key in replica.join.deadline_keys(first) {
            if shutdown.is_cancelled() {
                return;
            }
            let due = match replica
                .join
                .due(&key, unix_ms().saturating_sub(grace), SWEEP_BATCH)
                .await
            {
                Ok(due) => due,
                Err(error) => {
                    replica.metrics.redis_error("deadline_sweep");
                    warn!(%error, %key, "deadline sweep failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            for turn_id in due {
                sweep_turn(&replica, &turn_id).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callers::Reply;
    use crate::registry::Registry;
    use crate::store::memory::MemoryStore;
    use crate::store::TurnStore;
    use crate::testing::{self, finals, open_turn, stored, until};
    use crate::turns::OwnedTurn;
    use crate::CoordinatorConfig;

    #[tokio::test]
    async fn the_clock_ends_an_owned_turn_at_its_deadline_and_forgets_it() {
        let (store, replica) = testing::store_and_replica().await;
        let deadline = unix_ms() + 30;
        let created = store.create(open_turn("t1", 1, deadline)).await;
        assert!(matches!(created, Ok(crate::store::redis::Created::New)));
        let owned = OwnedTurn {
            reply: Reply::kept(testing::REPLY).unwrap_or_else(|| panic!("an inbox reply")),
            trace: None,
            deadline_unix_ms: deadline,
            ended_calls: Default::default(),
            tools: Default::default(),
            started: Default::default(),
            ahead: None,
        };
        replica.turns.own("t1".into(), owned);
        let stop = CancellationToken::new();
        let ticking = tokio::spawn(clock(Arc::clone(&replica), stop.clone()));
        until(&store, "t1", |t| t.published > 0).await;
        stop.cancel();
        let _ = ticking.await;
        let turn = stored(&store, "t1");
        assert_eq!(turn.ended.as_deref(), Some("deadline"));
        assert_eq!(finals(&turn), 1);
        assert!(!replica.turns.owns("t1"));
    }

    #[tokio::test]
    async fn the_sweep_ends_each_turn_past_its_deadline_once_and_leaves_the_others() {
        let store = Arc::new(MemoryStore::default());
        let config = CoordinatorConfig {
            fair_sharing: false,
            sweep_interval: Duration::from_millis(5),
            sweep_grace: Duration::ZERO,
            ..CoordinatorConfig::local()
        };
        let registry = Registry::holding(&[testing::tool("crm.get")]);
        let replica = testing::replica_with(Arc::clone(&store), registry, config).await;
        let now = unix_ms();
        for (turn_id, deadline) in [("past", now - 1), ("future", now + 60_000)] {
            let created = store.create(open_turn(turn_id, 1, deadline)).await;
            assert!(matches!(created, Ok(crate::store::redis::Created::New)));
        }
        let stop = CancellationToken::new();
        let sweeping = tokio::spawn(sweep(Arc::clone(&replica), stop.clone()));
        until(&store, "past", |t| t.published > 0).await;
        // A few more sweeps find nothing more to do.
        tokio::time::sleep(Duration::from_millis(30)).await;
        stop.cancel();
        let _ = sweeping.await;
        let past = stored(&store, "past");
        assert_eq!(past.ended.as_deref(), Some("deadline"));
        assert_eq!((finals(&past), past.published), (1, 1));
        assert_eq!(store.deadline_of("past"), None);
        assert_eq!(stored(&store, "future").state, "open");
        assert!(store.deadline_of("future").is_some());
    }
}
