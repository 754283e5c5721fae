//! `toolfleet-dev bench`: what the fleet adds on top of the tools, against the floor of the
//! same NATS and Redis, with tracing export off and on.
//!
//! Owns the bench's flags, its plan (counts and durations), running each phase in each
//! tracing configuration on a fleet of its own, and writing the JSON report. It must
//! never measure on shared servers unless asked (`--given-servers`, `--attach`), and
//! never delete streams or keys outside the prefixes it made (an attached fleet's are
//! left alone).
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | `fleet` | coordinator, worker and gateway child processes per phase, readiness, cleanup |
//! | `http` | the `http` phase: turns through the gateway (JSON, SSE) beside the NATS client |
//! | `phases` | the measurements: floor, overhead, throughput, parallel, scaling, memory |
//! | `progress` | the progress bar on a terminal and the stderr lines written beside it |
//! | `report` | the Markdown tables, the targets, the JSON file |
//! | `sink` | the OTLP/HTTP sink the traced processes export to |
//! | `stats` | percentiles, load average, `/proc` memory and machine facts |

mod fleet;
mod http;
mod instructions;
mod openai;
mod phases;
mod progress;
mod report;
mod sink;
mod skeleton;
pub(crate) mod stats;
mod tenants;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::ValueEnum;
use serde::Serialize;
use serde_json::json;
use toolfleet_cli::local::Servers;
use toolfleet_common::FleetClient;

pub(crate) use fleet::{live_workers, OTEL_VARIABLES};
use fleet::{Env, Fleet, Spec};
use phases::{Floor, Memory, Overhead, Parallel, ScalingPoint, Throughput};
use progress::Progress;
use sink::{Counts, Sink};
use stats::Machine;

/// Which tracing configurations to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TracingChoice {
    /// Without OTLP export.
    Off,
    /// Exporting every span and metric to an OTLP/HTTP sink on loopback.
    On,
    /// Both, phase by phase.
    Both,
}

/// A phase of the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// NATS request-reply, Redis and JetStream round trips.
    Floor,
    /// Submit → `final` of three no-op calls at concurrency 1.
    Overhead,
    /// Concurrent turns of three no-op calls.
    Throughput,
    /// Three 50 ms calls in one turn.
    Parallel,
    /// 1, 2, 4, 8 worker processes serving a 20 ms tool.
    Scaling,
    /// Coordinator memory with many turns in flight.
    Memory,
    /// Turns through the HTTP gateway (JSON and SSE) beside the NATS client; needs
    /// PostgreSQL at `TOOLFLEET_DATABASE_URL` for the gateway's API key.
    Http,
    /// Cancel → `final` of turns whose one call runs for 2 s.
    Cancel,
    /// `/v1/chat/completions` with one round of three no-op fleet calls against a
    /// scripted model server that answers at once: what the loop adds per round; needs
    /// PostgreSQL like `http`.
    Openai,
    /// Instructions per turn of the coordinator, the worker and the client (turns of
    /// the overhead phase) under valgrind's callgrind; skipped without valgrind.
    Instructions,
    /// A tenant keeping 64 turns of four 200 ms calls in flight on one worker of 8
    /// slots, alone and beside a light tenant's one-call turns: both tenants' figures.
    Tenants,
}

const ALL_PHASES: [Phase; 11] = [
    Phase::Floor,
    Phase::Overhead,
    Phase::Throughput,
    Phase::Parallel,
    Phase::Scaling,
    Phase::Memory,
    Phase::Http,
    Phase::Cancel,
    Phase::Openai,
    Phase::Instructions,
    Phase::Tenants,
];

/// Arguments of `toolfleet-dev bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// A smoke run: every phase, briefly (about a minute).
    #[arg(long)]
    quick: bool,
    /// Tracing export: off, on or both.
    #[arg(long, value_enum, default_value = "both")]
    tracing: TracingChoice,
    /// Phases to run (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    phases: Vec<Phase>,
    /// Turns in flight in the throughput phase.
    #[arg(long, default_value_t = 64)]
    turns: usize,
    /// Measured seconds of the throughput phase (default 8, quick 2).
    #[arg(long)]
    seconds: Option<f64>,
    /// Worker process counts of the scaling phase.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    workers: Vec<usize>,
    /// Calls each worker runs at once in the scaling phase.
    #[arg(long, default_value_t = 8)]
    worker_concurrency: usize,
    /// The light tenant's one-call turns in the tenants phase (default 50, quick 10).
    #[arg(long)]
    light_turns: Option<usize>,
    /// Turns in flight in the memory phase.
    #[arg(long, default_value_t = 1000)]
    memory_turns: usize,
    /// Runtime worker threads of each coordinator and worker process (default: one per
    /// CPU).
    #[arg(long)]
    node_threads: Option<usize>,
    /// Where the JSON report goes.
    #[arg(long, default_value = "target/bench/toolfleet-bench.json")]
    out: PathBuf,
    /// Measure the coordinators and workers already serving `--prefix` (with the test
    /// pack) instead of starting them; runs the floor, overhead, throughput and parallel
    /// phases once, with whatever tracing that fleet has.
    #[arg(long)]
    attach: bool,
    /// Use NATS and Redis at `--nats` / `--redis` (`TOOLFLEET_NATS_URL`,
    /// `TOOLFLEET_REDIS_URL`) when they answer, instead of private `nats-server -js` and
    /// `redis-server` on free loopback ports.
    #[arg(long)]
    given_servers: bool,
    /// Run on a local 3-node NATS JetStream cluster (streams with 3 replicas) and a
    /// Redis Cluster of 3 masters with a replica each instead of one server of each.
    #[arg(long, conflicts_with_all = ["given_servers", "attach"])]
    cluster: bool,
    /// Spread the turns over this many pairs of jobs and results streams
    /// (`TOOLFLEET_STREAM_PARTITIONS` of the fleets it starts).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    partitions: u32,
    /// Print each fleet's prefix and process ids.
    #[arg(long)]
    verbose: bool,
}

/// Counts and durations of one run.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    quick: bool,
    floor_samples: usize,
    overhead_warmup: usize,
    overhead_turns: usize,
    overhead_cap_s: f64,
    throughput_turns: usize,
    throughput_warmup_s: f64,
    throughput_seconds: f64,
    parallel_turns: usize,
    cancel_turns: usize,
    scaling_workers: Vec<usize>,
    scaling_concurrency: usize,
    scaling_warmup_s: f64,
    scaling_seconds: f64,
    memory_turns: usize,
    memory_sleep_ms: u64,
    node_threads: Option<usize>,
    tenants_heavy_turns: usize,
    tenants_light_turns: usize,
    tenants_warmup_s: f64,
    tenants_seconds: f64,
}

impl Plan {
    fn from_args(args: &BenchArgs) -> Self {
        let q = args.quick;
        Self {
            quick: q,
            floor_samples: if q { 300 } else { 2_000 },
            overhead_warmup: if q { 30 } else { 200 },
            overhead_turns: if q { 300 } else { 4_000 },
            overhead_cap_s: if q { 5.0 } else { 20.0 },
            throughput_turns: args.turns.max(1),
            throughput_warmup_s: if q { 0.5 } else { 2.0 },
            throughput_seconds: args.seconds.unwrap_or(if q { 2.0 } else { 8.0 }),
            parallel_turns: if q { 10 } else { 60 },
            cancel_turns: if q { 10 } else { 100 },
            scaling_workers: args.workers.clone(),
            scaling_concurrency: args.worker_concurrency.max(1),
            scaling_warmup_s: if q { 0.5 } else { 1.0 },
            scaling_seconds: if q { 1.5 } else { 4.0 },
            memory_turns: args.memory_turns.max(1),
            memory_sleep_ms: if q { 3_000 } else { 5_000 },
            node_threads: args.node_threads,
            tenants_heavy_turns: 64,
            tenants_light_turns: args.light_turns.unwrap_or(if q { 10 } else { 50 }).max(1),
            tenants_warmup_s: if q { 1.0 } else { 3.0 },
            tenants_seconds: if q { 3.0 } else { 8.0 },
        }
    }
}

/// What the OTLP sink received during a phase.
#[derive(Debug, Clone, Copy, Serialize)]
struct Exported {
    trace_requests: u64,
    metric_requests: u64,
    kib: f64,
}

impl From<Counts> for Exported {
    fn from(c: Counts) -> Self {
        Self {
            trace_requests: c.trace_requests,
            metric_requests: c.metric_requests,
            kib: stats::round3(c.bytes as f64 / 1024.0),
        }
    }
}

/// A phase's figures with the conditions they were taken in.
#[derive(Debug, Clone, Serialize)]
struct Measured<T> {
    #[serde(flatten)]
    figures: T,
    /// Load averages before the phase.
    load_before: [f64; 3],
    /// Load averages after it.
    load_after: [f64; 3],
    /// OTLP export received during the phase (tracing on).
    #[serde(skip_serializing_if = "Option::is_none")]
    exported: Option<Exported>,
}

/// Every phase's figures under one tracing configuration.
#[derive(Debug, Clone, Serialize, Default)]
struct ModeReport {
    tracing: &'static str,
    floor: Option<Measured<Floor>>,
    overhead: Option<Measured<Overhead>>,
    throughput: Option<Measured<Throughput>>,
    parallel: Option<Measured<Parallel>>,
    cancel: Option<Measured<phases::Cancel>>,
    scaling: Vec<Measured<ScalingPoint>>,
    memory: Option<Measured<Memory>>,
    http: Option<Measured<http::Http>>,
    openai: Option<Measured<openai::Openai>>,
    instructions: Option<Measured<instructions::Instructions>>,
    tenants: Option<Measured<tenants::Tenants>>,
}

/// Whether one configuration exports traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    On,
    Attached,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::On => "on",
            Mode::Attached => "as configured",
        }
    }

    /// The configuration's part of a prefix.
    fn tag(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::On => "on",
            Mode::Attached => "attached",
        }
    }
}

/// Why the instructions phase cannot run here, if it cannot.
pub(crate) fn instructions_unavailable() -> Option<String> {
    instructions::unavailable()
}

/// Runs the bench.
pub async fn run(nats_url: &str, redis_url: &str, prefix: &str, args: BenchArgs) -> Result<()> {
    let started = Instant::now();
    let plan = Plan::from_args(&args);
    let phases = selected_phases(&args.phases);
    let modes = selected_modes(&args);

    // The fleets' processes inherit it.
    std::env::set_var(
        toolfleet_common::streams::STREAM_PARTITIONS_ENV,
        args.partitions.to_string(),
    );
    // Kept until the end: dropping them stops the clusters.
    let mut _clusters = None;
    let servers = if args.cluster {
        let (nats, redis) = tokio::try_join!(
            toolfleet_dev::cluster::NatsCluster::start(3),
            toolfleet_dev::cluster::RedisCluster::start(3, 1)
        )?;
        // The fleets' processes inherit it: their streams get three replicas.
        std::env::set_var(toolfleet_common::streams::STREAM_REPLICAS_ENV, "3");
        let started = (0..nats.size())
            .filter_map(|i| nats.pid(i).map(|pid| ("nats-server", pid)))
            .chain((0..redis.size()).filter_map(|i| redis.pid(i).map(|pid| ("redis-server", pid))))
            .collect();
        let servers = Servers::external(nats.urls(), redis.url(), started);
        _clusters = Some((nats, redis));
        servers
    } else if args.attach {
        // The attached fleet is on these servers: never private ones in their place
        // (a slow answer would measure nothing); the connections below fail if they are
        // down.
        Servers::external(nats_url.to_string(), redis_url.to_string(), Vec::new())
    } else if args.given_servers {
        Servers::start(nats_url, redis_url).await?
    } else {
        Servers::private().await?
    };
    // A bar on stderr when it is a terminal; elsewhere stderr gets the same lines as ever.
    let progress = Progress::new(std::io::stderr().is_terminal());
    let env = Env::connect(
        &servers.nats_url,
        &servers.redis_url,
        args.verbose,
        progress.clone(),
    )
    .await?;
    let sink = Sink::start().await?;
    let machine = Machine::read();
    let load_start = stats::load_average();
    let versions = Versions::read(&env).await;
    eprintln!(
        "toolfleet-dev bench: {} CPUs ({}), load {:?}; nats-server {} at {}, redis {} at {}",
        machine.cpus,
        machine.cpu_model,
        load_start,
        versions.nats,
        env.nats_url,
        versions.redis,
        env.redis_url
    );
    progress.start(progress::stages(&phases, &modes, &plan, args.attach));

    let mut reports = empty_reports(&modes);
    let others = watched(&servers);
    let outcome = run_phases(
        &env,
        &sink,
        &plan,
        &phases,
        &modes,
        &mut reports,
        &others,
        prefix,
        args.attach,
    )
    .await;
    progress.after("cleaning up");
    env.cleanup_all().await;
    sink.stop().await;
    progress.finish();
    outcome?;

    let load = [load_start, stats::load_average()];
    let elapsed = started.elapsed().as_secs_f64();
    let report = json_report(&machine, &env, versions, &plan, &reports, load, elapsed);
    println!(
        "{}",
        report::markdown(&machine, &plan, &reports, load[0], load[1], elapsed)
    );
    write_json(&args.out, &report)?;
    eprintln!("JSON report: {}", args.out.display());
    Ok(())
}

/// The phases asked for (all when none are), in the bench's order.
fn selected_phases(asked: &[Phase]) -> Vec<Phase> {
    if asked.is_empty() {
        ALL_PHASES.to_vec()
    } else {
        ALL_PHASES
            .into_iter()
            .filter(|p| asked.contains(p))
            .collect()
    }
}

/// The tracing configurations to measure: the attached fleet's, or those `--tracing` names.
fn selected_modes(args: &BenchArgs) -> Vec<Mode> {
    if args.attach {
        vec![Mode::Attached]
    } else {
        match args.tracing {
            TracingChoice::Off => vec![Mode::Off],
            TracingChoice::On => vec![Mode::On],
            TracingChoice::Both => vec![Mode::Off, Mode::On],
        }
    }
}

/// An empty report for each tracing configuration, labelled.
fn empty_reports(modes: &[Mode]) -> Vec<ModeReport> {
    modes
        .iter()
        .map(|m| ModeReport {
            tracing: m.label(),
            ..Default::default()
        })
        .collect()
}

/// Processes watched besides each fleet's own: the servers started and this process.
fn watched(servers: &Servers) -> Vec<(String, u32)> {
    let mut others: Vec<(String, u32)> = servers
        .started
        .iter()
        .map(|(name, pid)| (name.to_string(), *pid))
        .collect();
    others.push(("bench client".to_string(), std::process::id()));
    others
}

/// The versions of the NATS and Redis servers measured against.
struct Versions {
    nats: String,
    redis: String,
}

impl Versions {
    /// Asks both servers of `env` for their versions.
    async fn read(env: &Env) -> Self {
        Self {
            nats: env.nats.server_info().version,
            redis: redis_version(env).await,
        }
    }
}

/// The JSON report: the run's conditions, plan, every configuration's figures and the
/// targets; `load` is the load averages at start and at end.
fn json_report(
    machine: &Machine,
    env: &Env,
    versions: Versions,
    plan: &Plan,
    reports: &[ModeReport],
    load: [[f64; 3]; 2],
    elapsed: f64,
) -> serde_json::Value {
    json!({
        "tool": "toolfleet-dev bench",
        "version": env!("CARGO_PKG_VERSION"),
        "finished_at": toolfleet_common::call::now_rfc3339(),
        "seconds": stats::round3(elapsed),
        "machine": machine,
        "servers": {
            "nats_url": env.nats_url,
            "nats_version": versions.nats,
            "redis_url": env.redis_url,
            "redis_version": versions.redis,
        },
        "load_start": load[0],
        "load_end": load[1],
        "plan": plan,
        "modes": reports,
        "targets": report::targets(reports),
    })
}

/// Writes `report` as pretty JSON to `out`, making its folder first.
fn write_json(out: &std::path::Path, report: &serde_json::Value) -> Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(out, serde_json::to_vec_pretty(report)?)
        .with_context(|| format!("writing {}", out.display()))
}

async fn redis_version(env: &Env) -> String {
    let mut redis = env.redis.clone();
    let info: Result<String, _> = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut redis)
        .await;
    info.ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// Runs `work` between two load readings and the sink's counters.
async fn measured<T, F>(sink: &Sink, mode: Mode, work: F) -> Result<Measured<T>>
where
    F: std::future::Future<Output = Result<T>>,
{
    let load_before = stats::load_average();
    let counts_before = sink.counts();
    let figures = work.await?;
    Ok(Measured {
        figures,
        load_before,
        load_after: stats::load_average(),
        exported: (mode == Mode::On).then(|| sink.counts().since(counts_before).into()),
    })
}

/// Runs each phase in each tracing configuration, filling that configuration's report.
#[allow(clippy::too_many_arguments)]
async fn run_phases(
    env: &Env,
    sink: &Sink,
    plan: &Plan,
    phases: &[Phase],
    modes: &[Mode],
    reports: &mut [ModeReport],
    others: &[(String, u32)],
    attach_prefix: &str,
    attach: bool,
) -> Result<()> {
    let progress = &env.progress;
    for phase in phases {
        for (mode, report) in modes.iter().copied().zip(reports.iter_mut()) {
            progress.note(format_args!("{phase:?}, tracing {}", mode.label()));
            progress.stage(*phase, mode, None);
            let stage = Stage {
                env,
                sink,
                plan,
                mode,
                attached_to: attach.then_some(attach_prefix),
                others,
            };
            stage.run(*phase, report).await?;
        }
    }
    Ok(())
}

/// Where one phase runs in one tracing configuration.
struct Stage<'a> {
    env: &'a Env,
    sink: &'a Sink,
    plan: &'a Plan,
    mode: Mode,
    /// The prefix of the running fleet measured instead of fresh ones (`--attach`).
    attached_to: Option<&'a str>,
    /// Processes watched besides a fleet's own: the servers and this process.
    others: &'a [(String, u32)],
}

impl Stage<'_> {
    /// Runs `phase` in this configuration and keeps its figures in `report`; the scaling
    /// and memory phases are skipped on an attached fleet.
    async fn run(&self, phase: Phase, report: &mut ModeReport) -> Result<()> {
        let progress = &self.env.progress;
        let attach = self.attached_to.is_some();
        match phase {
            Phase::Floor => {
                report.floor = Some(self.floor().await?);
                progress.done();
            }
            Phase::Overhead => {
                let floor = report.floor.as_ref().map(|f| f.figures.clone());
                report.overhead = Some(self.overhead(floor).await?);
                progress.done();
            }
            Phase::Throughput => {
                report.throughput = Some(self.throughput().await?);
                progress.done();
            }
            Phase::Parallel => {
                report.parallel = Some(self.parallel().await?);
                progress.done();
            }
            Phase::Cancel => {
                report.cancel = Some(self.cancel().await?);
                progress.done();
            }
            Phase::Scaling if !attach => {
                for &workers in &self.plan.scaling_workers {
                    report.scaling.push(self.scaling_point(workers).await?);
                    progress.done();
                }
            }
            Phase::Memory if !attach => {
                report.memory = Some(self.memory().await?);
                progress.done();
            }
            Phase::Http if !attach => {
                report.http = Some(self.http().await?);
                progress.done();
            }
            Phase::Openai if !attach => {
                report.openai = Some(self.openai().await?);
                progress.done();
            }
            Phase::Instructions if !attach => {
                match instructions::unavailable() {
                    Some(why) => progress.note(format_args!("  skipped: {why}")),
                    None => report.instructions = Some(self.instructions().await?),
                }
                progress.done();
            }
            Phase::Tenants if !attach => {
                report.tenants = Some(self.tenants().await?);
                progress.done();
            }
            Phase::Scaling
            | Phase::Memory
            | Phase::Http
            | Phase::Openai
            | Phase::Instructions
            | Phase::Tenants => {
                progress.note("  skipped: needs a fleet the bench starts");
            }
        }
        Ok(())
    }

    /// The floor phase: round trips to NATS and Redis, no fleet.
    async fn floor(&self) -> Result<Measured<Floor>> {
        let prefix = self.prefix("floor");
        let plan = self.plan;
        let work = phases::floor(self.env, &prefix, plan.floor_samples, plan.node_threads);
        measured(self.sink, self.mode, work).await
    }

    /// The overhead phase at concurrency 1, against the `floor` phase's figures.
    async fn overhead(&self, floor: Option<Floor>) -> Result<Measured<Overhead>> {
        let plan = self.plan;
        let progress = &self.env.progress;
        self.on_fleet("overhead", 1, 8, |client, probe| async move {
            phases::overhead(
                &client,
                plan.overhead_warmup,
                plan.overhead_turns,
                secs(plan.overhead_cap_s),
                floor.as_ref(),
                &probe,
                progress,
            )
            .await
        })
        .await
    }

    /// The throughput phase: a closed loop of turns of three no-op calls.
    async fn throughput(&self) -> Result<Measured<Throughput>> {
        let plan = self.plan;
        let progress = &self.env.progress;
        let decision = phases::decision("test.noop", &json!({}), 3);
        // Enough worker slots that the tools never queue the turns.
        let slots = (plan.throughput_turns * 3).max(8);
        self.on_fleet("throughput", 1, slots, |client, probe| async move {
            phases::closed_loop(
                &client,
                &decision,
                3,
                plan.throughput_turns,
                secs(plan.throughput_warmup_s),
                secs(plan.throughput_seconds),
                10_000,
                &probe,
                progress,
            )
            .await
        })
        .await
    }

    /// The tenants phase: a flooding tenant beside a light one, on one worker of 8
    /// slots.
    async fn tenants(&self) -> Result<Measured<tenants::Tenants>> {
        let plan = self.plan;
        let progress = &self.env.progress;
        self.on_fleet("tenants", 1, 8, |client, _| async move {
            tenants::tenants(
                &client,
                plan.tenants_heavy_turns,
                plan.tenants_light_turns,
                secs(plan.tenants_warmup_s),
                secs(plan.tenants_seconds),
                progress,
            )
            .await
        })
        .await
    }

    /// The parallel phase: three 50 ms calls in one turn.
    async fn parallel(&self) -> Result<Measured<Parallel>> {
        let plan = self.plan;
        let progress = &self.env.progress;
        self.on_fleet("parallel", 1, 8, |client, _| async move {
            phases::parallel(&client, plan.parallel_turns, progress).await
        })
        .await
    }

    /// The cancel phase: turns of one 2 s call, cancelled once it runs.
    async fn cancel(&self) -> Result<Measured<phases::Cancel>> {
        let plan = self.plan;
        let progress = &self.env.progress;
        self.on_fleet("cancel", 1, 8, |client, _| async move {
            phases::cancel(&client, plan.cancel_turns, progress).await
        })
        .await
    }

    /// One point of the scaling phase, on a fleet of `workers` worker processes.
    async fn scaling_point(&self, workers: usize) -> Result<Measured<ScalingPoint>> {
        let plan = self.plan;
        let progress = &self.env.progress;
        let workers = workers.max(1);
        let concurrency = plan.scaling_concurrency;
        let name = format!("scale{workers}");
        let plural = if workers == 1 { "" } else { "s" };
        progress.stage(
            Phase::Scaling,
            self.mode,
            Some(format!("{workers} worker{plural}")),
        );
        self.on_fleet(&name, workers, concurrency, |client, probe| async move {
            phases::scaling_point(
                &client,
                workers,
                concurrency,
                secs(plan.scaling_warmup_s),
                secs(plan.scaling_seconds),
                &probe,
                progress,
            )
            .await
        })
        .await
    }

    /// The memory phase, on a fresh fleet of its own, stopped afterwards.
    async fn memory(&self) -> Result<Measured<Memory>> {
        let slots = self.plan.memory_turns * 3;
        let (prefix, fleet) = self.fresh("memory", 1, slots).await?;
        let work = phases::memory(&fleet, self.plan.memory_turns, self.plan.memory_sleep_ms);
        let m = measured(self.sink, self.mode, work).await;
        self.retire(&prefix, fleet, m).await
    }

    /// The http phase: a gateway child process in front of a fresh fleet, with an API
    /// key made for the phase and revoked after it.
    async fn http(&self) -> Result<Measured<http::Http>> {
        let plan = self.plan;
        let slots = (plan.throughput_turns * 3).max(8);
        let (prefix, fleet) = self.fresh("http", 1, slots).await?;
        let otlp = (self.mode == Mode::On).then(|| self.sink.endpoint());
        let started = self.env.start_gateway(&prefix, otlp.as_deref(), &[]).await;
        let outcome = match started {
            Ok(gateway) => {
                let work = async {
                    let target = http::Target::new(
                        fleet.client.clone(),
                        gateway.base.clone(),
                        gateway.key.clone(),
                        128,
                    )?;
                    http::run(
                        &target,
                        plan.overhead_turns / 2,
                        secs(plan.overhead_cap_s),
                        plan.throughput_turns,
                        secs(plan.throughput_seconds),
                        &self.env.progress,
                    )
                    .await
                };
                let m = measured(self.sink, self.mode, work).await;
                gateway.stop(&self.env.progress).await;
                m
            }
            Err(error) => Err(error),
        };
        self.retire(&prefix, fleet, outcome).await
    }

    /// The openai phase: a scripted model server and a gateway child process pointed at
    /// it, in front of a fresh fleet.
    async fn openai(&self) -> Result<Measured<openai::Openai>> {
        let plan = self.plan;
        let (prefix, fleet) = self.fresh("openai", 1, 16).await?;
        let upstream =
            toolfleet_dev::upstream::ScriptedUpstream::start_with_unique_ids(openai::script())
                .await?;
        let otlp = (self.mode == Mode::On).then(|| self.sink.endpoint());
        let extra = [("TOOLFLEET_UPSTREAM_BASE_URL", upstream.base_url.clone())];
        let started = self
            .env
            .start_gateway(&prefix, otlp.as_deref(), &extra)
            .await;
        let outcome = match started {
            Ok(gateway) => {
                let work = openai::run(
                    &gateway.base,
                    &gateway.key,
                    &upstream.base_url,
                    plan.overhead_turns / 2,
                    secs(plan.overhead_cap_s),
                    &self.env.progress,
                );
                let m = measured(self.sink, self.mode, work).await;
                gateway.stop(&self.env.progress).await;
                m
            }
            Err(error) => Err(error),
        };
        self.retire(&prefix, fleet, outcome).await
    }

    /// The instructions phase: a fleet under callgrind, driven by two client runs.
    async fn instructions(&self) -> Result<Measured<instructions::Instructions>> {
        let prefix = self.prefix("instr");
        let dir = toolfleet_cli::local::tempdir::Dir::new("callgrind")
            .context("creating a folder for callgrind's files")?;
        // One worker of eight slots, as in the overhead phase.
        let spec = self.spec(1, 8);
        let counted = instructions::count(self.env, &prefix, &spec, dir.path());
        let m = measured(self.sink, self.mode, counted).await;
        self.env.cleanup(&prefix).await;
        m
    }

    /// How to start a fleet of `workers` workers of `concurrency` slots each in this
    /// configuration.
    fn spec(&self, workers: usize, concurrency: usize) -> Spec {
        Spec {
            workers,
            worker_concurrency: concurrency,
            otlp: (self.mode == Mode::On).then(|| self.sink.endpoint()),
            threads: self.plan.node_threads,
            wrap: Vec::new(),
        }
    }

    /// A fresh prefix for `name` in this configuration, remembered for cleanup.
    fn prefix(&self, name: &str) -> String {
        self.env.prefix(&format!("{name}_{}", self.mode.tag()))
    }

    /// A fresh fleet under its own prefix, for one phase in this configuration: `workers`
    /// workers of `concurrency` slots each.
    async fn fresh(
        &self,
        name: &str,
        workers: usize,
        concurrency: usize,
    ) -> Result<(String, Fleet)> {
        let prefix = self.prefix(name);
        let spec = self.spec(workers, concurrency);
        let fleet = self.env.start(&prefix, &spec).await?;
        Ok((prefix, fleet))
    }

    /// Measures `work` on the running fleet under `attached_to`, or else on a fresh one
    /// (see [`Stage::fresh`]) that is stopped and cleaned up afterwards, whatever the
    /// outcome. `work` gets a client of that fleet and the processes to watch: the fresh
    /// fleet's with `others`, or `others` alone.
    async fn on_fleet<T, W, F>(
        &self,
        name: &str,
        workers: usize,
        concurrency: usize,
        work: W,
    ) -> Result<Measured<T>>
    where
        W: FnOnce(FleetClient, phases::Probe) -> F,
        F: std::future::Future<Output = Result<T>>,
    {
        if let Some(prefix) = self.attached_to {
            let client = attached(self.env, prefix).await?;
            return measured(self.sink, self.mode, work(client, self.others.to_vec())).await;
        }
        let (prefix, fleet) = self.fresh(name, workers, concurrency).await?;
        let probe = fleet.probe(self.others);
        let m = measured(self.sink, self.mode, work(fleet.client.clone(), probe)).await;
        self.retire(&prefix, fleet, m).await
    }

    /// Stops `fleet`, deletes the streams and keys left under its `prefix`, and hands
    /// back `outcome`, the result of what ran on it.
    async fn retire<T>(&self, prefix: &str, fleet: Fleet, outcome: Result<T>) -> Result<T> {
        fleet.stop(&self.env.progress).await;
        self.env.cleanup(prefix).await;
        outcome
    }
}

/// A client for the running fleet under `prefix`, once it lists the test tools.
async fn attached(env: &Env, prefix: &str) -> Result<FleetClient> {
    let client = env.client(prefix);
    env.wait_ready(&client, &toolfleet_common::Names::new(prefix), 0)
        .await
        .context("the fleet must serve the test pack (toolfleet up --packs test)")?;
    Ok(client)
}
