//! `GET /v1/tools?format=openai|anthropic|mcp|native`: the tools the caller's tenant may
//! call, with a live worker, in the format its model wants.
//!
//! Owns the HTTP shape of the catalog. Never filters tools itself: the coordinator
//! answers for the tenant the API key names.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::Json;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use toolfleet_common::CatalogFormat;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::ApiQuery;
use crate::Gateway;

/// Longest wait for the coordinator's catalog reply.
const CATALOG_WAIT: Duration = Duration::from_secs(5);

/// Query of `GET /v1/tools`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
pub struct ToolsQuery {
    /// The format of each entry (default `openai`).
    #[serde(default)]
    pub format: CatalogFormat,
}

/// The catalog of the caller's tenant.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ToolsAnswer {
    /// The format of `tools`.
    pub format: CatalogFormat,
    /// One entry per tool, in that format.
    pub tools: Vec<Value>,
}

/// `GET /v1/tools`.
pub async fn list(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    ApiQuery(query): ApiQuery<ToolsQuery>,
) -> Result<Json<ToolsAnswer>, ApiError> {
    gateway.nats_connected()?;
    let tools = gateway
        .client
        .catalog(query.format, Some(caller.tenant), CATALOG_WAIT)
        .await?;
    Ok(Json(ToolsAnswer {
        format: query.format,
        tools,
    }))
}
