//! Graceful drain on SIGTERM: a worker process finishes and acks the call it is running
//! while new jobs go to another worker, hands a call still running at the end of its
//! grace back so another worker answers it at once, and a coordinator process leaves its turns in
//! flight to another replica, which finishes them before their deadline.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;
use toolfleet_common::client::TurnStream;
use toolfleet_common::{CallState, FinalEvent, FleetClient, TurnRequest};
use toolfleet_packs as packs;
use toolfleet_tests::eventually_named;
use toolfleet_tests::fleet::{
    call, read_ack, read_final, result_of, timed_turn, until_state, Fleet, Running,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);
const EXIT_WAIT: Duration = Duration::from_secs(20);

/// Waits until every job of `fleet`'s jobs stream is acked and gone.
async fn jobs_all_acked(fleet: &Fleet, tools: &[&str]) -> Result<()> {
    let js = async_nats::jetstream::new(fleet.client.nats().clone());
    let stream_name = fleet.names.jobs_stream();
    let consumers: Vec<String> = tools.iter().map(|t| fleet.names.tool_consumer(t)).collect();
    eventually_named("every job acked", Duration::from_secs(10), || {
        let js = js.clone();
        let stream_name = stream_name.clone();
        let consumers = consumers.clone();
        async move {
            let mut stream = js.get_stream(&stream_name).await.ok()?;
            if stream.info().await.ok()?.state.messages != 0 {
                return None;
            }
            for name in &consumers {
                let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                    stream.get_consumer(name).await.ok()?;
                let info = consumer.info().await.ok()?;
                if info.num_ack_pending != 0 || info.num_pending != 0 {
                    return None;
                }
            }
            Some(())
        }
    })
    .await
}

/// Waits until the registry lists `worker_id` as a live worker of `tool`.
async fn worker_live(fleet: &Fleet, tool: &str, worker_id: &str) -> Result<()> {
    let client = fleet.redis.client()?;
    let key = fleet.names.tool_workers_key(tool);
    eventually_named("the second worker registered", EVENT_WAIT, || {
        let client = client.clone();
        let key = key.clone();
        async move {
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            let score: Option<f64> = redis::cmd("ZSCORE")
                .arg(&key)
                .arg(worker_id)
                .query_async(&mut conn)
                .await
                .ok()?;
            score.map(|_| ())
        }
    })
    .await
}

/// A fleet with one coordinator and the worker `draining` (started with `env` besides
/// its id) running the call `id` of `tool` (sleeping `sleep_ms`, in a turn of 30 s),
/// then a second worker `successor` serving `tool` too: the fleet, its coordinator, the
/// draining worker's pid and the turn's stream.
async fn running_beside_a_successor(
    tool: &str,
    id: &str,
    sleep_ms: u64,
    env: &[(&str, &str)],
) -> Result<(Fleet, Running, u32, TurnStream)> {
    let mut fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    let env = [&[("TOOLFLEET_WORKER_ID", "draining")][..], env].concat();
    let draining = fleet.spawn_node("worker", &env)?;
    fleet.wait_for_tools(&[tool]).await?;
    let running = call(id, tool, json!({ "sleep_ms": sleep_ms }));
    let mut stream = fleet.submit_calls("acme", 30_000, vec![running]).await?;
    until_state(&mut stream, Some(id), CallState::Running, EVENT_WAIT).await?;
    fleet.spawn_node("worker", &[("TOOLFLEET_WORKER_ID", "successor")])?;
    worker_live(&fleet, tool, "successor").await?;
    Ok((fleet, coordinator, draining, stream))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_worker_finishes_its_call_and_takes_no_new_jobs() -> Result<()> {
    const TOOL: &str = "test.behave_once";
    const SLEEP_MS: u64 = 4000;
    let env = [("TOOLFLEET_SHUTDOWN_GRACE_MS", "15000")];
    let (mut fleet, _coordinator, draining, mut in_flight) =
        running_beside_a_successor(TOOL, "in-flight", SLEEP_MS, &env).await?;

    let client = fleet.client.clone();
    let signalled = Instant::now();
    let after_signal = async move {
        // Past the drained worker's last pull request, well before its call ends.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let after = call("after-signal", TOOL, json!({"sleep_ms": 10}));
        submit_and_finish(&client, timed_turn("acme", 20_000, vec![after])).await
    };
    let (terminated, later) = tokio::join!(fleet.terminate_node(draining, EXIT_WAIT), after_signal);
    terminated.context("the worker did not exit after SIGTERM")?;
    let exited_after = signalled.elapsed();

    let fin = read_final(&mut in_flight, EVENT_WAIT).await?;
    let r = result_of(&fin, "in-flight")?;
    assert_eq!(r.state, CallState::Done, "{r:?}");
    assert_eq!(r.attempts, 1, "the call ran again: {r:?}");
    assert_eq!(r.worker_id.as_deref(), Some("draining"));
    assert!(r.duration_ms >= SLEEP_MS);
    assert!(!fin.deadline_hit);
    assert!(
        exited_after < Duration::from_millis(SLEEP_MS + 5000),
        "the worker took {exited_after:?} to exit"
    );

    let later = later?;
    let r = result_of(&later, "after-signal")?;
    assert_eq!(r.state, CallState::Done, "{r:?}");
    assert_eq!(r.worker_id.as_deref(), Some("successor"));

    jobs_all_acked(&fleet, &[TOOL]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_running_past_the_grace_is_handed_back_and_answered_by_another_worker() -> Result<()>
{
    const TOOL: &str = "test.behave";
    const SLEEP_MS: u64 = 3000;
    const GRACE_MS: u64 = 1000;
    // The first worker creates the consumers: an ack wait far longer than the test, so
    // only a hand-back (NAK) can bring the call to the successor in time.
    let env = [
        ("TOOLFLEET_SHUTDOWN_GRACE_MS", "1000"),
        ("TOOLFLEET_ACK_WAIT_MS", "60000"),
    ];
    let (mut fleet, _coordinator, draining, mut stream) =
        running_beside_a_successor(TOOL, "slow", SLEEP_MS, &env).await?;

    let signalled = Instant::now();
    fleet.terminate_node(draining, EXIT_WAIT).await?;
    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    let answered = signalled.elapsed();
    let r = result_of(&fin, "slow")?;
    assert_eq!(r.state, CallState::Done, "{r:?}");
    assert_eq!(r.worker_id.as_deref(), Some("successor"), "{r:?}");
    assert_eq!(r.attempts, 2, "{r:?}");
    let bound = Duration::from_millis(GRACE_MS + SLEEP_MS + 1500);
    eprintln!("answered {answered:?} after SIGTERM");
    assert!(answered < bound, "answered {answered:?} after SIGTERM");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_coordinator_leaves_its_turns_to_another_replica() -> Result<()> {
    const TURNS: usize = 3;
    // Long enough that the replica's start, its pulls and the first one's exit fit well
    // inside the calls on a loaded machine: the coordinator must exit while they run.
    const SLEEP_MS: u64 = 10_000;
    const DEADLINE_MS: u64 = 30_000;
    let mut fleet = Fleet::start().await?;
    let tools = packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    let _worker = fleet.worker(fleet.worker_config(), tools);
    let first = fleet.spawn_node("coordinator", &[("TOOLFLEET_SHUTDOWN_GRACE_MS", "200")])?;
    fleet.wait_for_tools(&["test.behave"]).await?;

    let submitted = Instant::now();
    let mut streams = Vec::new();
    for n in 0..TURNS {
        let calls = ["a", "b"].map(|c| {
            call(
                &format!("t{n}-{c}"),
                "test.behave",
                json!({"sleep_ms": SLEEP_MS}),
            )
        });
        let request = timed_turn("acme", DEADLINE_MS, calls.to_vec());
        let mut stream = fleet.client.submit(request).await?;
        read_ack(&mut stream, EVENT_WAIT).await?;
        streams.push(stream);
    }

    let _second = fleet.coordinator(fleet.coordinator_config());
    results_pulled_by_two(&fleet).await?;

    let client = fleet.client.clone();
    let during_drain = async move {
        let during = call("during-drain", "test.noop", json!({}));
        submit_and_finish(&client, timed_turn("acme", DEADLINE_MS, vec![during])).await
    };
    let (terminated, drained_turn) =
        tokio::join!(fleet.terminate_node(first, EXIT_WAIT), during_drain);
    terminated.context("the coordinator did not exit after SIGTERM")?;
    assert!(
        submitted.elapsed() < Duration::from_millis(SLEEP_MS),
        "the coordinator exited only after its calls had ended"
    );

    for mut stream in streams {
        let fin = read_final(&mut stream, Duration::from_millis(SLEEP_MS) + EVENT_WAIT).await?;
        assert!(!fin.deadline_hit, "{fin:?}");
        assert_eq!(fin.summary.ok, 2, "{fin:?}");
    }
    assert!(
        submitted.elapsed() < Duration::from_millis(SLEEP_MS + 5000),
        "the turns ended only after {:?}",
        submitted.elapsed()
    );
    let drained_turn = drained_turn?;
    assert_eq!(drained_turn.summary.ok, 1, "{drained_turn:?}");
    Ok(())
}

/// Submits `request` and reads it to `final`.
async fn submit_and_finish(client: &FleetClient, request: TurnRequest) -> Result<FinalEvent> {
    read_final(&mut client.submit(request).await?, EVENT_WAIT).await
}

/// Waits until two replicas have pull requests waiting on the results consumer.
async fn results_pulled_by_two(fleet: &Fleet) -> Result<()> {
    let js = async_nats::jetstream::new(fleet.client.nats().clone());
    let stream_name = fleet.names.results_stream();
    let consumer_name = fleet.names.results_consumer();
    eventually_named("two replicas pulling results", EVENT_WAIT, || {
        let js = js.clone();
        let stream_name = stream_name.clone();
        let consumer_name = consumer_name.clone();
        async move {
            let stream = js.get_stream(&stream_name).await.ok()?;
            let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                stream.get_consumer(&consumer_name).await.ok()?;
            let info = consumer.info().await.ok()?;
            (info.num_waiting >= 2).then_some(())
        }
    })
    .await
}
