//! The HTTP gateway: turns over Server-Sent Events or one JSON answer, the tool catalog,
//! API keys that fix the tenant, an OpenAPI document generated from the handlers' types,
//! and a live turn page.
//!
//! The gateway is one more stateless NATS frontend. It holds a [`FleetClient`] (its own
//! NATS user), reads API keys from PostgreSQL, and never touches Redis or the join: the
//! coordinator owns every turn, so whatever the NATS client guarantees holds over HTTP.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | `api` | the router: routes, layers (CORS, body limit, tracing), OpenAPI and docs, health |
//! | `auth` | the [`auth::Caller`] extractor: API key → tenant, rate per key |
//! | `catalog` | `GET /v1/tools` |
//! | `config` | [`GatewayConfig`] from `TOOLFLEET_GATEWAY_*` |
//! | `error` | [`error::ApiError`]: status, stable code, `{error: {code, message}}`, `Retry-After` |
//! | `extract` | JSON body and query extractors answering in the error shape |
//! | `http_metrics` | HTTP RED metrics: every request's duration by method, route and status |
//! | `keys` | key format, hashing, the cached PostgreSQL lookup, admin create/list/revoke |
//! | `limits` | token bucket per key, turn slots |
//! | `mcp` | `/mcp`: the fleet as an MCP server (Streamable HTTP), API keys as bearer tokens |
//! | `openai` | `POST /v1/chat/completions`: the model's tool loop on the fleet, streamed or not |
//! | `page` | the live turn page at `/` (plain HTML, CSS and JS, no build step) |
//! | `trace` | the server span with HTTP semantic conventions, `traceparent` in and out |
//! | `turns` | `POST /v1/turns`, SSE and JSON |
//! | `turn_scope` | turn ids scoped by tenant: the client's id ↔ the stored id, one 404 for any id not the tenant's |
//! | `stream_token` | short-lived, turn-scoped tokens that let a browser's `EventSource` read one turn |
//! | `sse` | a turn's events as Server-Sent Events, shared by `turns` and `stored` |
//! | `stored` | `GET /v1/turns/{id}`, `GET /v1/turns/{id}/events` (resumed after `Last-Event-ID`), `DELETE /v1/turns/{id}` |
//!
//! A turn's path: `api` routes `POST /v1/turns` → `trace` opens the server span (parent:
//! the request's `traceparent`) → `auth` finds the key's tenant and takes a token →
//! `turns` builds the `TurnRequest`, takes a turn slot and submits it with the
//! `FleetClient` (the coordinator's `turn` span becomes a child of the server span) →
//! events go back as SSE frames or are collected to the `final`.

pub mod api;
pub mod auth;
pub mod catalog;
pub mod config;
pub mod error;
pub mod extract;
pub mod http_metrics;
pub mod keys;
pub mod limits;
pub mod mcp;
pub mod openai;
pub mod page;
pub mod sse;
pub mod stored;
pub mod stream_token;
pub mod trace;
pub mod turn_scope;
pub mod turns;

use std::net::SocketAddr;
use std::sync::Arc;

pub use config::GatewayConfig;
use error::ApiError;
use keys::KeyStore;
use limits::{RateLimiter, TurnSlots};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use toolfleet_common::FleetClient;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// NATS could not be reached.
    #[error("connecting to NATS: {0}")]
    Nats(#[from] toolfleet_common::client::ClientError),
    /// The listen address could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving HTTP: {0}")]
    Serve(std::io::Error),
    /// The chat-completions upstream is misconfigured.
    #[error("{0}")]
    Upstream(#[from] openai::UpstreamError),
}

/// What every request handler shares.
#[derive(Debug)]
pub struct Gateway {
    /// Settings.
    pub config: GatewayConfig,
    /// The frontend client (the gateway's own NATS user).
    pub client: FleetClient,
    /// API keys.
    pub keys: KeyStore,
    /// Per-key token buckets.
    pub limiter: RateLimiter,
    /// Turns followed at once.
    pub slots: TurnSlots,
    /// The model server of `/v1/chat/completions`, when configured.
    pub upstream: Option<openai::Upstream>,
    /// Each tenant's OpenAI-format catalog as the chat loop last read it.
    pub chat_catalogs: openai::CatalogCache,
    /// Mints and checks the stream tokens of `EventSource` readers.
    pub stream_tokens: stream_token::StreamTokens,
}

impl Gateway {
    /// A gateway with `config` on `client`; an error when the upstream settings are
    /// unusable.
    pub fn new(config: GatewayConfig, client: FleetClient) -> Result<Self, GatewayError> {
        Ok(Self {
            keys: KeyStore::new(config.database_url.clone(), config.key_cache),
            limiter: RateLimiter::new(config.rate_per_s, config.burst),
            slots: TurnSlots::new(config.max_turns),
            upstream: openai::Upstream::new(&config.upstream)?,
            chat_catalogs: openai::CatalogCache::new(config.upstream.catalog_cache),
            stream_tokens: stream_token::StreamTokens::new(
                config.stream_token_secret.clone().unwrap_or_else(|| {
                    let why = "no TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET: stream tokens are \
                               signed with a secret of this process only and stop working \
                               when it restarts";
                    // Expected of a loopback-only gateway (`toolfleet up`, tests).
                    if config.addr.ip().is_loopback() {
                        tracing::info!("{why}");
                    } else {
                        tracing::warn!("{why}");
                    }
                    stream_token::TokenSecret::random()
                }),
                config.stream_token_ttl,
            ),
            client,
            config,
        })
    }

    /// 503 `unavailable` unless the NATS connection is up (a publish would otherwise wait
    /// for a reconnect).
    pub fn nats_connected(&self) -> Result<(), ApiError> {
        match self.client.nats().connection_state() {
            async_nats::connection::State::Connected => Ok(()),
            _ => Err(ApiError::unavailable(
                "the gateway is not connected to NATS",
            )),
        }
    }
}

/// Connects to NATS as the configured user, binds the listen address and serves until
/// `shutdown`.
pub async fn run(config: GatewayConfig, shutdown: CancellationToken) -> Result<(), GatewayError> {
    // A misconfigured upstream stops the start, before any connection.
    openai::Upstream::new(&config.upstream)?;
    // The operational endpoint (metrics) on its own port, when configured.
    let ops = toolfleet_common::health::start_process("toolfleet-gateway", config.ops_addr)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: config.ops_addr.unwrap_or(config.addr),
            source,
        })?;
    let client =
        FleetClient::connect_with(&config.nats_url, &config.prefix, &config.nats_credentials)
            .await?;
    let nats = client.nats().clone();
    ops.health.set_readiness(Arc::new(move || {
        let connected = matches!(
            nats.connection_state(),
            async_nats::connection::State::Connected
        );
        Box::pin(async move {
            match connected {
                true => Ok(()),
                false => Err("NATS is not connected".to_string()),
            }
        })
    }));
    let addr = config.addr;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| GatewayError::Bind { addr, source })?;
    tracing::info!(%addr, "gateway listening");
    serve(listener, Gateway::new(config, client)?, shutdown).await
}

/// Serves `gateway` on `listener` until `shutdown`; open event streams end with it.
pub async fn serve(
    listener: TcpListener,
    gateway: Gateway,
    shutdown: CancellationToken,
) -> Result<(), GatewayError> {
    use axum::serve::ListenerExt;
    let app = http_metrics::layer(api::router(Arc::new(gateway)));
    // Event-stream frames are small writes: without TCP_NODELAY each waits for the
    // client's delayed ACK (40 ms).
    let listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::warn!(%error, "could not set TCP_NODELAY");
        }
    });
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown.cancelled_owned())
    .await
    .map_err(GatewayError::Serve)
}
