//! A call's result counts once: the first one recorded wins, later copies only bump
//! the turn's `duplicates` counter, and a result for a call the turn does not have
//! changes nothing.

use std::time::Duration;

use async_nats::HeaderMap;
use serde_json::{json, Value};
use toolfleet_common::names::HEADER_MSG_ID;
use toolfleet_common::{CallState, TurnEvent};
use toolfleet_tests::eventually_named;
use toolfleet_tests::fleet::{
    call, call_ids, final_of, forged_result, read_ack, read_to_end, result_of, timed_turn,
    value_at, Fleet,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);
const SLEEP_MS: u64 = 1500;

fn forged(id: &str, value: Value) -> anyhow::Result<Vec<u8>> {
    forged_result(id, "test.behave", value, "forger")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_result_wins_and_copies_are_counted() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let js = async_nats::jetstream::new(fleet.client.nats().clone());

    let calls = ["a", "b"].map(|id| {
        call(
            id,
            "test.behave",
            json!({"sleep_ms": SLEEP_MS, "value": "real"}),
        )
    });
    let request = timed_turn("acme", 5000, calls.to_vec());
    let mut stream = fleet.client.submit(request).await?;
    let turn_id = stream.turn_id().to_string();
    let subject = fleet.names.result_subject(&turn_id);
    read_ack(&mut stream, EVENT_WAIT).await?;

    // A forged result for `a`, without a message id, is recorded first.
    js.publish(subject.clone(), forged("a", json!({"forged": 1}))?.into())
        .await?
        .await?;
    eventually_named("the forged result to be recorded", EVENT_WAIT, || {
        let fleet = &fleet;
        let turn_id = turn_id.as_str();
        async move {
            let recorded = fleet.recorded_results(turn_id).await.ok()?;
            recorded.contains_key("a").then_some(())
        }
    })
    .await?;

    // A second copy with a message id of its own, then a result for a call the turn
    // does not have.
    let mut headers = HeaderMap::new();
    headers.insert(HEADER_MSG_ID, "forged-copy");
    js.publish_with_headers(
        subject.clone(),
        headers,
        forged("a", json!({"forged": 2}))?.into(),
    )
    .await?
    .await?;
    js.publish(
        subject.clone(),
        forged("ghost", json!({"forged": 3}))?.into(),
    )
    .await?
    .await?;

    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    let fin = final_of(&events)?;
    assert!(!fin.deadline_hit);
    assert_eq!(call_ids(fin), ["a", "b"]);
    let a = result_of(fin, "a")?;
    assert_eq!(a.result, Some(json!({"forged": 1})));
    assert_eq!(a.worker_id.as_deref(), Some("forger"));
    let b = result_of(fin, "b")?;
    assert!(b.ok);
    assert_eq!(value_at(b, "/value"), Some(json!("real")));
    assert_eq!((fin.summary.total, fin.summary.ok), (2, 2));
    assert_eq!(fin.history.openai.len(), 2);

    // `a` was reported done once.
    let a_done = events
        .iter()
        .filter(|e| {
            matches!(e, TurnEvent::ToolState { tool_call_id, state: CallState::Done, .. }
                if tool_call_id == "a")
        })
        .count();
    assert_eq!(a_done, 1);

    // The copy and the worker's real answer for `a` are duplicates.
    fleet
        .wait_for_counter(&turn_id, "duplicates", "2", EVENT_WAIT)
        .await?;

    // Every result was consumed and acked; the ghost left no trace.
    eventually_named("the results consumer to drain", EVENT_WAIT, || {
        let js = js.clone();
        let stream_name = fleet.names.results_stream();
        let consumer_name = fleet.names.results_consumer();
        async move {
            let stream = js.get_stream(stream_name).await.ok()?;
            let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                stream.get_consumer(&consumer_name).await.ok()?;
            let info = consumer.info().await.ok()?;
            (info.num_pending == 0 && info.num_ack_pending == 0).then_some(())
        }
    })
    .await?;
    let counters = fleet.counters(&turn_id).await?;
    assert_eq!(counters.get("late").map(String::as_str), Some("0"));
    assert_eq!(counters.get("duplicates").map(String::as_str), Some("2"));
    // Once the `final` (which holds `a`'s first result, above) is stored, the turn keeps
    // no result body, only which calls had theirs: enough to tell a copy from a late
    // result.
    let results = fleet.hash(fleet.names.turn_results_key(&turn_id)).await?;
    assert!(results.is_empty(), "{results:?}");
    assert_eq!(fleet.recorded_calls(&turn_id).await?, ["a", "b"]);
    Ok(())
}
