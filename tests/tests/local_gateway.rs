//! `toolfleet up --gateway` as a user runs it: the real `toolfleet` binary, its gateway
//! on a free loopback port and its API keys in a PostgreSQL database of this test's own
//! (`pg::TestDatabase`);
//! the curl line it prints, sent as is over HTTP, answers a two-call turn as an event
//! stream (an `ack`, then a `final` with every call ok); and SIGTERM (the user's Ctrl-C)
//! stops the command and the `toolfleet-gateway` process it started with it.
//!
//! Needs PostgreSQL at `TOOLFLEET_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`): without it the test fails, saying so.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use toolfleet_tests::fleet::{checkout_cli, Fleet};
use toolfleet_tests::gateway::{read_events, SseEvent};
use toolfleet_tests::pg::TestDatabase;
use toolfleet_tests::{child_command, free_port, strings_at};

/// Longest `toolfleet up --gateway` may take to print its curl line: the fleet's start,
/// the key database's migrations and the gateway's start.
const START_WAIT: Duration = Duration::from_secs(90);
/// Longest the turn may take, from the request to the end of its event stream.
const TURN_WAIT: Duration = Duration::from_secs(30);
/// Longest the gateway's port may keep accepting connections after SIGTERM.
const PORT_CLOSED_WAIT: Duration = Duration::from_secs(15);
/// Longest `toolfleet up` may take to exit after SIGTERM: the gateway's stop (at most
/// 10 s before it is killed), then the coordinator's and the worker's.
const EXIT_WAIT: Duration = Duration::from_secs(45);
/// Longest a killed process may take to be reaped.
const REAP_WAIT: Duration = Duration::from_secs(20);
/// Poll interval of the bounded waits.
const POLL: Duration = Duration::from_millis(50);

/// The gateway's executable, which `toolfleet up --gateway` looks for beside itself.
const GATEWAY_BIN: &str = "toolfleet-gateway";
/// The tools of the demo turn the curl line sends, in order.
const DEMO_TOOLS: [&str; 2] = ["crm.listUpcomingAppointments", "crm.getOpenInvoices"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_the_gateway_answers_a_turn_over_http_and_stops_with_it() -> Result<()> {
    let database = TestDatabase::create().await?;
    let cli = checkout_cli().await?;
    let fleet = Fleet::start().await?;
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;

    let mut up = Up::start(&cli, &fleet, &database, addr)?;
    let curl = up.curl_line().await?;
    up.find_gateway()?;
    let request = CurlRequest::parse(&curl)?;
    assert_eq!(
        request.url,
        format!("http://{addr}/v1/turns"),
        "the curl line names the gateway's address"
    );
    let body: Value = serde_json::from_str(&request.body).context("the curl line's body")?;
    let tools = strings_at(
        &body["decision"]["calls"],
        "/toolName",
        "the curl line's calls",
    )?;
    assert_eq!(tools, DEMO_TOOLS, "{body}");

    let events = tokio::time::timeout(TURN_WAIT, request.send_and_read())
        .await
        .context("the turn's event stream did not end in time")??;
    let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"ack"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"final"), "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| **k == "final").count(),
        1,
        "{kinds:?}"
    );
    let (ack, fin) = (&events[0].data, &events[events.len() - 1].data);
    assert_eq!(ack["calls"].as_array().map(Vec::len), Some(2), "{ack}");
    assert_eq!(fin["turn_id"], ack["turn_id"], "{fin}");
    let summary = &fin["summary"];
    assert_eq!(summary["total"], 2, "{fin}");
    assert_eq!(summary["ok"], 2, "every call is ok: {fin}");

    // The user's Ctrl-C: the command stops, and its gateway with it.
    up.terminate()?;
    wait_port_closed(addr).await?;
    let status = up.wait_exit().await?;
    assert!(status.success(), "toolfleet up exited with {status}");
    up.wait_gateway_gone().await?;
    Ok(())
}

// ----- toolfleet up --------------------------------------------------------------------

/// `toolfleet up --gateway` as a child process with its stdout read line by line; on
/// drop it is killed together with every process it started, and its gateway even when
/// that outlived it.
struct Up {
    child: Child,
    pid: u32,
    lines: mpsc::UnboundedReceiver<String>,
    reader: JoinHandle<()>,
    /// The `toolfleet-gateway` process it started, once found.
    gateway: Option<Process>,
}

impl Up {
    /// Starts `cli up --gateway --gateway-addr addr` on `fleet`'s servers with its keys
    /// in `database`, the gateway taken from beside `cli`.
    fn start(cli: &Path, fleet: &Fleet, database: &TestDatabase, addr: SocketAddr) -> Result<Self> {
        let mut command = child_command(cli, Stdio::piped());
        command
            .args(["up", "--gateway", "--gateway-addr", &addr.to_string()])
            .envs(fleet.servers_env())
            .env("TOOLFLEET_DATABASE_URL", database.url())
            .env_remove("TOOLFLEET_HTTP_ADDR")
            .env_remove("TOOLFLEET_MCP_SERVERS")
            .env_remove("TOOLFLEET_GATEWAY_BIN")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .kill_on_drop(true);
        let mut child = command.spawn().context("starting toolfleet up")?;
        let pid = child.id().context("toolfleet up has no process id")?;
        let stdout = child.stdout.take().context("toolfleet up has no stdout")?;
        let (sender, lines) = mpsc::unbounded_channel();
        // Read to the end, so the command never blocks on a full pipe.
        let reader = tokio::spawn(async move {
            let mut stdout = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = stdout.next_line().await {
                let _ = sender.send(line);
            }
        });
        Ok(Self {
            child,
            pid,
            lines,
            reader,
            gateway: None,
        })
    }

    /// The `curl` line it prints once its gateway listens, within [`START_WAIT`]; an
    /// error when it exits first.
    async fn curl_line(&mut self) -> Result<String> {
        let deadline = Instant::now() + START_WAIT;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.recv())
                .await
                .with_context(|| {
                    format!("toolfleet up printed no curl line within {START_WAIT:?}")
                })?;
            let Some(line) = line else {
                let status = tokio::time::timeout(REAP_WAIT, self.child.wait()).await;
                bail!("toolfleet up ended its output before a curl line: {status:?}");
            };
            if let Some(at) = line.find("curl ") {
                return Ok(line[at..].to_string());
            }
        }
    }

    /// Finds the `toolfleet-gateway` process among its children.
    fn find_gateway(&mut self) -> Result<()> {
        let gateway = processes()
            .into_iter()
            .find(|process| process.parent == self.pid && process.is_gateway())
            .with_context(|| format!("toolfleet up (pid {}) runs no {GATEWAY_BIN}", self.pid))?;
        self.gateway = Some(gateway);
        Ok(())
    }

    /// SIGTERM, as a user's Ctrl-C stops it.
    fn terminate(&self) -> Result<()> {
        kill(pid(self.pid)?, Signal::SIGTERM).context("SIGTERM to toolfleet up")?;
        Ok(())
    }

    /// Its exit status, within [`EXIT_WAIT`].
    async fn wait_exit(&mut self) -> Result<ExitStatus> {
        tokio::time::timeout(EXIT_WAIT, self.child.wait())
            .await
            .with_context(|| format!("toolfleet up still runs {EXIT_WAIT:?} after SIGTERM"))?
            .context("waiting for toolfleet up")
    }

    /// Waits until the gateway process it started no longer runs, within
    /// [`PORT_CLOSED_WAIT`].
    async fn wait_gateway_gone(&self) -> Result<()> {
        let gateway = self.gateway.as_ref().context("the gateway was not found")?;
        let deadline = Instant::now() + PORT_CLOSED_WAIT;
        while gateway.runs() {
            if Instant::now() >= deadline {
                bail!(
                    "{GATEWAY_BIN} (pid {}) still runs {PORT_CLOSED_WAIT:?} after toolfleet up \
                     exited",
                    gateway.pid
                );
            }
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.reader.abort();
        // Its children only while it runs: once reaped, its process id may be another's.
        let mut family = match self.child.try_wait() {
            Ok(None) => descendants(self.pid),
            _ => Vec::new(),
        };
        family.extend(self.gateway.iter().filter(|g| g.runs()).map(|g| g.pid));
        let _ = self.child.start_kill();
        for process in family {
            if let Ok(process) = pid(process) {
                let _ = kill(process, Signal::SIGKILL);
            }
        }
    }
}

/// `process` as a `nix` process id.
fn pid(process: u32) -> Result<Pid> {
    Ok(Pid::from_raw(i32::try_from(process)?))
}

/// A process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Process {
    pid: u32,
    parent: u32,
    /// `R`, `S`, ..., `Z` (exited, not yet reaped).
    state: char,
    /// When it started, in clock ticks after boot: with `pid`, who it is.
    started: u64,
}

impl Process {
    /// `pid` now; `None` when no such process exists.
    fn read(pid: u32) -> Option<Self> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let fields: Vec<&str> = text
            .get(text.rfind(')')? + 1..)?
            .split_whitespace()
            .collect();
        Some(Self {
            pid,
            state: fields.first()?.chars().next()?,
            parent: fields.get(1)?.parse().ok()?,
            started: fields.get(19)?.parse().ok()?,
        })
    }

    /// Whether this very process still runs (not exited, its id not reused).
    fn runs(&self) -> bool {
        Self::read(self.pid)
            .is_some_and(|now| now.started == self.started && !matches!(now.state, 'Z' | 'X'))
    }

    /// Whether it is a running `toolfleet-gateway`.
    fn is_gateway(&self) -> bool {
        // The kernel keeps the first 15 bytes of a process's name.
        let name = std::fs::read_to_string(format!("/proc/{}/comm", self.pid)).unwrap_or_default();
        let name = name.trim();
        self.runs() && !name.is_empty() && GATEWAY_BIN.starts_with(name)
    }
}

/// Every process now (from `/proc`).
fn processes() -> Vec<Process> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter_map(Process::read)
        .collect()
}

/// The processes below `root`.
fn descendants(root: u32) -> Vec<u32> {
    let table = processes();
    let mut found = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for process in &table {
            if process.parent == parent && !found.contains(&process.pid) {
                found.push(process.pid);
                parents.push(process.pid);
            }
        }
    }
    found
}

/// Waits until nothing accepts connections on `addr`, within [`PORT_CLOSED_WAIT`].
async fn wait_port_closed(addr: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + PORT_CLOSED_WAIT;
    loop {
        let attempt = tokio::time::timeout(POLL * 10, tokio::net::TcpStream::connect(addr)).await;
        if matches!(attempt, Ok(Err(_))) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the gateway's port {addr} still accepts connections {PORT_CLOSED_WAIT:?} after SIGTERM");
        }
        tokio::time::sleep(POLL).await;
    }
}

// ----- the curl line -------------------------------------------------------------------

/// The request a printed `curl -N URL -H 'Name: value'... -d 'BODY'` line makes.
#[derive(Debug)]
struct CurlRequest {
    url: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl CurlRequest {
    /// Reads `line` as a shell reads it (words, single quotes), then as curl reads its
    /// arguments.
    fn parse(line: &str) -> Result<Self> {
        let words = shell_words(line)?;
        ensure!(words.first().map(String::as_str) == Some("curl"), "{line}");
        let (mut url, mut headers, mut body) = (None, Vec::new(), None);
        let mut args = words[1..].iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "-N" => {}
                "-H" => {
                    let header = args.next().context("-H without a header")?;
                    let (name, value) = header.split_once(':').context("a header without ':'")?;
                    headers.push((name.trim().to_string(), value.trim().to_string()));
                }
                "-d" => body = Some(args.next().context("-d without a body")?.clone()),
                other if !other.starts_with('-') => url = Some(other.to_string()),
                other => bail!("an option this test does not know: {other} in {line}"),
            }
        }
        Ok(Self {
            url: url.with_context(|| format!("no URL in {line}"))?,
            headers,
            body: body.with_context(|| format!("no body in {line}"))?,
        })
    }

    /// Sends the request, as curl would, and reads its answer as an event stream.
    async fn send_and_read(&self) -> Result<Vec<SseEvent>> {
        let mut request = reqwest::Client::new().post(&self.url);
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        let response = request.body(self.body.clone()).send().await?;
        let status = response.status();
        ensure!(status.is_success(), "POST {}: {status}", self.url);
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        ensure!(
            content_type.starts_with("text/event-stream"),
            "the answer is {content_type:?}, not an event stream"
        );
        read_events(response).await
    }
}

/// The words of `line` as a POSIX shell splits them: whitespace between words, single
/// quotes kept literally.
fn shell_words(line: &str) -> Result<Vec<String>> {
    let (mut words, mut word, mut in_word, mut quoted) = (Vec::new(), String::new(), false, false);
    for c in line.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                in_word = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    ensure!(!quoted, "an unclosed quote in {line}");
    if in_word {
        words.push(word);
    }
    Ok(words)
}
