//! How much one API key, one client address and the whole gateway may do: a token
//! bucket per key (429 with `Retry-After` when empty), a bucket of failed key checks per
//! client address ([`FailureLimiter`], checked before a key is looked up), and a bound on
//! turns followed at once (503 `overloaded`).
//!
//! Owns the buckets and the turn slots. Never answers a request itself: the handlers
//! turn a refusal into an [`crate::error::ApiError`].

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// Most client addresses with a failure bucket; idle full buckets are dropped when there
/// are more, and a new address is refused while none can be dropped.
const MAX_CLIENTS: usize = 100_000;
/// Shortest time between two sweeps of full buckets while the table is full.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One bucket of failed API-key checks per client address: `burst` failures at once,
/// earned back at `per_min` a minute. A check takes a token before the key is looked up
/// and gives it back when the key was known, so a client out of tokens cannot make the
/// gateway ask PostgreSQL about another key until it earns one back.
///
/// IPv6 clients are counted by their /64 (one host usually holds a whole /64); an
/// IPv4-mapped IPv6 address counts as its IPv4 address.
#[derive(Debug)]
pub struct FailureLimiter {
    rate: f64,
    burst: f64,
    clients: Mutex<Clients>,
}

#[derive(Debug)]
struct Clients {
    buckets: HashMap<IpAddr, Bucket>,
    swept: Option<Instant>,
}

/// The address `ip` is counted under.
pub fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

impl FailureLimiter {
    /// A limiter allowing `burst` failures at once, `per_min` more a minute.
    pub fn new(per_min: u32, burst: u32) -> Self {
        Self {
            rate: f64::from(per_min.max(1)) / 60.0,
            burst: f64::from(burst.max(1)),
            clients: Mutex::new(Clients {
                buckets: HashMap::new(),
                swept: None,
            }),
        }
    }

    /// Takes a token for a key check from `ip`; `Err(seconds)` to wait when the
    /// address has failed too often. Give it back with [`FailureLimiter::refund`] when
    /// the key turned out known (or could not be checked).
    pub fn take(&self, ip: IpAddr) -> Result<(), u64> {
        self.take_at(client_of(ip), Instant::now())
    }

    /// Gives back the token a check from `ip` took.
    pub fn refund(&self, ip: IpAddr) {
        self.refund_at(client_of(ip), Instant::now());
    }

    fn take_at(&self, client: IpAddr, now: Instant) -> Result<(), u64> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        let (rate, burst) = (self.rate, self.burst);
        if clients.buckets.len() >= MAX_CLIENTS && !clients.buckets.contains_key(&client) {
            let due = clients
                .swept
                .is_none_or(|at| now.saturating_duration_since(at) >= SWEEP_EVERY);
            if due {
                clients
                    .buckets
                    .retain(|_, b| refill(b, rate, burst, now).tokens < burst);
                clients.swept = Some(now);
            }
            if clients.buckets.len() >= MAX_CLIENTS {
                // Every tracked address failed recently: a new one waits for a sweep.
                return Err(SWEEP_EVERY.as_secs().max(1));
            }
        }
        let bucket = clients.buckets.entry(client).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        *bucket = refill(bucket, rate, burst, now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(((1.0 - bucket.tokens) / rate).ceil().max(1.0) as u64)
        }
    }

    fn refund_at(&self, client: IpAddr, now: Instant) {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        let (rate, burst) = (self.rate, self.burst);
        if let Some(bucket) = clients.buckets.get_mut(&client) {
            let mut refilled = refill(bucket, rate, burst, now);
            refilled.tokens = (refilled.tokens + 1.0).min(burst);
            *bucket = refilled;
        }
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
    fn failed_checks_are_counted_per_address_and_earned_back() {
        let limiter = FailureLimiter::new(60, 2);
        let start = Instant::now();
        let a = client_of("192.0.2.1".parse().unwrap_or(IpAddr::V4([0; 4].into())));
        let b = client_of("192.0.2.2".parse().unwrap_or(IpAddr::V4([0; 4].into())));
        assert_eq!(limiter.take_at(a, start), Ok(()));
        assert_eq!(limiter.take_at(a, start), Ok(()));
        assert_eq!(limiter.take_at(a, start), Err(1));
        // Another address has its own bucket.
        assert_eq!(limiter.take_at(b, start), Ok(()));
        // A known key gives its token back.
        limiter.refund_at(a, start);
        assert_eq!(limiter.take_at(a, start), Ok(()));
        assert!(limiter.take_at(a, start).is_err());
        // One a second at 60 a minute.
        assert_eq!(
            limiter.take_at(a, start + Duration::from_millis(1000)),
            Ok(())
        );
    }

    #[test]
    fn ipv6_clients_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let parse = |s: &str| s.parse::<IpAddr>().unwrap_or(IpAddr::V4([0; 4].into()));
        assert_eq!(
            client_of(parse("2001:db8:1:2:aaaa::1")),
            client_of(parse("2001:db8:1:2:bbbb::9"))
        );
        assert_ne!(
            client_of(parse("2001:db8:1:2::1")),
            client_of(parse("2001:db8:1:3::1"))
        );
        assert_eq!(client_of(parse("::ffff:192.0.2.7")), parse("192.0.2.7"));
        assert_eq!(client_of(parse("192.0.2.7")), parse("192.0.2.7"));
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
