//! One trace per turn across processes: the coordinator and the worker run as separate
//! processes exporting OTLP/HTTP to a receiver inside the test.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::HeaderMap;
use serde_json::json;
use toolfleet_common::names::HEADER_TRACEPARENT;
use toolfleet_common::CallState;
use toolfleet_tests::eventually_named;
use toolfleet_tests::fleet::{call, read_final, timed_turn, Fleet};
use toolfleet_tests::otlp::{OtlpReceiver, ReceivedSpan};

const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;
const STATUS_ERROR: i32 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_is_one_trace_from_frontend_to_every_tool() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let mut fleet = Fleet::start().await?;
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "500".to_string()),
    ];
    let env: Vec<(&str, &str)> = otel.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let coordinator = fleet.spawn_node("coordinator", &env)?;
    let worker = fleet.spawn_node("worker", &env)?;
    fleet.wait_for_tools(&["test.behave"]).await?;

    // The frontend's own span, as a W3C traceparent.
    let frontend_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let frontend_span = "00f067aa0ba902b7";
    let mut headers = HeaderMap::new();
    headers.insert(
        HEADER_TRACEPARENT,
        format!("00-{frontend_trace}-{frontend_span}-01").as_str(),
    );
    let calls = vec![
        call("fast_1", "test.behave", json!({"sleep_ms": 10})),
        call("fast_2", "test.behave", json!({"sleep_ms": 20})),
        call("slow", "test.behave", json!({"sleep_ms": 3000})),
    ];
    let request = timed_turn("acme", 700, calls);
    let mut stream = fleet.client.submit_with_headers(request, headers).await?;
    let turn_id = stream.turn_id().to_string();
    let fin = read_final(&mut stream, Duration::from_secs(10)).await?;
    let states: Vec<CallState> = fin.results.iter().map(|r| r.state).collect();
    assert_eq!(
        states,
        [CallState::Done, CallState::Done, CallState::Timeout],
        "{fin:?}"
    );

    // Stop both processes gracefully so their exporters flush.
    fleet.terminate_nodes(&[worker, coordinator]).await?;

    let spans = eventually_named("spans of the turn", Duration::from_secs(10), || {
        let spans = receiver.spans();
        async move {
            let execs = spans
                .iter()
                .filter(|s| s.attr("gen_ai.operation.name") == Some("execute_tool"))
                .count();
            let join = spans.iter().any(|s| s.name == "join");
            let turn = spans.iter().any(|s| s.name == "turn");
            (execs >= 3 && join && turn).then_some(spans)
        }
    })
    .await
    .map_err(|e| {
        let got: Vec<(String, String)> = receiver
            .spans()
            .into_iter()
            .map(|s| (s.service, s.name))
            .collect();
        anyhow::anyhow!("{e}; received: {got:?}")
    })?;
    let mine: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| s.trace_id == frontend_trace)
        .collect();
    let by_id: HashMap<&str, &ReceivedSpan> =
        mine.iter().map(|s| (s.span_id.as_str(), *s)).collect();

    // Every span of the turn is in the frontend's trace.
    for s in &spans {
        if s.attr("toolfleet.turn.id") == Some(turn_id.as_str()) {
            assert_eq!(s.trace_id, frontend_trace, "span {} left the trace", s.name);
        }
    }

    // The turn span is the frontend span's child, with turn and tenant ids.
    let turn_span = mine
        .iter()
        .find(|s| s.name == "turn")
        .copied()
        .ok_or_else(|| anyhow::anyhow!("no turn span"))?;
    assert_eq!(turn_span.parent_span_id, frontend_span);
    assert_eq!(turn_span.service, "toolfleet-coordinator");
    assert_eq!(turn_span.attr("toolfleet.turn.id"), Some(turn_id.as_str()));
    assert_eq!(turn_span.attr("toolfleet.tenant.id"), Some("acme"));

    // One producer span per call, under the turn, with messaging attributes.
    let producers: Vec<&ReceivedSpan> = mine
        .iter()
        .filter(|s| s.kind == PRODUCER)
        .copied()
        .collect();
    assert_eq!(producers.len(), 3, "{producers:#?}");
    for p in &producers {
        assert_eq!(p.parent_span_id, turn_span.span_id);
        assert_eq!(p.name, "publish fleet.jobs.test.behave");
        assert_eq!(p.attr("messaging.system"), Some("nats"));
        assert_eq!(p.attr("messaging.operation.name"), Some("publish"));
        assert_eq!(
            p.attr("messaging.destination.name"),
            Some("fleet.jobs.test.behave")
        );
    }

    // One execute_tool span per executed call, parented through `process` under the
    // turn, `process` linked to that call's producer span; the timed-out call's span
    // has error status.
    for id in ["fast_1", "fast_2", "slow"] {
        let exec = mine
            .iter()
            .find(|s| {
                s.attr("gen_ai.operation.name") == Some("execute_tool")
                    && s.attr("gen_ai.tool.call.id") == Some(id)
            })
            .copied()
            .ok_or_else(|| anyhow::anyhow!("no execute_tool span for {id}"))?;
        assert_eq!(exec.name, "execute_tool test.behave");
        assert_eq!(exec.service, "toolfleet-worker");
        assert_eq!(exec.attr("gen_ai.tool.name"), Some("test.behave"));
        let process = by_id
            .get(exec.parent_span_id.as_str())
            .copied()
            .ok_or_else(|| anyhow::anyhow!("execute_tool of {id} has no parent"))?;
        assert_eq!(process.kind, CONSUMER);
        assert_eq!(process.name, "process fleet.jobs.test.behave");
        assert_eq!(process.attr("messaging.system"), Some("nats"));
        assert!(process.attr("toolfleet.queue_wait_ms").is_some());
        assert_eq!(process.parent_span_id, turn_span.span_id);
        let link = process.links.first().map(|(_, span)| span.as_str());
        let producer = link
            .and_then(|span| by_id.get(span))
            .copied()
            .ok_or_else(|| anyhow::anyhow!("process of {id} links to no producer"))?;
        assert_eq!(producer.kind, PRODUCER);
        assert_eq!(producer.attr("gen_ai.tool.call.id"), Some(id));
        if id == "slow" {
            assert_eq!(exec.status_code, STATUS_ERROR);
            assert_eq!(exec.attr("error.type"), Some("deadline_exceeded"));
        } else {
            assert_ne!(exec.status_code, STATUS_ERROR);
        }
    }

    // join and narrate, in the same trace, under the turn.
    let join = mine
        .iter()
        .find(|s| s.name == "join")
        .copied()
        .ok_or_else(|| anyhow::anyhow!("no join span"))?;
    assert_eq!(join.parent_span_id, turn_span.span_id);
    assert_eq!(join.attr("toolfleet.summary.timeouts"), Some("1"));
    assert_eq!(join.status_code, STATUS_ERROR);
    assert!(mine.iter().any(|s| s.name == "narrate"));
    Ok(())
}

/// The names of every span one fleet exports for one turn of two calls, with the
/// coordinator and the worker logging at `log_level`.
async fn spans_of_a_turn_logged_at(log_level: &str) -> anyhow::Result<Vec<String>> {
    let receiver = OtlpReceiver::start().await?;
    let mut fleet = Fleet::start().await?;
    let endpoint = receiver.endpoint();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("RUST_LOG", log_level),
    ];
    let coordinator = fleet.spawn_node("coordinator", &env)?;
    let worker = fleet.spawn_node("worker", &env)?;
    fleet.wait_for_tools(&["test.behave"]).await?;
    let calls = vec![
        call("a", "test.behave", json!({"sleep_ms": 5})),
        call("b", "test.behave", json!({"sleep_ms": 5})),
    ];
    let mut stream = fleet.submit_calls("acme", 5_000, calls).await?;
    let fin = read_final(&mut stream, Duration::from_secs(10)).await?;
    assert!(
        fin.results.iter().all(|r| r.state == CallState::Done),
        "{fin:?}"
    );
    fleet.terminate_nodes(&[worker, coordinator]).await?;
    // Both processes flushed their exporters before they exited.
    let mut names: Vec<String> = receiver.spans().into_iter().map(|s| s.name).collect();
    names.sort();
    Ok(names)
}

/// Each name once, and how many `execute_tool` spans there were.
fn kinds(names: &[String]) -> (Vec<&String>, usize) {
    let mut distinct: Vec<&String> = names.iter().collect();
    distinct.dedup();
    let executed = names
        .iter()
        .filter(|n| n.starts_with("execute_tool"))
        .count();
    (distinct, executed)
}

/// Spans are exported at `info` and above whatever `RUST_LOG` says about log lines:
/// the same kinds of span with log lines at `warn` (one global filter) and at `debug`
/// (a filter of the exporter's own). (How many `narrate` spans a turn has depends on
/// how its results raced: each may build the closing events ahead.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_level_changes_no_exported_span() -> anyhow::Result<()> {
    let quiet = spans_of_a_turn_logged_at("warn").await?;
    let verbose =
        spans_of_a_turn_logged_at("warn,toolfleet_coordinator=debug,toolfleet_worker=debug")
            .await?;
    let (quiet_kinds, quiet_executed) = kinds(&quiet);
    assert!(quiet.iter().any(|n| n == "turn"), "{quiet:?}");
    assert_eq!(quiet_executed, 2, "{quiet:?}");
    assert_eq!((quiet_kinds, quiet_executed), kinds(&verbose));
    Ok(())
}

/// `OTEL_METRICS_EXPORTER=none` with an OTLP endpoint that takes traces only (Jaeger
/// answers `/v1/metrics` with 404, an ERROR line a minute in every process): the
/// processes post no metrics and still export their spans, while a process without the
/// setting posts its metrics on the same interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_export_turned_off_posts_no_metrics_and_keeps_the_spans() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let control = OtlpReceiver::start().await?;
    let mut fleet = Fleet::start().await?;
    let endpoint = receiver.endpoint();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "200"),
        ("OTEL_METRICS_EXPORTER", "none"),
    ];
    let coordinator = fleet.spawn_node("coordinator", &env)?;
    let worker = fleet.spawn_node("worker", &env)?;
    let control_endpoint = control.endpoint();
    let control_env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", control_endpoint.as_str()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "200"),
    ];
    let exporting = fleet.spawn_node("worker", &control_env)?;
    fleet.wait_for_tools(&["test.behave"]).await?;
    let calls = vec![call("a", "test.behave", json!({"sleep_ms": 5}))];
    let mut stream = fleet.submit_calls("acme", 5_000, calls).await?;
    read_final(&mut stream, Duration::from_secs(10)).await?;
    eventually_named("the control's metrics", Duration::from_secs(15), || {
        let posts = control.metrics_posts();
        async move { (posts >= 3).then_some(()) }
    })
    .await?;
    fleet
        .terminate_nodes(&[worker, coordinator, exporting])
        .await?;
    let names: Vec<String> = receiver.spans().into_iter().map(|s| s.name).collect();
    assert!(names.iter().any(|n| n == "turn"), "{names:?}");
    assert_eq!(receiver.metrics_posts(), 0);
    Ok(())
}
