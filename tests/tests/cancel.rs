//! Cancelling a turn: the turn ends at once with one `final` whose calls without a
//! result are `cancelled`, the running tool sees its token fire, held calls never start,
//! a cancel racing the last result still ends the turn once, other tenants' and unknown
//! or finished turns are answered clearly, and Ctrl-C on `toolfleet submit` cancels.
//! Real nats-server, redis-server, coordinator and worker; every wait bounded.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use toolfleet_common::call::codes;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::turn::CancelOutcome;
use toolfleet_common::{CallState, TurnEvent};
use toolfleet_tests::fleet::{
    call, checkout_cli, final_in, named_turn, one_sleeping_call, read_to_end, Fleet,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// The `started` notices per call id of `turn_id` seen on `progress` within `within`.
async fn starts_of(
    progress: &mut async_nats::Subscriber,
    turn_id: &str,
    within: Duration,
) -> HashMap<String, usize> {
    let mut starts = HashMap::new();
    let until = tokio::time::Instant::now() + within;
    while let Ok(Some(message)) = tokio::time::timeout_at(until, progress.next()).await {
        let names = toolfleet_common::Names::default();
        let turn = names
            .progress_subject_parts(&message.subject)
            .map_or("", |(turn, _)| turn);
        if turn != turn_id {
            continue;
        }
        if let Ok(ProgressNotice::Started { tool_call_id, .. }) =
            serde_json::from_slice(&message.payload)
        {
            *starts.entry(tool_call_id).or_default() += 1;
        }
    }
    starts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_turn_ends_at_once_its_running_call_stops_and_held_calls_never_start(
) -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let mut progress = fleet.subscribe_progress().await?;
    let turn_id = "cancel-at-once";
    let mut request = named_turn(
        turn_id,
        "acme",
        20_000,
        vec![
            call("c1", "test.behave", json!({"sleep_ms": 2_000})),
            call("c2", "test.behave", json!({"sleep_ms": 100})),
            call("c3", "test.behave", json!({"sleep_ms": 100})),
        ],
    );
    request.options.concurrency = Some(1);
    let mut stream = fleet.client.submit(request).await?;

    // c1 runs; c2 and c3 wait for its slot.
    let started = tokio::time::timeout(EVENT_WAIT, progress.next())
        .await
        .context("c1 never started")?
        .context("progress subscription ended")?;
    let notice: ProgressNotice = serde_json::from_slice(&started.payload)?;
    assert!(
        matches!(&notice, ProgressNotice::Started { tool_call_id, .. } if tool_call_id == "c1"),
        "{notice:?}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = Instant::now();
    let reply = fleet.client.cancel(turn_id, None, EVENT_WAIT).await?;
    assert_eq!(reply.outcome, CancelOutcome::Cancelled, "{reply:?}");
    assert_eq!(reply.ended.as_deref(), Some("cancelled"));

    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    let ended_after = asked.elapsed();
    let fin = final_in(&events)?;
    // Long before c1's two seconds would have run out.
    assert!(ended_after < Duration::from_secs(1), "{ended_after:?}");
    let states: Vec<_> = fin.results.iter().map(|r| r.state).collect();
    assert_eq!(states, vec![CallState::Cancelled; 3], "{fin:?}");
    for result in &fin.results {
        let error = result
            .error
            .as_ref()
            .context("a cancelled call has an error")?;
        assert_eq!(error.code, codes::CANCELLED);
        assert!(!error.retryable);
    }
    assert_eq!(fin.summary.cancelled, 3);
    assert!(!fin.deadline_hit);
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, TurnEvent::Final(_)))
            .count(),
        1
    );
    // The model is told what happened to every call.
    let history = serde_json::to_string(&fin.history.openai)?;
    assert_eq!(
        history.matches("cancelled by the caller").count(),
        3,
        "{history}"
    );

    // The running tool saw its token fire.
    let until = Instant::now() + EVENT_WAIT;
    while !toolfleet_packs::testing::saw_cancellation(turn_id, "c1") {
        anyhow::ensure!(Instant::now() < until, "c1 never saw the cancellation");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The held calls never started, and nothing was recorded after the final (c1's
    // result was dropped by its worker, so none arrived late).
    let starts = starts_of(&mut progress, turn_id, Duration::from_millis(2_500)).await;
    assert_eq!(starts.get("c2"), None, "{starts:?}");
    assert_eq!(starts.get("c3"), None, "{starts:?}");
    let mut redis = fleet
        .redis
        .client()?
        .get_multiplexed_async_connection()
        .await?;
    let (late, results): (Option<u64>, u64) = redis::pipe()
        .hget(fleet.names.turn_meta_key(turn_id), "late")
        .hlen(fleet.names.turn_results_key(turn_id))
        .query_async(&mut redis)
        .await?;
    assert_eq!(late, Some(0));
    assert_eq!(results, 0);

    // Cancelling again changes nothing and says how the turn ended.
    let again = fleet.client.cancel(turn_id, None, EVENT_WAIT).await?;
    assert_eq!(again.outcome, CancelOutcome::AlreadyEnded);
    assert_eq!(again.ended.as_deref(), Some("cancelled"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_finished_and_other_tenants_turns_are_answered_clearly() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;

    let unknown = fleet
        .client
        .cancel("never-submitted", None, EVENT_WAIT)
        .await?;
    assert_eq!(unknown.outcome, CancelOutcome::UnknownTurn);

    let request = named_turn(
        "cancel-finished",
        "acme",
        10_000,
        vec![call("c1", "test.behave", json!({"value": 1}))],
    );
    let done = fleet.client.run_turn(request, EVENT_WAIT).await?;
    assert_eq!(done.final_event.results[0].state, CallState::Done);
    let finished = fleet
        .client
        .cancel("cancel-finished", Some("acme"), EVENT_WAIT)
        .await?;
    assert_eq!(finished.outcome, CancelOutcome::AlreadyEnded);
    assert_eq!(finished.ended.as_deref(), Some("complete"));

    // A running turn of tenant acme: a cancel naming another tenant finds nothing and
    // changes nothing.
    let request = one_sleeping_call("cancel-other-tenant", 10_000, 300);
    let mut stream = fleet.client.submit(request).await?;
    let ack = stream.next_event(EVENT_WAIT).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
    let foreign = fleet
        .client
        .cancel("cancel-other-tenant", Some("globex"), EVENT_WAIT)
        .await?;
    assert_eq!(foreign.outcome, CancelOutcome::UnknownTurn);
    let fin = final_in(&read_to_end(&mut stream, EVENT_WAIT).await?)?;
    assert_eq!(fin.results[0].state, CallState::Done);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_racing_the_last_result_ends_the_turn_once() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let (mut cancelled, mut complete) = (0, 0);
    for i in 0..30u64 {
        let turn_id = format!("race-{i}");
        let request = one_sleeping_call(&turn_id, 10_000, 20);
        let mut stream = fleet.client.submit(request).await?;
        let ack = stream.next_event(EVENT_WAIT).await?;
        assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
        // Around the moment the call's result comes back.
        tokio::time::sleep(Duration::from_millis(10 + i % 25)).await;
        let reply = fleet.client.cancel(&turn_id, None, EVENT_WAIT).await?;
        let events = read_to_end(&mut stream, EVENT_WAIT).await?;
        let fin = final_in(&events)?;
        let finals = events
            .iter()
            .filter(|e| matches!(e, TurnEvent::Final(_)))
            .count();
        assert_eq!(finals, 1, "{turn_id}: {events:?}");
        // The stored turn holds that one final too.
        let mut attached = fleet.client.attach(&turn_id).await?;
        let replayed = read_to_end(&mut attached, EVENT_WAIT).await?;
        assert_eq!(final_in(&replayed)?, fin, "{turn_id}");
        match (reply.outcome, fin.results[0].state) {
            (CancelOutcome::Cancelled, CallState::Cancelled) => cancelled += 1,
            (CancelOutcome::AlreadyEnded, CallState::Done) => {
                assert_eq!(reply.ended.as_deref(), Some("complete"));
                complete += 1;
            }
            other => bail!("{turn_id}: cancel answer and final disagree: {other:?}"),
        }
    }
    assert_eq!(cancelled + complete, 30);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_on_toolfleet_submit_cancels_the_turn() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let cli = checkout_cli().await?;
    let dir = tempfile::tempdir()?;
    let decision = dir.path().join("decision.json");
    std::fs::write(
        &decision,
        json!({"type": "tool_calls", "calls": [
            {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 5_000}}
        ]})
        .to_string(),
    )?;
    let mut child = toolfleet_tests::child_command(cli, Stdio::piped())
        .arg("submit")
        .arg(&decision)
        .args(["--tenant", "acme", "--deadline-ms", "20000"])
        .envs(fleet.servers_env())
        .spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    // `turn <id>` comes first, then the events; wait for the ack's line.
    let mut turn_id = None;
    let until = tokio::time::Instant::now() + EVENT_WAIT;
    while let Ok(Ok(Some(line))) = tokio::time::timeout_at(until, lines.next_line()).await {
        if let Some(id) = line.strip_prefix("turn ") {
            turn_id = Some(id.trim().to_string());
        } else if turn_id.is_some() && line.contains("ack") {
            break;
        }
    }
    let turn_id = turn_id.context("toolfleet submit printed no turn id")?;
    let pid = child.id().context("no pid")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGINT,
    )?;
    let mut rest = Vec::new();
    while let Ok(Ok(Some(line))) =
        tokio::time::timeout_at(tokio::time::Instant::now() + EVENT_WAIT, lines.next_line()).await
    {
        rest.push(line);
    }
    let status = tokio::time::timeout(EVENT_WAIT, child.wait())
        .await
        .context("toolfleet submit did not exit after Ctrl-C")??;
    assert!(status.success(), "{status}: {rest:?}");

    let mut attached = fleet.client.attach(&turn_id).await?;
    let fin = final_in(&read_to_end(&mut attached, EVENT_WAIT).await?)?;
    assert_eq!(fin.results[0].state, CallState::Cancelled, "{fin:?}");
    Ok(())
}
