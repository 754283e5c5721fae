//! Call ids are model-written: ones that cannot travel in NATS headers or that look like
//! the keys of refused calls fail their own call, never the turn.

use std::time::Duration;

use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_tests::fleet::{call, code_of, Fleet};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_call_ids_fail_their_call_only() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let calls = vec![
        call("line\r\nbreak", "test.behave", json!({})),
        call("#1", "test.behave", json!({})),
        call("c3", "no.such.tool", json!({})),
        call("ok", "test.behave", json!({})),
    ];
    let outcome = fleet
        .run_calls("acme", calls, Duration::from_secs(10))
        .await?;
    let fin = outcome.final_event;
    let codes_seen: Vec<Option<&str>> = fin.results.iter().map(code_of).collect();
    assert_eq!(
        codes_seen,
        [
            Some(codes::MALFORMED_CALL),
            Some(codes::MALFORMED_CALL),
            Some(codes::UNKNOWN_TOOL),
            None
        ]
    );
    assert!(
        !fin.deadline_hit,
        "the turn ended with its results, not its deadline"
    );
    assert_eq!(fin.summary.ok, 1);
    assert_eq!(fin.history.openai.len(), 4);
    Ok(())
}
