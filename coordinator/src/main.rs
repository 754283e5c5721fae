//! `toolfleet-coordinator`: reads its configuration from the environment, sets up
//! telemetry and runs until SIGTERM or Ctrl-C. Its only arguments are `--help` and
//! `--version`; any other is refused before anything starts.

use anyhow::Context;
use toolfleet_common::config::{DEFAULT_NATS_URL, DEFAULT_REDIS_URL};
use toolfleet_common::names::DEFAULT_PREFIX;
use toolfleet_common::shutdown;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_coordinator::CoordinatorConfig;

/// What `--help` says above the usage.
fn help() -> String {
    format!(
        "\
toolfleet-coordinator: the toolfleet coordinator. It takes turns in over NATS JetStream,
validates them, dispatches their tool calls to the workers, joins the results in Redis and
streams each turn's events back, until SIGTERM or Ctrl-C.

Settings come from environment variables only; the main ones:
  TOOLFLEET_NATS_URL      NATS server(s), comma-separated (default {DEFAULT_NATS_URL})
  TOOLFLEET_REDIS_URL     Redis: one server or a cluster (default {DEFAULT_REDIS_URL})
  TOOLFLEET_PREFIX        prefix of every subject, stream and key (default {DEFAULT_PREFIX})
  TOOLFLEET_TENANTS_FILE  JSON file of per-tenant policies (default none)
  TOOLFLEET_HTTP_ADDR     health and metrics, /healthz /readyz /metrics
                          (default 0.0.0.0:9090; off disables)
  TOOLFLEET_LOG_FORMAT    text or json (default text)
  OTEL_EXPORTER_OTLP_ENDPOINT  OTLP export of traces and metrics (default none)
Every setting and its default: docs/CONFIGURATION.md; the allowed ranges and what the
health endpoints answer: docs/OPERATIONS.md (Settings ranges, Health endpoints)."
    )
}

fn main() -> anyhow::Result<()> {
    // First of all: `--help` or a typo never starts telemetry, a runtime or a connection.
    toolfleet_common::args::server_args(
        "toolfleet-coordinator",
        env!("CARGO_PKG_VERSION"),
        &help(),
    )
    .exit_unless_run();
    serve()
}

#[tokio::main]
async fn serve() -> anyhow::Result<()> {
    let telemetry_config = TelemetryConfig {
        closing_span: Some(toolfleet_common::names::spans::TURN),
        ..TelemetryConfig::from_env("toolfleet-coordinator")?
    };
    let telemetry = telemetry::init(&telemetry_config)?;
    let config = CoordinatorConfig::from_env()?;
    let outcome = toolfleet_coordinator::run(config, shutdown::on_signal())
        .await
        .context("coordinator failed");
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    outcome
}
