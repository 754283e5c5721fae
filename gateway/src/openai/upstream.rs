//! The model server behind `/v1/chat/completions`: any OpenAI-compatible endpoint
//! (`TOOLFLEET_UPSTREAM_BASE_URL`, `http://` or `https://`), asked for one completion at a
//! time, streamed or not.
//!
//! Owns the HTTP exchange: TLS (the system's roots, or `TOOLFLEET_UPSTREAM_CA_FILE`
//! instead, and a client certificate for servers that ask for one), the bearer key, the
//! request timeout, reading a streamed answer's `data:` lines up to `[DONE]`, and keeping
//! an upstream failure (status and body) so the caller gets it as the upstream sent it.
//! Never decides anything about tools or rounds (`openai/mod.rs` does).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Map, Value};
use toolfleet_common::metrics::ChatMetrics;
use toolfleet_common::tls::TlsFiles;

use crate::config::UpstreamConfig;

/// Largest answer (or error body) read from the upstream.
const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;

/// Why the upstream client could not be made from the configuration.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The base URL is not an `http://` or `https://` URL.
    #[error("TOOLFLEET_UPSTREAM_BASE_URL {url:?}: {reason}")]
    Url {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The key cannot be sent in a header.
    #[error("TOOLFLEET_UPSTREAM_API_KEY holds characters an HTTP header cannot carry")]
    Key,
    /// A certificate or key file could not be read or used.
    #[error("upstream TLS: {0}")]
    Tls(String),
}

type Http = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The upstream client (its `Debug` leaves the key out).
#[derive(Clone)]
pub struct Upstream {
    http: Http,
    url: Uri,
    authorization: Option<HeaderValue>,
    timeout: Duration,
    metrics: ChatMetrics,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// An upstream answer that is not a completion: passed through to the caller.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The upstream's status (502 when it could not be reached or answered nonsense, 504
    /// when it did not answer in time).
    pub status: StatusCode,
    /// Its body (an OpenAI error object when the gateway writes it).
    pub body: Bytes,
    /// Set when the gateway wrote the failure: `unavailable` or `timeout`.
    pub kind: Option<&'static str>,
}

impl Failure {
    fn gateway(message: String) -> Self {
        Self::written(StatusCode::BAD_GATEWAY, "unavailable", message)
    }

    fn written(status: StatusCode, kind: &'static str, message: String) -> Self {
        let code = match kind {
            "timeout" => "upstream_timeout",
            _ => "upstream_unavailable",
        };
        let body = serde_json::json!({"error": {
            "message": message, "type": "upstream_error", "code": code
        }});
        Self {
            status,
            body: Bytes::from(body.to_string()),
            kind: Some(kind),
        }
    }

    /// The body as JSON (an error object), for an event stream already under way.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(
            |_| serde_json::json!({"error": {"message": String::from_utf8_lossy(&self.body)}}),
        )
    }

    /// This failure's `error.type` in metrics: the gateway's kind, else the status.
    fn error_type(&self) -> String {
        self.kind
            .map(str::to_string)
            .unwrap_or_else(|| self.status.as_u16().to_string())
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

/// The TLS settings of upstream connections: `files`' CA instead of the system's roots
/// when set, and its client certificate when set.
fn tls_config(files: &TlsFiles) -> Result<rustls::ClientConfig, UpstreamError> {
    let tls = |e: &dyn std::fmt::Display| UpstreamError::Tls(e.to_string());
    let mut roots = rustls::RootCertStore::empty();
    match &files.ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| tls(&format!("{}: {e}", path.display())))?;
            for cert in certs {
                let cert = cert.map_err(|e| tls(&format!("{}: {e}", path.display())))?;
                roots.add(cert).map_err(|e| tls(&e))?;
            }
            if roots.is_empty() {
                return Err(tls(&format!("{} holds no certificate", path.display())));
            }
        }
        None => {
            // Certificates the system store holds but rustls cannot use are skipped.
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls(&e))?
        .with_root_certificates(roots);
    match &files.client {
        None => Ok(builder.with_no_client_auth()),
        Some(client) => {
            let chain = CertificateDer::pem_file_iter(&client.cert_file)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| tls(&format!("{}: {e}", client.cert_file.display())))?;
            let key = PrivateKeyDer::from_pem_file(&client.key_file)
                .map_err(|e| tls(&format!("{}: {e}", client.key_file.display())))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| tls(&e))
        }
    }
}

impl Upstream {
    /// The client of `config`'s upstream; `None` when no base URL is configured.
    pub fn new(config: &UpstreamConfig) -> Result<Option<Self>, UpstreamError> {
        let Some(base) = config.base_url.as_deref() else {
            return Ok(None);
        };
        let url_error = |reason: String| UpstreamError::Url {
            url: base.to_string(),
            reason,
        };
        let url: Uri = format!("{base}/chat/completions")
            .parse()
            .map_err(|e: axum::http::uri::InvalidUri| url_error(e.to_string()))?;
        if !matches!(url.scheme_str(), Some("http" | "https")) || url.host().is_none() {
            return Err(url_error("not an http:// or https:// URL".into()));
        }
        let authorization = match config.api_key.as_deref() {
            None => None,
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| UpstreamError::Key)?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(&config.tls)?)
            .https_or_http()
            .enable_http1()
            .build();
        let http = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Some(Self {
            http,
            url,
            authorization,
            timeout: config.timeout,
            metrics: ChatMetrics::new(),
        }))
    }

    /// The loop's instruments.
    pub fn metrics(&self) -> &ChatMetrics {
        &self.metrics
    }

    /// Times `request` as one GenAI operation for `body`'s model, bounded by the
    /// configured timeout.
    async fn measured<T>(
        &self,
        body: &Map<String, Value>,
        request: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        let started = Instant::now();
        let outcome = match tokio::time::timeout(self.timeout, request).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Failure::written(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout",
                format!("the upstream did not answer within {:?}", self.timeout),
            )),
        };
        let model = body.get("model").and_then(Value::as_str).unwrap_or("");
        let error = outcome.as_ref().err().map(Failure::error_type);
        self.metrics
            .upstream_request(model, started.elapsed().as_secs_f64(), error.as_deref());
        outcome
    }

    /// Sends `body`; the response when its status is a success, else the failure.
    async fn send(
        &self,
        body: &Map<String, Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, Failure> {
        let bytes = serde_json::to_vec(body)
            .map_err(|e| Failure::gateway(format!("the request could not be encoded: {e}")))?;
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(self.url.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json, text/event-stream");
        if let Some(authorization) = &self.authorization {
            request = request.header(header::AUTHORIZATION, authorization.clone());
        }
        let request = request
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| Failure::gateway(format!("the request could not be built: {e}")))?;
        let response =
            self.http.request(request).await.map_err(|e| {
                Failure::gateway(format!("the upstream did not answer: {}", chain(&e)))
            })?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let body = read_all(response).await.unwrap_or_default();
        Err(Failure {
            status,
            body,
            kind: None,
        })
    }

    /// One completion of `body` without streaming.
    pub async fn complete(&self, body: &Map<String, Value>) -> Result<Value, Failure> {
        let answer = self.measured(body, self.complete_once(body)).await?;
        if let Some(usage) = answer.get("usage") {
            let model = body.get("model").and_then(Value::as_str).unwrap_or("");
            self.metrics.usage(model, usage);
        }
        Ok(answer)
    }

    async fn complete_once(&self, body: &Map<String, Value>) -> Result<Value, Failure> {
        let mut body = body.clone();
        body.insert("stream".into(), Value::Bool(false));
        body.remove("stream_options");
        let response = self.send(&body).await?;
        let bytes = read_all(response).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| Failure::gateway(format!("the upstream's answer is not JSON: {e}")))
    }

    /// One streamed completion of `body`: every chunk, in order, up to `[DONE]`.
    pub async fn stream(&self, body: &Map<String, Value>) -> Result<Vec<Value>, Failure> {
        let chunks = self.measured(body, self.stream_once(body)).await?;
        if let Some(usage) = chunks.iter().rev().find_map(|c| c.get("usage")) {
            let model = body.get("model").and_then(Value::as_str).unwrap_or("");
            self.metrics.usage(model, usage);
        }
        Ok(chunks)
    }

    async fn stream_once(&self, body: &Map<String, Value>) -> Result<Vec<Value>, Failure> {
        let mut body = body.clone();
        body.insert("stream".into(), Value::Bool(true));
        let mut response = self.send(&body).await?;
        let mut buffer = Vec::new();
        let mut chunks = Vec::new();
        let mut read = 0usize;
        while let Some(frame) = response.body_mut().frame().await {
            let frame =
                frame.map_err(|e| Failure::gateway(format!("the upstream's stream broke: {e}")))?;
            let Ok(piece) = frame.into_data() else {
                continue;
            };
            read += piece.len();
            if read > MAX_ANSWER_BYTES {
                return Err(Failure::gateway(format!(
                    "the upstream's streamed answer passed {MAX_ANSWER_BYTES} bytes"
                )));
            }
            buffer.extend_from_slice(&piece);
            while let Some(end) = find_line_end(&buffer) {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim_end().strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    return Ok(chunks);
                }
                match serde_json::from_str::<Value>(data) {
                    Ok(chunk) if chunk.get("error").is_some() => {
                        return Err(Failure {
                            status: StatusCode::BAD_GATEWAY,
                            body: Bytes::from(chunk.to_string()),
                            kind: None,
                        })
                    }
                    Ok(chunk) => chunks.push(chunk),
                    Err(e) => {
                        return Err(Failure::gateway(format!(
                            "the upstream sent a chunk that is not JSON: {e}"
                        )))
                    }
                }
            }
        }
        // A stream closed without `[DONE]` still ends the answer.
        Ok(chunks)
    }
}

/// The whole body of `response`, at most [`MAX_ANSWER_BYTES`].
async fn read_all(response: hyper::Response<hyper::body::Incoming>) -> Result<Bytes, Failure> {
    Limited::new(response.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map(|body| body.to_bytes())
        .map_err(|e| Failure::gateway(format!("the upstream's answer could not be read: {e}")))
}

/// `error` with its sources, so the message names the cause (refused, TLS, DNS).
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn find_line_end(buffer: &[u8]) -> Option<usize> {
    buffer.iter().position(|b| *b == b'\n')
}
