//! The gateway's settings: where it listens, which NATS and PostgreSQL it uses, and the
//! limits it applies per request and per API key.
//!
//! Owns reading `TOOLFLEET_GATEWAY_*` (and the shared NATS variables) into
//! [`GatewayConfig`]; malformed or out-of-range values are errors naming the variable.
//! Never opens a connection: `lib.rs` does that with these settings.

use std::net::SocketAddr;
use std::time::Duration;

use toolfleet_common::config::{env_in, env_ms_in, env_or, env_string, ConfigError, Endpoints};
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::tls::{TlsFiles, TlsVariables};

/// The TLS variables of the chat-completions upstream.
pub const UPSTREAM_TLS: TlsVariables = TlsVariables {
    ca_file: "TOOLFLEET_UPSTREAM_CA_FILE",
    cert_file: "TOOLFLEET_UPSTREAM_CERT_FILE",
    key_file: "TOOLFLEET_UPSTREAM_KEY_FILE",
};

/// Where the gateway listens when `TOOLFLEET_GATEWAY_ADDR` is unset.
pub const DEFAULT_ADDR: &str = "0.0.0.0:8080";
pub use toolfleet_keys::DEFAULT_DATABASE_URL;
/// The Jaeger UI the live page links traces to when `TOOLFLEET_GATEWAY_JAEGER_URL` is unset.
pub const DEFAULT_JAEGER_URL: &str = "http://localhost:16686";
/// How long a known key is trusted when `TOOLFLEET_GATEWAY_KEY_CACHE_MS` is unset.
pub const DEFAULT_KEY_CACHE: Duration = Duration::from_secs(5);
/// Known keys remembered when `TOOLFLEET_GATEWAY_KEY_CACHE_ENTRIES` is unset.
pub const DEFAULT_KEY_CACHE_ENTRIES: usize = 10_000;
/// How long an unknown key is remembered when `TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_MS` is
/// unset.
pub const DEFAULT_UNKNOWN_KEY_CACHE: Duration = Duration::from_secs(10);
/// Unknown keys remembered when `TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_ENTRIES` is unset.
pub const DEFAULT_UNKNOWN_KEY_CACHE_ENTRIES: usize = 10_000;
/// Failed key checks one client may make at once when `TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST`
/// is unset.
pub const DEFAULT_AUTH_FAILURE_BURST: u32 = 20;
/// Failed key checks a client earns back a minute when
/// `TOOLFLEET_GATEWAY_AUTH_FAILURES_PER_MIN` is unset.
pub const DEFAULT_AUTH_FAILURES_PER_MIN: u32 = 30;

/// How long a stream token lives at least when `TOOLFLEET_GATEWAY_STREAM_TOKEN_TTL_MS` is
/// unset.
pub const DEFAULT_STREAM_TOKEN_TTL: Duration = Duration::from_secs(600);
/// The shortest stream-token secret accepted, in bytes.
pub const MIN_STREAM_TOKEN_SECRET: usize = 32;
/// The variable holding the stream-token secret.
pub const STREAM_TOKEN_SECRET_VAR: &str = "TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET";

/// MCP sessions one API key may hold open when `TOOLFLEET_GATEWAY_MCP_SESSIONS_PER_KEY`
/// is unset.
pub const DEFAULT_MCP_SESSIONS_PER_KEY: usize = 32;
/// How long an MCP session may stay idle when `TOOLFLEET_GATEWAY_MCP_SESSION_IDLE_MS` is
/// unset: longer than the longest call (the 300 s turn cap plus the grace), so a session
/// is never closed idle under a call still running.
pub const DEFAULT_MCP_SESSION_IDLE: Duration = Duration::from_secs(600);

/// How the gateway checks API keys: the cache of known keys, the cache of unknown keys,
/// and the limit on failed checks per client address. Unknown keys never take a place
/// of a known one: the two caches are bounded apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyCheckConfig {
    /// How long a known key read from PostgreSQL is trusted (`TOOLFLEET_GATEWAY_KEY_CACHE_MS`,
    /// default 5 s; 0: every request asks PostgreSQL): a revoked key stops working at
    /// most this long after revocation.
    pub ttl: Duration,
    /// Known keys remembered at most (`TOOLFLEET_GATEWAY_KEY_CACHE_ENTRIES`, default
    /// 10,000); past it the least recently used key is forgotten, never the whole cache.
    /// The keys PostgreSQL ever confirmed (spared the failure bucket below) are
    /// remembered in as many entries of their own.
    pub entries: usize,
    /// How long a key PostgreSQL does not know (or knows as revoked) is answered 401
    /// without asking again (`TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_MS`, default 10 s; 0:
    /// not remembered). Keys are generated when they are created, so no client holds
    /// a key before it exists; a key that was looked up as unknown starts working at most
    /// this long after it appears in `api_keys`.
    pub unknown_ttl: Duration,
    /// Unknown keys remembered at most (`TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_ENTRIES`,
    /// default 10,000), least recently used forgotten first.
    pub unknown_entries: usize,
    /// Failed key checks one client address (an IPv6 client: its /64) may make at once
    /// (`TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST`, default 20). Past it, every request of
    /// that address whose key is neither in the known-key cache nor one PostgreSQL has
    /// confirmed before gets 429 `rate_limited` with `Retry-After`, before PostgreSQL is
    /// asked; a key that worked before is looked up again whatever the address's
    /// failures, so a valid key never waits behind another client of its address.
    pub failure_burst: u32,
    /// Failed key checks a client address earns back a minute
    /// (`TOOLFLEET_GATEWAY_AUTH_FAILURES_PER_MIN`, default 30).
    pub failures_per_min: u32,
}

impl Default for KeyCheckConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_KEY_CACHE,
            entries: DEFAULT_KEY_CACHE_ENTRIES,
            unknown_ttl: DEFAULT_UNKNOWN_KEY_CACHE,
            unknown_entries: DEFAULT_UNKNOWN_KEY_CACHE_ENTRIES,
            failure_burst: DEFAULT_AUTH_FAILURE_BURST,
            failures_per_min: DEFAULT_AUTH_FAILURES_PER_MIN,
        }
    }
}

impl KeyCheckConfig {
    /// Reads the settings from the environment; a malformed or out-of-range value is an
    /// error naming its variable.
    pub fn from_env() -> Result<Self, ConfigError> {
        let d = Self::default();
        Ok(Self {
            ttl: env_ms_in("TOOLFLEET_GATEWAY_KEY_CACHE_MS", d.ttl, 0..=300_000)?,
            entries: env_in(
                "TOOLFLEET_GATEWAY_KEY_CACHE_ENTRIES",
                d.entries,
                1..=1_000_000,
            )?,
            unknown_ttl: env_ms_in(
                "TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_MS",
                d.unknown_ttl,
                0..=300_000,
            )?,
            unknown_entries: env_in(
                "TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_ENTRIES",
                d.unknown_entries,
                1..=1_000_000,
            )?,
            failure_burst: env_in(
                "TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST",
                d.failure_burst,
                1..=1_000_000,
            )?,
            failures_per_min: env_in(
                "TOOLFLEET_GATEWAY_AUTH_FAILURES_PER_MIN",
                d.failures_per_min,
                1..=1_000_000,
            )?,
        })
    }
}

/// Gateway settings from the environment.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Listen address (`TOOLFLEET_GATEWAY_ADDR`, default `0.0.0.0:8080`).
    pub addr: SocketAddr,
    /// NATS URL (`TOOLFLEET_NATS_URL`).
    pub nats_url: String,
    /// The gateway's own NATS user (`TOOLFLEET_NATS_USER`, `TOOLFLEET_NATS_PASSWORD`).
    pub nats_credentials: NatsCredentials,
    /// Subject prefix (`TOOLFLEET_PREFIX`).
    pub prefix: String,
    /// PostgreSQL holding the API keys (`TOOLFLEET_DATABASE_URL`).
    pub database_url: String,
    /// How API keys are checked: how long and how many known keys are trusted
    /// (`TOOLFLEET_GATEWAY_KEY_CACHE_MS`, default 5 s: a revoked key stops working at most
    /// this long after revocation), unknown keys remembered, and failed checks allowed
    /// per client address. See [`KeyCheckConfig`].
    pub key_cache: KeyCheckConfig,
    /// Largest request body in bytes (`TOOLFLEET_GATEWAY_MAX_BODY_BYTES`, default 1 MiB).
    pub max_body_bytes: usize,
    /// Requests per second each API key may make on average
    /// (`TOOLFLEET_GATEWAY_RATE_PER_S`, default 20).
    pub rate_per_s: f64,
    /// Requests one API key may make at once above its rate (`TOOLFLEET_GATEWAY_BURST`,
    /// default 40).
    pub burst: f64,
    /// Turns this gateway follows at once; more are refused with 503 `overloaded`
    /// (`TOOLFLEET_GATEWAY_MAX_TURNS`, default 1024).
    pub max_turns: usize,
    /// Deadline of a turn that names none, as the gateway waits for it
    /// (`TOOLFLEET_DEFAULT_DEADLINE_MS`, default 15 s).
    pub default_deadline: Duration,
    /// How long after a turn's deadline the gateway still waits for its `final`
    /// (`TOOLFLEET_GATEWAY_FINAL_GRACE_MS`, default 5 s).
    pub final_grace: Duration,
    /// Origins allowed by CORS (`TOOLFLEET_GATEWAY_CORS_ORIGINS`, comma-separated; empty:
    /// no CORS headers, same origin only).
    pub cors_origins: Vec<String>,
    /// Base URL of the Jaeger UI the live page links to (`TOOLFLEET_GATEWAY_JAEGER_URL`).
    pub jaeger_url: String,
    /// Whether a client that goes away from a turn's event stream before its `final`
    /// cancels the turn (`TOOLFLEET_GATEWAY_CANCEL_ON_DISCONNECT`, default `false`: the
    /// turn runs on and `GET /v1/turns/{id}/events` resumes it).
    pub cancel_on_disconnect: bool,
    /// The model server `POST /v1/chat/completions` forwards to, and how its tool loop
    /// runs (`TOOLFLEET_UPSTREAM_*`, `TOOLFLEET_OPENAI_*`).
    pub upstream: UpstreamConfig,
    /// Address of the operational endpoint, `/healthz`, `/readyz` and `/metrics`
    /// (`TOOLFLEET_HTTP_ADDR`, default `off`): a port of its own, so metrics never show
    /// on the public API port.
    pub ops_addr: Option<SocketAddr>,
    /// `Host` values `/mcp` accepts (`TOOLFLEET_GATEWAY_MCP_ALLOWED_HOSTS`, comma-separated;
    /// default the loopback names): the MCP transport refuses others, against DNS
    /// rebinding. Add the gateway's public host names.
    pub mcp_allowed_hosts: Vec<String>,
    /// MCP sessions one API key may hold open at once
    /// (`TOOLFLEET_GATEWAY_MCP_SESSIONS_PER_KEY`, default 32). A key opening one more
    /// loses its own least recently used session (its next request there gets 404 and
    /// the client opens a new one); other keys' sessions are never touched.
    pub mcp_sessions_per_key: usize,
    /// How long an MCP session may go without a request before it is closed
    /// (`TOOLFLEET_GATEWAY_MCP_SESSION_IDLE_MS`, default 10 min: longer than any call runs).
    pub mcp_session_idle: Duration,
    /// The secret stream tokens are signed with (`TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET`,
    /// at least 32 bytes; the same on every replica behind one address). Required by
    /// [`GatewayConfig::from_env`] unless the gateway listens on a loopback address
    /// only; `None` (a loopback gateway without it, or a config built in code): a random
    /// secret per process, so a token works only on the process that minted it.
    pub stream_token_secret: Option<crate::stream_token::TokenSecret>,
    /// How long a stream token lives at least (`TOOLFLEET_GATEWAY_STREAM_TOKEN_TTL_MS`,
    /// default 10 min); a token minted with a turn lives past that turn's deadline.
    pub stream_token_ttl: Duration,
}

/// The OpenAI-compatible upstream of `/v1/chat/completions` and the loop's limits.
#[derive(Clone, PartialEq)]
pub struct UpstreamConfig {
    /// Base URL of any OpenAI-compatible server, up to and including its `/v1`
    /// (`TOOLFLEET_UPSTREAM_BASE_URL`, e.g. `https://api.openai.com/v1`); unset: the
    /// route answers 503 `upstream_not_configured`.
    pub base_url: Option<String>,
    /// Bearer key sent upstream (`TOOLFLEET_UPSTREAM_API_KEY`).
    pub api_key: Option<String>,
    /// Model that replaces the request's `model` (`TOOLFLEET_UPSTREAM_MODEL`).
    pub model: Option<String>,
    /// Rounds of fleet tool calls before the loop stops (`TOOLFLEET_OPENAI_MAX_ROUNDS`).
    pub max_rounds: u32,
    /// Calls of one round that run; later ones get `too_many_calls`
    /// (`TOOLFLEET_OPENAI_MAX_CALLS_PER_ROUND`).
    pub max_calls_per_round: usize,
    /// How long one upstream request may take (`TOOLFLEET_UPSTREAM_TIMEOUT_MS`).
    pub timeout: Duration,
    /// TLS to an `https://` upstream: `TOOLFLEET_UPSTREAM_CA_FILE` (trusted instead of
    /// the system's roots), `TOOLFLEET_UPSTREAM_CERT_FILE` and `_KEY_FILE` (a client
    /// certificate for servers that verify clients).
    pub tls: TlsFiles,
    /// How long the loop reuses a tenant's fleet catalog before asking the coordinators
    /// again (`TOOLFLEET_OPENAI_CATALOG_CACHE_MS`, default 1 s; 0: every request asks).
    pub catalog_cache: Duration,
}

impl std::fmt::Debug for UpstreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "***"))
            .field("model", &self.model)
            .field("max_rounds", &self.max_rounds)
            .field("max_calls_per_round", &self.max_calls_per_round)
            .field("timeout", &self.timeout)
            .field("catalog_cache", &self.catalog_cache)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            base_url: None,
            api_key: None,
            model: None,
            max_rounds: 8,
            max_calls_per_round: 16,
            timeout: Duration::from_secs(120),
            catalog_cache: Duration::from_secs(1),
            tls: TlsFiles::none(),
        }
    }
}

impl UpstreamConfig {
    fn from_env() -> Result<Self, ConfigError> {
        let d = Self::default();
        let optional = |name: &str| Some(env_string(name, "")).filter(|v| !v.is_empty());
        Ok(Self {
            base_url: optional("TOOLFLEET_UPSTREAM_BASE_URL")
                .map(|url| url.trim_end_matches('/').to_string()),
            api_key: optional("TOOLFLEET_UPSTREAM_API_KEY"),
            model: optional("TOOLFLEET_UPSTREAM_MODEL"),
            max_rounds: env_in("TOOLFLEET_OPENAI_MAX_ROUNDS", d.max_rounds, 1..=64)?,
            max_calls_per_round: env_in(
                "TOOLFLEET_OPENAI_MAX_CALLS_PER_ROUND",
                d.max_calls_per_round,
                1..=256,
            )?,
            timeout: env_ms_in("TOOLFLEET_UPSTREAM_TIMEOUT_MS", d.timeout, 1000..=600_000)?,
            catalog_cache: env_ms_in(
                "TOOLFLEET_OPENAI_CATALOG_CACHE_MS",
                d.catalog_cache,
                0..=60_000,
            )?,
            tls: TlsFiles::from_env(&UPSTREAM_TLS)?,
        })
    }
}

impl GatewayConfig {
    /// Defaults against local servers.
    pub fn local() -> Self {
        let Endpoints {
            nats_url,
            nats_credentials,
            prefix,
            ..
        } = Endpoints::local();
        Self {
            addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            nats_url,
            nats_credentials,
            prefix,
            database_url: DEFAULT_DATABASE_URL.to_string(),
            key_cache: KeyCheckConfig::default(),
            max_body_bytes: 1024 * 1024,
            rate_per_s: 20.0,
            burst: 40.0,
            max_turns: 1024,
            default_deadline: Duration::from_secs(15),
            final_grace: Duration::from_secs(5),
            cors_origins: Vec::new(),
            jaeger_url: DEFAULT_JAEGER_URL.to_string(),
            cancel_on_disconnect: false,
            upstream: UpstreamConfig::default(),
            ops_addr: None,
            mcp_allowed_hosts: ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec(),
            mcp_sessions_per_key: DEFAULT_MCP_SESSIONS_PER_KEY,
            mcp_session_idle: DEFAULT_MCP_SESSION_IDLE,
            stream_token_secret: None,
            stream_token_ttl: DEFAULT_STREAM_TOKEN_TTL,
        }
    }

    /// Reads the configuration from the environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        let d = Self::local();
        let Endpoints {
            nats_url,
            nats_credentials,
            prefix,
            ..
        } = Endpoints::from_env()?;
        let addr_text = env_string("TOOLFLEET_GATEWAY_ADDR", DEFAULT_ADDR);
        let addr: SocketAddr = addr_text.parse().map_err(|e| ConfigError {
            name: "TOOLFLEET_GATEWAY_ADDR".into(),
            value: addr_text.clone(),
            reason: format!("{e}"),
        })?;
        let stream_token_secret = stream_token_secret(addr)?;
        Ok(Self {
            addr,
            nats_url,
            nats_credentials,
            prefix,
            database_url: env_string("TOOLFLEET_DATABASE_URL", DEFAULT_DATABASE_URL),
            key_cache: KeyCheckConfig::from_env()?,
            max_body_bytes: env_in(
                "TOOLFLEET_GATEWAY_MAX_BODY_BYTES",
                d.max_body_bytes,
                1024..=64 * 1024 * 1024,
            )?,
            rate_per_s: env_in("TOOLFLEET_GATEWAY_RATE_PER_S", d.rate_per_s, 0.01..=1e6)?,
            burst: env_in("TOOLFLEET_GATEWAY_BURST", d.burst, 1.0..=1e6)?,
            max_turns: env_in("TOOLFLEET_GATEWAY_MAX_TURNS", d.max_turns, 1..=1_000_000)?,
            default_deadline: env_ms_in(
                "TOOLFLEET_DEFAULT_DEADLINE_MS",
                d.default_deadline,
                1..=3_600_000,
            )?,
            final_grace: env_ms_in(
                "TOOLFLEET_GATEWAY_FINAL_GRACE_MS",
                d.final_grace,
                1..=600_000,
            )?,
            cors_origins: env_string("TOOLFLEET_GATEWAY_CORS_ORIGINS", "")
                .split(',')
                .map(str::trim)
                .filter(|o| !o.is_empty())
                .map(String::from)
                .collect(),
            jaeger_url: env_string("TOOLFLEET_GATEWAY_JAEGER_URL", DEFAULT_JAEGER_URL),
            cancel_on_disconnect: env_or(
                "TOOLFLEET_GATEWAY_CANCEL_ON_DISCONNECT",
                d.cancel_on_disconnect,
            )?,
            upstream: UpstreamConfig::from_env()?,
            ops_addr: toolfleet_common::http::addr_from_env("off")?,
            mcp_allowed_hosts: env_string(
                "TOOLFLEET_GATEWAY_MCP_ALLOWED_HOSTS",
                &d.mcp_allowed_hosts.join(","),
            )
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .map(String::from)
            .collect(),
            mcp_sessions_per_key: env_in(
                "TOOLFLEET_GATEWAY_MCP_SESSIONS_PER_KEY",
                d.mcp_sessions_per_key,
                1..=10_000,
            )?,
            mcp_session_idle: env_ms_in(
                "TOOLFLEET_GATEWAY_MCP_SESSION_IDLE_MS",
                d.mcp_session_idle,
                1000..=86_400_000,
            )?,
            stream_token_secret,
            stream_token_ttl: env_ms_in(
                "TOOLFLEET_GATEWAY_STREAM_TOKEN_TTL_MS",
                d.stream_token_ttl,
                1000..=86_400_000,
            )?,
        })
    }
}

/// `TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET` for a gateway listening on `addr`: shorter than
/// [`MIN_STREAM_TOKEN_SECRET`] bytes is an error (the value is never repeated); unset or
/// empty is an error too unless `addr` is a loopback address. A gateway anyone else can
/// reach may be one of several replicas behind one address, or restart under a browser's
/// open `EventSource`: with a secret drawn per process, a token minted by one replica is
/// refused by the next (401, on which an `EventSource` stops for good). A loopback-only
/// gateway (`toolfleet up`, tests) has no neighbour: there `None` means a per-process
/// secret.
fn stream_token_secret(
    addr: SocketAddr,
) -> Result<Option<crate::stream_token::TokenSecret>, ConfigError> {
    let text = env_string(STREAM_TOKEN_SECRET_VAR, "");
    match text.len() {
        0 if addr.ip().is_loopback() => Ok(None),
        0 => Err(ConfigError {
            name: STREAM_TOKEN_SECRET_VAR.into(),
            value: String::new(),
            reason: format!(
                "required when the gateway listens beyond loopback (TOOLFLEET_GATEWAY_ADDR={addr}): \
                 every replica behind one address, and the same replica after a restart, must \
                 sign stream tokens with the same secret; set at least \
                 {MIN_STREAM_TOKEN_SECRET} bytes (e.g. `openssl rand -hex 32`), the same on \
                 every replica"
            ),
        }),
        n if n < MIN_STREAM_TOKEN_SECRET => Err(ConfigError {
            name: STREAM_TOKEN_SECRET_VAR.into(),
            value: "***".into(),
            reason: format!("at least {MIN_STREAM_TOKEN_SECRET} bytes are required"),
        }),
        _ => Ok(Some(crate::stream_token::TokenSecret::new(&text))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_check_settings_refuse_malformed_values() {
        // Only this test sets these variables.
        assert_eq!(
            KeyCheckConfig::from_env().ok(),
            Some(KeyCheckConfig::default())
        );
        for (name, bad) in [
            ("TOOLFLEET_GATEWAY_KEY_CACHE_ENTRIES", "lots"),
            ("TOOLFLEET_GATEWAY_KEY_CACHE_ENTRIES", "0"),
            ("TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_MS", "-1"),
            ("TOOLFLEET_GATEWAY_UNKNOWN_KEY_CACHE_ENTRIES", "0"),
            ("TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST", "1.5"),
            ("TOOLFLEET_GATEWAY_AUTH_FAILURES_PER_MIN", "0"),
        ] {
            std::env::set_var(name, bad);
            let outcome = KeyCheckConfig::from_env();
            std::env::remove_var(name);
            assert_eq!(
                outcome.err().map(|e| e.name),
                Some(name.to_string()),
                "{name}={bad}"
            );
        }
        std::env::set_var("TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST", "5");
        let outcome = KeyCheckConfig::from_env();
        std::env::remove_var("TOOLFLEET_GATEWAY_AUTH_FAILURE_BURST");
        assert_eq!(outcome.ok().map(|c| c.failure_burst), Some(5));
    }

    #[test]
    fn a_gateway_beyond_loopback_needs_a_shared_stream_token_secret() {
        // No test sets the variable.
        let at = |addr: &str| stream_token_secret(addr.parse().unwrap_or(([0; 4], 0).into()));
        assert!(matches!(at("127.0.0.1:8080"), Ok(None)));
        assert!(matches!(at("[::1]:8080"), Ok(None)));
        for public in ["0.0.0.0:8080", "[::]:8080", "10.1.2.3:8080"] {
            let refused = at(public).err();
            assert_eq!(
                refused.as_ref().map(|e| e.name.as_str()),
                Some(STREAM_TOKEN_SECRET_VAR),
                "{public}"
            );
            assert!(refused.is_some_and(|e| e.reason.contains("openssl rand")));
        }
    }
}
