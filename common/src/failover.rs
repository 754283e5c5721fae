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

/// How long [`Failover::claim_if_cut_off`] waits for the cluster to answer through this
/// server.
pub const CUT_OFF_PROBE: Duration = Duration::from_secs(1);

/// How long an answer through this server keeps [`Failover::claim_if_cut_off`] from
/// asking again.
const ANSWER_HOLDS: Duration = Duration::from_secs(1);

/// Grants moves of one connection: at most one per [`FAILOVER_SPACING`], and never when
/// no other server is known. Clones share the spacing.
#[derive(Debug, Clone)]
pub struct Failover {
    /// Whether another server is known: several URLs given, or a server that is part of
    /// a cluster (its `INFO` names the cluster; a lone server's advertised URLs may list
    /// several of its own addresses, so they do not count).
    pub(crate) clustered: bool,
    last: Arc<Mutex<Option<tokio::time::Instant>>>,
    /// When the cluster last answered a probe through this server; held while one
    /// probe runs, so concurrent callers ask once.
    answered: Arc<tokio::sync::Mutex<Option<tokio::time::Instant>>>,
}

impl Failover {
    /// The mover of `nats`, connected with several URLs (`several_urls`) or one.
    pub fn of(nats: &async_nats::Client, several_urls: bool) -> Self {
        Self {
            clustered: several_urls || nats.server_info().cluster.is_some(),
            last: Default::default(),
            answered: Default::default(),
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

    /// Whether [`Failover::claim`] would grant a move now, without claiming it.
    fn may_claim(&self) -> bool {
        self.clustered
            && !self
                .last
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some_and(|at| at.elapsed() < FAILOVER_SPACING)
    }

    /// Claims a move when this server seems cut off from its cluster: JetStream through
    /// it describes none of `streams` within [`CUT_OFF_PROBE`] with a leader that
    /// reaches a majority of the stream's replicas. A failing publish or a silent pull
    /// may instead be one stream's or consumer's leader being elected again (the fault
    /// is then the same on every server, and moving would only drop the connection's
    /// subscriptions for a while). Concurrent callers share one probe, and an answer
    /// holds for a second.
    pub async fn claim_if_cut_off(
        &self,
        js: &async_nats::jetstream::Context,
        streams: &[String],
    ) -> bool {
        if !self.may_claim() {
            return false;
        }
        let mut answered = self.answered.lock().await;
        if answered.is_some_and(|at| at.elapsed() < ANSWER_HOLDS) || !self.may_claim() {
            return false;
        }
        if cluster_answers(js, streams).await {
            *answered = Some(tokio::time::Instant::now());
            return false;
        }
        self.claim()
    }
}

/// A replica of a stream not heard from by its leader for this long is not counted as
/// reached (its Raft group sends heartbeats every second).
const PEER_SILENT: Duration = Duration::from_secs(3);

/// Whether JetStream describes any of `streams` within [`CUT_OFF_PROBE`] with a leader
/// that reaches a majority of the stream's copies. A server cut off from its cluster
/// may still lead a stream and describe it (nats-server 2.9 keeps a minority leader),
/// but its replicas then go unheard.
async fn cluster_answers(js: &async_nats::jetstream::Context, streams: &[String]) -> bool {
    if streams.is_empty() {
        return false;
    }
    let asks = streams.iter().map(|name| {
        Box::pin(async move {
            match js.get_stream(name).await {
                Ok(stream) if leads_a_majority(stream.cached_info().cluster.as_ref()) => Ok(()),
                _ => Err(()),
            }
        })
    });
    matches!(
        tokio::time::timeout(CUT_OFF_PROBE, futures::future::select_ok(asks)).await,
        Ok(Ok(_))
    )
}

/// Why [`publish_within`] sent nothing.
#[derive(Debug, thiserror::Error)]
pub enum PublishWithinError {
    /// The connection's outgoing queue stayed full for this long: it is down
    /// (reconnecting, or moving to another server).
    #[error("the NATS connection took nothing for {0:?} (reconnecting)")]
    QueueFull(Duration),
    /// The client refused the message (an invalid subject, a payload over the limit).
    #[error(transparent)]
    Publish(#[from] async_nats::PublishError),
}

/// Publishes `payload` on `subject` unless the connection's outgoing queue stays full for
/// `wait`. While a connection is down nothing drains that queue (2,048 commands), and a
/// plain publish waits for the reconnection: seconds while a cut-off server is left.
/// For best-effort sends that must not hold up their caller, such as a turn's events,
/// which are stored before they are sent and replayed on attach. Nothing is sent when it
/// gives up (a queued send is not taken back).
pub async fn publish_within(
    nats: &async_nats::Client,
    subject: String,
    payload: bytes::Bytes,
    wait: Duration,
) -> Result<(), PublishWithinError> {
    match tokio::time::timeout(wait, nats.publish(subject, payload)).await {
        Ok(sent) => Ok(sent?),
        Err(_) => Err(PublishWithinError::QueueFull(wait)),
    }
}

/// Whether a stream's leader reaches more than half of its copies (itself included):
/// a replica counts when it is current, not offline and heard from within
/// [`PEER_SILENT`]. A stream of one copy (or a server outside a cluster) always does.
fn leads_a_majority(cluster: Option<&async_nats::jetstream::stream::ClusterInfo>) -> bool {
    let Some(cluster) = cluster else { return true };
    if cluster.replicas.is_empty() {
        return true;
    }
    if cluster.leader.is_none() {
        return false;
    }
    let reached = cluster
        .replicas
        .iter()
        .filter(|p| p.current && !p.offline && p.active < PEER_SILENT)
        .count();
    (1 + reached) * 2 > 1 + cluster.replicas.len()
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

    fn cluster(json: serde_json::Value) -> async_nats::jetstream::stream::ClusterInfo {
        serde_json::from_value(json).expect("cluster info")
    }

    #[test]
    fn a_leader_counts_only_with_a_majority_of_replicas_heard_from() {
        let peer = |current: bool, active_ms: u64| serde_json::json!({"name": "n", "current": current, "active": active_ms * 1_000_000});
        // Leader and both replicas heard: majority; one replica heard: 2 of 3.
        let both =
            cluster(serde_json::json!({"leader": "a", "replicas": [peer(true, 5), peer(true, 9)]}));
        assert!(leads_a_majority(Some(&both)));
        let one = cluster(
            serde_json::json!({"leader": "a", "replicas": [peer(true, 5), peer(true, 60_000)]}),
        );
        assert!(leads_a_majority(Some(&one)));
        // A leader cut off from both replicas (unheard for a minute, or not current).
        let cut = cluster(
            serde_json::json!({"leader": "a", "replicas": [peer(true, 60_000), peer(false, 5)]}),
        );
        assert!(!leads_a_majority(Some(&cut)));
        // No leader; a single copy; a server outside a cluster.
        let leaderless = cluster(serde_json::json!({"replicas": [peer(true, 5), peer(true, 5)]}));
        assert!(!leads_a_majority(Some(&leaderless)));
        assert!(leads_a_majority(Some(&cluster(
            serde_json::json!({"leader": "a"})
        ))));
        assert!(leads_a_majority(None));
    }

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
