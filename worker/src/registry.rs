//! Announcing this worker's tools in Redis: definitions for the coordinators' catalog
//! and validation, and a liveness entry per tool refreshed by a heartbeat.
//!
//! Owns this worker's registry keys only; it must never write another worker's entries
//! or any key of a turn.

use redis::aio::ConnectionManager;
use toolfleet_common::call::unix_ms;
use toolfleet_common::{Names, ToolDefinition};

/// This worker's entry in the tool registry.
pub struct Registration {
    redis: ConnectionManager,
    names: Names,
    worker_id: String,
    definitions: Vec<(String, String)>,
    ttl_ms: u64,
}

impl Registration {
    /// Prepares the registration of `tools`; an entry lives `ttl_ms` past each beat.
    pub fn new(
        redis: ConnectionManager,
        names: Names,
        worker_id: String,
        tools: &[ToolDefinition],
        ttl_ms: u64,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self {
            redis,
            names,
            worker_id,
            definitions: serialized(tools)?,
            ttl_ms,
        })
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
    pub async fn beat(&mut self) -> redis::RedisResult<()> {
        if self.definitions.is_empty() {
            return Ok(());
        }
        let now = unix_ms();
        let mut pipe = redis::pipe();
        for (name, json) in &self.definitions {
            let workers = self.names.tool_workers_key(name);
            pipe.hset(self.names.tools_key(), name, json).ignore();
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
