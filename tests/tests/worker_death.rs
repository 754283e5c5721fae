//! A worker process killed mid-call: an idempotent call is delivered again to another
//! worker and succeeds; a call that must not run twice ends `call_interrupted` at
//! once instead of hanging until the deadline.

use std::time::{Duration, Instant};

use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::client::TurnStream;
use toolfleet_common::{CallState, FinalEvent, TurnEvent};
use toolfleet_tests::fleet::{
    call, code_of, final_of, read_to_end, result_of, tool_calls, turn, Fleet,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);
const DEADLINE_MS: u64 = 15_000;
const SLEEP_MS: u64 = 2000;

/// Reads `stream` until call `id` is reported `running`.
async fn until_running(stream: &mut TurnStream, id: &str) -> anyhow::Result<()> {
    loop {
        match stream.next_event(EVENT_WAIT).await? {
            TurnEvent::ToolState {
                tool_call_id,
                state: CallState::Running,
                ..
            } if tool_call_id == id => return Ok(()),
            event if event.is_last() => anyhow::bail!("turn ended before {id} ran: {event:?}"),
            _ => {}
        }
    }
}

/// Runs one `tool` call on a worker process, kills that worker while the call runs,
/// starts another worker process, and returns the final event and how long the turn
/// took after the kill.
async fn kill_worker_mid_call(tool: &str) -> anyhow::Result<(FinalEvent, Duration)> {
    let mut fleet = Fleet::start().await?;
    let _c = fleet.coordinator(fleet.coordinator_config());
    let first = fleet.spawn_node("worker", &[])?;
    fleet.wait_for_tools(&[tool]).await?;

    let mut request = turn(
        "acme",
        tool_calls(vec![call("victim", tool, json!({"sleep_ms": SLEEP_MS}))]),
    );
    request.deadline_ms = Some(DEADLINE_MS);
    let mut stream = fleet.client.submit(request).await?;
    until_running(&mut stream, "victim").await?;

    fleet.kill_node(first).await?;
    let killed = Instant::now();
    fleet.spawn_node("worker", &[])?;

    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    let after_kill = killed.elapsed();
    Ok((final_of(&events)?.clone(), after_kill))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_call_is_delivered_again() -> anyhow::Result<()> {
    let (fin, after_kill) = kill_worker_mid_call("test.behave").await?;
    let r = result_of(&fin, "victim")?;
    assert!(r.ok, "{r:?}");
    assert_eq!(r.state, CallState::Done);
    assert!(r.attempts >= 2, "attempts = {}", r.attempts);
    assert!(r.duration_ms >= SLEEP_MS);
    assert_eq!(
        r.result.as_ref().map(|v| v["attempt"].clone()),
        Some(json!(r.attempts))
    );
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
