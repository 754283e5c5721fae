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

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;
use toolfleet_common::streams::{jobs_config, results_config};
use toolfleet_common::topology::Needed;
use toolfleet_common::ToolDefinition;
use tracing::debug;

use crate::results::results_consumer_config;
use crate::startup::Replica;

/// The JetStream objects the coordinator recreates when they disappear, streams first.
pub(crate) fn needed(replica: &Replica) -> Vec<Needed> {
    let names = &replica.names;
    vec![
        Needed::Stream(jobs_config(names)),
        Needed::Stream(results_config(names)),
        Needed::Consumer(
            names.results_stream(),
            results_consumer_config(&names.results_consumer()),
        ),
    ]
}

/// Every `period` until `stop`: the turns this replica owns and, for each tool in the
/// registry, its consumer's pending and ack-pending jobs and the age of its oldest job.
pub(crate) async fn sample(replica: Arc<Replica>, period: Duration, stop: CancellationToken) {
    loop {
        replica.metrics.turns_in_flight(replica.turns.count());
        if let Ok(stream) = replica.js.get_stream(replica.names.jobs_stream()).await {
            let snapshot = replica.registry.snapshot();
            for tool in snapshot.sorted() {
                if let Err(error) = sample_tool(&replica, &stream, &tool.definition).await {
                    debug!(tool = %tool.definition.name, %error, "queue lag not sampled");
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
    }
}

/// Ensures `definition`'s consumer (created when missing, retry settings put back) and
/// samples its queue lag.
async fn sample_tool(
    replica: &Replica,
    stream: &jetstream::stream::Stream,
    definition: &ToolDefinition,
) -> Result<(), String> {
    let tool = definition.name.as_str();
    let info = crate::consumers::ensure(replica, definition).await?;
    let now_s = i64::try_from(unix_ms() / 1000).unwrap_or(i64::MAX);
    let waiting = info.num_pending + u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX);
    let oldest_age = match waiting {
        0 => 0,
        _ => stream
            .get_first_raw_message_by_subject(replica.names.job_subject(tool), 0)
            .await
            .map(|m| (now_s - m.time.unix_timestamp()).max(0))
            .unwrap_or(0),
    };
    replica.metrics.queue_lag(
        tool,
        info.num_pending,
        u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX),
        oldest_age,
    );
    Ok(())
}
