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
//! `toolfleet-worker` binary that hosts them live in the `toolfleet-packs` crate: the
//! binary is `packs/src/bin/toolfleet-worker.rs`, the packs are `packs/src/`. Nothing
//! here may depend on a database, an HTTP client or any one pack.
//!
//! | module | what lives there |
//! |---|---|
//! | this file | [`run`] and [`run_set`]: health, connections, draining on shutdown (NAK at the end of the grace), withdrawal; [`WorkerError`] |
//! | [`toolset`] | [`ToolSet`]: the tools served, changeable while the worker runs |
//! | `serving` | keeping the served tools (consumers recreated when lost, pull loops) and the registration and heartbeat in line with the set |
//! | [`tool`] | `Tool`, its builder, `ToolContext`, `ToolOutput`, `ToolError` |
//! | `process` | [`serve`]: a whole worker process (settings, telemetry, signals) in one call |
//! | [`prelude`] | what a tool file needs in one `use` |
//! | [`schema`] | the schemas the model sees, derived from argument and output types |
//! | [`config`] | `WorkerConfig` from environment variables |
//! | [`conformance`] | the conformance probe `toolfleet conformance` drives (PROTOCOL §7.11) |
//! | `consumers` | each tool's durable consumer: created, checked, its delivery settings kept in line with the definition |
//! | [`registry`] | announcing tools and liveness in Redis |
//! | `runner` | pulling jobs, running calls, publishing results, acking |
//! | `keepalive` | the progress acks that keep running jobs from being redelivered, one task for all |
//! | `output` | results checked against the output schema (feature `output-schema`) |
//! | `cache` | Redis result cache for idempotent read-only tools (`ResultCache::wrap`; feature `cache`) |
//!
//! Features: `prometheus` (`/metrics`), `output-schema` (the JSON Schema validator) and
//! `cache` are on by default, as the packs use them; `otlp` and `otlp-grpc` are off.
//!
//! The example in docs/TOOLS.md's "Writing a tool" section is
//! `examples/writing_a_tool.rs` (`cargo run -p toolfleet-worker --example writing_a_tool`).

#[cfg(feature = "cache")]
pub mod cache;
mod cancel;
pub mod config;
pub mod conformance;
mod consumers;
mod keepalive;
mod output;
pub mod prelude;
mod process;
pub mod registry;
mod runner;
pub mod schema;
mod serving;
pub mod tool;
pub mod toolset;

pub use process::{serve, ServeError};
pub use toolfleet_worker_macros::{main, tool, ToolError};

/// The Tokio runtime the worker runs on: a tool that sleeps, times out or does async I/O
/// uses it as `toolfleet_worker::tokio` (`toolfleet_worker::tokio::time::sleep`), so a
/// tool crate needs no `tokio` dependency of its own.
pub use tokio;

/// What the macros' generated code names; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use tokio;
}

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::health::{connect_nats, start_process};
use toolfleet_common::streams::{ensure_streams, EnsureStreamsError};
use toolfleet_common::tool::{validate_tool_name, ToolNameError};
use toolfleet_common::Names;
use tracing::{info, warn};

pub use config::{ConsumerMode, WorkerConfig};
pub use tool::{Tool, ToolContext, ToolError, ToolOutput};
pub use toolset::ToolSet;

use registry::Registration;
use runner::{ServedTool, Shared};
use serving::Serving;

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
    /// A tool's definition is longer than coordinators read
    /// ([`toolfleet_common::tool::MAX_DEFINITION_BYTES`]): they would refuse it.
    #[error("tool {tool}: its definition is {bytes} bytes of JSON, over the bound of {limit} bytes coordinators read (MAX_DEFINITION_BYTES): shorten its description or schemas")]
    DefinitionTooLarge {
        /// The tool.
        tool: String,
        /// The definition's JSON length.
        bytes: usize,
        /// The bound.
        limit: usize,
    },
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
    /// A NATS subscription could not be made.
    #[error("nats subscription {subject}: {message}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// The client's error.
        message: String,
    },
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
    if tools.is_empty() {
        return Err(WorkerError::Tools("no tools to serve".into()));
    }
    let mut seen = HashSet::new();
    for tool in &tools {
        let name = &tool.definition().name;
        if !seen.insert(name.clone()) {
            return Err(WorkerError::Tools(format!("tool {name} registered twice")));
        }
        if let Some(kind) = schema::non_object_type(&tool.definition().input_schema) {
            return Err(WorkerError::Tools(format!(
                "tool {name}: its arguments are a JSON {kind}, but a call's arguments are \
                 always an object: take a struct with named fields, or no arguments at all"
            )));
        }
    }
    run_set(config, ToolSet::new(tools), shutdown).await
}

/// [`run`] for a set of tools that may change while the worker runs: tools added to
/// `tools` are served (consumer, pull loop, registration) from then on, removed ones
/// stop being pulled and are withdrawn from the registry (their running calls finish),
/// replaced ones take every job from then on. The set may be empty. A tool of the set at start that
/// cannot be served is an error; one added later is logged and left out.
pub async fn run_set(
    config: WorkerConfig,
    tools: ToolSet,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let mut changes = tools.subscribe();
    let initial: Vec<Tool> = changes.borrow_and_update().values().cloned().collect();
    for tool in &initial {
        checked(tool.clone(), &config)?;
    }
    let started = start_process("toolfleet-worker", config.http_addr)
        .await
        .map_err(WorkerError::Http)?;
    let (health, metrics) = (started.health, started.metrics);
    let _stop_http_on_exit = started.guard;
    let names = config.names();
    let name = format!("toolfleet-worker {}", config.worker_id);
    let credentials = &config.nats_credentials;
    let nats = match connect_nats(
        &config.nats_url,
        credentials,
        name,
        metrics.clone(),
        &health,
        &shutdown,
    )
    .await?
    {
        Some(nats) => nats,
        None => return Ok(()),
    };
    health.set_phase("creating streams");
    let js = credentials.jetstream(nats.clone());
    let jobs_streams = ensure_streams(&js, &names).await?.jobs;
    // Cancelled turns: followed before any job is taken.
    let cancellations = cancel::follow_cancelled(&nats, &names).await?;
    let Some((redis, registration)) = connect_registry(&config, &names, &health, &shutdown).await?
    else {
        return Ok(());
    };
    let shared = Arc::new(Shared {
        nats: nats.clone(),
        js,
        names: names.clone(),
        worker_id: config.worker_id.clone(),
        server: toolfleet_common::telemetry::server_of(&config.nats_url),
        max_result_bytes: config.max_result_bytes,
        running_after: config.running_after,
        metrics,
        abandon: CancellationToken::new(),
        cancellations: cancellations.clone(),
        failover: toolfleet_common::failover::Failover::for_urls(&nats, &config.nats_url),
        keepalives: Default::default(),
    });
    let keepalive_stop = CancellationToken::new();
    // Aborted when dropped: a start that fails further on leaves no task behind.
    let keepalive = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
        Arc::clone(&shared.keepalives).run(keepalive_stop.clone()),
    ));
    let mut serving = Serving::new(
        config.clone(),
        Arc::clone(&shared),
        health.clone(),
        jobs_streams,
        redis,
        registration,
        shutdown.clone(),
    );
    health.set_phase("creating consumers");
    for tool in initial {
        serving.add(tool).await?;
    }
    serving.announce().await?;
    info!(worker_id = %config.worker_id, "worker serving");
    let (loops, calls) = (serving.loops.clone(), serving.calls.clone());
    let heartbeat_stop = CancellationToken::new();
    let heartbeat = tokio::spawn(serving.run(changes, heartbeat_stop.clone()));

    shutdown.cancelled().await;
    health.start_draining();
    let grace_ends = tokio::time::Instant::now() + config.shutdown_grace;
    info!("worker stopping: no new jobs");
    loops.close();
    loops.wait().await;
    drain_calls(&shared, &calls, grace_ends).await;
    keepalive_stop.cancel();
    let _ = keepalive.await;
    heartbeat_stop.cancel();
    withdraw(heartbeat, &nats, &names).await;
    info!("worker stopped");
    Ok(())
}

/// The Redis connection of `config` and the worker's registration in the tool registry
/// (its liveness entries live 3 heartbeats). Redis is retried until it answers, with
/// readiness naming the step and the last failure; `None` when `shutdown` came first.
async fn connect_registry(
    config: &WorkerConfig,
    names: &Names,
    health: &toolfleet_common::health::Health,
    shutdown: &CancellationToken,
) -> Result<
    Option<(
        toolfleet_common::redis_client::RedisConnection,
        Registration,
    )>,
    WorkerError,
> {
    let connecting = toolfleet_common::health::connect_redis(
        &config.redis_url,
        toolfleet_common::redis_client::RedisOptions::with_tls(config.redis_tls.clone()),
        health,
        shutdown,
    );
    let Some(redis) = connecting.await.map_err(redis::RedisError::from)? else {
        return Ok(None);
    };
    let ttl_ms = u64::try_from((config.heartbeat * 3).as_millis()).unwrap_or(u64::MAX);
    let registration = Registration::new(
        redis.clone(),
        names.clone(),
        config.worker_id.clone(),
        &toolfleet_common::redis_client::RedisTarget::parse(&config.redis_url)
            .map(|target| target.username())
            .unwrap_or_default(),
        &[],
        ttl_ms,
    )?;
    Ok(Some((redis, registration)))
}

/// Once the heartbeat task has stopped: removes this worker's liveness entries, tells
/// the coordinators (`registry.changed`) and flushes the connection.
async fn withdraw(
    heartbeat: tokio::task::JoinHandle<Registration>,
    nats: &async_nats::Client,
    names: &Names,
) {
    if let Ok(mut registration) = heartbeat.await {
        if let Err(error) = registration.withdraw().await {
            warn!(%error, "could not withdraw from the registry");
        }
    }
    let _ = nats.publish(names.registry_changed(), "".into()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), nats.flush()).await;
}

/// Checks `tool` (name usable, definition within the bound coordinators read, output
/// schema compiles) and pairs it with its compiled
/// output schema and the consumer settings it asks for (replaced by the bound
/// consumer's once bound).
fn checked(tool: Tool, config: &WorkerConfig) -> Result<ServedTool, WorkerError> {
    let def = tool.definition();
    validate_tool_name(&def.name)?;
    let bytes = serde_json::to_string(def)?.len();
    let limit = toolfleet_common::tool::MAX_DEFINITION_BYTES;
    if bytes > limit {
        return Err(WorkerError::DefinitionTooLarge {
            tool: def.name.clone(),
            bytes,
            limit,
        });
    }
    let output = output::OutputCheck::compile(def.output_schema.as_ref()).map_err(|message| {
        WorkerError::OutputSchema {
            tool: def.name.clone(),
            message,
        }
    })?;
    Ok(ServedTool {
        output,
        bound: consumers::Bound::wanted(&config.names(), &tool, config.ack_wait),
        tool,
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn described(description: String) -> Tool {
        Tool::builder("t.described", description).handler(
            |_ctx: ToolContext, args: Value| async move { Ok::<_, ToolError>(ToolOutput::new(args)) },
        )
    }

    #[tokio::test]
    async fn a_definition_over_the_bound_is_refused_at_start() {
        let limit = toolfleet_common::tool::MAX_DEFINITION_BYTES;
        assert!(checked(described("fits".into()), &WorkerConfig::local()).is_ok());
        let started = tokio::time::timeout(
            Duration::from_secs(5),
            run(
                WorkerConfig::local(),
                vec![described("x".repeat(limit))],
                CancellationToken::new(),
            ),
        )
        .await;
        match started {
            Ok(Err(WorkerError::DefinitionTooLarge {
                tool,
                bytes,
                limit: bound,
            })) => {
                assert_eq!(tool, "t.described");
                assert!(bytes > limit && bound == limit);
            }
            other => panic!("an oversize definition was not refused at start: {other:?}"),
        }
    }
}
