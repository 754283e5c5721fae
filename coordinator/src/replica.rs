//! The state every task of one coordinator replica shares, and the small helpers every
//! task uses with it.
//!
//! Owns [`Replica`] (its connections, the join, the registry, the turns it owns, the
//! tasks it spawned), the narrow handles it lends to the steps that need only a few of
//! its fields ([`Outbox`] for storing and sending a turn's events, [`JobSink`] for
//! publishing jobs, [`Sharing`] for the tools' lanes), [`Ensured`] (the tool consumers
//! it created or checked) and [`next_message`]. A leaf: it knows no handler, so every
//! handler can take it or one of its handles and `startup.rs` builds it without a
//! module importing back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::health::Health;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::{Names, ToolDefinition};

use crate::callers::{Caller, Reply};
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
    /// The turns' calls and results: the Redis join (`store/redis.rs`), behind the seam of
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

impl Replica {
    /// The caller of a request and where its answer goes (`Caller::of_request`).
    pub(crate) fn caller_of(
        &self,
        message: &async_nats::Message,
        request: &str,
    ) -> Option<(Caller, Reply)> {
        let own_inbox = self.config.nats_credentials.inbox_prefix();
        Caller::of_request(&self.names, &own_inbox, &self.metrics, message, request)
    }

    /// The handles of a step that stores a turn's events and sends them.
    pub(crate) fn outbox(&self) -> Outbox<'_> {
        Outbox {
            store: &*self.join,
            metrics: &self.metrics,
            nats: &self.nats,
        }
    }

    /// The handles of publishing jobs.
    pub(crate) fn job_sink(&self) -> JobSink<'_> {
        JobSink {
            config: &self.config,
            names: &self.names,
            nats: &self.nats,
            js: &self.js,
            failover: &self.failover,
        }
    }

    /// The handles of the tools' lanes and of the jobs they hand out.
    pub(crate) fn sharing(&self) -> Sharing<'_> {
        Sharing {
            config: &self.config,
            registry: &self.registry,
            metrics: &self.metrics,
            lanes: &self.lanes,
            store: &*self.join,
            turns: &self.turns,
            jobs: self.job_sink(),
        }
    }
}

/// What admitting, replaying and emitting a turn's events use: the store that keeps
/// them, its error counters, and the connection they are sent on.
#[derive(Clone, Copy)]
pub(crate) struct Outbox<'a> {
    pub store: &'a dyn TurnStore,
    pub metrics: &'a FleetMetrics,
    pub nats: &'a async_nats::Client,
}

/// What publishing a job uses (`dispatch.rs`): the subjects, the stream, and the
/// connection with its failover when publishes keep failing.
#[derive(Clone, Copy)]
pub(crate) struct JobSink<'a> {
    pub config: &'a CoordinatorConfig,
    pub names: &'a Names,
    pub nats: &'a async_nats::Client,
    pub js: &'a jetstream::Context,
    pub failover: &'a toolfleet_common::failover::Failover,
}

/// What the tools' lanes use (`sharing.rs`): the tenants' policies, the live workers,
/// the lanes, the turn store and the turns owned here, and the jobs they hand out.
#[derive(Clone, Copy)]
pub(crate) struct Sharing<'a> {
    pub config: &'a CoordinatorConfig,
    pub registry: &'a Registry,
    pub metrics: &'a FleetMetrics,
    pub lanes: &'a crate::lanes::Lanes,
    pub store: &'a dyn TurnStore,
    pub turns: &'a OwnedTurns,
    pub jobs: JobSink<'a>,
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
