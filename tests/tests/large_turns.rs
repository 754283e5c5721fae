//! The join's scripts hold a turn as large as the coordinator accepts: a decision may
//! carry 10,000 calls (`TOOLFLEET_MAX_DECISION_CALLS`), and its calls, refused results,
//! first events and queued jobs are written by one `CREATE`, its closing events by one
//! `STORE_FINAL`. Redis's Lua unpacks at most about 8,000 values at once, so the
//! scripts write in slices; this drives them past that on a real Redis.

use anyhow::{bail, Result};
use serde_json::json;
use toolfleet_common::call::unix_ms;
use toolfleet_common::redis_client::{self, RedisConnection};
use toolfleet_common::{CallResult, JobEnvelope, Names, ToolCall};
use toolfleet_coordinator::join::{CallEntry, Created, Emitted, JoinStore, NewTurn, StoredFinal};
use toolfleet_tests::fleet::new_turn;

/// Above what one Lua `unpack` takes: 2 × 5,000 values of calls, as many of results.
const CALLS: usize = 5_000;

fn call(id: &str) -> ToolCall {
    ToolCall {
        id: id.to_string(),
        name: "test.behave".to_string(),
        arguments: json!({}),
        parent_id: None,
    }
}

/// `command key` (`HLEN`, `LLEN`) on `conn`.
async fn size(conn: &mut RedisConnection, command: &str, key: String) -> Result<usize> {
    Ok(redis::cmd(command).arg(key).query_async(conn).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_of_ten_thousand_values_is_created_and_ended() -> Result<()> {
    let server = toolfleet_tests::RedisServer::start().await?;
    let redis = redis_client::connect(&server.url(), Default::default()).await?;
    let names = Names::new("large");
    let store = JoinStore::new(redis.clone(), names.clone());
    let turn_id = "turn-large";
    let keys: Vec<String> = (0..CALLS).map(|k| format!("k{k}")).collect();
    let calls = keys
        .iter()
        .enumerate()
        .map(|(index, key)| {
            let entry = CallEntry {
                index,
                id: format!("c{index}"),
                name: "test.behave".to_string(),
                parent_id: None,
                queued: index >= CALLS / 2,
            };
            (key.clone(), entry)
        })
        .collect();
    // The first half is refused up front (results stored with the turn), the second
    // queued behind a concurrency bound.
    let results = keys[..CALLS / 2]
        .iter()
        .enumerate()
        .map(|(i, key)| {
            (
                key.clone(),
                CallResult::success(&call(&format!("c{i}")), json!(i)),
            )
        })
        .collect();
    let queued = keys[CALLS / 2..]
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let job = JobEnvelope {
                turn_id: turn_id.to_string(),
                tenant_id: "acme".to_string(),
                session_id: None,
                call: call(&format!("c{}", CALLS / 2 + i)),
                deadline_unix_ms: unix_ms() + 60_000,
                timeout_ms: 1000,
                dispatched_unix_ms: 0,
                context: Default::default(),
            };
            (key.clone(), job)
        })
        .collect();
    let events: Vec<String> = (0..=CALLS)
        .map(|seq| json!({"seq": seq}).to_string())
        .collect();
    let new = NewTurn {
        paced: true,
        calls,
        results,
        events,
        queued,
        ..new_turn(turn_id)
    };
    assert_eq!(store.create(new).await?, Created::New);

    let mut conn = redis;
    let calls = size(&mut conn, "HLEN", names.turn_calls_key(turn_id)).await?;
    let results = size(&mut conn, "HLEN", names.turn_results_key(turn_id)).await?;
    let events = size(&mut conn, "LLEN", names.turn_events_key(turn_id)).await?;
    let queue = size(&mut conn, "LLEN", names.turn_queue_key(turn_id)).await?;
    assert_eq!(
        (calls, results, events, queue),
        (CALLS, CALLS / 2, CALLS + 1, CALLS / 2)
    );
    let first_queued: String = redis::cmd("LINDEX")
        .arg(names.turn_queue_key(turn_id))
        .arg(0)
        .query_async(&mut conn)
        .await?;
    assert_eq!(first_queued, format!("k{}", CALLS / 2));

    // More events than one unpack takes, while the turn runs and at its end.
    let many: Vec<String> = (0..9_000).map(|i| json!({"more": i}).to_string()).collect();
    match store.emit(turn_id, None, &many).await? {
        Emitted::Stored { first_seq, .. } => assert_eq!(first_seq, CALLS as u64 + 2),
        other => bail!("EMIT: {other:?}"),
    }
    match store.store_final(turn_id, &many).await? {
        StoredFinal::Stored { first_seq, .. } => {
            assert_eq!(first_seq, CALLS as u64 + 2 + 9_000);
        }
        other => bail!("STORE_FINAL: {other:?}"),
    }
    let events = size(&mut conn, "LLEN", names.turn_events_key(turn_id)).await?;
    assert_eq!(events, CALLS + 1 + 2 * 9_000);
    Ok(())
}
