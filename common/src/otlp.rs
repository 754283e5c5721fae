//! OTLP/HTTP span export (`http/protobuf`) whose request body is written straight from
//! the SDK's [`SpanData`], in one pass and one allocation per batch.
//!
//! The body is the `ExportTraceServiceRequest` of
//! `opentelemetry/proto/collector/trace/v1/trace_service.proto`, field for field what
//! `opentelemetry-otlp` sends (one `ResourceSpans`, one `ScopeSpans` per instrumentation
//! scope in order of first appearance, span flags with the "has is-remote" bit), without
//! building the intermediate message types first; the unit tests decode it with the
//! generated types and compare it with the reference conversion.
//!
//! Settings are the standard ones, read as `opentelemetry-otlp` reads them:
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as given, else `OTEL_EXPORTER_OTLP_ENDPOINT` with
//! `/v1/traces` appended, else `http://localhost:4318/v1/traces`;
//! `OTEL_EXPORTER_OTLP_TRACES_HEADERS` else `OTEL_EXPORTER_OTLP_HEADERS`
//! (`key=value,...`, values percent-decoded); `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` else
//! `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds, default 10 000). A compression setting
//! other than `none` is warned about and ignored (bodies go uncompressed, as before).
//!
//! A request answered 429, 502, 503 or 504, or not answered at all, is sent again after
//! 100 ms, 200 ms, 400 ms (plus up to 100 ms of jitter; a `Retry-After` in seconds is
//! honoured), while the timeout allows; any other status fails the batch.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;

/// Where and how spans are sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpExportConfig {
    /// The full URL spans are posted to.
    pub endpoint: String,
    /// Extra request headers (authentication, tenant).
    pub headers: Vec<(String, String)>,
    /// Limit of one export, retries included.
    pub timeout: Duration,
}

const DEFAULT_ENDPOINT: &str = "http://localhost:4318";
const TRACES_PATH: &str = "/v1/traces";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const RETRIES: u32 = 3;
const FIRST_DELAY: Duration = Duration::from_millis(100);

impl HttpExportConfig {
    /// Reads the standard `OTEL_EXPORTER_OTLP_*` variables (see the module docs).
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The configuration `var` (a variable lookup) describes.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let endpoint = match (
            set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            set("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            (Some(signal), _) => signal.trim().to_string(),
            (None, Some(base)) => join_path(base.trim(), TRACES_PATH),
            (None, None) => join_path(DEFAULT_ENDPOINT, TRACES_PATH),
        };
        let headers = set("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
            .or_else(|| set("OTEL_EXPORTER_OTLP_HEADERS"))
            .map(|v| parse_headers(&v))
            .unwrap_or_default();
        let millis = |name: &str| set(name).and_then(|v| v.trim().parse::<u64>().ok());
        let timeout = millis("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|| millis("OTEL_EXPORTER_OTLP_TIMEOUT"))
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_TIMEOUT);
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
            "OTEL_EXPORTER_OTLP_COMPRESSION",
        ] {
            if let Some(v) = set(name).filter(|v| !v.trim().eq_ignore_ascii_case("none")) {
                tracing::warn!(
                    variable = name,
                    value = v.as_str(),
                    "OTLP compression is not supported; spans are sent uncompressed"
                );
            }
        }
        Self {
            endpoint,
            headers,
            timeout,
        }
    }
}

fn join_path(base: &str, path: &str) -> String {
    match base.strip_suffix('/') {
        Some(b) => format!("{b}{path}"),
        None => format!("{base}{path}"),
    }
}

/// `key=value,key=value` with percent-encoded values; pairs without a key or a value
/// are skipped.
fn parse_headers(input: &str) -> Vec<(String, String)> {
    input
        .split_terminator(',')
        .filter_map(|pair| {
            let (k, v) = pair.trim().split_once('=')?;
            let (k, v) = (k.trim(), v.trim());
            let v = percent_decode(v).unwrap_or_else(|| v.to_string());
            (!k.is_empty() && !v.is_empty()).then(|| (k.to_string(), v))
        })
        .collect()
}

fn percent_decode(v: &str) -> Option<String> {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Exports spans over OTLP/HTTP with protobuf bodies.
#[derive(Debug)]
pub struct HttpSpanExporter {
    client: Mutex<Option<reqwest::blocking::Client>>,
    config: HttpExportConfig,
    headers: reqwest::header::HeaderMap,
    /// The encoded `Resource` message and the resource's schema URL.
    resource: (Vec<u8>, String),
}

/// The exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("OTLP/HTTP exporter: {0}")]
pub struct BuildError(String);

impl HttpSpanExporter {
    /// An exporter sending to `config`. The blocking HTTP client is built on a thread of
    /// its own (it must not be built inside an async runtime).
    pub fn new(config: HttpExportConfig) -> Result<Self, BuildError> {
        let mut headers = reqwest::header::HeaderMap::new();
        for (k, v) in &config.headers {
            let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                .map_err(|e| BuildError(format!("header name {k:?}: {e}")))?;
            let value = reqwest::header::HeaderValue::from_str(v)
                .map_err(|e| BuildError(format!("header {k}: {e}")))?;
            headers.insert(name, value);
        }
        let timeout = config.timeout;
        let client = std::thread::spawn(move || {
            reqwest::blocking::Client::builder()
                .timeout(timeout)
                .user_agent(concat!("toolfleet/", env!("CARGO_PKG_VERSION")))
                .build()
        })
        .join()
        .map_err(|_| BuildError("building the HTTP client panicked".into()))?
        .map_err(|e| BuildError(e.to_string()))?;
        Ok(Self {
            client: Mutex::new(Some(client)),
            config,
            headers,
            resource: (
                encode_resource(&Resource::builder_empty().build()),
                String::new(),
            ),
        })
    }

    fn client(&self) -> Option<reqwest::blocking::Client> {
        self.client.lock().ok().and_then(|c| c.clone())
    }

    fn post(&self, body: Vec<u8>) -> OTelSdkResult {
        let client = self
            .client()
            .ok_or_else(|| OTelSdkError::InternalFailure("exporter is shut down".into()))?;
        let body = bytes::Bytes::from(body);
        let deadline = Instant::now() + self.config.timeout;
        let mut delay = FIRST_DELAY;
        let mut attempt = 0;
        loop {
            let sent = client
                .post(&self.config.endpoint)
                .headers(self.headers.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
                .body(body.clone())
                .send();
            let (failure, wait) = match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(Duration::from_secs);
                    // Read the body so that the connection goes back to the pool.
                    let _ = response.bytes();
                    if (200..300).contains(&status) {
                        return Ok(());
                    }
                    let failure = format!("OTLP/HTTP export answered {status}");
                    if !matches!(status, 429 | 502 | 503 | 504) {
                        return Err(OTelSdkError::InternalFailure(failure));
                    }
                    (failure, retry_after)
                }
                Err(e) => (format!("OTLP/HTTP export failed: {e}"), None),
            };
            let pause = wait.unwrap_or(delay + jitter());
            attempt += 1;
            if attempt > RETRIES || Instant::now() + pause >= deadline {
                return Err(OTelSdkError::InternalFailure(failure));
            }
            std::thread::sleep(pause);
            delay *= 2;
        }
    }
}

fn jitter() -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Duration::from_millis(u64::from(nanos % 100))
}

impl SpanExporter for HttpSpanExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        if batch.is_empty() {
            return Ok(());
        }
        let body = encode_request(&batch, &self.resource.0, &self.resource.1);
        self.post(body)
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        // Dropped here, on the batch processor's thread, never inside a runtime.
        if let Ok(mut c) = self.client.lock() {
            c.take();
        }
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = (
            encode_resource(resource),
            resource.schema_url().unwrap_or_default().to_string(),
        );
    }
}

// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

fn varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

fn key(buf: &mut Vec<u8>, field: u32, wire: u32) {
    varint(buf, u64::from((field << 3) | wire));
}

fn bytes_field(buf: &mut Vec<u8>, field: u32, value: &[u8]) {
    key(buf, field, LEN);
    varint(buf, value.len() as u64);
    buf.extend_from_slice(value);
}

/// A string or bytes field, left out when empty (proto3 default).
fn opt_bytes(buf: &mut Vec<u8>, field: u32, value: &[u8]) {
    if !value.is_empty() {
        bytes_field(buf, field, value);
    }
}

/// A uint32/enum field, left out when zero.
fn opt_varint(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        key(buf, field, VARINT);
        varint(buf, value);
    }
}

fn opt_fixed64(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        key(buf, field, FIXED64);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

fn opt_fixed32(buf: &mut Vec<u8>, field: u32, value: u32) {
    if value != 0 {
        key(buf, field, FIXED32);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

/// A nested message: its key, then its length, then what `body` writes. One byte is
/// set aside for the length; a longer length moves the body up.
fn message(buf: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    key(buf, field, LEN);
    let at = buf.len();
    buf.push(0);
    body(buf);
    let len = buf.len() - at - 1;
    if len < 0x80 {
        buf[at] = len as u8;
        return;
    }
    // The length's varint, on the stack (a u64 takes at most 10 bytes).
    let mut prefix = [0u8; 10];
    let mut n = 0;
    let mut v = len as u64;
    while v >= 0x80 {
        prefix[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    prefix[n] = v as u8;
    let prefix = &prefix[..=n];
    let extra = prefix.len() - 1;
    buf.resize(buf.len() + extra, 0);
    buf.copy_within(at + 1..at + 1 + len, at + 1 + extra);
    buf[at..at + prefix.len()].copy_from_slice(prefix);
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// `AnyValue`: every member of its `oneof` is written, default or not.
fn any_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Bool(b) => {
            key(buf, 2, VARINT);
            buf.push(u8::from(*b));
        }
        Value::I64(i) => {
            key(buf, 3, VARINT);
            varint(buf, *i as u64);
        }
        Value::F64(f) => {
            key(buf, 4, FIXED64);
            buf.extend_from_slice(&f.to_le_bytes());
        }
        Value::String(s) => bytes_field(buf, 1, s.as_str().as_bytes()),
        Value::Array(array) => message(buf, 5, |buf| array_values(buf, array)),
        // `Value` is non-exhaustive; a kind added later goes as its text.
        #[allow(unreachable_patterns)]
        other => bytes_field(buf, 1, other.as_str().as_bytes()),
    }
}

fn array_values(buf: &mut Vec<u8>, array: &Array) {
    fn each<T>(buf: &mut Vec<u8>, items: &[T], f: impl Fn(&mut Vec<u8>, &T)) {
        for item in items {
            message(buf, 1, |buf| f(buf, item));
        }
    }
    match array {
        Array::Bool(v) => each(buf, v, |buf, b| any_value(buf, &Value::Bool(*b))),
        Array::I64(v) => each(buf, v, |buf, i| any_value(buf, &Value::I64(*i))),
        Array::F64(v) => each(buf, v, |buf, f| any_value(buf, &Value::F64(*f))),
        Array::String(v) => each(buf, v, |buf, s: &StringValue| {
            bytes_field(buf, 1, s.as_str().as_bytes())
        }),
        #[allow(unreachable_patterns)]
        _ => {}
    }
}

fn key_value(buf: &mut Vec<u8>, field: u32, k: &str, v: &Value) {
    message(buf, field, |buf| {
        opt_bytes(buf, 1, k.as_bytes());
        message(buf, 2, |buf| any_value(buf, v));
    });
}

fn attributes(buf: &mut Vec<u8>, field: u32, attrs: &[KeyValue]) {
    for kv in attrs {
        key_value(buf, field, kv.key.as_str(), &kv.value);
    }
}

/// The body of a `Resource` message.
fn encode_resource(resource: &Resource) -> Vec<u8> {
    let mut buf = Vec::new();
    for (k, v) in resource.iter() {
        key_value(&mut buf, 1, k.as_str(), v);
    }
    buf
}

/// Span flags: the W3C trace flags and the "parent is remote" bits
/// (`SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK`, `SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK`).
fn span_flags(remote: bool, trace_flags: u8) -> u32 {
    u32::from(trace_flags) | 0x100 | if remote { 0x200 } else { 0 }
}

fn span_kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

fn span(buf: &mut Vec<u8>, s: &SpanData) {
    let cx = &s.span_context;
    bytes_field(buf, 1, &cx.trace_id().to_bytes());
    bytes_field(buf, 2, &cx.span_id().to_bytes());
    let state = cx.trace_state().header();
    opt_bytes(buf, 3, state.as_bytes());
    if s.parent_span_id != opentelemetry::trace::SpanId::INVALID {
        bytes_field(buf, 4, &s.parent_span_id.to_bytes());
    }
    opt_bytes(buf, 5, s.name.as_bytes());
    opt_varint(buf, 6, span_kind(&s.span_kind));
    opt_fixed64(buf, 7, nanos(s.start_time));
    opt_fixed64(buf, 8, nanos(s.end_time));
    attributes(buf, 9, &s.attributes);
    opt_varint(buf, 10, u64::from(s.dropped_attributes_count));
    for e in s.events.iter() {
        message(buf, 11, |buf| {
            opt_fixed64(buf, 1, nanos(e.timestamp));
            opt_bytes(buf, 2, e.name.as_bytes());
            attributes(buf, 3, &e.attributes);
            opt_varint(buf, 4, u64::from(e.dropped_attributes_count));
        });
    }
    opt_varint(buf, 12, u64::from(s.events.dropped_count));
    for l in s.links.iter() {
        message(buf, 13, |buf| {
            let lcx = &l.span_context;
            bytes_field(buf, 1, &lcx.trace_id().to_bytes());
            bytes_field(buf, 2, &lcx.span_id().to_bytes());
            let state = lcx.trace_state().header();
            opt_bytes(buf, 3, state.as_bytes());
            attributes(buf, 4, &l.attributes);
            opt_varint(buf, 5, u64::from(l.dropped_attributes_count));
            opt_fixed32(
                buf,
                6,
                span_flags(lcx.is_remote(), lcx.trace_flags().to_u8()),
            );
        });
    }
    opt_varint(buf, 14, u64::from(s.links.dropped_count));
    message(buf, 15, |buf| {
        let (message, code): (&str, u64) = match &s.status {
            Status::Unset => ("", 0),
            Status::Ok => ("", 1),
            Status::Error { description } => (description.as_ref(), 2),
        };
        opt_bytes(buf, 2, message.as_bytes());
        opt_varint(buf, 3, code);
    });
    opt_fixed32(
        buf,
        16,
        span_flags(
            s.parent_span_is_remote,
            s.span_context.trace_flags().to_u8(),
        ),
    );
}

fn scope(buf: &mut Vec<u8>, scope: &InstrumentationScope) {
    opt_bytes(buf, 1, scope.name().as_bytes());
    opt_bytes(buf, 2, scope.version().unwrap_or_default().as_bytes());
    for kv in scope.attributes() {
        key_value(buf, 3, kv.key.as_str(), &kv.value);
    }
}

/// The `ExportTraceServiceRequest` carrying `spans` of the resource whose encoded
/// attributes are `resource` (schema URL `schema_url`).
pub fn encode_request(spans: &[SpanData], resource: &[u8], schema_url: &str) -> Vec<u8> {
    // Spans grouped by scope, scopes in order of first appearance.
    let mut groups: Vec<(&InstrumentationScope, Vec<&SpanData>)> = Vec::new();
    for s in spans {
        let scope = &s.instrumentation_scope;
        match groups.iter_mut().find(|(g, _)| *g == scope) {
            Some((_, members)) => members.push(s),
            None => groups.push((scope, vec![s])),
        }
    }
    let mut buf = Vec::with_capacity(resource.len() + 64 + spans.len() * 512);
    message(&mut buf, 1, |buf| {
        message(buf, 1, |buf| buf.extend_from_slice(resource));
        for (sc, members) in &groups {
            message(buf, 2, |buf| {
                message(buf, 1, |buf| scope(buf, sc));
                for s in members {
                    message(buf, 2, |buf| span(buf, s));
                }
                opt_bytes(buf, 3, sc.schema_url().unwrap_or_default().as_bytes());
            });
        }
        opt_bytes(buf, 3, schema_url.as_bytes());
    });
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Event, Link, SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use prost::Message;
    use std::borrow::Cow;

    fn scope(name: &'static str) -> InstrumentationScope {
        InstrumentationScope::builder(name)
            .with_version("1.2.3")
            .with_schema_url("https://opentelemetry.io/schemas/1.26.0")
            .with_attributes([KeyValue::new("scope.attr", 7i64)])
            .build()
    }

    fn span(n: u64, scope: InstrumentationScope, status: Status) -> SpanData {
        let trace_state = TraceState::from_key_value([("vendor", "x1")]).unwrap_or_default();
        let cx = SpanContext::new(
            TraceId::from(0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736 + u128::from(n)),
            SpanId::from(0x00f0_67aa_0ba9_02b7 + n),
            TraceFlags::SAMPLED,
            false,
            trace_state,
        );
        let mut events = SpanEvents::default();
        events.events.push(Event::new(
            "retry",
            UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789),
            vec![KeyValue::new("attempt", 2i64)],
            1,
        ));
        events.dropped_count = 3;
        let mut links = SpanLinks::default();
        links.links.push(Link::new(
            SpanContext::new(
                TraceId::from(77u128),
                SpanId::from(78u64),
                TraceFlags::default(),
                true,
                TraceState::default(),
            ),
            vec![KeyValue::new("link.kind", "producer")],
            0,
        ));
        SpanData {
            span_context: cx,
            parent_span_id: if n.is_multiple_of(2) {
                SpanId::from(0x1111 + n)
            } else {
                SpanId::INVALID
            },
            parent_span_is_remote: n.is_multiple_of(3),
            span_kind: [
                SpanKind::Internal,
                SpanKind::Server,
                SpanKind::Client,
                SpanKind::Producer,
                SpanKind::Consumer,
            ][(n % 5) as usize]
                .clone(),
            name: Cow::Owned(format!("span-{n}")),
            start_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_000_000_000 + n),
            end_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_500_000_000 + n),
            attributes: vec![
                KeyValue::new("toolfleet.turn.id", "t-1"),
                KeyValue::new("empty", ""),
                KeyValue::new("count", -3i64),
                KeyValue::new("big", i64::MAX),
                KeyValue::new("ratio", 0.25f64),
                KeyValue::new("ok", false),
                KeyValue::new("flag", true),
                KeyValue::new(
                    "long",
                    "x".repeat(300 + n as usize), // a length of two varint bytes
                ),
                KeyValue::new(
                    "names",
                    Value::Array(Array::String(vec!["a".into(), "".into(), "ccc".into()])),
                ),
                KeyValue::new("ints", Value::Array(Array::I64(vec![1, -1, 0]))),
                KeyValue::new("floats", Value::Array(Array::F64(vec![1.5, 0.0]))),
                KeyValue::new("bools", Value::Array(Array::Bool(vec![true, false]))),
            ],
            dropped_attributes_count: 2,
            events,
            links,
            status,
            instrumentation_scope: scope,
        }
    }

    fn resource() -> Resource {
        Resource::builder_empty()
            .with_attributes([
                KeyValue::new("service.name", "toolfleet-coordinator"),
                KeyValue::new("service.instance.id", "host-42"),
            ])
            .with_schema_url(
                [KeyValue::new("service.version", "0.1.0")],
                "https://opentelemetry.io/schemas/1.26.0",
            )
            .build()
    }

    /// What `opentelemetry-otlp` would send for `spans`, decoded.
    fn reference(spans: Vec<SpanData>, resource: &Resource) -> ExportTraceServiceRequest {
        let r = ResourceAttributesWithSchema::from(resource);
        ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(spans, &r),
        }
    }

    fn ours(spans: &[SpanData], resource: &Resource) -> ExportTraceServiceRequest {
        let body = encode_request(
            spans,
            &encode_resource(resource),
            resource.schema_url().unwrap_or_default(),
        );
        ExportTraceServiceRequest::decode(body.as_slice()).unwrap_or_default()
    }

    #[test]
    fn the_body_decodes_to_what_the_reference_conversion_builds() {
        let spans: Vec<SpanData> = (0..12)
            .map(|n| {
                let status = match n % 3 {
                    0 => Status::Unset,
                    1 => Status::Ok,
                    _ => Status::error(format!("call {n} timed out")),
                };
                let sc = if n % 4 == 3 {
                    scope("other")
                } else {
                    scope("toolfleet")
                };
                span(n, sc, status)
            })
            .collect();
        let resource = resource();
        let expected = reference(spans.clone(), &resource);
        let got = ours(&spans, &resource);
        assert_eq!(got.resource_spans.len(), 1);
        assert_eq!(got.resource_spans[0].scope_spans.len(), 2);
        assert_eq!(got.resource_spans[0].scope_spans[0].spans.len(), 9);
        assert_eq!(got, expected);
    }

    #[test]
    fn a_minimal_span_and_an_empty_resource_match_too() {
        let mut s = span(1, InstrumentationScope::builder("t").build(), Status::Unset);
        s.attributes.clear();
        s.events = SpanEvents::default();
        s.links = SpanLinks::default();
        s.dropped_attributes_count = 0;
        s.span_context = SpanContext::new(
            TraceId::from(1u128),
            SpanId::from(2u64),
            TraceFlags::default(),
            false,
            TraceState::default(),
        );
        let resource = Resource::builder_empty().build();
        assert_eq!(
            ours(std::slice::from_ref(&s), &resource),
            reference(vec![s], &resource)
        );
    }

    #[test]
    fn lengths_of_every_size_are_written_minimally() {
        for len in [0usize, 1, 127, 128, 129, 16_383, 16_384, 70_000] {
            let mut buf = vec![9u8];
            message(&mut buf, 1, |b| b.extend(std::iter::repeat_n(7u8, len)));
            let mut expected = vec![9u8, 0x0a];
            varint(&mut expected, len as u64);
            expected.extend(std::iter::repeat_n(7u8, len));
            assert_eq!(buf, expected, "length {len}");
        }
    }

    #[test]
    fn settings_are_read_as_the_standard_variables_say() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let c = HttpExportConfig::from_vars(vars(&[]));
        assert_eq!(c.endpoint, "http://localhost:4318/v1/traces");
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        let c = HttpExportConfig::from_vars(vars(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "api-key=a%20b, tenant=t1,bad,=x",
            ),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
        ]));
        assert_eq!(c.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(
            c.headers,
            vec![
                ("api-key".to_string(), "a b".to_string()),
                ("tenant".to_string(), "t1".to_string())
            ]
        );
        assert_eq!(c.timeout, Duration::from_millis(2500));
        let c = HttpExportConfig::from_vars(vars(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://traces:9999/custom",
            ),
            ("OTEL_EXPORTER_OTLP_HEADERS", "a=1"),
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "b=2"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "700"),
        ]));
        assert_eq!(c.endpoint, "http://traces:9999/custom");
        assert_eq!(c.headers, vec![("b".to_string(), "2".to_string())]);
        assert_eq!(c.timeout, Duration::from_millis(700));
    }
}
