//! An OTLP/HTTP trace receiver running inside a test: accepts
//! `POST /v1/traces` (protobuf), keeps every span, answers `/v1/metrics` with success.

use std::collections::HashMap;
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
    /// OTLP status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
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
    list.iter()
        .filter_map(|kv| {
            let v = kv.value.as_ref()?.value.as_ref()?;
            let s = match v {
                AnyValue::StringValue(s) => s.clone(),
                AnyValue::IntValue(i) => i.to_string(),
                AnyValue::BoolValue(b) => b.to_string(),
                AnyValue::DoubleValue(d) => d.to_string(),
                _ => return None,
            };
            Some((kv.key.clone(), s))
        })
        .collect()
}

impl OtlpReceiver {
    /// Starts listening on a free loopback port.
    pub async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let store = Arc::clone(&spans);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let _ = serve_connection(stream, store).await;
                });
            }
        });
        Ok(Self { port, spans, task })
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
}

async fn serve_connection(
    mut stream: TcpStream,
    store: Arc<Mutex<Vec<ReceivedSpan>>>,
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
        if path.starts_with("/v1/traces") {
            if let Ok(request) = ExportTraceServiceRequest::decode(body.as_slice()) {
                let mut received = Vec::new();
                for rs in request.resource_spans {
                    let service = rs
                        .resource
                        .as_ref()
                        .map(|r| attrs(&r.attributes))
                        .and_then(|a| a.get("service.name").cloned())
                        .unwrap_or_default();
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            received.push(ReceivedSpan {
                                service: service.clone(),
                                name: s.name.clone(),
                                trace_id: hex(&s.trace_id),
                                span_id: hex(&s.span_id),
                                parent_span_id: hex(&s.parent_span_id),
                                kind: s.kind,
                                attributes: attrs(&s.attributes),
                                status_code: s.status.as_ref().map_or(0, |st| st.code),
                                start_unix_nano: s.start_time_unix_nano,
                                end_unix_nano: s.end_time_unix_nano,
                            });
                        }
                    }
                }
                match store.lock() {
                    Ok(mut g) => g.extend(received),
                    Err(p) => p.into_inner().extend(received),
                }
            }
        }
        let response =
            "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
        stream.write_all(response.as_bytes()).await?;
    }
}
