//! API keys as PostgreSQL keeps them (`api_keys`, `migrations/0004_api_keys.sql`, per-key
//! chat limits in `0005_api_key_chat_limits.sql`): the key format, the hash the table
//! stores instead of the key, reading a key's row, and the admin operations
//! `toolfleet admin keys create|list|limit|revoke` runs ([`create`], [`list`],
//! [`set_chat_limits`], [`revoke`]).
//!
//! A crate of its own so that the `toolfleet` command manages keys without linking the
//! HTTP gateway; the gateway's cached, rate-limited lookup (`toolfleet_gateway::keys`)
//! reads rows through [`lookup_sql`] and [`record`]. A key maps to exactly one tenant.
//! Never stores or logs a key itself.

use std::time::Duration;

use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio_postgres::{Client, NoTls, Row};
use toolfleet_common::turn::normalize_tenant;

/// The database of API keys when `TOOLFLEET_DATABASE_URL` is unset.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/toolfleet";
/// Every key starts with this.
pub const KEY_PREFIX: &str = "tfk_";
/// Characters of a key shown in listings (`tfk_` and 8 hex digits).
const SHOWN: usize = 12;
/// Longest wait for PostgreSQL to accept a connection or answer a lookup.
pub const DB_WAIT: Duration = Duration::from_secs(3);

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
/// and a request's option (`toolfleet_gateway::openai::LoopOptions`).
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
    pub fn strictness(gate: Option<Self>) -> u8 {
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

/// The lookup of an unrevoked key by its hash (`$1`): the row [`record`] reads.
pub fn lookup_sql() -> String {
    format!(
        "SELECT id::text AS id, tenant_id, name, {CHAT_COLUMNS} FROM api_keys
         WHERE key_hash = $1 AND revoked_at IS NULL"
    )
}

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

/// The key a row of [`LOOKUP_SQL`] describes.
pub fn record(row: &Row) -> Result<KeyRecord, KeyError> {
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
