//! A local fleet: NATS and Redis at the given URLs, or `nats-server` / `redis-server`
//! started on free loopback ports when nothing answers; a coordinator and a worker
//! in-process.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use toolfleet_common::{CatalogFormat, FleetClient, Names};
use toolfleet_coordinator::CoordinatorConfig;
use toolfleet_worker::{packs, WorkerConfig};

/// A running local fleet; dropping it stops the servers it started.
pub struct LocalFleet {
    /// NATS URL in use.
    pub nats_url: String,
    /// Redis URL in use.
    pub redis_url: String,
    /// Client for the fleet.
    pub client: FleetClient,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    _servers: Servers,
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

mod tempdir {
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

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

async fn wait_port(port: u16, what: &str) -> Result<()> {
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

    /// Starts private servers on free loopback ports, whatever answers elsewhere.
    pub async fn private() -> Result<Self> {
        Self::start_with("", "", false).await
    }

    async fn start_with(nats_url: &str, redis_url: &str, reuse: bool) -> Result<Self> {
        let mut servers = Vec::new();
        let mut started = Vec::new();
        let mut dirs = Vec::new();
        let nats_url = if reuse && answers(nats_url, 4222).await {
            nats_url.to_string()
        } else {
            let bin = find_binary("nats-server")
                .context("no NATS answers and nats-server is not installed")?;
            let port = free_port()?;
            let dir = tempdir::Dir::new("nats")?;
            let child = Command::new(bin)
                .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .context("starting nats-server")?;
            started.extend(child.id().map(|pid| ("nats-server", pid)));
            servers.push(child);
            dirs.push(dir);
            wait_port(port, "nats-server").await?;
            eprintln!("started nats-server on 127.0.0.1:{port}");
            format!("nats://127.0.0.1:{port}")
        };
        let redis_url = if reuse && answers(redis_url, 6379).await {
            redis_url.to_string()
        } else {
            let bin = find_binary("redis-server")
                .context("no Redis answers and redis-server is not installed")?;
            let port = free_port()?;
            let dir = tempdir::Dir::new("redis")?;
            let child = Command::new(bin)
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                ])
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .context("starting redis-server")?;
            started.extend(child.id().map(|pid| ("redis-server", pid)));
            servers.push(child);
            dirs.push(dir);
            wait_port(port, "redis-server").await?;
            eprintln!("started redis-server on 127.0.0.1:{port}");
            format!("redis://127.0.0.1:{port}/")
        };
        Ok(Self {
            nats_url,
            redis_url,
            started,
            _children: servers,
            _dirs: dirs,
        })
    }
}

impl LocalFleet {
    /// Starts (or reuses) the servers and runs a coordinator and a worker with `packs`.
    pub async fn start(
        nats_url: &str,
        redis_url: &str,
        prefix: &str,
        pack_names: &[&str],
    ) -> Result<Self> {
        let servers = Servers::start(nats_url, redis_url).await?;
        let nats_url = servers.nats_url.clone();
        let redis_url = servers.redis_url.clone();
        let shutdown = CancellationToken::new();
        let coordinator = CoordinatorConfig {
            nats_url: nats_url.clone(),
            redis_url: redis_url.clone(),
            prefix: prefix.to_string(),
            ..CoordinatorConfig::from_env()?
        };
        let worker = WorkerConfig {
            nats_url: nats_url.clone(),
            redis_url: redis_url.clone(),
            prefix: prefix.to_string(),
            ..WorkerConfig::from_env()?
        };
        let tools = packs::tools_with(pack_names, &packs::PackSettings::from_env(&worker)?)?;
        let wanted: Vec<String> = tools.iter().map(|t| t.definition().name.clone()).collect();
        let mut tasks = Vec::new();
        {
            let token = shutdown.clone();
            tasks.push(tokio::spawn(async move {
                if let Err(error) = toolfleet_coordinator::run(coordinator, token).await {
                    eprintln!("coordinator failed: {error}");
                }
            }));
        }
        {
            let token = shutdown.clone();
            tasks.push(tokio::spawn(async move {
                if let Err(error) = toolfleet_worker::run(worker, tools, token).await {
                    eprintln!("worker failed: {error}");
                }
            }));
        }
        let client = FleetClient::connect(&nats_url, Names::new(prefix).prefix()).await?;
        let fleet = Self {
            nats_url,
            redis_url,
            client,
            shutdown,
            tasks,
            _servers: servers,
        };
        fleet.wait_for(&wanted).await?;
        Ok(fleet)
    }

    async fn wait_for(&self, wanted: &[String]) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(tools) = self
                .client
                .catalog(CatalogFormat::Native, None, Duration::from_millis(500))
                .await
            {
                let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
                if wanted.iter().all(|w| names.contains(&w.as_str())) {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("the local fleet did not list its tools within 15 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the coordinator and worker gracefully, then the servers it started.
    pub async fn stop(self) {
        self.shutdown.cancel();
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
        }
    }
}
