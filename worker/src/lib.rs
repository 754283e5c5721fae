//! # toolfleet-worker
//!
//! The worker SDK: a tool is one async fn with typed arguments; [`run`] serves a set of
//! tools from their JetStream pull consumers until shut down.
//!
//! ```no_run
//! # use toolfleet_worker::{Tool, ToolContext, ToolOutput, ToolError, WorkerConfig};
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Args { #[serde(rename = "customerId")] customer_id: String }
//!
//! # async fn demo() -> Result<(), toolfleet_worker::WorkerError> {
//! let tool = Tool::builder("crm.getOpenInvoices", "The customer's open invoices")
//!     .waiting_hint("checking your billing")
//!     .idempotent(3)
//!     .handler(|_ctx: ToolContext, args: Args| async move {
//!         Ok::<_, ToolError>(ToolOutput::new(serde_json::json!({"customer": args.customer_id})))
//!     });
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! toolfleet_worker::run(WorkerConfig::from_env()?, vec![tool], shutdown).await
//! # }
//! ```
//!
//! # Layout
//!
//! This crate is the SDK only: it owns serving tools (consumers, registry, the runner,
//! the result cache) and never contains tools of its own; the tool packs and the
//! `toolfleet-worker` binary that hosts them live in the `toolfleet-packs` crate
//! (`packs/`). Nothing here may depend on a database, an HTTP client or any one pack.
//!
//! | module | what lives there |
//! |---|---|
//! | this file | [`run`]: health, consumers (recreated when lost), registration, heartbeat, draining on shutdown (NAK at the end of the grace); [`WorkerError`] |
//! | [`tool`] | `Tool`, its builder, `ToolContext`, `ToolOutput`, `ToolError` |
//! | `serve` | [`serve`]: a whole worker process (settings, telemetry, signals) in one call |
//! | [`prelude`] | what a tool file needs in one `use` |
//! | [`schema`] | the schemas the model sees, derived from argument and output types |
//! | [`config`] | `WorkerConfig` from environment variables |
//! | `consumers` | each tool's durable consumer: created, checked, its delivery settings kept in line with the definition |
//! | [`registry`] | announcing tools and liveness in Redis |
//! | `runner` | pulling jobs, running calls, publishing results, acking |
//! | `output` | results checked against the output schema (feature `output-schema`) |
//! | `cache` | Redis result cache for idempotent read-only tools (`ResultCache::wrap`; feature `cache`) |
//!
//! Features: `prometheus` (`/metrics`), `output-schema` (the JSON Schema validator) and
//! `cache` are on by default, as the packs use them; `otlp` and `otlp-grpc` are off.
//!
//! The example in the README's "Writing a tool" section is
//! `examples/writing_a_tool.rs` (`cargo run -p toolfleet-worker --example writing_a_tool`).

#[cfg(feature = "cache")]
pub mod cache;
pub mod config;
mod consumers;
mod output;
pub mod prelude;
pub mod registry;
mod runner;
pub mod schema;
mod serve;
pub mod tool;

pub use serve::{serve, ServeError};
pub use toolfleet_worker_macros::{main, tool, ToolError};

/// What the macros' generated code names; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use tokio;
}

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::health::{connect_nats, start_process, Health};
use toolfleet_common::streams::{ensure_streams, EnsureStreamsError};
use toolfleet_common::tool::{validate_tool_name, ToolNameError};
use toolfleet_common::topology::{self, Needed};
use toolfleet_common::Names;
use tracing::{info, warn};

pub use config::WorkerConfig;
pub use tool::{Tool, ToolContext, ToolError, ToolOutput};

use registry::Registration;
use runner::{serve_tool, ServedTool, Shared};

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A setting is malformed.
    #[error("configuration: {0}")]
    Config(#[from] toolfleet_common::config::ConfigError),
    /// A tool's name is unusable.
    #[error(transparent)]
    ToolName(#[from] ToolNameError),
    /// Two tools share a name, or there are none.
    #[error("tools: {0}")]
    Tools(String),
    /// A tool's output schema does not compile.
    #[error("tool {tool}: output schema: {message}")]
    OutputSchema {
        /// The tool.
        tool: String,
        /// The compiler's complaint.
        message: String,
    },
    /// NATS could not be reached.
    #[error("nats: {0}")]
    Nats(#[from] async_nats::ConnectError),
    /// The streams could not be created.
    #[error(transparent)]
    Streams(#[from] EnsureStreamsError),
    /// A tool consumer could not be created.
    #[error("consumer {consumer}: {message}")]
    Consumer {
        /// The consumer name.
        consumer: String,
        /// The JetStream error.
        message: String,
    },
    /// Redis could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A definition does not serialize.
    #[error("definition: {0}")]
    Definition(#[from] serde_json::Error),
    /// The HTTP endpoint could not bind.
    #[error("http endpoint: {0}")]
    Http(std::io::Error),
}

/// Serves `tools` until `shutdown` is cancelled, then stops pulling, lets in-flight calls
/// finish within the grace period, hands back (NAK) the calls still running when it runs
/// out, withdraws the worker from the registry and flushes.
///
/// The HTTP endpoint answers from the start: `/readyz` names the step start-up is in
/// ("connecting to NATS", ...), and fails from the shutdown request on; `/healthz` fails
/// when a tool's pull loop died.
pub async fn run(
    config: WorkerConfig,
    tools: Vec<Tool>,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let mut served = serve_list(tools, &config)?;
    let started = start_process("toolfleet-worker", config.http_addr)
        .await
        .map_err(WorkerError::Http)?;
    let (health, metrics) = (started.health, started.metrics);
    let _stop_http_on_exit = started.guard;
    let names = Names::new(config.prefix.clone());
    let name = format!("toolfleet-worker {}", config.worker_id);
    let credentials = &config.nats_credentials;
    let nats = match connect_nats(
        &config.nats_url,
        credentials,
        name,
        metrics.clone(),
        &shutdown,
    )
    .await?
    {
        Some(nats) => nats,
        None => return Ok(()),
    };
    health.set_phase("creating consumers");
    let js = jetstream::new(nats.clone());
    let (jobs_stream, _) = ensure_streams(&js, &names).await?;
    let mut consumers = Vec::with_capacity(served.len());
    for tool in &mut served {
        let (consumer, bound) =
            consumers::bind(&jobs_stream, &names, &tool.tool, config.ack_wait).await?;
        tool.bound = bound;
        consumers.push(consumer);
    }
    let served: Vec<_> = served.into_iter().map(Arc::new).collect();
    health.set_phase("connecting to Redis");
    let (registration, redis) = register(&config, &names, &served, &nats).await?;
    let shared = Arc::new(Shared {
        nats: nats.clone(),
        js,
        names: names.clone(),
        worker_id: config.worker_id.clone(),
        server: toolfleet_common::telemetry::server_of(&config.nats_url),
        max_result_bytes: config.max_result_bytes,
        metrics,
        abandon: CancellationToken::new(),
    });
    let refusals = registry::Refusals::default();
    health.set_readiness(readiness(&shared, redis, &served, refusals.clone()));
    let (loops, calls) = start_loops(&config, &shared, &health, served, consumers, &shutdown);
    let heartbeat_stop = CancellationToken::new();
    let heartbeat = spawn_heartbeat(
        registration,
        config.heartbeat,
        shared.metrics.clone(),
        refusals,
        heartbeat_stop.clone(),
    );

    shutdown.cancelled().await;
    health.start_draining();
    let grace_ends = tokio::time::Instant::now() + config.shutdown_grace;
    info!("worker stopping: no new jobs");
    loops.wait().await;
    drain_calls(&shared, &calls, grace_ends).await;
    heartbeat_stop.cancel();
    if let Ok(mut registration) = heartbeat.await {
        if let Err(error) = registration.withdraw().await {
            warn!(%error, "could not withdraw from the registry");
        }
    }
    let _ = nats.publish(names.registry_changed(), "".into()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), nats.flush()).await;
    info!("worker stopped");
    Ok(())
}

/// Announces the tools in Redis (one beat) and tells the coordinators; the registration
/// and a Redis connection for the readiness check.
async fn register(
    config: &WorkerConfig,
    names: &Names,
    served: &[Arc<ServedTool>],
    nats: &async_nats::Client,
) -> Result<(Registration, redis::aio::ConnectionManager), WorkerError> {
    let redis_client = redis::Client::open(config.redis_url.as_str())?;
    let redis = redis::aio::ConnectionManager::new(redis_client).await?;
    let definitions: Vec<_> = served.iter().map(|t| t.tool.definition().clone()).collect();
    let ttl_ms = u64::try_from((config.heartbeat * 3).as_millis()).unwrap_or(u64::MAX);
    let mut registration = Registration::new(
        redis.clone(),
        names.clone(),
        config.worker_id.clone(),
        &definitions,
        ttl_ms,
    )?;
    registration.beat().await?;
    let _ = nats.publish(names.registry_changed(), "".into()).await;
    info!(worker_id = %config.worker_id, tools = definitions.len(), "worker serving");
    Ok((registration, redis))
}

/// Ready when NATS is connected, Redis answers, every tool's consumer exists and no
/// tool's definition is refused by the coordinators.
fn readiness(
    shared: &Shared,
    redis: redis::aio::ConnectionManager,
    served: &[Arc<ServedTool>],
    refusals: registry::Refusals,
) -> toolfleet_common::http::Readiness {
    let names = &shared.names;
    let consumers = served
        .iter()
        .map(|t| {
            (
                names.jobs_stream(),
                names.tool_consumer(&t.tool.definition().name),
            )
        })
        .collect();
    let connected = toolfleet_common::ready::readiness(
        shared.nats.clone(),
        redis,
        toolfleet_common::ready::Needs {
            streams: Vec::new(),
            consumers,
        },
    );
    Arc::new(move || {
        let (connected, refusals) = (Arc::clone(&connected), refusals.clone());
        Box::pin(async move {
            match refusals.not_ready() {
                Some(why) => Err(why),
                None => connected().await,
            }
        })
    })
}

/// Starts, supervised until `shutdown`, one pull loop per tool (its calls on the
/// returned call tracker) and the watch that recreates lost tool consumers; the loops'
/// tracker (closed) and the calls' tracker.
fn start_loops(
    config: &WorkerConfig,
    shared: &Arc<Shared>,
    health: &Health,
    served: Vec<Arc<ServedTool>>,
    consumers: Vec<consumer::PullConsumer>,
    shutdown: &CancellationToken,
) -> (TaskTracker, TaskTracker) {
    let names = &shared.names;
    let needed = served
        .iter()
        .map(|t| {
            Needed::Consumer(
                names.jobs_stream(),
                consumers::config(names, &t.tool, config.ack_wait),
            )
        })
        .collect();
    let (loops, calls) = (TaskTracker::new(), TaskTracker::new());
    for (tool, consumer) in served.into_iter().zip(consumers) {
        let tool_name = tool.tool.definition().name.clone();
        shared
            .metrics
            .worker_capacity(&tool_name, config.concurrency);
        let serve = serve_tool(
            Arc::clone(shared),
            tool,
            consumer,
            config.concurrency,
            shutdown.clone(),
            calls.clone(),
        );
        health.supervise(&loops, "pull_loop", shutdown, serve);
    }
    let watch = topology::watch(
        shared.js.clone(),
        needed,
        config.topology_check,
        shared.metrics.clone(),
        shutdown.clone(),
    );
    health.supervise(&loops, "topology", shutdown, watch);
    loops.close();
    (loops, calls)
}

/// Checks `tools` (names usable and unique, output schemas compile) and pairs each with
/// its compiled output schema and the consumer settings it asks for (replaced by the
/// bound consumer's once bound).
fn serve_list(tools: Vec<Tool>, config: &WorkerConfig) -> Result<Vec<ServedTool>, WorkerError> {
    if tools.is_empty() {
        return Err(WorkerError::Tools("no tools to serve".into()));
    }
    let mut seen = HashSet::new();
    let mut served = Vec::with_capacity(tools.len());
    for tool in tools {
        let def = tool.definition();
        validate_tool_name(&def.name)?;
        if !seen.insert(def.name.clone()) {
            return Err(WorkerError::Tools(format!(
                "tool {} registered twice",
                def.name
            )));
        }
        let output =
            output::OutputCheck::compile(def.output_schema.as_ref()).map_err(|message| {
                WorkerError::OutputSchema {
                    tool: def.name.clone(),
                    message,
                }
            })?;
        let names = Names::new(config.prefix.clone());
        let bound = consumers::Bound::wanted(&names, &tool, config.ack_wait);
        served.push(ServedTool {
            tool,
            output,
            bound,
        });
    }
    Ok(served)
}

/// Beats every `period` until `stop`, reading the coordinators' refusals into
/// `refusals` after each beat; then hands the registration back for withdrawal.
fn spawn_heartbeat(
    mut registration: Registration,
    period: Duration,
    metrics: toolfleet_common::metrics::FleetMetrics,
    refusals: registry::Refusals,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Registration> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(period) => {
                    if let Err(error) = registration.beat().await {
                        metrics.redis_error("heartbeat");
                        warn!(%error, "heartbeat failed");
                    } else if let Err(error) = registration.read_refusals(&refusals).await {
                        warn!(%error, "reading the coordinators' refusals failed");
                    }
                }
            }
        }
        registration
    })
}

/// Lets in-flight calls finish until `grace_ends` (the shutdown request plus the grace);
/// then hands the rest back (NAK) so another worker takes them at once instead of after
/// the ack wait.
async fn drain_calls(shared: &Shared, calls: &TaskTracker, grace_ends: tokio::time::Instant) {
    calls.close();
    if tokio::time::timeout_at(grace_ends, calls.wait())
        .await
        .is_ok()
    {
        return;
    }
    warn!("in-flight calls did not finish within the grace period; handing them back");
    shared.abandon.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), calls.wait()).await;
}
