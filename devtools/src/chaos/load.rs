//! The load: a fixed number of turns kept in flight through [`FleetClient`], each turn
//! a few calls of the sleeping test tool, and what the frontend saw of each turn.
//!
//! Owns building the chaos turns, following each one to its end (a `final`, an `error`,
//! or nothing by its deadline plus the patience) and judging its `final`. It must never
//! look at the fleet's Redis or streams: it sees only what a frontend sees.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use toolfleet_common::client::{ClientErrorKind, TurnStream};
use toolfleet_common::turn::turn_codes;
use toolfleet_common::{CallError, FinalEvent, FleetClient, TurnEvent, TurnRequest};

use super::fleet::TOOL;
use super::MsRange;

/// Tenant of the chaos turns.
const TENANT: &str = "chaos";
/// How long a submission may take before it counts as refused.
const SUBMIT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the events of a turn are still read after its `final`, to see a second one.
const AFTER_FINAL: Duration = Duration::from_secs(1);

/// What the turns look like and how long the frontend waits for them.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Turns kept in flight.
    pub in_flight: usize,
    /// Calls per turn.
    pub calls: usize,
    /// Calls of a turn run at once (`None`: the coordinator's bound).
    pub concurrency: Option<usize>,
    /// Range of each call's sleep, milliseconds.
    pub call_ms: MsRange,
    /// The turn deadline.
    pub deadline: Duration,
    /// A turn with neither `final` nor `error` by deadline + this is lost.
    pub patience: Duration,
    /// Seed of the calls' durations.
    pub seed: u64,
}

/// How one turn ended, as the frontend saw it.
#[derive(Debug)]
pub enum Ending {
    /// The submission failed, or the turn's `error` says the fleet was unavailable.
    Refused {
        /// The client error kind (`Publish`, `submit_timeout`, …) or the error code.
        reason: String,
        /// Whether a turn `error` event said so (`reason` is then its code).
        by_event: bool,
        /// How long the refusal asked to wait before trying again.
        retry_after: Option<Duration>,
    },
    /// A turn-level `error` event that is not a refusal.
    Error {
        /// Its code.
        code: String,
    },
    /// A `final` event.
    Final {
        /// Submit → `final`.
        latency: Duration,
        /// Whether the `final` breaks the count (see [`counted_twice`]).
        counted_twice: bool,
        /// The calls' terminal states (`done`, `timeout`, …) and error codes.
        call_states: Vec<String>,
        /// Whether an event reached the frontend through its standby connection first
        /// (`TurnStream::heard_through_standby`).
        through_standby: bool,
        /// Reads the turn's events for a while after the `final`; `true` when a second,
        /// different `final` arrived.
        second_final: JoinHandle<bool>,
    },
    /// Neither `final` nor `error` by deadline + patience.
    Lost {
        /// Why the frontend stopped waiting: the client error kind (`Timeout` at the
        /// patience, `Closed` when the stream's subscription ended).
        gave_up: ClientErrorKind,
        /// The last `seq` the stream handed out (0: no event).
        last_seq: u64,
        /// The stream's asks by the patience, and how many NATS answered with "no
        /// responders".
        asks: (u32, u32),
        /// Reads the turn's events for [`LOST_WATCH`] more: what came after all.
        later: JoinHandle<Later>,
    },
}

/// What a lost turn's stream gave in the [`LOST_WATCH`] after the patience.
#[derive(Debug, Clone)]
pub struct Later {
    /// Submit → the `final` or `error` that came after all, if one did.
    pub ended_after: Option<Duration>,
    /// `final`, `error:<code>`, or the client error kind that ended the watch.
    pub ended_by: String,
}

/// How long a lost turn's events are still read, to tell a turn whose `final` came
/// after the patience from one that never got it.
pub const LOST_WATCH: Duration = Duration::from_secs(30);

/// One turn's record.
#[derive(Debug)]
pub struct TurnRecord {
    /// The turn id.
    pub turn_id: String,
    /// Whether its `ack` arrived.
    pub acked: bool,
    /// How it ended.
    pub ending: Ending,
}

/// Keeps `spec.in_flight` turns in flight until `stop` is cancelled, then lets every
/// turn in flight end (bounded by its deadline + patience) and returns every record.
/// `abort` ends the turns in flight at once instead (their records are dropped).
pub async fn run(
    client: FleetClient,
    spec: LoadSpec,
    stop: CancellationToken,
    abort: CancellationToken,
) -> Vec<TurnRecord> {
    let spec = Arc::new(spec);
    let mut slots = JoinSet::new();
    for slot in 0..spec.in_flight {
        let (client, spec, stop) = (client.clone(), spec.clone(), stop.clone());
        slots.spawn(async move {
            let mut rng = fastrand::Rng::with_seed(spec.seed.wrapping_add(slot as u64));
            let mut records = Vec::new();
            while !stop.is_cancelled() {
                let record = one_turn(&client, &spec, &mut rng).await;
                // A refusal that names a wait (`overloaded`) is honoured, as a frontend
                // should: asking again at once only adds to the load.
                let wait = match &record.ending {
                    Ending::Refused { retry_after, .. } => *retry_after,
                    _ => None,
                };
                records.push(record);
                if let Some(wait) = wait {
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
            records
        });
    }
    let mut records = Vec::new();
    loop {
        tokio::select! {
            joined = slots.join_next() => match joined {
                Some(Ok(slot_records)) => records.extend(slot_records),
                Some(Err(_)) => {}
                None => break,
            },
            _ = abort.cancelled() => {
                slots.abort_all();
                break;
            }
        }
    }
    records
}

/// A decision of `spec.calls` calls of [`TOOL`], each sleeping a random time in
/// `spec.call_ms`; the call ids, in order.
fn decision(spec: &LoadSpec, rng: &mut fastrand::Rng) -> (Value, Vec<String>) {
    let ids: Vec<String> = (0..spec.calls).map(|i| format!("call_{i}")).collect();
    let calls: Vec<Value> = ids
        .iter()
        .map(|id| {
            let sleep_ms = rng.u64(spec.call_ms.low..=spec.call_ms.high);
            json!({"id": id, "toolName": TOOL, "arguments": {"sleep_ms": sleep_ms}})
        })
        .collect();
    (json!({"type": "tool_calls", "calls": calls}), ids)
}

async fn one_turn(client: &FleetClient, spec: &LoadSpec, rng: &mut fastrand::Rng) -> TurnRecord {
    let turn_id = uuid::Uuid::new_v4().simple().to_string();
    let (decision, call_ids) = decision(spec, rng);
    let request = TurnRequest {
        turn_id: Some(turn_id.clone()),
        tenant_id: TENANT.into(),
        session_id: None,
        user_message: None,
        decision,
        deadline_ms: Some(spec.deadline.as_millis() as u64),
        options: toolfleet_common::turn::TurnOptions {
            concurrency: spec.concurrency,
            ..Default::default()
        },
        context: Map::new(),
    };
    let submitted = Instant::now();
    let stream = match tokio::time::timeout(SUBMIT_TIMEOUT, client.submit(request)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => return refused(turn_id, format!("{:?}", error.kind())),
        Err(_) => return refused(turn_id, "submit_timeout".into()),
    };
    follow(stream, spec, submitted, &call_ids).await
}

fn refused(turn_id: String, reason: String) -> TurnRecord {
    TurnRecord {
        turn_id,
        acked: false,
        ending: Ending::Refused {
            reason,
            by_event: false,
            retry_after: None,
        },
    }
}

/// Reads the turn's events until its `final` or `error`, or until deadline + patience
/// after `submitted`. Any event may arrive more than once; the first `final` or `error`
/// ends the turn.
async fn follow(
    mut stream: TurnStream,
    spec: &LoadSpec,
    submitted: Instant,
    call_ids: &[String],
) -> TurnRecord {
    let give_up = submitted + spec.deadline + spec.patience;
    let turn_id = stream.turn_id().to_string();
    let mut acked = false;
    let gave_up = loop {
        let left = give_up.saturating_duration_since(Instant::now());
        let event = match stream.next_event(left).await {
            Ok(event) => event,
            Err(error) if error.kind() == ClientErrorKind::Decode => continue,
            Err(error) => break error.kind(),
        };
        let ending = match event {
            TurnEvent::Final(fin) => Ending::Final {
                latency: submitted.elapsed(),
                counted_twice: counted_twice(&fin, call_ids),
                call_states: call_states(&fin),
                through_standby: stream.heard_through_standby(),
                second_final: tokio::spawn(second_final(stream, fin)),
            },
            TurnEvent::Error { error, .. } => turn_error(&error),
            TurnEvent::Ack { .. } => {
                acked = true;
                continue;
            }
            _ => continue,
        };
        return TurnRecord {
            turn_id,
            acked: acked || matches!(ending, Ending::Final { .. }),
            ending,
        };
    };
    TurnRecord {
        turn_id,
        acked,
        ending: Ending::Lost {
            gave_up,
            last_seq: stream.last_seq(),
            asks: (stream.asks(), stream.no_responders()),
            later: tokio::spawn(ended_later(stream, submitted)),
        },
    }
}

/// Reads a lost turn's events for [`LOST_WATCH`]: its `final` or `error`, if one comes,
/// else the client error that ended the watch.
async fn ended_later(mut stream: TurnStream, submitted: Instant) -> Later {
    let until = Instant::now() + LOST_WATCH;
    let ended = |ended_by: String| Later {
        ended_after: Some(submitted.elapsed()),
        ended_by,
    };
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match stream.next_event(left).await {
            Ok(TurnEvent::Final(_)) => return ended("final".into()),
            Ok(TurnEvent::Error { error, .. }) => return ended(format!("error:{}", error.code)),
            Ok(_) => {}
            Err(error) if error.kind() == ClientErrorKind::Decode => {}
            Err(error) => {
                return Later {
                    ended_after: None,
                    ended_by: format!("{:?}", error.kind()),
                }
            }
        }
    }
}

/// A turn-level `error`: a refusal when the fleet says it is unavailable (or that a
/// retry may succeed), an error of its code otherwise.
fn turn_error(error: &CallError) -> Ending {
    if error.code == turn_codes::UNAVAILABLE || error.retryable {
        Ending::Refused {
            reason: error.code.clone(),
            by_event: true,
            retry_after: error.retry_after_ms.map(Duration::from_millis),
        }
    } else {
        Ending::Error {
            code: error.code.clone(),
        }
    }
}

/// Whether a `final` counts the turn's calls wrongly: its summary's total is not the
/// number of calls, its states do not add up to the total, or its results do not hold
/// every call id exactly once.
pub fn counted_twice(fin: &FinalEvent, call_ids: &[String]) -> bool {
    let s = &fin.summary;
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for result in &fin.results {
        *seen.entry(result.tool_call_id.as_str()).or_default() += 1;
    }
    s.total != call_ids.len()
        || s.ok + s.errors + s.timeouts + s.skipped != s.total
        || seen.len() != call_ids.len()
        || call_ids.iter().any(|id| seen.get(id.as_str()) != Some(&1))
}

/// Each call's terminal state, with its error code when it has one (`error:<code>`).
fn call_states(fin: &FinalEvent) -> Vec<String> {
    fin.results
        .iter()
        .map(|r| {
            let state = serde_json::to_value(r.state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            match &r.error {
                Some(error) if !r.ok => format!("{state}:{}", error.code),
                _ => state,
            }
        })
        .collect()
}

/// Reads the stream for [`AFTER_FINAL`] after `first`; `true` when a `final` different
/// from `first` arrives (an identical one is a tolerated duplicate).
async fn second_final(mut stream: TurnStream, first: FinalEvent) -> bool {
    let until = Instant::now() + AFTER_FINAL;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match stream.next_event(left).await {
            Ok(TurnEvent::Final(fin)) if fin != first => return true,
            Ok(_) => {}
            Err(error) if error.kind() == ClientErrorKind::Decode => {}
            Err(_) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolfleet_common::call::{CallResult, CallState, Summary};

    fn fin(ids: &[&str], total: usize) -> FinalEvent {
        let results: Vec<CallResult> = ids
            .iter()
            .map(|id| {
                serde_json::from_value(json!({
                    "tool_call_id": id, "name": TOOL, "ok": true, "state": "done",
                    "result": {}
                }))
                .expect("a call result")
            })
            .collect();
        let mut summary = Summary::of(&results);
        summary.total = total;
        serde_json::from_value(json!({
            "turn_id": "t", "text": "", "results": results, "summary": summary,
            "history": {"openai": [], "anthropic": []}
        }))
        .expect("a final")
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_final_with_every_call_once_counts_right() {
        let calls = ids(&["a", "b", "c"]);
        assert!(!counted_twice(&fin(&["a", "b", "c"], 3), &calls));
        assert_eq!(
            call_states(&fin(&["a"], 1)),
            vec![serde_json::to_value(CallState::Done)
                .expect("a state")
                .as_str()
                .expect("a string")
                .to_string()]
        );
    }

    #[test]
    fn a_repeated_missing_or_miscounted_call_counts_twice() {
        let calls = ids(&["a", "b", "c"]);
        assert!(counted_twice(&fin(&["a", "a", "b", "c"], 4), &calls));
        assert!(counted_twice(&fin(&["a", "a", "b"], 3), &calls));
        assert!(counted_twice(&fin(&["a", "b"], 2), &calls));
        assert!(counted_twice(&fin(&["a", "b", "c"], 4), &calls));
    }

    #[test]
    fn unavailable_or_retryable_errors_are_refusals() {
        let error = |code: &str, retryable: bool| CallError {
            code: code.into(),
            message: String::new(),
            retryable,
            user_message: None,
            retry_after_ms: None,
        };
        assert!(matches!(
            turn_error(&error(turn_codes::UNAVAILABLE, false)),
            Ending::Refused { .. }
        ));
        assert!(matches!(
            turn_error(&error("whatever", true)),
            Ending::Refused { .. }
        ));
        assert!(matches!(
            turn_error(&error(turn_codes::INVALID_DECISION, false)),
            Ending::Error { .. }
        ));
    }
}
