//! A tool's durable JetStream consumer: its configuration derived from the tool's
//! definition, getting or creating it at start-up, and keeping its delivery settings
//! (`max_deliver`, `ack_wait`, `backoff`) in line with the definition.
//!
//! A consumer outlives the workers bound to it, so a changed retry policy or ack wait
//! would otherwise leave it with stale values while the runner decides by the new ones
//! (a retry NAKed past `max_deliver` is never redelivered). Start-up therefore updates a
//! drifted consumer, or fails naming both values; the runner reads the values the
//! consumer is bound with ([`Bound`]), never the definition's. This module never pulls
//! jobs nor decides retries.

use std::fmt::Write as _;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{self, IntoConsumerConfig};
use toolfleet_common::Names;
use tracing::warn;

use crate::tool::Tool;
use crate::WorkerError;

/// The delivery settings of the consumer a tool is served from, as the server has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bound {
    /// Deliveries of one job, the first included.
    pub max_deliver: u32,
    /// How long a delivery may stay unacknowledged before it is redelivered.
    pub ack_wait: Duration,
}

impl Bound {
    /// The settings `tool`'s consumer is created with.
    pub fn wanted(names: &Names, tool: &Tool, ack_wait: Duration) -> Self {
        Self::of(&config(names, 0, tool, ack_wait).into_consumer_config())
    }

    /// The settings of a consumer configuration.
    fn of(config: &consumer::Config) -> Self {
        Self {
            // Zero or less: no limit.
            max_deliver: match u32::try_from(config.max_deliver) {
                Ok(0) | Err(_) => u32::MAX,
                Ok(n) => n,
            },
            ack_wait: config.ack_wait,
        }
    }
}

/// The durable pull consumer of `tool` in stream partition `partition` (also used to
/// recreate it when it disappears).
pub(crate) fn config(
    names: &Names,
    partition: u32,
    tool: &Tool,
    ack_wait: Duration,
) -> consumer::pull::Config {
    toolfleet_common::streams::tool_consumer_config(names, partition, tool.definition(), ack_wait)
}

/// Gets or creates `tool`'s consumer on `jobs_stream` (stream partition `partition`'s),
/// checks it serves that tool and brings its delivery
/// settings in line with the definition; the consumer and the settings it is bound with.
pub(crate) async fn bind(
    jobs_stream: &jetstream::stream::Stream,
    names: &Names,
    partition: u32,
    tool: &Tool,
    ack_wait: Duration,
) -> Result<(consumer::PullConsumer, Bound), WorkerError> {
    let create = config(names, partition, tool, ack_wait);
    let wanted = create.clone().into_consumer_config();
    let durable = names.tool_consumer(&tool.definition().name);
    let failed = |message: String| WorkerError::Consumer {
        consumer: durable.clone(),
        message,
    };
    let consumer: consumer::PullConsumer = jobs_stream
        .get_or_create_consumer(&durable, create.clone())
        .await
        .map_err(|e| failed(e.to_string()))?;
    let filter = &consumer.cached_info().config.filter_subject;
    if *filter != wanted.filter_subject {
        return Err(failed(format!(
            "the consumer serves {filter}, not tool {}; rename one of the two tools",
            tool.definition().name
        )));
    }
    let Some(before) = drift(&consumer.cached_info().config, &wanted) else {
        return Ok((consumer, Bound::of(&wanted)));
    };
    warn!(consumer = %durable, differences = %before, "the consumer's delivery settings differ from the tool's definition; updating the consumer");
    // A create of an existing durable consumer updates its editable settings.
    let updated: consumer::PullConsumer = jobs_stream
        .create_consumer(create)
        .await
        .map_err(|e| failed(format!("{before}; updating it failed: {e}")))?;
    if let Some(after) = drift(&updated.cached_info().config, &wanted) {
        return Err(failed(format!("{after} after an update")));
    }
    let bound = Bound::of(&updated.cached_info().config);
    Ok((updated, bound))
}

/// How long a worker in `bind` mode waits for the coordinator to create a consumer.
pub(crate) const BIND_WAIT: Duration = Duration::from_secs(30);

/// Waits until `tool`'s consumer exists with its definition's filter and retry settings
/// (the coordinator creates it from the registry), then binds to it without ever sending
/// a create: the consumer and the settings it is bound with (its own ack wait).
pub(crate) async fn wait_and_bind(
    jobs_stream: &jetstream::stream::Stream,
    names: &Names,
    partition: u32,
    tool: &Tool,
    nats: &async_nats::Client,
) -> Result<(consumer::PullConsumer, Bound), WorkerError> {
    // The ack wait is the coordinator's to choose; compared without it.
    let wanted = config(names, partition, tool, Duration::ZERO).into_consumer_config();
    let durable = names.tool_consumer(&tool.definition().name);
    let started = tokio::time::Instant::now();
    let mut last = String::from("it does not exist");
    let mut polls = 0u32;
    while started.elapsed() < BIND_WAIT {
        // Announced again every second: a coordinator that started after the first
        // announcement learns the tool from a later one.
        if polls.is_multiple_of(5) {
            let tool = &tool.definition().name;
            let _ = nats
                .publish(names.registry_changed_for(tool), bytes::Bytes::new())
                .await;
            let _ = nats
                .publish(names.registry_changed(), bytes::Bytes::new())
                .await;
        }
        polls += 1;
        match jobs_stream
            .get_consumer::<consumer::pull::Config>(&durable)
            .await
        {
            Ok(consumer) => {
                let current = &consumer.cached_info().config;
                let mut comparable = wanted.clone();
                comparable.ack_wait = current.ack_wait;
                match (current.filter_subject == wanted.filter_subject)
                    .then(|| drift(current, &comparable))
                {
                    Some(None) => {
                        let bound = Bound::of(current);
                        return Ok((consumer, bound));
                    }
                    Some(Some(differences)) => last = differences,
                    None => last = format!("it serves {}", current.filter_subject),
                }
            }
            Err(error) => last = error.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(WorkerError::Consumer {
        consumer: durable,
        message: format!(
            "no consumer with the definition's settings after {}s (TOOLFLEET_WORKER_CONSUMERS=bind: a coordinator creates it once it has read the definition; is one running?): {last}",
            BIND_WAIT.as_secs()
        ),
    })
}

/// How `current`'s delivery settings differ from `wanted`'s, naming both values; `None`
/// when they agree.
fn drift(current: &consumer::Config, wanted: &consumer::Config) -> Option<String> {
    let mut out = String::new();
    let mut differs = |what: &str, has: String, wants: String| {
        if has != wants {
            let sep = if out.is_empty() { "" } else { ", " };
            let _ = write!(
                out,
                "{sep}{what} is {has} on the consumer, {wants} in the tool's definition"
            );
        }
    };
    differs(
        "max_deliver",
        current.max_deliver.to_string(),
        wanted.max_deliver.to_string(),
    );
    differs(
        "ack_wait",
        format!("{:?}", current.ack_wait),
        format!("{:?}", wanted.ack_wait),
    );
    differs(
        "backoff",
        format!("{:?}", current.backoff),
        format!("{:?}", wanted.backoff),
    );
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(max_deliver: i64, ack_wait_ms: u64) -> consumer::Config {
        consumer::Config {
            max_deliver,
            ack_wait: Duration::from_millis(ack_wait_ms),
            ..Default::default()
        }
    }

    #[test]
    fn drift_names_both_values_of_every_difference() {
        assert_eq!(drift(&with(3, 5000), &with(3, 5000)), None);
        let text = drift(&with(2, 5000), &with(3, 1000)).expect("drift");
        assert!(text.contains("max_deliver is 2 on the consumer, 3 in the tool's definition"));
        assert!(text.contains("ack_wait is 5s on the consumer, 1s in the tool's definition"));
        let mut backoff = with(3, 5000);
        backoff.backoff = vec![Duration::from_secs(1)];
        assert!(drift(&backoff, &with(3, 5000))
            .expect("drift")
            .starts_with("backoff"));
    }

    #[test]
    fn bound_reads_the_consumer_settings() {
        let bound = Bound::of(&with(4, 2500));
        assert_eq!(bound.max_deliver, 4);
        assert_eq!(bound.ack_wait, Duration::from_millis(2500));
        assert_eq!(Bound::of(&with(-1, 1)).max_deliver, u32::MAX);
    }
}
