//! Header poison as a hostile publisher sends it: the malformed header blocks nats-server
//! forwards unchecked, written as raw `HPUB` frames over TCP. Used against the
//! coordinator (tests/header_poison.rs) and against a worker built outside the workspace
//! (tests/tool_crate.rs). Never asserts.

use std::time::Duration;

use anyhow::{bail, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// How long the server may take to answer one frame.
const FRAME_WAIT: Duration = Duration::from_secs(10);

/// The malformed header blocks: a CR/LF in a value followed by a line without a colon,
/// invalid UTF-8 in a value, a name with a space, a status that is not a number, a lone
/// carriage return inside a value, and no `NATS/1.0` version line.
pub const POISON: [&[u8]; 6] = [
    b"NATS/1.0\r\nTraceparent: 00-aa\r\nno colon here\r\n\r\n",
    b"NATS/1.0\r\nToolfleet-Turn-Id: \xff\xfe\r\n\r\n",
    b"NATS/1.0\r\nBad Name: x\r\n\r\n",
    b"NATS/1.0 abc\r\n\r\n",
    b"NATS/1.0\r\nTraceparent: 00-a\rb\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n\r\n",
];

/// A raw NATS connection that publishes frames as written.
pub struct RawPublisher {
    stream: BufReader<TcpStream>,
}

impl RawPublisher {
    pub async fn connect(port: u16) -> Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", port)).await?;
        let mut publisher = Self {
            stream: BufReader::new(stream),
        };
        publisher.read_line().await?; // INFO
        publisher
            .stream
            .write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n")
            .await?;
        Ok(publisher)
    }

    async fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        tokio::time::timeout(FRAME_WAIT, self.stream.read_line(&mut line)).await??;
        Ok(line)
    }

    /// `HPUB subject [reply] header payload`, then a PING answered by PONG, so the
    /// server has taken the frame before this returns.
    pub async fn hpub(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        header: &[u8],
        payload: &[u8],
    ) -> Result<()> {
        let reply = reply.map(|r| format!(" {r}")).unwrap_or_default();
        let mut frame = format!(
            "HPUB {subject}{reply} {} {}\r\n",
            header.len(),
            header.len() + payload.len()
        )
        .into_bytes();
        frame.extend_from_slice(header);
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\nPING\r\n");
        self.stream.write_all(&frame).await?;
        loop {
            let line = self.read_line().await?;
            if line.starts_with("PONG") {
                return Ok(());
            }
            if line.starts_with("-ERR") {
                bail!("server refused the frame: {line}");
            }
        }
    }
}
