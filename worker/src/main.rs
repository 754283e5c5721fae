//! `toolfleet-worker`: serves the tool packs named in `TOOLFLEET_PACKS` (default `demo`)
//! until SIGTERM or Ctrl-C, then drains.

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_worker::{packs, WorkerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = telemetry::init(&TelemetryConfig::from_env("toolfleet-worker")?)?;
    let config = WorkerConfig::from_env()?;
    let packs_setting = std::env::var("TOOLFLEET_PACKS").unwrap_or_else(|_| "demo".into());
    let names: Vec<&str> = packs_setting.split(',').collect();
    let tools = packs::tools_for(&names).map_err(anyhow::Error::msg)?;
    let shutdown = CancellationToken::new();
    {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            shutdown.cancel();
        });
    }
    let outcome = toolfleet_worker::run(config, tools, shutdown)
        .await
        .context("worker failed");
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    outcome
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
