//! `toolfleet-coordinator`: reads its configuration from the environment, sets up
//! telemetry and runs until SIGTERM or Ctrl-C.

use anyhow::Context;
use toolfleet_common::shutdown;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_coordinator::CoordinatorConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
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
