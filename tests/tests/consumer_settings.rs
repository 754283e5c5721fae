//! A tool's JetStream consumer follows the tool's definition: a retry policy changed
//! between two worker starts is in force on the second start, so every attempt it
//! allows runs instead of the job stalling at the old `max_deliver`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_tests::fleet::{call, Fleet};
use toolfleet_worker::{Tool, ToolContext, ToolError, ToolOutput};

const TOOL: &str = "test.always_flaky";
const EVENT_WAIT: Duration = Duration::from_secs(15);

/// An idempotent tool allowing `max_attempts` deliveries that fails retryably every
/// time, counting its runs in `runs`.
fn always_flaky(max_attempts: u32, runs: Arc<AtomicU32>) -> Tool {
    Tool::builder(TOOL, "Fails with a retryable error every time")
        .idempotent(max_attempts)
        .handler(move |_ctx: ToolContext, _args: Value| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Err::<ToolOutput, _>(ToolError::retryable("flaky", "failed again")) }
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_retry_policy_is_in_force_on_the_next_start() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());

    let first_runs = Arc::new(AtomicU32::new(0));
    let first = fleet.worker(fleet.worker_config(), vec![always_flaky(2, first_runs)]);
    fleet.wait_for_tools(&[TOOL]).await?;
    assert_eq!(fleet.consumer_max_deliver(TOOL).await?, 2);
    first.stop().await;
    fleet.wait_for_tool_gone(TOOL).await?;

    let runs = Arc::new(AtomicU32::new(0));
    let second = fleet.worker(
        fleet.worker_config(),
        vec![always_flaky(3, Arc::clone(&runs))],
    );
    fleet
        .assert_gives_up_after(TOOL, 3, "flaky", EVENT_WAIT)
        .await?;
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    second.stop().await;
    coordinator.stop().await;
    Ok(())
}

/// The settings of `tool`'s consumer as the server has them.
async fn consumer_config(
    js: &async_nats::jetstream::Context,
    names: &toolfleet_common::Names,
    tool: &str,
) -> anyhow::Result<async_nats::jetstream::consumer::Config> {
    let stream = js.get_stream(names.jobs_stream()).await?;
    Ok(stream
        .consumer_info(names.tool_consumer(tool))
        .await?
        .config
        .clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_puts_back_a_consumer_changed_behind_its_back() -> anyhow::Result<()> {
    use async_nats::jetstream::consumer;
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let js = async_nats::jetstream::new(fleet.client.nats().clone());
    let tool = "test.behave";
    let before = consumer_config(&js, &fleet.names, tool).await?;

    // What a stalling worker would set: one delivery, one job at a time, an hour's wait.
    let stream = js.get_stream(fleet.names.jobs_stream()).await?;
    let changed: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(fleet.names.tool_consumer(tool)),
            filter_subject: fleet.names.job_subject(tool),
            ack_wait: before.ack_wait,
            max_deliver: 1,
            max_ack_pending: 1,
            ..Default::default()
        })
        .await?;
    // The server's answer to the change (the coordinator may put it back at any moment
    // after, so the consumer is not read again here).
    assert_eq!(changed.cached_info().config.max_ack_pending, 1);

    toolfleet_tests::eventually_named("the consumer put back", EVENT_WAIT, || {
        let (js, names) = (js.clone(), fleet.names.clone());
        let before = before.clone();
        async move {
            let now = consumer_config(&js, &names, tool).await.ok()?;
            (now.max_deliver == before.max_deliver && now.max_ack_pending == before.max_ack_pending)
                .then_some(())
        }
    })
    .await?;

    // Eight calls at once all run (one at a time they would queue behind each other).
    let calls = (0..8)
        .map(|i| call(&format!("c{i}"), tool, json!({"sleep_ms": 300, "value": i})))
        .collect();
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    assert_eq!(outcome.final_event.summary.ok, 8);
    Ok(())
}
