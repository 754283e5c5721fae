//! The example tool crate (examples/tool-crate: three `#[tool]` fns, typed outputs and
//! errors) in a real fleet: every tool answers in one turn with its output's `Display`
//! as the summary, its typed error arrives with its code, and an argument the type does
//! not name is refused before any worker runs.

use std::time::Duration;

use serde_json::json;
use toolfleet_common::call::codes;
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{call, code_of, result_of, value_at, Fleet};

const EVENT_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_crates_tools_serve_a_turn() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let tools = toolfleet_example_tools::tools();
    let (coordinator, worker) = fleet
        .start_with(
            fleet.coordinator_config(),
            tools,
            &["units.celsius_to_fahrenheit", "math.add", "hello.greet"],
        )
        .await?;

    let calls = vec![
        call("f", "units.celsius_to_fahrenheit", json!({"celsius": 100})),
        call("sum", "math.add", json!({"a": 40, "b": 2})),
        call("hi", "hello.greet", json!({"name": "Ada"})),
        call(
            "cold",
            "units.celsius_to_fahrenheit",
            json!({"celsius": -300}),
        ),
        call(
            "units",
            "units.celsius_to_fahrenheit",
            json!({"celsius": 1, "units": "F"}),
        ),
    ];
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let fin = &outcome.final_event;

    let f = result_of(fin, "f")?;
    assert_eq!(value_at(f, "/fahrenheit"), Some(json!(212.0)), "{f:?}");
    assert_eq!(
        f.summary.as_deref(),
        Some("That is 212.0 degrees Fahrenheit.")
    );
    let sum = result_of(fin, "sum")?;
    assert_eq!(value_at(sum, "/sum"), Some(json!(42)), "{sum:?}");
    assert_eq!(sum.summary.as_deref(), Some("The sum is 42."));
    let hi = result_of(fin, "hi")?;
    assert_eq!(
        hi.summary.as_deref(),
        Some("Hello Ada, from acme."),
        "{hi:?}"
    );

    let cold = result_of(fin, "cold")?;
    assert_eq!(cold.state, CallState::Error);
    assert_eq!(code_of(cold), Some("below_absolute_zero"), "{cold:?}");
    let units = result_of(fin, "units")?;
    assert_eq!(code_of(units), Some(codes::INVALID_ARGUMENTS), "{units:?}");
    assert_eq!(units.attempts, 0, "refused before a worker ran it");

    worker.stop().await;
    coordinator.stop().await;
    Ok(())
}
