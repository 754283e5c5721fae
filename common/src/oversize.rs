//! Turn requests over the NATS server's `max_payload` because of one call's arguments:
//! the client replaces the largest arguments, one at a time, by a marker naming their
//! size, so the request fits and only those calls fail (`arguments_too_large`), while
//! every other call of the turn runs.
//!
//! Owns the marker (PROTOCOL §3.1) and finding the arguments in any decision shape: the
//! values of `arguments` (OpenAI chat and Responses, the simple form; a JSON string or an
//! object), `input` (Anthropic `tool_use`) and `parameters` (a `parallel` meta-call's
//! entries). Never decides a call's result: the coordinator does, on seeing the marker.

use serde_json::{json, Value};

/// The only key of the arguments object that replaced arguments too large to send; its
/// value is their size in bytes.
pub const OVERSIZE_ARGUMENTS_KEY: &str = "$toolfleet_arguments_too_large";

/// Keys whose values are a call's arguments in some decision shape.
const ARGUMENT_KEYS: [&str; 3] = ["arguments", "input", "parameters"];

/// The size named by a marker, when `arguments` is one.
pub fn oversize_marker(arguments: &Value) -> Option<u64> {
    let object = arguments.as_object()?;
    match (object.len(), object.get(OVERSIZE_ARGUMENTS_KEY)) {
        (1, Some(size)) => size.as_u64(),
        _ => None,
    }
}

/// Replaces, largest first, the arguments found in `decision` by markers until
/// `encoded_len(decision)` is at most `max`; how many were replaced, or `None` when the
/// decision does not fit even then (it is left with the markers in place).
pub fn fit_decision(
    decision: &mut Value,
    max: usize,
    mut encoded_len: impl FnMut(&Value) -> usize,
) -> Option<usize> {
    let mut found = Vec::new();
    collect(decision, &mut String::new(), &mut found);
    found.sort_by_key(|entry| std::cmp::Reverse(entry.1));
    let mut replaced = 0;
    for (pointer, size) in found {
        if encoded_len(decision) <= max {
            return Some(replaced);
        }
        let Some(slot) = decision.pointer_mut(&pointer) else {
            continue;
        };
        let marker = json!({ OVERSIZE_ARGUMENTS_KEY: size });
        *slot = match slot {
            // OpenAI carries arguments as JSON text.
            Value::String(_) => Value::String(marker.to_string()),
            _ => marker,
        };
        replaced += 1;
    }
    (encoded_len(decision) <= max).then_some(replaced)
}

/// Every argument value under `value` with its JSON pointer and its encoded size (a
/// string's own length for JSON text), outermost first; nothing inside a found value.
fn collect(value: &Value, pointer: &mut String, found: &mut Vec<(String, usize)>) {
    let children: Vec<(String, &Value)> = match value {
        Value::Object(object) => object.iter().map(|(k, v)| (k.clone(), v)).collect(),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect(),
        _ => return,
    };
    let arguments_here = value.is_object();
    for (key, child) in children {
        let len = pointer.len();
        pointer.push('/');
        pointer.push_str(&key.replace('~', "~0").replace('/', "~1"));
        if arguments_here && ARGUMENT_KEYS.contains(&key.as_str()) && is_arguments(child) {
            found.push((pointer.clone(), size_of(child)));
        } else {
            collect(child, pointer, found);
        }
        pointer.truncate(len);
    }
}

fn is_arguments(value: &Value) -> bool {
    matches!(value, Value::Object(_) | Value::String(_))
}

fn size_of(value: &Value) -> usize {
    match value {
        Value::String(text) => text.len(),
        other => serde_json::to_vec(other).map_or(0, |v| v.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn len(value: &Value) -> usize {
        serde_json::to_vec(value).map_or(0, |v| v.len())
    }

    #[test]
    fn the_largest_arguments_go_first_and_only_as_many_as_needed() {
        let big = "x".repeat(10_000);
        let mut decision = json!({
            "type": "tool_calls",
            "calls": [
                {"id": "a", "name": "t", "arguments": {"q": "small"}},
                {"id": "b", "name": "t", "arguments": {"blob": big}},
                {"id": "c", "name": "t", "arguments": {"q": "also small"}},
            ]
        });
        assert_eq!(fit_decision(&mut decision, 1000, len), Some(1));
        let calls = decision["calls"].as_array().expect("calls");
        assert_eq!(calls[0]["arguments"], json!({"q": "small"}));
        assert_eq!(oversize_marker(&calls[1]["arguments"]), Some(10_011));
        assert_eq!(calls[2]["arguments"], json!({"q": "also small"}));
    }

    #[test]
    fn openai_text_arguments_become_marker_text_and_anthropic_input_a_marker() {
        let big = "y".repeat(5_000);
        let mut openai = json!({"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "t", "arguments": format!("{{\"b\":\"{big}\"}}")}}
        ]});
        assert_eq!(fit_decision(&mut openai, 500, len), Some(1));
        let text = openai["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .expect("text");
        let parsed: Value = serde_json::from_str(text).expect("json");
        assert_eq!(oversize_marker(&parsed), Some(5_008));

        let mut anthropic = json!({"content": [
            {"type": "tool_use", "id": "2", "name": "t", "input": {"b": big}}
        ]});
        assert_eq!(fit_decision(&mut anthropic, 500, len), Some(1));
        assert!(oversize_marker(&anthropic["content"][0]["input"]).is_some());
    }

    #[test]
    fn a_decision_that_cannot_fit_says_so() {
        let mut decision = json!({"type": "final", "text": "z".repeat(2_000)});
        assert_eq!(fit_decision(&mut decision, 100, len), None);
        assert_eq!(oversize_marker(&json!({"q": 1})), None);
        assert_eq!(
            oversize_marker(&json!({ OVERSIZE_ARGUMENTS_KEY: 7 })),
            Some(7)
        );
    }
}
