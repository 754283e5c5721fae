//! The gateway's view of API keys: lookups by hash through two bounded caches (known
//! keys, unknown keys) behind a limit on failed checks per client address, which a key
//! PostgreSQL has confirmed before never waits behind.
//!
//! Owns the cached lookup ([`KeyStore`]) and what a check found ([`KeyCheck`]). The key
//! format, the table's rows and the admin operations live in `toolfleet-keys`
//! (re-exported here), which the `toolfleet` command uses without linking the gateway.
//! Never stores or logs a key itself, and never writes: the gateway only reads.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::{Client, Statement};
pub use toolfleet_keys::*;

use crate::config::KeyCheckConfig;
use crate::limits::FailureLimiter;

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

/// How long a key PostgreSQL confirmed is remembered as one (not trusted: only spared the
/// failure bucket of its address when it is looked up again).
const CONFIRMED_FOR: Duration = Duration::from_secs(7 * 24 * 3600);

/// The gateway's view of `api_keys`: lookups by hash, known keys remembered for the
/// cache period in a bounded cache of their own, unknown keys in another (so a flood of
/// bad keys neither reaches PostgreSQL each time nor pushes a good key out), and a
/// bucket of failed checks per client address taken before PostgreSQL is asked about a
/// key it never confirmed. Keys it confirmed are remembered apart (bounded like the
/// known keys, least recently used forgotten first): when their cache period ends they
/// are asked about again without a failure token, so a valid key never waits behind
/// the failures of another client of its address (behind one proxy, every client).
pub struct KeyStore {
    url: String,
    settings: KeyCheckConfig,
    client: tokio::sync::Mutex<Option<Arc<Connection>>>,
    known: Mutex<Lru<KeyRecord>>,
    unknown: Mutex<Lru<()>>,
    confirmed: Mutex<Lru<()>>,
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
            confirmed: Mutex::new(Lru::new(settings.entries, CONFIRMED_FOR)),
            failures: FailureLimiter::new(settings.failures_per_min, settings.failure_burst),
            queries: AtomicU64::new(0),
        }
    }

    /// Checks `key` presented by the client at `peer`. A key in the known-key cache
    /// answers at once. A key PostgreSQL confirmed before is asked about again without
    /// touching the address's failures (turned out revoked: it counts as a failure
    /// then). Any other key takes one of the address's failure tokens first (none left:
    /// [`KeyCheck::TooManyFailures`], and PostgreSQL is not asked), and gives it back
    /// when it is known.
    pub async fn check(&self, peer: IpAddr, key: &str) -> Result<KeyCheck, KeyError> {
        let hash = hash_key(key);
        if let Some(record) = self.cached_known(&hash) {
            return Ok(KeyCheck::Known(record));
        }
        let confirmed = self.was_confirmed(&hash);
        if !confirmed {
            if let Err(wait) = self.failures.take(peer) {
                return Ok(KeyCheck::TooManyFailures(wait));
            }
        }
        match self.lookup_hash(&hash).await {
            Ok(Some(record)) => {
                if !confirmed {
                    self.failures.refund(peer);
                }
                Ok(KeyCheck::Known(record))
            }
            Ok(None) => {
                if confirmed {
                    // Revoked since: a failure like any unknown key's from now on.
                    let _ = self.failures.take(peer);
                }
                Ok(KeyCheck::Unknown)
            }
            Err(error) => {
                // Not the client's failure.
                if !confirmed {
                    self.failures.refund(peer);
                }
                Err(error)
            }
        }
    }

    fn was_confirmed(&self, hash: &str) -> bool {
        let mut confirmed = self.confirmed.lock().unwrap_or_else(|p| p.into_inner());
        confirmed.get(hash, Instant::now()).is_some()
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
                self.confirmed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(hash, (), now);
                self.known.lock().unwrap_or_else(|p| p.into_inner()).insert(
                    hash,
                    record.clone(),
                    now,
                );
            }
            None => {
                self.confirmed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(hash);
                self.unknown
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(hash, (), now)
            }
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
            Ok(Ok(row)) => row.as_ref().map(toolfleet_keys::record).transpose(),
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
                let lookup = tokio::time::timeout(DB_WAIT, client.prepare(&lookup_sql()))
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
}
