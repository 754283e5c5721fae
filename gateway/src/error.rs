//! Every error the gateway answers: an HTTP status, a stable `code` (the protocol's
//! codes where one exists), a message, whether a retry may help, and `Retry-After` for
//! 429 and 503.
//!
//! Owns mapping each failure (a refused key, a turn-level `error` event, a client
//! error, a body the extractor refused) to one status and code, and the JSON shape
//! `{"error": {"code", "message", "retryable"}}`. Never decides *whether* to refuse:
//! the handlers and limits do.

use aide::generate::GenContext;
use aide::openapi::{
    Header, MediaType, Operation, ParameterSchemaOrContent, ReferenceOr, Response, SchemaObject,
    StatusCode as DocStatus,
};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use toolfleet_common::client::{ClientError, ClientErrorKind};
use toolfleet_common::turn::turn_codes;
use toolfleet_common::CallError;

/// Codes only the HTTP surface uses; turn-level codes come from
/// [`toolfleet_common::turn::turn_codes`].
pub mod codes {
    /// No API key, or one that is unknown or revoked.
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// The turn belongs to another tenant than the key's.
    pub const FORBIDDEN: &str = "forbidden";
    /// The request body is larger than `TOOLFLEET_GATEWAY_MAX_BODY_BYTES`.
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// The key's token bucket is empty; retry after `Retry-After` seconds.
    pub const RATE_LIMITED: &str = "rate_limited";
    /// The gateway follows as many turns as it may; retry after `Retry-After` seconds.
    pub const OVERLOADED: &str = "overloaded";
    /// `/v1/chat/completions` without a configured model server.
    pub const UPSTREAM_NOT_CONFIGURED: &str = "upstream_not_configured";
    /// No such route or turn.
    pub const NOT_FOUND: &str = "not_found";
    /// No event of the turn arrived in time.
    pub const TIMEOUT: &str = "timeout";
    /// The fleet answered something the gateway could not read.
    pub const BAD_GATEWAY: &str = "bad_gateway";
}

/// The JSON body of every error response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorDetail {
    /// Stable code (`unauthorized`, `rate_limited`, `invalid_decision`, ...).
    pub code: String,
    /// Human-readable message; never parse it.
    pub message: String,
    /// Whether the same request may succeed later.
    pub retryable: bool,
}

/// An error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable code.
    pub code: String,
    /// Message.
    pub message: String,
    /// Seconds for `Retry-After` (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with `status`, `code` and `message`.
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            code: code.to_string(),
            message: message.into(),
            retry_after: None,
        }
    }

    /// Adds `Retry-After: seconds` (at least 1).
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }

    /// 401: no valid API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, codes::UNAUTHORIZED, message)
    }

    /// 400 `invalid_request`.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            turn_codes::INVALID_REQUEST,
            message,
        )
    }

    /// 413 `payload_too_large`.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            codes::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {limit} bytes"),
        )
    }

    /// 503 `unavailable` with `Retry-After: 1`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            turn_codes::UNAVAILABLE,
            message,
        )
        .retry_after(1)
    }

    /// 503 `overloaded` with `Retry-After: 1`: every turn slot is taken.
    pub fn overloaded() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::OVERLOADED,
            "the gateway follows as many turns as it may",
        )
        .retry_after(1)
    }

    /// 429 `rate_limited` with `Retry-After: wait`: the key's token bucket is empty.
    pub fn rate_limited(wait: u64) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            codes::RATE_LIMITED,
            format!("this key's request rate is exhausted; retry in {wait} s"),
        )
        .retry_after(wait)
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, codes::NOT_FOUND, message)
    }

    /// The answer to a turn that ended with an `error` event carrying `error`.
    pub fn from_turn_error(error: &CallError) -> Self {
        let status = match error.code.as_str() {
            turn_codes::INVALID_REQUEST => StatusCode::BAD_REQUEST,
            turn_codes::INVALID_DECISION | turn_codes::DECISION_TOO_LARGE => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            turn_codes::DUPLICATE_TURN | turn_codes::TURN_ID_CONFLICT => StatusCode::CONFLICT,
            turn_codes::TENANT_NOT_ALLOWED => StatusCode::FORBIDDEN,
            turn_codes::UNKNOWN_TURN => StatusCode::NOT_FOUND,
            turn_codes::CONTEXT_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            _ if error.retryable => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::UNPROCESSABLE_ENTITY,
        };
        let out = Self::new(status, &error.code, error.message.clone());
        if status == StatusCode::SERVICE_UNAVAILABLE {
            // The fleet's own wait when it names one, in whole seconds, at least 1.
            let wait_s = error.retry_after_ms.map_or(1, |ms| ms.div_ceil(1000));
            out.retry_after(wait_s)
        } else {
            out
        }
    }

    /// Whether a retry of the same request may succeed.
    pub fn retryable(&self) -> bool {
        matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        )
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.clone(),
                message: self.message.clone(),
                retryable: self.retryable(),
            },
        }
    }
}

impl From<ClientError> for ApiError {
    fn from(error: ClientError) -> Self {
        let message = error.to_string();
        match error.kind() {
            ClientErrorKind::InvalidRequest => Self::invalid_request(message),
            ClientErrorKind::PayloadTooLarge => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                codes::PAYLOAD_TOO_LARGE,
                message,
            ),
            ClientErrorKind::Decode => {
                Self::new(StatusCode::BAD_GATEWAY, codes::BAD_GATEWAY, message)
            }
            ClientErrorKind::Timeout => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, codes::TIMEOUT, message).retry_after(1)
            }
            _ => Self::unavailable(message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
        }
        response
    }
}

/// The statuses every authenticated operation may answer, with what they mean.
const COMMON_ERRORS: [(u16, &str); 5] = [
    (400, "The request is malformed (`invalid_request`)."),
    (401, "No API key, or an unknown or revoked one (`unauthorized`)."),
    (413, "The body is over the limit (`payload_too_large`), or the turn context is (`context_too_large`)."),
    (429, "The key's rate is exhausted (`rate_limited`); see `Retry-After`."),
    (503, "The fleet cannot take the request now (`unavailable`, `overloaded`, `timeout`); see `Retry-After`."),
];

/// The documented responses of an operation answering `T`: `T`'s own response as 200,
/// then `extra` (other answers such as 204), its own errors (`status`, description),
/// then the errors every authenticated operation may answer.
pub fn documented_responses<T: aide::OperationOutput>(
    ctx: &mut GenContext,
    operation: &mut Operation,
    extra: Vec<(u16, Response)>,
    errors: &[(u16, &str)],
) -> Vec<(Option<DocStatus>, Response)> {
    let ok = T::operation_response(ctx, operation);
    let mut out: Vec<(Option<DocStatus>, Response)> = ok
        .map(|ok| (Some(DocStatus::Code(200)), ok))
        .into_iter()
        .chain(
            extra
                .into_iter()
                .map(|(s, r)| (Some(DocStatus::Code(s)), r)),
        )
        .collect();
    for (status, what) in errors {
        out.push((
            Some(DocStatus::Code(*status)),
            error_response(ctx, *status, what),
        ));
    }
    out.extend(<ApiError as aide::OperationOutput>::inferred_responses(
        ctx, operation,
    ));
    out
}

/// The documented error response with `description`; `Retry-After` for 429 and 503.
pub fn error_response(ctx: &mut GenContext, status: u16, description: &str) -> Response {
    let json_schema = ctx.schema.subschema_for::<ErrorBody>();
    let mut response = Response {
        description: description.to_string(),
        content: [("application/json".to_string(), media(json_schema))]
            .into_iter()
            .collect(),
        ..Default::default()
    };
    if status == 429 || status == 503 {
        response.headers.insert(
            "Retry-After".into(),
            ReferenceOr::Item(integer_header("Seconds to wait before retrying.", true)),
        );
    }
    response
}

/// A documented response with `description` and no body yet.
pub fn described(description: &str) -> Response {
    Response {
        description: description.to_string(),
        ..Default::default()
    }
}

/// A documented body of `json_schema`, without an example.
pub fn media(json_schema: schemars::Schema) -> MediaType {
    MediaType {
        schema: Some(SchemaObject {
            json_schema,
            example: None,
            external_docs: None,
        }),
        ..Default::default()
    }
}

/// A documented integer response header.
pub fn integer_header(description: &str, required: bool) -> Header {
    header_of(
        description,
        required,
        schemars::json_schema!({"type": "integer", "minimum": 0}),
    )
}

/// A documented string response header.
pub fn string_header(description: &str, required: bool) -> Header {
    header_of(
        description,
        required,
        schemars::json_schema!({"type": "string"}),
    )
}

fn header_of(description: &str, required: bool, json_schema: schemars::Schema) -> Header {
    Header {
        description: Some(description.to_string()),
        style: Default::default(),
        required,
        deprecated: None,
        format: ParameterSchemaOrContent::Schema(SchemaObject {
            json_schema,
            example: None,
            external_docs: None,
        }),
        example: None,
        examples: Default::default(),
        extensions: Default::default(),
    }
}

impl aide::OperationOutput for ApiError {
    type Inner = ErrorBody;

    fn operation_response(ctx: &mut GenContext, _: &mut Operation) -> Option<Response> {
        Some(error_response(ctx, 400, "An error."))
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        _: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        COMMON_ERRORS
            .iter()
            .map(|(status, what)| {
                (
                    Some(DocStatus::Code(*status)),
                    error_response(ctx, *status, what),
                )
            })
            .collect()
    }
}
