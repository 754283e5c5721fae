//! A whole fleet for one test: private `nats-server` and `redis-server`, coordinators and
//! workers in-process (stoppable by token) or as child processes (killable), and a
//! frontend client; and the helpers the integration tests share to drive it: run a turn
//! with these calls and collect its `final`, wait until a call reaches a state, until the
//! catalog lists some tools, until a turn's counter reaches a value.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;
use toolfleet_common::client::{TurnOutcome, TurnStream};
use toolfleet_common::{
    CallResult, CallState, CatalogFormat, FinalEvent, FleetClient, Names, TurnEvent, TurnRequest,
};
use toolfleet_coordinator::join::NewTurn;
use toolfleet_coordinator::{CoordinatorConfig, TenantPolicies, TenantPolicy};
use toolfleet_worker::{Tool, WorkerConfig};

use crate::{eventually_named, NatsServer, RedisServer};

/// How long the catalog waits ([`wait_for_catalog`]) may take.
const CATALOG_WAIT: Duration = Duration::from_secs(15);

/// How long one catalog request of a catalog wait may take.
const CATALOG_REQUEST: Duration = Duration::from_millis(500);

/// Path of the `fleet-node` test binary (coordinator or worker in a child process):
/// beside the running test executable's `deps/` directory.
pub fn fleet_node_path() -> Result<std::path::PathBuf> {
    test_binary("fleet-node")
}

/// Path of the test crate's binary `name`, beside the running test executable's
/// `deps/` directory; an error that says how to build it when it is missing.
pub(crate) fn test_binary(name: &str) -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .context("test executable has no target directory")?;
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    anyhow::ensure!(
        path.exists(),
        "{} is not built (cargo build -p toolfleet-tests --bin {name})",
        path.display()
    );
    Ok(path)
}

/// The short timings every `fleet-node` a test starts runs with: heartbeat 500 ms, ack
/// wait 1 s, sweeps every 100 ms with a 300 ms grace, catalog refresh 250 ms, and its HTTP
/// endpoints on a free loopback port.
const NODE_TIMINGS: [(&str, &str); 6] = [
    ("TOOLFLEET_HEARTBEAT_MS", "500"),
    ("TOOLFLEET_ACK_WAIT_MS", "1000"),
    ("TOOLFLEET_SWEEP_INTERVAL_MS", "100"),
    ("TOOLFLEET_SWEEP_GRACE_MS", "300"),
    ("TOOLFLEET_REGISTRY_REFRESH_MS", "250"),
    ("TOOLFLEET_HTTP_ADDR", "127.0.0.1:0"),
];

/// `fleet-node <role>` under `prefix` with [`NODE_TIMINGS`], as a
/// [`crate::child_command`]; the caller adds where the servers are.
pub(crate) fn node_command(role: &str, prefix: &str) -> Result<Command> {
    let mut command = crate::child_command(fleet_node_path()?, Stdio::null());
    command
        .arg(role)
        .env("TOOLFLEET_PREFIX", prefix)
        .envs(NODE_TIMINGS);
    Ok(command)
}

/// How long building the command-line binaries from this checkout may take.
const CLI_BUILD_TIMEOUT: Duration = Duration::from_secs(900);

/// Builds `toolfleet`, `toolfleet-coordinator` and `toolfleet-worker` from this checkout
/// into the running tests' target directory and profile (a no-op when they are up to
/// date) and returns the path of `toolfleet`; `toolfleet-gateway` lies beside it, where
/// `toolfleet up --gateway` looks for it.
pub async fn checkout_cli() -> Result<std::path::PathBuf> {
    checkout_binary(&["toolfleet-cli", "toolfleet-gateway"], "toolfleet").await
}

/// Builds `toolfleet-dev` (the benchmark and the chaos run), `toolfleet-coordinator`
/// and `toolfleet-worker` from this checkout as [`checkout_cli`] does and returns the
/// path of `toolfleet-dev`; the other two lie beside it, where `toolfleet-dev chaos`
/// looks for them.
pub async fn checkout_dev() -> Result<std::path::PathBuf> {
    checkout_binary(&["toolfleet-dev"], "toolfleet-dev").await
}

/// Builds the binaries of `packages`, `toolfleet-coordinator` and `toolfleet-packs` from
/// this checkout and returns the path of `binary`.
async fn checkout_binary(packages: &[&str], binary: &str) -> Result<std::path::PathBuf> {
    let node = fleet_node_path()?;
    let dir = node.parent().context("fleet-node has no folder")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(crate::repo_path(""))
        .args(["build", "--bins", "--quiet"])
        .args(packages.iter().flat_map(|package| ["-p", package]))
        .args(["-p", "toolfleet-coordinator"])
        .args(["-p", "toolfleet-packs"])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if dir.file_name().is_some_and(|name| name == "release") {
        build.arg("--release");
    }
    let status = tokio::time::timeout(CLI_BUILD_TIMEOUT, build.status())
        .await
        .context("building the command-line binaries took too long")??;
    anyhow::ensure!(
        status.success(),
        "building the command-line binaries failed: {status}"
    );
    let path = dir.join(format!("{binary}{}", std::env::consts::EXE_SUFFIX));
    anyhow::ensure!(path.is_file(), "{} was not built", path.display());
    Ok(path)
}

/// Runs this checkout's `toolfleet-dev bench` with `args`, its report written to a
/// temporary file, bounded by `timeout`, and returns that JSON report.
pub async fn bench_report(args: &[&str], timeout: Duration) -> Result<Value> {
    let args = [&["bench"], args].concat();
    let (status, report) = dev_report(&args, "--out", Stdio::null(), timeout).await?;
    anyhow::ensure!(status.success(), "toolfleet-dev bench failed: {status}");
    report
}

/// Runs this checkout's `toolfleet-dev` with `args`, then `report_flag` naming a
/// temporary file for its JSON report, with `stdout`, bounded by `timeout`: its exit
/// status and the report it wrote (an error where it wrote none).
pub async fn dev_report(
    args: &[&str],
    report_flag: &str,
    stdout: Stdio,
    timeout: Duration,
) -> Result<(std::process::ExitStatus, Result<Value>)> {
    let toolfleet_dev = checkout_dev().await?;
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("report.json");
    let what = format!(
        "toolfleet-dev {}",
        args.first().copied().unwrap_or_default()
    );
    let status = Command::new(toolfleet_dev)
        .args(args)
        .arg(report_flag)
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(stdout)
        .kill_on_drop(true)
        .status();
    let status = tokio::time::timeout(timeout, status)
        .await
        .with_context(|| format!("{what} did not finish in time"))??;
    let report = std::fs::read_to_string(&out)
        .with_context(|| format!("{what} ({status}) wrote no report"))
        .and_then(|text| Ok(serde_json::from_str(&text)?));
    Ok((status, report))
}

/// An in-process component: cancel its token to stop it gracefully, abort to stop it
/// without any cleanup.
pub struct Running {
    /// Cancels the component gracefully.
    pub shutdown: CancellationToken,
    /// The component's task.
    pub handle: JoinHandle<()>,
}

impl Running {
    /// Runs the component `what` in a task: `start` gets the shutdown token and returns
    /// the component's run; its error, if any, is logged.
    pub fn spawn<F, Fut, E>(what: &'static str, start: F) -> Self
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: std::fmt::Display,
    {
        let shutdown = CancellationToken::new();
        let run = start(shutdown.clone());
        let handle = tokio::spawn(async move {
            if let Err(error) = run.await {
                tracing::error!(%error, "{what} failed");
            }
        });
        Self { shutdown, handle }
    }

    /// An in-process coordinator with `config`.
    pub fn coordinator(config: CoordinatorConfig) -> Self {
        Self::spawn("coordinator", |token| {
            toolfleet_coordinator::run(config, token)
        })
    }

    /// An in-process worker with `config`, serving `tools`.
    pub fn worker(config: WorkerConfig, tools: Vec<Tool>) -> Self {
        Self::spawn("worker", |token| {
            toolfleet_worker::run(config, tools, token)
        })
    }

    /// Graceful stop, bounded.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), self.handle).await;
    }
}

/// Coordinator settings for the servers at `nats_url` and `redis_url` under `names`,
/// with short sweeps for tests.
pub fn coordinator_settings(
    nats_url: String,
    redis_url: String,
    names: &Names,
) -> CoordinatorConfig {
    CoordinatorConfig {
        nats_url,
        redis_url,
        prefix: names.prefix().to_string(),
        stream_partitions: names.partitions(),
        sweep_interval: Duration::from_millis(100),
        sweep_grace: Duration::from_millis(300),
        registry_refresh: Duration::from_millis(250),
        shutdown_grace: Duration::from_secs(2),
        ..CoordinatorConfig::local()
    }
}

/// Worker settings for the servers at `nats_url` and `redis_url` under `names`, with a
/// short ack wait so redelivery is quick, and a `started` notice for every call, instant
/// ones included (tests read the notices to count how often a call ran). Worker
/// processes a test spawns keep the default running delay.
pub fn worker_settings(nats_url: String, redis_url: String, names: &Names) -> WorkerConfig {
    WorkerConfig {
        heartbeat: Duration::from_millis(500),
        ack_wait: Duration::from_millis(1000),
        running_after: Duration::ZERO,
        nats_url,
        redis_url,
        prefix: names.prefix().to_string(),
        stream_partitions: names.partitions(),
        ..WorkerConfig::local()
    }
}

/// Tenant policies where `tenant` may use only the tools matching `patterns` and every
/// other tenant has the default policy.
pub fn allowlist(tenant: &str, patterns: &[&str]) -> TenantPolicies {
    TenantPolicies {
        default: TenantPolicy::default(),
        tenants: BTreeMap::from([(
            tenant.to_string(),
            TenantPolicy {
                allowed_tools: Some(patterns.iter().map(|p| p.to_string()).collect()),
                ..TenantPolicy::default()
            },
        )]),
    }
}

/// A fleet under test.
pub struct Fleet {
    /// The NATS server.
    pub nats: NatsServer,
    /// The Redis server.
    pub redis: RedisServer,
    /// The names in use.
    pub names: Names,
    /// A frontend client.
    pub client: FleetClient,
    children: Vec<Child>,
}

impl Fleet {
    /// Starts the servers and a client (no coordinator or worker yet).
    pub async fn start() -> Result<Self> {
        Self::start_with_nats_config("").await
    }

    /// [`Fleet::start`] with `extra_conf` appended to the NATS server's configuration
    /// (a later setting overrides an earlier one, e.g. `max_payload: 1MB`).
    pub async fn start_with_nats_config(extra_conf: &str) -> Result<Self> {
        crate::init_test_tracing();
        let nats = NatsServer::start_with_config(extra_conf).await?;
        let redis = RedisServer::start().await?;
        let names = Names::default();
        let client = FleetClient::connect(&nats.url(), names.prefix()).await?;
        Ok(Self {
            nats,
            redis,
            names,
            client,
            children: Vec::new(),
        })
    }

    /// [`Fleet::start`], then [`Fleet::start_default`]: a fleet with an in-process
    /// coordinator and a worker with the demo and test packs, their tools listed.
    pub async fn start_with_default_nodes() -> Result<(Self, Running, Running)> {
        let fleet = Self::start().await?;
        let (coordinator, worker) = fleet.start_default().await?;
        Ok((fleet, coordinator, worker))
    }

    /// Coordinator settings for this fleet, with short sweeps for tests.
    pub fn coordinator_config(&self) -> CoordinatorConfig {
        coordinator_settings(self.nats.url(), self.redis.url(), &self.names)
    }

    /// Worker settings for this fleet, with a short ack wait so redelivery is quick.
    pub fn worker_config(&self) -> WorkerConfig {
        worker_settings(self.nats.url(), self.redis.url(), &self.names)
    }

    /// Starts an in-process coordinator.
    pub fn coordinator(&self, config: CoordinatorConfig) -> Running {
        Running::coordinator(config)
    }

    /// Starts an in-process worker serving `tools`.
    pub fn worker(&self, config: WorkerConfig, tools: Vec<Tool>) -> Running {
        Running::worker(config, tools)
    }

    /// Starts an in-process coordinator with `config` and a worker serving `tools`, and
    /// waits until the catalog lists every tool in `listed`.
    pub async fn start_with(
        &self,
        config: CoordinatorConfig,
        tools: Vec<Tool>,
        listed: &[&str],
    ) -> Result<(Running, Running)> {
        let c = self.coordinator(config);
        let w = self.worker(self.worker_config(), tools);
        self.wait_for_tools(listed).await?;
        Ok((c, w))
    }

    /// Like [`Fleet::start_with`], with this fleet's coordinator settings but for a
    /// tenant `tenant` that may use only the tools matching `patterns`.
    pub async fn start_with_allowlist(
        &self,
        tenant: &str,
        patterns: &[&str],
        tools: Vec<Tool>,
        listed: &[&str],
    ) -> Result<(Running, Running)> {
        let mut config = self.coordinator_config();
        config.tenants = allowlist(tenant, patterns);
        self.start_with(config, tools, listed).await
    }

    /// Starts an in-process coordinator and a worker with the demo and test packs, and
    /// waits until the catalog lists every one of their tools (a worker announces its
    /// tools one by one, and a coordinator may take them in over two refreshes).
    pub async fn start_default(&self) -> Result<(Running, Running)> {
        let tools = toolfleet_packs::tools_for(&["demo", "test"]).map_err(anyhow::Error::msg)?;
        let names: Vec<String> = tools.iter().map(|t| t.definition().name.clone()).collect();
        let listed: Vec<&str> = names.iter().map(String::as_str).collect();
        self.start_with(self.coordinator_config(), tools, &listed)
            .await
    }

    /// Where this fleet's servers are and its prefix, as the variables every toolfleet
    /// process reads (`TOOLFLEET_NATS_URL`, `TOOLFLEET_REDIS_URL`, `TOOLFLEET_PREFIX`).
    pub fn servers_env(&self) -> [(&'static str, String); 3] {
        [
            ("TOOLFLEET_NATS_URL", self.nats.url()),
            ("TOOLFLEET_REDIS_URL", self.redis.url()),
            ("TOOLFLEET_PREFIX", self.names.prefix().to_string()),
        ]
    }

    /// Spawns `fleet-node <role>` as a child process with this fleet's settings and
    /// `extra` environment.
    pub fn spawn_node(&mut self, role: &str, extra: &[(&str, &str)]) -> Result<u32> {
        let mut cmd = node_command(role, self.names.prefix())?;
        cmd.envs(self.servers_env()).envs(extra.iter().copied());
        let child = cmd.spawn().context("spawning fleet-node")?;
        let pid = child.id().context("child has no pid")?;
        self.children.push(child);
        Ok(pid)
    }

    /// Kills the child process `pid` with SIGKILL (no cleanup, no acks).
    pub async fn kill_node(&mut self, pid: u32) -> Result<()> {
        if let Some(pos) = self.children.iter().position(|c| c.id() == Some(pid)) {
            let mut child = self.children.remove(pos);
            child.start_kill()?;
            tokio::time::timeout(Duration::from_secs(5), child.wait()).await??;
        }
        Ok(())
    }

    /// Sends SIGTERM to the child `pid` and waits (bounded) for it to exit.
    pub async fn terminate_node(&mut self, pid: u32, wait: Duration) -> Result<()> {
        if let Some(pos) = self.children.iter().position(|c| c.id() == Some(pid)) {
            let mut child = self.children.remove(pos);
            let raw = i32::try_from(pid)?;
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGTERM,
            )?;
            tokio::time::timeout(wait, child.wait()).await??;
        }
        Ok(())
    }

    /// Terminates each child of `pids` in order ([`Fleet::terminate_node`], 15 s each):
    /// a worker before its coordinator, so both flush their span exporters on the way.
    pub async fn terminate_nodes(&mut self, pids: &[u32]) -> Result<()> {
        for &pid in pids {
            self.terminate_node(pid, Duration::from_secs(15)).await?;
        }
        Ok(())
    }

    /// The `max_deliver` the server has for `tool`'s consumer.
    pub async fn consumer_max_deliver(&self, tool: &str) -> Result<i64> {
        let nats = async_nats::connect(self.nats.url()).await?;
        let js = async_nats::jetstream::new(nats);
        let stream = js.get_stream(self.names.jobs_stream()).await?;
        let info = stream.consumer_info(self.names.tool_consumer(tool)).await?;
        Ok(info.config.max_deliver)
    }

    /// The jobs and results streams as the server has them now, each with its
    /// consumers' delivery and ack state, one line each: what a failed turn's assertion
    /// prints, so a missing result shows whether it was stored, delivered or acked.
    pub async fn describe_streams(&self) -> String {
        let js = async_nats::jetstream::new(self.client.nats().clone());
        let mut lines = Vec::new();
        for name in [self.names.jobs_stream(), self.names.results_stream()] {
            let mut stream = match js.get_stream(&name).await {
                Ok(stream) => stream,
                Err(error) => {
                    lines.push(format!("stream {name}: {error}"));
                    continue;
                }
            };
            if let Ok(info) = stream.info().await {
                let state = &info.state;
                lines.push(format!(
                    "stream {name}: {} messages, seq {}..{}",
                    state.messages, state.first_sequence, state.last_sequence
                ));
            }
            let mut consumers = stream.consumers();
            while let Some(Ok(info)) = consumers.next().await {
                lines.push(format!(
                    "  consumer {}: delivered {} (stream seq {}), acked to {}, pending {}, ack pending {}, redelivered {}, waiting pulls {}",
                    info.name,
                    info.delivered.consumer_sequence,
                    info.delivered.stream_sequence,
                    info.ack_floor.stream_sequence,
                    info.num_pending,
                    info.num_ack_pending,
                    info.num_redelivered,
                    info.num_waiting,
                ));
            }
        }
        lines.join("\n")
    }

    /// Waits until the catalog (native format) lists every tool in `names`.
    pub async fn wait_for_tools(&self, names: &[&str]) -> Result<()> {
        wait_for_tools_on(&self.client, names).await
    }

    /// Waits until the catalog no longer lists `name`.
    pub async fn wait_for_tool_gone(&self, name: &str) -> Result<()> {
        wait_for_catalog(&self.client, "tool gone from the catalog", |tools| {
            !tools.iter().any(|t| t["name"] == name)
        })
        .await
    }

    /// Submits a turn of `tenant` with `calls` and a deadline of `deadline_ms` (see
    /// [`timed_turn`]); its event stream.
    pub async fn submit_calls(
        &self,
        tenant: &str,
        deadline_ms: u64,
        calls: Vec<Value>,
    ) -> Result<TurnStream> {
        Ok(self
            .client
            .submit(timed_turn(tenant, deadline_ms, calls))
            .await?)
    }

    /// Submits `request` and collects every event up to its `final` (each wait for an
    /// event bounded by `wait`).
    pub async fn run(&self, request: TurnRequest, wait: Duration) -> Result<TurnOutcome> {
        Ok(self.client.run_turn(request, wait).await?)
    }

    /// Runs a turn of `tenant` whose decision holds `calls` (see [`Fleet::run`]).
    pub async fn run_calls(
        &self,
        tenant: &str,
        calls: Vec<Value>,
        wait: Duration,
    ) -> Result<TurnOutcome> {
        self.run(turn(tenant, tool_calls(calls)), wait).await
    }

    /// Runs a turn for `tenant` with the one call `id` of `tool` with `arguments` (as
    /// [`Fleet::run_calls`]): that call's result in the final.
    pub async fn run_one(
        &self,
        tenant: &str,
        id: &str,
        tool: &str,
        arguments: Value,
        wait: Duration,
    ) -> Result<CallResult> {
        let outcome = self
            .run_calls(tenant, vec![call(id, tool, arguments)], wait)
            .await?;
        result_of(&outcome.final_event, id).cloned()
    }

    /// Asserts that `tool` (once listed) gives a job `attempts` deliveries: its consumer
    /// says so, and a call that fails every time ends as an error with `code` after
    /// exactly `attempts` attempts.
    pub async fn assert_gives_up_after(
        &self,
        tool: &str,
        attempts: u32,
        code: &str,
        wait: Duration,
    ) -> Result<()> {
        self.wait_for_tools(&[tool]).await?;
        assert_eq!(self.consumer_max_deliver(tool).await?, i64::from(attempts));
        let result = self.run_one("acme", "c1", tool, json!({}), wait).await?;
        assert_eq!(result.state, CallState::Error, "{result:?}");
        assert_eq!(code_of(&result), Some(code), "{result:?}");
        assert_eq!(result.attempts, attempts, "{result:?}");
        Ok(())
    }

    /// A subscription to every worker's progress notices.
    pub async fn subscribe_progress(&self) -> Result<async_nats::Subscriber> {
        Ok(self
            .client
            .nats()
            .subscribe(self.names.progress_wildcard())
            .await?)
    }

    /// Publishes raw `payload` on the turn subject with a fresh inbox as the reply
    /// subject, and returns the inbox's subscription (it stays open after `final`).
    pub async fn submit_raw(&self, payload: Vec<u8>) -> Result<async_nats::Subscriber> {
        let nats = self.client.nats();
        let inbox = nats.new_inbox();
        let subscriber = nats.subscribe(inbox.clone()).await?;
        nats.publish_with_reply(self.names.turn_submit(), inbox, payload.into())
            .await?;
        nats.flush().await?;
        Ok(subscriber)
    }

    /// A Redis hash of this fleet's Redis, as strings.
    pub async fn hash(&self, key: String) -> Result<HashMap<String, String>> {
        let mut conn = self
            .redis
            .client()?
            .get_multiplexed_async_connection()
            .await?;
        Ok(redis::cmd("HGETALL")
            .arg(key)
            .query_async(&mut conn)
            .await?)
    }

    /// The calls of the ended turn `turn_id` whose results were recorded, sorted: once
    /// its `final` (which carries each result) is stored, the turn's results hash is
    /// gone and each call's entry says whether its result came (see [`recorded_calls`]).
    pub async fn recorded_calls(&self, turn_id: &str) -> Result<Vec<String>> {
        Ok(recorded_calls(
            &self.hash(self.names.turn_calls_key(turn_id)).await?,
        ))
    }

    /// The results recorded in Redis for `turn_id`, by call key.
    pub async fn recorded_results(&self, turn_id: &str) -> Result<HashMap<String, CallResult>> {
        self.hash(self.names.turn_results_key(turn_id))
            .await?
            .into_iter()
            .map(|(k, v)| Ok((k, serde_json::from_str(&v)?)))
            .collect()
    }

    /// The turn's late-result and duplicate counters in Redis.
    pub async fn counters(&self, turn_id: &str) -> Result<HashMap<String, String>> {
        self.hash(self.names.turn_meta_key(turn_id)).await
    }

    /// Waits (at most `wait`) until the turn's `counter` in Redis reads `want`.
    pub async fn wait_for_counter(
        &self,
        turn_id: &str,
        counter: &str,
        want: &str,
        wait: Duration,
    ) -> Result<()> {
        let what = format!("the turn's {counter} counter to reach {want}");
        eventually_named(&what, wait, || async move {
            let counters = self.counters(turn_id).await.ok()?;
            (counters.get(counter).map(String::as_str) == Some(want)).then_some(())
        })
        .await
    }
}

/// Waits (at most 15 s) until the catalog (native format) that `client` gets satisfies
/// `ready`; `what` names the wait in its timeout error.
pub async fn wait_for_catalog(
    client: &FleetClient,
    what: &str,
    ready: impl Fn(&[Value]) -> bool,
) -> Result<()> {
    let ready = &ready;
    eventually_named(what, CATALOG_WAIT, || async move {
        let tools = client
            .catalog(CatalogFormat::Native, None, CATALOG_REQUEST)
            .await
            .ok()?;
        ready(&tools).then_some(())
    })
    .await
}

/// Waits until the catalog that `client` gets lists every tool in `names`.
pub async fn wait_for_tools_on(client: &FleetClient, names: &[&str]) -> Result<()> {
    wait_for_catalog(client, "tools in the catalog", |tools| {
        let listed: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
        names.iter().all(|n| listed.contains(n))
    })
    .await
}

/// A turn for the join store as the coordinator creates one: `acme`'s, submitted by the
/// frontend `frontend` with its events to `reply.subject`, 60 s to its deadline and keys
/// that live 120 s, not paced, past the lanes, with no calls, results, events or queued
/// jobs yet (a test sets those with struct update syntax).
pub fn new_turn(turn_id: &str) -> NewTurn<'_> {
    NewTurn {
        turn_id,
        reply: "reply.subject",
        digest: "",
        tenant: "acme",
        deadline_unix_ms: unix_ms() + 60_000,
        paced: false,
        calls: Vec::new(),
        results: Vec::new(),
        ttl_ms: 120_000,
        created_unix_ms: unix_ms(),
        traceparent: "",
        trace: "",
        caller: "frontend",
        events: Vec::new(),
        ended: false,
        queued: Vec::new(),
        laned: false,
    }
}

/// A turn request for `tenant` with `decision`.
pub fn turn(tenant: &str, decision: Value) -> TurnRequest {
    TurnRequest {
        turn_id: None,
        tenant_id: tenant.to_string(),
        session_id: Some("session-1".into()),
        user_message: None,
        decision,
        deadline_ms: Some(10_000),
        options: Default::default(),
        context: Default::default(),
    }
}

/// A turn request for `tenant` whose decision holds `calls`, with a deadline of
/// `deadline_ms`.
pub fn timed_turn(tenant: &str, deadline_ms: u64, calls: Vec<Value>) -> TurnRequest {
    let mut request = turn(tenant, tool_calls(calls));
    request.deadline_ms = Some(deadline_ms);
    request
}

/// [`timed_turn`] under the turn id `turn_id`.
pub fn named_turn(turn_id: &str, tenant: &str, deadline_ms: u64, calls: Vec<Value>) -> TurnRequest {
    TurnRequest {
        turn_id: Some(turn_id.to_string()),
        ..timed_turn(tenant, deadline_ms, calls)
    }
}

/// The turn `turn_id` of tenant `acme` (with a deadline of `deadline_ms`) whose one
/// call `c1` of `test.behave` sleeps `sleep_ms`.
pub fn one_sleeping_call(turn_id: &str, deadline_ms: u64, sleep_ms: u64) -> TurnRequest {
    let sleeping = call("c1", "test.behave", json!({ "sleep_ms": sleep_ms }));
    named_turn(turn_id, "acme", deadline_ms, vec![sleeping])
}

/// A simple-form call `{id, toolName, arguments}`.
pub fn call(id: &str, tool: &str, arguments: Value) -> Value {
    json!({"id": id, "toolName": tool, "arguments": arguments})
}

/// A call of the demo pack's CRM tool `tool` for the customer `customer`.
pub fn crm_call(id: &str, tool: &str, customer: &str) -> Value {
    call(id, tool, json!({ "customerId": customer }))
}

/// The calls `c<i>` for each `i` of `indices`, each of `test.behave` sleeping
/// `sleep_ms` and then answering `i`.
pub fn sleeping_calls(indices: impl IntoIterator<Item = usize>, sleep_ms: u64) -> Vec<Value> {
    indices
        .into_iter()
        .map(|i| {
            call(
                &format!("c{i}"),
                "test.behave",
                json!({"sleep_ms": sleep_ms, "value": i}),
            )
        })
        .collect()
}

/// A simple-form decision holding `calls`.
pub fn tool_calls(calls: Vec<Value>) -> Value {
    json!({"type": "tool_calls", "calls": calls})
}

/// Reads `stream` until its last event (`final` or `error`), each read bounded by
/// `wait`; returns every event, the last one last.
pub async fn read_to_end(stream: &mut TurnStream, wait: Duration) -> Result<Vec<TurnEvent>> {
    let mut events = Vec::new();
    loop {
        let event = stream.next_event(wait).await?;
        let last = event.is_last();
        events.push(event);
        if last {
            return Ok(events);
        }
    }
}

/// Reads the first event of `stream` (bounded by `wait`) and fails unless it is the
/// `ack`.
pub async fn read_ack(stream: &mut TurnStream, wait: Duration) -> Result<()> {
    match stream.next_event(wait).await? {
        TurnEvent::Ack { .. } => Ok(()),
        other => anyhow::bail!("expected ack, got {other:?}"),
    }
}

/// Reads `stream` to its end (see [`read_to_end`]) and returns its `final` event; an
/// `error` event instead is an error.
pub async fn read_final(stream: &mut TurnStream, wait: Duration) -> Result<FinalEvent> {
    let events = read_to_end(stream, wait).await?;
    Ok(final_of(&events)?.clone())
}

/// Reads `stream` until call `id` (any call, when `None`) is reported in `state`, each
/// read bounded by `wait`; fails if the turn ends first.
pub async fn until_state(
    stream: &mut TurnStream,
    id: Option<&str>,
    state: CallState,
    wait: Duration,
) -> Result<()> {
    loop {
        match stream.next_event(wait).await? {
            TurnEvent::ToolState {
                tool_call_id,
                state: reported,
                ..
            } if reported == state && id.is_none_or(|id| id == tool_call_id) => return Ok(()),
            event if event.is_last() => {
                anyhow::bail!("turn ended before call {id:?} was {state:?}: {event:?}")
            }
            _ => {}
        }
    }
}

/// Asserts on what an example client prints, one line per event as `seq type text`:
/// the ack numbered 1 first, and the final last, numbered as the line count.
pub fn assert_numbered_ack_to_final(text: &str) -> Result<()> {
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(
        lines.first().map(|l| &l[..2]),
        Some(&["1", "ack"][..]),
        "{text}"
    );
    let last = lines.last().context("no output")?;
    assert_eq!(
        last[..2],
        [lines.len().to_string().as_str(), "final"],
        "{text}"
    );
    Ok(())
}

/// The `final` event among `events`.
pub fn final_of(events: &[TurnEvent]) -> Result<&FinalEvent> {
    events
        .iter()
        .find_map(|e| match e {
            TurnEvent::Final(fin) => Some(fin),
            _ => None,
        })
        .context("no final event")
}

/// The `final` that ends `events`: an error when the last event is anything else.
pub fn final_in(events: &[TurnEvent]) -> Result<FinalEvent> {
    match events.last() {
        Some(TurnEvent::Final(fin)) => Ok(fin.clone()),
        other => anyhow::bail!("expected a final last, got {other:?}"),
    }
}

/// The call ids of the results in `fin`, in order.
pub fn call_ids(fin: &FinalEvent) -> Vec<&str> {
    fin.results
        .iter()
        .map(|r| r.tool_call_id.as_str())
        .collect()
}

/// The result of call `id` in `fin`.
pub fn result_of<'a>(fin: &'a FinalEvent, id: &str) -> Result<&'a CallResult> {
    fin.results
        .iter()
        .find(|r| r.tool_call_id == id)
        .with_context(|| format!("no result for call {id}"))
}

/// The error code of a result, if it has an error.
pub fn code_of(result: &CallResult) -> Option<&str> {
    result.error.as_ref().map(|e| e.code.as_str())
}

/// Asserts that of the two calls of `fin`, `failed` ended in an error with `code` and
/// `succeeded` succeeded.
pub fn assert_one_error(fin: &FinalEvent, failed: &str, code: &str, succeeded: &str) -> Result<()> {
    let r = result_of(fin, failed)?;
    assert_eq!(r.state, CallState::Error, "{failed}: {r:?}");
    assert_eq!(code_of(r), Some(code), "{failed}: {r:?}");
    assert!(result_of(fin, succeeded)?.ok, "{succeeded}: {fin:?}");
    assert_eq!((fin.summary.ok, fin.summary.errors), (1, 1), "{fin:?}");
    Ok(())
}

/// The error code of the result of call `id` in `fin`, if it has an error.
pub fn code_at<'a>(fin: &'a FinalEvent, id: &str) -> Result<Option<&'a str>> {
    Ok(code_of(result_of(fin, id)?))
}

/// The value at JSON `pointer` (e.g. `/booking/status`) in a result's value: `None`
/// without a value, `null` where the value has nothing at `pointer`.
pub fn value_at(result: &CallResult, pointer: &str) -> Option<Value> {
    result
        .result
        .as_ref()
        .map(|v| v.pointer(pointer).cloned().unwrap_or(Value::Null))
}

/// The next event on a raw subscription (see [`Fleet::submit_raw`]), waiting at most
/// `wait`.
pub async fn next_raw_event(
    subscriber: &mut async_nats::Subscriber,
    wait: Duration,
) -> Result<TurnEvent> {
    let message = tokio::time::timeout(wait, subscriber.next())
        .await
        .map_err(|_| anyhow::anyhow!("no event within {wait:?}"))?
        .context("subscription closed")?;
    Ok(serde_json::from_slice(&message.payload)?)
}

/// The body of a successful `CallResult` of call `id` that claims to come from `tool`
/// and from worker `worker`, as a forging publisher would send it.
pub fn forged_result(id: &str, tool: &str, value: Value, worker: &str) -> Result<Vec<u8>> {
    let call = toolfleet_common::ToolCall {
        id: id.to_string(),
        name: tool.to_string(),
        arguments: serde_json::json!({}),
        parent_id: None,
    };
    let mut result = CallResult::success(&call, value);
    result.attempts = 1;
    result.worker_id = Some(worker.into());
    Ok(serde_json::to_vec(&result)?)
}

/// The keys of `calls` (a turn's calls hash, by call key) whose entry is marked
/// `"recorded": true`, sorted: the calls that had their result when the turn's `final`
/// was stored.
pub fn recorded_calls(calls: &HashMap<String, String>) -> Vec<String> {
    let mut keys: Vec<String> = calls
        .iter()
        .filter(|(_, entry)| {
            serde_json::from_str::<Value>(entry).is_ok_and(|e| e["recorded"] == json!(true))
        })
        .map(|(key, _)| key.clone())
        .collect();
    keys.sort_unstable();
    keys
}
