//! Redis memory as the coordinators see it: ended turns give way, then new turns are
//! shed, before Redis is full.
//!
//! Owns [`StoreMemory`] (the last `used_memory` and `maxmemory` read, shared by every
//! handler of a replica) and [`sample`], which reads them every [`SAMPLE_PERIOD`]. A
//! Redis with `noeviction` (what deploy/ runs) answers OOM to every write once full:
//! in-flight turns could then neither record results nor store their `final`. Two
//! steps keep it from filling:
//!
//! 1. from `TOOLFLEET_REDIS_TRIM_PERCENT` of `maxmemory`, each sample deletes the turns
//!    that ended and were sent longest ago ([`JoinStore::trim_ended`], at most
//!    [`TRIM_PER_BUCKET`] per index bucket): their retention, kept for attaching and
//!    for late results, is cut short, oldest first, and counted;
//! 2. from `TOOLFLEET_REDIS_SHED_PERCENT`, intake refuses new turns with the retryable
//!    `overloaded` (`intake.rs`), so the turns in flight keep the room left to end. A
//!    new turn counts with what it will store ([`StoreMemory::admit`]: its request's
//!    bytes, [`STORED_PER_REQUEST_BYTE`] times over), and so do the turns this replica
//!    let in since the last sample, so a burst of large turns between two samples
//!    cannot carry Redis past the line either.
//!
//! Open turns are never deleted. Writes to Redis only through the join's trim.
//!
//! [`JoinStore::trim_ended`]: crate::store::redis::JoinStore::trim_ended

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::redis_client::RedisConnection;
use tracing::{debug, warn};

use crate::store::redis::JoinStore;

/// How often a replica reads Redis's memory.
pub(crate) const SAMPLE_PERIOD: Duration = Duration::from_millis(500);

/// The most ended turns of one index bucket one sample deletes: with 16 buckets, 8,000
/// turns a second per replica, above what a fleet ends.
pub(crate) const TRIM_PER_BUCKET: usize = 250;

/// What one ended turn is taken to hold when choosing how many to delete: a three-call
/// turn of small results (docs/OPERATIONS.md, *Sizing Redis*).
const TURN_BYTES: u64 = 8 * 1024;

/// How many bytes of Redis a turn takes for each byte of its request, at most: its
/// calls' arguments stored with the turn, again in a job waiting in a lane (or held
/// back by the turn's concurrency bound), and its events.
pub(crate) const STORED_PER_REQUEST_BYTE: u64 = 3;

/// Redis's memory at the last sample.
#[derive(Debug)]
pub(crate) struct StoreMemory {
    /// `used_memory`, in bytes (the fullest node of a cluster).
    used: AtomicU64,
    /// Bytes the turns let in since the last sample will store, by this replica's
    /// reckoning ([`StoreMemory::admit`]).
    pending: AtomicU64,
    /// `maxmemory` of that node, in bytes; 0 for none.
    max: AtomicU64,
    /// `TOOLFLEET_REDIS_SHED_PERCENT`.
    shed_percent: u8,
    /// `TOOLFLEET_REDIS_TRIM_PERCENT`.
    trim_percent: u8,
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
    pub fn new(shed_percent: u8, trim_percent: u8) -> Self {
        Self {
            used: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            max: AtomicU64::new(0),
            shed_percent,
            trim_percent,
        }
    }

    /// Whether ended turns are to give way now.
    pub fn trimming(&self) -> bool {
        self.past(self.trim_percent)
    }

    /// How many ended turns of each of `buckets` index buckets one sample deletes: about
    /// as many as free the memory past the trim share, so memory settles just under it
    /// instead of dropping far and climbing again; at least 1, at most
    /// [`TRIM_PER_BUCKET`].
    pub fn trim_per_bucket(&self, buckets: u32) -> usize {
        let (used, max) = (
            self.used.load(Ordering::Relaxed),
            self.max.load(Ordering::Relaxed),
        );
        let limit = u128::from(max) * u128::from(self.trim_percent) / 100;
        let excess = u128::from(used).saturating_sub(limit);
        let turns = excess / u128::from(TURN_BYTES) + 1;
        let per_bucket = turns.div_ceil(u128::from(buckets.max(1)));
        usize::try_from(per_bucket).map_or(TRIM_PER_BUCKET, |n| n.clamp(1, TRIM_PER_BUCKET))
    }

    /// Whether the last sample is at or past `percent` of a `maxmemory`.
    fn past(&self, percent: u8) -> bool {
        let (used, max) = (
            self.used.load(Ordering::Relaxed),
            self.max.load(Ordering::Relaxed),
        );
        let limit = u128::from(max) * u128::from(percent) / 100;
        max > 0 && percent < 100 && u128::from(used) >= limit
    }

    /// Keeps a sample (which counts what the turns let in before it stored).
    pub fn record(&self, used: u64, max: u64) {
        self.used.store(used, Ordering::Relaxed);
        self.max.store(max, Ordering::Relaxed);
        self.pending.store(0, Ordering::Relaxed);
    }

    /// Lets in a turn whose request holds `request_bytes`, unless what it will store,
    /// with the last sample and what the turns let in since then will store, reaches
    /// the shed share: then `Some`, and nothing is counted.
    pub fn admit(&self, request_bytes: usize) -> Option<Full> {
        let max = self.max.load(Ordering::Relaxed);
        if max == 0 || self.shed_percent >= 100 {
            return None;
        }
        let bytes = (request_bytes as u64)
            .saturating_mul(STORED_PER_REQUEST_BYTE)
            .saturating_add(TURN_BYTES);
        let used = self
            .used
            .load(Ordering::Relaxed)
            .saturating_add(self.pending.load(Ordering::Relaxed));
        let limit = u128::from(max) * u128::from(self.shed_percent) / 100;
        if u128::from(used.saturating_add(bytes)) >= limit {
            return Some(Full {
                used,
                max,
                shed_percent: self.shed_percent,
            });
        }
        self.pending.fetch_add(bytes, Ordering::Relaxed);
        None
    }

    /// `Some` while the last sample alone is past the shed share.
    #[cfg(test)]
    pub fn full(&self) -> Option<Full> {
        self.past(self.shed_percent).then(|| Full {
            used: self.used.load(Ordering::Relaxed),
            max: self.max.load(Ordering::Relaxed),
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

/// What [`sample`] works with: the replica's memory reading, the join it trims, its
/// metrics, the retention and the number of index buckets.
pub(crate) struct Sampler {
    /// The replica's reading, which intake consults.
    pub memory: Arc<StoreMemory>,
    /// The turn store, whose ended turns give way.
    pub join: JoinStore,
    /// Where samples and trims are counted.
    pub metrics: FleetMetrics,
    /// `TOOLFLEET_RETENTION_MS`: index entries older than this are dropped.
    pub retention: Duration,
    /// `TOOLFLEET_DEADLINE_BUCKETS`.
    pub buckets: u32,
}

/// Reads Redis's memory every [`SAMPLE_PERIOD`] until `stop`, deleting the oldest
/// ended turns while it is past the trim share.
pub(crate) async fn sample(sampler: Sampler, mut redis: RedisConnection, stop: CancellationToken) {
    let Sampler {
        memory,
        join,
        metrics,
        retention,
        buckets,
    } = sampler;
    let retention = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
    loop {
        let answer: redis::RedisResult<redis::Value> = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut redis)
            .await;
        match answer.as_ref().ok().and_then(parse_info) {
            Some((used, max)) => {
                memory.record(used, max);
                metrics.redis_memory(used, max);
            }
            None => debug!(error = ?answer.err(), "Redis memory not sampled"),
        }
        if memory.trimming() {
            let per_bucket = memory.trim_per_bucket(buckets);
            match join.trim_ended(per_bucket, retention).await {
                Ok(0) => {}
                Ok(trimmed) => {
                    metrics.turns_trimmed(trimmed);
                    warn!(trimmed, "ended turns deleted before their retention ran out: Redis is near its maxmemory");
                }
                Err(error) => {
                    metrics.redis_error("trim_ended");
                    warn!(%error, "could not delete ended turns");
                }
            }
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
        let memory = StoreMemory::new(85, 70);
        memory.record(70, 100);
        assert!(memory.trimming());
        assert_eq!(memory.full(), None);
        assert_eq!(memory.full(), None);
        memory.record(84, 100);
        assert_eq!(memory.full(), None);
        memory.record(85, 100);
        assert!(memory.full().is_some());
        // No maxmemory: never full.
        memory.record(u64::MAX, 0);
        assert_eq!(memory.full(), None);
        assert!(!memory.trimming());
        // 100 %: never refuses.
        let never = StoreMemory::new(100, 100);
        never.record(100, 100);
        assert_eq!(never.full(), None);
        assert!(!never.trimming());
        // Past the trim share by 1 MiB over 16 buckets: 129 turns of 8 KiB, 9 a bucket.
        let trim = StoreMemory::new(85, 70);
        trim.record(70 + (1 << 20), 100 + (1 << 20) * 100 / 70);
        assert!((1..=TRIM_PER_BUCKET).contains(&trim.trim_per_bucket(16)));
        trim.record(71 << 20, 100 << 20);
        assert_eq!(trim.trim_per_bucket(16), 9);
        trim.record(1 << 40, (1 << 40) + 1);
        assert_eq!(trim.trim_per_bucket(16), TRIM_PER_BUCKET);
    }

    #[test]
    fn a_new_turn_counts_with_what_it_and_the_turns_since_the_sample_will_store() {
        let memory = StoreMemory::new(85, 70);
        // No sample yet, or no maxmemory: every turn goes in.
        assert_eq!(memory.admit(1 << 30), None);
        let max = 10 << 20;
        memory.record(5 << 20, max);
        // 5 MiB held; the line at 8.5 MiB. A 1 MiB request stores about 3 MiB.
        assert_eq!(memory.admit(1 << 20), None);
        // The next one would pass the line with the first one's bytes counted.
        let full = memory.admit(1 << 20).map(|f| f.used);
        assert_eq!(full, Some((5 << 20) + 3 * (1 << 20) + TURN_BYTES));
        // A small one still fits; a refused one counted nothing.
        assert_eq!(memory.admit(1024), None);
        // A sample counts what was stored: the pending bytes start again.
        memory.record(5 << 20, max);
        assert_eq!(memory.admit(1 << 20), None);
        // At the line, even an empty request waits.
        memory.record(max / 100 * 85, max);
        assert!(memory.admit(0).is_some());
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
