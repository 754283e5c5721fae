//! The calls of one decision run at the same time: three 300 ms calls end in well under
//! the sum of their durations. A `parallel` meta-call's history entry aggregates its
//! children: their results with timing, and their summary.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use toolfleet_common::call::codes;
use toolfleet_common::CallState;
use toolfleet_tests::fleet::{
    call, call_ids, code_of, result_of, tool_calls, turn, value_at, Fleet,
};

const EVENT_WAIT: Duration = Duration::from_secs(10);
const SLEEP_MS: u64 = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sleeping_calls_overlap() -> anyhow::Result<()> {
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let ids = ["p1", "p2", "p3"];
    let calls = ids
        .iter()
        .map(|id| {
            call(
                id,
                "test.behave",
                json!({"sleep_ms": SLEEP_MS, "value": id}),
            )
        })
        .collect();

    let started = Instant::now();
    let outcome = fleet.run_calls("acme", calls, EVENT_WAIT).await?;
    let wall = started.elapsed();

    let fin = &outcome.final_event;
    assert!(
        wall < Duration::from_millis(800),
        "three {SLEEP_MS} ms calls took {wall:?} end to end"
    );
    assert!(!fin.deadline_hit);
    assert_eq!(fin.summary.total, 3);
    assert_eq!(fin.summary.ok, 3);
    assert_eq!(call_ids(fin), ids);
    for r in &fin.results {
        assert!(r.ok, "{r:?}");
        assert_eq!(r.state, CallState::Done);
        assert!(
            r.duration_ms >= SLEEP_MS,
            "{} ran {} ms",
            r.tool_call_id,
            r.duration_ms
        );
        assert_eq!(value_at(r, "/value"), Some(json!(r.tool_call_id)));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parallel_call_gets_one_history_entry_with_summary_and_timing() -> anyhow::Result<()> {
    // Room for the fast child to finish under a loaded machine's stalls.
    const DEADLINE_MS: u64 = 2000;
    const FAST_MS: u64 = 50;
    let (fleet, _c, _w) = Fleet::start_with_default_nodes().await?;
    let meta = json!({
        "id": "call_par",
        "toolName": "parallel",
        "arguments": {"calls": [
            {"name": "test.behave", "arguments": {"sleep_ms": FAST_MS, "value": "fast"}},
            {"name": "test.behave", "arguments": {"fail": "broken"}},
            {"name": "test.behave", "arguments": {"sleep_ms": 3 * DEADLINE_MS}},
        ]}
    });
    let mut request = turn("acme", tool_calls(vec![meta]));
    request.deadline_ms = Some(DEADLINE_MS);
    let outcome = fleet.run(request, EVENT_WAIT).await?;
    let fin = &outcome.final_event;

    let ids = ["call_par.0", "call_par.1", "call_par.2"];
    assert_eq!(call_ids(fin), ids);
    assert!(fin.deadline_hit, "{:?}", fin.results);
    let fast = result_of(fin, "call_par.0")?;
    assert_eq!(fast.state, CallState::Done, "{fast:?}");
    let broken = result_of(fin, "call_par.1")?;
    assert_eq!(code_of(broken), Some("broken"), "{broken:?}");
    let slow = result_of(fin, "call_par.2")?;
    assert_eq!(slow.state, CallState::Timeout, "{slow:?}");
    assert_eq!(code_of(slow), Some(codes::DEADLINE_EXCEEDED));

    // One entry, under the meta-call's id, in both renderings.
    assert_eq!(fin.history.openai.len(), 1, "{:?}", fin.history.openai);
    let entry = &fin.history.openai[0];
    assert_eq!(entry["role"], "tool");
    assert_eq!(entry["tool_call_id"], "call_par");
    let blocks = fin.history.anthropic[0]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(blocks.len(), 1, "{blocks:?}");
    assert_eq!(blocks[0]["tool_use_id"], "call_par");
    assert_eq!(blocks[0]["is_error"], false);
    assert_eq!(blocks[0]["content"], entry["content"]);

    let content: Value = serde_json::from_str(entry["content"].as_str().unwrap_or_default())?;
    assert_eq!(
        content["summary"],
        json!({"total": 3, "ok": 1, "errors": 1, "timeouts": 1, "skipped": 0})
    );
    // Every call of the turn is a child of `call_par`: the same counts as the final's.
    assert_eq!(content["summary"], serde_json::to_value(fin.summary)?);

    let children = content["results"].as_array().cloned().unwrap_or_default();
    let child_ids: Vec<&str> = children
        .iter()
        .filter_map(|c| c["tool_call_id"].as_str())
        .collect();
    assert_eq!(child_ids, ids);
    for child in &children {
        let id = child["tool_call_id"].as_str().unwrap_or_default();
        let result = result_of(fin, id)?;
        assert_eq!(child["ok"], result.ok, "{id}");
        assert_eq!(child["duration_ms"], json!(result.duration_ms), "{id}");
        assert_eq!(child["started_at"], json!(result.started_at), "{id}");
        assert_eq!(child["ended_at"], json!(result.ended_at), "{id}");
    }
    let fast_ms = children[0]["duration_ms"].as_u64().unwrap_or_default();
    assert!(fast_ms >= FAST_MS, "the fast child ran {fast_ms} ms");
    assert!(children[0]["started_at"].is_string(), "{:?}", children[0]);
    assert!(children[1]["started_at"].is_string(), "{:?}", children[1]);
    assert_eq!(children[0]["result"]["value"], "fast");
    assert_eq!(children[1]["error"]["code"], "broken");
    assert_eq!(children[2]["error"]["code"], codes::DEADLINE_EXCEEDED);
    Ok(())
}
