//! Tenants share a saturated tool fairly: a tenant with one call is not queued behind
//! another tenant's backlog, a tenant's cap on calls in flight holds, and a tenant over
//! its own limits is refused with `overloaded` while other tenants go on. Every turn
//! accepted ends with all its calls answered.
//!
//! Turns that end by cancel release their slots and waiting calls at once.
//!
//! Assertions are on counts and order (how many of the heavy tenant's calls started
//! before the light one's), with generous bounds, never on latency.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;
use tokio::task::JoinHandle;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::turn::{turn_codes, CancelOutcome};
use toolfleet_common::{CallState, FinalEvent, TurnEvent};
use toolfleet_coordinator::config::{TenantPolicies, TenantPolicy};
use toolfleet_tests::fleet::{call, named_turn, read_ack, read_to_end, timed_turn, Fleet, Running};

const HEAVY: &str = "heavy";
const LIGHT: &str = "light";
/// The heavy tenant's calls: long enough that its backlog lasts seconds on 8 slots.
const HEAVY_MS: u64 = 200;
/// Longest wait for any one event (a heavy turn waits its turn behind the backlog).
const EVENT_WAIT: Duration = Duration::from_secs(20);

async fn start(fleet: &Fleet, tenants: TenantPolicies) -> anyhow::Result<(Running, Running)> {
    let mut config = fleet.coordinator_config();
    config.tenants = tenants;
    let tools = toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg)?;
    fleet.start_with(config, tools, &["test.behave"]).await
}

/// A turn of `tenant` with `calls` calls of `sleep_ms`, ids `<prefix>-<i>`.
fn sleepy(
    tenant: &str,
    prefix: &str,
    calls: usize,
    sleep_ms: u64,
    deadline_ms: u64,
) -> toolfleet_common::TurnRequest {
    let calls = (0..calls)
        .map(|i| {
            let id = format!("{prefix}-{i}");
            call(
                &id,
                "test.behave",
                json!({"sleep_ms": sleep_ms, "value": id}),
            )
        })
        .collect();
    timed_turn(tenant, deadline_ms, calls)
}

/// Runs `request` to its end: its `final`, or the `error` event's code.
async fn outcome(
    fleet: &Fleet,
    request: toolfleet_common::TurnRequest,
) -> anyhow::Result<Result<FinalEvent, String>> {
    let mut stream = fleet.client.submit(request).await?;
    let events = read_to_end(&mut stream, EVENT_WAIT).await?;
    Ok(match events.last() {
        Some(TurnEvent::Final(fin)) => Ok(fin.clone()),
        Some(TurnEvent::Error { error, .. }) => {
            // Every refusal here is `overloaded`, which says when to try again.
            if error.code == turn_codes::OVERLOADED {
                assert!(
                    error.retryable && error.retry_after_ms.is_some(),
                    "{error:?}"
                );
            }
            Err(error.code.clone())
        }
        other => anyhow::bail!("the turn ended with {other:?}"),
    })
}

fn all_ok(fin: &FinalEvent, calls: usize) {
    assert!(!fin.deadline_hit, "{fin:?}");
    assert_eq!(fin.summary.total, calls);
    assert_eq!(fin.summary.ok, calls, "{:?}", fin.results);
}

/// The heavy tenant's `turns` turns of four calls of [`HEAVY_MS`] (deadline 30 s), each
/// submitted and read to its end in its own task.
fn heavy_backlog(fleet: &Fleet, turns: usize) -> Vec<JoinHandle<anyhow::Result<Vec<TurnEvent>>>> {
    (0..turns)
        .map(|t| {
            let request = sleepy(HEAVY, &format!("h{t}"), 4, HEAVY_MS, 30_000);
            let client = fleet.client.clone();
            tokio::spawn(async move {
                let mut stream = client.submit(request).await?;
                anyhow::Ok(read_to_end(&mut stream, EVENT_WAIT).await?)
            })
        })
        .collect()
}

/// Waits for every turn of [`heavy_backlog`] and asserts each ended with its final, its
/// four calls all done.
async fn all_heavy_ok(
    heavy: Vec<JoinHandle<anyhow::Result<Vec<TurnEvent>>>>,
) -> anyhow::Result<()> {
    for turn in heavy {
        let events = turn.await??;
        match events.last() {
            Some(TurnEvent::Final(fin)) => all_ok(fin, 4),
            other => anyhow::bail!("a heavy turn ended with {other:?}"),
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_is_not_queued_behind_a_heavy_backlog() -> anyhow::Result<()> {
    const HEAVY_TURNS: usize = 24;
    let fleet = Fleet::start().await?;
    let (_c, _w) = start(&fleet, TenantPolicies::default()).await?;
    let mut progress = fleet.subscribe_progress().await?;

    // 96 calls of 200 ms on one worker of 8 slots: a 2.4 s backlog.
    let heavy = heavy_backlog(&fleet, HEAVY_TURNS);
    // Once the tool is busy, the light tenant asks for one 10 ms call.
    let mut started = Vec::new();
    let busy_by = Instant::now() + Duration::from_secs(10);
    while started.len() < 8 {
        let notice = tokio::time::timeout_at(busy_by.into(), progress.next()).await?;
        let Some(message) = notice else {
            anyhow::bail!("progress subscription ended")
        };
        if let Ok(ProgressNotice::Started { tool_call_id, .. }) =
            serde_json::from_slice(&message.payload)
        {
            started.push(tool_call_id);
        }
    }
    let light = sleepy(LIGHT, "light", 1, 10, 30_000);
    let light_turn = tokio::spawn({
        let client = fleet.client.clone();
        async move {
            let mut stream = client.submit(light).await?;
            anyhow::Ok(read_to_end(&mut stream, EVENT_WAIT).await?)
        }
    });
    let submitted_after = started.len();
    let until = Instant::now() + EVENT_WAIT;
    loop {
        let notice = tokio::time::timeout_at(until.into(), progress.next()).await?;
        let Some(message) = notice else {
            anyhow::bail!("progress subscription ended")
        };
        if let Ok(ProgressNotice::Started { tool_call_id, .. }) =
            serde_json::from_slice(&message.payload)
        {
            let light = tool_call_id == "light-0";
            started.push(tool_call_id);
            if light {
                break;
            }
        }
    }
    // Heavy calls that started after the light turn was submitted and before its call:
    // those already on the stream then (the tool's slots and one headroom's worth, at
    // most 16 on 8 slots), never the backlog of 80 behind them.
    let ahead = started.len() - 1 - submitted_after;
    assert!(
        ahead <= 24,
        "{ahead} heavy calls started between the light turn's submission and its call: {started:?}"
    );

    let events = light_turn.await??;
    match events.last() {
        Some(TurnEvent::Final(fin)) => all_ok(fin, 1),
        other => anyhow::bail!("the light turn ended with {other:?}"),
    }
    all_heavy_ok(heavy).await
}

/// The most calls of `fin` that ran at the same time, from their timings.
fn most_at_once(fin: &FinalEvent) -> usize {
    let mut edges: BTreeMap<(String, u8), i64> = BTreeMap::new();
    for r in &fin.results {
        let (Some(start), Some(end)) = (&r.started_at, &r.ended_at) else {
            continue;
        };
        // Ends sort before starts at the same instant: back to back is not overlap.
        *edges.entry((end.clone(), 0)).or_default() -= 1;
        *edges.entry((start.clone(), 1)).or_default() += 1;
    }
    let (mut now, mut most) = (0i64, 0i64);
    for delta in edges.values() {
        now += delta;
        most = most.max(now);
    }
    usize::try_from(most).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_cap_on_calls_in_flight_holds_on_a_free_tool() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tenants = TenantPolicies {
        tenants: BTreeMap::from([(
            "capped".to_string(),
            TenantPolicy {
                max_calls_in_flight: Some(2),
                ..TenantPolicy::default()
            },
        )]),
        ..TenantPolicies::default()
    };
    let (_c, _w) = start(&fleet, tenants).await?;
    let fin = match outcome(&fleet, sleepy("capped", "c", 6, 150, 20_000)).await? {
        Ok(fin) => fin,
        Err(code) => anyhow::bail!("refused: {code}"),
    };
    all_ok(&fin, 6);
    let most = most_at_once(&fin);
    assert!(most <= 2, "{most} calls ran at once: {:?}", fin.results);
    // Another tenant's identical turn runs its calls together.
    let free = match outcome(&fleet, sleepy("free", "f", 6, 150, 20_000)).await? {
        Ok(fin) => fin,
        Err(code) => anyhow::bail!("refused: {code}"),
    };
    all_ok(&free, 6);
    assert!(most_at_once(&free) > 2, "{:?}", free.results);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_own_limits_is_refused_and_others_go_on() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tenants = TenantPolicies {
        tenants: BTreeMap::from([(
            HEAVY.to_string(),
            TenantPolicy {
                max_turns_in_flight: Some(20),
                ..TenantPolicy::default()
            },
        )]),
        ..TenantPolicies::default()
    };
    let (_c, _w) = start(&fleet, tenants).await?;

    // 20 turns of four 200 ms calls, accepted one after the other: the tenant's limit
    // (the first ends about 200 ms after its acceptance).
    let mut streams = Vec::new();
    for t in 0..20 {
        let request = sleepy(HEAVY, &format!("h{t}"), 4, HEAVY_MS, 30_000);
        let mut stream = fleet.client.submit(request).await?;
        read_ack(&mut stream, EVENT_WAIT).await?;
        streams.push(stream);
    }
    // One more turn is past the tenant's turns in flight.
    let refused = outcome(&fleet, sleepy(HEAVY, "over", 1, 10, 30_000)).await?;
    assert_eq!(refused.err().as_deref(), Some(turn_codes::OVERLOADED));
    let heavy: Vec<_> = streams
        .into_iter()
        .map(|mut stream| {
            tokio::spawn(async move { anyhow::Ok(read_to_end(&mut stream, EVENT_WAIT).await?) })
        })
        .collect();

    // The other tenant, with the same short deadline, is neither refused nor late.
    let light = outcome(&fleet, sleepy(LIGHT, "light", 1, 10, 1_500)).await?;
    match light {
        Ok(fin) => all_ok(&fin, 1),
        Err(code) => anyhow::bail!("the light tenant was refused: {code}"),
    }

    let mut ended = 0;
    for turn in heavy {
        let events = turn.await??;
        match events.last() {
            Some(TurnEvent::Final(fin)) => {
                all_ok(fin, 4);
                ended += 1;
            }
            other => anyhow::bail!("a heavy turn ended with {other:?}"),
        }
    }
    assert_eq!(ended, 20);
    // Its turns ended: the tenant is let in again.
    let again = outcome(&fleet, sleepy(HEAVY, "again", 1, 10, 5_000)).await?;
    assert!(again.is_ok(), "{again:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_that_would_outlive_the_deadline_is_refused() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let (_c, _w) = start(&fleet, TenantPolicies::default()).await?;
    let heavy = heavy_backlog(&fleet, 20);
    tokio::time::sleep(Duration::from_millis(600)).await;
    // About 60 calls of its own still wait: 1.5 s on 8 slots, past a 1 s deadline.
    let refused = outcome(&fleet, sleepy(HEAVY, "late", 1, 10, 1_000)).await?;
    assert_eq!(refused.err().as_deref(), Some(turn_codes::OVERLOADED));
    // The light tenant's turn with the same deadline runs.
    match outcome(&fleet, sleepy(LIGHT, "light", 1, 10, 1_000)).await? {
        Ok(fin) => all_ok(&fin, 1),
        Err(code) => anyhow::bail!("the light tenant was refused: {code}"),
    }
    all_heavy_ok(heavy).await
}

/// A tenant that fills a tool and then cancels its turns frees the tool at once: the
/// cancelled turns' slots and their calls still waiting in the lane are released when
/// the turns end, not at their deadlines, so another tenant's turn runs right after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_turns_release_their_lane_slots_at_once() -> anyhow::Result<()> {
    const TURNS: usize = 10;
    let fleet = Fleet::start().await?;
    let (_c, _w) = start(&fleet, TenantPolicies::default()).await?;

    // 10 turns × 8 calls of 5 s (deadline 60 s) on one worker of 8 slots: the slots and
    // the stream's headroom are taken, some 70 calls wait in the lane.
    let mut streams = Vec::with_capacity(TURNS);
    for t in 0..TURNS {
        let mut stream = fleet
            .client
            .submit(sleepy(HEAVY, &format!("x{t}"), 8, 5_000, 60_000))
            .await?;
        read_ack(&mut stream, EVENT_WAIT).await?;
        streams.push(stream);
    }
    for stream in &streams {
        let reply = fleet
            .client
            .cancel(stream.turn_id(), None, EVENT_WAIT)
            .await?;
        assert_eq!(reply.outcome, CancelOutcome::Cancelled, "{reply:?}");
    }
    for mut stream in streams {
        let events = read_to_end(&mut stream, EVENT_WAIT).await?;
        match events.last() {
            Some(TurnEvent::Final(fin)) => {
                assert_eq!(fin.summary.total, 8);
                assert!(
                    fin.results.iter().all(|r| r.state == CallState::Cancelled),
                    "{fin:?}"
                );
            }
            other => anyhow::bail!("a cancelled turn ended with {other:?}"),
        }
    }

    // Another tenant's one 10 ms call, with 8 s to run: the cancelled turns' slots would
    // otherwise be held until their 60 s deadlines.
    let light = outcome(&fleet, sleepy(LIGHT, "light", 1, 10, 8_000)).await?;
    match light {
        Ok(fin) => all_ok(&fin, 1),
        Err(code) => anyhow::bail!("the other tenant's turn was refused: {code}"),
    }
    // And the cancelling tenant's own next turn too.
    let again = outcome(&fleet, sleepy(HEAVY, "again", 2, 10, 8_000)).await?;
    match again {
        Ok(fin) => all_ok(&fin, 2),
        Err(code) => anyhow::bail!("the tenant's next turn was refused: {code}"),
    }
    Ok(())
}

/// A turn refused as it is stored (its id names another request's turn) gives back the
/// place among its tenant's turns in flight it took when admitted, and so does a
/// cancelled one: a tenant limited to one turn in flight is let in again at once, not
/// at those turns' deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_cancelled_turns_give_back_their_place_in_flight() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tenants = TenantPolicies {
        tenants: BTreeMap::from([(
            HEAVY.to_string(),
            TenantPolicy {
                max_turns_in_flight: Some(1),
                ..TenantPolicy::default()
            },
        )]),
        ..TenantPolicies::default()
    };
    let (_c, _w) = start(&fleet, tenants).await?;
    let quick = |value: &str| vec![call("c1", "test.behave", json!({"value": value}))];

    // The turn `taken` ends; the same id with another decision is refused when stored.
    let mut first = fleet
        .client
        .submit(named_turn("taken", HEAVY, 30_000, quick("first")))
        .await?;
    let events = read_to_end(&mut first, EVENT_WAIT).await?;
    assert!(
        matches!(events.last(), Some(TurnEvent::Final(_))),
        "{events:?}"
    );
    let conflict = outcome(&fleet, named_turn("taken", HEAVY, 60_000, quick("other"))).await?;
    assert_eq!(
        conflict.err().as_deref(),
        Some(turn_codes::TURN_ID_CONFLICT)
    );
    match outcome(&fleet, sleepy(HEAVY, "after-refusal", 1, 10, 5_000)).await? {
        Ok(fin) => all_ok(&fin, 1),
        Err(code) => anyhow::bail!("the tenant was refused after a refused turn: {code}"),
    }

    // A turn of a 5 s call (deadline 60 s), cancelled: the next turn goes in at once.
    let mut long = fleet
        .client
        .submit(sleepy(HEAVY, "long", 1, 5_000, 60_000))
        .await?;
    read_ack(&mut long, EVENT_WAIT).await?;
    let reply = fleet
        .client
        .cancel(long.turn_id(), None, EVENT_WAIT)
        .await?;
    assert_eq!(reply.outcome, CancelOutcome::Cancelled, "{reply:?}");
    read_to_end(&mut long, EVENT_WAIT).await?;
    match outcome(&fleet, sleepy(HEAVY, "after-cancel", 1, 10, 5_000)).await? {
        Ok(fin) => all_ok(&fin, 1),
        Err(code) => anyhow::bail!("the tenant was refused after a cancelled turn: {code}"),
    }
    Ok(())
}
