//! `toolfleet conformance` against real workers: the Rust worker (`fleet-node` serving
//! the conformance pack) and the Python SDK worker pass every case, the drain on SIGTERM
//! included; a deliberately faulty Python worker gets its defects named —
//! `duration_ms: 0.27` in its results (a warning: the coordinator reads it leniently and
//! the call is done) and `timeout_ms: 2000.0` in its definition (a failure: the
//! coordinator refuses the definition and writes the refusal back to the registry).

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;
use toolfleet_cli::conformance::{self, Report, Severity};
use toolfleet_common::CallState;
use toolfleet_packs::testing::CONFORMANCE_TOOL;
use toolfleet_tests::conformance::{assert_clean, settings};
use toolfleet_tests::fleet::{call, result_of, Fleet};
use toolfleet_tests::python::sdk_fleet;

const WAIT: Duration = Duration::from_secs(15);

/// The codes of the findings of `case` with `severity`.
fn codes(report: &Report, case: &str, severity: Severity) -> Vec<&'static str> {
    report
        .case(case)
        .map(|c| {
            c.findings
                .iter()
                .filter(|f| f.severity == severity)
                .map(|f| f.code)
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_worker_conforms() -> Result<()> {
    let mut fleet = Fleet::start().await?;
    let coordinator = fleet.coordinator(fleet.coordinator_config());
    // The probe's `panic` case panics in the tool on purpose. With a backtrace asked
    // for (CI sets RUST_BACKTRACE), the panic hook symbolizes this debug build's frames
    // on the runtime thread, which on a loaded machine can outlast the 1 s ack wait: the
    // job is redelivered and runs twice (`several_results`), which is not the worker's
    // protocol under test.
    let pid = fleet.spawn_node(
        "worker",
        &[("FLEET_NODE_PACKS", "conformance"), ("RUST_BACKTRACE", "0")],
    )?;
    fleet.wait_for_tools(&[CONFORMANCE_TOOL]).await?;

    let report = conformance::run(&settings(&fleet, CONFORMANCE_TOOL, Some(pid))?).await?;
    assert_clean(&report);
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_worker_conforms() -> Result<()> {
    const TOOL: &str = "conformance.py_probe";
    let (python, fleet, coordinator) = sdk_fleet(env!("CARGO_TARGET_TMPDIR")).await?;
    let args = ["-m", "toolfleet_worker.conformance"];
    let mut worker = toolfleet_tests::python::worker(
        &python,
        &fleet,
        &args,
        &[("TOOLFLEET_CONFORMANCE_TOOL", TOOL)],
    )?;
    fleet.wait_for_tools(&[TOOL]).await?;
    let pid = worker.id().context("the Python worker has no pid")?;

    let report = conformance::run(&settings(&fleet, TOOL, Some(pid))?).await?;
    assert_clean(&report);
    let status = tokio::time::timeout(WAIT, worker.wait()).await??;
    assert!(status.success(), "{status}");
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faulty_workers_defects_are_named() -> Result<()> {
    let (python, fleet, coordinator) = sdk_fleet(env!("CARGO_TARGET_TMPDIR")).await?;
    let script = ["tests/python/faulty_worker.py"];
    let mut worker = toolfleet_tests::python::worker(&python, &fleet, &script, &[])?;
    fleet.wait_for_tools(&["conformance.faulty"]).await?;

    // Float durations: named as a warning ...
    let report = conformance::run(&settings(&fleet, "conformance.faulty", None)?).await?;
    assert!(report.passed(), "{report}");
    assert!(
        codes(&report, "echo", Severity::Warning).contains(&"non_integer_field"),
        "{report}"
    );
    // ... because the coordinator reads them leniently: the call is done, not lost.
    let echo = json!({"behave": "echo", "value": 7});
    let outcome = fleet
        .run_calls("acme", vec![call("c1", "conformance.faulty", echo)], WAIT)
        .await?;
    let result = result_of(&outcome.final_event, "c1")?;
    assert_eq!(result.state, CallState::Done, "{result:?}");
    assert_eq!(result.duration_ms, 0);

    // A float timeout: the coordinator refuses the definition and says so in the
    // registry; conformance names both.
    wait_for_refusal(&fleet, "conformance.sloppy").await?;
    let report = conformance::run(&settings(&fleet, "conformance.sloppy", None)?).await?;
    assert!(!report.passed(), "{report}");
    let failures = codes(&report, "definition", Severity::Failure);
    assert!(failures.contains(&"definition_type"), "{report}");
    assert!(failures.contains(&"definition_rejected"), "{report}");

    toolfleet_tests::python::terminate(&mut worker).await?;
    coordinator.stop().await;
    Ok(())
}

/// Waits until a coordinator's refusal of `tool`'s definition is in the registry.
async fn wait_for_refusal(fleet: &Fleet, tool: &str) -> Result<()> {
    let mut redis = redis::Client::open(fleet.redis.url())?
        .get_multiplexed_async_connection()
        .await?;
    let end = tokio::time::Instant::now() + WAIT;
    loop {
        let refusal: Option<String> = redis::cmd("HGET")
            .arg(fleet.names.rejected_definitions_key())
            .arg(tool)
            .query_async(&mut redis)
            .await?;
        if refusal.is_some() {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < end,
            "no refusal of {tool} written back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
