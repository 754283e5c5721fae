//! Redis kept from filling, against a real `redis-server` with a small `maxmemory` and
//! `noeviction` (what deploy/ runs): past `TOOLFLEET_REDIS_TRIM_PERCENT` of it, turns
//! that ended give way (their keys deleted) while an open turn keeps its keys and ends,
//! and new turns still run; past `TOOLFLEET_REDIS_SHED_PERCENT`, a new turn is refused
//! with the retryable `overloaded` while a turn already in flight still records its
//! result and ends with its `final`, and the Rust client waits the refusals out; once
//! memory is freed, turns run again. A burst of large turns faster than memory is
//! sampled is refused before it fills Redis.

use std::time::Duration;

use anyhow::Result;
use redis::aio::MultiplexedConnection;
use serde_json::json;
use toolfleet_common::client::TurnStream;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::TurnEvent;
use toolfleet_tests::fleet::{call, read_to_end, timed_turn, Fleet, Running};
use toolfleet_tests::{cap_redis_memory, eventually_named, redis_memory};

/// Bytes of one junk value the test fills Redis with.
const JUNK_VALUE: usize = 64 * 1024;

/// Gives Redis a `maxmemory` 8 MiB above what it holds now, with `noeviction`; the limit.
async fn limit_memory(admin: &mut MultiplexedConnection) -> Result<u64> {
    let (used, _) = redis_memory(admin).await?;
    let max = used + 8 * 1024 * 1024;
    cap_redis_memory(admin, max).await?;
    Ok(max)
}

/// Writes junk keys until Redis holds `percent` of `max`; how many it wrote.
async fn fill_to(admin: &mut MultiplexedConnection, max: u64, percent: u64) -> Result<u32> {
    let junk = "x".repeat(JUNK_VALUE);
    let mut n = 0u32;
    while redis_memory(admin).await?.0 < max / 100 * percent {
        let () = redis::cmd("SET")
            .arg(format!("junk:{n}"))
            .arg(&junk)
            .query_async(admin)
            .await?;
        n += 1;
    }
    Ok(n)
}

/// Submits an `acme` turn (deadline 20 s) whose one call sleeps `sleep_ms`: a turn still
/// open while the test fills Redis.
async fn submit_slow(fleet: &Fleet, sleep_ms: u64) -> Result<TurnStream> {
    let slow = vec![call(
        "slow",
        "test.behave",
        json!({"sleep_ms": sleep_ms, "value": 1}),
    )];
    fleet.submit_calls("acme", 20_000, slow).await
}

/// An `acme` turn of one quick call (deadline 5 s) read to its end within 10 s: its
/// events, or `None` when it could not be submitted or read (a poll tries again).
fn quick_turn(fleet: &Fleet) -> impl std::future::Future<Output = Option<Vec<TurnEvent>>> {
    let client = fleet.client.clone();
    let quick = vec![call("quick", "test.behave", json!({"value": 2}))];
    let request = timed_turn("acme", 5_000, quick);
    async move {
        let mut stream = client.submit(request).await.ok()?;
        read_to_end(&mut stream, Duration::from_secs(10)).await.ok()
    }
}

/// A fleet with the demo and test packs, and an admin connection to its Redis.
async fn fleet_with_admin() -> Result<(Fleet, (Running, Running), MultiplexedConnection)> {
    let fleet = Fleet::start().await?;
    let nodes = fleet.start_default().await?;
    let admin = fleet
        .redis
        .client()?
        .get_multiplexed_async_connection()
        .await?;
    Ok((fleet, nodes, admin))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_turns_wait_while_redis_is_nearly_full_and_turns_in_flight_end() -> Result<()> {
    let (fleet, _nodes, mut admin) = fleet_with_admin().await?;
    let max = limit_memory(&mut admin).await?;

    // A turn in flight: its call runs while Redis fills.
    let mut in_flight = submit_slow(&fleet, 1500).await?;

    // Fill to about 93 % of maxmemory.
    let n = fill_to(&mut admin, max, 93).await?;

    eventually_named(
        "a new turn refused with overloaded",
        Duration::from_secs(10),
        || {
            let events = quick_turn(&fleet);
            async move {
                match events.await?.last()? {
                    TurnEvent::Error { error, .. }
                        if error.code == turn_codes::OVERLOADED
                            && error.retryable
                            && error.retry_after_ms == Some(1000) =>
                    {
                        Some(())
                    }
                    _ => None,
                }
            }
        },
    )
    .await?;

    // The turn in flight still ends with its result.
    let events = read_to_end(&mut in_flight, Duration::from_secs(20)).await?;
    match events.last() {
        Some(TurnEvent::Final(fin)) => {
            assert_eq!(fin.summary.ok, 1, "{fin:?}");
        }
        other => anyhow::bail!("the turn in flight ended with {other:?}"),
    }

    // The Rust client waits out the refusals of a turn submitted now: it is submitted
    // again after each `retry_after_ms` and runs once memory is freed.
    let waiting = {
        let client = fleet.client.clone();
        let quick = vec![call("quick", "test.behave", json!({"value": 2}))];
        let request = timed_turn("acme", 5_000, quick);
        tokio::spawn(async move { client.run_turn(request, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(
        !waiting.is_finished(),
        "run_turn ended while Redis was full"
    );

    // Memory freed: turns run again.
    for k in 0..n {
        let () = redis::cmd("DEL")
            .arg(format!("junk:{k}"))
            .query_async(&mut admin)
            .await?;
    }
    eventually_named("turns run again", Duration::from_secs(10), || {
        let events = quick_turn(&fleet);
        async move {
            matches!(events.await?.last()?, TurnEvent::Final(f) if f.summary.ok == 1).then_some(())
        }
    })
    .await?;
    let outcome = tokio::time::timeout(Duration::from_secs(30), waiting).await???;
    assert_eq!(outcome.final_event.summary.ok, 1, "{outcome:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_turns_give_way_when_redis_runs_short_and_open_turns_never() -> Result<()> {
    let (fleet, _nodes, mut admin) = fleet_with_admin().await?;
    let exists = |turn_id: String| {
        let key = fleet.names.turn_meta_key(&turn_id);
        let client = fleet.redis.client();
        async move {
            let mut conn = client.ok()?.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("EXISTS")
                .arg(key)
                .query_async::<bool>(&mut conn)
                .await
                .ok()
        }
    };

    // Turns that ended and were sent.
    let mut ended = Vec::new();
    for i in 0..20 {
        let quick = vec![call("q", "test.behave", json!({"value": i}))];
        let mut stream = fleet.submit_calls("acme", 5_000, quick).await?;
        let events = read_to_end(&mut stream, Duration::from_secs(10)).await?;
        assert!(matches!(events.last(), Some(TurnEvent::Final(_))));
        ended.push(stream.turn_id().to_string());
    }
    // One turn still open.
    let mut open = submit_slow(&fleet, 3000).await?;
    let open_id = open.turn_id().to_string();
    assert!(matches!(
        open.next_event(Duration::from_secs(5)).await?,
        TurnEvent::Ack { .. }
    ));

    // Redis at about 75 % of its maxmemory: past the trim share (70 %), short of the
    // shed share (85 %).
    let max = limit_memory(&mut admin).await?;
    fill_to(&mut admin, max, 75).await?;

    eventually_named("the ended turns deleted", Duration::from_secs(10), || {
        let ended = ended.clone();
        let exists = &exists;
        async move {
            for turn_id in ended {
                if exists(turn_id).await? {
                    return None;
                }
            }
            Some(())
        }
    })
    .await?;
    assert_eq!(
        exists(open_id.clone()).await,
        Some(true),
        "an open turn was deleted"
    );

    // New turns still run (nothing refused below the shed share), and the open turn ends.
    let quick = vec![call("q", "test.behave", json!({"value": "new"}))];
    let mut stream = fleet.submit_calls("acme", 5_000, quick).await?;
    let events = read_to_end(&mut stream, Duration::from_secs(10)).await?;
    assert!(
        matches!(events.last(), Some(TurnEvent::Final(f)) if f.summary.ok == 1),
        "{events:?}"
    );
    let events = read_to_end(&mut open, Duration::from_secs(20)).await?;
    match events.last() {
        Some(TurnEvent::Final(fin)) => assert_eq!(fin.summary.ok, 1, "{fin:?}"),
        other => anyhow::bail!("the open turn ended with {other:?}"),
    }
    Ok(())
}

/// Bytes Redis holds for `turn_id` once its `final` is stored: `MEMORY USAGE` summed over
/// every key of the turn (`<prefix>:turn:{<id>}:*`), by key.
async fn turn_bytes(
    admin: &mut MultiplexedConnection,
    fleet: &Fleet,
    turn_id: &str,
) -> Result<Vec<(String, u64)>> {
    let pattern = fleet.names.turn_meta_key(turn_id).replace(":meta", ":*");
    let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query_async(admin).await?;
    let mut sizes = Vec::new();
    for key in keys {
        let bytes: Option<u64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .arg("SAMPLES")
            .arg(0)
            .query_async(admin)
            .await?;
        sizes.push((key, bytes.unwrap_or(0)));
    }
    sizes.sort();
    Ok(sizes)
}

/// Runs `calls` as one turn to its `final` and returns the bytes Redis holds for it
/// after the `final` was sent (the mean over `turns` such turns).
async fn bytes_per_turn(
    fleet: &Fleet,
    admin: &mut MultiplexedConnection,
    calls: &[serde_json::Value],
    turns: u64,
) -> Result<u64> {
    let mut total = 0;
    for _ in 0..turns {
        let mut stream = fleet.submit_calls("acme", 10_000, calls.to_vec()).await?;
        let events = read_to_end(&mut stream, Duration::from_secs(20)).await?;
        match events.last() {
            Some(TurnEvent::Final(fin)) => assert_eq!(fin.summary.ok, calls.len(), "{fin:?}"),
            other => anyhow::bail!("the turn ended with {other:?}"),
        }
        let turn_id = stream.turn_id().to_string();
        // The `final` is marked sent just after it is published.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let sizes = turn_bytes(admin, fleet, &turn_id).await?;
        total += sizes.iter().map(|(_, b)| b).sum::<u64>();
    }
    Ok(total / turns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_turn_holds_each_result_once() -> Result<()> {
    let (fleet, _nodes, mut admin) = fleet_with_admin().await?;

    // The bench's turn: three calls of small results; and chaos's: three calls that
    // sleep (each sends `running`).
    let noop: Vec<_> = (0..3)
        .map(|i| call(&format!("call_{i}"), "test.noop", json!({})))
        .collect();
    let small = bytes_per_turn(&fleet, &mut admin, &noop, 5).await?;
    let sleeping: Vec<_> = (0..3)
        .map(|i| {
            call(
                &format!("call_{i}"),
                "test.behave",
                json!({"sleep_ms": 20 + 30 * i}),
            )
        })
        .collect();
    let sleepy = bytes_per_turn(&fleet, &mut admin, &sleeping, 5).await?;
    eprintln!("three-call turn: {small} bytes (no-op calls), {sleepy} bytes (sleeping calls)");

    // Sixteen calls of 8 KiB results: what is held past the results once is bounded.
    let value = "v".repeat(8 * 1024);
    let sixteen: Vec<_> = (0..16)
        .map(|i| call(&format!("call_{i}"), "test.behave", json!({"value": value})))
        .collect();
    let large = bytes_per_turn(&fleet, &mut admin, &sixteen, 2).await?;
    let results_once = 16 * 8 * 1024;
    eprintln!("16 × 8 KiB turn: {large} bytes ({results_once} of results)");
    // Before each result was kept once, the no-op turn held 4,552 bytes; before the
    // event list left out the turn id and the results hash gave way to the `final`,
    // the no-op turn held 3,648 and the sleeping one 4,160.
    assert!(small <= 2_800, "a three-call turn holds {small} bytes");
    assert!(sleepy <= 3_450, "a three-call turn holds {sleepy} bytes");
    assert!(
        large <= results_once * 3 / 2,
        "a turn of {results_once} bytes of results holds {large} bytes"
    );
    Ok(())
}

/// Redis's count of commands refused for want of memory (`errorstat_OOM`).
async fn oom_errors(admin: &mut MultiplexedConnection) -> Result<u64> {
    let info: String = redis::cmd("INFO")
        .arg("errorstats")
        .query_async(admin)
        .await?;
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("errorstat_OOM:count="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0))
}

/// One tenant's burst of large turns, sent at once (faster than memory is sampled),
/// cannot carry Redis past the shed line: each turn is let in or refused up front with
/// `overloaded`, every turn let in ends with its `final` and all its results (Redis never
/// refuses a write for want of memory), and a turn sent afterwards runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_large_turns_is_refused_before_it_fills_redis() -> Result<()> {
    const TURNS: usize = 48;
    let (fleet, _nodes, mut admin) = fleet_with_admin().await?;
    limit_memory(&mut admin).await?;
    // A first sample of the new limit by the coordinator.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let oom_before = oom_errors(&mut admin).await?;

    // 48 turns of three 200 ms calls with 200 KB arguments each: about 29 MB of
    // arguments, echoed in the results, against 8 MiB of room.
    let big = "y".repeat(200 * 1024);
    let mut turns = Vec::with_capacity(TURNS);
    for t in 0..TURNS {
        let calls = (0..3)
            .map(|i| {
                call(
                    &format!("b{t}-{i}"),
                    "test.behave",
                    json!({"sleep_ms": 200, "value": big}),
                )
            })
            .collect();
        let request = timed_turn("acme", 30_000, calls);
        let client = fleet.client.clone();
        turns.push(tokio::spawn(async move {
            let mut stream = client.submit(request).await?;
            anyhow::Ok(read_to_end(&mut stream, Duration::from_secs(40)).await?)
        }));
    }
    let (mut ended, mut refused) = (0, 0);
    for turn in turns {
        let events = turn.await??;
        match events.last() {
            Some(TurnEvent::Final(fin)) => {
                assert_eq!(fin.summary.ok, 3, "a turn let in lost a result: {fin:?}");
                ended += 1;
            }
            Some(TurnEvent::Error { error, .. }) if error.code == turn_codes::OVERLOADED => {
                assert!(error.retryable, "{error:?}");
                refused += 1;
            }
            other => anyhow::bail!("a turn ended with {other:?}"),
        }
    }
    assert!(ended > 0, "no turn was let in");
    assert!(refused > 0, "every turn was let in");
    assert_eq!(
        oom_errors(&mut admin).await?,
        oom_before,
        "Redis refused writes for want of memory ({ended} turns let in, {refused} refused)"
    );

    // Another turn runs once the burst has ended.
    eventually_named(
        "a turn runs after the burst",
        Duration::from_secs(20),
        || {
            let events = quick_turn(&fleet);
            async move {
                matches!(events.await?.last()?, TurnEvent::Final(f) if f.summary.ok == 1)
                    .then_some(())
            }
        },
    )
    .await?;
    Ok(())
}
