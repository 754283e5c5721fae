//! The `instructions` phase: how many instructions the coordinator, the worker and the
//! client execute per turn, counted by valgrind's callgrind. Unlike the clocks, the
//! count does not move with the machine's load, so two builds can be compared on it.
//!
//! Owns the fleet it starts under callgrind and the two client runs that drive it: this
//! executable as `bench --attach --given-servers --phases overhead` (turns of three
//! `test.noop` calls at concurrency 1), itself under callgrind, once short (`--quick`)
//! and once long. The fleet's counters are zeroed before each client run and dumped
//! after it (`callgrind_control`); each process's count is fitted as
//! `fixed + per_turn × turns` over the two runs, so start-up, the catalog wait and the
//! report fall out of the per-turn figure. It must never signal a process it did not
//! start, and leaves the callgrind files only in its own temporary folder.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tokio::process::Command;

use super::fleet::{Env, Spec, OTEL_VARIABLES};

/// The programs the phase needs.
const NEEDED: [&str; 2] = ["valgrind", "callgrind_control"];

/// The phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Instructions {
    /// Turns the short and the long client run completed (warm-up included).
    pub turns: [u64; 2],
    /// Instructions per turn by process (`coordinator`, `worker`, `client`) and their
    /// sum (`all`).
    pub per_turn: BTreeMap<&'static str, u64>,
    /// Instructions of each process outside the turns (start-up of the client, its
    /// catalog wait and report; the fleet's idle work during a run).
    pub fixed: BTreeMap<&'static str, i64>,
    /// Redis's work per turn, from `INFO commandstats` over the same two runs:
    /// `commands` (every command, those scripts run included) and `scripts` (script
    /// calls: `EVALSHA`, `EVAL`, `FCALL`).
    pub redis_per_turn: BTreeMap<&'static str, f64>,
}

/// The commands Redis has run (`commands`) and, of them, script calls (`scripts`),
/// summed over `INFO commandstats`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct RedisWork {
    commands: u64,
    scripts: u64,
}

/// Script calls among `INFO commandstats`' commands.
const SCRIPT_COMMANDS: [&str; 6] = [
    "evalsha",
    "eval",
    "fcall",
    "evalsha_ro",
    "eval_ro",
    "fcall_ro",
];

/// Sums `INFO commandstats`: `cmdstat_<name>:calls=<n>,usec=…` lines.
fn parse_commandstats(info: &str) -> RedisWork {
    let mut work = RedisWork::default();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let calls = rest
            .split(',')
            .find_map(|field| field.strip_prefix("calls="))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        work.commands += calls;
        if SCRIPT_COMMANDS.contains(&name) {
            work.scripts += calls;
        }
    }
    work
}

/// Redis's commands so far, from `INFO commandstats`.
async fn redis_work(env: &Env) -> Result<RedisWork> {
    let mut redis = env.redis.clone();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut redis)
        .await
        .context("reading Redis's INFO commandstats")?;
    Ok(parse_commandstats(&info))
}

/// Why the phase cannot run here, if it cannot: a program it needs is missing.
pub fn unavailable() -> Option<String> {
    let missing: Vec<&str> = NEEDED.into_iter().filter(|p| !on_path(p)).collect();
    (!missing.is_empty()).then(|| {
        format!(
            "{} not installed (apt-get install -y valgrind)",
            missing.join(" and ")
        )
    })
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// The command line that runs a program under callgrind, its output in `dir` named
/// after `tag` and the process id.
fn under_callgrind(dir: &Path, tag: &str) -> Vec<String> {
    vec![
        "valgrind".to_string(),
        "--quiet".to_string(),
        "--tool=callgrind".to_string(),
        format!(
            "--callgrind-out-file={}",
            dir.join(format!("{tag}.%p.out")).display()
        ),
    ]
}

/// Counts the instructions per turn of a fleet under `prefix` started from `spec`
/// (its processes run under callgrind), writing callgrind's files into `dir`.
pub async fn count(env: &Env, prefix: &str, spec: &Spec, dir: &Path) -> Result<Instructions> {
    let spec = Spec {
        wrap: under_callgrind(dir, "fleet"),
        ..spec.clone()
    };
    let fleet = env.start(prefix, &spec).await?;
    let pids = [
        ("coordinator", fleet.coordinator.pid),
        ("worker", fleet.workers.first().context("a worker")?.pid),
    ];
    let outcome = async {
        let short = client_run(env, prefix, dir, "short", &pids).await?;
        let long = client_run(env, prefix, dir, "long", &pids).await?;
        fit(&short, &long)
    }
    .await;
    fleet.stop(&env.progress).await;
    outcome
}

/// One client run: its turns and the instructions of each process over it.
#[derive(Debug)]
struct Run {
    turns: u64,
    counts: [(&'static str, u64); 3],
    /// Redis's commands over the run.
    redis: RedisWork,
}

/// Runs the client under callgrind against the fleet under `prefix`, with the fleet's
/// counters zeroed before and dumped after.
async fn client_run(
    env: &Env,
    prefix: &str,
    dir: &Path,
    name: &str,
    fleet: &[(&'static str, u32); 2],
) -> Result<Run> {
    for (_, pid) in fleet {
        callgrind_control(&["-z", &pid.to_string()]).await?;
    }
    let redis_before = redis_work(env).await?;
    let report = dir.join(format!("{name}.json"));
    let log = dir.join(format!("{name}.log"));
    let tag = format!("client-{name}");
    let wrap = under_callgrind(dir, &tag);
    let mut cmd = Command::new(&wrap[0]);
    cmd.args(&wrap[1..])
        .arg(&env.exe)
        .args(["--nats", &env.nats_url, "--redis", &env.redis_url])
        .args(["--prefix", prefix, "bench", "--attach", "--given-servers"])
        .args(["--phases", "overhead", "--out"])
        .arg(&report)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).context("creating the client's log")?)
        .kill_on_drop(true);
    if name == "short" {
        cmd.arg("--quick");
    }
    for variable in OTEL_VARIABLES {
        cmd.env_remove(variable);
    }
    let status = cmd.status().await.context("running the client")?;
    if !status.success() {
        // The client's own error line, not the backtrace after it.
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let error = text
            .lines()
            .find(|l| l.starts_with("Error:"))
            .or_else(|| text.lines().find(|l| !l.trim().is_empty()))
            .unwrap_or("no output");
        // The first failed turn's reason, when turns failed.
        let first = text
            .lines()
            .find(|l| l.trim_start().starts_with("a turn failed"))
            .map(|l| format!(" ({})", l.trim()))
            .unwrap_or_default();
        bail!("the {name} client run failed ({status}): {error}{first}");
    }
    let redis_after = redis_work(env).await?;
    let redis = RedisWork {
        commands: redis_after.commands.saturating_sub(redis_before.commands),
        scripts: redis_after.scripts.saturating_sub(redis_before.scripts),
    };
    let turns = turns_in(&report)?;
    let client = summary(&single_file(dir, &tag)?)?;
    let mut counts = [("coordinator", 0), ("worker", 0), ("client", client)];
    for (i, (role, pid)) in fleet.iter().enumerate() {
        callgrind_control(&["-d", &pid.to_string()]).await?;
        let dump = latest_dump(dir, *pid)?;
        counts[i] = (role, summary(&dump)?);
    }
    Ok(Run {
        turns,
        counts,
        redis,
    })
}

/// Turns a child bench's JSON report says it ran: warm-up, measured and failed.
fn turns_in(report: &Path) -> Result<u64> {
    let text =
        std::fs::read_to_string(report).with_context(|| format!("reading {}", report.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)?;
    let overhead = &value["modes"][0]["overhead"];
    let parts = [
        value["plan"]["overhead_warmup"].as_u64(),
        overhead["turn"]["count"].as_u64(),
        overhead["failed"].as_u64(),
    ];
    match parts {
        [Some(warmup), Some(measured), Some(failed)] => Ok(warmup + measured + failed),
        _ => bail!("{} has no overhead figures", report.display()),
    }
}

async fn callgrind_control(args: &[&str]) -> Result<()> {
    let status = Command::new("callgrind_control")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .context("running callgrind_control")?;
    if !status.success() {
        bail!("callgrind_control {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// The one callgrind file of a finished process whose output was named after `tag`.
fn single_file(dir: &Path, tag: &str) -> Result<PathBuf> {
    let start = format!("{tag}.");
    files(dir)?
        .into_iter()
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&start) && n.ends_with(".out"))
        })
        .with_context(|| format!("no callgrind file of {tag} in {}", dir.display()))
}

/// The last dump of the fleet process `pid` (`fleet.<pid>.out.<n>`, highest `n`).
fn latest_dump(dir: &Path, pid: u32) -> Result<PathBuf> {
    let start = format!("fleet.{pid}.out.");
    files(dir)?
        .into_iter()
        .filter_map(|p| {
            let n: u64 = p
                .file_name()?
                .to_str()?
                .strip_prefix(&start)?
                .parse()
                .ok()?;
            Some((n, p))
        })
        .max_by_key(|(n, _)| *n)
        .map(|(_, p)| p)
        .with_context(|| format!("no callgrind dump of process {pid} in {}", dir.display()))
}

fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect())
}

/// The instruction count a callgrind file reports (`summary:`, else `totals:`).
fn summary(file: &Path) -> Result<u64> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    parse_summary(&text).with_context(|| format!("no instruction total in {}", file.display()))
}

fn parse_summary(text: &str) -> Option<u64> {
    let total = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
    };
    total("summary:").or_else(|| total("totals:"))
}

/// Each process's count as `fixed + per_turn × turns`, from a short and a long run.
fn fit(short: &Run, long: &Run) -> Result<Instructions> {
    if long.turns <= short.turns {
        bail!(
            "the long run had {} turns, the short one {}: no fit",
            long.turns,
            short.turns
        );
    }
    let extra_turns = (long.turns - short.turns) as f64;
    let mut per_turn = BTreeMap::new();
    let mut fixed = BTreeMap::new();
    for ((role, a), (_, b)) in short.counts.iter().zip(long.counts.iter()) {
        let slope = (*b as f64 - *a as f64) / extra_turns;
        per_turn.insert(*role, slope.max(0.0).round() as u64);
        fixed.insert(
            *role,
            (*a as f64 - slope * short.turns as f64).round() as i64,
        );
    }
    let all = per_turn.values().sum();
    per_turn.insert("all", all);
    // Hundredths: a turn's commands are a whole number, the fleet's idle work (heartbeats,
    // memory samples) a fraction.
    let redis_slope = |a: u64, b: u64| {
        let slope = (b as f64 - a as f64) / extra_turns;
        (slope.max(0.0) * 100.0).round() / 100.0
    };
    let redis_per_turn = BTreeMap::from([
        (
            "commands",
            redis_slope(short.redis.commands, long.redis.commands),
        ),
        (
            "scripts",
            redis_slope(short.redis.scripts, long.redis.scripts),
        ),
    ]);
    Ok(Instructions {
        turns: [short.turns, long.turns],
        per_turn,
        fixed,
        redis_per_turn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callgrind_totals_are_read_from_summary_or_totals() {
        let dump = "version: 1\ncmd: toolfleet\nevents: Ir\nsummary: 123456\n\nfn=main\n";
        assert_eq!(parse_summary(dump), Some(123_456));
        assert_eq!(parse_summary("events: Ir\ntotals: 42 \n"), Some(42));
        assert_eq!(parse_summary("events: Ir\n"), None);
    }

    #[test]
    fn commandstats_are_summed_with_script_calls_apart() {
        let info = "# Commandstats\r\n\
            cmdstat_evalsha:calls=12,usec=300,usec_per_call=25.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_hset:calls=30,usec=40,usec_per_call=1.33,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_fcall:calls=2,usec=40,usec_per_call=20.00,rejected_calls=0,failed_calls=0\r\n";
        assert_eq!(
            parse_commandstats(info),
            RedisWork {
                commands: 44,
                scripts: 14
            }
        );
        assert_eq!(parse_commandstats(""), RedisWork::default());
    }

    #[test]
    fn counts_are_fitted_per_turn_over_two_runs() {
        let run = |turns, c, w, cl, commands, scripts| Run {
            turns,
            counts: [("coordinator", c), ("worker", w), ("client", cl)],
            redis: RedisWork { commands, scripts },
        };
        // 1,000 fixed + 500 per turn, 200 fixed + 100 per turn, 5,000 fixed + 50 per turn;
        // Redis: 3 fixed + 7.5 commands per turn, of them 2 scripts.
        let short = run(10, 6_000, 1_200, 5_500, 78, 20);
        let long = run(110, 56_000, 11_200, 10_500, 828, 220);
        let fitted = fit(&short, &long).expect("a fit");
        assert_eq!(fitted.turns, [10, 110]);
        assert_eq!(fitted.per_turn["coordinator"], 500);
        assert_eq!(fitted.per_turn["worker"], 100);
        assert_eq!(fitted.per_turn["client"], 50);
        assert_eq!(fitted.per_turn["all"], 650);
        assert_eq!(fitted.fixed["coordinator"], 1_000);
        assert_eq!(fitted.fixed["client"], 5_000);
        assert_eq!(fitted.redis_per_turn["commands"], 7.5);
        assert_eq!(fitted.redis_per_turn["scripts"], 2.0);
        assert!(fit(&long, &short).is_err(), "no fit without more turns");
    }
}
