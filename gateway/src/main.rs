//! `toolfleet-gateway`: the HTTP gateway, configured by the environment, until SIGTERM
//! or Ctrl-C. Its only arguments are `--help` and `--version`; any other is refused
//! before anything starts.

use toolfleet_common::config::DEFAULT_NATS_URL;
use toolfleet_common::names::DEFAULT_PREFIX;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_gateway::config::{DEFAULT_ADDR, DEFAULT_DATABASE_URL};
use toolfleet_gateway::GatewayConfig;

/// What `--help` says above the usage.
fn help() -> String {
    format!(
        "\
toolfleet-gateway: the toolfleet HTTP gateway. It takes turns over HTTP (Server-Sent
Events or JSON, an OpenAI-style /v1/chat/completions, MCP at /mcp) from clients holding an
API key, which fixes their tenant, and hands them to the fleet over NATS, until SIGTERM
or Ctrl-C.

Settings come from environment variables only; the main ones:
  TOOLFLEET_GATEWAY_ADDR  the API, with /healthz and /readyz (default {DEFAULT_ADDR})
  TOOLFLEET_NATS_URL      NATS server(s), comma-separated (default {DEFAULT_NATS_URL})
  TOOLFLEET_PREFIX        prefix of every subject, stream and key (default {DEFAULT_PREFIX})
  TOOLFLEET_DATABASE_URL  PostgreSQL holding the API keys
                          (default {DEFAULT_DATABASE_URL})
  TOOLFLEET_HTTP_ADDR     metrics, /healthz /readyz /metrics on a port of their own
                          (default off)
  TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET  signs stream tokens, the same on every replica
                          (required unless TOOLFLEET_GATEWAY_ADDR is a loopback address)
  TOOLFLEET_UPSTREAM_BASE_URL  the model server of /v1/chat/completions (default none)
  TOOLFLEET_LOG_FORMAT    text or json (default text)
  OTEL_EXPORTER_OTLP_ENDPOINT  OTLP export of traces and metrics (default none)
Every setting and its default: docs/CONFIGURATION.md; the allowed ranges and what the
health endpoints answer: docs/OPERATIONS.md (Settings ranges, Health endpoints); the API:
docs/FRONTENDS.md."
    )
}

fn main() -> anyhow::Result<()> {
    // First of all: `--help` or a typo never starts telemetry, a runtime or a connection.
    toolfleet_common::args::server_args("toolfleet-gateway", env!("CARGO_PKG_VERSION"), &help())
        .exit_unless_run();
    serve()
}

#[tokio::main]
async fn serve() -> anyhow::Result<()> {
    let mut telemetry_config = TelemetryConfig::from_env("toolfleet-gateway")?;
    // Responses carry the server span's traceparent even when nothing is exported.
    telemetry_config.always_trace = true;
    let telemetry = telemetry::init(&telemetry_config)?;
    let config = GatewayConfig::from_env()?;
    let outcome = toolfleet_gateway::run(config, toolfleet_common::shutdown::on_signal()).await;
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    Ok(outcome?)
}
