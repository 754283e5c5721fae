//! Latency samples and their percentiles; machine facts read from `/proc`.
//!
//! Owns the percentile method and the parsing of `/proc`. It must never write anything
//! or touch a process beyond reading its `/proc` files.

use std::time::Duration;

use serde::Serialize;

/// Latency samples of one measurement.
#[derive(Debug, Default, Clone)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    /// Adds one sample.
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    /// Adds every sample of `other`.
    pub fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }

    /// How many samples.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Percentiles of the samples (nearest rank).
    pub fn summary(&self) -> Summary {
        let mut sorted = self.0.clone();
        sorted.sort_unstable();
        let ms = |d: Duration| round3(d.as_secs_f64() * 1000.0);
        let at = |p: f64| -> f64 {
            if sorted.is_empty() {
                return 0.0;
            }
            // The epsilon keeps 99.9 % of 1000 at rank 999 despite rounding.
            let rank = (p / 100.0 * sorted.len() as f64 - 1e-9).ceil() as usize;
            let index = rank.clamp(1, sorted.len()) - 1;
            ms(sorted[index])
        };
        let mean = if sorted.is_empty() {
            0.0
        } else {
            round3(
                sorted.iter().map(Duration::as_secs_f64).sum::<f64>() * 1000.0
                    / sorted.len() as f64,
            )
        };
        Summary {
            count: sorted.len(),
            mean_ms: mean,
            p50_ms: at(50.0),
            p90_ms: at(90.0),
            p99_ms: at(99.0),
            p999_ms: at(99.9),
            max_ms: sorted.last().map(|d| ms(*d)).unwrap_or(0.0),
        }
    }
}

/// Percentiles of a latency measurement, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Summary {
    /// Samples.
    pub count: usize,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest sample.
    pub max_ms: f64,
}

/// `x` rounded to three decimals.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Load averages (1, 5, 15 minutes) from `/proc/loadavg`.
pub fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut out = [0.0; 3];
    for (slot, field) in out.iter_mut().zip(text.split_whitespace()) {
        *slot = field.parse().unwrap_or(0.0);
    }
    out
}

/// Resident and peak resident memory of a process, in MiB, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Rss {
    /// `VmRSS`.
    pub rss_mib: f64,
    /// `VmHWM` (peak resident size).
    pub hwm_mib: f64,
}

/// `VmRSS` and `VmHWM` of `pid`, when the process exists.
pub fn rss(pid: u32) -> Option<Rss> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |name: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse::<f64>()
            .ok()
    };
    Some(Rss {
        rss_mib: round3(kib("VmRSS:")? / 1024.0),
        hwm_mib: round3(kib("VmHWM:")? / 1024.0),
    })
}

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, 100 on Linux).
const USER_HZ: f64 = 100.0;

/// CPU time (user + system, every thread) `pid` has used so far, in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after it are space-separated, and
    // utime and stime are the 12th and 13th of them.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

/// Context switches (voluntary and involuntary) of every live thread of `pid` so far,
/// from `/proc/<pid>/task/*/status`; a thread that already exited is not counted.
pub fn context_switches(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        total += text
            .lines()
            .filter_map(|l| {
                l.strip_prefix("voluntary_ctxt_switches:")
                    .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
            })
            .filter_map(|v| v.trim().parse::<u64>().ok())
            .sum::<u64>();
    }
    Some(total)
}

/// The machine the bench ran on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPUs available to this process.
    pub cpus: usize,
    /// CPU model name.
    pub cpu_model: String,
    /// Physical memory, GiB.
    pub memory_gib: f64,
    /// Kernel release.
    pub kernel: String,
}

impl Machine {
    /// Reads the facts from `/proc`.
    pub fn read() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_kib: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        Self {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            memory_gib: (memory_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut l = Latencies::default();
        for ms in 1..=1000u64 {
            l.push(Duration::from_millis(ms));
        }
        let s = l.summary();
        assert_eq!(s.count, 1000);
        assert_eq!(s.p50_ms, 500.0);
        assert_eq!(s.p99_ms, 990.0);
        assert_eq!(s.p999_ms, 999.0);
        assert_eq!(s.max_ms, 1000.0);
        assert_eq!(s.mean_ms, 500.5);
    }

    #[test]
    fn empty_samples_summarise_to_zero() {
        let s = Latencies::default().summary();
        assert_eq!(s.count, 0);
        assert_eq!(s.p99_ms, 0.0);
    }

    #[test]
    fn reads_own_cpu_time() {
        let spin = std::time::Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(50) {
            x = x.wrapping_add(1);
        }
        assert!(x > 0);
        assert!(cpu_seconds(std::process::id()).is_some_and(|s| s > 0.0));
    }

    #[test]
    fn reads_own_memory() {
        let own = rss(std::process::id());
        assert!(own.is_some_and(|r| r.rss_mib > 0.0 && r.hwm_mib >= r.rss_mib));
    }
}
