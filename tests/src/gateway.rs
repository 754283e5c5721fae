//! The HTTP gateway under test: a `gateway-node` child process (the gateway binary's
//! code) on a free loopback port, serving a [`Fleet`]'s NATS, with its API keys in a
//! [`TestDatabase`]; and the helpers the gateway tests share (make a key, read an event
//! stream, compare two finals).
//!
//! Owns the process it starts (killed on drop). Never talks to the coordinator or Redis
//! itself: everything goes through HTTP like a frontend's requests.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::Value;
use tokio::process::Child;

use crate::fleet::{Fleet, Running};
use crate::pg::TestDatabase;

/// How long the gateway may take to answer `/readyz`.
const START_WAIT: Duration = Duration::from_secs(20);
/// Longest wait for one HTTP answer in the tests.
pub const HTTP_WAIT: Duration = Duration::from_secs(20);

/// Path of the `gateway-node` test binary, beside the running test executable's `deps/`.
pub fn gateway_node_path() -> Result<std::path::PathBuf> {
    crate::fleet::test_binary("gateway-node")
}

/// A running gateway process.
pub struct GatewayNode {
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// An HTTP client.
    pub http: reqwest::Client,
    child: Child,
}

/// What most gateway tests start with: a fleet with its default coordinator and worker,
/// a database for API keys, and a `gateway-node` on both with `extra` settings, in the
/// order a test binds them (dropped the other way round, gateway first).
pub async fn stack(
    extra: &[(&str, &str)],
) -> Result<(Fleet, Running, Running, TestDatabase, GatewayNode)> {
    let (fleet, coordinator, worker) = Fleet::start_with_default_nodes().await?;
    let db = TestDatabase::create().await?;
    let gateway = GatewayNode::start(&fleet, &db, extra).await?;
    Ok((fleet, coordinator, worker, db, gateway))
}

impl GatewayNode {
    /// Starts a gateway on `fleet`'s NATS with keys in `db`, with `extra` environment
    /// (`TOOLFLEET_GATEWAY_*` limits), and waits until `/readyz` answers 200.
    pub async fn start(fleet: &Fleet, db: &TestDatabase, extra: &[(&str, &str)]) -> Result<Self> {
        Self::start_on(&fleet.nats.url(), fleet.names.prefix(), db, extra).await
    }

    /// Like [`GatewayNode::start`], on NATS at `nats_url` under `prefix`.
    pub async fn start_on(
        nats_url: &str,
        prefix: &str,
        db: &TestDatabase,
        extra: &[(&str, &str)],
    ) -> Result<Self> {
        let port = crate::free_port()?;
        let mut cmd = crate::child_command(gateway_node_path()?, Stdio::null());
        cmd.env("TOOLFLEET_NATS_URL", nats_url)
            .env("TOOLFLEET_PREFIX", prefix)
            .env("TOOLFLEET_DATABASE_URL", db.url())
            .env("TOOLFLEET_GATEWAY_ADDR", format!("127.0.0.1:{port}"))
            .env("TOOLFLEET_GATEWAY_KEY_CACHE_MS", "0")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .envs(extra.iter().copied());
        let child = cmd.spawn().context("spawning gateway-node")?;
        let node = Self {
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder().timeout(HTTP_WAIT).build()?,
            child,
        };
        node.wait_ready().await?;
        Ok(node)
    }

    async fn wait_ready(&self) -> Result<()> {
        let url = format!("{}/readyz", self.base);
        crate::eventually_named("the gateway to be ready", START_WAIT, || async {
            let response = self.http.get(&url).send().await.ok()?;
            response.status().is_success().then_some(())
        })
        .await
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET path` (under `key` where given); the answer's body as JSON, whatever its
    /// status.
    pub async fn get_json(&self, path: &str, key: Option<&str>) -> Result<Value> {
        let mut request = self.http.get(self.url(path));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        Ok(request.send().await?.json().await?)
    }

    /// `GET path` without a key; the answer's body as text, whatever its status.
    pub async fn get_text(&self, path: &str) -> Result<String> {
        Ok(self.http.get(self.url(path)).send().await?.text().await?)
    }

    /// `POST path` with no body under `key`; the answer's body as JSON, whatever its
    /// status.
    pub async fn post_for_json(&self, path: &str, key: &str) -> Result<Value> {
        let request = self.http.post(self.url(path)).bearer_auth(key);
        Ok(request.send().await?.json().await?)
    }

    /// The gateway process's id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// `POST /v1/turns` with `body` under `key`, as an event stream.
    pub async fn stream_turn(&self, key: &str, body: &Value) -> Result<reqwest::Response> {
        Ok(self
            .http
            .post(self.url("/v1/turns"))
            .bearer_auth(key)
            .header("accept", "text/event-stream")
            .json(body)
            .send()
            .await?)
    }

    /// `POST /v1/turns?events=true` with `body` under `key`, as one JSON answer.
    pub async fn json_turn(&self, key: &str, body: &Value) -> Result<reqwest::Response> {
        Ok(self
            .http
            .post(self.url("/v1/turns?events=true"))
            .bearer_auth(key)
            .json(body)
            .send()
            .await?)
    }
}

/// A fresh API key for `tenant` in `db`.
pub async fn create_key(db: &TestDatabase, tenant: &str) -> Result<String> {
    let admin = db.admin().await?;
    Ok(toolfleet_gateway::keys::create(&admin, tenant, "test")
        .await?
        .key)
}

/// One Server-Sent Event: its `id:`, `event:` and `data:` parsed as JSON.
#[derive(Debug, Clone)]
pub struct SseEvent {
    /// The `id:` line, if any.
    pub id: Option<String>,
    /// The `event:` line.
    pub event: String,
    /// The `data:` lines joined, as JSON.
    pub data: Value,
    /// The `data:` text exactly as sent.
    pub raw: String,
}

/// Reads `response` as an event stream to its end (each chunk bounded by [`HTTP_WAIT`]).
pub async fn read_events(response: reqwest::Response) -> Result<Vec<SseEvent>> {
    let mut body = response.bytes_stream();
    let mut buffer = String::new();
    let mut events = Vec::new();
    loop {
        let chunk = tokio::time::timeout(HTTP_WAIT, body.next())
            .await
            .context("the event stream stalled")?;
        let Some(chunk) = chunk else { break };
        buffer.push_str(std::str::from_utf8(&chunk?)?);
        while let Some(cut) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..cut + 2).collect();
            events.push(parse_frame(&frame)?);
        }
    }
    if !buffer.trim().is_empty() {
        bail!("the stream ended inside a frame: {buffer:?}");
    }
    Ok(events)
}

/// Reads the first `n` events of `response`, then drops the connection: a client that
/// goes away mid-stream.
pub async fn read_first_events(response: reqwest::Response, n: usize) -> Result<Vec<SseEvent>> {
    let mut body = response.bytes_stream();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while events.len() < n {
        let chunk = tokio::time::timeout(HTTP_WAIT, body.next())
            .await
            .context("the event stream stalled")?
            .context("the event stream ended early")?;
        buffer.push_str(std::str::from_utf8(&chunk?)?);
        while let Some(cut) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..cut + 2).collect();
            events.push(parse_frame(&frame)?);
        }
    }
    events.truncate(n);
    Ok(events)
}

fn parse_frame(frame: &str) -> Result<SseEvent> {
    let (mut id, mut event, mut data) = (None, String::from("message"), Vec::new());
    for line in frame.lines() {
        if let Some(v) = line.strip_prefix("id:") {
            id = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("event:") {
            event = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
        }
    }
    let raw = data.join("\n");
    Ok(SseEvent {
        id,
        event,
        data: serde_json::from_str(&raw).with_context(|| format!("data is not JSON: {raw}"))?,
        raw,
    })
}

/// A `final` event with what differs between two runs of the same decision replaced by
/// placeholders: the turn id, generated call ids (by order of appearance), and the
/// results' times, durations, attempts and worker ids.
pub fn comparable_final(fin: &Value) -> Value {
    let mut text = serde_json::to_string(fin).unwrap_or_default();
    let mut replace = |from: &str, to: String| text = text.replace(from, &to);
    if let Some(turn) = fin["turn_id"].as_str() {
        replace(turn, "<turn>".into());
    }
    let ids: Vec<String> = fin["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["tool_call_id"].as_str().map(String::from))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        if id.starts_with("call_") && id.len() > 20 {
            replace(id, format!("<call {i}>"));
        }
    }
    let text = mask_volatile(&text);
    let mut value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    if let Some(results) = value["results"].as_array_mut() {
        for result in results {
            for field in [
                "started_at",
                "ended_at",
                "duration_ms",
                "attempts",
                "worker_id",
            ] {
                if let Some(object) = result.as_object_mut() {
                    object.remove(field);
                }
            }
        }
    }
    value
}

/// `text` with every RFC 3339 UTC time (`2026-11-24T16:39:18.273Z`) replaced by `<time>`
/// and every `duration_ms` number (also inside escaped JSON) by 0.
fn mask_volatile(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if let Some(len) = time_at(&bytes[i..]) {
            out.push_str("<time>");
            i += len;
            continue;
        }
        for key in ["duration_ms\\\":", "duration_ms\":"] {
            if text[i..].starts_with(key) {
                out.push_str(key);
                i += key.len();
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
                out.push('0');
            }
        }
        if let Some(c) = text[i..].chars().next() {
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The length of the RFC 3339 UTC time at the start of `b`, if one is there.
fn time_at(b: &[u8]) -> Option<usize> {
    let digits = |range: std::ops::Range<usize>| {
        range
            .clone()
            .all(|k| b.get(k).is_some_and(u8::is_ascii_digit))
    };
    let shape = digits(0..4)
        && b.get(4) == Some(&b'-')
        && digits(5..7)
        && b.get(7) == Some(&b'-')
        && digits(8..10)
        && b.get(10) == Some(&b'T')
        && digits(11..13)
        && b.get(13) == Some(&b':')
        && digits(14..16)
        && b.get(16) == Some(&b':')
        && digits(17..19);
    if !shape {
        return None;
    }
    let mut end = 19;
    if b.get(end) == Some(&b'.') {
        end += 1;
        while b.get(end).is_some_and(u8::is_ascii_digit) {
            end += 1;
        }
    }
    (b.get(end) == Some(&b'Z')).then_some(end + 1)
}
