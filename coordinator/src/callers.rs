//! Who submitted a turn: the frontend named by the subject it published on, where that
//! frontend's events may go, and which tenants it may name.
//!
//! Owns the checks between decoding a turn request and taking it: the reply subject
//! must be inside the submitting frontend's own inbox (`_INBOX_<user>.…`; for the
//! unidentified subject, inside the `_INBOX` namespace and never the coordinator's own
//! inbox), and, when `TOOLFLEET_FRONTEND_TENANTS` binds frontends to tenants, the turn's
//! tenant must be one of the caller's. NATS permissions make the subject's last token
//! trustworthy: only user `<user>` may publish `<p>.turns.submit.<user>`.
//!
//! Owns [`Reply`], the only type the coordinator publishes frontend answers to: a
//! subject taken from a message becomes a `Reply` only through [`Caller::reply_to`],
//! and a subject the turn store kept for a turn (which `reply_to` admitted when the
//! turn was taken or attached) only through [`Reply::kept`], which still refuses any
//! subject outside the inbox namespace. `events.rs` publishes to nothing else; the
//! crate's `clippy.toml` forbids the raw NATS publish everywhere but there and in
//! `dispatch.rs` (jobs, on subjects built from `Names`).
//!
//! Never publishes: `intake.rs` drops a request whose reply is refused (publishing
//! anything there is exactly what the check prevents) and refuses a tenant mismatch on
//! the caller's own inbox through `finalize.rs`. Counts every refused reply, and logs
//! them sampled (`log_sample.rs`): a frontend flooding them cannot flood the log.

use toolfleet_common::credentials::DEFAULT_INBOX_PREFIX;
use toolfleet_common::metrics::FleetMetrics;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::{CallError, Names};
use tracing::warn;

use crate::config::FrontendBindings;
use crate::log_sample::LogSample;

/// A subject a frontend may receive on. Only [`Caller::reply_to`] (for a subject taken
/// from a message) and [`Reply::kept`] (for one the turn store kept) make one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply(String);

impl Reply {
    /// The subject the turn store kept for a turn, if it is a plain subject inside the
    /// inbox namespace. Every stored reply passed [`Caller::reply_to`] when its turn
    /// was taken or attached, and only the coordinators' Redis user writes turn keys;
    /// the namespace check keeps a fleet subject out even so.
    pub fn kept(subject: &str) -> Option<Self> {
        (plain(subject) && subject.starts_with(DEFAULT_INBOX_PREFIX))
            .then(|| Self(subject.to_string()))
    }

    /// The subject.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `subject` names one subject: no wildcard, no whitespace, no empty token.
fn plain(subject: &str) -> bool {
    !subject.is_empty()
        && !subject.contains(['*', '>'])
        && !subject.chars().any(char::is_whitespace)
        && subject.split('.').all(|token| !token.is_empty())
}

/// The frontend a turn request came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    /// The NATS user of an identified submission; `None` on the unidentified subject.
    pub frontend: Option<String>,
}

impl Caller {
    /// The caller of a request published on `subject`.
    pub fn of(names: &Names, subject: &str) -> Self {
        Self {
            frontend: names.submitting_frontend(subject).map(String::from),
        }
    }

    /// Whether events may be published to `reply`: inside this caller's own inbox, never
    /// inside `own_inbox` (the coordinator's, whose JetStream answers it would forge)
    /// unless that is the shared `_INBOX` of a server without users.
    pub fn may_receive(&self, reply: &str, own_inbox: &str) -> bool {
        let inside = |prefix: &str| {
            reply
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix('.'))
                .is_some_and(|rest| !rest.is_empty())
        };
        if reply.contains(['*', '>']) || reply.chars().any(char::is_whitespace) {
            return false;
        }
        match &self.frontend {
            Some(user) => inside(&format!("{DEFAULT_INBOX_PREFIX}_{user}")),
            None => {
                let shared = own_inbox == DEFAULT_INBOX_PREFIX;
                reply.starts_with(DEFAULT_INBOX_PREFIX) && (shared || !inside(own_inbox))
            }
        }
    }

    /// `reply` as a [`Reply`] when this caller [may receive](Self::may_receive) on it.
    pub fn reply_to(&self, reply: &str, own_inbox: &str) -> Option<Reply> {
        (plain(reply) && self.may_receive(reply, own_inbox)).then(|| Reply(reply.to_string()))
    }

    /// The caller of `message` and the [`Reply`] its answer goes to; `None` when the
    /// message has no reply subject, or, counted, when its reply is outside the
    /// caller's own inbox: such a `request` (what the log calls it) is dropped, never
    /// answered, and logged as a [`LogSample`] lets (the first, then one line a period
    /// with the count of those not logged).
    pub(crate) fn of_request(
        names: &Names,
        own_inbox: &str,
        metrics: &FleetMetrics,
        message: &async_nats::Message,
        request: &str,
    ) -> Option<(Self, Reply)> {
        let subject = message.reply.as_deref()?;
        let caller = Self::of(names, &message.subject);
        let Some(reply) = caller.reply_to(subject, own_inbox) else {
            // Every refusal counted; a line only now and then (a flood of them cost
            // every tenant its latency in log writes).
            metrics.turn_refused(turn_codes::REPLY_NOT_ALLOWED);
            static LOGGED: LogSample = LogSample::refusals();
            if let Some(suppressed) = LOGGED.admit() {
                warn!(subject = %message.subject, reply = %subject, suppressed, "{request} dropped: reply outside the caller's inbox");
            }
            return None;
        };
        Some((caller, reply))
    }

    /// Refuses a turn for `tenant` unless the bindings let this caller name it.
    pub fn check_tenant(&self, bindings: &FrontendBindings, tenant: &str) -> Result<(), CallError> {
        if bindings.allows(self.frontend.as_deref(), tenant) {
            return Ok(());
        }
        let who = self
            .frontend
            .as_deref()
            .unwrap_or("an unidentified frontend");
        Err(CallError::fatal(
            turn_codes::TENANT_NOT_ALLOWED,
            format!("{who} may not submit turns for tenant {tenant}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &str = "_INBOX_coordinator";

    #[test]
    fn identified_callers_reply_only_to_their_own_inbox() {
        let names = Names::new("fleet");
        let a = Caller::of(&names, "fleet.turns.submit.web");
        assert_eq!(a.frontend.as_deref(), Some("web"));
        assert!(a.may_receive("_INBOX_web.abc", OWN));
        assert!(!a.may_receive("_INBOX_web", OWN));
        assert!(!a.may_receive("_INBOX_kiosk.abc", OWN));
        assert!(!a.may_receive("_INBOX_webx.abc", OWN));
        assert!(!a.may_receive("fleet.jobs.crm.getOpenInvoices", OWN));
        assert!(!a.may_receive("_INBOX_web.>", OWN));
    }

    #[test]
    fn unidentified_callers_stay_in_the_inbox_namespace() {
        let names = Names::new("fleet");
        let anonymous = Caller::of(&names, "fleet.turns.submit");
        assert_eq!(anonymous.frontend, None);
        assert!(anonymous.may_receive("_INBOX.abc", OWN));
        assert!(anonymous.may_receive("_INBOX_frontend.abc", OWN));
        assert!(!anonymous.may_receive("_INBOX_coordinator.abc", OWN));
        assert!(!anonymous.may_receive("fleet.jobs.x", OWN));
        assert!(!anonymous.may_receive("$JS.API.STREAM.DELETE.FLEET_JOBS", OWN));
        // Without users every client shares `_INBOX`.
        assert!(anonymous.may_receive("_INBOX.abc", DEFAULT_INBOX_PREFIX));
    }

    #[test]
    fn replies_are_made_only_from_admitted_subjects() {
        let names = Names::new("fleet");
        let web = Caller::of(&names, "fleet.turns.submit.web");
        assert_eq!(
            web.reply_to("_INBOX_web.abc", OWN).map(|r| r.to_string()),
            Some("_INBOX_web.abc".to_string())
        );
        for foreign in [
            "_INBOX_kiosk.abc",
            "fleet.jobs.crm.getOpenInvoices",
            "fleet.cancelled.t1",
            "fleet.ended.t1",
            "_INBOX_web..x",
        ] {
            assert!(web.reply_to(foreign, OWN).is_none(), "{foreign}");
        }
        assert!(Reply::kept("_INBOX_web.abc").is_some());
        for kept in ["fleet.jobs.x", "_INBOX_web.>", "", "_INBOX_web. x"] {
            assert!(Reply::kept(kept).is_none(), "{kept}");
        }
    }

    #[test]
    fn tenants_follow_the_bindings() {
        let names = Names::new("fleet");
        let bindings = FrontendBindings::parse("web=t1").unwrap_or_default();
        let web = Caller::of(&names, "fleet.turns.submit.web");
        assert!(web.check_tenant(&bindings, " T1").is_ok());
        let refused = web.check_tenant(&bindings, "t2").err().map(|e| e.code);
        assert_eq!(refused.as_deref(), Some(turn_codes::TENANT_NOT_ALLOWED));
        let anonymous = Caller::of(&names, "fleet.turns.submit");
        assert!(anonymous.check_tenant(&bindings, "t1").is_err());
    }
}
