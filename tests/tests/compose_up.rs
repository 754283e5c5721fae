//! `docker compose up` for real, as README's "For operators" (docs/DEPLOYMENT.md) has a
//! user run it: the images from `deploy/ci-images/setup.sh` (Debian's docker.io and
//! docker-compose, stand-in service images with the tags compose names, `toolfleet:dev`
//! from the Dockerfile's runtime stage over this checkout's binaries), then the compose
//! file itself, changed only where it publishes ports (to free loopback ports, so the
//! machine's own servers and other runs keep theirs).
//!
//! One test, in order: every service healthy within a bound; the README's `cli submit`;
//! an API key from `admin keys create` and a gateway turn over SSE; `--scale worker=3`
//! and turns spread over the three; `stop worker` under load (calls in flight finish, new
//! calls end at once as `no_live_worker`, no turn lost, the workers exit 0); `kill -9`
//! of a coordinator under load with no turn lost and the replica back healthy; no span
//! from a health probe; `down -v` leaving no container, volume or network; then the
//! cluster profile with one NATS node and one Redis master stopped under load, no turn
//! lost, and `down -v` again. What each step measured is printed (`--nocapture`).
//! Assertions are on counts and states only, never on log text; every wait is bounded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use tokio::process::Command;
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::{CallState, FleetClient, TurnRequest};
use toolfleet_tests::gateway::read_events;
use toolfleet_tests::{metric_value, repo_path};

/// Debian's client (its built-in BuildKit needs no plugin); setup.sh installs it.
const DOCKER: &str = "/usr/bin/docker";
/// Debian's docker-compose 1.29.
const COMPOSE: &str = "docker-compose";
/// Packages, the daemon and the images, cold (apt, debootstrap, five image builds).
const SETUP_TIMEOUT: Duration = Duration::from_secs(1800);
/// Building this checkout's binaries (a no-op after `cargo test` built them).
const BUILD_TIMEOUT: Duration = Duration::from_secs(1200);
/// One compose command (`up -d`, `stop`, `down -v`, `run --rm`).
const COMPOSE_TIMEOUT: Duration = Duration::from_secs(240);
/// From `up -d` to every service healthy.
const HEALTHY_WITHIN: Duration = Duration::from_secs(180);
/// Longest wait for any one event of a turn.
const EVENT_WAIT: Duration = Duration::from_secs(45);
/// The turns' own deadline: above a Redis failover (cluster-node-timeout 5 s).
const TURN_DEADLINE_MS: u64 = 30_000;
/// The README's example decision, inside the image and in this checkout.
const DECISION: &str = "examples/decisions/appointments_and_billing.openai.json";
const IMAGE_DECISION: &str =
    "/usr/share/toolfleet/examples/decisions/appointments_and_billing.openai.json";
/// Every password compose asks for (README's `.env` loop).
const PASSWORDS: [&str; 13] = [
    "NATS_COORDINATOR",
    "NATS_WORKER",
    "NATS_FRONTEND",
    "NATS_FRONTEND2",
    "NATS_GATEWAY",
    "POSTGRES",
    "GATEWAY_DB",
    "GATEWAY_STREAM_TOKEN",
    "REDIS",
    "REDIS_WORKER",
    "REDIS_EXPORTER",
    "REDIS_REPLICATION",
    "REDIS_ADMIN",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compose_stack_comes_up_serves_scales_drains_and_survives_a_kill() -> Result<()> {
    let started = Instant::now();
    let bins = build_binaries().await?;
    setup_images(&bins).await?;
    println!("set-up: {:.1} s", started.elapsed().as_secs_f64());

    single_node_stack().await?;
    cluster_profile().await?;
    println!(
        "compose test: {:.1} s in all",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The default services: up, submit, gateway, scale, drain, kill, down.
async fn single_node_stack() -> Result<()> {
    let stack = Compose::new("single", None)?;
    let up = Instant::now();
    stack.compose(&["up", "-d", "--no-build"]).await?;
    let expect = [
        ("nats", 1),
        ("redis", 1),
        ("jaeger", 1),
        ("postgres", 1),
        ("coordinator", 2),
        ("worker", 1),
        ("gateway", 1),
    ];
    stack.wait_healthy(&expect, &["admin"]).await?;
    println!(
        "healthy: {} containers in {:.1} s",
        expect.iter().map(|(_, n)| n).sum::<usize>(),
        up.elapsed().as_secs_f64()
    );

    // README: `docker compose run --rm cli submit FILE --message ...`.
    let out = stack
        .compose(&[
            "run",
            "--rm",
            "-T",
            "cli",
            "submit",
            IMAGE_DECISION,
            "--message",
            "Show me my appointments and my billing",
            "--json",
        ])
        .await?;
    let events: Vec<Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let finals: Vec<&Value> = events.iter().filter(|e| e["type"] == "final").collect();
    ensure!(finals.len() == 1, "cli submit: {} finals", finals.len());
    ensure!(
        finals[0]["summary"]["ok"] == 2,
        "cli submit: {}",
        finals[0]["summary"]
    );
    println!(
        "cli submit: 1 final, {} calls ok",
        finals[0]["summary"]["ok"]
    );

    // README: `docker compose run --rm admin keys create --tenant demo`, then the gateway.
    let created: Value = serde_json::from_str(
        &stack
            .compose(&[
                "run", "--rm", "-T", "admin", "keys", "create", "--tenant", "demo",
            ])
            .await?,
    )
    .context("admin keys create printed no JSON")?;
    let key = created["key"]["key"]
        .as_str()
        .context("no key in admin's answer")?
        .to_string();
    let gateway = stack.published("gateway", 8080).await?;
    let decision: Value = serde_json::from_str(&std::fs::read_to_string(repo_path(DECISION))?)?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let response = http
        .post(format!("http://{gateway}/v1/turns"))
        .bearer_auth(&key)
        .header("accept", "text/event-stream")
        .json(&json!({"decision": decision, "context": {"customerId": "cust_001"}}))
        .send()
        .await?;
    ensure!(response.status() == 200, "gateway: {}", response.status());
    let events = read_events(response).await?;
    let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    ensure!(
        kinds.first() == Some(&"ack") && kinds.last() == Some(&"final"),
        "gateway events: {kinds:?}"
    );
    ensure!(kinds.iter().filter(|k| **k == "final").count() == 1);
    let summary = &events.last().context("no events")?.data["summary"];
    ensure!(summary["ok"] == 2, "gateway final: {summary}");
    println!("gateway: {} SSE events, 1 final, 2 calls ok", events.len());

    let nats = stack.published("nats", 4222).await?;
    let client = FleetClient::connect_with(
        &format!("nats://{nats}"),
        "fleet",
        &NatsCredentials::user_and_password("frontend", stack.password("NATS_FRONTEND")),
    )
    .await?;
    let client = Arc::new(client);

    // `up -d --scale worker=3`: three healthy workers, a burst of turns spread over them.
    stack
        .compose(&["up", "-d", "--no-build", "--scale", "worker=3"])
        .await?;
    let scaled = [
        ("nats", 1),
        ("redis", 1),
        ("jaeger", 1),
        ("postgres", 1),
        ("coordinator", 2),
        ("worker", 3),
        ("gateway", 1),
    ];
    stack.wait_healthy(&scaled, &["admin"]).await?;
    let before = stack.executed_per_worker().await?;
    let burst = run_turns(&client, 60, 12, None).await;
    ensure!(burst.lost == 0 && burst.calls_ok == 120, "scale: {burst:?}");
    let after = stack.executed_per_worker().await?;
    let spread: Vec<u64> = after
        .iter()
        .map(|(name, n)| n - before.get(name).copied().unwrap_or(0))
        .collect();
    println!("scale: 3 workers healthy, 120 calls spread {spread:?}");
    ensure!(spread.len() == 3, "workers: {after:?}");
    ensure!(spread.iter().sum::<u64>() == 120, "spread: {spread:?}");
    ensure!(
        spread.iter().all(|n| *n > 0),
        "a worker ran nothing: {spread:?}"
    );

    // `stop worker` under load, then one worker started again (a rolling restart): every
    // turn ends once; every call ends `ok` (held until a worker is back) or
    // `no_live_worker` (refused at once), none at its deadline; every worker drains and
    // exits 0.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move { run_turns(&client, 100_000, 8, Some(stop)).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stopping = Instant::now();
    stack.compose(&["stop", "worker"]).await?;
    let stop_took = stopping.elapsed();
    let exits: Vec<(String, i64)> = stack
        .containers()
        .await?
        .iter()
        .filter(|c| c.service == "worker")
        .map(|c| (c.state.clone(), c.exit_code))
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let restarting = Instant::now();
    stack
        .compose(&["up", "-d", "--no-build", "--scale", "worker=1"])
        .await?;
    stack.wait_healthy(&expect, &["admin"]).await?;
    let worker_back = restarting.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    let drained = load.await?;
    println!(
        "drain: stop took {:.1} s, workers {exits:?}; no worker for 3 s, then one healthy \
         {:.1} s later; {} turns, {} lost, calls {} ok, {} no_live_worker, {} other {:?}",
        stop_took.as_secs_f64(),
        worker_back.as_secs_f64(),
        drained.turns,
        drained.lost,
        drained.calls_ok,
        drained.calls_no_worker,
        drained.calls_other,
        drained.other
    );
    ensure!(
        exits.len() == 3 && exits.iter().all(|(s, code)| s == "exited" && *code == 0),
        "workers after stop: {exits:?}"
    );
    ensure!(drained.lost == 0, "drain lost turns: {drained:?}");
    ensure!(drained.calls_other == 0, "drain: {drained:?}");
    let back = run_turns(&client, 10, 5, None).await;
    ensure!(
        back.lost == 0 && back.calls_ok == 20,
        "after drain: {back:?}"
    );

    // `kill -9` of a coordinator under load: no turn lost, the replica restarted healthy.
    let coordinators: Vec<Container> = stack
        .containers()
        .await?
        .into_iter()
        .filter(|c| c.service == "coordinator")
        .collect();
    ensure!(coordinators.len() == 2);
    let victim = i32::try_from(coordinators[0].pid)?;
    ensure!(
        victim > 0,
        "coordinator has no process: {:?}",
        coordinators[0]
    );
    let load = {
        let client = client.clone();
        tokio::spawn(async move { run_turns(&client, 300, 20, None).await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The process itself, as a crash would end it (`docker kill` counts as a manual stop,
    // which the restart policy leaves down).
    let pid = nix::unistd::Pid::from_raw(victim);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)?;
    let killed = load.await?;
    println!(
        "kill -9 coordinator: {} turns, {} lost, calls {} ok, {} no_live_worker, {} other {:?}",
        killed.turns,
        killed.lost,
        killed.calls_ok,
        killed.calls_no_worker,
        killed.calls_other,
        killed.other
    );
    ensure!(killed.turns == 300 && killed.lost == 0, "kill: {killed:?}");
    let restarted = Instant::now();
    stack.wait_healthy(&expect, &["admin"]).await?;
    println!(
        "kill -9 coordinator: 2 coordinators healthy again {:.1} s after the load ended",
        restarted.elapsed().as_secs_f64()
    );

    // No health probe became a trace (any service), spans seen by the Jaeger stand-in.
    let traces = stack.spans().await?;
    let probe_spans = traces.spans.iter().filter(|s| is_probe(s)).count();
    let gateway_parentless = traces
        .spans
        .iter()
        .filter(|s| s.service == "toolfleet-gateway" && !s.parent && !is_request(s))
        .count();
    println!(
        "traces: {} spans, {} from probes, {} parentless gateway spans outside requests \
         (OpenAPI generation), {} metric exports refused",
        traces.spans.len(),
        probe_spans,
        gateway_parentless,
        traces.metrics_posts
    );
    ensure!(probe_spans == 0, "{probe_spans} spans from health probes");
    // Jaeger takes no metrics: the services that export to it push none
    // (OTEL_METRICS_EXPORTER=none), rather than logging its 404 every minute.
    ensure!(
        traces.metrics_posts == 0,
        "{} metric exports sent to Jaeger",
        traces.metrics_posts
    );

    stack.down().await?;
    Ok(())
}

/// The cluster profile: 3 NATS nodes, a 6-node Redis Cluster, its coordinators and worker;
/// one NATS node and one Redis master stopped under load.
async fn cluster_profile() -> Result<()> {
    let stack = Compose::new("cluster", Some("cluster"))?;
    let up = Instant::now();
    stack
        .compose(&[
            "up",
            "-d",
            "--no-build",
            "coordinator-clustered",
            "worker-clustered",
        ])
        .await?;
    let expect = [
        ("nats-1", 1),
        ("nats-2", 1),
        ("nats-3", 1),
        ("redis-node-1", 1),
        ("redis-node-2", 1),
        ("redis-node-3", 1),
        ("redis-node-4", 1),
        ("redis-node-5", 1),
        ("redis-node-6", 1),
        ("coordinator-clustered", 2),
        ("worker-clustered", 1),
    ];
    stack
        .wait_healthy(&expect, &["redis-cluster-create"])
        .await?;
    println!(
        "cluster: 12 containers healthy in {:.1} s",
        up.elapsed().as_secs_f64()
    );
    let containers = stack.containers().await?;
    let urls: Vec<String> = ["nats-1", "nats-2", "nats-3"]
        .iter()
        .map(|s| {
            let c = containers.iter().find(|c| c.service == *s);
            c.map(|c| format!("nats://{}:4222", c.ip))
                .with_context(|| format!("no {s}"))
        })
        .collect::<Result<_>>()?;
    let client = Arc::new(
        FleetClient::connect_with(
            &urls.join(","),
            "fleet",
            &NatsCredentials::user_and_password("frontend", stack.password("NATS_FRONTEND")),
        )
        .await?,
    );
    let warm = run_turns(&client, 10, 5, None).await;
    ensure!(warm.lost == 0 && warm.calls_ok == 20, "cluster: {warm:?}");

    let master = stack.a_redis_master().await?;
    let load = {
        let client = client.clone();
        tokio::spawn(async move { run_turns(&client, 200, 8, None).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    stack.compose(&["stop", "-t", "10", "nats-2"]).await?;
    stack.compose(&["stop", "-t", "10", &master]).await?;
    let survived = load.await?;
    println!(
        "cluster, nats-2 and {master} (a master) stopped: {} turns, {} lost, calls {} ok, {} no_live_worker, {} other",
        survived.turns,
        survived.lost,
        survived.calls_ok,
        survived.calls_no_worker,
        survived.calls_other
    );
    ensure!(
        survived.turns == 200 && survived.lost == 0,
        "cluster: {survived:?}"
    );
    stack.down().await?;
    Ok(())
}

// ----- the turns ------------------------------------------------------------------------

/// What a batch of turns came to.
#[derive(Debug, Default)]
struct Turns {
    /// Turns submitted.
    turns: usize,
    /// Turns with no `final` (an error, or silence past [`EVENT_WAIT`]).
    lost: usize,
    calls_ok: usize,
    calls_no_worker: usize,
    calls_other: usize,
    /// The other calls by `state/code`.
    other: BTreeMap<String, usize>,
}

/// Runs up to `count` copies of the README's decision for tenant `demo`, `parallel` at a
/// time, until `stop` (when given) is set.
async fn run_turns(
    client: &Arc<FleetClient>,
    count: usize,
    parallel: usize,
    stop: Option<Arc<AtomicBool>>,
) -> Turns {
    let decision: Value = match std::fs::read_to_string(repo_path(DECISION))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
    {
        Some(d) => d,
        None => return Turns::default(),
    };
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..parallel {
        let (client, next, stop, decision) =
            (client.clone(), next.clone(), stop.clone(), decision.clone());
        tasks.push(tokio::spawn(async move {
            let mut tally = Turns::default();
            loop {
                if stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) {
                    break;
                }
                if next.fetch_add(1, Ordering::SeqCst) >= count {
                    break;
                }
                tally.turns += 1;
                let request: TurnRequest = match serde_json::from_value(json!({
                    "tenant_id": "demo",
                    "decision": decision,
                    "deadline_ms": TURN_DEADLINE_MS,
                    "context": {"customerId": "cust_001"},
                })) {
                    Ok(r) => r,
                    Err(_) => {
                        tally.lost += 1;
                        continue;
                    }
                };
                match client.run_turn(request, EVENT_WAIT).await {
                    Ok(outcome) => {
                        for call in &outcome.final_event.results {
                            if call.ok {
                                tally.calls_ok += 1;
                            } else if call.state == CallState::Error
                                && call
                                    .error
                                    .as_ref()
                                    .is_some_and(|e| e.code == "no_live_worker")
                            {
                                tally.calls_no_worker += 1;
                            } else {
                                tally.calls_other += 1;
                                let code = call.error.as_ref().map(|e| e.code.as_str());
                                let key = format!("{:?}/{}", call.state, code.unwrap_or("-"));
                                *tally.other.entry(key).or_default() += 1;
                            }
                        }
                    }
                    Err(_) => tally.lost += 1,
                }
            }
            tally
        }));
    }
    let mut all = Turns::default();
    for task in tasks {
        let t = task.await.unwrap_or_default();
        all.turns += t.turns;
        all.lost += t.lost;
        all.calls_ok += t.calls_ok;
        all.calls_no_worker += t.calls_no_worker;
        all.calls_other += t.calls_other;
        for (key, n) in t.other {
            *all.other.entry(key).or_default() += n;
        }
    }
    all
}

// ----- compose ----------------------------------------------------------------------

/// One compose project of this test: its own name, passwords and copy of the compose
/// file (ports on free loopback ports); `down -v` on drop, whatever happened.
struct Compose {
    project: String,
    profile: Option<&'static str>,
    dir: tempfile::TempDir,
    passwords: BTreeMap<String, String>,
    down: bool,
}

impl Compose {
    fn new(name: &str, profile: Option<&'static str>) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let compose = std::fs::read_to_string(repo_path("docker-compose.yml"))?;
        std::fs::write(dir.path().join("compose.yml"), loopback_ports(&compose))?;
        let passwords: BTreeMap<String, String> = PASSWORDS
            .iter()
            .map(|v| {
                // As README's `.env` loop makes them: `tf` and 32 hex digits.
                let value = format!("tf{}", uuid::Uuid::new_v4().simple());
                (format!("TOOLFLEET_{v}_PASSWORD"), value)
            })
            .collect();
        let env: String = passwords
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect();
        std::fs::write(dir.path().join(".env"), env)?;
        Ok(Self {
            project: format!("tfci{}{name}", std::process::id()),
            profile,
            dir,
            passwords,
            down: false,
        })
    }

    fn password(&self, role: &str) -> String {
        self.passwords
            .get(&format!("TOOLFLEET_{role}_PASSWORD"))
            .cloned()
            .unwrap_or_default()
    }

    fn args(&self) -> Vec<String> {
        let dir = self.dir.path();
        let mut args = vec![
            "-p".to_string(),
            self.project.clone(),
            "--project-directory".to_string(),
            repo_path("").display().to_string(),
            "--env-file".to_string(),
            dir.join(".env").display().to_string(),
            "-f".to_string(),
            dir.join("compose.yml").display().to_string(),
        ];
        if let Some(profile) = self.profile {
            args.extend(["--profile".to_string(), profile.to_string()]);
        }
        args
    }

    /// Runs `docker-compose ARGS` for this project; its standard output.
    async fn compose(&self, args: &[&str]) -> Result<String> {
        let mut command = Command::new(COMPOSE);
        command.args(self.args()).args(args);
        run(command, &format!("docker-compose {}", args.join(" "))).await
    }

    /// `host:port` where compose published `service`'s `port`.
    async fn published(&self, service: &str, port: u16) -> Result<String> {
        let out = self.compose(&["port", service, &port.to_string()]).await?;
        let addr = out.trim().to_string();
        ensure!(
            addr.contains(':'),
            "{service}:{port} is not published: {addr:?}"
        );
        Ok(addr)
    }

    /// Every container of this project.
    async fn containers(&self) -> Result<Vec<Container>> {
        let label = format!("label=com.docker.compose.project={}", self.project);
        let ids = docker(&["ps", "-aq", "--filter", &label]).await?;
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut args = vec!["inspect"];
        args.extend(ids);
        let all: Vec<Value> = serde_json::from_str(&docker(&args).await?)?;
        Ok(all
            .iter()
            .map(|c| {
                let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
                let networks = c["NetworkSettings"]["Networks"].as_object();
                Container {
                    id: text(&c["Id"]),
                    service: text(&c["Config"]["Labels"]["com.docker.compose.service"]),
                    state: text(&c["State"]["Status"]),
                    health: text(&c["State"]["Health"]["Status"]),
                    exit_code: c["State"]["ExitCode"].as_i64().unwrap_or(-1),
                    pid: c["State"]["Pid"].as_i64().unwrap_or(0),
                    ip: networks
                        .and_then(|n| n.values().next())
                        .map(|n| text(&n["IPAddress"]))
                        .unwrap_or_default(),
                }
            })
            .collect())
    }

    /// Waits until `services` run healthy in the given numbers and each of `completed`
    /// has exited 0, within [`HEALTHY_WITHIN`]; fails at once when one of `completed`
    /// exits otherwise.
    async fn wait_healthy(&self, services: &[(&str, usize)], completed: &[&str]) -> Result<()> {
        let deadline = Instant::now() + HEALTHY_WITHIN;
        loop {
            let all = self.containers().await?;
            let healthy = |s: &str| {
                all.iter()
                    .filter(|c| c.service == s && c.state == "running" && c.health == "healthy")
                    .count()
            };
            let mut waiting: Vec<String> = services
                .iter()
                .filter(|(s, n)| healthy(s) != *n)
                .map(|(s, n)| format!("{s} {}/{n}", healthy(s)))
                .collect();
            for s in completed {
                let done: Vec<&Container> = all.iter().filter(|c| c.service == *s).collect();
                if let Some(failed) = done
                    .iter()
                    .find(|c| c.state == "exited" && c.exit_code != 0)
                {
                    bail!("{s} exited {}", failed.exit_code);
                }
                if !done.iter().any(|c| c.state == "exited" && c.exit_code == 0) {
                    waiting.push(format!("{s} not completed"));
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "not healthy within {} s: {}",
                    HEALTHY_WITHIN.as_secs(),
                    waiting.join(", ")
                );
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Calls executed so far by each running worker, from its `/metrics`.
    async fn executed_per_worker(&self) -> Result<BTreeMap<String, u64>> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()?;
        let mut counts = BTreeMap::new();
        for c in self.containers().await? {
            if c.service != "worker" || c.state != "running" {
                continue;
            }
            let text = http
                .get(format!("http://{}:9091/metrics", c.ip))
                .send()
                .await?
                .text()
                .await?;
            let n = metric_value(&text, "toolfleet_call_duration_seconds_count", &[]);
            counts.insert(c.id, n.unwrap_or(0.0) as u64);
        }
        Ok(counts)
    }

    /// The spans the Jaeger stand-in has received (deploy/ci-images/otlp_standin.py).
    async fn spans(&self) -> Result<Spans> {
        // Batches leave each process at most 5 s after their spans end.
        tokio::time::sleep(Duration::from_secs(6)).await;
        let addr = self.published("jaeger", 16686).await?;
        let body: Value = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?
            .get(format!("http://{addr}/api/spans"))
            .send()
            .await?
            .json()
            .await?;
        let spans = body["spans"]
            .as_array()
            .context("no spans")?
            .iter()
            .map(|s| Span {
                service: s["service"].as_str().unwrap_or_default().to_string(),
                name: s["name"].as_str().unwrap_or_default().to_string(),
                parent: s["parent"].as_bool().unwrap_or(false),
                attributes: s["attributes"].clone(),
            })
            .collect();
        Ok(Spans {
            spans,
            metrics_posts: body["counts"]["metrics_posts"].as_u64().unwrap_or(0),
        })
    }

    /// A Redis Cluster node that is a master now.
    async fn a_redis_master(&self) -> Result<String> {
        for i in 1..=6 {
            let service = format!("redis-node-{i}");
            let out = self
                .compose(&[
                    "exec",
                    "-T",
                    &service,
                    "sh",
                    "-c",
                    "REDISCLI_AUTH=$TOOLFLEET_REDIS_ADMIN_PASSWORD redis-cli --no-auth-warning --user admin role",
                ])
                .await?;
            if out.lines().next().map(str::trim) == Some("master") {
                return Ok(service);
            }
        }
        bail!("no Redis master among the six nodes")
    }

    /// `down -v`, then nothing of the project left: no container, volume or network.
    async fn down(mut self) -> Result<()> {
        self.down = true;
        self.compose(&["down", "-v", "--remove-orphans", "-t", "20"])
            .await?;
        let label = format!("label=com.docker.compose.project={}", self.project);
        let left = [
            docker(&["ps", "-aq", "--filter", &label]).await?,
            docker(&["volume", "ls", "-q", "--filter", &label]).await?,
            docker(&["network", "ls", "-q", "--filter", &label]).await?,
        ];
        let counts: Vec<usize> = left.iter().map(|s| s.split_whitespace().count()).collect();
        println!(
            "down -v ({}): {} containers, {} volumes, {} networks left",
            self.project, counts[0], counts[1], counts[2]
        );
        ensure!(counts == [0, 0, 0], "left after down -v: {left:?}");
        Ok(())
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        if self.down {
            return;
        }
        // What went wrong, for the reader of a failed run: states and each log's end.
        for args in [&["ps"][..], &["logs", "--no-color", "--tail", "25"][..]] {
            let _ = std::process::Command::new("timeout")
                .arg("60")
                .arg(COMPOSE)
                .args(self.args())
                .args(args)
                .stdin(Stdio::null())
                .status();
        }
        let _ = std::process::Command::new("timeout")
            .arg("180")
            .arg(COMPOSE)
            .args(self.args())
            .args(["down", "-v", "--remove-orphans", "-t", "5"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// One container, as `docker inspect` has it.
#[derive(Debug, Clone)]
struct Container {
    id: String,
    service: String,
    state: String,
    health: String,
    exit_code: i64,
    ip: String,
    pid: i64,
}

struct Spans {
    spans: Vec<Span>,
    metrics_posts: u64,
}

struct Span {
    service: String,
    name: String,
    parent: bool,
    attributes: Value,
}

/// A span of a health probe's request.
fn is_probe(span: &Span) -> bool {
    let probe = |s: &str| s.ends_with("/readyz") || s.ends_with("/healthz");
    probe(&span.name)
        || ["http.route", "url.path", "http.target"]
            .iter()
            .any(|k| span.attributes[*k].as_str().is_some_and(probe))
}

/// A span of an HTTP request served (its name is `METHOD /route`).
fn is_request(span: &Span) -> bool {
    ["GET ", "POST ", "DELETE ", "PUT "]
        .iter()
        .any(|m| span.name.starts_with(m))
}

/// The compose file with every published port moved to a free port on the loopback
/// (`127.0.0.1::PORT`), everything else as committed.
fn loopback_ports(compose: &str) -> String {
    let mut out = String::new();
    let mut in_ports = false;
    for line in compose.lines() {
        let t = line.trim();
        if t == "ports:" {
            in_ports = true;
        } else if in_ports && t.starts_with("- ") {
            let port = t[2..]
                .trim_matches('"')
                .rsplit(':')
                .next()
                .unwrap_or_default();
            let indent = &line[..line.len() - line.trim_start().len()];
            out.push_str(&format!("{indent}- \"127.0.0.1::{port}\"\n"));
            continue;
        } else if !t.starts_with('#') {
            in_ports = false;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

// ----- set-up -----------------------------------------------------------------------

/// Builds this checkout's four binaries in the tests' profile (a no-op when `cargo test`
/// has built them) and returns their folder.
async fn build_binaries() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test executable has no target directory")?
        .to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(repo_path(""))
        .args(["build", "--bins", "--quiet"])
        .args(["-p", "toolfleet-cli", "-p", "toolfleet-coordinator"])
        .args(["-p", "toolfleet-packs", "-p", "toolfleet-gateway"]);
    if dir.file_name().is_some_and(|name| name == "release") {
        build.arg("--release");
    }
    build.stdin(Stdio::null()).kill_on_drop(true);
    let status = tokio::time::timeout(BUILD_TIMEOUT, build.status())
        .await
        .context("building the binaries took too long")??;
    ensure!(status.success(), "building the binaries failed: {status}");
    Ok(dir)
}

/// deploy/ci-images/setup.sh: packages, daemon, images.
async fn setup_images(bins: &Path) -> Result<()> {
    let mut command = Command::new("bash");
    command
        .arg(repo_path("deploy/ci-images/setup.sh"))
        .arg(bins)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(SETUP_TIMEOUT, command.output())
        .await
        .context("deploy/ci-images/setup.sh took too long")??;
    print!("{}", String::from_utf8_lossy(&output.stdout));
    ensure!(
        output.status.success(),
        "deploy/ci-images/setup.sh failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// `docker ARGS`, its standard output.
async fn docker(args: &[&str]) -> Result<String> {
    let mut command = Command::new(DOCKER);
    command.args(args);
    run(command, &format!("docker {}", args.join(" "))).await
}

/// Runs `command` bounded by [`COMPOSE_TIMEOUT`], with none of this process's
/// TOOLFLEET_, COMPOSE_ or DOCKER_ variables (the project's .env decides); its output.
async fn run(mut command: Command, what: &str) -> Result<String> {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().to_string();
        if ["TOOLFLEET_", "COMPOSE_", "DOCKER_"]
            .iter()
            .any(|p| key.starts_with(p))
        {
            command.env_remove(&key);
        }
    }
    command.stdin(Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(COMPOSE_TIMEOUT, command.output())
        .await
        .with_context(|| format!("{what}: no answer within {} s", COMPOSE_TIMEOUT.as_secs()))??;
    ensure!(
        output.status.success(),
        "{what}: {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
