//! A turn ends at its deadline: the slow call is a `timeout` that keeps the timing of the
//! run its worker announced, the fast one keeps its result, and the slow call's late
//! result is counted and changes nothing.

use std::time::{Duration, Instant};

use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::{CallState, TurnEvent};
use toolfleet_tests::fleet::{call, code_of, named_turn, next_raw_event, result_of, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(5);
const DEADLINE_MS: u64 = 500;
const SLOW_MS: u64 = 1500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_ends_the_turn_and_late_results_change_nothing() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let turn_id = uuid::Uuid::new_v4().simple().to_string();
    let fast = call("fast", "test.behave", json!({"value": "quick"}));
    let slow = call("slow", "test.behave", json!({"sleep_ms": SLOW_MS}));
    let request = named_turn(&turn_id, "acme", DEADLINE_MS, vec![fast, slow]);

    let submitted = Instant::now();
    let mut events = fleet.submit_raw(serde_json::to_vec(&request)?).await?;
    let fin = loop {
        match next_raw_event(&mut events, EVENT_WAIT).await? {
            TurnEvent::Final(fin) => break fin,
            TurnEvent::Error { error, .. } => anyhow::bail!("turn failed: {error:?}"),
            _ => {}
        }
    };
    let took = submitted.elapsed();
    assert!(
        took >= Duration::from_millis(DEADLINE_MS - 50) && took < Duration::from_millis(SLOW_MS),
        "final after {took:?}, the deadline is {DEADLINE_MS} ms"
    );
    assert!(fin.deadline_hit);
    assert_eq!(fin.turn_id, turn_id);
    let fast = result_of(&fin, "fast")?;
    assert!(fast.ok, "{fast:?}");
    let slow = result_of(&fin, "slow")?;
    assert_eq!(slow.state, CallState::Timeout, "{slow:?}");
    assert_eq!(code_of(slow), Some(codes::DEADLINE_EXCEEDED));
    // The slow call ran (its worker announced it): its timing runs from its start to
    // the turn's end, with its attempt and worker.
    assert!(
        slow.started_at.is_some() && slow.ended_at.is_some(),
        "{slow:?}"
    );
    assert!(
        (DEADLINE_MS / 2..SLOW_MS).contains(&slow.duration_ms),
        "{slow:?}"
    );
    assert_eq!(slow.attempts, 1, "{slow:?}");
    assert!(slow.worker_id.is_some(), "{slow:?}");
    assert_eq!(
        (fin.summary.total, fin.summary.ok, fin.summary.timeouts),
        (2, 1, 1)
    );

    // The worker's own answer for the slow call arrives after the turn ended: counted
    // as late, and not recorded.
    fleet
        .wait_for_counter(&turn_id, "late", "1", Duration::from_secs(5))
        .await?;
    let counters = fleet.counters(&turn_id).await?;
    assert_eq!(counters.get("duplicates").map(String::as_str), Some("0"));
    assert_eq!(counters.get("state").map(String::as_str), Some("final"));
    assert_eq!(counters.get("ended").map(String::as_str), Some("deadline"));
    assert_eq!(fleet.recorded_calls(&turn_id).await?, ["fast"]);

    // Nothing more is published for the turn.
    match next_raw_event(&mut events, Duration::from_millis(500)).await {
        Err(_) => {}
        Ok(event) => anyhow::bail!("event after final: {event:?}"),
    }
    Ok(())
}
