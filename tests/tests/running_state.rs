//! A call is announced `running` once it has run for its worker's `running_after`
//! (`TOOLFLEET_RUNNING_AFTER_MS`): an instant call sends no `started` notice and goes
//! from `pending` to `done`; a call that runs longer sends its notice, and its frontend
//! sees `running` before `done`. Every call still gets its terminal state and result.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::{CallState, TurnEvent};
use toolfleet_tests::fleet::{call, read_to_end, tool_calls, turn, Fleet};
use toolfleet_worker::WorkerConfig;

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_call_that_outlives_the_delay_is_announced_running() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let config = WorkerConfig {
        running_after: WorkerConfig::local().running_after,
        ..fleet.worker_config()
    };
    assert!(
        !config.running_after.is_zero(),
        "the default delays the notice"
    );
    let _coordinator = fleet.coordinator(fleet.coordinator_config());
    let _worker = fleet.worker(config, tools);
    fleet.wait_for_tools(&["test.noop", "test.behave"]).await?;
    let mut progress = fleet.subscribe_progress().await?;

    let calls = vec![
        call("instant", "test.noop", json!({})),
        call(
            "slow",
            "test.behave",
            json!({"sleep_ms": 1000, "value": "v"}),
        ),
    ];
    let mut stream = fleet.client.submit(turn("acme", tool_calls(calls))).await?;
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;

    let mut states: BTreeMap<String, Vec<CallState>> = BTreeMap::new();
    for event in &events {
        if let TurnEvent::ToolState {
            tool_call_id,
            state,
            ..
        } = event
        {
            states.entry(tool_call_id.clone()).or_default().push(*state);
        }
    }
    let instant_states = [CallState::Pending, CallState::Done];
    let slow_states = [CallState::Pending, CallState::Running, CallState::Done];
    if states.get("instant").map(Vec::as_slice) != Some(instant_states.as_slice())
        || states.get("slow").map(Vec::as_slice) != Some(slow_states.as_slice())
    {
        // Where the results went: stored, delivered to the coordinator, acked.
        let streams = fleet.describe_streams().await;
        panic!("call states {states:?}\nevents {events:?}\n{streams}");
    }
    assert_eq!(
        states.get("instant").map(Vec::as_slice),
        Some([CallState::Pending, CallState::Done].as_slice()),
        "{events:?}"
    );
    assert_eq!(
        states.get("slow").map(Vec::as_slice),
        Some([CallState::Pending, CallState::Running, CallState::Done].as_slice()),
        "{events:?}"
    );
    let Some(TurnEvent::Final(fin)) = events.last() else {
        anyhow::bail!("no final last: {events:?}");
    };
    assert_eq!((fin.summary.total, fin.summary.ok), (2, 2), "{fin:?}");

    // The notices themselves: one for the slow call, none for the instant one.
    let mut started = Vec::new();
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(300), progress.next()).await
    {
        if let Ok(ProgressNotice::Started { tool_call_id, .. }) =
            serde_json::from_slice(&message.payload)
        {
            started.push(tool_call_id);
        }
    }
    assert_eq!(started, ["slow"]);
    Ok(())
}
