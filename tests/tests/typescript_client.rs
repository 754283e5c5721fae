//! The JavaScript client of `clients/typescript` (`toolfleet.js`), run by Node against
//! real gateways in front of a real fleet, as an application uses it: a turn of three
//! calls whose stream is cut mid-turn and resumed with `Last-Event-ID` (every `seq` once,
//! in order), a turn left after two events and followed again, a stream token used
//! without the key, a cancel, refusals typed by code, an `overloaded` gateway waited out
//! for its `Retry-After`; a turn followed while its gateway is killed and started again;
//! its event-stream parser on its own; its README's example run as
//! written; and the live page served with this very client.
//!
//! Needs only `node` (20+) on the machine: the client has no dependencies.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use toolfleet_tests::fleet::{assert_numbered_ack_to_final, Fleet};
use toolfleet_tests::gateway::{create_key, gateway_node_path, stack, GatewayNode};
use toolfleet_tests::pg::TestDatabase;
use toolfleet_tests::{child_command, repo_path};

/// Bound of one `node` run.
const NODE_WAIT: Duration = Duration::from_secs(120);

/// `node <args>` in `dir` with `env`, bounded by [`NODE_WAIT`]: its stdout.
async fn node(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let mut command = child_command("node", Stdio::piped());
    command
        .args(args)
        .current_dir(dir)
        .envs(env.iter().copied());
    let out = tokio::time::timeout(NODE_WAIT, command.output())
        .await
        .with_context(|| format!("node {args:?} did not finish in time"))?
        .context("starting node (apt-get install -y nodejs)")?;
    anyhow::ensure!(out.status.success(), "node {args:?} failed: {}", out.status);
    Ok(String::from_utf8(out.stdout)?)
}

fn seqs(from: u64, to: u64) -> Value {
    json!((from..=to).collect::<Vec<_>>())
}

fn len(value: &Value) -> u64 {
    value.as_array().map_or(0, |a| a.len() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_javascript_client_streams_resumes_cancels_and_waits_out_overloaded() -> Result<()> {
    let (fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let busy = GatewayNode::start(&fleet, &db, &[("TOOLFLEET_GATEWAY_MAX_TURNS", "1")]).await?;
    let key = create_key(&db, "demo").await?;
    let dir = repo_path("clients/typescript");
    let out = node(
        &dir,
        &["test/gateway.mjs", &gateway.base, &key, &busy.base],
        &[],
    )
    .await?;
    let report: Value = serde_json::from_str(out.lines().last().context("no report")?)
        .with_context(|| format!("not JSON: {out}"))?;

    // Cut after three frames: resumed once from seq 3, every seq once, in order.
    let dropped = &report["dropped"];
    let n = len(&dropped["seqs"]);
    assert_eq!(dropped["seqs"], seqs(1, n), "{dropped}");
    assert_eq!(dropped["types"][0], "ack");
    assert_eq!(dropped["types"][n as usize - 1], "final");
    assert_eq!(dropped["states"], json!(["done", "done", "done"]));
    assert_eq!(dropped["resumes"], 1, "{dropped}");
    assert_eq!(dropped["streamToken"], true);
    let requests = dropped["requests"].as_array().context("requests")?;
    assert_eq!(requests.len(), 2, "{dropped}");
    assert_eq!(requests[0]["method"], "POST");
    assert_eq!(requests[1]["method"], "GET");
    assert_eq!(requests[1]["lastEventId"], "3");

    // Left after two events: the rest from seq 3, followed by id or by iterating again.
    let left = &report["leftAndResumed"];
    assert_eq!(left["first"], json!([1, 2]));
    assert_eq!(left["after"], 2);
    let all = 2 + len(&left["rest"]);
    assert_eq!(left["rest"], seqs(3, all), "{left}");
    assert_eq!(left["again"], left["rest"]);
    assert_eq!(left["restTypes"][len(&left["rest"]) as usize - 1], "final");
    assert_eq!(left["stored"], json!({"status": "ended", "count": all}));

    // A stream token reads the turn without the key, and does nothing else.
    let token = &report["withToken"];
    assert_eq!(token["types"][0], "ack");
    assert_eq!(token["seqs"], seqs(1, len(&token["seqs"])));
    assert_eq!(token["types"][len(&token["types"]) as usize - 1], "final");
    assert_eq!(token["eventsUrl"], true);
    assert_eq!(token["directStatus"], 200);
    assert_eq!(token["cancelRefused"]["status"], 401);
    assert_eq!(token["minted"], true);

    let cancelled = &report["cancelled"];
    assert_eq!(cancelled["reply"]["outcome"], "cancelled");
    assert_eq!(cancelled["second"]["outcome"], "already_ended");
    assert_eq!(cancelled["states"], json!(["cancelled"]));
    assert_eq!(cancelled["summary"]["cancelled"], 1);
    assert!(cancelled["finalAfterMs"].as_u64().unwrap_or(u64::MAX) < 3000);

    let refused = &report["refused"];
    let typed = |status: u16, code: &str, retryable: bool| json!({"error": true, "status": status, "code": code, "retryable": retryable});
    assert_eq!(refused["decision"], typed(422, "invalid_decision", false));
    assert_eq!(refused["deadline"], typed(400, "invalid_request", false));
    assert_eq!(refused["key"], typed(401, "unauthorized", false));
    assert_eq!(refused["unknown"], typed(404, "unknown_turn", false));
    assert_eq!(refused["tools"], true);

    // One turn at a time: the refusal is typed, and a waiting client gets in once the
    // first turn ended, no sooner than Retry-After.
    let overloaded = &report["overloaded"];
    assert_eq!(
        overloaded["refusal"],
        json!({"status": 503, "code": "overloaded", "retryable": true, "retryAfterMs": 1000})
    );
    let retries = overloaded["retries"].as_array().context("retries")?;
    assert!(!retries.is_empty(), "{overloaded}");
    for retry in retries {
        assert_eq!(retry["status"], 503);
        assert_eq!(retry["code"], "overloaded");
        assert_eq!(retry["waitMs"], 1000);
    }
    let waited = overloaded["acceptedAfterMs"]
        .as_u64()
        .context("acceptedAfterMs")?;
    assert!(waited >= 1000 * retries.len() as u64, "{overloaded}");
    assert_eq!(overloaded["secondSummary"]["ok"], 1);
    assert_eq!(overloaded["firstSummary"]["ok"], 1);
    Ok(())
}

/// A `gateway-node` on `port` for `fleet` with keys in `db`, ready; killed when dropped.
async fn gateway_on(fleet: &Fleet, db: &TestDatabase, port: u16) -> Result<Child> {
    let child = child_command(gateway_node_path()?, Stdio::null())
        .env("TOOLFLEET_NATS_URL", fleet.nats.url())
        .env("TOOLFLEET_PREFIX", fleet.names.prefix())
        .env("TOOLFLEET_DATABASE_URL", db.url())
        .env("TOOLFLEET_GATEWAY_ADDR", format!("127.0.0.1:{port}"))
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .spawn()
        .context("spawning gateway-node")?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let ready = format!("http://127.0.0.1:{port}/readyz");
    toolfleet_tests::eventually_named("the gateway to be ready", NODE_WAIT, || async {
        let response = http.get(&ready).send().await.ok()?;
        response.status().is_success().then_some(())
    })
    .await?;
    Ok(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_resumes_on_a_gateway_started_again_after_a_kill() -> Result<()> {
    let (fleet, _coordinator, _worker) = Fleet::start_with_default_nodes().await?;
    let db = TestDatabase::create().await?;
    let port = toolfleet_tests::free_port()?;
    let mut gateway = gateway_on(&fleet, &db, port).await?;
    let key = create_key(&db, "demo").await?;
    let base = format!("http://127.0.0.1:{port}");
    let mut client = child_command("node", Stdio::piped())
        .args(["test/restart.mjs", &base, &key])
        .current_dir(repo_path("clients/typescript"))
        .spawn()
        .context("starting node")?;
    let mut lines = BufReader::new(client.stdout.take().context("no stdout")?).lines();
    let ready = tokio::time::timeout(NODE_WAIT, lines.next_line())
        .await
        .context("the client never read its first events")??
        .context("the client ended early")?;
    let ready: Value = serde_json::from_str(&ready)?;
    assert!(ready["ready"].is_string(), "{ready}");

    // The call sleeps 3 s: the gateway dies under the open stream and comes back.
    gateway.kill().await?;
    let _gateway = gateway_on(&fleet, &db, port).await?;

    let report = tokio::time::timeout(NODE_WAIT, lines.next_line())
        .await
        .context("the client did not finish")??
        .context("the client printed no report")?;
    let status = tokio::time::timeout(NODE_WAIT, client.wait()).await??;
    assert!(status.success(), "{status}");
    let report: Value = serde_json::from_str(&report)?;
    let n = len(&report["seqs"]);
    assert_eq!(report["seqs"], seqs(1, n), "{report}");
    assert_eq!(report["types"][n as usize - 1], "final", "{report}");
    assert_eq!(report["states"], json!(["done"]), "{report}");
    assert!(report["resumes"].as_u64().unwrap_or(0) >= 1, "{report}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_parser_takes_frames_split_anywhere() -> Result<()> {
    let dir = repo_path("clients/typescript");
    node(&dir, &["--test", "test/sse.test.mjs"], &[]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_example_of_the_javascript_client_runs_as_written() -> Result<()> {
    let (_fleet, _coordinator, _worker, db, gateway) = stack(&[]).await?;
    let key = create_key(&db, "demo").await?;
    let readme = toolfleet_tests::read_repo_file("clients/typescript/README.md")?;
    let code = readme
        .split("## Example")
        .nth(1)
        .and_then(|section| section.split("```js\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .context("no js block under ## Example")?;
    assert!(code.lines().count() <= 10, "a ten-line example:\n{code}");
    // The README's setup: the module copied beside the application's code.
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("example.mjs"), code)?;
    std::fs::copy(
        repo_path("clients/typescript/toolfleet.js"),
        dir.path().join("toolfleet.js"),
    )?;
    let env = [
        ("TOOLFLEET_URL", gateway.base.as_str()),
        ("TOOLFLEET_API_KEY", key.as_str()),
    ];
    let out = node(dir.path(), &["example.mjs"], &env).await?;
    // One line per event, `seq type text`: the ack first, the final last.
    assert_numbered_ack_to_final(&out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_loads_this_client() -> Result<()> {
    let fleet = Fleet::start().await?;
    let db = TestDatabase::create().await?;
    let gateway = GatewayNode::start(&fleet, &db, &[]).await?;
    let served = gateway
        .http
        .get(gateway.url("/page/toolfleet.js"))
        .send()
        .await?;
    assert_eq!(served.status(), 200);
    assert!(served
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/javascript")));
    let served = served.text().await?;
    assert_eq!(
        served,
        toolfleet_tests::read_repo_file("clients/typescript/toolfleet.js")?
    );
    let page = gateway.get_text("/").await?;
    assert!(
        page.contains(r#"<script type="module" src="/page/app.js">"#),
        "{page}"
    );
    let app = gateway.get_text("/page/app.js").await?;
    assert!(app.contains(r#"from "/page/toolfleet.js""#), "{app}");
    Ok(())
}
