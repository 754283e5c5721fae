//! Turning a turn's results into one answer. [`Narrator`] is the seam for other
//! narrators (a model-backed one, say); [`TemplateNarrator`] needs nothing but the
//! results.
//!
//! The template's rules, in order:
//! - some call succeeded: the successful results in call order, each spoken as
//!   [`spoken_result`] says (the tool's own `summary` when it gave one, else its text,
//!   else a small flat object as "square: 49" phrases, else a neutral sentence with the
//!   tool's spoken name), then one sentence for every failed call ("I couldn't check
//!   your billing or get your order status right now, and I couldn't look up your
//!   appointments in time."), each named by its waiting hint or its spoken name, and
//!   counted when it has neither ("complete one other request");
//! - every call failed, each with a definite reason for the user (state `error`, not
//!   `retryable`, with a `user_message`): those messages, each once, in first-seen order
//!   (twelve `customer_not_found` calls are one sentence);
//! - otherwise (no calls, or any failure that is retryable, a timeout, skipped or has no
//!   user message): [`FALLBACK`], because nothing the user could act on can be said.
//!
//! A tool's name (`crm.getOpenInvoices`, or one the model made up) and raw JSON are
//! never spoken: both are for programs, and the answer is for a person's ears.
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
    /// (`store/redis.rs`, `RECORD`). `false` (the default, and right for any narrator that
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

/// Successful results in call order (each tool's own summary when it gave one), then one
/// sentence naming the failed calls in words; when nothing succeeded, the failures' user messages if every
/// failure is definite and has one, and the fallback line otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct TemplateNarrator;

/// Longest sentence of `name: value` phrases spoken for a result without a summary.
const PHRASES_CHARS: usize = 200;

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
        for (r, tool) in input.results.iter().zip(&input.tools).filter(|(r, _)| r.ok) {
            let chunk = spoken_result(r, *tool);
            if !chunks.contains(&chunk) {
                chunks.push(chunk);
            }
        }
        let failed = input
            .results
            .iter()
            .zip(&input.tools)
            .filter(|(r, _)| !r.ok)
            .map(|(r, tool)| (r.state, *tool));
        chunks.extend(failures_sentence(failed));
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

/// Longest spoken name used; a longer one is ignored, as if the tool gave none.
const SPOKEN_NAME_CHARS: usize = 80;

/// What a tool gives as a person hears it: its definition's `spoken_name`, trimmed,
/// without a closing full stop; `None` when it gave none, a blank or overlong one, or
/// one that is only its own tool name.
fn spoken_name(tool: Option<&ToolDefinition>) -> Option<String> {
    let tool = tool?;
    let name = tool
        .spoken_name
        .as_deref()?
        .trim()
        .trim_end_matches('.')
        .trim();
    let usable = !name.is_empty()
        && name.chars().count() <= SPOKEN_NAME_CHARS
        && !name.eq_ignore_ascii_case(&tool.name);
    usable.then(|| name.to_string())
}

/// What the narrator says it could not do for a failed call of `tool`: the base form of
/// its waiting hint ("check your billing"), else "get" and its spoken name ("get your
/// order status"); `None` when the tool is unknown or gave neither, because a tool's
/// name is never spoken.
fn failed_action(tool: Option<&ToolDefinition>) -> Option<String> {
    let hint = tool
        .and_then(|t| t.waiting_hint.as_deref())
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(base_form);
    hint.or_else(|| spoken_name(tool).map(|name| format!("get {name}")))
}

/// The failed calls of a turn in which something succeeded, as one sentence, or `None`
/// when none failed. One clause per way of failing, in this order: `I couldn't … right
/// now` (errors and skipped calls), `I couldn't … in time` (timeouts), `I stopped before
/// I could …, as you asked` (cancelled); each names the calls' actions once, in call
/// order, joined with "or", and counts the calls it has no words for ("complete one other
/// request", "complete two of the requests").
fn failures_sentence<'a>(
    failed: impl Iterator<Item = (CallState, Option<&'a ToolDefinition>)>,
) -> Option<String> {
    // (actions, calls without words) for errors, timeouts and cancellations.
    let mut groups: [(Vec<String>, usize); 3] = Default::default();
    for (state, tool) in failed {
        let group = match state {
            CallState::Timeout => &mut groups[1],
            CallState::Cancelled => &mut groups[2],
            _ => &mut groups[0],
        };
        match failed_action(tool) {
            Some(action) if !group.0.contains(&action) => group.0.push(action),
            Some(_) => {}
            None => group.1 += 1,
        }
    }
    let clauses: Vec<String> = groups
        .into_iter()
        .enumerate()
        .filter_map(|(kind, (mut actions, unnamed))| {
            match (actions.is_empty(), unnamed) {
                (true, 0) => return None,
                (true, n) => actions.push(format!("complete {} of the requests", count_words(n))),
                (false, 0) => {}
                (false, 1) => actions.push("complete one other request".to_string()),
                (false, n) => actions.push(format!("complete {} other requests", count_words(n))),
            }
            let actions = join_or(&actions);
            Some(match kind {
                0 => format!("I couldn't {actions} right now"),
                1 => format!("I couldn't {actions} in time"),
                _ => format!("I stopped before I could {actions}, as you asked"),
            })
        })
        .collect();
    match clauses.as_slice() {
        [] => None,
        [one] => Some(format!("{one}.")),
        [init @ .., last] => Some(format!("{}, and {last}.", init.join(", "))),
    }
}

/// A count as spoken: words up to twelve, digits above.
fn count_words(n: usize) -> String {
    const WORDS: [&str; 13] = [
        "no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve",
    ];
    WORDS
        .get(n)
        .map_or_else(|| n.to_string(), |w| (*w).to_string())
}

/// Alternatives as spoken: "a", "a or b", "a, b, or c".
fn join_or(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [a, b] => format!("{a} or {b}"),
        [init @ .., last] => format!("{}, or {last}", init.join(", ")),
    }
}

/// `text` with its first letter in upper case.
fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
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

/// A successful result of `tool` as spoken: the tool's `summary` when it gave one; else
/// its value, unwrapped from a lone [`WRAPPERS`] field (`{"result": "HI THERE"}`), as
/// - text: the text itself (`HI THERE`);
/// - an object of at most [`MAX_PHRASES`] fields, each a string, number, yes/no or a
///   short list of those: one phrase a field, its name in words (`square: 49.`,
///   `city: Oslo, high c: 21.`; null fields left out);
/// - a number, yes/no or a short list of those: the value after the tool's spoken name
///   (`Your order count is 3.`), or after "The result is" for a tool without one;
/// - nothing (null, empty): `There was nothing to report for <spoken name>.`;
/// - anything else: a neutral sentence, `I got <spoken name>.` (`I got that for you.`
///   for a tool without one).
///
/// Never raw JSON and never the tool's name: neither is anything a person should hear.
pub fn spoken_result(r: &CallResult, tool: Option<&ToolDefinition>) -> String {
    if let Some(summary) = r
        .summary
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        return summary.to_string();
    }
    let value = r.result.as_ref().map(unwrapped).unwrap_or(&Value::Null);
    let named = spoken_name(tool);
    if let Some(spoken) = match value {
        Value::String(text) if !text.trim().is_empty() => {
            Some(cut(text.trim().to_string(), TEXT_CHARS))
        }
        Value::Object(fields) => phrases(fields),
        _ => None,
    } {
        return spoken;
    }
    if is_nothing(value) {
        return match named {
            Some(name) => format!("There was nothing to report for {name}."),
            None => "There was nothing to report.".to_string(),
        };
    }
    let said = match value {
        Value::Array(items) if items.len() <= MAX_PHRASES => items
            .iter()
            .map(scalar)
            .collect::<Option<Vec<_>>>()
            .map(|i| join_and(&i)),
        other => scalar(other),
    };
    match (said, named) {
        (Some(said), Some(name)) => full_stop(format!("{} is {said}", capitalized(&name))),
        (Some(said), None) => full_stop(format!("The result is {said}")),
        (None, Some(name)) => format!("I got {name}."),
        (None, None) => "I got that for you.".to_string(),
    }
}

/// Whether `value` holds nothing a person could be told: null, blank text, an empty list,
/// an object whose fields are all null.
fn is_nothing(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::String(s) => s.trim().is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(Value::is_null),
        _ => false,
    }
}

/// `sentence` ending in a full stop (or the mark it already ends with).
fn full_stop(sentence: String) -> String {
    if sentence.ends_with(['.', '!', '?']) {
        sentence
    } else {
        format!("{sentence}.")
    }
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
/// empty, too large, nested, or longer than [`PHRASES_CHARS`] spoken.
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
    if sentence.chars().count() > PHRASES_CHARS {
        return None;
    }
    Some(full_stop(sentence))
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
        spoken_result(&CallResult::success(&call("hold.tool"), value), None)
    }

    /// A known tool `name` with an optional waiting hint and spoken name.
    fn tool(name: &str, hint: Option<&str>, spoken_name: Option<&str>) -> ToolDefinition {
        let mut tool = ToolDefinition::new(name, "");
        tool.waiting_hint = hint.map(str::to_string);
        tool.spoken_name = spoken_name.map(str::to_string);
        tool
    }

    /// A call of `name` that ended in `state`, with an error written for logs.
    fn failed(name: &str, state: CallState) -> CallResult {
        CallResult::failure(
            &call(name),
            state,
            CallError::retryable("upstream_down", format!("{name}: connection refused")),
        )
    }

    fn succeeded(name: &str, summary: &str) -> CallResult {
        let mut r = CallResult::success(&call(name), json!({"any": "thing"}));
        r.summary = Some(summary.into());
        r
    }

    /// Asserts that no chunk speaks a tool name, JSON or an error written for logs.
    fn assert_hearable(chunks: &[String], names: &[&str]) {
        for chunk in chunks {
            for name in names {
                assert!(!chunk.contains(name), "{chunk:?} speaks {name}");
            }
            assert!(
                !chunk.contains(['{', '}', '[', ']', '"']),
                "{chunk:?} speaks JSON"
            );
            assert!(!chunk.contains("connection refused"), "{chunk:?}");
        }
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
        assert_eq!(spoken(json!({"slept": 7})), "slept: 7.");
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
        // A bare value or a short list of values is the result.
        assert_eq!(spoken(json!({"result": 49})), "The result is 49.");
        assert_eq!(spoken(json!(["a", "b"])), "The result is a and b.");
        // Nested or large objects get a neutral sentence, never their JSON or the tool.
        assert_eq!(spoken(json!({"a": {"b": 1}})), "I got that for you.");
        let wide: serde_json::Map<String, Value> =
            (0..7).map(|i| (format!("f{i}"), json!(i))).collect();
        assert_eq!(spoken(Value::Object(wide)), "I got that for you.");
        // Nothing at all is said as nothing.
        for nothing in [json!({}), json!([]), json!(null), json!({"result": " "})] {
            assert_eq!(spoken(nothing), "There was nothing to report.");
        }
        // The tool's own summary comes first.
        let mut summarized = CallResult::success(&call("hold.tool"), json!({"square": 49}));
        summarized.summary = Some("Forty-nine.".into());
        assert_eq!(spoken_result(&summarized, None), "Forty-nine.");
    }

    #[test]
    fn a_spoken_name_stands_where_the_result_has_no_words() {
        let orders = tool("aa.orders.status", None, Some(" your order status. "));
        let said = |value: Value| {
            spoken_result(
                &CallResult::success(&call("aa.orders.status"), value),
                Some(&orders),
            )
        };
        assert_eq!(said(json!({"result": 3})), "Your order status is 3.");
        assert_eq!(
            said(json!({"orders": [{"id": 1}, {"id": 2}]})),
            "I got your order status."
        );
        assert_eq!(
            said(json!([])),
            "There was nothing to report for your order status."
        );
        // Text and phrases need no name.
        assert_eq!(said(json!({"result": "Shipped"})), "Shipped");
        // A blank, overlong or self-naming spoken name is no name.
        for unusable in ["  ", "aa.orders.status", &"x".repeat(SPOKEN_NAME_CHARS + 1)] {
            let t = tool("aa.orders.status", None, Some(unusable));
            let r = CallResult::success(&call("aa.orders.status"), json!({"a": {"b": 1}}));
            assert_eq!(
                spoken_result(&r, Some(&t)),
                "I got that for you.",
                "{unusable:?}"
            );
        }
    }

    #[test]
    fn failures_without_words_are_counted_never_named() {
        // The turn that once said "I couldn't get a result from aa.orders.status, get a
        // result from aa.text.stats and get a result from aa.nope right now."
        let orders = tool("aa.orders.status", None, None);
        let stats = tool("aa.text.stats", None, None);
        let results = [
            succeeded("crm.getOpenInvoices", "You have no open invoices."),
            failed("aa.orders.status", CallState::Error),
            failed("aa.text.stats", CallState::Error),
            failed("aa.nope", CallState::Error),
        ];
        let chunks = narrate(&results, vec![None, Some(&orders), Some(&stats), None]);
        assert_eq!(
            chunks,
            [
                "You have no open invoices.",
                "I couldn't complete three of the requests right now."
            ]
        );
        assert_hearable(&chunks, &["aa.orders.status", "aa.text.stats", "aa.nope"]);
        // One alone.
        let chunks = narrate(&results[..2], vec![None, Some(&orders)]);
        assert_eq!(
            chunks[1],
            "I couldn't complete one of the requests right now."
        );
    }

    #[test]
    fn failures_with_words_are_one_sentence_joined_with_or() {
        let billing = tool("crm.getOpenInvoices", Some("checking your billing"), None);
        let orders = tool("aa.orders.status", None, Some("your order status"));
        let stats = tool("aa.text.stats", None, Some("the text statistics"));
        let results = [
            succeeded("crm.listUpcomingAppointments", "You have one appointment."),
            failed("crm.getOpenInvoices", CallState::Error),
            failed("aa.orders.status", CallState::Error),
            failed("aa.nope", CallState::Error),
            failed("crm.getOpenInvoices", CallState::Error),
            failed("aa.text.stats", CallState::Skipped),
        ];
        let chunks = narrate(
            &results,
            vec![
                None,
                Some(&billing),
                Some(&orders),
                None,
                Some(&billing),
                Some(&stats),
            ],
        );
        assert_eq!(
            chunks[1],
            "I couldn't check your billing, get your order status, get the text statistics, \
             or complete one other request right now."
        );
        assert_eq!(chunks.len(), 2);
        assert_hearable(&chunks, &["crm.", "aa."]);

        // Two alternatives take "or" alone; two unnamed beside a named one are counted.
        let two = narrate(&results[..3], vec![None, Some(&billing), Some(&orders)]);
        assert_eq!(
            two[1],
            "I couldn't check your billing or get your order status right now."
        );
        let counted = [
            results[0].clone(),
            failed("crm.getOpenInvoices", CallState::Error),
            failed("aa.nope", CallState::Error),
            failed("aa.other", CallState::Error),
        ];
        let counted = narrate(&counted, vec![None, Some(&billing), None, None]);
        assert_eq!(
            counted[1],
            "I couldn't check your billing or complete two other requests right now."
        );
    }

    #[test]
    fn errors_timeouts_and_cancellations_share_one_sentence() {
        let billing = tool("crm.getOpenInvoices", Some("checking your billing"), None);
        let appointments = tool(
            "crm.listUpcomingAppointments",
            Some("looking up your upcoming appointments"),
            None,
        );
        let orders = tool("aa.orders.status", None, Some("your order status"));
        let results = [
            succeeded("crm.getCustomer", "Your account is active."),
            failed("crm.listUpcomingAppointments", CallState::Timeout),
            failed("crm.getOpenInvoices", CallState::Error),
            failed("aa.orders.status", CallState::Cancelled),
            failed("aa.nope", CallState::Timeout),
        ];
        let chunks = narrate(
            &results,
            vec![
                None,
                Some(&appointments),
                Some(&billing),
                Some(&orders),
                None,
            ],
        );
        assert_eq!(
            chunks,
            [
                "Your account is active.",
                "I couldn't check your billing right now, I couldn't look up your upcoming \
                 appointments or complete one other request in time, and I stopped before I \
                 could get your order status, as you asked."
            ]
        );
        assert_hearable(&chunks, &["crm.", "aa."]);
        // Two kinds: joined with ", and".
        let chunks = narrate(
            &results[..3],
            vec![None, Some(&appointments), Some(&billing)],
        );
        assert_eq!(
            chunks[1],
            "I couldn't check your billing right now, and I couldn't look up your upcoming \
             appointments in time."
        );
    }

    #[test]
    fn a_turn_of_many_results_never_speaks_json_or_a_tool_name() {
        let names = ["aa.py2.block", "aa.orders.status", "x.y"];
        let results = [
            CallResult::success(&call(names[0]), json!({"slept": 7, "nested": {"a": 1}})),
            CallResult::success(&call(names[1]), json!([{"id": 1}])),
            CallResult::success(&call(names[2]), json!(null)),
            failed("aa.nope", CallState::Error),
        ];
        let chunks = narrate(&results, vec![None; 4]);
        assert_eq!(
            chunks,
            [
                "I got that for you.",
                "There was nothing to report.",
                "I couldn't complete one of the requests right now."
            ]
        );
        assert_hearable(&chunks, &names);
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
