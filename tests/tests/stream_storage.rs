//! `TOOLFLEET_STREAM_STORAGE=memory`, an opt-in: the processes that create the jobs and
//! results streams create them in nats-server's memory, and turns run through them as
//! through file-stored ones. The default stays `file`.

use std::time::Duration;

use async_nats::jetstream::stream::StorageType;
use serde_json::json;
use toolfleet_tests::fleet::{call, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// The storage of the jobs and results streams of `fleet`.
async fn storages(fleet: &Fleet) -> anyhow::Result<[StorageType; 2]> {
    let js = async_nats::jetstream::new(fleet.client.nats().clone());
    let mut jobs = js.get_stream(fleet.names.jobs_stream_in(0)).await?;
    let mut results = js.get_stream(fleet.names.results_stream_in(0)).await?;
    Ok([
        jobs.info().await?.config.storage,
        results.info().await?.config.storage,
    ])
}

async fn a_turn_runs(fleet: &Fleet) -> anyhow::Result<()> {
    let calls = vec![
        call("a", "test.noop", json!({})),
        call("b", "test.noop", json!({})),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!((fin.summary.total, fin.summary.ok), (2, 2), "{fin:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_storage_is_an_opt_in_and_turns_run_through_it() -> anyhow::Result<()> {
    let mut fleet = Fleet::start().await?;
    let memory = [("TOOLFLEET_STREAM_STORAGE", "memory")];
    fleet.spawn_node("coordinator", &memory)?;
    fleet.spawn_node("worker", &memory)?;
    fleet.wait_for_tools(&["test.noop"]).await?;
    assert_eq!(
        storages(&fleet).await?,
        [StorageType::Memory, StorageType::Memory]
    );
    a_turn_runs(&fleet).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_storage_is_the_default() -> anyhow::Result<()> {
    let mut fleet = Fleet::start().await?;
    fleet.spawn_node("coordinator", &[])?;
    fleet.spawn_node("worker", &[])?;
    fleet.wait_for_tools(&["test.noop"]).await?;
    assert_eq!(
        storages(&fleet).await?,
        [StorageType::File, StorageType::File]
    );
    a_turn_runs(&fleet).await
}
