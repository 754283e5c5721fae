//! API keys: made, hashed, stored in PostgreSQL (`api_keys`, `migrations/0004_api_keys.sql`,
//! per-key chat limits in `0005_api_key_chat_limits.sql`), looked up through two bounded
//! caches (known keys, unknown keys) behind a limit on failed checks per client address.
//!
//! Owns the key format (`tfk_` and 64 hex digits of randomness), the SHA-256 the table
//! stores instead of the key, the gateway's cached lookup ([`KeyStore`]), and the admin
//! operations `toolfleet admin keys create|list|limit|revoke` runs ([`create`], [`list`],
//! [`set_chat_limits`], [`revoke`]). A key maps to exactly one tenant. Never stores or logs a key itself, and
//! never writes from the gateway: the gateway only reads.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio_postgres::{Client, NoTls, Row, Statement};
use toolfleet_common::turn::normalize_tenant;

use crate::config::KeyCheckConfig;
use crate::limits::FailureLimiter;

/// Every key starts with this.
pub const KEY_PREFIX: &str = "tfk_";
/// Characters of a key shown in listings (`tfk_` and 8 hex digits).
const SHOWN: usize = 12;
/// Longest wait for PostgreSQL to accept a connection or answer a lookup.
const DB_WAIT: Duration = Duration::from_secs(3);

/// Why the key store could not answer.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// PostgreSQL refused, broke or stayed silent.
    #[error("the key database is unavailable: {0}")]
    Unavailable(String),
    /// The command's input is unusable (an empty tenant, an unknown key id).
    #[error("{0}")]
    Invalid(String),
}

/// A key as the gateway knows it: which tenant it speaks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyRecord {
    /// The key's id (`api_keys.id`).
    pub id: String,
    /// The tenant every request with this key runs for (normalized).
    pub tenant: String,
    /// The name given at creation.
    pub name: String,
    /// Limits of this key's chat-completions loop.
    pub chat: ChatLimits,
}

/// The stop-after gate of the chat-completions loop: a key's limit ([`ChatLimits`])
/// and a request's option (`openai::LoopOptions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopAfter {
    /// After the first round of fleet calls the model must answer in text.
    First,
    /// After the first round with several calls the model must answer in text.
    Burst,
}

impl StopAfter {
    /// How early the gate stops the loop: `first` stops no later than `burst`.
    pub(crate) fn strictness(gate: Option<Self>) -> u8 {
        match gate {
            None => 0,
            Some(Self::Burst) => 1,
            Some(Self::First) => 2,
        }
    }
}

/// A key's limits on the chat-completions loop; `None` leaves the gateway's
/// configuration in force. A request may tighten them, never loosen them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ChatLimits {
    /// Rounds of fleet calls (1–64).
    pub max_rounds: Option<u32>,
    /// Calls of one round (1–256).
    pub max_calls_per_round: Option<u32>,
    /// The stop-after gate.
    pub stop_after: Option<StopAfter>,
}

impl ChatLimits {
    /// Checks the bounds the table enforces, with a clear message.
    pub fn validate(&self) -> Result<(), KeyError> {
        if self.max_rounds.is_some_and(|r| !(1..=64).contains(&r)) {
            return Err(KeyError::Invalid("max rounds must be 1 to 64".into()));
        }
        if self
            .max_calls_per_round
            .is_some_and(|c| !(1..=256).contains(&c))
        {
            return Err(KeyError::Invalid(
                "max calls per round must be 1 to 256".into(),
            ));
        }
        Ok(())
    }
}

/// The column value of `stop_after`.
fn stop_after_text(stop_after: Option<StopAfter>) -> Option<&'static str> {
    stop_after.map(|s| match s {
        StopAfter::First => "first",
        StopAfter::Burst => "burst",
    })
}

/// The limits in `row`'s `chat_*` columns.
fn chat_limits(row: &Row) -> Result<ChatLimits, KeyError> {
    let int = |name: &str| -> Result<Option<u32>, KeyError> {
        let value: Option<i32> = row
            .try_get(name)
            .map_err(|e| KeyError::Unavailable(format!("column {name}: {e}")))?;
        Ok(value.and_then(|v| u32::try_from(v).ok()))
    };
    let stop_after: Option<String> = row
        .try_get("chat_stop_after")
        .map_err(|e| KeyError::Unavailable(format!("column chat_stop_after: {e}")))?;
    Ok(ChatLimits {
        max_rounds: int("chat_max_rounds")?,
        max_calls_per_round: int("chat_max_calls_per_round")?,
        stop_after: match stop_after.as_deref() {
            Some("first") => Some(StopAfter::First),
            Some("burst") => Some(StopAfter::Burst),
            _ => None,
        },
    })
}

/// The columns of a key's chat limits, for a SELECT or RETURNING list.
const CHAT_COLUMNS: &str = "chat_max_rounds, chat_max_calls_per_round, chat_stop_after";

/// SHA-256 of `key`, as 64 hex digits (what `api_keys.key_hash` holds).
pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A fresh key: `tfk_` and 64 hex digits from two random UUIDs (244 random bits).
pub fn generate_key() -> String {
    format!(
        "{KEY_PREFIX}{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Connects to PostgreSQL at `url`, the connection driven by a task of its own.
pub async fn connect(url: &str) -> Result<Client, KeyError> {
    let connecting = tokio_postgres::connect(url, NoTls);
    let (client, connection) = tokio::time::timeout(DB_WAIT, connecting)
        .await
        .map_err(|_| KeyError::Unavailable(format!("no connection within {DB_WAIT:?}")))?
        .map_err(|e| KeyError::Unavailable(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(%error, "key database connection ended");
        }
    });
    Ok(client)
}

/// What checking a key from a client found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyCheck {
    /// A known, unrevoked key.
    Known(KeyRecord),
    /// An unknown or revoked key (the client's failure count went up).
    Unknown,
    /// The client failed too many checks: retry after this many seconds. PostgreSQL
    /// was not asked.
    TooManyFailures(u64),
}

/// A bounded map from key hashes to answers, each trusted for `ttl`; when full, the
/// least recently used entry is forgotten (never the whole map).
#[derive(Debug)]
struct Lru<V> {
    capacity: usize,
    ttl: Duration,
    tick: u64,
    entries: HashMap<String, Entry<V>>,
    /// Hashes by last use, oldest first.
    order: BTreeMap<u64, String>,
}

#[derive(Debug)]
struct Entry<V> {
    value: V,
    at: Instant,
    used: u64,
}

impl<V: Clone> Lru<V> {
    fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            capacity: capacity.max(1),
            ttl,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// The answer for `hash` if it is younger than the TTL; marks it used.
    fn get(&mut self, hash: &str, now: Instant) -> Option<V> {
        let entry = self.entries.get_mut(hash)?;
        if now.saturating_duration_since(entry.at) >= self.ttl {
            self.remove(hash);
            return None;
        }
        self.tick += 1;
        if let Some(name) = self.order.remove(&entry.used) {
            self.order.insert(self.tick, name);
        }
        entry.used = self.tick;
        Some(entry.value.clone())
    }

    /// Remembers `value` for `hash`, forgetting the least recently used entries past
    /// the capacity. Nothing is remembered with a TTL of zero.
    fn insert(&mut self, hash: &str, value: V, now: Instant) {
        if self.ttl.is_zero() {
            return;
        }
        self.remove(hash);
        while self.entries.len() >= self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
        }
        self.tick += 1;
        self.order.insert(self.tick, hash.to_string());
        self.entries.insert(
            hash.to_string(),
            Entry {
                value,
                at: now,
                used: self.tick,
            },
        );
    }

    fn remove(&mut self, hash: &str) {
        if let Some(entry) = self.entries.remove(hash) {
            self.order.remove(&entry.used);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// The gateway's view of `api_keys`: lookups by hash, known keys remembered for the
/// cache period in a bounded cache of their own, unknown keys in another (so a flood of
/// bad keys neither reaches PostgreSQL each time nor pushes a good key out), and a
/// bucket of failed checks per client address taken before PostgreSQL is asked.
pub struct KeyStore {
    url: String,
    settings: KeyCheckConfig,
    client: tokio::sync::Mutex<Option<Arc<Connection>>>,
    known: Mutex<Lru<KeyRecord>>,
    unknown: Mutex<Lru<()>>,
    failures: FailureLimiter,
    queries: AtomicU64,
}

impl std::fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStore")
            .field("settings", &self.settings)
            .finish()
    }
}

impl KeyStore {
    /// A store reading PostgreSQL at `url`, caching and limiting as `settings` say.
    pub fn new(url: impl Into<String>, settings: KeyCheckConfig) -> Self {
        Self {
            url: url.into(),
            settings,
            client: tokio::sync::Mutex::new(None),
            known: Mutex::new(Lru::new(settings.entries, settings.ttl)),
            unknown: Mutex::new(Lru::new(settings.unknown_entries, settings.unknown_ttl)),
            failures: FailureLimiter::new(settings.failures_per_min, settings.failure_burst),
            queries: AtomicU64::new(0),
        }
    }

    /// Checks `key` presented by the client at `peer`. A key in the known-key cache
    /// answers at once; otherwise the check takes one of the address's failure tokens
    /// (none left: [`KeyCheck::TooManyFailures`], and PostgreSQL is not asked), and a
    /// known key gives it back.
    pub async fn check(&self, peer: IpAddr, key: &str) -> Result<KeyCheck, KeyError> {
        let hash = hash_key(key);
        if let Some(record) = self.cached_known(&hash) {
            return Ok(KeyCheck::Known(record));
        }
        if let Err(wait) = self.failures.take(peer) {
            return Ok(KeyCheck::TooManyFailures(wait));
        }
        match self.lookup_hash(&hash).await {
            Ok(Some(record)) => {
                self.failures.refund(peer);
                Ok(KeyCheck::Known(record))
            }
            Ok(None) => Ok(KeyCheck::Unknown),
            Err(error) => {
                // Not the client's failure.
                self.failures.refund(peer);
                Err(error)
            }
        }
    }

    /// The key's record, `None` for an unknown or revoked key (through the caches, with
    /// no failure counted).
    pub async fn lookup(&self, key: &str) -> Result<Option<KeyRecord>, KeyError> {
        let hash = hash_key(key);
        if let Some(record) = self.cached_known(&hash) {
            return Ok(Some(record));
        }
        self.lookup_hash(&hash).await
    }

    /// Queries sent to PostgreSQL so far (lookups and readiness checks).
    pub fn queries(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }

    /// Whether PostgreSQL answers and the table is there.
    pub async fn ready(&self) -> Result<(), KeyError> {
        self.query(&hash_key("")).await.map(|_| ())
    }

    fn cached_known(&self, hash: &str) -> Option<KeyRecord> {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.get(hash, Instant::now())
    }

    /// The unknown-key cache, then PostgreSQL; remembers the answer.
    async fn lookup_hash(&self, hash: &str) -> Result<Option<KeyRecord>, KeyError> {
        {
            let mut unknown = self.unknown.lock().unwrap_or_else(|p| p.into_inner());
            if unknown.get(hash, Instant::now()).is_some() {
                return Ok(None);
            }
        }
        let found = self.query(hash).await?;
        let now = Instant::now();
        match &found {
            Some(record) => {
                self.unknown
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(hash);
                self.known.lock().unwrap_or_else(|p| p.into_inner()).insert(
                    hash,
                    record.clone(),
                    now,
                );
            }
            None => self
                .unknown
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(hash, (), now),
        }
        Ok(found)
    }

    async fn query(&self, hash: &str) -> Result<Option<KeyRecord>, KeyError> {
        let connection = self.connection().await?;
        self.queries.fetch_add(1, Ordering::Relaxed);
        let answer = tokio::time::timeout(
            DB_WAIT,
            connection.client.query_opt(&connection.lookup, &[&hash]),
        )
        .await;
        match answer {
            Ok(Ok(row)) => row.map(|r| record(&r)).transpose(),
            Ok(Err(e)) => {
                self.forget(&connection).await;
                Err(KeyError::Unavailable(e.to_string()))
            }
            Err(_) => {
                self.forget(&connection).await;
                Err(KeyError::Unavailable(format!(
                    "no answer within {DB_WAIT:?}"
                )))
            }
        }
    }

    /// The open connection, or a new one with the lookup prepared (one round trip and
    /// one transaction a lookup afterwards, instead of a prepare each time).
    async fn connection(&self) -> Result<Arc<Connection>, KeyError> {
        let mut slot = self.client.lock().await;
        match slot.as_ref() {
            Some(connection) if !connection.client.is_closed() => Ok(connection.clone()),
            _ => {
                let client = connect(&self.url).await?;
                let sql = format!(
                    "SELECT id::text AS id, tenant_id, name, {CHAT_COLUMNS} FROM api_keys
                     WHERE key_hash = $1 AND revoked_at IS NULL"
                );
                let lookup = tokio::time::timeout(DB_WAIT, client.prepare(&sql))
                    .await
                    .map_err(|_| KeyError::Unavailable(format!("no answer within {DB_WAIT:?}")))?
                    .map_err(|e| KeyError::Unavailable(e.to_string()))?;
                let connection = Arc::new(Connection { client, lookup });
                *slot = Some(connection.clone());
                Ok(connection)
            }
        }
    }

    /// Drops `connection` so the next lookup connects again.
    async fn forget(&self, connection: &Arc<Connection>) {
        let mut slot = self.client.lock().await;
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, connection)) {
            *slot = None;
        }
    }
}

/// The key store's connection and its prepared lookup.
struct Connection {
    client: Client,
    lookup: Statement,
}

fn record(row: &Row) -> Result<KeyRecord, KeyError> {
    let text = |name: &str| -> Result<String, KeyError> {
        row.try_get(name)
            .map_err(|e| KeyError::Unavailable(format!("column {name}: {e}")))
    };
    Ok(KeyRecord {
        id: text("id")?,
        tenant: text("tenant_id")?,
        name: text("name")?,
        chat: chat_limits(row)?,
    })
}

/// A key as `toolfleet admin keys create` prints it: the only time the key is shown.
#[derive(Debug, Clone, Serialize)]
pub struct CreatedKey {
    /// The key's id.
    pub id: String,
    /// The tenant.
    pub tenant: String,
    /// The name.
    pub name: String,
    /// The key itself; only its hash is stored.
    pub key: String,
}

/// A key as `toolfleet admin keys list` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct ListedKey {
    /// The key's id.
    pub id: String,
    /// The tenant.
    pub tenant: String,
    /// The name.
    pub name: String,
    /// The key's first characters.
    pub prefix: String,
    /// When it was made (RFC 3339).
    pub created_at: String,
    /// When it was revoked, if it was.
    pub revoked_at: Option<String>,
    /// Its chat-completions limits.
    pub chat: ChatLimits,
}

const TIMES: &str =
    "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS created_at,
     to_char(revoked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS revoked_at";

/// Makes a key for `tenant` named `name` and stores its hash.
pub async fn create(client: &Client, tenant: &str, name: &str) -> Result<CreatedKey, KeyError> {
    let tenant = normalize_tenant(tenant);
    if tenant.is_empty() {
        return Err(KeyError::Invalid("a key needs a tenant".into()));
    }
    let key = generate_key();
    let row = client
        .query_one(
            "INSERT INTO api_keys (tenant_id, name, key_hash, key_prefix) VALUES ($1, $2, $3, $4)
             RETURNING id::text AS id",
            &[&tenant, &name.trim(), &hash_key(&key), &&key[..SHOWN]],
        )
        .await
        .map_err(|e| KeyError::Unavailable(e.to_string()))?;
    Ok(CreatedKey {
        id: row
            .try_get("id")
            .map_err(|e| KeyError::Unavailable(e.to_string()))?,
        tenant,
        name: name.trim().to_string(),
        key,
    })
}

/// Every key, or only `tenant`'s, newest first.
pub async fn list(client: &Client, tenant: Option<&str>) -> Result<Vec<ListedKey>, KeyError> {
    let tenant = tenant.map(normalize_tenant).unwrap_or_default();
    let sql = format!(
        "SELECT id::text AS id, tenant_id, name, key_prefix, {TIMES}, {CHAT_COLUMNS}
         FROM api_keys WHERE $1 = '' OR tenant_id = $1 ORDER BY created_at DESC, id"
    );
    let rows = client
        .query(&sql, &[&tenant])
        .await
        .map_err(|e| KeyError::Unavailable(e.to_string()))?;
    rows.iter().map(listed).collect()
}

/// Revokes key `id`; its hash stays, so it can never work again.
pub async fn revoke(client: &Client, id: &str) -> Result<ListedKey, KeyError> {
    let id = uuid::Uuid::parse_str(id.trim())
        .map_err(|_| KeyError::Invalid(format!("{id:?} is not a key id")))?;
    let sql = format!(
        "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1::text::uuid
         RETURNING id::text AS id, tenant_id, name, key_prefix, {TIMES}, {CHAT_COLUMNS}"
    );
    let row = client
        .query_opt(&sql, &[&id.to_string()])
        .await
        .map_err(|e| KeyError::Unavailable(e.to_string()))?
        .ok_or_else(|| KeyError::Invalid(format!("no key {id}")))?;
    listed(&row)
}

/// Sets key `id`'s chat limits to `limits` (a `None` clears that limit); the gateway
/// applies them within its key cache period.
pub async fn set_chat_limits(
    client: &Client,
    id: &str,
    limits: ChatLimits,
) -> Result<ListedKey, KeyError> {
    limits.validate()?;
    let id = uuid::Uuid::parse_str(id.trim())
        .map_err(|_| KeyError::Invalid(format!("{id:?} is not a key id")))?;
    let sql = format!(
        "UPDATE api_keys SET chat_max_rounds = $2, chat_max_calls_per_round = $3,
                chat_stop_after = $4
         WHERE id = $1::text::uuid
         RETURNING id::text AS id, tenant_id, name, key_prefix, {TIMES}, {CHAT_COLUMNS}"
    );
    let int = |v: Option<u32>| v.and_then(|v| i32::try_from(v).ok());
    let row = client
        .query_opt(
            &sql,
            &[
                &id.to_string(),
                &int(limits.max_rounds),
                &int(limits.max_calls_per_round),
                &stop_after_text(limits.stop_after),
            ],
        )
        .await
        .map_err(|e| KeyError::Unavailable(e.to_string()))?
        .ok_or_else(|| KeyError::Invalid(format!("no key {id}")))?;
    listed(&row)
}

fn listed(row: &Row) -> Result<ListedKey, KeyError> {
    let get = |name: &str| -> Result<Option<String>, KeyError> {
        row.try_get(name)
            .map_err(|e| KeyError::Unavailable(format!("column {name}: {e}")))
    };
    Ok(ListedKey {
        id: get("id")?.unwrap_or_default(),
        tenant: get("tenant_id")?.unwrap_or_default(),
        name: get("name")?.unwrap_or_default(),
        prefix: get("key_prefix")?.unwrap_or_default(),
        created_at: get("created_at")?.unwrap_or_default(),
        revoked_at: get("revoked_at")?,
        chat: chat_limits(row)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> KeyRecord {
        KeyRecord {
            id: id.into(),
            tenant: "acme".into(),
            name: "test".into(),
            chat: ChatLimits::default(),
        }
    }

    #[test]
    fn a_full_cache_forgets_its_least_recently_used_key_only() {
        let mut cache = Lru::new(3, Duration::from_secs(60));
        let now = Instant::now();
        cache.insert("a", record("a"), now);
        for other in ["b", "c", "d", "e", "f", "g"] {
            // `a` is used between the others, so it is never the oldest.
            assert_eq!(cache.get("a", now), Some(record("a")));
            cache.insert(other, record(other), now);
            assert!(cache.len() <= 3);
        }
        assert_eq!(cache.get("a", now), Some(record("a")));
        assert_eq!(cache.get("g", now), Some(record("g")));
        assert_eq!(
            cache.get("b", now),
            None,
            "the oldest went, not the whole cache"
        );
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn cached_answers_expire_and_a_zero_ttl_caches_nothing() {
        let mut cache = Lru::new(10, Duration::from_secs(5));
        let now = Instant::now();
        cache.insert("a", (), now);
        assert_eq!(cache.get("a", now + Duration::from_secs(4)), Some(()));
        assert_eq!(cache.get("a", now + Duration::from_secs(5)), None);
        assert_eq!(cache.len(), 0);
        let mut off = Lru::new(10, Duration::ZERO);
        off.insert("a", (), now);
        assert_eq!(off.get("a", now), None);
        assert_eq!(off.len(), 0);
    }

    #[test]
    fn keys_are_random_and_hashed() {
        let (a, b) = (generate_key(), generate_key());
        assert_ne!(a, b);
        assert!(a.starts_with(KEY_PREFIX) && a.len() == KEY_PREFIX.len() + 64);
        assert_eq!(hash_key(&a).len(), 64);
        assert_eq!(hash_key(&a), hash_key(&a));
        assert_ne!(hash_key(&a), hash_key(&b));
    }
}
