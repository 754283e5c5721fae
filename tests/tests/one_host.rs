//! Two workers on one host with the same HTTP port: the second fails at start-up before
//! it announces itself (the registry never lists it), and the first keeps serving.

use std::time::Duration;

use redis::AsyncCommands;
use serde_json::json;
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, result_of, Fleet};
use toolfleet_worker::WorkerError;

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_on_a_taken_port_fails_before_announcing() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let port = toolfleet_tests::free_port()?;
    let mut config = fleet.worker_config();
    config.http_addr = Some(([127, 0, 0, 1], port).into());
    let tools = || toolfleet_packs::tools_for(&["test"]).map_err(anyhow::Error::msg);

    let coordinator = fleet.coordinator(fleet.coordinator_config());
    let first = fleet.worker(config.clone(), tools()?);
    fleet.wait_for_tools(&["test.behave"]).await?;

    let mut second_config = config;
    second_config.worker_id = "second-on-this-host".into();
    let second = tokio::time::timeout(
        Duration::from_secs(10),
        toolfleet_worker::run(second_config, tools()?, Default::default()),
    )
    .await?;
    assert!(matches!(second, Err(WorkerError::Http(_))), "{second:?}");

    let mut redis = redis::Client::open(fleet.redis.url())?
        .get_multiplexed_async_connection()
        .await?;
    let workers: Vec<String> = redis
        .zrange(fleet.names.tool_workers_key("test.behave"), 0, -1)
        .await?;
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert!(!workers.contains(&"second-on-this-host".to_string()));

    let outcome = fleet
        .run_calls(
            "acme",
            vec![call("c1", "test.behave", json!({"value": 1}))],
            EVENT_WAIT,
        )
        .await?;
    assert_eq!(
        result_of(&outcome.final_event, "c1")?.state,
        CallState::Done
    );

    first.stop().await;
    coordinator.stop().await;
    Ok(())
}
