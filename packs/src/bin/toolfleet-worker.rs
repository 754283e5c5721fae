//! The `toolfleet-worker` binary: the worker process that serves the built-in tool packs
//! of this crate (`toolfleet-packs`), named in `TOOLFLEET_PACKS` (default `demo`), until
//! SIGTERM or Ctrl-C, then drains, then stops what the packs run (MCP servers).
//!
//! The worker SDK it runs on is the `toolfleet-worker` library (`worker/`); this file
//! only wires settings, telemetry and the packs' tools into the SDK's `run_set`, and
//! must never hold tool logic of its own.

use anyhow::Context;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_worker::WorkerConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = telemetry::init(&TelemetryConfig::from_env("toolfleet-worker")?)?;
    let config = WorkerConfig::from_env()?;
    let packs_setting = toolfleet_packs::packs_from_env()?;
    let names: Vec<&str> = packs_setting.iter().map(String::as_str).collect();
    let settings = toolfleet_packs::PackSettings::from_env(&config)?;
    let packs = toolfleet_packs::start_packs(&names, &settings).await?;
    let shutdown = toolfleet_common::shutdown::on_signal();
    let outcome = toolfleet_worker::run_set(config, packs.tools.clone(), shutdown)
        .await
        .context("worker failed");
    packs.stop().await;
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    outcome
}
