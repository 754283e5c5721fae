//! A small HTTP/1.1 server for operational endpoints (`/healthz`, `/readyz`,
//! `/metrics`): GET only, one request per connection, bounded reads.
//!
//! Owns serving and routing those paths. Never decides liveness or readiness itself (the
//! process's `health` routes its paths to it through a [`Handler`]) and never serves a frontend's traffic.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A response: status code, content type and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

impl Response {
    /// `200 OK` with a text body.
    pub fn ok(body: impl Into<String>) -> Self {
        Self {
            status: 200,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    /// A text response with `status`.
    pub fn status(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

/// The boxed future a handler returns.
pub type ResponseFuture = Pin<Box<dyn Future<Output = Response> + Send>>;

/// Maps a request path to a response.
pub type Handler = Arc<dyn Fn(String) -> ResponseFuture + Send + Sync>;

/// Largest request head read.
const MAX_HEAD: usize = 8 * 1024;

/// Binds `addr` and serves `handler` until `shutdown`; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    handler: Handler,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = shutdown.cancelled() => break,
                a = listener.accept() => a,
            };
            let Ok((mut stream, _)) = accepted else {
                continue;
            };
            let handler = Arc::clone(&handler);
            tokio::spawn(async move {
                let mut buf = vec![0u8; MAX_HEAD];
                let mut len = 0;
                let read = tokio::time::timeout(Duration::from_secs(5), async {
                    while len < buf.len() {
                        let n = stream.read(&mut buf[len..]).await?;
                        if n == 0 {
                            break;
                        }
                        len += n;
                        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                    Ok::<_, std::io::Error>(())
                })
                .await;
                if !matches!(read, Ok(Ok(()))) {
                    return;
                }
                let head = String::from_utf8_lossy(&buf[..len]);
                let mut parts = head.split_whitespace();
                let method = parts.next().unwrap_or_default().to_string();
                let path = parts
                    .next()
                    .unwrap_or("/")
                    .split('?')
                    .next()
                    .unwrap_or("/")
                    .to_string();
                let response = if method == "GET" || method == "HEAD" {
                    handler(path).await
                } else {
                    Response::status(405, "method not allowed\n")
                };
                let reason = match response.status {
                    200 => "OK",
                    404 => "Not Found",
                    405 => "Method Not Allowed",
                    503 => "Service Unavailable",
                    _ => "Status",
                };
                let body = if method == "HEAD" {
                    ""
                } else {
                    response.body.as_str()
                };
                let head = format!(
                    "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    response.status,
                    response.content_type,
                    response.body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(local)
}

/// The boxed future of a readiness check: `Err(reason)` when not ready.
pub type ReadyFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// A readiness check.
pub type Readiness = Arc<dyn Fn() -> ReadyFuture + Send + Sync>;

/// Reads `TOOLFLEET_HTTP_ADDR`: unset means `default`; `off` disables the endpoint.
pub fn addr_from_env(default: &str) -> Result<Option<SocketAddr>, crate::env::ConfigError> {
    let value = crate::env::env_string("TOOLFLEET_HTTP_ADDR", default);
    if value.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    value
        .parse()
        .map(Some)
        .map_err(|e: std::net::AddrParseError| crate::env::ConfigError {
            name: "TOOLFLEET_HTTP_ADDR".into(),
            value,
            reason: e.to_string(),
        })
}
