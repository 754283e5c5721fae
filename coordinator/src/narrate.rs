//! Turning a turn's results into one answer. [`Narrator`] is the seam for other
//! narrators (a model-backed one, say); [`TemplateNarrator`] needs nothing but the
//! results.

use futures::future::BoxFuture;
use serde_json::Value;
use toolfleet_common::{CallResult, CallState, ToolDefinition};
use toolfleet_decision::ack::base_form;

/// The line spoken when every call failed.
pub const FALLBACK: &str =
    "I'm having trouble pulling that up right now. Would you like me to take a message?";

/// What a narrator gets.
pub struct NarrationInput<'a> {
    /// What the user said, if the frontend sent it.
    pub user_message: Option<&'a str>,
    /// Every call's result, in decision order.
    pub results: &'a [CallResult],
    /// The definition of each result's tool, when known (same order as `results`).
    pub tools: Vec<Option<&'a ToolDefinition>>,
}

/// A narrator failed; the coordinator then speaks [`FALLBACK`].
#[derive(Debug, thiserror::Error)]
#[error("narration failed: {0}")]
pub struct NarrateError(pub String);

/// Produces the answer as one or more chunks, streamed as `narration` events.
pub trait Narrator: Send + Sync {
    /// Narrates `input`.
    fn narrate<'a>(
        &'a self,
        input: &'a NarrationInput<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, NarrateError>>;
}

/// Successful results in call order (each tool's own summary when it gave one), then the
/// failed calls by name; the fallback line when nothing succeeded.
#[derive(Debug, Clone, Copy, Default)]
pub struct TemplateNarrator;

/// Longest JSON excerpt spoken for a result without a summary.
const EXCERPT_CHARS: usize = 200;

impl TemplateNarrator {
    /// The chunks for `input`.
    pub fn chunks(input: &NarrationInput<'_>) -> Vec<String> {
        if input.results.is_empty() || input.results.iter().all(|r| !r.ok) {
            return vec![FALLBACK.to_string()];
        }
        let mut chunks: Vec<String> = Vec::new();
        for r in input.results.iter().filter(|r| r.ok) {
            let chunk = match &r.summary {
                Some(s) if !s.trim().is_empty() => s.trim().to_string(),
                _ => format!(
                    "Here is what {} returned: {}.",
                    r.name,
                    excerpt(r.result.as_ref())
                ),
            };
            if !chunks.contains(&chunk) {
                chunks.push(chunk);
            }
        }
        let mut errored: Vec<String> = Vec::new();
        let mut timed_out: Vec<String> = Vec::new();
        for (r, tool) in input.results.iter().zip(&input.tools) {
            if r.ok {
                continue;
            }
            let action = tool
                .and_then(|t| t.waiting_hint.as_deref())
                .map(base_form)
                .unwrap_or_else(|| {
                    if r.name.is_empty() {
                        "complete one of the requests".to_string()
                    } else {
                        format!("get a result from {}", r.name)
                    }
                });
            let list = match r.state {
                CallState::Timeout => &mut timed_out,
                _ => &mut errored,
            };
            if !list.contains(&action) {
                list.push(action);
            }
        }
        if !errored.is_empty() {
            chunks.push(format!("I couldn't {} right now.", join_and(&errored)));
        }
        if !timed_out.is_empty() {
            chunks.push(format!("I couldn't {} in time.", join_and(&timed_out)));
        }
        chunks
    }
}

impl Narrator for TemplateNarrator {
    fn narrate<'a>(
        &'a self,
        input: &'a NarrationInput<'a>,
    ) -> BoxFuture<'a, Result<Vec<String>, NarrateError>> {
        Box::pin(async move { Ok(Self::chunks(input)) })
    }
}

fn excerpt(value: Option<&Value>) -> String {
    let text = match value {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => "nothing".to_string(),
    };
    if text.chars().count() <= EXCERPT_CHARS {
        text
    } else {
        let cut: String = text.chars().take(EXCERPT_CHARS).collect();
        format!("{cut}…")
    }
}

fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use toolfleet_common::{CallError, ToolCall};

    fn call(name: &str) -> ToolCall {
        ToolCall {
            id: format!("id-{name}"),
            name: name.into(),
            arguments: json!({}),
            parent_id: None,
        }
    }

    #[test]
    fn successes_in_order_then_failures_named() {
        let mut a = CallResult::success(&call("crm.listUpcomingAppointments"), json!([]));
        a.summary = Some("You have one upcoming appointment.".into());
        let b = CallResult::failure(
            &call("crm.getOpenInvoices"),
            CallState::Timeout,
            CallError::fatal("deadline_exceeded", "late"),
        );
        let mut billing = ToolDefinition::new("crm.getOpenInvoices", "");
        billing.waiting_hint = Some("checking your billing".into());
        let results = [a, b];
        let input = NarrationInput {
            user_message: None,
            results: &results,
            tools: vec![None, Some(&billing)],
        };
        assert_eq!(
            TemplateNarrator::chunks(&input),
            vec![
                "You have one upcoming appointment.".to_string(),
                "I couldn't check your billing in time.".to_string()
            ]
        );
    }

    #[test]
    fn all_failed_is_the_fallback() {
        let results = [CallResult::failure(
            &call("x"),
            CallState::Error,
            CallError::fatal("tool_error", "boom"),
        )];
        let input = NarrationInput {
            user_message: None,
            results: &results,
            tools: vec![None],
        };
        assert_eq!(TemplateNarrator::chunks(&input), vec![FALLBACK.to_string()]);
    }
}
