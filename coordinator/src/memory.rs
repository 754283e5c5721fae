//! Redis memory as the coordinators see it, and new turns shed before Redis is full.
//!
//! Owns [`StoreMemory`] (the last `used_memory` and `maxmemory` read, shared by every
//! handler of a replica) and [`sample`], which reads them every [`SAMPLE_PERIOD`]. A
//! Redis with `noeviction` (what deploy/ runs) answers OOM to every write once full:
//! in-flight turns could then neither record results nor store their `final`. So once
//! `used_memory` reaches `TOOLFLEET_REDIS_SHED_PERCENT` of `maxmemory`, intake refuses
//! new turns with the retryable `overloaded` (`intake.rs`); the turns in flight keep
//! the room left to end, and the ended ones expire and free it. Never writes to Redis.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use toolfleet_common::redis_client::RedisConnection;
use tracing::debug;

use crate::startup::Replica;

/// How often a replica reads Redis's memory.
pub(crate) const SAMPLE_PERIOD: Duration = Duration::from_millis(500);

/// Redis's memory at the last sample.
#[derive(Debug)]
pub(crate) struct StoreMemory {
    /// `used_memory`, in bytes (the fullest node of a cluster).
    used: AtomicU64,
    /// `maxmemory` of that node, in bytes; 0 for none.
    max: AtomicU64,
    /// `TOOLFLEET_REDIS_SHED_PERCENT`.
    shed_percent: u8,
}

/// Why new turns are refused: Redis holds `used` bytes of its `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full {
    /// `used_memory`.
    pub used: u64,
    /// `maxmemory`.
    pub max: u64,
    /// The share at which turns are refused, in percent.
    pub shed_percent: u8,
}

impl StoreMemory {
    /// Nothing sampled yet: no refusal until a sample says so.
    pub fn new(shed_percent: u8) -> Self {
        Self {
            used: AtomicU64::new(0),
            max: AtomicU64::new(0),
            shed_percent,
        }
    }

    /// Keeps a sample.
    pub fn record(&self, used: u64, max: u64) {
        self.used.store(used, Ordering::Relaxed);
        self.max.store(max, Ordering::Relaxed);
    }

    /// `Some` while new turns are to be refused.
    pub fn full(&self) -> Option<Full> {
        let (used, max) = (
            self.used.load(Ordering::Relaxed),
            self.max.load(Ordering::Relaxed),
        );
        let limit = u128::from(max) * u128::from(self.shed_percent) / 100;
        (max > 0 && self.shed_percent < 100 && u128::from(used) >= limit).then_some(Full {
            used,
            max,
            shed_percent: self.shed_percent,
        })
    }
}

/// `used_memory` and `maxmemory` of an `INFO memory` answer: of the node whose share is
/// highest when it holds several (a cluster answers per node).
pub(crate) fn parse_info(answer: &redis::Value) -> Option<(u64, u64)> {
    let mut texts = Vec::new();
    collect_texts(answer, &mut texts);
    texts
        .iter()
        .filter_map(|text| {
            let field = |name: &str| {
                text.lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            };
            Some((field("used_memory")?, field("maxmemory").unwrap_or(0)))
        })
        .max_by(|a, b| share(*a).total_cmp(&share(*b)))
}

/// `used / max`, 0 without a limit.
fn share((used, max): (u64, u64)) -> f64 {
    if max == 0 {
        0.0
    } else {
        used as f64 / max as f64
    }
}

fn collect_texts(value: &redis::Value, texts: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(bytes) => texts.push(String::from_utf8_lossy(bytes).into()),
        redis::Value::SimpleString(text) | redis::Value::VerbatimString { text, .. } => {
            texts.push(text.clone())
        }
        redis::Value::Array(values) | redis::Value::Set(values) => {
            values.iter().for_each(|v| collect_texts(v, texts))
        }
        redis::Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            collect_texts(k, texts);
            collect_texts(v, texts);
        }),
        _ => {}
    }
}

/// Reads Redis's memory every [`SAMPLE_PERIOD`] until `stop`.
pub(crate) async fn sample(
    replica: Arc<Replica>,
    mut redis: RedisConnection,
    stop: CancellationToken,
) {
    loop {
        let answer: redis::RedisResult<redis::Value> = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut redis)
            .await;
        match answer.as_ref().ok().and_then(parse_info) {
            Some((used, max)) => {
                replica.memory.record(used, max);
                replica.metrics.redis_memory(used, max);
            }
            None => debug!(error = ?answer.err(), "Redis memory not sampled"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(SAMPLE_PERIOD) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_turns_are_refused_from_the_configured_share() {
        let memory = StoreMemory::new(85);
        assert_eq!(memory.full(), None);
        memory.record(84, 100);
        assert_eq!(memory.full(), None);
        memory.record(85, 100);
        assert!(memory.full().is_some());
        // No maxmemory: never full.
        memory.record(u64::MAX, 0);
        assert_eq!(memory.full(), None);
        // 100 %: never refuses.
        let never = StoreMemory::new(100);
        never.record(100, 100);
        assert_eq!(never.full(), None);
    }

    #[test]
    fn info_answers_give_the_fullest_node() {
        let one = redis::Value::BulkString(
            b"# Memory\r\nused_memory:900\r\nused_memory_human:900B\r\nmaxmemory:1000\r\n".to_vec(),
        );
        assert_eq!(parse_info(&one), Some((900, 1000)));
        let cluster = redis::Value::Map(vec![
            (
                redis::Value::SimpleString("a:6379".into()),
                redis::Value::BulkString(b"used_memory:10\r\nmaxmemory:1000\r\n".to_vec()),
            ),
            (
                redis::Value::SimpleString("b:6379".into()),
                redis::Value::BulkString(b"used_memory:500\r\nmaxmemory:1000\r\n".to_vec()),
            ),
        ]);
        assert_eq!(parse_info(&cluster), Some((500, 1000)));
        assert_eq!(parse_info(&redis::Value::Nil), None);
    }
}
