//! `toolfleet-dev budget`: the per-turn cost CI holds every change to.
//!
//! Owns the budget file (`docs/budget.json`) and the check against it: the bench's
//! `instructions` phase is run with tracing on and every default feature on (this
//! executable as `bench --phases instructions --tracing on`, on private servers), and
//! its figures per turn of three `test.noop` calls — instructions of coordinator +
//! worker + client counted by callgrind, Redis's commands and script calls from
//! `INFO commandstats` — are compared with the file. A figure more than the file's
//! tolerance (2 %) over its budget fails the check; one well under it is reported, so
//! the cut that made it can lower the budget. `--write` records the measured figures as
//! the new budget, with the reason given (`docs/BENCHMARKS.md` says what a raise needs).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::process::Command;

/// Arguments of `toolfleet-dev budget`.
#[derive(Debug, clap::Args)]
pub struct BudgetArgs {
    /// The budget file.
    #[arg(long, default_value = "docs/budget.json")]
    file: PathBuf,
    /// Where the bench's JSON report goes.
    #[arg(long, default_value = "target/bench/budget-report.json")]
    out: PathBuf,
    /// Check an existing bench report (with an `instructions` phase, tracing on)
    /// instead of running the bench.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Record the measured figures as the budget, with this reason, instead of checking.
    #[arg(long, value_name = "REASON")]
    write: Option<String>,
}

/// The budget file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Budget {
    /// How far over a figure may go before the check fails (0.02: 2 %).
    pub tolerance: f64,
    /// Instructions per turn of coordinator + worker + client.
    pub instructions_per_turn: u64,
    /// Redis commands per turn (those scripts run included).
    pub redis_commands_per_turn: f64,
    /// Redis script calls per turn.
    pub redis_scripts_per_turn: f64,
    /// What the figures were measured on and why they moved, newest last.
    #[serde(default)]
    pub history: Vec<Entry>,
}

/// One change of the budget.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    /// When it was measured (UTC date).
    pub date: String,
    /// The figures then: instructions, Redis commands, Redis script calls per turn.
    pub instructions_per_turn: u64,
    pub redis_commands_per_turn: f64,
    pub redis_scripts_per_turn: f64,
    /// Why the budget moved.
    pub why: String,
}

/// The figures of one measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    pub instructions_per_turn: u64,
    pub coordinator: u64,
    pub worker: u64,
    pub client: u64,
    pub redis_commands_per_turn: f64,
    pub redis_scripts_per_turn: f64,
}

/// One figure against its budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub name: &'static str,
    pub budget: f64,
    pub measured: f64,
    pub verdict: Verdict,
}

/// How a figure stands against its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the tolerance either way.
    Within,
    /// More than the tolerance over: the check fails.
    Over,
    /// More than twice the tolerance under: the budget can be lowered.
    Under,
}

impl Budget {
    /// Each figure of `measured` against this budget.
    pub fn check(&self, measured: &Measured) -> Vec<Line> {
        let line = |name, budget: f64, measured: f64| {
            let verdict = if measured > budget * (1.0 + self.tolerance) {
                Verdict::Over
            } else if measured < budget * (1.0 - 2.0 * self.tolerance) {
                Verdict::Under
            } else {
                Verdict::Within
            };
            Line {
                name,
                budget,
                measured,
                verdict,
            }
        };
        vec![
            line(
                "instructions per turn (coordinator + worker + client)",
                self.instructions_per_turn as f64,
                measured.instructions_per_turn as f64,
            ),
            line(
                "Redis commands per turn",
                self.redis_commands_per_turn,
                measured.redis_commands_per_turn,
            ),
            line(
                "Redis script calls per turn",
                self.redis_scripts_per_turn,
                measured.redis_scripts_per_turn,
            ),
        ]
    }

    /// This budget moved to `measured`, for `why`, on `date`.
    pub fn moved_to(&self, measured: &Measured, date: &str, why: &str) -> Budget {
        let mut next = self.clone();
        next.instructions_per_turn = measured.instructions_per_turn;
        next.redis_commands_per_turn = measured.redis_commands_per_turn;
        next.redis_scripts_per_turn = measured.redis_scripts_per_turn;
        next.history.push(Entry {
            date: date.to_string(),
            instructions_per_turn: measured.instructions_per_turn,
            redis_commands_per_turn: measured.redis_commands_per_turn,
            redis_scripts_per_turn: measured.redis_scripts_per_turn,
            why: why.to_string(),
        });
        next
    }
}

/// The figures of a bench report's `instructions` phase, tracing on.
pub fn measured_in(report: &Value) -> Result<Measured> {
    let modes = report["modes"]
        .as_array()
        .context("the report has no modes")?;
    let phase = modes
        .iter()
        .find(|m| m["tracing"] == "on")
        .map(|m| &m["instructions"])
        .filter(|p| p.is_object())
        .context("the report has no instructions phase with tracing on")?;
    let per_turn = |k: &str| {
        phase["per_turn"][k]
            .as_u64()
            .with_context(|| format!("no instructions per turn of {k}"))
    };
    let redis = |k: &str| {
        phase["redis_per_turn"][k]
            .as_f64()
            .with_context(|| format!("no Redis {k} per turn"))
    };
    Ok(Measured {
        instructions_per_turn: per_turn("all")?,
        coordinator: per_turn("coordinator")?,
        worker: per_turn("worker")?,
        client: per_turn("client")?,
        redis_commands_per_turn: redis("commands")?,
        redis_scripts_per_turn: redis("scripts")?,
    })
}

/// Runs the check (or `--write`).
pub async fn run(args: BudgetArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading the budget {}", args.file.display()))?;
    let budget: Budget = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a budget", args.file.display()))?;
    let report_path = match &args.report {
        Some(path) => path.clone(),
        None => {
            bench(&args.out).await?;
            args.out.clone()
        }
    };
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(&report_path)
            .with_context(|| format!("reading {}", report_path.display()))?,
    )?;
    let measured = measured_in(&report)?;
    println!(
        "instructions per turn: coordinator {} + worker {} + client {} = {}",
        measured.coordinator, measured.worker, measured.client, measured.instructions_per_turn
    );
    if let Some(why) = &args.write {
        let date = today();
        let next = budget.moved_to(&measured, &date, why);
        std::fs::write(&args.file, serde_json::to_string_pretty(&next)? + "\n")
            .with_context(|| format!("writing {}", args.file.display()))?;
        println!("{} now holds these figures", args.file.display());
        return Ok(());
    }
    let lines = budget.check(&measured);
    let mut over = 0;
    for line in &lines {
        let ratio = line.measured / line.budget.max(f64::MIN_POSITIVE);
        let verdict = match line.verdict {
            Verdict::Within => "within budget",
            Verdict::Over => {
                over += 1;
                "OVER BUDGET"
            }
            Verdict::Under => "under budget: lower it (toolfleet-dev budget --write REASON)",
        };
        println!(
            "{}: {} against a budget of {} ({:+.1} %): {verdict}",
            line.name,
            shown(line.measured),
            shown(line.budget),
            (ratio - 1.0) * 100.0
        );
    }
    if over > 0 {
        // A verdict, not a failure of the tool: one line, exit status 1.
        eprintln!(
            "{over} figure(s) over the budget in {} by more than {:.0} %; cut the cost, or \
             raise the budget with a line in docs/BENCHMARKS.md saying what it buys",
            args.file.display(),
            budget.tolerance * 100.0
        );
        std::process::exit(1);
    }
    Ok(())
}

/// A figure as the check prints it: whole instructions, hundredths of commands.
fn shown(v: f64) -> String {
    if v >= 1000.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Runs this executable's bench (instructions phase, tracing on) into `out`.
async fn bench(out: &Path) -> Result<()> {
    if let Some(why) = crate::bench::instructions_unavailable() {
        bail!("the budget is counted by callgrind: {why}");
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    let status = Command::new(exe)
        .args([
            "bench",
            "--phases",
            "instructions",
            "--tracing",
            "on",
            "--out",
        ])
        .arg(out)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .status()
        .await
        .context("running the bench")?;
    if !status.success() {
        bail!("the bench failed ({status})");
    }
    Ok(())
}

/// Today's UTC date, `YYYY-MM-DD`.
fn today() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    civil(days)
}

/// The date `days` after 1970-01-01, `YYYY-MM-DD`.
fn civil(days: i64) -> String {
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn budget() -> Budget {
        Budget {
            tolerance: 0.02,
            instructions_per_turn: 1_000_000,
            redis_commands_per_turn: 20.0,
            redis_scripts_per_turn: 4.0,
            history: Vec::new(),
        }
    }

    fn measured(instructions: u64, commands: f64, scripts: f64) -> Measured {
        Measured {
            instructions_per_turn: instructions,
            coordinator: instructions / 2,
            worker: instructions / 4,
            client: instructions / 4,
            redis_commands_per_turn: commands,
            redis_scripts_per_turn: scripts,
        }
    }

    fn verdicts(lines: &[Line]) -> Vec<Verdict> {
        lines.iter().map(|l| l.verdict).collect()
    }

    #[test]
    fn a_figure_more_than_two_percent_over_fails() {
        let b = budget();
        assert_eq!(
            verdicts(&b.check(&measured(1_019_000, 20.3, 4.0))),
            [Verdict::Within; 3]
        );
        assert_eq!(
            verdicts(&b.check(&measured(1_021_000, 20.0, 4.0)))[0],
            Verdict::Over
        );
        assert_eq!(
            verdicts(&b.check(&measured(1_000_000, 20.5, 4.0)))[1],
            Verdict::Over
        );
        assert_eq!(
            verdicts(&b.check(&measured(1_000_000, 20.0, 5.0)))[2],
            Verdict::Over
        );
    }

    #[test]
    fn a_figure_well_under_asks_for_a_lower_budget() {
        let lines = budget().check(&measured(900_000, 20.0, 4.0));
        assert_eq!(
            verdicts(&lines),
            [Verdict::Under, Verdict::Within, Verdict::Within]
        );
    }

    #[test]
    fn writing_moves_every_figure_and_keeps_the_reason() {
        let next = budget().moved_to(&measured(800_000, 15.0, 2.0), "2026-12-02", "a cut");
        assert_eq!(next.instructions_per_turn, 800_000);
        assert_eq!(next.redis_scripts_per_turn, 2.0);
        assert_eq!(next.history.len(), 1);
        assert_eq!(next.history[0].why, "a cut");
        assert_eq!(
            verdicts(&next.check(&measured(800_000, 15.0, 2.0))),
            [Verdict::Within; 3]
        );
    }

    #[test]
    fn the_figures_come_from_the_traced_instructions_phase() {
        let report = json!({"modes": [
            {"tracing": "off", "instructions": null},
            {"tracing": "on", "instructions": {
                "per_turn": {"coordinator": 5, "worker": 3, "client": 2, "all": 10},
                "redis_per_turn": {"commands": 12.5, "scripts": 3.0}
            }}
        ]});
        let m = measured_in(&report).expect("figures");
        assert_eq!(m.instructions_per_turn, 10);
        assert_eq!(m.redis_commands_per_turn, 12.5);
        let untraced = json!({"modes": [{"tracing": "off", "instructions": {}}]});
        assert!(measured_in(&untraced).is_err());
    }

    #[test]
    fn the_shipped_budget_file_parses() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/budget.json");
        let text = std::fs::read_to_string(path).expect("docs/budget.json");
        let b: Budget = serde_json::from_str(&text).expect("a budget");
        assert!(b.tolerance > 0.0 && b.tolerance <= 0.05);
        assert!(b.instructions_per_turn > 0);
        let last = b.history.last().expect("the budget's history");
        assert_eq!(last.instructions_per_turn, b.instructions_per_turn);
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil(0), "1970-01-01");
        assert_eq!(civil(11_016), "2000-02-29");
        assert_eq!(civil(20_789), "2026-12-02");
    }
}
