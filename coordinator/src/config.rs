//! Coordinator configuration: environment variables plus an optional tenants file.
//!
//! Owns `CoordinatorConfig` and the per-tenant policies. Never applies a limit itself:
//! `limits.rs` combines these with the request, `validate.rs` applies per-call ones.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toolfleet_common::config::{self, env_in, env_ms_in, env_string, ConfigError, Endpoints};
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::tls::TlsFiles;
use toolfleet_common::turn::normalize_tenant;
use toolfleet_common::Names;

/// Everything a coordinator needs to run.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// NATS URL (`TOOLFLEET_NATS_URL`).
    pub nats_url: String,
    /// NATS user, password, inbox prefix and TLS files (`TOOLFLEET_NATS_USER`,
    /// `TOOLFLEET_NATS_PASSWORD`, `TOOLFLEET_NATS_INBOX_PREFIX`, `TOOLFLEET_NATS_CA_FILE`,
    /// `TOOLFLEET_NATS_CERT_FILE`, `TOOLFLEET_NATS_KEY_FILE`).
    pub nats_credentials: NatsCredentials,
    /// Redis URL (`TOOLFLEET_REDIS_URL`).
    pub redis_url: String,
    /// Redis TLS files (`TOOLFLEET_REDIS_CA_FILE`, `TOOLFLEET_REDIS_CERT_FILE`,
    /// `TOOLFLEET_REDIS_KEY_FILE`).
    pub redis_tls: TlsFiles,
    /// Subject and key prefix (`TOOLFLEET_PREFIX`).
    pub prefix: String,
    /// Pairs of jobs and results streams the turns are spread over
    /// (`TOOLFLEET_STREAM_PARTITIONS`, default 1); the same in every process of a fleet.
    pub stream_partitions: u32,
    /// Deadline of a turn that names none (`TOOLFLEET_DEFAULT_DEADLINE_MS`).
    pub default_deadline: Duration,
    /// Longest deadline a turn may ask for (`TOOLFLEET_MAX_DEADLINE_MS`).
    pub max_deadline: Duration,
    /// Calls per turn that run; later ones get `too_many_calls` (`TOOLFLEET_MAX_CALLS`).
    pub max_calls: usize,
    /// Decisions with more calls than this are refused whole (`TOOLFLEET_MAX_DECISION_CALLS`).
    pub max_decision_calls: usize,
    /// Calls of one turn in flight at once (`TOOLFLEET_CONCURRENCY`).
    pub concurrency: usize,
    /// Largest serialized arguments accepted per call (`TOOLFLEET_MAX_ARGUMENT_BYTES`).
    pub max_argument_bytes: usize,
    /// Ack wait of the tool consumers this coordinator creates (`TOOLFLEET_TOOL_ACK_WAIT_MS`):
    /// how long after a worker's last sign of life its call is redelivered. An existing
    /// consumer keeps its own.
    pub tool_ack_wait: Duration,
    /// Largest serialized turn `context` accepted; it is copied into every job
    /// (`TOOLFLEET_MAX_CONTEXT_BYTES`). A larger one refuses the turn with
    /// `context_too_large`.
    pub max_context_bytes: usize,
    /// Turns this replica takes in at once and follows until they end; one more is
    /// refused with `overloaded` (retryable) instead of queued
    /// (`TOOLFLEET_MAX_TURNS_IN_PROGRESS`).
    pub max_turns_in_progress: usize,
    /// The share of Redis's `maxmemory`, in percent, at which new turns are refused with
    /// `overloaded` so the turns in flight can still record and end
    /// (`TOOLFLEET_REDIS_SHED_PERCENT`; 100 never refuses). A Redis without `maxmemory`
    /// is never the reason for a refusal.
    pub redis_shed_percent: u8,
    /// The share of Redis's `maxmemory`, in percent, from which the turns that ended and
    /// were sent longest ago are deleted before their retention runs out
    /// (`TOOLFLEET_REDIS_TRIM_PERCENT`; 100 never trims). Open turns are never deleted.
    pub redis_trim_percent: u8,
    /// Argument names that identify a tenant; a call whose argument of one of these
    /// names differs from the turn's tenant is refused (`TOOLFLEET_TENANT_ARGUMENT_KEYS`,
    /// comma-separated).
    pub tenant_argument_keys: Vec<String>,
    /// How often every replica looks for turns past their deadline
    /// (`TOOLFLEET_SWEEP_INTERVAL_MS`).
    pub sweep_interval: Duration,
    /// How long after a deadline another replica steps in for a turn's owner
    /// (`TOOLFLEET_SWEEP_GRACE_MS`).
    pub sweep_grace: Duration,
    /// Buckets of the deadline index, each its own Redis key and hash tag, so on Redis
    /// Cluster no slot sees every turn (`TOOLFLEET_DEADLINE_BUCKETS`, default 16). Raise
    /// it freely; a lower value strands the entries of the buckets dropped.
    pub deadline_buckets: u32,
    /// How often the tool registry is re-read (`TOOLFLEET_REGISTRY_REFRESH_MS`).
    pub registry_refresh: Duration,
    /// How long a turn's keys stay in Redis after its deadline, for late results
    /// (`TOOLFLEET_RETENTION_MS`).
    pub retention: Duration,
    /// Results recorded at once by this replica (`TOOLFLEET_RESULT_CONCURRENCY`).
    pub result_concurrency: usize,
    /// Turn requests this replica takes in at once: decoded, planned, stored and
    /// dispatched (`TOOLFLEET_INTAKE_CONCURRENCY`). A burst beyond it waits in the
    /// replica's subscription, not as that many decoded requests in memory together.
    pub intake_concurrency: usize,
    /// How long owned turns may run on after a shutdown request
    /// (`TOOLFLEET_SHUTDOWN_GRACE_MS`).
    pub shutdown_grace: Duration,
    /// How often the streams and the results consumer are checked and recreated if
    /// missing, and the queue-lag gauges sampled (`TOOLFLEET_TOPOLOGY_CHECK_MS`).
    pub topology_check: Duration,
    /// Per-tenant policies (`TOOLFLEET_TENANTS_FILE`, JSON).
    pub tenants: TenantPolicies,
    /// Whether every tool's calls pass through its lane, shared fairly between the
    /// tenants with calls waiting (`TOOLFLEET_FAIR_SHARING`, `on` or `off`; default on).
    pub fair_sharing: bool,
    /// Calls of one tool a worker runs at once, as the lanes count a tool's slots:
    /// live workers × this (`TOOLFLEET_LANE_WORKER_SLOTS`, default 8, the workers'
    /// `TOOLFLEET_WORKER_CONCURRENCY` default). Set it to the workers' own.
    pub lane_worker_slots: usize,
    /// How much work beyond the slots a lane keeps on the stream, in milliseconds of
    /// the tool's mean call time, so a worker never waits for the next job to be
    /// published (`TOOLFLEET_LANE_HEADROOM_MS`, default 5): a 200 ms tool gets one
    /// extra job, a 1 ms tool as many as it has slots.
    pub lane_headroom: Duration,
    /// Tenants each frontend user may name (`TOOLFLEET_FRONTEND_TENANTS`).
    pub frontends: FrontendBindings,
    /// Address of `/healthz`, `/readyz` and `/metrics` (`TOOLFLEET_HTTP_ADDR`, default
    /// `0.0.0.0:9090`, `off` to disable; none in [`CoordinatorConfig::local`]).
    pub http_addr: Option<std::net::SocketAddr>,
}

impl CoordinatorConfig {
    /// The names of every subject, stream and key of this coordinator's fleet.
    pub fn names(&self) -> Names {
        Names::new(self.prefix.clone()).with_partitions(self.stream_partitions)
    }

    /// Defaults against local servers.
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
            default_deadline: Duration::from_secs(15),
            max_deadline: Duration::from_secs(300),
            max_calls: 16,
            max_decision_calls: 256,
            concurrency: 16,
            max_argument_bytes: 256 * 1024,
            max_context_bytes: 32 * 1024,
            tool_ack_wait: Duration::from_secs(5),
            max_turns_in_progress: 20_000,
            redis_shed_percent: 85,
            redis_trim_percent: 70,
            tenant_argument_keys: ["tenant_id", "tenantId", "business_id", "businessId"]
                .map(String::from)
                .to_vec(),
            sweep_interval: Duration::from_millis(500),
            sweep_grace: Duration::from_millis(1000),
            deadline_buckets: 16,
            registry_refresh: Duration::from_secs(1),
            retention: Duration::from_secs(600),
            result_concurrency: 256,
            intake_concurrency: 64,
            shutdown_grace: Duration::from_secs(10),
            topology_check: Duration::from_secs(1),
            tenants: TenantPolicies::default(),
            fair_sharing: true,
            lane_worker_slots: 8,
            lane_headroom: Duration::from_millis(5),
            frontends: FrontendBindings::default(),
            http_addr: None,
        }
    }

    /// Reads the configuration from the environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        let tenants = match std::env::var("TOOLFLEET_TENANTS_FILE") {
            Ok(path) if !path.trim().is_empty() => {
                TenantPolicies::from_file(Path::new(path.trim())).map_err(|reason| ConfigError {
                    name: "TOOLFLEET_TENANTS_FILE".into(),
                    value: path.clone(),
                    reason: reason.to_string(),
                })?
            }
            _ => TenantPolicies::default(),
        };
        // A bad tenants file is reported ahead of a bad endpoint variable.
        let d = Self::at(Endpoints::from_env()?);
        let keys = env_string(
            "TOOLFLEET_TENANT_ARGUMENT_KEYS",
            &d.tenant_argument_keys.join(","),
        );
        let config = Self {
            tenant_argument_keys: keys
                .split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect(),
            tenants,
            fair_sharing: fair_sharing_from_env()?,
            frontends: frontend_bindings_from_env()?,
            http_addr: toolfleet_common::http::addr_from_env("0.0.0.0:9090")?,
            ..d
        }
        .with_ranged_env()?;
        if config.default_deadline > config.max_deadline {
            return Err(ConfigError {
                name: "TOOLFLEET_DEFAULT_DEADLINE_MS".into(),
                value: config.default_deadline.as_millis().to_string(),
                reason: format!(
                    "out of range: allowed up to TOOLFLEET_MAX_DEADLINE_MS ({})",
                    config.max_deadline.as_millis()
                ),
            });
        }
        config.check_retention()?;
        Ok(config)
    }

    /// Refuses a retention shorter than the sweep grace plus one sweep interval: a
    /// turn's keys would expire before any replica could sweep it.
    fn check_retention(&self) -> Result<(), ConfigError> {
        let needed = self.sweep_grace + self.sweep_interval;
        if self.retention >= needed {
            return Ok(());
        }
        Err(ConfigError {
            name: "TOOLFLEET_RETENTION_MS".into(),
            value: self.retention.as_millis().to_string(),
            reason: format!(
                "out of range: must be at least TOOLFLEET_SWEEP_GRACE_MS + TOOLFLEET_SWEEP_INTERVAL_MS ({})",
                needed.as_millis()
            ),
        })
    }
}

impl CoordinatorConfig {
    /// These settings with every duration and count read from the environment and
    /// checked against its range (see [`ranges`]).
    fn with_ranged_env(self) -> Result<Self, ConfigError> {
        use ranges as r;
        let d = self;
        Ok(Self {
            default_deadline: env_ms_in(
                "TOOLFLEET_DEFAULT_DEADLINE_MS",
                d.default_deadline,
                r::DEADLINE_MS,
            )?,
            max_deadline: env_ms_in("TOOLFLEET_MAX_DEADLINE_MS", d.max_deadline, r::DEADLINE_MS)?,
            max_calls: env_in("TOOLFLEET_MAX_CALLS", d.max_calls, r::CALLS)?,
            max_decision_calls: env_in(
                "TOOLFLEET_MAX_DECISION_CALLS",
                d.max_decision_calls,
                r::DECISION_CALLS,
            )?,
            concurrency: env_in("TOOLFLEET_CONCURRENCY", d.concurrency, r::CALLS)?,
            max_argument_bytes: env_in(
                "TOOLFLEET_MAX_ARGUMENT_BYTES",
                d.max_argument_bytes,
                r::ARGUMENT_BYTES,
            )?,
            tool_ack_wait: env_ms_in(
                "TOOLFLEET_TOOL_ACK_WAIT_MS",
                d.tool_ack_wait,
                r::ACK_WAIT_MS,
            )?,
            max_context_bytes: env_in(
                "TOOLFLEET_MAX_CONTEXT_BYTES",
                d.max_context_bytes,
                r::CONTEXT_BYTES,
            )?,
            max_turns_in_progress: env_in(
                "TOOLFLEET_MAX_TURNS_IN_PROGRESS",
                d.max_turns_in_progress,
                r::TURNS_IN_PROGRESS,
            )?,
            redis_shed_percent: env_in(
                "TOOLFLEET_REDIS_SHED_PERCENT",
                d.redis_shed_percent,
                r::SHED_PERCENT,
            )?,
            redis_trim_percent: env_in(
                "TOOLFLEET_REDIS_TRIM_PERCENT",
                d.redis_trim_percent,
                r::SHED_PERCENT,
            )?,
            sweep_interval: env_ms_in(
                "TOOLFLEET_SWEEP_INTERVAL_MS",
                d.sweep_interval,
                r::SWEEP_INTERVAL_MS,
            )?,
            sweep_grace: env_ms_in("TOOLFLEET_SWEEP_GRACE_MS", d.sweep_grace, r::SWEEP_GRACE_MS)?,
            deadline_buckets: env_in(
                "TOOLFLEET_DEADLINE_BUCKETS",
                d.deadline_buckets,
                r::DEADLINE_BUCKETS,
            )?,
            registry_refresh: env_ms_in(
                "TOOLFLEET_REGISTRY_REFRESH_MS",
                d.registry_refresh,
                r::REFRESH_MS,
            )?,
            retention: env_ms_in("TOOLFLEET_RETENTION_MS", d.retention, r::RETENTION_MS)?,
            result_concurrency: env_in(
                "TOOLFLEET_RESULT_CONCURRENCY",
                d.result_concurrency,
                r::REPLICA_CONCURRENCY,
            )?,
            intake_concurrency: env_in(
                "TOOLFLEET_INTAKE_CONCURRENCY",
                d.intake_concurrency,
                r::REPLICA_CONCURRENCY,
            )?,
            shutdown_grace: config::shutdown_grace_from_env(d.shutdown_grace)?,
            topology_check: config::topology_check_from_env(d.topology_check)?,
            lane_worker_slots: env_in(
                "TOOLFLEET_LANE_WORKER_SLOTS",
                d.lane_worker_slots,
                r::LANE_WORKER_SLOTS,
            )?,
            lane_headroom: env_ms_in(
                "TOOLFLEET_LANE_HEADROOM_MS",
                d.lane_headroom,
                r::LANE_HEADROOM_MS,
            )?,
            ..d
        })
    }
}

/// The allowed range of each setting: zero is refused wherever it would stop the fleet
/// (every call refused, timed out, or Redis polled in a busy loop), and the upper bounds
/// keep semaphores, buckets and timers sane.
pub mod ranges {
    use std::ops::RangeInclusive;

    /// Turn deadlines (default and maximum), in ms: the latency buckets end at 300 s.
    pub const DEADLINE_MS: RangeInclusive<u64> = 100..=300_000;
    /// Calls per turn and calls of one turn in flight.
    pub const CALLS: RangeInclusive<usize> = 1..=1024;
    /// Calls of a decision before it is refused whole.
    pub const DECISION_CALLS: RangeInclusive<usize> = 1..=10_000;
    /// Serialized arguments of one call, in bytes.
    pub const ARGUMENT_BYTES: RangeInclusive<usize> = 1024..=8 * 1024 * 1024;
    pub use toolfleet_common::config::{ACK_WAIT_MS, SHUTDOWN_GRACE_MS};
    /// Serialized turn context, in bytes.
    pub const CONTEXT_BYTES: RangeInclusive<usize> = 256..=1024 * 1024;
    /// Turns one replica takes in and follows at once.
    pub const TURNS_IN_PROGRESS: RangeInclusive<usize> = 1..=1_000_000;
    /// `TOOLFLEET_REDIS_SHED_PERCENT` and `TOOLFLEET_REDIS_TRIM_PERCENT`.
    pub const SHED_PERCENT: RangeInclusive<u8> = 10..=100;
    /// Deadline sweeps, in ms.
    pub const SWEEP_INTERVAL_MS: RangeInclusive<u64> = 50..=10_000;
    /// Buckets of the deadline index.
    pub const DEADLINE_BUCKETS: RangeInclusive<u32> = 1..=1024;
    /// Wait before another replica ends an owner's turn, in ms.
    pub const SWEEP_GRACE_MS: RangeInclusive<u64> = 100..=60_000;
    /// Registry refreshes and topology checks, in ms.
    pub const REFRESH_MS: RangeInclusive<u64> = 100..=60_000;
    /// Turn keys kept after the deadline, in ms.
    pub const RETENTION_MS: RangeInclusive<u64> = 10_000..=86_400_000;
    /// Results recorded, and turn requests taken in, at once by one replica.
    pub const REPLICA_CONCURRENCY: RangeInclusive<usize> = 1..=4096;
    /// Calls of one tool a worker runs at once, as the lanes count them.
    pub const LANE_WORKER_SLOTS: RangeInclusive<usize> = 1..=4096;
    /// A lane's work beyond the slots, in ms of mean call time.
    pub const LANE_HEADROOM_MS: RangeInclusive<u64> = 0..=10_000;
    /// A tenant's weight in the lanes.
    pub const WEIGHT: RangeInclusive<u32> = 1..=1000;
}

/// `TOOLFLEET_FAIR_SHARING`: `on` (default) or `off`.
fn fair_sharing_from_env() -> Result<bool, ConfigError> {
    let name = "TOOLFLEET_FAIR_SHARING";
    let value = env_string(name, "on");
    match value.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        _ => Err(ConfigError {
            name: name.into(),
            value,
            reason: "must be on or off".into(),
        }),
    }
}

/// Limits and allowlist of one tenant. Unset fields fall back to the coordinator's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantPolicy {
    /// Tools the tenant may call: exact names, or prefixes ending in `*`
    /// (`crm.*`). Absent means every tool.
    pub allowed_tools: Option<Vec<String>>,
    /// Calls per turn.
    pub max_calls: Option<usize>,
    /// Calls in flight per turn.
    pub concurrency: Option<usize>,
    /// Per-call timeout cap in milliseconds.
    pub tool_timeout_ms: Option<u64>,
    /// Turn deadline in milliseconds (default and cap).
    pub deadline_ms: Option<u64>,
    /// The tenant's share of a saturated tool against the other tenants with calls
    /// waiting on it (1 to 1000; default 1): a tenant of weight 3 gets three calls
    /// started for each one of a tenant of weight 1.
    pub weight: Option<u32>,
    /// Calls of the tenant in flight on any one tool at once; more wait in the tool's
    /// lane, even while the tool has free slots.
    pub max_calls_in_flight: Option<usize>,
    /// The same per tool, by tool name; a tool named here uses this instead of
    /// `max_calls_in_flight`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tool_calls_in_flight: BTreeMap<String, usize>,
    /// Turns of the tenant in flight at once, over every coordinator; one more is
    /// refused with `overloaded` and a retry hint.
    pub max_turns_in_flight: Option<usize>,
}

impl TenantPolicy {
    /// The tenant's weight in the tools' lanes.
    pub fn weight(&self) -> u32 {
        self.weight.unwrap_or(1)
    }

    /// The most calls of the tenant in flight on `tool` at once (`None`: no limit but
    /// the tool's).
    pub fn calls_in_flight_on(&self, tool: &str) -> Option<usize> {
        self.tool_calls_in_flight
            .get(tool)
            .copied()
            .or(self.max_calls_in_flight)
    }

    /// Refuses values outside their ranges.
    fn check(&self) -> Result<(), PolicyError> {
        if let Some(weight) = self.weight {
            if !ranges::WEIGHT.contains(&weight) {
                return Err(PolicyError::Weight(weight));
            }
        }
        let caps = self.tool_calls_in_flight.values().copied();
        let limits = [self.max_calls_in_flight, self.max_turns_in_flight];
        if limits.into_iter().flatten().chain(caps).any(|n| n == 0) {
            return Err(PolicyError::ZeroLimit);
        }
        Ok(())
    }

    /// Whether `tool` is on the allowlist.
    pub fn allows(&self, tool: &str) -> bool {
        match &self.allowed_tools {
            None => true,
            Some(list) => list.iter().any(|pattern| match pattern.strip_suffix('*') {
                Some(prefix) => tool.starts_with(prefix),
                None => pattern == tool,
            }),
        }
    }
}

/// A tenant's policy with a value outside its range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The weight is not between 1 and 1000.
    #[error("weight {0} is not between 1 and 1000")]
    Weight(u32),
    /// A limit of calls or turns in flight is 0.
    #[error(
        "max_calls_in_flight, tool_calls_in_flight and max_turns_in_flight must be at least 1"
    )]
    ZeroLimit,
}

/// Why a tenants file was not read.
#[derive(Debug, thiserror::Error)]
pub enum TenantsFileError {
    /// The file could not be read.
    #[error("{0}")]
    Read(#[from] std::io::Error),
    /// The file is not a tenants file.
    #[error("{0}")]
    Parse(#[from] serde_json::Error),
    /// A policy has a value outside its range (`tenant`: `None` for the default).
    #[error("{}: {reason}", tenant.as_ref().map_or_else(|| "default".to_string(), |t| format!("tenant {t}")))]
    Policy {
        /// The tenant whose policy it is; `None` for the default policy.
        tenant: Option<String>,
        /// What is wrong with it.
        reason: PolicyError,
    },
}

/// Why `TOOLFLEET_FRONTEND_TENANTS` was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindingError {
    /// An entry is not `frontend=tenant,...`.
    #[error("{0:?} is not frontend=tenant,...")]
    NotABinding(String),
    /// An entry names no usable frontend user or no tenant.
    #[error("{0:?} needs a frontend user and a tenant")]
    Incomplete(String),
}

/// `TOOLFLEET_FRONTEND_TENANTS`, empty when unset.
fn frontend_bindings_from_env() -> Result<FrontendBindings, ConfigError> {
    let name = "TOOLFLEET_FRONTEND_TENANTS";
    let value = env_string(name, "");
    FrontendBindings::parse(&value).map_err(|reason| ConfigError {
        name: name.into(),
        value,
        reason: reason.to_string(),
    })
}

/// Policies by tenant id, with a default for tenants not listed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPolicies {
    /// Policy of tenants without their own entry.
    #[serde(default)]
    pub default: TenantPolicy,
    /// Policies by tenant id.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantPolicy>,
}

impl TenantPolicies {
    /// Reads policies from a JSON file.
    pub fn from_file(path: &Path) -> Result<Self, TenantsFileError> {
        let text = std::fs::read_to_string(path)?;
        let policies: Self = serde_json::from_str(&text)?;
        policies
            .default
            .check()
            .map_err(|reason| TenantsFileError::Policy {
                tenant: None,
                reason,
            })?;
        for (tenant, policy) in &policies.tenants {
            policy.check().map_err(|reason| TenantsFileError::Policy {
                tenant: Some(tenant.clone()),
                reason,
            })?;
        }
        Ok(policies)
    }

    /// The metric label of `tenant`: its id when the tenants file names it, else
    /// `_other`, so a request never adds a series.
    pub fn label(&self, tenant: &str) -> String {
        let normalized = normalize_tenant(tenant);
        self.tenants
            .keys()
            .map(|id| normalize_tenant(id))
            .find(|id| *id == normalized)
            .unwrap_or_else(|| "_other".to_string())
    }

    /// The policy of `tenant`, both ids compared in their normalized form.
    pub fn get(&self, tenant: &str) -> &TenantPolicy {
        let tenant = normalize_tenant(tenant);
        self.tenants
            .iter()
            .find(|(id, _)| normalize_tenant(id) == tenant)
            .map_or(&self.default, |(_, policy)| policy)
    }
}

/// Which tenants each frontend (NATS user) may submit turns for
/// (`TOOLFLEET_FRONTEND_TENANTS`, `frontend=acme,globex;frontend2=initech;gateway=*`).
/// Empty: no binding, any identified or unidentified frontend names its tenant. `*`
/// binds a frontend to every tenant: for a frontend that authenticates its own callers
/// and fixes their tenant itself (the HTTP gateway, from its API keys).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrontendBindings {
    /// Normalized tenant ids by frontend user.
    pub tenants: BTreeMap<String, Vec<String>>,
}

/// The binding of a frontend to every tenant (`gateway=*`).
pub const ANY_TENANT: &str = "*";

impl FrontendBindings {
    /// Parses `frontend=t1,t2;other=t3`.
    pub fn parse(text: &str) -> Result<Self, BindingError> {
        let mut tenants = BTreeMap::new();
        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let (frontend, list) = entry
                .split_once('=')
                .ok_or_else(|| BindingError::NotABinding(entry.to_string()))?;
            let ids: Vec<String> = list
                .split(',')
                .map(normalize_tenant)
                .filter(|t| !t.is_empty())
                .collect();
            let frontend = frontend.trim();
            if frontend.is_empty() || frontend.contains(['.', '*', '>', ' ']) || ids.is_empty() {
                return Err(BindingError::Incomplete(entry.to_string()));
            }
            tenants.insert(frontend.to_string(), ids);
        }
        Ok(Self { tenants })
    }

    /// Whether any binding is configured.
    pub fn enforced(&self) -> bool {
        !self.tenants.is_empty()
    }

    /// The tenants `frontend` is bound to: `None` when it may name any (no bindings, or
    /// bound to `*`), else its tenants (empty when it is bound to none).
    pub fn tenants_of(&self, frontend: Option<&str>) -> Option<&[String]> {
        if !self.enforced() {
            return None;
        }
        let bound = frontend.and_then(|f| self.tenants.get(f));
        match bound {
            Some(ids) if ids.iter().any(|t| t == ANY_TENANT) => None,
            Some(ids) => Some(ids),
            None => Some(&[]),
        }
    }

    /// Whether `frontend` may submit for the (normalized) `tenant`.
    pub fn allows(&self, frontend: Option<&str>, tenant: &str) -> bool {
        if !self.enforced() {
            return true;
        }
        frontend
            .and_then(|f| self.tenants.get(f))
            .is_some_and(|ids| {
                ids.iter()
                    .any(|t| t == ANY_TENANT || *t == normalize_tenant(tenant))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowlist_patterns() {
        let p = TenantPolicy {
            allowed_tools: Some(vec!["crm.*".into(), "get_faqs".into()]),
            ..Default::default()
        };
        assert!(p.allows("crm.getOpenInvoices"));
        assert!(p.allows("get_faqs"));
        assert!(!p.allows("get_faqs_v2"));
        assert!(!p.allows("test.behave"));
        assert!(TenantPolicy::default().allows("anything"));
    }

    #[test]
    fn tenants_file_shape() {
        let parsed: Result<TenantPolicies, _> = serde_json::from_str(
            r#"{"tenants": {"acme": {"max_calls": 2, "tool_timeout_ms": 400, "deadline_ms": 1000}}}"#,
        );
        let parsed = parsed.unwrap_or_default();
        assert_eq!(parsed.get("acme").max_calls, Some(2));
        assert_eq!(parsed.get("other").max_calls, None);
        for spelling in ["ACME", " acme", "acme "] {
            assert_eq!(parsed.get(spelling).max_calls, Some(2));
        }
    }

    #[test]
    fn tenant_shares() {
        let parsed: TenantPolicies = serde_json::from_str(
            r#"{"default": {"weight": 1},
                "tenants": {"Acme": {"weight": 3, "max_calls_in_flight": 4,
                  "tool_calls_in_flight": {"crm.slow": 1}, "max_turns_in_flight": 10}}}"#,
        )
        .unwrap_or_default();
        let acme = parsed.get("acme");
        assert_eq!(acme.weight(), 3);
        assert_eq!(acme.calls_in_flight_on("crm.fast"), Some(4));
        assert_eq!(acme.calls_in_flight_on("crm.slow"), Some(1));
        assert_eq!(acme.max_turns_in_flight, Some(10));
        assert_eq!(parsed.get("other").weight(), 1);
        assert_eq!(parsed.get("other").calls_in_flight_on("crm.fast"), None);
        assert_eq!(parsed.label(" ACME"), "acme");
        assert_eq!(parsed.label("globex"), "_other");
        for bad in [
            TenantPolicy {
                weight: Some(0),
                ..Default::default()
            },
            TenantPolicy {
                weight: Some(1001),
                ..Default::default()
            },
            TenantPolicy {
                max_turns_in_flight: Some(0),
                ..Default::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn retention_must_outlast_a_sweep() {
        let mut config = CoordinatorConfig::local();
        assert!(config.check_retention().is_ok());
        config.sweep_grace = Duration::from_secs(3600);
        let error = config.check_retention().err().map(|e| e.name);
        assert_eq!(error.as_deref(), Some("TOOLFLEET_RETENTION_MS"));
    }

    #[test]
    fn a_tenants_file_is_refused_by_kind_of_fault() {
        let dir = std::env::temp_dir().join(format!("toolfleet-tenants-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
            path
        };
        let missing = TenantPolicies::from_file(&dir.join("missing.json"));
        assert!(matches!(missing, Err(TenantsFileError::Read(_))));
        let junk = TenantPolicies::from_file(&write("junk.json", "{"));
        assert!(matches!(junk, Err(TenantsFileError::Parse(_))));
        let heavy = write("heavy.json", r#"{"tenants": {"acme": {"weight": 0}}}"#);
        match TenantPolicies::from_file(&heavy) {
            Err(TenantsFileError::Policy { tenant, reason }) => {
                assert_eq!(
                    (tenant.as_deref(), reason),
                    (Some("acme"), PolicyError::Weight(0))
                );
            }
            other => panic!("a policy error expected: {other:?}"),
        }
        let zero = write("zero.json", r#"{"default": {"max_turns_in_flight": 0}}"#);
        assert!(matches!(
            TenantPolicies::from_file(&zero),
            Err(TenantsFileError::Policy {
                tenant: None,
                reason: PolicyError::ZeroLimit
            })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn frontend_bindings() {
        let b = FrontendBindings::parse("web=acme, Globex ;kiosk=initech").unwrap_or_default();
        assert!(b.allows(Some("web"), " GLOBEX"));
        assert!(!b.allows(Some("web"), "initech"));
        assert!(!b.allows(None, "acme"));
        assert!(!b.allows(Some("other"), "acme"));
        assert!(FrontendBindings::default().allows(None, "anyone"));
        assert_eq!(
            FrontendBindings::parse("web"),
            Err(BindingError::NotABinding("web".into()))
        );
        assert_eq!(
            FrontendBindings::parse("a.b=t1"),
            Err(BindingError::Incomplete("a.b=t1".into()))
        );
    }

    #[test]
    fn a_frontend_bound_to_any_tenant() {
        let b = FrontendBindings::parse("web=acme;gateway=*").unwrap_or_default();
        assert!(b.allows(Some("gateway"), "acme"));
        assert!(b.allows(Some("gateway"), "globex"));
        assert!(!b.allows(Some("web"), "globex"));
        assert!(!b.allows(None, "globex"));
    }
}
