//! A worker process killed mid-call: an idempotent call is delivered again to another
//! worker and succeeds; a call that must not run twice ends `call_interrupted` at
//! once instead of hanging until the deadline.

use std::time::{Duration, Instant};

use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::{CallState, FinalEvent};
use toolfleet_tests::fleet::{
    call, code_of, read_final, result_of, timed_turn, until_state, value_at, Fleet,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);
const DEADLINE_MS: u64 = 15_000;
const SLEEP_MS: u64 = 2000;

/// Runs one `tool` call on a worker process, kills that worker while the call runs,
/// starts another worker process, and returns the final event and how long the turn
/// took after the kill.
async fn kill_worker_mid_call(tool: &str) -> anyhow::Result<(FinalEvent, Duration)> {
    let mut fleet = Fleet::start().await?;
    let _c = fleet.coordinator(fleet.coordinator_config());
    let first = fleet.spawn_node("worker", &[])?;
    fleet.wait_for_tools(&[tool]).await?;

    let victim = call("victim", tool, json!({"sleep_ms": SLEEP_MS}));
    let request = timed_turn("acme", DEADLINE_MS, vec![victim]);
    let mut stream = fleet.client.submit(request).await?;
    until_state(&mut stream, Some("victim"), CallState::Running, EVENT_WAIT).await?;

    fleet.kill_node(first).await?;
    let killed = Instant::now();
    fleet.spawn_node("worker", &[])?;

    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    Ok((fin, killed.elapsed()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_call_is_delivered_again() -> anyhow::Result<()> {
    let (fin, after_kill) = kill_worker_mid_call("test.behave").await?;
    let r = result_of(&fin, "victim")?;
    assert!(r.ok, "{r:?}");
    assert_eq!(r.state, CallState::Done);
    assert!(r.attempts >= 2, "attempts = {}", r.attempts);
    assert!(r.duration_ms >= SLEEP_MS);
    assert_eq!(value_at(r, "/attempt"), Some(json!(r.attempts)));
    assert!(!fin.deadline_hit);
    assert!(
        after_kill < Duration::from_millis(DEADLINE_MS / 2),
        "the turn took {after_kill:?} after the kill"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_must_not_run_twice_is_interrupted() -> anyhow::Result<()> {
    let (fin, after_kill) = kill_worker_mid_call("test.behave_once").await?;
    let r = result_of(&fin, "victim")?;
    assert!(!r.ok);
    assert_eq!(r.state, CallState::Error, "{r:?}");
    assert_eq!(code_of(r), Some(codes::CALL_INTERRUPTED));
    assert!(r.attempts >= 2, "attempts = {}", r.attempts);
    assert!(!fin.deadline_hit);
    assert!(
        after_kill < Duration::from_millis(DEADLINE_MS / 3),
        "the turn took {after_kill:?} after the kill"
    );
    Ok(())
}
