//! Ending a turn: ordering its results, filling in the calls that never answered,
//! narrating, and publishing `narration` and `final`.

use std::sync::Arc;

use toolfleet_common::call::{codes, unix_ms};
use toolfleet_common::history::render_history;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::names::spans;
use toolfleet_common::telemetry;
use toolfleet_common::{
    CallError, CallResult, CallState, FinalEvent, Summary, ToolCall, TurnEvent,
};
use tracing::{info_span, warn, Instrument};

use crate::events;
use crate::join::{CallEntry, Closing};
use crate::narrate::{NarrationInput, TemplateNarrator, FALLBACK};
use crate::Inner;

/// Longest a narrator may take before the template narration is used instead.
pub const NARRATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Publishes the end of `turn_id` from what the join returned. Runs exactly once per
/// turn: only the caller whose script ended the turn gets a [`Closing`].
pub(crate) async fn close_turn(
    inner: &Arc<Inner>,
    turn_id: &str,
    closing: Closing,
    deadline_hit: bool,
) {
    let span = info_span!(
        parent: None,
        "join",
        otel.name = spans::JOIN,
        otel.status_code = tracing::field::Empty,
        toolfleet.turn.id = %turn_id,
        toolfleet.turn.deadline_hit = deadline_hit,
        toolfleet.summary.ok = tracing::field::Empty,
        toolfleet.summary.errors = tracing::field::Empty,
        toolfleet.summary.timeouts = tracing::field::Empty,
        toolfleet.summary.skipped = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if let Some(traceparent) = &closing.traceparent {
        telemetry::set_parent_from_traceparent(&span, traceparent);
    }
    let turn_seconds = unix_ms().saturating_sub(closing.created_unix_ms) as f64 / 1000.0;
    async {
        let Closing {
            reply,
            calls,
            mut results,
            ..
        } = closing;
        let mut entries: Vec<(String, CallEntry)> = calls.into_iter().collect();
        entries.sort_by_key(|(_, e)| e.index);
        let mut ordered = Vec::with_capacity(entries.len());
        for (key, entry) in entries {
            match results.remove(&key) {
                Some(r) => ordered.push(r),
                None => {
                    let missing = missing_result(&entry);
                    inner.metrics.call_ended(
                        &missing.name,
                        missing.state.as_str(),
                        missing.error.as_ref().map(|e| e.code.as_str()),
                    );
                    events::publish(
                        &inner.nats,
                        &reply,
                        &events::tool_state(
                            turn_id,
                            &missing.tool_call_id,
                            &missing.name,
                            missing.state,
                            missing.error.clone(),
                        ),
                    )
                    .await;
                    ordered.push(missing);
                }
            }
        }
        let summary = Summary::of(&ordered);
        let current = tracing::Span::current();
        current.record("toolfleet.summary.ok", summary.ok);
        current.record("toolfleet.summary.errors", summary.errors);
        current.record("toolfleet.summary.timeouts", summary.timeouts);
        current.record("toolfleet.summary.skipped", summary.skipped);
        if summary.timeouts > 0 {
            current.record("otel.status_code", "ERROR");
            current.record("error.type", codes::DEADLINE_EXCEEDED);
        }
        publish_final(inner, turn_id, &reply, ordered, deadline_hit).await;
    }
    .instrument(span)
    .await;
    inner.metrics.turn_ended(
        if deadline_hit { "deadline" } else { "complete" },
        turn_seconds,
    );
    // Another replica that took the turn is told; this one forgets it at once.
    if !inner.owns(turn_id) {
        notify_ended(inner, turn_id).await;
    }
    inner.release(turn_id);
    if let Err(error) = inner.join.forget_deadline(turn_id).await {
        warn!(%turn_id, %error, "could not drop the turn from the deadline index");
    }
}

/// Narrates `results` and publishes the `narration` chunks and the `final` event.
pub(crate) async fn publish_final(
    inner: &Arc<Inner>,
    turn_id: &str,
    reply: &str,
    results: Vec<CallResult>,
    deadline_hit: bool,
) {
    let registry = inner.registry.snapshot();
    let tools: Vec<_> = results
        .iter()
        .map(|r| registry.get(&r.name).map(|t| &t.definition))
        .collect();
    let input = NarrationInput {
        user_message: None,
        results: &results,
        tools,
    };
    let narration = tokio::time::timeout(NARRATE_TIMEOUT, inner.narrator.narrate(&input))
        .instrument(info_span!(
            "narrate",
            otel.name = spans::NARRATE,
            toolfleet.turn.id = %turn_id
        ))
        .await;
    let chunks = match narration {
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
    };
    for chunk in &chunks {
        events::publish(
            &inner.nats,
            reply,
            &TurnEvent::Narration {
                turn_id: turn_id.to_string(),
                text: chunk.clone(),
            },
        )
        .await;
    }
    let summary = Summary::of(&results);
    let history = render_history(&results);
    let event = TurnEvent::Final(FinalEvent {
        turn_id: turn_id.to_string(),
        text: chunks.join(" "),
        results,
        summary,
        history,
        deadline_hit,
    });
    events::publish(&inner.nats, reply, &event).await;
}

fn missing_result(entry: &CallEntry) -> CallResult {
    let call = ToolCall {
        id: entry.id.clone(),
        name: entry.name.clone(),
        arguments: serde_json::Value::Null,
        parent_id: entry.parent_id.clone(),
    };
    if entry.queued {
        CallResult::failure(
            &call,
            CallState::Skipped,
            CallError::retryable(
                codes::NOT_DISPATCHED,
                "the turn ended before the call was dispatched",
            ),
        )
    } else {
        CallResult::failure(
            &call,
            CallState::Timeout,
            CallError::retryable(
                codes::DEADLINE_EXCEEDED,
                "no result before the turn's deadline",
            ),
        )
    }
}

/// Tells the turn's owner (possibly another replica) that the turn ended, so it closes
/// the turn span and forgets the turn at once.
async fn notify_ended(inner: &Inner, turn_id: &str) {
    if let Ok(body) = serde_json::to_vec(&ProgressNotice::Ended) {
        let _ = inner
            .nats
            .publish(inner.names.progress_subject(turn_id), body.into())
            .await;
    }
}
