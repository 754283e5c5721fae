//! What the fleet's command-line programs (`toolfleet`, `toolfleet-dev`) do around their
//! command: the global flags that say where the fleet is ([`FleetArgs`]), and telemetry
//! set up before the command and flushed after it ([`telemetry_config`], [`run_traced`]).
//!
//! Owns no command and no fleet logic: each program matches its own commands and says
//! which service a command runs as.

use std::future::Future;

use anyhow::Result;
use toolfleet_common::config::{DEFAULT_NATS_URL, DEFAULT_REDIS_URL};
use toolfleet_common::names::DEFAULT_PREFIX;
use toolfleet_common::telemetry::{self, TelemetryConfig};

/// Where the fleet is: the NATS and Redis URLs and the subject and key prefix, flags of
/// every subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct FleetArgs {
    /// NATS URL.
    #[arg(long, global = true, env = "TOOLFLEET_NATS_URL", default_value = DEFAULT_NATS_URL)]
    pub nats: String,
    /// Redis URL (for commands that start a local fleet).
    #[arg(long, global = true, env = "TOOLFLEET_REDIS_URL", default_value = DEFAULT_REDIS_URL)]
    pub redis: String,
    /// Subject and key prefix.
    #[arg(long, global = true, env = "TOOLFLEET_PREFIX", default_value = DEFAULT_PREFIX)]
    pub prefix: String,
}

/// The telemetry of a command running as `service`: logs at `warn` unless `RUST_LOG`
/// says otherwise; every trace kept unless it is a `fleet_node` (a coordinator or worker,
/// which sample as configured); with `runs_coordinator`, a turn's trace ends with the
/// coordinator's `turn` span.
pub fn telemetry_config(
    service: &str,
    fleet_node: bool,
    runs_coordinator: bool,
) -> Result<TelemetryConfig> {
    let mut config = TelemetryConfig::from_env(service)?;
    if std::env::var_os("RUST_LOG").is_none() {
        config.log_filter = "warn".into();
    }
    config.always_trace = !fleet_node;
    if runs_coordinator {
        config.closing_span = Some(toolfleet_common::names::spans::TURN);
    }
    Ok(config)
}

/// Runs `command` with telemetry set up as `config` says, then flushes it; a panic of
/// the command goes on here.
pub async fn run_traced<F>(config: &TelemetryConfig, command: F) -> Result<()>
where
    F: Future<Output = Result<()>> + Send + 'static,
{
    let telemetry = telemetry::init(config)?;
    // On a runtime thread, not the thread that blocks on `main`: a message for the
    // command's loops (a bench's turn loop, a frontend's stream) then wakes a runtime
    // thread, not the main thread and then a runtime thread for each task it spawns.
    let outcome = match tokio::spawn(command).await {
        Ok(outcome) => outcome,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => Err(error.into()),
    };
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    outcome
}
