//! Local clusters on loopback: a JetStream cluster of `nats-server`s ([`NatsCluster`])
//! and a Redis Cluster of `redis-server`s ([`RedisCluster`]), each node on its own free
//! port with its own data folder, with the faults a cluster is tested under: a node
//! killed (`kill`), brought back (`restart`, same port, same data), and a NATS node cut
//! off from its peers (`partition` / `heal`). `toolfleet-dev chaos --cluster`,
//! `toolfleet-dev bench --cluster` and the cluster tests use them.
//!
//! A partition is made with `iptables` on the loopback interface: each node runs under
//! a user id of its own (when this process is root), its route connections are marked
//! (`CONNMARK`, by the node's user id and the cluster's route ports) and every marked
//! packet is dropped; clients keep reaching the node. Only rules this module added are
//! ever removed, on `heal` and on drop; only loopback traffic of the cluster's own
//! route ports is ever matched.
//!
//! Owns the processes and folders it starts: dropping a cluster kills its nodes,
//! removes its rules and deletes its folders. Never touches a server it did not start.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use tokio::process::{Child, Command};

/// How long a node may take to listen, and a cluster to be usable.
const NODE_START: Duration = Duration::from_secs(15);
/// How long a whole cluster may take to elect its leaders / cover its slots.
const CLUSTER_START: Duration = Duration::from_secs(45);
/// First user id the nodes run under (plus the node's route or bus port).
const NODE_UID_BASE: u32 = 200_000;

/// A temporary folder, removed on drop.
struct Folder(PathBuf);

impl Folder {
    fn new(tag: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(format!(
            "toolfleet-{tag}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` distinct free loopback ports, none handed out before in this process.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    toolfleet_testkit::free_ports(n).context("choosing free loopback ports")
}

fn find_binary(name: &str) -> Result<PathBuf> {
    Ok(toolfleet_testkit::find_binary(name)?)
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Hands `dir` and everything in it to `uid`.
fn chown_tree(dir: &Path, uid: u32) -> Result<()> {
    std::os::unix::fs::chown(dir, Some(uid), Some(uid))
        .with_context(|| format!("chown {}", dir.display()))?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            chown_tree(&path, uid)?;
        } else {
            std::os::unix::fs::chown(&path, Some(uid), Some(uid))?;
        }
    }
    Ok(())
}

/// One server process of a cluster.
struct Node {
    /// Executable.
    binary: PathBuf,
    /// Its command line.
    args: Vec<String>,
    /// Client port.
    port: u16,
    /// Output file.
    log: PathBuf,
    /// User id it runs under (root only).
    uid: Option<u32>,
    /// Environment it runs with beside this process's.
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl Node {
    async fn spawn(&mut self) -> Result<()> {
        self.kill().await;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut command = Command::new(&self.binary);
        command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .kill_on_drop(true);
        if let Some(uid) = self.uid {
            command.uid(uid).gid(uid);
        }
        self.child = Some(
            command
                .spawn()
                .with_context(|| format!("starting {}", self.binary.display()))?,
        );
        let deadline = tokio::time::Instant::now() + NODE_START;
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                bail!(
                    "{} exited ({status}); log {}",
                    self.binary.display(),
                    self.log.display()
                );
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{} did not listen on {} within {NODE_START:?}; log {}",
                    self.binary.display(),
                    self.port,
                    self.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
        }
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

/// The server processes of one cluster, with the faults a test puts them under: each
/// node killed, started again, or cut off from its peers. Both clusters hand these
/// controls out through `Deref`, so `cluster.kill(i)` reads the same on either.
pub struct Members {
    nodes: Vec<Node>,
    /// The port each node's peers reach it on (NATS routes, the Redis cluster bus):
    /// what a partition cuts.
    peer_ports: Vec<u16>,
    /// The rules cutting each node off, while it is partitioned.
    partitions: Vec<Option<Rules>>,
    /// The high bits of a partition's connection mark, one value per kind of cluster.
    mark_base: u32,
}

impl Members {
    fn new(nodes: Vec<Node>, peer_ports: Vec<u16>, mark_base: u32) -> Self {
        Self {
            partitions: nodes.iter().map(|_| None).collect(),
            nodes,
            peer_ports,
            mark_base,
        }
    }

    /// Starts every node and waits until each listens.
    async fn spawn_all(&mut self) -> Result<()> {
        for node in &mut self.nodes {
            node.spawn().await?;
        }
        Ok(())
    }

    /// How many nodes the cluster has.
    pub fn size(&self) -> usize {
        self.nodes.len()
    }

    /// Node `i`'s process id while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].pid()
    }

    /// Whether node `i` runs.
    pub fn is_running(&mut self, i: usize) -> bool {
        self.nodes[i].is_running()
    }

    /// Kills node `i` (SIGKILL).
    pub async fn kill(&mut self, i: usize) {
        self.nodes[i].kill().await;
    }

    /// Starts node `i` again on its port: a NATS node with its store; a Redis node
    /// rejoins the cluster with an empty dataset (a master that was replaced comes back
    /// as a replica of its successor).
    pub async fn restart(&mut self, i: usize) -> Result<()> {
        self.nodes[i].spawn().await
    }

    /// Cuts node `i` off from the other nodes' peer ports (NATS routes, the Redis
    /// cluster bus), not from its clients or a replica's replication link. Needs root
    /// and `iptables`.
    pub fn partition(&mut self, i: usize) -> Result<()> {
        let uid = self.nodes[i]
            .uid
            .context("partitions need root (nodes run under their own user ids)")?;
        if self.partitions[i].is_none() {
            let mark = self.mark_base | u32::from(self.peer_ports[i]);
            self.partitions[i] = Some(Rules::add(isolation_rules(uid, &self.peer_ports, mark))?);
        }
        Ok(())
    }

    /// Ends node `i`'s partition.
    pub fn heal(&mut self, i: usize) {
        self.partitions[i] = None;
    }
}

/// `iptables` rules in the `OUTPUT` chain, removed on drop.
struct Rules {
    iptables: PathBuf,
    rules: Vec<Vec<String>>,
}

/// How often one `iptables` change is tried before it counts as failed: with the
/// nf_tables backend, a change that races another process's change of the ruleset is
/// refused (exit status 4) and succeeds when made again.
const IPTABLES_TRIES: u32 = 5;

impl Rules {
    /// Adds `rules` in order; on a failure removes those already added.
    fn add(rules: Vec<Vec<String>>) -> Result<Self> {
        let mut added = Self {
            iptables: find_binary("iptables")?,
            rules: Vec::new(),
        };
        for rule in rules {
            added.change("-A", &rule)?;
            added.rules.push(rule);
        }
        Ok(added)
    }

    /// Appends (`-A`) or deletes (`-D`) `rule` in the `OUTPUT` chain, tried again a few
    /// times when `iptables` refuses it; the last refusal's message on failure.
    fn change(&self, action: &str, rule: &[String]) -> Result<()> {
        let mut tries = 0;
        loop {
            tries += 1;
            let output = std::process::Command::new(&self.iptables)
                .args(["-w", "5", action, "OUTPUT"])
                .args(rule)
                .stdin(Stdio::null())
                .output()
                .context("running iptables")?;
            if output.status.success() {
                return Ok(());
            }
            if tries >= IPTABLES_TRIES {
                bail!(
                    "iptables {action} OUTPUT {rule:?}: {}: {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                );
            }
            std::thread::sleep(Duration::from_millis(100 * u64::from(tries)));
        }
    }
}

impl Drop for Rules {
    fn drop(&mut self) {
        for rule in self.rules.iter().rev() {
            let _ = self.change("-D", rule);
        }
    }
}

/// The rules cutting the node running as `uid` off from the peers it reaches on
/// `ports` (the cluster's route or bus ports): its connections on those ports are
/// marked by the packets it sends, and every packet of a marked connection, in either
/// direction, is dropped. `mark` is unique to the node.
fn isolation_rules(uid: u32, ports: &[u16], mark: u32) -> Vec<Vec<String>> {
    let ports = ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mark = format!("{mark:#x}");
    let rule = |parts: &[&str]| parts.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        rule(&[
            "-o",
            "lo",
            "-p",
            "tcp",
            "-m",
            "owner",
            "--uid-owner",
            &uid.to_string(),
            "-m",
            "multiport",
            "--ports",
            &ports,
            "-j",
            "CONNMARK",
            "--set-mark",
            &mark,
        ]),
        rule(&[
            "-o", "lo", "-p", "tcp", "-m", "connmark", "--mark", &mark, "-j", "DROP",
        ]),
    ]
}

/// `GOMAXPROCS` for each of `nodes` Go servers sharing this machine: its share of the
/// cores, at least one, as a container's CPU limit would give it (nats-server 2.9 does
/// not read such limits itself), unless `GOMAXPROCS` is already set. With the Go
/// default every node runs a scheduler per core and the nodes' idle spinning competes
/// with the fleet: on two cores a 3-node cluster spent 1.17–1.27 ms of CPU per turn of
/// three calls with the default and 0.86 ms with one each (`toolfleet-dev bench --cluster`).
fn go_share_of_cores(nodes: usize) -> Vec<(String, String)> {
    if std::env::var_os("GOMAXPROCS").is_some() {
        return Vec::new();
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let share = (cores / nodes.max(1)).max(1);
    vec![("GOMAXPROCS".to_string(), share.to_string())]
}

/// `Deref` and `DerefMut` of each cluster type to its [`Members`], so a cluster is used
/// as its nodes (`kill`, `restart`, `partition`, `heal`).
macro_rules! deref_to_members {
    ($($cluster:ty),*) => {$(
        impl std::ops::Deref for $cluster {
            type Target = Members;

            fn deref(&self) -> &Members {
                &self.members
            }
        }

        impl std::ops::DerefMut for $cluster {
            fn deref_mut(&mut self) -> &mut Members {
                &mut self.members
            }
        }
    )*};
}

deref_to_members!(NatsCluster, RedisCluster);

/// A JetStream cluster of `nats-server`s on loopback, fully meshed by routes.
pub struct NatsCluster {
    members: Members,
    monitor_ports: Vec<u16>,
    _folder: Folder,
}

impl NatsCluster {
    /// Starts `size` JetStream servers (`n0`, `n1`, ...) on free loopback ports, each
    /// with its own store, routed to each other, and waits until JetStream answers
    /// (a meta leader is elected).
    pub async fn start(size: usize) -> Result<Self> {
        ensure!(size >= 1, "a cluster needs a node");
        let binary = find_binary("nats-server")?;
        let folder = Folder::new("nats-cluster")?;
        let mut ports = free_ports(3 * size)?;
        let monitor_ports = ports.split_off(2 * size);
        let route_ports = ports.split_off(size);
        let client_ports = ports;
        let mut nodes = Vec::with_capacity(size);
        for i in 0..size {
            let dir = folder.0.join(format!("n{i}"));
            std::fs::create_dir_all(dir.join("jetstream"))?;
            let routes = route_ports
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, port)| format!("\"nats-route://127.0.0.1:{port}\""))
                .collect::<Vec<_>>()
                .join(", ");
            let config = format!(
                "server_name: n{i}\nlisten: \"127.0.0.1:{client}\"\n\
                 http: \"127.0.0.1:{monitor}\"\nmax_payload: 8MB\n\
                 jetstream {{ store_dir: \"{store}\" }}\n\
                 cluster {{\n  name: toolfleet\n  listen: \"127.0.0.1:{route}\"\n  routes: [{routes}]\n}}\n",
                client = client_ports[i],
                monitor = monitor_ports[i],
                store = dir.join("jetstream").display(),
                route = route_ports[i],
            );
            let config_path = dir.join("nats-server.conf");
            std::fs::write(&config_path, config)?;
            let uid = is_root().then(|| NODE_UID_BASE + u32::from(route_ports[i]));
            if let Some(uid) = uid {
                chown_tree(&dir, uid)?;
            }
            nodes.push(Node {
                binary: binary.clone(),
                args: vec!["-c".into(), config_path.display().to_string()],
                port: client_ports[i],
                log: folder.0.join(format!("n{i}.log")),
                uid,
                env: go_share_of_cores(size),
                child: None,
            });
        }
        let mut cluster = Self {
            members: Members::new(nodes, route_ports, 0x7f00_0000),
            monitor_ports,
            _folder: folder,
        };
        cluster.members.spawn_all().await?;
        cluster.wait_jetstream(CLUSTER_START).await?;
        Ok(cluster)
    }

    /// Every node's client URL, comma-separated (`TOOLFLEET_NATS_URL`).
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Node `i`'s client URL.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// Node `i`'s client port.
    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].port
    }

    /// Node `i`'s monitoring endpoint (`/routez`, `/subsz`, `/jsz`, ...), for reading
    /// what a node believes during a fault.
    pub fn monitor_url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.monitor_ports[i])
    }

    /// Node `i`'s server name (`n<i>`), as JetStream names leaders.
    pub fn server_name(i: usize) -> String {
        format!("n{i}")
    }

    /// Connects a plain client to every node's URL.
    pub async fn connect(&self) -> Result<async_nats::Client> {
        let servers = self
            .urls()
            .split(',')
            .map(str::parse)
            .collect::<std::io::Result<Vec<async_nats::ServerAddr>>>()?;
        let connect = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(servers);
        tokio::time::timeout(Duration::from_secs(10), connect)
            .await
            .context("connecting to the NATS cluster timed out")?
            .context("connecting to the NATS cluster")
    }

    /// Waits until JetStream answers account queries (`$JS.API.INFO` without an
    /// error: a meta leader is elected), for at most `timeout`.
    pub async fn wait_jetstream(&self, timeout: Duration) -> Result<()> {
        let client = self.connect().await?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let answer = tokio::time::timeout(
                Duration::from_secs(2),
                client.request("$JS.API.INFO", bytes::Bytes::new()),
            )
            .await;
            let last = match answer {
                Ok(Ok(message)) => {
                    match serde_json::from_slice::<serde_json::Value>(&message.payload) {
                        Ok(info) if info.get("error").is_none() => return Ok(()),
                        other => format!("{other:?}"),
                    }
                }
                other => format!("{other:?}"),
            };
            if tokio::time::Instant::now() >= deadline {
                bail!("JetStream did not answer within {timeout:?}: {last}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The node leading `stream`'s replicas, when it has a leader.
    pub async fn stream_leader(&self, stream: &str) -> Result<Option<usize>> {
        let js = async_nats::jetstream::new(self.connect().await?);
        let mut stream = js.get_stream(stream).await?;
        let info = stream.info().await?;
        Ok(info
            .cluster
            .as_ref()
            .and_then(|c| c.leader.as_deref())
            .and_then(|leader| leader.strip_prefix('n'))
            .and_then(|i| i.parse().ok()))
    }
}

/// A Redis Cluster of `redis-server`s on loopback: masters and their replicas,
/// joined with `redis-cli --cluster create`, persistence off.
pub struct RedisCluster {
    members: Members,
    _folder: Folder,
}

impl RedisCluster {
    /// Starts `masters * (1 + replicas)` servers and joins them into a cluster with
    /// `replicas` replicas per master (node timeout 2 s, so a dead master's replica takes
    /// over within about 3 s), and waits until every node sees every slot covered.
    pub async fn start(masters: usize, replicas: usize) -> Result<Self> {
        ensure!(masters >= 3, "a Redis Cluster needs at least 3 masters");
        let binary = find_binary("redis-server")?;
        let cli = find_binary("redis-cli")?;
        let folder = Folder::new("redis-cluster")?;
        let size = masters * (1 + replicas);
        let mut ports = free_ports(2 * size)?;
        let bus_ports = ports.split_off(size);
        let mut nodes = Vec::with_capacity(size);
        for i in 0..size {
            let dir = folder.0.join(format!("r{i}"));
            std::fs::create_dir_all(&dir)?;
            let uid = is_root().then(|| NODE_UID_BASE + u32::from(bus_ports[i]));
            if let Some(uid) = uid {
                chown_tree(&dir, uid)?;
            }
            let args = [
                "--port",
                &ports[i].to_string(),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &dir.join("nodes.conf").display().to_string(),
                "--cluster-port",
                &bus_ports[i].to_string(),
                "--cluster-node-timeout",
                "2000",
                // A replica takes over whatever its last contact with the master, and a
                // new replica syncs at once (no diskless delay), so a master can be
                // killed as soon as the cluster is up.
                "--cluster-replica-validity-factor",
                "0",
                "--repl-diskless-sync-delay",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &dir.display().to_string(),
                "--daemonize",
                "no",
            ]
            .map(String::from)
            .to_vec();
            nodes.push(Node {
                binary: binary.clone(),
                args,
                port: ports[i],
                log: folder.0.join(format!("r{i}.log")),
                uid,
                env: Vec::new(),
                child: None,
            });
        }
        let mut cluster = Self {
            members: Members::new(nodes, bus_ports, 0x7e00_0000),
            _folder: folder,
        };
        cluster.members.spawn_all().await?;
        let mut create = Command::new(cli);
        create.arg("--cluster").arg("create");
        for port in &ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let output = tokio::time::timeout(
            CLUSTER_START,
            create
                .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .context("redis-cli --cluster create took too long")??;
        ensure!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        cluster.wait_ok(CLUSTER_START).await?;
        Ok(cluster)
    }

    /// The cluster as `TOOLFLEET_REDIS_URL`: `redis+cluster://` and every node.
    pub fn url(&self) -> String {
        let nodes = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",");
        format!("redis+cluster://{nodes}")
    }

    /// Node `i`'s own URL (one server; for `CLUSTER` and `ROLE` queries).
    pub fn node_url(&self, i: usize) -> String {
        format!("redis://127.0.0.1:{}/", self.nodes[i].port)
    }

    /// The nodes that are masters now (by `ROLE`), among those that run and answer.
    pub async fn masters(&self) -> Vec<usize> {
        let mut masters = Vec::new();
        for i in 0..self.nodes.len() {
            if self.role(i).await.as_deref() == Some("master") {
                masters.push(i);
            }
        }
        masters
    }

    /// Node `i`'s role (`master`, `slave`), `None` when it does not answer.
    pub async fn role(&self, i: usize) -> Option<String> {
        let client = redis::Client::open(self.node_url(i)).ok()?;
        let mut conn = tokio::time::timeout(
            Duration::from_millis(500),
            client.get_multiplexed_async_connection(),
        )
        .await
        .ok()?
        .ok()?;
        let role: redis::Value = tokio::time::timeout(
            Duration::from_millis(500),
            redis::cmd("ROLE").query_async(&mut conn),
        )
        .await
        .ok()?
        .ok()?;
        match role {
            redis::Value::Array(items) => items.first().and_then(|v| match v {
                redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                redis::Value::SimpleString(s) => Some(s.clone()),
                _ => None,
            }),
            _ => None,
        }
    }

    /// The node serving `key`'s slot as master now (by `CLUSTER NODES` of the first
    /// node that answers).
    pub async fn master_of(&self, key: &str) -> Result<usize> {
        for i in 0..self.nodes.len() {
            let Ok(client) = redis::Client::open(self.node_url(i)) else {
                continue;
            };
            let query = async {
                let mut conn = client.get_multiplexed_async_connection().await?;
                let slot: u16 = redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(key)
                    .query_async(&mut conn)
                    .await?;
                let nodes: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query_async(&mut conn)
                    .await?;
                Ok::<_, redis::RedisError>((slot, nodes))
            };
            let Ok(Ok((slot, nodes))) =
                tokio::time::timeout(Duration::from_millis(800), query).await
            else {
                continue;
            };
            for line in nodes.lines() {
                let fields: Vec<&str> = line.split_whitespace().collect();
                if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                    continue;
                }
                let serves = fields[8..].iter().any(|range| {
                    let mut bounds = range.split('-').map(str::parse::<u16>);
                    match (bounds.next(), bounds.next()) {
                        (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&slot),
                        (Some(Ok(a)), None) => a == slot,
                        _ => false,
                    }
                });
                let port = fields[1]
                    .split('@')
                    .next()
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| p.parse::<u16>().ok());
                if let (true, Some(port)) = (serves, port) {
                    if let Some(node) = self.nodes.iter().position(|n| n.port == port) {
                        return Ok(node);
                    }
                }
            }
        }
        bail!("no master found for {key:?}")
    }

    /// Waits until every running node reports `cluster_state:ok` and every running
    /// replica's link to its master is up.
    pub async fn wait_ok(&mut self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut all_ok = true;
            for i in 0..self.nodes.len() {
                if !self.nodes[i].is_running() {
                    continue;
                }
                if !self.cluster_ok(i).await {
                    all_ok = false;
                    break;
                }
            }
            if all_ok {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("the Redis Cluster was not ok within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn cluster_ok(&self, i: usize) -> bool {
        let Ok(client) = redis::Client::open(self.node_url(i)) else {
            return false;
        };
        let info = async {
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            let cluster = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async::<String>(&mut conn)
                .await
                .ok()?;
            let replication = redis::cmd("INFO")
                .arg("replication")
                .query_async::<String>(&mut conn)
                .await
                .ok()?;
            Some((cluster, replication))
        };
        matches!(
            tokio::time::timeout(Duration::from_millis(500), info).await,
            Ok(Some((cluster, replication)))
                if cluster.contains("cluster_state:ok")
                    && (replication.contains("role:master")
                        || replication.contains("master_link_status:up"))
        )
    }
}
