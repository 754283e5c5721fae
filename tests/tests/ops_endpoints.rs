//! The operational HTTP endpoints of real coordinator and worker processes: liveness,
//! readiness that follows Redis, and Prometheus metrics that count the calls of a turn.

use std::time::Duration;

use serde_json::json;
use toolfleet_tests::fleet::{call, Fleet};
use toolfleet_tests::{eventually_named, free_port, http_get, metric_value, wait_http_status};

/// Waits (at most 15 s) until `GET path` on `port` answers `want`.
async fn wait_status(port: u16, path: &str, want: u16) -> anyhow::Result<()> {
    wait_http_status(port, path, want, Duration::from_secs(15)).await?;
    Ok(())
}

/// The series an alert reads per tool exist at 0 before any event: on a coordinator
/// once it learned the tool (calls refused `no_live_worker`, calls ended by outcome),
/// on a worker once it serves the tool (jobs handed back at shutdown, redelivered, ...).
/// A counter born at its first value has no earlier sample: `increase()` over it stays
/// 0, and one `no_live_worker` refusal of a quiet tool would never fire
/// ToolfleetNoLiveWorker.
async fn tool_series_start_at_zero(coordinator: u16, worker: u16) -> anyhow::Result<()> {
    let tool = "gen_ai_tool_name=\"test.behave\"";
    let mut expected: Vec<(u16, String, String)> = Vec::new();
    for error_type in toolfleet_common::metrics::TOOL_ALERT_ERROR_TYPES {
        let label = format!("error_type=\"{error_type}\"");
        expected.push((coordinator, "toolfleet_errors_total".into(), label));
    }
    for outcome in toolfleet_common::metrics::TOOL_CALL_OUTCOMES {
        let label = format!("outcome=\"{outcome}\"");
        expected.push((coordinator, "toolfleet_calls_total".into(), label));
    }
    for counter in toolfleet_common::metrics::WORKER_TOOL_COUNTERS {
        let name = format!("{}_total", counter.replace('.', "_"));
        expected.push((worker, name, tool.to_string()));
    }
    for (port, name, label) in &expected {
        let what = format!("{name}{{{label},{tool}}} on port {port}");
        let value = eventually_named(&what, Duration::from_secs(15), || async {
            let (_, text) = http_get(*port, "/metrics").await.ok()?;
            metric_value(&text, name, &[label.as_str(), tool])
        })
        .await?;
        assert_eq!(value, 0.0, "{what}");
    }
    // The worker's hand-backs and redeliveries by name, as the dashboard reads them.
    let (_, text) = http_get(worker, "/metrics").await?;
    for name in [
        "toolfleet_jobs_handed_back_total",
        "toolfleet_jobs_redeliveries_total",
    ] {
        assert_eq!(
            metric_value(&text, name, &[tool]),
            Some(0.0),
            "{name}: {text}"
        );
    }
    Ok(())
}

/// A tool's own code ("boom") is counted as `other`, so codes cannot grow the series; the
/// build info, in-flight turns and process metrics are there from the start.
fn bounded_and_always_present(metrics: &str) {
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("toolfleet_errors_total{") && l.contains("error_type=\"other\"")),
        "{metrics}"
    );
    assert!(!metrics.contains("boom"), "{metrics}");
    for name in [
        "toolfleet_build_info",
        "toolfleet_turns_in_flight",
        "process_memory_usage_bytes",
        "process_open_fds",
        "process_cpu_time_seconds_total",
    ] {
        assert!(
            metric_value(metrics, name, &[]).is_some(),
            "{name}: {metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() -> anyhow::Result<()> {
    let mut fleet = Fleet::start().await?;
    let coordinator_port = free_port()?;
    let worker_port = free_port()?;
    let c_addr = format!("127.0.0.1:{coordinator_port}");
    let w_addr = format!("127.0.0.1:{worker_port}");
    fleet.spawn_node("coordinator", &[("TOOLFLEET_HTTP_ADDR", c_addr.as_str())])?;
    fleet.spawn_node("worker", &[("TOOLFLEET_HTTP_ADDR", w_addr.as_str())])?;
    fleet.wait_for_tools(&["test.behave"]).await?;

    for port in [coordinator_port, worker_port] {
        wait_status(port, "/healthz", 200).await?;
        wait_status(port, "/readyz", 200).await?;
        assert_eq!(http_get(port, "/nope").await?.0, 404);
    }
    tool_series_start_at_zero(coordinator_port, worker_port).await?;

    let calls = vec![
        call("a", "test.behave", json!({})),
        call("b", "test.behave", json!({"fail": "boom"})),
    ];
    let outcome = fleet
        .run_calls("acme", calls, Duration::from_secs(10))
        .await?;
    assert_eq!(outcome.final_event.summary.ok, 1);

    let (status, metrics) = http_get(coordinator_port, "/metrics").await?;
    assert_eq!(status, 200);
    let calls: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("toolfleet_calls_total{"))
        .collect();
    assert!(
        calls
            .iter()
            .any(|l| l.contains("outcome=\"done\"") && l.contains("test.behave")),
        "{metrics}"
    );
    bounded_and_always_present(&metrics);
    assert!(
        metrics.contains("toolfleet_turn_duration_seconds_bucket"),
        "{metrics}"
    );
    let (_, worker_metrics) = http_get(worker_port, "/metrics").await?;
    let capacity = metric_value(
        &worker_metrics,
        "toolfleet_worker_capacity",
        &["gen_ai_tool_name=\"test.behave\""],
    );
    assert_eq!(capacity, Some(8.0), "{worker_metrics}");
    assert!(
        worker_metrics.contains("toolfleet_call_duration_seconds_bucket"),
        "{worker_metrics}"
    );

    // Calls running now, by tool: one while a call sleeps, none once it ended.
    let in_flight = |text: &str| {
        metric_value(
            text,
            "toolfleet_jobs_in_flight",
            &["gen_ai_tool_name=\"test.behave\""],
        )
    };
    assert_eq!(in_flight(&worker_metrics), Some(0.0), "{worker_metrics}");
    let running = vec![call("slow", "test.behave", json!({"sleep_ms": 1500}))];
    let watch = async {
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let (_, text) = http_get(worker_port, "/metrics").await?;
            if in_flight(&text) == Some(1.0) || tokio::time::Instant::now() >= until {
                return anyhow::Ok(in_flight(&text));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (outcome, seen) = tokio::join!(
        fleet.run_calls("acme", running, Duration::from_secs(10)),
        watch
    );
    assert_eq!(outcome?.final_event.summary.ok, 1);
    assert_eq!(seen?, Some(1.0));
    let (_, worker_metrics) = http_get(worker_port, "/metrics").await?;
    assert_eq!(in_flight(&worker_metrics), Some(0.0), "{worker_metrics}");

    // Readiness follows Redis; liveness does not.
    fleet.redis.stop().await;
    wait_status(coordinator_port, "/readyz", 503).await?;
    wait_status(worker_port, "/readyz", 503).await?;
    assert_eq!(http_get(coordinator_port, "/healthz").await?.0, 200);
    fleet.redis.restart().await?;
    wait_status(coordinator_port, "/readyz", 200).await?;
    Ok(())
}
