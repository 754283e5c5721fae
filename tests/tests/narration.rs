//! Narration tells the truth: when every call of a turn fails for a definite reason the
//! user can act on, the answer is that reason, not the generic fallback line. Twelve
//! `crm.getOpenInvoices` calls for a customer who does not exist, run by a real worker
//! through a real coordinator, NATS and Redis, end with one sentence spoken once
//! (`narration` and `final.text`), while every call keeps its own `customer_not_found`
//! result and the summary counts twelve errors.

use std::time::Duration;

use serde_json::json;
use toolfleet_common::CallState;
use toolfleet_coordinator::narrate::FALLBACK;
use toolfleet_packs::crm::{CUSTOMER_NOT_FOUND, CUSTOMER_NOT_FOUND_SENTENCE};
use toolfleet_tests::fleet::{call, call_ids, code_of, result_of, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twelve_calls_for_an_unknown_customer_speak_one_sentence() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let ids: Vec<String> = (1..=12).map(|i| format!("bill_{i:02}")).collect();
    let calls = ids
        .iter()
        .map(|id| {
            call(
                id,
                "crm.getOpenInvoices",
                json!({"customerId": "cust_nobody"}),
            )
        })
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
