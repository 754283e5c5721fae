//! Announcing this worker's tools in Redis: definitions for the coordinators' catalog
//! and validation, and a liveness entry per tool refreshed by a heartbeat.
//!
//! Reads back what coordinators refused of this worker's tools (a definition they
//! cannot read, a result they cannot record; PROTOCOL §2.6): logged at ERROR once per
//! refusal, and a refused definition fails `/readyz` ([`Refusals`]).
//!
//! Owns this worker's registry keys only (each tool's definition key and liveness set,
//! and adding the tool's name to the set of names); it must never write another worker's
//! entries or any key of a turn. Under the deploy/ Redis ACL it cannot: its Redis user
//! may write only its own tools' keys.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use toolfleet_common::call::unix_ms;
use toolfleet_common::http::Readiness;
use toolfleet_common::redis_client::RedisConnection;
use toolfleet_common::tool::Rejection;
use toolfleet_common::{Names, ToolDefinition};
use tracing::error;

/// What coordinators refused of this worker's tools, as last read from the registry.
#[derive(Debug, Clone, Default)]
pub struct Refusals {
    /// Tool → the refusal of its definition, while it stands.
    definitions: Arc<Mutex<HashMap<String, Rejection>>>,
    /// Tool → the last refused result seen (logged once).
    results: Arc<Mutex<HashMap<String, Rejection>>>,
}

impl Refusals {
    /// Why the worker is not ready: a tool whose definition coordinators refuse (its
    /// calls get `unknown_tool`). `None` when none is refused.
    pub fn not_ready(&self) -> Option<String> {
        let definitions = self.definitions.lock().ok()?;
        let (tool, rejection) = definitions.iter().next()?;
        Some(format!(
            "coordinators refuse the definition of {tool}: {}",
            rejection.reason
        ))
    }

    /// `check` that also fails while a definition is refused.
    pub fn guard(&self, check: Readiness) -> Readiness {
        let refusals = self.clone();
        Arc::new(move || {
            let (check, refusals) = (Arc::clone(&check), refusals.clone());
            Box::pin(async move {
                match refusals.not_ready() {
                    Some(why) => Err(why),
                    None => check().await,
                }
            })
        })
    }

    /// Takes in the refusals read for `tool`, logging each new one at ERROR.
    fn update(&self, tool: &str, definition: Option<Rejection>, result: Option<Rejection>) {
        if let Ok(mut definitions) = self.definitions.lock() {
            match definition {
                Some(rejection) => {
                    if definitions.get(tool) != Some(&rejection) {
                        error!(%tool, reason = %rejection.reason, "coordinators refuse this tool's definition; its calls get unknown_tool");
                    }
                    definitions.insert(tool.to_string(), rejection);
                }
                None => {
                    definitions.remove(tool);
                }
            }
        }
        let (Some(rejection), Ok(mut results)) = (result, self.results.lock()) else {
            return;
        };
        if results.get(tool) != Some(&rejection) {
            error!(%tool, reason = %rejection.reason, turn = ?rejection.turn_id, call = ?rejection.tool_call_id, "a coordinator refused a result of this tool");
            results.insert(tool.to_string(), rejection);
        }
    }
}

/// Waits before sending a beat again after it failed for a lost connection.
const BEAT_RETRY_DELAYS: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
];

/// This worker's entry in the tool registry.
pub struct Registration {
    redis: RedisConnection,
    names: Names,
    worker_id: String,
    /// Written beside each definition: the Redis user this worker connects as and its id.
    by: String,
    definitions: Vec<(String, String)>,
    ttl_ms: u64,
}

impl Registration {
    /// Prepares the registration of `tools`; an entry lives `ttl_ms` past each beat.
    /// `redis_user` is the Redis user the worker connects as (recorded with each
    /// definition it writes).
    pub fn new(
        redis: RedisConnection,
        names: Names,
        worker_id: String,
        redis_user: &str,
        tools: &[ToolDefinition],
        ttl_ms: u64,
    ) -> Result<Self, serde_json::Error> {
        let user = if redis_user.is_empty() {
            "default"
        } else {
            redis_user
        };
        Ok(Self {
            redis,
            names,
            by: format!("{user}/{worker_id}"),
            worker_id,
            definitions: serialized(tools)?,
            ttl_ms,
        })
    }

    /// The names of the tools this registration announces.
    pub fn tool_names(&self) -> impl Iterator<Item = &str> {
        self.definitions.iter().map(|(name, _)| name.as_str())
    }

    /// Announces `tools` from the next beat on, in place of the previous list; the names
    /// of the tools no longer listed, for [`Registration::withdraw_tools`].
    pub fn set_tools(
        &mut self,
        tools: &[ToolDefinition],
    ) -> Result<Vec<String>, serde_json::Error> {
        let definitions = serialized(tools)?;
        let dropped = self
            .definitions
            .iter()
            .filter(|(name, _)| !definitions.iter().any(|(kept, _)| kept == name))
            .map(|(name, _)| name.clone())
            .collect();
        self.definitions = definitions;
        Ok(dropped)
    }

    /// Writes the definitions and marks this worker alive for each tool; prunes workers
    /// whose entries expired.
    ///
    /// A Redis connection is found dead only by a command that fails on it, and the
    /// reconnect starts then: a beat that fails for a lost connection is sent again
    /// after [`BEAT_RETRY_DELAYS`], so a Redis restart since the last beat never costs a
    /// beat (restarts closer together than a heartbeat would otherwise let every entry
    /// expire).
    pub async fn beat(&mut self) -> redis::RedisResult<()> {
        let mut delays = BEAT_RETRY_DELAYS.iter();
        loop {
            match self.beat_once().await {
                Err(error) if error.is_io_error() || error.is_unrecoverable_error() => {
                    match delays.next() {
                        Some(delay) => tokio::time::sleep(*delay).await,
                        None => return Err(error),
                    }
                }
                other => return other,
            }
        }
    }

    async fn beat_once(&mut self) -> redis::RedisResult<()> {
        if self.definitions.is_empty() {
            return Ok(());
        }
        let now = unix_ms();
        let mut pipe = redis::pipe();
        for (name, json) in &self.definitions {
            let workers = self.names.tool_workers_key(name);
            pipe.cmd("HSET")
                .arg(self.names.tool_definition_key(name))
                .arg("definition")
                .arg(json)
                .arg("by")
                .arg(&self.by)
                .ignore();
            pipe.zadd(&workers, &self.worker_id, now + self.ttl_ms)
                .ignore();
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(&workers)
                .arg("-inf")
                .arg(now)
                .ignore();
        }
        pipe.query_async(&mut self.redis).await
    }

    /// Writes `definition` (and its name) without a liveness entry: the coordinator
    /// creates the tool's consumer from it before the worker serves the tool.
    pub async fn write_definition(
        &mut self,
        definition: &ToolDefinition,
    ) -> Result<(), crate::WorkerError> {
        let json = serde_json::to_string(definition)?;
        let mut pipe = redis::pipe();
        pipe.cmd("HSET")
            .arg(self.names.tool_definition_key(&definition.name))
            .arg("definition")
            .arg(json)
            .arg("by")
            .arg(&self.by)
            .ignore();
        Ok(pipe.query_async(&mut self.redis).await?)
    }

    /// Reads what coordinators refused of these tools into `refusals`.
    pub async fn read_refusals(&mut self, refusals: &Refusals) -> redis::RedisResult<()> {
        if self.definitions.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (name, _) in &self.definitions {
            pipe.hget(self.names.rejected_definitions_key(), name);
            pipe.hget(self.names.rejected_results_key(), name);
        }
        let read: Vec<Option<String>> = pipe.query_async(&mut self.redis).await?;
        let decode = |raw: Option<&Option<String>>| {
            raw.and_then(Option::as_deref)
                .and_then(|json| serde_json::from_str::<Rejection>(json).ok())
        };
        for (i, (name, _)) in self.definitions.iter().enumerate() {
            refusals.update(name, decode(read.get(2 * i)), decode(read.get(2 * i + 1)));
        }
        Ok(())
    }

    /// Removes this worker's liveness entries (definitions stay for the catalog).
    pub async fn withdraw(&mut self) -> redis::RedisResult<()> {
        let all: Vec<String> = self.definitions.iter().map(|(n, _)| n.clone()).collect();
        self.withdraw_tools(&all).await
    }

    /// Removes this worker's liveness entries of the tools `names` (definitions stay for
    /// the catalog, which lists only tools with a live worker).
    pub async fn withdraw_tools(&mut self, names: &[String]) -> redis::RedisResult<()> {
        if names.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for name in names {
            pipe.zrem(self.names.tool_workers_key(name), &self.worker_id)
                .ignore();
        }
        pipe.query_async(&mut self.redis).await
    }
}

/// Each definition with its JSON.
fn serialized(tools: &[ToolDefinition]) -> Result<Vec<(String, String)>, serde_json::Error> {
    tools
        .iter()
        .map(|d| Ok((d.name.clone(), serde_json::to_string(d)?)))
        .collect()
}
