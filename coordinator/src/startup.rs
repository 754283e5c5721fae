//! Starting and stopping a coordinator replica: connections, streams, the background
//! tasks, the turn subscription and the drain on shutdown.
//!
//! Owns [`Replica`], the state every task of one coordinator shares, the order in
//! which a replica comes up and goes down (HTTP endpoint first, so `/readyz` names the
//! step start-up waits on; readiness 503 from the shutdown request on), and the
//! supervision of its background tasks (one that dies fails `/healthz`). Never handles a turn itself: each turn request
//! goes to `intake.rs`, each result to `results.rs`, each progress notice to
//! `progress.rs`, each catalog request to `catalog.rs`, and the sweeper in `deadline.rs`
//! ends the turns whose owner is gone.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::health::{connect_nats, start_process, Health, Started};
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::names::COORDINATOR_QUEUE_GROUP;
use toolfleet_common::redis_client::{RedisConnection, RedisOptions};
use toolfleet_common::streams::ensure_streams;
use toolfleet_common::Names;
use tracing::{info, warn};

use crate::attach;
use crate::cancel;
use crate::join::JoinStore;
use crate::narrate::{Narrator, TemplateNarrator};
use crate::registry::Registry;
use crate::turns::OwnedTurns;
use crate::{
    catalog, deadline, intake, progress, results, upkeep, CoordinatorConfig, CoordinatorError,
};

/// How long a Redis reply may take before the call counts as failed.
pub const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// State shared by every task of one coordinator replica.
pub(crate) struct Replica {
    pub config: CoordinatorConfig,
    pub names: Names,
    pub nats: async_nats::Client,
    /// Moves `nats` to another server of a cluster when job publishes keep failing.
    pub failover: toolfleet_common::failover::Failover,
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
    /// Liveness, readiness and the drain flag served on `/healthz` and `/readyz`.
    pub health: Health,
    /// The tool consumers this replica created or checked, by definition.
    pub consumers: crate::consumers::Ensured,
    /// Redis's memory at the last sample; new turns are refused while it is near full.
    pub memory: Arc<crate::memory::StoreMemory>,
    /// The tools' lanes, shared fairly between tenants (`sharing.rs`).
    pub lanes: crate::sharing::Lanes,
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
///
/// The HTTP endpoint answers from the start: `/readyz` names the step start-up is in
/// ("connecting to NATS", ...) until the connections exist.
pub async fn run_with_narrator(
    config: CoordinatorConfig,
    narrator: Arc<dyn Narrator>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    // The guard stops the HTTP endpoint and the background tasks however this returns.
    let Started {
        health,
        metrics,
        stop: stop_background,
        guard: _stop_on_exit,
    } = start_process("toolfleet-coordinator", config.http_addr)
        .await
        .map_err(CoordinatorError::Http)?;
    let names = config.names();
    let connecting = connect_nats(
        &config.nats_url,
        &config.nats_credentials,
        "toolfleet-coordinator".to_string(),
        metrics.clone(),
        &health,
        &shutdown,
    );
    let Some(nats) = connecting.await? else {
        return Ok(());
    };
    health.set_phase("creating streams");
    let js = config.nats_credentials.jetstream(nats.clone());
    let streams = ensure_streams(&js, &names).await?;
    let mut consumers = Vec::with_capacity(streams.results.len());
    for results_stream in &streams.results {
        let consumer = results::results_consumer(results_stream, &names.results_consumer())
            .await
            .map_err(CoordinatorError::Consumer)?;
        consumers.push(consumer);
    }
    let Some(mut redis) = connect_redis(&config, &health, &shutdown).await? else {
        return Ok(());
    };
    let registry = Registry::default();
    registry.refresh(&mut redis, &names).await?;

    let replica = Arc::new(Replica {
        join: JoinStore::new(redis.clone(), names.clone())
            .with_deadline_buckets(config.deadline_buckets),
        config: config.clone(),
        names: names.clone(),
        nats: nats.clone(),
        failover: toolfleet_common::failover::Failover::for_urls(&nats, &config.nats_url),
        js,
        registry,
        narrator,
        metrics,
        tasks: TaskTracker::new(),
        turns: OwnedTurns::default(),
        health: health.clone(),
        consumers: Default::default(),
        memory: Arc::new(crate::memory::StoreMemory::new(
            config.redis_shed_percent,
            config.redis_trim_percent,
        )),
        lanes: crate::sharing::Lanes::new(crate::lanes::LaneStore::new(
            redis.clone(),
            names.clone(),
        )),
    });
    let background = TaskTracker::new();
    spawn_background(
        &replica,
        &background,
        &stop_background,
        consumers,
        redis.clone(),
    )
    .await?;
    health.set_readiness(toolfleet_common::ready::readiness(
        nats.clone(),
        replica.js.clone(),
        redis,
        toolfleet_common::ready::Needs {
            streams: (0..names.partitions())
                .map(|k| names.jobs_stream_in(k))
                .collect(),
            consumers: (0..names.partitions())
                .map(|k| (names.results_stream_in(k), names.results_consumer()))
                .collect(),
        },
    ));

    take_turns_on_runtime(&replica, shutdown).await?;
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

/// A Redis connection for the join (one server or a cluster, `redis_client.rs`),
/// retried until Redis answers (readiness names the step and the last failure); `None`
/// when `shutdown` came first.
async fn connect_redis(
    config: &CoordinatorConfig,
    health: &Health,
    shutdown: &CancellationToken,
) -> Result<Option<RedisConnection>, redis::RedisError> {
    // A script that ran but whose reply was slow must not be reported as failed, so the
    // response timeout is generous.
    let options = RedisOptions {
        response_timeout: Some(REDIS_RESPONSE_TIMEOUT),
        tls: config.redis_tls.clone(),
    };
    let connecting =
        toolfleet_common::health::connect_redis(&config.redis_url, options, health, shutdown);
    Ok(connecting.await?)
}

/// Starts the supervised tasks that run beside the turns until `stop`: registry
/// refresh, progress relay, catalog, deadline clock and sweeper, results consumer, topology
/// upkeep and gauge sampling. One that dies makes the replica not live.
async fn spawn_background(
    replica: &Arc<Replica>,
    background: &TaskTracker,
    stop: &CancellationToken,
    results: Vec<jetstream::consumer::PullConsumer>,
    redis: RedisConnection,
) -> Result<(), CoordinatorError> {
    let (nats, names, health) = (&replica.nats, &replica.names, &replica.health);
    let changes = nats.subscribe(names.registry_changed()).await?;
    let announced = nats.subscribe(names.registry_changed_any()).await?;
    let sampler = crate::memory::Sampler {
        memory: Arc::clone(&replica.memory),
        join: replica.join.clone(),
        metrics: replica.metrics.clone(),
        retention: replica.config.retention,
        buckets: replica.config.deadline_buckets,
    };
    let memory = crate::memory::sample(sampler, redis.clone(), stop.clone());
    health.supervise(background, "redis_memory", stop, memory);
    health.supervise(
        background,
        "registry_refresh",
        stop,
        refresh_registry(
            Arc::clone(replica),
            (changes, announced),
            redis,
            stop.clone(),
        ),
    );
    let progress_sub = nats.subscribe(names.progress_wildcard()).await?;
    let ended_sub = nats.subscribe(names.ended_wildcard()).await?;
    let relay = progress::relay(Arc::clone(replica), progress_sub, ended_sub, stop.clone());
    health.supervise(background, "progress_relay", stop, relay);
    // Identified frontends (`<p>.catalog.<user>`) and unidentified ones.
    let catalog_sub = nats
        .queue_subscribe(names.catalog(), COORDINATOR_QUEUE_GROUP.to_string())
        .await?;
    let catalog = catalog::serve(Arc::clone(replica), catalog_sub, stop.clone());
    health.supervise(background, "catalog", stop, catalog);
    let identified_sub = nats
        .queue_subscribe(names.catalog_any(), COORDINATOR_QUEUE_GROUP.to_string())
        .await?;
    let identified = catalog::serve(Arc::clone(replica), identified_sub, stop.clone());
    health.supervise(background, "catalog_identified", stop, identified);
    let clock = deadline::clock(Arc::clone(replica), stop.clone());
    health.supervise(background, "deadline_clock", stop, clock);
    let sweep = deadline::sweep(Arc::clone(replica), stop.clone());
    health.supervise(background, "deadline_sweeper", stop, sweep);
    let consume = results::consume_all(
        Arc::clone(replica),
        results,
        replica.config.result_concurrency,
        stop.clone(),
    );
    health.supervise(background, "results_consumer", stop, consume);
    let period = replica.config.topology_check;
    let watch = toolfleet_common::topology::watch(
        replica.js.clone(),
        upkeep::needed(replica),
        period,
        replica.metrics.clone(),
        stop.clone(),
    );
    health.supervise(background, "topology", stop, watch);
    let sample = upkeep::sample(Arc::clone(replica), period, stop.clone());
    health.supervise(background, "gauges", stop, sample);
    Ok(())
}

/// The shortest time between two registry refreshes of a replica: notices that arrive
/// closer together are answered by one refresh.
const MIN_REFRESH_GAP: Duration = Duration::from_millis(100);

/// The most names of tools not yet known one refresh looks up; the others are
/// announced again at their workers' next heartbeat.
const MAX_ANNOUNCED_PER_REFRESH: usize = 256;

/// Notes the tool `message` announces when the registry does not know it yet (up to
/// [`MAX_ANNOUNCED_PER_REFRESH`]); whether it did.
fn note_unknown(
    replica: &Replica,
    message: &async_nats::Message,
    unknown: &mut BTreeSet<String>,
) -> bool {
    let Some(tool) = replica.names.registry_changed_tool(&message.subject) else {
        return false;
    };
    if unknown.len() >= MAX_ANNOUNCED_PER_REFRESH || replica.registry.snapshot().knows(tool) {
        return false;
    }
    unknown.insert(tool.to_string())
}

/// Re-reads the registry periodically and on every announced change, until `stop`.
async fn refresh_registry(
    replica: Arc<Replica>,
    (mut changes, mut announced): (async_nats::Subscriber, async_nats::Subscriber),
    mut redis: RedisConnection,
    stop: CancellationToken,
) {
    let period = replica.config.registry_refresh;
    crate::consumers::ensure_changed(&replica).await;
    let mut unknown: BTreeSet<String> = BTreeSet::new();
    let mut last = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep_until(last + period) => {}
            Some(_) = changes.next() => {}
            Some(message) = announced.next() => {
                // A tool already known costs a lookup; only a new name leads to Redis.
                if !note_unknown(&replica, &message, &mut unknown) {
                    continue;
                }
            }
        }
        // However often workers announce, a replica refreshes at most once per gap; the
        // tools announced meanwhile (a worker announces all of its own at once) are
        // looked up together.
        let next = last + MIN_REFRESH_GAP;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(next) => break,
                Some(message) = announced.next() => {
                    note_unknown(&replica, &message, &mut unknown);
                }
            }
        }
        while let Some(Some(message)) = announced.next().now_or_never() {
            note_unknown(&replica, &message, &mut unknown);
        }
        last = tokio::time::Instant::now();
        if !unknown.is_empty() {
            let names: Vec<String> = std::mem::take(&mut unknown).into_iter().collect();
            let admitted = replica
                .registry
                .admit_announced(&mut redis, &replica.names, &names)
                .await;
            if let Err(error) = admitted {
                replica.metrics.redis_error("registry_refresh");
                warn!(%error, "announced tools not added");
            }
        }
        if let Err(error) = replica.registry.refresh(&mut redis, &replica.names).await {
            replica.metrics.redis_error("registry_refresh");
            warn!(%error, "registry refresh failed");
        }
        crate::consumers::ensure_changed(&replica).await;
    }
}

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

/// [`take_turns`] in a task of its own, so on a runtime thread even when `run` is what
/// `main` blocks on: each request then wakes a runtime thread, not the main thread and
/// then a runtime thread for its handler.
async fn take_turns_on_runtime(
    replica: &Arc<Replica>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    let intake = {
        let replica = Arc::clone(replica);
        tokio::spawn(async move { take_turns(&replica, shutdown).await })
    };
    match intake.await {
        Ok(taken) => taken,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        // Cancelled: the runtime is shutting down; drain what is left.
        Err(_) => Ok(()),
    }
}

/// Takes turn requests from the queue group until `shutdown`, then the ones already
/// delivered to this replica (new ones go to the other replicas).
async fn take_turns(
    replica: &Arc<Replica>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    // Each handler is boxed: its task then moves a pointer, not the handler's whole
    // state machine, each time it is spawned, polled to its end and dropped.
    let take = |message, permit| {
        let replica = Arc::clone(replica);
        replica.tasks.clone().spawn(Box::pin(async move {
            intake::handle_turn_message(replica, message).await;
            drop(permit);
        }));
    };
    // Requests being taken in at once (`TOOLFLEET_INTAKE_CONCURRENCY`): a burst waits in
    // the subscription, not as that many decoded requests and plans in memory together.
    let intake_slots = Arc::new(Semaphore::new(replica.config.intake_concurrency));
    let slot = || async { Arc::clone(&intake_slots).acquire_owned().await.ok() };
    let attach = |message| {
        let replica = Arc::clone(replica);
        replica
            .tasks
            .clone()
            .spawn(Box::pin(attach::handle_attach_message(replica, message)));
    };
    let cancel = |message| {
        let replica = Arc::clone(replica);
        replica
            .tasks
            .clone()
            .spawn(Box::pin(cancel::handle_cancel_message(replica, message)));
    };
    let group = || COORDINATOR_QUEUE_GROUP.to_string();
    let names = &replica.names;
    // Identified frontends (`<p>.turns.submit.<user>`) and unidentified ones.
    let mut identified = replica
        .nats
        .queue_subscribe(names.turn_submit_any(), group())
        .await?;
    let mut unidentified = replica
        .nats
        .queue_subscribe(names.turn_submit(), group())
        .await?;
    // Attach requests: a frontend following a turn it submitted.
    let mut attaching = replica
        .nats
        .queue_subscribe(names.turn_attach_any(), group())
        .await?;
    let mut attaching_unidentified = replica
        .nats
        .queue_subscribe(names.turn_attach(), group())
        .await?;
    // Cancel requests: a frontend stopping a turn it submitted.
    let mut cancelling = replica
        .nats
        .queue_subscribe(names.turn_cancel_any(), group())
        .await?;
    let mut cancelling_unidentified = replica
        .nats
        .queue_subscribe(names.turn_cancel(), group())
        .await?;
    info!(prefix = %names.prefix(), "coordinator taking turns");
    {
        let turns = futures::stream::select(&mut identified, &mut unidentified);
        let attaches = futures::stream::select(&mut attaching, &mut attaching_unidentified);
        let cancels = futures::stream::select(&mut cancelling, &mut cancelling_unidentified);
        let mut all = futures::stream::select(
            futures::stream::select(turns.map(Incoming::Turn), attaches.map(Incoming::Attach)),
            cancels.map(Incoming::Cancel),
        );
        while let Some(message) = next_message(&mut all, &shutdown).await {
            match message {
                Incoming::Turn(message) => take(message, slot().await),
                Incoming::Attach(message) => attach(message),
                Incoming::Cancel(message) => cancel(message),
            }
        }
    }
    replica.health.start_draining();
    info!("coordinator stopping: no new turns");
    let _ = identified.drain().await;
    let _ = unidentified.drain().await;
    let _ = attaching.unsubscribe().await;
    let _ = attaching_unidentified.unsubscribe().await;
    let _ = cancelling.unsubscribe().await;
    let _ = cancelling_unidentified.unsubscribe().await;
    let mut turns = futures::stream::select(identified, unidentified);
    while let Some(message) = turns.next().await {
        take(message, slot().await);
    }
    Ok(())
}

/// A message on one of the subjects frontends publish to.
enum Incoming {
    Turn(async_nats::Message),
    Attach(async_nats::Message),
    Cancel(async_nats::Message),
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
