//! The calls of one decision run at the same time: three 300 ms calls end in well under
//! the sum of their durations.

use std::time::{Duration, Instant};

use serde_json::json;
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, call_ids, value_at, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(10);
const SLEEP_MS: u64 = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sleeping_calls_overlap() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let ids = ["p1", "p2", "p3"];
    let calls = ids
        .iter()
        .map(|id| {
            call(
                id,
                "test.behave",
                json!({"sleep_ms": SLEEP_MS, "value": id}),
            )
        })
        .collect();

    let started = Instant::now();
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let wall = started.elapsed();

    let fin = &outcome.final_event;
    assert!(
        wall < Duration::from_millis(800),
        "three {SLEEP_MS} ms calls took {wall:?} end to end"
    );
    assert!(!fin.deadline_hit);
    assert_eq!(fin.summary.total, 3);
    assert_eq!(fin.summary.ok, 3);
    assert_eq!(call_ids(fin), ids);
    for r in &fin.results {
        assert!(r.ok, "{r:?}");
        assert_eq!(r.state, CallState::Done);
        assert!(
            r.duration_ms >= SLEEP_MS,
            "{} ran {} ms",
            r.tool_call_id,
            r.duration_ms
        );
        assert_eq!(value_at(r, "/value"), Some(json!(r.tool_call_id)));
    }
    Ok(())
}
