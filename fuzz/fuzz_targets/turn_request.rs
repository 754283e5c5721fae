//! Any bytes as a turn request, decoded as the coordinator's intake does: the request,
//! its ids, its tenant in normalized form and its decision. Never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use toolfleet_common::turn::{normalize_tenant, valid_turn_id};
use toolfleet_common::TurnRequest;
use toolfleet_decision::parse::parse_decision;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = serde_json::from_slice::<TurnRequest>(data) {
        if let Some(id) = &request.turn_id {
            let _ = valid_turn_id(id);
        }
        let _ = normalize_tenant(&request.tenant_id);
        let _ = parse_decision(&request.decision, 256);
    }
});
