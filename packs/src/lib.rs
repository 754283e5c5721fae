//! # toolfleet-packs
//!
//! The tool packs the `toolfleet-worker` binary (`src/bin/toolfleet-worker.rs`) hosts,
//! chosen by name (`TOOLFLEET_PACKS=demo,test`), and what they need: PostgreSQL ([`db`]) and tools
//! declared in a file that call HTTP endpoints ([`http_tool`]). Tools are built with the
//! worker SDK (`toolfleet-worker`: [`Tool`], `run`, the result cache); this crate owns
//! every tool toolfleet ships and must never reimplement what the SDK does (serving,
//! registering, acking, caching): a pack only builds [`Tool`]s.
//!
//! | pack | tools | needs |
//! |---|---|---|
//! | `demo` (alias `crm`) | CRM tools on the sample data shipped in the binary | nothing |
//! | `test` | tools that sleep, fail or panic on request | nothing |
//! | `conformance` | `conformance.probe`, the tool `toolfleet conformance` drives | nothing |
//! | `receptionist` | `get_latest_booking`, `get_policies`, ... on PostgreSQL | `TOOLFLEET_DATABASE_URL` |
//! | `crm-db` | the CRM tools (same names and arguments as `demo`) on PostgreSQL | `TOOLFLEET_DATABASE_URL` |
//! | `http` | tools declared in a file that call HTTP endpoints | `TOOLFLEET_HTTP_TOOLS_FILE` |
//! | `mcp` | the tools of MCP servers (stdio or Streamable HTTP), as `<server>.<tool>` | `TOOLFLEET_MCP_SERVERS` |
//!
//! The `mcp` pack's tools change while the worker runs (servers restart, their lists
//! change), so it is started with [`start_packs`], which hands the worker a
//! [`ToolSet`] for `toolfleet_worker::run_set`; [`tools_with`] serves the fixed packs.
//!
//! `demo` and `crm-db` serve the same tool names, so one worker serves one of them.
//! Results of the database packs are cached in Redis for `TOOLFLEET_CACHE_TTL_MS`.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | this file | pack selection: [`start_packs`], [`tools_for`], [`tools_with`], [`PackSettings`], [`PackError`] |
//! | [`crm`] | the `demo` pack on the sample data, and the spoken forms the other packs share |
//! | [`crm_db`] | the `crm-db` pack: the `demo` tools on PostgreSQL |
//! | [`receptionist`] | the `receptionist` pack |
//! | [`testing`] | the `test` and `conformance` packs |
//! | [`db`] | PostgreSQL for the database packs: pool, scoped read-only queries, migrations |
//! | [`keda`] | the worker's KEDA `ScaledObject`, one trigger per tool consumer |
//! | [`http_tool`] | the `http` pack: tools declared in a file that POST to an HTTP endpoint |
//! | [`json_file`] | reading the JSON settings files of the `http` and `mcp` packs |
//! | [`mcp`] | the `mcp` pack: MCP servers' tools, kept in the worker's set while the servers come and go |

pub mod crm;
pub mod crm_db;
pub mod db;
pub mod http_tool;
pub mod json_file;
pub mod keda;
pub mod mcp;
pub mod receptionist;
pub mod testing;

use std::path::PathBuf;
use std::time::Duration;

use toolfleet_common::config::{env_ms, ConfigError};
use toolfleet_common::Names;
use toolfleet_worker::cache::{CacheConfig, CacheError, ResultCache};
use toolfleet_worker::{Tool, ToolSet, WorkerConfig};

use crate::db::{Db, DbConfig};
use crate::http_tool::HttpToolError;
use crate::mcp::{McpConfigError, McpPack};

/// Pack names the binary knows.
pub const PACKS: &[&str] = &[
    "demo",
    "test",
    "conformance",
    "receptionist",
    "crm-db",
    "http",
    "mcp",
];

/// Packs whose tools change while the worker runs ([`start_packs`] only).
const RUN_TIME_PACKS: &[&str] = &["mcp"];

/// Packs that need no settings.
const STATIC_PACKS: &[&str] = &["demo", "crm", "test", "conformance", ""];

/// Settings of the packs that need more than their name.
#[derive(Debug, Clone, Default)]
pub struct PackSettings {
    /// The database of `receptionist` and `crm-db` (`TOOLFLEET_DATABASE_*`).
    pub database: Option<DbConfig>,
    /// The result cache of the database packs; `None` disables it.
    pub cache: Option<CacheConfig>,
    /// The declarations of the `http` pack (`TOOLFLEET_HTTP_TOOLS_FILE`).
    pub http_tools_file: Option<PathBuf>,
    /// The servers file of the `mcp` pack (`TOOLFLEET_MCP_SERVERS`).
    pub mcp_servers_file: Option<PathBuf>,
}

impl PackSettings {
    /// Reads the settings from the environment; the cache uses the Redis of
    /// `TOOLFLEET_CACHE_REDIS_URL`, else `worker`'s (and its TLS files), and its prefix,
    /// with a TTL of `TOOLFLEET_CACHE_TTL_MS` (default 30000; 0 disables it).
    pub fn from_env(worker: &WorkerConfig) -> Result<Self, ConfigError> {
        let ttl = env_ms("TOOLFLEET_CACHE_TTL_MS", CacheConfig::DEFAULT_TTL)?;
        let redis_url = std::env::var("TOOLFLEET_CACHE_REDIS_URL")
            .ok()
            .map(|url| url.trim().to_string())
            .filter(|url| !url.is_empty())
            .unwrap_or_else(|| worker.redis_url.clone());
        let cache = (ttl > Duration::ZERO).then(|| CacheConfig {
            ttl,
            redis_tls: worker.redis_tls.clone(),
            ..CacheConfig::new(redis_url, Names::new(worker.prefix.clone()))
        });
        Ok(Self {
            database: DbConfig::from_env()?,
            cache,
            http_tools_file: path_from_env("TOOLFLEET_HTTP_TOOLS_FILE"),
            mcp_servers_file: path_from_env("TOOLFLEET_MCP_SERVERS"),
        })
    }
}

/// The variable naming the packs the `toolfleet-worker` binary serves.
pub const PACKS_ENV: &str = "TOOLFLEET_PACKS";

/// The packs `TOOLFLEET_PACKS` names (`demo` when unset), refused when it names none: a
/// worker serving no tool would be ready and do nothing.
pub fn packs_from_env() -> Result<Vec<String>, ConfigError> {
    packs_from_setting(std::env::var(PACKS_ENV).ok())
}

/// [`packs_from_env`] of the variable's value (`None`: unset).
pub fn packs_from_setting(setting: Option<String>) -> Result<Vec<String>, ConfigError> {
    let setting = setting.unwrap_or_else(|| "demo".into());
    let packs: Vec<String> = setting
        .split(',')
        .map(str::trim)
        .filter(|pack| !pack.is_empty())
        .map(str::to_string)
        .collect();
    if packs.is_empty() {
        return Err(ConfigError {
            name: PACKS_ENV.to_string(),
            value: setting,
            reason: format!("names no tool pack: one or more of {PACKS:?}, comma-separated"),
        });
    }
    Ok(packs)
}

/// The path in the environment variable `name`, if set and not blank.
fn path_from_env(name: &str) -> Option<PathBuf> {
    std::env::var(name)
        .ok()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// Why the tools of a pack could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// No pack has that name.
    #[error("unknown tool pack {0:?} (known: {PACKS:?})")]
    Unknown(String),
    /// A pack needs a setting that is not there.
    #[error("tool pack {pack} needs {variable}")]
    MissingSetting {
        /// The pack.
        pack: &'static str,
        /// The environment variable.
        variable: &'static str,
    },
    /// A setting is malformed.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The HTTP tools could not be built.
    #[error(transparent)]
    Http(#[from] HttpToolError),
    /// The cache could not be set up.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The MCP servers file is unusable.
    #[error(transparent)]
    Mcp(#[from] McpConfigError),
    /// A pack whose tools change at run time was asked for a fixed list.
    #[error(
        "tool pack {0} has no fixed list of tools (its servers' tools change while the worker \
         runs), so it cannot be used here: serve it with `toolfleet up --packs {0}` or the \
         toolfleet-worker binary (TOOLFLEET_PACKS={0}); in code, start it with \
         toolfleet_packs::start_packs"
    )]
    RunTime(&'static str),
}

/// The tools of the named packs, with `settings` for those that need them.
pub fn tools_with(packs: &[&str], settings: &PackSettings) -> Result<Vec<Tool>, PackError> {
    let cache = settings.cache.clone().map(ResultCache::new).transpose()?;
    let mut db: Option<Db> = None;
    let mut database = |pack: &'static str| -> Result<Db, PackError> {
        if let Some(db) = &db {
            return Ok(db.clone());
        }
        let config = settings.database.clone().ok_or(PackError::MissingSetting {
            pack,
            variable: "TOOLFLEET_DATABASE_URL",
        })?;
        let pool = Db::new(config);
        db = Some(pool.clone());
        Ok(pool)
    };
    let mut tools = Vec::new();
    for pack in packs {
        match pack.trim() {
            "demo" | "crm" => tools.extend(crm::tools()),
            "test" => tools.extend(testing::tools()),
            "conformance" => tools.push(testing::conformance_tool(testing::CONFORMANCE_TOOL)),
            "receptionist" => tools.extend(receptionist::tools(
                &database("receptionist")?,
                cache.as_ref(),
            )),
            "crm-db" => tools.extend(crm_db::tools(&database("crm-db")?, cache.as_ref())),
            "http" => {
                let path = file_setting(
                    &settings.http_tools_file,
                    "http",
                    "TOOLFLEET_HTTP_TOOLS_FILE",
                )?;
                tools.extend(http_tool::tools_from_file(path)?);
            }
            "mcp" => return Err(PackError::RunTime("mcp")),
            "" => {}
            other => return Err(PackError::Unknown(other.to_string())),
        }
    }
    Ok(tools)
}

/// The file that configures `pack`, or why the pack cannot start: its environment
/// variable `variable` is not set.
fn file_setting<'a>(
    file: &'a Option<PathBuf>,
    pack: &'static str,
    variable: &'static str,
) -> Result<&'a PathBuf, PackError> {
    file.as_ref()
        .ok_or(PackError::MissingSetting { pack, variable })
}

/// The named packs, started: their tools as the set a worker serves
/// (`toolfleet_worker::run_set`), and the `mcp` pack's servers connected and supervised.
pub struct StartedPacks {
    /// The tools to serve; the `mcp` pack changes it while the servers come and go.
    pub tools: ToolSet,
    mcp: Option<McpPack>,
}

impl StartedPacks {
    /// Stops what the packs run (the MCP servers); call it after the worker stopped.
    pub async fn stop(self) {
        if let Some(mcp) = self.mcp {
            mcp.stop().await;
        }
    }
}

/// Starts the named packs with `settings`: the fixed packs' tools go into the set, and
/// the `mcp` pack connects to its servers (each within its connection timeout) and
/// keeps their tools in it.
pub async fn start_packs(
    packs: &[&str],
    settings: &PackSettings,
) -> Result<StartedPacks, PackError> {
    let (run_time, fixed): (Vec<&str>, Vec<&str>) = packs
        .iter()
        .map(|p| p.trim())
        .partition(|p| RUN_TIME_PACKS.contains(p));
    let tools = ToolSet::new(tools_with(&fixed, settings)?);
    let mut mcp = None;
    if !run_time.is_empty() {
        let path = file_setting(&settings.mcp_servers_file, "mcp", "TOOLFLEET_MCP_SERVERS")?;
        let servers = mcp::read_servers(path)?;
        mcp = Some(McpPack::start(servers, &tools).await);
    }
    Ok(StartedPacks { tools, mcp })
}

/// The tools of the named packs; packs that need settings read them from the
/// environment ([`PackSettings::from_env`]).
pub fn tools_for(packs: &[&str]) -> Result<Vec<Tool>, String> {
    let settings = if packs.iter().all(|p| STATIC_PACKS.contains(&p.trim())) {
        PackSettings::default()
    } else {
        let worker = WorkerConfig::from_env().map_err(|e| e.to_string())?;
        PackSettings::from_env(&worker).map_err(|e| e.to_string())?
    };
    tools_with(packs, &settings).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_must_name_a_pack() {
        assert_eq!(
            packs_from_setting(None).ok(),
            Some(vec!["demo".to_string()])
        );
        let two = packs_from_setting(Some(" demo, test ".into())).ok();
        assert_eq!(two, Some(vec!["demo".to_string(), "test".to_string()]));
        for none in ["", " ", ",", " , "] {
            let refused = packs_from_setting(Some(none.into())).expect_err(none);
            assert_eq!(refused.name, PACKS_ENV);
        }
    }
}
