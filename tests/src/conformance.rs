//! `toolfleet conformance` (the probe of `toolfleet_cli::conformance`) run against a tool
//! on a test's fleet: its settings, and the check that a worker passed every case.

use std::time::Duration;

use anyhow::Result;
use toolfleet_cli::conformance::{Report, Settings};

use crate::fleet::Fleet;

/// The probe's settings for `tool` on `fleet`: 10 s per case, and the worker's process
/// `pid` when the probe may stop it at its end.
pub fn settings(fleet: &Fleet, tool: &str, pid: Option<u32>) -> Result<Settings> {
    Ok(Settings {
        nats_url: fleet.nats.url(),
        redis_url: fleet.redis.url(),
        prefix: fleet.names.prefix().to_string(),
        tool: tool.to_string(),
        timeout: Duration::from_secs(10),
        pid: pid.map(i32::try_from).transpose()?,
    })
}

/// Asserts that every one of the probe's seven cases ran and found nothing.
pub fn assert_clean(report: &Report) {
    assert_eq!(report.cases.len(), 7, "{report}");
    for case in &report.cases {
        assert!(case.skipped.is_none(), "{report}");
        assert!(case.findings.is_empty(), "{report}");
    }
}
