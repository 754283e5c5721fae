//! The whole life of a worker process in one call, [`serve`] — settings from the
//! environment, telemetry (logs, `/metrics`, OTLP when built with it), SIGTERM/Ctrl-C
//! handling, [`crate::run`] (which binds HTTP before it announces itself, and drains and
//! withdraws on shutdown), then a telemetry flush. It owns process wiring only; serving
//! tools belongs to [`crate::run`].

use toolfleet_common::telemetry::{self, TelemetryConfig};

use crate::{Tool, WorkerConfig};

/// What stopped [`serve`]: bad settings, telemetry that could not start, or the worker's
/// own error.
pub type ServeError = Box<dyn std::error::Error + Send + Sync>;

/// Serves `tools` until SIGTERM or Ctrl-C, with settings from the environment
/// (`TOOLFLEET_*`, `OTEL_*`, `RUST_LOG`; the service is named `OTEL_SERVICE_NAME`, else
/// `toolfleet-worker`). On the signal it stops pulling, lets in-flight calls finish within
/// the grace, withdraws from the registry and flushes telemetry.
///
/// ```no_run
/// # async fn demo(tools: Vec<toolfleet_worker::Tool>) -> Result<(), toolfleet_worker::ServeError> {
/// toolfleet_worker::serve(tools).await
/// # }
/// ```
pub async fn serve(tools: Vec<Tool>) -> Result<(), ServeError> {
    let config = WorkerConfig::from_env()?;
    let telemetry = telemetry::init(&TelemetryConfig::from_env("toolfleet-worker")?)?;
    let shutdown = toolfleet_common::shutdown::on_signal();
    let outcome = crate::run(config, tools, shutdown).await;
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    Ok(outcome?)
}
