//! Moving a process's NATS connection to another server of a cluster.
//!
//! A server cut off from the rest of its cluster keeps its client connections, and its
//! stale routes swallow what they publish; a server that rejoins may answer "no stream
//! found" for seconds while its JetStream catches up. A process that hears nothing, or
//! whose JetStream requests keep failing, through its server asks [`Failover::claim`]
//! and, when granted, reconnects (`async_nats::Client::force_reconnect`; subscriptions
//! follow the connection). Used by the frontend client (a turn silent too long) and by
//! coordinators (a job publish that keeps failing).

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Least time between two moves of one connection to another server.
pub const FAILOVER_SPACING: Duration = Duration::from_secs(5);

/// Grants moves of one connection: at most one per [`FAILOVER_SPACING`], and never when
/// no other server is known. Clones share the spacing.
#[derive(Debug, Clone)]
pub struct Failover {
    /// Whether another server is known: several URLs given, or a server that is part of
    /// a cluster (its `INFO` names the cluster; a lone server's advertised URLs may list
    /// several of its own addresses, so they do not count).
    pub(crate) clustered: bool,
    last: Arc<Mutex<Option<tokio::time::Instant>>>,
}

impl Failover {
    /// The mover of `nats`, connected with several URLs (`several_urls`) or one.
    pub fn of(nats: &async_nats::Client, several_urls: bool) -> Self {
        Self {
            clustered: several_urls || nats.server_info().cluster.is_some(),
            last: Default::default(),
        }
    }

    /// Whether a move may start now (another server is known, none started lately);
    /// claims it when so.
    pub fn claim(&self) -> bool {
        if !self.clustered {
            return false;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at| at.elapsed() < FAILOVER_SPACING) {
            return false;
        }
        *last = Some(tokio::time::Instant::now());
        true
    }
}
