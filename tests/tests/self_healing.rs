//! A fleet that heals after NATS loses its data: nats-server stopped, its JetStream
//! store wiped and started again empty, while a coordinator and a worker process keep
//! running. The coordinator recreates both streams and the results consumer, the worker
//! its tool consumers, and turns are answered again without restarting either process.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
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
    let (_, text) = http_get(c_port, "/metrics").await?;
    let recreated = metric_value(
        &text,
        "toolfleet_topology_recreated_total",
        &["kind=\"stream\""],
    );
    assert_eq!(recreated, Some(2.0), "{text}");
    let (_, text) = http_get(w_port, "/metrics").await?;
    let recreated = metric_value(
        &text,
        "toolfleet_topology_recreated_total",
        &["kind=\"consumer\""],
    );
    assert!(recreated.unwrap_or(0.0) >= 1.0, "{text}");
    Ok(())
}
