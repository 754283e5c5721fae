//! `toolfleet-dev chaos`: keeps turns in flight on a local fleet of its own while one kind
//! of process is killed with SIGKILL and restarted on a schedule, and counts what the
//! frontend saw: turns lost, late, refused and counted twice.
//!
//! Owns the command's flags, the fault schedule and the run of each fault on a fresh
//! fleet (a `none` baseline first). It must never touch servers it did not start (it
//! listens on 127.0.0.1 only), never run unbounded (every fault lasts `--each`, every
//! turn at most its deadline + 5 s), and never leave a process or folder behind, Ctrl-C
//! or SIGTERM included. The turns' path through the fleet is the coordinator's and the
//! worker's business; this command only sees what a frontend sees.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | `fleet` | the fleet's servers and nodes as child processes; kill and restart |
//! | `load` | the turns kept in flight and how each one ended |
//! | `report` | counts per fault, the table, the JSON file |

mod fleet;
mod load;
mod report;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::ValueEnum;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::bench::stats::Machine;
use fleet::{ChaosFleet, FleetSpec, NodeBinaries};
use load::LoadSpec;
use report::FaultReport;

/// Extra time the turns in flight get to end after the load stops, beyond their own
/// deadline + patience and submission timeout, before they are abandoned.
const DRAIN_MARGIN: Duration = Duration::from_secs(15);
/// The longest `--each`.
const MAX_EACH: Duration = Duration::from_secs(3600);

/// A kind of process to kill, or none (the baseline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fault {
    /// No fault: the baseline.
    None,
    /// A worker process.
    Worker,
    /// A coordinator process.
    Coordinator,
    /// The redis-server (restarted from its append-only file).
    Redis,
    /// The nats-server (restarted on its JetStream store).
    Nats,
    /// `--cluster`: one node of the NATS cluster (restarted on its store).
    NatsNode,
    /// `--cluster`: a Redis master; restarted once its replica took over, it comes back
    /// as that replica's replica.
    RedisMaster,
    /// `--cluster`: one NATS node cut off from the other two for 5 s.
    Partition,
    /// `--cluster`: a Redis master cut off from the cluster bus (its clients still reach
    /// it) until its replica has taken over, then 5 s more; healed, it rejoins as that
    /// replica's replica.
    RedisPartition,
}

impl Fault {
    /// The fault's name in the table and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Worker => "worker",
            Self::Coordinator => "coordinator",
            Self::Redis => "redis",
            Self::Nats => "nats",
            Self::NatsNode => "nats-node",
            Self::RedisMaster => "redis-master",
            Self::Partition => "partition",
            Self::RedisPartition => "redis-partition",
        }
    }

    /// Whether the fault needs the clusters (`--cluster`).
    pub fn clustered(self) -> bool {
        matches!(
            self,
            Self::NatsNode | Self::RedisMaster | Self::Partition | Self::RedisPartition
        )
    }
}

/// How long a `partition` fault cuts a NATS node off (a `redis-partition` fault: how
/// long it holds the cut after the replica took over).
pub const PARTITION: Duration = Duration::from_secs(5);

/// A range of milliseconds, `low..=high`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsRange {
    /// Shortest.
    pub low: u64,
    /// Longest.
    pub high: u64,
}

impl MsRange {
    /// `20-80` (milliseconds) or `40` for both ends.
    fn parse_ms(s: &str) -> Result<Self, String> {
        Self::parse_with(s, |part| {
            part.trim()
                .parse::<u64>()
                .map_err(|_| format!("{part:?} is not a number of milliseconds"))
        })
    }

    /// `1.5s-3s`, `500ms-1s` or `2s` for both ends.
    fn parse_durations(s: &str) -> Result<Self, String> {
        Self::parse_with(s, |part| parse_duration(part).map(|d| d.as_millis() as u64))
    }

    fn parse_with(s: &str, one: impl Fn(&str) -> Result<u64, String>) -> Result<Self, String> {
        let (low, high) = match s.split_once('-') {
            Some((low, high)) => (one(low)?, one(high)?),
            None => (one(s)?, one(s)?),
        };
        if low > high {
            return Err(format!("{s:?}: the low end is above the high end"));
        }
        Ok(Self { low, high })
    }

    /// A value in the range.
    fn pick(self, rng: &mut fastrand::Rng) -> Duration {
        Duration::from_millis(rng.u64(self.low..=self.high))
    }
}

/// `40s`, `1.5s`, `500ms`, `2m`; a bare number is seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit_ms) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60_000.0)
    } else {
        (s, 1000.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as 40s, 1.5s or 500ms"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!(
            "{s:?} is not a duration such as 40s, 1.5s or 500ms"
        ));
    }
    Ok(Duration::from_millis((value * unit_ms).round() as u64))
}

/// Arguments of `toolfleet-dev chaos`.
#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    /// Kinds of process to kill, one fault after another (a `none` baseline runs first).
    /// Default: `worker,coordinator,redis,nats`; with `--cluster`,
    /// `nats-node,redis-master,partition,redis-partition`.
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Option<Vec<Fault>>,
    /// Run on a local 3-node NATS JetStream cluster (streams with 3 replicas) and a
    /// Redis Cluster of 3 masters with a replica each, instead of one server of each.
    #[arg(long)]
    cluster: bool,
    /// Spread the turns over this many pairs of jobs and results streams
    /// (`TOOLFLEET_STREAM_PARTITIONS` of the fleet's processes).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    partitions: u32,
    /// How long turns are submitted under each fault (`40s`, `2m`).
    #[arg(long, default_value = "40s", value_parser = parse_duration)]
    each: Duration,
    /// Turns kept in flight.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    in_flight: u16,
    /// Calls per turn.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    calls: u16,
    /// Calls of a turn run at once; the rest wait in the turn's queue (`1` runs them one
    /// after another, so a killed coordinator leaves paced turns behind). Default: the
    /// coordinator's.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    concurrency: Option<u16>,
    /// Range of each call's duration, milliseconds (`20-80`).
    #[arg(long, default_value = "20-80", value_parser = MsRange::parse_ms)]
    call_ms: MsRange,
    /// Turn deadline, milliseconds.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    deadline_ms: u64,
    /// Coordinator processes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=16))]
    coordinators: u16,
    /// Worker processes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=16))]
    workers: u16,
    /// Time between kills, a range (`1.5s-3s`).
    #[arg(long, default_value = "1.5s-3s", value_parser = MsRange::parse_durations)]
    kill_every: MsRange,
    /// How long a killed process stays down before it is started again (`0.5s-1s`).
    #[arg(long, default_value = "0.5s-1s", value_parser = MsRange::parse_durations)]
    down: MsRange,
    /// A `final` later than deadline + this counts as late.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    late_after: Duration,
    /// A turn with neither `final` nor `error` by deadline + this counts as lost (the
    /// client stops waiting for it; whether it ended later is reported apart).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    patience: Duration,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Set the fleet's Redis `maxmemory` to this many megabytes (with `noeviction`, as
    /// deploy/ runs it) for a soak: a long `--faults none --each 30m` run shows whether
    /// memory reaches a plateau, and the turns refused with `overloaded` past it. One
    /// Redis server only (not with `--cluster`).
    #[arg(long, value_name = "MB", value_parser = clap::value_parser!(u64).range(8..=1_048_576))]
    redis_maxmemory: Option<u64>,
    /// Seed of the call durations and the kill schedule (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Append each coordinator's and worker's standard error to `<DIR>/<name>.log`.
    #[arg(long, value_name = "DIR")]
    logs: Option<PathBuf>,
}

impl ChaosArgs {
    /// The faults in run order: `none` first, each kind once.
    fn plan(&self) -> Vec<Fault> {
        let mut plan = vec![Fault::None];
        let default = if self.cluster {
            vec![
                Fault::NatsNode,
                Fault::RedisMaster,
                Fault::Partition,
                Fault::RedisPartition,
            ]
        } else {
            vec![Fault::Worker, Fault::Coordinator, Fault::Redis, Fault::Nats]
        };
        for fault in self.faults.as_ref().unwrap_or(&default) {
            if !plan.contains(fault) {
                plan.push(*fault);
            }
        }
        plan
    }

    fn load_spec(&self, seed: u64) -> LoadSpec {
        LoadSpec {
            in_flight: self.in_flight.into(),
            calls: self.calls.into(),
            concurrency: self.concurrency.map(usize::from),
            call_ms: self.call_ms,
            deadline: Duration::from_millis(self.deadline_ms),
            patience: self.patience,
            seed,
        }
    }

    fn fleet_spec(&self) -> FleetSpec {
        FleetSpec {
            coordinators: self.coordinators.into(),
            workers: self.workers.into(),
            logs: self.logs.clone(),
            cluster: self.cluster,
            partitions: self.partitions,
        }
    }
}

/// Runs every fault of `args`, prints the table, writes the JSON; fails when a turn
/// was lost or counted twice, or on Ctrl-C / SIGTERM (after cleaning up).
pub async fn run(args: ChaosArgs) -> Result<()> {
    ensure!(args.each <= MAX_EACH, "--each is at most {MAX_EACH:?}");
    for fault in args.plan() {
        ensure!(
            !fault.clustered() || args.cluster,
            "the fault {} needs --cluster",
            fault.name()
        );
        ensure!(
            !args.cluster || !matches!(fault, Fault::Redis | Fault::Nats),
            "with --cluster, kill servers with nats-node and redis-master, not {}",
            fault.name()
        );
    }
    ensure!(
        args.redis_maxmemory.is_none() || !args.cluster,
        "--redis-maxmemory sets one Redis server's limit: not with --cluster"
    );
    if let Some(dir) = &args.logs {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    let binaries = NodeBinaries::locate()?;
    let interrupt = toolfleet_cli::node::stop_on_signal();
    let [coordinator, worker] = binaries.describe();
    eprintln!("chaos: seed {seed}; coordinator `{coordinator}`, worker `{worker}`");
    let mut reports = Vec::new();
    for (i, fault) in args.plan().into_iter().enumerate() {
        let fault_seed = seed.wrapping_add((i as u64) << 32);
        let report = run_fault(fault, &args, &binaries, fault_seed, &interrupt).await?;
        eprintln!(
            "chaos: {}: {} turns, {} lost, {} counted twice",
            report.fault, report.turns, report.lost, report.counted_twice
        );
        reports.push(report);
    }
    println!("{}", report::table(&reports, args.late_after));
    if let Some(path) = &args.json {
        write_json(path, &args, seed, &binaries, &reports)?;
    }
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| r.failed())
        .map(|r| r.fault.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("turns lost or counted twice under: {}", failed.join(", "));
    }
    Ok(())
}

/// One fault on a fresh fleet: the load for `--each` while the schedule kills and
/// restarts processes of that kind, then the turns in flight end, then the fleet stops.
async fn run_fault(
    fault: Fault,
    args: &ChaosArgs,
    binaries: &NodeBinaries,
    seed: u64,
    interrupt: &CancellationToken,
) -> Result<FaultReport> {
    eprintln!("chaos: {}: starting a fleet", fault.name());
    // A fleet that does not come up (a cluster that misses its start-up timeout on a
    // loaded machine) is no turn lost: it is started afresh once before the run fails.
    let mut fleet = match ChaosFleet::start(&args.fleet_spec(), binaries).await {
        Ok(fleet) => fleet,
        Err(error) => {
            eprintln!(
                "chaos: {}: the fleet did not start ({error:#}); starting it again",
                fault.name()
            );
            ChaosFleet::start(&args.fleet_spec(), binaries)
                .await
                .with_context(|| format!("starting the fleet for fault {}", fault.name()))?
        }
    };
    eprintln!(
        "chaos: {}: fleet up at {}; {:?} of load",
        fault.name(),
        fleet.nats_url,
        args.each
    );
    if let Some(mb) = args.redis_maxmemory {
        limit_redis(&fleet.redis_url, mb).await?;
    }
    let spec = args.load_spec(seed);
    let drain = spec.deadline + spec.patience + DRAIN_MARGIN;
    let (stop, abort) = (CancellationToken::new(), interrupt.child_token());
    let memory = tokio::spawn(sample_memory(fleet.redis_url.clone(), stop.clone()));
    let load = tokio::spawn(load::run(
        fleet.client.clone(),
        spec,
        stop.clone(),
        abort.clone(),
    ));
    let started = Instant::now();
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let kills = inject(
        &mut fleet,
        fault,
        args,
        &mut rng,
        started + args.each,
        interrupt,
    )
    .await;
    let seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    let records = match tokio::time::timeout(drain, load).await {
        Ok(joined) => joined.unwrap_or_default(),
        Err(_) => {
            abort.cancel();
            Vec::new()
        }
    };
    let memory = memory.await.unwrap_or_default();
    if interrupt.is_cancelled() {
        fleet.stop().await;
        bail!("interrupted; every process stopped and its data removed");
    }
    // The fleet stays up while the tally watches lost turns for whether they ended later.
    let deadline = Duration::from_millis(args.deadline_ms);
    let mut report =
        FaultReport::tally(fault, kills?, seconds, args.late_after, deadline, records).await;
    fleet.stop().await;
    report.redis_memory = memory;
    Ok(report)
}

/// Sets the Redis server's `maxmemory` to `mb` megabytes, with `noeviction`.
async fn limit_redis(redis_url: &str, mb: u64) -> Result<()> {
    let mut redis = toolfleet_common::redis_client::connect(redis_url, Default::default()).await?;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(mb * 1024 * 1024)
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut redis)
        .await?;
    Ok(())
}

/// Redis's memory every [`report::MEMORY_EVERY`] until `stop` (a sample that fails,
/// while Redis is down, is left out).
async fn sample_memory(redis_url: String, stop: CancellationToken) -> Vec<report::MemorySample> {
    let started = Instant::now();
    let mut samples = Vec::new();
    let Ok(mut redis) =
        toolfleet_common::redis_client::connect(&redis_url, Default::default()).await
    else {
        return samples;
    };
    loop {
        let info: redis::RedisResult<String> = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut redis)
            .await;
        if let Ok(info) = info {
            let field = |name: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            };
            if let Some(used_bytes) = field("used_memory") {
                samples.push(report::MemorySample {
                    at_s: (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
                    used_bytes,
                    max_bytes: field("maxmemory").unwrap_or(0),
                });
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return samples,
            _ = tokio::time::sleep(report::MEMORY_EVERY) => {}
        }
    }
}

/// Until `until`: waits `--kill-every`, kills a random process of `fault` kind, waits
/// `--down`, starts it again. The number of kills.
async fn inject(
    fleet: &mut ChaosFleet,
    fault: Fault,
    args: &ChaosArgs,
    rng: &mut fastrand::Rng,
    until: Instant,
    interrupt: &CancellationToken,
) -> Result<usize> {
    let mut kills = 0;
    loop {
        let wait = args.kill_every.pick(rng);
        if fault == Fault::None || Instant::now() + wait >= until {
            break;
        }
        if !pause(wait, interrupt).await {
            return Ok(kills);
        }
        let Some(index) = fleet.kill(fault, rng.usize(..)).await? else {
            break;
        };
        kills += 1;
        tracing::info!(fault = fault.name(), target = index, "fault begins");
        let down = if matches!(fault, Fault::Partition | Fault::RedisPartition) {
            PARTITION
        } else {
            args.down.pick(rng)
        };
        pause(down, interrupt).await;
        if let Err(error) = fleet.restart(fault, index).await {
            // One fault at a time: with this one not yet undone (a cluster still
            // healing), no other begins; the load runs on and its turns are counted.
            eprintln!(
                "chaos: {}: target {index} is not back ({error:#}); no further faults this run",
                fault.name()
            );
            break;
        }
        tracing::info!(fault = fault.name(), target = index, "fault ends");
    }
    pause(until.saturating_duration_since(Instant::now()), interrupt).await;
    Ok(kills)
}

/// Sleeps `duration`; `false` when interrupted first.
async fn pause(duration: Duration, interrupt: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(duration) => true,
        _ = interrupt.cancelled() => false,
    }
}

fn write_json(
    path: &PathBuf,
    args: &ChaosArgs,
    seed: u64,
    binaries: &NodeBinaries,
    reports: &[FaultReport],
) -> Result<()> {
    let faults: Vec<&str> = args.plan().iter().map(|f| f.name()).collect();
    let [coordinator, worker] = binaries.describe();
    let body = json!({
        "seed": seed,
        "settings": {
            "faults": faults,
            "each_s": args.each.as_secs_f64(),
            "in_flight": args.in_flight,
            "calls": args.calls,
            "call_ms": [args.call_ms.low, args.call_ms.high],
            "deadline_ms": args.deadline_ms,
            "late_after_ms": args.late_after.as_millis() as u64,
            "lost_after_ms": (Duration::from_millis(args.deadline_ms) + args.patience).as_millis() as u64,
            "cluster": args.cluster,
            "coordinators": args.coordinators,
            "workers": args.workers,
            "kill_every_ms": [args.kill_every.low, args.kill_every.high],
            "down_ms": [args.down.low, args.down.high],
        },
        "binaries": {"coordinator": coordinator, "worker": worker},
        "machine": Machine::read(),
        "passed": reports.iter().all(|r| !r.failed()),
        "faults": reports,
    });
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_vec_pretty(&body)?)
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_ranges_parse() {
        assert_eq!(parse_duration("40s"), Ok(Duration::from_secs(40)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("4"), Ok(Duration::from_secs(4)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-1s").is_err());
        assert_eq!(
            MsRange::parse_durations("1.5s-3s"),
            Ok(MsRange {
                low: 1500,
                high: 3000
            })
        );
        assert_eq!(
            MsRange::parse_ms("20-80"),
            Ok(MsRange { low: 20, high: 80 })
        );
        assert_eq!(MsRange::parse_ms("40"), Ok(MsRange { low: 40, high: 40 }));
        assert!(MsRange::parse_ms("80-20").is_err());
    }

    #[test]
    fn the_baseline_runs_first_and_each_fault_once() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ChaosArgs,
        }
        let cli = Cli::parse_from(["x", "--faults", "nats,worker,nats,none"]);
        assert_eq!(
            cli.args.plan(),
            vec![Fault::None, Fault::Nats, Fault::Worker]
        );
        let cli = Cli::parse_from(["x", "--cluster"]);
        assert_eq!(
            cli.args.plan(),
            vec![
                Fault::None,
                Fault::NatsNode,
                Fault::RedisMaster,
                Fault::Partition,
                Fault::RedisPartition
            ]
        );
        let cli = Cli::parse_from(["x", "--cluster", "--faults", "partition,worker"]);
        assert_eq!(
            cli.args.plan(),
            vec![Fault::None, Fault::Partition, Fault::Worker]
        );
    }
}
