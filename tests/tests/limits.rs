//! Limits that refuse with a clear code instead of failing the whole turn or growing
//! without bound: a call whose arguments are too large for the NATS server fails alone
//! (`arguments_too_large`), a turn context over the limit refuses its turn
//! (`context_too_large`), and a burst beyond the turns a replica may follow is refused
//! with `overloaded` while every accepted turn still ends with its `final`; a burst
//! wider than the requests a replica takes in at once waits, and every turn ends.

use std::time::Duration;

use serde_json::{json, Value};
use toolfleet_common::call::codes;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::TurnEvent;
use toolfleet_coordinator::CoordinatorConfig;
use toolfleet_tests::fleet::{
    assert_one_error, call, code_at, read_to_end, result_of, sleeping_calls, timed_turn, turn,
    Fleet, Running,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// The burst of 10,000 turns loads the shared servers and both cores for seconds; a turn
/// of another test beside it could miss its deadline. The burst holds this for writing,
/// every other test for reading.
static BURST: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_too_large_for_the_server_fails_alone() -> anyhow::Result<()> {
    let _beside_the_burst = BURST.read().await;
    let fleet = Fleet::start_with_nats_config("max_payload: 1MB").await?;
    assert_eq!(fleet.client.nats().server_info().max_payload, 1024 * 1024);
    let _nodes = fleet.start_default().await?;
    let huge = "x".repeat(3 * 1024 * 1024);
    let calls = vec![
        call("first", "test.behave", json!({"value": "one"})),
        call("huge", "test.behave", json!({"value": huge})),
        call("last", "test.behave", json!({"value": "two"})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!(code_at(fin, "huge")?, Some(codes::ARGUMENTS_TOO_LARGE));
    assert!(result_of(fin, "first")?.ok && result_of(fin, "last")?.ok);
    assert_eq!((fin.summary.ok, fin.summary.errors), (2, 1));

    // The same in the OpenAI shape, where arguments are JSON text.
    let decision = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "big", "type": "function", "function": {
            "name": "test__behave",
            "arguments": json!({"value": "y".repeat(2 * 1024 * 1024)}).to_string()}},
        {"id": "fine", "type": "function", "function": {
            "name": "test__behave", "arguments": "{\"value\": 1}"}},
    ]});
    let outcome = fleet.run(turn("acme", decision), EVENT_WAIT).await?;
    assert_one_error(
        &outcome.final_event,
        "big",
        codes::ARGUMENTS_TOO_LARGE,
        "fine",
    )?;
    Ok(())
}

/// A fresh fleet whose coordinator runs with the settings `tune` makes, beside a worker
/// of the testing tools, once `serving` is listed.
async fn tuned_fleet(
    tune: impl FnOnce(&mut CoordinatorConfig),
    serving: &str,
) -> anyhow::Result<(Fleet, (Running, Running))> {
    let fleet = Fleet::start().await?;
    let mut config = fleet.coordinator_config();
    tune(&mut config);
    let tools = toolfleet_packs::testing::tools();
    let nodes = fleet.start_with(config, tools, &[serving]).await?;
    Ok((fleet, nodes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_over_the_limit_refuses_its_turn() -> anyhow::Result<()> {
    let _beside_the_burst = BURST.read().await;
    let tune = |config: &mut CoordinatorConfig| config.max_context_bytes = 4096;
    let (fleet, _nodes) = tuned_fleet(tune, "test.behave").await?;
    let calls = vec![call("a", "test.behave", json!({"value": 1}))];

    let mut request = timed_turn("acme", 5000, calls.clone());
    request
        .context
        .insert("notes".into(), Value::String("n".repeat(8192)));
    let mut stream = fleet.client.submit(request).await?;
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    match events.as_slice() {
        [TurnEvent::Error { error, .. }] => {
            assert_eq!(error.code, turn_codes::CONTEXT_TOO_LARGE);
            assert!(!error.retryable);
        }
        other => anyhow::bail!("expected one error event, got {other:?}"),
    }

    // A context within the limit runs (the deadline leaves room for the burst test
    // beside it on a small machine).
    let mut request = timed_turn("acme", 9000, calls);
    request.context.insert("customer".into(), json!("c-1"));
    let outcome = fleet.run(request, EVENT_WAIT).await?;
    assert_eq!(code_at(&outcome.final_event, "a")?, None);
    Ok(())
}

/// How a submitted turn of the burst ended.
#[derive(Debug, PartialEq, Eq)]
enum Ending {
    /// Every call done, in its `final`.
    Final,
    /// Refused at once with `overloaded`.
    Overloaded,
}

/// A burst of `turns` turns submitted at once, each in a task of its own: turn `i` of
/// `calls(i)` with a deadline of `deadline_ms`, read to its end (for as long), and its
/// last event judged by `ending`.
fn burst<T: Send + 'static>(
    fleet: &Fleet,
    turns: usize,
    deadline_ms: u64,
    calls: impl Fn(usize) -> Vec<Value>,
    ending: impl Fn(usize, Option<&TurnEvent>) -> anyhow::Result<T> + Copy + Send + 'static,
) -> tokio::task::JoinSet<anyhow::Result<T>> {
    let mut burst = tokio::task::JoinSet::new();
    for i in 0..turns {
        let client = fleet.client.clone();
        let request = timed_turn("acme", deadline_ms, calls(i));
        burst.spawn(async move {
            let mut stream = client.submit(request).await?;
            let events = read_to_end(&mut stream, Duration::from_millis(deadline_ms)).await?;
            ending(i, events.last())
        });
    }
    burst
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_the_bound_is_refused_with_overloaded() -> anyhow::Result<()> {
    let _alone = BURST.write().await;
    const TURNS: usize = 10_000;
    const BOUND: usize = 200;
    let tune = |config: &mut CoordinatorConfig| config.max_turns_in_progress = BOUND;
    let (fleet, _nodes) = tuned_fleet(tune, "test.behave").await?;

    let calls = |i| sleeping_calls([i], 300);
    let mut turns = burst(&fleet, TURNS, 60_000, calls, |i, last| match last {
        Some(TurnEvent::Final(fin)) if fin.results.iter().all(|r| r.ok) => Ok(Ending::Final),
        Some(TurnEvent::Error { error, .. })
            if error.code == turn_codes::OVERLOADED && error.retryable =>
        {
            Ok(Ending::Overloaded)
        }
        other => anyhow::bail!("turn {i} ended otherwise: {other:?}"),
    });
    let (mut finals, mut overloaded) = (0, 0);
    let all = tokio::time::timeout(Duration::from_secs(240), async {
        while let Some(joined) = turns.join_next().await {
            match joined?? {
                Ending::Final => finals += 1,
                Ending::Overloaded => overloaded += 1,
            }
        }
        anyhow::Ok(())
    })
    .await;
    all.map_err(|_| anyhow::anyhow!("the burst did not end in 240 s"))??;
    assert_eq!(finals + overloaded, TURNS);
    assert!(overloaded > 0, "no turn was refused");
    // How many of the burst get in depends on how it interleaves with the turns that
    // finish and with resubmissions being answered (both hold slots), which varies with
    // the machine's load; the bound shows in the refusals, and accepted turns end.
    assert!(finals > 0, "no turn was accepted");

    // Once the burst is over the replica takes turns again.
    let after = vec![call("after", "test.behave", json!({"value": "after"}))];
    let outcome = fleet.run_calls("acme", after, EVENT_WAIT).await?;
    assert!(result_of(&outcome.final_event, "after")?.ok);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_wider_than_the_intake_waits_and_every_turn_ends() -> anyhow::Result<()> {
    let _beside_the_burst = BURST.read().await;
    const TURNS: usize = 200;
    // One request taken in at a time: the other 199 wait in the subscription.
    let tune = |config: &mut CoordinatorConfig| config.intake_concurrency = 1;
    let (fleet, _nodes) = tuned_fleet(tune, "test.noop").await?;

    let calls = |i| vec![call(&format!("c{i}"), "test.noop", json!({}))];
    let mut turns = burst(&fleet, TURNS, 30_000, calls, |i, last| match last {
        Some(TurnEvent::Final(fin)) if fin.summary.ok == 1 => anyhow::Ok(()),
        other => anyhow::bail!("turn {i} ended otherwise: {other:?}"),
    });
    let mut finals = 0;
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(joined) = turns.join_next().await {
            joined??;
            finals += 1;
        }
        anyhow::Ok(())
    })
    .await
    .map_err(|_| anyhow::anyhow!("the burst did not end in 60 s"))??;
    assert_eq!(finals, TURNS);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streams_on_the_server_are_bounded_and_refuse_new_messages_when_full(
) -> anyhow::Result<()> {
    let _beside_the_burst = BURST.read().await;
    use async_nats::jetstream::stream::DiscardPolicy;
    use toolfleet_common::streams::{MAX_BYTES, MAX_MESSAGE_SIZE};
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let js = async_nats::jetstream::new(fleet.client.nats().clone());
    for name in [fleet.names.jobs_stream(), fleet.names.results_stream()] {
        let mut stream = js.get_stream(&name).await?;
        let config = &stream.info().await?.config;
        assert_eq!(config.max_bytes, MAX_BYTES, "{name}");
        assert_eq!(config.max_message_size, MAX_MESSAGE_SIZE, "{name}");
        assert_eq!(config.discard, DiscardPolicy::New, "{name}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_type_decision_cannot_take_another_turns_id() -> anyhow::Result<()> {
    let _beside_the_burst = BURST.read().await;
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let calls = vec![call("a", "test.behave", json!({"value": 1}))];
    let first = fleet
        .run(timed_turn("acme", 5000, calls), EVENT_WAIT)
        .await?;
    let taken = first.final_event.turn_id.clone();

    // Another tenant's no-tool answer under that id is refused, not sent anywhere.
    let mut answer = turn(
        "globex",
        json!({"type": "final", "text": "Please read me the full card number."}),
    );
    answer.turn_id = Some(taken);
    let mut stream = fleet.client.submit(answer).await?;
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    match events.as_slice() {
        [TurnEvent::Error { error, .. }] => assert_eq!(error.code, turn_codes::DUPLICATE_TURN),
        other => anyhow::bail!("expected duplicate_turn, got {other:?}"),
    }
    Ok(())
}
