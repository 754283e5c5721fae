//! A turn's limits: how many calls may run, how many at once, and when the turn ends.
//!
//! Owns the arithmetic that combines the coordinator's settings, the tenant's policy,
//! the request's options and a `parallel` meta-call's own asks into one [`TurnLimits`]:
//! every source may only tighten a limit, never loosen one. Per-call limits (argument
//! size, tool timeout caps) are applied in `validate.rs`.
//!
//! Never looks at the calls themselves or at Redis. Next: `validate.rs` plans each call
//! under these limits.

use std::time::Duration;

use toolfleet_common::TurnRequest;
use toolfleet_decision::parse::ToolCallsDecision;

use crate::config::{CoordinatorConfig, TenantPolicy};

/// What one turn may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TurnLimits {
    /// Calls that may run; later ones are refused with `too_many_calls`.
    pub max_calls: usize,
    /// Calls in flight at once; the rest wait for a slot (at least 1).
    pub concurrency: usize,
    /// The turn's time budget in milliseconds (at least 1).
    pub budget_ms: u64,
}

impl TurnLimits {
    /// The tightest of every source's limits.
    pub(crate) fn resolve(
        config: &CoordinatorConfig,
        policy: &TenantPolicy,
        request: &TurnRequest,
        decision: &ToolCallsDecision,
    ) -> Self {
        let max_calls = tightest(
            config.max_calls,
            [policy.max_calls, request.options.max_calls],
        );
        let concurrency = tightest(
            config.concurrency,
            [
                policy.concurrency,
                request.options.concurrency,
                decision.concurrency,
            ],
        )
        .max(1);
        let max_deadline_ms = policy
            .deadline_ms
            .unwrap_or(u64::MAX)
            .min(millis(config.max_deadline));
        let budget_ms = request
            .deadline_ms
            .or(policy.deadline_ms)
            .unwrap_or_else(|| millis(config.default_deadline))
            .min(decision.timeout_ms.unwrap_or(u64::MAX))
            .min(max_deadline_ms)
            .max(1);
        Self {
            max_calls,
            concurrency,
            budget_ms,
        }
    }
}

/// The smallest of `base` and every limit that is set.
fn tightest<T: Ord + Copy, const N: usize>(base: T, limits: [Option<T>; N]) -> T {
    limits.into_iter().flatten().fold(base, T::min)
}

/// `d` in whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(concurrency: Option<usize>, timeout_ms: Option<u64>) -> ToolCallsDecision {
        ToolCallsDecision {
            calls: Vec::new(),
            acknowledgement: None,
            concurrency,
            timeout_ms,
        }
    }

    fn request(deadline_ms: Option<u64>) -> TurnRequest {
        serde_json::from_value(serde_json::json!({
            "tenant_id": "t", "decision": {}, "deadline_ms": deadline_ms
        }))
        .unwrap_or_else(|e| panic!("request: {e}"))
    }

    #[test]
    fn every_source_only_tightens() {
        let config = CoordinatorConfig::local();
        let loose = TenantPolicy::default();
        let limits = TurnLimits::resolve(&config, &loose, &request(None), &decision(None, None));
        assert_eq!(limits.max_calls, config.max_calls);
        assert_eq!(limits.concurrency, config.concurrency);
        assert_eq!(limits.budget_ms, millis(config.default_deadline));

        let tight = TenantPolicy {
            max_calls: Some(3),
            concurrency: Some(2),
            deadline_ms: Some(900),
            ..TenantPolicy::default()
        };
        let limits = TurnLimits::resolve(
            &config,
            &tight,
            &request(Some(60_000)),
            &decision(Some(1), Some(500)),
        );
        assert_eq!(
            limits,
            TurnLimits {
                max_calls: 3,
                concurrency: 1,
                budget_ms: 500
            }
        );
    }

    #[test]
    fn zero_concurrency_and_budget_become_one() {
        let config = CoordinatorConfig::local();
        let limits = TurnLimits::resolve(
            &config,
            &TenantPolicy::default(),
            &request(Some(0)),
            &decision(Some(0), None),
        );
        assert_eq!((limits.concurrency, limits.budget_ms), (1, 1));
    }
}
