//! `toolfleet-worker`: serves the tool packs named in `TOOLFLEET_PACKS` (default `demo`)
//! until SIGTERM or Ctrl-C, then drains. It only wires settings, telemetry and the
//! packs' tools into the SDK's `run`; it must never hold tool logic of its own.

use anyhow::Context;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_worker::WorkerConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = telemetry::init(&TelemetryConfig::from_env("toolfleet-worker")?)?;
    let config = WorkerConfig::from_env()?;
    let packs_setting = std::env::var("TOOLFLEET_PACKS").unwrap_or_else(|_| "demo".into());
    let names: Vec<&str> = packs_setting.split(',').collect();
    let tools = toolfleet_packs::tools_for(&names).map_err(anyhow::Error::msg)?;
    let shutdown = toolfleet_common::shutdown::on_signal();
    let outcome = toolfleet_worker::run(config, tools, shutdown)
        .await
        .context("worker failed");
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    outcome
}
