//! `toolfleet conformance --tool NAME`: drives whatever worker serves the conformance
//! probe `NAME` (PROTOCOL §7.11) through the protocol's cases as a coordinator would, and
//! reports what it got wrong.
//!
//! Owns the cases, their verdicts and the report. It publishes jobs on the tool's subject
//! with the protocol's headers, reads the results and progress notices the worker
//! publishes (core subscriptions beside the streams: it never consumes from them) and
//! the acknowledgements it sends on the consumer's `$JS.ACK` subjects. It never runs a
//! tool or a coordinator, and touches no turn keys in Redis.
//!
//! | module | what lives there |
//! |---|---|
//! | this file | [`run`], [`Settings`], [`Report`], [`Finding`] |
//! | `probe` | the definition and consumer checks, the registry reads |
//! | `cases` | one function per protocol case: echo, retry, term, keep-alive, panic, shutdown |
//! | `watch` | what the worker sent for one job: acknowledgements, results, notices |

mod cases;
mod probe;
mod watch;

use std::fmt;
use std::time::Duration;

use serde::Serialize;
use toolfleet_common::Names;

pub use probe::Probe;

/// What to check and where.
#[derive(Debug, Clone)]
pub struct Settings {
    /// NATS URL.
    pub nats_url: String,
    /// Redis URL (the registry).
    pub redis_url: String,
    /// Subject and key prefix.
    pub prefix: String,
    /// The probe tool's name.
    pub tool: String,
    /// Longest wait of one case.
    pub timeout: Duration,
    /// The worker's process, for the shutdown case (SIGTERM); the case is skipped
    /// without it.
    pub pid: Option<i32>,
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Against the protocol, but the fleet copes (a coordinator reads it leniently).
    Warning,
    /// Against the protocol: calls fail, stall or are lost.
    Failure,
}

/// One thing a worker got wrong.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Warning or failure.
    pub severity: Severity,
    /// A stable name of the defect (`non_integer_field`, `no_retry_nak`, ...).
    pub code: &'static str,
    /// What was seen, and what the protocol asks for.
    pub detail: String,
}

/// The verdict of one case.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    /// The case (`definition`, `echo`, `retry`, `term`, `keepalive`, `panic`, `shutdown`).
    pub name: &'static str,
    /// Set when the case could not run (why).
    pub skipped: Option<String>,
    /// What went wrong; empty when the worker passed.
    pub findings: Vec<Finding>,
}

impl Case {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            skipped: None,
            findings: Vec::new(),
        }
    }

    fn skipped(name: &'static str, why: impl Into<String>) -> Self {
        Self {
            skipped: Some(why.into()),
            ..Self::new(name)
        }
    }

    fn fail(&mut self, code: &'static str, detail: impl Into<String>) {
        self.push(Severity::Failure, code, detail);
    }

    fn warn(&mut self, code: &'static str, detail: impl Into<String>) {
        self.push(Severity::Warning, code, detail);
    }

    fn push(&mut self, severity: Severity, code: &'static str, detail: impl Into<String>) {
        self.findings.push(Finding {
            severity,
            code,
            detail: detail.into(),
        });
    }

    /// Whether the case found a failure.
    pub fn failed(&self) -> bool {
        self.findings
            .iter()
            .any(|f| f.severity == Severity::Failure)
    }
}

/// Every case's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The probe tool checked.
    pub tool: String,
    /// The cases, in the order they ran.
    pub cases: Vec<Case>,
}

impl Report {
    /// Whether no case failed (warnings allowed).
    pub fn passed(&self) -> bool {
        !self.cases.iter().any(Case::failed)
    }

    /// The case named `name`.
    pub fn case(&self, name: &str) -> Option<&Case> {
        self.cases.iter().find(|c| c.name == name)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "conformance of the worker serving {}", self.tool)?;
        for case in &self.cases {
            let verdict = match (&case.skipped, case.failed(), case.findings.is_empty()) {
                (Some(_), _, _) => "SKIP",
                (None, true, _) => "FAIL",
                (None, false, false) => "WARN",
                (None, false, true) => "PASS",
            };
            write!(f, "{verdict} {}", case.name)?;
            match &case.skipped {
                Some(why) => writeln!(f, ": {why}")?,
                None => writeln!(f)?,
            }
            for finding in &case.findings {
                let level = match finding.severity {
                    Severity::Warning => "warning",
                    Severity::Failure => "failure",
                };
                writeln!(f, "  {level} [{}] {}", finding.code, finding.detail)?;
            }
        }
        let failed = self.cases.iter().filter(|c| c.failed()).count();
        write!(f, "{} cases, {failed} failed", self.cases.len())
    }
}

/// Why conformance could not run at all (as opposed to a worker's defect).
#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    /// NATS could not be reached.
    #[error("nats: {0}")]
    Nats(String),
    /// Redis could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Runs every case against the worker serving `settings.tool`. The definition is checked
/// first; the job cases run only when the tool is registered with a live worker.
pub async fn run(settings: &Settings) -> Result<Report, ConformanceError> {
    let names = Names::new(settings.prefix.clone());
    let credentials = toolfleet_common::credentials::NatsCredentials::from_env()
        .map_err(|e| ConformanceError::Nats(e.to_string()))?;
    let nats = credentials
        .apply(async_nats::ConnectOptions::new().name("toolfleet-conformance"))
        .connect(toolfleet_common::config::NatsUrls(&settings.nats_url))
        .await
        .map_err(|e| ConformanceError::Nats(e.to_string()))?;
    let redis_tls = toolfleet_common::tls::TlsFiles::from_env(&toolfleet_common::tls::REDIS_TLS)
        .map_err(|e| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "invalid Redis TLS setting",
                e.to_string(),
            ))
        })?;
    let redis = toolfleet_common::redis_client::connect(
        &settings.redis_url,
        toolfleet_common::redis_client::RedisOptions::with_tls(redis_tls),
    )
    .await
    .map_err(redis::RedisError::from)?;
    let (definition, probe) = probe::check(&nats, redis.clone(), &names, settings).await;
    let mut cases = vec![definition];
    match probe {
        Some(probe) => cases.extend(cases::run_all(&probe, settings).await),
        None => {
            for name in cases::NAMES {
                cases.push(Case::skipped(
                    name,
                    "the definition check found no usable probe",
                ));
            }
        }
    }
    Ok(Report {
        tool: settings.tool.clone(),
        cases,
    })
}
