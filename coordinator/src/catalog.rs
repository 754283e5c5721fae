//! Serving the tool catalog to frontends: tools with a live worker, in the format asked
//! for, restricted to the tenant's allowlist when a tenant is named.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_common::tool::{CatalogRequest, CatalogResponse};

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
        let request: CatalogRequest = if message.payload.is_empty() {
            CatalogRequest::default()
        } else {
            serde_json::from_slice(&message.payload).unwrap_or_default()
        };
        let response = catalog(&inner, &request);
        if let Ok(body) = serde_json::to_vec(&response) {
            let _ = inner.nats.publish(reply, body.into()).await;
        }
    }
    let _ = subscriber.unsubscribe().await;
}
