//! Parsing a model decision, in any supported shape, into normalized calls.
//!
//! Supported shapes, detected in this order:
//!
//! 1. a JSON array of OpenAI Responses output items (`function_call`, `message`,
//!    `reasoning`) or of Anthropic content blocks (`tool_use`, `text`);
//! 2. a whole OpenAI Chat Completions response (`choices[0].message` is used);
//! 3. the simple form `{"type": "tool_calls", "calls": [...], "acknowledgement"?}` or
//!    `{"type": "final", "text": ...}`;
//! 4. an OpenAI assistant message (`tool_calls[]`, or `role: "assistant"` with string
//!    or null `content`);
//! 5. an OpenAI Responses response (`output[]`);
//! 6. an Anthropic message (`content[]`).
//!
//! Every call keeps its id (one is generated when it has none) and its position. A call
//! to the [`PARALLEL_TOOL`] meta-tool is replaced, in place, by the calls it carries.
//! Entries that cannot be used are kept in their slot with a [`DecisionCall::problem`],
//! so the model's history still gets a result for them. Duplicate ids and tool names
//! are left for the coordinator to judge.

use std::borrow::Cow;

use serde_json::{Map, Value};

use toolfleet_common::call::{codes, CallError, ToolCall};
use toolfleet_common::names::PARALLEL_TOOL;

/// What the model decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// No tools: the text is the answer.
    Final {
        /// The answer, trimmed.
        text: String,
    },
    /// One or more tool calls to run.
    ToolCalls(ToolCallsDecision),
}

impl Decision {
    /// The calls of the decision (empty for [`Decision::Final`]).
    pub fn calls(&self) -> &[DecisionCall] {
        match self {
            Self::Final { .. } => &[],
            Self::ToolCalls(d) => &d.calls,
        }
    }
}

/// A decision that calls tools.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallsDecision {
    /// The calls in the model's order, `parallel` meta-calls flattened in place.
    pub calls: Vec<DecisionCall>,
    /// The model's own text alongside the calls, trimmed; `None` when there is none.
    pub acknowledgement: Option<String>,
    /// Concurrency bound asked for by a `parallel` meta-call (the smallest one when
    /// several ask).
    pub concurrency: Option<usize>,
    /// Timeout in milliseconds asked for by a `parallel` meta-call (the smallest one when
    /// several ask).
    pub timeout_ms: Option<u64>,
}

/// One normalized call, and why it cannot run when it cannot.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionCall {
    /// The call: id, name, arguments and, for flattened calls, the meta-call's id.
    pub call: ToolCall,
    /// Set when the entry is unusable (`malformed_call` or `malformed_arguments`); the
    /// call must get this error as its result instead of running.
    pub problem: Option<CallError>,
}

impl DecisionCall {
    /// Whether the call is well-formed (it may still fail the coordinator's checks).
    pub fn is_well_formed(&self) -> bool {
        self.problem.is_none()
    }
}

/// Why a decision could not be parsed at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DecisionError {
    kind: DecisionErrorKind,
    message: String,
}

impl DecisionError {
    fn new(kind: DecisionErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> DecisionErrorKind {
        self.kind
    }

    /// The human-readable explanation (also the `Display` text).
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The kinds of [`DecisionError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionErrorKind {
    /// The decision text is not valid JSON.
    NotJson,
    /// The JSON is not any supported decision shape, or holds neither calls nor text.
    UnrecognizedShape,
    /// The decision holds more calls (after flattening) than allowed.
    TooManyCalls,
}

/// Parses a decision given as JSON text.
///
/// # Errors
///
/// [`DecisionErrorKind::NotJson`] when `text` is not JSON, otherwise as
/// [`parse_decision`].
pub fn parse_decision_str(text: &str, max_calls: usize) -> Result<Decision, DecisionError> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        DecisionError::new(
            DecisionErrorKind::NotJson,
            format!("the decision is not valid JSON: {e}"),
        )
    })?;
    parse_decision(&value, max_calls)
}

/// Parses a decision in any supported shape (see the [module docs](self)).
///
/// A JSON string whose content is a JSON object or array is parsed as that value.
///
/// # Errors
///
/// [`DecisionErrorKind::TooManyCalls`] as soon as more than `max_calls` calls are found
/// (after flattening `parallel`), and [`DecisionErrorKind::UnrecognizedShape`] for
/// anything that is not a decision or holds neither calls nor text.
pub fn parse_decision(value: &Value, max_calls: usize) -> Result<Decision, DecisionError> {
    let builder = Builder::new(max_calls);
    match value {
        Value::Array(items) => parse_item_array(items, builder),
        Value::Object(obj) => parse_object(obj, builder),
        Value::String(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(items)) => parse_item_array(&items, builder),
            Ok(Value::Object(obj)) => parse_object(&obj, builder),
            _ => Err(unrecognized(
                "the decision is a string, not a JSON object or array",
            )),
        },
        other => Err(unrecognized(format!(
            "the decision must be a JSON object or array, not {}",
            json_kind(other)
        ))),
    }
}

/// A fresh call id: `call_` followed by 24 lowercase hex digits.
pub fn generate_call_id() -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    let short: String = hex.chars().take(24).collect();
    format!("call_{short}")
}

// ----- shapes -------------------------------------------------------------------------

const SHAPES_HINT: &str = "expected an OpenAI chat completion or assistant message, \
    OpenAI Responses output, an Anthropic message or content blocks, \
    or {\"type\": \"tool_calls\" | \"final\"}";

fn parse_item_array(items: &[Value], builder: Builder) -> Result<Decision, DecisionError> {
    let family = items.iter().find_map(|item| match type_of(item)? {
        "function_call" | "message" | "reasoning" => Some(Family::Responses),
        "tool_use" | "text" => Some(Family::Anthropic),
        _ => None,
    });
    match family {
        Some(Family::Responses) => parse_responses_items(items, builder),
        Some(Family::Anthropic) => parse_anthropic_blocks(items, builder),
        None => Err(unrecognized(format!(
            "the decision is an array of neither OpenAI Responses output items nor \
             Anthropic content blocks; {SHAPES_HINT}"
        ))),
    }
}

enum Family {
    Responses,
    Anthropic,
}

fn parse_object(obj: &Map<String, Value>, builder: Builder) -> Result<Decision, DecisionError> {
    if let Some(choices) = obj.get("choices").and_then(Value::as_array) {
        let message = choices
            .first()
            .and_then(|choice| choice.get("message"))
            .and_then(Value::as_object)
            .ok_or_else(|| {
                unrecognized("an OpenAI chat completion needs an object at `choices[0].message`")
            })?;
        return parse_openai_message(message, builder);
    }

    match str_field(obj, "type") {
        Some("tool_calls") => return parse_simple_calls(obj, builder),
        Some("final") => return parse_simple_final(obj),
        _ => {}
    }

    let has_tool_calls = obj.get("tool_calls").is_some_and(Value::is_array);
    let assistant_text = str_field(obj, "role") == Some("assistant")
        && matches!(
            obj.get("content"),
            None | Some(Value::Null | Value::String(_))
        );
    if has_tool_calls || assistant_text {
        return parse_openai_message(obj, builder);
    }

    if let Some(output) = obj.get("output").and_then(Value::as_array) {
        return parse_responses_items(output, builder);
    }

    if let Some(content) = obj.get("content").and_then(Value::as_array) {
        return parse_anthropic_blocks(content, builder);
    }

    Err(unrecognized(format!(
        "unrecognized decision shape; {SHAPES_HINT}"
    )))
}

fn parse_simple_calls(
    obj: &Map<String, Value>,
    mut builder: Builder,
) -> Result<Decision, DecisionError> {
    let calls = obj
        .get("calls")
        .and_then(Value::as_array)
        .ok_or_else(|| unrecognized("a `tool_calls` decision needs a `calls` array"))?;
    if calls.is_empty() {
        return Err(unrecognized(
            "a `tool_calls` decision has an empty `calls` array",
        ));
    }
    for (index, entry) in calls.iter().enumerate() {
        builder.push_entry(simple_entry(entry), None, index)?;
    }
    let acknowledgement = obj
        .get("acknowledgement")
        .and_then(Value::as_str)
        .and_then(non_blank);
    builder.finish(acknowledgement)
}

fn parse_simple_final(obj: &Map<String, Value>) -> Result<Decision, DecisionError> {
    match str_field(obj, "text").and_then(non_blank) {
        Some(text) => Ok(Decision::Final { text }),
        None => Err(unrecognized("a `final` decision needs a non-empty `text`")),
    }
}

fn parse_openai_message(
    msg: &Map<String, Value>,
    mut builder: Builder,
) -> Result<Decision, DecisionError> {
    if let Some(tool_calls) = msg.get("tool_calls").and_then(Value::as_array) {
        for (index, entry) in tool_calls.iter().enumerate() {
            builder.push_entry(openai_entry(entry), None, index)?;
        }
    }
    let text = match msg.get("content") {
        Some(Value::String(s)) => non_blank(s),
        Some(Value::Array(parts)) => {
            join_texts(parts.iter().filter_map(|part| match type_of(part) {
                Some("text" | "output_text") => part.get("text").and_then(Value::as_str),
                _ => None,
            }))
        }
        _ => None,
    };
    let text = text.or_else(|| {
        if builder.calls.is_empty() {
            msg.get("refusal")
                .and_then(Value::as_str)
                .and_then(non_blank)
        } else {
            None
        }
    });
    builder.finish(text)
}

fn parse_responses_items(items: &[Value], mut builder: Builder) -> Result<Decision, DecisionError> {
    let mut texts: Vec<&str> = Vec::new();
    for (index, obj, kind) in typed_objects(items) {
        match kind {
            Some("function_call") => {
                let entry = Entry {
                    id: non_empty_str(obj, "call_id").or_else(|| non_empty_str(obj, "id")),
                    name: str_field(obj, "name"),
                    arguments: obj.get("arguments"),
                    defect: None,
                };
                builder.push_entry(entry, None, index)?;
            }
            Some("message") => match obj.get("content") {
                Some(Value::Array(parts)) => {
                    texts.extend(parts.iter().filter_map(|part| match type_of(part) {
                        Some("output_text" | "text") => part.get("text").and_then(Value::as_str),
                        _ => None,
                    }));
                }
                Some(Value::String(s)) => texts.push(s),
                _ => {}
            },
            _ => {}
        }
    }
    builder.finish(join_texts(texts.into_iter()))
}

fn parse_anthropic_blocks(
    blocks: &[Value],
    mut builder: Builder,
) -> Result<Decision, DecisionError> {
    let mut texts: Vec<&str> = Vec::new();
    for (index, obj, kind) in typed_objects(blocks) {
        match kind {
            Some("tool_use") => {
                let entry = Entry {
                    id: str_field(obj, "id"),
                    name: str_field(obj, "name"),
                    arguments: obj.get("input"),
                    defect: None,
                };
                builder.push_entry(entry, None, index)?;
            }
            Some("text") => {
                if let Some(text) = str_field(obj, "text") {
                    texts.push(text);
                }
            }
            _ => {}
        }
    }
    builder.finish(join_texts(texts.into_iter()))
}

// ----- call entries -------------------------------------------------------------------

/// One call entry as found in the decision, before normalization.
struct Entry<'a> {
    id: Option<&'a str>,
    name: Option<&'a str>,
    arguments: Option<&'a Value>,
    /// Why the entry is not a usable call at all.
    defect: Option<&'static str>,
}

impl Entry<'_> {
    fn defective(defect: &'static str) -> Self {
        Self {
            id: None,
            name: None,
            arguments: None,
            defect: Some(defect),
        }
    }
}

/// `{id?, toolName | name, arguments}` (the simple form and `parallel`'s inner calls).
fn simple_entry(value: &Value) -> Entry<'_> {
    let Some(obj) = value.as_object() else {
        return Entry::defective("the call entry is not a JSON object");
    };
    Entry {
        id: str_field(obj, "id"),
        name: str_field(obj, "toolName").or_else(|| str_field(obj, "name")),
        arguments: obj.get("arguments").or_else(|| obj.get("input")),
        defect: None,
    }
}

/// `{id, type: "function", function: {name, arguments}}`.
fn openai_entry(value: &Value) -> Entry<'_> {
    let Some(obj) = value.as_object() else {
        return Entry::defective("the tool call is not a JSON object");
    };
    let id = str_field(obj, "id");
    match obj.get("function").and_then(Value::as_object) {
        Some(function) => Entry {
            id,
            name: str_field(function, "name"),
            arguments: function.get("arguments"),
            defect: None,
        },
        None if str_field(obj, "name").is_some() => Entry {
            id,
            name: str_field(obj, "name"),
            arguments: obj.get("arguments"),
            defect: None,
        },
        None => Entry {
            id,
            name: None,
            arguments: None,
            defect: Some("the tool call has no `function` object"),
        },
    }
}

/// Arguments that are not a JSON object: the value to keep and what is wrong.
struct BadArguments {
    value: Value,
    message: String,
}

/// Normalizes arguments to a JSON object: absent, null and empty strings become `{}`,
/// strings are parsed as JSON, objects are taken as they are.
fn normalize_arguments(arguments: Option<&Value>) -> Result<Cow<'_, Value>, BadArguments> {
    match arguments {
        None | Some(Value::Null) => Ok(Cow::Owned(Value::Object(Map::new()))),
        Some(value @ Value::Object(_)) => Ok(Cow::Borrowed(value)),
        Some(Value::String(text)) => {
            if text.trim().is_empty() {
                return Ok(Cow::Owned(Value::Object(Map::new())));
            }
            match serde_json::from_str::<Value>(text) {
                Ok(value @ Value::Object(_)) => Ok(Cow::Owned(value)),
                Ok(other) => Err(BadArguments {
                    message: format!(
                        "the arguments must be a JSON object, not {}",
                        json_kind(&other)
                    ),
                    value: other,
                }),
                Err(e) => Err(BadArguments {
                    value: Value::Null,
                    message: format!("the arguments are not valid JSON: {e}"),
                }),
            }
        }
        Some(other) => Err(BadArguments {
            value: other.clone(),
            message: format!(
                "the arguments must be a JSON object, not {}",
                json_kind(other)
            ),
        }),
    }
}

// ----- building -----------------------------------------------------------------------

struct Builder {
    max_calls: usize,
    calls: Vec<DecisionCall>,
    concurrency: Option<usize>,
    timeout_ms: Option<u64>,
}

impl Builder {
    fn new(max_calls: usize) -> Self {
        Self {
            max_calls,
            calls: Vec::new(),
            concurrency: None,
            timeout_ms: None,
        }
    }

    /// Normalizes one entry and appends it (or, for `parallel`, its calls).
    ///
    /// `index` is the entry's position in its array; it names inner `parallel` calls
    /// that have no id of their own.
    fn push_entry(
        &mut self,
        entry: Entry<'_>,
        parent: Option<&str>,
        index: usize,
    ) -> Result<(), DecisionError> {
        let id = match entry.id.filter(|id| !id.trim().is_empty()) {
            Some(id) => id.to_string(),
            None => match parent {
                Some(parent) => format!("{parent}.{index}"),
                None => generate_call_id(),
            },
        };
        let name = entry.name.unwrap_or_default();
        let call = |arguments: Value| ToolCall {
            id: id.clone(),
            name: name.to_string(),
            arguments,
            parent_id: parent.map(str::to_string),
        };

        if let Some(defect) = entry.defect {
            return self.push(call(Value::Null), Some(malformed_call(defect)));
        }
        if name.trim().is_empty() {
            return self.push(
                call(Value::Null),
                Some(malformed_call("the call has no tool name")),
            );
        }
        if name == PARALLEL_TOOL {
            if parent.is_some() {
                return self.push(
                    call(Value::Null),
                    Some(malformed_call(
                        "`parallel` cannot be called inside `parallel`",
                    )),
                );
            }
            return self.flatten_parallel(id, entry.arguments);
        }
        match normalize_arguments(entry.arguments) {
            Ok(arguments) => self.push(call(arguments.into_owned()), None),
            Err(bad) => self.push(call(bad.value), Some(malformed_arguments(bad.message))),
        }
    }

    /// Replaces a `parallel` meta-call by its inner calls.
    fn flatten_parallel(
        &mut self,
        meta_id: String,
        arguments: Option<&Value>,
    ) -> Result<(), DecisionError> {
        let meta_call = |arguments: Value| ToolCall {
            id: meta_id.clone(),
            name: PARALLEL_TOOL.to_string(),
            arguments,
            parent_id: None,
        };
        let arguments = match normalize_arguments(arguments) {
            Ok(arguments) => arguments,
            Err(bad) => {
                return self.push(meta_call(bad.value), Some(malformed_arguments(bad.message)));
            }
        };
        let inner = match arguments.get("calls").and_then(Value::as_array) {
            Some(inner) if !inner.is_empty() => inner,
            Some(_) => {
                return self.push(
                    meta_call(arguments.into_owned()),
                    Some(malformed_arguments("`parallel` has an empty `calls` array")),
                );
            }
            None => {
                return self.push(
                    meta_call(arguments.into_owned()),
                    Some(malformed_arguments("`parallel` needs a `calls` array")),
                );
            }
        };

        if let Some(n) =
            positive_u64(arguments.get("concurrency")).and_then(|n| usize::try_from(n).ok())
        {
            self.concurrency = Some(self.concurrency.map_or(n, |c| c.min(n)));
        }
        if let Some(ms) = positive_u64(arguments.get("timeout_ms")) {
            self.timeout_ms = Some(self.timeout_ms.map_or(ms, |t| t.min(ms)));
        }

        for (index, entry) in inner.iter().enumerate() {
            self.push_entry(simple_entry(entry), Some(&meta_id), index)?;
        }
        Ok(())
    }

    fn push(&mut self, call: ToolCall, problem: Option<CallError>) -> Result<(), DecisionError> {
        if self.calls.len() >= self.max_calls {
            return Err(DecisionError::new(
                DecisionErrorKind::TooManyCalls,
                format!("the decision holds more than {} tool calls", self.max_calls),
            ));
        }
        self.calls.push(DecisionCall { call, problem });
        Ok(())
    }

    fn finish(self, text: Option<String>) -> Result<Decision, DecisionError> {
        if self.calls.is_empty() {
            return match text {
                Some(text) => Ok(Decision::Final { text }),
                None => Err(unrecognized(
                    "the decision holds neither tool calls nor text",
                )),
            };
        }
        Ok(Decision::ToolCalls(ToolCallsDecision {
            calls: self.calls,
            acknowledgement: text,
            concurrency: self.concurrency,
            timeout_ms: self.timeout_ms,
        }))
    }
}

// ----- helpers ------------------------------------------------------------------------

fn malformed_call(message: &str) -> CallError {
    CallError::fatal(codes::MALFORMED_CALL, message)
}

fn malformed_arguments(message: impl Into<String>) -> CallError {
    CallError::fatal(codes::MALFORMED_ARGUMENTS, message)
}

fn unrecognized(message: impl Into<String>) -> DecisionError {
    DecisionError::new(DecisionErrorKind::UnrecognizedShape, message)
}

/// The objects among `items` (Responses items, Anthropic content blocks), each with its
/// index in `items` and its `type`; items that are not objects are passed over.
fn typed_objects(
    items: &[Value],
) -> impl Iterator<Item = (usize, &Map<String, Value>, Option<&str>)> {
    items.iter().enumerate().filter_map(|(index, item)| {
        let obj = item.as_object()?;
        Some((index, obj, str_field(obj, "type")))
    })
}

fn str_field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    obj.get(key).and_then(Value::as_str)
}

fn non_empty_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    str_field(obj, key).filter(|s| !s.trim().is_empty())
}

fn type_of(value: &Value) -> Option<&str> {
    value.get("type").and_then(Value::as_str)
}

fn positive_u64(value: Option<&Value>) -> Option<u64> {
    value.and_then(Value::as_u64).filter(|&n| n > 0)
}

fn non_blank(text: &str) -> Option<String> {
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// Joins the non-blank texts, each trimmed, with single spaces.
fn join_texts<'a>(texts: impl Iterator<Item = &'a str>) -> Option<String> {
    let parts: Vec<&str> = texts.map(str::trim).filter(|t| !t.is_empty()).collect();
    (!parts.is_empty()).then(|| parts.join(" "))
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool_calls(value: Value) -> ToolCallsDecision {
        match parse_decision(&value, 100) {
            Ok(Decision::ToolCalls(d)) => d,
            other => panic!("expected tool calls from {value}, got {other:?}"),
        }
    }

    fn error_kind(value: Value, max_calls: usize) -> DecisionErrorKind {
        match parse_decision(&value, max_calls) {
            Err(e) => e.kind(),
            Ok(d) => panic!("expected an error from {value}, got {d:?}"),
        }
    }

    fn ids(d: &ToolCallsDecision) -> Vec<&str> {
        d.calls.iter().map(|c| c.call.id.as_str()).collect()
    }

    fn names(d: &ToolCallsDecision) -> Vec<&str> {
        d.calls.iter().map(|c| c.call.name.as_str()).collect()
    }

    fn problem(c: &DecisionCall) -> Option<&str> {
        c.problem.as_ref().map(|p| p.code.as_str())
    }

    #[test]
    fn generated_ids_have_the_expected_form() {
        let id = generate_call_id();
        assert_eq!(id.len(), 29);
        assert!(id.starts_with("call_"));
        assert!(id[5..].chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(id, generate_call_id());
    }

    #[test]
    fn openai_chat_completion() {
        let d = tool_calls(json!({
            "id": "chatcmpl-1",
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "  Let me check.  ",
                    "tool_calls": [
                        {"id": "call_a", "type": "function",
                         "function": {"name": "getAppointments", "arguments": "{\"days\": 7}"}},
                        {"id": "call_b", "type": "function",
                         "function": {"name": "getBilling", "arguments": ""}},
                    ]
                },
                "finish_reason": "tool_calls"
            }]
        }));
        assert_eq!(ids(&d), ["call_a", "call_b"]);
        assert_eq!(names(&d), ["getAppointments", "getBilling"]);
        assert_eq!(d.calls[0].call.arguments, json!({"days": 7}));
        assert_eq!(d.calls[1].call.arguments, json!({}));
        assert!(d.calls.iter().all(DecisionCall::is_well_formed));
        assert_eq!(d.acknowledgement.as_deref(), Some("Let me check."));
        assert_eq!(d.calls[0].call.parent_id, None);
    }

    #[test]
    fn openai_invalid_arguments_fail_only_that_call() {
        let d = tool_calls(json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "a", "arguments": "{\"x\": "}},
                {"id": "2", "type": "function", "function": {"name": "b", "arguments": "[1, 2]"}},
                {"id": "3", "type": "function", "function": {"name": "c", "arguments": {"y": 1}}},
                {"id": "4", "type": "function", "function": {"name": "d", "arguments": "42"}},
                {"id": "5", "type": "function", "function": {"name": "e", "arguments": 42}},
            ]
        }));
        assert_eq!(ids(&d), ["1", "2", "3", "4", "5"]);
        assert_eq!(problem(&d.calls[0]), Some(codes::MALFORMED_ARGUMENTS));
        assert_eq!(d.calls[0].call.arguments, Value::Null);
        assert_eq!(problem(&d.calls[1]), Some(codes::MALFORMED_ARGUMENTS));
        assert_eq!(problem(&d.calls[2]), None);
        assert_eq!(d.calls[2].call.arguments, json!({"y": 1}));
        assert_eq!(problem(&d.calls[3]), Some(codes::MALFORMED_ARGUMENTS));
        assert_eq!(problem(&d.calls[4]), Some(codes::MALFORMED_ARGUMENTS));
        assert_eq!(d.acknowledgement, None);
    }

    #[test]
    fn openai_message_without_calls_is_final() {
        let d = parse_decision(
            &json!({"role": "assistant", "content": "It is sunny.", "tool_calls": []}),
            10,
        );
        assert_eq!(
            d,
            Ok(Decision::Final {
                text: "It is sunny.".into()
            })
        );
        let d = parse_decision(&json!({"role": "assistant", "content": "Hi."}), 10);
        assert_eq!(d, Ok(Decision::Final { text: "Hi.".into() }));
        assert_eq!(
            error_kind(json!({"role": "assistant", "content": "  "}), 10),
            DecisionErrorKind::UnrecognizedShape
        );
        assert_eq!(
            error_kind(json!({"choices": []}), 10),
            DecisionErrorKind::UnrecognizedShape
        );
    }

    #[test]
    fn openai_malformed_entries_keep_their_slot() {
        let d = tool_calls(json!({
            "tool_calls": [
                "nonsense",
                {"id": "x", "type": "function"},
                {"id": "y", "type": "function", "function": {"arguments": "{}"}},
                {"id": "", "type": "function", "function": {"name": "ok", "arguments": "{}"}},
                {"id": 7, "type": "function", "function": {"name": 5, "arguments": "{}"}},
            ]
        }));
        assert_eq!(d.calls.len(), 5);
        assert_eq!(problem(&d.calls[0]), Some(codes::MALFORMED_CALL));
        assert!(d.calls[0].call.id.starts_with("call_"));
        assert_eq!(d.calls[0].call.name, "");
        assert_eq!(d.calls[1].call.id, "x");
        assert_eq!(problem(&d.calls[1]), Some(codes::MALFORMED_CALL));
        assert_eq!(d.calls[2].call.id, "y");
        assert_eq!(problem(&d.calls[2]), Some(codes::MALFORMED_CALL));
        assert!(d.calls[3].call.id.starts_with("call_"));
        assert_eq!(problem(&d.calls[3]), None);
        assert!(d.calls[4].call.id.starts_with("call_"));
        assert_eq!(problem(&d.calls[4]), Some(codes::MALFORMED_CALL));
    }

    #[test]
    fn responses_output() {
        let items = json!([
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "One moment."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1",
             "name": "getBilling", "arguments": "{\"month\": \"2026-01\"}"},
            {"type": "function_call", "id": "fc_2", "name": "getFaqs", "arguments": "{}"},
            {"type": "function_call", "name": "getHours", "arguments": ""},
        ]);
        let d = tool_calls(items.clone());
        assert_eq!(ids(&d)[..2], ["call_1", "fc_2"]);
        assert!(d.calls[2].call.id.starts_with("call_"));
        assert_eq!(d.calls[0].call.arguments, json!({"month": "2026-01"}));
        assert_eq!(d.acknowledgement.as_deref(), Some("One moment."));

        let wrapped = tool_calls(json!({"id": "resp_1", "output": items}));
        assert_eq!(wrapped.calls.len(), 3);
        assert_eq!(wrapped.calls[0].call.id, "call_1");

        let final_text = parse_decision(
            &json!({"output": [{"type": "message",
                "content": [{"type": "output_text", "text": "Open 9 to 5."}]}]}),
            10,
        );
        assert_eq!(
            final_text,
            Ok(Decision::Final {
                text: "Open 9 to 5.".into()
            })
        );
    }

    #[test]
    fn anthropic_message_and_blocks() {
        let message = json!({
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Sure,"},
                {"type": "tool_use", "id": "toolu_1", "name": "getAppointments", "input": {"days": 7}},
                {"type": "text", "text": " checking now. "},
                {"type": "tool_use", "id": "toolu_2", "name": "getBilling", "input": {}},
                {"type": "tool_use", "id": "toolu_3", "name": "getBilling", "input": {"a": 1}},
            ]
        });
        let d = tool_calls(message.clone());
        assert_eq!(ids(&d), ["toolu_1", "toolu_2", "toolu_3"]);
        assert_eq!(d.acknowledgement.as_deref(), Some("Sure, checking now."));
        assert_eq!(d.calls[0].call.arguments, json!({"days": 7}));

        let blocks = tool_calls(message["content"].clone());
        assert_eq!(blocks, d);

        let text_only = parse_decision(
            &json!({"role": "assistant", "content": [{"type": "text", "text": "Hello"},
                {"type": "text", "text": "there."}]}),
            10,
        );
        assert_eq!(
            text_only,
            Ok(Decision::Final {
                text: "Hello there.".into()
            })
        );
    }

    #[test]
    fn simple_form() {
        let d = tool_calls(json!({
            "type": "tool_calls",
            "acknowledgement": "Checking.",
            "calls": [
                {"toolName": "crm.getOpenInvoices", "arguments": {"customer": "c1"}},
                {"id": "mine", "name": "getFaqs", "arguments": "{\"q\": \"hours\"}"},
            ]
        }));
        assert_eq!(names(&d), ["crm.getOpenInvoices", "getFaqs"]);
        assert!(d.calls[0].call.id.starts_with("call_"));
        assert_eq!(d.calls[1].call.id, "mine");
        assert_eq!(d.calls[1].call.arguments, json!({"q": "hours"}));
        assert_eq!(d.acknowledgement.as_deref(), Some("Checking."));

        assert_eq!(
            parse_decision(&json!({"type": "final", "text": "Done."}), 10),
            Ok(Decision::Final {
                text: "Done.".into()
            })
        );
        assert_eq!(
            error_kind(json!({"type": "final"}), 10),
            DecisionErrorKind::UnrecognizedShape
        );
        assert_eq!(
            error_kind(json!({"type": "tool_calls", "calls": []}), 10),
            DecisionErrorKind::UnrecognizedShape
        );
        assert_eq!(
            error_kind(json!({"type": "tool_calls"}), 10),
            DecisionErrorKind::UnrecognizedShape
        );
    }

    #[test]
    fn parallel_is_flattened_in_place() {
        let d = tool_calls(json!({
            "type": "tool_calls",
            "calls": [
                {"id": "first", "name": "a", "arguments": {}},
                {"id": "p1", "name": "parallel", "arguments": {
                    "concurrency": 4,
                    "timeout_ms": 1500,
                    "calls": [
                        {"name": "b", "arguments": {"x": 1}},
                        {"id": "own", "toolName": "c", "arguments": "{\"y\": 2}"},
                        {"name": "parallel", "arguments": {"calls": []}},
                        {"name": "d", "arguments": "{bad"},
                        17,
                    ]
                }},
                {"id": "last", "name": "e", "arguments": {}},
            ]
        }));
        assert_eq!(
            ids(&d),
            ["first", "p1.0", "own", "p1.2", "p1.3", "p1.4", "last"]
        );
        assert_eq!(names(&d), ["a", "b", "c", "parallel", "d", "", "e"]);
        for c in &d.calls[1..6] {
            assert_eq!(c.call.parent_id.as_deref(), Some("p1"));
        }
        assert_eq!(d.calls[0].call.parent_id, None);
        assert_eq!(d.calls[6].call.parent_id, None);
        assert_eq!(d.calls[1].call.arguments, json!({"x": 1}));
        assert_eq!(d.calls[2].call.arguments, json!({"y": 2}));
        assert_eq!(problem(&d.calls[3]), Some(codes::MALFORMED_CALL));
        assert_eq!(problem(&d.calls[4]), Some(codes::MALFORMED_ARGUMENTS));
        assert_eq!(problem(&d.calls[5]), Some(codes::MALFORMED_CALL));
        assert_eq!(d.concurrency, Some(4));
        assert_eq!(d.timeout_ms, Some(1500));
    }

    #[test]
    fn parallel_from_openai_with_string_arguments() {
        let args = json!({"calls": [
            {"name": "a", "arguments": {}},
            {"name": "b", "arguments": "{}"},
        ]})
        .to_string();
        let d = tool_calls(json!({
            "role": "assistant",
            "tool_calls": [{"id": "call_p", "type": "function",
                "function": {"name": "parallel", "arguments": args}}]
        }));
        assert_eq!(ids(&d), ["call_p.0", "call_p.1"]);
        assert_eq!(d.concurrency, None);
        assert_eq!(d.timeout_ms, None);
    }

    #[test]
    fn parallel_without_calls_is_one_malformed_call() {
        for args in [
            json!({"concurrency": 2}),
            json!({"calls": "nope"}),
            json!({"calls": []}),
            json!("{not json"),
            json!(3),
        ] {
            let d = tool_calls(json!({
                "type": "tool_calls",
                "calls": [{"id": "p", "name": "parallel", "arguments": args}]
            }));
            assert_eq!(d.calls.len(), 1, "{args}");
            assert_eq!(d.calls[0].call.id, "p");
            assert_eq!(d.calls[0].call.name, "parallel");
            assert_eq!(problem(&d.calls[0]), Some(codes::MALFORMED_ARGUMENTS));
            assert_eq!(d.concurrency, None);
        }
    }

    #[test]
    fn several_parallel_calls_keep_the_tightest_limits() {
        let d = tool_calls(json!({
            "type": "tool_calls",
            "calls": [
                {"id": "p", "name": "parallel",
                 "arguments": {"concurrency": 8, "timeout_ms": 100, "calls": [{"name": "a"}]}},
                {"id": "q", "name": "parallel",
                 "arguments": {"concurrency": 2, "timeout_ms": 0, "calls": [{"name": "b"}]}},
            ]
        }));
        assert_eq!(ids(&d), ["p.0", "q.0"]);
        assert_eq!(d.concurrency, Some(2));
        assert_eq!(d.timeout_ms, Some(100));
        assert_eq!(d.calls[0].call.arguments, json!({}));
    }

    #[test]
    fn duplicate_ids_are_kept() {
        let d = tool_calls(json!({"type": "tool_calls", "calls": [
            {"id": "same", "name": "a"}, {"id": "same", "name": "b"},
        ]}));
        assert_eq!(ids(&d), ["same", "same"]);
    }

    #[test]
    fn too_many_calls_counts_after_flattening() {
        let calls: Vec<Value> = (0..10_000)
            .map(|i| json!({"name": "t", "arguments": {"i": i}}))
            .collect();
        assert_eq!(
            error_kind(json!({"type": "tool_calls", "calls": calls}), 64),
            DecisionErrorKind::TooManyCalls
        );
        let nested = json!({"type": "tool_calls", "calls": [
            {"name": "a"},
            {"name": "parallel", "arguments": {"calls": [{"name": "b"}, {"name": "c"}]}},
        ]});
        assert_eq!(
            error_kind(nested.clone(), 2),
            DecisionErrorKind::TooManyCalls
        );
        assert_eq!(tool_calls(nested).calls.len(), 3);
        assert_eq!(
            error_kind(json!({"type": "tool_calls", "calls": [{"name": "a"}]}), 0),
            DecisionErrorKind::TooManyCalls
        );
    }

    #[test]
    fn text_decisions_and_errors() {
        assert_eq!(
            parse_decision_str("{\"type\":\"final\",\"text\":\"ok\"}", 5),
            Ok(Decision::Final { text: "ok".into() })
        );
        assert_eq!(
            parse_decision_str("{\"type\":", 5).map_err(|e| e.kind()),
            Err(DecisionErrorKind::NotJson)
        );
        let encoded = Value::String(json!({"type": "final", "text": "ok"}).to_string());
        assert_eq!(
            parse_decision(&encoded, 5),
            Ok(Decision::Final { text: "ok".into() })
        );
        let e = parse_decision(&json!({"foo": 1}), 5).err();
        assert!(e.is_some_and(|e| e.to_string().contains("unrecognized decision shape")));
    }

    #[test]
    fn odd_inputs_never_panic() {
        let huge = "x".repeat(1 << 20);
        let mut deep = json!("bottom");
        for _ in 0..200 {
            deep = json!({"calls": [deep], "content": [{"type": "text"}]});
        }
        let inputs = [
            Value::Null,
            json!(0),
            json!(-1.5),
            json!(true),
            json!(""),
            json!("null"),
            json!("\"nested\""),
            Value::String(huge.clone()),
            json!([]),
            json!([null, 1, "x", [], {}]),
            json!([{"type": "tool_use"}, {"type": "text", "text": 5}]),
            json!([{"type": "function_call", "arguments": huge}]),
            json!({}),
            json!({"choices": "x"}),
            json!({"choices": [null]}),
            json!({"choices": [{"message": []}]}),
            json!({"type": 5}),
            json!({"type": "tool_calls", "calls": [null, [], {"name": null}, {"name": {}}]}),
            json!({"type": "tool_calls", "calls": [{"name": "parallel", "arguments": {"calls": [[[]]]}}]}),
            json!({"tool_calls": [{"function": {"name": huge.clone(), "arguments": huge.clone()}}]}),
            json!({"tool_calls": [{"function": {"name": "a", "arguments": "\u{0}\u{ffff}"}}]}),
            json!({"role": "assistant", "content": 17}),
            json!({"output": [null, {"type": "message", "content": [null, 3]}]}),
            json!({"content": [{"type": "tool_use", "input": "[[[[["}]}),
            json!({"content": [{"type": "tool_use", "name": "parallel", "input": {"calls": [{"name": "parallel"}]}}]}),
            json!({"tool_calls": [{"function": {"name": "a", "arguments": "[".repeat(10_000)}}]}),
            deep,
        ];
        for input in inputs {
            for max in [0, 1, 1000] {
                let _ = parse_decision(&input, max);
            }
            let _ = parse_decision_str(&input.to_string(), 1000);
        }
        for text in [
            "",
            "   ",
            "nul",
            "[",
            "{\"a\":",
            "\u{feff}{}",
            &"[".repeat(100_000),
        ] {
            let _ = parse_decision_str(text, 10);
        }
    }

    #[test]
    fn odd_inputs_map_to_the_right_errors() {
        for input in [
            Value::Null,
            json!(1),
            json!(true),
            json!("hello"),
            json!([]),
            json!({}),
        ] {
            assert_eq!(error_kind(input, 10), DecisionErrorKind::UnrecognizedShape);
        }
        let d = tool_calls(
            json!({"tool_calls": [{"function": {"name": "a", "arguments": "[".repeat(10_000)}}]}),
        );
        assert_eq!(problem(&d.calls[0]), Some(codes::MALFORMED_ARGUMENTS));
    }
}
