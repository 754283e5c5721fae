//! What a coordinator keeps in place and measures beside the turns: the JetStream
//! topology it owns (both streams and the shared results consumer, recreated when NATS
//! lost them) and the gauges sampled every period (each known tool's queue lag from its
//! consumer, the turns this replica owns).
//!
//! Owns the list of JetStream objects the coordinator recreates and the sampling loop,
//! which also ensures every registered tool's consumer each period (`consumers.rs`).
//! Never handles a turn or a result.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;
use toolfleet_common::metrics::QueueLag;
use toolfleet_common::streams::{jobs_config, results_config};
use toolfleet_common::topology::Needed;
use toolfleet_common::{Names, ToolDefinition};
use tracing::debug;

use crate::consumers::EnsureConsumerError;
use crate::replica::Replica;
use crate::results::results_consumer_config;

/// The JetStream objects the coordinator recreates when they disappear, streams first.
pub(crate) fn needed(names: &Names) -> Vec<Needed> {
    let partitions = 0..names.partitions();
    let streams = partitions.clone().flat_map(|k| {
        [
            Needed::Stream(jobs_config(names, k)),
            Needed::Stream(results_config(names, k)),
        ]
    });
    let consumers = partitions.map(|k| {
        Needed::Consumer(
            names.results_stream_in(k),
            results_consumer_config(&names.results_consumer()),
        )
    });
    streams.chain(consumers).collect()
}

/// Every `period` until `stop`: the turns this replica owns and, for each tool in the
/// registry, its consumer's pending and ack-pending jobs and the age of its oldest job;
/// then every tool's lane's upkeep and the tenants' gauges (`sharing::tick`).
pub(crate) async fn sample(replica: Arc<Replica>, period: Duration, stop: CancellationToken) {
    loop {
        replica.metrics.turns_in_flight(replica.turns.count());
        let snapshot = replica.registry.snapshot();
        let mut lags = Vec::new();
        for tool in snapshot.sorted() {
            match sample_tool(&replica, &tool.definition).await {
                Ok(lag) => lags.push(lag),
                Err(error) => debug!(tool = %tool.definition.name, %error, "queue lag not sampled"),
            }
        }
        // Tools that left the registry leave the gauges.
        replica.metrics.queue_lags(lags);
        if let Some(results) = results_pending(&replica).await {
            replica.metrics.results_pending(results);
        }
        let tools: Vec<String> = snapshot
            .sorted()
            .iter()
            .map(|t| t.definition.name.clone())
            .collect();
        let unpublished = crate::sharing::tick(replica.sharing(), &tools).await;
        crate::results::record_unpublished(&replica, unpublished).await;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
    }
}

/// Ensures `definition`'s consumer in every stream partition (created when missing,
/// retry settings put back) and samples its queue lag, summed over the partitions (the
/// oldest job's age: the oldest of any).
async fn sample_tool(
    replica: &Replica,
    definition: &ToolDefinition,
) -> Result<QueueLag, EnsureConsumerError> {
    let tool = definition.name.as_str();
    let infos = crate::consumers::ensure(replica, definition).await?;
    let now_s = i64::try_from(unix_ms() / 1000).unwrap_or(i64::MAX);
    let (mut pending, mut ack_pending, mut oldest_age) = (0u64, 0u64, 0i64);
    for (partition, info) in (0..).zip(&infos) {
        let unacked = u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX);
        pending = pending.saturating_add(info.num_pending);
        ack_pending = ack_pending.saturating_add(unacked);
        if info.num_pending + unacked == 0 {
            continue;
        }
        let Ok(stream) = replica
            .js
            .get_stream_no_info(replica.names.jobs_stream_in(partition))
            .await
        else {
            continue;
        };
        let age = stream
            .get_first_raw_message_by_subject(replica.names.job_subject_in(partition, tool), 0)
            .await
            .map(|m| (now_s - m.time.unix_timestamp()).max(0))
            .unwrap_or(0);
        oldest_age = oldest_age.max(age);
    }
    Ok(QueueLag {
        tool: tool.to_string(),
        pending,
        ack_pending,
        oldest_age_s: oldest_age,
    })
}

/// Results not yet recorded: pending and delivered-not-acked on the shared results
/// consumer, summed over the partitions; `None` when NATS did not answer.
async fn results_pending(replica: &Replica) -> Option<u64> {
    let names = &replica.names;
    let mut results = 0u64;
    for partition in 0..names.partitions() {
        let stream = replica
            .js
            .get_stream_no_info(names.results_stream_in(partition))
            .await
            .ok()?;
        let info = stream.consumer_info(names.results_consumer()).await.ok()?;
        let unacked = u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX);
        results = results
            .saturating_add(info.num_pending)
            .saturating_add(unacked);
    }
    Some(results)
}
