//! Serving the tool catalog to frontends: tools with a live worker, in the format asked
//! for, restricted to the tenant's allowlist when a tenant is named.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_common::tool::{CatalogFormat, CatalogRequest, CatalogResponse};
use toolfleet_common::turn::turn_codes;
use toolfleet_common::CallError;

use crate::Inner;

/// The catalog for `request`.
pub(crate) fn catalog(inner: &Inner, request: &CatalogRequest) -> CatalogResponse {
    let snapshot = inner.registry.snapshot();
    let policy = request
        .tenant_id
        .as_deref()
        .map(|t| inner.config.tenants.get(t));
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
    inner: Arc<Inner>,
    mut subscriber: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = subscriber.next() => match m { Some(m) => m, None => break },
        };
        let Some(reply) = message.reply.clone() else {
            continue;
        };
        let parsed = if message.payload.is_empty() {
            Ok(CatalogRequest::default())
        } else {
            serde_json::from_slice::<CatalogRequest>(&message.payload)
        };
        let response = match parsed {
            Ok(request) => catalog(&inner, &request),
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
            let _ = inner.nats.publish(reply, body.into()).await;
        }
    }
    let _ = subscriber.unsubscribe().await;
}
