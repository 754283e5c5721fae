//! Starting and stopping a coordinator replica: connections, streams, the background
//! tasks, the turn subscription and the drain on shutdown.
//!
//! Owns [`Replica`], the state every task of one coordinator shares, and the order in
//! which a replica comes up and goes down. Never handles a turn itself: each turn request
//! goes to `intake.rs`, each result to `results.rs`, each progress notice to
//! `progress.rs`, each catalog request to `catalog.rs`, and the sweeper in `deadline.rs`
//! ends the turns whose owner is gone.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::names::COORDINATOR_QUEUE_GROUP;
use toolfleet_common::streams::ensure_streams;
use toolfleet_common::Names;
use tracing::{info, warn};

use crate::join::JoinStore;
use crate::narrate::{Narrator, TemplateNarrator};
use crate::registry::Registry;
use crate::turns::OwnedTurns;
use crate::{catalog, deadline, intake, progress, results, CoordinatorConfig, CoordinatorError};

/// How long a Redis reply may take before the call counts as failed.
pub const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// State shared by every task of one coordinator replica.
pub(crate) struct Replica {
    pub config: CoordinatorConfig,
    pub names: Names,
    pub nats: async_nats::Client,
    pub js: jetstream::Context,
    /// The turns' calls and results in Redis.
    pub join: JoinStore,
    /// Tool definitions and live workers.
    pub registry: Registry,
    pub narrator: Arc<dyn Narrator>,
    pub metrics: FleetMetrics,
    /// Every spawned task (turns, results, timers), so shutdown can wait for them.
    pub tasks: TaskTracker,
    /// The turns this replica took and has not seen end.
    pub turns: OwnedTurns,
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
    let mut redis = connect_redis(&config.redis_url).await?;
    let registry = Registry::default();
    registry.refresh(&mut redis, &names).await?;

    let replica = Arc::new(Replica {
        join: JoinStore::new(redis.clone(), names.clone()),
        config: config.clone(),
        names: names.clone(),
        nats: nats.clone(),
        js,
        registry,
        narrator,
        metrics: FleetMetrics::new(),
        tasks: TaskTracker::new(),
        turns: OwnedTurns::default(),
    });
    let background = TaskTracker::new();
    let stop_background = CancellationToken::new();
    spawn_background(
        &replica,
        &background,
        &stop_background,
        consumer,
        redis.clone(),
    )
    .await?;
    if let Some(addr) = config.http_addr {
        let ready = toolfleet_common::ready::readiness(
            nats.clone(),
            redis,
            toolfleet_common::ready::Needs {
                streams: vec![names.jobs_stream()],
                consumers: vec![(names.results_stream(), names.results_consumer())],
            },
        );
        let handler = toolfleet_common::http::ops_handler(ready);
        let bound = toolfleet_common::http::serve(addr, handler, stop_background.clone())
            .await
            .map_err(CoordinatorError::Http)?;
        info!(%bound, "serving /healthz, /readyz and /metrics");
    }

    take_turns(&replica, shutdown).await?;
    drain(&replica).await;
    stop_background.cancel();
    background.close();
    background.wait().await;
    replica.tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(2), replica.tasks.wait()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), nats.flush()).await;
    info!("coordinator stopped");
    Ok(())
}

/// A Redis connection for the join: TCP_NODELAY, a generous response timeout.
async fn connect_redis(url: &str) -> Result<redis::aio::ConnectionManager, redis::RedisError> {
    // Without TCP_NODELAY, a script sent while another's reply is outstanding waits for
    // that reply (Nagle), which serializes concurrent recordings.
    let client = redis::Client::open(
        redis::IntoConnectionInfo::into_connection_info(url)?
            .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true)),
    )?;
    // A script that ran but whose reply was slow must not be reported as failed, so the
    // response timeout is generous.
    redis::aio::ConnectionManager::new_with_config(
        client,
        redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(REDIS_RESPONSE_TIMEOUT)),
    )
    .await
}

/// Starts the tasks that run beside the turns until `stop`: registry refresh, progress
/// relay, catalog, deadline sweeper and the results consumer.
async fn spawn_background(
    replica: &Arc<Replica>,
    background: &TaskTracker,
    stop: &CancellationToken,
    results: jetstream::consumer::PullConsumer,
    mut redis: redis::aio::ConnectionManager,
) -> Result<(), CoordinatorError> {
    let (nats, names) = (&replica.nats, &replica.names);
    // Registry: periodic refresh plus a refresh on every announced change.
    let mut changes = nats.subscribe(names.registry_changed()).await?;
    let (registry, period) = (replica.registry.clone(), replica.config.registry_refresh);
    let (names_task, stop_task) = (names.clone(), stop.clone());
    background.spawn(async move {
        loop {
            tokio::select! {
                _ = stop_task.cancelled() => break,
                _ = tokio::time::sleep(period) => {}
                Some(_) = changes.next() => {}
            }
            if let Err(error) = registry.refresh(&mut redis, &names_task).await {
                warn!(%error, "registry refresh failed");
            }
        }
    });
    let progress_sub = nats.subscribe(names.progress_wildcard()).await?;
    background.spawn(progress::relay(
        Arc::clone(replica),
        progress_sub,
        stop.clone(),
    ));
    let catalog_sub = nats
        .queue_subscribe(names.catalog(), COORDINATOR_QUEUE_GROUP.to_string())
        .await?;
    background.spawn(catalog::serve(
        Arc::clone(replica),
        catalog_sub,
        stop.clone(),
    ));
    background.spawn(deadline::sweep(Arc::clone(replica), stop.clone()));
    background.spawn(results::consume(
        Arc::clone(replica),
        results,
        replica.config.result_concurrency,
        stop.clone(),
    ));
    Ok(())
}

/// The next message of `subscriber`, or `None` once `stop` is cancelled or the
/// subscription ended.
pub(crate) async fn next_message(
    subscriber: &mut async_nats::Subscriber,
    stop: &CancellationToken,
) -> Option<async_nats::Message> {
    tokio::select! {
        _ = stop.cancelled() => None,
        m = subscriber.next() => m,
    }
}

/// Takes turn requests from the queue group until `shutdown`, then the ones already
/// delivered to this replica (new ones go to the other replicas).
async fn take_turns(
    replica: &Arc<Replica>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    let take = |message| {
        let replica = Arc::clone(replica);
        replica
            .tasks
            .clone()
            .spawn(intake::handle_turn_message(replica, message));
    };
    let mut turns = replica
        .nats
        .queue_subscribe(
            replica.names.turn_submit(),
            COORDINATOR_QUEUE_GROUP.to_string(),
        )
        .await?;
    info!(prefix = %replica.names.prefix(), "coordinator taking turns");
    while let Some(message) = next_message(&mut turns, &shutdown).await {
        take(message);
    }
    info!("coordinator stopping: no new turns");
    let _ = turns.drain().await;
    while let Some(message) = turns.next().await {
        take(message);
    }
    Ok(())
}

/// Lets owned turns end within the grace period, then abandons the rest to the other
/// replicas' sweepers (their deadline entries stay in Redis).
async fn drain(replica: &Replica) {
    let deadline = tokio::time::Instant::now() + replica.config.shutdown_grace;
    while replica.turns.count() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if replica.turns.count() > 0 {
        warn!(
            turns = replica.turns.count(),
            "turns still open after the grace period; another replica ends them at their deadline"
        );
    }
    replica.turns.abandon_all();
}
