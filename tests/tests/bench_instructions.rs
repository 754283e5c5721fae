//! `toolfleet-dev bench --phases instructions`, built from this checkout: a fleet under
//! valgrind's callgrind driven by two client runs; the report gives each process's
//! instructions per turn and their sum.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;
use toolfleet_tests::fleet::bench_report;

/// Bound of the whole run: a fleet starting under callgrind and two client runs.
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// Whether `program` is an executable on `PATH`.
fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_counts_instructions_per_turn_of_each_process() -> Result<()> {
    // Without valgrind the bench skips the phase; say what to install instead.
    for program in ["valgrind", "callgrind_control"] {
        anyhow::ensure!(
            on_path(program),
            "{program} is needed for the bench's instruction counts: apt-get install -y valgrind"
        );
    }
    let report = bench_report(
        &["--phases", "instructions", "--tracing", "off"],
        RUN_TIMEOUT,
    )
    .await?;

    let figures = &report["modes"][0]["instructions"];
    let turns: Vec<u64> = figures["turns"]
        .as_array()
        .context("the runs' turns")?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(turns.len(), 2, "{figures}");
    assert!(
        turns[1] > turns[0],
        "the long run has more turns: {turns:?}"
    );
    let per_turn = |process: &str| figures["per_turn"][process].as_u64().unwrap_or(0);
    // A turn of three calls takes each process far more than ten thousand instructions
    // (decoding, a Redis script, NATS messages), and the coordinator more than the worker.
    for process in ["coordinator", "worker", "client"] {
        assert!(per_turn(process) > 10_000, "{process}: {figures}");
    }
    assert!(per_turn("coordinator") > per_turn("worker"), "{figures}");
    assert_eq!(
        per_turn("all"),
        per_turn("coordinator") + per_turn("worker") + per_turn("client")
    );
    let target = report["targets"]
        .as_array()
        .context("the targets")?
        .iter()
        .find(|t| {
            t["target"]
                .as_str()
                .is_some_and(|t| t.starts_with("instructions per turn"))
        })
        .context("the instructions target")?;
    let judged = target["measured"][0][1]
        .as_f64()
        .context("a judged figure")?;
    assert!(
        (judged - per_turn("all") as f64 / 1e6).abs() < 0.001,
        "{target}"
    );
    Ok(())
}
