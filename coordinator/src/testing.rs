//! What the turn path's unit tests share: a replica over the in-memory store
//! (`store/memory.rs`), with no server behind it.
//!
//! Owns [`replica`] and the small builders of tools, requests and results the tests
//! use. The replica's NATS client never connects (events and notices wait in its queue,
//! job publishes time out at once) and its Redis connection for the lanes is never used
//! (fair sharing off), so what a test asserts on is what the store holds: a turn's
//! events in order, how it ended, how often its `final` was marked sent. Test-only.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio_util::task::TaskTracker;
use toolfleet_common::call::unix_ms;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::redis_client::RedisConnection;
use toolfleet_common::{CallResult, ToolCall};

use crate::lanes::{LaneStore, Lanes};
use crate::memory::StoreMemory;
use crate::narrate::TemplateNarrator;
use crate::registry::Registry;
use crate::replica::Replica;
use crate::store::memory::{MemoryStore, StoredState};
use crate::store::redis::{CallEntry, NewTurn};
use crate::turns::OwnedTurns;
use crate::CoordinatorConfig;

/// The reply subject of the tests' unidentified frontend.
pub(crate) const REPLY: &str = "_INBOX.test.reply";

/// A port nothing listens on.
const NOWHERE: &str = "127.0.0.1:1";

/// A replica over `store` that knows `registry`'s tools, with `config`'s settings.
pub(crate) async fn replica_with(
    store: Arc<MemoryStore>,
    registry: Registry,
    config: CoordinatorConfig,
) -> Arc<Replica> {
    let nats = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(format!("nats://{NOWHERE}"))
        .await
        .unwrap_or_else(|e| panic!("a client that connects later: {e}"));
    let mut js = async_nats::jetstream::new(nats.clone());
    js.set_timeout(Duration::from_millis(20));
    let redis = redis::Client::open(format!("redis://{NOWHERE}/"))
        .and_then(|client| {
            ConnectionManager::new_lazy_with_config(client, ConnectionManagerConfig::new())
        })
        .unwrap_or_else(|e| panic!("a lazy Redis connection: {e}"));
    let names = config.names();
    Arc::new(Replica {
        names: names.clone(),
        failover: toolfleet_common::failover::Failover::for_urls(&nats, &config.nats_url),
        nats,
        js,
        join: store,
        registry,
        narrator: Arc::new(TemplateNarrator),
        metrics: FleetMetrics::new(),
        tasks: TaskTracker::new(),
        turns: OwnedTurns::default(),
        health: Default::default(),
        consumers: Default::default(),
        memory: Arc::new(StoreMemory::new(
            config.redis_shed_percent,
            config.redis_trim_percent,
        )),
        lanes: Lanes::new(LaneStore::new(RedisConnection::Single(redis), names)),
        config,
    })
}

/// A replica over `store` that knows the tool `crm.get`, fair sharing off.
pub(crate) async fn replica(store: Arc<MemoryStore>) -> Arc<Replica> {
    let config = CoordinatorConfig {
        fair_sharing: false,
        ..CoordinatorConfig::local()
    };
    replica_with(store, Registry::holding(&[tool("crm.get")]), config).await
}

/// A new memory store and a [`replica`] over it.
pub(crate) async fn store_and_replica() -> (Arc<MemoryStore>, Arc<Replica>) {
    let store = Arc::new(MemoryStore::default());
    let replica = replica(Arc::clone(&store)).await;
    (store, replica)
}

/// The definition of a tool named `name` that takes any object.
pub(crate) fn tool(name: &str) -> (&str, String) {
    let definition = serde_json::json!({
        "name": name,
        "description": "a tool of the tests",
        "input_schema": {"type": "object"}
    });
    (name, definition.to_string())
}

/// Creates turn `turn_id` as [`open`] does and ends it at its deadline, as a replica
/// that died before storing or sending the turn's `final` leaves it.
pub(crate) async fn ended(store: &MemoryStore, turn_id: &str) {
    use crate::store::TurnStore;
    open(store, turn_id).await;
    let finalized = store.finalize(turn_id, "deadline").await;
    assert!(matches!(
        finalized,
        Ok(crate::store::redis::Finalized::Ended(_))
    ));
}

/// Creates an open turn `turn_id` of two calls, its deadline a minute away, in `store`.
pub(crate) async fn open(store: &MemoryStore, turn_id: &str) {
    use crate::store::TurnStore;
    let created = store
        .create(open_turn(turn_id, 2, unix_ms() + 60_000))
        .await;
    assert!(
        matches!(created, Ok(crate::store::redis::Created::New)),
        "{created:?}"
    );
}

/// A turn of `calls` (keys `c1`, `c2`, … of tool `crm.get`) for the unidentified
/// frontend, open until `deadline_unix_ms`; the first `running` run now, the rest
/// queued (paced) when fewer than all.
pub(crate) fn open_turn<'a>(turn_id: &'a str, calls: usize, deadline_unix_ms: u64) -> NewTurn<'a> {
    let calls = (1..=calls)
        .map(|i| {
            let entry = CallEntry {
                index: i - 1,
                id: format!("c{i}"),
                name: "crm.get".into(),
                parent_id: None,
                queued: false,
            };
            (format!("c{i}"), entry)
        })
        .collect();
    NewTurn {
        turn_id,
        reply: REPLY,
        digest: "digest",
        tenant: "acme",
        deadline_unix_ms,
        paced: false,
        calls,
        results: Vec::new(),
        ttl_ms: 60_000,
        created_unix_ms: unix_ms(),
        traceparent: "",
        trace: "",
        caller: "",
        events: vec![r#"{"type":"ack"}"#.to_string()],
        ended: false,
        queued: Vec::new(),
        laned: false,
    }
}

/// A successful result of call `key` of `crm.get`.
pub(crate) fn ok_result(key: &str) -> CallResult {
    let call = ToolCall {
        id: key.to_string(),
        name: "crm.get".into(),
        arguments: serde_json::json!({}),
        parent_id: None,
    };
    CallResult::success(&call, serde_json::json!({"ok": key}))
}

/// The `type` of every event `turn` stored, in order.
pub(crate) fn event_types(turn: &StoredState) -> Vec<String> {
    turn.events
        .iter()
        .map(|e| {
            serde_json::from_str::<serde_json::Value>(e)
                .ok()
                .and_then(|v| v["type"].as_str().map(str::to_string))
                .unwrap_or_default()
        })
        .collect()
}

/// How many `final` events `turn` stored.
pub(crate) fn finals(turn: &StoredState) -> usize {
    event_types(turn).iter().filter(|t| *t == "final").count()
}

/// The turn `turn_id` as `store` holds it; panics when it is not there.
pub(crate) fn stored(store: &MemoryStore, turn_id: &str) -> StoredState {
    store
        .turn(turn_id)
        .unwrap_or_else(|| panic!("turn {turn_id} is not stored"))
}

/// Waits (at most two seconds) until `done` holds for the turn `turn_id`.
pub(crate) async fn until(store: &MemoryStore, turn_id: &str, done: impl Fn(&StoredState) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < deadline {
        if store.turn(turn_id).is_some_and(|t| done(&t)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "turn {turn_id} never reached the state waited for: {:?}",
        store.turn(turn_id)
    );
}
