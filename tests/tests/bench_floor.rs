//! `toolfleet-dev bench --quick --phases floor,overhead`, built from this checkout: the floor
//! phase drives turns through the bare hops of a durable turn (a stand-in coordinator
//! and worker on the product's streams and Redis), and the overhead phase reports what
//! the fleet adds above them.

use std::time::Duration;

use anyhow::{Context, Result};
use toolfleet_tests::fleet::bench_report;

/// Bound of the whole run: the servers, the floor's round trips, one fleet's turns.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floor_measures_a_durable_turn_through_the_bare_hops() -> Result<()> {
    let args = ["--quick", "--phases", "floor,overhead", "--tracing", "off"];
    let report = bench_report(&args, RUN_TIMEOUT).await?;
    let mode = &report["modes"][0];

    let skeleton = &mode["floor"]["skeleton"];
    let figure = |stage: &str, name: &str| skeleton[stage][name].as_f64().unwrap_or(-1.0);
    // The quick plan's 300 samples, every turn answered with its ack and its final.
    for stage in ["ack", "turn"] {
        assert_eq!(skeleton[stage]["count"].as_u64(), Some(300), "{skeleton}");
        assert!(figure(stage, "p50_ms") > 0.0, "{skeleton}");
    }
    // The ack comes before the final of the same turn, so at every rank.
    assert!(
        figure("ack", "p50_ms") <= figure("turn", "p50_ms"),
        "{skeleton}"
    );
    // A durable turn crosses more than one NATS round trip: its jobs and results are
    // stored and pulled, and it makes Redis round trips.
    let request_reply = mode["floor"]["nats_request_reply"]["p50_ms"]
        .as_f64()
        .context("the NATS round trip")?;
    assert!(
        figure("turn", "p50_ms") > request_reply,
        "{}",
        mode["floor"]
    );

    let overhead = &mode["overhead"];
    let added = overhead["over_skeleton_p50_ms"]
        .as_f64()
        .context("the overhead over the bare turn")?;
    let turn_p50 = overhead["turn"]["p50_ms"]
        .as_f64()
        .context("the turn p50")?;
    assert!(
        (turn_p50 - figure("turn", "p50_ms") - added).abs() < 0.002,
        "{overhead}"
    );
    assert!(
        overhead["floor_multiple_p50"].as_f64().is_some(),
        "{overhead}"
    );
    Ok(())
}
