//! `deploy/redis/start.sh`, as compose runs it: the ACL file's committed development
//! passwords never go live. A real `redis-server` starts from `deploy/redis/redis.conf`
//! (its `dir /data`, the container's volume, pointed at a temporary directory) and
//! `users.acl` with the passwords from the environment; the committed ones are refused,
//! and a missing password stops the start.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::process::{Child, Command};
use toolfleet_tests::{find_binary, free_port, repo_path};

/// The passwords compose hands the Redis container.
const PASSWORDS: [(&str, &str); 3] = [
    ("TOOLFLEET_REDIS_PASSWORD", "fleet-7c1f0e9a4b"),
    ("TOOLFLEET_REDIS_WORKER_PASSWORD", "worker-2d8e6a13f0"),
    ("TOOLFLEET_REDIS_EXPORTER_PASSWORD", "exporter-95b3c4d2e1"),
];

/// `start.sh` with `env` on a free port, its `$TMPDIR` in `dir`.
fn start(dir: &tempfile::TempDir, port: u16, env: &[(&str, &str)]) -> Result<Child> {
    let redis_server = find_binary("redis-server")?;
    let bin_dir: PathBuf = redis_server
        .parent()
        .context("redis-server's directory")?
        .into();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let conf = std::fs::read_to_string(repo_path("deploy/redis/redis.conf"))?
        .lines()
        .map(|line| match line.starts_with("dir ") {
            true => format!("dir {}", dir.path().display()),
            false => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let conf_file = dir.path().join("redis.conf");
    std::fs::write(&conf_file, conf)?;
    let mut command = Command::new("sh");
    command
        .arg(repo_path("deploy/redis/start.sh"))
        .arg(&conf_file)
        .arg(repo_path("deploy/redis/users.acl"))
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--appendonly", "no"])
        .env_clear()
        .env("PATH", path)
        .env("TMPDIR", dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    Ok(command.spawn()?)
}

/// Whether `user` with `password` gets `PONG`.
async fn ping(port: u16, user: &str, password: &str) -> Result<bool> {
    let client = redis::Client::open(format!("redis://{user}:{password}@127.0.0.1:{port}/"))?;
    let connecting = client.get_multiplexed_async_connection();
    match tokio::time::timeout(Duration::from_secs(5), connecting).await {
        Ok(Ok(mut connection)) => {
            let pong: String = redis::cmd("PING").query_async(&mut connection).await?;
            Ok(pong == "PONG")
        }
        Ok(Err(e)) if e.kind() == redis::ErrorKind::AuthenticationFailed => Ok(false),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => anyhow::bail!("redis on {port} did not answer"),
    }
}

#[tokio::test]
async fn redis_starts_with_the_environments_passwords_and_refuses_the_committed_ones() -> Result<()>
{
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let _server = start(&dir, port, &PASSWORDS)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        match ping(port, "toolfleet", PASSWORDS[0].1).await {
            Ok(true) => break,
            _ if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => anyhow::bail!("redis did not start: {other:?}"),
        }
    }
    assert!(ping(port, "worker", PASSWORDS[1].1).await?);
    assert!(ping(port, "exporter", PASSWORDS[2].1).await?);
    // The placeholders committed in users.acl are not passwords of the running server.
    assert!(!ping(port, "toolfleet", "toolfleet-dev-redis-password").await?);
    assert!(!ping(port, "worker", "toolfleet-dev-redis-worker-password").await?);
    Ok(())
}

#[tokio::test]
async fn a_missing_password_stops_redis_from_starting() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    // The worker's password is missing; another is unusable (a space).
    for env in [
        vec![PASSWORDS[0], PASSWORDS[2]],
        vec![
            PASSWORDS[0],
            ("TOOLFLEET_REDIS_WORKER_PASSWORD", "two words"),
            PASSWORDS[2],
        ],
    ] {
        let child = start(&dir, port, &env)?;
        let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
            .await
            .context("start.sh did not stop")??;
        assert!(!out.status.success());
        assert!(ping(port, "toolfleet", PASSWORDS[0].1).await.is_err());
    }
    Ok(())
}
