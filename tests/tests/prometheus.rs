//! The alert rules against a real Prometheus (Debian's `prometheus` package): `promtool`
//! checks and unit-tests deploy/prometheus/alerts.yml, and a Prometheus scraping a real
//! coordinator and worker sees a turn storm with a failing tool take the error-ratio
//! alert to pending and then firing, for that tool only.
//!
//! Every query of every panel of the Grafana dashboard runs against that Prometheus; with
//! `TOOLFLEET_DASHBOARD_SVG=docs/dashboard.svg` the test also draws the panels there.
//!
//! The scrape test loads the rules with their windows and `for` durations scaled down
//! (minutes to seconds), so the same expressions fire within the test's bounds.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use toolfleet_tests::fleet::{call, Fleet};
use toolfleet_tests::{
    dashboard, eventually_named, free_port, http_get, repo_path, wait_http_status,
};

/// `name` from Debian's `prometheus` package; an error naming the package when missing.
fn prometheus_tool(name: &str) -> Result<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(name))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/bin").join(name)])
        .find(|p| p.is_file())
        .with_context(|| format!("{name} not found: apt-get install -y prometheus"))
}

fn promtool(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new(prometheus_tool("promtool")?)
        .args(args)
        .current_dir(repo_path("deploy/prometheus"))
        .output()?;
    if !out.status.success() {
        bail!(
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

#[test]
fn promtool_checks_and_tests_the_alert_rules() -> Result<()> {
    promtool(&["check", "rules", "alerts.yml"])?;
    promtool(&["test", "rules", "alerts_test.yml"])
}

/// alerts.yml with every `[Nm]` window at 10 s and every `for: Nm` at 3 s.
fn time_scaled_rules() -> Result<String> {
    let text = std::fs::read_to_string(repo_path("deploy/prometheus/alerts.yml"))?;
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut line = line.to_string();
        for minutes in 1..=15 {
            line = line.replace(&format!("[{minutes}m]"), "[10s]");
            line = line.replace(&format!("for: {minutes}m"), "for: 3s");
        }
        out.push_str(&line);
        out.push('\n');
    }
    Ok(out)
}

/// A Prometheus scraping `targets` (job, port) every second, with the scaled rules.
async fn start_prometheus(
    dir: &std::path::Path,
    port: u16,
    targets: &[(&str, u16)],
) -> Result<Child> {
    std::fs::write(dir.join("alerts.yml"), time_scaled_rules()?)?;
    let mut config = String::from(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [alerts.yml]\nscrape_configs:\n",
    );
    for (job, target) in targets {
        config.push_str(&format!(
            "  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        ));
    }
    std::fs::write(dir.join("prometheus.yml"), config)?;
    let log = std::fs::File::create(dir.join("prometheus.log"))?;
    Ok(Command::new(prometheus_tool("prometheus")?)
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()?)
}

/// The state (`pending`, `firing`) of `alert` for `tool`, if Prometheus has it.
async fn alert_state(port: u16, alert: &str, tool: &str) -> Option<String> {
    let (status, body) = http_get(port, "/api/v1/alerts").await.ok()?;
    let body: Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
    body["data"]["alerts"].as_array()?.iter().find_map(|a| {
        let labels = &a["labels"];
        (labels["alertname"] == alert && labels["gen_ai_tool_name"] == tool)
            .then(|| a["state"].as_str().unwrap_or_default().to_string())
    })
}

/// Turns until aborted: each with a failing `test.behave` call, a slow one that succeeds
/// and a `test.noop`.
async fn storm(client: toolfleet_common::FleetClient) {
    for n in 0u64.. {
        let calls = vec![
            call(&format!("f{n}"), "test.behave", json!({"fail": "boom"})),
            call(
                &format!("s{n}"),
                "test.behave",
                json!({"sleep_ms": 50 + (n * 37) % 250}),
            ),
            call(&format!("ok{n}"), "test.noop", json!({})),
        ];
        let turn = toolfleet_tests::fleet::turn("acme", toolfleet_tests::fleet::tool_calls(calls));
        let _ = client.run_turn(turn, Duration::from_secs(5)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every panel of the dashboard evaluates and the turn, tool and process panels have
/// data; with `TOOLFLEET_DASHBOARD_SVG` set, the panels are drawn there first.
async fn dashboard_has_data(p_port: u16) -> Result<()> {
    if let Ok(path) = std::env::var("TOOLFLEET_DASHBOARD_SVG") {
        // Long enough that every 1-minute window of the drawn range is full of samples.
        tokio::time::sleep(Duration::from_secs(120)).await;
        let now = toolfleet_common::call::unix_ms() as f64 / 1000.0;
        let panels = dashboard::query_range(p_port, now - 60.0, now, 1.0).await?;
        std::fs::write(path, dashboard::svg(&panels))?;
    }
    let now = toolfleet_common::call::unix_ms() as f64 / 1000.0;
    let panels = dashboard::query_range(p_port, now - 30.0, now, 1.0).await?;
    let titles = [
        "Turns per second",
        "Tool error ratio",
        "Tool latency",
        "Process memory",
        "Worker saturation",
    ];
    for title in titles {
        let panel = panels
            .iter()
            .find(|p| p.title.starts_with(title))
            .context(title)?;
        assert!(
            panel.series.iter().any(|(_, points)| !points.is_empty()),
            "{title}: no data"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_fleet_and_the_error_ratio_alert_fires() -> Result<()> {
    const ALERT: &str = "ToolfleetToolErrorRatioHigh";
    let mut fleet = Fleet::start().await?;
    let (c_port, w_port, p_port) = (free_port()?, free_port()?, free_port()?);
    let (c_addr, w_addr) = (format!("127.0.0.1:{c_port}"), format!("127.0.0.1:{w_port}"));
    fleet.spawn_node("coordinator", &[("TOOLFLEET_HTTP_ADDR", c_addr.as_str())])?;
    fleet.spawn_node("worker", &[("TOOLFLEET_HTTP_ADDR", w_addr.as_str())])?;
    fleet.wait_for_tools(&["test.behave", "test.noop"]).await?;
    let dir = tempfile::tempdir()?;
    let mut prometheus = start_prometheus(
        dir.path(),
        p_port,
        &[("coordinator", c_port), ("worker-metrics", w_port)],
    )
    .await?;
    wait_http_status(p_port, "/-/ready", 200, Duration::from_secs(30)).await?;

    let storm = tokio::spawn(storm(fleet.client.clone()));

    let both_up = eventually_named("both targets up", Duration::from_secs(30), || async {
        let (_, body) = http_get(p_port, "/api/v1/query?query=sum(up)").await.ok()?;
        let body: Value = serde_json::from_str(&body).ok()?;
        (body["data"]["result"][0]["value"][1] == "2").then_some(())
    });
    both_up.await?;
    let wait = Duration::from_secs(60);
    eventually_named("the alert pending", wait, || async {
        alert_state(p_port, ALERT, "test.behave")
            .await
            .filter(|s| s == "pending")
    })
    .await?;
    eventually_named("the alert firing", wait, || async {
        alert_state(p_port, ALERT, "test.behave")
            .await
            .filter(|s| s == "firing")
    })
    .await?;
    assert_eq!(alert_state(p_port, ALERT, "test.noop").await, None);

    dashboard_has_data(p_port).await?;
    storm.abort();
    prometheus.kill().await?;
    Ok(())
}

/// The values of the series `query` selects, by their labels' text.
async fn series(port: u16, query: &str) -> Option<Vec<(Value, String)>> {
    let path = format!("/api/v1/query?query={}", encode(query));
    let (status, body) = http_get(port, &path).await.ok()?;
    let body: Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
    let results = body["data"]["result"].as_array()?;
    Some(
        results
            .iter()
            .map(|r| {
                (
                    r["metric"].clone(),
                    r["value"][1].as_str().unwrap_or("").to_string(),
                )
            })
            .collect(),
    )
}

/// `text` percent-encoded for a query string.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Whether `alert` is firing.
async fn firing(port: u16, alert: &str) -> Option<bool> {
    let (status, body) = http_get(port, "/api/v1/alerts").await.ok()?;
    let body: Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
    Some(
        body["data"]["alerts"]
            .as_array()?
            .iter()
            .any(|a| a["labels"]["alertname"] == alert && a["state"] == "firing"),
    )
}

/// A counter born at its first event has no earlier sample, and `increase()` over it
/// stays 0: the processes export the counters of the increase-based alerts at 0 from
/// their start. A Prometheus scraping a live coordinator and worker sees them at 0
/// before any failure, and the first stream NATS loses takes
/// ToolfleetTopologyRecreated to firing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_counters_start_at_zero_and_the_first_recreated_stream_fires_its_alert(
) -> Result<()> {
    const ALERT: &str = "ToolfleetTopologyRecreated";
    let mut fleet = Fleet::start().await?;
    let (c_port, w_port, p_port) = (free_port()?, free_port()?, free_port()?);
    let (c_addr, w_addr) = (format!("127.0.0.1:{c_port}"), format!("127.0.0.1:{w_port}"));
    fleet.spawn_node("coordinator", &[("TOOLFLEET_HTTP_ADDR", c_addr.as_str())])?;
    fleet.spawn_node("worker", &[("TOOLFLEET_HTTP_ADDR", w_addr.as_str())])?;
    fleet.wait_for_tools(&["test.noop"]).await?;
    let dir = tempfile::tempdir()?;
    let mut prometheus = start_prometheus(
        dir.path(),
        p_port,
        &[("coordinator", c_port), ("worker-metrics", w_port)],
    )
    .await?;
    wait_http_status(p_port, "/-/ready", 200, Duration::from_secs(30)).await?;

    // Each series exists, at 0, before anything failed.
    let at_zero = [
        r#"toolfleet_turns_refused_total{job="coordinator",code="unavailable"}"#,
        r#"toolfleet_turns_refused_total{job="coordinator",code="invalid_decision"}"#,
        r#"toolfleet_results_refused_total{job="coordinator",code="wrong_tool"}"#,
        r#"toolfleet_redis_errors_total{job="coordinator",operation="create_turn"}"#,
        r#"toolfleet_redis_errors_total{job="worker-metrics",operation="heartbeat"}"#,
        r#"toolfleet_topology_recreated_total{job="coordinator",kind="stream"}"#,
        r#"toolfleet_topology_recreated_total{job="coordinator",kind="consumer"}"#,
        r#"toolfleet_tasks_died_total{job="coordinator",task="results_consumer"}"#,
        r#"toolfleet_tasks_died_total{job="coordinator",task="topology"}"#,
        r#"toolfleet_tasks_died_total{job="worker-metrics",task="pull_loop"}"#,
        r#"toolfleet_nats_events_total{job="coordinator",event="disconnected"}"#,
        r#"toolfleet_nats_events_total{job="worker-metrics",event="slow_consumer"}"#,
    ];
    for query in at_zero {
        let seen = eventually_named(query, Duration::from_secs(30), || async {
            series(p_port, query).await.filter(|s| !s.is_empty())
        })
        .await?;
        assert!(seen.iter().all(|(_, v)| v == "0"), "{query}: {seen:?}");
    }
    assert_eq!(firing(p_port, ALERT).await, Some(false));

    // NATS loses the jobs stream; the coordinator recreates it, once.
    let js = async_nats::jetstream::new(fleet.nats.connect().await?);
    js.delete_stream(fleet.names.jobs_stream()).await?;
    let recreated = r#"toolfleet_topology_recreated_total{job="coordinator",kind="stream"}"#;
    eventually_named(
        "the stream counted as recreated",
        Duration::from_secs(30),
        || async {
            let seen = series(p_port, recreated).await?;
            seen.iter().any(|(_, v)| v == "1").then_some(())
        },
    )
    .await?;
    eventually_named("the alert firing", Duration::from_secs(30), || async {
        firing(p_port, ALERT).await.filter(|f| *f)
    })
    .await?;
    prometheus.kill().await?;
    Ok(())
}
