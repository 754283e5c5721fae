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

use crate::callers::Caller;
use crate::config::TenantPolicy;
use crate::events;
use crate::registry::Registry;
use crate::replica::{next_message, Replica};
use crate::CoordinatorConfig;

/// The catalog for `request` from `caller`.
pub(crate) fn catalog(
    config: &CoordinatorConfig,
    registry: &Registry,
    caller: &Caller,
    request: &CatalogRequest,
) -> CatalogResponse {
    let bindings = &config.frontends;
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
        .map(|ids| ids.iter().map(|t| config.tenants.get(t)).collect());
    let snapshot = registry.snapshot();
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
        let Some((caller, reply)) = replica.caller_of(&message, "catalog request") else {
            continue;
        };
        let parsed = if message.payload.is_empty() {
            Ok(CatalogRequest::default())
        } else {
            serde_json::from_slice::<CatalogRequest>(&message.payload)
        };
        let response = match parsed {
            Ok(request) => catalog(&replica.config, &replica.registry, &caller, &request),
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
            events::answer(&replica.nats, &reply, body.into()).await;
        }
    }
    let _ = subscriber.unsubscribe().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FrontendBindings;
    use crate::testing::tool;

    fn request(tenant: Option<&str>) -> CatalogRequest {
        CatalogRequest {
            format: CatalogFormat::default(),
            tenant_id: tenant.map(String::from),
        }
    }

    #[test]
    fn a_frontend_sees_the_tools_its_tenants_allow_and_no_other_tenants_catalog() {
        let registry = Registry::holding(&[tool("crm.get"), tool("bank.pay")]);
        let mut config = CoordinatorConfig::local();
        let acme = TenantPolicy {
            allowed_tools: Some(vec!["crm.*".into()]),
            ..TenantPolicy::default()
        };
        config.tenants.tenants.insert("acme".into(), acme);
        config.frontends = FrontendBindings::parse("web=acme").unwrap_or_default();
        let web = Caller {
            frontend: Some("web".into()),
        };
        let own = catalog(&config, &registry, &web, &request(None));
        assert_eq!((own.tools.len(), own.error), (1, None));
        let named = catalog(&config, &registry, &web, &request(Some("ACME")));
        assert_eq!(named.tools.len(), 1, "tenant ids compare normalized");
        let other = catalog(&config, &registry, &web, &request(Some("globex")));
        assert!(other.tools.is_empty());
        assert_eq!(
            other.error.map(|e| e.code),
            Some(turn_codes::TENANT_NOT_ALLOWED.to_string())
        );
    }
}
