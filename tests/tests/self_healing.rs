//! A fleet that heals after NATS loses its data: nats-server stopped, its JetStream
//! store wiped and started again empty, while a coordinator and a worker process keep
//! running. The coordinator recreates both streams and the results consumer, the tool
//! consumers are recreated by the worker or the coordinator (whichever checks first),
//! and turns are answered again without restarting either process.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::json;
use toolfleet_tests::fleet::{call, Fleet};
use toolfleet_tests::{free_port, http_get, metric_value, wait_http_status};

/// How long after NATS is back the fleet must answer turns again: the reconnect (the
/// clients retry within a few hundred ms), one topology check (1 s by default) for the
/// streams and consumers, and the renewal of a pull request the server lost (a worker
/// gives a silent batch up after 2 s, the coordinator its results pull after two missed
/// 1 s heartbeats). Measured: about 1.9 s.
const HEAL_BOUND: Duration = Duration::from_secs(6);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_serves_again_after_nats_restarts_with_an_empty_store() -> Result<()> {
    let mut fleet = Fleet::start().await?;
    let (c_port, w_port) = (free_port()?, free_port()?);
    let (c_addr, w_addr) = (format!("127.0.0.1:{c_port}"), format!("127.0.0.1:{w_port}"));
    fleet.spawn_node("coordinator", &[("TOOLFLEET_HTTP_ADDR", c_addr.as_str())])?;
    fleet.spawn_node("worker", &[("TOOLFLEET_HTTP_ADDR", w_addr.as_str())])?;
    fleet.wait_for_tools(&["test.behave"]).await?;
    let before = fleet
        .run_calls(
            "acme",
            vec![call("a", "test.behave", json!({}))],
            Duration::from_secs(10),
        )
        .await?;
    assert_eq!(before.final_event.summary.ok, 1);

    fleet.nats.stop().await;
    let store = fleet.nats.store_dir().to_path_buf();
    std::fs::remove_dir_all(&store)?;
    std::fs::create_dir_all(&store)?;
    fleet.nats.restart().await?;
    let back = Instant::now();

    let js = async_nats::jetstream::new(fleet.nats.connect().await?);
    let mut served_at = None;
    let mut n = 0;
    while back.elapsed() < HEAL_BOUND + Duration::from_secs(10) {
        n += 1;
        let id = format!("after-{n}");
        let turn = fleet.run_calls(
            "acme",
            vec![call(&id, "test.behave", json!({}))],
            Duration::from_secs(2),
        );
        if let Ok(Ok(outcome)) = tokio::time::timeout(Duration::from_secs(3), turn).await {
            if outcome.final_event.summary.ok == 1 {
                served_at = Some(back.elapsed());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let served_at = served_at.context("no turn answered after NATS came back empty")?;
    eprintln!("fleet served again {served_at:?} after NATS came back empty");
    assert!(served_at < HEAL_BOUND, "healed only after {served_at:?}");

    for stream in [fleet.names.jobs_stream(), fleet.names.results_stream()] {
        js.get_stream(&stream)
            .await
            .with_context(|| stream.clone())?;
    }
    wait_http_status(c_port, "/readyz", 200, Duration::from_secs(10)).await?;
    wait_http_status(w_port, "/readyz", 200, Duration::from_secs(10)).await?;
    let (_, coordinator) = http_get(c_port, "/metrics").await?;
    let recreated = metric_value(
        &coordinator,
        "toolfleet_topology_recreated_total",
        &["kind=\"stream\""],
    );
    assert_eq!(recreated, Some(2.0), "{coordinator}");
    // The tool's consumer is back, recreated by whichever process checked first: the
    // worker, or the coordinator, which keeps every tool's consumer too. Between them
    // they count at least two consumers: the coordinators' own and the tool's.
    js.get_stream(fleet.names.jobs_stream())
        .await?
        .consumer_info(fleet.names.tool_consumer("test.behave"))
        .await
        .context("the tool's consumer")?;
    let (_, worker) = http_get(w_port, "/metrics").await?;
    let consumers = |text: &str| {
        metric_value(
            text,
            "toolfleet_topology_recreated_total",
            &["kind=\"consumer\""],
        )
        .unwrap_or(0.0)
    };
    assert!(
        consumers(&coordinator) + consumers(&worker) >= 2.0,
        "{coordinator}\n{worker}"
    );
    Ok(())
}

/// A best-effort publish (a turn's events) never waits for a reconnection: while the
/// connection is down its outgoing queue fills, and `publish_within` gives up after its
/// bound instead of waiting as a plain publish does; once the server is back it sends
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_publish_gives_up_while_the_connection_is_down() -> Result<()> {
    use toolfleet_common::failover::{publish_within, PublishWithinError};
    use toolfleet_tests::NatsServer;

    let mut nats = NatsServer::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let wait = Duration::from_millis(100);
    let body = bytes::Bytes::from_static(b"event");
    publish_within(&client, "bounded.x".into(), body.clone(), wait).await?;

    nats.kill().await;
    // Queued at once until the queue is full, then one that gives up after `wait`.
    let mut gave_up = None;
    for queued in 0..20_000 {
        let started = Instant::now();
        match publish_within(&client, "bounded.x".into(), body.clone(), wait).await {
            Ok(()) => continue,
            Err(PublishWithinError::QueueFull(bound)) => {
                gave_up = Some((queued, started.elapsed(), bound));
                break;
            }
            Err(error) => return Err(error.into()),
        }
    }
    let (queued, took, bound) = gave_up.context("the queue never filled while NATS was down")?;
    assert_eq!(bound, wait);
    assert!(queued > 0, "the first publishes are queued");
    assert!(
        took >= wait && took < wait + Duration::from_secs(1),
        "gave up after {took:?}, bound {wait:?}"
    );

    nats.restart().await?;
    let listener = async_nats::connect(nats.url()).await?;
    let mut heard = listener.subscribe("bounded.back").await?;
    listener.flush().await?;
    let back = async {
        loop {
            let _ = publish_within(&client, "bounded.back".into(), body.clone(), wait).await;
            if let Ok(Some(_)) =
                tokio::time::timeout(Duration::from_millis(200), heard.next()).await
            {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(15), back)
        .await
        .context("publishes did not reach the server after it came back")?;
    Ok(())
}

/// A process moves off its NATS server only when JetStream through it describes none of
/// the fleet's streams: a stream that answers says the server still reaches the
/// cluster, and the failure was one stream's or consumer's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_is_claimed_only_when_no_stream_is_described_through_the_server() -> Result<()> {
    use toolfleet_common::failover::Failover;
    use toolfleet_tests::NatsServer;

    let nats = NatsServer::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client.clone());
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: "PROBED".into(),
        subjects: vec!["probed.>".into()],
        ..Default::default()
    })
    .await?;
    // As if several servers were configured: moves may be claimed.
    let failover = Failover::of(&client, true);
    let some = ["GONE".to_string(), "PROBED".to_string()];
    assert!(
        !failover.claim_if_cut_off(&js, &some).await,
        "one stream answers: no move"
    );
    let none = ["GONE".to_string(), "NEVER".to_string()];
    tokio::time::sleep(Duration::from_millis(1100)).await; // past the held answer
    assert!(
        failover.claim_if_cut_off(&js, &none).await,
        "no stream answers: a move"
    );
    assert!(
        !failover.claim_if_cut_off(&js, &none).await,
        "moves are spaced"
    );
    Ok(())
}
