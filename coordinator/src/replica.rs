//! The state every task of one coordinator replica shares, and the small helpers every
//! task uses with it.
//!
//! Owns [`Replica`] (its connections, the join, the registry, the turns it owns, the
//! tasks it spawned), [`Ensured`] (the tool consumers it created or checked) and
//! [`next_message`]. A leaf: it knows no handler, so every handler can take it and
//! `startup.rs` builds it without a module importing back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::health::Health;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::{Names, ToolDefinition};

use crate::narrate::Narrator;
use crate::registry::Registry;
use crate::store::TurnStore;
use crate::turns::OwnedTurns;
use crate::CoordinatorConfig;

/// State shared by every task of one coordinator replica.
pub(crate) struct Replica {
    pub config: CoordinatorConfig,
    pub names: Names,
    pub nats: async_nats::Client,
    /// Moves `nats` to another server of a cluster when job publishes keep failing.
    pub failover: toolfleet_common::failover::Failover,
    pub js: jetstream::Context,
    /// The turns' calls and results: the Redis join (`join.rs`), behind the seam of
    /// `store.rs`.
    pub join: Arc<dyn TurnStore>,
    /// Tool definitions and live workers.
    pub registry: Registry,
    pub narrator: Arc<dyn Narrator>,
    pub metrics: FleetMetrics,
    /// Every spawned task (turns, results, timers), so shutdown can wait for them.
    pub tasks: TaskTracker,
    /// The turns this replica took and has not seen end.
    pub turns: OwnedTurns,
    /// Liveness, readiness and the drain flag served on `/healthz` and `/readyz`.
    pub health: Health,
    /// The tool consumers this replica created or checked, by definition.
    pub consumers: Ensured,
    /// Redis's memory at the last sample; new turns are refused while it is near full.
    pub memory: Arc<crate::memory::StoreMemory>,
    /// The tools' lanes, shared fairly between tenants (`lanes.rs`, `sharing.rs`).
    pub lanes: crate::lanes::Lanes,
}

/// The definitions whose consumer this replica has ensured, by tool, so a refresh that
/// changed nothing costs no JetStream request.
#[derive(Default)]
pub(crate) struct Ensured(pub(crate) Mutex<HashMap<String, ToolDefinition>>);

/// The next message of `subscriber`, or `None` once `stop` is cancelled or the
/// subscription ended.
pub(crate) async fn next_message<T>(
    subscriber: &mut (impl futures::Stream<Item = T> + Unpin),
    stop: &CancellationToken,
) -> Option<T> {
    tokio::select! {
        _ = stop.cancelled() => None,
        m = subscriber.next() => m,
    }
}
