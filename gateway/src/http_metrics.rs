//! The gateway's HTTP RED metrics: every request's duration (from the request to its
//! response head) by method, route and status, as OpenTelemetry's HTTP server semantic
//! conventions name them (`http.server.request.duration`; Prometheus:
//! `http_server_request_duration_seconds`, whose `_count` is the requests).
//!
//! Owns the instrument and the layer that records it. The route label is the route's
//! pattern (`/v1/turns/{id}`), never the path a client sent, so its values are bounded;
//! a request no route matched counts under `unmatched`. A streamed answer (server-sent
//! events) counts when its head is sent, not when the stream ends.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use opentelemetry::metrics::Histogram;
use opentelemetry::KeyValue;
use toolfleet_common::metrics::names::HTTP_SERVER_DURATION;

/// The route label of a request no route matched.
pub const UNMATCHED: &str = "unmatched";

/// Duration buckets: the OpenTelemetry HTTP server defaults, 5 ms to 10 s.
const BOUNDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

/// `app` with every request recorded.
pub fn layer(app: Router) -> Router {
    let duration = opentelemetry::global::meter("toolfleet")
        .f64_histogram(HTTP_SERVER_DURATION)
        .with_unit("s")
        .with_description("Gateway HTTP requests, from the request to the response head")
        .with_boundaries(BOUNDS.to_vec())
        .build();
    app.layer(axum::middleware::from_fn(
        move |request: Request, next: Next| {
            let duration = duration.clone();
            record(duration, request, next)
        },
    ))
}

async fn record(duration: Histogram<f64>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = method_label(request.method());
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|path| path.as_str().to_string())
        .unwrap_or_else(|| UNMATCHED.to_string());
    let response = next.run(request).await;
    duration.record(
        started.elapsed().as_secs_f64(),
        &[
            KeyValue::new("http.request.method", method),
            KeyValue::new("http.route", route),
            KeyValue::new(
                "http.response.status_code",
                i64::from(response.status().as_u16()),
            ),
        ],
    );
    response
}

/// The method label: a standard method, else `_OTHER` (the semantic conventions' bound).
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    const KNOWN: [(Method, &str); 9] = [
        (Method::GET, "GET"),
        (Method::POST, "POST"),
        (Method::PUT, "PUT"),
        (Method::DELETE, "DELETE"),
        (Method::PATCH, "PATCH"),
        (Method::HEAD, "HEAD"),
        (Method::OPTIONS, "OPTIONS"),
        (Method::CONNECT, "CONNECT"),
        (Method::TRACE, "TRACE"),
    ];
    KNOWN
        .iter()
        .find(|(known, _)| known == method)
        .map(|(_, label)| *label)
        .unwrap_or("_OTHER")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_methods_share_one_label() {
        assert_eq!(method_label(&axum::http::Method::POST), "POST");
        let odd = axum::http::Method::from_bytes(b"BREW").expect("a token");
        assert_eq!(method_label(&odd), "_OTHER");
    }
}
