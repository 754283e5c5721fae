//! `toolfleet up` as a user first runs it: the `mcp` pack (the test server of
//! `tests/mcp/server.py`) served beside `demo` while the usual ops ports (9090, 9091)
//! are taken; `TOOLFLEET_HTTP_ADDR` given (the worker gets a port of its own) or taken
//! (refused at once); and the commands that need a running fleet, run without one.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, checkout_cli, crm_call, result_of, Fleet};
use toolfleet_tests::{child_command, free_port, python};

const EVENT_WAIT: Duration = Duration::from_secs(20);
/// Longest a refusing command may take to exit.
const REFUSAL_WAIT: Duration = Duration::from_secs(10);

/// `toolfleet up` with `args`, on `fleet`'s servers and prefix, with `env`; killed on drop.
async fn up(fleet: &Fleet, args: &[&str], env: &[(&str, &str)]) -> Result<Child> {
    let mut command = child_command(checkout_cli().await?, Stdio::null());
    command
        .arg("up")
        .args(args)
        .envs(fleet.servers_env())
        .env_remove("TOOLFLEET_HTTP_ADDR")
        .env_remove("TOOLFLEET_MCP_SERVERS")
        .envs(env.iter().copied());
    Ok(command.spawn()?)
}

/// Waits until the catalog lists `tools`, failing at once when `child` exits first.
async fn wait_serving(fleet: &Fleet, child: &mut Child, tools: &[&str]) -> Result<()> {
    tokio::select! {
        listed = fleet.wait_for_tools(tools) => listed,
        status = child.wait() => bail!("toolfleet up exited before serving: {:?}", status?),
    }
}

/// A listener on `port` of every interface, or `None` when something else holds it
/// already (taken either way).
fn hold(port: u16) -> Option<std::net::TcpListener> {
    std::net::TcpListener::bind(("0.0.0.0", port)).ok()
}

/// A servers file in `dir` naming the test's stdio MCP server `local`.
fn servers_file(dir: &Path, python: &Path) -> Result<PathBuf> {
    let script = toolfleet_tests::repo_path("tests/mcp/server.py");
    let servers = json!({"servers": {"local": {
        "command": python,
        "args": [script, "stdio"],
        "timeout_ms": 5000
    }}});
    let path = dir.join("mcp_servers.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&servers)?)?;
    Ok(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_the_mcp_pack_beside_demo_with_the_usual_ops_ports_taken() -> Result<()> {
    let python = python::venv(env!("CARGO_TARGET_TMPDIR"), "tests/mcp/requirements.txt").await?;
    let dir = tempfile::tempdir()?;
    let file = servers_file(dir.path(), &python)?;
    let (_coordinator_port, _worker_port) = (hold(9090), hold(9091));
    let fleet = Fleet::start().await?;
    let servers = file.display().to_string();
    let mut child = up(
        &fleet,
        &["--packs", "demo,mcp"],
        &[("TOOLFLEET_MCP_SERVERS", &servers)],
    )
    .await?;
    let tools = [
        "crm.listUpcomingAppointments",
        "local.forecast",
        "local.learn",
    ];
    wait_serving(&fleet, &mut child, &tools).await?;

    let outcome = fleet
        .run_calls(
            "demo",
            vec![
                crm_call("c1", "crm.listUpcomingAppointments", "cust_001"),
                call("c2", "local.forecast", json!({"city": "Oslo"})),
                call("c3", "local.learn", json!({"name": "shout"})),
            ],
            EVENT_WAIT,
        )
        .await?;
    let fin = &outcome.final_event;
    for id in ["c1", "c2", "c3"] {
        let result = result_of(fin, id)?;
        assert_eq!(result.state, CallState::Done, "{id}: {result:?}");
    }
    assert_eq!(
        result_of(fin, "c2")?
            .result
            .as_ref()
            .map(|r| r["high_c"].clone()),
        Some(json!(21))
    );
    // The MCP results are spoken as sentences: the wrapped text as its text, the
    // structured forecast as phrases.
    let narration = outcome.narration();
    assert!(narration.contains(&"learned shout"), "{narration:?}");
    assert!(
        narration
            .iter()
            .any(|chunk| chunk.starts_with("city: Oslo, high c: 21, sky: sunny")),
        "{narration:?}"
    );
    assert!(
        !narration.iter().any(|chunk| chunk.contains('{')),
        "{narration:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_gives_the_worker_its_own_ops_port_beside_toolfleet_http_addr() -> Result<()> {
    let fleet = Fleet::start().await?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut child = up(
        &fleet,
        &["--packs", "demo"],
        &[("TOOLFLEET_HTTP_ADDR", &addr)],
    )
    .await?;
    wait_serving(&fleet, &mut child, &["crm.listUpcomingAppointments"]).await?;
    // The coordinator answers on the address given; the worker, on a port of its own,
    // serves the turn.
    let health = reqwest::get(format!("http://{addr}/healthz")).await?;
    assert!(health.status().is_success(), "{}", health.status());
    let outcome = fleet
        .run_calls(
            "demo",
            vec![crm_call("c1", "crm.listUpcomingAppointments", "cust_001")],
            EVENT_WAIT,
        )
        .await?;
    assert_eq!(
        result_of(&outcome.final_event, "c1")?.state,
        CallState::Done
    );
    Ok(())
}

/// Waits for `child` to exit, at most [`REFUSAL_WAIT`]; its status and stderr.
async fn refusal(child: Child) -> Result<(ExitStatus, String)> {
    let out = tokio::time::timeout(REFUSAL_WAIT, child.wait_with_output())
        .await
        .context("the command did not exit in time")??;
    Ok((
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_refuses_a_taken_toolfleet_http_addr_at_once() -> Result<()> {
    let fleet = Fleet::start().await?;
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let mut command = Command::new(checkout_cli().await?);
    command
        .args(["up", "--packs", "demo"])
        .env("TOOLFLEET_NATS_URL", fleet.nats.url())
        .env("TOOLFLEET_REDIS_URL", fleet.redis.url())
        .env("TOOLFLEET_HTTP_ADDR", &addr)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let (status, stderr) = refusal(command.spawn()?).await?;
    assert!(!status.success(), "{status}");
    // The refusal names the setting and the address.
    assert!(stderr.contains("TOOLFLEET_HTTP_ADDR"), "{stderr}");
    assert!(stderr.contains(&addr), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_without_a_fleet_name_the_url_they_tried() -> Result<()> {
    let cli = checkout_cli().await?;
    let url = format!("nats://127.0.0.1:{}", free_port()?);
    let dir = tempfile::tempdir()?;
    let decision = dir.path().join("decision.json");
    let calls: Value = json!({"type": "tool_calls", "calls": [
        {"id": "c1", "toolName": "crm.listUpcomingAppointments", "arguments": {}}
    ]});
    std::fs::write(&decision, calls.to_string())?;
    let decision = decision.display().to_string();
    let commands: [&[&str]; 4] = [
        &["submit", &decision],
        &["catalog"],
        &["turn", "some-turn"],
        &["cancel", "some-turn"],
    ];
    for args in commands {
        let child = Command::new(&cli)
            .args(args)
            .env("TOOLFLEET_NATS_URL", &url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let (status, stderr) = refusal(child).await.context(args[0].to_string())?;
        assert!(!status.success(), "{args:?}: {status}");
        // It names the URL it tried and the variable that points elsewhere.
        assert!(stderr.contains(&url), "{args:?}: {stderr}");
        assert!(stderr.contains("TOOLFLEET_NATS_URL"), "{args:?}: {stderr}");
    }
    Ok(())
}
