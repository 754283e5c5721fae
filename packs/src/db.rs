//! PostgreSQL for the database-backed tool packs: settings, a small connection pool whose
//! connections run as the read-only role, tenant-scoped read-only queries, the schema
//! migrations (`migrations/*.sql`, tracked in `schema_migrations`) and the demo seed,
//! and [`Db::tool`] / [`cached`], which turn a database handler into a (cached) tool.
//! It must never run a tool's query outside [`Db::query_scoped`], nor hold tool logic.
//!
//! Every query a tool runs goes through [`Db::query_scoped`]: one `READ ONLY` transaction
//! on a connection that did `SET ROLE <reader>` and `default_transaction_read_only = on`,
//! with `toolfleet.business_id` set to the turn's tenant so the row-level security
//! policies of `migrations/0003_reader_role.sql` hide every other business's rows.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row};
use toolfleet_common::config::{env_ms, env_or, ConfigError};
use toolfleet_common::CallError;
use toolfleet_worker::cache::ResultCache;
use toolfleet_worker::tool::{Tool, ToolBuilder, ToolContext, ToolError, ToolOutput};
use tracing::debug;
use uuid::Uuid;

/// Code of a call that could not reach the database in time (retryable).
pub const DATABASE_UNAVAILABLE: &str = "database_unavailable";
/// Code of a query the database refused (not retryable).
pub const DATABASE_ERROR: &str = "database_error";

/// The role tools run as unless `TOOLFLEET_DATABASE_ROLE` says otherwise.
pub const DEFAULT_READER_ROLE: &str = "toolfleet_reader";

/// Schema migrations in the order they are applied: (version, SQL).
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_receptionist",
        include_str!("../../migrations/0001_receptionist.sql"),
    ),
    ("0002_crm", include_str!("../../migrations/0002_crm.sql")),
    (
        "0003_reader_role",
        include_str!("../../migrations/0003_reader_role.sql"),
    ),
    (
        "0004_api_keys",
        include_str!("../../migrations/0004_api_keys.sql"),
    ),
    (
        "0005_api_key_chat_limits",
        include_str!("../../migrations/0005_api_key_chat_limits.sql"),
    ),
];

/// Demo rows for two businesses (idempotent; see `migrations/seed/demo_businesses.sql`).
pub const DEMO_SEED: &str = include_str!("../../migrations/seed/demo_businesses.sql");

/// Key of the advisory lock that serialises migrations of one database.
const MIGRATION_LOCK: i64 = 0x746f_6f6c_666c_6565;

/// Database settings of the tool packs.
#[derive(Debug, Clone)]
pub struct DbConfig {
    /// Connection URL (`TOOLFLEET_DATABASE_URL`), e.g.
    /// `postgres://toolfleet@127.0.0.1:5432/toolfleet`.
    pub url: String,
    /// Role every connection switches to (`TOOLFLEET_DATABASE_ROLE`, default
    /// `toolfleet_reader`; empty keeps the login role).
    pub role: Option<String>,
    /// Most connections open at once (`TOOLFLEET_DATABASE_POOL`, default 4).
    pub max_connections: usize,
    /// Budget of one tool query: waiting for a connection, connecting, and the
    /// transaction (`TOOLFLEET_DATABASE_TIMEOUT_MS`, default 300). Also the server-side
    /// `statement_timeout`.
    pub timeout: Duration,
}

impl DbConfig {
    /// Settings for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            role: Some(DEFAULT_READER_ROLE.to_string()),
            max_connections: 4,
            timeout: Duration::from_millis(300),
        }
    }

    /// Reads the settings from the environment; `None` when `TOOLFLEET_DATABASE_URL` is
    /// unset or empty.
    pub fn from_env() -> Result<Option<Self>, ConfigError> {
        let url = match std::env::var("TOOLFLEET_DATABASE_URL") {
            Ok(url) if !url.trim().is_empty() => url.trim().to_string(),
            _ => return Ok(None),
        };
        let d = Self::new(url);
        let role = match std::env::var("TOOLFLEET_DATABASE_ROLE") {
            Ok(role) if role.trim().is_empty() => None,
            Ok(role) => Some(role.trim().to_string()),
            Err(_) => d.role.clone(),
        };
        Ok(Some(Self {
            role,
            max_connections: env_or("TOOLFLEET_DATABASE_POOL", d.max_connections)?.max(1),
            timeout: env_ms("TOOLFLEET_DATABASE_TIMEOUT_MS", d.timeout)?,
            url: d.url,
        }))
    }
}

/// Why a query failed.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// No connection could be had in time, or the connection broke.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The query did not finish within the budget.
    #[error("database query timed out after {0:?}")]
    Timeout(Duration),
    /// The database refused the query.
    #[error("database error: {0}")]
    Query(String),
}

impl DbError {
    /// Whether the same query could succeed later.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, DbError::Query(_))
    }

    fn from_pg(error: &tokio_postgres::Error) -> Self {
        if error.is_closed() {
            return DbError::Unavailable(error.to_string());
        }
        let Some(state) = error.code() else {
            // No SQLSTATE: an I/O or protocol failure of the connection.
            return DbError::Unavailable(error.to_string());
        };
        let code = state.code();
        if code.starts_with("08")
            || *state == SqlState::ADMIN_SHUTDOWN
            || *state == SqlState::CRASH_SHUTDOWN
            || *state == SqlState::CANNOT_CONNECT_NOW
            || *state == SqlState::TOO_MANY_CONNECTIONS
            || *state == SqlState::T_R_SERIALIZATION_FAILURE
            || *state == SqlState::T_R_DEADLOCK_DETECTED
        {
            DbError::Unavailable(error.to_string())
        } else if *state == SqlState::QUERY_CANCELED {
            DbError::Unavailable(format!("query cancelled (statement timeout): {error}"))
        } else {
            let detail = error
                .as_db_error()
                .map_or_else(|| error.to_string(), |db| db.message().to_string());
            DbError::Query(format!("{detail} (SQLSTATE {code})"))
        }
    }
}

impl From<DbError> for CallError {
    fn from(error: DbError) -> Self {
        if error.is_retryable() {
            CallError::retryable(DATABASE_UNAVAILABLE, error.to_string())
        } else {
            CallError::fatal(DATABASE_ERROR, error.to_string())
        }
    }
}

/// Counters of a [`Db`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DbStats {
    /// Connections opened so far.
    pub connections_opened: u64,
    /// Scoped queries that returned rows.
    pub queries: u64,
    /// Scoped queries that failed.
    pub failures: u64,
}

/// A pool of read-only connections, opened on demand. Cheap to clone.
#[derive(Clone)]
pub struct Db {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("role", &self.inner.config.role)
            .field("max_connections", &self.inner.config.max_connections)
            .finish()
    }
}

struct Inner {
    config: DbConfig,
    /// Open connections not in use; a broken one is dropped when taken.
    idle: Mutex<Vec<Client>>,
    /// One permit per connection that may be open.
    slots: Arc<Semaphore>,
    connections_opened: AtomicU64,
    queries: AtomicU64,
    failures: AtomicU64,
}

impl Db {
    /// A pool for `config`; nothing is opened until the first query.
    pub fn new(config: DbConfig) -> Self {
        let slots = Arc::new(Semaphore::new(config.max_connections.max(1)));
        Self {
            inner: Arc::new(Inner {
                config,
                idle: Mutex::new(Vec::new()),
                slots,
                connections_opened: AtomicU64::new(0),
                queries: AtomicU64::new(0),
                failures: AtomicU64::new(0),
            }),
        }
    }

    /// The settings in use.
    pub fn config(&self) -> &DbConfig {
        &self.inner.config
    }

    /// Counters so far.
    pub fn stats(&self) -> DbStats {
        DbStats {
            connections_opened: self.inner.connections_opened.load(Ordering::Relaxed),
            queries: self.inner.queries.load(Ordering::Relaxed),
            failures: self.inner.failures.load(Ordering::Relaxed),
        }
    }

    /// `builder` finished with `handler`, which gets a handle on this pool with every call
    /// (a database tool's handler is `async fn(Db, ToolContext, Args)`).
    pub fn tool<A, F, Fut>(&self, builder: ToolBuilder, handler: F) -> Tool
    where
        A: DeserializeOwned + schemars::JsonSchema + Send + 'static,
        F: Fn(Db, ToolContext, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<ToolOutput, ToolError>> + Send + 'static,
    {
        let db = self.clone();
        builder.handler(move |ctx, args: A| handler(db.clone(), ctx, args))
    }

    /// Runs `sql` with `params` in a read-only transaction scoped to `business`, within
    /// the configured budget. A connection that failed or timed out is not reused.
    pub async fn query_scoped(
        &self,
        business: Uuid,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, DbError> {
        let budget = self.inner.config.timeout;
        let outcome = tokio::time::timeout(budget, self.query_inner(business, sql, params)).await;
        let result = match outcome {
            Ok(result) => result,
            Err(_) => Err(DbError::Timeout(budget)),
        };
        let counter = if result.is_ok() {
            &self.inner.queries
        } else {
            &self.inner.failures
        };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    async fn query_inner(
        &self,
        business: Uuid,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, DbError> {
        let _permit = Arc::clone(&self.inner.slots)
            .acquire_owned()
            .await
            .map_err(|_| DbError::Unavailable("the pool is closed".into()))?;
        let mut client = match self.take_idle() {
            Some(client) => client,
            None => self.connect().await?,
        };
        let result = run_scoped(&mut client, business, sql, params).await;
        match &result {
            Ok(_) => self.give_back(client),
            Err(DbError::Query(_)) if !client.is_closed() => self.give_back(client),
            Err(_) => {}
        }
        result
    }

    fn take_idle(&self) -> Option<Client> {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(client) = idle.pop() {
            if !client.is_closed() {
                return Some(client);
            }
        }
        None
    }

    fn give_back(&self, client: Client) {
        if client.is_closed() {
            return;
        }
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.push(client);
    }

    async fn connect(&self) -> Result<Client, DbError> {
        let config = &self.inner.config;
        let (client, connection) = tokio_postgres::connect(&config.url, NoTls)
            .await
            .map_err(|e| DbError::from_pg(&e))?;
        // The connection task ends when the client is dropped or the server goes away.
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                debug!(%error, "database connection ended");
            }
        });
        let mut setup = String::from("SET default_transaction_read_only = on; ");
        setup.push_str(&format!(
            "SET statement_timeout = {}; ",
            config.timeout.as_millis().max(1)
        ));
        if let Some(role) = &config.role {
            setup.push_str(&format!("SET ROLE {};", quote_ident(role)));
        }
        client
            .batch_execute(&setup)
            .await
            .map_err(|e| DbError::from_pg(&e))?;
        self.inner
            .connections_opened
            .fetch_add(1, Ordering::Relaxed);
        Ok(client)
    }
}

/// `tool` with its results cached in `cache` (varying on the context entries `vary_on`),
/// or `tool` unchanged without a cache.
pub fn cached(cache: Option<&ResultCache>, tool: Tool, vary_on: &[&str]) -> Tool {
    match cache {
        Some(cache) => cache.wrap(tool, vary_on),
        None => tool,
    }
}

async fn run_scoped(
    client: &mut Client,
    business: Uuid,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, DbError> {
    let tx = client
        .build_transaction()
        .read_only(true)
        .start()
        .await
        .map_err(|e| DbError::from_pg(&e))?;
    tx.execute(
        "SELECT set_config('toolfleet.business_id', $1, true)",
        &[&business.to_string()],
    )
    .await
    .map_err(|e| DbError::from_pg(&e))?;
    let rows = tx
        .query(sql, params)
        .await
        .map_err(|e| DbError::from_pg(&e))?;
    tx.commit().await.map_err(|e| DbError::from_pg(&e))?;
    Ok(rows)
}

/// `name` as a quoted SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Why migrations or the seed failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The database could not be reached.
    #[error("connecting to the database: {0}")]
    Connect(#[source] tokio_postgres::Error),
    /// A migration or the seed failed; nothing of that step was applied.
    #[error("{step}: {source}")]
    Step {
        /// The migration version, or `seed`.
        step: String,
        /// The database's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The URL does not name a database.
    #[error("the database URL {0:?} names no database")]
    NoDatabase(String),
}

/// Connects with `url` (no role switch), driving the connection on a task.
pub async fn connect_admin(url: &str) -> Result<Client, MigrateError> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(MigrateError::Connect)?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            debug!(%error, "admin connection ended");
        }
    });
    Ok(client)
}

/// Applies the migrations `client`'s database has not had yet, each in its own
/// transaction, under an advisory lock; returns the versions applied now.
pub async fn migrate(client: &mut Client) -> Result<Vec<String>, MigrateError> {
    let step = |step: &str| {
        let step = step.to_string();
        move |source| MigrateError::Step {
            step: step.clone(),
            source,
        }
    };
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                 version    text PRIMARY KEY,
                 applied_at timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await
        .map_err(step("schema_migrations"))?;
    let mut applied = Vec::new();
    for (version, sql) in MIGRATIONS {
        let tx = client.transaction().await.map_err(step(version))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(step(version))?;
        let done = tx
            .query_opt(
                "SELECT 1 FROM schema_migrations WHERE version = $1",
                &[version],
            )
            .await
            .map_err(step(version))?;
        if done.is_some() {
            continue;
        }
        tx.batch_execute(sql).await.map_err(step(version))?;
        tx.execute(
            "INSERT INTO schema_migrations (version) VALUES ($1)",
            &[version],
        )
        .await
        .map_err(step(version))?;
        tx.commit().await.map_err(step(version))?;
        applied.push((*version).to_string());
    }
    Ok(applied)
}

/// Inserts the demo rows of two businesses (idempotent).
pub async fn seed_demo(client: &mut Client) -> Result<(), MigrateError> {
    let tx = client
        .transaction()
        .await
        .map_err(|source| MigrateError::Step {
            step: "seed".into(),
            source,
        })?;
    tx.batch_execute(DEMO_SEED)
        .await
        .map_err(|source| MigrateError::Step {
            step: "seed".into(),
            source,
        })?;
    tx.commit().await.map_err(|source| MigrateError::Step {
        step: "seed".into(),
        source,
    })
}

/// Creates the database `url` names when it does not exist, connecting to the
/// `postgres` database of the same server; returns whether it was created.
pub async fn create_database_if_missing(url: &str) -> Result<bool, MigrateError> {
    let config: tokio_postgres::Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| MigrateError::Connect(e))?;
    let name = config
        .get_dbname()
        .map(str::to_string)
        .ok_or_else(|| MigrateError::NoDatabase(url.to_string()))?;
    let mut maintenance = config.clone();
    maintenance.dbname("postgres");
    let (client, connection) = maintenance
        .connect(NoTls)
        .await
        .map_err(MigrateError::Connect)?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            debug!(%error, "maintenance connection ended");
        }
    });
    let exists = client
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await
        .map_err(|source| MigrateError::Step {
            step: "create database".into(),
            source,
        })?
        .is_some();
    if exists {
        return Ok(false);
    }
    client
        .batch_execute(&format!("CREATE DATABASE {}", quote_ident(&name)))
        .await
        .map_err(|source| MigrateError::Step {
            step: "create database".into(),
            source,
        })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("toolfleet_reader"), "\"toolfleet_reader\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn retryable_errors_map_to_the_unavailable_code() {
        let e: CallError = DbError::Timeout(Duration::from_millis(5)).into();
        assert_eq!((e.code.as_str(), e.retryable), (DATABASE_UNAVAILABLE, true));
        let e: CallError = DbError::Query("syntax".into()).into();
        assert_eq!((e.code.as_str(), e.retryable), (DATABASE_ERROR, false));
    }

    #[test]
    fn migrations_are_in_order() {
        let versions: Vec<&str> = MIGRATIONS.iter().map(|(v, _)| *v).collect();
        let mut sorted = versions.clone();
        sorted.sort_unstable();
        assert_eq!(versions, sorted);
    }
}
