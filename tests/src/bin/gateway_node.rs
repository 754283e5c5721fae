//! `gateway-node`: the HTTP gateway configured from the environment, as
//! `toolfleet-gateway` runs it, so tests drive a real gateway process.

use toolfleet_common::telemetry::{self, TelemetryConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut config = TelemetryConfig::from_env("toolfleet-gateway")?;
    config.always_trace = true;
    let telemetry = telemetry::init(&config)?;
    let gateway = toolfleet_gateway::GatewayConfig::from_env()?;
    let outcome = toolfleet_gateway::run(gateway, toolfleet_common::shutdown::on_signal()).await;
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    Ok(outcome?)
}
