//! The fleets under measurement: a coordinator and workers as child processes of this
//! executable (`toolfleet-dev coordinator`, `toolfleet-dev worker --packs test`), each phase
//! under its own prefix; cleanup of the streams and keys a prefix left behind.
//!
//! Owns the child processes it spawns and the prefixes it hands out. It must never
//! signal a process it did not spawn, and never delete anything outside a prefix it
//! is given.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_nats::jetstream;
use futures::StreamExt;
use tokio::process::{Child, Command};
use toolfleet_common::call::unix_ms;
use toolfleet_common::{CatalogFormat, FleetClient, Names};

use super::progress::Progress;

/// Tools every bench fleet must list before it is measured.
const TOOLS: [&str; 2] = ["test.noop", "test.behave"];
/// How long a fleet may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a child may take to stop after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Variables that would point a child's telemetry somewhere else.
pub(crate) const OTEL_VARIABLES: [&str; 5] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_SERVICE_NAME",
];

/// A child of the bench (`program` is this executable, or a wrapper around it) as a
/// [`toolfleet_testkit::child_command`], killed with its handle, with none of
/// [`OTEL_VARIABLES`]: a node's telemetry goes only where the bench points it.
fn node_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::from(toolfleet_testkit::child_command(program, Stdio::null()));
    cmd.kill_on_drop(true);
    for name in OTEL_VARIABLES {
        cmd.env_remove(name);
    }
    cmd
}

/// Where the fleets run: the servers, this executable, and every prefix used so far.
pub struct Env {
    /// This executable, started as coordinator and workers.
    pub exe: PathBuf,
    /// NATS URL.
    pub nats_url: String,
    /// Redis URL.
    pub redis_url: String,
    /// The bench's own NATS connection (clients, floor, cleanup).
    pub nats: async_nats::Client,
    /// The bench's own Redis connection (floor, readiness, cleanup).
    pub redis: toolfleet_common::redis_client::RedisConnection,
    /// Tag shared by this run's prefixes.
    pub run_id: String,
    /// Print the children's pids and prefixes.
    pub verbose: bool,
    /// The progress bar, and where the bench's lines to stderr go.
    pub progress: Progress,
    used: Mutex<Vec<String>>,
}

/// How to start one fleet.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Worker processes.
    pub workers: usize,
    /// `TOOLFLEET_WORKER_CONCURRENCY` of each worker.
    pub worker_concurrency: usize,
    /// OTLP endpoint the processes export to; `None` turns tracing export off.
    pub otlp: Option<String>,
    /// Runtime worker threads of each process (`TOKIO_WORKER_THREADS`); `None`: one per
    /// CPU.
    pub threads: Option<usize>,
    /// A command line each process runs under (`valgrind --tool=callgrind …`); empty:
    /// none. A fleet under one gets [`WRAPPED_START_FACTOR`] times as long to start.
    pub wrap: Vec<String>,
}

/// How many times longer than [`START_TIMEOUT`] a fleet under a `wrap` may take to start.
const WRAPPED_START_FACTOR: u32 = 6;

/// One child process.
pub struct Node {
    /// `coordinator` or `worker`.
    pub role: &'static str,
    /// Its process id.
    pub pid: u32,
    child: Child,
}

/// A coordinator and its workers under one prefix.
pub struct Fleet {
    /// The names under the fleet's prefix.
    pub names: Names,
    /// A frontend client on the bench's connection.
    pub client: FleetClient,
    /// The coordinator process.
    pub coordinator: Node,
    /// The worker processes.
    pub workers: Vec<Node>,
}

impl Env {
    /// Connects to the servers.
    pub async fn connect(
        nats_url: &str,
        redis_url: &str,
        verbose: bool,
        progress: Progress,
    ) -> Result<Self> {
        let nats =
            toolfleet_common::failover::prefer_another_server(async_nats::ConnectOptions::new())
                .name("toolfleet-bench")
                .connect(toolfleet_common::config::NatsUrls(nats_url))
                .await
                .with_context(|| format!("connecting to NATS at {nats_url}"))?;
        let redis = toolfleet_common::redis_client::connect(redis_url, Default::default())
            .await
            .with_context(|| format!("connecting to Redis at {redis_url}"))?;
        let run_id = uuid::Uuid::new_v4().simple().to_string()[..6].to_string();
        Ok(Self {
            exe: std::env::current_exe().context("locating this executable")?,
            nats_url: nats_url.to_string(),
            redis_url: redis_url.to_string(),
            nats,
            redis,
            run_id,
            verbose,
            progress,
            used: Mutex::new(Vec::new()),
        })
    }

    /// A fresh prefix for `phase` (a single subject token), remembered for cleanup.
    pub fn prefix(&self, phase: &str) -> String {
        let prefix = format!("tfb{}_{phase}", self.run_id);
        match self.used.lock() {
            Ok(mut used) => used.push(prefix.clone()),
            Err(poisoned) => poisoned.into_inner().push(prefix.clone()),
        }
        prefix
    }

    /// A client for the fleet under `prefix`, on the bench's connection.
    pub fn client(&self, prefix: &str) -> FleetClient {
        FleetClient::new(self.nats.clone(), Names::new(prefix))
    }

    fn spawn(&self, prefix: &str, role: &'static str, index: usize, spec: &Spec) -> Result<Node> {
        let mut cmd = match spec.wrap.split_first() {
            Some((program, args)) => {
                let mut cmd = node_command(program);
                cmd.args(args).arg(&self.exe);
                cmd
            }
            None => node_command(&self.exe),
        };
        cmd.arg("--nats")
            .arg(&self.nats_url)
            .arg("--redis")
            .arg(&self.redis_url)
            .arg("--prefix")
            .arg(prefix)
            .arg(role);
        if role == "worker" {
            cmd.args(["--packs", "test"]);
        }
        cmd.envs([
            ("TOOLFLEET_HTTP_ADDR", "off".to_string()),
            (
                "TOOLFLEET_WORKER_CONCURRENCY",
                spec.worker_concurrency.to_string(),
            ),
            // The coordinators' lanes count the workers' slots alike.
            (
                "TOOLFLEET_LANE_WORKER_SLOTS",
                spec.worker_concurrency.clamp(1, 4096).to_string(),
            ),
            ("TOOLFLEET_WORKER_ID", format!("{prefix}-{role}-{index}")),
            ("TOOLFLEET_RETENTION_MS", "60000".to_string()),
        ]);
        match spec.threads {
            Some(n) => cmd.env("TOKIO_WORKER_THREADS", n.to_string()),
            None => cmd.env_remove("TOKIO_WORKER_THREADS"),
        };
        if let Some(endpoint) = &spec.otlp {
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
                .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf");
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {} {role}", self.exe.display()))?;
        let pid = child.id().context("the child has no pid")?;
        Ok(Node { role, pid, child })
    }

    /// Starts a coordinator and `spec.workers` workers under `prefix` and waits until
    /// the coordinator lists the test tools with every worker alive.
    pub async fn start(&self, prefix: &str, spec: &Spec) -> Result<Fleet> {
        let coordinator = self.spawn(prefix, "coordinator", 0, spec)?;
        let mut workers = Vec::with_capacity(spec.workers);
        for i in 0..spec.workers {
            workers.push(self.spawn(prefix, "worker", i, spec)?);
        }
        let fleet = Fleet {
            names: Names::new(prefix),
            client: self.client(prefix),
            coordinator,
            workers,
        };
        if self.verbose {
            let pids: Vec<u32> = fleet.workers.iter().map(|w| w.pid).collect();
            self.progress.note(format_args!(
                "  fleet {prefix}: coordinator pid {}, worker pids {pids:?}",
                fleet.coordinator.pid
            ));
        }
        let within = if spec.wrap.is_empty() {
            START_TIMEOUT
        } else {
            START_TIMEOUT * WRAPPED_START_FACTOR
        };
        self.wait_ready_within(&fleet.client, &fleet.names, spec.workers, within)
            .await?;
        Ok(fleet)
    }

    /// Waits until the catalog under `names` lists the test tools and, when `workers`
    /// is not zero, that many workers are alive for each.
    pub async fn wait_ready(
        &self,
        client: &FleetClient,
        names: &Names,
        workers: usize,
    ) -> Result<()> {
        self.wait_ready_within(client, names, workers, START_TIMEOUT)
            .await
    }

    /// [`Env::wait_ready`], for at most `within`.
    async fn wait_ready_within(
        &self,
        client: &FleetClient,
        names: &Names,
        workers: usize,
        within: Duration,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.is_ready(client, names, workers).await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "the fleet under prefix {} did not list {TOOLS:?} with {workers} live workers within {within:?}",
                    names.prefix()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn is_ready(&self, client: &FleetClient, names: &Names, workers: usize) -> bool {
        let Ok(tools) = client
            .catalog(CatalogFormat::Native, None, Duration::from_millis(500))
            .await
        else {
            return false;
        };
        let listed: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
        if !TOOLS.iter().all(|t| listed.contains(t)) {
            return false;
        }
        let mut redis = self.redis.clone();
        for tool in TOOLS {
            if live_workers(&mut redis, names, tool)
                .await
                .is_none_or(|n| n < workers)
            {
                return false;
            }
        }
        true
    }

    /// Deletes the streams and Redis keys of every prefix used so far.
    pub async fn cleanup_all(&self) {
        let used: Vec<String> = match self.used.lock() {
            Ok(used) => used.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        for prefix in used {
            self.cleanup(&prefix).await;
        }
    }

    /// Deletes the streams and Redis keys under `prefix` (best effort).
    pub async fn cleanup(&self, prefix: &str) {
        let names = Names::new(prefix);
        let js = jetstream::new(self.nats.clone());
        let partitions = toolfleet_common::config::env_in(
            toolfleet_common::streams::STREAM_PARTITIONS_ENV,
            1,
            toolfleet_common::streams::STREAM_PARTITIONS_RANGE,
        )
        .unwrap_or(1);
        let streams = (0..partitions)
            .flat_map(|k| [names.jobs_stream_in(k), names.results_stream_in(k)])
            .chain([floor_stream(&names)]);
        for stream in streams {
            let _ = js.delete_stream(&stream).await;
        }
        let mut redis = self.redis.clone();
        let mut cursor: u64 = 0;
        loop {
            let page: Result<(u64, Vec<String>), _> = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}:*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut redis)
                .await;
            let Ok((next, keys)) = page else {
                break;
            };
            if !keys.is_empty() {
                let _: Result<u64, _> = redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async(&mut redis)
                    .await;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
}

/// How many workers serving `tool` under `names` have a live heartbeat; `None` when
/// Redis does not answer.
pub(crate) async fn live_workers(
    redis: &mut toolfleet_common::redis_client::RedisConnection,
    names: &Names,
    tool: &str,
) -> Option<usize> {
    redis::cmd("ZCOUNT")
        .arg(names.tool_workers_key(tool))
        .arg(unix_ms())
        .arg("+inf")
        .query_async(redis)
        .await
        .ok()
}

/// The HTTP gateway of one phase, with the API key made for it.
pub struct BenchGateway {
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// The key (tenant `bench`).
    pub key: String,
    key_id: String,
    database_url: String,
    node: Node,
}

/// Turns the gateway follows at once in the bench: above the throughput phase's 64, below
/// the burst's 100 connections, so the burst meets `overloaded`.
const GATEWAY_MAX_TURNS: &str = "80";

impl Env {
    /// Starts `toolfleet-dev gateway` for the fleet under `prefix` on a free port (exporting
    /// to `otlp` when given), with a fresh key of tenant `bench` in the database of
    /// `TOOLFLEET_DATABASE_URL` (migrated first), and waits for `/readyz`.
    pub async fn start_gateway(
        &self,
        prefix: &str,
        otlp: Option<&str>,
        extra: &[(&str, String)],
    ) -> Result<BenchGateway> {
        let database_url = std::env::var("TOOLFLEET_DATABASE_URL")
            .unwrap_or_else(|_| toolfleet_gateway::config::DEFAULT_DATABASE_URL.into());
        toolfleet_packs::db::create_database_if_missing(&database_url)
            .await
            .with_context(|| format!("the http phase keeps its API key in PostgreSQL at {database_url} (TOOLFLEET_DATABASE_URL)"))?;
        let mut admin = toolfleet_packs::db::connect_admin(&database_url).await?;
        toolfleet_packs::db::migrate(&mut admin).await?;
        let key = toolfleet_gateway::keys::create(&admin, "bench", "toolfleet-dev bench").await?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut cmd = node_command(&self.exe);
        cmd.arg("--nats")
            .arg(&self.nats_url)
            .arg("--prefix")
            .arg(prefix)
            .arg("gateway")
            .envs([
                ("TOOLFLEET_GATEWAY_ADDR", format!("127.0.0.1:{port}")),
                ("TOOLFLEET_DATABASE_URL", database_url.clone()),
                ("TOOLFLEET_GATEWAY_RATE_PER_S", "1000000".into()),
                ("TOOLFLEET_GATEWAY_BURST", "1000000".into()),
                ("TOOLFLEET_GATEWAY_MAX_TURNS", GATEWAY_MAX_TURNS.into()),
            ]);
        for (name, value) in extra {
            cmd.env(name, value);
        }
        if let Some(endpoint) = otlp {
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
                .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf");
        }
        let child = cmd.spawn().context("starting the gateway")?;
        let pid = child.id().context("the gateway has no pid")?;
        let gateway = BenchGateway {
            base: format!("http://127.0.0.1:{port}"),
            key: key.key,
            key_id: key.id,
            database_url,
            node: Node {
                role: "gateway",
                pid,
                child,
            },
        };
        gateway.wait_ready().await?;
        Ok(gateway)
    }
}

impl BenchGateway {
    async fn wait_ready(&self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        let url = format!("{}/readyz", self.base);
        let http = reqwest::Client::new();
        loop {
            if let Ok(r) = http.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "the gateway at {} was not ready within {START_TIMEOUT:?}",
                    self.base
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the gateway and revokes its key.
    pub async fn stop(self, progress: &Progress) {
        self.node.stop(progress).await;
        if let Ok(admin) = toolfleet_packs::db::connect_admin(&self.database_url).await {
            let _ = toolfleet_gateway::keys::revoke(&admin, &self.key_id).await;
        }
    }
}

/// The stream the floor measurement publishes to.
pub fn floor_stream(names: &Names) -> String {
    format!("{}_FLOOR", names.prefix().to_uppercase())
}

impl Fleet {
    /// The fleet's processes by kind, with `others` (the servers, this process).
    pub fn probe(&self, others: &[(String, u32)]) -> Vec<(String, u32)> {
        let mut probe = vec![("coordinator".to_string(), self.coordinator.pid)];
        probe.extend(self.workers.iter().map(|w| ("worker".to_string(), w.pid)));
        probe.extend(others.iter().cloned());
        probe
    }

    /// Stops every process (SIGTERM, then SIGKILL after a bound, noted on `progress`).
    pub async fn stop(self, progress: &Progress) {
        let nodes = std::iter::once(self.coordinator).chain(self.workers);
        futures::stream::iter(nodes)
            .for_each_concurrent(None, |node| node.stop(progress))
            .await;
    }
}

impl Node {
    /// SIGTERM, then SIGKILL after a bound (noted on `progress`).
    pub async fn stop(mut self, progress: &Progress) {
        if !toolfleet_cli::local::terminate(&mut self.child, STOP_TIMEOUT).await {
            progress.note(format_args!(
                "{} pid {} did not stop within {STOP_TIMEOUT:?}; killed it",
                self.role, self.pid
            ));
        }
    }
}
