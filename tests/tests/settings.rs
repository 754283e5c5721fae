//! Settings that would break the fleet quietly are refused at start-up: a coordinator
//! or worker process given zero or a huge value exits with an error that names the
//! variable, the value and the allowed range, before it connects to anything.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::process::Command;
use toolfleet_tests::fleet::fleet_node_path;

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
