//! JSON Schemas of the wire messages, generated from the Rust types that (de)serialize
//! them, and published under `docs/schemas/` so workers and frontends in other languages
//! can validate what they send. The unit test here fails when a published file is out of
//! date; `TOOLFLEET_WRITE_SCHEMAS=1 cargo test -p toolfleet-common schemas` rewrites
//! them. Generating only: nothing here validates messages.

use serde_json::Value;

use crate::job::ProgressNotice;
use crate::tool::{CatalogRequest, CatalogResponse, Rejection};
use crate::turn::{AttachRequest, CancelReply, CancelRequest};
use crate::{CallResult, JobEnvelope, ToolDefinition, TurnEvent, TurnRequest};

/// A `TurnEvent` as a frontend receives it: with its `seq` when its turn is stored.
#[derive(schemars::JsonSchema)]
#[allow(dead_code)]
struct SentTurnEvent {
    /// The event's position among the turn's stored events (1, 2, 3 …; `final` last).
    /// Absent on the `error` of a request whose turn was never stored and on the
    /// `error` answering an attach.
    seq: Option<u64>,
    #[serde(flatten)]
    event: TurnEvent,
}

/// Every wire message as (file stem under `docs/schemas/`, its JSON Schema).
pub fn wire_schemas() -> Vec<(&'static str, Value)> {
    fn of<T: schemars::JsonSchema>() -> Value {
        serde_json::to_value(schemars::schema_for!(T)).unwrap_or(Value::Null)
    }
    vec![
        ("tool_definition", of::<ToolDefinition>()),
        ("job_envelope", of::<JobEnvelope>()),
        ("progress_notice", of::<ProgressNotice>()),
        ("call_result", of::<CallResult>()),
        ("turn_request", of::<TurnRequest>()),
        ("turn_event", of::<SentTurnEvent>()),
        ("attach_request", of::<AttachRequest>()),
        ("cancel_request", of::<CancelRequest>()),
        ("cancel_reply", of::<CancelReply>()),
        ("catalog_request", of::<CatalogRequest>()),
        ("catalog_response", of::<CatalogResponse>()),
        ("rejection", of::<Rejection>()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_schemas_are_current() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/schemas");
        let write = std::env::var("TOOLFLEET_WRITE_SCHEMAS").is_ok_and(|v| v == "1");
        let mut stale = Vec::new();
        for (name, schema) in wire_schemas() {
            let path = dir.join(format!("{name}.schema.json"));
            let text = serde_json::to_string_pretty(&schema).expect("a schema serializes") + "\n";
            if write {
                std::fs::create_dir_all(&dir).expect("docs/schemas");
                std::fs::write(&path, &text).expect("writing a schema");
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                stale.push(name);
            }
        }
        assert!(
            stale.is_empty(),
            "docs/schemas is out of date for {stale:?}: run TOOLFLEET_WRITE_SCHEMAS=1 cargo test -p toolfleet-common schemas"
        );
    }

    #[test]
    fn integer_fields_are_integers_in_the_schemas() {
        let schemas: std::collections::HashMap<_, _> = wire_schemas().into_iter().collect();
        assert_eq!(
            schemas["tool_definition"]["properties"]["timeout_ms"]["type"],
            "integer"
        );
        assert_eq!(
            schemas["call_result"]["properties"]["duration_ms"]["type"],
            "integer"
        );
    }
}
