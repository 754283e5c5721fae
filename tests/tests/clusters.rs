//! The fleet on clusters: a 3-node JetStream cluster (streams with 3 replicas) and a
//! Redis Cluster of 3 masters with a replica each, started by the harness on loopback.
//! Every join script runs on the Redis Cluster (each touches one slot); turns run
//! through the fleet while the stream leader's node is killed, while a Redis master is
//! killed (its replica takes over), while a Redis master is cut off from the cluster
//! bus (its replica takes over while it still answers its clients), and while one NATS
//! node is cut off from the other two for 5 s. In each: every turn ends with exactly one `final`, no call counted
//! twice, and a turn submitted during the fault is accepted or refused with a typed
//! error, never silence. Real servers and processes; every wait bounded.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tokio::sync::Mutex;
use toolfleet_common::call::unix_ms;
use toolfleet_common::client::TurnStream;
use toolfleet_common::redis_client::{self, RedisConnection};
use toolfleet_common::{
    CallResult, CallState, FleetClient, JobEnvelope, Names, ToolCall, TurnEvent,
};
use toolfleet_coordinator::join::{
    Attached, CallEntry, Cancelled, Created, Emitted, Finalized, JoinStore, NewTurn, Recorded,
    StoredFinal,
};
use toolfleet_dev::cluster::{NatsCluster, RedisCluster};
use toolfleet_tests::fleet::{
    coordinator_settings, new_turn, sleeping_calls, tool_calls, turn, worker_settings, Running,
};

/// The cluster tests start many servers each: one at a time on a small machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// How long a turn of these tests may take to end, from submission.
const TURN_WAIT: Duration = Duration::from_secs(25);

/// The streams get three replicas on the 3-node cluster.
fn three_replicas() {
    std::env::set_var("TOOLFLEET_STREAM_REPLICAS", "3");
}

async fn cluster_redis(cluster: &RedisCluster) -> Result<RedisConnection> {
    Ok(redis_client::connect(&cluster.url(), Default::default()).await?)
}

fn entry(index: usize, id: &str, queued: bool) -> CallEntry {
    CallEntry {
        index,
        id: id.to_string(),
        name: "test.behave".to_string(),
        parent_id: None,
        queued,
    }
}

fn result(id: &str) -> CallResult {
    let call = ToolCall {
        id: id.to_string(),
        name: "test.behave".to_string(),
        arguments: json!({}),
        parent_id: None,
    };
    CallResult::success(&call, json!({"ok": id}))
}

fn job(turn_id: &str, id: &str) -> JobEnvelope {
    JobEnvelope {
        turn_id: turn_id.to_string(),
        tenant_id: "acme".to_string(),
        session_id: None,
        call: ToolCall {
            id: id.to_string(),
            name: "test.behave".to_string(),
            arguments: json!({}),
            parent_id: None,
        },
        deadline_unix_ms: unix_ms() + 60_000,
        timeout_ms: 1000,
        dispatched_unix_ms: 0,
        context: Default::default(),
    }
}

/// One paced turn of two calls (the second queued) through every script and command
/// of the join, on whatever slot its id hashes to.
async fn every_script_once(store: &JoinStore, turn_id: &str) -> Result<()> {
    let deadline = unix_ms() + 60_000;
    let new = || NewTurn {
        deadline_unix_ms: deadline,
        paced: true,
        calls: vec![
            ("k0".to_string(), entry(0, "c0", false)),
            ("k1".to_string(), entry(1, "c1", true)),
        ],
        events: vec!["{\"type\":\"ack\"}".to_string()],
        queued: vec![("k1".to_string(), job(turn_id, "c1"))],
        ..new_turn(turn_id)
    };
    assert_eq!(store.create(new()).await?, Created::New, "CREATE");
    assert_eq!(
        store.create(new()).await?,
        Created::Exists {
            same_caller: true,
            same_request: true
        },
        "CREATE again"
    );
    match store
        .emit(
            turn_id,
            Some("k0"),
            &["{\"type\":\"tool_state\"}".to_string()],
        )
        .await?
    {
        Emitted::Stored { first_seq, .. } => assert_eq!(first_seq, 2, "EMIT"),
        other => bail!("EMIT: {other:?}"),
    }
    match store
        .attach(turn_id, "frontend", Some("acme"), "reply.two", 0)
        .await?
    {
        Attached::Events(events) => assert_eq!(events.len(), 2, "ATTACH"),
        other => bail!("ATTACH: {other:?}"),
    }
    match store
        .record(turn_id, "k0", &result("c0"), "{\"s\":0}")
        .await?
    {
        Recorded::Recorded {
            released: Some(released),
            ..
        } => {
            assert_eq!(released.key, "k1", "RECORD releases the queued call");
        }
        other => bail!("RECORD: {other:?}"),
    }
    match store
        .record(turn_id, "k0", &result("c0"), "{\"s\":0}")
        .await?
    {
        Recorded::Duplicate { again, .. } => assert_eq!(again.len(), 1, "RECORD duplicate"),
        other => bail!("RECORD duplicate: {other:?}"),
    }
    store.confirm_dispatched(turn_id, "k1").await?;
    match store
        .record(turn_id, "k1", &result("c1"), "{\"s\":1}")
        .await?
    {
        Recorded::Complete { closing, .. } => assert_eq!(closing.results.len(), 2),
        other => bail!("RECORD last: {other:?}"),
    }
    assert!(
        matches!(
            store.finalize(turn_id, "deadline").await?,
            Finalized::Unstored { .. }
        ),
        "FINALIZE of a turn ended without its final stored"
    );
    match store
        .store_final(turn_id, &["{\"type\":\"final\"}".to_string()])
        .await?
    {
        StoredFinal::Stored { .. } => {}
        other => bail!("STORE_FINAL: {other:?}"),
    }
    assert_eq!(
        store
            .store_final(turn_id, &["{\"type\":\"final\"}".to_string()])
            .await?,
        StoredFinal::StoredBefore
    );
    let stored = store.stored_events(turn_id).await?;
    assert_eq!(stored.reply, "reply.two");
    assert_eq!(stored.events.len(), 5, "ack, tool_state, two states, final");
    // The first mark, and only it, says so (on a cluster too: two slots).
    assert!(store.mark_published(turn_id).await?);
    assert!(!store.mark_published(turn_id).await?);
    assert!(matches!(
        store.finalize(turn_id, "deadline").await?,
        Finalized::AlreadyEnded { published: true }
    ));
    assert_eq!(store.counters(turn_id).await?, (0, 1));
    assert!(
        matches!(
            store.cancel(turn_id, "frontend", Some("acme")).await?,
            Cancelled::AlreadyEnded(_)
        ),
        "CANCEL of an ended turn"
    );
    store.forget_deadline(turn_id).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_join_script_runs_on_a_redis_cluster() -> Result<()> {
    let _serial = ONE_AT_A_TIME.lock().await;
    let cluster = RedisCluster::start(3, 1).await?;
    let redis = cluster_redis(&cluster).await?;
    let names = Names::new("fleet");
    let store = JoinStore::new(redis.clone(), names.clone()).with_deadline_buckets(16);
    // Turn ids on every master.
    let mut masters = BTreeMap::new();
    for i in 0..24 {
        let turn_id = format!("cluster-turn-{i}");
        every_script_once(&store, &turn_id).await?;
        *masters
            .entry(cluster.master_of(&names.turn_meta_key(&turn_id)).await?)
            .or_insert(0) += 1;
    }
    assert_eq!(masters.len(), 3, "turns on every master: {masters:?}");

    // The deadline index: a turn past its deadline is found in its own bucket, whatever
    // bucket the sweeper starts at; the buckets live on several masters.
    let past = NewTurn {
        reply: "r",
        deadline_unix_ms: unix_ms() - 1,
        calls: vec![("k0".to_string(), entry(0, "c0", false))],
        ttl_ms: 60_000,
        caller: "",
        events: vec!["{}".to_string()],
        ..new_turn("due-turn")
    };
    assert_eq!(store.create(past).await?, Created::New);
    let mut found = Vec::new();
    for key in store.deadline_keys(5) {
        found.extend(store.due(&key, unix_ms(), 100).await?);
    }
    assert_eq!(found, vec!["due-turn".to_string()]);
    let mut bucket_masters = std::collections::BTreeSet::new();
    for bucket in 0..16 {
        bucket_masters.insert(
            cluster
                .master_of(&names.deadline_bucket_key(bucket))
                .await?,
        );
    }
    assert!(
        bucket_masters.len() >= 2,
        "buckets spread: {bucket_masters:?}"
    );

    // An entry of the single index of earlier releases is moved to its bucket.
    let mut conn = redis.clone();
    let _: () = redis::cmd("ZADD")
        .arg(names.legacy_deadlines_key())
        .arg(1)
        .arg("old-turn")
        .query_async(&mut conn)
        .await?;
    let legacy = store
        .due(&names.legacy_deadlines_key(), unix_ms(), 10)
        .await?;
    assert_eq!(legacy, vec!["old-turn".to_string()]);
    let home = names.deadline_bucket_key(Names::deadline_bucket("old-turn", 16));
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(&home)
        .arg("old-turn")
        .query_async(&mut conn)
        .await?;
    assert_eq!(score, Some(1.0));
    store.forget_deadline("old-turn").await?;
    let left: u64 = redis::cmd("ZCARD")
        .arg(&home)
        .query_async(&mut conn)
        .await?;
    assert_eq!(left, 0);

    // A Redis node killed and brought back: scripts run on again once its replica took
    // over (the script cache of the new master is filled on demand).
    let victim = cluster
        .master_of(&names.turn_meta_key("after-failover"))
        .await?;
    let mut cluster = cluster;
    cluster.kill(victim).await;
    let failover = tokio::time::Instant::now() + Duration::from_secs(20);
    while cluster
        .master_of(&names.turn_meta_key("after-failover"))
        .await
        .map_or(true, |master| master == victim)
    {
        assert!(
            tokio::time::Instant::now() < failover,
            "no replica took over within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.wait_ok(Duration::from_secs(20)).await?;
    every_script_once(&store, "after-failover").await?;
    cluster.restart(victim).await?;
    Ok(())
}

/// A fleet on the clusters: two coordinators and a worker in-process, and a client.
struct ClusterFleet {
    nats: NatsCluster,
    redis: RedisCluster,
    names: Names,
    client: FleetClient,
    nodes: Vec<Running>,
    // Held while the clusters run, released last (see [`ONE_AT_A_TIME`]).
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

/// Which NATS nodes the fleet's processes and the test's client connect to.
enum Placement {
    /// Everyone gets every node's URL.
    Anywhere,
    /// The coordinators and the worker get nodes 1 and 2 only; the client gets node 0
    /// only (it learns the others from the cluster's advertised URLs).
    ClientAloneOnNode0,
    /// The coordinators and the client get nodes 1 and 2 only; the only worker gets
    /// node 0 only.
    WorkerAloneOnNode0,
}

impl ClusterFleet {
    async fn start() -> Result<Self> {
        Self::start_placed(Placement::Anywhere).await
    }

    async fn start_placed(placement: Placement) -> Result<Self> {
        Self::start_with(placement, 1).await
    }

    /// A fleet whose turns are spread over `partitions` pairs of streams.
    async fn start_with(placement: Placement, partitions: u32) -> Result<Self> {
        let serial = ONE_AT_A_TIME.lock().await;
        toolfleet_tests::init_test_tracing();
        three_replicas();
        let (nats, redis) = tokio::try_join!(NatsCluster::start(3), RedisCluster::start(3, 1))?;
        let others = format!("{},{}", nats.url(1), nats.url(2));
        let (process_urls, worker_url, client_url) = match placement {
            Placement::Anywhere => (nats.urls(), nats.urls(), nats.urls()),
            Placement::ClientAloneOnNode0 => (others.clone(), others, nats.url(0)),
            Placement::WorkerAloneOnNode0 => (others.clone(), nats.url(0), others),
        };
        let names = Names::new(format!(
            "c{}",
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        ))
        .with_partitions(partitions);
        let mut tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
        if partitions > 1 {
            // Every tool has a replicated consumer in every partition: only the tool the
            // turns call, so the fleet is up in the time the others take.
            tools.retain(|t| t.definition().name == "test.behave");
        }
        let mut nodes = Vec::new();
        for _ in 0..2 {
            nodes.push(Running::coordinator(coordinator_settings(
                process_urls.clone(),
                redis.url(),
                &names,
            )));
        }
        nodes.push(Running::worker(
            worker_settings(worker_url, redis.url(), &names),
            tools,
        ));
        let client = FleetClient::connect(&client_url, names.prefix()).await?;
        toolfleet_tests::fleet::wait_for_tools_on(&client, &["test.behave"]).await?;
        Ok(Self {
            nats,
            redis,
            names,
            client,
            nodes,
            _serial: serial,
        })
    }

    async fn stop(self) {
        for node in self.nodes {
            node.stop().await;
        }
    }
}

/// A turn of `calls` calls of the sleeping test tool.
fn sleeping_turn(id: &str, calls: usize, sleep_ms: u64) -> toolfleet_common::TurnRequest {
    let mut request = turn("acme", tool_calls(sleeping_calls(0..calls, sleep_ms)));
    request.turn_id = Some(id.to_string());
    request.deadline_ms = Some(12_000);
    request
}

/// How a turn ended for the frontend.
#[derive(Debug)]
enum End {
    /// One `final` holding every call once; its calls' states.
    Final(Vec<CallState>),
    /// A typed refusal or error (its code).
    Refused(String),
}

/// Follows `stream` to its `final` or `error`, then reads on for a moment: a second
/// `final` with other content fails the test, as does a final that counts a call twice
/// or misses one, or silence.
async fn follow(mut stream: TurnStream, calls: usize, accepted: Arc<AtomicUsize>) -> Result<End> {
    let give_up = tokio::time::Instant::now() + TURN_WAIT;
    let mut first = true;
    loop {
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        let event = stream.next_event(left).await;
        if std::mem::take(&mut first) && !matches!(event, Ok(TurnEvent::Error { .. }) | Err(_)) {
            accepted.fetch_add(1, Ordering::SeqCst);
        }
        match event {
            Ok(TurnEvent::Final(fin)) => {
                let mut ids: Vec<&str> = fin
                    .results
                    .iter()
                    .map(|r| r.tool_call_id.as_str())
                    .collect();
                ids.sort_unstable();
                let expected: Vec<String> = (0..calls).map(|i| format!("c{i}")).collect();
                assert_eq!(ids, expected, "every call once in {}", fin.turn_id);
                assert_eq!(fin.summary.total, calls);
                let s = &fin.summary;
                assert_eq!(s.ok + s.errors + s.timeouts + s.skipped, calls);
                // Anything after the final: the same final again at most.
                while let Ok(event) = stream.next_event(Duration::from_millis(500)).await {
                    if let TurnEvent::Final(again) = event {
                        assert_eq!(again, fin, "a second, different final");
                    }
                }
                return Ok(End::Final(fin.results.iter().map(|r| r.state).collect()));
            }
            Ok(TurnEvent::Error { error, .. }) => return Ok(End::Refused(error.code)),
            Ok(_) => {}
            Err(error) => bail!("turn {} ended in silence: {error}", stream.turn_id()),
        }
    }
}

/// Submits `count` turns of `calls` calls at once and returns their follow tasks.
async fn submit_all(
    client: &FleetClient,
    tag: &str,
    count: usize,
    calls: usize,
    sleep_ms: u64,
) -> Vec<tokio::task::JoinHandle<Result<End>>> {
    submit_counted(client, tag, count, calls, sleep_ms, Arc::default())
}

/// Like [`submit_all`], then waits until every turn is accepted (its first event is
/// not a refusal), so a fault that follows finds them all in flight.
async fn submit_accepted(
    client: &FleetClient,
    tag: &str,
    count: usize,
    calls: usize,
    sleep_ms: u64,
) -> Result<Vec<tokio::task::JoinHandle<Result<End>>>> {
    let accepted = Arc::new(AtomicUsize::new(0));
    let followers = submit_counted(client, tag, count, calls, sleep_ms, Arc::clone(&accepted));
    let all_in = async {
        while accepted.load(Ordering::SeqCst) < count {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), all_in)
        .await
        .with_context(|| format!("{tag}: not every turn accepted within 10 s"))?;
    Ok(followers)
}

fn submit_counted(
    client: &FleetClient,
    tag: &str,
    count: usize,
    calls: usize,
    sleep_ms: u64,
    accepted: Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Result<End>>> {
    let mut followers = Vec::new();
    for i in 0..count {
        let request = sleeping_turn(&format!("{tag}-{i}"), calls, sleep_ms);
        let client = client.clone();
        let accepted = Arc::clone(&accepted);
        followers.push(tokio::spawn(async move {
            match tokio::time::timeout(Duration::from_secs(15), client.submit(request)).await {
                Ok(Ok(stream)) => follow(stream, calls, accepted).await,
                Ok(Err(error)) => Ok(End::Refused(format!("{:?}", error.kind()))),
                Err(_) => bail!("a submission neither accepted nor refused in 15 s"),
            }
        }));
    }
    followers
}

/// How a batch of turns ended.
#[derive(Debug, Default)]
struct Ends {
    /// Turns that ended with their `final`.
    finals: usize,
    /// Their calls that ended `done`.
    done: usize,
    /// Their calls that ended otherwise (`timeout`, `error`).
    not_done: usize,
    /// The codes of the turns refused with a typed error.
    refused: Vec<String>,
}

/// Every turn's end; fails on silence or a wrong final.
async fn ends(followers: Vec<tokio::task::JoinHandle<Result<End>>>) -> Result<Ends> {
    let mut ends = Ends::default();
    for follower in followers {
        match follower.await.context("a follower panicked")?? {
            End::Final(states) => {
                ends.finals += 1;
                let done = states.iter().filter(|s| **s == CallState::Done).count();
                ends.done += done;
                ends.not_done += states.len() - done;
            }
            End::Refused(code) => ends.refused.push(code),
        }
    }
    eprintln!("{ends:?}");
    Ok(ends)
}

/// Turns before and after a fault: every one ends with every call done.
async fn all_done(client: &FleetClient, tag: &str) -> Result<()> {
    let ends = ends(submit_all(client, tag, 5, 3, 50).await).await?;
    assert_eq!((ends.finals, ends.done), (5, 15), "{tag}: {ends:?}");
    Ok(())
}

/// A new fleet's first turns, before any fault: batches like [`all_done`] until one has
/// every call done, for at most 30 s (on a loaded machine the replicated streams and
/// consumers of a cluster just started may still be settling). Every batch still ends
/// with one `final` per turn.
async fn serving(client: &FleetClient) -> Result<()> {
    recovers(client, "before", Duration::from_secs(30)).await
}

/// Turns after a fault heals: batches like [`all_done`] until one has every call done,
/// for at most `within`. Every batch still ends with one `final` per turn (checked by
/// `follow`); only the calls may fail while the healed node's JetStream catches up.
async fn recovers(client: &FleetClient, tag: &str, within: Duration) -> Result<()> {
    recovers_with(client, tag, 5, within).await
}

/// [`recovers`] with batches of `turns` turns (enough of them reach every partition of
/// a partitioned fleet).
async fn recovers_with(
    client: &FleetClient,
    tag: &str,
    turns: usize,
    within: Duration,
) -> Result<()> {
    let give_up = tokio::time::Instant::now() + within;
    for attempt in 0.. {
        let batch = submit_all(client, &format!("{tag}-{attempt}"), turns, 3, 50).await;
        let ends = ends(batch).await?;
        assert_eq!(ends.finals, turns, "{tag}: {ends:?}");
        if ends.done == 3 * turns {
            return Ok(());
        }
        if tokio::time::Instant::now() >= give_up {
            bail!("{tag}: the fleet did not recover within {within:?}: {ends:?}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}

/// Turns in flight through a fault: every one was accepted before it and ends with
/// its one `final`.
fn in_flight_ended(ends: &Ends, turns: usize) {
    assert_eq!(
        ends.finals, turns,
        "every turn in flight ends with its final: {ends:?}"
    );
}

/// Turns submitted during a fault: each accepted and ended, or refused with a code.
fn during_answered(ends: &Ends, turns: usize) {
    assert_eq!(ends.finals + ends.refused.len(), turns, "{ends:?}");
    assert!(ends.refused.iter().all(|code| !code.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_survive_the_stream_leader_node_killed_with_20_in_flight() -> Result<()> {
    let mut fleet = ClusterFleet::start().await?;
    // Before the fault: turns run on the clusters.
    serving(&fleet.client).await?;

    let followers = submit_accepted(&fleet.client, "leader", 20, 3, 800).await?;
    let leader = fleet
        .nats
        .stream_leader(&fleet.names.jobs_stream())
        .await?
        .context("the jobs stream has a leader")?;
    fleet.nats.kill(leader).await;
    let during = submit_all(&fleet.client, "during", 5, 2, 50).await;
    in_flight_ended(&ends(followers).await?, 20);
    during_answered(&ends(during).await?, 5);
    fleet.nats.restart(leader).await?;
    all_done(&fleet.client, "after").await?;
    fleet.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_spread_over_stream_partitions_and_survive_a_node_killed() -> Result<()> {
    const PARTITIONS: u32 = 4;
    let mut fleet = ClusterFleet::start_with(Placement::Anywhere, PARTITIONS).await?;
    let names = fleet.names.clone();
    let js = async_nats::jetstream::new(fleet.nats.connect().await?);
    let streams: Vec<(u32, String)> = (0..PARTITIONS)
        .flat_map(|k| {
            [
                (k, names.jobs_stream_in(k)),
                (k, names.results_stream_in(k)),
            ]
        })
        .collect();
    // A fleet just started may still be settling the replicated streams and consumers
    // of its partitions: batches that reach every partition until one has every call
    // done, as the other tests' `serving`; what the streams held then is the baseline.
    recovers_with(&fleet.client, "settle", 24, Duration::from_secs(30)).await?;
    let mut held = Vec::new();
    for (_, stream) in &streams {
        held.push(
            js.get_stream(stream)
                .await?
                .info()
                .await?
                .state
                .last_sequence,
        );
    }
    let ends_before = ends(submit_all(&fleet.client, "spread", 24, 3, 20).await).await?;
    assert_eq!(
        (ends_before.finals, ends_before.done),
        (24, 72),
        "{ends_before:?}"
    );
    // Every partition's pair of streams carried its turns' jobs and results, and the
    // streams' leaders are not all on one node.
    let mut leaders = std::collections::BTreeSet::new();
    for ((k, stream), held) in streams.iter().zip(held) {
        let expected = (0..24)
            .filter(|i| names.partition_of(&format!("spread-{i}")) == *k)
            .count() as u64
            * 3;
        let info = js.get_stream(stream).await?.info().await?.clone();
        assert_eq!(info.config.num_replicas, 3, "{stream}");
        assert_eq!(info.state.last_sequence - held, expected, "{stream}");
        leaders.extend(fleet.nats.stream_leader(stream).await?);
    }
    assert!(
        leaders.len() > 1,
        "every stream led by one node: {leaders:?}"
    );
    // The node leading partition 1's jobs stream dies with 20 turns in flight.
    let followers = submit_accepted(&fleet.client, "spread-kill", 20, 3, 800).await?;
    let leader = fleet
        .nats
        .stream_leader(&names.jobs_stream_in(1))
        .await?
        .context("partition 1's jobs stream has a leader")?;
    fleet.nats.kill(leader).await;
    in_flight_ended(&ends(followers).await?, 20);
    fleet.nats.restart(leader).await?;
    all_done(&fleet.client, "spread-after").await?;
    fleet.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_survive_a_redis_master_killed_mid_turn() -> Result<()> {
    let mut fleet = ClusterFleet::start().await?;
    let followers = submit_accepted(&fleet.client, "master", 20, 3, 800).await?;
    let victim = fleet
        .redis
        .master_of(&fleet.names.turn_meta_key("master-0"))
        .await?;
    fleet.redis.kill(victim).await;
    let during = submit_all(&fleet.client, "during", 5, 2, 50).await;
    in_flight_ended(&ends(followers).await?, 20);
    during_answered(&ends(during).await?, 5);
    fleet.redis.restart(victim).await?;
    fleet.redis.wait_ok(Duration::from_secs(20)).await?;
    all_done(&fleet.client, "after").await?;
    fleet.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_survive_a_redis_master_partitioned() -> Result<()> {
    let mut fleet = ClusterFleet::start().await?;
    serving(&fleet.client).await?;
    let followers = submit_accepted(&fleet.client, "cut", 20, 3, 800).await?;
    // The master holding the first in-flight turn is cut off from the cluster bus (its
    // clients still reach it): the others fail it over to its replica while it goes on
    // answering until it sees it lost the majority.
    let victim = fleet
        .redis
        .master_of(&fleet.names.turn_meta_key("cut-0"))
        .await?;
    fleet.redis.partition(victim)?;
    let during = submit_all(&fleet.client, "during", 5, 2, 50).await;
    // Held until the replica has taken over (node timeout 2 s), then for a while after.
    let promoted = async {
        while fleet.redis.role(victim).await.as_deref() == Some("master")
            && fleet.redis.masters().await.len() < 4
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(15), promoted)
        .await
        .context("no replica took over the cut-off master's slots")?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    fleet.redis.heal(victim);
    in_flight_ended(&ends(followers).await?, 20);
    during_answered(&ends(during).await?, 5);
    // The old master rejoins as a replica of its successor.
    fleet.redis.wait_ok(Duration::from_secs(20)).await?;
    let masters = fleet.redis.masters().await;
    assert!(
        !masters.contains(&victim),
        "masters after the heal: {masters:?}"
    );
    recovers(&fleet.client, "after", Duration::from_secs(30)).await?;
    fleet.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_survive_a_nats_node_partitioned_for_5_seconds() -> Result<()> {
    let mut fleet = ClusterFleet::start().await?;
    let followers = submit_accepted(&fleet.client, "partition", 20, 3, 800).await?;
    let leader = fleet
        .nats
        .stream_leader(&fleet.names.results_stream())
        .await?
        .context("the results stream has a leader")?;
    fleet.nats.partition(leader)?;
    let during = submit_all(&fleet.client, "during", 5, 2, 50).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    fleet.nats.heal(leader);
    in_flight_ended(&ends(followers).await?, 20);
    during_answered(&ends(during).await?, 5);
    // A coordinator on the healed node may find no route to the jobs stream for a
    // while (its publishes answer "no stream found" until that node's JetStream has
    // caught up): those calls fail `dispatch_failed`, their turns still end once.
    recovers(&fleet.client, "after", Duration::from_secs(45)).await?;
    // The healed node is routed to both others again, as they are to it (within 10 s).
    for node in 0..fleet.nats.size() {
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let routez: serde_json::Value =
                reqwest::get(format!("{}/routez", fleet.nats.monitor_url(node)))
                    .await?
                    .json()
                    .await?;
            if routez["num_routes"] == 2 {
                break;
            }
            assert!(tokio::time::Instant::now() < until, "node {node}: {routez}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    fleet.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_a_cut_off_nats_node_moves_to_another_and_its_turns_end() -> Result<()> {
    let mut fleet = ClusterFleet::start_placed(Placement::ClientAloneOnNode0).await?;
    serving(&fleet.client).await?;
    // The client's node is cut off from the other two, where every coordinator and the
    // worker are; its connection to the client stays up. Turns submitted now reach no
    // coordinator until the client moves to another node (it knows them from the
    // cluster's advertised URLs).
    fleet.nats.partition(0)?;
    let outcome = async {
        let during = submit_all(&fleet.client, "cut-off", 3, 2, 50).await;
        let ends = ends(during).await?;
        // Each turn ends with its final and every call with a terminal state. A call may
        // fail `dispatch_failed` when a stream's leader was on the cut node and its
        // election outlasts the coordinator's tries.
        assert_eq!((ends.finals, ends.done + ends.not_done), (3, 6), "{ends:?}");
        // Through the node it moved to, the client's turns are then served in full
        // while the cut holds.
        recovers(&fleet.client, "moved", Duration::from_secs(30)).await
    }
    .await;
    let moved = fleet.client.nats().server_info().port != fleet.nats.port(0);
    fleet.nats.heal(0);
    outcome?;
    assert!(moved, "the client still talks to the cut-off node");
    fleet.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_a_cut_off_nats_node_hears_its_final_through_its_standby() -> Result<()> {
    const DEADLINE_MS: u64 = 6000;
    let mut fleet = ClusterFleet::start_placed(Placement::ClientAloneOnNode0).await?;
    serving(&fleet.client).await?;
    let mut request = sleeping_turn("standby", 2, 500);
    request.deadline_ms = Some(DEADLINE_MS);
    let mut stream = fleet.client.submit(request).await?;
    let ack = stream.next_event(Duration::from_secs(10)).await?;
    assert!(matches!(ack, TurnEvent::Ack { .. }), "{ack:?}");
    // Accepted; now the client's node is cut off from the two others, where the
    // coordinators and the worker are. The calls end there and the final is stored,
    // but nothing reaches node 0. A probe period past the deadline the stream asks
    // through the client's standby connection (on another node) and hears its final
    // there, a probe period before the silence would move the client's own connection.
    fleet.nats.partition(0)?;
    let outcome = async {
        let fin = loop {
            match stream.next_event(TURN_WAIT).await? {
                TurnEvent::Final(fin) => break fin,
                TurnEvent::Error { error, .. } => bail!("the turn failed: {error:?}"),
                _ => {}
            }
        };
        // Heard through the standby alone, the client's own connection moves on.
        let moved = async {
            while fleet.client.nats().server_info().port == fleet.nats.port(0) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let moved = tokio::time::timeout(Duration::from_secs(5), moved)
            .await
            .is_ok();
        Ok::<_, anyhow::Error>((fin, moved))
    }
    .await;
    fleet.nats.heal(0);
    let (fin, moved) = outcome?;
    // Every call ends (`done`, or `timeout` when a stream's leader was on the cut node
    // and its election outlasted the deadline).
    let s = &fin.summary;
    assert_eq!(
        (s.total, s.ok + s.errors + s.timeouts + s.skipped),
        (2, 2),
        "{fin:?}"
    );
    assert!(
        stream.heard_through_standby(),
        "the final came through the client's own connection, not its standby"
    );
    assert!(
        moved,
        "the client's own connection stayed on the cut-off node"
    );
    fleet.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_a_cut_off_nats_node_moves_to_another_and_serves_again() -> Result<()> {
    let mut fleet = ClusterFleet::start_placed(Placement::WorkerAloneOnNode0).await?;
    serving(&fleet.client).await?;
    // The only worker's node is cut off from the other two, where the coordinators and
    // the client are; the worker's connection stays up but its pulls reach no consumer
    // leader. Turns submitted now run only once the worker has moved to another node
    // (it knows them from the cluster's advertised URLs), while the cut holds: batches
    // of turns until one has every call done (each turn ending with one final).
    fleet.nats.partition(0)?;
    let outcome = recovers(&fleet.client, "worker-cut-off", Duration::from_secs(45)).await;
    fleet.nats.heal(0);
    outcome?;
    // As after any healed partition, the rejoined node may refuse work for a while.
    recovers(&fleet.client, "after", Duration::from_secs(45)).await?;
    fleet.stop().await;
    Ok(())
}

/// `toolfleet-dev chaos --cluster`, built from this checkout, briefly: the partition fault
/// (a NATS node cut off for 5 s) and the redis-partition fault (a Redis master cut off
/// from the cluster bus) after the baseline, on clusters of its own. No turn is counted
/// twice or lost; under the partition, a turn may end past the command's patience, with
/// its one `final` all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn toolfleet_chaos_on_clusters_loses_no_turn() -> Result<()> {
    let _serial = ONE_AT_A_TIME.lock().await;
    let toolfleet_dev = toolfleet_tests::fleet::checkout_dev().await?;
    let dir = tempfile::tempdir()?;
    let json_path = dir.path().join("chaos.json");
    let status = tokio::process::Command::new(toolfleet_dev)
        .args([
            "chaos",
            "--cluster",
            "--faults",
            "partition,redis-partition",
            "--each",
            "4s",
            // A turn submitted as a Redis master is cut off is answered once the cluster
            // has failed it over (cluster-node-timeout, then the election): on a two-CPU
            // machine that has passed the default 5 s past the deadline.
            "--patience",
            "15s",
        ])
        .arg("--json")
        .arg(&json_path)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(180), status)
        .await
        .context("toolfleet-dev chaos --cluster did not finish in time")??;
    let status = output.status;
    // The command's own account of a run that ended early (a fleet that did not start,
    // a fault it could not inject) is what a failure here has to show.
    let stderr = String::from_utf8_lossy(&output.stderr);
    let written = std::fs::read_to_string(&json_path).with_context(|| {
        format!("toolfleet-dev chaos --cluster wrote no report ({status}):\n{stderr}")
    })?;
    let report: serde_json::Value = serde_json::from_str(&written)?;
    let faults = report["faults"].as_array().context("a faults array")?;
    let names: Vec<&str> = faults.iter().filter_map(|f| f["fault"].as_str()).collect();
    assert_eq!(names, ["none", "partition", "redis-partition"]);
    for fault in faults {
        assert!(fault["turns"].as_u64().unwrap_or(0) > 0, "{fault}");
        assert_eq!(fault["counted_twice"].as_u64(), Some(0), "{fault}");
        if fault["fault"] == "partition" {
            // A frontend whose own NATS node is cut off may hear its turn's `final` only
            // once its connection has moved or the cut has healed: now and then past the
            // command's patience (docs/RELIABILITY.md, the partition table). Every turn
            // must still end with its one `final`: none lost for good.
            assert_eq!(fault["lost_then_ended"], fault["lost"], "{fault}");
            let lost = fault["lost_turns"].as_array().context("lost turns")?;
            assert!(
                lost.iter().all(|t| t["ended_by"] == "final"),
                "a turn without its final: {fault}"
            );
        } else {
            assert_eq!(fault["lost"].as_u64(), Some(0), "{fault}");
        }
    }
    assert!(faults[1]["kills"].as_u64().unwrap_or(0) > 0);
    assert!(faults[2]["kills"].as_u64().unwrap_or(0) > 0);
    // The command fails when any turn missed its patience; above, only the partition's
    // may have, each ending with its `final` later.
    let partition_late = faults[1]["lost"].as_u64().unwrap_or(0) > 0;
    assert!(
        status.success() || partition_late,
        "toolfleet-dev chaos --cluster failed: {status}"
    );
    Ok(())
}
