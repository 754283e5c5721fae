//! The model server behind `/v1/chat/completions`: any OpenAI-compatible endpoint
//! (`TOOLFLEET_UPSTREAM_BASE_URL`), asked for one completion at a time, streamed or not.
//!
//! Owns the HTTP exchange: the bearer key, the request timeout, reading a streamed
//! answer's `data:` lines up to `[DONE]`, and keeping an upstream failure (status and
//! body) so the caller gets it as the upstream sent it. Never decides anything about
//! tools or rounds (`openai/mod.rs` does).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Map, Value};

use crate::config::UpstreamConfig;

/// The upstream client (its `Debug` leaves the key out).
#[derive(Clone)]
pub struct Upstream {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
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
    /// The upstream's status (502 when it could not be reached or answered nonsense).
    pub status: StatusCode,
    /// Its body (an OpenAI error object when the gateway writes it).
    pub body: Bytes,
}

impl Failure {
    fn gateway(message: String) -> Self {
        let body = serde_json::json!({"error": {
            "message": message, "type": "upstream_error", "code": "upstream_unavailable"
        }});
        Self {
            status: StatusCode::BAD_GATEWAY,
            body: Bytes::from(body.to_string()),
        }
    }

    /// The body as JSON (an error object), for an event stream already under way.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(
            |_| serde_json::json!({"error": {"message": String::from_utf8_lossy(&self.body)}}),
        )
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body).into_response();
        response.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        response
    }
}

impl Upstream {
    /// The client of `config`'s upstream; `None` when no base URL is configured.
    pub fn new(config: &UpstreamConfig) -> Option<Self> {
        let base = config.base_url.as_deref()?;
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .build()
            .ok()?;
        Some(Self {
            http,
            url: format!("{base}/chat/completions"),
            api_key: config.api_key.clone(),
        })
    }

    async fn send(&self, body: &Map<String, Value>) -> Result<reqwest::Response, Failure> {
        let mut request = self.http.post(&self.url).json(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = request
            .send()
            .await
            .map_err(|e| Failure::gateway(format!("the upstream did not answer: {e}")))?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status =
            StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let body = response.bytes().await.unwrap_or_default();
        Err(Failure { status, body })
    }

    /// One completion of `body` without streaming.
    pub async fn complete(&self, body: &Map<String, Value>) -> Result<Value, Failure> {
        let mut body = body.clone();
        body.insert("stream".into(), Value::Bool(false));
        body.remove("stream_options");
        let response = self.send(&body).await?;
        response
            .json::<Value>()
            .await
            .map_err(|e| Failure::gateway(format!("the upstream's answer is not JSON: {e}")))
    }

    /// One streamed completion of `body`: every chunk, in order, up to `[DONE]`.
    pub async fn stream(&self, body: &Map<String, Value>) -> Result<Vec<Value>, Failure> {
        let mut body = body.clone();
        body.insert("stream".into(), Value::Bool(true));
        let response = self.send(&body).await?;
        let mut bytes = response.bytes_stream();
        let mut buffer = Vec::new();
        let mut chunks = Vec::new();
        while let Some(piece) = bytes.next().await {
            let piece =
                piece.map_err(|e| Failure::gateway(format!("the upstream's stream broke: {e}")))?;
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

fn find_line_end(buffer: &[u8]) -> Option<usize> {
    buffer.iter().position(|b| *b == b'\n')
}
