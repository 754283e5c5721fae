//! Chat Completions chunks and whole responses, one into the other: the upstream's
//! streamed chunks assembled into the response the same request would have had without
//! `stream` (the loop decides on that), and a response the gateway writes itself turned
//! into chunks (so a streamed conversation ends the same way as an unstreamed one).
//!
//! Owns the folding rules: content fragments joined; tool-call deltas gathered by
//! `index` (the first fragment brings `id` and `function.name`, later ones append to
//! `function.arguments`); the last non-null `finish_reason`; `usage` from whichever chunk
//! carries it. Never talks to anyone.

use serde_json::{json, Map, Value};

/// The `chat.completion` response `chunks` (`chat.completion.chunk` objects) add up to.
pub fn assemble(chunks: &[Value]) -> Value {
    let first = chunks.first().cloned().unwrap_or(Value::Null);
    let mut content: Option<String> = None;
    let mut refusal: Option<String> = None;
    let mut calls: Vec<(u64, Map<String, Value>)> = Vec::new();
    let mut finish_reason = Value::Null;
    let mut usage = Value::Null;
    for chunk in chunks {
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage = u.clone();
        }
        let Some(choice) = chunk.pointer("/choices/0") else {
            continue;
        };
        if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
            finish_reason = reason.clone();
        }
        let Some(delta) = choice.get("delta") else {
            continue;
        };
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            content.get_or_insert_with(String::new).push_str(text);
        }
        if let Some(text) = delta.get("refusal").and_then(Value::as_str) {
            refusal.get_or_insert_with(String::new).push_str(text);
        }
        for fragment in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = fragment.get("index").and_then(Value::as_u64).unwrap_or(0);
            let slot = match calls.iter().position(|(i, _)| *i == index) {
                Some(at) => &mut calls[at].1,
                None => {
                    let mut call = Map::new();
                    call.insert("id".into(), Value::Null);
                    call.insert("type".into(), json!("function"));
                    call.insert("function".into(), json!({"name": "", "arguments": ""}));
                    calls.push((index, call));
                    &mut calls.last_mut().expect("just pushed").1
                }
            };
            merge_call(slot, fragment);
        }
    }
    calls.sort_by_key(|(index, _)| *index);
    let mut message = Map::new();
    message.insert("role".into(), json!("assistant"));
    message.insert("content".into(), content.map_or(Value::Null, Value::String));
    if let Some(refusal) = refusal {
        message.insert("refusal".into(), Value::String(refusal));
    }
    if !calls.is_empty() {
        let calls = calls.into_iter().map(|(_, c)| Value::Object(c)).collect();
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    let mut response = Map::new();
    for key in [
        "id",
        "created",
        "model",
        "system_fingerprint",
        "service_tier",
    ] {
        if let Some(value) = first.get(key).filter(|v| !v.is_null()) {
            response.insert(key.into(), value.clone());
        }
    }
    response.insert("object".into(), json!("chat.completion"));
    response.insert(
        "choices".into(),
        json!([{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": null}]),
    );
    if !usage.is_null() {
        response.insert("usage".into(), usage);
    }
    Value::Object(response)
}

/// Adds one tool-call delta to the call being gathered.
fn merge_call(call: &mut Map<String, Value>, fragment: &Value) {
    if let Some(id) = fragment.get("id").filter(|v| !v.is_null()) {
        call.insert("id".into(), id.clone());
    }
    let Some(function) = fragment.get("function") else {
        return;
    };
    let Some(Value::Object(target)) = call.get_mut("function") else {
        return;
    };
    if let Some(name) = function.get("name").and_then(Value::as_str) {
        let joined = format!(
            "{}{name}",
            target.get("name").and_then(Value::as_str).unwrap_or("")
        );
        target.insert("name".into(), Value::String(joined));
    }
    if let Some(arguments) = function.get("arguments").and_then(Value::as_str) {
        let joined = format!(
            "{}{arguments}",
            target
                .get("arguments")
                .and_then(Value::as_str)
                .unwrap_or("")
        );
        target.insert("arguments".into(), Value::String(joined));
    }
}

/// `response` (a `chat.completion` the gateway wrote) as chunks: the message in one
/// delta, then the finish reason (with `usage` and any extension fields of `response`).
pub fn chunks_of(response: &Value) -> Vec<Value> {
    let mut head = Map::new();
    for key in ["id", "created", "model", "system_fingerprint"] {
        if let Some(value) = response.get(key) {
            head.insert(key.into(), value.clone());
        }
    }
    head.insert("object".into(), json!("chat.completion.chunk"));
    let message = response
        .pointer("/choices/0/message")
        .cloned()
        .unwrap_or(Value::Null);
    let mut delta = Map::new();
    delta.insert("role".into(), json!("assistant"));
    delta.insert(
        "content".into(),
        message.get("content").cloned().unwrap_or(Value::Null),
    );
    if let Some(Value::Array(calls)) = message.get("tool_calls") {
        let indexed = calls
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let mut call = call.clone();
                if let Value::Object(fields) = &mut call {
                    fields.insert("index".into(), json!(i));
                }
                call
            })
            .collect();
        delta.insert("tool_calls".into(), Value::Array(indexed));
    }
    let mut first = head.clone();
    first.insert(
        "choices".into(),
        json!([{"index": 0, "delta": delta, "finish_reason": null}]),
    );
    let mut last = head;
    let reason = response
        .pointer("/choices/0/finish_reason")
        .cloned()
        .unwrap_or(Value::Null);
    last.insert(
        "choices".into(),
        json!([{"index": 0, "delta": {}, "finish_reason": reason}]),
    );
    if let Some(usage) = response.get("usage") {
        last.insert("usage".into(), usage.clone());
    }
    if let Some(extension) = response.get(super::EXTENSION) {
        last.insert(super::EXTENSION.into(), extension.clone());
    }
    vec![Value::Object(first), Value::Object(last)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_fragments_split_across_chunks_become_whole_calls() {
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        };
        let chunks = vec![
            chunk(json!({"role": "assistant", "content": null}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "a", "type": "function", "function": {"name": "crm__x", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 1, "id": "b", "type": "function", "function": {"name": "crm__y", "arguments": "{\"q\""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 1, "function": {"arguments": ": 1}"}}]}),
                Value::Null,
            ),
            chunk(json!({}), json!("tool_calls")),
        ];
        let response = assemble(&chunks);
        let message = &response["choices"][0]["message"];
        assert_eq!(message["content"], Value::Null);
        assert_eq!(message["tool_calls"][0]["id"], "a");
        assert_eq!(message["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(message["tool_calls"][1]["function"]["name"], "crm__y");
        assert_eq!(
            message["tool_calls"][1]["function"]["arguments"],
            "{\"q\": 1}"
        );
        assert_eq!(response["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn a_written_response_survives_the_round_trip_through_chunks() {
        let response = json!({"id": "r", "created": 2, "model": "m", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Done."},
                         "finish_reason": "stop", "logprobs": null}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}});
        assert_eq!(assemble(&chunks_of(&response)), response);
    }
}
