//! Moving a process's NATS connection to another server of a cluster.
//!
//! A server cut off from the rest of its cluster keeps its client connections, and its
//! stale routes swallow what they publish; a server that rejoins may answer "no stream
//! found" for seconds while its JetStream catches up. A process that hears nothing, or
//! whose JetStream requests keep failing, through its server asks [`Failover::claim`]
//! and, when granted, reconnects (`async_nats::Client::force_reconnect`; subscriptions
//! follow the connection). Used by the frontend client (a turn silent too long), by
//! coordinators (a job publish that keeps failing) and by workers (pulls no server
//! answers). [`prefer_another_server`] makes such a move land on another server.

use std::hash::BuildHasher;
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

    /// The mover of `nats`, connected to the servers of `urls` (`TOOLFLEET_NATS_URL`: one
    /// URL or a comma-separated list).
    pub fn for_urls(nats: &async_nats::Client, urls: &str) -> Self {
        let several = urls.split(',').filter(|u| !u.trim().is_empty()).count() > 1;
        Self::of(nats, several)
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

/// `options` choosing the server of every connection and reconnection themselves: the
/// one with the fewest failed attempts; among those any but the server chosen last; among
/// those a configured one before one the cluster advertised; at random. A forced move (`force_reconnect`) off a server that still accepts
/// connections (one cut off from its cluster) thereby lands on another server of the
/// pool instead of, as often as not, the same one; a server that went away is avoided
/// as async-nats's own choice would (it failed), and with one server nothing changes.
pub fn prefer_another_server(options: async_nats::ConnectOptions) -> async_nats::ConnectOptions {
    let last: Arc<Mutex<Option<async_nats::ServerAddr>>> = Arc::default();
    options.reconnect_to_server_callback(move |servers, _info| {
        let chosen = choose(&servers, &last);
        async move { chosen }
    })
}

/// The server [`prefer_another_server`] connects to next, remembered as the last.
fn choose(
    servers: &[async_nats::Server],
    last: &Mutex<Option<async_nats::ServerAddr>>,
) -> Option<async_nats::ReconnectToServer> {
    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
    let order = std::hash::RandomState::new();
    let chosen = servers.iter().min_by_key(|s| {
        (
            s.failed_attempts,
            last.as_ref() == Some(&s.addr),
            // The servers this process was told to use before the ones a server named.
            s.is_discovered,
            order.hash_one(&s.addr),
        )
    })?;
    *last = Some(chosen.addr.clone());
    Some(async_nats::ReconnectToServer {
        addr: chosen.addr.clone(),
        // The library's backoff between attempts.
        delay: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(port: u16, failed_attempts: usize) -> async_nats::Server {
        async_nats::Server {
            addr: format!("nats://127.0.0.1:{port}").parse().expect("address"),
            failed_attempts,
            did_connect: true,
            is_discovered: false,
            last_error: None,
        }
    }

    #[test]
    fn a_move_lands_on_another_server_unless_it_failed_more() {
        let last = Mutex::new(None);
        let pool = [server(1, 0), server(2, 0), server(3, 0)];
        let mut previous = choose(&pool, &last).expect("a server").addr;
        for _ in 0..50 {
            let next = choose(&pool, &last).expect("a server").addr;
            assert_ne!(next, previous, "the same server twice in a row");
            previous = next;
        }
        // The others failed: back to the last one.
        let pool = [server(1, 0), server(2, 3), server(3, 1)];
        *last.lock().expect("lock") = Some(pool[0].addr.clone());
        assert_eq!(choose(&pool, &last).expect("a server").addr, pool[0].addr);
        // A configured server before an advertised one.
        let mut advertised = server(9, 0);
        advertised.is_discovered = true;
        let pool = [server(8, 0), advertised];
        *last.lock().expect("lock") = None;
        for _ in 0..10 {
            *last.lock().expect("lock") = None;
            assert_eq!(choose(&pool, &last).expect("a server").addr, pool[0].addr);
        }
        // One server: always it.
        let one = [server(7, 0)];
        assert_eq!(choose(&one, &last).expect("a server").addr, one[0].addr);
        assert_eq!(choose(&one, &last).expect("a server").addr, one[0].addr);
        assert!(choose(&[], &last).is_none());
    }
}
