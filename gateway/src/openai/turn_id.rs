//! The fleet turn id of one round of the chat-completions loop.
//!
//! A round's id is a digest of everything that makes the round what it is: the tenant,
//! the API key, the conversation before the model's message and the message's calls
//! (ids, names and arguments). The same request sent again (a client's retry, a
//! conversation continued after a message that also called the caller's own tools)
//! gives the same id, so it attaches to the turn that already ran instead of running its
//! calls twice; any other conversation, even one whose model numbers its calls `call_0,
//! call_1` or sends no ids, gives another id and never sees that turn's results.
//!
//! The digest reads the conversation the way clients send it back, not byte for byte:
//! arguments as JSON values (whitespace and key order do not count, empty arguments are
//! `{}`), `null` and empty content alike, text parts as their text. A `role: "tool"`
//! message answering a fleet call counts by its call id only: the gateway puts the
//! fleet's own result there, whatever the caller sent. Never talks to anyone.

use std::collections::{HashMap, HashSet};

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The fleet turn of the assistant message whose calls are `calls`, said after
/// `before`, for `tenant` and the key `key_id`; `fleet` names the fleet tools offered.
pub fn turn_id_of(
    tenant: &str,
    key_id: &str,
    before: &[Value],
    calls: &[Value],
    fleet: &HashSet<String>,
) -> String {
    let mut digest = Sha256::new();
    let mut field = |bytes: &[u8]| {
        digest.update((bytes.len() as u64).to_be_bytes());
        digest.update(bytes);
    };
    field(b"toolfleet-chat-round-v2");
    field(tenant.as_bytes());
    field(key_id.as_bytes());
    // Which call each tool message answers: the calls of the last assistant message.
    let mut answered: HashMap<String, String> = HashMap::new();
    for message in before {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        field(b"message");
        field(role.as_bytes());
        match role {
            "tool" => {
                let id = message
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                field(id.as_bytes());
                let fleets = answered.get(id).is_some_and(|name| fleet.contains(name));
                if !fleets {
                    field(text_of(message.get("content")).as_bytes());
                }
            }
            _ => {
                field(text_of(message.get("content")).as_bytes());
                let message_calls = message
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                if role == "assistant" {
                    answered.clear();
                    for call in message_calls {
                        answered.insert(call_id(call).to_string(), name_of(call).to_string());
                    }
                }
                for call in message_calls {
                    add_call(&mut field, call);
                }
            }
        }
    }
    field(b"calls");
    for call in calls {
        add_call(&mut field, call);
    }
    let hex: String = digest
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("oai-{}", &hex[..40])
}

/// Adds `call`'s id, name and canonical arguments.
fn add_call(field: &mut impl FnMut(&[u8]), call: &Value) {
    field(b"call");
    field(call_id(call).as_bytes());
    field(name_of(call).as_bytes());
    field(arguments_of(call).as_bytes());
}

fn call_id(call: &Value) -> &str {
    call.get("id").and_then(Value::as_str).unwrap_or("")
}

fn name_of(call: &Value) -> &str {
    call.pointer("/function/name")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// A call's arguments as canonical JSON (the text itself when it is not JSON).
fn arguments_of(call: &Value) -> String {
    let text = call
        .pointer("/function/arguments")
        .and_then(Value::as_str)
        .unwrap_or("");
    if text.trim().is_empty() {
        return "{}".into();
    }
    match serde_json::from_str::<Value>(text) {
        Ok(value) => canonical(&value),
        Err(_) => text.to_string(),
    }
}

/// A message's content as text: a string as it is, text parts joined, other parts as
/// canonical JSON; nothing for `null`.
fn text_of(content: Option<&Value>) -> String {
    match content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|part| match part.get("text").and_then(Value::as_str) {
                Some(text) if part.get("type").and_then(Value::as_str) == Some("text") => {
                    text.to_string()
                }
                _ => canonical(part),
            })
            .collect(),
        Some(other) => canonical(other),
    }
}

/// `value` as JSON with every object's keys sorted and no whitespace.
fn canonical(value: &Value) -> String {
    match value {
        Value::Object(fields) => {
            let mut keys: Vec<&String> = fields.keys().collect();
            keys.sort();
            let inner: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canonical(&fields[k])))
                .collect();
            format!("{{{}}}", inner.join(","))
        }
        Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(canonical).collect();
            format!("[{}]", inner.join(","))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn call(id: &str, name: &str, arguments: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
    }

    fn user(text: &str) -> Vec<Value> {
        vec![json!({"role": "user", "content": text})]
    }

    fn fleet() -> HashSet<String> {
        HashSet::from(["crm__listUpcomingAppointments".to_string()])
    }

    #[test]
    fn the_same_round_sent_again_has_the_same_valid_id() {
        let calls = vec![call("call_0", "crm__listUpcomingAppointments", "{}")];
        let id = turn_id_of("acme", "k1", &user("hi"), &calls, &fleet());
        assert_eq!(id, turn_id_of("acme", "k1", &user("hi"), &calls, &fleet()));
        assert!(toolfleet_common::turn::valid_turn_id(&id));
    }

    #[test]
    fn another_conversation_with_the_same_call_ids_has_another_id() {
        let one = vec![call(
            "call_0",
            "crm__listUpcomingAppointments",
            r#"{"customerId":"cust_001"}"#,
        )];
        let two = vec![call(
            "call_0",
            "crm__listUpcomingAppointments",
            r#"{"customerId":"cust_002"}"#,
        )];
        let f = fleet();
        let base = turn_id_of("acme", "k1", &user("cust_001"), &one, &f);
        // Other arguments, another conversation, another tenant or key, no ids at all.
        assert_ne!(base, turn_id_of("acme", "k1", &user("cust_001"), &two, &f));
        assert_ne!(base, turn_id_of("acme", "k1", &user("cust_002"), &one, &f));
        assert_ne!(
            base,
            turn_id_of("globex", "k1", &user("cust_001"), &one, &f)
        );
        assert_ne!(base, turn_id_of("acme", "k2", &user("cust_001"), &one, &f));
        let bare = |args: &str| vec![json!({"function": {"name": "crm__x", "arguments": args}})];
        assert_ne!(
            turn_id_of("acme", "k1", &user("a"), &bare("{\"a\":1}"), &f),
            turn_id_of("acme", "k1", &user("a"), &bare("{\"a\":2}"), &f)
        );
    }

    #[test]
    fn a_conversation_sent_back_by_a_typed_client_keeps_its_ids() {
        let f = fleet();
        let model = vec![
            call(
                "c1",
                "crm__listUpcomingAppointments",
                "{ \"b\": 1, \"a\": 2 }",
            ),
            call("c2", "get_weather", ""),
        ];
        let prefix = vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": model.clone()}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "the fleet's result"}),
            json!({"role": "tool", "tool_call_id": "c2", "content": "sunny"}),
        ];
        let next = vec![call("c3", "crm__listUpcomingAppointments", "{}")];
        // As a typed client re-encodes it: arguments re-serialized, empty content, a
        // string for one text part, its own text where the fleet's result goes.
        let resent_calls = vec![
            call("c1", "crm__listUpcomingAppointments", r#"{"a":2,"b":1}"#),
            call("c2", "get_weather", "{}"),
        ];
        let resent = vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "", "tool_calls": resent_calls}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "unavailable tool"}),
            json!({"role": "tool", "tool_call_id": "c2", "content": "sunny"}),
        ];
        assert_eq!(
            turn_id_of("acme", "k", &prefix, &next, &f),
            turn_id_of("acme", "k", &resent, &next, &f)
        );
        // The caller's own result counts.
        let mut rainy = resent.clone();
        rainy[4] = json!({"role": "tool", "tool_call_id": "c2", "content": "rainy"});
        assert_ne!(
            turn_id_of("acme", "k", &prefix, &next, &f),
            turn_id_of("acme", "k", &rainy, &next, &f)
        );
    }
}
