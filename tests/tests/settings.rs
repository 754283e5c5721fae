//! Settings that would break the fleet quietly are refused at start-up: a coordinator
//! or worker process given zero or a huge value exits with an error that names the
//! variable, the value and the allowed range, before it connects to anything. And the
//! shipped server binaries read no settings from their arguments: `--help` and
//! `--version` answer and exit, anything else is refused, all before they connect.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::process::Command;
use toolfleet_tests::fleet::{checkout_cli, fleet_node_path};
use toolfleet_tests::{free_port, http_get, NatsServer, RedisServer};

/// Runs `fleet-node role` with `name=value` against servers that do not exist; its exit
/// status and standard error.
async fn start_with(role: &str, name: &str, value: &str) -> Result<(bool, String)> {
    let child = Command::new(fleet_node_path()?)
        .arg(role)
        .env("TOOLFLEET_NATS_URL", "nats://127.0.0.1:1")
        .env("TOOLFLEET_REDIS_URL", "redis://127.0.0.1:1/")
        .env("TOOLFLEET_HTTP_ADDR", "off")
        .env(name, value)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .with_context(|| format!("{role} with {name}={value} did not exit"))??;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_and_huge_settings_are_refused_naming_the_variable() -> Result<()> {
    let huge = u64::MAX.to_string();
    let cases = [
        ("coordinator", "TOOLFLEET_MAX_CALLS", "0", "1 to 1024"),
        (
            "coordinator",
            "TOOLFLEET_DEFAULT_DEADLINE_MS",
            "0",
            "100 to 300000",
        ),
        (
            "coordinator",
            "TOOLFLEET_SWEEP_INTERVAL_MS",
            "0",
            "50 to 10000",
        ),
        (
            "coordinator",
            "TOOLFLEET_REGISTRY_REFRESH_MS",
            "0",
            "100 to 60000",
        ),
        (
            "coordinator",
            "TOOLFLEET_RESULT_CONCURRENCY",
            &huge,
            "1 to 4096",
        ),
        (
            "coordinator",
            "TOOLFLEET_INTAKE_CONCURRENCY",
            "0",
            "1 to 4096",
        ),
        (
            "coordinator",
            "TOOLFLEET_MAX_DEADLINE_MS",
            &huge,
            "100 to 300000",
        ),
        ("worker", "TOOLFLEET_HEARTBEAT_MS", "0", "100 to 60000"),
        (
            "worker",
            "TOOLFLEET_WORKER_CONCURRENCY",
            &huge,
            "1 to 65536",
        ),
        ("worker", "TOOLFLEET_ACK_WAIT_MS", "0", "500 to 600000"),
        ("worker", "TOOLFLEET_RUNNING_AFTER_MS", &huge, "0 to 60000"),
        (
            "coordinator",
            "TOOLFLEET_STREAM_STORAGE",
            "disk",
            "file or memory",
        ),
        (
            "worker",
            "TOOLFLEET_STREAM_STORAGE",
            "disk",
            "file or memory",
        ),
    ];
    for (role, name, value, range) in cases {
        let (ok, stderr) = start_with(role, name, value).await?;
        assert!(!ok, "{role} started with {name}={value}");
        let line = stderr
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_default();
        assert!(
            line.contains(&format!("{value:?}")) && line.contains(range),
            "{role} {name}={value}: {stderr}"
        );
    }
    Ok(())
}

/// A prefix that is not one NATS subject token is refused at start, naming the variable,
/// before anything is connected (the servers here do not exist).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_that_is_not_one_subject_token_is_refused_at_start() -> Result<()> {
    for role in ["coordinator", "worker"] {
        for value in ["a.b", "fleet.*", "a b"] {
            let (ok, stderr) = start_with(role, "TOOLFLEET_PREFIX", value).await?;
            assert!(!ok, "{role} started with TOOLFLEET_PREFIX={value}");
            let named = stderr
                .lines()
                .any(|l| l.contains("TOOLFLEET_PREFIX") && l.contains(&format!("{value:?}")));
            assert!(named, "{role} TOOLFLEET_PREFIX={value}: {stderr}");
        }
    }
    Ok(())
}

/// How long one `--help`, `--version` or refused start may take to exit.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// What the servers have seen of clients: NATS's connections ever accepted (`/varz`
/// `total_connections`, closed ones included) and open now; Redis's connections ever
/// received (`INFO stats`), open now (`INFO clients`, this test's own included) and its
/// keys (`DBSIZE`).
#[derive(Debug, PartialEq, Eq)]
struct Clients {
    nats_total: u64,
    nats_open: u64,
    redis_total: u64,
    redis_open: u64,
    redis_keys: u64,
}

/// The `name:value` field of an `INFO` answer.
fn info_field(info: &str, name: &str) -> Result<u64> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .with_context(|| format!("INFO has no {name}: {info}"))?
        .trim()
        .parse()
        .with_context(|| format!("INFO {name}"))
}

/// [`Clients`] now, from NATS's monitoring port and over `redis`.
async fn clients(
    monitor_port: u16,
    redis: &mut redis::aio::MultiplexedConnection,
) -> Result<Clients> {
    let (status, body) = http_get(monitor_port, "/varz").await?;
    anyhow::ensure!(status == 200, "nats /varz answered {status}: {body}");
    let varz: serde_json::Value = serde_json::from_str(&body).context("nats /varz")?;
    let count = |field: &str| {
        varz[field]
            .as_u64()
            .with_context(|| format!("nats /varz has no {field}: {body}"))
    };
    let stats: String = redis::cmd("INFO").arg("stats").query_async(redis).await?;
    let client_info: String = redis::cmd("INFO").arg("clients").query_async(redis).await?;
    Ok(Clients {
        nats_total: count("total_connections")?,
        nats_open: count("connections")?,
        redis_total: info_field(&stats, "total_connections_received")?,
        redis_open: info_field(&client_info, "connected_clients")?,
        redis_keys: redis::cmd("DBSIZE").query_async(redis).await?,
    })
}

/// `toolfleet-coordinator`, `toolfleet-worker` and `toolfleet-gateway`, built from this
/// checkout and pointed at a live NATS and Redis (and free ports for their HTTP
/// endpoints), answer `--help` and `-h` with what they are, the settings they read and
/// their health address, `--version` and `-V` with `<name> <version>`, both on stdout
/// with exit code 0, and refuse a misspelled flag with one line on stderr and exit code
/// 2; each exits within [`ANSWER_WAIT`] and neither server sees a connection from any of
/// them (nor does Redis get a key: no worker registered its tools).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_binaries_answer_help_and_version_and_refuse_other_arguments_unconnected(
) -> Result<()> {
    let toolfleet = checkout_cli().await?;
    let dir = toolfleet.parent().context("toolfleet has no folder")?;
    let monitor_port = free_port()?;
    let nats =
        NatsServer::start_with_config(&format!("http: \"127.0.0.1:{monitor_port}\"")).await?;
    let redis_server = RedisServer::start().await?;
    let mut redis = redis_server
        .client()?
        .get_multiplexed_async_connection()
        .await?;
    let before = clients(monitor_port, &mut redis).await?;
    let version = env!("CARGO_PKG_VERSION");
    let (ops_port, gateway_port) = (free_port()?, free_port()?);
    let env = [
        ("TOOLFLEET_NATS_URL", nats.url()),
        ("TOOLFLEET_REDIS_URL", redis_server.url()),
        ("TOOLFLEET_PREFIX", "argsfleet".to_string()),
        ("TOOLFLEET_PACKS", "demo".to_string()),
        ("TOOLFLEET_HTTP_ADDR", format!("127.0.0.1:{ops_port}")),
        (
            "TOOLFLEET_GATEWAY_ADDR",
            format!("127.0.0.1:{gateway_port}"),
        ),
        ("RUST_LOG", "info".to_string()),
    ];
    // Each binary, the health address its help names, and a setting only it reads.
    let binaries = [
        (
            "toolfleet-coordinator",
            "0.0.0.0:9090",
            "TOOLFLEET_REDIS_URL",
        ),
        ("toolfleet-worker", "0.0.0.0:9091", "TOOLFLEET_PACKS"),
        (
            "toolfleet-gateway",
            "0.0.0.0:8080",
            "TOOLFLEET_GATEWAY_ADDR",
        ),
    ];
    for (name, health_addr, setting) in binaries {
        let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
        for arg in ["--help", "-h", "--version", "-V", "--hepl"] {
            let run = Command::new(&path)
                .arg(arg)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .output();
            let out = tokio::time::timeout(ANSWER_WAIT, run)
                .await
                .with_context(|| format!("{name} {arg} did not exit: it started serving"))??;
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            let what = format!("{name} {arg} ({}): {stdout}{stderr}", out.status);
            match arg {
                "--help" | "-h" => {
                    assert_eq!(out.status.code(), Some(0), "{what}");
                    assert!(stdout.starts_with(&format!("{name}: ")), "{what}");
                    for needle in [
                        "TOOLFLEET_NATS_URL",
                        "TOOLFLEET_HTTP_ADDR",
                        setting,
                        health_addr,
                        "/healthz",
                        "docs/CONFIGURATION.md",
                        &format!("Usage: {name} [--help | --version]"),
                    ] {
                        assert!(stdout.contains(needle), "no {needle}: {what}");
                    }
                    assert!(stderr.is_empty(), "{what}");
                }
                "--version" | "-V" => {
                    assert_eq!(out.status.code(), Some(0), "{what}");
                    assert_eq!(stdout, format!("{name} {version}\n"), "{what}");
                    assert!(stderr.is_empty(), "{what}");
                }
                _ => {
                    assert_eq!(out.status.code(), Some(2), "{what}");
                    assert!(stdout.is_empty(), "{what}");
                    assert_eq!(stderr.lines().count(), 1, "{what}");
                    assert!(
                        stderr.starts_with(&format!(
                            "{name}: unexpected argument '--hepl'; it takes --help or --version"
                        )),
                        "{what}"
                    );
                }
            }
        }
    }
    let after = clients(monitor_port, &mut redis).await?;
    assert_eq!(
        after, before,
        "a binary asked for --help, --version or a typo connected to NATS or Redis"
    );
    Ok(())
}
