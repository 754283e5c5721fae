//! The gateway driven by real HTTP clients of other ecosystems: schemathesis (PyPI) runs
//! the gateway's own OpenAPI document against it (every route, chat completions against
//! a model server that answers in text, and `/mcp`), and Playwright (PyPI) drives Debian's
//! headless Chromium through the live turn page and drives a real `EventSource` that
//! authenticates with a stream token. Both come from a virtual environment
//! the test provisions (`tests/python/requirements-gateway.txt`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;
use toolfleet_tests::fleet::Fleet;
use toolfleet_tests::gateway::{create_key, GatewayNode};
use toolfleet_tests::pg::TestDatabase;
use toolfleet_tests::python::venv;
use toolfleet_tests::{repo_path, strings_at};

const REQUIREMENTS: &str = "tests/python/requirements-gateway.txt";
/// Where Debian's chromium package puts the browser.
const CHROMIUM: &str = "/usr/bin/chromium";
/// The page's turn: three calls of different lengths, one of which fails, pasted as
/// the decision.
const THREE_CALLS: &str = r#"{"type": "tool_calls", "calls": [
  {"id": "call_appointments", "toolName": "crm.listUpcomingAppointments", "arguments": {"customerId": "cust_002"}},
  {"id": "call_slow", "toolName": "test.behave", "arguments": {"sleep_ms": 300}},
  {"id": "call_failing", "toolName": "test.behave", "arguments": {"sleep_ms": 150, "fail": "upstream_down"}}
]}"#;

/// The committed screenshot of a finished three-call turn.
const SCREENSHOT: &str = "docs/gateway-live-page.png";

/// Runs `command` (bounded by `limit`); its stdout, or an error with both outputs.
async fn output(command: &mut Command, limit: Duration) -> Result<String> {
    let out = tokio::time::timeout(
        limit,
        command.stdin(Stdio::null()).kill_on_drop(true).output(),
    )
    .await
    .context("timed out")??;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

/// A fleet, a database and a gateway with a generous rate, and a key for tenant `demo`.
async fn served() -> Result<(Fleet, TestDatabase, GatewayNode, String, impl Drop)> {
    served_on(&[]).await
}

/// [`served`], the gateway's chat completions going to the model server at `base_url`.
async fn served_with(
    base_url: &str,
) -> Result<(Fleet, TestDatabase, GatewayNode, String, impl Drop)> {
    served_on(&[("TOOLFLEET_UPSTREAM_BASE_URL", base_url)]).await
}

async fn served_on(
    extra: &[(&str, &str)],
) -> Result<(Fleet, TestDatabase, GatewayNode, String, impl Drop)> {
    let (fleet, coordinator, worker) = Fleet::start_with_default_nodes().await?;
    let db = TestDatabase::create().await?;
    let mut settings = vec![
        ("TOOLFLEET_GATEWAY_RATE_PER_S", "10000"),
        ("TOOLFLEET_GATEWAY_BURST", "10000"),
    ];
    settings.extend_from_slice(extra);
    let gateway = GatewayNode::start(&fleet, &db, &settings).await?;
    let key = create_key(&db, "demo").await?;
    Ok((fleet, db, gateway, key, Nodes(Some((coordinator, worker)))))
}

/// Keeps the in-process coordinator and worker alive until dropped.
struct Nodes(
    Option<(
        toolfleet_tests::fleet::Running,
        toolfleet_tests::fleet::Running,
    )>,
);

impl Drop for Nodes {
    fn drop(&mut self) {
        if let Some((c, w)) = self.0.take() {
            c.shutdown.cancel();
            w.shutdown.cancel();
        }
    }
}

/// A model server that answers every chat completion with one line of text (as chunks
/// when the request streams), so the gateway's tool loop ends in one round whatever the
/// conversation; stopped when dropped.
struct TextModel {
    base_url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TextModel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TextModel {
    async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}/v1", listener.local_addr()?);
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let answer = tokio::time::timeout(Duration::from_secs(10), answer(socket));
                    let _ = answer.await;
                });
            }
        });
        Ok(Self { base_url, task })
    }
}

/// Reads one request from `socket` and answers it, closing the connection.
async fn answer(mut socket: TcpStream) -> Result<()> {
    let mut request = Vec::new();
    let mut chunk = [0u8; 8192];
    let (head_end, length) = loop {
        let n = socket.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "closed before the request ended");
        request.extend_from_slice(&chunk[..n]);
        if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&request[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            break (end + 4, length);
        }
    };
    while request.len() < head_end + length {
        let n = socket.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "closed before the body ended");
        request.extend_from_slice(&chunk[..n]);
    }
    let body: Value = serde_json::from_slice(&request[head_end..]).unwrap_or(Value::Null);
    let model = body["model"].as_str().unwrap_or("text-model").to_string();
    let text = "You have two upcoming appointments.";
    let (content_type, payload) = if body["stream"] == true {
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "chatcmpl-text", "object": "chat.completion.chunk", "created": 1,
                   "model": model, "choices": [{"index": 0, "delta": delta,
                   "finish_reason": finish}]})
        };
        let frames = [
            chunk(json!({"role": "assistant", "content": text}), Value::Null),
            chunk(json!({}), json!("stop")),
        ];
        let mut sse: String = frames.iter().map(|f| format!("data: {f}\n\n")).collect();
        sse.push_str("data: [DONE]\n\n");
        ("text/event-stream", sse)
    } else {
        let completion = json!({
            "id": "chatcmpl-text", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
        });
        ("application/json", completion.to_string())
    };
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        payload.len()
    );
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(payload.as_bytes()).await?;
    socket.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_and_no_schema_violation() -> Result<()> {
    let python = venv(env!("CARGO_TARGET_TMPDIR"), REQUIREMENTS).await?;
    let model = TextModel::start().await?;
    let (_fleet, _db, gateway, key, _nodes) = served_with(&model.base_url).await?;
    // `python -m`: the environment's entry-point scripts name the folder it was built in.
    let report = output(
        Command::new(&python)
            .args(["-m", "schemathesis.cli", "run"])
            .arg(gateway.url("/openapi.json"))
            .args(["--url", &gateway.base])
            .args(["-H", &format!("Authorization: Bearer {key}")])
            .args([
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,\
                 response_schema_conformance,response_headers_conformance",
            ])
            .args(["--max-examples", "25", "--seed", "1", "--no-color"])
            .args(["--request-timeout", "20"])
            .env("SCHEMATHESIS_HOOKS", "")
            .current_dir(env!("CARGO_TARGET_TMPDIR")),
        Duration::from_secs(240),
    )
    .await
    .context("schemathesis reported failures")?;
    // Every operation ran (a non-zero exit above is any failed check): submit, catalog,
    // a turn by id read, followed and cancelled, a stream token minted, chat completions,
    // MCP's POST, GET and DELETE, health, readiness, the rendered document and the live
    // page's five routes, its gateway client included (the document itself is the one
    // schemathesis reads).
    assert!(report.contains("Tested: 18"), "{report}");
    assert!(!report.contains(" failed"), "{report}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_shows_every_call_of_a_turn_in_chromium() -> Result<()> {
    anyhow::ensure!(
        Path::new(CHROMIUM).is_file(),
        "{CHROMIUM} not found: apt-get install chromium"
    );
    let python = venv(env!("CARGO_TARGET_TMPDIR"), REQUIREMENTS).await?;
    let (_fleet, _db, gateway, key, _nodes) = served().await?;
    let screenshot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gateway-live-page.png");
    let stdout = output(
        Command::new(&python)
            .arg(repo_path("tests/python/live_page.py"))
            .arg(&gateway.base)
            .arg(&key)
            .arg(THREE_CALLS)
            .arg(&screenshot),
        Duration::from_secs(150),
    )
    .await?;
    let report: Value = serde_json::from_str(stdout.trim())?;
    let rows = report["rows"].as_array().context("no rows")?;
    let seen: Vec<(&str, &str)> = rows
        .iter()
        .filter_map(|r| Some((r["id"].as_str()?, r["state"].as_str()?)))
        .collect();
    assert_eq!(
        seen,
        [
            ("call_appointments", "done"),
            ("call_slow", "done"),
            ("call_failing", "error")
        ],
        "{report}"
    );
    let slow: u64 = rows[1]["ms"].as_str().unwrap_or_default().parse()?;
    assert!(slow >= 300, "{report}");
    let summary = report["summary"].as_str().unwrap_or_default();
    assert!(summary.contains("total 3, ok 2, errors 1"), "{report}");
    assert!(
        report["narration"]
            .as_str()
            .is_some_and(|n| n.contains("appointment")),
        "{report}"
    );
    assert!(
        report["ack"].as_str().is_some_and(|a| !a.is_empty()),
        "{report}"
    );
    let trace = report["trace"].as_str().unwrap_or_default();
    assert!(
        trace.starts_with("http://localhost:16686/trace/") && trace.len() == 61,
        "{report}"
    );
    assert_eq!(report["problem"], "", "{report}");
    assert!(std::fs::metadata(&screenshot)?.len() > 10_000);
    if std::env::var_os("TOOLFLEET_UPDATE_SCREENSHOT").is_some() {
        std::fs::copy(&screenshot, repo_path(SCREENSHOT))?;
    }
    Ok(())
}

/// A turn whose calls end at 300, 1500 and 3500 ms: long enough that a stream cut after
/// its first events misses some while the browser waits to reconnect.
fn long_turn(turn_id: &str) -> Value {
    serde_json::json!({
        "turn_id": turn_id,
        "deadline_ms": 20000,
        "decision": {"type": "tool_calls", "calls": [
            {"id": "c1", "toolName": "test.behave", "arguments": {"sleep_ms": 300}},
            {"id": "c2", "toolName": "test.behave", "arguments": {"sleep_ms": 1500}},
            {"id": "c3", "toolName": "test.behave", "arguments": {"sleep_ms": 3500}}
        ]}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browsers_event_source_follows_a_turn_with_a_stream_token_through_a_dropped_connection(
) -> Result<()> {
    anyhow::ensure!(
        Path::new(CHROMIUM).is_file(),
        "{CHROMIUM} not found: apt-get install chromium"
    );
    let python = venv(env!("CARGO_TARGET_TMPDIR"), REQUIREMENTS).await?;
    let (_fleet, _db, gateway, key, _nodes) = served().await?;
    let stdout = output(
        Command::new(&python)
            .arg(repo_path("tests/python/event_source.py"))
            .arg(&gateway.base)
            .arg(&key)
            .arg(long_turn("browser-es-1").to_string()),
        Duration::from_secs(150),
    )
    .await?;
    let report: Value = serde_json::from_str(stdout.trim())?;
    // The backend's submit was accepted at once, with a URL that carries no key.
    assert_eq!(report["status"], 202, "{report}");
    assert_eq!(report["key_in_url"], false, "{report}");
    let events = report["events"].as_array().context("no events")?;
    let ids: Vec<u64> = events
        .iter()
        .map(|e| e["id"].as_str().and_then(|id| id.parse().ok()))
        .collect::<Option<_>>()
        .context("an event without id")?;
    // Every event once, in order, across the cut: ack, 3 pending, 3 done, narration, final.
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>(), "{report}");
    assert!(ids.len() >= 9, "{report}");
    let finals = events.iter().filter(|e| e["type"] == "final").count();
    assert_eq!(finals, 1, "{report}");
    assert_eq!(events.last().map(|e| &e["type"]), Some(&"final".into()));
    let states = strings_at(&report["final"]["results"], "/state", "the final's results")?;
    assert_eq!(states, ["done", "done", "done"], "{report}");
    // The browser reconnected by itself, naming the last event it had.
    assert!(report["opens"].as_u64() >= Some(2), "{report}");
    let requests = report["events_requests"]
        .as_array()
        .context("no requests")?;
    assert!(requests.len() >= 2, "{report}");
    assert_eq!(requests[0]["last_event_id"], Value::Null, "{report}");
    let resumed_after: u64 = requests[1]["last_event_id"]
        .as_str()
        .and_then(|id| id.parse().ok())
        .context("the reconnect named no Last-Event-ID")?;
    assert!((2..ids.len() as u64).contains(&resumed_after), "{report}");
    // Without a token, or with another turn's, the EventSource is refused and closes.
    for refused in ["no_token", "wrong_turn"] {
        assert_eq!(report[refused]["readyState"], 2, "{refused}: {report}");
        assert_eq!(report[refused]["events"], 0, "{refused}: {report}");
    }
    Ok(())
}
