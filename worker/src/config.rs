//! Worker configuration from environment variables.
//!
//! Owns `WorkerConfig`: how a worker reaches NATS and Redis and how it serves
//! (`TOOLFLEET_*`). It must never hold settings of a tool or a pack: those are read
//! by the packs themselves (`toolfleet-packs`).

use std::time::Duration;

use toolfleet_common::config::{self, env_in, env_ms_in, env_string, ConfigError, Endpoints};
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::tls::TlsFiles;
use toolfleet_common::Names;

/// Everything a worker needs to run.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// NATS URL (`TOOLFLEET_NATS_URL`).
    pub nats_url: String,
    /// NATS user, password, inbox prefix and TLS files (`TOOLFLEET_NATS_USER`,
    /// `TOOLFLEET_NATS_PASSWORD`, `TOOLFLEET_NATS_INBOX_PREFIX`, `TOOLFLEET_NATS_CA_FILE`,
    /// `TOOLFLEET_NATS_CERT_FILE`, `TOOLFLEET_NATS_KEY_FILE`).
    pub nats_credentials: NatsCredentials,
    /// Redis URL (`TOOLFLEET_REDIS_URL`), for tool registration and liveness.
    pub redis_url: String,
    /// Redis TLS files (`TOOLFLEET_REDIS_CA_FILE`, `TOOLFLEET_REDIS_CERT_FILE`,
    /// `TOOLFLEET_REDIS_KEY_FILE`).
    pub redis_tls: TlsFiles,
    /// Subject and key prefix (`TOOLFLEET_PREFIX`).
    pub prefix: String,
    /// Pairs of jobs and results streams the turns are spread over
    /// (`TOOLFLEET_STREAM_PARTITIONS`, default 1): this worker pulls each tool's jobs
    /// from every partition. The same in every process of a fleet.
    pub stream_partitions: u32,
    /// This worker's id (`TOOLFLEET_WORKER_ID`; generated when unset).
    pub worker_id: String,
    /// Calls of one tool this worker runs at once (`TOOLFLEET_WORKER_CONCURRENCY`).
    pub concurrency: usize,
    /// Liveness heartbeat period (`TOOLFLEET_HEARTBEAT_MS`); a worker is dead after
    /// three missed beats.
    pub heartbeat: Duration,
    /// JetStream ack wait of the tool consumers (`TOOLFLEET_ACK_WAIT_MS`): how long after
    /// a worker's last sign of life its call is redelivered.
    pub ack_wait: Duration,
    /// Largest result a tool may return, in bytes (`TOOLFLEET_MAX_RESULT_BYTES`).
    pub max_result_bytes: usize,
    /// How long a call runs before its worker announces it started
    /// (`TOOLFLEET_RUNNING_AFTER_MS`, default 2; 0 announces every call as it starts). A
    /// call that ends sooner sends no `started` notice: its frontend sees `pending`, then
    /// the terminal state, and the fleet is spared a notice, a relay and an event for
    /// a state nobody could have seen.
    pub running_after: Duration,
    /// How long in-flight calls may run on after a shutdown request
    /// (`TOOLFLEET_SHUTDOWN_GRACE_MS`).
    pub shutdown_grace: Duration,
    /// How often the tool consumers are checked and recreated if missing
    /// (`TOOLFLEET_TOPOLOGY_CHECK_MS`).
    pub topology_check: Duration,
    /// Address of `/healthz`, `/readyz` and `/metrics` (`TOOLFLEET_HTTP_ADDR`, default
    /// `0.0.0.0:9091`, `off` to disable; none in [`WorkerConfig::local`]).
    pub http_addr: Option<std::net::SocketAddr>,
    /// Whether the worker creates its tools' consumers or only binds to the ones the
    /// coordinator creates (`TOOLFLEET_WORKER_CONSUMERS`, `create` or `bind`).
    pub consumers: ConsumerMode,
}

/// How a worker gets its tools' durable consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerMode {
    /// Get, create or update each consumer itself (development, NATS without users).
    Create,
    /// Never create or change a consumer: announce the definition, wait until the
    /// coordinator created the consumer with the definition's settings, bind to it. The
    /// deploy/ NATS users allow workers nothing else.
    Bind,
}

impl ConsumerMode {
    fn from_env() -> Result<Self, ConfigError> {
        const NAME: &str = "TOOLFLEET_WORKER_CONSUMERS";
        match env_string(NAME, "create").to_ascii_lowercase().as_str() {
            "create" => Ok(Self::Create),
            "bind" => Ok(Self::Bind),
            other => Err(ConfigError {
                name: NAME.into(),
                value: other.into(),
                reason: "must be create or bind".into(),
            }),
        }
    }
}

impl WorkerConfig {
    /// The names of every subject, stream and key of this worker's fleet.
    pub fn names(&self) -> Names {
        Names::new(self.prefix.clone()).with_partitions(self.stream_partitions)
    }

    /// Default settings against local servers.
    pub fn local() -> Self {
        Self::at(Endpoints::local())
    }

    /// Default settings against `endpoints`.
    fn at(endpoints: Endpoints) -> Self {
        Self {
            nats_url: endpoints.nats_url,
            nats_credentials: endpoints.nats_credentials,
            redis_url: endpoints.redis_url,
            redis_tls: endpoints.redis_tls,
            prefix: endpoints.prefix,
            stream_partitions: endpoints.stream_partitions,
            worker_id: default_worker_id(),
            concurrency: 8,
            heartbeat: Duration::from_secs(2),
            ack_wait: Duration::from_secs(5),
            max_result_bytes: 512 * 1024,
            running_after: Duration::from_millis(2),
            shutdown_grace: Duration::from_secs(10),
            topology_check: Duration::from_secs(1),
            http_addr: None,
            consumers: ConsumerMode::Create,
        }
    }

    /// Reads the configuration from the environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        let d = Self::at(Endpoints::from_env()?);
        Ok(Self {
            worker_id: env_string("TOOLFLEET_WORKER_ID", &d.worker_id),
            concurrency: env_in(
                "TOOLFLEET_WORKER_CONCURRENCY",
                d.concurrency,
                ranges::CONCURRENCY,
            )?,
            heartbeat: env_ms_in("TOOLFLEET_HEARTBEAT_MS", d.heartbeat, ranges::HEARTBEAT_MS)?,
            ack_wait: env_ms_in("TOOLFLEET_ACK_WAIT_MS", d.ack_wait, ranges::ACK_WAIT_MS)?,
            max_result_bytes: env_in(
                "TOOLFLEET_MAX_RESULT_BYTES",
                d.max_result_bytes,
                ranges::RESULT_BYTES,
            )?,
            running_after: env_ms_in(
                "TOOLFLEET_RUNNING_AFTER_MS",
                d.running_after,
                ranges::RUNNING_AFTER_MS,
            )?,
            shutdown_grace: config::shutdown_grace_from_env(d.shutdown_grace)?,
            topology_check: config::topology_check_from_env(d.topology_check)?,
            http_addr: toolfleet_common::http::addr_from_env("0.0.0.0:9091")?,
            consumers: ConsumerMode::from_env()?,
            ..d
        })
    }
}

/// The allowed range of each setting: zero is refused wherever it would stop the worker
/// (no slot, a heartbeat loop hammering Redis, jobs redelivered at once).
pub mod ranges {
    use std::ops::RangeInclusive;

    /// Calls of one tool at once (a semaphore's size; I/O-bound tools such as the bench's
    /// no-op run thousands at once).
    pub const CONCURRENCY: RangeInclusive<usize> = 1..=65_536;
    /// Heartbeat period, in ms.
    pub const HEARTBEAT_MS: RangeInclusive<u64> = 100..=60_000;
    pub use toolfleet_common::config::{ACK_WAIT_MS, SHUTDOWN_GRACE_MS, TOPOLOGY_CHECK_MS};
    /// Largest result, in bytes.
    pub const RESULT_BYTES: RangeInclusive<usize> = 1024..=8 * 1024 * 1024;
    /// Delay of the `started` notice, in ms (0: at the call's start).
    pub const RUNNING_AFTER_MS: RangeInclusive<u64> = 0..=60_000;
}

/// `<host name>-<pid>-<6 hex>` (PROTOCOL §7.1).
fn default_worker_id() -> String {
    let host = toolfleet_common::telemetry::host_name();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &suffix[..6])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_worker_id_is_host_pid_and_six_hex() {
        let id = default_worker_id();
        let host = toolfleet_common::telemetry::host_name();
        let rest = id
            .strip_prefix(&format!("{host}-"))
            .expect("host name first");
        let (pid, hex) = rest.split_once('-').expect("pid and suffix");
        assert_eq!(pid, std::process::id().to_string());
        assert_eq!(hex.len(), 6);
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(default_worker_id(), id, "unique per call");
    }
}
