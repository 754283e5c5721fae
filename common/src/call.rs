//! One tool call: its normalized form, its states, its error and its result.
//!
//! Owns the wire types of a call (`ToolCall`, `CallState`, `CallError` with its stable
//! [`codes`], `CallResult`, `Summary`) and their JSON shapes, which every language's
//! worker and frontend reads. Never decides anything about a call: validation is the
//! coordinator's, execution the worker's. A field added here is optional on the wire.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A tool call normalized from any decision shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ToolCall {
    /// The call id the model produced (or one generated when it produced none).
    pub id: String,
    /// The tool name.
    pub name: String,
    /// The arguments, always a JSON value (an object for well-formed calls).
    #[serde(default)]
    pub arguments: Value,
    /// For calls flattened out of the `parallel` meta-tool: the meta-call's id, which is
    /// the id the model's history knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<String>,
}

/// The life of a call as the frontend sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Accepted and queued, not yet picked up by a worker.
    Pending,
    /// A worker is executing it.
    Running,
    /// Finished with a result.
    Done,
    /// Finished with an error (including every validation error).
    Error,
    /// No result before the tool's timeout or the turn's deadline.
    Timeout,
    /// Never dispatched (the turn ended first).
    Skipped,
    /// The caller cancelled the turn before the call's result was recorded.
    Cancelled,
}

impl CallState {
    /// Whether the call is over.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Done | Self::Error | Self::Timeout | Self::Skipped | Self::Cancelled
        )
    }

    /// The lowercase wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::Done => "done",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Skipped => "skipped",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Stable error codes used by toolfleet itself. Tools may use codes of their own.
pub mod codes {
    /// A call entry in the decision had no usable name or was not an object.
    pub const MALFORMED_CALL: &str = "malformed_call";
    /// The call's `arguments` string is not valid JSON, or not an object.
    pub const MALFORMED_ARGUMENTS: &str = "malformed_arguments";
    /// No tool of that name is registered.
    pub const UNKNOWN_TOOL: &str = "unknown_tool";
    /// The arguments fail the tool's input JSON Schema.
    pub const INVALID_ARGUMENTS: &str = "invalid_arguments";
    /// Another call earlier in the decision has the same id.
    pub const DUPLICATE_CALL_ID: &str = "duplicate_call_id";
    /// The call is past the turn's call cap.
    pub const TOO_MANY_CALLS: &str = "too_many_calls";
    /// The tenant's allowlist does not include this tool.
    pub const TOOL_NOT_ALLOWED: &str = "tool_not_allowed";
    /// The arguments name a tenant other than the turn's.
    pub const TENANT_MISMATCH: &str = "tenant_mismatch";
    /// The arguments are larger than the coordinator accepts.
    pub const ARGUMENTS_TOO_LARGE: &str = "arguments_too_large";
    /// The tool is registered but no worker serving it is alive.
    pub const NO_LIVE_WORKER: &str = "no_live_worker";
    /// The job could not be published to JetStream.
    pub const DISPATCH_FAILED: &str = "dispatch_failed";
    /// The tool returned an error without a code of its own.
    pub const TOOL_ERROR: &str = "tool_error";
    /// The tool panicked.
    pub const TOOL_PANICKED: &str = "tool_panicked";
    /// The tool ran past its own timeout.
    pub const TOOL_TIMEOUT: &str = "tool_timeout";
    /// The turn's deadline passed before the call's result arrived.
    pub const DEADLINE_EXCEEDED: &str = "deadline_exceeded";
    /// A non-idempotent call was interrupted (its worker died) and is not re-run.
    pub const CALL_INTERRUPTED: &str = "call_interrupted";
    /// The caller cancelled the turn before the call's result was recorded.
    pub const CANCELLED: &str = "cancelled";
    /// The tool's result failed its output schema.
    pub const INVALID_RESULT: &str = "invalid_result";
    /// The tool's result is larger than the worker may publish.
    pub const RESULT_TOO_LARGE: &str = "result_too_large";
    /// The turn ended before the call was dispatched.
    pub const NOT_DISPATCHED: &str = "not_dispatched";
    /// The worker's arguments did not deserialize into the tool's argument type.
    pub const BAD_ARGUMENTS: &str = "bad_arguments";

    /// Every code above, in that order: the `error.type` values the metrics keep
    /// (`metrics::error_type`).
    pub const ALL: [&str; 21] = [
        MALFORMED_CALL,
        MALFORMED_ARGUMENTS,
        UNKNOWN_TOOL,
        INVALID_ARGUMENTS,
        DUPLICATE_CALL_ID,
        TOO_MANY_CALLS,
        TOOL_NOT_ALLOWED,
        TENANT_MISMATCH,
        ARGUMENTS_TOO_LARGE,
        NO_LIVE_WORKER,
        DISPATCH_FAILED,
        TOOL_ERROR,
        TOOL_PANICKED,
        TOOL_TIMEOUT,
        DEADLINE_EXCEEDED,
        CALL_INTERRUPTED,
        CANCELLED,
        INVALID_RESULT,
        RESULT_TOO_LARGE,
        NOT_DISPATCHED,
        BAD_ARGUMENTS,
    ];
}

/// An error that crosses the wire: a stable code, a human message, whether trying
/// again later could succeed, and optionally a sentence the end user may hear. Nobody
/// parses `message`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CallError {
    /// Stable machine-readable code (see [`codes`]).
    pub code: String,
    /// Human-readable explanation, for logs and the model; never spoken to the user.
    pub message: String,
    /// Whether the same call could succeed if tried again.
    #[serde(default)]
    pub retryable: bool,
    /// One sentence saying why the call failed, written for the end user and safe to
    /// show them ("I couldn't find a customer with that id."). Set only for definite
    /// failures the user can act on; narrators speak it when every call of a turn
    /// failed with a non-retryable error that carries one. Absent on the wire when
    /// `None`, and absent from errors written by parties that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_message: Option<String>,
    /// For a retryable refusal (`overloaded`): how long to wait before trying again, in
    /// milliseconds. A client that asks again sooner only adds to the load that refused
    /// it. Absent on the wire when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl CallError {
    /// An error that will fail again if retried.
    pub fn fatal(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retryable: false,
            user_message: None,
            retry_after_ms: None,
        }
    }

    /// An error that may pass if retried.
    pub fn retryable(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retryable: true,
            user_message: None,
            retry_after_ms: None,
        }
    }

    /// Adds how long to wait before trying again (see [`CallError::retry_after_ms`]).
    #[must_use]
    pub fn retry_after(mut self, wait: std::time::Duration) -> Self {
        self.retry_after_ms = Some(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX));
        self
    }

    /// Adds the sentence the end user may hear about this error (see
    /// [`CallError::user_message`]); it must reveal nothing the user may not know.
    #[must_use]
    pub fn with_user_message(mut self, sentence: impl Into<String>) -> Self {
        self.user_message = Some(sentence.into());
        self
    }
}

/// The outcome of one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CallResult {
    /// The model's call id.
    pub tool_call_id: String,
    /// The tool name.
    pub name: String,
    /// `true` exactly when `state` is `done`.
    pub ok: bool,
    /// Terminal state: `done`, `error`, `timeout` or `skipped`.
    pub state: CallState,
    /// The tool's JSON result when `ok`.
    #[serde(default)]
    pub result: Option<Value>,
    /// The error when not `ok`.
    #[serde(default)]
    pub error: Option<CallError>,
    /// RFC 3339 time the worker started the call (absent if it never ran).
    #[serde(default)]
    pub started_at: Option<String>,
    /// RFC 3339 time the call ended.
    #[serde(default)]
    pub ended_at: Option<String>,
    /// Execution time in milliseconds (0 if it never ran). Read leniently: any
    /// non-negative number is accepted and rounded (`0.27` reads 0); written as an integer.
    #[serde(default, deserialize_with = "lenient::count")]
    pub duration_ms: u64,
    /// How many deliveries the call took (0 if never dispatched). Read leniently, like
    /// `duration_ms`.
    #[serde(default, deserialize_with = "lenient::count")]
    pub attempts: u32,
    /// The tool's own one-sentence spoken summary of its result, used by narrators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// The id of the worker that produced the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    /// The id of the `parallel` meta-call this call was flattened out of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<String>,
}

impl CallResult {
    /// A successful result.
    pub fn success(call: &ToolCall, result: Value) -> Self {
        Self::ended(call, CallState::Done, Some(result), None)
    }

    /// A failed result in `state` (`error`, `timeout` or `skipped`).
    pub fn failure(call: &ToolCall, state: CallState, error: CallError) -> Self {
        Self::ended(call, state, None, Some(error))
    }

    /// A result of `call` in `state`, with no timing, attempts or worker yet.
    fn ended(
        call: &ToolCall,
        state: CallState,
        result: Option<Value>,
        error: Option<CallError>,
    ) -> Self {
        Self {
            tool_call_id: call.id.clone(),
            name: call.name.clone(),
            ok: state == CallState::Done,
            state,
            result,
            error,
            started_at: None,
            ended_at: None,
            duration_ms: 0,
            attempts: 0,
            summary: None,
            worker_id: None,
            parent_id: call.parent_id.clone(),
        }
    }
}

/// Counts over a turn's results.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Summary {
    /// Every call the decision held.
    pub total: usize,
    /// Calls that ended `done`.
    pub ok: usize,
    /// Calls that ended `error`.
    pub errors: usize,
    /// Calls that ended `timeout`.
    pub timeouts: usize,
    /// Calls that ended `skipped`.
    pub skipped: usize,
    /// Calls that ended `cancelled` (the caller cancelled the turn); left out when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cancelled: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Summary {
    /// Counts `results` by state.
    pub fn of(results: &[CallResult]) -> Self {
        let mut s = Self {
            total: results.len(),
            ..Self::default()
        };
        for r in results {
            match r.state {
                CallState::Done => s.ok += 1,
                CallState::Timeout => s.timeouts += 1,
                CallState::Skipped => s.skipped += 1,
                CallState::Cancelled => s.cancelled += 1,
                CallState::Error | CallState::Pending | CallState::Running => s.errors += 1,
            }
        }
        s
    }
}

/// Current time as an RFC 3339 string with millisecond precision.
pub fn now_rfc3339() -> String {
    rfc3339(time::OffsetDateTime::now_utc())
}

/// Formats `t` as RFC 3339 with millisecond precision, in UTC
/// (`2026-01-20T14:00:00.500Z`). Written digit by digit: every call and every result
/// carries two timestamps, and the general formatter costs ten times as much.
pub fn rfc3339(t: time::OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    let year = t.year();
    let Ok(year) = u32::try_from(year) else {
        return rfc3339_formatted(t);
    };
    if year > 9999 {
        return rfc3339_formatted(t);
    }
    let mut out = *b"0000-00-00T00:00:00.000Z";
    let mut put = |at: usize, width: usize, mut value: u32| {
        for i in (at..at + width).rev() {
            out[i] = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    put(0, 4, year);
    put(5, 2, u32::from(u8::from(t.month())));
    put(8, 2, u32::from(t.day()));
    put(11, 2, u32::from(t.hour()));
    put(14, 2, u32::from(t.minute()));
    put(17, 2, u32::from(t.second()));
    put(20, 3, u32::from(t.millisecond()));
    String::from_utf8(out.to_vec()).unwrap_or_default()
}

/// [`rfc3339`] through `time`'s formatter, for years outside 0000-9999.
fn rfc3339_formatted(t: time::OffsetDateTime) -> String {
    let fmt = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    t.format(&fmt).unwrap_or_default()
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    let now = time::OffsetDateTime::now_utc();
    u64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or(0)
}

/// Lenient readers of the fields PROTOCOL §3.4 calls lenient: a worker in another
/// language that writes a count as a float (`"duration_ms": 0.27`) still gets its result
/// recorded instead of losing the call to the turn's deadline.
pub mod lenient {
    use serde::de::{Deserializer, Error, Visitor};

    /// A non-negative count written as an integer or as any finite non-negative number
    /// (rounded to the nearest integer).
    pub fn count<'de, D, T>(deserializer: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: TryFrom<u64>,
    {
        let n = deserializer.deserialize_any(CountVisitor)?;
        T::try_from(n).map_err(|_| D::Error::custom(format!("{n} is out of range")))
    }

    struct CountVisitor;

    impl Visitor<'_> for CountVisitor {
        type Value = u64;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a non-negative number")
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom(format!("{v} is negative")))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<u64, E> {
            if !v.is_finite() || v < 0.0 {
                return Err(E::custom(format!("{v} is not a non-negative number")));
            }
            // Saturating float-to-int conversion, by the language's definition.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            Ok(v.round() as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_code_is_listed_in_all() {
        let source = include_str!("call.rs");
        let start = source.find("pub mod codes {").unwrap_or(0);
        let end = source[start..]
            .find("pub const ALL")
            .map_or(0, |i| start + i);
        let declared: Vec<&str> = source[start..end]
            .lines()
            .filter_map(|line| line.trim().strip_prefix("pub const "))
            .filter_map(|rest| rest.split(':').next())
            .collect();
        assert_eq!(declared.len(), super::codes::ALL.len(), "{declared:?}");
    }

    #[test]
    fn counts_are_read_leniently() {
        let read = |counts: &str| {
            let body =
                format!(r#"{{"tool_call_id":"c","name":"t","ok":true,"state":"done",{counts}}}"#);
            serde_json::from_str::<super::CallResult>(&body).map(|r| (r.duration_ms, r.attempts))
        };
        assert_eq!(
            read(r#""duration_ms":0.27,"attempts":1"#).ok(),
            Some((0, 1))
        );
        assert_eq!(
            read(r#""duration_ms":7.6,"attempts":2.0"#).ok(),
            Some((8, 2))
        );
        assert_eq!(read(r#""duration_ms":12"#).ok(), Some((12, 0)));
        assert!(read(r#""duration_ms":-1"#).is_err());
        assert!(read(r#""duration_ms":"7""#).is_err());
    }

    use super::*;

    #[test]
    fn summary_counts_states() {
        let call = ToolCall {
            id: "a".into(),
            name: "t".into(),
            arguments: Value::Null,
            parent_id: None,
        };
        let results = vec![
            CallResult::success(&call, Value::Null),
            CallResult::failure(&call, CallState::Timeout, CallError::fatal("x", "y")),
            CallResult::failure(&call, CallState::Error, CallError::fatal("x", "y")),
            CallResult::failure(&call, CallState::Skipped, CallError::fatal("x", "y")),
        ];
        let s = Summary::of(&results);
        assert_eq!(
            (s.total, s.ok, s.timeouts, s.errors, s.skipped),
            (4, 1, 1, 1, 1)
        );
    }

    #[test]
    fn user_message_is_optional_on_the_wire() -> Result<(), serde_json::Error> {
        // An error from a party that predates the field still reads, without one.
        let old: CallError =
            serde_json::from_str(r#"{"code": "x", "message": "y", "retryable": false}"#)?;
        assert_eq!(old, CallError::fatal("x", "y"));
        assert_eq!(old.user_message, None);
        // Without one, nothing new is written.
        let plain = serde_json::to_value(CallError::fatal("x", "y"))?;
        assert_eq!(
            plain,
            serde_json::json!({"code": "x", "message": "y", "retryable": false})
        );
        // With one, it round-trips.
        let told = CallError::fatal("customer_not_found", "no customer with id \"nobody\"")
            .with_user_message("I couldn't find a customer with that id.");
        let value = serde_json::to_value(&told)?;
        assert_eq!(
            value["user_message"],
            "I couldn't find a customer with that id."
        );
        assert_eq!(serde_json::from_value::<CallError>(value)?, told);
        Ok(())
    }

    #[test]
    fn timestamps_are_rfc3339() {
        let t = time::macros::datetime!(2026-01-20 14:00:00.5 UTC);
        assert_eq!(rfc3339(t), "2026-01-20T14:00:00.500Z");
    }

    #[test]
    fn timestamps_match_the_general_formatter() {
        // Every day of four centuries (leap days and century years included), at a
        // time of day that moves through hours, minutes, seconds and milliseconds,
        // plus the ends of the range the digit writer covers and the years past it.
        let start = time::macros::datetime!(1900-01-01 00:00:00 UTC);
        for day in 0..146_097i64 {
            let t = start
                + time::Duration::days(day)
                + time::Duration::milliseconds((day * 7_919_993) % 86_400_000);
            assert_eq!(rfc3339(t), rfc3339_formatted(t), "{t}");
        }
        for t in [
            time::macros::datetime!(0000-01-01 00:00:00.000 UTC),
            time::macros::datetime!(9999-12-31 23:59:59.999 UTC),
            time::macros::datetime!(1970-01-01 00:00:00.0009 UTC),
        ] {
            assert_eq!(rfc3339(t), rfc3339_formatted(t), "{t}");
        }
        let east = time::macros::datetime!(2026-01-20 16:00:00.500 +02:00);
        assert_eq!(rfc3339(east), "2026-01-20T14:00:00.500Z");
        let past = time::macros::datetime!(-0001-06-01 00:00:00 UTC);
        assert_eq!(rfc3339(past), rfc3339_formatted(past));
    }
}
