//! Tools declared in configuration that call an HTTP endpoint (the `http` pack).
//!
//! Owns the tools file format and the mapping of HTTP outcomes to call results. It must
//! never follow the model's arguments to another URL than the declared one, nor retry
//! on its own: redelivery is the runner's.
//!
//! A tools file (`TOOLFLEET_HTTP_TOOLS_FILE`, JSON) declares each tool's definition and
//! URL. A call POSTs the call's arguments as the JSON body, with the headers
//! `Fleet-Tenant-Id`, `Fleet-Turn-Id`, `Fleet-Call-Id`, `Fleet-Attempt`,
//! `Fleet-Session-Id` (when the turn has one) and `Idempotency-Key: <turn>.<call>`, plus
//! the tool's own configured headers. A 2xx JSON response is the result; an optional
//! `Fleet-Summary` response header is its spoken summary.
//!
//! Failures map to codes with an explicit `retryable` flag:
//!
//! | what happened | code | retryable |
//! |---|---|---|
//! | no response within the tool's `timeout_ms` | `upstream_timeout` | yes |
//! | connection refused or broken | `upstream_unreachable` | yes |
//! | 5xx, 408 | `upstream_unavailable` | yes |
//! | 429 | `upstream_rate_limited` | yes |
//! | other 4xx (and other non-2xx) | `upstream_rejected` | no |
//! | body not JSON, or larger than `max_response_bytes` | `upstream_invalid_response` | no |
//!
//! Retryable failures of a tool declared `idempotent` are delivered again (up to
//! `max_attempts`) by the runner.
//!
//! ```json
//! {"tools": [{
//!   "name": "weather.now", "description": "Current weather for a city",
//!   "url": "http://127.0.0.1:8080/weather",
//!   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
//!   "waiting_hint": "checking the weather", "timeout_ms": 2000, "idempotent": true, "max_attempts": 3
//! }]}
//! ```
//!
//! Only `http://` URLs are supported (no TLS in the client); put a TLS-terminating proxy
//! or sidecar in front of an `https` service.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use serde::Deserialize;
use serde_json::{json, Value};
use toolfleet_common::names::{
    HEADER_ATTEMPT, HEADER_CALL_ID, HEADER_SESSION_ID, HEADER_SUMMARY, HEADER_TENANT_ID,
    HEADER_TURN_ID,
};
use toolfleet_common::{RetryPolicy, ToolDefinition};

use toolfleet_worker::tool::{Tool, ToolContext, ToolError, ToolFuture, ToolOutput};

use crate::json_file::{read_json, JsonFileError};

/// No response within the timeout.
pub const UPSTREAM_TIMEOUT: &str = "upstream_timeout";
/// The endpoint could not be reached.
pub const UPSTREAM_UNREACHABLE: &str = "upstream_unreachable";
/// The endpoint answered 5xx or 408.
pub const UPSTREAM_UNAVAILABLE: &str = "upstream_unavailable";
/// The endpoint answered 429.
pub const UPSTREAM_RATE_LIMITED: &str = "upstream_rate_limited";
/// The endpoint refused the call (4xx).
pub const UPSTREAM_REJECTED: &str = "upstream_rejected";
/// The endpoint's answer is not usable JSON.
pub const UPSTREAM_INVALID_RESPONSE: &str = "upstream_invalid_response";

/// Extra time the runner allows beyond the HTTP timeout, so the adapter's own
/// `upstream_timeout` is what a slow endpoint produces.
const RUNNER_MARGIN: Duration = Duration::from_millis(100);
/// Characters of an error response body quoted in the error message.
const ERROR_BODY_QUOTE: usize = 200;

fn default_input_schema() -> Value {
    json!({"type": "object"})
}
fn default_timeout_ms() -> u64 {
    2_000
}
fn default_max_attempts() -> u32 {
    3
}
fn default_max_response_bytes() -> usize {
    512 * 1024
}

/// One HTTP tool as declared in the tools file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpToolSpec {
    /// Tool name (registry spelling).
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// The endpoint (`http://host:port/path`) the arguments are POSTed to.
    pub url: String,
    /// JSON Schema of the arguments (default: any object).
    #[serde(default = "default_input_schema")]
    pub input_schema: Value,
    /// JSON Schema of the response, checked before the result is published.
    #[serde(default)]
    pub output_schema: Option<Value>,
    /// What the assistant says it is doing while the tool runs.
    #[serde(default)]
    pub waiting_hint: Option<String>,
    /// How long to wait for the response (default 2000 ms).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Whether a call may be sent again after a retryable failure (default false).
    #[serde(default)]
    pub idempotent: bool,
    /// Deliveries of an idempotent call, including the first (default 3).
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Extra request headers (e.g. an API key).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Whether the endpoint reads tenant data (informational).
    #[serde(default)]
    pub tenant_scoped: bool,
    /// Largest response body accepted (default 512 KiB).
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
}

/// The tools file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpToolsFile {
    /// The declared tools.
    pub tools: Vec<HttpToolSpec>,
}

/// Why HTTP tools could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum HttpToolError {
    /// The tools file could not be read or is not valid.
    #[error(transparent)]
    File(#[from] JsonFileError),
    /// A tool's declaration is unusable.
    #[error("http tool {tool}: {reason}")]
    Invalid {
        /// The tool.
        tool: String,
        /// What is wrong.
        reason: String,
    },
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
}

/// Reads the tools file at `path` and builds its tools.
pub fn tools_from_file(path: &Path) -> Result<Vec<Tool>, HttpToolError> {
    let file: HttpToolsFile = read_json(path)?;
    tools(file.tools)
}

/// Builds the tools of `specs`, sharing one HTTP client.
pub fn tools(specs: Vec<HttpToolSpec>) -> Result<Vec<Tool>, HttpToolError> {
    let client = reqwest::Client::builder().build()?;
    specs.into_iter().map(|s| tool(s, client.clone())).collect()
}

/// Prepared per-tool request data.
struct Endpoint {
    url: reqwest::Url,
    headers: HeaderMap,
    timeout: Duration,
    max_response_bytes: usize,
    client: reqwest::Client,
}

/// Builds one HTTP tool on `client`.
pub fn tool(spec: HttpToolSpec, client: reqwest::Client) -> Result<Tool, HttpToolError> {
    let invalid = |reason: String| HttpToolError::Invalid {
        tool: spec.name.clone(),
        reason,
    };
    let url = reqwest::Url::parse(&spec.url).map_err(|e| invalid(format!("url: {e}")))?;
    if url.scheme() != "http" {
        return Err(invalid(format!(
            "url scheme {:?} is not supported; use http:// (TLS via a proxy)",
            url.scheme()
        )));
    }
    if spec.timeout_ms == 0 {
        return Err(invalid("timeout_ms must be positive".into()));
    }
    let mut headers = HeaderMap::new();
    for (name, value) in &spec.headers {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| invalid(format!("header {name:?}: {e}")))?;
        let value =
            HeaderValue::from_str(value).map_err(|e| invalid(format!("header {name}: {e}")))?;
        headers.insert(name, value);
    }
    let timeout = Duration::from_millis(spec.timeout_ms);
    let mut definition = ToolDefinition::new(spec.name.clone(), spec.description.clone());
    definition.input_schema = spec.input_schema.clone();
    definition.output_schema = spec.output_schema.clone();
    definition.waiting_hint = spec.waiting_hint.clone();
    definition.timeout_ms =
        u64::try_from((timeout + RUNNER_MARGIN).as_millis()).unwrap_or(u64::MAX);
    definition.retry = RetryPolicy {
        idempotent: spec.idempotent,
        max_attempts: if spec.idempotent {
            spec.max_attempts.max(1)
        } else {
            1
        },
    };
    definition.tenant_scoped = spec.tenant_scoped;
    let endpoint = Arc::new(Endpoint {
        url,
        headers,
        timeout,
        max_response_bytes: spec.max_response_bytes,
        client,
    });
    Ok(Tool::from_fn(
        definition,
        move |ctx: ToolContext, arguments: Value| -> ToolFuture {
            let endpoint = Arc::clone(&endpoint);
            Box::pin(async move { endpoint.call(ctx, arguments).await })
        },
    ))
}

impl Endpoint {
    async fn call(&self, ctx: ToolContext, arguments: Value) -> Result<ToolOutput, ToolError> {
        let body = serde_json::to_vec(&arguments).map_err(|e| {
            ToolError::fatal(toolfleet_common::call::codes::BAD_ARGUMENTS, e.to_string())
        })?;
        let mut headers = self.headers.clone();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let mut put = |name: &'static str, value: &str| {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(name, value);
            }
        };
        put(HEADER_TENANT_ID, &ctx.tenant_id);
        put(HEADER_TURN_ID, &ctx.turn_id);
        put(HEADER_CALL_ID, &ctx.call_id);
        put(HEADER_ATTEMPT, &ctx.attempt.to_string());
        if let Some(session) = &ctx.session_id {
            put(HEADER_SESSION_ID, session);
        }
        put(
            "idempotency-key",
            &format!("{}.{}", ctx.turn_id, ctx.call_id),
        );
        let sent = self
            .client
            .post(self.url.clone())
            .headers(headers)
            .timeout(self.timeout)
            .body(body)
            .send()
            .await;
        let mut response = sent.map_err(|e| self.transport_error(&e))?;
        let status = response.status();
        let summary = response
            .headers()
            .get(HEADER_SUMMARY)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let mut bytes = Vec::new();
        loop {
            let chunk = tokio::time::timeout(self.timeout, response.chunk())
                .await
                .map_err(|_| self.timed_out())?
                .map_err(|e| self.transport_error(&e))?;
            let Some(chunk) = chunk else { break };
            if bytes.len() + chunk.len() > self.max_response_bytes {
                return Err(ToolError::fatal(
                    UPSTREAM_INVALID_RESPONSE,
                    format!(
                        "the response is larger than {} bytes",
                        self.max_response_bytes
                    ),
                ));
            }
            bytes.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            return Err(status_error(status.as_u16(), &bytes));
        }
        let value: Value = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|e| {
                ToolError::fatal(
                    UPSTREAM_INVALID_RESPONSE,
                    format!("the response is not JSON: {e}"),
                )
            })?
        };
        let output = ToolOutput::new(value);
        Ok(match summary {
            Some(s) if !s.trim().is_empty() => output.with_summary(s),
            _ => output,
        })
    }

    fn timed_out(&self) -> ToolError {
        ToolError::retryable(
            UPSTREAM_TIMEOUT,
            format!("no response within {} ms", self.timeout.as_millis()),
        )
    }

    fn transport_error(&self, error: &reqwest::Error) -> ToolError {
        if error.is_timeout() {
            self.timed_out()
        } else {
            ToolError::retryable(UPSTREAM_UNREACHABLE, format!("{}: {error}", self.url))
        }
    }
}

/// The error of a non-2xx answer.
pub fn status_error(status: u16, body: &[u8]) -> ToolError {
    let text = String::from_utf8_lossy(body);
    let quoted: String = text.chars().take(ERROR_BODY_QUOTE).collect();
    let message = if quoted.trim().is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status}: {}", quoted.trim())
    };
    match status {
        429 => ToolError::retryable(UPSTREAM_RATE_LIMITED, message),
        408 | 500..=599 => ToolError::retryable(UPSTREAM_UNAVAILABLE, message),
        _ => ToolError::fatal(UPSTREAM_REJECTED, message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str) -> HttpToolSpec {
        serde_json::from_value(json!({"name": "x.y", "description": "d", "url": url}))
            .unwrap_or_else(|e| panic!("spec: {e}"))
    }

    #[test]
    fn statuses_map_to_codes() {
        let e = status_error(503, b"down");
        assert_eq!((e.code.as_str(), e.retryable), (UPSTREAM_UNAVAILABLE, true));
        let e = status_error(429, b"");
        assert_eq!(
            (e.code.as_str(), e.retryable),
            (UPSTREAM_RATE_LIMITED, true)
        );
        let e = status_error(404, b"");
        assert_eq!((e.code.as_str(), e.retryable), (UPSTREAM_REJECTED, false));
        let e = status_error(408, b"");
        assert!(e.retryable);
    }

    #[test]
    fn declarations_are_checked() {
        let client = reqwest::Client::new();
        assert!(tool(spec("http://127.0.0.1:9/x"), client.clone()).is_ok());
        assert!(matches!(
            tool(spec("https://example.invalid/x"), client.clone()),
            Err(HttpToolError::Invalid { .. })
        ));
        assert!(matches!(
            tool(spec("not a url"), client),
            Err(HttpToolError::Invalid { .. })
        ));
        let file: Result<HttpToolsFile, _> = serde_json::from_str(
            r#"{"tools": [{"name": "a", "description": "b", "url": "http://h/", "surprise": 1}]}"#,
        );
        assert!(file.is_err());
    }

    #[test]
    fn definitions_follow_the_declaration() -> Result<(), HttpToolError> {
        let mut s = spec("http://127.0.0.1:9/x");
        s.idempotent = true;
        s.max_attempts = 2;
        s.timeout_ms = 300;
        let t = tool(s, reqwest::Client::new())?;
        let d = t.definition();
        assert!(d.retry.idempotent);
        assert_eq!(d.retry.max_attempts, 2);
        assert_eq!(d.timeout_ms, 400);
        assert_eq!(d.input_schema, json!({"type": "object"}));
        Ok(())
    }
}
