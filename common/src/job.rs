//! The job envelope: one call, published on `<prefix>.jobs.<tool>`.
//!
//! Owns `JobEnvelope` (what a worker receives) and `ProgressNotice` (the core-NATS
//! notices between workers and coordinators). Never publishes either: the coordinator's
//! `dispatch` and `events`, and the worker's runner, do.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::call::ToolCall;

/// What a worker receives for one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct JobEnvelope {
    /// The turn the call belongs to.
    pub turn_id: String,
    /// The tenant, from the turn (never from the model's arguments).
    pub tenant_id: String,
    /// The frontend's session id, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The call: id, tool name, arguments.
    pub call: ToolCall,
    /// The turn's deadline in Unix milliseconds: a result after it is late.
    pub deadline_unix_ms: u64,
    /// The tool's timeout in milliseconds.
    pub timeout_ms: u64,
    /// When the coordinator published the job, in Unix milliseconds.
    pub dispatched_unix_ms: u64,
    /// Free-form turn context (customer id, caller phone, ...).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub context: Map<String, Value>,
}

impl JobEnvelope {
    /// The JetStream de-duplication id of this job: `<turn_id>.<call_id>`, so a
    /// re-publish of the same call is dropped while equal call ids of different turns
    /// are not.
    pub fn msg_id(&self) -> String {
        job_msg_id(&self.turn_id, &self.call.id)
    }
}

/// The JetStream de-duplication id of a call's job.
pub fn job_msg_id(turn_id: &str, call_id: &str) -> String {
    crate::names::concat(&[turn_id, ".", call_id])
}

/// A core NATS notice on `<prefix>.progress.<turn_id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ProgressNotice {
    /// A worker has been executing the call for its running delay (at once when the
    /// delay is zero); never sent for a call that ended sooner.
    Started {
        /// The call id.
        tool_call_id: String,
        /// The tool name.
        name: String,
        /// The delivery attempt.
        attempt: u32,
        /// The worker's id.
        worker_id: String,
        /// When the worker began executing the call, Unix milliseconds: the call's
        /// `started_at` should the turn end before its result (absent from older
        /// workers: the notice's arrival stands in).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_unix_ms: Option<u64>,
    },
    /// A coordinator published the turn's `final`; the owner forgets the turn.
    Ended,
}
