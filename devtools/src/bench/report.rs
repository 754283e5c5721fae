//! The bench's output: Markdown tables of every figure side by side for each tracing
//! configuration, and the targets beside their measured figures.
//!
//! Owns the targets (goals and bounds) and the layout of the tables. It must never
//! measure, print or write files: it turns finished reports into text and values, and
//! the caller does the output.

use serde::Serialize;

use super::instructions::Instructions;
use super::phases::{Floor, Memory, Overhead, Parallel, Throughput};
use super::stats::{Machine, Summary};
use super::{Measured, ModeReport, Plan};

/// A target and how each configuration did.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What is measured.
    pub target: &'static str,
    /// The goal, in words.
    pub goal: &'static str,
    /// Measured figure per configuration, in the goal's unit (`None`: not measured).
    pub measured: Vec<(String, Option<f64>)>,
    /// Whether the traced figure (or the only one) meets the goal.
    pub met: Option<bool>,
}

/// Bytes in a MiB over bytes in an MB.
const MIB_IN_MB: f64 = 1.048_576;

/// Which side of its bound a figure must fall on.
#[derive(Debug, Clone, Copy)]
enum Bound {
    /// At most this much.
    AtMost(f64),
    /// At least this much.
    AtLeast(f64),
}

impl Bound {
    fn met_by(self, v: f64) -> bool {
        match self {
            Bound::AtMost(max) => v <= max,
            Bound::AtLeast(min) => v >= min,
        }
    }
}

/// One of the targets: what is measured, the goal, how to read the figure from a
/// configuration's report, and the bound the figure must meet.
struct Goal {
    target: &'static str,
    goal: &'static str,
    figure: fn(&ModeReport) -> Option<f64>,
    bound: Bound,
}

/// A figure over another of the same run, to three decimals; `None` when either is
/// missing or the divisor is not positive.
fn ratio(over: Option<f64>, under: Option<f64>) -> Option<f64> {
    match (over, under) {
        (Some(o), Some(u)) if u > 0.0 => Some((o / u * 1000.0).round() / 1000.0),
        _ => None,
    }
}

/// The bare durable turn's p50 or p99 of the same run (`floor` phase).
fn bare(r: &ModeReport, p99: bool) -> Option<f64> {
    let skeleton = r.floor.as_ref()?.figures.skeleton.as_ref()?;
    Some(if p99 {
        skeleton.turn.p99_ms
    } else {
        skeleton.turn.p50_ms
    })
}

/// CPU ms per turn in the throughput phase, summed over `kinds`.
fn cpu(r: &ModeReport, kinds: &[&str]) -> Option<f64> {
    let cpu = &r.throughput.as_ref()?.figures.cpu_ms_per_turn;
    Some(kinds.iter().filter_map(|k| cpu.get(*k)).sum())
}

/// The targets, in the order they are reported. The latency and CPU targets are ratios
/// to what the same run measured of the servers alone (the bare durable turn: the hops
/// a durable turn crosses with nothing of toolfleet between them), so that they judge
/// the fleet and not the machine the run landed on; the absolute figures are in the
/// tables above, with the machine named.
const GOALS: [Goal; 11] = [
    Goal {
        target: "overhead p50 ÷ bare durable turn p50 (3 no-op calls, concurrency 1)",
        goal: "≤ 1.5×",
        figure: |r| ratio(r.overhead.as_ref().map(|m| m.figures.turn.p50_ms), bare(r, false)),
        bound: Bound::AtMost(1.5),
    },
    Goal {
        target: "overhead p99 ÷ bare durable turn p99",
        goal: "≤ 2.0×",
        figure: |r| ratio(r.overhead.as_ref().map(|m| m.figures.turn.p99_ms), bare(r, true)),
        bound: Bound::AtMost(2.0),
    },
    Goal {
        target: "CPU per turn, coordinator + worker + client ÷ nats-server + redis-server",
        goal: "≤ 1.0×",
        figure: |r| {
            ratio(
                cpu(r, &["coordinator", "worker", "bench client"]),
                cpu(r, &["nats-server", "redis-server"]),
            )
        },
        bound: Bound::AtMost(1.0),
    },
    Goal {
        target: "3 × 50 ms turn p50 − 50 ms, ÷ bare durable turn p50",
        goal: "≤ 2.0×",
        figure: |r| {
            ratio(
                r.parallel.as_ref().map(|m| m.figures.turn.p50_ms - 50.0),
                bare(r, false),
            )
        },
        bound: Bound::AtMost(2.0),
    },
    Goal {
        target: "instructions per turn, coordinator + worker + client (3 no-op calls), millions",
        goal: "≤ 1.0",
        figure: |r| {
            r.instructions
                .as_ref()
                .and_then(|m| m.figures.per_turn.get("all"))
                .map(|all| (*all as f64 / 1_000.0).round() / 1_000.0)
        },
        bound: Bound::AtMost(1.0),
    },
    Goal {
        target: "throughput, turns/s of 3 calls each (held by the CPU ratio)",
        goal: "≥ 2,500 turns/s",
        figure: |r| r.throughput.as_ref().map(|m| m.figures.turns_per_s),
        bound: Bound::AtLeast(2_500.0),
    },
    Goal {
        target: "coordinator resident memory with 1,000 turns in flight, MB",
        goal: "≤ 64 MB",
        figure: |r| {
            r.memory
                .as_ref()
                .map(|m| (m.figures.in_flight_rss_mib * MIB_IN_MB * 10.0).round() / 10.0)
        },
        bound: Bound::AtMost(64.0),
    },
    Goal {
        target: "gateway overhead over the NATS client, p50 at concurrency 1 (JSON), ms",
        goal: "≤ +0.3 ms",
        figure: |r| r.http.as_ref().map(|m| m.figures.json_overhead_p50_ms),
        bound: Bound::AtMost(0.3),
    },
    Goal {
        target: "gateway throughput (JSON) as a share of the NATS client's, %",
        goal: "≥ 80 %",
        figure: |r| r.http.as_ref().map(|m| m.figures.json_throughput_pct),
        bound: Bound::AtLeast(80.0),
    },
    Goal {
        target: "chat-completions loop: added latency per round, p50 at concurrency 1, ms",
        goal: "≤ 2 ms",
        figure: |r| r.openai.as_ref().map(|m| m.figures.added_per_round_p50_ms),
        bound: Bound::AtMost(2.0),
    },
    Goal {
        target: "burst of 2,000 on 100 connections: 5xx other than 503 + Retry-After, plus 200s without final",
        goal: "0",
        figure: |r| {
            r.http.as_ref().map(|m| {
                let b = &m.figures.burst;
                let ok = b.statuses.get(&200).copied().unwrap_or(0);
                (b.bad + ok.saturating_sub(b.finals)) as f64
            })
        },
        bound: Bound::AtMost(0.0),
    },
];

impl Goal {
    /// This goal beside each configuration's figure; judged on the traced figure (or
    /// the only one).
    fn judge(&self, reports: &[ModeReport]) -> Target {
        let measured: Vec<(String, Option<f64>)> = reports
            .iter()
            .map(|r| (r.tracing.to_string(), (self.figure)(r)))
            .collect();
        let judged = reports
            .iter()
            .find(|r| r.tracing == "on")
            .or_else(|| reports.first())
            .and_then(self.figure);
        Target {
            target: self.target,
            goal: self.goal,
            measured,
            met: judged.map(|v| self.bound.met_by(v)),
        }
    }
}

/// The targets beside the measured figures.
pub fn targets(reports: &[ModeReport]) -> Vec<Target> {
    GOALS.iter().map(|g| g.judge(reports)).collect()
}

/// A Markdown table with padded columns.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: Vec<String>) -> Self {
        Self {
            header,
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let columns = self.header.len();
        let mut widths = vec![3usize; columns];
        for row in std::iter::once(&self.header).chain(&self.rows) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let padded: Vec<String> = (0..columns)
                .map(|i| {
                    let cell = cells.get(i).map(String::as_str).unwrap_or("");
                    let pad = widths[i].saturating_sub(cell.chars().count());
                    format!("{cell}{}", " ".repeat(pad))
                })
                .collect();
            format!("| {} |", padded.join(" | "))
        };
        let mut out = vec![line(&self.header)];
        out.push(format!(
            "|{}|",
            widths
                .iter()
                .map(|w| "-".repeat(w + 2))
                .collect::<Vec<_>>()
                .join("|")
        ));
        out.extend(self.rows.iter().map(|r| line(r)));
        out.join("\n")
    }
}

fn f1(x: f64) -> String {
    format!("{x:.1}")
}

fn ms(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

fn p50_p99(s: &Summary) -> String {
    format!("{} / {}", ms(s.p50_ms), ms(s.p99_ms))
}

/// `p50 / p99` of each of `summaries`, side by side (`a · b · c`).
fn each_p50_p99(summaries: &[&Summary]) -> String {
    let cells: Vec<String> = summaries.iter().map(|s| p50_p99(s)).collect();
    cells.join(" · ")
}

fn load(m: &Measured<impl Serialize>) -> String {
    format!("{:.2} → {:.2}", m.load_before[0], m.load_after[0])
}

/// Adds one row whose cells come from each configuration's report.
fn row(
    table: &mut Table,
    reports: &[ModeReport],
    phase: &str,
    figure: &str,
    cell: impl Fn(&ModeReport) -> Option<String>,
) {
    let cells: Vec<Option<String>> = reports.iter().map(&cell).collect();
    if cells.iter().all(Option::is_none) {
        return;
    }
    let mut out = vec![phase.to_string(), figure.to_string()];
    out.extend(cells.into_iter().map(|c| c.unwrap_or_else(|| "—".into())));
    table.row(out);
}

/// A cell of one phase's row, from that phase's figures in one configuration.
type Cell<T> = fn(&Measured<T>) -> String;

/// Adds a row for each `(figure, cell)` of one phase, whose figures `part` reads from
/// each configuration's report.
fn phase_rows<T>(
    table: &mut Table,
    reports: &[ModeReport],
    phase: &str,
    part: fn(&ModeReport) -> Option<&Measured<T>>,
    rows: &[(&str, Cell<T>)],
) {
    for (figure, cell) in rows {
        row(table, reports, phase, figure, |r| part(r).map(cell));
    }
}

/// `turns measured (failed)`: the turns a summary counts and the failed ones.
fn counted(turn: &Summary, failed: usize) -> String {
    format!("{} ({})", turn.count, failed)
}

/// A table's header: two leading columns, then one per tracing configuration.
fn header(first: &str, second: &str, reports: &[ModeReport]) -> Vec<String> {
    let mut header = vec![first.to_string(), second.to_string()];
    header.extend(reports.iter().map(|r| format!("tracing {}", r.tracing)));
    header
}

/// Every figure and the targets, as Markdown.
pub fn markdown(
    machine: &Machine,
    plan: &Plan,
    reports: &[ModeReport],
    load_start: [f64; 3],
    load_end: [f64; 3],
    seconds: f64,
) -> String {
    format!(
        "## toolfleet-dev bench\n\n\
         {} CPUs ({}), {} GiB, Linux {}; {} run, {:.0} s; load average 1/5/15 min: \
         {:.2} {:.2} {:.2} at start, {:.2} {:.2} {:.2} at end.\n\n\
         {}\n\n### Targets\n\n{}\n",
        machine.cpus,
        machine.cpu_model,
        machine.memory_gib,
        machine.kernel,
        if plan.quick { "quick" } else { "full" },
        seconds,
        load_start[0],
        load_start[1],
        load_start[2],
        load_end[0],
        load_end[1],
        load_end[2],
        figures_table(plan, reports).render(),
        targets_table(reports).render()
    )
}

/// The table of every phase's figures, one column per tracing configuration.
fn figures_table(plan: &Plan, reports: &[ModeReport]) -> Table {
    let mut t = Table::new(header("phase", "figure", reports));
    floor_rows(&mut t, reports);
    overhead_rows(&mut t, reports);
    throughput_rows(&mut t, plan, reports);
    parallel_rows(&mut t, reports);
    cancel_rows(&mut t, reports);
    tenants_rows(&mut t, reports);
    scaling_rows(&mut t, plan, reports);
    memory_rows(&mut t, plan, reports);
    http_rows(&mut t, reports);
    openai_rows(&mut t, reports);
    instructions_rows(&mut t, reports);
    row(
        &mut t,
        reports,
        "OTLP sink",
        "trace exports received (KiB) during throughput",
        |r| {
            r.throughput
                .as_ref()
                .and_then(|m| m.exported)
                .map(|e| format!("{} ({:.0})", e.trace_requests, e.kib))
        },
    );
    t
}

/// Adds the floor phase's rows: NATS, Redis and JetStream round trips.
fn floor_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<Floor>(
        t,
        reports,
        "floor",
        |r| r.floor.as_ref(),
        &[
            ("NATS request-reply p50 / p99 ms", |m| {
                p50_p99(&m.figures.nats_request_reply)
            }),
            ("Redis PING p50 / p99 ms", |m| {
                p50_p99(&m.figures.redis_ping)
            }),
            ("JetStream publish → ack p50 / p99 ms", |m| {
                p50_p99(&m.figures.jetstream_publish)
            }),
            ("floor = NATS p50 + Redis p50, ms", |m| {
                ms(m.figures.floor_p50_ms)
            }),
            (
                "bare durable turn of 3 calls (no toolfleet between the hops): ack / final p50 / p99 ms",
                |m| match &m.figures.skeleton {
                    Some(s) => format!("{} / {}", ms(s.ack.p50_ms), p50_p99(&s.turn)),
                    None => "—".into(),
                },
            ),
        ],
    );
}

/// Adds the overhead phase's rows: turn latencies, their steps and the floor multiple.
fn overhead_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<Overhead>(
        t,
        reports,
        "1 overhead: 3 × test.noop, concurrency 1",
        |r| r.overhead.as_ref(),
        &[
            ("submit → final p50 / p99 / p99.9 ms", |m| {
                let s = &m.figures.turn;
                format!("{} / {} / {}", ms(s.p50_ms), ms(s.p99_ms), ms(s.p999_ms))
            }),
            (
                "p50 ms submit → ack / 1st running or done / 1st done / last done",
                |m| {
                    let f = &m.figures;
                    format!(
                        "{} / {} / {} / {}",
                        ms(f.ack.p50_ms),
                        ms(f.first_running.p50_ms),
                        ms(f.first_done.p50_ms),
                        ms(f.last_done.p50_ms)
                    )
                },
            ),
            (
                "stage ms, mean of turns ≤ p50 → of turns ≥ p99: ack / running or done / 1st done / last done / final",
                |m| {
                    let t = &m.figures.tail;
                    t.typical_ms
                        .iter()
                        .zip(t.slowest_ms.iter())
                        .map(|(a, b)| format!("{} → {}", ms(*a), ms(*b)))
                        .collect::<Vec<_>>()
                        .join(" / ")
                },
            ),
            (
                "context switches per turn: coordinator / worker / nats-server / redis-server / bench client",
                |m| per_process(&m.figures.context_switches_per_turn, |v| format!("{v:.1}")),
            ),
            ("p50 as a multiple of the floor", |m| {
                m.figures
                    .floor_multiple_p50
                    .map_or_else(|| "—".into(), |x| format!("{x:.1}×"))
            }),
            ("p50 added over the bare durable turn, ms", |m| {
                m.figures
                    .over_skeleton_p50_ms
                    .map_or_else(|| "—".into(), |x| format!("+{}", ms(x)))
            }),
            ("turns measured (failed)", |m| {
                counted(&m.figures.turn, m.figures.failed)
            }),
            ("1-min load before → after", load),
        ],
    );
}

/// Adds the openai phase's rows: one round of the chat-completions loop.
fn openai_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<super::openai::Openai>(
        t,
        reports,
        "9 openai: /v1/chat/completions, one round of 3 × test.noop, instant model server",
        |r| r.openai.as_ref(),
        &[
            (
                "p50 / p99 ms model server · chat (2 model requests + 1 round) · gateway turn",
                |m| {
                    let f = &m.figures;
                    each_p50_p99(&[&f.upstream, &f.chat, &f.gateway_turn])
                },
            ),
            (
                "added per round (chat − 2 × model server), p50 ms",
                |m| format!("+{}", ms(m.figures.added_per_round_p50_ms)),
            ),
            ("requests measured (failed)", |m| {
                counted(&m.figures.chat, m.figures.failed)
            }),
        ],
    );
}

/// Adds the http phase's rows: the gateway beside the NATS client.
fn http_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<super::http::Http>(
        t,
        reports,
        "7 http: 3 × test.noop through the gateway",
        |r| r.http.as_ref(),
        &[
            (
                "p50 / p99 ms NATS client · JSON · SSE (concurrency 1)",
                |m| {
                    let f = &m.figures;
                    each_p50_p99(&[&f.nats, &f.json, &f.sse])
                },
            ),
            ("p50 over the NATS client, ms JSON / SSE", |m| {
                let f = &m.figures;
                format!(
                    "+{} / +{}",
                    ms(f.json_overhead_p50_ms),
                    ms(f.sse_overhead_p50_ms)
                )
            }),
            ("turns/s NATS client · JSON · SSE (64 in flight)", |m| {
                let f = &m.figures;
                format!(
                    "{} · {} · {}",
                    f1(f.nats_turns_per_s),
                    f1(f.json_turns_per_s),
                    f1(f.sse_turns_per_s)
                )
            }),
            ("JSON turns/s as % of the NATS client's", |m| {
                format!("{:.0} %", m.figures.json_throughput_pct)
            }),
            ("burst 2,000 × 100 connections: statuses (s)", |m| {
                let b = &m.figures.burst;
                let statuses: Vec<String> = b
                    .statuses
                    .iter()
                    .map(|(s, n)| format!("{s}: {n}"))
                    .collect();
                format!("{} ({:.1} s)", statuses.join(", "), b.seconds)
            }),
            ("burst: finals of 200s, 503 with Retry-After, bad", |m| {
                let b = &m.figures.burst;
                format!("{} / {} / {}", b.finals, b.refused_with_retry_after, b.bad)
            }),
            ("turns failed", |m| m.figures.failed.to_string()),
        ],
    );
}

/// Adds the throughput phase's rows: rates, latencies and CPU per turn.
fn throughput_rows(t: &mut Table, plan: &Plan, reports: &[ModeReport]) {
    phase_rows::<Throughput>(
        t,
        reports,
        &format!(
            "2 throughput: {} turns in flight, 3 × test.noop",
            plan.throughput_turns
        ),
        |r| r.throughput.as_ref(),
        &[
            ("turns/s", |m| f1(m.figures.turns_per_s)),
            ("calls/s", |m| f1(m.figures.calls_per_s)),
            ("turn p50 / p99 ms", |m| p50_p99(&m.figures.turn)),
            (
                "CPU ms per turn: coordinator / worker / nats-server / redis / bench client",
                |m| cpu_per_turn(&m.figures),
            ),
            (
                "peak RSS MiB: coordinator / worker / nats-server / redis / bench client",
                |m| per_process(&m.figures.peak_rss_mib, f1),
            ),
            ("CPUs busy (of the processes above)", |m| {
                format!("{:.2}", m.figures.cpus_busy)
            }),
            ("turns in the window (failed)", |m| {
                format!(
                    "{} in {} s ({})",
                    m.figures.turns, m.figures.seconds, m.figures.failed
                )
            }),
            ("1-min load before → after", load),
        ],
    );
}

/// CPU ms per turn of the coordinator, worker, nats-server, redis and bench client.
fn cpu_per_turn(figures: &Throughput) -> String {
    per_process(&figures.cpu_ms_per_turn, |v| format!("{v:.3}"))
}

/// A figure of the coordinator, worker, nats-server, redis and bench client, each
/// written by `show`.
fn per_process(
    figures: &std::collections::BTreeMap<String, f64>,
    show: fn(f64) -> String,
) -> String {
    [
        "coordinator",
        "worker",
        "nats-server",
        "redis-server",
        "bench client",
    ]
    .iter()
    .map(|k| {
        figures
            .get(*k)
            .map_or_else(|| "—".to_string(), |v| show(*v))
    })
    .collect::<Vec<_>>()
    .join(" / ")
}

/// Adds the parallel phase's rows: the 3 × 50 ms turn against a sequential runner.
fn parallel_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<Parallel>(
        t,
        reports,
        "3 parallel: 3 × test.behave 50 ms",
        |r| r.parallel.as_ref(),
        &[
            ("turn p50 / p99 ms", |m| p50_p99(&m.figures.turn)),
            ("slowest call as its worker timed it, p50 ms", |m| {
                ms(m.figures.slowest_call.p50_ms)
            }),
            ("3 × test.noop after 50 ms idle, p50 / p99 ms", |m| {
                p50_p99(&m.figures.idle_noop_turn)
            }),
            ("a sequential runner needs, ms", |m| {
                m.figures.sequential_ms.to_string()
            }),
            ("speedup (p50)", |m| {
                format!("{:.2}×", m.figures.speedup_p50)
            }),
            ("turns measured (failed)", |m| {
                counted(&m.figures.turn, m.figures.failed)
            }),
        ],
    );
}

/// Adds the cancel phase's rows.
fn cancel_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<super::phases::Cancel>(
        t,
        reports,
        "cancel: 1 × test.behave 2 s, cancelled once it runs",
        |r| r.cancel.as_ref(),
        &[
            ("cancel → final p50 / p99 ms", |m| {
                p50_p99(&m.figures.cancel_to_final)
            }),
            ("cancel → answer p50 / p99 ms", |m| {
                p50_p99(&m.figures.cancel_answered)
            }),
            ("turns measured (failed)", |m| {
                counted(&m.figures.cancel_to_final, m.figures.failed)
            }),
        ],
    );
}

/// Adds the tenants phase's rows.
fn tenants_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<super::tenants::Tenants>(
        t,
        reports,
        "tenants: heavy 64 × (4 × test.behave 200 ms) beside light 1 × 10 ms, 1 worker × 8",
        |r| r.tenants.as_ref(),
        &[
            ("heavy turns/s alone / beside light (ratio)", |m| {
                let f = &m.figures;
                let ratio = match f.heavy_alone_turns_per_s > 0.0 {
                    true => f.heavy_beside_turns_per_s / f.heavy_alone_turns_per_s * 100.0,
                    false => 0.0,
                };
                format!(
                    "{} / {} ({ratio:.0}%)",
                    f1(f.heavy_alone_turns_per_s),
                    f1(f.heavy_beside_turns_per_s)
                )
            }),
            ("light turn p50 / p99 / max ms", |m| {
                let l = &m.figures.light_turn;
                format!("{} / {}", p50_p99(l), ms(l.max_ms))
            }),
            ("light turns (deadline hit, failed)", |m| {
                let f = &m.figures;
                format!(
                    "{} ({}, {})",
                    f.light_turn.count, f.light_deadline_hit, f.light_failed
                )
            }),
            ("heavy turns failed, turns lost", |m| {
                format!("{}, {}", m.figures.heavy_failed, m.figures.lost)
            }),
        ],
    );
}

/// Adds the scaling phase's rows, one per worker count of the plan.
fn scaling_rows(t: &mut Table, plan: &Plan, reports: &[ModeReport]) {
    let phase = format!(
        "4 worker scaling: test.behave 20 ms, {} slots per worker",
        plan.scaling_concurrency
    );
    for (i, workers) in plan.scaling_workers.iter().enumerate() {
        let ideal = *workers as f64 * plan.scaling_concurrency as f64 * 50.0;
        let figure = format!(
            "{workers} worker{}: calls/s (ideal {ideal:.0}), turn p50 ms",
            if *workers == 1 { "" } else { "s" }
        );
        row(t, reports, &phase, &figure, |r| {
            r.scaling.get(i).map(|m| {
                format!(
                    "{} ({:.0}%), {}{}",
                    f1(m.figures.run.calls_per_s),
                    m.figures.efficiency * 100.0,
                    ms(m.figures.run.turn.p50_ms),
                    if m.figures.run.failed > 0 {
                        format!(", {} failed", m.figures.run.failed)
                    } else {
                        String::new()
                    }
                )
            })
        });
    }
}

/// Adds the memory phase's rows: coordinator RSS and how fast the turns were taken.
fn memory_rows(t: &mut Table, plan: &Plan, reports: &[ModeReport]) {
    phase_rows::<Memory>(
        t,
        reports,
        &format!("5 memory: {} turns × 3 calls in flight", plan.memory_turns),
        |r| r.memory.as_ref(),
        &[
            ("coordinator VmRSS idle / in flight / peak, MiB", |m| {
                format!(
                    "{} / {} / {}",
                    f1(m.figures.idle.rss_mib),
                    f1(m.figures.in_flight_rss_mib),
                    f1(m.figures.after.hwm_mib)
                )
            }),
            ("turns acknowledged in, s", |m| {
                format!(
                    "{:.2} ({} failed)",
                    m.figures.submit_seconds, m.figures.failed
                )
            }),
        ],
    );
}

/// Adds the instructions phase's rows: instructions per turn of each process.
fn instructions_rows(t: &mut Table, reports: &[ModeReport]) {
    phase_rows::<Instructions>(
        t,
        reports,
        "instructions: 3 × test.noop, concurrency 1, under callgrind",
        |r| r.instructions.as_ref(),
        &[
            (
                "instructions per turn: coordinator / worker / client / all",
                |m| {
                    ["coordinator", "worker", "client", "all"]
                        .iter()
                        .map(|k| {
                            m.figures
                                .per_turn
                                .get(k)
                                .map_or_else(|| "—".to_string(), |v| thousands(*v))
                        })
                        .collect::<Vec<_>>()
                        .join(" / ")
                },
            ),
            ("Redis per turn: commands / script calls", |m| {
                let r = &m.figures.redis_per_turn;
                let get = |k: &str| {
                    r.get(k)
                        .map_or_else(|| "—".to_string(), |v| format!("{v:.2}"))
                };
                format!("{} / {}", get("commands"), get("scripts"))
            }),
            ("turns of the short / long client run", |m| {
                format!("{} / {}", m.figures.turns[0], m.figures.turns[1])
            }),
        ],
    );
}

/// `n` with a comma between groups of three digits.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The table of the targets, each configuration's figure and whether it is met.
fn targets_table(reports: &[ModeReport]) -> Table {
    let mut goals_header = header("target", "goal", reports);
    goals_header.push("met".to_string());
    let mut goals = Table::new(goals_header);
    for target in targets(reports) {
        let mut cells = vec![target.target.to_string(), target.goal.to_string()];
        cells.extend(
            target
                .measured
                .iter()
                .map(|(_, v)| v.map_or_else(|| "—".to_string(), ms)),
        );
        cells.push(match target.met {
            Some(true) => "yes".into(),
            Some(false) => "no".into(),
            None => "—".into(),
        });
        goals.row(cells);
    }
    goals
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(2_308_960), "2,308,960");
    }

    #[test]
    fn tables_pad_columns() {
        let mut t = Table::new(vec!["a".into(), "bb".into()]);
        t.row(vec!["long cell".into(), "x".into()]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines
            .iter()
            .all(|l| l.chars().count() == lines[0].chars().count()));
    }

    #[test]
    fn ratios_are_taken_within_one_run_and_need_both_figures() {
        assert_eq!(ratio(Some(2.9), Some(1.0)), Some(2.9));
        assert_eq!(ratio(Some(1.0), Some(3.0)), Some(0.333));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
        assert_eq!(ratio(Some(1.0), None), None);
    }

    #[test]
    fn targets_judge_the_traced_figures() {
        let reports = vec![
            ModeReport {
                tracing: "off",
                ..Default::default()
            },
            ModeReport {
                tracing: "on",
                ..Default::default()
            },
        ];
        let targets = targets(&reports);
        assert_eq!(targets.len(), GOALS.len());
        assert!(targets.iter().all(|t| t.met.is_none()));
    }
}
