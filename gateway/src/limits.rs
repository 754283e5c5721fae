//! How much one API key and the whole gateway may do: a token bucket per key (429 with
//! `Retry-After` when empty) and a bound on turns followed at once (503 `overloaded`).
//!
//! Owns the buckets and the turn slots. Never answers a request itself: the handlers
//! turn a refusal into an [`crate::error::ApiError`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most keys with a bucket; idle full buckets are dropped when there are more.
const MAX_BUCKETS: usize = 100_000;

/// One token bucket per API key: `rate` tokens a second, at most `burst` saved.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RateLimiter {
    /// A limiter of `rate` requests a second with bursts of `burst`.
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate,
            burst: burst.max(1.0),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a token for `key`; `Err(seconds)` to wait when the bucket is empty.
    pub fn take(&self, key: &str) -> Result<(), u64> {
        self.take_at(key, Instant::now())
    }

    fn take_at(&self, key: &str, now: Instant) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(key) {
            let (rate, burst) = (self.rate, self.burst);
            buckets.retain(|_, b| refill(b, rate, burst, now).tokens < burst);
        }
        let bucket = buckets.entry(key.to_string()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        *bucket = refill(bucket, self.rate, self.burst, now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(((1.0 - bucket.tokens) / self.rate).ceil().max(1.0) as u64)
        }
    }
}

fn refill(bucket: &Bucket, rate: f64, burst: f64, now: Instant) -> Bucket {
    let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
    Bucket {
        tokens: (bucket.tokens + elapsed * rate).min(burst),
        at: now,
    }
}

/// The turns this gateway follows at once.
#[derive(Debug, Clone)]
pub struct TurnSlots(Arc<Semaphore>);

impl TurnSlots {
    /// Room for `max` turns.
    pub fn new(max: usize) -> Self {
        Self(Arc::new(Semaphore::new(max)))
    }

    /// A slot held until the turn's response ends; `None` when every slot is taken.
    pub fn try_take(&self) -> Option<OwnedSemaphorePermit> {
        self.0.clone().try_acquire_owned().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_bucket_refuses_past_its_burst_and_refills_at_its_rate() {
        let limiter = RateLimiter::new(2.0, 3.0);
        let start = Instant::now();
        for _ in 0..3 {
            assert_eq!(limiter.take_at("k", start), Ok(()));
        }
        assert_eq!(limiter.take_at("k", start), Err(1));
        assert_eq!(limiter.take_at("other", start), Ok(()));
        assert_eq!(
            limiter.take_at("k", start + Duration::from_millis(500)),
            Ok(())
        );
        assert!(limiter
            .take_at("k", start + Duration::from_millis(500))
            .is_err());
    }

    #[test]
    fn slots_run_out_and_come_back() {
        let slots = TurnSlots::new(1);
        let held = slots.try_take();
        assert!(held.is_some());
        assert!(slots.try_take().is_none());
        drop(held);
        assert!(slots.try_take().is_some());
    }
}
