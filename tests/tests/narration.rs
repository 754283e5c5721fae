//! Narration tells the truth: when every call of a turn fails for a definite reason the
//! user can act on, the answer is that reason, not the generic fallback line. Twelve
//! `crm.getOpenInvoices` calls for a customer who does not exist, run by a real worker
//! through a real coordinator, NATS and Redis, end with one sentence spoken once
//! (`narration` and `final.text`), while every call keeps its own `customer_not_found`
//! result and the summary counts twelve errors.
//!
//! And what a person hears of a mixed turn: successes said in words, every failure in
//! one sentence, no tool's name (not even one the model made up) and no JSON, a tool's
//! `spoken_name` where the narrator has nothing else to call it by.

use std::time::Duration;

use serde_json::json;
use toolfleet_common::CallState;
use toolfleet_coordinator::narrate::FALLBACK;
use toolfleet_packs::crm::{CUSTOMER_NOT_FOUND, CUSTOMER_NOT_FOUND_SENTENCE};
use toolfleet_tests::fleet::{call, call_ids, code_of, crm_call, result_of, Fleet};
use toolfleet_worker::{Tool, ToolContext, ToolError, ToolOutput};

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twelve_calls_for_an_unknown_customer_speak_one_sentence() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let ids: Vec<String> = (1..=12).map(|i| format!("bill_{i:02}")).collect();
    let calls = ids
        .iter()
        .map(|id| crm_call(id, "crm.getOpenInvoices", "cust_nobody"))
        .collect();
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;

    // The answer is the reason, once.
    assert_eq!(fin.text, CUSTOMER_NOT_FOUND_SENTENCE);
    assert_ne!(fin.text, FALLBACK);
    let narration = outcome.narration();
    assert_eq!(narration, [CUSTOMER_NOT_FOUND_SENTENCE]);

    // Every call still has its own definite result.
    assert_eq!(call_ids(fin), ids);
    for id in &ids {
        let r = result_of(fin, id)?;
        assert_eq!(r.state, CallState::Error, "{id}: {r:?}");
        assert_eq!(code_of(r), Some(CUSTOMER_NOT_FOUND), "{id}: {r:?}");
        let error = r.error.as_ref();
        assert_eq!(error.map(|e| e.retryable), Some(false), "{id}: {r:?}");
        assert_eq!(
            error.and_then(|e| e.user_message.as_deref()),
            Some(CUSTOMER_NOT_FOUND_SENTENCE),
            "{id}: {r:?}"
        );
        assert_eq!(r.attempts, 1, "{id}: a final error is not retried");
    }
    assert_eq!(
        (
            fin.summary.total,
            fin.summary.ok,
            fin.summary.errors,
            fin.summary.timeouts,
            fin.summary.skipped
        ),
        (12, 0, 12, 0, 0)
    );
    assert!(!fin.deadline_hit);
    Ok(())
}

/// Tools named as a model-written fleet might name them: one that fails and has only a
/// spoken name, one that fails and has no words at all, one whose result is nested JSON.
fn wordless_tools() -> Vec<Tool> {
    vec![
        Tool::builder("aa.orders.status", "The customer's order status")
            .spoken_name("your order status")
            .handler(|_ctx: ToolContext, _args: ()| async move {
                Err::<ToolOutput, _>(ToolError::fatal("orders_down", "orders API: 502"))
            }),
        Tool::builder("aa.text.stats", "Statistics of a text").handler(
            |_ctx: ToolContext, _args: ()| async move {
                Err::<ToolOutput, _>(ToolError::fatal("stats_failed", "stats: bad input"))
            },
        ),
        Tool::builder("aa.py2.block", "Blocks for a while")
            .spoken_name("the block report")
            .handler(|_ctx: ToolContext, _args: ()| async move {
                Ok::<_, ToolError>(ToolOutput::new(json!({"slept": 7, "detail": {"ms": [7]}})))
            }),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_turn_is_heard_in_words_with_every_failure_in_one_sentence() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let mut tools = toolfleet_packs::tools_for(&["demo"]).map_err(anyhow::Error::msg)?;
    tools.extend(wordless_tools());
    let names = [
        "crm.listUpcomingAppointments",
        "aa.orders.status",
        "aa.text.stats",
        "aa.py2.block",
    ];
    let _nodes = fleet
        .start_with(fleet.coordinator_config(), tools, &names)
        .await?;
    let calls = vec![
        crm_call("appointments", "crm.listUpcomingAppointments", "cust_002"),
        call("orders", "aa.orders.status", json!({})),
        call("stats", "aa.text.stats", json!({})),
        call("invented", "aa.nope", json!({})),
        call("block", "aa.py2.block", json!({})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    let narration = outcome.narration();

    // The appointments in the tool's own words, the nested result by its spoken name,
    // then one sentence for the three failures: the named one by its spoken name, the
    // two without words (one of a tool the model invented) counted.
    assert_eq!(narration.len(), 3, "{narration:?}");
    assert!(narration[0].starts_with("You have"), "{narration:?}");
    assert_eq!(narration[1], "I got the block report.");
    assert_eq!(
        narration[2],
        "I couldn't get your order status or complete two other requests right now."
    );
    assert_eq!(fin.text, narration.join(" "));
    for name in names.iter().chain(&["aa.nope"]) {
        assert!(!fin.text.contains(name), "{name} spoken: {}", fin.text);
    }
    assert!(
        !fin.text.contains(['{', '}', '"']),
        "JSON spoken: {}",
        fin.text
    );
    assert_eq!(code_of(result_of(fin, "invented")?), Some("unknown_tool"));
    assert_eq!(
        (fin.summary.total, fin.summary.ok, fin.summary.errors),
        (5, 2, 3)
    );
    Ok(())
}
