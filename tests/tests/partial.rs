//! A failing call never sinks its turn: every call gets its own result with a stable
//! code, the rest still run, and the history holds one entry per call.

use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_common::call::codes;
use toolfleet_common::{CallState, TurnEvent, TurnOptions};
use toolfleet_coordinator::narrate::FALLBACK;
use toolfleet_packs as packs;
use toolfleet_tests::fleet::{
    assert_one_error, call, call_ids, code_at, code_of, crm_call, result_of, tool_calls, turn,
    value_at, Fleet,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_failure_gets_its_own_code() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let expected = [
        ("good", CallState::Done, None),
        ("boom", CallState::Error, Some("boom")),
        ("unknown", CallState::Error, Some(codes::UNKNOWN_TOOL)),
        ("bad_type", CallState::Error, Some(codes::INVALID_ARGUMENTS)),
        (
            "bad_field",
            CallState::Error,
            Some(codes::INVALID_ARGUMENTS),
        ),
    ];
    let calls = vec![
        call("good", "test.behave", json!({"value": 7})),
        call("boom", "test.behave", json!({"fail": "boom"})),
        call("unknown", "test.nosuchtool", json!({})),
        call("bad_type", "test.behave", json!({"sleep_ms": "soon"})),
        call(
            "bad_field",
            "test.behave",
            json!({"sleep_ms": 1, "colour": "red"}),
        ),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;

    let ids = call_ids(fin);
    assert_eq!(ids, expected.map(|(id, _, _)| id));
    for (id, state, code) in expected {
        let r = result_of(fin, id)?;
        assert_eq!(r.state, state, "{id}: {r:?}");
        assert_eq!(r.ok, state == CallState::Done, "{id}");
        assert_eq!(code_of(r), code, "{id}: {r:?}");
    }
    assert_eq!(value_at(result_of(fin, "good")?, "/value"), Some(json!(7)));
    // The tool's own failure ran on a worker; validation failures never left the
    // coordinator.
    assert_eq!(result_of(fin, "boom")?.attempts, 1);
    assert_eq!(result_of(fin, "unknown")?.attempts, 0);
    assert_eq!(result_of(fin, "bad_type")?.attempts, 0);

    assert_eq!(fin.summary.total, 5);
    assert_eq!(fin.summary.ok, 1);
    assert_eq!(fin.summary.errors, 4);
    assert_eq!(fin.summary.timeouts, 0);
    assert_eq!(fin.summary.skipped, 0);
    assert!(!fin.deadline_hit);

    // Refused calls are reported as errors in the first burst of states.
    let refused_states: Vec<(&str, Option<&str>)> = outcome
        .events
        .iter()
        .filter_map(|e| match e {
            TurnEvent::ToolState {
                tool_call_id,
                state: CallState::Error,
                error,
                ..
            } => Some((
                tool_call_id.as_str(),
                error.as_ref().map(|e| e.code.as_str()),
            )),
            _ => None,
        })
        .collect();
    assert!(refused_states.contains(&("unknown", Some(codes::UNKNOWN_TOOL))));
    assert!(refused_states.contains(&("bad_type", Some(codes::INVALID_ARGUMENTS))));
    assert!(refused_states.contains(&("boom", Some("boom"))));

    // History: one OpenAI tool message and one Anthropic block per call, in order.
    assert_eq!(fin.history.openai.len(), 5);
    let openai_ids: Vec<&str> = fin
        .history
        .openai
        .iter()
        .filter_map(|m| m["tool_call_id"].as_str())
        .collect();
    assert_eq!(openai_ids, ids);
    assert_eq!(fin.history.anthropic.len(), 1);
    let message = &fin.history.anthropic[0];
    assert_eq!(message["role"], "user");
    let blocks = message["content"].as_array().cloned().unwrap_or_default();
    assert_eq!(blocks.len(), 5);
    for (block, (id, state, code)) in blocks.iter().zip(expected) {
        assert_eq!(block["type"], "tool_result");
        assert_eq!(block["tool_use_id"], id);
        assert_eq!(block["is_error"], json!(state != CallState::Done), "{id}");
        if let Some(code) = code {
            let content: Value =
                serde_json::from_str(block["content"].as_str().unwrap_or_default())?;
            assert_eq!(content["error"]["code"], code, "{id}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panics_duplicates_and_the_call_cap() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;

    // A panicking tool is an error for its call only, and the worker lives on.
    let panics = call("panics", "test.behave", json!({"panic": true}));
    let fine = call("fine", "test.noop", json!({}));
    let outcome = fleet
        .run_calls("acme", vec![panics, fine], EVENT_WAIT)
        .await?;
    assert_one_error(&outcome.final_event, "panics", codes::TOOL_PANICKED, "fine")?;

    // The second use of a call id is refused; the first runs.
    let first = call("same", "test.behave", json!({"value": "first"}));
    let second = call("same", "test.behave", json!({"value": "second"}));
    let outcome = fleet
        .run_calls("acme", vec![first, second], EVENT_WAIT)
        .await?;
    let fin = &outcome.final_event;
    assert_eq!(fin.results.len(), 2);
    assert!(fin.results[0].ok, "{:?}", fin.results[0]);
    assert_eq!(value_at(&fin.results[0], "/value"), Some(json!("first")));
    assert_eq!(fin.results[1].tool_call_id, "same");
    assert_eq!(code_of(&fin.results[1]), Some(codes::DUPLICATE_CALL_ID));
    assert_eq!((fin.summary.ok, fin.summary.errors), (1, 1));

    // Calls past the turn's cap are refused; the others run.
    let noops = ["c1", "c2", "c3"].map(|id| call(id, "test.noop", json!({})));
    let mut request = turn("acme", tool_calls(noops.to_vec()));
    request.options = TurnOptions {
        max_calls: Some(2),
        concurrency: None,
    };
    let outcome = fleet.run(request, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert!(result_of(fin, "c1")?.ok);
    assert!(result_of(fin, "c2")?.ok);
    assert_eq!(code_at(fin, "c3")?, Some(codes::TOO_MANY_CALLS));
    assert_eq!(
        (fin.summary.total, fin.summary.ok, fin.summary.errors),
        (3, 2, 1)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_policy_refuses_calls() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tools = packs::tools_for(&["demo", "test"]).map_err(anyhow::Error::msg)?;
    let listed = ["crm.getOpenInvoices", "test.behave"];
    let (_c, _w) = fleet
        .start_with_allowlist("t1", &["crm.*"], tools, &listed)
        .await?;

    let calls = vec![
        crm_call("crm", "crm.getOpenInvoices", "cust_001"),
        call("test", "test.behave", json!({})),
        call(
            "other_tenant",
            "crm.getOpenInvoices",
            json!({"customerId": "cust_001", "tenant_id": "other"}),
        ),
    ];
    let outcome = fleet.run_calls("t1", calls.clone(), EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert!(result_of(fin, "crm")?.ok, "{:?}", result_of(fin, "crm")?);
    assert_eq!(code_at(fin, "test")?, Some(codes::TOOL_NOT_ALLOWED));
    assert_eq!(code_at(fin, "other_tenant")?, Some(codes::TENANT_MISMATCH));
    assert_eq!(
        (fin.summary.total, fin.summary.ok, fin.summary.errors),
        (3, 1, 2)
    );

    // Another tenant has no allowlist; naming a foreign tenant is still refused.
    let outcome = fleet.run_calls("t2", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert!(result_of(fin, "crm")?.ok);
    assert!(result_of(fin, "test")?.ok);
    assert_eq!(code_at(fin, "other_tenant")?, Some(codes::TENANT_MISMATCH));

    // Naming the turn's own tenant is fine as far as the tenant check goes (the CRM
    // schema then refuses the extra field).
    let own_tenant = call(
        "own_tenant",
        "crm.getOpenInvoices",
        json!({"customerId": "cust_001", "tenant_id": "t1"}),
    );
    let outcome = fleet.run_calls("t1", vec![own_tenant], EVENT_WAIT).await?;
    assert_eq!(
        code_at(&outcome.final_event, "own_tenant")?,
        Some(codes::INVALID_ARGUMENTS)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_all_failed_turn_speaks_the_fallback() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let boom = call("boom", "test.behave", json!({"fail": "boom"}));
    let unknown = call("unknown", "nope.nothing", json!({}));
    let outcome = fleet
        .run_calls("acme", vec![boom, unknown], EVENT_WAIT)
        .await?;
    let fin = &outcome.final_event;
    assert_eq!(fin.summary.ok, 0);
    assert_eq!(fin.summary.errors, 2);
    assert_eq!(code_at(fin, "boom")?, Some("boom"));
    assert_eq!(code_at(fin, "unknown")?, Some(codes::UNKNOWN_TOOL));
    assert_eq!(fin.text, FALLBACK);
    let narration = outcome.narration();
    assert_eq!(narration, [FALLBACK]);
    let blocks = fin.history.anthropic[0]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(blocks.len(), 2);
    assert!(blocks.iter().all(|b| b["is_error"] == json!(true)));
    Ok(())
}
