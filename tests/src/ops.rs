//! The operational HTTP endpoints of processes under test: `GET` a path with every wait
//! bounded, wait for a status, read one metric out of Prometheus text.

use std::time::Duration;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::eventually_named;

/// `GET path` on loopback `port` (bounded); `(status, body)`.
pub async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let connect = TcpStream::connect(("127.0.0.1", port));
    let mut stream = tokio::time::timeout(Duration::from_secs(2), connect).await??;
    // HTTP/1.0: the server closes the connection after one unchunked response.
    let request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut text)).await??;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Waits (at most `timeout`) until `GET path` on `port` answers `status`; the last body.
pub async fn wait_http_status(
    port: u16,
    path: &str,
    status: u16,
    timeout: Duration,
) -> Result<String> {
    eventually_named(
        &format!("{path} answering {status}"),
        timeout,
        || async move {
            match http_get(port, path).await {
                Ok((s, body)) if s == status => Some(body),
                _ => None,
            }
        },
    )
    .await
}

/// The value of the Prometheus sample `name{...labels containing every of `labels`}` in
/// `text`, summed over matching series.
pub fn metric_value(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let series_name = series.split('{').next().unwrap_or_default();
        if series_name != name || !labels.iter().all(|l| series.contains(l)) {
            continue;
        }
        let value: f64 = value.parse().ok()?;
        found = Some(found.unwrap_or(0.0) + value);
    }
    found
}
