//! An OTLP/HTTP sink on loopback: accepts `POST /v1/traces` and `POST /v1/metrics`,
//! counts requests and bytes, and discards the bodies, so the fleet's processes export
//! exactly as they would to a collector without one running.
//!
//! Owns its listener and counters. It must never listen beyond loopback, and never
//! decode or keep the bodies it receives.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Largest request head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// A connection idle for this long is closed.
const IDLE: Duration = Duration::from_secs(120);

/// What the sink has received.
#[derive(Debug, Default)]
pub struct Received {
    /// `POST /v1/traces` requests.
    pub trace_requests: AtomicU64,
    /// `POST /v1/metrics` requests.
    pub metric_requests: AtomicU64,
    /// Body bytes of every request.
    pub bytes: AtomicU64,
}

/// Counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Trace export requests.
    pub trace_requests: u64,
    /// Metric export requests.
    pub metric_requests: u64,
    /// Body bytes.
    pub bytes: u64,
}

impl Counts {
    /// What arrived between `earlier` and `self`.
    pub fn since(self, earlier: Counts) -> Counts {
        Counts {
            trace_requests: self.trace_requests.saturating_sub(earlier.trace_requests),
            metric_requests: self.metric_requests.saturating_sub(earlier.metric_requests),
            bytes: self.bytes.saturating_sub(earlier.bytes),
        }
    }
}

/// The running sink; [`Sink::stop`] or dropping it stops accepting.
pub struct Sink {
    port: u16,
    received: Arc<Received>,
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Sink {
    /// Listens on a free loopback port.
    pub async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let received = Arc::new(Received::default());
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        {
            let received = Arc::clone(&received);
            let stop = stop.clone();
            let connections = tasks.clone();
            tasks.spawn(async move {
                loop {
                    let accepted = tokio::select! {
                        _ = stop.cancelled() => break,
                        a = listener.accept() => a,
                    };
                    let Ok((stream, _)) = accepted else {
                        continue;
                    };
                    let received = Arc::clone(&received);
                    let stop = stop.clone();
                    connections.spawn(async move {
                        tokio::select! {
                            _ = stop.cancelled() => {}
                            _ = serve(stream, &received) => {}
                        }
                    });
                }
            });
        }
        Ok(Self {
            port,
            received,
            stop,
            tasks,
        })
    }

    /// The value for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The counters now.
    pub fn counts(&self) -> Counts {
        Counts {
            trace_requests: self.received.trace_requests.load(Ordering::Relaxed),
            metric_requests: self.received.metric_requests.load(Ordering::Relaxed),
            bytes: self.received.bytes.load(Ordering::Relaxed),
        }
    }

    /// Stops accepting and closes every connection.
    pub async fn stop(self) {
        self.stop.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.tasks.wait()).await;
    }
}

/// Answers requests on one keep-alive connection until the peer closes it.
async fn serve(stream: TcpStream, received: &Received) -> Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let Some(head) = read_head(&mut reader).await? else {
            return Ok(());
        };
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
        let header = |name: &str| {
            head.lines().find_map(|line| {
                let (k, v) = line.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_string())
            })
        };
        let chunked =
            header("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let bytes = if chunked {
            discard_chunked(&mut reader).await?
        } else {
            let length: u64 = header("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            discard(&mut reader, length).await?
        };
        received.bytes.fetch_add(bytes, Ordering::Relaxed);
        if path.starts_with("/v1/traces") {
            received.trace_requests.fetch_add(1, Ordering::Relaxed);
        } else if path.starts_with("/v1/metrics") {
            received.metric_requests.fetch_add(1, Ordering::Relaxed);
        }
        let response =
            "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
        write.write_all(response.as_bytes()).await?;
    }
}

/// The request line and headers, or `None` when the peer closed the connection.
async fn read_head<R: AsyncRead + Unpin>(reader: &mut BufReader<R>) -> Result<Option<String>> {
    let mut head = Vec::new();
    loop {
        let before = head.len();
        let n = tokio::time::timeout(IDLE, reader.read_until(b'\n', &mut head)).await??;
        if n == 0 {
            return Ok(None);
        }
        if head.len() > MAX_HEAD {
            bail!("request head too large");
        }
        let line = &head[before..];
        if line == b"\r\n" || line == b"\n" {
            if head.len() == line.len() {
                // A blank line between requests.
                head.clear();
                continue;
            }
            return Ok(Some(String::from_utf8_lossy(&head).into_owned()));
        }
    }
}

async fn discard<R: AsyncRead + Unpin>(reader: &mut BufReader<R>, length: u64) -> Result<u64> {
    let copied = tokio::io::copy(&mut reader.take(length), &mut tokio::io::sink()).await?;
    if copied != length {
        bail!("body ended after {copied} of {length} bytes");
    }
    Ok(copied)
}

async fn discard_chunked<R: AsyncRead + Unpin>(reader: &mut BufReader<R>) -> Result<u64> {
    let mut total = 0u64;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).await?;
        let size_text = line.trim().split(';').next().unwrap_or("");
        let Ok(size) = u64::from_str_radix(size_text, 16) else {
            bail!("bad chunk size {size_text:?}");
        };
        if size == 0 {
            // Trailers, up to the blank line.
            loop {
                line.clear();
                let n = reader.read_line(&mut line).await?;
                if n == 0 || line == "\r\n" || line == "\n" {
                    return Ok(total);
                }
            }
        }
        total += discard(reader, size).await?;
        line.clear();
        reader.read_line(&mut line).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn post(
        stream: &mut TcpStream,
        path: &str,
        body: &[u8],
    ) -> Result<String, Box<dyn std::error::Error>> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body).await?;
        let mut buf = vec![0u8; 256];
        let n = stream.read(&mut buf).await?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    #[tokio::test]
    async fn counts_requests_on_a_keep_alive_connection() -> Result<(), Box<dyn std::error::Error>>
    {
        let sink = Sink::start().await?;
        let addr = sink.endpoint().replace("http://", "");
        let mut stream = TcpStream::connect(addr).await?;
        let first = post(&mut stream, "/v1/traces", &[1u8; 1000]).await?;
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        let second = post(&mut stream, "/v1/metrics", &[2u8; 10]).await?;
        assert!(second.starts_with("HTTP/1.1 200"), "{second}");
        stream
            .write_all(b"POST /v1/traces HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
            .await?;
        let mut buf = vec![0u8; 256];
        let n = stream.read(&mut buf).await?;
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let counts = sink.counts();
        assert_eq!(
            counts,
            Counts {
                trace_requests: 2,
                metric_requests: 1,
                bytes: 1015
            }
        );
        sink.stop().await;
        Ok(())
    }
}
