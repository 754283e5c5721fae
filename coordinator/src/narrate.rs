//! Turning a turn's results into one answer. [`Narrator`] is the seam for other
//! narrators (a model-backed one, say); [`TemplateNarrator`] needs nothing but the
//! results.
//!
//! The template's rules, in order:
//! - some call succeeded: the successful results in call order, each spoken as
//!   [`spoken_result`] says (the tool's own `summary` when it gave one, else its text,
//!   else a small flat object as "square: 49" phrases, else a JSON excerpt), then the
//!   failed calls named by their waiting hints ("I couldn't check your billing right
//!   now.");
//! - every call failed, each with a definite reason for the user (state `error`, not
//!   `retryable`, with a `user_message`): those messages, each once, in first-seen order
//!   (twelve `customer_not_found` calls are one sentence);
//! - otherwise (no calls, or any failure that is retryable, a timeout, skipped or has no
//!   user message): [`FALLBACK`], because nothing the user could act on can be said.
//!
//! It never reads an error's `message` (written for logs and the model, not the user),
//! and it does no I/O.

use futures::future::BoxFuture;
use serde_json::Value;
use toolfleet_common::{CallResult, CallState, ToolDefinition};
use toolfleet_decision::ack::base_form;

/// What is said when the caller cancelled the turn before any call ended.
pub const STOPPED: &str = "Stopped, as you asked.";

/// The line spoken when every call failed and not every failure has a definite reason
/// for the user (see the module's rules), and when a narrator returns no chunks.
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

/// A narrator failed; the coordinator then narrates with [`TemplateNarrator`].
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

    /// Whether [`Narrator::narrate_ahead`] narrates: then a turn's closing events are
    /// built before its last result is recorded and stored by the same script
    /// (`join.rs`, `RECORD`). `false` (the default, and right for any narrator that
    /// calls out) narrates after the join.
    fn narrates_ahead(&self) -> bool {
        false
    }

    /// The narration of `input` at once, without I/O and without waiting, when
    /// [`Narrator::narrates_ahead`]; `None` otherwise.
    fn narrate_ahead(&self, _input: &NarrationInput<'_>) -> Option<Vec<String>> {
        None
    }
}

/// Successful results in call order (each tool's own summary when it gave one), then the
/// failed calls by name; when nothing succeeded, the failures' user messages if every
/// failure is definite and has one, and the fallback line otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct TemplateNarrator;

/// Longest JSON excerpt spoken for a result without a summary.
const EXCERPT_CHARS: usize = 200;

impl TemplateNarrator {
    /// The chunks for `input`.
    pub fn chunks(input: &NarrationInput<'_>) -> Vec<String> {
        if input.results.is_empty() {
            return vec![FALLBACK.to_string()];
        }
        if input
            .results
            .iter()
            .all(|r| r.state == CallState::Cancelled)
        {
            return vec![STOPPED.to_string()];
        }
        if input.results.iter().all(|r| !r.ok) {
            return definite_reasons(input.results).unwrap_or_else(|| vec![FALLBACK.to_string()]);
        }
        let mut chunks: Vec<String> = Vec::new();
        for r in input.results.iter().filter(|r| r.ok) {
            let chunk = spoken_result(r);
            if !chunks.contains(&chunk) {
                chunks.push(chunk);
            }
        }
        let mut errored: Vec<String> = Vec::new();
        let mut timed_out: Vec<String> = Vec::new();
        let mut stopped: Vec<String> = Vec::new();
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
                CallState::Cancelled => &mut stopped,
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
        if !stopped.is_empty() {
            chunks.push(format!(
                "I stopped before I could {}, as you asked.",
                join_and(&stopped)
            ));
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

    fn narrates_ahead(&self) -> bool {
        true
    }

    fn narrate_ahead(&self, input: &NarrationInput<'_>) -> Option<Vec<String>> {
        Some(Self::chunks(input))
    }
}

/// The user messages of `results`, each once in first-seen order, when every result is a
/// definite failure with one: state `error`, an error that is not retryable and a
/// non-blank `user_message`. `None` as soon as one result is anything else.
fn definite_reasons(results: &[CallResult]) -> Option<Vec<String>> {
    let mut reasons: Vec<String> = Vec::new();
    for r in results {
        if r.state != CallState::Error {
            return None;
        }
        let error = r.error.as_ref().filter(|e| !e.retryable)?;
        let reason = error
            .user_message
            .as_deref()
            .map(str::trim)
            .filter(|m| !m.is_empty())?;
        if !reasons.iter().any(|seen| seen == reason) {
            reasons.push(reason.to_string());
        }
    }
    Some(reasons)
}

/// Field names under which a tool wraps its one answer: the Python MCP SDK's
/// structured output of a function returning a plain value is `{"result": ...}`.
const WRAPPERS: &[&str] = &[
    "result", "text", "message", "output", "answer", "content", "value", "response", "reply",
];

/// Most fields of an object spoken as phrases.
const MAX_PHRASES: usize = 6;

/// Longest text result spoken.
const TEXT_CHARS: usize = 1000;

/// A successful result as spoken: the tool's `summary` when it gave one; else its
/// value, unwrapped from a lone [`WRAPPERS`] field (`{"result": "HI THERE"}`), as
/// - text: the text itself (`HI THERE`);
/// - an object of at most [`MAX_PHRASES`] fields, each a string, number, yes/no or a
///   short list of those: one phrase a field, its name in words (`square: 49.`,
///   `city: Oslo, high c: 21.`; null fields left out);
/// - anything else: `Here is what <tool> returned: <JSON excerpt>.`
pub fn spoken_result(r: &CallResult) -> String {
    if let Some(summary) = r
        .summary
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        return summary.to_string();
    }
    let value = r.result.as_ref().map(unwrapped);
    let spoken = match value {
        Some(Value::String(text)) if !text.trim().is_empty() => {
            Some(cut(text.trim().to_string(), TEXT_CHARS))
        }
        Some(Value::Object(fields)) => phrases(fields),
        _ => None,
    };
    spoken.unwrap_or_else(|| format!("Here is what {} returned: {}.", r.name, excerpt(value)))
}

/// `value` without the lone wrapper fields around its answer.
fn unwrapped(value: &Value) -> &Value {
    match value {
        Value::Object(fields) if fields.len() == 1 => match fields.iter().next() {
            Some((name, inner)) if WRAPPERS.contains(&name.to_ascii_lowercase().as_str()) => {
                unwrapped(inner)
            }
            _ => value,
        },
        other => other,
    }
}

/// A small flat object as one sentence of `name: value` phrases; `None` when it is
/// empty, too large, nested, or longer than [`EXCERPT_CHARS`] spoken.
fn phrases(fields: &serde_json::Map<String, Value>) -> Option<String> {
    let present: Vec<(&String, &Value)> = fields.iter().filter(|(_, v)| !v.is_null()).collect();
    if present.is_empty() || present.len() > MAX_PHRASES {
        return None;
    }
    let mut spoken = Vec::with_capacity(present.len());
    for (name, value) in present {
        let said = match value {
            Value::Array(items) if !items.is_empty() && items.len() <= MAX_PHRASES => {
                let items: Option<Vec<String>> = items.iter().map(scalar).collect();
                join_and(&items?)
            }
            other => scalar(other)?,
        };
        spoken.push(format!("{}: {said}", words(name)));
    }
    let sentence = spoken.join(", ");
    if sentence.chars().count() > EXCERPT_CHARS {
        return None;
    }
    if sentence.ends_with(['.', '!', '?']) {
        Some(sentence)
    } else {
        Some(format!("{sentence}."))
    }
}

/// A string, number or boolean as spoken; `None` for anything else.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(true) => Some("yes".to_string()),
        Value::Bool(false) => Some("no".to_string()),
        _ => None,
    }
}

/// A field name in words: `high_c` is `high c`, `customerId` is `customer id`,
/// `customerID` is `customer ID`.
fn words(name: &str) -> String {
    let mut split: Vec<String> = Vec::new();
    let mut word = String::new();
    let mut previous_lower = false;
    for c in name.chars() {
        if c == '_' || c == '-' || c.is_whitespace() {
            split.push(std::mem::take(&mut word));
            previous_lower = false;
            continue;
        }
        if c.is_uppercase() && previous_lower {
            split.push(std::mem::take(&mut word));
        }
        previous_lower = c.is_lowercase() || c.is_ascii_digit();
        word.push(c);
    }
    split.push(word);
    split
        .into_iter()
        .filter(|w| !w.is_empty())
        .map(|w| {
            let acronym = w.chars().count() > 1 && w.chars().all(|c| !c.is_lowercase());
            if acronym {
                w
            } else {
                w.to_lowercase()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn excerpt(value: Option<&Value>) -> String {
    let text = match value {
        None | Some(Value::Null) => return "nothing".to_string(),
        Some(Value::String(s)) if s.trim().is_empty() => return "nothing".to_string(),
        Some(Value::Array(a)) if a.is_empty() => return "nothing".to_string(),
        Some(Value::Object(o)) if o.values().all(Value::is_null) => return "nothing".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    cut(text, EXCERPT_CHARS)
}

/// `text` cut to `chars` characters, with `…` when cut.
fn cut(text: String, chars: usize) -> String {
    if text.chars().count() <= chars {
        text
    } else {
        let cut: String = text.chars().take(chars).collect();
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

    const NO_CUSTOMER: &str = "I couldn't find a customer with that id.";
    const NO_BOOKING: &str = "I couldn't find a booking with that reference.";

    /// A definite failure of `name`: `error`, not retryable, with `sentence` for the user.
    fn definite(name: &str, code: &str, sentence: &str) -> CallResult {
        CallResult::failure(
            &call(name),
            CallState::Error,
            CallError::fatal(code, format!("{code}: internal detail")).with_user_message(sentence),
        )
    }

    fn narrate(results: &[CallResult], tools: Vec<Option<&ToolDefinition>>) -> Vec<String> {
        TemplateNarrator::chunks(&NarrationInput {
            user_message: None,
            results,
            tools,
        })
    }

    #[test]
    fn all_definite_failures_speak_their_reasons_once_in_order() {
        // Twelve calls for an unknown customer are one sentence.
        let twelve: Vec<CallResult> = (0..12)
            .map(|_| definite("crm.getOpenInvoices", "customer_not_found", NO_CUSTOMER))
            .collect();
        assert_eq!(
            narrate(&twelve, vec![None; 12]),
            vec![NO_CUSTOMER.to_string()]
        );

        // Different reasons are each spoken once, in the order first seen; surrounding
        // blanks are trimmed before comparing.
        let results = [
            definite("crm.getOpenInvoices", "customer_not_found", NO_CUSTOMER),
            definite("get_booking_by_id", "booking_not_found", NO_BOOKING),
            definite("crm.getNextAppointment", "customer_not_found", NO_CUSTOMER),
            definite(
                "get_booking_by_id",
                "invalid_booking_id",
                &format!(" {NO_BOOKING} "),
            ),
        ];
        assert_eq!(
            narrate(&results, vec![None; 4]),
            vec![NO_CUSTOMER.to_string(), NO_BOOKING.to_string()]
        );
    }

    #[test]
    fn all_failed_with_one_retryable_is_the_fallback() {
        let mut retryable = definite("crm.getOpenInvoices", "database_unavailable", NO_CUSTOMER);
        if let Some(error) = retryable.error.as_mut() {
            error.retryable = true;
        }
        let mut results: Vec<CallResult> = (0..11)
            .map(|_| definite("crm.getOpenInvoices", "customer_not_found", NO_CUSTOMER))
            .collect();
        results.push(retryable);
        assert_eq!(
            narrate(&results, vec![None; 12]),
            vec![FALLBACK.to_string()]
        );

        // So is one definite failure without a user message (an internal error).
        let results = [
            definite("crm.getOpenInvoices", "customer_not_found", NO_CUSTOMER),
            CallResult::failure(
                &call("x"),
                CallState::Error,
                CallError::fatal("tool_panicked", "the tool panicked"),
            ),
        ];
        assert_eq!(narrate(&results, vec![None; 2]), vec![FALLBACK.to_string()]);
    }

    #[test]
    fn all_failed_with_a_timeout_is_the_fallback() {
        // The state decides, even for an error that is final and carries a message.
        for state in [CallState::Timeout, CallState::Skipped] {
            let late = CallResult::failure(
                &call("crm.getNextAppointment"),
                state,
                CallError::fatal("deadline_exceeded", "late").with_user_message(NO_CUSTOMER),
            );
            let results = [
                definite("crm.getOpenInvoices", "customer_not_found", NO_CUSTOMER),
                late,
            ];
            assert_eq!(
                narrate(&results, vec![None; 2]),
                vec![FALLBACK.to_string()],
                "{state:?}"
            );
        }
    }

    #[test]
    fn mixed_turns_name_the_failed_tool_not_its_user_message() {
        let mut ok = CallResult::success(&call("crm.listUpcomingAppointments"), json!([]));
        ok.summary = Some("You have no upcoming appointments.".into());
        let failed = definite("crm.getOpenInvoices", "customer_not_found", NO_CUSTOMER);
        let mut billing = ToolDefinition::new("crm.getOpenInvoices", "");
        billing.waiting_hint = Some("checking your billing".into());
        let results = [ok, failed];
        assert_eq!(
            narrate(&results, vec![None, Some(&billing)]),
            vec![
                "You have no upcoming appointments.".to_string(),
                "I couldn't check your billing right now.".to_string()
            ]
        );
    }

    fn spoken(value: Value) -> String {
        spoken_result(&CallResult::success(&call("hold.tool"), value))
    }

    #[test]
    fn results_without_a_summary_are_spoken_as_a_person_would() {
        // A lone text field is its text, however deep the wrappers.
        assert_eq!(spoken(json!({"result": "HI THERE"})), "HI THERE");
        assert_eq!(
            spoken(json!({"Result": {"text": " slept 5 ms "}})),
            "slept 5 ms"
        );
        assert_eq!(spoken(json!("plain text")), "plain text");
        // A small flat object is one phrase a field, null fields left out.
        assert_eq!(spoken(json!({"square": 49})), "square: 49.");
        assert_eq!(
            spoken(json!({"city": "Oslo", "high_c": 21, "sky": null, "customerID": "c1"})),
            "city: Oslo, customer ID: c1, high c: 21."
        );
        assert_eq!(
            spoken(json!({"isOpen": true, "days": ["Monday", "Tuesday", "Friday"]})),
            "days: Monday, Tuesday and Friday, is open: yes."
        );
        assert_eq!(spoken(json!({"status": "Booked."})), "status: Booked.");
        // A lone field that is not a wrapper keeps its name.
        assert_eq!(spoken(json!({"status": "confirmed"})), "status: confirmed.");
        // Numbers, nested or large objects and nothing at all keep the excerpt.
        assert_eq!(
            spoken(json!({"result": 49})),
            "Here is what hold.tool returned: 49."
        );
        assert_eq!(
            spoken(json!({"a": {"b": 1}})),
            r#"Here is what hold.tool returned: {"a":{"b":1}}."#
        );
        let wide: serde_json::Map<String, Value> =
            (0..7).map(|i| (format!("f{i}"), json!(i))).collect();
        assert!(spoken(Value::Object(wide)).starts_with("Here is what hold.tool returned: {"));
        assert_eq!(
            spoken(json!({})),
            "Here is what hold.tool returned: nothing."
        );
        assert_eq!(
            spoken(json!([])),
            "Here is what hold.tool returned: nothing."
        );
        // The tool's own summary comes first.
        let mut summarized = CallResult::success(&call("hold.tool"), json!({"square": 49}));
        summarized.summary = Some("Forty-nine.".into());
        assert_eq!(spoken_result(&summarized), "Forty-nine.");
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
