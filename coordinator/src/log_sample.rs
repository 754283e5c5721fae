//! Sampled log lines for refusals a remote peer can trigger at will.
//!
//! Owns [`LogSample`]: one per kind of refusal (a reply outside the caller's inbox, a
//! turn request without a reply, headers over the limits), a static at the refusal's
//! site. The first refusal of a kind is logged, then at most one line per
//! [`REFUSAL_LOG_INTERVAL`], carrying how many refusals of that kind were not logged
//! since the line before: a frontend flooding a refusal (1.5 million catalog requests
//! in 30 s wrote 323 MiB of WARN lines and slowed every tenant) costs two atomic
//! operations per request, not a line. Lock-free: a load, and an add on the path that
//! does not log.
//!
//! Never counts a refusal for the metrics: the refusal's site counts every one
//! (`toolfleet_turns_refused_total`) whether or not its line is written.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The least time between two lines of one kind of refusal.
pub(crate) const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// `last_ms` before the first line.
const NEVER: u64 = u64::MAX;

/// When the lines of one kind of refusal were last written, and how many were not
/// written since.
#[derive(Debug)]
pub(crate) struct LogSample {
    /// Milliseconds between lines.
    interval_ms: u64,
    /// When the last line was written ([`clock_ms`]); [`NEVER`] before the first.
    last_ms: AtomicU64,
    /// Refusals not logged since the last line.
    suppressed: AtomicU64,
}

impl LogSample {
    /// A sample writing at most one line every `interval`.
    pub(crate) const fn new(interval: Duration) -> Self {
        Self {
            interval_ms: interval.as_millis() as u64,
            last_ms: AtomicU64::new(NEVER),
            suppressed: AtomicU64::new(0),
        }
    }

    /// A sample writing at most one line every [`REFUSAL_LOG_INTERVAL`].
    pub(crate) const fn refusals() -> Self {
        Self::new(REFUSAL_LOG_INTERVAL)
    }

    /// `Some(suppressed)` when this refusal is to be logged, with the count of those
    /// of its kind not logged since the last line; `None` (and counted) otherwise.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(clock_ms())
    }

    /// [`LogSample::admit`] at `now_ms` on the sample's clock.
    fn admit_at(&self, now_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == NEVER || now_ms >= last.saturating_add(self.interval_ms);
        // Of refusals racing past the interval, the one that moves the clock logs.
        if due
            && self
                .last_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// Milliseconds since the first sample asked for the time (monotonic).
fn clock_ms() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = ORIGIN.get_or_init(Instant::now);
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(NEVER - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_refusal_is_logged_then_one_a_period_with_the_count_left_out() {
        let sample = LogSample::new(Duration::from_secs(10));
        assert_eq!(sample.admit_at(5_000), Some(0), "the first line");
        // A flood inside the period: no line, each one counted.
        for ms in 5_000..15_000 {
            assert_eq!(sample.admit_at(ms), None, "at {ms} ms");
        }
        assert_eq!(sample.admit_at(15_000), Some(10_000), "one line a period");
        assert_eq!(sample.admit_at(15_001), None);
        // A quiet spell: the next refusal is logged at once, naming the one left out.
        assert_eq!(sample.admit_at(90_000), Some(1));
        assert_eq!(sample.admit_at(100_000), Some(0));
    }

    #[test]
    fn every_refusal_is_either_logged_or_counted_when_threads_race() {
        let sample = LogSample::new(Duration::from_millis(10));
        let per_thread = 20_000u64;
        let (lines, reported) = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let sample = &sample;
                    scope.spawn(move || {
                        let (mut lines, mut reported) = (0u64, 0u64);
                        for n in 0..per_thread {
                            // A clock that moves 1 ms every 1,000 refusals of a thread.
                            if let Some(left_out) = sample.admit_at(n / 1_000) {
                                lines += 1;
                                reported += left_out;
                            }
                        }
                        (lines, reported)
                    })
                })
                .collect();
            threads
                .into_iter()
                .filter_map(|t| t.join().ok())
                .fold((0, 0), |(l, r), (lines, reported)| {
                    (l + lines, r + reported)
                })
        });
        let pending = sample.suppressed.load(Ordering::Relaxed);
        assert_eq!(lines + reported + pending, 4 * per_thread);
        // 20 ms of clock, 10 ms apart: the first line at 0, the next at 10, none more.
        assert_eq!(lines, 2);
    }

    #[test]
    fn the_real_clock_logs_the_first_and_samples_the_rest() {
        let sample = LogSample::refusals();
        assert_eq!(sample.admit(), Some(0));
        assert!((0..1_000).all(|_| sample.admit().is_none()));
    }
}
