//! A call that runs longer than its consumer's ack wait is kept alive by its worker's
//! progress acks: it runs once and is not delivered again while it runs, however many
//! such calls run at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, result_of, Fleet};
use toolfleet_worker::{Tool, ToolContext, ToolOutput};

const TOOL: &str = "test.long";
const EVENT_WAIT: Duration = Duration::from_secs(20);
/// How long each call runs: two and a half times the test fleet's 1 s ack wait.
const RUNS_FOR: Duration = Duration::from_millis(2_500);

/// A tool that runs for [`RUNS_FOR`], counting its runs in `runs`.
fn long(runs: Arc<AtomicU32>) -> Tool {
    Tool::builder(TOOL, "Runs for longer than the ack wait").handler(
        move |_ctx: ToolContext, args: Value| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(RUNS_FOR).await;
                Ok::<_, toolfleet_worker::ToolError>(ToolOutput::new(args))
            }
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_longer_than_the_ack_wait_run_once() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    let runs = Arc::new(AtomicU32::new(0));
    let worker = fleet.worker(fleet.worker_config(), vec![long(Arc::clone(&runs))]);
    fleet.wait_for_tools(&[TOOL]).await?;

    let calls = (0..3)
        .map(|i| call(&format!("c{i}"), TOOL, json!({ "i": i })))
        .collect();
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    for i in 0..3 {
        let result = result_of(&outcome.final_event, &format!("c{i}"))?;
        assert_eq!(result.state, CallState::Done, "{result:?}");
        assert_eq!(result.attempts, 1, "{result:?}");
        assert_eq!(result.result, Some(json!({ "i": i })), "{result:?}");
    }
    // Past the ack wait again: a job delivered twice would have run by now.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    worker.stop().await;
    coordinator.stop().await;
    Ok(())
}
