//! The fleet as an MCP server: the official MCP Python SDK (from PyPI, provisioned by the
//! test: `tests/python/requirements-mcp.txt`) connects to the gateway's `/mcp` with an
//! API key as its bearer token, lists its tenant's fleet tools and calls them; each call
//! is one fleet turn.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;
use toolfleet_tests::gateway::{create_key, stack};
use toolfleet_tests::python::{script_json, venv};
use toolfleet_tests::strings_at;

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
    let args = [&[url, key][..], extra].concat();
    script_json(python, "tests/python/mcp_client.py", &args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_client_lists_and_calls_the_tenants_fleet_tools() -> Result<()> {
    let python = venv(env!("CARGO_TARGET_TMPDIR"), REQUIREMENTS).await?;
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, "acme").await?;
    let url = format!("{}/mcp", gateway.base);

    let seen = client(&python, &url, &key).await?;
    let tools = strings_at(&seen["tools"], "", "tools")?;
    assert!(tools.contains(&"crm.getOpenInvoices"), "{tools:?}");
    assert!(tools.contains(&"test.behave"), "{tools:?}");

    let ok = &seen["ok"];
    assert_eq!(ok["is_error"], false, "{ok}");
    assert_eq!(ok["structured"]["value"], "from mcp", "{ok}");
    assert_eq!(ok["structured"]["tenant_id"], "acme", "{ok}");
    // The client asked for progress: the call's states came as notifications.
    let progress = strings_at(&seen["progress"], "", "progress")?;
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
    let (fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
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
