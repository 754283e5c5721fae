//! The fleet as an MCP server: the official MCP Python SDK (from PyPI, provisioned by the
//! test: `tests/python/requirements-mcp.txt`) connects to the gateway's `/mcp` with an
//! API key as its bearer token, lists its tenant's fleet tools and calls them; each call
//! is one fleet turn.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tokio::process::Command;
use toolfleet_tests::fleet::Fleet;
use toolfleet_tests::gateway::{create_key, GatewayNode};
use toolfleet_tests::pg::TestDatabase;
use toolfleet_tests::python::venv;
use toolfleet_tests::repo_path;

const REQUIREMENTS: &str = "tests/python/requirements-mcp.txt";

async fn client(python: &std::path::Path, url: &str, key: &str) -> Result<Value> {
    client_with(python, url, key, &[]).await
}

async fn client_with(
    python: &std::path::Path,
    url: &str,
    key: &str,
    extra: &[&str],
) -> Result<Value> {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(python)
            .arg(repo_path("tests/python/mcp_client.py"))
            .arg(url)
            .arg(key)
            .args(extra)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("the MCP client hung")??;
    if !out.status.success() {
        bail!(
            "mcp_client.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| String::from_utf8_lossy(&out.stdout).to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_client_lists_and_calls_the_tenants_fleet_tools() -> Result<()> {
    let python = venv(env!("CARGO_TARGET_TMPDIR"), REQUIREMENTS).await?;
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let db = TestDatabase::create().await?;
    let gateway = GatewayNode::start(&fleet, &db, &[]).await?;
    let key = create_key(&db, "acme").await?;
    let url = format!("{}/mcp", gateway.base);

    let seen = client(&python, &url, &key).await?;
    let tools: Vec<&str> = seen["tools"]
        .as_array()
        .context("tools")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(tools.contains(&"crm.getOpenInvoices"), "{tools:?}");
    assert!(tools.contains(&"test.behave"), "{tools:?}");

    let ok = &seen["ok"];
    assert_eq!(ok["is_error"], false, "{ok}");
    assert_eq!(ok["structured"]["value"], "from mcp", "{ok}");
    assert_eq!(ok["structured"]["tenant_id"], "acme", "{ok}");
    // The client asked for progress: the call's states came as notifications.
    let progress: Vec<&str> = seen["progress"]
        .as_array()
        .context("progress")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(progress.contains(&"done"), "{progress:?}");

    assert_eq!(seen["failing"]["is_error"], true, "{}", seen["failing"]);
    assert_eq!(seen["unknown"]["is_error"], true, "{}", seen["unknown"]);

    // Without a valid key the transport is never reached.
    let refused = client(&python, &url, "wrong").await?;
    assert_eq!(refused["refused"], 401);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_mcp_client_abandons_cancels_its_turn() -> Result<()> {
    use futures::StreamExt;
    let python = venv(env!("CARGO_TARGET_TMPDIR"), REQUIREMENTS).await?;
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let db = TestDatabase::create().await?;
    let gateway = GatewayNode::start(&fleet, &db, &[]).await?;
    let key = create_key(&db, "acme").await?;
    // Cancelled turns are announced to the workers on `<p>.cancelled.<turn>`.
    let mut cancelled = fleet
        .client
        .nats()
        .subscribe(fleet.names.turn_cancelled_any())
        .await?;
    let url = format!("{}/mcp", gateway.base);
    let seen = client_with(&python, &url, &key, &["cancel"]).await?;
    assert_eq!(seen["abandoned"], true);
    let notice = tokio::time::timeout(Duration::from_secs(10), cancelled.next())
        .await
        .context("the abandoned call's turn was not cancelled")?;
    assert!(notice.is_some());
    Ok(())
}
