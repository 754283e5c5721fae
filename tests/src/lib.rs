//! Test harness for toolfleet's integration tests.
//!
//! The integration tests in `tests/tests/*.rs` run the coordinator and the
//! workers against real infrastructure processes. This crate provides:
//!
//! - [`NatsServer`]: a private `nats-server` with JetStream enabled, its own
//!   store directory, an 8 MiB `max_payload` and optional extra configuration,
//!   listening on a free loopback port. It can be stopped and restarted on the
//!   same port with the same store, so JetStream data survives a restart.
//! - [`RedisServer`]: a private, non-persistent `redis-server` on a free
//!   loopback port (or on a TLS port only, [`RedisServer::start_tls`]). Both are a
//!   [`Server`], which holds their shared stop/kill/restart controls.
//! - [`conformance`]: the conformance probe's settings for a fleet's tool, and its
//!   clean report.
//! - [`fleet::Fleet`]: a whole fleet on those servers, with the shared helpers
//!   of the integration tests (run a turn with these calls, wait for a call's
//!   state, a catalog or a counter, read a turn to its `final`).
//! - [`eventually`] and [`eventually_named`]: bounded polling helpers for
//!   asserting on state that converges asynchronously.
//! - [`secured::SecuredServers`]: servers configured from `deploy/` (per-role NATS
//!   users, Redis ACL users) and a per-role connection that sees permission errors.
//! - [`tls::TlsServers`]: NATS and Redis that take only TLS clients, with a CA and
//!   certificates made by `openssl` ([`tls::TestCertificates`]), and fleet processes
//!   pointed at them by the TLS variables.
//! - [`gateway::GatewayNode`]: the HTTP gateway as a child process (`gateway-node`) on
//!   a free port, with API keys made in a [`pg::TestDatabase`], and the SSE reader.
//! - [`pg::TestDatabase`]: a private PostgreSQL database, migrated and seeded,
//!   dropped on `Drop`.
//! - [`python::venv`]: a virtual environment with a requirements file installed,
//!   made once per file content, so tests with Python clients need only `python3`.
//! - [`redis_memory`] and [`cap_redis_memory`]: what Redis holds, and a `maxmemory`
//!   for tests that fill it.
//! - [`init_test_tracing`]: an idempotent `tracing` subscriber for tests.
//! - [`child_command`]: a child process that shares the test's stderr and dies with
//!   its handle.
//! - [`free_port`] and [`find_binary`] (from `toolfleet-testkit`), [`repo_path`],
//!   [`read_repo_file`] and [`read_repo_json`]: a free loopback port, a server's
//!   executable and the repository's own files.
//!
//! Every server lives in its own temporary directory that also holds its log
//! file (server output never goes to the test's stdout/stderr). Startup waits
//! are bounded by [`READY_TIMEOUT`]; a failed startup reports the tail of the
//! server log. Dropping a server kills its process and removes its directory.
//! If the dropping thread is panicking (a failed test), the log tail is printed
//! to stderr so it shows up in the test's captured output.

pub mod conformance;
pub mod dashboard;
pub mod fleet;
pub mod gateway;
pub mod ops;
pub mod otlp;
pub mod pg;
pub mod poison;
pub mod python;
pub mod secured;
pub mod tls;
pub use ops::{http_get, metric_value, wait_http_status};
pub use toolfleet_testkit::{find_binary, free_port};

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::future::Future;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// Upper bound on how long a server start or restart waits for the server to
/// accept connections before giving up with an error.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// The `max_payload` configured on every [`NatsServer`], in bytes (8 MiB).
pub const NATS_MAX_PAYLOAD: usize = 8 * 1024 * 1024;

/// How long a graceful stop (SIGTERM) may take before the process is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// How long to wait for a killed process to be reaped.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How long `Drop` blocks waiting for a killed process to exit.
const DROP_WAIT: Duration = Duration::from_secs(2);

/// How many fresh ports a start tries before giving up.
const START_ATTEMPTS: usize = 3;

/// How many times a restart tries to bind its (fixed) port again.
const RESTART_ATTEMPTS: usize = 3;

/// Poll interval of the readiness loops and of [`eventually`].
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Timeout of a single readiness probe connection.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Number of log lines included in error messages.
const LOG_TAIL_LINES: usize = 40;

/// Maximum number of bytes read from the end of a log for its tail.
const LOG_TAIL_BYTES: u64 = 16 * 1024;

/// Log line printed by `nats-server` once it accepts clients.
const NATS_READY_MARKER: &str = "Server is ready";

/// Log line printed by `redis-server` once it accepts clients.
const REDIS_READY_MARKER: &str = "Ready to accept connections";

/// Returns the last [`LOG_TAIL_LINES`] lines of the file at `path`.
fn log_tail(path: &Path) -> String {
    let read = || -> std::io::Result<String> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        let start = len.saturating_sub(LOG_TAIL_BYTES);
        file.seek(SeekFrom::Start(start))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(LOG_TAIL_LINES);
            lines[from..].join("\n")
        }
        Err(err) => format!("<could not read {}: {err}>", path.display()),
    }
}

/// Returns the current length of the file at `path` (0 if it is missing).
fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Whether the file at `path` contains `marker` after byte `offset`.
fn log_contains_after(path: &Path, offset: u64, marker: &str) -> bool {
    let read = || -> std::io::Result<bool> {
        let mut file = std::fs::File::open(path)?;
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).contains(marker))
    };
    read().unwrap_or(false)
}

/// How a server is checked for readiness over TCP.
#[derive(Debug, Clone, Copy)]
enum Probe {
    /// A NATS server greets every client with an `INFO {...}` line.
    Nats,
    /// A Redis server answers an inline `PING` with `+PONG`.
    Redis,
    /// A Redis server on a TLS port only accepts the connection (a plain `PING` gets no
    /// answer there); its log line says the rest.
    RedisTls,
}

impl Probe {
    /// The log line the server prints once it accepts clients.
    fn ready_marker(self) -> &'static str {
        match self {
            Probe::Nats => NATS_READY_MARKER,
            Probe::Redis | Probe::RedisTls => REDIS_READY_MARKER,
        }
    }

    /// Connects to `port` once and checks the server's protocol greeting.
    async fn check(self, port: u16) -> bool {
        let attempt = async {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
            if let Probe::RedisTls = self {
                return Some(true);
            }
            if let Probe::Redis = self {
                stream.write_all(b"PING\r\n").await.ok()?;
            }
            let mut buf = Vec::with_capacity(512);
            let mut chunk = [0u8; 512];
            while !buf.windows(2).any(|w| w == b"\r\n") && buf.len() < 64 * 1024 {
                let n = stream.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            Some(match self {
                Probe::Nats => buf.starts_with(b"INFO "),
                Probe::Redis => buf.starts_with(b"+PONG"),
                Probe::RedisTls => true,
            })
        };
        matches!(
            tokio::time::timeout(PROBE_TIMEOUT, attempt).await,
            Ok(Some(true))
        )
    }
}

/// A server child process with its log file.
struct ServerProcess {
    /// Human-readable program name used in errors.
    name: &'static str,
    /// Executable to run.
    binary: PathBuf,
    /// File receiving the child's stdout and stderr (appended across restarts).
    log_path: PathBuf,
    /// Readiness check.
    probe: Probe,
    /// The running child, if any.
    child: Option<Child>,
}

impl ServerProcess {
    /// Spawns the server with `args` and waits until it serves `port`.
    ///
    /// Readiness requires the child to be alive, to have logged its ready
    /// line since this spawn, and to answer the protocol probe on `port`.
    async fn spawn_ready(&mut self, args: &[OsString], port: u16) -> Result<()> {
        self.stop().await;
        let log_offset = file_len(&self.log_path);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .with_context(|| format!("opening log file {}", self.log_path.display()))?;
        let log_err = log.try_clone().context("cloning log file handle")?;
        let mut child = Command::new(&self.binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawning {}", self.binary.display()))?;

        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    bail!(
                        "{} exited ({status}) before accepting connections on port {port}; log tail:\n{}",
                        self.name,
                        log_tail(&self.log_path)
                    );
                }
                Ok(None) => {}
                Err(err) => {
                    kill_and_reap(&mut child).await;
                    return Err(anyhow!(err).context(format!("polling {} process", self.name)));
                }
            }
            if log_contains_after(&self.log_path, log_offset, self.probe.ready_marker())
                && self.probe.check(port).await
            {
                if let Ok(None) = child.try_wait() {
                    self.child = Some(child);
                    return Ok(());
                }
                continue;
            }
            if Instant::now() >= deadline {
                kill_and_reap(&mut child).await;
                bail!(
                    "{} did not accept connections on port {port} within {READY_TIMEOUT:?}; log tail:\n{}",
                    self.name,
                    log_tail(&self.log_path)
                );
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Stops the child gracefully (SIGTERM), killing it if it lingers.
    async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let terminated = child
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .map(|pid| {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                )
                .is_ok()
            })
            .unwrap_or(false);
        if terminated && tokio::time::timeout(STOP_GRACE, child.wait()).await.is_ok() {
            return;
        }
        kill_and_reap(&mut child).await;
    }

    /// Kills the child with SIGKILL without a graceful shutdown.
    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_and_reap(&mut child).await;
        }
    }

    /// Whether a child is running.
    fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(Ok(Some(_)) | Err(_)) => {
                self.child = None;
                false
            }
            None => false,
        }
    }

    /// OS process id of the running child.
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- {} log tail ({}) ----\n{}\n---- end of {} log ----",
                self.name,
                self.log_path.display(),
                log_tail(&self.log_path),
                self.name
            );
        }
        let Some(mut child) = self.child.take() else {
            return;
        };
        // Failure means the process has already exited.
        let _ = child.start_kill();
        let deadline = std::time::Instant::now() + DROP_WAIT;
        while std::time::Instant::now() < deadline {
            match child.try_wait() {
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Ok(Some(_)) | Err(_) => break,
            }
        }
    }
}

/// Sends SIGKILL to `child` and waits (bounded) for it to be reaped.
async fn kill_and_reap(child: &mut Child) {
    // Failure means the process has already exited.
    let _ = child.start_kill();
    let _ = tokio::time::timeout(KILL_WAIT, child.wait()).await;
}

/// A private server process for one test, in its own temporary directory.
///
/// The server listens on `127.0.0.1` on a free port that it keeps across
/// restarts. `K` is what kind of server it is: [`NatsServer`] and
/// [`RedisServer`] add their own constructors and client helpers.
///
/// Dropping the value kills the server and deletes its directory.
pub struct Server<K> {
    /// The server process; declared before `dir` so it dies first.
    process: ServerProcess,
    /// Arguments of the current configuration (port included).
    args: Vec<OsString>,
    /// Port the server listens on.
    port: u16,
    /// What the kind of server keeps (paths of its configuration, ...).
    kind: K,
    /// Temporary directory holding configuration, data and log.
    dir: tempfile::TempDir,
}

impl<K> std::fmt::Debug for Server<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(self.process.name)
            .field("port", &self.port)
            .field("dir", &self.dir.path())
            .field("pid", &self.process.pid())
            .finish()
    }
}

impl<K> Server<K> {
    /// Starts `name` from `binary` in `dir` on a free port, trying up to
    /// [`START_ATTEMPTS`] ports, each waited for at most [`READY_TIMEOUT`].
    /// `args_for` gives the command line for a port.
    async fn launch(
        name: &'static str,
        binary: PathBuf,
        probe: Probe,
        dir: tempfile::TempDir,
        kind: K,
        args_for: impl Fn(&K, &Path, u16) -> Vec<OsString>,
    ) -> Result<Self> {
        let mut server = Server {
            process: ServerProcess {
                name,
                binary,
                log_path: dir.path().join(format!("{name}.log")),
                probe,
                child: None,
            },
            args: Vec::new(),
            port: 0,
            kind,
            dir,
        };
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            server.port = free_port()?;
            server.args = args_for(&server.kind, server.dir.path(), server.port);
            match server.process.spawn_ready(&server.args, server.port).await {
                Ok(()) => return Ok(server),
                Err(err) => last_error = Some(err),
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow!("no start attempt was made"))
            .context(format!("starting {name} ({START_ATTEMPTS} attempts)")))
    }

    /// TCP port the server listens on (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Path of the file receiving the server's output.
    pub fn log_path(&self) -> &Path {
        &self.process.log_path
    }

    /// The last lines of the server's log, for diagnostics.
    pub fn log_tail(&self) -> String {
        log_tail(&self.process.log_path)
    }

    /// OS process id of the running server, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// Stops the server: SIGTERM (so NATS flushes its JetStream store), then
    /// SIGKILL if it has not exited within a few seconds; waits for the exit.
    /// Does nothing if the server is not running.
    pub async fn stop(&mut self) {
        self.process.stop().await;
    }

    /// Kills the server abruptly (SIGKILL, no shutdown) and waits for it,
    /// simulating a crash. Does nothing if the server is not running.
    pub async fn kill(&mut self) {
        self.process.kill().await;
    }

    /// Stops the server if it runs and starts it again on the same port with
    /// the same configuration, and waits until it accepts clients. NATS keeps
    /// its JetStream store (streams and their messages survive); Redis starts
    /// with an empty dataset (persistence is disabled).
    pub async fn restart(&mut self) -> Result<()> {
        self.process.stop().await;
        let mut last_error = None;
        for _ in 0..RESTART_ATTEMPTS {
            match self.process.spawn_ready(&self.args, self.port).await {
                Ok(()) => return Ok(()),
                Err(err) => last_error = Some(err),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last_error
            .unwrap_or_else(|| anyhow!("no restart attempt was made"))
            .context(format!(
                "restarting {} on port {}",
                self.process.name, self.port
            )))
    }
}

/// What a [`NatsServer`] keeps: its generated configuration and store.
#[derive(Debug)]
pub struct Nats {
    /// JetStream store directory (inside the server's directory).
    store_dir: PathBuf,
    /// Generated configuration file (inside the server's directory).
    config_path: PathBuf,
}

/// A private `nats-server` with JetStream, for one test.
///
/// The server stores JetStream data in its own temporary directory and
/// allows payloads of up to [`NATS_MAX_PAYLOAD`] bytes. The binary is taken
/// from `$NATS_SERVER_BIN`, else `nats-server` on `PATH`, else
/// `/usr/sbin/nats-server`.
pub type NatsServer = Server<Nats>;

impl Server<Nats> {
    /// Starts a JetStream-enabled server on a free port and waits (at most
    /// [`READY_TIMEOUT`] per attempt) until it accepts clients.
    pub async fn start() -> Result<Self> {
        Self::start_with_config("").await
    }

    /// Like [`NatsServer::start`], appending `extra_conf` verbatim to the
    /// generated configuration file (for accounts, users, limits, ...).
    ///
    /// Port, listen address and JetStream store directory are given on the
    /// command line and therefore override any value in `extra_conf`.
    pub async fn start_with_config(extra_conf: &str) -> Result<Self> {
        let binary = find_binary("nats-server")?;
        let dir = tempfile::Builder::new()
            .prefix("toolfleet-nats-")
            .tempdir()
            .context("creating temporary directory for nats-server")?;
        let store_dir = dir.path().join("jetstream");
        std::fs::create_dir_all(&store_dir)
            .with_context(|| format!("creating {}", store_dir.display()))?;
        let config_path = dir.path().join("nats-server.conf");
        let config = format!("max_payload: 8MB\njetstream: enabled\n\n{extra_conf}\n");
        std::fs::write(&config_path, config)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let kind = Nats {
            store_dir,
            config_path,
        };
        Self::launch(
            "nats-server",
            binary,
            Probe::Nats,
            dir,
            kind,
            |kind, _, port| {
                vec![
                    "-c".into(),
                    kind.config_path.clone().into_os_string(),
                    "-a".into(),
                    "127.0.0.1".into(),
                    "-p".into(),
                    port.to_string().into(),
                    "-js".into(),
                    "-sd".into(),
                    kind.store_dir.clone().into_os_string(),
                ]
            },
        )
        .await
    }

    /// Client URL of the server, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// JetStream store directory (kept across restarts).
    pub fn store_dir(&self) -> &Path {
        &self.kind.store_dir
    }

    /// Path of the generated configuration file.
    pub fn config_path(&self) -> &Path {
        &self.kind.config_path
    }

    /// Connects a plain client (no credentials) with a bounded connect timeout.
    pub async fn connect(&self) -> Result<async_nats::Client> {
        let url = self.url();
        let connect = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(url.as_str());
        tokio::time::timeout(READY_TIMEOUT, connect)
            .await
            .map_err(|_| anyhow!("connecting to {url} timed out"))?
            .with_context(|| format!("connecting to {url}"))
    }
}

/// What a [`RedisServer`] keeps: its TLS files when it takes only TLS clients.
#[derive(Debug)]
pub struct Redis {
    /// Certificate, key and CA of the TLS port; `None` for a plain server.
    tls: Option<RedisTlsFiles>,
}

/// The files of a [`RedisServer`] that takes only TLS clients.
#[derive(Debug, Clone)]
pub struct RedisTlsFiles {
    /// The server's certificate (PEM).
    pub cert_file: PathBuf,
    /// Its key (PEM).
    pub key_file: PathBuf,
    /// The CA that signs client certificates (PEM).
    pub ca_file: PathBuf,
    /// Whether a client must show a certificate signed by that CA
    /// (`--tls-auth-clients yes`).
    pub verify_clients: bool,
}

/// A private, non-persistent `redis-server` for one test.
///
/// Persistence is disabled (`--save "" --appendonly no`), so a restart starts
/// with an empty dataset. The binary is taken from `$REDIS_SERVER_BIN`, else
/// `redis-server` on `PATH`, else `/usr/bin/redis-server`.
pub type RedisServer = Server<Redis>;

impl Server<Redis> {
    /// Starts a server on a free port and waits (at most [`READY_TIMEOUT`] per
    /// attempt) until it answers `PING`.
    pub async fn start() -> Result<Self> {
        Self::start_with(Redis { tls: None }).await
    }

    /// Starts a server that listens only on a TLS port (`--port 0 --tls-port N`) with
    /// `tls`'s certificate, and waits (at most [`READY_TIMEOUT`] per attempt) until it
    /// accepts connections. [`RedisServer::url`] is then `rediss://`.
    pub async fn start_tls(tls: RedisTlsFiles) -> Result<Self> {
        Self::start_with(Redis { tls: Some(tls) }).await
    }

    async fn start_with(kind: Redis) -> Result<Self> {
        let binary = find_binary("redis-server")?;
        let dir = tempfile::Builder::new()
            .prefix("toolfleet-redis-")
            .tempdir()
            .context("creating temporary directory for redis-server")?;
        let probe = match kind.tls {
            Some(_) => Probe::RedisTls,
            None => Probe::Redis,
        };
        Self::launch(
            "redis-server",
            binary,
            probe,
            dir,
            kind,
            |kind, dir, port| {
                let mut args: Vec<OsString> = vec![
                    "--bind".into(),
                    "127.0.0.1".into(),
                    "--save".into(),
                    "".into(),
                    "--appendonly".into(),
                    "no".into(),
                    "--daemonize".into(),
                    "no".into(),
                    "--dir".into(),
                    dir.as_os_str().to_os_string(),
                ];
                match &kind.tls {
                    None => args.extend(["--port".into(), port.to_string().into()]),
                    Some(tls) => args.extend([
                        "--port".into(),
                        "0".into(),
                        "--tls-port".into(),
                        port.to_string().into(),
                        "--tls-cert-file".into(),
                        tls.cert_file.clone().into_os_string(),
                        "--tls-key-file".into(),
                        tls.key_file.clone().into_os_string(),
                        "--tls-ca-cert-file".into(),
                        tls.ca_file.clone().into_os_string(),
                        "--tls-auth-clients".into(),
                        if tls.verify_clients { "yes" } else { "no" }.into(),
                    ]),
                }
                args
            },
        )
        .await
    }

    /// Client URL of the server, `redis://127.0.0.1:PORT/` (`rediss://` for a server
    /// started with [`RedisServer::start_tls`]).
    pub fn url(&self) -> String {
        let scheme = if self.kind.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// A `redis` client for [`RedisServer::url`] (connects lazily).
    pub fn client(&self) -> Result<redis::Client> {
        redis::Client::open(self.url()).context("creating redis client")
    }
}

/// `used_memory` and `maxmemory` of the Redis behind `admin` (from `INFO memory`).
pub async fn redis_memory(admin: &mut redis::aio::MultiplexedConnection) -> Result<(u64, u64)> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(admin).await?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Ok((
        field("used_memory").context("used_memory")?,
        field("maxmemory").context("maxmemory")?,
    ))
}

/// Gives the Redis behind `admin` a `maxmemory` of `max` bytes with `noeviction`, as
/// deploy/ runs it: a write past the limit is refused and nothing is evicted.
pub async fn cap_redis_memory(
    admin: &mut redis::aio::MultiplexedConnection,
    max: u64,
) -> Result<()> {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(max)
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(admin)
        .await?;
    Ok(())
}

/// Polls `f` every 20 ms until it yields `Some`, for at most `timeout`.
///
/// Each call of `f` is itself bounded by the remaining time. Returns the value
/// of the first `Some`, or an error once `timeout` has elapsed.
pub async fn eventually<F, Fut, T>(timeout: Duration, f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_named("condition", timeout, f).await
}

/// Like [`eventually`], naming what is awaited (`what`) in the timeout error.
pub async fn eventually_named<F, Fut, T>(what: &str, timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    let deadline = started + timeout;
    let mut attempts: u64 = 0;
    loop {
        attempts += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(remaining, f()).await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(_) => break,
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        tokio::time::sleep(POLL_INTERVAL.min(remaining)).await;
    }
    bail!(
        "timed out after {:?} waiting for {what} ({attempts} attempts)",
        started.elapsed()
    )
}

/// Installs a `tracing` subscriber for tests: formatted output through the
/// test writer (captured per test), filtered by `RUST_LOG` (default `warn`).
///
/// Safe to call from every test: only the first call installs anything.
pub fn init_test_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Fails only if a global subscriber is already installed.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// [`toolfleet_testkit::child_command`] as a tokio command that is killed when its
/// handle (or the future waiting on its output) drops, so no child outlives its test.
pub fn child_command(program: impl AsRef<std::ffi::OsStr>, stdout: Stdio) -> Command {
    let mut command = Command::from(toolfleet_testkit::child_command(program, stdout));
    command.kill_on_drop(true);
    command
}

/// Runs `command` to its end (killed when it takes longer than `wait`); its output where
/// it exits successfully, else an error naming `what` with its exit status and stderr.
pub async fn output_of(
    command: &mut Command,
    wait: Duration,
    what: &str,
) -> Result<std::process::Output> {
    let out = tokio::time::timeout(wait, command.kill_on_drop(true).output())
        .await
        .with_context(|| format!("{what} timed out"))?
        .with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// The string at the JSON `pointer` of each element of the array `list` (the element
/// itself for the empty pointer), skipping elements without one; an error naming `what`
/// where `list` is no array.
pub fn strings_at<'a>(
    list: &'a serde_json::Value,
    pointer: &str,
    what: &str,
) -> Result<Vec<&'a str>> {
    Ok(list
        .as_array()
        .with_context(|| format!("{what}: not an array"))?
        .iter()
        .filter_map(|element| element.pointer(pointer).and_then(serde_json::Value::as_str))
        .collect())
}

/// The path of `relative` in the repository (the workspace root).
pub fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative)
}

/// The text of the repository file `relative`.
pub fn read_repo_file(relative: &str) -> Result<String> {
    let path = repo_path(relative);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// The repository file `relative`, parsed as JSON.
pub fn read_repo_json(relative: &str) -> Result<serde_json::Value> {
    serde_json::from_str(&read_repo_file(relative)?).with_context(|| format!("parsing {relative}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bound for whole test bodies.
    const TEST_TIMEOUT: Duration = Duration::from_secs(60);

    /// Runs `fut` bounded by [`TEST_TIMEOUT`], with the test's tracing on.
    async fn bounded<T>(fut: impl Future<Output = Result<T>>) -> Result<T> {
        init_test_tracing();
        tokio::time::timeout(TEST_TIMEOUT, fut)
            .await
            .map_err(|_| anyhow!("test timed out after {TEST_TIMEOUT:?}"))?
    }

    /// Whether a TCP connection to `port` on loopback is refused (bounded).
    async fn connect_fails(port: u16) -> bool {
        matches!(
            tokio::time::timeout(
                Duration::from_millis(500),
                TcpStream::connect(("127.0.0.1", port))
            )
            .await,
            Ok(Err(_))
        )
    }

    /// Creates the stream `name` on `subjects` in `js`.
    async fn create_stream(
        js: &async_nats::jetstream::Context,
        name: &str,
        subjects: &str,
    ) -> Result<async_nats::jetstream::stream::Stream> {
        Ok(js
            .create_stream(async_nats::jetstream::stream::Config {
                name: name.to_string(),
                subjects: vec![subjects.to_string()],
                ..Default::default()
            })
            .await?)
    }

    /// How many messages the stream `DURABLE` of `nats` holds.
    async fn durable_messages(nats: &NatsServer) -> Result<u64> {
        let js = async_nats::jetstream::new(nats.connect().await?);
        let mut stream = js.get_stream("DURABLE").await?;
        Ok(stream.info().await?.state.messages)
    }

    /// What the server of `client` answers to `PING`.
    async fn ping(client: &redis::Client) -> Result<String> {
        let mut con = client.get_multiplexed_async_connection().await?;
        Ok(redis::cmd("PING").query_async(&mut con).await?)
    }

    /// Drops `server` and waits (bounded) until its port refuses connections.
    async fn drop_and_wait_closed<K>(server: Server<K>) -> Result<()> {
        let port = server.port();
        let what = format!("{} port to refuse connections", server.process.name);
        drop(server);
        eventually_named(&what, Duration::from_secs(5), || async {
            connect_fails(port).await.then_some(())
        })
        .await
    }

    #[tokio::test]
    async fn nats_server_accepts_jetstream_stream() -> Result<()> {
        bounded(async {
            let nats = NatsServer::start().await?;
            assert_eq!(nats.url(), format!("nats://127.0.0.1:{}", nats.port()));
            assert!(nats.store_dir().is_dir());
            assert!(nats.config_path().is_file());
            let client = nats.connect().await?;
            assert_eq!(client.server_info().max_payload, NATS_MAX_PAYLOAD);
            assert!(client.server_info().jetstream);

            let js = async_nats::jetstream::new(client);
            let stream = create_stream(&js, "HARNESS", "harness.>").await?;
            assert_eq!(stream.cached_info().config.name, "HARNESS");
            let ack = js.publish("harness.one", "hello".into()).await?.await?;
            assert_eq!(ack.stream, "HARNESS");

            let big = vec![b'x'; 6 * 1024 * 1024];
            let ack = js.publish("harness.big", big.into()).await?.await?;
            assert_eq!(ack.sequence, 2);
            Ok(())
        })
        .await
    }

    #[tokio::test]
    async fn nats_restart_keeps_stream_and_port() -> Result<()> {
        bounded(async {
            let mut nats = NatsServer::start().await?;
            let port = nats.port();
            {
                let js = async_nats::jetstream::new(nats.connect().await?);
                create_stream(&js, "DURABLE", "durable.>").await?;
                js.publish("durable.a", "kept".into()).await?.await?;
            }

            nats.stop().await;
            assert!(!nats.is_running());
            assert!(connect_fails(port).await, "port still accepts after stop");

            nats.restart().await?;
            assert_eq!(nats.port(), port);
            assert!(nats.is_running());
            assert_eq!(durable_messages(&nats).await?, 1);

            nats.kill().await;
            nats.restart().await?;
            assert_eq!(durable_messages(&nats).await?, 1);
            Ok(())
        })
        .await
    }

    #[tokio::test]
    async fn nats_extra_config_is_applied() -> Result<()> {
        bounded(async {
            let nats =
                NatsServer::start_with_config("authorization {\n  token: \"s3cret\"\n}\n").await?;
            assert!(nats.connect().await.is_err(), "connected without token");
            let client = async_nats::ConnectOptions::with_token("s3cret".to_string())
                .connection_timeout(Duration::from_secs(5))
                .connect(nats.url())
                .await?;
            assert_eq!(client.server_info().max_payload, NATS_MAX_PAYLOAD);
            Ok(())
        })
        .await
    }

    #[tokio::test]
    async fn nats_start_with_bad_config_reports_log() -> Result<()> {
        bounded(async {
            match NatsServer::start_with_config("this is { not valid").await {
                Ok(_) => bail!("start with an invalid config succeeded"),
                Err(err) => {
                    let message = format!("{err:#}");
                    assert!(message.contains("log tail"), "{message}");
                    Ok(())
                }
            }
        })
        .await
    }

    #[tokio::test]
    async fn nats_process_gone_after_drop() -> Result<()> {
        bounded(async {
            let nats = NatsServer::start().await?;
            let dir = nats.store_dir().to_path_buf();
            drop_and_wait_closed(nats).await?;
            assert!(!dir.exists(), "temp dir not removed");
            Ok(())
        })
        .await
    }

    #[tokio::test]
    async fn redis_server_answers_ping_and_restarts() -> Result<()> {
        bounded(async {
            let mut redis_server = RedisServer::start().await?;
            let port = redis_server.port();
            assert_eq!(redis_server.url(), format!("redis://127.0.0.1:{port}/"));
            let client = redis_server.client()?;
            assert_eq!(ping(&client).await?, "PONG");

            redis_server.restart().await?;
            assert_eq!(redis_server.port(), port);
            assert_eq!(ping(&client).await?, "PONG");
            Ok(())
        })
        .await
    }

    #[tokio::test]
    async fn redis_process_gone_after_drop() -> Result<()> {
        bounded(async { drop_and_wait_closed(RedisServer::start().await?).await }).await
    }

    #[tokio::test]
    async fn eventually_returns_value_or_times_out() -> Result<()> {
        let mut calls = 0;
        let value = eventually(Duration::from_secs(5), || {
            calls += 1;
            let done = calls >= 3;
            async move { done.then_some(calls) }
        })
        .await?;
        assert_eq!(value, 3);

        let started = std::time::Instant::now();
        let err = match eventually_named("the impossible", Duration::from_millis(100), || async {
            None::<()>
        })
        .await
        {
            Ok(()) => bail!("eventually succeeded on a None-only closure"),
            Err(err) => err,
        };
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(err.to_string().contains("the impossible"), "{err}");

        let err = eventually(Duration::from_millis(100), || async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Some(())
        })
        .await;
        assert!(err.is_err());
        Ok(())
    }
}
