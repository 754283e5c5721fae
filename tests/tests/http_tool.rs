//! HTTP tools declared in a tools file, against a small HTTP server run by the test on
//! loopback: arguments and ids reach the endpoint, JSON comes back as the result, and
//! statuses and timeouts become retryable or final errors.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use toolfleet_common::CallState;
use toolfleet_packs::{self as packs, http_tool, PackSettings};
use toolfleet_tests::fleet::{call, code_of, result_of, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(15);
const MAX_REQUEST: usize = 64 * 1024;

/// A loopback HTTP/1.1 server answering by path, counting requests per path.
struct Upstream {
    addr: SocketAddr,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    task: JoinHandle<()>,
}

impl Upstream {
    async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let hits: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let counter = Arc::clone(&hits);
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let counter = Arc::clone(&counter);
                tokio::spawn(async move {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(10), serve(socket, counter)).await;
                });
            }
        });
        Ok(Self { addr, hits, task })
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn hits(&self, path: &str) -> usize {
        self.hits
            .lock()
            .map(|h| h.get(path).copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut socket: TcpStream, hits: Arc<Mutex<HashMap<String, usize>>>) -> Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        anyhow::ensure!(buf.len() < MAX_REQUEST, "request head too large");
        let n = socket.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed mid-request");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_string();
    let path = request_line.split(' ').nth(1).unwrap_or("/").to_string();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let length: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    anyhow::ensure!(length <= MAX_REQUEST, "body too large");
    while buf.len() < head_end + length {
        let n = socket.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed mid-body");
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = &buf[head_end..head_end + length];
    if let Ok(mut h) = hits.lock() {
        *h.entry(path.clone()).or_insert(0) += 1;
    }
    let header = |name: &str| headers.get(name).cloned().unwrap_or_default();
    let (status, extra, payload) = match path.as_str() {
        "/echo" => {
            let args: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let echoed = json!({
                "method": request_line.split(' ').next(),
                "args": args,
                "tenant": header("fleet-tenant-id"),
                "turn": header("fleet-turn-id"),
                "call": header("fleet-call-id"),
                "attempt": header("fleet-attempt"),
                "idempotency_key": header("idempotency-key"),
                "api_key": header("x-api-key"),
                "content_type": header("content-type"),
            });
            (
                "200 OK",
                "Fleet-Summary: The upstream echoed your request.\r\n",
                echoed.to_string(),
            )
        }
        "/unavailable" => ("503 Service Unavailable", "", "down for maintenance".into()),
        "/limited" => ("429 Too Many Requests", "", String::new()),
        "/rejected" => ("400 Bad Request", "", "unknown city".into()),
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            ("200 OK", "", "{}".into())
        }
        "/not-json" => ("200 OK", "", "hello".into()),
        _ => ("404 Not Found", "", String::new()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n{payload}",
        payload.len()
    );
    socket.write_all(response.as_bytes()).await?;
    socket.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_tools_map_answers_to_results_and_retryable_errors() -> Result<()> {
    let upstream = Upstream::start().await?;
    let refused = toolfleet_tests::free_port()?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("http_tools.json");
    let spec = |name: &str, url: String, extra: Value| {
        let mut s = json!({
            "name": name,
            "description": format!("{name} over HTTP"),
            "url": url,
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        });
        if let (Some(s), Some(extra)) = (s.as_object_mut(), extra.as_object()) {
            s.extend(extra.clone());
        }
        s
    };
    let declared = json!({"tools": [
        spec("http.echo", upstream.url("/echo"), json!({
            "idempotent": true, "waiting_hint": "asking the upstream",
            "headers": {"x-api-key": "k-123"}
        })),
        spec("http.unavailable", upstream.url("/unavailable"), json!({"idempotent": true, "max_attempts": 2})),
        spec("http.limited", upstream.url("/limited"), json!({})),
        spec("http.rejected", upstream.url("/rejected"), json!({"idempotent": true, "max_attempts": 3})),
        spec("http.slow", upstream.url("/slow"), json!({"timeout_ms": 300})),
        spec("http.not_json", upstream.url("/not-json"), json!({})),
        spec("http.gone", format!("http://127.0.0.1:{refused}/x"), json!({})),
    ]});
    std::fs::write(&file, serde_json::to_vec_pretty(&declared)?)?;

    let fleet = Fleet::start().await?;
    let settings = PackSettings {
        http_tools_file: Some(file),
        ..PackSettings::default()
    };
    let tools = packs::tools_with(&["http"], &settings)?;
    let listed = ["http.echo", "http.gone", "http.slow", "http.unavailable"];
    let (_c, _w) = fleet
        .start_with(fleet.coordinator_config(), tools, &listed)
        .await?;

    let args = json!({"city": "Sydney"});
    let calls = [
        "echo",
        "unavailable",
        "limited",
        "rejected",
        "slow",
        "not_json",
        "gone",
    ]
    .map(|id| call(id, &format!("http.{id}"), args.clone()));
    let outcome = fleet.run_calls("acme", calls.to_vec(), EVENT_WAIT).await?;
    let fin = &outcome.final_event;

    let echo = result_of(fin, "echo")?;
    assert_eq!(echo.state, CallState::Done, "{echo:?}");
    let value = echo.result.clone().unwrap_or_default();
    assert_eq!(value["method"], json!("POST"));
    assert_eq!(value["args"], args);
    assert_eq!(value["tenant"], json!("acme"));
    assert_eq!(value["turn"], json!(fin.turn_id));
    assert_eq!(value["call"], json!("echo"));
    assert_eq!(value["attempt"], json!("1"));
    assert_eq!(
        value["idempotency_key"],
        json!(format!("{}.echo", fin.turn_id))
    );
    assert_eq!(value["api_key"], json!("k-123"));
    assert_eq!(value["content_type"], json!("application/json"));
    assert_eq!(
        echo.summary.as_deref(),
        Some("The upstream echoed your request.")
    );

    let expect = |id: &str, code: &str, retryable: bool| -> Result<()> {
        let r = result_of(fin, id)?;
        assert_eq!(code_of(r), Some(code), "{id}: {r:?}");
        assert_eq!(
            r.error.as_ref().map(|e| e.retryable),
            Some(retryable),
            "{id}"
        );
        Ok(())
    };
    expect("unavailable", http_tool::UPSTREAM_UNAVAILABLE, true)?;
    expect("limited", http_tool::UPSTREAM_RATE_LIMITED, true)?;
    expect("rejected", http_tool::UPSTREAM_REJECTED, false)?;
    expect("slow", http_tool::UPSTREAM_TIMEOUT, true)?;
    expect("not_json", http_tool::UPSTREAM_INVALID_RESPONSE, false)?;
    expect("gone", http_tool::UPSTREAM_UNREACHABLE, true)?;
    assert!(result_of(fin, "rejected")?
        .error
        .as_ref()
        .is_some_and(|e| e.message.contains("unknown city")));

    // Retryable failures of idempotent tools are tried again; the others are not.
    assert_eq!(upstream.hits("/unavailable"), 2);
    assert_eq!(result_of(fin, "unavailable")?.attempts, 2);
    assert_eq!(upstream.hits("/rejected"), 1);
    assert_eq!(upstream.hits("/limited"), 1);
    assert_eq!(upstream.hits("/echo"), 1);
    assert!(result_of(fin, "slow")?.duration_ms < 2_000);
    Ok(())
}
