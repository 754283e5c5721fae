//! Starting and stopping a coordinator replica: connections, streams, the background
//! tasks, the turn subscription and the drain on shutdown.
//!
//! Owns building the [`Replica`] (`replica.rs`) every task of one coordinator shares,
//! the order in which a replica comes up and goes down (HTTP endpoint first, so `/readyz` names the
//! step start-up waits on; readiness 503 from the shutdown request on), and the
//! supervision of its background tasks (one that dies fails `/healthz`). Never handles a turn itself: the loop that takes
//! turn, attach and cancel requests in is `intake.rs`'s, each result goes, to `results.rs`, each progress notice to
//! `progress.rs`, each catalog request to `catalog.rs`, and the sweeper in `deadline.rs`
//! ends the turns whose owner is gone.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::health::{connect_nats, start_process, Health, Started};
use toolfleet_common::names::COORDINATOR_QUEUE_GROUP;
use toolfleet_common::redis_client::{RedisConnection, RedisOptions};
use toolfleet_common::streams::ensure_streams;
use toolfleet_common::Names;
use tracing::{info, warn};

use crate::narrate::{Narrator, TemplateNarrator};
use crate::registry::Registry;
use crate::replica::Replica;
use crate::store::redis::JoinStore;
use crate::turns::OwnedTurns;
use crate::{
    catalog, deadline, intake, progress, results, upkeep, CoordinatorConfig, CoordinatorError,
};

/// How long a Redis reply may take before the call counts as failed.
pub const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

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
        let consumer = results::results_consumer(results_stream, &names.results_consumer()).await?;
        consumers.push(consumer);
    }
    let Some(mut redis) = connect_redis(&config, &health, &shutdown).await? else {
        return Ok(());
    };
    let registry = Registry::default();
    for tool in registry.refresh(&mut redis, &names).await? {
        metrics.tool_known(&tool);
    }

    let join =
        JoinStore::new(redis.clone(), names.clone()).with_deadline_buckets(config.deadline_buckets);
    let replica = Arc::new(Replica {
        join: Arc::new(join.clone()),
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
        lanes: crate::lanes::Lanes::new(crate::lanes::LaneStore::new(redis.clone(), names.clone())),
    });
    let background = TaskTracker::new();
    let redis_for_background = (redis.clone(), join);
    spawn_background(
        &replica,
        &background,
        &stop_background,
        consumers,
        redis_for_background,
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

    intake::take_turns_on_runtime(&replica, shutdown).await?;
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
    (redis, join): (RedisConnection, JoinStore),
) -> Result<(), CoordinatorError> {
    let (nats, names, health) = (&replica.nats, &replica.names, &replica.health);
    let changes = nats.subscribe(names.registry_changed()).await?;
    let announced = nats.subscribe(names.registry_changed_any()).await?;
    let sampler = crate::memory::Sampler {
        memory: Arc::clone(&replica.memory),
        join,
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
        upkeep::needed(&replica.names),
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
    (names, registry): (&Names, &Registry),
    message: &async_nats::Message,
    unknown: &mut BTreeSet<String>,
) -> bool {
    let Some(tool) = names.registry_changed_tool(&message.subject) else {
        return false;
    };
    if unknown.len() >= MAX_ANNOUNCED_PER_REFRESH || registry.snapshot().knows(tool) {
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
    let known = (&replica.names, &replica.registry);
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
                if !note_unknown(known, &message, &mut unknown) {
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
                    note_unknown(known, &message, &mut unknown);
                }
            }
        }
        while let Some(Some(message)) = announced.next().now_or_never() {
            note_unknown(known, &message, &mut unknown);
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
        match replica.registry.refresh(&mut redis, &replica.names).await {
            // Each tool's failure series start at 0 once, when it is first seen.
            Ok(learned) => learned
                .iter()
                .for_each(|tool| replica.metrics.tool_known(tool)),
            Err(error) => {
                replica.metrics.redis_error("registry_refresh");
                warn!(%error, "registry refresh failed");
            }
        }
        crate::consumers::ensure_changed(&replica).await;
    }
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
