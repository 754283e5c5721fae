//! The `mcp` pack: the tools of MCP servers served as fleet tools, on the official Rust
//! SDK (`rmcp`).
//!
//! A servers file (`TOOLFLEET_MCP_SERVERS`, [`config`]) names each server and how to
//! reach it: a command the worker runs and talks to over stdio, or a Streamable HTTP
//! URL. [`McpPack::start`] connects to every server, lists its tools and puts each into
//! the worker's [`ToolSet`] as `<server>.<tool>` (description, input and output schemas
//! as the server gives them; read-only or idempotent tools may run again, see
//! `toolfleet_common::mcp`). From then on each server is supervised on its own:
//!
//! - `notifications/tools/list_changed` lists its tools again; the set, and so the
//!   registry and the catalog, follow.
//! - A server that exits (stdio) or whose connection ends loses its tools from the set
//!   (the worker withdraws them: a call finds no live worker and fails fast), its calls
//!   in flight fail with `mcp_server_unavailable` (retryable), and it is started again
//!   with backoff (200 ms doubling to 10 s); its tools come back once it answers.
//! - A call is one `tools/call` (`call.rs`): `isError` or a JSON-RPC error is
//!   `tool_error` with the server's message; the runner's time budget (the server's
//!   `timeout_ms`, the turn's deadline) drops an unanswered call, which sends
//!   `notifications/cancelled`. The call's trace context travels in `_meta.traceparent`
//!   and, to HTTP servers, as the `traceparent` header (`http.rs`).
//!
//! It owns connections and the names its servers put in the set; serving the set
//! (consumers, registry) is the worker SDK's ([`toolfleet_worker::run_set`]).
//!
//! | file | what lives there |
//! |---|---|
//! | this file | [`McpPack`]: start and stop every server |
//! | [`config`] | the servers file |
//! | `server` | one server's connection, tool list and restarts |
//! | `call` | one `tools/call` and its result; [`MCP_SERVER_UNAVAILABLE`] |
//! | `http` | the HTTP client that adds `traceparent` |

mod call;
pub mod config;
mod http;
mod server;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_worker::ToolSet;

pub use call::MCP_SERVER_UNAVAILABLE;
pub use config::{read_servers, McpConfigError, McpServer, McpServersFile, Transport};
use server::Server;

/// Longest a server's stop may take.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The running servers of the pack.
pub struct McpPack {
    servers: Vec<Arc<Server>>,
    /// One supervisor per server.
    tasks: TaskTracker,
    /// Stops the supervisors (and so closes every connection and child process).
    stop: CancellationToken,
}

impl McpPack {
    /// Starts every server of `servers`, their tools going into `tools`, and returns
    /// once each has listed its tools or failed its first start (each within the
    /// connection timeout); a server that failed keeps being started in the background.
    pub async fn start(servers: Vec<McpServer>, tools: &ToolSet) -> Self {
        let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
        let mut started = Vec::new();
        let mut firsts = Vec::new();
        for spec in servers {
            let server = Arc::new(Server::new(spec, tools.clone()));
            let (first, first_done) = oneshot::channel();
            tasks.spawn(Arc::clone(&server).supervise(first, stop.clone()));
            firsts.push(first_done);
            started.push(server);
        }
        tasks.close();
        let wait = server::CONNECT_TIMEOUT + Duration::from_secs(1);
        let _ = tokio::time::timeout(wait, futures::future::join_all(firsts)).await;
        Self {
            servers: started,
            tasks,
            stop,
        }
    }

    /// The servers' names.
    pub fn servers(&self) -> Vec<&str> {
        self.servers.iter().map(|s| s.name()).collect()
    }

    /// Closes every connection and stops every child process; call it after the worker
    /// stopped, so calls in flight finish first.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(STOP_WAIT, self.tasks.wait()).await;
    }
}
