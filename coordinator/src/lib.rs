//! # toolfleet-coordinator
//!
//! Takes turns from a queue group, validates each call, publishes one JetStream job per
//! call, joins the results in Redis under a deadline, narrates one answer and streams
//! `ack` → `tool_state` → `narration` → `final` back to the frontend. Replicas share the
//! load and can finish each other's turns.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | [`config`] | `CoordinatorConfig` (environment) and per-tenant policies |
//! | [`registry`] | the cached tool registry: definitions, compiled schemas, live workers |
//! | [`validate`] | per-call validation: the verdict for every call of a decision |
//! | `intake` | taking a turn: parse, validate, create, ack, dispatch, arm the deadline |
//! | `results` | the shared results consumer: record, report, finalize |
//! | [`join`] | where results are joined: Redis Lua scripts, write-once and end-once |
//! | `finalize` | ordering results, filling in timeouts, narrating, publishing `final` |
//! | [`narrate`] | the `Narrator` trait and the template narrator |
//! | `sweeper` | ending turns past their deadline whose owner is gone |
//! | `progress` | relaying `running` and pacing dispatch by completions |
//! | `catalog` | serving the tool catalog to frontends |
//! | `events` | publishing turn events to the frontend |

mod catalog;
pub mod config;
mod events;
mod finalize;
mod intake;
pub mod join;
pub mod narrate;
mod progress;
pub mod registry;
mod results;
mod sweeper;
pub mod validate;

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::names::COORDINATOR_QUEUE_GROUP;
use toolfleet_common::streams::{ensure_streams, EnsureStreamsError};
use toolfleet_common::{JobEnvelope, Names};
use tracing::{info, warn};

pub use config::{CoordinatorConfig, TenantPolicies, TenantPolicy};
pub use narrate::{Narrator, TemplateNarrator};

use join::{CallEntry, JoinStore};
use registry::Registry;

/// How long a Redis reply may take before the call counts as failed.
pub const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// NATS could not be reached.
    #[error("nats: {0}")]
    Nats(#[from] async_nats::ConnectError),
    /// A subscription failed.
    #[error("subscribe: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    /// The streams could not be created.
    #[error(transparent)]
    Streams(#[from] EnsureStreamsError),
    /// The results consumer could not be created.
    #[error("results consumer: {0}")]
    Consumer(String),
    /// Redis could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The HTTP endpoint could not bind.
    #[error("http endpoint: {0}")]
    Http(std::io::Error),
}

/// A call held back by a turn's concurrency bound.
pub(crate) struct QueuedJob {
    pub key: String,
    pub job: JobEnvelope,
    pub entry: CallEntry,
}

/// A turn this replica took: only the owner relays `running` and paces dispatch.
pub(crate) struct OwnedTurn {
    /// The frontend's reply subject.
    pub reply: String,
    /// The turn's span: open while this replica owns the turn, so it covers the whole
    /// turn and parents the job publishes.
    pub span: tracing::Span,
    /// Calls waiting for a free slot.
    pub queue: VecDeque<QueuedJob>,
    /// Cancels the deadline timer when the turn ends early.
    pub timer: CancellationToken,
    /// Calls whose terminal state this replica published; their `running` is not
    /// relayed any more.
    pub ended_calls: HashSet<String>,
}

/// How one replica orders what it publishes about a turn while it records the turn's
/// results concurrently (their scripts share one pipelined Redis connection).
#[derive(Default)]
pub(crate) struct TurnGate {
    /// Held for reading by each recording from before its script is sent until its
    /// call's state is published; held for writing by whoever ended the turn while it
    /// publishes the end, so `final` follows every state recorded here before the end.
    pub recording: tokio::sync::RwLock<()>,
    /// Held while publishing a state of one of the turn's calls or the turn's end, so a
    /// relayed `running` never follows that call's terminal state.
    pub publishing: tokio::sync::Mutex<()>,
}

/// State shared by every task of one coordinator.
pub(crate) struct Inner {
    pub config: CoordinatorConfig,
    pub names: Names,
    pub nats: async_nats::Client,
    pub js: jetstream::Context,
    pub join: JoinStore,
    pub registry: Registry,
    pub narrator: Arc<dyn Narrator>,
    pub metrics: toolfleet_common::metrics::FleetMetrics,
    /// Every spawned task (turns, results, timers), so shutdown can wait for them.
    pub tasks: TaskTracker,
    /// Turns taken by this replica and not yet ended.
    owned: Mutex<HashMap<String, OwnedTurn>>,
    /// The gate of each turn whose results are being recorded or whose end is being
    /// published here; dropped when nobody holds it.
    gates: Mutex<HashMap<String, Arc<TurnGate>>>,
}

impl Inner {
    fn owned(&self) -> std::sync::MutexGuard<'_, HashMap<String, OwnedTurn>> {
        match self.owned.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    pub(crate) fn own(&self, turn_id: String, turn: OwnedTurn) {
        self.owned().insert(turn_id, turn);
    }

    pub(crate) fn owns(&self, turn_id: &str) -> bool {
        self.owned().contains_key(turn_id)
    }

    pub(crate) fn turn_span(&self, turn_id: &str) -> Option<tracing::Span> {
        self.owned().get(turn_id).map(|t| t.span.clone())
    }

    pub(crate) fn next_queued(&self, turn_id: &str) -> Option<QueuedJob> {
        self.owned().get_mut(turn_id)?.queue.pop_front()
    }

    /// Forgets an ended turn and stops its deadline timer.
    pub(crate) fn release(&self, turn_id: &str) {
        if let Some(turn) = self.owned().remove(turn_id) {
            turn.timer.cancel();
        }
    }

    /// Stops every owned turn's deadline timer and forgets the turns (their deadline
    /// entries stay in Redis for the sweepers of other replicas).
    fn abandon_owned(&self) {
        for (_, turn) in self.owned().drain() {
            turn.timer.cancel();
        }
    }

    fn owned_count(&self) -> usize {
        self.owned().len()
    }

    /// Notes that this replica published the terminal state of `call_id`.
    pub(crate) fn mark_ended(&self, turn_id: &str, call_id: &str) {
        if let Some(turn) = self.owned().get_mut(turn_id) {
            turn.ended_calls.insert(call_id.to_string());
        }
    }

    /// The reply subject for relaying `running` of `call_id`: only while this replica
    /// owns the turn and has not published the call's terminal state.
    pub(crate) fn running_target(&self, turn_id: &str, call_id: &str) -> Option<String> {
        self.owned()
            .get(turn_id)
            .filter(|t| !t.ended_calls.contains(call_id))
            .map(|t| t.reply.clone())
    }

    fn gates(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<TurnGate>>> {
        match self.gates.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Runs `work` with the gate of `turn_id` (recording a result, ending the turn, or
    /// relaying a state), then forgets the gate when nobody else holds it.
    pub(crate) async fn gated<T, F, Fut>(&self, turn_id: &str, work: F) -> T
    where
        F: FnOnce(Arc<TurnGate>) -> Fut,
        Fut: Future<Output = T>,
    {
        let gate = Arc::clone(self.gates().entry(turn_id.to_string()).or_default());
        let out = work(Arc::clone(&gate)).await;
        let mut gates = self.gates();
        drop(gate);
        // Under the map guard, a count of one means nobody else holds or waits for it.
        if gates
            .get(turn_id)
            .is_some_and(|g| Arc::strong_count(g) == 1)
        {
            gates.remove(turn_id);
        }
        out
    }
}

/// Runs a coordinator with the template narrator until `shutdown` is cancelled.
pub async fn run(
    config: CoordinatorConfig,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    run_with_narrator(config, Arc::new(TemplateNarrator), shutdown).await
}

/// Runs a coordinator with `narrator` until `shutdown` is cancelled: then it stops
/// taking turns, lets its own turns end within the grace period, stops consuming results
/// and flushes. Turns it could not finish are ended by another replica at their deadline.
pub async fn run_with_narrator(
    config: CoordinatorConfig,
    narrator: Arc<dyn Narrator>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    let names = Names::new(config.prefix.clone());
    let nats = config
        .nats_credentials
        .apply(async_nats::ConnectOptions::new())
        .name("toolfleet-coordinator")
        .retry_on_initial_connect()
        .connect(&config.nats_url)
        .await?;
    let js = jetstream::new(nats.clone());
    let (_, results_stream) = ensure_streams(&js, &names).await?;
    let consumer = results::results_consumer(&results_stream, &names.results_consumer())
        .await
        .map_err(CoordinatorError::Consumer)?;
    // Without TCP_NODELAY, a script sent while another's reply is outstanding waits for
    // that reply (Nagle), which serializes concurrent recordings.
    let redis_client = redis::Client::open(
        redis::IntoConnectionInfo::into_connection_info(config.redis_url.as_str())?
            .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true)),
    )?;
    // A script that ran but whose reply was slow must not be reported as failed, so the
    // response timeout is generous.
    let mut redis = redis::aio::ConnectionManager::new_with_config(
        redis_client,
        redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(REDIS_RESPONSE_TIMEOUT)),
    )
    .await?;

    let redis_probe = redis.clone();
    let registry = Registry::default();
    registry.refresh(&mut redis, &names).await?;

    let inner = Arc::new(Inner {
        join: JoinStore::new(redis.clone(), names.clone()),
        config: config.clone(),
        names: names.clone(),
        nats: nats.clone(),
        js,
        registry: registry.clone(),
        narrator,
        metrics: toolfleet_common::metrics::FleetMetrics::new(),
        tasks: TaskTracker::new(),
        owned: Mutex::new(HashMap::new()),
        gates: Mutex::new(HashMap::new()),
    });

    let background = TaskTracker::new();
    let stop_background = CancellationToken::new();

    // Registry: periodic refresh plus a refresh on every announced change.
    {
        let mut changes = nats.subscribe(names.registry_changed()).await?;
        let stop = stop_background.clone();
        let names = names.clone();
        let period = config.registry_refresh;
        background.spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(period) => {}
                    Some(_) = changes.next() => {}
                }
                if let Err(error) = registry.refresh(&mut redis, &names).await {
                    warn!(%error, "registry refresh failed");
                }
            }
        });
    }
    let progress_sub = nats.subscribe(names.progress_wildcard()).await?;
    background.spawn(progress::relay(
        Arc::clone(&inner),
        progress_sub,
        stop_background.clone(),
    ));
    let catalog_sub = nats
        .queue_subscribe(names.catalog(), COORDINATOR_QUEUE_GROUP.to_string())
        .await?;
    background.spawn(catalog::serve(
        Arc::clone(&inner),
        catalog_sub,
        stop_background.clone(),
    ));
    background.spawn(sweeper::sweep(Arc::clone(&inner), stop_background.clone()));
    background.spawn(results::consume(
        Arc::clone(&inner),
        consumer,
        config.result_concurrency,
        stop_background.clone(),
    ));

    if let Some(addr) = config.http_addr {
        let ready = toolfleet_common::ready::readiness(
            nats.clone(),
            redis_probe.clone(),
            toolfleet_common::ready::Needs {
                streams: vec![names.jobs_stream()],
                consumers: vec![(names.results_stream(), names.results_consumer())],
            },
        );
        let bound = toolfleet_common::http::serve(
            addr,
            toolfleet_common::http::ops_handler(ready),
            stop_background.clone(),
        )
        .await
        .map_err(CoordinatorError::Http)?;
        info!(%bound, "serving /healthz, /readyz and /metrics");
    }

    let mut turns = nats
        .queue_subscribe(names.turn_submit(), COORDINATOR_QUEUE_GROUP.to_string())
        .await?;
    info!(prefix = %names.prefix(), "coordinator taking turns");
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = turns.next() => match m { Some(m) => m, None => break },
        };
        let inner = Arc::clone(&inner);
        inner
            .tasks
            .clone()
            .spawn(intake::handle_turn_message(inner, message));
    }

    info!("coordinator stopping: no new turns");
    // Requests already delivered to this subscription are still taken; new ones go to
    // the other replicas of the queue group.
    let _ = turns.drain().await;
    while let Some(message) = turns.next().await {
        let inner = Arc::clone(&inner);
        inner
            .tasks
            .clone()
            .spawn(intake::handle_turn_message(inner, message));
    }
    let deadline = tokio::time::Instant::now() + config.shutdown_grace;
    while inner.owned_count() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if inner.owned_count() > 0 {
        warn!(
            turns = inner.owned_count(),
            "turns still open after the grace period; another replica ends them at their deadline"
        );
    }
    // Turns still owned end at their deadline on whichever replica sweeps first.
    inner.abandon_owned();
    stop_background.cancel();
    background.close();
    background.wait().await;
    inner.tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(2), inner.tasks.wait()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), nats.flush()).await;
    info!("coordinator stopped");
    Ok(())
}
