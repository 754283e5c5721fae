//! NATS headers built from data without panicking.
//!
//! Owns [`set`], the one way toolfleet puts a value that came from a request, a job, a
//! result or Redis into a `HeaderMap` (async-nats panics on a value with CR or LF), and
//! [`call_headers`], the ids every job and result carries. A value that cannot be a
//! header is left out: headers are metadata (tracing, de-duplication, span attributes);
//! the body holds what matters. Never reads headers (see `telemetry.rs` and the
//! coordinator's `trace.rs`).

use async_nats::header::HeaderValue;
use async_nats::HeaderMap;

use crate::names::{HEADER_CALL_ID, HEADER_MSG_ID, HEADER_TENANT_ID, HEADER_TURN_ID};
use crate::JobEnvelope;

/// Sets header `name` to `value`, or leaves it out (returning `false`) when `value` is
/// not a valid header value (CR or LF).
pub fn set(headers: &mut HeaderMap, name: &'static str, value: &str) -> bool {
    match value.parse::<HeaderValue>() {
        Ok(value) => {
            headers.insert(self::name(name), value);
            true
        }
        Err(_) => false,
    }
}

/// A header name from a constant, without the validation and copy a `&str` name costs
/// at every lookup.
pub fn name(name: &'static str) -> async_nats::header::HeaderName {
    async_nats::header::HeaderName::from_static(name)
}

/// The ids a job and its result carry: turn, call, message id and tenant.
pub fn call_headers(job: &JobEnvelope) -> HeaderMap {
    let mut headers = HeaderMap::new();
    set(&mut headers, HEADER_MSG_ID, &job.msg_id());
    set(&mut headers, HEADER_TURN_ID, &job.turn_id);
    set(&mut headers, HEADER_CALL_ID, &job.call.id);
    set(&mut headers, HEADER_TENANT_ID, &job.tenant_id);
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_with_line_breaks_are_left_out() {
        let mut headers = HeaderMap::new();
        assert!(!set(&mut headers, "traceparent", "00-abc\r\nX: y"));
        assert!(!set(&mut headers, "traceparent", "a\nb"));
        assert!(headers.get("traceparent").is_none());
        assert!(set(&mut headers, "traceparent", "00-abc-def-01"));
        assert_eq!(
            headers.get("traceparent").map(|v| v.to_string()),
            Some("00-abc-def-01".into())
        );
    }
}
