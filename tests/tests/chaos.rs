//! `toolfleet-dev chaos`, built from this checkout, in a short run: every fault kind
//! (worker, coordinator, Redis, NATS) for a few seconds each on a fleet of its own.
//! Every accepted turn must end with exactly one final: no turn lost, none counted
//! twice, and every fault ran turns.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;
use toolfleet_tests::fleet::dev_report;

/// The faults the run covers, after the `none` baseline.
const FAULTS: [&str; 4] = ["worker", "coordinator", "redis", "nats"];
/// Bound of the whole chaos run (five fleets of four seconds each, plus start-up and
/// the turns in flight ending).
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs `toolfleet-dev chaos` for `FAULTS`, four seconds each; its exit success and report.
async fn short_chaos_run() -> Result<(bool, Value)> {
    let faults = FAULTS.join(",");
    let args = ["chaos", "--faults", &faults, "--each", "4s"];
    let (status, report) = dev_report(&args, "--json", Stdio::inherit(), RUN_TIMEOUT).await?;
    Ok((status.success(), report?))
}

fn count(fault: &Value, field: &str) -> u64 {
    fault[field].as_u64().unwrap_or(u64::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_turn_is_lost_or_counted_twice_under_any_fault() -> Result<()> {
    let (succeeded, report) = short_chaos_run().await?;
    let faults = report["faults"].as_array().context("a faults array")?;
    let names: Vec<&str> = faults.iter().filter_map(|f| f["fault"].as_str()).collect();
    let mut expected = vec!["none"];
    expected.extend(FAULTS);
    assert_eq!(names, expected);

    let broken: Vec<String> = faults
        .iter()
        .filter(|f| count(f, "turns") == 0 || count(f, "lost") > 0 || count(f, "counted_twice") > 0)
        .map(|f| {
            format!(
                "{}: {} turns, {} lost {}, {} counted twice {}",
                f["fault"],
                f["turns"],
                f["lost"],
                f["lost_turns"],
                f["counted_twice"],
                f["counted_twice_turn_ids"]
            )
        })
        .collect();
    assert!(
        broken.is_empty(),
        "faults that broke the guarantee: {broken:#?}"
    );
    for fault in faults.iter().skip(1) {
        assert!(
            count(fault, "kills") > 0,
            "no kill under {}",
            fault["fault"]
        );
    }
    assert!(
        succeeded,
        "toolfleet-dev chaos failed although its report passed"
    );
    assert_eq!(report["passed"], Value::Bool(true));
    Ok(())
}
