//! A worker whose tools change while it runs (`run_set`): a tool inserted into its
//! `ToolSet` is served and listed, a removed one leaves the catalog and its calls fail
//! fast, and a worker may start with no tools at all.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::{CallState, ToolDefinition};
use toolfleet_tests::fleet::{call, code_of, result_of, Fleet, Running};
use toolfleet_worker::{Tool, ToolOutput, ToolSet};

const EVENT_WAIT: Duration = Duration::from_secs(15);

/// A tool named `name` answering `answer`.
fn answering(name: &str, answer: &'static str) -> Tool {
    Tool::from_fn(ToolDefinition::new(name, "answers"), move |_, _| {
        Box::pin(async move { Ok(ToolOutput::new(json!(answer))) })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_come_and_go_while_the_worker_runs() -> Result<()> {
    let fleet = Fleet::start().await?;
    let _c = fleet.coordinator(fleet.coordinator_config());
    let tools = ToolSet::new([]);
    let (config, set) = (fleet.worker_config(), tools.clone());
    let worker = Running::spawn("worker", |token| {
        toolfleet_worker::run_set(config, set, token)
    });

    tools.insert(answering("live.first", "one"));
    fleet.wait_for_tools(&["live.first"]).await?;
    let outcome = fleet
        .run_calls("acme", vec![call("a", "live.first", json!({}))], EVENT_WAIT)
        .await?;
    assert_eq!(
        result_of(&outcome.final_event, "a")?.result,
        Some(json!("one"))
    );

    // Replaced: the new handler answers. Removed: gone from the catalog, refused fast.
    tools.update(|set| {
        set.insert("live.first".into(), answering("live.first", "uno"));
        set.insert("live.second".into(), answering("live.second", "two"));
    });
    fleet.wait_for_tools(&["live.second"]).await?;
    let outcome = fleet
        .run_calls(
            "acme",
            vec![
                call("a", "live.first", json!({})),
                call("b", "live.second", json!({})),
            ],
            EVENT_WAIT,
        )
        .await?;
    assert_eq!(
        result_of(&outcome.final_event, "a")?.result,
        Some(json!("uno"))
    );
    assert_eq!(
        result_of(&outcome.final_event, "b")?.result,
        Some(json!("two"))
    );

    assert!(tools.remove("live.first"));
    fleet.wait_for_tool_gone("live.first").await?;
    let outcome = fleet
        .run_calls("acme", vec![call("a", "live.first", json!({}))], EVENT_WAIT)
        .await?;
    let refused = result_of(&outcome.final_event, "a")?;
    assert_eq!(refused.state, CallState::Error);
    assert_eq!(code_of(refused), Some(codes::NO_LIVE_WORKER));
    fleet.wait_for_tools(&["live.second"]).await?;
    worker.stop().await;
    Ok(())
}
