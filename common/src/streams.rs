//! Creating the JetStream streams toolfleet uses: a jobs and a results stream per
//! stream partition. Coordinators and workers both call [`ensure_streams`]; whichever
//! starts first creates them.
//!
//! Owns the streams' configuration (subjects, retention, duplicate window, limits) and
//! the tool consumers' configuration. Never creates consumers: the coordinator creates
//! its results consumer and every tool's consumer (a worker in `create` mode may create
//! its own); `topology` recreates what disappears.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::names::Names;

/// How long JetStream remembers a message id for de-duplication.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// How long an unconsumed job or result is kept.
pub const MAX_AGE: Duration = Duration::from_secs(3600);
/// Bytes each stream may hold; when full, new messages are refused (`DiscardPolicy::New`),
/// so one caller cannot fill the server's store and nothing already queued is dropped.
pub const MAX_BYTES: i64 = 256 * 1024 * 1024;
/// Largest message either stream stores (the deploy `max_payload`).
pub const MAX_MESSAGE_SIZE: i32 = 8 * 1024 * 1024;

/// Failure to create or look up a stream.
#[derive(Debug, thiserror::Error)]
#[error("stream {stream}: {source}")]
pub struct EnsureStreamsError {
    /// The stream's name.
    pub stream: String,
    /// The JetStream error.
    #[source]
    pub source: jetstream::context::CreateStreamError,
}

/// The jobs and results streams of every stream partition, indexed by partition.
#[derive(Debug)]
pub struct Streams {
    /// The jobs stream of each partition.
    pub jobs: Vec<stream::Stream>,
    /// The results stream of each partition.
    pub results: Vec<stream::Stream>,
}

/// Creates the jobs and results streams of each of `names`' stream partitions when
/// missing and returns them.
pub async fn ensure_streams(
    js: &jetstream::Context,
    names: &Names,
) -> Result<Streams, EnsureStreamsError> {
    let mut streams = Streams {
        jobs: Vec::new(),
        results: Vec::new(),
    };
    for partition in 0..names.partitions() {
        streams
            .jobs
            .push(ensure(js, jobs_config(names, partition)).await?);
        streams
            .results
            .push(ensure(js, results_config(names, partition)).await?);
    }
    Ok(streams)
}

/// The durable pull consumer of the tool `definition` on the jobs stream of stream
/// partition `partition` (one per partition, each with the same name), with
/// `ack_wait`: `max_deliver` from the retry policy (2 for a tool that is not idempotent,
/// so the second delivery reports the interruption instead of running the call). The
/// coordinator creates it from the registry; a worker in `create` mode may too. Both use
/// this one function, so they never disagree.
pub fn tool_consumer_config(
    names: &Names,
    partition: u32,
    definition: &crate::ToolDefinition,
    ack_wait: Duration,
) -> jetstream::consumer::pull::Config {
    use jetstream::consumer::AckPolicy;
    let max_deliver = if definition.retry.idempotent {
        i64::from(definition.retry.max_attempts.max(1))
    } else {
        2
    };
    jetstream::consumer::pull::Config {
        durable_name: Some(names.tool_consumer(&definition.name)),
        filter_subject: names.job_subject_in(partition, &definition.name),
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        max_deliver,
        backoff: Vec::new(),
        max_ack_pending: TOOL_MAX_ACK_PENDING,
        ..Default::default()
    }
}

/// Jobs of one tool delivered and not yet acknowledged, across its workers.
pub const TOOL_MAX_ACK_PENDING: i64 = 10_000;

/// The configuration of stream partition `partition`'s jobs stream.
pub fn jobs_config(names: &Names, partition: u32) -> stream::Config {
    config(
        names.jobs_stream_in(partition),
        names.jobs_wildcard_in(partition),
    )
}

/// The configuration of stream partition `partition`'s results stream.
pub fn results_config(names: &Names, partition: u32) -> stream::Config {
    config(
        names.results_stream_in(partition),
        names.results_wildcard_in(partition),
    )
}

/// Pairs of jobs and results streams a fleet's turns are spread over
/// (`TOOLFLEET_STREAM_PARTITIONS`, default 1): a turn's jobs and results all go to the
/// partition of its id ([`Names::stream_partition`]), so each stream's leader carries
/// its share of the turns. Every coordinator and worker of a fleet must use the same
/// number; see docs/SCALING.md.
pub const STREAM_PARTITIONS_ENV: &str = "TOOLFLEET_STREAM_PARTITIONS";
/// Its allowed values.
pub const STREAM_PARTITIONS_RANGE: std::ops::RangeInclusive<u32> = 1..=64;

/// Replicas of each stream (`TOOLFLEET_STREAM_REPLICAS`, 1 to 5, default 1; 3 on a
/// 3-node JetStream cluster). A malformed value is refused when the process reads its
/// endpoints (`config::Endpoints::from_env`), so here it is already valid. Consumers
/// take their stream's replicas. A stream that exists keeps its replicas: change them
/// with `nats stream edit <stream> --replicas 3`.
pub fn stream_replicas() -> usize {
    crate::env::env_in(STREAM_REPLICAS_ENV, 1, STREAM_REPLICAS_RANGE).unwrap_or(1)
}

/// The setting of [`stream_replicas`].
pub const STREAM_REPLICAS_ENV: &str = "TOOLFLEET_STREAM_REPLICAS";
/// Its allowed values (JetStream's own limit is 5).
pub const STREAM_REPLICAS_RANGE: std::ops::RangeInclusive<usize> = 1..=5;

/// Where the jobs and results streams keep their messages when they are created
/// (`TOOLFLEET_STREAM_STORAGE`: `file`, the default, or `memory`). `memory` spares the
/// server its store writes but trades durability: a restarted nats-server has lost every
/// queued job and every result not yet recorded, so those calls end as `timeout` at their
/// turn's deadline (the turn still gets its one `final`, from Redis). A malformed value
/// is refused when the process reads its endpoints (`config::Endpoints::from_env`). A
/// stream that exists keeps its storage: JetStream cannot change it, so delete the
/// stream while it is empty and let the fleet create it again.
pub fn stream_storage() -> stream::StorageType {
    parse_storage(&crate::env::env_string(STREAM_STORAGE_ENV, "file"))
        .unwrap_or(stream::StorageType::File)
}

/// The setting of [`stream_storage`].
pub const STREAM_STORAGE_ENV: &str = "TOOLFLEET_STREAM_STORAGE";

/// `file` or `memory` (any case) as a storage type.
pub fn parse_storage(value: &str) -> Result<stream::StorageType, crate::env::ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "file" => Ok(stream::StorageType::File),
        "memory" => Ok(stream::StorageType::Memory),
        _ => Err(crate::env::ConfigError {
            name: STREAM_STORAGE_ENV.into(),
            value: value.into(),
            reason: "must be file or memory".into(),
        }),
    }
}

fn config(name: String, subject: String) -> stream::Config {
    stream::Config {
        num_replicas: stream_replicas(),
        name,
        subjects: vec![subject],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream_storage(),
        duplicate_window: DUPLICATE_WINDOW,
        max_age: MAX_AGE,
        max_bytes: MAX_BYTES,
        max_message_size: MAX_MESSAGE_SIZE,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    }
}

async fn ensure(
    js: &jetstream::Context,
    config: stream::Config,
) -> Result<stream::Stream, EnsureStreamsError> {
    let name = config.name.clone();
    match js.get_or_create_stream(config).await {
        Ok(stream) => Ok(stream),
        // Another process may have created the stream between the lookup and the
        // create, which then fails; use the stream that now exists.
        Err(source) => js.get_stream(&name).await.map_err(|_| EnsureStreamsError {
            stream: name,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_file_or_memory_and_nothing_else() {
        assert_eq!(parse_storage("file").ok(), Some(stream::StorageType::File));
        assert_eq!(
            parse_storage(" Memory ").ok(),
            Some(stream::StorageType::Memory)
        );
        let error = parse_storage("disk").err();
        assert_eq!(error.map(|e| e.name), Some(STREAM_STORAGE_ENV.to_string()));
    }
}
