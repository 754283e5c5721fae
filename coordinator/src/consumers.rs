//! Every tool's durable consumer on the jobs stream of each stream partition, created and kept in line by the
//! coordinators from the registry: a worker never needs to create or change one (the
//! deploy/ NATS users let workers only bind, pull and ack), so no worker can stall a tool
//! by giving its consumer a long ack wait or a single delivery.
//!
//! Owns [`ensure`]: create a tool's consumer when missing, and put back its retry
//! settings (`max_deliver`, `backoff`, `max_ack_pending`) when they differ from what the
//! definition asks; an existing consumer keeps its ack wait (a worker in `create` mode
//! chooses its own). Called for each new or changed definition after a registry refresh,
//! and for every tool each topology period. Never pulls a job.

use async_nats::jetstream::consumer::{self, IntoConsumerConfig};
use async_nats::jetstream::context::{ConsumerInfoError, GetStreamError};
use async_nats::jetstream::stream::ConsumerError;
use toolfleet_common::streams::tool_consumer_config;
use toolfleet_common::topology::consumer_not_found;
use toolfleet_common::ToolDefinition;
use tracing::{info, warn};

use crate::replica::Replica;

/// Why a tool's consumer was not ensured.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EnsureConsumerError {
    /// The tool's jobs stream could not be reached.
    #[error(transparent)]
    Stream(#[from] GetStreamError),
    /// The consumer's state could not be read.
    #[error(transparent)]
    Info(#[from] ConsumerInfoError),
    /// A consumer of the tool's name serves another subject: left alone, never changed.
    #[error("consumer {durable} serves {serves}, not tool {tool}")]
    OtherTool {
        /// The consumer.
        durable: String,
        /// The subject it serves.
        serves: String,
        /// The tool it was ensured for.
        tool: String,
    },
    /// Creating or updating the consumer failed.
    #[error("creating consumer {name}: {source}")]
    Create {
        /// The consumer.
        name: String,
        /// Why.
        source: ConsumerError,
    },
}

/// Ensures the consumer of every tool whose definition is new or changed since this
/// replica last ensured it.
pub(crate) async fn ensure_changed(replica: &Replica) {
    let snapshot = replica.registry.snapshot();
    for tool in snapshot.sorted() {
        let definition = &tool.definition;
        let known = replica
            .consumers
            .0
            .lock()
            .map(|e| e.get(&definition.name) == Some(definition))
            .unwrap_or(false);
        if known {
            continue;
        }
        if let Err(error) = ensure(replica, definition).await {
            warn!(tool = %definition.name, %error, "tool consumer not ensured");
        }
    }
}

/// Creates `definition`'s consumer in every stream partition when missing or puts back
/// its retry settings; each partition's consumer state as the server has it afterwards.
pub(crate) async fn ensure(
    replica: &Replica,
    definition: &ToolDefinition,
) -> Result<Vec<consumer::Info>, EnsureConsumerError> {
    let mut infos = Vec::with_capacity(replica.names.partitions() as usize);
    for partition in 0..replica.names.partitions() {
        infos.push(ensure_in(replica, partition, definition).await?);
    }
    if let Ok(mut ensured) = replica.consumers.0.lock() {
        ensured.insert(definition.name.clone(), definition.clone());
    }
    Ok(infos)
}

/// [`ensure`] in stream partition `partition`.
async fn ensure_in(
    replica: &Replica,
    partition: u32,
    definition: &ToolDefinition,
) -> Result<consumer::Info, EnsureConsumerError> {
    let names = &replica.names;
    let wanted = tool_consumer_config(names, partition, definition, replica.config.tool_ack_wait);
    let durable = names.tool_consumer(&definition.name);
    // Run every topology period for every tool and partition: no STREAM.INFO request.
    let stream = replica
        .js
        .get_stream_no_info(names.jobs_stream_in(partition))
        .await?;
    let info = match stream.consumer_info(&durable).await {
        Ok(info) => {
            let current = &info.config;
            if current.filter_subject != wanted.filter_subject {
                return Err(EnsureConsumerError::OtherTool {
                    durable,
                    serves: current.filter_subject.clone(),
                    tool: definition.name.clone(),
                });
            }
            let differs = current.max_deliver != wanted.max_deliver
                || current.backoff != wanted.backoff
                || current.max_ack_pending != wanted.max_ack_pending;
            if differs {
                warn!(
                    consumer = %durable,
                    max_deliver = current.max_deliver,
                    max_ack_pending = current.max_ack_pending,
                    "the consumer's settings differ from the tool's definition; putting them back"
                );
                let update = consumer::pull::Config {
                    ack_wait: current.ack_wait,
                    ..wanted
                };
                replica.metrics.topology_recreated("consumer_settings");
                create(&stream, update).await?
            } else {
                info.clone()
            }
        }
        Err(error) if consumer_not_found(error.kind()) => {
            info!(consumer = %durable, tool = %definition.name, "creating the tool's consumer");
            create(&stream, wanted).await?
        }
        Err(error) => return Err(error.into()),
    };
    Ok(info)
}

async fn create(
    stream: &async_nats::jetstream::stream::Stream<()>,
    config: consumer::pull::Config,
) -> Result<consumer::Info, EnsureConsumerError> {
    let name = config.durable_name.clone().unwrap_or_default();
    let config = config.into_consumer_config();
    stream
        .create_consumer(config)
        .await
        .map(|c: consumer::Consumer<consumer::Config>| c.cached_info().clone())
        .map_err(|source| EnsureConsumerError::Create { name, source })
}
