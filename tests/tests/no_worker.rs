//! A tool whose every worker left fails at once with `no_live_worker` instead of
//! waiting for the turn's deadline.

use std::time::{Duration, Instant};

use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, code_of, result_of, timed_turn, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_without_workers_fails_fast() -> anyhow::Result<()> {
    let (fleet, _c, worker) = Fleet::start_with_default_nodes().await?;
    worker.stop().await;
    fleet.wait_for_tool_gone("test.behave").await?;

    let orphan = call("orphan", "test.behave", json!({"value": 1}));
    let request = timed_turn("acme", 10_000, vec![orphan]);
    let started = Instant::now();
    let outcome = fleet.run(request, EVENT_WAIT).await?;
    let took = started.elapsed();

    assert!(took < Duration::from_secs(1), "final after {took:?}");
    let fin = &outcome.final_event;
    assert!(!fin.deadline_hit);
    let r = result_of(fin, "orphan")?;
    assert_eq!(r.state, CallState::Error, "{r:?}");
    assert_eq!(code_of(r), Some(codes::NO_LIVE_WORKER));
    assert_eq!(r.error.as_ref().map(|e| e.retryable), Some(true));
    assert_eq!(r.attempts, 0);
    assert_eq!((fin.summary.total, fin.summary.errors), (1, 1));
    Ok(())
}
