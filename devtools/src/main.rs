//! `toolfleet-dev`: the developer tools of the fleet, kept out of the `toolfleet` command
//! users install: `bench` (what the fleet adds on top of the tools, against the NATS and
//! Redis floor) and `chaos` (turns in flight while processes are killed and restarted).
//!
//! Owns the tools' command line and telemetry set-up of this process. Fleet logic stays
//! in the coordinator, worker, packs and gateway crates; the hidden `coordinator` and
//! `worker` commands run them exactly as `toolfleet`'s commands of the same names do
//! (`toolfleet_cli::node`), and `gateway` as the `toolfleet-gateway` binary does, so the
//! processes under measurement are the shipped code.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | `bench` | the benchmark: overhead against the floor, throughput, scaling, memory |
//! | `chaos` | turns in flight while processes are killed and restarted; what was lost |
//! | `budget` | instructions and Redis commands per turn against `docs/budget.json` (CI) |
//! | `toolfleet_dev::cluster` (the library) | local NATS and Redis clusters and their faults |
//! | `toolfleet_dev::upstream` (the library) | the scripted model server of the `openai` phase |

mod bench;
mod budget;
mod chaos;

use anyhow::Result;
use clap::{Parser, Subcommand};
use toolfleet_cli::node;
use toolfleet_cli::process::{self, FleetArgs};

#[derive(Parser)]
#[command(
    name = "toolfleet-dev",
    version,
    about = "toolfleet's developer tools: the benchmark and the chaos run"
)]
struct Cli {
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure coordination overhead against the NATS/Redis floor, throughput, parallel
    /// speedup, worker scaling and coordinator memory, with tracing export off and on.
    Bench(bench::BenchArgs),
    /// Keep turns in flight on a fleet of its own while workers, coordinators, Redis or
    /// NATS are killed and restarted; count turns lost, late, refused and counted twice.
    Chaos(chaos::ChaosArgs),
    /// Check the instructions and Redis commands per turn against the budget CI holds
    /// every change to (docs/budget.json), or record new figures with `--write`.
    Budget(budget::BudgetArgs),
    /// Run the HTTP gateway configured by the environment until SIGTERM.
    #[command(hide = true)]
    Gateway,
    #[command(flatten)]
    Node(node::NodeCommand),
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let (service, fleet_node) = match &cli.command {
        Command::Node(node) => (node.service(), true),
        Command::Gateway => ("toolfleet-gateway", false),
        _ => ("toolfleet-dev", false),
    };
    // A coordinator ends a turn's trace with the `turn` span.
    let config =
        process::telemetry_config(service, fleet_node, service == "toolfleet-coordinator")?;
    process::run_traced(&config, run(cli)).await
}

async fn run(cli: Cli) -> Result<()> {
    let fleet = &cli.fleet;
    match cli.command {
        Command::Bench(args) => bench::run(&fleet.nats, &fleet.redis, &fleet.prefix, args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Budget(args) => budget::run(args).await,
        Command::Gateway => gateway(&fleet.nats, &fleet.prefix).await,
        Command::Node(node) => node.run(fleet).await,
    }
}

/// The HTTP gateway configured by the environment, on `nats_url` under `prefix`, until
/// SIGTERM: what the `toolfleet-gateway` binary runs.
async fn gateway(nats_url: &str, prefix: &str) -> Result<()> {
    let config = toolfleet_gateway::GatewayConfig {
        nats_url: nats_url.to_string(),
        prefix: prefix.to_string(),
        ..toolfleet_gateway::GatewayConfig::from_env()?
    };
    toolfleet_gateway::run(config, toolfleet_common::shutdown::on_signal()).await?;
    Ok(())
}
