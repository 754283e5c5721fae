//! Checking every call of a decision against the registry and the tenant's policy.
//! Each refused call gets its own error; the rest still run.
//!
//! Owns each call's verdict (dispatch with its timeout, or refuse with a stable code)
//! and its key in the join. Never publishes and never touches Redis. Next:
//! `dispatch.rs` lays the planned calls out and builds their jobs.

use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;

use serde_json::Value;
use toolfleet_common::call::codes;
use toolfleet_common::oversize::oversize_marker;
use toolfleet_common::tool::canonical_tool_name;
use toolfleet_common::turn::normalize_tenant;
use toolfleet_common::{CallError, ToolCall};
use toolfleet_decision::parse::DecisionCall;

use crate::config::TenantPolicy;
use crate::registry::{KnownTool, Snapshot};

/// What happens to one call.
pub enum Verdict {
    /// The call is published as a job.
    Dispatch {
        /// Its tool.
        tool: Arc<KnownTool>,
        /// Its timeout in milliseconds (tool timeout capped by the tenant's).
        timeout_ms: u64,
    },
    /// The call is refused with this error.
    Refuse(CallError),
}

/// One call of the decision with its verdict.
pub struct PlannedCall {
    /// Position in the decision.
    pub index: usize,
    /// The call, with its tool name in registry spelling when the tool is known.
    pub call: ToolCall,
    /// Key of the call in the turn's Redis hashes: the call id for dispatched calls,
    /// `#<index>` for refused ones (their ids may be duplicates).
    pub key: String,
    /// What happens to it.
    pub verdict: Verdict,
}

impl PlannedCall {
    /// Whether the call is dispatched.
    pub fn dispatched(&self) -> bool {
        matches!(self.verdict, Verdict::Dispatch { .. })
    }
}

/// Limits applied while validating.
pub struct Limits<'a> {
    /// Calls that may run; later ones are refused.
    pub max_calls: usize,
    /// Largest serialized arguments.
    pub max_argument_bytes: usize,
    /// The tenant's per-call timeout cap.
    pub tool_timeout_cap_ms: Option<u64>,
    /// Argument names that identify a tenant.
    pub tenant_argument_keys: &'a [String],
}

/// Validates every call in order.
pub fn plan(
    calls: Vec<DecisionCall>,
    tenant: &str,
    policy: &TenantPolicy,
    limits: &Limits<'_>,
    registry: &Snapshot,
) -> Vec<PlannedCall> {
    let mut seen = HashSet::with_capacity(calls.len());
    calls
        .into_iter()
        .enumerate()
        .map(|(index, decided)| {
            let mut call = decided.call;
            let first_use = seen.insert(call.id.clone());
            let verdict = judge(
                &mut call,
                decided.problem,
                first_use,
                index,
                tenant,
                policy,
                limits,
                registry,
            );
            let key = match verdict {
                Verdict::Dispatch { .. } => call.id.clone(),
                Verdict::Refuse(_) => format!("#{index}"),
            };
            PlannedCall {
                index,
                call,
                key,
                verdict,
            }
        })
        .collect()
}

/// The verdict for one call: the first check it fails refuses it, in this order —
/// a problem found while parsing, an unusable or repeated id, the call cap, an unknown
/// tool, the tenant's allowlist, argument size, tenant-naming arguments, the input
/// schema, a tool without a live worker.
#[allow(clippy::too_many_arguments)]
fn judge(
    call: &mut ToolCall,
    problem: Option<CallError>,
    first_use: bool,
    index: usize,
    tenant: &str,
    policy: &TenantPolicy,
    limits: &Limits<'_>,
    registry: &Snapshot,
) -> Verdict {
    let checked = problem.map_or(Ok(()), Err).and_then(|()| {
        check_position(call, first_use, index, limits)?;
        let tool = resolve_tool(call, registry)?;
        check_tenant(call, tenant, policy, limits)?;
        check_arguments(&tool, call)?;
        if tool.live_workers == 0 {
            let message = format!("no live worker serves {:?}", call.name);
            return Err(CallError::retryable(codes::NO_LIVE_WORKER, message));
        }
        Ok(tool)
    });
    match checked {
        Ok(tool) => {
            let timeout_ms = match limits.tool_timeout_cap_ms {
                Some(cap) => tool.definition.timeout_ms.min(cap),
                None => tool.definition.timeout_ms,
            };
            Verdict::Dispatch { tool, timeout_ms }
        }
        Err(error) => Verdict::Refuse(error),
    }
}

/// The call's id can travel and is its first use, and the call is within the cap.
fn check_position(
    call: &ToolCall,
    first_use: bool,
    index: usize,
    limits: &Limits<'_>,
) -> Result<(), CallError> {
    if let Some(reason) = unusable_call_id(&call.id) {
        return Err(CallError::fatal(codes::MALFORMED_CALL, reason));
    }
    if !first_use {
        let message = format!("call id {:?} appears earlier in the decision", call.id);
        return Err(CallError::fatal(codes::DUPLICATE_CALL_ID, message));
    }
    if index >= limits.max_calls {
        let message = format!("only {} calls per turn run", limits.max_calls);
        return Err(CallError::fatal(codes::TOO_MANY_CALLS, message));
    }
    Ok(())
}

/// The call's tool, by its fleet name or its model-facing name (the call is renamed to
/// the fleet spelling).
fn resolve_tool(call: &mut ToolCall, registry: &Snapshot) -> Result<Arc<KnownTool>, CallError> {
    if let Some(tool) = registry.get(&call.name) {
        return Ok(Arc::clone(tool));
    }
    let canonical = canonical_tool_name(&call.name);
    match registry.get(&canonical) {
        Some(tool) => {
            call.name = canonical;
            Ok(Arc::clone(tool))
        }
        None => {
            let message = format!("no tool named {:?}", call.name);
            Err(CallError::fatal(codes::UNKNOWN_TOOL, message))
        }
    }
}

/// The tenant may call the tool, the arguments are within the size limit, and no
/// tenant-naming argument names another tenant.
fn check_tenant(
    call: &ToolCall,
    tenant: &str,
    policy: &TenantPolicy,
    limits: &Limits<'_>,
) -> Result<(), CallError> {
    if !policy.allows(&call.name) {
        let message = format!("tenant {tenant:?} may not call {:?}", call.name);
        return Err(CallError::fatal(codes::TOOL_NOT_ALLOWED, message));
    }
    if let Some(size) = oversize_marker(&call.arguments) {
        let message = format!(
            "arguments are {size} bytes, more than a turn request can carry (the NATS server's max_payload); the client left them out"
        );
        return Err(CallError::fatal(codes::ARGUMENTS_TOO_LARGE, message));
    }
    let size = serialized_len(&call.arguments);
    if size > limits.max_argument_bytes {
        let limit = limits.max_argument_bytes;
        let message = format!("arguments are {size} bytes, the limit is {limit}");
        return Err(CallError::fatal(codes::ARGUMENTS_TOO_LARGE, message));
    }
    if let Some(key) = foreign_tenant(&call.arguments, tenant, limits.tenant_argument_keys) {
        let message = format!("argument {key:?} names another tenant");
        return Err(CallError::fatal(codes::TENANT_MISMATCH, message));
    }
    Ok(())
}

/// The arguments pass the tool's input schema (the first three errors are reported).
fn check_arguments(tool: &KnownTool, call: &ToolCall) -> Result<(), CallError> {
    let Some(validator) = &tool.validator else {
        let why = tool.schema_error.as_deref().unwrap_or("unknown error");
        let message = format!("the tool's input schema does not compile: {why}");
        return Err(CallError::fatal(codes::INVALID_ARGUMENTS, message));
    };
    let errors: Vec<String> = validator
        .iter_errors(&call.arguments)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("{at}: {e}")
            }
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(CallError::fatal(
            codes::INVALID_ARGUMENTS,
            errors.join("; "),
        ))
    }
}

/// Longest call id accepted.
pub const MAX_CALL_ID_BYTES: usize = 256;

/// Why a call id cannot travel in NATS headers and Redis fields, if it cannot: control
/// characters, more than [`MAX_CALL_ID_BYTES`], or a leading `#` (reserved for the keys
/// of refused calls).
pub fn unusable_call_id(id: &str) -> Option<String> {
    if id.len() > MAX_CALL_ID_BYTES {
        return Some(format!("call id is longer than {MAX_CALL_ID_BYTES} bytes"));
    }
    if id.chars().any(char::is_control) {
        return Some("call id contains control characters".into());
    }
    if id.starts_with('#') {
        return Some("call ids may not start with '#'".into());
    }
    None
}

/// The first tenant argument, at any depth of objects and arrays, that names another
/// tenant than `tenant` (both compared normalized). Arguments are already bounded in
/// size, so the walk is too; an explicit stack keeps deep nesting off the call stack.
fn foreign_tenant<'a>(arguments: &'a Value, tenant: &str, keys: &[String]) -> Option<&'a str> {
    let tenant = normalize_tenant(tenant);
    let mut stack = vec![arguments];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(map) => {
                for (key, inner) in map {
                    if let Value::String(named) = inner {
                        let is_tenant_key = keys.iter().any(|k| k == key);
                        if is_tenant_key && normalize_tenant(named) != tenant {
                            return Some(key.as_str());
                        }
                    }
                    stack.push(inner);
                }
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    None
}

/// Length of `value` as JSON without building the string.
fn serialized_len(value: &Value) -> usize {
    struct Counter(usize);
    impl Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_arguments_are_checked_at_any_depth() {
        let keys = ["tenant_id".to_string(), "tenantId".to_string()];
        let nested = serde_json::json!({"filter": {"tenantId": "other"}});
        assert_eq!(foreign_tenant(&nested, "t1", &keys), Some("tenantId"));
        let listed = serde_json::json!({"items": [{"q": 1}, {"tenant_id": "t2"}]});
        assert_eq!(foreign_tenant(&listed, "t1", &keys), Some("tenant_id"));
        let own = serde_json::json!({"tenant_id": " T1 ", "filter": {"tenantId": "t1"}});
        assert_eq!(foreign_tenant(&own, "t1", &keys), None);
    }

    #[test]
    fn call_ids_that_cannot_travel_are_refused() {
        assert!(unusable_call_id("call_1").is_none());
        let long = "x".repeat(300);
        for unusable in ["bad\r\nid", "#1", long.as_str()] {
            assert!(unusable_call_id(unusable).is_some(), "{unusable:?}");
        }
    }
}
