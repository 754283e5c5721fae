//! `fleet-node coordinator|worker`: a coordinator, or a worker with the packs of
//! `FLEET_NODE_PACKS` (default the demo and test packs; `mcp` reads
//! `TOOLFLEET_MCP_SERVERS`), configured from the environment, so tests can kill or
//! signal a real process.

use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let role = std::env::args().nth(1).unwrap_or_default();
    let service = format!("toolfleet-{role}");
    let telemetry =
        toolfleet_common::telemetry::init(&toolfleet_common::telemetry::TelemetryConfig {
            // A coordinator's spans of a turn end with its `turn` span.
            closing_span: (role == "coordinator").then_some(toolfleet_common::names::spans::TURN),
            ..toolfleet_common::telemetry::TelemetryConfig::from_env(&service)?
        })?;
    let shutdown = CancellationToken::new();
    {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            shutdown.cancel();
            Ok::<_, std::io::Error>(())
        });
    }
    match role.as_str() {
        "coordinator" => {
            let config = toolfleet_coordinator::CoordinatorConfig::from_env()?;
            toolfleet_coordinator::run(config, shutdown).await?;
        }
        "worker" => {
            let config = toolfleet_worker::WorkerConfig::from_env()?;
            let packs = std::env::var("FLEET_NODE_PACKS").unwrap_or_else(|_| "demo,test".into());
            let names: Vec<&str> = packs.split(',').collect();
            let settings = toolfleet_packs::PackSettings::from_env(&config)?;
            let packs = toolfleet_packs::start_packs(&names, &settings).await?;
            let outcome = toolfleet_worker::run_set(config, packs.tools.clone(), shutdown).await;
            packs.stop().await;
            outcome?;
        }
        other => anyhow::bail!("usage: fleet-node coordinator|worker (got {other:?})"),
    }
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    Ok(())
}
