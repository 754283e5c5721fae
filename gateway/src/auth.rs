//! Who is calling: the API key of a request (`Authorization: Bearer <key>` or
//! `X-Api-Key: <key>`), the tenant it maps to, and its rate.
//!
//! Owns the [`Caller`] extractor: a handler that takes a `Caller` runs only for a known,
//! unrevoked key whose bucket had a token. Before a key that is not in the known-key
//! cache, and that PostgreSQL never confirmed, is looked up, the client address (the TCP
//! peer; no forwarding header is trusted) must have a failure token left: a client that
//! presented too many unknown keys gets 429 `rate_limited` with `Retry-After` and costs
//! PostgreSQL nothing, while a key that worked before is looked up again whatever its
//! address's failures (a guesser behind the same proxy never holds it back). The
//! tenant comes from the key alone; a request body may repeat it but never choose it
//! (`turns.rs` checks). Never logs a key.
//!
//! Also owns the [`Reader`] extractor of a turn's event stream: an API key as above, or
//! a stream token (`?token=`, see `stream_token.rs`) naming that turn, for a browser's
//! `EventSource`, which cannot send headers. Never logs a token.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use aide::generate::GenContext;
use aide::openapi::{Operation, Response, SecurityRequirement, StatusCode as DocStatus};
use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};

use crate::error::{codes, error_response, ApiError};
use crate::keys::{KeyCheck, KeyError};
use crate::Gateway;

/// Name of the API-key security scheme in the OpenAPI document.
pub const SECURITY_SCHEME: &str = "api_key";
/// The header that may carry the key instead of `Authorization`.
pub const API_KEY_HEADER: &str = "x-api-key";
/// Name of the stream-token security scheme in the OpenAPI document.
pub const STREAM_TOKEN_SCHEME: &str = "stream_token";

/// The caller of a request: its key's id and tenant.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The key's id.
    pub key_id: String,
    /// The tenant every turn of this caller runs for.
    pub tenant: String,
    /// The key's limits on the chat-completions loop.
    pub chat: crate::keys::ChatLimits,
}

/// The address a request came from: the TCP peer the server recorded. A router served
/// without connection info counts every request as one client.
fn peer(parts: &Parts) -> IpAddr {
    parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |info| info.0.ip())
}

/// The key a request carries, if any.
fn presented_key(parts: &Parts) -> Option<&str> {
    let bearer = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest.trim())
        });
    let plain = || {
        parts
            .headers
            .get(API_KEY_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    bearer.or_else(plain).filter(|k| !k.is_empty())
}

impl FromRequestParts<Arc<Gateway>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        gateway: &Arc<Gateway>,
    ) -> Result<Self, Self::Rejection> {
        let key = presented_key(parts).ok_or_else(|| {
            ApiError::unauthorized("an API key is required (Authorization: Bearer <key>)")
        })?;
        let record = match gateway.keys.check(peer(parts), key).await {
            Ok(KeyCheck::Known(record)) => record,
            Ok(KeyCheck::Unknown) => {
                return Err(ApiError::unauthorized("unknown or revoked API key"))
            }
            Ok(KeyCheck::TooManyFailures(wait)) => {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    codes::RATE_LIMITED,
                    format!("too many unknown API keys from this address; retry in {wait} s"),
                )
                .retry_after(wait))
            }
            Err(KeyError::Unavailable(message)) | Err(KeyError::Invalid(message)) => {
                tracing::warn!(%message, "API key lookup failed");
                return Err(ApiError::unavailable(
                    "API keys cannot be checked right now",
                ));
            }
        };
        gateway
            .limiter
            .take(&record.id)
            .map_err(ApiError::rate_limited)?;
        Ok(Self {
            key_id: record.id,
            tenant: record.tenant,
            chat: record.chat,
        })
    }
}

/// Who reads a turn's event stream: a [`Caller`] by API key, or the holder of a stream
/// token for the turn in the path (`?token=`). Either way the reads spend the key's rate.
#[derive(Debug, Clone)]
pub struct Reader {
    /// The key's id (the one that minted the token, for a token).
    pub key_id: String,
    /// The tenant whose turn is read.
    pub tenant: String,
}

/// The `token` query parameter of a stream request.
#[derive(Debug, serde::Deserialize)]
struct TokenQuery {
    #[serde(default)]
    token: Option<String>,
}

/// The `turn_id` of the path.
#[derive(Debug, serde::Deserialize)]
struct TurnIdPath {
    turn_id: String,
}

impl FromRequestParts<Arc<Gateway>> for Reader {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        gateway: &Arc<Gateway>,
    ) -> Result<Self, Self::Rejection> {
        if presented_key(parts).is_some() {
            let caller = Caller::from_request_parts(parts, gateway).await?;
            return Ok(Self {
                key_id: caller.key_id,
                tenant: caller.tenant,
            });
        }
        let token = axum::extract::Query::<TokenQuery>::try_from_uri(&parts.uri)
            .ok()
            .and_then(|q| q.0.token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ApiError::unauthorized(
                    "an API key (Authorization: Bearer <key>) or a stream token (?token=) is required",
                )
            })?;
        let axum::extract::Path(path) =
            axum::extract::Path::<TurnIdPath>::from_request_parts(parts, gateway)
                .await
                .map_err(|_| ApiError::invalid_request("the path names no turn"))?;
        let grant = gateway
            .stream_tokens
            .check(&token, &path.turn_id)
            .map_err(|e| ApiError::unauthorized(e.to_string()))?;
        gateway
            .limiter
            .take(&grant.key_id)
            .map_err(ApiError::rate_limited)?;
        Ok(Self {
            key_id: grant.key_id,
            tenant: grant.tenant,
        })
    }
}

/// Documents `scheme` as one way to authorize `operation` (once).
fn require_scheme(operation: &mut Operation, scheme: &str) {
    let requirement: SecurityRequirement = [(scheme.to_string(), Vec::new())].into_iter().collect();
    if !operation.security.contains(&requirement) {
        operation.security.push(requirement);
    }
}

impl aide::OperationInput for Reader {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        Caller::operation_input(ctx, operation);
        require_scheme(operation, STREAM_TOKEN_SCHEME);
    }

    fn inferred_early_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        Caller::inferred_early_responses(ctx, operation)
    }
}

impl aide::OperationInput for Caller {
    fn operation_input(_: &mut GenContext, operation: &mut Operation) {
        require_scheme(operation, SECURITY_SCHEME);
    }

    fn inferred_early_responses(
        ctx: &mut GenContext,
        _: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        [
            (
                401,
                "No API key, or an unknown or revoked one (`unauthorized`).",
            ),
            (
                429,
                "The key's rate is exhausted, or this address presented too many unknown keys (`rate_limited`); see `Retry-After`.",
            ),
            (
                503,
                "The fleet or the key database cannot take the request now; see `Retry-After`.",
            ),
        ]
        .into_iter()
        .map(|(status, what)| {
            (
                Some(DocStatus::Code(status)),
                error_response(ctx, status, what),
            )
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(name: &str, value: &str) -> Parts {
        let request = axum::http::Request::builder()
            .header(name, value)
            .body(())
            .unwrap_or_default();
        request.into_parts().0
    }

    #[test]
    fn keys_come_from_bearer_or_x_api_key() {
        assert_eq!(
            presented_key(&parts("authorization", "Bearer tfk_1")),
            Some("tfk_1")
        );
        assert_eq!(
            presented_key(&parts("authorization", "bearer  tfk_2 ")),
            Some("tfk_2")
        );
        assert_eq!(presented_key(&parts("x-api-key", "tfk_3")), Some("tfk_3"));
        assert_eq!(presented_key(&parts("authorization", "Basic abc")), None);
        assert_eq!(presented_key(&parts("x-api-key", " ")), None);
    }
}
