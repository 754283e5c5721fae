//! Serving the tool catalog to frontends: tools with a live worker, in the format asked
//! for, restricted to the tenants the caller may see.
//!
//! Owns answering catalog requests from the cached registry (`registry.rs`). A request
//! is answered only when its reply subject is the caller's own inbox (`callers.rs`),
//! like a turn; one whose reply is anywhere else is dropped and counted. The tenant
//! comes from the caller's binding (`TOOLFLEET_FRONTEND_TENANTS`): a request may narrow
//! the list to one of the caller's tenants, and naming any other is refused with
//! `tenant_not_allowed`. Never reads Redis itself and never touches a turn.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use toolfleet_common::tool::{CatalogFormat, CatalogRequest, CatalogResponse};
use toolfleet_common::turn::{normalize_tenant, turn_codes};
use toolfleet_common::CallError;
use tracing::warn;

use crate::callers::Caller;
use crate::config::TenantPolicy;
use crate::events;
use crate::replica::{next_message, Replica};

/// The catalog for `request` from `caller`.
pub(crate) fn catalog(
    replica: &Replica,
    caller: &Caller,
    request: &CatalogRequest,
) -> CatalogResponse {
    let bindings = &replica.config.frontends;
    let bound = bindings.tenants_of(caller.frontend.as_deref());
    let named = request
        .tenant_id
        .as_deref()
        .map(normalize_tenant)
        .filter(|t| !t.is_empty());
    // The tenants whose allowlists decide: the one named, else the caller's own; `None`
    // for a caller that may see every tool.
    let tenants: Option<Vec<String>> = match (named, bound) {
        (Some(tenant), _) => {
            if let Err(error) = caller.check_tenant(bindings, &tenant) {
                return CatalogResponse {
                    format: request.format,
                    tools: Vec::new(),
                    error: Some(error),
                };
            }
            Some(vec![tenant])
        }
        (None, None) => None,
        (None, Some(own)) => Some(own.to_vec()),
    };
    let policies: Option<Vec<&TenantPolicy>> = tenants
        .as_ref()
        .map(|ids| ids.iter().map(|t| replica.config.tenants.get(t)).collect());
    let snapshot = replica.registry.snapshot();
    let tools = snapshot
        .sorted()
        .into_iter()
        .filter(|t| t.live_workers > 0)
        .filter(|t| {
            policies
                .as_ref()
                .is_none_or(|ps| ps.iter().any(|p| p.allows(&t.definition.name)))
        })
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
        let Some(subject) = message.reply.as_deref() else {
            continue;
        };
        let caller = Caller::of(&replica.names, &message.subject);
        let own_inbox = replica.config.nats_credentials.inbox_prefix();
        let Some(reply) = caller.reply_to(subject, &own_inbox) else {
            replica.metrics.turn_refused(turn_codes::REPLY_NOT_ALLOWED);
            warn!(subject = %message.subject, reply = %subject, "catalog request dropped: reply outside the caller's inbox");
            continue;
        };
        let parsed = if message.payload.is_empty() {
            Ok(CatalogRequest::default())
        } else {
            serde_json::from_slice::<CatalogRequest>(&message.payload)
        };
        let response = match parsed {
            Ok(request) => catalog(&replica, &caller, &request),
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
            events::answer(&replica, &reply, body.into()).await;
        }
    }
    let _ = subscriber.unsubscribe().await;
}
