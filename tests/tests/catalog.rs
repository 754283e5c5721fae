//! The catalog lists the live tools in every provider format, restricted to a tenant's
//! allowlist when a tenant is named.

use std::time::Duration;

use serde_json::Value;
use toolfleet_common::CatalogFormat;
use toolfleet_packs as packs;
use toolfleet_tests::fleet::Fleet;

const WAIT: Duration = Duration::from_secs(5);

const CRM_TOOLS: [&str; 3] = [
    "crm.getNextAppointment",
    "crm.getOpenInvoices",
    "crm.listUpcomingAppointments",
];
const TEST_TOOLS: [&str; 3] = ["test.behave", "test.behave_once", "test.noop"];

fn names_at<'a>(tools: &'a [Value], pointer: &str) -> Vec<&'a str> {
    tools
        .iter()
        .filter_map(|t| t.pointer(pointer).and_then(Value::as_str))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_in_every_format() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tools = packs::tools_for(&["demo", "test"]).map_err(anyhow::Error::msg)?;
    let all: Vec<&str> = CRM_TOOLS.iter().chain(&TEST_TOOLS).copied().collect();
    let (_c, _w) = fleet
        .start_with_allowlist("t1", &["crm.*"], tools, &all)
        .await?;
    let client = &fleet.client;

    // OpenAI: function tools, dots spelled `__`, sorted by name.
    let openai = client.catalog(CatalogFormat::Openai, None, WAIT).await?;
    let provider_names: Vec<String> = all.iter().map(|n| n.replace('.', "__")).collect();
    assert_eq!(names_at(&openai, "/function/name"), provider_names);
    for tool in &openai {
        assert_eq!(tool["type"], "function");
        assert_eq!(tool["function"]["parameters"]["type"], "object", "{tool}");
        assert!(tool["function"]["description"].is_string());
    }
    let invoices = openai
        .iter()
        .find(|t| t["function"]["name"] == "crm__getOpenInvoices")
        .ok_or_else(|| anyhow::anyhow!("no crm__getOpenInvoices"))?;
    assert!(invoices
        .pointer("/function/parameters/properties/customerId")
        .is_some());

    // Anthropic: `input_schema`, provider spelling.
    let anthropic = client.catalog(CatalogFormat::Anthropic, None, WAIT).await?;
    assert_eq!(names_at(&anthropic, "/name"), provider_names);
    for tool in &anthropic {
        assert_eq!(tool["input_schema"]["type"], "object", "{tool}");
        assert!(tool.get("parameters").is_none());
    }

    // MCP: `inputSchema`, registry spelling, idempotency hint.
    let mcp = client.catalog(CatalogFormat::Mcp, None, WAIT).await?;
    assert_eq!(names_at(&mcp, "/name"), all);
    for tool in &mcp {
        assert_eq!(tool["inputSchema"]["type"], "object", "{tool}");
    }
    let hint = |name: &str| {
        mcp.iter()
            .find(|t| t["name"] == name)
            .map(|t| t["annotations"]["idempotentHint"].clone())
    };
    assert_eq!(hint("test.behave"), Some(Value::Bool(true)));
    assert_eq!(hint("test.behave_once"), Some(Value::Bool(false)));

    // A tenant restricted to `crm.*` sees only the CRM tools, in every format.
    let crm_provider: Vec<String> = CRM_TOOLS.iter().map(|n| n.replace('.', "__")).collect();
    let t1 = Some("t1".to_string());
    let openai = client
        .catalog(CatalogFormat::Openai, t1.clone(), WAIT)
        .await?;
    assert_eq!(names_at(&openai, "/function/name"), crm_provider);
    let anthropic = client
        .catalog(CatalogFormat::Anthropic, t1.clone(), WAIT)
        .await?;
    assert_eq!(names_at(&anthropic, "/name"), crm_provider);
    let mcp = client.catalog(CatalogFormat::Mcp, t1.clone(), WAIT).await?;
    assert_eq!(names_at(&mcp, "/name"), CRM_TOOLS);
    let native = client.catalog(CatalogFormat::Native, t1, WAIT).await?;
    assert_eq!(names_at(&native, "/name"), CRM_TOOLS);

    // Any other tenant sees everything.
    let other = client
        .catalog(CatalogFormat::Mcp, Some("t2".to_string()), WAIT)
        .await?;
    assert_eq!(names_at(&other, "/name"), all);
    Ok(())
}
