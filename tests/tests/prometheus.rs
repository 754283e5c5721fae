//! The alert rules against a real Prometheus (Debian's `prometheus` package): `promtool`
//! checks and unit-tests deploy/prometheus/alerts.yml, and for every alert a test causes
//! its failure for real on a fleet of processes (a coordinator and a worker; a gateway
//! for the gateway's alert) and sees a Prometheus scraping them take it to firing: a
//! failing tool, a tool slower than the deadline, a worker killed and its targets gone,
//! a worker's slots full, retryable failures, NATS stopped for 10 s, a stream deleted,
//! Redis stopped, Redis short of memory, a supervised task panicking, every coordinator
//! gone behind a gateway. Each prints its time to firing (`time to firing: …`).
//!
//! Prometheus scrapes and evaluates every second. Rules are loaded as shipped where the
//! alert fires within a test's bounds so (NATS errors, topology, dead tasks, and Redis
//! errors beside the scaled run); elsewhere the test says it loads them scaled: every
//! `[Nm]` window at 10 s and every `for: Nm` at 3 s, the expressions otherwise as shipped.
//!
//! Every query of every panel of the Grafana dashboard runs against the error-ratio
//! test's Prometheus; with `TOOLFLEET_DASHBOARD_SVG=docs/dashboard.svg` the test also
//! draws the panels there.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use toolfleet_tests::fleet::{call, timed_turn, Fleet};
use toolfleet_tests::gateway::{create_key, GatewayNode};
use toolfleet_tests::pg::TestDatabase;
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

/// Whether the PromQL `expr` reads the metric `name` (itself, or a histogram's
/// `_bucket`, `_count` or `_sum`).
fn reads(expr: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    expr.match_indices(name).any(|(at, _)| {
        let before = expr[..at].chars().next_back();
        let after = &expr[at + name.len()..];
        before.is_none_or(|c| !ident(c))
            && (after.chars().next().is_none_or(|c| !ident(c))
                || ["_bucket", "_count", "_sum"]
                    .iter()
                    .any(|suffix| after.starts_with(suffix)))
    })
}

/// Every metric docs/OPERATIONS.md marks "dashboard" is read by a panel of the Grafana
/// dashboard, and every panel a runbook points to (`the *Title* panel`, the start of the
/// panel's title) exists there, the NATS and Redis servers' among them.
#[test]
fn the_dashboard_carries_what_operations_promises() -> Result<()> {
    let operations = std::fs::read_to_string(repo_path("docs/OPERATIONS.md"))?;
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(repo_path(
        "deploy/prometheus/grafana-dashboard.json",
    ))?)?;
    let panels = dashboard["panels"].as_array().context("no panels")?;
    let exprs: Vec<&str> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect();
    let titles: Vec<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();

    let mut promised = Vec::new();
    for row in operations.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        if cells.len() < 8 || cells[cells.len() - 2] != "dashboard" {
            continue;
        }
        promised.extend(cells[1].split(',').map(|n| n.trim().trim_matches('`')));
    }
    assert!(promised.len() >= 25, "{promised:?}");
    let missing: Vec<&&str> = promised
        .iter()
        .filter(|name| !exprs.iter().any(|e| reads(e, name)))
        .collect();
    assert!(missing.is_empty(), "no panel reads {missing:?}");

    let runbooks = &operations[operations.find("## Runbooks").context("no runbooks")?..];
    let mut named = Vec::new();
    for rest in runbooks.split("the *").skip(1) {
        if let Some((title, after)) = rest.split_once('*') {
            if after.starts_with(" panel") {
                named.push(title.replace('\n', " "));
            }
        }
    }
    for wanted in ["NATS server", "Redis server"] {
        assert!(named.iter().any(|n| n == wanted), "runbooks name {named:?}");
    }
    for title in &named {
        let found = titles.iter().any(|t| t.starts_with(title.as_str()));
        assert!(found, "no panel {title:?}: {titles:?}");
    }
    Ok(())
}

/// docs/OPERATIONS.md lists every `operation` label of `toolfleet_redis_errors_total` the
/// coordinator and the worker count, and every call site's operation is one whose series
/// starts at 0.
#[test]
fn operations_lists_every_redis_operation_the_processes_count() -> Result<()> {
    let operations = std::fs::read_to_string(repo_path("docs/OPERATIONS.md"))?;
    let row = operations
        .lines()
        .find(|l| l.starts_with("| `toolfleet_redis_errors_total`"))
        .context("no row for toolfleet_redis_errors_total")?;
    let counted = toolfleet_common::metrics::COORDINATOR_REDIS_OPERATIONS
        .iter()
        .chain(toolfleet_common::metrics::WORKER_REDIS_OPERATIONS.iter());
    let missing: Vec<&&str> = counted
        .filter(|op| !row.contains(&format!("`{op}`")))
        .collect();
    assert!(missing.is_empty(), "not listed: {missing:?}");

    // And those lists hold every operation a `redis_error("…")` call site names.
    let listed: Vec<&str> = toolfleet_common::metrics::COORDINATOR_REDIS_OPERATIONS
        .iter()
        .chain(toolfleet_common::metrics::WORKER_REDIS_OPERATIONS.iter())
        .copied()
        .collect();
    let mut sources = Vec::new();
    for dir in ["coordinator/src", "worker/src", "common/src"] {
        let mut stack = vec![repo_path(dir)];
        while let Some(path) = stack.pop() {
            if path.is_dir() {
                stack.extend(std::fs::read_dir(&path)?.filter_map(|e| e.ok().map(|e| e.path())));
            } else if path.extension().is_some_and(|e| e == "rs") {
                sources.push(std::fs::read_to_string(&path)?);
            }
        }
    }
    let emitted: Vec<&str> = sources
        .iter()
        .flat_map(|text| text.split("redis_error(\"").skip(1))
        .filter_map(|rest| rest.split_once('"').map(|(op, _)| op))
        .collect();
    assert!(emitted.len() >= listed.len(), "{emitted:?}");
    let unlisted: Vec<&&str> = emitted.iter().filter(|op| !listed.contains(op)).collect();
    assert!(
        unlisted.is_empty(),
        "counted but not started at 0: {unlisted:?}"
    );
    Ok(())
}

/// How a test loads deploy/prometheus/alerts.yml.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rules {
    /// As shipped.
    Shipped,
    /// Rewritten, and only in this way: every `[Nm]` window at 10 s and every `for: Nm`
    /// at 3 s, so an alert whose window and hold last minutes fires within a test's
    /// bounds on the same expression. Its time to firing is then the failure's effect
    /// reaching the metrics, not the shipped hold.
    Scaled,
}

/// alerts.yml as `rules` asks.
fn rules_text(rules: Rules) -> Result<String> {
    let text = std::fs::read_to_string(repo_path("deploy/prometheus/alerts.yml"))?;
    if rules == Rules::Shipped {
        return Ok(text);
    }
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

/// A Prometheus (Debian's) scraping fleet processes every second and evaluating the
/// alert rules every second; its targets are files it rereads, so a test can take every
/// target of a job away as a scheduler would.
struct Prometheus {
    port: u16,
    dir: tempfile::TempDir,
    child: Child,
}

/// The jobs a Prometheus of these tests scrapes, named as the ServiceMonitor names them.
const JOBS: [&str; 3] = ["coordinator", "worker-metrics", "gateway-metrics"];

impl Prometheus {
    /// Started with `rules`, scraping `targets` (job, ports); ready.
    async fn start(rules: Rules, targets: &[(&str, &[u16])]) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("alerts.yml"), rules_text(rules)?)?;
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [alerts.yml]\nscrape_configs:\n",
        );
        for job in JOBS {
            config.push_str(&format!(
                "  - job_name: {job}\n    file_sd_configs:\n      - files: ['{}']\n        refresh_interval: 1s\n",
                dir.path().join(format!("{job}.json")).display()
            ));
        }
        std::fs::write(dir.path().join("prometheus.yml"), config)?;
        let port = free_port()?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(prometheus_tool("prometheus")?)
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let prometheus = Self { port, dir, child };
        for job in JOBS {
            let ports = targets
                .iter()
                .find(|(j, _)| *j == job)
                .map(|(_, p)| *p)
                .unwrap_or(&[]);
            prometheus.set_targets(job, ports)?;
        }
        wait_http_status(port, "/-/ready", 200, Duration::from_secs(30)).await?;
        Ok(prometheus)
    }

    /// `job`'s targets from now on: the loopback `ports` (none: every pod gone).
    fn set_targets(&self, job: &str, ports: &[u16]) -> Result<()> {
        let targets: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let file = self.dir.path().join(format!("{job}.json"));
        let staged = self.dir.path().join(format!("{job}.json.new"));
        std::fs::write(&staged, json!([{"targets": targets}]).to_string())?;
        std::fs::rename(staged, file)?;
        Ok(())
    }

    /// The alerts Prometheus holds now.
    async fn alerts(&self) -> Option<Vec<Value>> {
        let (status, body) = http_get(self.port, "/api/v1/alerts").await.ok()?;
        let body: Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
        body["data"]["alerts"].as_array().cloned()
    }

    /// The state (`pending`, `firing`) of `alert` with every label of `labels` (a label
    /// given as "" must be absent), if Prometheus holds it.
    async fn state(&self, alert: &str, labels: &[(&str, &str)]) -> Option<String> {
        self.alerts().await?.iter().find_map(|a| {
            let l = &a["labels"];
            let matches = l["alertname"] == alert
                && labels.iter().all(|(k, v)| match *v {
                    "" => l.get(*k).is_none(),
                    v => l[*k] == v,
                });
            matches.then(|| a["state"].as_str().unwrap_or_default().to_string())
        })
    }

    /// [`Self::until_firing`] within the usual [`FIRES_WITHIN`].
    async fn until_fires(
        &self,
        alert: &str,
        labels: &[(&str, &str)],
        since: Instant,
        failure: &str,
    ) -> Result<Duration> {
        self.until_firing(alert, labels, since, failure, FIRES_WITHIN)
            .await
    }

    /// Waits (at most `within`) until `alert` with `labels` fires; the time since
    /// `since`, printed as the alert's time to firing after `failure`.
    async fn until_firing(
        &self,
        alert: &str,
        labels: &[(&str, &str)],
        since: Instant,
        failure: &str,
        within: Duration,
    ) -> Result<Duration> {
        eventually_named(&format!("{alert} firing"), within, || async {
            self.state(alert, labels)
                .await
                .filter(|s| s == "firing")
                .map(|_| ())
        })
        .await?;
        let took = since.elapsed();
        eprintln!(
            "time to firing: {alert} {:.1} s after {failure}",
            took.as_secs_f64()
        );
        Ok(took)
    }

    /// Waits (at most `within`) until `alert` with `labels` is neither pending nor
    /// firing; the time since `since`.
    async fn until_quiet(
        &self,
        alert: &str,
        labels: &[(&str, &str)],
        since: Instant,
        within: Duration,
    ) -> Result<Duration> {
        eventually_named(&format!("{alert} quiet"), within, || async {
            match self.alerts().await {
                Some(_) if self.state(alert, labels).await.is_none() => Some(()),
                _ => None,
            }
        })
        .await?;
        Ok(since.elapsed())
    }

    /// The sum of what `query` selects, once it selects something.
    async fn value(&self, query: &str) -> Option<f64> {
        let seen = series(self.port, query).await?;
        (!seen.is_empty()).then(|| seen.iter().filter_map(|(_, v)| v.parse::<f64>().ok()).sum())
    }

    /// Waits until `up` counts `targets` targets up.
    async fn until_up(&self, targets: usize) -> Result<()> {
        let want = targets.to_string();
        eventually_named("the targets up", Duration::from_secs(30), || async {
            let seen = series(self.port, "sum(up)").await?;
            (seen.first()?.1 == want).then_some(())
        })
        .await
    }

    async fn stop(mut self) -> Result<()> {
        self.child.kill().await?;
        Ok(())
    }
}

/// A fleet process serving its metrics on `port`.
#[derive(Debug, Clone, Copy)]
struct Node {
    pid: u32,
    port: u16,
}

impl Node {
    /// `fleet-node role` with its HTTP endpoint on a free port and `env`.
    fn spawn(fleet: &mut Fleet, role: &str, env: &[(&str, &str)]) -> Result<Self> {
        let port = free_port()?;
        let addr = format!("127.0.0.1:{port}");
        let mut all = vec![("TOOLFLEET_HTTP_ADDR", addr.as_str())];
        all.extend_from_slice(env);
        Ok(Self {
            pid: fleet.spawn_node(role, &all)?,
            port,
        })
    }

    /// The `instance` label Prometheus gives it.
    fn instance(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The value of `name{labels…}` on its `/metrics` now (0 when absent).
    async fn metric(&self, name: &str, labels: &[&str]) -> Result<f64> {
        let (_, text) = http_get(self.port, "/metrics").await?;
        Ok(toolfleet_tests::metric_value(&text, name, labels).unwrap_or(0.0))
    }
}

/// A fleet of one coordinator and one worker (test and demo packs) as processes, with
/// `coordinator` and `worker` environment added.
struct Scene {
    fleet: Fleet,
    coordinator: Node,
    worker: Node,
}

impl Scene {
    async fn start(coordinator: &[(&str, &str)], worker: &[(&str, &str)]) -> Result<Self> {
        let mut fleet = Fleet::start().await?;
        let coordinator = Node::spawn(&mut fleet, "coordinator", coordinator)?;
        let worker = Node::spawn(&mut fleet, "worker", worker)?;
        fleet.wait_for_tools(&["test.behave", "test.noop"]).await?;
        Ok(Self {
            fleet,
            coordinator,
            worker,
        })
    }

    /// A default fleet ([`Self::start`] with no extra settings) watched with `rules`.
    async fn start_watched(rules: Rules) -> Result<(Self, Prometheus)> {
        let scene = Self::start(&[], &[]).await?;
        let prometheus = scene.watched(rules).await?;
        Ok((scene, prometheus))
    }

    /// A Prometheus with `rules` scraping the coordinator and the worker, both up.
    async fn watched(&self, rules: Rules) -> Result<Prometheus> {
        let prometheus = Prometheus::start(
            rules,
            &[
                ("coordinator", &[self.coordinator.port]),
                ("worker-metrics", &[self.worker.port]),
            ],
        )
        .await?;
        prometheus.until_up(2).await?;
        Ok(prometheus)
    }
}

/// Turns until aborted, one after another, each of `calls` (made fresh for each turn by
/// its number) with `deadline_ms`; with the count of turns submitted so far.
fn turns_in_a_loop(
    client: &toolfleet_common::FleetClient,
    deadline_ms: u64,
    pause: Duration,
    calls: impl Fn(u64) -> Vec<Value> + Send + 'static,
) -> (tokio::task::JoinHandle<()>, Arc<AtomicU64>) {
    let client = client.clone();
    let submitted = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&submitted);
    let turns = tokio::spawn(async move {
        for n in 0u64.. {
            let turn = timed_turn("acme", deadline_ms, calls(n));
            counted.fetch_add(1, Ordering::SeqCst);
            let wait = Duration::from_millis(deadline_ms) + Duration::from_secs(3);
            let _ = client.run_turn(turn, wait).await;
            tokio::time::sleep(pause).await;
        }
    });
    (turns, submitted)
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

/// The values of the series `query` selects, by their labels' text.
async fn series(port: u16, query: &str) -> Option<Vec<(Value, String)>> {
    let path = format!(
        "/api/v1/query?query={}",
        toolfleet_tests::dashboard::encode(query)
    );
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

/// How long a scaled alert may take to fire.
const FIRES_WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_fleet_and_the_error_ratio_alert_fires() -> Result<()> {
    const ALERT: &str = "ToolfleetToolErrorRatioHigh";
    let (scene, prometheus) = Scene::start_watched(Rules::Scaled).await?;
    let started = Instant::now();
    let storm = tokio::spawn(storm(scene.fleet.client.clone()));
    let tool = [("gen_ai_tool_name", "test.behave")];
    eventually_named("the alert pending", FIRES_WITHIN, || async {
        prometheus
            .state(ALERT, &tool)
            .await
            .filter(|s| s == "pending")
    })
    .await?;
    let failure = "a tool failing a third of its calls";
    prometheus
        .until_fires(ALERT, &tool, started, failure)
        .await?;
    let healthy = [("gen_ai_tool_name", "test.noop")];
    assert_eq!(prometheus.state(ALERT, &healthy).await, None);

    dashboard_has_data(prometheus.port).await?;
    storm.abort();
    prometheus.stop().await
}

/// A counter born at its first event has no earlier sample, and `increase()` over it
/// stays 0: the processes export the counters of the increase-based alerts at 0 from
/// their start, and a tool's from the moment the coordinator learns it or the worker
/// serves it. A Prometheus scraping a live coordinator and worker sees them at 0
/// before any failure, and the first stream NATS loses takes
/// ToolfleetTopologyRecreated to firing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_counters_start_at_zero_and_the_first_recreated_stream_fires_its_alert(
) -> Result<()> {
    const ALERT: &str = "ToolfleetTopologyRecreated";
    let (scene, prometheus) = Scene::start_watched(Rules::Shipped).await?;

    // Each series exists, at 0, before anything failed.
    let mut at_zero = vec![
        r#"toolfleet_turns_refused_total{job="coordinator",code="unavailable"}"#.to_string(),
        r#"toolfleet_turns_refused_total{job="coordinator",code="invalid_decision"}"#.into(),
        r#"toolfleet_results_refused_total{job="coordinator",code="wrong_tool"}"#.into(),
        r#"toolfleet_topology_recreated_total{job="coordinator",kind="stream"}"#.into(),
        r#"toolfleet_topology_recreated_total{job="coordinator",kind="consumer"}"#.into(),
        r#"toolfleet_tasks_died_total{job="coordinator",task="results_consumer"}"#.into(),
        r#"toolfleet_tasks_died_total{job="coordinator",task="topology"}"#.into(),
        r#"toolfleet_tasks_died_total{job="worker-metrics",task="pull_loop"}"#.into(),
        r#"toolfleet_nats_events_total{job="coordinator",event="disconnected"}"#.into(),
        r#"toolfleet_nats_events_total{job="worker-metrics",event="slow_consumer"}"#.into(),
        r#"toolfleet_errors_total{job="coordinator",error_type="no_live_worker",gen_ai_tool_name="test.noop"}"#.into(),
        r#"toolfleet_calls_total{job="coordinator",outcome="error",gen_ai_tool_name="test.noop"}"#.into(),
        r#"toolfleet_jobs_handed_back_total{job="worker-metrics",gen_ai_tool_name="test.noop"}"#.into(),
        r#"toolfleet_jobs_redeliveries_total{job="worker-metrics",gen_ai_tool_name="test.noop"}"#.into(),
    ];
    for operation in toolfleet_common::metrics::COORDINATOR_REDIS_OPERATIONS {
        at_zero.push(format!(
            r#"toolfleet_redis_errors_total{{job="coordinator",operation="{operation}"}}"#
        ));
    }
    for operation in toolfleet_common::metrics::WORKER_REDIS_OPERATIONS {
        at_zero.push(format!(
            r#"toolfleet_redis_errors_total{{job="worker-metrics",operation="{operation}"}}"#
        ));
    }
    for query in &at_zero {
        let seen = eventually_named(query, Duration::from_secs(30), || async {
            series(prometheus.port, query)
                .await
                .filter(|s| !s.is_empty())
        })
        .await?;
        assert!(seen.iter().all(|(_, v)| v == "0"), "{query}: {seen:?}");
    }
    assert_eq!(prometheus.state(ALERT, &[]).await, None);
    // The results backlog is sampled, and every process times its Redis commands.
    let backlog = r#"toolfleet_results_pending{job="coordinator"}"#;
    eventually_named(backlog, Duration::from_secs(30), || async {
        prometheus.value(backlog).await
    })
    .await?;
    for job in ["coordinator", "worker-metrics"] {
        let timed = format!(r#"toolfleet_redis_duration_seconds_count{{job="{job}"}}"#);
        eventually_named(&timed, Duration::from_secs(30), || async {
            prometheus.value(&timed).await.filter(|n| *n > 0.0)
        })
        .await?;
    }

    // NATS loses the jobs stream; the coordinator recreates it, once.
    let js = async_nats::jetstream::new(scene.fleet.nats.connect().await?);
    let lost = Instant::now();
    js.delete_stream(scene.fleet.names.jobs_stream()).await?;
    let recreated = r#"toolfleet_topology_recreated_total{job="coordinator",kind="stream"}"#;
    eventually_named(
        "the stream counted as recreated",
        Duration::from_secs(30),
        || async { prometheus.value(recreated).await.filter(|v| *v == 1.0) },
    )
    .await?;
    prometheus
        .until_fires(ALERT, &[], lost, "the jobs stream deleted")
        .await?;
    prometheus.stop().await
}

/// NATS stopped for 10 s: the shipped ToolfleetNatsErrors fires for the coordinator and
/// the worker, each of which counted its disconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_second_nats_outage_fires_the_shipped_nats_errors_alert() -> Result<()> {
    const ALERT: &str = "ToolfleetNatsErrors";
    let (mut scene, prometheus) = Scene::start_watched(Rules::Shipped).await?;
    assert_eq!(prometheus.state(ALERT, &[]).await, None);

    let down = Instant::now();
    scene.fleet.nats.stop().await;
    let failure = "NATS stopped (for 10 s)";
    for node in [scene.coordinator, scene.worker] {
        let instance = node.instance();
        let instance = [("instance", instance.as_str())];
        prometheus
            .until_firing(ALERT, &instance, down, failure, Duration::from_secs(10))
            .await?;
    }
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(down.elapsed())).await;
    scene.fleet.nats.restart().await?;
    let back = Instant::now();
    for node in [scene.coordinator, scene.worker] {
        let disconnected = ["event=\"disconnected\""];
        assert!(
            node.metric("toolfleet_nats_events_total", &disconnected)
                .await?
                >= 1.0
        );
        wait_http_status(node.port, "/readyz", 200, Duration::from_secs(30)).await?;
        let instance = node.instance();
        let instance = [("instance", instance.as_str())];
        assert_eq!(
            prometheus.state(ALERT, &instance).await.as_deref(),
            Some("firing")
        );
    }
    eprintln!(
        "ready again {:.1} s after NATS restarted",
        back.elapsed().as_secs_f64()
    );
    // What the shipped window holds for each instance, for the record.
    let query = r#"sum by (instance) (increase(toolfleet_nats_events_total{event=~"disconnected|client_error|server_error|slow_consumer"}[5m]))"#;
    eprintln!("{query}: {:?}", series(prometheus.port, query).await);
    prometheus.stop().await
}

/// Redis stopped for 75 s and started again. Two Prometheus servers watch: one with the
/// scaled rules (ToolfleetRedisErrors and ToolfleetTurnsRefusedUnavailable fire within
/// seconds), one with the shipped rules (ToolfleetRedisErrors fires after its minute and
/// clears about a minute after Redis answers). Meanwhile the worker's heartbeat keeps its
/// period (each beat gives up within it and counts a failure), and each refused turn is
/// counted once however often its frontend sends it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_fires_redis_errors_and_refused_turns_and_clears_after_recovery(
) -> Result<()> {
    let mut scene = Scene::start(&[], &[]).await?;
    let scaled = scene.watched(Rules::Scaled).await?;
    let shipped = scene.watched(Rules::Shipped).await?;
    let coordinator = scene.coordinator.instance();
    let at_coordinator = [("instance", coordinator.as_str())];

    let down = Instant::now();
    scene.fleet.redis.stop().await;
    let (turns, submitted) =
        turns_in_a_loop(&scene.fleet.client, 2000, Duration::from_millis(200), |n| {
            vec![call(&format!("n{n}"), "test.noop", json!({}))]
        });
    let failure = "Redis stopped";

    scaled
        .until_fires("ToolfleetRedisErrors", &at_coordinator, down, failure)
        .await?;
    scaled
        .until_fires("ToolfleetTurnsRefusedUnavailable", &[], down, failure)
        .await?;
    // The heartbeat keeps its period (500 ms here) while Redis is away.
    let beats = ["operation=\"heartbeat\""];
    let before = scene
        .worker
        .metric("toolfleet_redis_errors_total", &beats)
        .await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let failed_beats = scene
        .worker
        .metric("toolfleet_redis_errors_total", &beats)
        .await?
        - before;
    eprintln!("heartbeats failed in 10 s of Redis outage: {failed_beats}");
    assert!(
        failed_beats >= 10.0,
        "{failed_beats} failed heartbeats in 10 s"
    );

    let shipped_within = Duration::from_secs(120);
    shipped
        .until_firing(
            "ToolfleetRedisErrors",
            &at_coordinator,
            down,
            failure,
            shipped_within,
        )
        .await?;
    let remaining = Duration::from_secs(75).saturating_sub(down.elapsed());
    tokio::time::sleep(remaining).await;
    turns.abort();

    let back = Instant::now();
    scene.fleet.redis.restart().await?;
    let cleared = shipped
        .until_quiet(
            "ToolfleetRedisErrors",
            &at_coordinator,
            back,
            Duration::from_secs(150),
        )
        .await?;
    eprintln!(
        "time to clear: ToolfleetRedisErrors (shipped) {:.1} s after Redis answered again",
        cleared.as_secs_f64()
    );

    // Each turn refused once, however often it was sent.
    let turns = submitted.load(Ordering::SeqCst) as f64;
    let refused = scene
        .coordinator
        .metric("toolfleet_turns_refused_total", &["code=\"unavailable\""])
        .await?;
    eprintln!("turns submitted during the outage: {turns}, counted refused unavailable: {refused}");
    assert!(
        refused >= 1.0 && refused <= turns,
        "{refused} refusals of {turns} turns"
    );
    scaled.stop().await?;
    shipped.stop().await
}

/// The only worker killed: calls to its tools are refused `no_live_worker`
/// (ToolfleetNoLiveWorker) and its target is down (ToolfleetTargetDown by instance);
/// once the worker's target is gone from discovery too (every pod of the job gone),
/// ToolfleetTargetDown fires for the job through `absent()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_gone_fires_no_live_worker_and_target_down_then_absent() -> Result<()> {
    let (mut scene, prometheus) = Scene::start_watched(Rules::Scaled).await?;
    let worker = scene.worker;

    let killed = Instant::now();
    scene.fleet.kill_node(worker.pid).await?;
    let (turns, _) = turns_in_a_loop(&scene.fleet.client, 2000, Duration::from_millis(100), |n| {
        vec![call(&format!("n{n}"), "test.noop", json!({}))]
    });
    let failure = "the only worker killed";
    let tool = [("gen_ai_tool_name", "test.noop")];
    prometheus
        .until_fires("ToolfleetNoLiveWorker", &tool, killed, failure)
        .await?;
    let instance = worker.instance();
    let target = [("job", "worker-metrics"), ("instance", instance.as_str())];
    prometheus
        .until_fires("ToolfleetTargetDown", &target, killed, failure)
        .await?;
    turns.abort();

    let gone = Instant::now();
    prometheus.set_targets("worker-metrics", &[])?;
    let job = [("job", "worker-metrics"), ("instance", "")];
    let failure = "every worker target gone from discovery";
    prometheus
        .until_fires("ToolfleetTargetDown", &job, gone, failure)
        .await?;
    prometheus.stop().await
}

/// One call refused `no_live_worker` on a quiet tool (no call before it, none after)
/// fires ToolfleetNoLiveWorker: the tool's series is at 0 from the moment the
/// coordinator learned the tool, so the lone refusal is an increase `rate()` sees (a
/// series born at 1 has no earlier sample, and the alert would never fire). The rules
/// are loaded scaled: as shipped (`[5m]`, `for: 1m`) the alert fires a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_no_live_worker_refusal_of_a_quiet_tool_fires_no_live_worker() -> Result<()> {
    let (mut scene, prometheus) = Scene::start_watched(Rules::Scaled).await?;
    let refusals = r#"toolfleet_errors_total{job="coordinator",error_type="no_live_worker",gen_ai_tool_name="test.noop"}"#;
    eventually_named(refusals, Duration::from_secs(30), || async {
        prometheus.value(refusals).await.filter(|v| *v == 0.0)
    })
    .await?;

    scene.fleet.kill_node(scene.worker.pid).await?;
    // One turn at a time until the coordinator refuses one: a call sent before it saw
    // the worker gone waits in the queue and ends at its deadline instead.
    let client = scene.fleet.client.clone();
    let refused = eventually_named(
        "a call refused no_live_worker",
        Duration::from_secs(60),
        || async {
            let calls = vec![call("lone", "test.noop", json!({}))];
            let turn = timed_turn("acme", 300, calls);
            let outcome = client.run_turn(turn, Duration::from_secs(5)).await.ok()?;
            let result = outcome.final_event.results.first()?;
            let code = result.error.as_ref()?.code.as_str();
            (code == "no_live_worker").then(Instant::now)
        },
    )
    .await?;
    let tool = [("gen_ai_tool_name", "test.noop")];
    prometheus
        .until_fires(
            "ToolfleetNoLiveWorker",
            &tool,
            refused,
            "one no_live_worker refusal",
        )
        .await?;
    assert_eq!(prometheus.value(refusals).await, Some(1.0));
    prometheus.stop().await
}

/// A tool slower than its turns' deadline: every turn ends at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_ending_at_their_deadline_fire_deadline_misses() -> Result<()> {
    let (scene, prometheus) = Scene::start_watched(Rules::Scaled).await?;
    let slow = Instant::now();
    let (turns, _) = turns_in_a_loop(&scene.fleet.client, 300, Duration::from_millis(50), |n| {
        vec![call(
            &format!("n{n}"),
            "test.behave",
            json!({"sleep_ms": 1500}),
        )]
    });
    let failure = "a tool slower than the turns' deadline";
    prometheus
        .until_fires("ToolfleetTurnDeadlineMisses", &[], slow, failure)
        .await?;
    turns.abort();
    prometheus.stop().await
}

/// A worker with two slots and a turn of four 25 s calls: its slots are full
/// (ToolfleetWorkersSaturated) and the calls waiting behind them pass 30 s
/// (ToolfleetQueueLag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_worker_fires_workers_saturated_and_queue_lag() -> Result<()> {
    let scene = Scene::start(&[], &[("TOOLFLEET_WORKER_CONCURRENCY", "2")]).await?;
    let prometheus = scene.watched(Rules::Scaled).await?;
    let calls: Vec<Value> = (0..4)
        .map(|n| {
            call(
                &format!("slow{n}"),
                "test.behave",
                json!({"sleep_ms": 25_000}),
            )
        })
        .collect();
    let busy = Instant::now();
    let client = scene.fleet.client.clone();
    let turn = tokio::spawn(async move {
        client
            .run_turn(timed_turn("acme", 120_000, calls), Duration::from_secs(125))
            .await
    });
    let failure = "four 25 s calls on a worker of two slots";
    let tool = [("gen_ai_tool_name", "test.behave")];
    prometheus
        .until_fires("ToolfleetWorkersSaturated", &tool, busy, failure)
        .await?;
    prometheus
        .until_firing(
            "ToolfleetQueueLag",
            &tool,
            busy,
            failure,
            Duration::from_secs(90),
        )
        .await?;
    turn.abort();
    prometheus.stop().await
}

/// An idempotent tool failing with a retryable error: every job is handed back and
/// delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_failures_fire_the_redelivery_storm() -> Result<()> {
    let (scene, prometheus) = Scene::start_watched(Rules::Scaled).await?;
    let flaky = Instant::now();
    let (turns, _) = turns_in_a_loop(&scene.fleet.client, 3000, Duration::from_millis(50), |n| {
        (0..3)
            .map(|k| {
                let args = json!({"fail": "flaky_backend", "retryable": true});
                call(&format!("f{n}-{k}"), "test.behave", args)
            })
            .collect()
    });
    let failure = "a tool failing retryably";
    let tool = [("gen_ai_tool_name", "test.behave")];
    prometheus
        .until_fires("ToolfleetRedeliveryStorm", &tool, flaky, failure)
        .await?;
    turns.abort();
    prometheus.stop().await
}

/// Redis `maxmemory` set so what it holds is `percent` % of it.
async fn hold_at(admin: &mut redis::aio::MultiplexedConnection, percent: u64) -> Result<()> {
    let (used, _) = toolfleet_tests::redis_memory(admin).await?;
    toolfleet_tests::cap_redis_memory(admin, used * 100 / percent).await
}

/// Redis given a `maxmemory` just above what it holds: ToolfleetRedisNearlyFull; then
/// one below what the coordinator lets it fill before it deletes ended turns (95 % here,
/// so the first alert can hold): ToolfleetRetentionCut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_short_of_memory_fires_nearly_full_and_retention_cut() -> Result<()> {
    let trim = [
        ("TOOLFLEET_REDIS_TRIM_PERCENT", "95"),
        ("TOOLFLEET_REDIS_SHED_PERCENT", "100"),
    ];
    let scene = Scene::start(&trim, &[]).await?;
    let prometheus = scene.watched(Rules::Scaled).await?;
    // Ended turns for the trimming to delete.
    for n in 0..150 {
        let calls = vec![call(&format!("n{n}"), "test.noop", json!({}))];
        scene
            .fleet
            .client
            .run_turn(timed_turn("acme", 5000, calls), Duration::from_secs(10))
            .await?;
    }
    let mut admin = scene
        .fleet
        .redis
        .client()?
        .get_multiplexed_async_connection()
        .await?;

    let full = Instant::now();
    hold_at(&mut admin, 88).await?;
    let failure = "Redis at 88 % of its maxmemory";
    prometheus
        .until_fires("ToolfleetRedisNearlyFull", &[], full, failure)
        .await?;
    let short = Instant::now();
    hold_at(&mut admin, 99).await?;
    let failure = "Redis at 99 % of its maxmemory";
    prometheus
        .until_fires("ToolfleetRetentionCut", &[], short, failure)
        .await?;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(0)
        .query_async(&mut admin)
        .await?;
    prometheus.stop().await
}

/// The coordinator's results consumer panics at the first result (the fault point
/// `panic_in_results_consumer`): the shipped ToolfleetTaskDied fires for that task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervised_task_that_dies_fires_task_died() -> Result<()> {
    const ALERT: &str = "ToolfleetTaskDied";
    let fault = [("TOOLFLEET_FAULT", "panic_in_results_consumer")];
    let scene = Scene::start(&fault, &[]).await?;
    let prometheus = scene.watched(Rules::Shipped).await?;
    let died = r#"toolfleet_tasks_died_total{task="results_consumer"}"#;
    eventually_named(
        "the task's counter at 0",
        Duration::from_secs(30),
        || async { prometheus.value(died).await.filter(|v| *v == 0.0) },
    )
    .await?;

    let killed = Instant::now();
    let calls = vec![call("n", "test.noop", json!({}))];
    let _ = scene
        .fleet
        .client
        .run_turn(timed_turn("acme", 1000, calls), Duration::from_secs(3))
        .await;
    let task = [("task", "results_consumer")];
    let failure = "the results consumer panicked";
    prometheus
        .until_fires(ALERT, &task, killed, failure)
        .await?;
    assert_eq!(http_get(scene.coordinator.port, "/healthz").await?.0, 503);
    prometheus.stop().await
}

/// A gateway answering turns, then every coordinator gone: its turns (1 s deadline)
/// answer 503 (ToolfleetGatewayErrors), and its requests are counted by route and status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_5xx_answers_fire_gateway_errors() -> Result<()> {
    const ALERT: &str = "ToolfleetGatewayErrors";
    let mut scene = Scene::start(&[], &[]).await?;
    let db = TestDatabase::create().await?;
    let ops = free_port()?;
    let ops_addr = format!("127.0.0.1:{ops}");
    let env = [
        ("TOOLFLEET_HTTP_ADDR", ops_addr.as_str()),
        ("TOOLFLEET_GATEWAY_FINAL_GRACE_MS", "500"),
    ];
    let gateway = GatewayNode::start(&scene.fleet, &db, &env).await?;
    let key = create_key(&db, "acme").await?;
    let prometheus = Prometheus::start(
        Rules::Scaled,
        &[
            ("coordinator", &[scene.coordinator.port]),
            ("worker-metrics", &[scene.worker.port]),
            ("gateway-metrics", &[ops]),
        ],
    )
    .await?;
    prometheus.until_up(3).await?;

    let answered = Arc::new(AtomicU64::new(0));
    let counting = Arc::clone(&answered);
    let requests = tokio::spawn(async move {
        let body = json!({"deadline_ms": 1000, "decision": {"type": "final", "text": "hello"}});
        loop {
            if let Ok(response) = gateway.json_turn(&key, &body).await {
                if response.status().is_server_error() {
                    counting.fetch_add(1, Ordering::SeqCst);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let turns = r#"http_server_request_duration_seconds_count{job="gateway-metrics",http_route="/v1/turns",http_request_method="POST",http_response_status_code="200"}"#;
    eventually_named(
        "answered turns counted",
        Duration::from_secs(30),
        || async { prometheus.value(turns).await.filter(|v| *v > 0.0) },
    )
    .await?;
    assert_eq!(prometheus.state(ALERT, &[]).await, None);

    let gone = Instant::now();
    scene.fleet.kill_node(scene.coordinator.pid).await?;
    prometheus
        .until_fires(ALERT, &[], gone, "every coordinator gone")
        .await?;
    assert!(answered.load(Ordering::SeqCst) > 0);
    requests.abort();
    prometheus.stop().await
}

/// A tool that left the registry (its workers gone and its definition deleted) leaves
/// the coordinator's queue gauges too, instead of its last sample staying forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_that_left_the_registry_leaves_the_queue_gauges() -> Result<()> {
    let mut scene = Scene::start(&[], &[]).await?;
    let coordinator = scene.coordinator;
    let noop = ["gen_ai_tool_name=\"test.noop\""];
    let gauge_of_noop = || async {
        let (_, text) = http_get(coordinator.port, "/metrics").await.ok()?;
        Some(toolfleet_tests::metric_value(&text, "toolfleet_queue_pending", &noop).is_some())
    };
    eventually_named(
        "test.noop's queue sampled",
        Duration::from_secs(30),
        || async { gauge_of_noop().await.filter(|present| *present) },
    )
    .await?;

    let worker = scene.worker.pid;
    scene
        .fleet
        .terminate_node(worker, Duration::from_secs(15))
        .await?;
    let mut redis = scene
        .fleet
        .redis
        .client()?
        .get_multiplexed_async_connection()
        .await?;
    let () = redis::cmd("DEL")
        .arg(scene.fleet.names.tool_definition_key("test.noop"))
        .query_async(&mut redis)
        .await?;
    scene.fleet.wait_for_tool_gone("test.noop").await?;
    eventually_named(
        "test.noop's queue gone",
        Duration::from_secs(30),
        || async { gauge_of_noop().await.filter(|present| !*present) },
    )
    .await?;
    Ok(())
}
