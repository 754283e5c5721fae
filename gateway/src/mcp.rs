//! `/mcp` on the gateway: the fleet as an MCP server (Streamable HTTP transport, the
//! official Rust SDK `rmcp`). Any MCP client connects with a gateway API key as its bearer
//! token and sees the key's tenant's fleet tools; each `tools/call` runs as one fleet turn
//! with one call.
//!
//! Owns the mapping between the two: `initialize` (tools capability), `tools/list` (the
//! tenant's catalog in MCP form), `tools/call` (a turn whose `final` becomes the
//! `CallToolResult`: a failed call is `isError` with its message), progress notifications
//! from the call's states when the client sent a `progressToken`, and
//! `notifications/cancelled` cancelling the turn. The key is checked before the request
//! reaches the MCP layer (401 otherwise, as on every other route); the tenant then rides
//! in the request's extensions. A session belongs to the key that opened it
//! (`SessionOwners`): a request naming a session opened by another key is answered
//! 404, as for a session that does not exist, and never reaches the session. A key holds
//! at most `TOOLFLEET_GATEWAY_MCP_SESSIONS_PER_KEY` sessions: opening one more closes
//! that key's least recently used one (never another key's), and a session idle for
//! `TOOLFLEET_GATEWAY_MCP_SESSION_IDLE_MS` is closed. Never decides anything about a
//! tool: the coordinator does.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::session::SessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{json, Value};
use toolfleet_common::call::CallState;
use toolfleet_common::tool::CatalogFormat;
use toolfleet_common::{TurnEvent, TurnRequest};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::Gateway;

/// How long the catalog may take.
const CATALOG_WAIT: Duration = Duration::from_secs(5);
/// The header naming a Streamable HTTP session.
const SESSION_HEADER: &str = "mcp-session-id";
/// Owners remembered before the first sweep of ended sessions.
const FIRST_SWEEP: usize = 1024;

/// The `/mcp` service: the MCP server behind the API-key check and the session owners.
pub fn service(gateway: Arc<Gateway>) -> axum::Router<Arc<Gateway>> {
    let hosts = gateway.config.mcp_allowed_hosts.clone();
    let config = StreamableHttpServerConfig::default().with_allowed_hosts(hosts);
    let handler = FleetMcp {
        gateway: Arc::clone(&gateway),
    };
    let mut sessions = LocalSessionManager::default();
    // A session without a request for this long ends (its worker quits and the manager
    // forgets it).
    sessions.session_config.keep_alive = Some(gateway.config.mcp_session_idle);
    let sessions = Arc::new(sessions);
    let mcp =
        StreamableHttpService::new(move || Ok(handler.clone()), Arc::clone(&sessions), config);
    let per_key = gateway.config.mcp_sessions_per_key;
    let guard = McpGuard {
        gateway,
        owners: Arc::new(SessionOwners::new(sessions, per_key)),
    };
    axum::Router::new()
        .nest_service("/mcp", mcp)
        .layer(axum::middleware::from_fn_with_state(guard, authenticate))
}

/// What the check in front of `/mcp` holds.
#[derive(Clone)]
struct McpGuard {
    gateway: Arc<Gateway>,
    owners: Arc<SessionOwners>,
}

/// Which API key opened each MCP session, and each key's sessions by last use. The
/// session ids come from the SDK's session manager (random UUIDs); an owner is recorded
/// when the response to the request that opened the session names it, forgotten when
/// its key deletes the session or the key opens one session too many (then its least
/// recently used session is closed), and swept once the manager no longer holds the
/// session (it ended idle), so the map stays as large as the live sessions (twice at
/// most between sweeps) and no key ever holds more than `per_key` of them.
struct SessionOwners {
    sessions: Arc<LocalSessionManager>,
    per_key: usize,
    owners: Mutex<Owners>,
}

#[derive(Default)]
struct Owners {
    /// Session → (owning key, its last use).
    by_session: HashMap<String, (String, u64)>,
    /// Key → its sessions by last use, oldest first.
    by_key: HashMap<String, BTreeMap<u64, String>>,
    tick: u64,
    sweep_at: usize,
}

impl Owners {
    fn forget(&mut self, id: &str) {
        let Some((key, used)) = self.by_session.remove(id) else {
            return;
        };
        if let Some(sessions) = self.by_key.get_mut(&key) {
            sessions.remove(&used);
            if sessions.is_empty() {
                self.by_key.remove(&key);
            }
        }
    }

    /// Marks `id` (of `key`) used now.
    fn touch(&mut self, id: &str, key: &str) {
        self.tick += 1;
        let tick = self.tick;
        let Some((_, used)) = self.by_session.get_mut(id) else {
            return;
        };
        let before = std::mem::replace(used, tick);
        let sessions = self.by_key.entry(key.to_string()).or_default();
        sessions.remove(&before);
        sessions.insert(tick, id.to_string());
    }
}

impl SessionOwners {
    fn new(sessions: Arc<LocalSessionManager>, per_key: usize) -> Self {
        Self {
            sessions,
            per_key: per_key.max(1),
            owners: Mutex::new(Owners {
                sweep_at: FIRST_SWEEP,
                ..Owners::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether session `id` was opened by key `key_id`; marks it used when it was. A
    /// session nobody opened through this gateway belongs to nobody.
    fn used_by(&self, id: &str, key_id: &str) -> bool {
        let mut owners = self.lock();
        let owned = owners
            .by_session
            .get(id)
            .is_some_and(|(owner, _)| owner == key_id);
        if owned {
            owners.touch(id, key_id);
        }
        owned
    }

    /// The sessions the manager still holds.
    async fn live(&self) -> HashSet<String> {
        self.sessions
            .sessions
            .read()
            .await
            .keys()
            .map(|id| id.to_string())
            .collect()
    }

    /// Records that key `key_id` opened session `id`. Past the key's bound, the key's
    /// sessions that ended are forgotten and then its least recently used ones closed
    /// until it holds the bound; sweeps ended sessions when the map has doubled since
    /// the last sweep.
    async fn opened(&self, id: &str, key_id: &str) {
        let (over, sweep) = {
            let mut owners = self.lock();
            owners.forget(id);
            owners
                .by_session
                .insert(id.to_string(), (key_id.to_string(), 0));
            owners.touch(id, key_id);
            let held = owners.by_key.get(key_id).map_or(0, BTreeMap::len);
            (
                held > self.per_key,
                owners.by_session.len() >= owners.sweep_at,
            )
        };
        if over {
            let live = self.live().await;
            let evicted: Vec<String> = {
                let mut owners = self.lock();
                let ended: Vec<String> = owners
                    .by_key
                    .get(key_id)
                    .into_iter()
                    .flat_map(BTreeMap::values)
                    .filter(|s| !live.contains(*s) && s.as_str() != id)
                    .cloned()
                    .collect();
                for session in &ended {
                    owners.forget(session);
                }
                let held = owners.by_key.get(key_id).map_or(0, BTreeMap::len);
                let oldest: Vec<String> = owners
                    .by_key
                    .get(key_id)
                    .into_iter()
                    .flat_map(BTreeMap::values)
                    .filter(|s| s.as_str() != id)
                    .take(held.saturating_sub(self.per_key))
                    .cloned()
                    .collect();
                for session in &oldest {
                    owners.forget(session);
                }
                oldest
            };
            for session in evicted {
                tracing::debug!(
                    key_id,
                    "MCP session bound reached: closing the key's least recently used session"
                );
                if let Err(error) = self.sessions.close_session(&session.into()).await {
                    tracing::warn!(%error, "closing an MCP session past its key's bound");
                }
            }
        }
        if sweep {
            let live = self.live().await;
            let mut owners = self.lock();
            let ended: Vec<String> = owners
                .by_session
                .keys()
                .filter(|s| !live.contains(*s))
                .cloned()
                .collect();
            for session in &ended {
                owners.forget(session);
            }
            owners.sweep_at = (owners.by_session.len() * 2).max(FIRST_SWEEP);
        }
    }

    fn closed(&self, id: &str) {
        self.lock().forget(id);
    }
}

/// The session a request or response names, if any.
fn session_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Refuses a request without a valid key (401 in the gateway's error shape) or naming a
/// session another key opened (404, like an unknown session: the Streamable HTTP
/// transport's answer to a session the server does not hold for this caller), hands the
/// caller on in the request's extensions, where the MCP handler reads it, and records
/// the owner of a session the request opens.
async fn authenticate(State(guard): State<McpGuard>, request: Request, next: Next) -> Response {
    use axum::extract::FromRequestParts;
    let (mut parts, body) = request.into_parts();
    let caller = match Caller::from_request_parts(&mut parts, &guard.gateway).await {
        Ok(caller) => caller,
        Err(error) => return error.into_response(),
    };
    let key_id = caller.key_id.clone();
    let named = session_of(&parts.headers);
    if let Some(id) = &named {
        if !guard.owners.used_by(id, &key_id) {
            return ApiError::not_found("no such MCP session").into_response();
        }
    }
    let deleting = parts.method == Method::DELETE;
    parts.extensions.insert(caller);
    let response = next.run(Request::from_parts(parts, body)).await;
    match &named {
        None => {
            if let Some(opened) = session_of(response.headers()) {
                guard.owners.opened(&opened, &key_id).await;
            }
        }
        Some(id) if deleting && response.status().is_success() => guard.owners.closed(id),
        Some(_) => {}
    }
    response
}

/// The MCP server handler.
#[derive(Clone)]
pub struct FleetMcp {
    gateway: Arc<Gateway>,
}

impl FleetMcp {
    /// The tenant of the request's API key.
    fn tenant(context: &RequestContext<RoleServer>) -> Result<String, McpError> {
        context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Caller>())
            .map(|caller| caller.tenant.clone())
            .ok_or_else(|| McpError::invalid_request("no API key on the request", None))
    }
}

impl ServerHandler for FleetMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "The tools of your toolfleet tenant. Each call runs on the fleet's workers.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let tenant = Self::tenant(&context)?;
        let catalog = self
            .gateway
            .client
            .catalog(CatalogFormat::Mcp, Some(tenant), CATALOG_WAIT)
            .await
            .map_err(|e| McpError::internal_error(e.to_string(), None))?;
        let tools = catalog
            .into_iter()
            .filter_map(|entry| serde_json::from_value(entry).ok())
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        use rmcp::model::RequestParamsMeta;
        let tenant = Self::tenant(&context)?;
        // The SDK moves a request's `_meta` into the context.
        let progress = request
            .progress_token()
            .or_else(|| context.meta.get_progress_token());
        let call_id = format!("mcp_{}", uuid::Uuid::new_v4().simple());
        let arguments = request.arguments.map_or(json!({}), Value::Object);
        let decision = json!({"type": "tool_calls", "calls": [
            {"id": call_id, "toolName": request.name, "arguments": arguments}
        ]});
        let turn = TurnRequest {
            turn_id: None,
            tenant_id: tenant.clone(),
            session_id: None,
            user_message: None,
            decision,
            deadline_ms: None,
            options: Default::default(),
            context: Default::default(),
        };
        let gateway = &self.gateway;
        let wait = gateway.event_wait(None);
        let failed =
            |message: String| Ok(CallToolResult::error(vec![ContentBlock::text(message)]).into());
        let mut stream = match gateway.client.submit(turn).await {
            Ok(stream) => stream,
            Err(error) => return failed(format!("the fleet did not take the call: {error}")),
        };
        let turn_id = stream.turn_id().to_string();
        let mut steps = 0.0;
        let mut cancelled = false;
        loop {
            let event = tokio::select! {
                event = stream.next_event(wait) => event,
                _ = context.ct.cancelled(), if !cancelled => {
                    // `notifications/cancelled`: the turn ends at once with a `cancelled` call.
                    cancelled = true;
                    let _ = gateway.client.cancel(&turn_id, Some(&tenant), wait).await;
                    continue;
                }
            };
            let event = match event {
                Ok(event) => event,
                Err(error) => return failed(format!("no result from the fleet: {error}")),
            };
            match event {
                TurnEvent::ToolState { state, .. } => {
                    if let Some(token) = &progress {
                        steps += 1.0;
                        let mut note = ProgressNotificationParam::new(token.clone(), steps);
                        note.message = Some(state_word(state).to_string());
                        let _ = context.peer.notify_progress(note).await;
                    }
                }
                TurnEvent::Final(fin) => {
                    return match fin.results.first() {
                        Some(result) => {
                            Ok(toolfleet_common::mcp::call_tool_result_of(result).into())
                        }
                        None => failed("the fleet returned no result".into()),
                    };
                }
                TurnEvent::Error { error, .. } => {
                    return failed(format!("{}: {}", error.code, error.message));
                }
                _ => {}
            }
        }
    }
}

fn state_word(state: CallState) -> &'static str {
    match state {
        CallState::Pending => "pending",
        CallState::Running => "running",
        CallState::Done => "done",
        CallState::Error => "error",
        CallState::Timeout => "timeout",
        CallState::Skipped => "skipped",
        CallState::Cancelled => "cancelled",
    }
}
