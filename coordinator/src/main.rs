//! `toolfleet-coordinator`: reads its configuration from the environment, sets up
//! telemetry and runs until SIGTERM or Ctrl-C.

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use toolfleet_common::telemetry::{self, TelemetryConfig};
use toolfleet_coordinator::CoordinatorConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = telemetry::init(&TelemetryConfig::from_env("toolfleet-coordinator")?)?;
    let config = CoordinatorConfig::from_env()?;
    let shutdown = CancellationToken::new();
    {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            shutdown.cancel();
        });
    }
    let outcome = toolfleet_coordinator::run(config, shutdown)
        .await
        .context("coordinator failed");
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
