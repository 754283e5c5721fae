//! The body and query extractors of the API: axum's `Json` and `Query`, with their
//! refusals answered in the gateway's error shape instead of plain text.
//!
//! Owns mapping a rejected body or query string to 400 `invalid_request` (413
//! `payload_too_large` for a body over the limit). Never validates meaning: handlers do.

use aide::generate::GenContext;
use aide::openapi::{Operation, Response, StatusCode as DocStatus};
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;

use crate::error::{codes, error_response, ApiError};

/// A JSON body; a refusal is an [`ApiError`].
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// A query string; a refusal is an [`ApiError`].
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                codes::PAYLOAD_TOO_LARGE,
                rejection.body_text(),
            );
        }
        ApiError::invalid_request(rejection.body_text())
    }
}

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(value) = axum::Json::<T>::from_request(request, state).await?;
        Ok(Self(value))
    }
}

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(value)| Self(value))
            .map_err(|rejection: QueryRejection| ApiError::invalid_request(rejection.body_text()))
    }
}

fn bad_request(ctx: &mut GenContext) -> Vec<(Option<DocStatus>, Response)> {
    let what = "The request is malformed (`invalid_request`).";
    vec![(Some(DocStatus::Code(400)), error_response(ctx, 400, what))]
}

impl<T: JsonSchema> aide::OperationInput for ApiJson<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        <axum::Json<T> as aide::OperationInput>::operation_input(ctx, operation);
    }

    fn inferred_early_responses(
        ctx: &mut GenContext,
        _: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        let mut out = bad_request(ctx);
        let what = "The body is over the limit (`payload_too_large`).";
        out.push((Some(DocStatus::Code(413)), error_response(ctx, 413, what)));
        out
    }
}

impl<T: JsonSchema> aide::OperationInput for ApiQuery<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        <axum::extract::Query<T> as aide::OperationInput>::operation_input(ctx, operation);
    }

    fn inferred_early_responses(
        ctx: &mut GenContext,
        _: &mut Operation,
    ) -> Vec<(Option<DocStatus>, Response)> {
        bad_request(ctx)
    }
}
