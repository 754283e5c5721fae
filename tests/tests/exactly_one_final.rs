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
use toolfleet_common::client::TurnStream;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::{CallState, TurnEvent, TurnRequest};
use toolfleet_tests::fleet::{
    call, code_of, final_in, named_turn, read_ack, read_to_end, sleeping_calls, timed_turn,
    tool_calls, turn, Fleet, Running,
};

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

/// Asserts that each call `c<i>` of turn `turn_id`, `i` in `calls`, started once in
/// `starts` (from [`count_starts`]).
fn assert_started_once(
    starts: &HashMap<String, usize>,
    turn_id: &str,
    calls: std::ops::RangeInclusive<usize>,
) {
    for i in calls {
        assert_eq!(
            starts.get(&format!("{turn_id}/c{i}")),
            Some(&1),
            "{starts:?}"
        );
    }
}

/// Submits the `acme` turn `turn_id` (deadline 8 s) of `calls` calls `c1`, `c2`, ... of
/// `sleep_ms` each, run one at a time (the others wait in the turn's queue), and reads
/// its ack.
async fn submit_one_at_a_time(
    fleet: &Fleet,
    turn_id: &str,
    calls: usize,
    sleep_ms: u64,
) -> Result<TurnStream> {
    let mut request = named_turn(turn_id, "acme", 8_000, sleeping_calls(1..=calls, sleep_ms));
    request.options.concurrency = Some(1);
    let mut stream = fleet.client.submit(request).await?;
    let ack = stream.next_event(EVENT_WAIT).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
    Ok(stream)
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

/// A fresh fleet with a worker of the `test` pack in this process and one coordinator
/// process (started with `env`), serving: the fleet, the worker and the coordinator's pid.
async fn coordinator_process_and_worker(env: &[(&str, &str)]) -> Result<(Fleet, Running, u32)> {
    let mut fleet = Fleet::start().await?;
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let worker = fleet.worker(fleet.worker_config(), tools);
    let coordinator = fleet.spawn_node("coordinator", env)?;
    fleet.wait_for_tools(&["test.behave"]).await?;
    Ok((fleet, worker, coordinator))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_stored_by_a_coordinator_that_died_is_sent_by_another() -> Result<()> {
    // The only coordinator exits right after storing the turn's final.
    let fault = [("TOOLFLEET_FAULT", "exit_after_final_stored")];
    let (fleet, _worker, _) = coordinator_process_and_worker(&fault).await?;
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
    let (mut fleet, _worker, owner) = coordinator_process_and_worker(&[]).await?;
    let mut progress = fleet.subscribe_progress().await?;

    // Five calls, one at a time: four of them wait in the turn's queue.
    let mut stream = submit_one_at_a_time(&fleet, "paced-owner-dies", 5, 300).await?;

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
    assert_started_once(&starts, "paced-owner-dies", 2..=5);
    assert_eq!(starts.get("paced-owner-dies/c1"), None, "{starts:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_released_by_a_coordinator_that_died_before_publishing_it_still_runs() -> Result<()>
{
    // The only coordinator exits right after the first result released the next call.
    let fault = [("TOOLFLEET_FAULT", "exit_after_call_released")];
    let (fleet, _worker, _) = coordinator_process_and_worker(&fault).await?;
    let mut progress = fleet.subscribe_progress().await?;
    let mut stream = submit_one_at_a_time(&fleet, "released-not-published", 3, 100).await?;
    // A replacement: the first result comes back to it (never acknowledged), is a
    // duplicate now, and hands back the released call no one published.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let _replacement = fleet.coordinator(fleet.coordinator_config());

    let fin = final_in(&read_to_end(&mut stream, EVENT_WAIT).await?)?;
    let states: Vec<_> = fin.results.iter().map(|r| r.state).collect();
    assert_eq!(states, vec![CallState::Done; 3], "{fin:?}");
    let starts = count_starts(&mut progress, Duration::from_millis(500)).await;
    assert_started_once(&starts, "released-not-published", 1..=3);
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
        .filter(|r| code_of(r) == Some(codes::RESULT_TOO_LARGE))
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

/// A Redis that dies with acknowledged writes not yet on disk (`appendfsync everysec`
/// while an fsync is slow) comes back without the turn's last events: the turn's later
/// events, its `final` included, are stored under seqs the client already holds. The
/// client still takes the `final`, since a turn ends once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_stored_under_a_seq_the_client_holds_still_ends_the_turn() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let fast = (1..=3).map(|i| call(&format!("fast{i}"), "test.behave", json!({"value": i})));
    let slow = call("slow", "test.behave", json!({"sleep_ms": 2_000}));
    let mut request = turn("acme", tool_calls(fast.chain([slow]).collect()));
    request.turn_id = Some("rewound-1".into());
    let mut stream = fleet.client.submit(request).await?;
    // The ack, four `pending` states and the three fast calls' `done`: seq 8 at least.
    let mut done = 0;
    while done < 3 {
        match stream.next_event(EVENT_WAIT).await? {
            TurnEvent::ToolState {
                state: CallState::Done,
                ..
            } => done += 1,
            TurnEvent::Final(fin) => bail!("the turn ended before its slow call: {fin:?}"),
            _ => {}
        }
    }
    let held = stream.last_seq();
    assert!(held >= 8, "{held}");
    // Redis keeps the ack only, as if it had died before writing the rest to disk.
    let mut redis = fleet
        .redis
        .client()?
        .get_multiplexed_async_connection()
        .await?;
    let events_key = fleet.names.turn_events_key("rewound-1");
    let _: () = redis::cmd("LTRIM")
        .arg(&events_key)
        .arg(0)
        .arg(0)
        .query_async(&mut redis)
        .await?;
    // The slow call's `done`, the narration and the `final` are stored under seqs 2 to 4.
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    let stored: u64 = redis::cmd("LLEN")
        .arg(&events_key)
        .query_async(&mut redis)
        .await?;
    assert!(stored < held, "the final was stored at seq {stored}");
    match events.last() {
        Some(TurnEvent::Final(fin)) => {
            assert_eq!(fin.results.len(), 4);
            assert_eq!(fin.summary.ok, 4);
        }
        other => bail!("expected the final, got {other:?}"),
    }
    Ok(())
}

/// A frontend's wait for the next event ends at its timeout even while NATS is gone (the
/// client's asks for the turn cannot be flushed then), so a caller is never held past
/// the time it gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_the_next_event_ends_at_its_timeout_while_nats_is_down() -> Result<()> {
    let (mut fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let mut stream = fleet
        .client
        .submit(sleeping_turn("nats-gone", 5_000))
        .await?;
    read_ack(&mut stream, EVENT_WAIT).await?;
    fleet.nats.stop().await;
    let wait = Duration::from_secs(3);
    let started = tokio::time::Instant::now();
    let waited = tokio::time::timeout(EVENT_WAIT * 3, async {
        loop {
            match stream.next_event(wait).await {
                // The `pending` state may still come from the client's buffer.
                Ok(TurnEvent::ToolState { .. }) => continue,
                other => return other,
            }
        }
    })
    .await
    .context("the wait outlived its timeout by far")?;
    let error = match waited {
        Err(error) => error,
        Ok(event) => bail!("an event while NATS is down: {event:?}"),
    };
    assert_eq!(
        error.kind(),
        toolfleet_common::client::ClientErrorKind::Timeout
    );
    assert!(started.elapsed() < wait * 2, "{:?}", started.elapsed());
    Ok(())
}
