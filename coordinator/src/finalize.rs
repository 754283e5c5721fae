//! How a turn ends: every way, matched in one place, each published exactly once.
//!
//! Owns [`TurnEnd`] and [`finish`]: ordering a turn's results, filling in the calls that
//! never answered (`timeout`, or `skipped` when pacing never dispatched them), narrating,
//! and publishing `narration` + `final` (or the turn-level `error` of a rejected turn);
//! then exporting the turn span (`trace.rs`) from the identity stored with the turn, so
//! the replica that ends a turn produces its span even when another took it; then
//! forgetting the turn here and telling its owner when that is another replica. The
//! span is exported by whichever replica marks the stored `final` sent first: the one
//! that ended the turn, or one that sent a `final` stored by a replica that died
//! before sending it ([`sweep_turn`]'s resend, `sent::replayed_final` after an attach).
//!
//! Only a caller that the join let end the turn reaches here with a [`Closing`]: the
//! result that completed it (`results.rs`), the deadline clock or the sweeper
//! (`deadline.rs`, through [`end_open_turn`]), or intake when no call could run. Never
//! records results and never decides the deadline. This is the turn's last step.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use toolfleet_common::call::{codes, rfc3339, unix_ms};
use toolfleet_common::names::spans;
use toolfleet_common::telemetry;
use toolfleet_common::{
    CallError, CallResult, CallState, FinalEvent, Summary, ToolCall, TurnEvent,
};
use tracing::{debug, info_span, warn, Instrument};

use crate::admission::{self, Admission, Taken};
use crate::callers::Reply;
use crate::events;
use crate::fault;
use crate::finals;
use crate::limits::millis;
use crate::narrate::{NarrationInput, TemplateNarrator, FALLBACK};
use crate::replica::Replica;
use crate::sent::{mark_sent, send_stored_again};
use crate::store::redis::{CallEntry, Closing, Finalized, NewTurn, StoredFinal};
use crate::trace::{self, worst_outcome, EndedBy, TurnOutcome, TurnTrace};
use crate::turns::{Ready, Started};

/// Longest a narrator may take before the template narration is used instead.
pub const NARRATE_TIMEOUT: Duration = Duration::from_secs(2);

/// Every way a turn ends.
pub(crate) enum TurnEnd {
    /// Every call has its result: the last one was just recorded, or every call was
    /// refused up front.
    AllResultsIn {
        /// The turn.
        turn_id: String,
        /// Its calls and results from the join.
        closing: Closing,
    },
    /// The deadline passed before every result was in.
    Deadline {
        /// The turn.
        turn_id: String,
        /// Its calls and the results recorded in time.
        closing: Closing,
    },
    /// The caller cancelled the turn before every result was in.
    Cancelled {
        /// The turn.
        turn_id: String,
        /// Its calls and the results recorded before the cancel.
        closing: Closing,
    },
    /// The model answered without calling a tool: its text is the answer.
    NoTools {
        /// The turn, its caller and reply subject.
        taken: Taken,
        /// The tenant.
        tenant: String,
        /// The model's answer.
        text: String,
        /// The turn span, when traced.
        trace: Option<TurnTrace>,
    },
    /// The request, its decision or the turn store refused the turn before any call ran.
    Rejected {
        /// The turn, when the request named a usable one.
        turn_id: Option<String>,
        /// The frontend's reply subject.
        reply: Reply,
        /// Why, with a stable code.
        error: CallError,
        /// The turn span, when traced.
        trace: Option<TurnTrace>,
    },
}

/// Why a turn that ran calls ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndReason {
    /// Every call has its result.
    Complete,
    /// The deadline passed first.
    Deadline,
    /// The caller cancelled it first.
    Cancelled,
}

impl EndReason {
    /// The metric label and span attribute value (`meta.ended` in the join).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Complete => "complete",
            Self::Deadline => "deadline",
            Self::Cancelled => "cancelled",
        }
    }

    fn deadline_hit(self) -> bool {
        self == Self::Deadline
    }
}

/// Publishes the end of a turn. For the two ends that come from the join, this runs
/// once per turn: only the caller whose script ended the turn holds a [`Closing`].
pub(crate) async fn finish(replica: &Arc<Replica>, end: TurnEnd) {
    finish_by(replica, end, None).await;
}

/// [`finish`], saying how this replica came to end the turn (`None`: as the end
/// says: the completing result, the owner's deadline, the cancel).
async fn finish_by(replica: &Arc<Replica>, end: TurnEnd, by: Option<EndedBy>) {
    match end {
        TurnEnd::AllResultsIn { turn_id, closing } => {
            let by = by.unwrap_or(EndedBy::Result);
            close_turn(replica, &turn_id, closing, EndReason::Complete, by).await;
        }
        TurnEnd::Deadline { turn_id, closing } => {
            let by = by.unwrap_or(EndedBy::Deadline);
            close_turn(replica, &turn_id, closing, EndReason::Deadline, by).await;
        }
        TurnEnd::Cancelled { turn_id, closing } => {
            let by = by.unwrap_or(EndedBy::Cancel);
            close_turn(replica, &turn_id, closing, EndReason::Cancelled, by).await;
        }
        TurnEnd::NoTools {
            taken,
            tenant,
            text,
            trace,
        } => answer_without_tools(replica, taken, &tenant, text, trace).await,
        TurnEnd::Rejected {
            turn_id,
            reply,
            error,
            trace,
        } => reject(replica, turn_id.as_deref(), &reply, error, trace).await,
    }
}

/// A turn refused before any call ran: its one `error`, never stored.
async fn reject(
    replica: &Replica,
    turn_id: Option<&str>,
    reply: &Reply,
    error: CallError,
    trace: Option<TurnTrace>,
) {
    telemetry::set_error(&tracing::Span::current(), &error.code, &error.message);
    let outcome_error = error.clone();
    replica.metrics.turn_refused_once(turn_id, &error.code);
    let event = events::turn_error(turn_id, error);
    events::publish_unstored(&replica.nats, reply, &event).await;
    if let Some(trace) = trace {
        trace.end(&TurnOutcome {
            turn_id: turn_id.unwrap_or_default(),
            outcome: "rejected",
            summary: None,
            deadline_hit: false,
            error: Some(&outcome_error),
            ended_by: EndedBy::Intake,
        });
    }
}

/// Ends `turn_id` now unless it already ended: at its deadline (`deadline_hit`), or at
/// once when none of its calls could run. States of results recorded here before the
/// end are published first.
pub(crate) async fn end_open_turn(replica: &Arc<Replica>, turn_id: &str, deadline_hit: bool) {
    let by = if deadline_hit {
        EndedBy::Deadline
    } else {
        EndedBy::Intake
    };
    end_turn(replica, turn_id, deadline_hit, by).await;
}

/// Ends `turn_id`, found open past its deadline plus the grace by the sweeper (its
/// owner did not end it), or sends its stored `final` again.
pub(crate) async fn sweep_turn(replica: &Arc<Replica>, turn_id: &str) {
    end_turn(replica, turn_id, true, EndedBy::Sweeper).await;
}

/// [`end_open_turn`], ended `by` this path.
async fn end_turn(replica: &Arc<Replica>, turn_id: &str, deadline_hit: bool, by: EndedBy) {
    let reason = if deadline_hit { "deadline" } else { "complete" };
    let script = match replica.turns.trace(turn_id) {
        Some(trace) => {
            let span = trace::join_script("FINALIZE", turn_id, &trace.tenant);
            trace.parent(&span);
            span
        }
        None => tracing::Span::none(),
    };
    match replica
        .join
        .finalize(turn_id, reason)
        .instrument(script)
        .await
    {
        Ok(Finalized::Ended(closing)) => {
            let turn_id = turn_id.to_string();
            let end = if deadline_hit {
                TurnEnd::Deadline {
                    turn_id: turn_id.clone(),
                    closing,
                }
            } else {
                TurnEnd::AllResultsIn {
                    turn_id: turn_id.clone(),
                    closing,
                }
            };
            replica
                .turns
                .gated(&turn_id, |gate| async move {
                    let _ending = gate.recording.write().await;
                    let _publishing = gate.publishing.lock().await;
                    finish_by(replica, end, Some(by)).await;
                })
                .await;
        }
        Ok(Finalized::Unstored { closing, ended }) => {
            // Its replica died between ending the turn and storing the `final`.
            let turn_id = turn_id.to_string();
            let end = if closing.results.len() >= closing.calls.len() {
                TurnEnd::AllResultsIn { turn_id, closing }
            } else if ended == EndReason::Cancelled.label() {
                TurnEnd::Cancelled { turn_id, closing }
            } else {
                TurnEnd::Deadline { turn_id, closing }
            };
            finish_by(replica, end, Some(EndedBy::Recovery)).await;
        }
        Ok(Finalized::AlreadyEnded { published: false }) => {
            // Stored but not marked sent: its replica died before sending it, is
            // sending it now, or stored it without hearing back (a `RECORD` that closed
            // the turn ahead and whose reply was lost); a frontend drops what it
            // already has by `seq`. An owner here forgets the turn.
            send_stored_again(replica, turn_id).await;
            replica.turns.release(turn_id);
        }
        Ok(Finalized::AlreadyEnded { published: true } | Finalized::UnknownTurn) => {
            replica.turns.release(turn_id);
            if let Err(error) = replica.join.forget_deadline(turn_id).await {
                debug!(%turn_id, %error, "deadline index cleanup failed");
            }
        }
        // The turn stays open in Redis with its deadline entry: the sweeper ends it.
        Err(error) => {
            replica.metrics.redis_error("end_turn");
            warn!(%turn_id, %error, "ending the turn failed; the sweeper retries")
        }
    }
}

/// Publishes the end of `turn_id` from what the join returned, then exports the turn
/// span (whichever replica this is). Only the replica whose `final` was stored does the
/// rest; another that stored first does it instead.
async fn close_turn(
    replica: &Arc<Replica>,
    turn_id: &str,
    closing: Closing,
    reason: EndReason,
    ended_by: EndedBy,
) {
    let deadline_hit = reason.deadline_hit();
    let trace = closing.trace.as_deref().and_then(TurnTrace::decode);
    let tenant = trace.as_ref().map(|t| t.tenant.clone()).unwrap_or_default();
    let span = join_span(turn_id, &tenant, reason);
    match (&trace, &closing.traceparent) {
        (Some(trace), _) => trace.parent(&span),
        (None, Some(traceparent)) => telemetry::set_parent_from_traceparent(&span, traceparent),
        (None, None) => {}
    }
    let created_unix_ms = closing.created_unix_ms;
    if reason != EndReason::Complete {
        release_lanes(replica, turn_id, &closing).await;
    }
    let (summary, error, sent) = async {
        let started = replica.turns.started(turn_id);
        let (ordered, missing) = complete_results(closing, reason, &started);
        let summary = Summary::of(&ordered);
        let error = worst_outcome(&ordered, deadline_hit);
        record_summary(&tracing::Span::current(), &summary, error.as_ref());
        let ending = Ending {
            turn_id,
            tenant: &tenant,
            missing: &missing,
            deadline_hit,
        };
        let sent = publish_final(replica, ending, ordered).await;
        if sent.is_some() {
            for result in &missing {
                replica.metrics.call_result(&result.name, result);
            }
        }
        (summary, error, sent)
    }
    .instrument(span)
    .await;
    let Some(marked_first) = sent else {
        replica.turns.release(turn_id);
        return;
    };
    let ended = Ended {
        turn_id,
        reason,
        summary: &summary,
        error: error.as_ref(),
        created_unix_ms,
        ended_by,
        marked_first,
    };
    turn_ended(replica, trace.as_ref(), ended).await;
}

/// Releases what a turn ending without all its results holds on the tools' lanes and
/// among its tenant's turns in flight (`sharing::turn_closed`); a completed turn's last
/// result released them as it was recorded.
async fn release_lanes(replica: &Arc<Replica>, turn_id: &str, closing: &Closing) {
    let missing: Vec<(&str, &str)> = closing
        .calls
        .iter()
        .filter(|(key, _)| !closing.results.contains_key(*key))
        .map(|(key, entry)| (entry.name.as_str(), key.as_str()))
        .collect();
    crate::sharing::turn_closed(
        replica.sharing(),
        &closing.tenant,
        turn_id,
        closing.deadline_unix_ms,
        &missing,
        closing.laned,
    )
    .await;
}

/// A turn whose `final` this replica stored and sent.
struct Ended<'a> {
    turn_id: &'a str,
    reason: EndReason,
    summary: &'a Summary,
    /// What the `join` span reports as its error.
    error: Option<&'a CallError>,
    /// When the turn was taken, Unix milliseconds.
    created_unix_ms: u64,
    /// How this replica came to end it.
    ended_by: EndedBy,
    /// This replica marked the `final` sent first: it, and no other, exports the turn
    /// span.
    marked_first: bool,
}

/// After a turn's `final` went out from here: ends the turn span (when this replica
/// marked the `final` sent first), counts the turn, tells the replica that took the
/// turn when that is another one, and forgets it.
async fn turn_ended(replica: &Arc<Replica>, trace: Option<&TurnTrace>, ended: Ended<'_>) {
    let Ended {
        turn_id,
        reason,
        summary,
        error,
        created_unix_ms,
        ended_by,
        marked_first,
    } = ended;
    let deadline_hit = reason.deadline_hit();
    if let Some(trace) = trace.filter(|_| marked_first) {
        trace.end(&TurnOutcome {
            turn_id,
            outcome: reason.label(),
            summary: Some(summary),
            deadline_hit,
            error,
            ended_by,
        });
    }
    let turn_seconds = unix_ms().saturating_sub(created_unix_ms) as f64 / 1000.0;
    replica.metrics.turn_ended(reason.label(), turn_seconds);
    // Another replica that took the turn is told; this one forgets it at once.
    if !replica.turns.owns(turn_id) {
        events::notify_ended(&replica.nats, &replica.names, turn_id).await;
    }
    replica.turns.release(turn_id);
}

/// The `join` span's summary attributes and its error.
fn record_summary(span: &tracing::Span, summary: &Summary, error: Option<&CallError>) {
    span.record("toolfleet.summary.ok", summary.ok as i64);
    span.record("toolfleet.summary.errors", summary.errors as i64);
    span.record("toolfleet.summary.timeouts", summary.timeouts as i64);
    span.record("toolfleet.summary.skipped", summary.skipped as i64);
    span.record("toolfleet.summary.cancelled", summary.cancelled as i64);
    if let Some(error) = error {
        telemetry::set_error(span, &error.code, &error.message);
    }
}

/// The closing events of an owned turn, built before its last result is recorded
/// (`results.rs`), with what ending the turn reports.
pub(crate) struct ClosedAhead {
    /// The narration chunks and the `final`, last.
    pub events: ClosingEvents,
    /// Each other call's key and the stored body of its result in the `final`.
    pub checks: Vec<(String, Vec<u8>)>,
    summary: Summary,
    error: Option<CallError>,
    created_unix_ms: u64,
    trace: Option<TurnTrace>,
}

/// Builds the closing events of an owned turn from `ready` (every call's result, the
/// one being recorded included), when the narrator narrates ahead: under a `narrate`
/// span, a child of the current span (the completing result's). `None` when the
/// narrator narrates only after the join.
pub(crate) fn close_ahead(
    replica: &Replica,
    turn_id: &str,
    tenant: &str,
    ready: Ready,
) -> Option<ClosedAhead> {
    if !replica.narrator.narrates_ahead() {
        return None;
    }
    let Ready {
        results,
        checks,
        created_unix_ms,
        trace,
    } = ready;
    let chunks = {
        let registry = replica.registry.snapshot();
        let input = NarrationInput {
            user_message: None,
            results: &results,
            tools: results
                .iter()
                .map(|r| registry.get(&r.name).map(|t| &t.definition))
                .collect(),
        };
        let _narrating = narrate_span(turn_id, tenant).entered();
        match replica.narrator.narrate_ahead(&input)? {
            chunks if chunks.is_empty() => vec![FALLBACK.to_string()],
            chunks => chunks,
        }
    };
    let summary = Summary::of(&results);
    let error = worst_outcome(&results, false);
    let events = closing_events(replica, turn_id, chunks, results, &[], false);
    Some(ClosedAhead {
        events,
        checks,
        summary,
        error,
        created_unix_ms,
        trace,
    })
}

/// Ends a turn whose completing `RECORD` stored `closed`'s events after the call's
/// `state` (at `seq`): sends them, marks the `final` sent and ends the turn, under a
/// `join` span as [`close_turn`] does.
pub(crate) async fn send_closed_ahead(
    replica: &Arc<Replica>,
    turn_id: &str,
    reply: &str,
    seq: u64,
    state: String,
    closed: ClosedAhead,
) {
    let ClosedAhead {
        events: closing,
        summary,
        error,
        created_unix_ms,
        trace,
        ..
    } = closed;
    let tenant = trace
        .as_ref()
        .map(|t| t.tenant.as_str())
        .unwrap_or_default();
    let span = join_span(turn_id, tenant, EndReason::Complete);
    if let Some(trace) = &trace {
        trace.parent(&span);
    }
    record_summary(&span, &summary, error.as_ref());
    let marked_first = async {
        fault::point(fault::EXIT_AFTER_FINAL_STORED);
        let mut sent = Vec::with_capacity(closing.sent.len() + 1);
        sent.push(state);
        sent.extend(closing.sent);
        events::publish_kept(&replica.nats, reply, seq, &sent).await;
        mark_sent(&*replica.join, &replica.metrics, turn_id).await
    }
    .instrument(span)
    .await;
    let ended = Ended {
        turn_id,
        reason: EndReason::Complete,
        summary: &summary,
        error: error.as_ref(),
        created_unix_ms,
        ended_by: EndedBy::Result,
        marked_first,
    };
    turn_ended(replica, trace.as_ref(), ended).await;
}

/// A no-tool turn: stored with its narration and `final`, then sent. A resubmission
/// of the same id by the same frontend replays it.
async fn answer_without_tools(
    replica: &Arc<Replica>,
    taken: Taken,
    tenant: &str,
    text: String,
    trace: Option<TurnTrace>,
) {
    let turn_id = &taken.turn_id;
    let narration = TurnEvent::Narration {
        turn_id: turn_id.clone(),
        text: text.clone(),
    };
    let event = TurnEvent::Final(FinalEvent {
        turn_id: turn_id.clone(),
        text,
        results: Vec::new(),
        summary: Summary::default(),
        history: Default::default(),
        deadline_hit: false,
        history_omitted: false,
    });
    let stored: Vec<String> = [&narration, &event]
        .into_iter()
        .filter_map(events::encode)
        .collect();
    let (traceparent, stored_trace) = TurnTrace::stored(trace.as_ref());
    let now = unix_ms();
    let turn = NewTurn {
        turn_id,
        reply: taken.reply.as_str(),
        digest: &taken.digest,
        tenant,
        deadline_unix_ms: now + millis(replica.config.sweep_grace),
        paced: false,
        calls: Vec::new(),
        results: Vec::new(),
        ttl_ms: millis(replica.config.retention),
        created_unix_ms: now,
        traceparent: &traceparent,
        trace: &stored_trace,
        caller: &taken.caller,
        events: stored.clone(),
        ended: true,
        queued: Vec::new(),
        laned: false,
    };
    match admission::admit(replica.outbox(), turn, &taken.reply).await {
        Admission::New => {}
        Admission::Replayed => return,
        Admission::Refused(error) => {
            return reject(replica, Some(turn_id), &taken.reply, error, trace).await;
        }
    }
    events::publish_stored(&replica.nats, &taken.reply, 1, &stored).await;
    let marked_first = match replica.join.mark_published(turn_id).await {
        Ok(first) => first,
        Err(error) => {
            debug!(%turn_id, %error, "could not mark the final sent; the sweeper sends it again");
            false
        }
    };
    if let Some(trace) = trace.filter(|_| marked_first) {
        trace.end(&TurnOutcome {
            turn_id,
            outcome: "no_tools",
            summary: None,
            deadline_hit: false,
            error: None,
            ended_by: EndedBy::Intake,
        });
    }
}

/// The `join` span: ending the turn from the join's answer, narrating, publishing.
fn join_span(turn_id: &str, tenant: &str, reason: EndReason) -> tracing::Span {
    info_span!(
        parent: None,
        "join",
        otel.name = spans::JOIN,
        toolfleet.turn.id = turn_id,
        toolfleet.tenant.id = tenant,
        toolfleet.turn.deadline_hit = reason.deadline_hit(),
        toolfleet.turn.outcome = reason.label(),
        toolfleet.summary.ok = tracing::field::Empty,
        toolfleet.summary.errors = tracing::field::Empty,
        toolfleet.summary.timeouts = tracing::field::Empty,
        toolfleet.summary.skipped = tracing::field::Empty,
        toolfleet.summary.cancelled = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// The turn's results in the model's order, a `timeout`, `skipped` or `cancelled` result
/// standing in for each call that has none; those stand-ins are also returned on their
/// own (their states are stored and sent with the `final`).
fn complete_results(
    closing: Closing,
    reason: EndReason,
    started: &HashMap<String, Started>,
) -> (Vec<CallResult>, Vec<CallResult>) {
    let Closing {
        calls, mut results, ..
    } = closing;
    let mut entries: Vec<(String, CallEntry)> = calls.into_iter().collect();
    entries.sort_by_key(|(_, e)| e.index);
    let mut ordered = Vec::with_capacity(entries.len());
    let mut missing = Vec::new();
    for (key, entry) in entries {
        let result = match results.remove(&key) {
            Some(r) => r,
            None => {
                let stand_in = missing_result(&entry, reason, started.get(&entry.id));
                missing.push(stand_in.clone());
                stand_in
            }
        };
        ordered.push(result);
    }
    (ordered, missing)
}

/// What a turn's end is told besides its results.
struct Ending<'a> {
    turn_id: &'a str,
    tenant: &'a str,
    /// Stand-in results of calls that never answered: their states go out first.
    missing: &'a [CallResult],
    deadline_hit: bool,
}

/// Narrates `results`, stores the closing events (the missing calls' states, the
/// `narration` chunks, the `final` last), then sends them and marks the `final` sent:
/// whether this call marked it sent first (`sent::mark_sent`). `None` when nothing was
/// stored here (another replica stored the turn's `final` first, or Redis failed: the
/// sweeper ends the turn later).
async fn publish_final(
    replica: &Arc<Replica>,
    ending: Ending<'_>,
    results: Vec<CallResult>,
) -> Option<bool> {
    let Ending {
        turn_id,
        tenant,
        missing,
        deadline_hit,
    } = ending;
    let chunks = narrate(replica, turn_id, tenant, &results).await;
    let closing = closing_events(replica, turn_id, chunks, results, missing, deadline_hit);
    match replica.join.store_final(turn_id, &closing.stored).await {
        Ok(StoredFinal::Stored { reply, first_seq }) => {
            fault::point(fault::EXIT_AFTER_FINAL_STORED);
            events::publish_kept(&replica.nats, &reply, first_seq, &closing.sent).await;
            Some(mark_sent(&*replica.join, &replica.metrics, turn_id).await)
        }
        Ok(StoredFinal::StoredBefore | StoredFinal::UnknownTurn) => None,
        Err(error) => {
            replica.metrics.redis_error("store_final");
            warn!(%turn_id, %error, "could not store the final; the sweeper ends the turn");
            None
        }
    }
}

/// A turn's closing events: the states of the calls that never answered (`missing`),
/// the narration `chunks`, and the `final` holding `results`, fitted to the largest
/// message the NATS server takes; as stored and as sent (`finals.rs`).
fn closing_events(
    replica: &Replica,
    turn_id: &str,
    chunks: Vec<String>,
    results: Vec<CallResult>,
    missing: &[CallResult],
    deadline_hit: bool,
) -> ClosingEvents {
    let text = chunks.join(" ");
    let narration = chunks.into_iter().map(|text| TurnEvent::Narration {
        turn_id: turn_id.to_string(),
        text,
    });
    let mut stored: Vec<String> = missing
        .iter()
        .map(|r| events::result_state(turn_id, r))
        .chain(narration)
        .filter_map(|e| events::encode(&e))
        .collect();
    let mut sent = stored.clone();
    let limit = finals::limit(&replica.nats);
    if let Some(last) = finals::encode(turn_id, &text, results, deadline_hit, limit) {
        stored.push(last.stored);
        sent.push(last.sent);
    }
    ClosingEvents { stored, sent }
}

/// A turn's closing events (narration, `final` last) as stored and as sent: the same
/// events but the `final`, stored without its history and sent with it.
pub(crate) struct ClosingEvents {
    /// What the turn's event list keeps.
    pub stored: Vec<String>,
    /// What the frontend is sent.
    pub sent: Vec<String>,
}

/// The `narrate` span of a turn.
fn narrate_span(turn_id: &str, tenant: &str) -> tracing::Span {
    info_span!(
        "narrate",
        otel.name = spans::NARRATE,
        toolfleet.turn.id = turn_id,
        toolfleet.tenant.id = tenant,
    )
}

/// The narration of `results`: the narrator's chunks, or the templates' when it fails
/// or takes longer than [`NARRATE_TIMEOUT`].
async fn narrate(
    replica: &Arc<Replica>,
    turn_id: &str,
    tenant: &str,
    results: &[CallResult],
) -> Vec<String> {
    let registry = replica.registry.snapshot();
    let tools: Vec<_> = results
        .iter()
        .map(|r| registry.get(&r.name).map(|t| &t.definition))
        .collect();
    let input = NarrationInput {
        user_message: None,
        results,
        tools,
    };
    let narration = tokio::time::timeout(NARRATE_TIMEOUT, replica.narrator.narrate(&input))
        .instrument(narrate_span(turn_id, tenant))
        .await;
    match narration {
        Ok(Ok(chunks)) if !chunks.is_empty() => chunks,
        Ok(Ok(_)) => vec![FALLBACK.to_string()],
        Ok(Err(error)) => {
            warn!(%turn_id, %error, "narrator failed; narrating from the templates");
            TemplateNarrator::chunks(&input)
        }
        Err(_) => {
            warn!(%turn_id, "narrator timed out; narrating from the templates");
            TemplateNarrator::chunks(&input)
        }
    }
}

/// The result of a call that has none at the end: `cancelled` when the caller cancelled
/// the turn, `skipped` when pacing never dispatched it, `timeout` otherwise.
fn missing_result(entry: &CallEntry, reason: EndReason, started: Option<&Started>) -> CallResult {
    let call = ToolCall {
        id: entry.id.clone(),
        name: entry.name.clone(),
        arguments: serde_json::Value::Null,
        parent_id: entry.parent_id.clone(),
    };
    let (state, error) = if reason == EndReason::Cancelled {
        (
            CallState::Cancelled,
            CallError::fatal(codes::CANCELLED, "cancelled by the caller"),
        )
    } else if entry.queued {
        let message = "the turn ended before the call was dispatched";
        (
            CallState::Skipped,
            CallError::retryable(codes::NOT_DISPATCHED, message),
        )
    } else {
        let message = "no result before the turn's deadline";
        (
            CallState::Timeout,
            CallError::retryable(codes::DEADLINE_EXCEEDED, message),
        )
    };
    let mut result = CallResult::failure(&call, state, error);
    if let Some(started) = started {
        let now = unix_ms();
        let at = |ms: u64| {
            time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
                .ok()
                .map(rfc3339)
        };
        result.started_at = at(started.unix_ms);
        result.ended_at = at(now);
        result.duration_ms = now.saturating_sub(started.unix_ms);
        result.attempts = started.attempt;
        result.worker_id = Some(started.worker_id.clone());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TurnStore;
    use crate::testing::{self, ended, event_types, finals, open, stored};

    #[tokio::test]
    async fn ending_a_turn_from_several_places_at_once_publishes_one_final() {
        let (store, replica) = testing::store_and_replica().await;
        open(&store, "t1").await;
        futures::join!(
            end_open_turn(&replica, "t1", true),
            end_open_turn(&replica, "t1", true),
            sweep_turn(&replica, "t1"),
        );
        let turn = stored(&store, "t1");
        assert_eq!(turn.ended.as_deref(), Some("deadline"));
        assert_eq!(finals(&turn), 1);
        assert_eq!(turn.published, 1);
        assert_eq!(
            store.deadline_of("t1"),
            None,
            "a sent final leaves the index"
        );
        // Every call without a result is in the final as timed out.
        let last = turn.events.last().cloned().unwrap_or_default();
        assert_eq!(last.matches(r#""state":"timeout""#).count(), 2, "{last}");
    }

    #[tokio::test]
    async fn a_final_stored_but_never_sent_is_sent_again_and_marked_once() {
        let (store, replica) = testing::store_and_replica().await;
        // The replica that ended the turn stored its final and died before sending it.
        ended(&store, "t1").await;
        let closing = [
            r#"{"type":"narration"}"#.to_string(),
            r#"{"type":"final"}"#.to_string(),
        ];
        assert!(matches!(
            store.store_final("t1", &closing).await,
            Ok(StoredFinal::Stored { .. })
        ));
        sweep_turn(&replica, "t1").await;
        sweep_turn(&replica, "t1").await;
        let turn = stored(&store, "t1");
        assert_eq!(turn.published, 1, "sent again once, then left alone");
        assert_eq!(finals(&turn), 1);
        assert_eq!(store.deadline_of("t1"), None);
    }

    #[tokio::test]
    async fn a_turn_ended_without_a_stored_final_is_finished_by_whoever_finds_it() {
        let (store, replica) = testing::store_and_replica().await;
        // Ended, and its replica died before storing the final.
        ended(&store, "t1").await;
        sweep_turn(&replica, "t1").await;
        let turn = stored(&store, "t1");
        assert_eq!(event_types(&turn).last().map(String::as_str), Some("final"));
        assert_eq!((finals(&turn), turn.published), (1, 1));
    }

    #[tokio::test]
    async fn a_turn_the_store_cannot_end_stays_open_for_the_sweeper() {
        let (store, replica) = testing::store_and_replica().await;
        open(&store, "t1").await;
        store.set_unavailable(true);
        end_open_turn(&replica, "t1", true).await;
        store.set_unavailable(false);
        let turn = stored(&store, "t1");
        assert_eq!((turn.state.as_str(), finals(&turn)), ("open", 0));
        assert!(
            store.deadline_of("t1").is_some(),
            "its deadline entry stays"
        );
    }

    fn timed_out(code: &str) -> CallResult {
        let call = ToolCall {
            id: "c".into(),
            name: "t".into(),
            arguments: serde_json::Value::Null,
            parent_id: None,
        };
        CallResult::failure(
            &call,
            CallState::Timeout,
            CallError::retryable(code, "no result"),
        )
    }

    #[test]
    fn a_turn_fails_with_its_worst_call_and_blames_the_deadline_when_it_passed() {
        let results = [timed_out(codes::TOOL_TIMEOUT)];
        let code = |deadline_hit| worst_outcome(&results, deadline_hit).map(|e| e.code);
        assert_eq!(code(false).as_deref(), Some(codes::TOOL_TIMEOUT));
        assert_eq!(code(true).as_deref(), Some(codes::DEADLINE_EXCEEDED));
        assert!(worst_outcome(&[], false).is_none());

        let call = ToolCall {
            id: "ok".into(),
            name: "t".into(),
            arguments: serde_json::Value::Null,
            parent_id: None,
        };
        let ok = CallResult::success(&call, serde_json::json!(1));
        let failed = |state, code: &str| {
            let mut call = call.clone();
            call.id = code.into();
            CallResult::failure(&call, state, CallError::fatal(code, "no"))
        };
        assert!(worst_outcome(std::slice::from_ref(&ok), false).is_none());
        // One of two calls failed: the turn failed, with that call's code.
        let one_failed = [ok.clone(), failed(CallState::Error, "boom")];
        let error = worst_outcome(&one_failed, false);
        assert_eq!(error.as_ref().map(|e| e.code.as_str()), Some("boom"));
        assert!(error.is_some_and(|e| e.message.starts_with("1 of 2 call(s)")));
        // A timeout is worse than an error, an error than a refusal never dispatched.
        let mixed = [
            failed(CallState::Skipped, codes::NOT_DISPATCHED),
            failed(CallState::Error, "unknown_tool"),
            failed(CallState::Timeout, codes::TOOL_TIMEOUT),
        ];
        let code = worst_outcome(&mixed, false).map(|e| e.code);
        assert_eq!(code.as_deref(), Some(codes::TOOL_TIMEOUT));
        let code = worst_outcome(&mixed[..2], false).map(|e| e.code);
        assert_eq!(code.as_deref(), Some("unknown_tool"));
    }
}
