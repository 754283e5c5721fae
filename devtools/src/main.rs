//! `toolfleet-dev`: the developer tools of the fleet, kept out of the `toolfleet` command
//! users install: `bench` (what the fleet adds on top of the tools, against the NATS and
//! Redis floor) and `chaos` (turns in flight while processes are killed and restarted).
//!
//! Owns the tools' command line and telemetry set-up of this process. Fleet logic stays
//! in the coordinator, worker, packs and gateway crates; the hidden `coordinator`,
//! `worker` and `gateway` commands run them exactly as `toolfleet`'s commands of the same
//! names do (`toolfleet_cli::node`), so the processes under measurement are the shipped
//! code.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | `bench` | the benchmark: overhead against the floor, throughput, scaling, memory |
//! | `chaos` | turns in flight while processes are killed and restarted; what was lost |
//! | `toolfleet_dev::cluster` (the library) | local NATS and Redis clusters and their faults |
//! | `toolfleet_dev::upstream` (the library) | the scripted model server of the `openai` phase |

mod bench;
mod chaos;

use anyhow::Result;
use clap::{Parser, Subcommand};
use toolfleet_cli::node;
use toolfleet_common::config::{DEFAULT_NATS_URL, DEFAULT_REDIS_URL};
use toolfleet_common::names::DEFAULT_PREFIX;
use toolfleet_common::telemetry::{self, TelemetryConfig};

#[derive(Parser)]
#[command(
    name = "toolfleet-dev",
    version,
    about = "toolfleet's developer tools: the benchmark and the chaos run"
)]
struct Cli {
    /// NATS URL.
    #[arg(long, global = true, env = "TOOLFLEET_NATS_URL", default_value = DEFAULT_NATS_URL)]
    nats: String,
    /// Redis URL.
    #[arg(long, global = true, env = "TOOLFLEET_REDIS_URL", default_value = DEFAULT_REDIS_URL)]
    redis: String,
    /// Subject and key prefix.
    #[arg(long, global = true, env = "TOOLFLEET_PREFIX", default_value = DEFAULT_PREFIX)]
    prefix: String,
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
    /// Run a coordinator configured by the environment until SIGTERM.
    #[command(hide = true)]
    Coordinator,
    /// Run the HTTP gateway configured by the environment until SIGTERM.
    #[command(hide = true)]
    Gateway,
    /// Run a worker configured by the environment until SIGTERM.
    #[command(hide = true)]
    Worker {
        /// Tool packs to serve.
        #[arg(long, value_delimiter = ',', default_value = "test")]
        packs: Vec<String>,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let (service, fleet_node) = match cli.command {
        Command::Coordinator => ("toolfleet-coordinator", true),
        Command::Worker { .. } => ("toolfleet-worker", true),
        Command::Gateway => ("toolfleet-gateway", false),
        _ => ("toolfleet-dev", false),
    };
    let mut telemetry_config = TelemetryConfig::from_env(service)?;
    if std::env::var_os("RUST_LOG").is_none() {
        telemetry_config.log_filter = "warn".into();
    }
    telemetry_config.always_trace = !fleet_node;
    // A coordinator ends a turn's trace with the `turn` span.
    if service == "toolfleet-coordinator" {
        telemetry_config.closing_span = Some(toolfleet_common::names::spans::TURN);
    }
    let telemetry = telemetry::init(&telemetry_config)?;
    // On a runtime thread, not the thread that blocks on `main`: a message for the
    // bench's turn loop then wakes a runtime thread, not the main thread and then a
    // runtime thread for each task it spawns.
    let outcome = match tokio::spawn(run(cli)).await {
        Ok(outcome) => outcome,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => Err(error.into()),
    };
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    outcome
}

async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Bench(args) => bench::run(&cli.nats, &cli.redis, &cli.prefix, args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Coordinator => node::coordinator(&cli.nats, &cli.redis, &cli.prefix).await,
        Command::Gateway => node::gateway(&cli.nats, &cli.prefix).await,
        Command::Worker { packs } => node::worker(&cli.nats, &cli.redis, &cli.prefix, &packs).await,
    }
}
