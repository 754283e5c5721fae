//! Keeping the JetStream topology in place: streams and durable consumers are looked up
//! and, when missing (NATS restarted with an empty store, an operator deleted one),
//! created again with their owner's configuration.
//!
//! Owns the get-or-create of one stream or consumer with a report of whether it had to
//! be created, and [`watch`], the periodic check that recreates what disappeared with a
//! WARN and a `toolfleet.topology.recreated` count each time. Never decides a stream's
//! or consumer's configuration (`streams` and each consumer's owner do) and never
//! consumes messages.
//!
//! Who recreates what: the coordinator recreates both streams and the shared results
//! consumer; each worker recreates its own tool consumers once the jobs stream exists
//! again (its NATS user may create its consumers but only look streams up).

use std::time::Duration;

use async_nats::jetstream::{self, consumer, context::GetStreamErrorKind, stream};
use async_nats::jetstream::{context::ConsumerInfoErrorKind, ErrorCode};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::metrics::FleetMetrics;

/// A JetStream object a process keeps in place.
#[derive(Debug, Clone)]
pub enum Needed {
    /// A stream this process may create.
    Stream(stream::Config),
    /// A pull consumer on the stream named first.
    Consumer(String, consumer::pull::Config),
}

impl Needed {
    fn kind(&self) -> &'static str {
        match self {
            Needed::Stream(_) => "stream",
            Needed::Consumer(..) => "consumer",
        }
    }

    fn name(&self) -> String {
        match self {
            Needed::Stream(c) => c.name.clone(),
            Needed::Consumer(_, c) => c.durable_name.clone().unwrap_or_default(),
        }
    }
}

/// What [`ensure`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// The object existed.
    Existed,
    /// The object was missing and has been created.
    Created,
    /// The consumer's stream is missing and this process does not create it.
    StreamMissing,
}

/// Looks `needed` up and creates it when missing; `Err` with the server's complaint on
/// any other failure.
pub async fn ensure(js: &jetstream::Context, needed: &Needed) -> Result<Presence, String> {
    match needed {
        Needed::Stream(config) => match js.get_stream(&config.name).await {
            Ok(_) => Ok(Presence::Existed),
            Err(e) if stream_not_found(e.kind()) => js
                .get_or_create_stream(config.clone())
                .await
                .map(|_| Presence::Created)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        },
        Needed::Consumer(stream_name, config) => {
            let stream = match js.get_stream(stream_name).await {
                Ok(s) => s,
                Err(e) if stream_not_found(e.kind()) => return Ok(Presence::StreamMissing),
                Err(e) => return Err(e.to_string()),
            };
            let name = config.durable_name.clone().unwrap_or_default();
            match stream.consumer_info(&name).await {
                Ok(_) => Ok(Presence::Existed),
                Err(e) if consumer_not_found(e.kind()) => stream
                    .get_or_create_consumer(&name, config.clone())
                    .await
                    .map(|_: consumer::PullConsumer| Presence::Created)
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

fn stream_not_found(kind: GetStreamErrorKind) -> bool {
    matches!(kind, GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Whether a consumer lookup failed because the consumer does not exist.
pub fn consumer_not_found(kind: ConsumerInfoErrorKind) -> bool {
    match kind {
        ConsumerInfoErrorKind::NotFound => true,
        ConsumerInfoErrorKind::JetStream(e) => e.error_code() == ErrorCode::CONSUMER_NOT_FOUND,
        _ => false,
    }
}

/// Every `period` until `stop`, ensures each of `needed` (in order, streams first) and
/// recreates what disappeared, with a WARN and a count each time (each watched kind's
/// count exists at 0 from the start).
pub async fn watch(
    js: jetstream::Context,
    needed: Vec<Needed>,
    period: Duration,
    metrics: FleetMetrics,
    stop: CancellationToken,
) {
    // Which objects' last check failed: a failure is a WARN the first time, then DEBUG
    // until the object is found again.
    let mut failing = vec![false; needed.len()];
    for item in &needed {
        metrics.topology_watched(item.kind());
    }
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        for (item, failing) in needed.iter().zip(failing.iter_mut()) {
            let (kind, name) = (item.kind(), item.name());
            match ensure(&js, item).await {
                Ok(Presence::Created) => {
                    metrics.topology_recreated(kind);
                    warn!(kind, %name, "JetStream object was missing; recreated it");
                    *failing = false;
                }
                Ok(Presence::Existed) => *failing = false,
                Ok(Presence::StreamMissing) => {
                    debug!(%name, "consumer's stream missing; waiting for the coordinator to recreate it");
                }
                Err(error) if !*failing => {
                    warn!(kind, %name, %error, "could not check or recreate a JetStream object");
                    *failing = true;
                }
                Err(error) => debug!(kind, %name, %error, "topology check failed"),
            }
        }
    }
}
