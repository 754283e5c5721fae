//! `toolfleet-worker`: serves the tool packs named in `TOOLFLEET_PACKS` (default `demo`).

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use toolfleet_worker::{packs, WorkerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let config = WorkerConfig::from_env()?;
    let packs_setting = std::env::var("TOOLFLEET_PACKS").unwrap_or_else(|_| "demo".into());
    let names: Vec<&str> = packs_setting.split(',').collect();
    let tools = packs::tools_for(&names).map_err(anyhow::Error::msg)?;
    let shutdown = CancellationToken::new();
    tokio::spawn(shutdown_on_signal(shutdown.clone()));
    toolfleet_worker::run(config, tools, shutdown)
        .await
        .context("worker failed")
}

async fn shutdown_on_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    shutdown.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    shutdown.cancel();
}
