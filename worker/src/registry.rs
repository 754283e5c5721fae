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
        let definitions = tools
            .iter()
            .map(|d| Ok((d.name.clone(), serde_json::to_string(d)?)))
            .collect::<Result<Vec<_>, serde_json::Error>>()?;
        Ok(Self {
            redis,
            names,
            worker_id,
            definitions,
            ttl_ms,
        })
    }

    /// Writes the definitions and marks this worker alive for each tool; prunes workers
    /// whose entries expired.
    pub async fn beat(&mut self) -> redis::RedisResult<()> {
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
        let mut pipe = redis::pipe();
        for (name, _) in &self.definitions {
            pipe.zrem(self.names.tool_workers_key(name), &self.worker_id)
                .ignore();
        }
        pipe.query_async(&mut self.redis).await
    }
}
