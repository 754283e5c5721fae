//! A three-call decision in every supported shape ends in a `final` with three results
//! in call order, and `ack` arrives before any call is done.

use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_common::{CallState, TurnEvent};
use toolfleet_tests::fleet::{call_ids, turn, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(10);

fn args(customer: &str) -> String {
    json!({ "customerId": customer }).to_string()
}

fn decisions() -> Vec<(&'static str, Value, [&'static str; 3])> {
    vec![
        (
            "openai chat completion",
            json!({
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "choices": [{
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": null,
                        "tool_calls": [
                            {"id": "call_a", "type": "function", "function": {"name": "crm__listUpcomingAppointments", "arguments": args("cust_001")}},
                            {"id": "call_b", "type": "function", "function": {"name": "crm.getOpenInvoices", "arguments": args("cust_001")}},
                            {"id": "call_c", "type": "function", "function": {"name": "crm.getNextAppointment", "arguments": args("cust_001")}}
                        ]
                    }
                }]
            }),
            ["call_a", "call_b", "call_c"],
        ),
        (
            "openai responses",
            json!({
                "object": "response",
                "output": [
                    {"type": "function_call", "id": "fc_1", "call_id": "r_a", "name": "crm.listUpcomingAppointments", "arguments": args("cust_001")},
                    {"type": "function_call", "id": "fc_2", "call_id": "r_b", "name": "crm.getOpenInvoices", "arguments": args("cust_001")},
                    {"type": "function_call", "id": "fc_3", "call_id": "r_c", "name": "crm.getNextAppointment", "arguments": args("cust_001")}
                ]
            }),
            ["r_a", "r_b", "r_c"],
        ),
        (
            "anthropic",
            json!({
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "stop_reason": "tool_use",
                "content": [
                    {"type": "text", "text": "Let me pull that up."},
                    {"type": "tool_use", "id": "toolu_a", "name": "crm__listUpcomingAppointments", "input": {"customerId": "cust_001"}},
                    {"type": "tool_use", "id": "toolu_b", "name": "crm__getOpenInvoices", "input": {"customerId": "cust_001"}},
                    {"type": "tool_use", "id": "toolu_c", "name": "crm__getNextAppointment", "input": {"customerId": "cust_001"}}
                ]
            }),
            ["toolu_a", "toolu_b", "toolu_c"],
        ),
        (
            "simple",
            json!({
                "type": "tool_calls",
                "calls": [
                    {"id": "s_a", "toolName": "crm.listUpcomingAppointments", "arguments": {"customerId": "cust_001"}},
                    {"id": "s_b", "toolName": "crm.getOpenInvoices", "arguments": {"customerId": "cust_001"}},
                    {"id": "s_c", "toolName": "crm.getNextAppointment", "arguments": {"customerId": "cust_001"}}
                ]
            }),
            ["s_a", "s_b", "s_c"],
        ),
        (
            "parallel meta-tool",
            json!({
                "type": "tool_calls",
                "calls": [{
                    "id": "p",
                    "toolName": "parallel",
                    "arguments": {"calls": [
                        {"id": "p_a", "name": "crm.listUpcomingAppointments", "arguments": {"customerId": "cust_001"}},
                        {"id": "p_b", "name": "crm.getOpenInvoices", "arguments": {"customerId": "cust_001"}},
                        {"id": "p_c", "name": "crm.getNextAppointment", "arguments": {"customerId": "cust_001"}}
                    ]}
                }]
            }),
            ["p_a", "p_b", "p_c"],
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shape_runs_three_calls_in_order() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    for (shape, decision, ids) in decisions() {
        let outcome = fleet.run(turn("acme", decision), EVENT_WAIT).await?;
        let fin = &outcome.final_event;
        assert_eq!(call_ids(fin), ids, "{shape}: results in call order");
        assert!(
            fin.results.iter().all(|r| r.ok),
            "{shape}: {:?}",
            fin.results
        );
        assert_eq!(fin.summary.total, 3, "{shape}");
        assert_eq!(fin.summary.ok, 3, "{shape}");
        assert!(
            fin.text.contains("upcoming appointments"),
            "{shape}: {}",
            fin.text
        );
        assert!(fin.text.contains("open invoice"), "{shape}: {}", fin.text);

        // ack first, before any call is done.
        let first = outcome.events.first().map(TurnEvent::kind);
        assert_eq!(first, Some("ack"), "{shape}");
        let first_done = outcome
            .events
            .iter()
            .position(|e| matches!(e, TurnEvent::ToolState { state, .. } if state.is_terminal()));
        assert!(first_done.is_some_and(|i| i > 0), "{shape}");
        // every call went pending -> done
        for id in ids {
            let states: Vec<CallState> = outcome
                .events
                .iter()
                .filter_map(|e| match e {
                    TurnEvent::ToolState {
                        tool_call_id,
                        state,
                        ..
                    } if tool_call_id == id => Some(*state),
                    _ => None,
                })
                .collect();
            assert_eq!(
                states.first(),
                Some(&CallState::Pending),
                "{shape} {id}: {states:?}"
            );
            assert_eq!(
                states.last(),
                Some(&CallState::Done),
                "{shape} {id}: {states:?}"
            );
        }
        if shape == "parallel meta-tool" {
            assert_eq!(
                fin.history.openai.len(),
                1,
                "one history entry for the meta-call"
            );
            assert_eq!(fin.history.openai[0]["tool_call_id"], "p");
        } else {
            assert_eq!(fin.history.openai.len(), 3, "{shape}");
            let blocks = fin.history.anthropic[0]["content"].as_array().map(Vec::len);
            assert_eq!(blocks, Some(3), "{shape}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_decision_passes_straight_through() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let decision = json!({"type": "final", "text": "You're welcome!"});
    let outcome = fleet.run(turn("acme", decision), EVENT_WAIT).await?;
    assert_eq!(outcome.final_event.text, "You're welcome!");
    assert!(outcome.final_event.results.is_empty());
    Ok(())
}
