//! What a chaos run found: the counts per fault, the table printed at the end and the
//! JSON file.
//!
//! Owns the definitions of the columns (what counts as lost, late, refused, counted
//! twice) as they are tallied from the turn records. It must never judge a turn from
//! anything but its record.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::load::{Ending, Later, TurnRecord, LOST_WATCH};
use super::Fault;
use crate::bench::stats::{round3, Latencies, Summary};

/// How long the watchers of second `final`s may still take once the load has stopped.
const SECOND_FINAL_WAIT: Duration = Duration::from_secs(5);
/// Turn ids listed per fault for the lost and counted-twice turns.
const LISTED_IDS: usize = 20;

/// The counts of one fault's run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FaultReport {
    /// The fault: `none`, `worker`, `coordinator`, `redis` or `nats`.
    pub fault: String,
    /// SIGKILLs sent (each followed by a restart).
    pub kills: usize,
    /// Seconds turns were submitted for.
    pub seconds: f64,
    /// Turns submitted.
    pub turns: usize,
    /// Turns whose `ack` (or `final`) arrived.
    pub accepted: usize,
    /// Turns that ended with a `final`.
    pub finals: usize,
    /// Turns with neither `final` nor `error` by deadline + patience.
    pub lost: usize,
    /// Of the lost turns, those whose `final` or `error` came within the following
    /// 30 s (`LOST_WATCH`): late beyond the patience rather than never ended.
    pub lost_then_ended: usize,
    /// Submit → that late `final` or `error` of each such turn, ms.
    pub lost_ended_after_ms: Vec<u64>,
    /// Turns whose `final` came later than deadline + the late threshold.
    pub late: usize,
    /// Turns that ended with a `final` after an event reached the frontend through its
    /// standby connection first (its own NATS server was silent too long).
    pub heard_through_standby: usize,
    /// Submissions that failed, or turns whose `error` said unavailable or retryable.
    pub refused: usize,
    /// Turns with two different `final`s, or a `final` that miscounts the calls.
    pub counted_twice: usize,
    /// Turn-level `error` events by code (refusals included).
    pub errors_by_code: BTreeMap<String, usize>,
    /// Refusals by client error kind or code.
    pub refused_by_reason: BTreeMap<String, usize>,
    /// The calls' terminal states in the `final`s (`done`, `timeout:deadline_exceeded`, …).
    pub call_states: BTreeMap<String, usize>,
    /// Submit → `final`, milliseconds.
    pub latency: Summary,
    /// Up to 20 lost turns' ids.
    pub lost_turn_ids: Vec<String>,
    /// What the frontend saw of those turns.
    pub lost_turns: Vec<LostTurn>,
    /// Up to 20 counted-twice turns' ids.
    pub counted_twice_turn_ids: Vec<String>,
    /// Redis's `used_memory` every [`MEMORY_EVERY`] of the load, bytes.
    pub redis_memory: Vec<MemorySample>,
}

/// How often the load samples Redis's memory.
pub const MEMORY_EVERY: Duration = Duration::from_secs(5);

/// Redis's memory at one moment of the load.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct MemorySample {
    /// Seconds since the load started.
    pub at_s: f64,
    /// `used_memory`, bytes.
    pub used_bytes: u64,
    /// `maxmemory`, bytes (0: none).
    pub max_bytes: u64,
}

/// What the frontend saw of one lost turn.
#[derive(Debug, Clone, Serialize)]
pub struct LostTurn {
    /// The turn id.
    pub turn_id: String,
    /// Whether its `ack` arrived.
    pub acked: bool,
    /// The last `seq` handed out by the patience (0: no event).
    pub last_seq: u64,
    /// The client error kind the wait ended with (`Timeout`, `Closed`, …).
    pub gave_up: String,
    /// The frontend's asks for the turn by then (the submission and each time it was
    /// sent again).
    pub asks: u32,
    /// How many of those NATS answered with "no responders".
    pub no_responders: u32,
    /// Submit → the `final` or `error` that came within the 30 s watched after, ms.
    pub ended_after_ms: Option<u64>,
    /// `final`, `error:<code>`, or the client error kind that ended the watch.
    pub ended_by: String,
}

impl FaultReport {
    /// Tallies `records`; waits (bounded) for the second-`final` watchers.
    pub async fn tally(
        fault: Fault,
        kills: usize,
        seconds: f64,
        late_after: Duration,
        deadline: Duration,
        records: Vec<TurnRecord>,
    ) -> Self {
        let mut report = Self {
            fault: fault.name().to_string(),
            kills,
            seconds: round3(seconds),
            turns: records.len(),
            ..Self::default()
        };
        let mut latencies = Latencies::default();
        for record in records {
            report.accepted += usize::from(record.acked);
            match record.ending {
                Ending::Refused {
                    reason, by_event, ..
                } => {
                    report.refused += 1;
                    if by_event {
                        *report.errors_by_code.entry(reason.clone()).or_default() += 1;
                    }
                    *report.refused_by_reason.entry(reason).or_default() += 1;
                }
                Ending::Error { code } => {
                    *report.errors_by_code.entry(code).or_default() += 1;
                }
                Ending::Lost {
                    gave_up,
                    last_seq,
                    asks: (asks, no_responders),
                    later,
                } => {
                    report.lost += 1;
                    push_id(&mut report.lost_turn_ids, &record.turn_id);
                    let later =
                        match tokio::time::timeout(LOST_WATCH + SECOND_FINAL_WAIT, later).await {
                            Ok(Ok(later)) => later,
                            Ok(Err(_)) | Err(_) => Later {
                                ended_after: None,
                                ended_by: "unwatched".into(),
                            },
                        };
                    let ended_after_ms = later.ended_after.map(|after| after.as_millis() as u64);
                    if let Some(ms) = ended_after_ms {
                        report.lost_then_ended += 1;
                        report.lost_ended_after_ms.push(ms);
                    }
                    if report.lost_turns.len() < LISTED_IDS {
                        report.lost_turns.push(LostTurn {
                            turn_id: record.turn_id.clone(),
                            acked: record.acked,
                            last_seq,
                            gave_up: format!("{gave_up:?}"),
                            asks,
                            no_responders,
                            ended_after_ms,
                            ended_by: later.ended_by,
                        });
                    }
                }
                Ending::Final {
                    latency,
                    counted_twice,
                    call_states,
                    through_standby,
                    second_final,
                } => {
                    report.finals += 1;
                    report.heard_through_standby += usize::from(through_standby);
                    latencies.push(latency);
                    report.late += usize::from(latency > deadline + late_after);
                    let second = tokio::time::timeout(SECOND_FINAL_WAIT, second_final)
                        .await
                        .is_ok_and(|seen| seen.unwrap_or(false));
                    if counted_twice || second {
                        report.counted_twice += 1;
                        push_id(&mut report.counted_twice_turn_ids, &record.turn_id);
                    }
                    for state in call_states {
                        *report.call_states.entry(state).or_default() += 1;
                    }
                }
            }
        }
        report.latency = latencies.summary();
        report
    }

    /// Whether the fault broke the guarantee: a turn lost or counted twice.
    pub fn failed(&self) -> bool {
        self.lost > 0 || self.counted_twice > 0
    }
}

fn push_id(ids: &mut Vec<String>, id: &str) {
    if ids.len() < LISTED_IDS {
        ids.push(id.to_string());
    }
}

/// The table printed at the end of a run.
pub fn table(reports: &[FaultReport], late_after: Duration) -> String {
    let late = format!("late (> deadline + {} s)", late_after.as_secs_f64());
    let mut out = format!(
        "| fault | kills | turns | accepted | lost (ended within 30 s more) | {late} | refused at submit | counted twice | p50 ms | p99 ms |\n|---|---|---|---|---|---|---|---|---|---|\n"
    );
    for r in reports {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} ({}) | {} | {} | {} | {:.1} | {:.1} |",
            r.fault,
            r.kills,
            r.turns,
            r.accepted,
            r.lost,
            r.lost_then_ended,
            r.late,
            r.refused,
            r.counted_twice,
            r.latency.p50_ms,
            r.latency.p99_ms
        );
    }
    for r in reports {
        if let Some(peak) = r.redis_memory.iter().map(|m| m.used_bytes).max() {
            let mb = |bytes: u64| bytes as f64 / 1_048_576.0;
            let series: Vec<String> = r
                .redis_memory
                .iter()
                .map(|m| format!("{:.1}", mb(m.used_bytes)))
                .collect();
            let max = r.redis_memory.last().map_or(0, |m| m.max_bytes);
            let _ = writeln!(
                out,
                "{} Redis used_memory MB every {} s (maxmemory {:.0} MB): {}; peak {:.1}",
                r.fault,
                MEMORY_EVERY.as_secs(),
                mb(max),
                series.join(" "),
                mb(peak)
            );
        }
        if r.heard_through_standby > 0 {
            let _ = writeln!(
                out,
                "{}: {} turns heard through the frontend's standby connection",
                r.fault, r.heard_through_standby
            );
        }
        if !r.errors_by_code.is_empty() {
            let _ = writeln!(out, "{} errors by code: {:?}", r.fault, r.errors_by_code);
        }
        for lost in &r.lost_turns {
            let after = lost
                .ended_after_ms
                .map_or_else(String::new, |ms| format!(" {ms} ms after submit"));
            let _ = writeln!(
                out,
                "{} lost turn {}: acked {}, last seq {}, {} asks ({} with no responders), gave up on {}; then {}{after}",
                r.fault,
                lost.turn_id,
                lost.acked,
                lost.last_seq,
                lost.asks,
                lost.no_responders,
                lost.gave_up,
                lost.ended_by
            );
        }
        if !r.refused_by_reason.is_empty() {
            let _ = writeln!(out, "{} refusals: {:?}", r.fault, r.refused_by_reason);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(turn_id: &str, last_seq: u64, later: Later) -> TurnRecord {
        TurnRecord {
            turn_id: turn_id.into(),
            acked: last_seq > 0,
            ending: Ending::Lost {
                gave_up: toolfleet_common::client::ClientErrorKind::Timeout,
                last_seq,
                asks: (4, 1),
                later: tokio::spawn(async move { later }),
            },
        }
    }

    #[tokio::test]
    async fn a_lost_turn_is_listed_with_what_came_after() {
        let records = vec![
            lost(
                "late",
                2,
                Later {
                    ended_after: Some(Duration::from_millis(9_500)),
                    ended_by: "final".into(),
                },
            ),
            lost(
                "never",
                0,
                Later {
                    ended_after: None,
                    ended_by: "Closed".into(),
                },
            ),
        ];
        let second = Duration::from_secs(1);
        let report = FaultReport::tally(Fault::Nats, 1, 1.0, second, 3 * second, records).await;
        assert_eq!((report.lost, report.lost_then_ended), (2, 1));
        assert_eq!(report.lost_ended_after_ms, vec![9_500]);
        assert_eq!(report.lost_turn_ids, vec!["late", "never"]);
        let seen: Vec<String> = report
            .lost_turns
            .iter()
            .map(|t| {
                format!(
                    "{} {} {} {}/{} {} {:?} {}",
                    t.turn_id,
                    t.acked,
                    t.last_seq,
                    t.asks,
                    t.no_responders,
                    t.gave_up,
                    t.ended_after_ms,
                    t.ended_by
                )
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                "late true 2 4/1 Timeout Some(9500) final",
                "never false 0 4/1 Timeout None Closed"
            ]
        );
        assert!(report.failed());
        assert!(table(&[report], second).contains("nats lost turn never"));
    }
}
