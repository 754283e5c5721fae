//! Ending a turn: ordering its results, filling in the calls that never answered,
//! narrating, and publishing `narration` and `final`.

use std::sync::Arc;

use toolfleet_common::call::codes;
use toolfleet_common::history::render_history;
use toolfleet_common::{
    CallError, CallResult, CallState, FinalEvent, Summary, ToolCall, TurnEvent,
};
use tracing::{info_span, warn, Instrument};

use crate::events;
use crate::join::{CallEntry, Closing};
use crate::narrate::{NarrationInput, FALLBACK};
use crate::Inner;

/// Publishes the end of `turn_id` from what the join returned. Runs exactly once per
/// turn: only the caller whose script ended the turn gets a [`Closing`].
pub(crate) async fn close_turn(
    inner: &Arc<Inner>,
    turn_id: &str,
    closing: Closing,
    deadline_hit: bool,
) {
    let span = info_span!("join", turn_id = %turn_id, deadline_hit);
    async {
        let Closing {
            reply,
            calls,
            mut results,
        } = closing;
        let mut entries: Vec<(String, CallEntry)> = calls.into_iter().collect();
        entries.sort_by_key(|(_, e)| e.index);
        let mut ordered = Vec::with_capacity(entries.len());
        for (key, entry) in entries {
            match results.remove(&key) {
                Some(r) => ordered.push(r),
                None => {
                    let missing = missing_result(&entry);
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
        publish_final(inner, turn_id, &reply, ordered, deadline_hit).await;
    }
    .instrument(span)
    .await;
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
    let chunks = match inner
        .narrator
        .narrate(&input)
        .instrument(info_span!("narrate", turn_id = %turn_id))
        .await
    {
        Ok(chunks) if !chunks.is_empty() => chunks,
        Ok(_) => vec![FALLBACK.to_string()],
        Err(error) => {
            warn!(%turn_id, %error, "narrator failed; speaking the fallback");
            vec![FALLBACK.to_string()]
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
