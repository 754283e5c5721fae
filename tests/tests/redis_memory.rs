//! Redis kept from filling, against a real `redis-server` with a small `maxmemory` and
//! `noeviction` (what deploy/ runs): past `TOOLFLEET_REDIS_TRIM_PERCENT` of it, turns
//! that ended give way (their keys deleted) while an open turn keeps its keys and ends,
//! and new turns still run; past `TOOLFLEET_REDIS_SHED_PERCENT`, a new turn is refused
//! with the retryable `overloaded` while a turn already in flight still records its
//! result and ends with its `final`; once memory is freed, turns run again.

use std::time::Duration;

use anyhow::{Context, Result};
use redis::aio::MultiplexedConnection;
use serde_json::json;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::TurnEvent;
use toolfleet_tests::eventually_named;
use toolfleet_tests::fleet::{call, read_to_end, timed_turn, Fleet, Running};

/// Bytes of one junk value the test fills Redis with.
const JUNK_VALUE: usize = 64 * 1024;

/// `used_memory` and `maxmemory` of the server.
async fn memory(admin: &mut MultiplexedConnection) -> Result<(u64, u64)> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(admin).await?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Ok((
        field("used_memory").context("used_memory")?,
        field("maxmemory").context("maxmemory")?,
    ))
}

/// Gives Redis a `maxmemory` 8 MiB above what it holds now, with `noeviction`; the limit.
async fn limit_memory(admin: &mut MultiplexedConnection) -> Result<u64> {
    let (used, _) = memory(admin).await?;
    let max = used + 8 * 1024 * 1024;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(max)
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(admin)
        .await?;
    Ok(max)
}

/// Writes junk keys until Redis holds `percent` of `max`; how many it wrote.
async fn fill_to(admin: &mut MultiplexedConnection, max: u64, percent: u64) -> Result<u32> {
    let junk = "x".repeat(JUNK_VALUE);
    let mut n = 0u32;
    while memory(admin).await?.0 < max / 100 * percent {
        let () = redis::cmd("SET")
            .arg(format!("junk:{n}"))
            .arg(&junk)
            .query_async(admin)
            .await?;
        n += 1;
    }
    Ok(n)
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
    let slow = vec![call(
        "slow",
        "test.behave",
        json!({"sleep_ms": 1500, "value": 1}),
    )];
    let mut in_flight = fleet
        .client
        .submit(timed_turn("acme", 20_000, slow))
        .await?;

    // Fill to about 93 % of maxmemory.
    let n = fill_to(&mut admin, max, 93).await?;

    let quick = || vec![call("quick", "test.behave", json!({"value": 2}))];
    eventually_named(
        "a new turn refused with overloaded",
        Duration::from_secs(10),
        || {
            let client = fleet.client.clone();
            let request = timed_turn("acme", 5_000, quick());
            async move {
                let mut stream = client.submit(request).await.ok()?;
                let events = read_to_end(&mut stream, Duration::from_secs(10))
                    .await
                    .ok()?;
                match events.last()? {
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

    // Memory freed: turns run again.
    for k in 0..n {
        let () = redis::cmd("DEL")
            .arg(format!("junk:{k}"))
            .query_async(&mut admin)
            .await?;
    }
    eventually_named("turns run again", Duration::from_secs(10), || {
        let client = fleet.client.clone();
        let request = timed_turn("acme", 5_000, quick());
        async move {
            let mut stream = client.submit(request).await.ok()?;
            let events = read_to_end(&mut stream, Duration::from_secs(10))
                .await
                .ok()?;
            matches!(events.last()?, TurnEvent::Final(f) if f.summary.ok == 1).then_some(())
        }
    })
    .await?;
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
        let mut stream = fleet
            .client
            .submit(timed_turn("acme", 5_000, quick))
            .await?;
        let events = read_to_end(&mut stream, Duration::from_secs(10)).await?;
        assert!(matches!(events.last(), Some(TurnEvent::Final(_))));
        ended.push(stream.turn_id().to_string());
    }
    // One turn still open.
    let slow = vec![call(
        "slow",
        "test.behave",
        json!({"sleep_ms": 3000, "value": 1}),
    )];
    let mut open = fleet
        .client
        .submit(timed_turn("acme", 20_000, slow))
        .await?;
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
    let mut stream = fleet
        .client
        .submit(timed_turn("acme", 5_000, quick))
        .await?;
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
        let mut stream = fleet
            .client
            .submit(timed_turn("acme", 10_000, calls.to_vec()))
            .await?;
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
    // Before each result was kept once, the no-op turn held 4,552 bytes.
    assert!(small <= 4_000, "a three-call turn holds {small} bytes");
    assert!(sleepy <= 4_400, "a three-call turn holds {sleepy} bytes");
    assert!(
        large <= results_once * 3 / 2,
        "a turn of {results_once} bytes of results holds {large} bytes"
    );
    Ok(())
}
