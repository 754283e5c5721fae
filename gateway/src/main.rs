//! `toolfleet-gateway`: the HTTP gateway, configured by the environment, until SIGTERM
//! or Ctrl-C.

use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_gateway::GatewayConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut telemetry_config = TelemetryConfig::from_env("toolfleet-gateway")?;
    // Responses carry the server span's traceparent even when nothing is exported.
    telemetry_config.always_trace = true;
    let telemetry = telemetry::init(&telemetry_config)?;
    let config = GatewayConfig::from_env()?;
    let outcome = toolfleet_gateway::run(config, toolfleet_common::shutdown::on_signal()).await;
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    Ok(outcome?)
}
