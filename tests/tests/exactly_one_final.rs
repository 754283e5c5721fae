//! Every accepted turn ends with one `final` the frontend receives: a resubmitted turn id
//! re-attaches (its calls never run twice), attaching by id replays a finished or running
//! turn, a coordinator that dies between storing and sending a `final` is covered by
//! another's sweeper, a paced turn's queued calls outlive the coordinator that took it, a NATS restart loses no `final`, a `final` too large for NATS
//! arrives in a form that fits, and a turn whose Redis state is lost ends with
//! `turn_state_lost` instead of silence. Real nats-server, redis-server and coordinator
//! processes; every wait bounded.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::{CallState, FinalEvent, TurnEvent, TurnRequest};
use toolfleet_tests::fleet::{call, read_to_end, timed_turn, tool_calls, turn, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// A turn with id `id` whose one call sleeps `sleep_ms`.
fn sleeping_turn(id: &str, sleep_ms: u64) -> TurnRequest {
    let mut request = turn(
        "acme",
        tool_calls(vec![call(
            "c1",
            "test.behave",
            json!({"sleep_ms": sleep_ms, "value": id}),
        )]),
    );
    request.turn_id = Some(id.to_string());
    request
}

/// The `final` at the end of `events`.
fn final_in(events: &[TurnEvent]) -> Result<FinalEvent> {
    match events.last() {
        Some(TurnEvent::Final(fin)) => Ok(fin.clone()),
        other => bail!("expected a final last, got {other:?}"),
    }
}

/// How many `started` notices each turn's calls had: a call that ran twice counts 2.
async fn count_starts(
    progress: &mut async_nats::Subscriber,
    within: Duration,
) -> HashMap<String, usize> {
    let mut starts = HashMap::new();
    let until = tokio::time::Instant::now() + within;
    while let Ok(Some(message)) = tokio::time::timeout_at(until, progress.next()).await {
        if let Ok(ProgressNotice::Started { tool_call_id, .. }) =
            serde_json::from_slice(&message.payload)
        {
            let names = toolfleet_common::Names::default();
            let turn = names
                .progress_subject_parts(&message.subject)
                .map_or("", |(turn, _)| turn);
            *starts.entry(format!("{turn}/{tool_call_id}")).or_default() += 1;
        }
    }
    starts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resubmitted_turn_reattaches_and_never_runs_twice() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let mut progress = fleet.subscribe_progress().await?;

    // While it runs: the second submission follows the same turn.
    let mut first = fleet
        .client
        .submit(sleeping_turn("resubmit-1", 600))
        .await?;
    let mut second = fleet
        .client
        .submit(sleeping_turn("resubmit-1", 600))
        .await?;
    let first = final_in(&read_to_end(&mut first, EVENT_WAIT).await?)?;
    let second = final_in(&read_to_end(&mut second, EVENT_WAIT).await?)?;
    assert_eq!(first, second);
    assert_eq!(first.results[0].state, CallState::Done);

    // After it ended: the same final again.
    let mut third = fleet
        .client
        .submit(sleeping_turn("resubmit-1", 600))
        .await?;
    let events = read_to_end(&mut third, EVENT_WAIT).await?;
    assert!(
        matches!(events.first(), Some(TurnEvent::Ack { .. })),
        "{events:?}"
    );
    assert_eq!(final_in(&events)?, first);

    let starts = count_starts(&mut progress, Duration::from_millis(500)).await;
    assert_eq!(starts.get("resubmit-1/c1"), Some(&1), "{starts:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attaching_replays_finished_and_running_turns_and_names_unknown_ones() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;

    let done = fleet
        .client
        .run_turn(sleeping_turn("attach-done", 0), EVENT_WAIT)
        .await?;
    let mut attached = fleet.client.attach("attach-done").await?;
    let events = read_to_end(&mut attached, EVENT_WAIT).await?;
    assert_eq!(
        events, done.events,
        "a finished turn replays every event in order"
    );
    assert_eq!(attached.last_seq(), events.len() as u64);

    let mut running = fleet
        .client
        .submit(sleeping_turn("attach-running", 800))
        .await?;
    let first = running.next_event(EVENT_WAIT).await?;
    assert!(matches!(first, TurnEvent::Ack { .. }), "{first:?}");
    let mut follower = fleet.client.attach("attach-running").await?;
    let followed = final_in(&read_to_end(&mut follower, EVENT_WAIT).await?)?;
    let submitted = final_in(&read_to_end(&mut running, EVENT_WAIT).await?)?;
    assert_eq!(followed, submitted);

    let mut unknown = fleet.client.attach("never-submitted").await?;
    match unknown.next_event(EVENT_WAIT).await? {
        TurnEvent::Error { error, .. } => assert_eq!(error.code, turn_codes::UNKNOWN_TURN),
        other => bail!("expected unknown_turn, got {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_stored_by_a_coordinator_that_died_is_sent_by_another() -> Result<()> {
    let mut fleet = Fleet::start().await?;
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let _worker = fleet.worker(fleet.worker_config(), tools);
    // The only coordinator exits right after storing the turn's final.
    fleet.spawn_node(
        "coordinator",
        &[("TOOLFLEET_FAULT", "exit_after_final_stored")],
    )?;
    fleet.wait_for_tools(&["test.behave"]).await?;
    let request = timed_turn(
        "acme",
        1_500,
        vec![call("c1", "test.behave", json!({"value": 1}))],
    );
    let mut stream = fleet.client.submit(request).await?;
    let ack = stream.next_event(EVENT_WAIT).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
    // A replacement replica: its sweeper (or the client's attach) sends the stored final.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _replacement = fleet.coordinator(fleet.coordinator_config());
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    let fin = final_in(&events)?;
    assert_eq!(fin.results.len(), 1);
    assert_eq!(fin.results[0].state, CallState::Done, "{fin:?}");
    let finals = events
        .iter()
        .filter(|e| matches!(e, TurnEvent::Final(_)))
        .count();
    assert_eq!(finals, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paced_calls_of_a_coordinator_that_died_are_dispatched_by_another() -> Result<()> {
    let mut fleet = Fleet::start().await?;
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let _worker = fleet.worker(fleet.worker_config(), tools);
    let owner = fleet.spawn_node("coordinator", &[])?;
    fleet.wait_for_tools(&["test.behave"]).await?;
    let mut progress = fleet.subscribe_progress().await?;

    // Five calls, one at a time: four of them wait in the turn's queue.
    let calls = (1..=5)
        .map(|i| {
            call(
                &format!("c{i}"),
                "test.behave",
                json!({"sleep_ms": 300, "value": i}),
            )
        })
        .collect();
    let mut request = timed_turn("acme", 8_000, calls);
    request.turn_id = Some("paced-owner-dies".into());
    request.options.concurrency = Some(1);
    let mut stream = fleet.client.submit(request).await?;
    let ack = stream.next_event(EVENT_WAIT).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");

    // The only coordinator dies while the first call runs; a new one takes over from
    // what Redis holds (the results consumer redelivers, its recording releases the
    // next call).
    let first = tokio::time::timeout(EVENT_WAIT, progress.next())
        .await
        .context("no call started")?;
    assert!(first.is_some());
    fleet.kill_node(owner).await?;
    let _replacement = fleet.coordinator(fleet.coordinator_config());

    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    let fin = final_in(&events)?;
    let states: Vec<_> = fin.results.iter().map(|r| r.state).collect();
    assert_eq!(states, vec![CallState::Done; 5], "{fin:?}");
    let finals = events
        .iter()
        .filter(|e| matches!(e, TurnEvent::Final(_)))
        .count();
    assert_eq!(finals, 1);

    // Each call ran once (the first one's start was read above).
    let starts = count_starts(&mut progress, Duration::from_millis(500)).await;
    for i in 2..=5 {
        assert_eq!(
            starts.get(&format!("paced-owner-dies/c{i}")),
            Some(&1),
            "{starts:?}"
        );
    }
    assert_eq!(starts.get("paced-owner-dies/c1"), None, "{starts:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_released_by_a_coordinator_that_died_before_publishing_it_still_runs() -> Result<()>
{
    let mut fleet = Fleet::start().await?;
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let _worker = fleet.worker(fleet.worker_config(), tools);
    // The only coordinator exits right after the first result released the next call.
    fleet.spawn_node(
        "coordinator",
        &[("TOOLFLEET_FAULT", "exit_after_call_released")],
    )?;
    fleet.wait_for_tools(&["test.behave"]).await?;
    let mut progress = fleet.subscribe_progress().await?;
    let calls = (1..=3)
        .map(|i| {
            call(
                &format!("c{i}"),
                "test.behave",
                json!({"sleep_ms": 100, "value": i}),
            )
        })
        .collect();
    let mut request = timed_turn("acme", 8_000, calls);
    request.turn_id = Some("released-not-published".into());
    request.options.concurrency = Some(1);
    let mut stream = fleet.client.submit(request).await?;
    let ack = stream.next_event(EVENT_WAIT).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
    // A replacement: the first result comes back to it (never acknowledged), is a
    // duplicate now, and hands back the released call no one published.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let _replacement = fleet.coordinator(fleet.coordinator_config());

    let fin = final_in(&read_to_end(&mut stream, EVENT_WAIT).await?)?;
    let states: Vec<_> = fin.results.iter().map(|r| r.state).collect();
    assert_eq!(states, vec![CallState::Done; 3], "{fin:?}");
    let starts = count_starts(&mut progress, Duration::from_millis(500)).await;
    for i in 1..=3 {
        assert_eq!(
            starts.get(&format!("released-not-published/c{i}")),
            Some(&1),
            "{starts:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_final_arrives_across_a_nats_restart() -> Result<()> {
    let (mut fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let mut streams = Vec::new();
    for i in 0..20 {
        let request = timed_turn(
            "acme",
            8_000,
            vec![call(
                "c1",
                "test.behave",
                json!({"sleep_ms": 400 + 20 * i, "value": i}),
            )],
        );
        streams.push(fleet.client.submit(request).await?);
    }
    for stream in &mut streams {
        let ack = stream.next_event(EVENT_WAIT).await?;
        assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
    }
    fleet.nats.restart().await?;
    let mut done = 0;
    for stream in &mut streams {
        let events = read_to_end(stream, Duration::from_secs(15)).await?;
        let fin = final_in(&events).with_context(|| format!("turn {}", stream.turn_id()))?;
        assert_eq!(fin.results.len(), 1);
        done += 1;
    }
    assert_eq!(done, 20);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_whose_results_fit_once_carries_them_all_and_leaves_the_history_out() -> Result<()>
{
    // NATS's default max_payload (1 MiB) and four results of 200 KB: with the history
    // (each result again for OpenAI and for Anthropic) the final would be 2.4 MB;
    // without it, every result fits.
    let fleet = Fleet::start_with_nats_config("max_payload: 1MB").await?;
    let max = fleet.client.nats().server_info().max_payload;
    let mut config = fleet.coordinator_config();
    config.max_argument_bytes = max;
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let _nodes = fleet.start_with(config, tools, &["test.behave"]).await?;
    let big = "x".repeat(200_000);
    let calls = (1..=4)
        .map(|i| call(&format!("c{i}"), "test.behave", json!({"value": big})))
        .collect();
    let outcome = fleet
        .client
        .run_turn(turn("acme", tool_calls(calls)), EVENT_WAIT)
        .await?;
    let fin = outcome.final_event;
    assert!(serde_json::to_vec(&fin)?.len() <= max);
    let ids: Vec<&str> = fin
        .results
        .iter()
        .map(|r| r.tool_call_id.as_str())
        .collect();
    assert_eq!(ids, ["c1", "c2", "c3", "c4"]);
    let cut = fin
        .results
        .iter()
        .filter(|r| {
            r.error
                .as_ref()
                .is_some_and(|e| e.code == codes::RESULT_TOO_LARGE)
        })
        .count();
    assert_eq!(
        cut,
        0,
        "{:?}",
        fin.results
            .iter()
            .map(|r| r.error.clone())
            .collect::<Vec<_>>()
    );
    assert_eq!(fin.summary.ok, 4);
    assert!(fin.history_omitted);
    assert!(fin.history.openai.is_empty());
    // The frontend renders the history from the results: one entry per call.
    let history = fin.session_history();
    assert_eq!(history.openai.len(), 4);
    assert_eq!(history.openai[3]["tool_call_id"], "c4");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_redis_state_is_lost_ends_with_turn_state_lost() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let mut stream = fleet.client.submit(sleeping_turn("lost-1", 1_500)).await?;
    let ack = stream.next_event(EVENT_WAIT).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
    let mut redis = fleet
        .redis
        .client()?
        .get_multiplexed_async_connection()
        .await?;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut redis).await?;
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    match events.last() {
        Some(TurnEvent::Error { error, .. }) => assert_eq!(error.code, turn_codes::TURN_STATE_LOST),
        other => bail!("expected turn_state_lost, got {other:?}"),
    }
    Ok(())
}
