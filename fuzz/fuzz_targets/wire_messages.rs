//! Any bytes as a call result or a job envelope (what workers and the coordinator read
//! from JetStream), and the headers a job's ids would give. Never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use toolfleet_common::headers::call_headers;
use toolfleet_common::{CallResult, JobEnvelope};

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<CallResult>(data);
    if let Ok(job) = serde_json::from_slice::<JobEnvelope>(data) {
        let _ = call_headers(&job);
    }
});
