//! Any bytes as a model decision: parsing never panics, whatever the shape.
#![no_main]

use libfuzzer_sys::fuzz_target;
use toolfleet_decision::parse::parse_decision;

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = parse_decision(&value, 256);
    }
});
