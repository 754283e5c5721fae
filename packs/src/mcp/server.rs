//! One MCP server's life in a worker: connected (its child process started, or its URL
//! reached), its tools listed into the worker's [`ToolSet`] as `<server>.<tool>`,
//! listed again on `notifications/tools/list_changed`, and when the server exits or its
//! connection ends, its tools taken out of the set (so the worker withdraws them from
//! the registry) and the server started again with backoff.
//!
//! Owns the connection and the names this server put in the set; it never touches
//! another pack's tools (a name already served by something else is left out, with an
//! error) and never runs a call (see `call.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use reqwest::header::{HeaderName, HeaderValue};
use rmcp::model::{
    ClientCapabilities, ClientConfig, Implementation, SubscriptionFilter, Tool as McpTool,
};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientHandler, Peer, RoleClient, ServiceExt};
use tokio::sync::{oneshot, Notify};
use tokio_util::sync::CancellationToken;
use toolfleet_common::mcp::definition_of;
use toolfleet_common::ToolDefinition;
use toolfleet_worker::{Tool, ToolSet};
use tracing::{error, info, warn};

use super::config::{McpServer, Transport};
use super::http::TracingClient;

/// Longest a connection (start, `initialize`) may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// First delay before a lost server is started again; doubled after each failure.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
/// Longest delay between two starts.
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A connection that lasted this long resets the backoff.
const STABLE: Duration = Duration::from_secs(10);
/// How long a stopping server's connection may take to close.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// One declared server, shared by its tools' handlers.
pub(crate) struct Server {
    spec: McpServer,
    tools: ToolSet,
    /// The connection calls go through; `None` while the server is down.
    peer: Mutex<Option<Peer<RoleClient>>>,
    /// The fleet names this server put in the set.
    owned: Mutex<BTreeSet<String>>,
}

/// What the client does with the server's notifications: a changed tool list wakes
/// the supervisor.
#[derive(Clone)]
struct Listener {
    changed: Arc<Notify>,
}

impl ClientHandler for Listener {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.changed.notify_one();
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("toolfleet-worker", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// A live connection.
struct Connection {
    service: RunningService<RoleClient, Listener>,
    changed: Arc<Notify>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Server {
    /// A server whose tools go into `tools`; not yet started.
    pub fn new(spec: McpServer, tools: ToolSet) -> Self {
        Self {
            spec,
            tools,
            peer: Mutex::new(None),
            owned: Mutex::new(BTreeSet::new()),
        }
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The current connection, `None` while the server is down.
    pub fn peer(&self) -> Option<Peer<RoleClient>> {
        lock(&self.peer).clone()
    }

    /// Until `stop`: connects, serves the server's tools while the connection lasts,
    /// and starts again with backoff when it ends. `first` is told when the first
    /// attempt is over (tools listed, or the attempt failed).
    pub async fn supervise(self: Arc<Self>, first: oneshot::Sender<()>, stop: CancellationToken) {
        let mut first = Some(first);
        let mut backoff = BACKOFF_MIN;
        loop {
            let connected = tokio::select! {
                _ = stop.cancelled() => return,
                c = tokio::time::timeout(CONNECT_TIMEOUT, self.connect()) => c,
            };
            match connected {
                Ok(Ok(connection)) => {
                    let since = Instant::now();
                    self.serve(connection, &mut first, &stop).await;
                    if stop.is_cancelled() {
                        return;
                    }
                    if since.elapsed() >= STABLE {
                        backoff = BACKOFF_MIN;
                    }
                }
                Ok(Err(why)) => warn!(server = %self.name(), %why, "MCP server did not start"),
                Err(_) => {
                    warn!(server = %self.name(), "MCP server did not answer initialize in time")
                }
            }
            if let Some(first) = first.take() {
                let _ = first.send(());
            }
            info!(server = %self.name(), backoff_ms = backoff.as_millis() as u64, "starting the MCP server again after a pause");
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Starts the server (stdio) or reaches it (HTTP) and runs `initialize`.
    async fn connect(&self) -> Result<Connection, String> {
        let changed = Arc::new(Notify::new());
        let listener = Listener {
            changed: Arc::clone(&changed),
        };
        let service = match &self.spec.transport {
            Transport::Stdio {
                command,
                args,
                env,
                cwd,
            } => {
                listener
                    .serve(child(command, args, env, cwd.as_deref())?)
                    .await
            }
            Transport::Http { url, headers } => listener.serve(http(url, headers)?).await,
        };
        let service = service.map_err(|e| e.to_string())?;
        Ok(Connection { service, changed })
    }

    /// While `connection` lasts (or until `stop`): its tools in the set, listed again on
    /// every change; then out of the set.
    async fn serve(
        self: &Arc<Self>,
        connection: Connection,
        first: &mut Option<oneshot::Sender<()>>,
        stop: &CancellationToken,
    ) {
        let Connection { service, changed } = connection;
        let peer = service.peer().clone();
        let _listening = listen_for_changes(&peer, Arc::clone(&changed)).await;
        *lock(&self.peer) = Some(peer.clone());
        self.list(&peer).await;
        let protocol = peer
            .peer_info()
            .map(|i| i.protocol_version.as_str().to_string())
            .unwrap_or_default();
        info!(server = %self.name(), %protocol, tools = lock(&self.owned).len(), "MCP server up");
        if let Some(first) = first.take() {
            let _ = first.send(());
        }
        let close = service.cancellation_token();
        let ended = service.waiting();
        tokio::pin!(ended);
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    close.cancel();
                    let _ = tokio::time::timeout(CLOSE_WAIT, &mut ended).await;
                    break;
                }
                _ = &mut ended => {
                    warn!(server = %self.name(), "MCP server exited or its connection ended; its tools are withdrawn");
                    break;
                }
                _ = changed.notified() => self.list(&peer).await,
            }
        }
        *lock(&self.peer) = None;
        self.withdraw();
    }

    /// Lists the server's tools and puts them in the set in place of the previous list;
    /// on failure the previous list stays.
    async fn list(self: &Arc<Self>, peer: &Peer<RoleClient>) {
        match peer.list_all_tools().await {
            Ok(listed) => self.replace_tools(&listed),
            Err(why) => warn!(server = %self.name(), %why, "listing the MCP server's tools failed"),
        }
    }

    /// Makes `listed` this server's tools in the set: new and changed ones put in,
    /// unchanged ones kept as they are (their pull loops go on), gone ones taken out.
    fn replace_tools(self: &Arc<Self>, listed: &[McpTool]) {
        let wanted = self.definitions(listed);
        let mut owned = lock(&self.owned);
        self.tools.update(|set| {
            for name in owned.iter() {
                if !wanted.contains_key(name) {
                    set.remove(name);
                }
            }
            let mut now = BTreeSet::new();
            for (name, (definition, mcp_name)) in wanted {
                let theirs = set.contains_key(&name) && !owned.contains(&name);
                if theirs {
                    error!(server = %self.name(), tool = %name, "another pack serves a tool of this name; the MCP tool is left out");
                    continue;
                }
                let unchanged = set.get(&name).is_some_and(|t| *t.definition() == definition);
                if !unchanged {
                    set.insert(name.clone(), self.tool(definition, mcp_name));
                }
                now.insert(name);
            }
            *owned = now;
        });
    }

    /// The fleet definitions of `listed` by fleet name, each with the tool's MCP name;
    /// a tool whose name cannot be a fleet name is left out, with an error.
    fn definitions(&self, listed: &[McpTool]) -> BTreeMap<String, (ToolDefinition, String)> {
        let mut wanted = BTreeMap::new();
        for tool in listed {
            match definition_of(self.name(), tool) {
                Ok(definition) => {
                    let name = definition.name.clone();
                    let definition = self.fleet_definition(definition);
                    wanted.insert(name, (definition, tool.name.to_string()));
                }
                Err(why) => error!(server = %self.name(), %why, "MCP tool left out"),
            }
        }
        wanted
    }

    /// The server's settings applied to a listed tool's definition.
    fn fleet_definition(&self, mut definition: ToolDefinition) -> ToolDefinition {
        definition.timeout_ms = u64::try_from(self.spec.timeout.as_millis()).unwrap_or(u64::MAX);
        definition.waiting_hint.clone_from(&self.spec.waiting_hint);
        definition
    }

    /// The fleet tool that calls `mcp_name` on this server.
    fn tool(self: &Arc<Self>, definition: ToolDefinition, mcp_name: String) -> Tool {
        let server = Arc::clone(self);
        let mcp_name: Arc<str> = mcp_name.into();
        Tool::from_fn(definition, move |ctx, arguments| {
            let (server, mcp_name) = (Arc::clone(&server), Arc::clone(&mcp_name));
            Box::pin(async move {
                super::call::call(server.peer(), server.name(), &mcp_name, ctx, arguments).await
            })
        })
    }

    /// Takes this server's tools out of the set.
    fn withdraw(&self) {
        let mut owned = lock(&self.owned);
        self.tools.update(|set| {
            for name in owned.iter() {
                set.remove(name);
            }
        });
        owned.clear();
    }
}

/// The server's process, started with its stdin and stdout piped to the client and its
/// stderr to the worker's.
fn child(
    command: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
    cwd: Option<&std::path::Path>,
) -> Result<TokioChildProcess, String> {
    let mut cmd = tokio::process::Command::new(command);
    cmd.args(args).envs(env);
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
    }
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting {command}: {e}"))?;
    Ok(transport)
}

/// The Streamable HTTP transport to `url` with `headers` on every request, on a client
/// that adds each call's `traceparent`, keeps no idle connections and follows no
/// redirect.
fn http(
    url: &str,
    headers: &BTreeMap<String, String>,
) -> Result<StreamableHttpClientTransport<TracingClient>, String> {
    let config =
        StreamableHttpClientTransportConfig::with_uri(url).custom_headers(header_map(headers)?);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| e.to_string())?;
    Ok(StreamableHttpClientTransport::with_client(
        TracingClient(client),
        config,
    ))
}

/// On protocol versions where list changes come only on a `subscriptions/listen`
/// stream (2026-07-28 on), opens one for tool list changes and forwards them to
/// `changed`; earlier versions deliver them to [`Listener`] unasked. The forwarding
/// task ends when the returned handle is dropped.
async fn listen_for_changes(
    peer: &Peer<RoleClient>,
    changed: Arc<Notify>,
) -> Option<tokio_util::task::AbortOnDropHandle<()>> {
    let info = peer.peer_info()?;
    let announces = info
        .capabilities
        .tools
        .as_ref()
        .and_then(|t| t.list_changed)
        .unwrap_or(false);
    if info.protocol_version.has_initialize() || !announces {
        return None;
    }
    let filter = SubscriptionFilter::builder().tools_list_changed().build();
    let mut subscription = match peer.listen(filter).await {
        Ok(s) => s,
        Err(why) => {
            warn!(%why, "could not subscribe to the MCP server's tool list changes");
            return None;
        }
    };
    let forward = tokio::spawn(async move {
        while let Ok(Some(_)) = subscription.next().await {
            changed.notify_one();
        }
    });
    Some(tokio_util::task::AbortOnDropHandle::new(forward))
}

/// The configured headers as HTTP headers.
fn header_map(
    headers: &BTreeMap<String, String>,
) -> Result<std::collections::HashMap<HeaderName, HeaderValue>, String> {
    headers
        .iter()
        .map(|(name, value)| {
            let name =
                HeaderName::try_from(name.as_str()).map_err(|e| format!("header {name:?}: {e}"))?;
            let value =
                HeaderValue::try_from(value.as_str()).map_err(|e| format!("header {name}: {e}"))?;
            Ok((name, value))
        })
        .collect()
}
