//! A whole fleet for one test: private `nats-server` and `redis-server`, coordinators and
//! workers in-process (stoppable by token) or as child processes (killable), and a
//! frontend client.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use toolfleet_common::client::TurnStream;
use toolfleet_common::{
    CallResult, CatalogFormat, FinalEvent, FleetClient, Names, TurnEvent, TurnRequest,
};
use toolfleet_coordinator::CoordinatorConfig;
use toolfleet_worker::{packs, Tool, WorkerConfig};

use crate::{eventually_named, NatsServer, RedisServer};

/// Path of the `fleet-node` test binary (coordinator or worker in a child process):
/// beside the running test executable's `deps/` directory.
pub fn fleet_node_path() -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .context("test executable has no target directory")?;
    let path = dir.join(format!("fleet-node{}", std::env::consts::EXE_SUFFIX));
    anyhow::ensure!(path.exists(), "{} is not built", path.display());
    Ok(path)
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
    /// Graceful stop, bounded.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), self.handle).await;
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
        crate::init_test_tracing();
        let nats = NatsServer::start().await?;
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

    /// Coordinator settings for this fleet, with short sweeps for tests.
    pub fn coordinator_config(&self) -> CoordinatorConfig {
        CoordinatorConfig {
            nats_url: self.nats.url(),
            redis_url: self.redis.url(),
            prefix: self.names.prefix().to_string(),
            sweep_interval: Duration::from_millis(100),
            sweep_grace: Duration::from_millis(300),
            registry_refresh: Duration::from_millis(250),
            shutdown_grace: Duration::from_secs(2),
            ..CoordinatorConfig::local()
        }
    }

    /// Worker settings for this fleet, with a short ack wait so redelivery is quick.
    pub fn worker_config(&self) -> WorkerConfig {
        WorkerConfig {
            nats_url: self.nats.url(),
            redis_url: self.redis.url(),
            prefix: self.names.prefix().to_string(),
            heartbeat: Duration::from_millis(500),
            ack_wait: Duration::from_millis(1000),
            ..WorkerConfig::local()
        }
    }

    /// Starts an in-process coordinator.
    pub fn coordinator(&self, config: CoordinatorConfig) -> Running {
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = tokio::spawn(async move {
            if let Err(error) = toolfleet_coordinator::run(config, token).await {
                tracing::error!(%error, "coordinator failed");
            }
        });
        Running { shutdown, handle }
    }

    /// Starts an in-process worker serving `tools`.
    pub fn worker(&self, config: WorkerConfig, tools: Vec<Tool>) -> Running {
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = tokio::spawn(async move {
            if let Err(error) = toolfleet_worker::run(config, tools, token).await {
                tracing::error!(%error, "worker failed");
            }
        });
        Running { shutdown, handle }
    }

    /// Starts an in-process coordinator and a worker with the demo and test packs, and
    /// waits until the catalog lists the tools.
    pub async fn start_default(&self) -> Result<(Running, Running)> {
        let c = self.coordinator(self.coordinator_config());
        let tools = packs::tools_for(&["demo", "test"]).map_err(anyhow::Error::msg)?;
        let w = self.worker(self.worker_config(), tools);
        self.wait_for_tools(&["crm.getOpenInvoices", "test.behave", "test.behave_once"])
            .await?;
        Ok((c, w))
    }

    /// Spawns `fleet-node <role>` as a child process with this fleet's settings and
    /// `extra` environment.
    pub fn spawn_node(&mut self, role: &str, extra: &[(&str, &str)]) -> Result<u32> {
        let mut cmd = Command::new(fleet_node_path()?);
        cmd.arg(role)
            .env("TOOLFLEET_NATS_URL", self.nats.url())
            .env("TOOLFLEET_REDIS_URL", self.redis.url())
            .env("TOOLFLEET_PREFIX", self.names.prefix())
            .env("TOOLFLEET_HEARTBEAT_MS", "500")
            .env("TOOLFLEET_ACK_WAIT_MS", "1000")
            .env("TOOLFLEET_SWEEP_INTERVAL_MS", "100")
            .env("TOOLFLEET_SWEEP_GRACE_MS", "300")
            .env("TOOLFLEET_REGISTRY_REFRESH_MS", "250")
            .env("TOOLFLEET_HTTP_ADDR", "127.0.0.1:0")
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in extra {
            cmd.env(k, v);
        }
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

    /// Waits until the catalog (native format) lists every tool in `names`.
    pub async fn wait_for_tools(&self, names: &[&str]) -> Result<()> {
        let client = self.client.clone();
        eventually_named("tools in the catalog", Duration::from_secs(15), || {
            let client = client.clone();
            async move {
                let tools = client
                    .catalog(CatalogFormat::Native, None, Duration::from_millis(500))
                    .await
                    .ok()?;
                let listed: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
                names.iter().all(|n| listed.contains(n)).then_some(())
            }
        })
        .await
    }

    /// Waits until the catalog no longer lists `name`.
    pub async fn wait_for_tool_gone(&self, name: &str) -> Result<()> {
        let client = self.client.clone();
        eventually_named(
            "tool gone from the catalog",
            Duration::from_secs(15),
            || {
                let client = client.clone();
                async move {
                    let tools = client
                        .catalog(CatalogFormat::Native, None, Duration::from_millis(500))
                        .await
                        .ok()?;
                    (!tools.iter().any(|t| t["name"] == name)).then_some(())
                }
            },
        )
        .await
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
    async fn hash(&self, key: String) -> Result<HashMap<String, String>> {
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

/// A simple-form call `{id, toolName, arguments}`.
pub fn call(id: &str, tool: &str, arguments: Value) -> Value {
    json!({"id": id, "toolName": tool, "arguments": arguments})
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
