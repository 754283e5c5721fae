//! One fleet component per process: `toolfleet coordinator` and `toolfleet worker`
//! (hidden commands), configured by the same `TOOLFLEET_*` variables as the dedicated
//! binaries. `toolfleet-dev bench` starts them as child processes (its own hidden
//! commands of the same names), so each has its own telemetry.
//!
//! Owns only turning flags and environment into a config and stopping on SIGTERM or
//! Ctrl-C. It must never start servers or other processes, and never configure a node
//! differently from the dedicated binaries.

use anyhow::{Context, Result};
use tokio_util::sync::CancellationToken;
use toolfleet_coordinator::CoordinatorConfig;
use toolfleet_worker::WorkerConfig;

use crate::process::FleetArgs;

/// The hidden commands that run one fleet component in this process, the same in
/// `toolfleet` and `toolfleet-dev`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum NodeCommand {
    /// Run a coordinator configured by the environment until SIGTERM.
    #[command(hide = true)]
    Coordinator,
    /// Run a worker configured by the environment until SIGTERM.
    #[command(hide = true)]
    Worker {
        /// Tool packs to serve.
        #[arg(long, value_delimiter = ',', default_value = "test")]
        packs: Vec<String>,
    },
}

impl NodeCommand {
    /// The service its telemetry reports, that of the dedicated binary.
    pub fn service(&self) -> &'static str {
        match self {
            Self::Coordinator => "toolfleet-coordinator",
            Self::Worker { .. } => "toolfleet-worker",
        }
    }

    /// Runs the component on the fleet `fleet` names until SIGTERM or Ctrl-C.
    pub async fn run(self, fleet: &FleetArgs) -> Result<()> {
        match self {
            Self::Coordinator => coordinator(&fleet.nats, &fleet.redis, &fleet.prefix).await,
            Self::Worker { packs } => {
                worker(&fleet.nats, &fleet.redis, &fleet.prefix, &packs).await
            }
        }
    }
}

/// Runs a coordinator until SIGTERM or Ctrl-C.
pub async fn coordinator(nats_url: &str, redis_url: &str, prefix: &str) -> Result<()> {
    let config = CoordinatorConfig {
        nats_url: nats_url.to_string(),
        redis_url: redis_url.to_string(),
        prefix: prefix.to_string(),
        ..CoordinatorConfig::from_env()?
    };
    toolfleet_coordinator::run(config, stop_on_signal())
        .await
        .context("coordinator failed")
}

/// Runs a worker serving `pack_names` until SIGTERM or Ctrl-C, its packs started as
/// the `toolfleet-worker` binary starts them (the `mcp` pack included).
pub async fn worker(
    nats_url: &str,
    redis_url: &str,
    prefix: &str,
    pack_names: &[String],
) -> Result<()> {
    let config = WorkerConfig {
        nats_url: nats_url.to_string(),
        redis_url: redis_url.to_string(),
        prefix: prefix.to_string(),
        ..WorkerConfig::from_env()?
    };
    let names: Vec<&str> = pack_names.iter().map(String::as_str).collect();
    let settings = toolfleet_packs::PackSettings::from_env(&config)?;
    let packs = toolfleet_packs::start_packs(&names, &settings).await?;
    let outcome = toolfleet_worker::run_set(config, packs.tools.clone(), stop_on_signal())
        .await
        .context("worker failed");
    packs.stop().await;
    outcome
}

/// A token cancelled by the first SIGTERM or Ctrl-C.
pub fn stop_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            if let Ok(mut term) = signal(SignalKind::terminate()) {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                cancel.cancel();
                return;
            }
        }
        let _ = tokio::signal::ctrl_c().await;
        cancel.cancel();
    });
    token
}
