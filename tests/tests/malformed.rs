//! Malformed input never panics or hangs the coordinator: unusable requests get one
//! `error` event with a stable code, unusable calls get their own result, and the
//! coordinator keeps answering.

use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_common::call::codes;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::{CallError, TurnEvent};
use toolfleet_tests::fleet::{
    assert_one_error, call, call_ids, code_at, next_raw_event, read_to_end, result_of, tool_calls,
    turn, Fleet,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// The error of a turn that must end with a single `error` event.
async fn turn_error(fleet: &Fleet, decision: Value) -> anyhow::Result<CallError> {
    let mut stream = fleet.client.submit(turn("acme", decision)).await?;
    let turn_id = stream.turn_id().to_string();
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    match events.as_slice() {
        [TurnEvent::Error {
            turn_id: Some(id),
            error,
        }] if *id == turn_id => Ok(error.clone()),
        other => anyhow::bail!("expected one error event, got {other:?}"),
    }
}

/// The error of a raw request that must be answered with a single `error` event.
async fn raw_error(fleet: &Fleet, payload: &[u8]) -> anyhow::Result<CallError> {
    let mut events = fleet.submit_raw(payload.to_vec()).await?;
    match next_raw_event(&mut events, EVENT_WAIT).await? {
        TurnEvent::Error { error, .. } => Ok(error),
        other => anyhow::bail!("expected an error event, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_is_refused_and_the_coordinator_lives_on() -> anyhow::Result<()> {
    let (fleet, coordinator, _w) = Fleet::start_with_default_nodes().await?;

    // Requests that are not a turn request at all.
    for payload in [
        &b"this is not json"[..],
        &b"\xff\xfe\x00garbage{"[..],
        &b""[..],
        &b"{\"tenant_id\": \"acme\"}"[..],
        &b"{\"tenant_id\": 7, \"decision\": {}}"[..],
        &b"{\"turn_id\": \"not a valid id!\", \"tenant_id\": \"acme\", \"decision\": {}}"[..],
    ] {
        let error = raw_error(&fleet, payload).await?;
        assert_eq!(
            error.code,
            turn_codes::INVALID_REQUEST,
            "{}",
            String::from_utf8_lossy(payload)
        );
    }

    // Decisions of no supported shape.
    for decision in [
        json!(42),
        json!({"foo": 1}),
        json!(null),
        json!([]),
        json!("not a decision"),
        json!({"type": "tool_calls", "calls": []}),
    ] {
        let error = turn_error(&fleet, decision.clone()).await?;
        assert_eq!(error.code, turn_codes::INVALID_DECISION, "{decision}");
    }

    // More calls than the coordinator looks at.
    let many: Vec<Value> = (0..10_000)
        .map(|i| call(&format!("c{i}"), "test.noop", json!({})))
        .collect();
    let error = turn_error(&fleet, tool_calls(many)).await?;
    assert_eq!(error.code, turn_codes::DECISION_TOO_LARGE);

    // Truncated arguments spoil only their own call.
    let decision = json!({
        "role": "assistant",
        "content": null,
        "tool_calls": [
            {"id": "cut", "type": "function",
             "function": {"name": "test__behave", "arguments": "{\"sleep_ms\": 1, \"val"}},
            {"id": "whole", "type": "function",
             "function": {"name": "test__behave", "arguments": "{\"value\": \"fine\"}"}},
            {"id": "no_function", "type": "function"},
            {"id": "array_args", "type": "function",
             "function": {"name": "test.noop", "arguments": "[1, 2]"}},
        ]
    });
    let outcome = fleet.run(turn("acme", decision), EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!(call_ids(fin), ["cut", "whole", "no_function", "array_args"]);
    assert_eq!(code_at(fin, "cut")?, Some(codes::MALFORMED_ARGUMENTS));
    let whole = result_of(fin, "whole")?;
    assert!(whole.ok, "{whole:?}");
    assert_eq!(whole.name, "test.behave");
    assert_eq!(code_at(fin, "no_function")?, Some(codes::MALFORMED_CALL));
    assert_eq!(
        code_at(fin, "array_args")?,
        Some(codes::MALFORMED_ARGUMENTS)
    );
    assert_eq!((fin.summary.ok, fin.summary.errors), (1, 3));
    assert_eq!(fin.history.openai.len(), 4);

    // A multi-megabyte argument is refused; the turn still ends.
    let huge = "x".repeat(3 * 1024 * 1024);
    let calls = vec![
        call("huge", "test.behave", json!({"value": huge})),
        call("small", "test.behave", json!({"value": "small"})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    assert_one_error(
        &outcome.final_event,
        "huge",
        codes::ARGUMENTS_TOO_LARGE,
        "small",
    )?;

    // After all that, an ordinary turn still works.
    assert!(!coordinator.handle.is_finished(), "the coordinator stopped");
    let after = call("after", "test.behave", json!({"value": 1}));
    let outcome = fleet.run_calls("acme", vec![after], EVENT_WAIT).await?;
    assert!(result_of(&outcome.final_event, "after")?.ok);
    assert_eq!(outcome.events.first().map(TurnEvent::kind), Some("ack"));
    Ok(())
}
