//! Where results are joined and where a result goes: every replica pulls from the
//! shared results consumer, records each result in the turn store (`store/redis.rs`,
//! whose scripts count it once), publishes the call's terminal state, and ends the turn
//! when it was the last one.
//!
//! Owns the results consumer, the recording of every result (workers' and the
//! coordinator's own `dispatch_failed`, handed back by whoever dispatched:
//! [`record_unpublished`]), and the ordering of a call's state before the
//! turn's `final` through the turn's gate. Each result gets a CONSUMER span (`trace.rs`)
//! around its recording and its state, not around the turn's end. A late result (after the turn ended or its
//! deadline passed) is counted in the join and the metrics, never published. A duplicate
//! is counted and ignored. A result whose tool differs from its subject's tool or from
//! its call's tool (a worker forging another tool's result) is counted and refused.
//!
//! Every result but a forged one also frees its call's slot in its tool's lane
//! (`sharing.rs`), which may hand out another tenant's waiting call for this replica to
//! publish.
//!
//! A result of a paced turn frees a slot: the `RECORD` script releases the next queued
//! call in the same step and this replica publishes its job (`dispatch.rs`), whichever
//! replica owns the turn; a duplicate result publishes again the released calls whose
//! publish was never confirmed (their releaser died). A released job that cannot be
//! published has its `dispatch_failed` result recorded next, in a queue, not by
//! recursion.
//!
//! A result that may complete a turn this replica owns carries the turn's closing
//! events, built ahead by `finalize.rs` from the results known here (`turns.rs`), into
//! its `RECORD`, which stores them when it completes the turn and every other stored
//! result is the one they hold (`store/redis.rs`).
//!
//! Never builds the `final` (`finalize.rs` does). Next: `finalize.rs`, for the result
//! that completes the turn.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream::ConsumerError;
use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::names::HEADER_TENANT_ID;
use toolfleet_common::tool::Rejection;
use toolfleet_common::{telemetry, CallResult};
use tracing::{debug, warn, Instrument};

use crate::dispatch::Unpublished;
use crate::events;
use crate::finalize::{close_ahead, finish, send_closed_ahead, ClosedAhead, TurnEnd};
use crate::lanes::LaneError;
use crate::registry::Registry;
use crate::replica::Replica;
use crate::sharing;
use crate::store::redis::{Closing, ClosingAhead, JoinError, Recorded};
use crate::trace;
use crate::turns::TurnGate;

/// Ack wait of the results consumer: a result whose coordinator died while recording
/// it (and any call that recording released) is redelivered to another replica after
/// this long. Recording takes milliseconds; one that takes longer is recorded again
/// elsewhere, which the join turns into a harmless duplicate.
pub const RESULTS_ACK_WAIT: Duration = Duration::from_secs(3);

/// Idle heartbeat of the results pull: a pull request lost with the consumer (NATS
/// restarted empty) is noticed after two missed heartbeats and renewed.
const PULL_HEARTBEAT: Duration = Duration::from_secs(1);

/// Deliveries of one result before it is given up: none (-1). While Redis is
/// unreachable a result is redelivered with a growing delay ([`redelivery_delay`]) and
/// kept in the stream, bounded by the stream's own limits (docs/RELIABILITY.md).
pub const RESULTS_MAX_DELIVER: i64 = -1;

/// Longest wait before a result whose recording failed is delivered again.
const MAX_REDELIVERY_DELAY: Duration = Duration::from_secs(5);

/// The wait before the next delivery of a result delivered `delivered` times: 200 ms,
/// doubling, at most [`MAX_REDELIVERY_DELAY`].
fn redelivery_delay(delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.clamp(1, 16) - 1).unwrap_or(0);
    (Duration::from_millis(200) * 2u32.pow(doublings)).min(MAX_REDELIVERY_DELAY)
}

/// Creates the results consumer shared by every replica, or brings an existing one's
/// editable settings (ack wait, redelivery) to this version's.
pub(crate) async fn results_consumer(
    stream: &jetstream::stream::Stream,
    durable: &str,
) -> Result<PullConsumer, ConsumerError> {
    stream
        .create_consumer(results_consumer_config(durable))
        .await
}

/// The results consumer's configuration (also used to recreate it, see `upkeep.rs`).
pub(crate) fn results_consumer_config(durable: &str) -> jetstream::consumer::pull::Config {
    jetstream::consumer::pull::Config {
        durable_name: Some(durable.to_string()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: RESULTS_ACK_WAIT,
        max_deliver: RESULTS_MAX_DELIVER,
        max_ack_pending: 20_000,
        ..Default::default()
    }
}

/// Pulls results from every stream partition's results consumer until `shutdown`,
/// handling up to `concurrency` at once across them.
pub(crate) async fn consume_all(
    replica: Arc<Replica>,
    consumers: Vec<PullConsumer>,
    concurrency: usize,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(concurrency));
    let loops = consumers.into_iter().map(|consumer| {
        consume(
            Arc::clone(&replica),
            consumer,
            Arc::clone(&slots),
            concurrency,
            shutdown.clone(),
        )
    });
    futures::future::join_all(loops).await;
}

/// Pulls results from one results consumer until `shutdown`, each handled once a slot
/// of `slots` is free.
async fn consume(
    replica: Arc<Replica>,
    consumer: PullConsumer,
    slots: Arc<Semaphore>,
    concurrency: usize,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let mut messages = match consumer
            .stream()
            .max_messages_per_batch(concurrency.min(512))
            .heartbeat(PULL_HEARTBEAT)
            .expires(Duration::from_secs(30))
            .messages()
            .await
        {
            Ok(m) => m,
            Err(error) => {
                warn!(%error, "results pull failed");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => continue,
                }
            }
        };
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = messages.next() => next,
            };
            match next {
                Some(Ok(message)) => {
                    crate::fault::panic_point(crate::fault::PANIC_IN_RESULTS_CONSUMER);
                    let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
                        return;
                    };
                    let replica = Arc::clone(&replica);
                    // Boxed: the task then moves a pointer, not the handler's whole
                    // state machine, each time it is spawned, polled to its end and
                    // dropped.
                    replica.tasks.clone().spawn(Box::pin(async move {
                        handle_result_message(&replica, message).await;
                        drop(permit);
                    }));
                }
                Some(Err(error)) => {
                    debug!(%error, "results stream error; re-subscribing");
                    break;
                }
                None => break,
            }
        }
    }
}

async fn handle_result_message(replica: &Arc<Replica>, message: jetstream::Message) {
    let Some((turn_id, subject_tool)) = replica.names.result_subject_parts(&message.subject) else {
        let _ = message.ack_with(AckKind::Term).await;
        return;
    };
    let turn_id = turn_id.to_string();
    let result: CallResult = match serde_json::from_slice(&message.payload) {
        Ok(r) => r,
        Err(error) => {
            warn!(%turn_id, %error, "undecodable result dropped");
            let _ = message.ack_with(AckKind::Term).await;
            if let Some(tool) = subject_tool {
                let reason = format!("the result does not decode: {error}");
                reject(replica, tool, &turn_id, &message.payload, reason).await;
            }
            return;
        }
    };
    // NATS let only the tool's workers publish on its subject; the body must agree.
    if subject_tool.is_some_and(|tool| tool != result.name) {
        replica.metrics.forged_result();
        warn!(%turn_id, subject = %message.subject, tool = %result.name, "result naming another tool than its subject refused");
        let _ = message.ack_with(AckKind::Term).await;
        return;
    }
    let key = result.tool_call_id.clone();
    let template = replica.names.results_template();
    let (address, port) = telemetry::server_of(&replica.config.nats_url);
    let group = replica.names.results_consumer();
    let source = trace::ResultSource {
        server: (&address, port),
        group: &group,
    };
    let consumer = trace::result_received(
        &template,
        &message.subject,
        message.headers.as_ref(),
        &turn_id,
        &source,
    );
    let message_id = message
        .headers
        .as_ref()
        .and_then(|h| h.get(toolfleet_common::names::HEADER_MSG_ID))
        .map(|v| v.to_string())
        .unwrap_or_else(|| toolfleet_common::job::job_msg_id(&turn_id, &key));
    consumer.record("messaging.message.id", message_id.as_str());
    consumer.record("gen_ai.tool.call.id", key.as_str());
    consumer.record("gen_ai.tool.name", result.name.as_str());
    let tenant = message
        .headers
        .as_ref()
        .and_then(|h| h.get(toolfleet_common::headers::name(HEADER_TENANT_ID)))
        .map(|v| v.to_string())
        .unwrap_or_default();
    let traced = Traced {
        span: &consumer,
        tenant: &tenant,
    };
    // The worker's bytes decoded as `result`: they are stored as they came.
    let body = Some(&message.payload[..]);
    match try_record(replica, &turn_id, &key, result, body, traced).await {
        Ok(unpublished) => {
            record_unpublished(replica, unpublished).await;
            if let Err(error) = message.ack().await {
                debug!(%error, "result ack failed; a duplicate will be ignored");
            }
        }
        Err(error) => {
            telemetry::set_error(&consumer, "join_unavailable", &error.to_string());
            replica.metrics.redis_error("record_result");
            warn!(%turn_id, %error, "recording a result failed; it will be redelivered");
            let delivered = message.info().map(|i| i.delivered).unwrap_or(1);
            let _ = message
                .ack_with(AckKind::Nak(Some(redelivery_delay(delivered))))
                .await;
        }
    }
}

/// Tells `tool`'s workers that a result they published on `turn_id` was refused
/// (PROTOCOL §2.6); best effort.
async fn reject(replica: &Replica, tool: &str, turn_id: &str, body: &[u8], reason: String) {
    let call = serde_json::from_slice::<serde_json::Value>(body).ok();
    let rejection = Rejection {
        reason,
        at_unix_ms: toolfleet_common::call::unix_ms(),
        turn_id: Some(turn_id.to_string()),
        tool_call_id: call.and_then(|c| c["tool_call_id"].as_str().map(str::to_string)),
    };
    if let Err(error) = replica.join.reject_result(tool, &rejection).await {
        replica.metrics.redis_error("reject_result");
        warn!(%tool, %error, "could not write back a refused result");
    }
}

/// Records the `dispatch_failed` results of jobs that could not be published, in order,
/// and then those of the jobs their recordings released and that could not be published
/// either; errors are logged, and the turn's deadline still ends it.
pub(crate) async fn record_unpublished(replica: &Arc<Replica>, unpublished: Vec<Unpublished>) {
    let span = tracing::Span::current();
    let mut queue = VecDeque::from(unpublished);
    while let Some(failed) = queue.pop_front() {
        let traced = Traced {
            span: &span,
            tenant: &failed.tenant,
        };
        let (turn_id, key) = (&failed.turn_id, &failed.key);
        match try_record(replica, turn_id, key, failed.result, None, traced).await {
            Ok(more) => queue.extend(more),
            Err(error) => {
                replica.metrics.redis_error("record_result");
                warn!(%turn_id, %error, "recording a result failed")
            }
        }
    }
}

/// The span a result is recorded under and the turn's tenant.
#[derive(Clone, Copy)]
struct Traced<'a> {
    /// The result's consumer span: it covers the recording and the call's state, not
    /// the turn's end, which the turn span covers.
    span: &'a tracing::Span,
    /// The turn's tenant (empty when unknown).
    tenant: &'a str,
}

/// Records `result` and reports what follows; then frees the call's slot in its
/// tool's lane (a lane that cannot be reached fails the recording, so the result is
/// delivered again: the join counts it as a duplicate, the lane frees the slot once).
/// Returns the jobs released by this result that could not be published, whose results
/// the caller records in turn.
async fn try_record(
    replica: &Arc<Replica>,
    turn_id: &str,
    key: &str,
    result: CallResult,
    body: Option<&[u8]>,
    traced: Traced<'_>,
) -> Result<Vec<Unpublished>, JoinError> {
    let tool = result.name.clone();
    let (outcome, laned, mut unpublished) = replica
        .turns
        .gated(turn_id, |gate| {
            record_and_report(replica, gate, turn_id, key, result, body, traced)
        })
        .await?;
    if matches!(outcome, "wrong_tool" | "unknown_call") {
        return Ok(unpublished);
    }
    let handed_out = sharing::release(replica.sharing(), &tool, turn_id, key, laned)
        .await
        .map_err(|error| match error {
            LaneError::Redis(e) => JoinError::Redis(e),
            LaneError::Decode(e) => JoinError::Decode(e),
        })?;
    unpublished.extend(handed_out);
    Ok(unpublished)
}

/// Records one result and publishes what follows. Results of one turn are recorded
/// concurrently; the gate keeps each call's state before the turn's `final`. `body` is
/// the result's JSON as received, stored instead of encoding `result` again. Returns
/// the outcome's kind (`Recorded::kind`), whether the turn's calls hold lane slots
/// (`Recorded::laned`) and the released jobs that could not be published.
async fn record_and_report(
    replica: &Arc<Replica>,
    gate: Arc<TurnGate>,
    turn_id: &str,
    key: &str,
    result: CallResult,
    body: Option<&[u8]>,
    traced: Traced<'_>,
) -> Result<(&'static str, bool, Vec<Unpublished>), JoinError> {
    let recording = gate.recording.read().await;
    let mut unpublished = Vec::new();
    let span = traced.span;
    let state = events::encode(&events::result_state(turn_id, &result)).unwrap_or_default();
    let (outcome, ahead) =
        record_closing_ahead(replica, turn_id, key, &result, body, &state, traced).await?;
    let kind = outcome.kind();
    let laned = outcome.laned();
    span.record("toolfleet.result.outcome", kind);
    match outcome {
        Recorded::UnknownTurn | Recorded::UnknownCall => {
            debug!(%turn_id, call = %key, "result for no known call ignored");
        }
        Recorded::WrongTool => {
            replica.metrics.forged_result();
            warn!(%turn_id, call = %key, tool = %result.name, "result naming another tool than its call refused");
        }
        Recorded::Duplicate { again, .. } => {
            replica.metrics.duplicate_result();
            debug!(%turn_id, call = %key, "duplicate result ignored");
            drop(recording);
            if !again.is_empty() {
                unpublished =
                    sharing::dispatch_released(replica.sharing(), turn_id, again, laned).await;
            }
        }
        Recorded::Late { .. } => {
            replica.metrics.late_result();
            debug!(%turn_id, call = %key, "late result counted");
        }
        Recorded::Recorded {
            reply,
            seq,
            released,
            ..
        } => {
            count_result(&replica.registry, &replica.metrics, &result);
            {
                let _publishing = gate.publishing.lock().await;
                replica.turns.mark_ended(turn_id, key);
                events::publish_kept(&replica.nats, &reply, seq, std::slice::from_ref(&state))
                    .instrument(span.clone())
                    .await;
            }
            drop(recording);
            if let Some(released) = released {
                unpublished =
                    sharing::dispatch_released(replica.sharing(), turn_id, vec![released], laned)
                        .await;
            }
        }
        Recorded::CompleteStored { reply, seq, .. } => {
            count_result(&replica.registry, &replica.metrics, &result);
            drop(recording);
            // Before the `final` goes out: a frontend that reads it may submit at once.
            sharing::turn_ended(replica.sharing(), traced.tenant, turn_id).await;
            let _ending = gate.recording.write().await;
            let _publishing = gate.publishing.lock().await;
            match ahead {
                Some(closed) => {
                    send_closed_ahead(replica, turn_id, &reply, seq, state, closed).await
                }
                // Only a `RECORD` given closing events stores them; the sweeper sends
                // a stored `final` that nobody marked sent.
                None => {
                    warn!(%turn_id, "closing events stored without being built here");
                    replica.turns.release(turn_id);
                }
            }
        }
        Recorded::Complete { closing, seq, .. } => {
            count_result(&replica.registry, &replica.metrics, &result);
            drop(recording);
            let last = LastState { seq, state };
            close_after_last(replica, &gate, turn_id, traced, closing, last).await;
        }
    }
    Ok((kind, laned, unpublished))
}

/// The stored state event of a turn's last result and its seq.
struct LastState {
    seq: u64,
    state: String,
}

/// Ends the turn whose last result was just recorded, its closing events not built
/// ahead: its place among its tenant's turns in flight given back, the result's state
/// published after every other recording of the turn in flight here, then the turn
/// finished (`finalize.rs`).
async fn close_after_last(
    replica: &Arc<Replica>,
    gate: &TurnGate,
    turn_id: &str,
    traced: Traced<'_>,
    closing: Closing,
    last: LastState,
) {
    // Before the `final` goes out: a frontend that reads it may submit at once.
    sharing::turn_ended(replica.sharing(), traced.tenant, turn_id).await;
    let _ending = gate.recording.write().await;
    let _publishing = gate.publishing.lock().await;
    events::publish_kept(
        &replica.nats,
        &closing.reply,
        last.seq,
        std::slice::from_ref(&last.state),
    )
    .instrument(traced.span.clone())
    .await;
    let end = TurnEnd::AllResultsIn {
        turn_id: turn_id.to_string(),
        closing,
    };
    finish(replica, end).await;
}

/// Runs `RECORD` for `result` (stored as `body`, or encoded when there is none), with
/// the turn's closing events when this result may complete a turn owned here and they
/// could be built ahead (`finalize.rs`); returns those events with the outcome.
async fn record_closing_ahead(
    replica: &Arc<Replica>,
    turn_id: &str,
    key: &str,
    result: &CallResult,
    body: Option<&[u8]>,
    state: &str,
    traced: Traced<'_>,
) -> Result<(Recorded, Option<ClosedAhead>), JoinError> {
    let span = traced.span;
    let encoded;
    let body = match body {
        Some(body) => body,
        None => {
            encoded = serde_json::to_vec(result).map_err(|e| JoinError::Decode(e.to_string()))?;
            &encoded[..]
        }
    };
    let ahead = replica
        .turns
        .note_result(turn_id, key, result, body)
        .and_then(|ready| span.in_scope(|| close_ahead(replica, turn_id, traced.tenant, ready)));
    let closing = ahead.as_ref().map(|a| ClosingAhead {
        checks: &a.checks,
        events: &a.events.stored,
    });
    let script = span.in_scope(|| trace::join_script("RECORD", turn_id, traced.tenant));
    let outcome = replica
        .join
        .record_encoded(turn_id, key, result, body, state, closing)
        .instrument(script)
        .instrument(span.clone())
        .await?;
    Ok((outcome, ahead))
}

/// Counts a recorded result under its tool's metric label.
fn count_result(registry: &Registry, metrics: &FleetMetrics, result: &CallResult) {
    let label = registry.snapshot().label(&result.name);
    metrics.call_result(&label, result);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::TurnStore;
    use crate::testing::{self, event_types, finals, ok_result, open_turn, stored};
    use toolfleet_common::call::unix_ms;

    /// Records `result` as if it came from the results consumer.
    async fn record(replica: &Arc<Replica>, turn_id: &str, result: CallResult) -> Vec<Unpublished> {
        let span = tracing::Span::none();
        let traced = Traced {
            span: &span,
            tenant: "acme",
        };
        let key = result.tool_call_id.clone();
        try_record(replica, turn_id, &key, result, None, traced)
            .await
            .unwrap_or_else(|e| panic!("recording {key}: {e}"))
    }

    async fn create(store: &MemoryStore, turn: crate::store::redis::NewTurn<'_>) {
        let created = store.create(turn).await;
        assert!(
            matches!(created, Ok(crate::store::redis::Created::New)),
            "{created:?}"
        );
    }

    #[tokio::test]
    async fn results_recorded_at_once_end_their_turn_with_one_final_after_every_state() {
        let (store, replica) = testing::store_and_replica().await;
        create(&store, open_turn("t1", 3, unix_ms() + 60_000)).await;
        let recordings = ["c1", "c2", "c3"].map(|k| record(&replica, "t1", ok_result(k)));
        futures::future::join_all(recordings).await;
        let turn = stored(&store, "t1");
        assert_eq!(turn.ended.as_deref(), Some("complete"));
        assert_eq!(finals(&turn), 1);
        let types = event_types(&turn);
        assert_eq!(types.last().map(String::as_str), Some("final"), "{types:?}");
        let states = types.iter().position(|t| t == "narration");
        assert_eq!(
            states,
            Some(4),
            "ack, three states, then the narration: {types:?}"
        );
        assert_eq!(turn.published, 1, "the final is marked sent once");
    }

    #[tokio::test]
    async fn a_duplicate_changes_nothing_and_a_result_after_the_end_counts_as_late() {
        let (store, replica) = testing::store_and_replica().await;
        create(&store, open_turn("t1", 2, unix_ms() + 60_000)).await;
        record(&replica, "t1", ok_result("c1")).await;
        record(&replica, "t1", ok_result("c1")).await;
        let turn = stored(&store, "t1");
        assert_eq!((turn.duplicates, turn.results.len()), (1, 1));
        assert_eq!(turn.events.len(), 2, "the duplicate published no state");

        create(&store, open_turn("t2", 2, unix_ms() + 60_000)).await;
        let ended = store.finalize("t2", "deadline").await;
        assert!(matches!(
            ended,
            Ok(crate::store::redis::Finalized::Ended(_))
        ));
        record(&replica, "t2", ok_result("c1")).await;
        let turn = stored(&store, "t2");
        assert_eq!((turn.late, turn.results.len()), (1, 0));
    }

    #[tokio::test]
    async fn a_result_naming_another_tool_than_its_call_is_refused() {
        let (store, replica) = testing::store_and_replica().await;
        create(&store, open_turn("t1", 1, unix_ms() + 60_000)).await;
        let mut forged = ok_result("c1");
        forged.name = "bank.transfer".into();
        record(&replica, "t1", forged).await;
        let turn = stored(&store, "t1");
        assert!(turn.results.is_empty());
        assert_eq!(turn.state, "open", "a forged result ends nothing");
    }

    #[tokio::test]
    async fn a_refused_result_is_written_back_for_its_tools_workers() {
        let (store, replica) = testing::store_and_replica().await;
        let body = br#"{"tool_call_id": "c1", "name": 7}"#;
        reject(&replica, "crm.get", "t1", body, "does not decode".into()).await;
        let rejection = store.rejected("crm.get");
        assert_eq!(
            rejection.map(|r| (r.turn_id, r.tool_call_id)),
            Some((Some("t1".into()), Some("c1".into())))
        );
    }

    #[tokio::test]
    async fn a_released_call_that_cannot_be_published_still_ends_its_turn_once() {
        let (store, replica) = testing::store_and_replica().await;
        // Two calls, one at a time: c2 waits for c1's slot. The deadline is near, so the
        // publish of c2 (no NATS behind this replica) gives up quickly.
        let deadline = unix_ms() + 300;
        let mut turn = open_turn("t1", 2, deadline);
        turn.paced = true;
        turn.calls[1].1.queued = true;
        let job: toolfleet_common::JobEnvelope = serde_json::from_value(serde_json::json!({
            "turn_id": "t1", "tenant_id": "acme",
            "call": {"id": "c2", "name": "crm.get", "arguments": {}},
            "deadline_unix_ms": deadline, "timeout_ms": 100, "dispatched_unix_ms": 0
        }))
        .unwrap_or_else(|e| panic!("job: {e}"));
        turn.queued = vec![("c2".into(), job)];
        create(&store, turn).await;

        let unpublished = record(&replica, "t1", ok_result("c1")).await;
        let released = stored(&store, "t1");
        assert_eq!(released.calls.get("c2").map(|c| c.queued), Some(false));
        assert_eq!(
            unpublished.len(),
            1,
            "c2 is handed back, not recorded inside"
        );
        assert_eq!(unpublished[0].key, "c2");

        record_unpublished(&replica, unpublished).await;
        let turn = stored(&store, "t1");
        assert_eq!(finals(&turn), 1);
        // The `final` holds c2's result (the stored bodies gave way to it).
        let fin = turn
            .events
            .iter()
            .find_map(|e| match serde_json::from_str(e) {
                Ok(toolfleet_common::TurnEvent::Final(fin)) => Some(fin),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no final in {:?}", turn.events));
        let c2 = fin.results.iter().find(|r| r.tool_call_id == "c2");
        assert!(
            c2.and_then(|r| r.error.as_ref())
                .is_some_and(|e| e.code == "dispatch_failed"),
            "{fin:?}"
        );
        assert!(turn.results.contains_key("c2"));
    }

    #[test]
    fn redelivery_backs_off_to_a_cap() {
        assert_eq!(redelivery_delay(1), Duration::from_millis(200));
        assert_eq!(redelivery_delay(2), Duration::from_millis(400));
        assert_eq!(redelivery_delay(5), Duration::from_millis(3200));
        assert_eq!(redelivery_delay(6), MAX_REDELIVERY_DELAY);
        assert_eq!(redelivery_delay(10_000), MAX_REDELIVERY_DELAY);
        assert_eq!(redelivery_delay(0), Duration::from_millis(200));
    }
}
