//! A local fleet: NATS and Redis at the given URLs, or `nats-server` / `redis-server`
//! started on free loopback ports when nothing answers; a coordinator and a worker
//! in-process, their ops endpoints on free ports ([`OpsAddrs`]), the worker's packs
//! started as the `toolfleet-worker` binary starts them (the `mcp` pack included);
//! optionally the HTTP gateway, the `toolfleet-gateway` binary as a child process
//! ([`LocalGateway`]).
//!
//! Owns the server processes it starts and their temporary data folders. It must never
//! stop or alter a server it did not start, and never leave one it started running:
//! they die when the [`Servers`] that holds them is dropped.

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use toolfleet_common::host::{binary_env_var, find_binary, free_port};
use toolfleet_common::{CatalogFormat, FleetClient, Names};
use toolfleet_coordinator::CoordinatorConfig;
use toolfleet_packs::StartedPacks;
use toolfleet_worker::WorkerConfig;

/// A running local fleet; dropping it stops the servers it started.
pub struct LocalFleet {
    /// NATS URL in use.
    pub nats_url: String,
    /// Redis URL in use.
    pub redis_url: String,
    /// Where the coordinator's and the worker's ops endpoints listen.
    pub ops: OpsAddrs,
    /// Client for the fleet.
    pub client: FleetClient,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    packs: StartedPacks,
    _servers: Servers,
}

/// The variable that places the ops endpoints (`/healthz`, `/readyz`, `/metrics`).
const HTTP_ADDR_VAR: &str = "TOOLFLEET_HTTP_ADDR";

/// Where a local fleet's coordinator and worker serve `/healthz`, `/readyz` and
/// `/metrics` (`None`: not served). Never the same address for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpsAddrs {
    /// The coordinator's endpoint.
    pub coordinator: Option<SocketAddr>,
    /// The worker's endpoint.
    pub worker: Option<SocketAddr>,
}

impl OpsAddrs {
    /// From `TOOLFLEET_HTTP_ADDR`: unset (or blank), free loopback ports for both, so a
    /// local fleet never collides with a fleet's usual ports (9090, 9091); `off`, none;
    /// an address, the coordinator there (refused at once when it is taken) and the
    /// worker on a free port of the same host.
    pub fn from_env() -> Result<Self> {
        let set = std::env::var(HTTP_ADDR_VAR)
            .ok()
            .filter(|v| !v.trim().is_empty());
        let coordinator = match set {
            None => free_addr(IpAddr::from([127, 0, 0, 1]))?,
            Some(_) => match toolfleet_common::http::addr_from_env("")? {
                None => {
                    return Ok(Self {
                        coordinator: None,
                        worker: None,
                    })
                }
                Some(addr) if addr.port() == 0 => free_addr(addr.ip())?,
                Some(addr) => {
                    TcpListener::bind(addr).with_context(|| {
                        format!(
                            "{HTTP_ADDR_VAR}={addr} cannot be used for the coordinator's ops \
                             endpoint: set {HTTP_ADDR_VAR} to a free address, unset it to use \
                             free ports, or set it to off"
                        )
                    })?;
                    addr
                }
            },
        };
        let mut worker = free_addr(coordinator.ip())?;
        while worker == coordinator {
            worker = free_addr(coordinator.ip())?;
        }
        Ok(Self {
            coordinator: Some(coordinator),
            worker: Some(worker),
        })
    }
}

/// A port of `ip` that nothing listens on now.
fn free_addr(ip: IpAddr) -> Result<SocketAddr> {
    let bound = TcpListener::bind((ip, 0))
        .with_context(|| format!("no free port on {ip} for an ops endpoint ({HTTP_ADDR_VAR})"))?;
    Ok(bound.local_addr()?)
}

/// NATS and Redis for a local fleet: the ones answering at the given URLs, or
/// `nats-server` / `redis-server` started on free loopback ports; dropping it stops the
/// servers it started.
pub struct Servers {
    /// NATS URL in use.
    pub nats_url: String,
    /// Redis URL in use.
    pub redis_url: String,
    /// Process ids of the servers started here, by name (`nats-server`, `redis-server`).
    pub started: Vec<(&'static str, u32)>,
    _children: Vec<Child>,
    _dirs: Vec<tempdir::Dir>,
}

pub mod tempdir {
    //! Temporary folders for the servers' data. Owns only the folders it creates; it
    //! must never remove anything else.

    use std::path::{Path, PathBuf};

    /// A directory removed on drop.
    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(tag: &str) -> std::io::Result<Self> {
            let path = std::env::temp_dir().join(format!(
                "toolfleet-{tag}-{}-{}",
                std::process::id(),
                uuid::Uuid::new_v4().simple()
            ));
            std::fs::create_dir_all(&path)?;
            Ok(Self(path))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn host_port(url: &str, default_port: u16) -> Option<SocketAddr> {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    let hostport = rest.split('/').next().unwrap_or(rest);
    let with_port = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:{default_port}")
    };
    with_port.to_socket_addrs().ok()?.next()
}

async fn answers(url: &str, default_port: u16) -> bool {
    let Some(addr) = host_port(url, default_port) else {
        return false;
    };
    matches!(
        tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(addr)
        )
        .await,
        Ok(Ok(_))
    )
}

/// Waits (at most 10 s) until something listens on 127.0.0.1:`port`.
pub async fn wait_port(port: u16, what: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what} did not start listening on port {port} within 10 s")
}

impl Servers {
    /// Reuses the servers answering at `nats_url` and `redis_url`, and starts private
    /// ones on free loopback ports for those that do not answer.
    pub async fn start(nats_url: &str, redis_url: &str) -> Result<Self> {
        Self::start_with(nats_url, redis_url, true).await
    }

    /// Servers started elsewhere (a local cluster), named by their URLs; `started`
    /// lists their processes for the CPU figures. Nothing is stopped on drop.
    pub fn external(
        nats_url: String,
        redis_url: String,
        started: Vec<(&'static str, u32)>,
    ) -> Self {
        Self {
            nats_url,
            redis_url,
            started,
            _children: Vec::new(),
            _dirs: Vec::new(),
        }
    }

    /// Starts private servers on free loopback ports, whatever answers elsewhere.
    pub async fn private() -> Result<Self> {
        Self::start_with("", "", false).await
    }

    async fn start_with(nats_url: &str, redis_url: &str, reuse: bool) -> Result<Self> {
        let mut servers = Self {
            nats_url: String::new(),
            redis_url: String::new(),
            started: Vec::new(),
            _children: Vec::new(),
            _dirs: Vec::new(),
        };
        servers.nats_url = servers.reuse_or_start(&NATS, nats_url, reuse).await?;
        servers.redis_url = servers.reuse_or_start(&REDIS, redis_url, reuse).await?;
        Ok(servers)
    }

    /// `url` when `reuse` is set and a server answers there; otherwise the URL of
    /// `server`, started here on a free loopback port with a fresh data folder.
    async fn reuse_or_start(&mut self, server: &Server, url: &str, reuse: bool) -> Result<String> {
        if reuse && answers(url, server.default_port).await {
            return Ok(url.to_string());
        }
        let name = server.bin;
        let bin = server.find()?;
        let port = free_port()?;
        let dir = tempdir::Dir::new(server.dir_tag)?;
        let child = server.spawn(&bin, port, dir.path())?;
        self.started.extend(child.id().map(|pid| (name, pid)));
        self._children.push(child);
        self._dirs.push(dir);
        wait_port(port, name).await?;
        eprintln!("started {name} on 127.0.0.1:{port}");
        Ok(server.url(port))
    }
}

/// A server a local fleet starts when none answers at the URL it was given.
pub struct Server {
    /// Its executable, also the name its process goes by in `Servers::started`.
    bin: &'static str,
    /// What it serves, in messages.
    what: &'static str,
    /// The port a URL without one means.
    default_port: u16,
    /// Tag of its temporary data folder.
    dir_tag: &'static str,
    /// Its arguments before the port.
    args_before_port: &'static [&'static str],
    /// Its arguments after the port, up to the data folder's path.
    args_before_dir: &'static [&'static str],
    /// Scheme of the URL it answers at.
    scheme: &'static str,
    /// Path of that URL after the port.
    path: &'static str,
}

impl Server {
    /// Its executable on `PATH` or in the usual system folders.
    pub fn find(&self) -> Result<PathBuf> {
        find_binary(self.bin).with_context(|| {
            format!(
                "the local fleet starts its own {} when none answers",
                self.what
            )
        })
    }

    /// Starts `bin` listening on 127.0.0.1:`port` with its data in `dir`; the process
    /// is killed when the returned child is dropped.
    pub fn spawn(&self, bin: &Path, port: u16, dir: &Path) -> Result<Child> {
        Command::new(bin)
            .args(self.args_before_port)
            .arg(port.to_string())
            .args(self.args_before_dir)
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.bin))
    }

    /// The URL it answers at on 127.0.0.1:`port`.
    pub fn url(&self, port: u16) -> String {
        format!("{}://127.0.0.1:{port}{}", self.scheme, self.path)
    }
}

/// `nats-server` with JetStream, its store in the data folder.
pub const NATS: Server = Server {
    bin: "nats-server",
    what: "NATS",
    default_port: 4222,
    dir_tag: "nats",
    args_before_port: &["-js", "-a", "127.0.0.1", "-p"],
    args_before_dir: &["-sd"],
    scheme: "nats",
    path: "",
};

/// `redis-server` without persistence, working in the data folder.
pub const REDIS: Server = Server {
    bin: "redis-server",
    what: "Redis",
    default_port: 6379,
    dir_tag: "redis",
    args_before_port: &["--bind", "127.0.0.1", "--save", "", "--port"],
    args_before_dir: &["--appendonly", "no", "--dir"],
    scheme: "redis",
    path: "/",
};

/// `redis-server` with an append-only file synced every second, in the data folder: a
/// restart keeps what was written up to a second before it died.
pub const REDIS_AOF: Server = Server {
    dir_tag: "redis-aof",
    args_before_dir: &["--appendonly", "yes", "--appendfsync", "everysec", "--dir"],
    ..REDIS
};

impl LocalFleet {
    /// Starts (or reuses) the servers and runs a coordinator and a worker with `packs`,
    /// started as the `toolfleet-worker` binary starts them; returns once the catalog
    /// lists the packs' tools, or with the error of a coordinator or worker that failed
    /// before.
    pub async fn start(
        nats_url: &str,
        redis_url: &str,
        prefix: &str,
        pack_names: &[&str],
    ) -> Result<Self> {
        let ops = OpsAddrs::from_env()?;
        let servers = Servers::start(nats_url, redis_url).await?;
        let nats_url = servers.nats_url.clone();
        let redis_url = servers.redis_url.clone();
        let shutdown = CancellationToken::new();
        let coordinator = CoordinatorConfig {
            nats_url: nats_url.clone(),
            redis_url: redis_url.clone(),
            prefix: prefix.to_string(),
            http_addr: ops.coordinator,
            ..CoordinatorConfig::from_env()?
        };
        let worker = WorkerConfig {
            nats_url: nats_url.clone(),
            redis_url: redis_url.clone(),
            prefix: prefix.to_string(),
            http_addr: ops.worker,
            ..WorkerConfig::from_env()?
        };
        let settings = toolfleet_packs::PackSettings::from_env(&worker)?;
        let packs = toolfleet_packs::start_packs(pack_names, &settings).await?;
        let wanted = packs.tools.names();
        // Failures before the fleet is up end the start; later ones are printed.
        let (failed, mut failures) = mpsc::unbounded_channel::<String>();
        let mut tasks = Vec::new();
        {
            let (token, failed) = (shutdown.clone(), failed.clone());
            tasks.push(tokio::spawn(async move {
                if let Err(error) = toolfleet_coordinator::run(coordinator, token).await {
                    report_failure(&failed, format!("coordinator failed: {error}"));
                }
            }));
        }
        {
            let (token, tools) = (shutdown.clone(), packs.tools.clone());
            tasks.push(tokio::spawn(async move {
                if let Err(error) = toolfleet_worker::run_set(worker, tools, token).await {
                    report_failure(&failed, format!("worker failed: {error}"));
                }
            }));
        }
        let client = match FleetClient::connect(&nats_url, Names::new(prefix).prefix()).await {
            Ok(client) => client,
            Err(error) => {
                stop_nodes(&shutdown, tasks, packs).await;
                return Err(error).context(format!("connecting to the local fleet at {nats_url}"));
            }
        };
        let fleet = Self {
            nats_url,
            redis_url,
            ops,
            client,
            shutdown,
            tasks,
            packs,
            _servers: servers,
        };
        let started = tokio::select! {
            listed = fleet.wait_for(&wanted) => listed,
            Some(failure) = failures.recv() => {
                Err(anyhow::anyhow!("the local fleet did not start: {failure}"))
            }
        };
        if let Err(error) = started {
            fleet.stop().await;
            return Err(error);
        }
        Ok(fleet)
    }

    async fn wait_for(&self, wanted: &[String]) -> Result<()> {
        wait_for_tools(&self.client, wanted, Duration::from_secs(15)).await
    }

    /// The names of the tools the worker serves now.
    pub fn tool_names(&self) -> Vec<String> {
        self.packs.tools.names()
    }

    /// Stops the coordinator and worker gracefully, then what the packs run (MCP
    /// servers), then the servers it started.
    pub async fn stop(self) {
        stop_nodes(&self.shutdown, self.tasks, self.packs).await;
    }
}

/// Hands `failure` to a start still waiting for the fleet, or prints it.
fn report_failure(failed: &mpsc::UnboundedSender<String>, failure: String) {
    if let Err(unheard) = failed.send(failure) {
        eprintln!("{}", unheard.0);
    }
}

/// Stops the coordinator and worker of `tasks`, then the packs' servers.
async fn stop_nodes(shutdown: &CancellationToken, tasks: Vec<JoinHandle<()>>, packs: StartedPacks) {
    shutdown.cancel();
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    }
    packs.stop().await;
}

/// Waits until the catalog `client` sees lists every tool in `wanted`, at most `timeout`.
pub async fn wait_for_tools(
    client: &FleetClient,
    wanted: &[String],
    timeout: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(tools) = client
            .catalog(CatalogFormat::Native, None, Duration::from_millis(500))
            .await
        {
            let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
            if wanted.iter().all(|w| names.contains(&w.as_str())) {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("the fleet did not list {wanted:?} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A turn body for the curl line `toolfleet up --gateway` prints.
const DEMO_TURN: &str = r#"{"decision": {"type": "tool_calls", "calls": [{"toolName": "crm.listUpcomingAppointments", "arguments": {"customerId": "cust_001"}}, {"toolName": "crm.getOpenInvoices", "arguments": {"customerId": "cust_001"}}]}}"#;

/// The HTTP gateway's executable, which `toolfleet up --gateway` starts.
const GATEWAY_BIN: &str = "toolfleet-gateway";

/// How long the gateway may take to listen, and to stop after SIGTERM.
const GATEWAY_WAIT: Duration = Duration::from_secs(10);

/// The HTTP gateway serving a local fleet, with a fresh API key for tenant `demo`: the
/// `toolfleet-gateway` binary as a child process, killed if it outlives this value.
pub struct LocalGateway {
    child: Child,
}

impl LocalGateway {
    /// Migrates the key database (`TOOLFLEET_DATABASE_URL`), makes a key for tenant
    /// `demo`, and starts `toolfleet-gateway` on `addr` over `fleet`'s NATS and `prefix`;
    /// prints the page's URL and the key once the gateway listens.
    pub async fn start(fleet: &LocalFleet, prefix: &str, addr: SocketAddr) -> Result<Self> {
        let bin = gateway_binary()?;
        // Refused here, at once, when taken: the child's own refusal would come after a
        // wait, and another server's answer could pass for the gateway's.
        TcpListener::bind(addr).with_context(|| format!("binding the gateway to {addr}"))?;
        let url = toolfleet_common::config::env_string(
            "TOOLFLEET_DATABASE_URL",
            toolfleet_keys::DEFAULT_DATABASE_URL,
        );
        toolfleet_packs::db::create_database_if_missing(&url).await?;
        let mut admin = toolfleet_packs::db::connect_admin(&url)
            .await
            .with_context(|| format!("the gateway keeps API keys in PostgreSQL at {url} (set TOOLFLEET_DATABASE_URL)"))?;
        toolfleet_packs::db::migrate(&mut admin).await?;
        let key = toolfleet_keys::create(&admin, "demo", "toolfleet up").await?;
        let log_filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        // One gateway, started and stopped with this command: a secret of its own signs
        // its stream tokens (the gateway refuses to listen beyond loopback without one).
        let stream_token_secret = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let child = Command::new(&bin)
            .envs([
                ("TOOLFLEET_NATS_URL", fleet.nats_url.as_str()),
                ("TOOLFLEET_PREFIX", prefix),
                ("TOOLFLEET_DATABASE_URL", url.as_str()),
                ("TOOLFLEET_GATEWAY_ADDR", &addr.to_string()),
                (
                    "TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET",
                    &stream_token_secret,
                ),
                // The fleet's ops endpoints are the coordinator's and the worker's.
                (HTTP_ADDR_VAR, "off"),
                ("RUST_LOG", &log_filter),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut gateway = Self { child };
        gateway.wait_listening(addr).await?;
        println!("gateway: http://{addr}/ (live turn page), http://{addr}/docs (API)");
        println!("API key for tenant demo: {}", key.key);
        println!(
            "try: curl -N http://{addr}/v1/turns -H 'Authorization: Bearer {}' -H 'Accept: text/event-stream' -H 'Content-Type: application/json' -d '{}'",
            key.key, DEMO_TURN
        );
        Ok(gateway)
    }

    /// Waits until the gateway accepts connections on `addr`; an error when it exits
    /// first (an address in use, a bad setting: its own message is on stderr).
    async fn wait_listening(&mut self, addr: SocketAddr) -> Result<()> {
        let deadline = tokio::time::Instant::now() + GATEWAY_WAIT;
        while tokio::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!("the gateway exited before listening on {addr}: {status}");
            }
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("the gateway did not listen on {addr} within {GATEWAY_WAIT:?}")
    }

    /// Stops serving (SIGTERM, then a kill after 10 s); open event streams end.
    pub async fn stop(mut self) {
        terminate(&mut self.child, GATEWAY_WAIT).await;
    }
}

/// Stops `child` with SIGTERM, killing it when it has not exited within `wait`; whether
/// it exited on its own.
pub async fn terminate(child: &mut Child, wait: Duration) -> bool {
    if let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    if tokio::time::timeout(wait, child.wait()).await.is_ok() {
        return true;
    }
    let _ = child.kill().await;
    false
}

/// `toolfleet-gateway`: where `TOOLFLEET_GATEWAY_BIN` says, else beside this executable
/// (a cargo build, an install, the container image), else on `PATH` or in the system
/// folders.
fn gateway_binary() -> Result<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join(GATEWAY_BIN)))
        .filter(|path| path.is_file());
    match beside {
        Some(path) if std::env::var_os(binary_env_var(GATEWAY_BIN)).is_none() => Ok(path),
        _ => find_binary(GATEWAY_BIN).context(
            "`toolfleet up --gateway` runs the toolfleet-gateway binary: build it \
             (cargo build -p toolfleet-gateway) or install it beside toolfleet",
        ),
    }
}
