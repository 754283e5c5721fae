//! The gateway's server span: one per request, named `<method> <route>`, with the HTTP
//! semantic-convention attributes, parented under an incoming `traceparent`, and its
//! own context returned in the response's `traceparent` (the live page links it to
//! Jaeger).
//!
//! Owns the tower-http `TraceLayer` hooks and the response header. The turn's spans are
//! children of this one because `FleetClient::submit` injects the current span into the
//! turn request. Never decides a response: it only observes.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::{ConnectInfo, MatchedPath, Request};
use axum::http::{header, HeaderValue, Response};
use toolfleet_common::names::HEADER_TRACEPARENT;
use toolfleet_common::telemetry;
use tower_http::classify::ServerErrorsFailureClass;
use tracing::field::Empty;
use tracing::Span;

/// Makes the server span of a request.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerSpan;

impl<B> tower_http::trace::MakeSpan<B> for ServerSpan {
    fn make_span(&mut self, request: &Request<B>) -> Span {
        let method = request.method().as_str();
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map(|p| p.as_str().to_string());
        let name = match &route {
            Some(route) => format!("{method} {route}"),
            None => method.to_string(),
        };
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let (address, port) = host.rsplit_once(':').unwrap_or((host, "80"));
        let span = tracing::info_span!(
            "HTTP request",
            otel.name = %name,
            otel.kind = "server",
            http.request.method = %method,
            http.route = route.as_deref().unwrap_or_default(),
            url.path = %request.uri().path(),
            url.scheme = "http",
            network.protocol.version = protocol(request.version()),
            server.address = %address,
            server.port = port.parse::<i64>().unwrap_or(80),
            client.address = Empty,
            user_agent.original = Empty,
            http.response.status_code = Empty,
            error.type = Empty,
        );
        if let Some(peer) = request.extensions().get::<ConnectInfo<SocketAddr>>() {
            span.record("client.address", peer.0.ip().to_string());
        }
        if let Some(agent) = request.headers().get(header::USER_AGENT) {
            span.record("user_agent.original", agent.to_str().unwrap_or_default());
        }
        if let Some(parent) = request
            .headers()
            .get(HEADER_TRACEPARENT)
            .and_then(|v| v.to_str().ok())
        {
            telemetry::set_parent_from_traceparent(&span, parent);
        }
        span
    }
}

fn protocol(version: axum::http::Version) -> &'static str {
    match version {
        axum::http::Version::HTTP_10 => "1.0",
        axum::http::Version::HTTP_2 => "2",
        axum::http::Version::HTTP_3 => "3",
        _ => "1.1",
    }
}

/// Records the response status on the server span; a 5xx marks it failed.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordStatus;

impl<B> tower_http::trace::OnResponse<B> for RecordStatus {
    fn on_response(self, response: &Response<B>, _latency: Duration, span: &Span) {
        let status = response.status();
        span.record("http.response.status_code", i64::from(status.as_u16()));
        if status.is_server_error() {
            let code = status.as_u16().to_string();
            telemetry::set_error(span, &code, status.canonical_reason().unwrap_or("error"));
        }
    }
}

/// Marks the span failed when the service itself failed.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordFailure;

impl tower_http::trace::OnFailure<ServerErrorsFailureClass> for RecordFailure {
    fn on_failure(&mut self, failure: ServerErrorsFailureClass, _latency: Duration, span: &Span) {
        if let ServerErrorsFailureClass::Error(message) = failure {
            telemetry::set_error(span, "_OTHER", &message);
        }
    }
}

/// Adds the current (server) span's `traceparent` to a response.
pub async fn add_traceparent(mut response: axum::response::Response) -> axum::response::Response {
    if let Some(value) =
        telemetry::traceparent(&Span::current()).and_then(|tp| HeaderValue::from_str(&tp).ok())
    {
        response.headers_mut().insert(HEADER_TRACEPARENT, value);
    }
    response
}
