//! Any text as a header value (a `traceparent` read back from Redis, a call id) and as
//! a subject (turn submissions, results): building headers and reading subjects never
//! panics.
#![no_main]

use async_nats::HeaderMap;
use libfuzzer_sys::fuzz_target;
use toolfleet_common::names::HEADER_TRACEPARENT;
use toolfleet_common::{headers, telemetry, Names};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut map = HeaderMap::new();
    headers::set(&mut map, HEADER_TRACEPARENT, text);
    let _ = telemetry::extract(Some(&map));
    let names = Names::new("fleet");
    let _ = names.submitting_frontend(text);
    let _ = names.result_subject_parts(text);
});
