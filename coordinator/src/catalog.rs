//! Serving the tool catalog to frontends: tools with a live worker, in the format asked
//! for, restricted to the tenant's allowlist when a tenant is named.
//!
//! Owns answering catalog requests from the cached registry (`registry.rs`). Never
//! reads Redis itself and never touches a turn.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use toolfleet_common::tool::{CatalogFormat, CatalogRequest, CatalogResponse};
use toolfleet_common::turn::turn_codes;
use toolfleet_common::CallError;

use crate::startup::{next_message, Replica};

/// The catalog for `request`.
pub(crate) fn catalog(replica: &Replica, request: &CatalogRequest) -> CatalogResponse {
    let snapshot = replica.registry.snapshot();
    let policy = request
        .tenant_id
        .as_deref()
        .map(|t| replica.config.tenants.get(t));
    let tools = snapshot
        .sorted()
        .into_iter()
        .filter(|t| t.live_workers > 0)
        .filter(|t| policy.is_none_or(|p| p.allows(&t.definition.name)))
        .map(|t| t.definition.to_catalog_entry(request.format))
        .collect();
    CatalogResponse {
        format: request.format,
        tools,
        error: None,
    }
}

/// Answers catalog requests until `shutdown`.
pub(crate) async fn serve(
    replica: Arc<Replica>,
    mut subscriber: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    while let Some(message) = next_message(&mut subscriber, &shutdown).await {
        let Some(reply) = message.reply.clone() else {
            continue;
        };
        let parsed = if message.payload.is_empty() {
            Ok(CatalogRequest::default())
        } else {
            serde_json::from_slice::<CatalogRequest>(&message.payload)
        };
        let response = match parsed {
            Ok(request) => catalog(&replica, &request),
            Err(error) => CatalogResponse {
                format: CatalogFormat::Native,
                tools: Vec::new(),
                error: Some(CallError::fatal(
                    turn_codes::INVALID_REQUEST,
                    format!("not a catalog request: {error}"),
                )),
            },
        };
        if let Ok(body) = serde_json::to_vec(&response) {
            let _ = replica.nats.publish(reply, body.into()).await;
        }
    }
    let _ = subscriber.unsubscribe().await;
}
