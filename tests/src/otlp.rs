//! An OTLP/HTTP trace receiver running inside a test: accepts
//! `POST /v1/traces` (protobuf), keeps every span, answers `/v1/metrics` with success
//! (counting those posts).
//!
//! Owns decoding exported spans into [`ReceivedSpan`] (attributes with their OTLP type,
//! resource, status message, events, links) and [`render_tree`], the indented span tree
//! of one trace that tests print and docs/OBSERVABILITY.md quotes. Never asserts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// One received span, flattened.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    /// `service.name` of the exporting process.
    pub service: String,
    /// Span name.
    pub name: String,
    /// Trace id, hex.
    pub trace_id: String,
    /// Span id, hex.
    pub span_id: String,
    /// Parent span id, hex (empty for a root).
    pub parent_span_id: String,
    /// OTLP span kind (1 internal, 2 server, 3 client, 4 producer, 5 consumer).
    pub kind: i32,
    /// String, int, bool and double attributes, as strings.
    pub attributes: HashMap<String, String>,
    /// The OTLP type of each attribute: `string`, `int`, `bool` or `double`.
    pub attribute_types: HashMap<String, &'static str>,
    /// Resource attributes of the exporting process, as strings.
    pub resource: HashMap<String, String>,
    /// OTLP status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
    /// The status description.
    pub status_message: String,
    /// Events: name and attributes (as strings).
    pub events: Vec<(String, HashMap<String, String>)>,
    /// Links: trace id and span id, hex.
    pub links: Vec<(String, String)>,
    /// Start time, Unix nanoseconds.
    pub start_unix_nano: u64,
    /// End time, Unix nanoseconds.
    pub end_unix_nano: u64,
}

impl ReceivedSpan {
    /// An attribute's value.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// The receiver; dropping it stops it.
pub struct OtlpReceiver {
    port: u16,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    metrics_posts: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attrs(list: &[KeyValue]) -> HashMap<String, String> {
    typed_attrs(list)
        .into_iter()
        .map(|(k, (v, _))| (k, v))
        .collect()
}

fn typed_attrs(list: &[KeyValue]) -> HashMap<String, (String, &'static str)> {
    list.iter()
        .filter_map(|kv| {
            let v = kv.value.as_ref()?.value.as_ref()?;
            let s = match v {
                AnyValue::StringValue(s) => (s.clone(), "string"),
                AnyValue::IntValue(i) => (i.to_string(), "int"),
                AnyValue::BoolValue(b) => (b.to_string(), "bool"),
                AnyValue::DoubleValue(d) => (d.to_string(), "double"),
                _ => return None,
            };
            Some((kv.key.clone(), s))
        })
        .collect()
}

fn received(
    resource: &HashMap<String, String>,
    s: opentelemetry_proto::tonic::trace::v1::Span,
) -> ReceivedSpan {
    let typed = typed_attrs(&s.attributes);
    ReceivedSpan {
        service: resource.get("service.name").cloned().unwrap_or_default(),
        resource: resource.clone(),
        name: s.name.clone(),
        trace_id: hex(&s.trace_id),
        span_id: hex(&s.span_id),
        parent_span_id: hex(&s.parent_span_id),
        kind: s.kind,
        attributes: typed
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect(),
        attribute_types: typed.iter().map(|(k, (_, t))| (k.clone(), *t)).collect(),
        status_code: s.status.as_ref().map_or(0, |st| st.code),
        status_message: s
            .status
            .as_ref()
            .map(|st| st.message.clone())
            .unwrap_or_default(),
        events: s
            .events
            .iter()
            .map(|e| (e.name.clone(), attrs(&e.attributes)))
            .collect(),
        links: s
            .links
            .iter()
            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
            .collect(),
        start_unix_nano: s.start_time_unix_nano,
        end_unix_nano: s.end_time_unix_nano,
    }
}

impl OtlpReceiver {
    /// Starts listening on a free loopback port.
    pub async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let metrics_posts = Arc::new(AtomicU64::new(0));
        let store = Arc::clone(&spans);
        let posts = Arc::clone(&metrics_posts);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let store = Arc::clone(&store);
                let posts = Arc::clone(&posts);
                tokio::spawn(async move {
                    let _ = serve_connection(stream, store, posts).await;
                });
            }
        });
        Ok(Self {
            port,
            spans,
            metrics_posts,
            task,
        })
    }

    /// The endpoint for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        match self.spans.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Metric exports (`POST /v1/metrics`) received so far.
    pub fn metrics_posts(&self) -> u64 {
        self.metrics_posts.load(Ordering::Relaxed)
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    store: Arc<Mutex<Vec<ReceivedSpan>>>,
    metrics_posts: Arc<AtomicU64>,
) -> Result<()> {
    loop {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut byte)).await??;
            if n == 0 {
                return Ok(());
            }
            head.push(byte[0]);
            anyhow::ensure!(head.len() < 64 * 1024, "request head too large");
        }
        let text = String::from_utf8_lossy(&head).to_string();
        let path = text.split_whitespace().nth(1).unwrap_or("/").to_string();
        let length = text
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())
                    .flatten()
            })
            .unwrap_or(0);
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).await?;
        if path.starts_with("/v1/metrics") {
            metrics_posts.fetch_add(1, Ordering::Relaxed);
        }
        if path.starts_with("/v1/traces") {
            if let Ok(request) = ExportTraceServiceRequest::decode(body.as_slice()) {
                let mut spans = Vec::new();
                for rs in request.resource_spans {
                    let resource = rs
                        .resource
                        .as_ref()
                        .map(|r| attrs(&r.attributes))
                        .unwrap_or_default();
                    for ss in rs.scope_spans {
                        spans.extend(ss.spans.into_iter().map(|s| received(&resource, s)));
                    }
                }
                match store.lock() {
                    Ok(mut g) => g.extend(spans),
                    Err(p) => p.into_inner().extend(spans),
                }
            }
        }
        let response =
            "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
        stream.write_all(response.as_bytes()).await?;
    }
}

/// The spans of `trace_id` as an indented tree, one line per span: name, kind, service
/// and instance, duration, offset from the trace's first span, status and the
/// attributes in `shown`; a span whose parent never arrived is listed under
/// `MISSING PARENT`.
pub fn render_tree(spans: &[ReceivedSpan], trace_id: &str, shown: &[&str]) -> String {
    let mine: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    let t0 = mine.iter().map(|s| s.start_unix_nano).min().unwrap_or(0);
    let ids: std::collections::HashSet<&str> = mine.iter().map(|s| s.span_id.as_str()).collect();
    let mut out = String::new();
    let mut roots: Vec<&ReceivedSpan> = mine
        .iter()
        .filter(|s| !ids.contains(s.parent_span_id.as_str()))
        .copied()
        .collect();
    roots.sort_by_key(|s| s.start_unix_nano);
    for root in roots {
        if !root.parent_span_id.is_empty() {
            out.push_str(&format!("MISSING PARENT {}\n", root.parent_span_id));
        }
        render_node(&mine, root, 0, t0, shown, &mut out);
    }
    out
}

fn render_node(
    all: &[&ReceivedSpan],
    span: &ReceivedSpan,
    depth: usize,
    t0: u64,
    shown: &[&str],
    out: &mut String,
) {
    const KINDS: [&str; 6] = ["", "internal", "server", "client", "producer", "consumer"];
    let kind = KINDS.get(span.kind as usize).copied().unwrap_or("?");
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut line = format!(
        "{}{} [{kind}] {}",
        "  ".repeat(depth),
        span.name,
        span.service
    );
    if let Some(instance) = span.resource.get("service.instance.id") {
        line.push_str(&format!("@{instance}"));
    }
    line.push_str(&format!(
        " +{:.0}ms {:.1}ms",
        ms(span.start_unix_nano.saturating_sub(t0)),
        ms(span.end_unix_nano.saturating_sub(span.start_unix_nano))
    ));
    if span.status_code == 2 {
        line.push_str(&format!(" ERROR {:?}", span.status_message));
    }
    for key in shown {
        if let Some(v) = span.attr(key) {
            line.push_str(&format!(" {key}={v}"));
        }
    }
    for (name, a) in &span.events {
        let what = a
            .get("error.type")
            .or_else(|| a.get("exception.type"))
            .cloned()
            .unwrap_or_default();
        let id = a.get("gen_ai.tool.call.id").cloned().unwrap_or_default();
        line.push_str(&format!(" <event {name} {id} {what}>"));
    }
    out.push_str(&line);
    out.push('\n');
    let mut children: Vec<&ReceivedSpan> = all
        .iter()
        .filter(|s| s.parent_span_id == span.span_id)
        .copied()
        .collect();
    children.sort_by_key(|s| s.start_unix_nano);
    for child in children {
        render_node(all, child, depth + 1, t0, shown, out);
    }
}
