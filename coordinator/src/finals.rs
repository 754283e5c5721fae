//! The `final` event as the coordinator writes it: fitted to the largest message the
//! NATS server takes, stored without its history, sent with it.
//!
//! The history repeats every result twice (once for OpenAI, once for Anthropic), and the
//! frontend can render it from the results (`FinalEvent::session_history`). So the turn's
//! stored `final` carries each result once, with `history_omitted`, and the `final` a
//! frontend is sent is the same event with its history: encoded from the results when
//! the turn ends ([`encode`]), and rendered again from the stored results when a stored
//! `final` is sent again ([`sendable`]: an attach, the sweeper's resend). A `final` too
//! large for one message with its history is sent without it, as it is stored.
//!
//! Pure: no I/O, no state. `finalize.rs` encodes, `events.rs` sends.

use std::borrow::Cow;

use serde::Serialize;
use toolfleet_common::call::codes;
use toolfleet_common::{
    CallError, CallResult, CallState, FinalEvent, Summary, ToolCall, TurnEvent,
};
use toolfleet_decision::history::HistoryOf;
use tracing::warn;

/// A turn's `final`, encoded twice: as stored and as sent.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Encoded {
    /// Each result once, `history_omitted`: what the turn's event list keeps.
    pub stored: String,
    /// With its history when that fits in one message: what the frontend is sent.
    pub sent: String,
}

/// The `final` of a turn with `results`, as stored and as sent, each within `limit`
/// bytes; `None` (logged) if it does not serialize.
pub(crate) fn encode(
    turn_id: &str,
    text: &str,
    mut results: Vec<CallResult>,
    deadline_hit: bool,
    limit: usize,
) -> Option<Encoded> {
    let kept = |r: &[CallResult]| r.iter().filter(|r| r.result.is_some()).count();
    let bodies = kept(&results);
    let stored = fit(turn_id, text, &mut results, deadline_hit, limit, false)?;
    // A body cut to fit: the history goes too, as stored.
    if kept(&results) < bodies {
        return Some(Encoded {
            sent: stored.clone(),
            stored,
        });
    }
    let sent = with_history(&stored, &results, deadline_hit)
        .filter(|sent| sent.len() <= limit)
        .unwrap_or_else(|| stored.clone());
    Some(Encoded { stored, sent })
}

/// A `final` encoded without its history, from its `history` member to the value of
/// `deadline_hit`.
const EMPTY_HISTORY: &str = r#""history":{"openai":[],"anthropic":[]},"deadline_hit":"#;

/// `stored` (a [`FinalOut`] without its history) with the history of `results` in
/// its place: the same text as encoding it with the history, without encoding the
/// results again. `None` if it does not have that shape.
fn with_history(stored: &str, results: &[CallResult], deadline_hit: bool) -> Option<String> {
    // The history member is the last but two (FinalOut's order); a result's own body
    // comes before it, so the last match is the member itself.
    let at = stored.rfind(EMPTY_HISTORY)?;
    let history = serde_json::to_string(&HistoryOf(results)).ok()?;
    let mut sent = String::with_capacity(stored.len() + history.len());
    sent.push_str(&stored[..at]);
    sent.push_str(r#""history":"#);
    sent.push_str(&history);
    sent.push_str(if deadline_hit {
        r#","deadline_hit":true}"#
    } else {
        r#","deadline_hit":false}"#
    });
    Some(sent)
}

/// How a `final` encoded with `history_omitted` ends ([`FinalOut`]'s last member).
const OMITTED_TAIL: &str = r#","history_omitted":true}"#;

/// A stored event as it is sent: a stored `final` with its history rendered again from
/// its results (when it fits in `limit` bytes), any other event as it is.
pub(crate) fn sendable(event: &str, limit: usize) -> Cow<'_, str> {
    if !(event.starts_with(r#"{"type":"final""#) && event.ends_with(OMITTED_TAIL)) {
        return Cow::Borrowed(event);
    }
    let Ok(TurnEvent::Final(stored)) = serde_json::from_str::<TurnEvent>(event) else {
        return Cow::Borrowed(event);
    };
    let FinalEvent {
        turn_id,
        text,
        mut results,
        deadline_hit,
        ..
    } = stored;
    match fit(&turn_id, &text, &mut results, deadline_hit, limit, true) {
        Some(sent) => Cow::Owned(sent),
        None => Cow::Borrowed(event),
    }
}

/// The largest `final` sent: the server's `max_payload` less room for the `seq` and
/// the message's own framing.
pub(crate) fn limit(nats: &async_nats::Client) -> usize {
    let max = nats.server_info().max_payload;
    let max = if max == 0 { DEFAULT_MAX_PAYLOAD } else { max };
    max.saturating_sub(FINAL_HEADROOM)
}

/// `max_payload` assumed when the server announced none (nats-server's default).
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// Bytes kept free below `max_payload` for the `seq` member and headers.
const FINAL_HEADROOM: usize = 4096;

/// A `final` as this coordinator writes it: a [`FinalEvent`]'s members, in its order,
/// with the history written straight from the results ([`HistoryOf`], or empty when
/// left out): the same text as `TurnEvent::Final` encodes, without building the
/// history's `Value` trees.
#[derive(Serialize)]
#[serde(tag = "type", rename = "final")]
struct FinalOut<'a> {
    turn_id: &'a str,
    text: &'a str,
    results: &'a [CallResult],
    summary: Summary,
    history: HistoryOf<'a>,
    deadline_hit: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    history_omitted: bool,
}

/// The `final` event of the turn, encoded and made to fit in `limit` bytes, with its
/// history when `with_history`. The history repeats every result twice, so it goes
/// first: a `final` too large with it is encoded with `history_omitted` (the frontend
/// renders it from the results). Then the largest result bodies, one by one, are
/// replaced by a `result_too_large` error of their call (every call id stays, in
/// order), and the summary follows. Encoded once when it fits, as nearly every `final`
/// does.
fn fit(
    turn_id: &str,
    text: &str,
    results: &mut Vec<CallResult>,
    deadline_hit: bool,
    limit: usize,
    with_history: bool,
) -> Option<String> {
    let mut history_omitted = !with_history;
    loop {
        let event = FinalOut {
            turn_id,
            text,
            results: results.as_slice(),
            summary: Summary::of(results),
            history: HistoryOf(if history_omitted { &[] } else { results }),
            deadline_hit,
            history_omitted,
        };
        let json = match serde_json::to_string(&event) {
            Ok(json) => json,
            Err(error) => {
                warn!(%turn_id, %error, "the final does not serialize");
                return None;
            }
        };
        if json.len() <= limit {
            return Some(json);
        }
        if !history_omitted {
            history_omitted = true;
            continue;
        }
        if !shrink(results, limit) {
            return Some(json);
        }
    }
}

/// Replaces the largest result body of `results` by a `result_too_large` error of its
/// call; false when no result body is left.
fn shrink(results: &mut [CallResult], limit: usize) -> bool {
    let largest = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.result.is_some())
        .max_by_key(|(_, r)| r.result.as_ref().map(|v| v.to_string().len()));
    let Some((index, _)) = largest else {
        return false;
    };
    let original = &results[index];
    let bytes = original
        .result
        .as_ref()
        .map(|v| v.to_string().len())
        .unwrap_or(0);
    let call = ToolCall {
        id: original.tool_call_id.clone(),
        name: original.name.clone(),
        arguments: serde_json::Value::Null,
        parent_id: original.parent_id.clone(),
    };
    let message =
        format!("the result ({bytes} bytes) was left out: the final must fit in {limit} bytes");
    let mut replaced = CallResult::failure(
        &call,
        CallState::Error,
        CallError::fatal(codes::RESULT_TOO_LARGE, message),
    );
    replaced.worker_id.clone_from(&original.worker_id);
    replaced.attempts = original.attempts;
    results[index] = replaced;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call `id` of tool `t`.
    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: "t".into(),
            arguments: serde_json::Value::Null,
            parent_id: None,
        }
    }

    #[test]
    fn a_final_is_encoded_once_as_it_is_or_fitted_to_the_limit() {
        let results = vec![
            CallResult::success(&call("small"), serde_json::json!({"n": 1})),
            CallResult::success(
                &call("large"),
                serde_json::json!({"text": "x".repeat(8_000)}),
            ),
            CallResult::success(
                &call("medium"),
                serde_json::json!({"text": "y".repeat(3_000)}),
            ),
        ];
        let event = FinalEvent {
            turn_id: "turn".into(),
            text: "done".into(),
            summary: Summary::of(&results),
            history: toolfleet_decision::history::render_history(&results),
            results,
            deadline_hit: false,
            history_omitted: false,
        };
        let fit = |limit: usize| {
            let results = event.results.clone();
            encode("turn", "done", results, false, limit).map(|e| e.sent)
        };
        // Fits: the encoding is the event's, unchanged.
        let whole = serde_json::to_string(&TurnEvent::Final(event.clone())).ok();
        assert_eq!(fit(1 << 20), whole);

        // Over the limit: the history goes first (rendered again from the results by
        // the frontend), then the largest body, then the next, until it fits.
        let fits = |limit: usize| {
            let json = fit(limit).expect("encodes");
            assert!(json.len() <= limit, "{} > {limit}", json.len());
            let Ok(TurnEvent::Final(fitted)) = serde_json::from_str(&json) else {
                panic!("not a final: {json}");
            };
            let ids: Vec<_> = fitted
                .results
                .iter()
                .map(|r| r.tool_call_id.clone())
                .collect();
            assert_eq!(ids, ["small", "large", "medium"]);
            let left_out: Vec<_> = fitted
                .results
                .iter()
                .filter(|r| {
                    r.error
                        .as_ref()
                        .is_some_and(|e| e.code == codes::RESULT_TOO_LARGE)
                })
                .map(|r| r.tool_call_id.clone())
                .collect();
            assert_eq!(fitted.summary, Summary::of(&fitted.results));
            assert!(fitted.history_omitted);
            assert!(fitted.history.openai.is_empty() && fitted.history.anthropic.is_empty());
            let rendered = fitted.session_history();
            assert_eq!(rendered.openai.len(), 3);
            left_out
        };
        let all_kept: Vec<String> = Vec::new();
        assert_eq!(fits(whole.as_ref().map_or(0, String::len) - 100), all_kept);
        let fitted = fit(whole.as_ref().map_or(0, String::len) - 100).expect("encodes");
        let Ok(TurnEvent::Final(fitted)) = serde_json::from_str(&fitted) else {
            panic!("not a final: {fitted}");
        };
        assert_eq!(fitted.session_history(), event.history);
        assert_eq!(fits(4_000), ["large"]);
        assert_eq!(fits(2_000), ["large", "medium"]);

        // Nothing left to leave out: the smallest encoding there is.
        let tight = fit(10).expect("encodes");
        assert!(tight.contains(codes::RESULT_TOO_LARGE));
    }

    #[test]
    fn a_final_is_stored_with_each_result_once_and_sent_again_with_its_history() {
        let results = vec![
            CallResult::success(
                &call("a"),
                serde_json::json!({"n": 1, "text": "x".repeat(500)}),
            ),
            CallResult::failure(
                &call("b"),
                CallState::Error,
                CallError::fatal("boom", "it broke"),
            ),
        ];
        let encoded = encode("turn", "done", results.clone(), true, 1 << 20).expect("encodes");
        let parse = |json: &str| match serde_json::from_str(json) {
            Ok(TurnEvent::Final(f)) => f,
            other => panic!("not a final: {other:?}"),
        };
        let (stored, sent) = (parse(&encoded.stored), parse(&encoded.sent));
        assert!(stored.history_omitted && !sent.history_omitted);
        assert_eq!(stored.results, sent.results);
        assert_eq!(stored.session_history(), sent.history);
        assert!(encoded.stored.len() * 2 < encoded.sent.len());
        // Sent again from the store: the same text as sent when the turn ended.
        assert_eq!(sendable(&encoded.stored, 1 << 20), encoded.sent);
        // Other events, and a `final` that fits only without its history, go as stored.
        let ack = r#"{"type":"ack","turn_id":"turn"}"#;
        assert_eq!(sendable(ack, 1 << 20), ack);
        let tight = encoded.stored.len() + 10;
        let cut = encode("turn", "done", results, true, tight).expect("encodes");
        assert_eq!(cut.stored, cut.sent);
        assert_eq!(sendable(&cut.stored, tight), cut.stored);
    }
}
