//! A turn's closing events built ahead ride on the `RECORD` of the result that
//! completes the turn, and are stored only when every other stored result is the one
//! they were built from: on a real Redis, the join's scripts store them once, refuse
//! them for a result recorded with other bytes, and ignore them for a result that does
//! not complete the turn.

use anyhow::{bail, Result};
use serde_json::json;
use toolfleet_common::redis_client::{self, RedisConnection};
use toolfleet_common::{CallResult, Names, ToolCall};
use toolfleet_coordinator::join::{
    CallEntry, ClosingAhead, Created, Finalized, JoinStore, NewTurn, Recorded, StoredFinal,
};
use toolfleet_tests::fleet::new_turn;

const TOOL: &str = "test.noop";

fn call(id: &str) -> ToolCall {
    ToolCall {
        id: id.to_string(),
        name: TOOL.to_string(),
        arguments: json!({}),
        parent_id: None,
    }
}

fn result(id: &str, value: i64) -> CallResult {
    CallResult::success(&call(id), json!({ "value": value }))
}

fn body(result: &CallResult) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(result)?)
}

/// A store on a fresh Redis with one open turn, keyed `c0`, `c1`, ….
struct OpenTurn {
    // Kept for its Drop: the Redis the store talks to.
    _server: toolfleet_tests::RedisServer,
    store: JoinStore,
    conn: RedisConnection,
    names: Names,
    turn_id: &'static str,
}

impl OpenTurn {
    /// A fresh Redis and the turn `turn_id` of `calls` calls, created.
    async fn start(turn_id: &'static str, calls: usize) -> Result<Self> {
        let server = toolfleet_tests::RedisServer::start().await?;
        let redis = redis_client::connect(&server.url(), Default::default()).await?;
        let names = Names::new("ahead");
        let store = JoinStore::new(redis.clone(), names.clone());
        let entries = (0..calls)
            .map(|index| {
                let id = format!("c{index}");
                let entry = CallEntry {
                    index,
                    id: id.clone(),
                    name: TOOL.to_string(),
                    parent_id: None,
                    queued: false,
                };
                (id, entry)
            })
            .collect();
        let new = NewTurn {
            calls: entries,
            events: vec![json!({"type": "ack"}).to_string()],
            ..new_turn(turn_id)
        };
        assert_eq!(store.create(new).await?, Created::New);
        Ok(Self {
            _server: server,
            store,
            conn: redis,
            names,
            turn_id,
        })
    }

    /// The turn's stored events.
    async fn events(&mut self) -> Result<Vec<String>> {
        Ok(redis::cmd("LRANGE")
            .arg(self.names.turn_events_key(self.turn_id))
            .arg(0)
            .arg(-1)
            .query_async(&mut self.conn)
            .await?)
    }

    /// Records `result` (under its call id, with the state event `{"s": <id>}`); with
    /// `checks`, carrying the closing events of [`closing`] built ahead from those
    /// results.
    async fn record(
        &self,
        result: &CallResult,
        checks: Option<&[(String, Vec<u8>)]>,
    ) -> Result<Recorded> {
        let key = result.tool_call_id.as_str();
        let state = json!({ "s": key }).to_string();
        let events = closing();
        let ahead = checks.map(|checks| ClosingAhead {
            checks,
            events: &events,
        });
        let body = body(result)?;
        Ok(self
            .store
            .record_encoded(self.turn_id, key, result, &body, &state, ahead)
            .await?)
    }
}

/// What [`OpenTurn::record`] checks a stored `result` against.
fn check(result: &CallResult) -> Result<(String, Vec<u8>)> {
    Ok((result.tool_call_id.clone(), body(result)?))
}

fn closing() -> Vec<String> {
    vec![
        json!({"type": "narration", "text": "done"}).to_string(),
        json!({"type": "final", "text": "done"}).to_string(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completing_result_stores_the_closing_events_built_ahead() -> Result<()> {
    let mut turn = OpenTurn::start("turn-ahead", 2).await?;
    let first = result("c0", 0);
    match turn.record(&first, None).await? {
        Recorded::Recorded { seq: 2, .. } => {}
        other => bail!("first RECORD: {other:?}"),
    }
    match turn
        .record(&result("c1", 1), Some(&[check(&first)?]))
        .await?
    {
        Recorded::CompleteStored { reply, seq, .. } => {
            assert_eq!((reply.as_str(), seq), ("reply.subject", 3));
        }
        other => bail!("completing RECORD: {other:?}"),
    }
    let stored = turn.events().await?;
    assert_eq!(stored.len(), 5);
    assert_eq!(stored[2], json!({"s": "c1"}).to_string());
    assert_eq!(&stored[3..], &closing()[..]);
    // The turn ended with its `final` stored and not yet sent: nobody stores another,
    // and a sweeper finding it sends the stored one.
    assert_eq!(
        turn.store.store_final(turn.turn_id, &closing()).await?,
        StoredFinal::StoredBefore
    );
    match turn.store.finalize(turn.turn_id, "deadline").await? {
        Finalized::AlreadyEnded { published: false } => {}
        other => bail!("FINALIZE: {other:?}"),
    }
    turn.store.mark_published(turn.turn_id).await?;
    match turn.store.finalize(turn.turn_id, "deadline").await? {
        Finalized::AlreadyEnded { published: true } => {}
        other => bail!("FINALIZE after the final was sent: {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_call_turn_stores_its_closing_events_with_its_result() -> Result<()> {
    let mut turn = OpenTurn::start("turn-single", 1).await?;
    match turn.record(&result("c0", 0), Some(&[])).await? {
        Recorded::CompleteStored { seq: 2, .. } => {}
        other => bail!("RECORD: {other:?}"),
    }
    assert_eq!(turn.events().await?.len(), 4);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_events_built_from_other_bytes_are_not_stored() -> Result<()> {
    let mut turn = OpenTurn::start("turn-other-bytes", 2).await?;
    // Another replica recorded the first call's result with other bytes (its job ran
    // twice); the closing events here were built from the first run's.
    let stored_first = result("c0", 7);
    turn.record(&stored_first, None).await?;
    let assumed = [check(&result("c0", 0))?];
    let closing_from_join = match turn.record(&result("c1", 1), Some(&assumed)).await? {
        Recorded::Complete { closing, seq, .. } => {
            assert_eq!(seq, 3);
            closing
        }
        other => bail!("completing RECORD: {other:?}"),
    };
    // The turn is handed back whole, with the result that is stored, and no closing
    // event went in: the caller closes it after the join.
    assert_eq!(closing_from_join.results.get("c0"), Some(&stored_first));
    assert_eq!(turn.events().await?.len(), 3);
    match turn.store.store_final(turn.turn_id, &closing()).await? {
        StoredFinal::Stored { first_seq: 4, .. } => {}
        other => bail!("STORE_FINAL: {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_events_go_in_only_with_the_result_that_completes_the_turn() -> Result<()> {
    let mut turn = OpenTurn::start("turn-not-last", 3).await?;
    let first = result("c0", 0);
    turn.record(&first, None).await?;
    // Built as if the third call's result were in already (it is only on its way):
    // the second result does not complete the turn, so nothing closes.
    let both = [check(&first)?, check(&result("c2", 2))?];
    match turn.record(&result("c1", 1), Some(&both)).await? {
        Recorded::Recorded { seq: 3, .. } => {}
        other => bail!("second RECORD: {other:?}"),
    }
    // Checks that leave a call out never close the turn either.
    match turn
        .record(&result("c2", 2), Some(&[check(&first)?]))
        .await?
    {
        Recorded::Complete { .. } => {}
        other => bail!("third RECORD: {other:?}"),
    }
    assert_eq!(turn.events().await?.len(), 4);
    match turn.store.finalize(turn.turn_id, "deadline").await? {
        Finalized::Unstored { ended, .. } => assert_eq!(ended, "complete"),
        other => bail!("FINALIZE: {other:?}"),
    }
    Ok(())
}
