//! A result cache in Redis for idempotent, read-only tools.
//!
//! Owns the cache keys (`tool_cache_key`) and their entries. It must never cache a tool
//! that is not idempotent (`wrap` returns it unchanged), never share an entry across
//! tenants, and never fail a call because Redis did.
//!
//! [`ResultCache::wrap`] returns a tool with the same definition whose handler first
//! looks the call up under a key made of the tenant, the tool, the arguments and the
//! context values the tool reads (`vary_on`), and stores successful results with a TTL.
//! The wrapped handler runs inside the runner like any other, so a cache hit still
//! produces the call's `started` notice, its result and its span; the hit is visible in
//! [`ResultCache::stats`] and as the `cache.hit` field of the `tool_cache` span.
//!
//! The cache is best effort: a Redis failure or a slow answer (more than
//! [`CacheConfig::op_timeout`]) counts as a miss and the tool runs.
//!
//! It is bounded whatever it is configured with: an entry is written only with
//! `SET key value PX ttl` (no other write command), a result whose entry is longer than
//! [`CacheConfig::MAX_VALUE_BYTES`] is not stored (counted in [`CacheStats::too_large`]),
//! and no entry lives longer than [`CacheConfig::MAX_TTL`]. The shipped worker user of
//! `deploy/redis/users.acl` may only read its tools' cache keys in the fleet's Redis
//! (`%R~`), so a pack that caches points [`CacheConfig::redis_url`] at a Redis of the
//! cache's own (`TOOLFLEET_CACHE_REDIS_URL`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;
use toolfleet_common::redis_client::{self, RedisConnection, RedisOptions};
use toolfleet_common::Names;
use tracing::{debug, field, info_span, Instrument};

use crate::tool::{Tool, ToolContext, ToolFuture, ToolOutput};

/// Settings of a [`ResultCache`].
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Redis URL.
    pub redis_url: String,
    /// Redis TLS files (the worker's `redis_tls`).
    pub redis_tls: toolfleet_common::tls::TlsFiles,
    /// Key names.
    pub names: Names,
    /// How long a result is served from the cache (`TOOLFLEET_CACHE_TTL_MS`); at most
    /// [`CacheConfig::MAX_TTL`], a longer one is shortened to it.
    pub ttl: Duration,
    /// Longest wait for one Redis command before the cache is skipped.
    pub op_timeout: Duration,
}

impl CacheConfig {
    /// Default TTL of cached results.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
    /// Default bound of one Redis command.
    pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_millis(50);
    /// The longest an entry lives, whatever [`CacheConfig::ttl`] asks.
    pub const MAX_TTL: Duration = Duration::from_secs(600);
    /// The largest entry stored (its JSON, in bytes); a larger result is not cached.
    pub const MAX_VALUE_BYTES: usize = 64 * 1024;

    /// Settings with the default TTL and command bound.
    pub fn new(redis_url: impl Into<String>, names: Names) -> Self {
        Self {
            redis_url: redis_url.into(),
            redis_tls: toolfleet_common::tls::TlsFiles::none(),
            names,
            ttl: Self::DEFAULT_TTL,
            op_timeout: Self::DEFAULT_OP_TIMEOUT,
        }
    }
}

/// Why a cache could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The Redis URL does not parse.
    #[error("cache redis url: {0}")]
    Url(#[from] redis::RedisError),
}

/// Counters of a [`ResultCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Calls answered from the cache.
    pub hits: u64,
    /// Calls that ran the tool because nothing was cached.
    pub misses: u64,
    /// Results stored.
    pub stores: u64,
    /// Redis failures or timeouts (each also counted as a miss or a failed store).
    pub errors: u64,
    /// Results not stored because their entry is over [`CacheConfig::MAX_VALUE_BYTES`].
    pub too_large: u64,
}

/// A Redis-backed cache of tool results. Cheap to clone; connects on first use.
#[derive(Clone)]
pub struct ResultCache {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ResultCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultCache")
            .field("ttl", &self.inner.config.ttl)
            .field("stats", &self.stats())
            .finish()
    }
}

struct Inner {
    config: CacheConfig,
    conn: OnceCell<RedisConnection>,
    hits: AtomicU64,
    misses: AtomicU64,
    stores: AtomicU64,
    errors: AtomicU64,
    too_large: AtomicU64,
}

/// What is stored per call.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    value: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    summary: Option<String>,
}

impl ResultCache {
    /// A cache for `config`; nothing is connected until the first call.
    pub fn new(config: CacheConfig) -> Result<Self, CacheError> {
        toolfleet_common::redis_client::RedisTarget::parse(&config.redis_url).map_err(|e| {
            CacheError::Url(toolfleet_common::redis_client::ConnectError::Url(e).into())
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                conn: OnceCell::new(),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                stores: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                too_large: AtomicU64::new(0),
            }),
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.inner.hits.load(Ordering::Relaxed),
            misses: self.inner.misses.load(Ordering::Relaxed),
            stores: self.inner.stores.load(Ordering::Relaxed),
            errors: self.inner.errors.load(Ordering::Relaxed),
            too_large: self.inner.too_large.load(Ordering::Relaxed),
        }
    }

    /// The key of a call of `tool` with `arguments` for `ctx`'s tenant, varying on the
    /// context values named in `vary_on`.
    pub fn key(
        &self,
        ctx: &ToolContext,
        tool: &str,
        arguments: &Value,
        vary_on: &[&str],
    ) -> String {
        let mut scope = Map::new();
        scope.insert("arguments".into(), canonical(arguments));
        let mut context = Map::new();
        for key in vary_on {
            context.insert(
                (*key).to_string(),
                ctx.context.get(*key).cloned().unwrap_or(Value::Null),
            );
        }
        scope.insert("context".into(), Value::Object(context));
        let digest = Sha256::digest(Value::Object(scope).to_string().as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        self.inner
            .config
            .names
            .tool_cache_key(&ctx.tenant_id, tool, &hex)
    }

    /// `tool` with its results cached, or `tool` unchanged when it is not idempotent.
    /// `vary_on` names the context entries the tool reads (e.g. the caller's phone).
    pub fn wrap(&self, tool: Tool, vary_on: &[&str]) -> Tool {
        let definition = tool.definition().clone();
        if !definition.retry.idempotent {
            return tool;
        }
        let cache = self.clone();
        let vary_on: Arc<Vec<String>> = Arc::new(vary_on.iter().map(|s| s.to_string()).collect());
        let name = definition.name.clone();
        Tool::from_fn(
            definition,
            move |ctx: ToolContext, arguments: Value| -> ToolFuture {
                let cache = cache.clone();
                let tool = tool.clone();
                let vary_on = Arc::clone(&vary_on);
                let name = name.clone();
                Box::pin(async move {
                    let vary: Vec<&str> = vary_on.iter().map(String::as_str).collect();
                    let key = cache.key(&ctx, &name, &arguments, &vary);
                    let span = info_span!("tool_cache", gen_ai.tool.name = %name, cache.hit = field::Empty);
                    let cached = cache.get(&key).instrument(span.clone()).await;
                    if let Some(entry) = cached {
                        span.record("cache.hit", true);
                        cache.inner.hits.fetch_add(1, Ordering::Relaxed);
                        return Ok(ToolOutput {
                            value: entry.value,
                            summary: entry.summary,
                        });
                    }
                    span.record("cache.hit", false);
                    cache.inner.misses.fetch_add(1, Ordering::Relaxed);
                    let output = tool.run(ctx, arguments).await?;
                    cache.put(&key, &output).instrument(span).await;
                    Ok(output)
                })
            },
        )
    }

    async fn connection(&self) -> Option<RedisConnection> {
        let init = self.inner.conn.get_or_try_init(|| {
            let url = self.inner.config.redis_url.clone();
            let options = RedisOptions::with_tls(self.inner.config.redis_tls.clone());
            async move { redis_client::connect(&url, options).await }
        });
        match tokio::time::timeout(self.inner.config.op_timeout, init).await {
            Ok(Ok(conn)) => Some(conn.clone()),
            Ok(Err(error)) => {
                debug!(%error, "cache: redis unavailable");
                None
            }
            Err(_) => {
                debug!("cache: redis connection timed out");
                None
            }
        }
    }

    async fn get(&self, key: &str) -> Option<Entry> {
        let Some(mut conn) = self.connection().await else {
            self.inner.errors.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        let get = cmd.query_async::<Option<String>>(&mut conn);
        match tokio::time::timeout(self.inner.config.op_timeout, get).await {
            Ok(Ok(Some(text))) => serde_json::from_str(&text).ok(),
            Ok(Ok(None)) => None,
            Ok(Err(error)) => {
                debug!(%error, "cache: GET failed");
                self.inner.errors.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(_) => {
                self.inner.errors.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    async fn put(&self, key: &str, output: &ToolOutput) {
        let entry = Entry {
            value: output.value.clone(),
            summary: output.summary.clone(),
        };
        let Some(text) = bounded_entry(&entry) else {
            self.inner.too_large.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Some(mut conn) = self.connection().await else {
            self.inner.errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let ttl_ms = bounded_ttl_ms(self.inner.config.ttl);
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(text).arg("PX").arg(ttl_ms);
        let set = cmd.query_async::<()>(&mut conn);
        match tokio::time::timeout(self.inner.config.op_timeout, set).await {
            Ok(Ok(())) => {
                self.inner.stores.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(error)) => {
                debug!(%error, "cache: SET failed");
                self.inner.errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.inner.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The JSON of `entry`, or `None` when it does not serialize or is longer than
/// [`CacheConfig::MAX_VALUE_BYTES`].
fn bounded_entry(entry: &Entry) -> Option<String> {
    serde_json::to_string(entry)
        .ok()
        .filter(|text| text.len() <= CacheConfig::MAX_VALUE_BYTES)
}

/// The TTL an entry is stored with: `ttl`, at least 1 ms and at most
/// [`CacheConfig::MAX_TTL`].
fn bounded_ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.min(CacheConfig::MAX_TTL).as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// `value` with every object's keys sorted, so equal arguments give equal keys whatever
/// order the model wrote them in.
fn canonical(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), canonical(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx(tenant: &str, phone: &str) -> ToolContext {
        let mut context = Map::new();
        context.insert("customer_phone".into(), json!(phone));
        ToolContext::new(tenant, context)
    }

    #[test]
    fn keys_depend_on_tenant_tool_arguments_and_varied_context() -> Result<(), CacheError> {
        let cache = ResultCache::new(CacheConfig::new("redis://127.0.0.1:1/", Names::default()))?;
        let a = json!({"topic": "cancellation", "x": {"b": 1, "a": 2}});
        let reordered: Value =
            serde_json::from_str(r#"{"x": {"a": 2, "b": 1}, "topic": "cancellation"}"#)
                .unwrap_or(Value::Null);
        let base = cache.key(&ctx("t1", "+1"), "get_policies", &a, &["customer_phone"]);
        assert_eq!(
            base,
            cache.key(
                &ctx("t1", "+1"),
                "get_policies",
                &reordered,
                &["customer_phone"]
            )
        );
        assert!(base.starts_with("fleet:cache:{t1}:get_policies:"));
        assert_ne!(
            base,
            cache.key(&ctx("t2", "+1"), "get_policies", &a, &["customer_phone"])
        );
        assert_ne!(
            base,
            cache.key(&ctx("t1", "+2"), "get_policies", &a, &["customer_phone"])
        );
        assert_ne!(
            base,
            cache.key(&ctx("t1", "+1"), "get_faqs", &a, &["customer_phone"])
        );
        assert_eq!(
            cache.key(&ctx("t1", "+1"), "get_policies", &a, &[]),
            cache.key(&ctx("t1", "+2"), "get_policies", &a, &[])
        );
        Ok(())
    }

    #[tokio::test]
    async fn unreachable_redis_is_a_miss_and_the_tool_runs() -> Result<(), CacheError> {
        let cache = ResultCache::new(CacheConfig::new("redis://127.0.0.1:1/", Names::default()))?;
        let tool = Tool::builder("t.echo", "echo").idempotent(2).handler(
            |_ctx: ToolContext, args: Value| async move {
                Ok::<_, crate::ToolError>(ToolOutput::new(args))
            },
        );
        let wrapped = cache.wrap(tool, &[]);
        let out = wrapped.call(ctx("t1", "+1"), json!({"a": 1})).await;
        assert_eq!(out.ok().map(|o| o.value), Some(json!({"a": 1})));
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.stores), (0, 1, 0));
        assert!(stats.errors >= 1);
        Ok(())
    }

    #[test]
    fn entries_are_bounded_in_size_and_lifetime() {
        let small = Entry {
            value: json!({"a": "x".repeat(100)}),
            summary: None,
        };
        assert!(bounded_entry(&small).is_some());
        let large = Entry {
            value: json!("x".repeat(64 << 20)),
            summary: None,
        };
        assert_eq!(bounded_entry(&large), None);
        assert_eq!(bounded_ttl_ms(Duration::from_secs(30)), 30_000);
        assert_eq!(bounded_ttl_ms(Duration::ZERO), 1);
        assert_eq!(bounded_ttl_ms(Duration::MAX), 600_000);
    }

    #[tokio::test]
    async fn a_result_too_large_to_cache_is_counted_and_returned() -> Result<(), CacheError> {
        let cache = ResultCache::new(CacheConfig::new("redis://127.0.0.1:1/", Names::default()))?;
        let tool = Tool::builder("t.big", "big").idempotent(2).handler(
            |_ctx: ToolContext, _args: Value| async move {
                Ok::<_, crate::ToolError>(ToolOutput::new(json!("x".repeat(1 << 20))))
            },
        );
        let wrapped = cache.wrap(tool, &[]);
        let out = wrapped.call(ctx("t1", "+1"), json!({})).await;
        assert_eq!(
            out.ok().and_then(|o| o.value.as_str().map(str::len)),
            Some(1 << 20)
        );
        let stats = cache.stats();
        assert_eq!((stats.stores, stats.too_large), (0, 1));
        Ok(())
    }
}
