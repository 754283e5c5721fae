//! The `toolfleet-worker` binary: the worker process that serves the built-in tool packs
//! of this crate (`toolfleet-packs`), named in `TOOLFLEET_PACKS` (default `demo`), until
//! SIGTERM or Ctrl-C, then drains, then stops what the packs run (MCP servers). Its only
//! arguments are `--help` and `--version`; any other is refused before anything starts.
//!
//! The worker SDK it runs on is the `toolfleet-worker` library (`worker/`); this file
//! only wires settings, telemetry and the packs' tools into the SDK's `run_set`, and
//! must never hold tool logic of its own.

use anyhow::Context;
use toolfleet_common::config::{DEFAULT_NATS_URL, DEFAULT_REDIS_URL};
use toolfleet_common::names::DEFAULT_PREFIX;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_packs::{PACKS, PACKS_ENV};
use toolfleet_worker::WorkerConfig;

/// What `--help` says above the usage.
fn help() -> String {
    let packs = PACKS.join(", ");
    format!(
        "\
toolfleet-worker: a toolfleet worker, serving the built-in tool packs named in
{PACKS_ENV}. It registers their tools in Redis, runs the calls the coordinators
dispatch over NATS JetStream and publishes their results, until SIGTERM or Ctrl-C,
then drains.

Settings come from environment variables only; the main ones:
  {PACKS_ENV}         packs to serve, comma-separated (default demo: sample tools and
                          data, not for production), of:
                          {packs}
  TOOLFLEET_NATS_URL      NATS server(s), comma-separated (default {DEFAULT_NATS_URL})
  TOOLFLEET_REDIS_URL     Redis: one server or a cluster (default {DEFAULT_REDIS_URL})
  TOOLFLEET_PREFIX        prefix of every subject, stream and key (default {DEFAULT_PREFIX})
  TOOLFLEET_DATABASE_URL  PostgreSQL of the receptionist and crm-db packs
  TOOLFLEET_WORKER_CONCURRENCY  calls of one tool run at once (default 8)
  TOOLFLEET_HTTP_ADDR     health and metrics, /healthz /readyz /metrics
                          (default 0.0.0.0:9091; off disables)
  TOOLFLEET_LOG_FORMAT    text or json (default text)
  OTEL_EXPORTER_OTLP_ENDPOINT  OTLP export of traces and metrics (default none)
Every setting and its default: docs/CONFIGURATION.md; the packs: docs/TOOLS.md; the
allowed ranges and what the health endpoints answer: docs/OPERATIONS.md (Settings
ranges, Health endpoints)."
    )
}

fn main() -> anyhow::Result<()> {
    // First of all: `--help` or a typo never starts telemetry, a runtime, a connection
    // or a pack.
    toolfleet_common::args::server_args("toolfleet-worker", env!("CARGO_PKG_VERSION"), &help())
        .exit_unless_run();
    serve()
}

#[tokio::main]
async fn serve() -> anyhow::Result<()> {
    let telemetry = telemetry::init(&TelemetryConfig::from_env("toolfleet-worker")?)?;
    let config = WorkerConfig::from_env()?;
    let packs_setting = toolfleet_packs::packs_from_env()?;
    let names: Vec<&str> = packs_setting.iter().map(String::as_str).collect();
    let settings = toolfleet_packs::PackSettings::from_env(&config)?;
    let packs = toolfleet_packs::start_packs(&names, &settings).await?;
    // The packs served, on the start line: a worker left on the default serves `demo`.
    tracing::info!(packs = %names.join(","), "worker starting");
    let shutdown = toolfleet_common::shutdown::on_signal();
    let outcome = toolfleet_worker::run_set(config, packs.tools.clone(), shutdown)
        .await
        .context("worker failed");
    packs.stop().await;
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    outcome
}
