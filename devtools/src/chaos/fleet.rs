//! The fleet under fault: its own `nats-server -js` and `redis-server` (append-only
//! file, synced every second) on free loopback ports — or, with `--cluster`, a 3-node
//! JetStream cluster and a Redis Cluster of 3 masters with a replica each
//! (`toolfleet_dev::cluster`) — and coordinator and worker processes, each of which can be
//! killed with SIGKILL and started again on the same port and data folder.
//!
//! Owns every process it spawns and the run folder holding their data. It must never
//! signal a process it did not spawn, never listen beyond 127.0.0.1, and never leave a
//! process or the run folder behind: [`ChaosFleet::stop`] (or dropping the fleet) kills
//! every process and removes the folder.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::{Child, Command};
use toolfleet_common::{FleetClient, Names};

use super::Fault;
use crate::bench::{live_workers, OTEL_VARIABLES};
use toolfleet_cli::local::{self, tempdir, Server, NATS, REDIS_AOF};
use toolfleet_dev::cluster::{NatsCluster, RedisCluster};

/// The tool the chaos turns call.
pub const TOOL: &str = "test.behave";
/// How long a fleet may take to list the tool with every worker alive (a fresh pair of
/// clusters and a debug build on two busy cores have taken over 30 s).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a restarted server may take to listen again.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// How many coordinators and workers to run, and where their logs go.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// Coordinator processes.
    pub coordinators: usize,
    /// Worker processes.
    pub workers: usize,
    /// Folder the nodes' standard error is appended to (`<label>.log`); `None`
    /// discards it.
    pub logs: Option<PathBuf>,
    /// Clusters instead of one server of each.
    pub cluster: bool,
    /// Pairs of jobs and results streams the turns are spread over.
    pub partitions: u32,
}

/// How long a Redis master's replica may take to take over, and the cluster to be
/// whole again after the old master's restart.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(30);

/// The executables of the coordinator and worker processes.
#[derive(Debug, Clone)]
pub struct NodeBinaries {
    coordinator: (PathBuf, Vec<&'static str>),
    worker: (PathBuf, Vec<&'static str>),
}

impl NodeBinaries {
    /// `toolfleet-coordinator` and `toolfleet-worker` beside this executable (one
    /// build); when either is missing, this executable's own `coordinator` and
    /// `worker --packs test` commands, which run the same code.
    pub fn locate() -> Result<Self> {
        let exe = std::env::current_exe().context("locating this executable")?;
        let dir = exe.parent().context("this executable has no folder")?;
        let beside = |name: &str| dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
        let (coordinator, worker) = (beside("toolfleet-coordinator"), beside("toolfleet-worker"));
        Ok(if coordinator.is_file() && worker.is_file() {
            Self {
                coordinator: (coordinator, vec![]),
                worker: (worker, vec![]),
            }
        } else {
            Self {
                coordinator: (exe.clone(), vec!["coordinator"]),
                worker: (exe, vec!["worker", "--packs", "test"]),
            }
        })
    }

    /// The coordinator's and the worker's command lines, for the report.
    pub fn describe(&self) -> [String; 2] {
        let line = |(path, args): &(PathBuf, Vec<&str>)| {
            std::iter::once(path.display().to_string())
                .chain(args.iter().map(|a| a.to_string()))
                .collect::<Vec<_>>()
                .join(" ")
        };
        [line(&self.coordinator), line(&self.worker)]
    }
}

/// How to start one process again, the same way each time.
enum Launch {
    /// A server on a fixed port with a fixed data folder.
    Server {
        server: &'static Server,
        bin: PathBuf,
        port: u16,
        dir: PathBuf,
    },
    /// A coordinator or worker with fixed arguments and environment.
    Node {
        program: PathBuf,
        args: Vec<&'static str>,
        env: Vec<(&'static str, String)>,
        log: Option<PathBuf>,
    },
}

/// One process of the fleet: running, or killed and waiting to be started again.
pub struct Proc {
    /// `nats`, `redis`, `coordinator-0`, `worker-1`, …
    pub label: String,
    launch: Launch,
    child: Option<Child>,
}

impl Proc {
    fn start(&mut self) -> Result<()> {
        let child = match &self.launch {
            Launch::Server {
                server,
                bin,
                port,
                dir,
            } => server.spawn(bin, *port, dir)?,
            Launch::Node {
                program,
                args,
                env,
                log,
            } => spawn_node(program, args, env, log.as_deref())
                .with_context(|| format!("starting {}", self.label))?,
        };
        self.child = Some(child);
        Ok(())
    }

    /// Waits until a server listens again (nodes listen on nothing).
    async fn wait_listening(&self) -> Result<()> {
        if let Launch::Server { port, .. } = &self.launch {
            tokio::time::timeout(LISTEN_TIMEOUT, local::wait_port(*port, &self.label))
                .await
                .with_context(|| format!("{} did not listen again", self.label))??;
        }
        Ok(())
    }

    /// Kills the process with SIGKILL and reaps it.
    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }
}

fn spawn_node(
    program: &Path,
    args: &[&str],
    env: &[(&str, String)],
    log: Option<&Path>,
) -> Result<Child> {
    let stderr = match log {
        Some(path) => Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?,
        ),
        None => Stdio::null(),
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .kill_on_drop(true);
    for name in OTEL_VARIABLES {
        cmd.env_remove(name);
    }
    Ok(cmd.spawn()?)
}

/// A fleet of its own: servers, coordinators and workers under one prefix.
pub struct ChaosFleet {
    /// NATS URL of the fleet's server (comma-separated nodes on a cluster).
    pub nats_url: String,
    /// Redis URL of the fleet's server (its cluster's nodes on a cluster).
    pub redis_url: String,
    /// A frontend client that reconnects for as long as the fleet runs.
    pub client: FleetClient,
    servers: Servers,
    coordinators: Vec<Proc>,
    workers: Vec<Proc>,
    /// Removed on drop, after the processes are gone.
    _run_dir: tempdir::Dir,
}

/// The fleet's NATS and Redis.
enum Servers {
    /// One server of each.
    Single { nats: Box<Proc>, redis: Box<Proc> },
    /// A NATS cluster and a Redis Cluster.
    Cluster {
        nats: Box<NatsCluster>,
        redis: Box<RedisCluster>,
    },
}

impl ChaosFleet {
    /// Starts the servers, then the nodes, and waits until the coordinators list
    /// [`TOOL`] with every worker alive.
    pub async fn start(spec: &FleetSpec, binaries: &NodeBinaries) -> Result<Self> {
        let run_dir = tempdir::Dir::new("chaos")?;
        let (servers, nats_url, redis_url) = if spec.cluster {
            let (nats, redis) = tokio::try_join!(NatsCluster::start(3), RedisCluster::start(3, 1))?;
            let (nats_url, redis_url) = (nats.urls(), redis.url());
            let servers = Servers::Cluster {
                nats: Box::new(nats),
                redis: Box::new(redis),
            };
            (servers, nats_url, redis_url)
        } else {
            let nats = start_server(&NATS, "nats", run_dir.path()).await?;
            let redis = start_server(&REDIS_AOF, "redis", run_dir.path()).await?;
            let (nats_url, redis_url) = (server_url(&nats), server_url(&redis));
            let servers = Servers::Single {
                nats: Box::new(nats),
                redis: Box::new(redis),
            };
            (servers, nats_url, redis_url)
        };
        let prefix = "chaos";
        let mut env = node_env(&nats_url, &redis_url, prefix);
        if spec.cluster {
            env.push(("TOOLFLEET_STREAM_REPLICAS", "3".to_string()));
        }
        env.push(("TOOLFLEET_STREAM_PARTITIONS", spec.partitions.to_string()));
        let node =
            |label: String, (program, args): &(PathBuf, Vec<&'static str>)| -> Result<Proc> {
                let mut env = env.clone();
                env.push(("TOOLFLEET_WORKER_ID", label.clone()));
                let log = spec.logs.as_ref().map(|d| d.join(format!("{label}.log")));
                let mut proc = Proc {
                    label,
                    launch: Launch::Node {
                        program: program.clone(),
                        args: args.clone(),
                        env,
                        log,
                    },
                    child: None,
                };
                proc.start()?;
                Ok(proc)
            };
        let coordinators = (0..spec.coordinators)
            .map(|i| node(format!("coordinator-{i}"), &binaries.coordinator))
            .collect::<Result<Vec<_>>>()?;
        let workers = (0..spec.workers)
            .map(|i| node(format!("worker-{i}"), &binaries.worker))
            .collect::<Result<Vec<_>>>()?;
        // Moves off a cut-off node land on another node, as a frontend's do.
        let nats_client =
            toolfleet_common::failover::prefer_another_server(async_nats::ConnectOptions::new())
                .name("toolfleet-chaos")
                .max_reconnects(None)
                .connect(toolfleet_common::config::NatsUrls(&nats_url))
                .await
                .with_context(|| format!("connecting to {nats_url}"))?;
        let names = Names::new(prefix);
        // A frontend's standby connection, as `FleetClient::connect` gives one.
        let client = FleetClient::new(nats_client, names.clone()).with_standby(
            &nats_url,
            toolfleet_common::credentials::NatsCredentials::none(),
        );
        let fleet = Self {
            nats_url,
            redis_url: redis_url.clone(),
            client,
            servers,
            coordinators,
            workers,
            _run_dir: run_dir,
        };
        fleet.wait_ready(&redis_url, &names, spec.workers).await?;
        Ok(fleet)
    }

    async fn wait_ready(&self, redis_url: &str, names: &Names, workers: usize) -> Result<()> {
        local::wait_for_tools(&self.client, &[TOOL.to_string()], START_TIMEOUT).await?;
        let mut redis =
            toolfleet_common::redis_client::connect(redis_url, Default::default()).await?;
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            let alive = live_workers(&mut redis, names, TOOL).await;
            if alive.is_some_and(|n| n >= workers) {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                let seen = alive.map_or("none readable".to_string(), |n| n.to_string());
                bail!(
                    "{workers} workers did not come alive within {START_TIMEOUT:?} (alive: {seen})"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// The processes a fault of `fault` kind picks from (cluster nodes are not
    /// processes of this list).
    fn of_kind(&mut self, fault: Fault) -> &mut [Proc] {
        match (fault, &mut self.servers) {
            (Fault::Worker, _) => &mut self.workers,
            (Fault::Coordinator, _) => &mut self.coordinators,
            (Fault::Redis, Servers::Single { redis, .. }) => std::slice::from_mut(&mut **redis),
            (Fault::Nats, Servers::Single { nats, .. }) => std::slice::from_mut(&mut **nats),
            _ => &mut [],
        }
    }

    /// Brings the `pick`-th target of `fault` kind (modulo their number) down: kills a
    /// process, a NATS node or a Redis master with SIGKILL, or cuts a NATS node off its
    /// peers; its index, or `None` when there is none of that kind.
    pub async fn kill(&mut self, fault: Fault, pick: usize) -> Result<Option<usize>> {
        match (fault, &mut self.servers) {
            (Fault::NatsNode, Servers::Cluster { nats, .. }) => {
                let index = pick % nats.size();
                nats.kill(index).await;
                Ok(Some(index))
            }
            (Fault::Partition, Servers::Cluster { nats, .. }) => {
                let index = pick % nats.size();
                nats.partition(index)?;
                Ok(Some(index))
            }
            (Fault::RedisMaster, Servers::Cluster { redis, .. }) => {
                let Some(index) = master_picked(redis, pick).await else {
                    return Ok(None);
                };
                redis.kill(index).await;
                Ok(Some(index))
            }
            (Fault::RedisPartition, Servers::Cluster { redis, .. }) => {
                let Some(index) = master_picked(redis, pick).await else {
                    return Ok(None);
                };
                redis.partition(index)?;
                // Held until its replica took over (the cut master still says it is
                // one, so four nodes answer `master`); the fault's pause follows.
                let until = tokio::time::Instant::now() + FAILOVER_TIMEOUT;
                while redis.masters().await.len() < 4 && tokio::time::Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(Some(index))
            }
            _ => {
                let procs = self.of_kind(fault);
                if procs.is_empty() {
                    return Ok(None);
                }
                let index = pick % procs.len();
                procs[index].kill().await;
                Ok(Some(index))
            }
        }
    }

    /// Brings the `index`-th target of `fault` kind back: starts a process or NATS node
    /// again (same port and data folder) and waits until it listens; ends a partition;
    /// restarts a Redis master once its replica took over, then waits until the
    /// cluster is whole (so one master is down at a time).
    pub async fn restart(&mut self, fault: Fault, index: usize) -> Result<()> {
        match (fault, &mut self.servers) {
            (Fault::NatsNode, Servers::Cluster { nats, .. }) => {
                nats.restart(index).await?;
                nats.wait_jetstream(FAILOVER_TIMEOUT).await
            }
            (Fault::Partition, Servers::Cluster { nats, .. }) => {
                nats.heal(index);
                Ok(())
            }
            (Fault::RedisPartition, Servers::Cluster { redis, .. }) => {
                redis.heal(index);
                redis.wait_ok(FAILOVER_TIMEOUT).await
            }
            (Fault::RedisMaster, Servers::Cluster { redis, .. }) => {
                let until = tokio::time::Instant::now() + FAILOVER_TIMEOUT;
                while redis.masters().await.len() < 3 {
                    if tokio::time::Instant::now() >= until {
                        bail!("no replica took over from Redis node {index}");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                redis.restart(index).await?;
                redis.wait_ok(FAILOVER_TIMEOUT).await
            }
            _ => {
                let Some(proc) = self.of_kind(fault).get_mut(index) else {
                    return Ok(());
                };
                proc.start()?;
                proc.wait_listening().await
            }
        }
    }

    /// Kills every process (nodes first), then removes the run folder.
    pub async fn stop(mut self) {
        for proc in self.coordinators.iter_mut().chain(self.workers.iter_mut()) {
            proc.kill().await;
        }
        if let Servers::Single { nats, redis } = &mut self.servers {
            nats.kill().await;
            redis.kill().await;
        }
        // Clusters stop (nodes killed, rules removed, folders deleted) when dropped.
    }
}

/// The `pick`-th of `redis`'s masters now (modulo their number), `None` when no node
/// answers as one: which node a Redis fault hits.
async fn master_picked(redis: &RedisCluster, pick: usize) -> Option<usize> {
    let masters = redis.masters().await;
    (!masters.is_empty()).then(|| masters[pick % masters.len()])
}

async fn start_server(server: &'static Server, label: &str, run_dir: &Path) -> Result<Proc> {
    let dir = run_dir.join(label);
    std::fs::create_dir_all(&dir)?;
    let mut proc = Proc {
        label: label.to_string(),
        launch: Launch::Server {
            server,
            bin: server.find()?,
            port: toolfleet_testkit::free_port()?,
            dir,
        },
        child: None,
    };
    proc.start()?;
    proc.wait_listening().await?;
    Ok(proc)
}

fn server_url(proc: &Proc) -> String {
    match &proc.launch {
        Launch::Server { server, port, .. } => server.url(*port),
        Launch::Node { .. } => String::new(),
    }
}

/// The environment every node gets: the fleet's servers and prefix, no HTTP listener
/// (several nodes share the host), the test pack, warnings only unless `RUST_LOG` says.
fn node_env(nats_url: &str, redis_url: &str, prefix: &str) -> Vec<(&'static str, String)> {
    vec![
        ("TOOLFLEET_NATS_URL", nats_url.to_string()),
        ("TOOLFLEET_REDIS_URL", redis_url.to_string()),
        ("TOOLFLEET_PREFIX", prefix.to_string()),
        ("TOOLFLEET_HTTP_ADDR", "off".to_string()),
        ("TOOLFLEET_PACKS", "test".to_string()),
        ("RUST_LOG", toolfleet_testkit::child_log_filter()),
    ]
}
