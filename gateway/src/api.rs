//! The gateway's router: the API routes with their OpenAPI documentation, `/openapi.json`
//! and `/docs`, `/healthz` and `/readyz`, the live page, and the layers every request
//! passes (CORS by origin list, tracing, the body limit).
//!
//! Owns which path goes to which handler and the order of the layers. The OpenAPI
//! document is generated from the handlers' extractor and response types (aide over the
//! schemars schemas the wire types already derive); what no handler type describes (chat
//! completions, `/mcp`, health, the page) and the request examples are in [`openapi`]. Never handles a request itself beyond health and the 404.

use std::sync::Arc;

use aide::axum::routing::{get_with, post_with};
use aide::axum::ApiRouter;
use aide::openapi::{OpenApi, SecurityScheme, Tag};
use aide::transform::TransformOpenApi;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::trace::TraceLayer;

use crate::auth::{API_KEY_HEADER, SECURITY_SCHEME, STREAM_TOKEN_SCHEME};
use crate::error::ApiError;
use crate::trace::{add_traceparent, RecordFailure, RecordStatus, ServerSpan};
use crate::{catalog, mcp, page, stored, turns, Gateway};

pub mod openapi;

/// The router of `gateway`, with every layer.
pub fn router(gateway: Arc<Gateway>) -> Router {
    let (routes, api) = documented();
    let document = serde_json::to_string(&api).unwrap_or_else(|_| "{}".into());
    let redoc = aide::redoc::Redoc::new("/openapi.json")
        .with_title("toolfleet gateway API")
        .html();
    let limit = gateway.config.max_body_bytes;
    let cors = cors(&gateway.config.cors_origins);
    let app = routes
        .route(
            "/openapi.json",
            get(move || async move { ([(header::CONTENT_TYPE, "application/json")], document) }),
        )
        .route("/docs", get(move || async move { Html(redoc) }))
        .merge(mcp::service(Arc::clone(&gateway)))
        .merge(page::routes())
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(limit))
        .layer(axum::middleware::map_response(json_errors))
        .layer(axum::middleware::map_response(move |r: Response| {
            json_too_large(r, limit)
        }))
        .layer(axum::middleware::map_response(add_traceparent))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(ServerSpan)
                .on_response(RecordStatus)
                .on_failure(RecordFailure),
        );
    let app = match cors {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.with_state(gateway)
}

/// The documented routes and their OpenAPI document.
fn documented() -> (Router<Arc<Gateway>>, OpenApi) {
    let mut api = OpenApi::default();
    let routes = api_routes().finish_api_with(&mut api, describe);
    (routes, api)
}

/// The gateway's OpenAPI document, as `/openapi.json` serves it.
pub fn document() -> OpenApi {
    documented().1
}

/// The documented API, and the documentation of the routes served beside it (`/mcp`,
/// health, the document, the live page).
fn api_routes() -> ApiRouter<Arc<Gateway>> {
    let routes = ApiRouter::new()
        .api_route(
            "/v1/turns",
            post_with(turns::submit, |op| {
                let mut op = op.id("submitTurn");
                openapi::set_request_example(op.inner_mut(), openapi::example_turn());
                op
                    .tag("turns")
                    .summary("Run the calls of one model decision")
                    .description(
                        "Submits a turn for the API key's tenant. With `Accept: text/event-stream` \
                         every event is streamed (`ack`, `tool_state`, `narration`, then `final` or \
                         `error`); otherwise the answer is one JSON body with the `final` event \
                         (and every event with `events=true`). The `final` object is the same in \
                         both modes.",
                    )
            }),
        )
        .api_route(
            "/v1/turns/{turn_id}",
            get_with(stored::get, |op| {
                op.id("getTurn")
                    .tag("turns")
                    .summary("A turn by id: its stored events and, once it ended, its final")
                    .description(
                        "Every event stored so far for a turn of the key's tenant (`status` \
                         `running`), or every event to its `final` (`status` `ended`), for \
                         the retention time after its deadline.",
                    )
            })
            .delete_with(stored::cancel, |op| {
                op.id("cancelTurn")
                    .tag("turns")
                    .summary("Cancel a turn")
                    .description(
                        "Ends the turn at once with one `final` whose calls without a result \
                         are `cancelled` (sent to whoever follows it); running tools are told \
                         to stop and held calls never start. Idempotent: a turn that already \
                         ended is left as it is (`already_ended`, with how it ended).",
                    )
            }),
        )
        .api_route(
            "/v1/turns/{turn_id}/events",
            get_with(stored::events, |op| {
                op.id("turnEvents")
                    .tag("turns")
                    .summary("A turn's events as Server-Sent Events, resumable")
                    .description(
                        "The turn's events after `Last-Event-ID` (or `after`), then its later \
                         ones until `final`: a browser's `EventSource` reconnects here and \
                         loses nothing. 204 when the client already holds the `final`. \
                         Authenticated by the API key, or by a stream token for this turn in \
                         `token` (an `EventSource` cannot send headers).",
                    )
            }),
        )
        .api_route(
            "/v1/turns/{turn_id}/stream-token",
            post_with(stored::stream_token, |op| {
                op.id("turnStreamToken")
                    .tag("turns")
                    .summary("A short-lived token that reads one turn's events")
                    .description(
                        "A token for `GET /v1/turns/{turn_id}/events?token=…`: it reads this \
                         turn's events (for the key's tenant) until `expires_at` and nothing \
                         else, so a backend holding the API key can hand a browser's \
                         `EventSource` a URL without the key.",
                    )
            }),
        )
        .api_route(
            "/v1/tools",
            get_with(catalog::list, |op| {
                op.id("listTools")
                    .tag("tools")
                    .summary("The tools the key's tenant may call")
            }),
        )
        .api_route(
            "/v1/chat/completions",
            post_with(openapi::chat_completions, openapi::describe_chat),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz));
    openapi::with_route_docs(routes)
}

/// The document's title, security scheme and tags.
fn describe(api: TransformOpenApi<'_>) -> TransformOpenApi<'_> {
    api.title("toolfleet gateway")
        .version(env!("CARGO_PKG_VERSION"))
        .description(
            "Turns over HTTP: every tool call of a model decision run in parallel on a \
             toolfleet worker fleet. Every request carries an API key \
             (`Authorization: Bearer <key>` or `X-Api-Key`); the key decides the tenant. \
             Errors are `{\"error\": {\"code\", \"message\", \"retryable\"}}`.",
        )
        .security_scheme(
            SECURITY_SCHEME,
            SecurityScheme::Http {
                scheme: "bearer".into(),
                bearer_format: Some("tfk_<64 hex digits>".into()),
                description: Some(format!(
                    "An API key from `toolfleet admin keys create`, as a bearer token or in `{API_KEY_HEADER}`."
                )),
                extensions: Default::default(),
            },
        )
        .security_scheme(
            STREAM_TOKEN_SCHEME,
            SecurityScheme::ApiKey {
                location: aide::openapi::ApiKeyLocation::Query,
                name: crate::stream_token::TOKEN_QUERY.into(),
                description: Some(
                    "A stream token (`tfs_…`) for the turn in the path, from `POST /v1/turns` \
                     (the `Toolfleet-Stream-Token` header, or the 202 answer) or \
                     `POST /v1/turns/{turn_id}/stream-token`."
                        .into(),
                ),
                extensions: Default::default(),
            },
        )
        .tag(tag("turns", "Turns: submit and follow."))
        .tag(tag("tools", "The tool catalog."))
        .tag(tag("chat", "OpenAI-compatible chat completions."))
        .tag(tag(
            "mcp",
            "The fleet as an MCP server (Streamable HTTP). JSON-RPC errors are the MCP \
             protocol's own; the transport's refusals are in the error shape.",
        ))
        .tag(tag(
            "meta",
            "Health, this document and the live page; no key.",
        ))
}

/// A tag of the document's operations.
fn tag(name: &str, description: &str) -> Tag {
    Tag {
        name: name.into(),
        description: Some(description.into()),
        ..Default::default()
    }
}

/// CORS for `origins` (none: no CORS headers at all, same origin only).
fn cors(origins: &[String]) -> Option<CorsLayer> {
    let allowed: Vec<HeaderValue> = origins
        .iter()
        .filter_map(|o| HeaderValue::from_str(o).ok())
        .collect();
    if allowed.is_empty() {
        return None;
    }
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(allowed))
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                header::ACCEPT,
                HeaderName::from_static("last-event-id"),
                HeaderName::from_static("traceparent"),
                HeaderName::from_static(API_KEY_HEADER),
                HeaderName::from_static(crate::openai::TOOLS_HEADER),
                HeaderName::from_static("prefer"),
            ])
            .expose_headers([
                header::RETRY_AFTER,
                HeaderName::from_static("traceparent"),
                HeaderName::from_static(crate::stream_token::TOKEN_HEADER),
            ]),
    )
}

/// Codes of the errors only the HTTP layer itself answers.
pub mod http_codes {
    /// 405: the path exists, the method does not.
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// 406: the `Accept` header names nothing the route answers (`/mcp`).
    pub const NOT_ACCEPTABLE: &str = "not_acceptable";
    /// 415: the body's content type is not one the route reads (`/mcp`).
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported_media_type";
    /// Any other error the HTTP layer or the MCP transport answered.
    pub const HTTP_ERROR: &str = "http_error";
}

/// Longest plain-text error body kept as a message.
const PLAIN_ERROR_BYTES: usize = 4096;

/// An error answered by a layer that is not a handler (axum's 405, the MCP transport's
/// Host, Accept and content-type refusals) in the `{"error": {...}}` shape, its status and
/// other headers (`Allow`, `Retry-After`, `Mcp-Session-Id`) kept. Event streams and JSON
/// answers pass unchanged.
async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let plain = !response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| {
            v.as_bytes().starts_with(b"application/json")
                || v.as_bytes().starts_with(b"text/event-stream")
        });
    if !(status.is_client_error() || status.is_server_error()) || !plain {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, PLAIN_ERROR_BYTES)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let code = match status {
        StatusCode::BAD_REQUEST => toolfleet_common::turn::turn_codes::INVALID_REQUEST,
        StatusCode::UNAUTHORIZED => crate::error::codes::UNAUTHORIZED,
        StatusCode::FORBIDDEN => crate::error::codes::FORBIDDEN,
        StatusCode::NOT_FOUND => crate::error::codes::NOT_FOUND,
        StatusCode::METHOD_NOT_ALLOWED => http_codes::METHOD_NOT_ALLOWED,
        StatusCode::NOT_ACCEPTABLE => http_codes::NOT_ACCEPTABLE,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => http_codes::UNSUPPORTED_MEDIA_TYPE,
        StatusCode::PAYLOAD_TOO_LARGE => crate::error::codes::PAYLOAD_TOO_LARGE,
        StatusCode::TOO_MANY_REQUESTS => crate::error::codes::RATE_LIMITED,
        _ => http_codes::HTTP_ERROR,
    };
    let message = match text.is_empty() {
        true => status
            .canonical_reason()
            .unwrap_or("the request was refused")
            .to_string(),
        false => text,
    };
    let shaped = ApiError::new(status, code, message).into_response();
    let (shaped_parts, shaped_body) = shaped.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    for (name, value) in &shaped_parts.headers {
        parts.headers.insert(name.clone(), value.clone());
    }
    Response::from_parts(parts, shaped_body)
}

/// The body limit layer's own 413 answered in the error shape.
async fn json_too_large(response: Response, limit: usize) -> Response {
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if response.status() == StatusCode::PAYLOAD_TOO_LARGE && !is_json {
        return ApiError::too_large(limit).into_response();
    }
    response
}

/// `GET /readyz`: NATS connected and the key database answering; 503 `unavailable`
/// otherwise.
async fn readyz(State(gateway): State<Arc<Gateway>>) -> Result<&'static str, ApiError> {
    if gateway.nats_connected().is_err() {
        return Err(ApiError::unavailable("not connected to NATS"));
    }
    match gateway.keys.ready().await {
        Ok(()) => Ok("ready"),
        Err(error) => Err(ApiError::unavailable(error.to_string())),
    }
}
