//! A coordinator process killed mid-turn: another coordinator finishes the turn, either
//! when the last result comes in (shared results consumer) or at the deadline (sweeper).

use std::time::{Duration, Instant};

use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::client::TurnStream;
use toolfleet_common::{CallState, FinalEvent};
use toolfleet_packs as packs;
use toolfleet_tests::fleet::{
    call, code_of, read_ack, read_final, result_of, timed_turn, until_state, value_at, Fleet,
    Running,
};

const EVENT_WAIT: Duration = Duration::from_secs(15);

/// A fleet whose only coordinator is a child process (returned by pid) and whose worker
/// runs in-process.
async fn fleet_with_coordinator_process() -> anyhow::Result<(Fleet, u32, Running)> {
    let mut fleet = Fleet::start().await?;
    let pid = fleet.spawn_node("coordinator", &[])?;
    let tools = packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let worker = fleet.worker(fleet.worker_config(), tools);
    fleet.wait_for_tools(&["test.behave"]).await?;
    Ok((fleet, pid, worker))
}

/// Submits one `test.behave` call sleeping `sleep_ms` under `deadline_ms`, kills the
/// coordinator process once the call runs, starts an in-process coordinator
/// and returns the turn's final event, its id and the time from submit to final.
async fn kill_coordinator_mid_turn(
    sleep_ms: u64,
    deadline_ms: u64,
) -> anyhow::Result<(Fleet, FinalEvent, String, Duration)> {
    let (mut fleet, first, _worker) = fleet_with_coordinator_process().await?;
    let orphan = call(
        "orphan",
        "test.behave",
        json!({"sleep_ms": sleep_ms, "value": "kept"}),
    );
    let request = timed_turn("acme", deadline_ms, vec![orphan]);
    let submitted = Instant::now();
    let mut stream: TurnStream = fleet.client.submit(request).await?;
    let turn_id = stream.turn_id().to_string();
    read_ack(&mut stream, EVENT_WAIT).await?;
    // `ack` leaves before the job does; `running` shows the job is out.
    until_state(&mut stream, None, CallState::Running, EVENT_WAIT).await?;

    fleet.kill_node(first).await?;
    let _second = fleet.coordinator(fleet.coordinator_config());

    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    Ok((fleet, fin, turn_id, submitted.elapsed()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_coordinator_records_the_last_result() -> anyhow::Result<()> {
    let (fleet, fin, turn_id, took) = kill_coordinator_mid_turn(1000, 10_000).await?;
    let r = result_of(&fin, "orphan")?;
    assert!(r.ok, "{r:?}");
    assert_eq!(r.state, CallState::Done);
    assert_eq!(value_at(r, "/value"), Some(json!("kept")));
    assert!(!fin.deadline_hit);
    assert_eq!((fin.summary.total, fin.summary.ok), (1, 1));
    assert!(took < Duration::from_secs(5), "final after {took:?}");
    let counters = fleet.counters(&turn_id).await?;
    assert_eq!(counters.get("ended").map(String::as_str), Some("complete"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_coordinator_ends_the_turn_at_its_deadline() -> anyhow::Result<()> {
    let deadline_ms = 1500;
    let (fleet, fin, turn_id, took) = kill_coordinator_mid_turn(5000, deadline_ms).await?;
    let r = result_of(&fin, "orphan")?;
    assert_eq!(r.state, CallState::Timeout, "{r:?}");
    assert_eq!(code_of(r), Some(codes::DEADLINE_EXCEEDED));
    assert!(fin.deadline_hit);
    assert_eq!((fin.summary.total, fin.summary.timeouts), (1, 1));
    assert!(
        took >= Duration::from_millis(deadline_ms) && took < Duration::from_millis(4000),
        "final after {took:?}, the deadline is {deadline_ms} ms"
    );
    let counters = fleet.counters(&turn_id).await?;
    assert_eq!(counters.get("ended").map(String::as_str), Some("deadline"));
    // The worker gave up at the deadline too; its answer is late.
    fleet
        .wait_for_counter(&turn_id, "late", "1", Duration::from_secs(5))
        .await?;
    Ok(())
}

/// A turn submitted while no coordinator is subscribed: NATS answers each ask with "no
/// responders", the stream asks again after each silence, and the first coordinator to
/// start takes the turn and ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_submitted_before_any_coordinator_is_taken_by_the_first() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tools = packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    // A coordinator that starts into a fleet no coordinator has served yet finds no
    // names in Redis and learns the worker's tools from its next beat; beats 100 ms
    // apart leave that well inside the stream's next ask (about 1.4 s after the start).
    let mut worker_config = fleet.worker_config();
    worker_config.heartbeat = Duration::from_millis(100);
    let _worker = fleet.worker(worker_config, tools);
    let request = timed_turn(
        "acme",
        10_000,
        vec![call("early", "test.behave", json!({"value": "taken"}))],
    );
    let mut stream = fleet.client.submit(request).await?;
    // Nothing answers but NATS: the submission and the ask after the first silence
    // (1 s) each come back as "no responders".
    let silent = stream.next_event(Duration::from_millis(1_600)).await;
    assert!(silent.is_err(), "{silent:?}");
    assert!(!stream.accepted());
    assert_eq!((stream.asks(), stream.no_responders()), (2, 2));

    let _coordinator = fleet.coordinator(fleet.coordinator_config());
    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    assert_eq!(fin.results.len(), 1);
    assert_eq!(fin.results[0].state, CallState::Done, "{fin:?}");
    assert!(stream.asks() > 2);
    Ok(())
}
