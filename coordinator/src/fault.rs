//! Fault points for failure tests: `TOOLFLEET_FAULT=<name>` makes the process exit
//! (status 86, no cleanup, like a crash) when it reaches the named point. Unset in
//! production; the reliability tests set it on a coordinator process they then replace.
//!
//! Owns the point names. Never changes behaviour when the variable is unset.

use std::sync::OnceLock;

/// After a turn's `final` is stored in Redis, before it is sent.
pub(crate) const EXIT_AFTER_FINAL_STORED: &str = "exit_after_final_stored";

/// After a freed slot released a paced turn's next call in Redis, before its job is
/// published.
pub(crate) const EXIT_AFTER_CALL_RELEASED: &str = "exit_after_call_released";

/// In the results consumer (a supervised task), at a result's arrival: the task panics,
/// as a bug in it would, and the replica stops being live.
pub(crate) const PANIC_IN_RESULTS_CONSUMER: &str = "panic_in_results_consumer";

/// Whether `TOOLFLEET_FAULT` names `point`.
fn named(point: &str) -> bool {
    static FAULT: OnceLock<Option<String>> = OnceLock::new();
    let fault = FAULT.get_or_init(|| std::env::var("TOOLFLEET_FAULT").ok());
    fault.as_deref() == Some(point)
}

/// Exits the process when `TOOLFLEET_FAULT` names `point`.
pub(crate) fn point(point: &str) {
    if named(point) {
        eprintln!("fault point {point} reached: exiting");
        std::process::exit(86);
    }
}

/// Panics (in the task that reaches it) when `TOOLFLEET_FAULT` names `point`.
pub(crate) fn panic_point(point: &str) {
    if named(point) {
        panic!("fault point {point} reached");
    }
}
