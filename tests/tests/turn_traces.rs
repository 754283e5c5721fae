//! What an SRE sees in Jaeger for one turn: coordinators and workers run as separate
//! processes exporting OTLP/HTTP to a receiver inside the test, and the assertions read
//! the received spans — durations, parent/child links, attributes and their types.
//!
//! Set `TOOLFLEET_TRACE_TREE_DIR` to write each turn's span tree to a file there (the
//! trees in docs/OBSERVABILITY.md come from it).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use serde_json::{json, Value};
use toolfleet_common::names::HEADER_TRACEPARENT;
use toolfleet_common::{CallState, TurnRequest};
use toolfleet_tests::eventually_named;
use toolfleet_tests::fleet::{call, read_ack, read_final, timed_turn, until_state, Fleet};
use toolfleet_tests::otlp::{render_tree, OtlpReceiver, ReceivedSpan};

const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;
const STATUS_ERROR: i32 = 2;
const EVENT_WAIT: Duration = Duration::from_secs(15);
const SPAN_WAIT: Duration = Duration::from_secs(15);

/// Attributes shown in printed trees.
const SHOWN: &[&str] = &[
    "gen_ai.tool.call.id",
    "toolfleet.attempt",
    "error.type",
    "toolfleet.turn.deadline_hit",
];

/// A receiver, a fleet and the environment that points processes at the receiver.
struct Traced {
    receiver: OtlpReceiver,
    fleet: Fleet,
}

impl Traced {
    /// A traced fleet with coordinator `coordinator-a` and worker `worker-a` serving
    /// `test.behave`; the two nodes' pids.
    async fn with_nodes() -> anyhow::Result<(Self, u32, u32)> {
        let mut t = Self::start().await?;
        let coordinator = t.spawn("coordinator", "coordinator-a")?;
        let worker = t.spawn("worker", "worker-a")?;
        t.fleet.wait_for_tools(&["test.behave"]).await?;
        Ok((t, coordinator, worker))
    }

    /// Stops `nodes` gracefully (each within 15 s), so their spans are flushed.
    async fn stop(&mut self, nodes: &[u32]) -> anyhow::Result<()> {
        for node in nodes {
            self.fleet
                .terminate_node(*node, Duration::from_secs(15))
                .await?;
        }
        Ok(())
    }

    async fn start() -> anyhow::Result<Self> {
        Ok(Self {
            receiver: OtlpReceiver::start().await?,
            fleet: Fleet::start().await?,
        })
    }

    /// Spawns `fleet-node <role>` exporting to the receiver, as `instance`.
    fn spawn(&mut self, role: &str, instance: &str) -> anyhow::Result<u32> {
        self.spawn_with(role, instance, &[("OTEL_BSP_SCHEDULE_DELAY", "100")])
    }

    /// [`Traced::spawn`] on the batch settings of deploy/ (the SDK's defaults: spans
    /// exported every 5 s), with `extra` environment.
    fn spawn_with(
        &mut self,
        role: &str,
        instance: &str,
        extra: &[(&str, &str)],
    ) -> anyhow::Result<u32> {
        let endpoint = self.receiver.endpoint();
        let resource = format!("service.instance.id={instance},deployment.environment.name=test");
        let mut env = vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
            ("OTEL_RESOURCE_ATTRIBUTES", resource.as_str()),
        ];
        env.extend_from_slice(extra);
        self.fleet.spawn_node(role, &env)
    }

    /// Submits `request` as the child of a frontend span in a fresh trace; returns the
    /// stream and the frontend's trace and span ids.
    /// Submits a turn for tenant `acme` of one `test.behave` call `id` that sleeps
    /// `sleep_ms`, under `deadline_ms`.
    async fn submit_sleep(
        &self,
        id: &str,
        sleep_ms: u64,
        deadline_ms: u64,
    ) -> anyhow::Result<(toolfleet_common::client::TurnStream, String, String)> {
        let calls = vec![call(id, "test.behave", json!({ "sleep_ms": sleep_ms }))];
        self.submit(timed_turn("acme", deadline_ms, calls)).await
    }

    async fn submit(
        &self,
        request: TurnRequest,
    ) -> anyhow::Result<(toolfleet_common::client::TurnStream, String, String)> {
        self.submit_flagged(request, true).await
    }

    /// [`Traced::submit`] with the frontend's `sampled` flag as given.
    async fn submit_flagged(
        &self,
        request: TurnRequest,
        sampled: bool,
    ) -> anyhow::Result<(toolfleet_common::client::TurnStream, String, String)> {
        let trace = uuid::Uuid::new_v4().simple().to_string();
        let span = trace[..16].to_string();
        let flags = if sampled { "01" } else { "00" };
        let mut headers = HeaderMap::new();
        headers.insert(
            HEADER_TRACEPARENT,
            format!("00-{trace}-{span}-{flags}").as_str(),
        );
        let stream = self
            .fleet
            .client
            .submit_with_headers(request, headers)
            .await?;
        Ok((stream, trace, span))
    }

    /// Waits until the trace holds a `turn` span and `ready` says the rest is in; writes
    /// the tree when asked to and prints it.
    async fn spans_of(
        &self,
        trace: &str,
        label: &str,
        ready: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> anyhow::Result<Vec<ReceivedSpan>> {
        let of_trace = || -> Vec<ReceivedSpan> {
            let all = self.receiver.spans();
            all.into_iter().filter(|s| s.trace_id == trace).collect()
        };
        let found = eventually_named("spans of the turn", SPAN_WAIT, || {
            let spans = of_trace();
            let done = spans.iter().any(|s| s.name == "turn") && ready(&spans);
            async move { done.then_some(spans) }
        })
        .await;
        let spans = of_trace();
        let tree = render_tree(&spans, trace, SHOWN);
        eprintln!("--- {label} ---\n{tree}");
        if let Ok(dir) = std::env::var("TOOLFLEET_TRACE_TREE_DIR") {
            let _ = std::fs::write(format!("{dir}/{label}.txt"), &tree);
        }
        found.map_err(|e| anyhow::anyhow!("{e}; tree:\n{tree}"))
    }
}

fn the<'a>(spans: &'a [ReceivedSpan], name: &str) -> anyhow::Result<&'a ReceivedSpan> {
    let found: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.name == name).collect();
    anyhow::ensure!(found.len() == 1, "{} spans named {name}", found.len());
    Ok(found[0])
}

/// Every span's parent is in the trace, except the root's, which is `root_parent`.
fn assert_no_missing_parent(spans: &[ReceivedSpan], root_parent: &str) {
    if let Some(s) = missing_parent(spans, root_parent) {
        panic!(
            "span {} ({}) has a parent that never arrived: {}",
            s.name, s.service, s.parent_span_id
        );
    }
}

/// The first span whose parent is neither among `spans` nor `root_parent`.
fn missing_parent<'a>(spans: &'a [ReceivedSpan], root_parent: &str) -> Option<&'a ReceivedSpan> {
    let ids: HashMap<&str, &ReceivedSpan> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    spans
        .iter()
        .find(|s| !ids.contains_key(s.parent_span_id.as_str()) && s.parent_span_id != root_parent)
}

/// Whether `ancestor` is `span` or one of its ancestors.
fn descends_from(spans: &[ReceivedSpan], span: &ReceivedSpan, ancestor: &str) -> bool {
    let mut at = span;
    for _ in 0..32 {
        if at.span_id == ancestor {
            return true;
        }
        match spans.iter().find(|s| s.span_id == at.parent_span_id) {
            Some(parent) => at = parent,
            None => return false,
        }
    }
    false
}

fn openai_call(id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_turn_span_lasts_as_long_as_the_turn() -> anyhow::Result<()> {
    let (mut t, coordinator, worker) = Traced::with_nodes().await?;

    let submitted = Instant::now();
    let (mut stream, trace, frontend) = t.submit_sleep("slow", 400, 5000).await?;
    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    let took = submitted.elapsed();
    assert_eq!(fin.results[0].state, CallState::Done, "{fin:?}");

    let spans = t
        .spans_of(&trace, "one-400ms-call", |s| {
            s.iter().any(|s| s.name.starts_with("execute_tool"))
                && s.iter().any(|s| s.name == "join")
        })
        .await?;
    let turn = the(&spans, "turn")?;
    assert_eq!(turn.kind, SERVER);
    assert_eq!(turn.parent_span_id, frontend);
    let turn_ms = (turn.end_unix_nano - turn.start_unix_nano) / 1_000_000;
    assert!(turn_ms >= 400, "turn span {turn_ms} ms");
    assert!(
        u128::from(turn_ms) <= took.as_millis() + 50,
        "turn span {turn_ms} ms, the turn took {took:?}"
    );
    assert_no_missing_parent(&spans, &frontend);
    for s in &spans {
        if s.span_id == turn.span_id {
            continue;
        }
        assert!(
            descends_from(&spans, s, &turn.span_id),
            "{} is outside the turn",
            s.name
        );
        assert!(
            s.start_unix_nano >= turn.start_unix_nano && s.end_unix_nano <= turn.end_unix_nano,
            "{} [{}, {}] is outside the turn [{}, {}]",
            s.name,
            s.start_unix_nano,
            s.end_unix_nano,
            turn.start_unix_nano,
            turn.end_unix_nano
        );
        assert_eq!(
            s.attr("toolfleet.turn.id"),
            Some(fin.turn_id.as_str()),
            "{}",
            s.name
        );
        assert_eq!(s.attr("toolfleet.tenant.id"), Some("acme"), "{}", s.name);
    }
    // The result hop: a consumer span on the coordinator under the turn, linked to the
    // worker's span, and a client span around the join script.
    let hop = spans
        .iter()
        .find(|s| s.kind == CONSUMER && s.service == "toolfleet-coordinator")
        .ok_or_else(|| anyhow::anyhow!("no consumer span for the result"))?;
    assert_eq!(hop.parent_span_id, turn.span_id);
    assert_eq!(hop.links.len(), 1);
    let worker_process = spans
        .iter()
        .find(|s| s.span_id == hop.links[0].1)
        .ok_or_else(|| anyhow::anyhow!("the result's consumer span links to nothing"))?;
    assert_eq!(worker_process.service, "toolfleet-worker");
    assert!(spans.iter().any(|s| s.kind == CLIENT
        && s.parent_span_id == hop.span_id
        && s.attr("db.system.name") == Some("redis")));

    t.stop(&[worker, coordinator]).await?;
    Ok(())
}

/// Seven calls failing in seven ways: three refused up front, a panic, a definite
/// error, a retryable error retried until it gives up, a call past the deadline.
fn seven_failures() -> TurnRequest {
    let calls = vec![
        openai_call("c_unknown", "crm__noSuchTool", "{}"),
        openai_call("c_malformed", "test__behave", "{\"sleep_ms\": "),
        openai_call("c_invalid", "test__behave", "{\"sleep_ms\": \"slow\"}"),
        openai_call("c_panic", "test__behave", "{\"panic\": true}"),
        openai_call("c_fatal", "test__behave", "{\"fail\": \"boom\"}"),
        openai_call(
            "c_retry",
            "test__behave",
            "{\"fail\": \"flaky\", \"retryable\": true}",
        ),
        openai_call("c_slow", "test__behave", "{\"sleep_ms\": 5000}"),
    ];
    let decision = json!({"role": "assistant", "content": null, "tool_calls": calls});
    let mut request = toolfleet_tests::fleet::turn("acme", decision);
    request.deadline_ms = Some(1500);
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_of_a_failing_turn_is_in_the_trace() -> anyhow::Result<()> {
    let (mut t, coordinator, worker) = Traced::with_nodes().await?;

    let (mut stream, trace, frontend) = t.submit(seven_failures()).await?;
    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    assert!(fin.deadline_hit);
    assert_eq!(fin.summary.ok, 0, "{fin:?}");
    let ids = [
        "c_unknown",
        "c_malformed",
        "c_invalid",
        "c_panic",
        "c_fatal",
        "c_retry",
        "c_slow",
    ];
    let spans = t
        .spans_of(&trace, "seven-failures", |s| {
            let execs = s
                .iter()
                .filter(|s| s.name.starts_with("execute_tool"))
                .count();
            execs >= 6 && s.iter().any(|s| s.name == "join")
        })
        .await?;
    assert_no_missing_parent(&spans, &frontend);
    let turn = the(&spans, "turn")?;
    assert_eq!(turn.attr("error.type"), Some("deadline_exceeded"));
    let join = the(&spans, "join")?;
    assert_eq!(join.attr("error.type"), Some("deadline_exceeded"));
    assert_eq!(join.status_code, STATUS_ERROR);

    // Every call id is on an error span with its code and a message.
    for (id, code) in ids.iter().zip([
        "unknown_tool",
        "malformed_arguments",
        "invalid_arguments",
        "tool_panicked",
        "boom",
        "flaky",
        "deadline_exceeded",
    ]) {
        let failing: Vec<&ReceivedSpan> = spans
            .iter()
            .filter(|s| {
                s.attr("gen_ai.tool.call.id") == Some(*id) && s.attr("error.type") == Some(code)
            })
            .collect();
        assert!(
            !failing.is_empty(),
            "no span of {id} with error.type {code}"
        );
        for s in failing {
            assert_eq!(s.status_code, STATUS_ERROR, "{} of {id}", s.name);
            assert!(
                !s.status_message.is_empty(),
                "{} of {id}: no message",
                s.name
            );
            assert!(s.status_message.len() <= 512, "{} of {id}", s.name);
        }
    }
    // Refused calls carry both tool names.
    let refused = spans
        .iter()
        .find(|s| s.attr("gen_ai.tool.call.id") == Some("c_malformed"))
        .ok_or_else(|| anyhow::anyhow!("no span for c_malformed"))?;
    assert_eq!(refused.attr("gen_ai.tool.name"), Some("test.behave"));
    assert_eq!(
        refused.attr("toolfleet.tool.provider_name"),
        Some("test__behave")
    );
    assert!(descends_from(&spans, refused, &turn.span_id));
    assert_eq!(refused.name, "refuse_tool test.behave");
    // A tool the registry does not hold names no operation: its refusal is the one
    // `refuse_tool _unknown`, the model's name for it only an attribute.
    let unknown = spans
        .iter()
        .find(|s| s.attr("gen_ai.tool.call.id") == Some("c_unknown"))
        .ok_or_else(|| anyhow::anyhow!("no span for c_unknown"))?;
    assert_eq!(unknown.name, "refuse_tool _unknown");
    assert_eq!(unknown.attr("gen_ai.tool.name"), Some("crm.noSuchTool"));
    assert_eq!(
        unknown.attr("toolfleet.tool.provider_name"),
        Some("crm__noSuchTool")
    );
    let named: Vec<&str> = spans
        .iter()
        .map(|s| s.name.as_str())
        .filter(|name| name.contains("noSuchTool"))
        .collect();
    assert!(
        named.is_empty(),
        "span names with a made-up tool: {named:?}"
    );

    // The panic is an exception event.
    let panic = spans
        .iter()
        .find(|s| {
            s.name.starts_with("execute_tool") && s.attr("gen_ai.tool.call.id") == Some("c_panic")
        })
        .ok_or_else(|| anyhow::anyhow!("no execute_tool span for c_panic"))?;
    assert!(panic.events.iter().any(|(name, a)| name == "exception"
        && a.get("exception.message")
            .is_some_and(|m| m.contains("asked to panic"))));

    // Each attempt of the retried call is a process span with its outcome.
    let mut attempts: Vec<(i64, Option<&str>)> = spans
        .iter()
        .filter(|s| {
            s.kind == CONSUMER
                && s.service == "toolfleet-worker"
                && s.attr("gen_ai.tool.call.id") == Some("c_retry")
        })
        .map(|s| {
            let attempt = s.attr("toolfleet.attempt").and_then(|a| a.parse().ok());
            (attempt.unwrap_or(0), s.attr("error.type"))
        })
        .collect();
    attempts.sort();
    assert_eq!(
        attempts,
        [(1, Some("flaky")), (2, Some("flaky")), (3, Some("flaky"))]
    );

    t.stop(&[worker, coordinator]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_finished_by_another_replica_is_one_whole_trace() -> anyhow::Result<()> {
    let (mut t, first, worker) = Traced::with_nodes().await?;

    let submitted = Instant::now();
    let (mut stream, trace, frontend) = t.submit_sleep("orphan", 1000, 10_000).await?;
    read_ack(&mut stream, EVENT_WAIT).await?;
    until_state(&mut stream, None, CallState::Running, EVENT_WAIT).await?;
    t.fleet.kill_node(first).await?;
    let second = t.spawn("coordinator", "coordinator-b")?;
    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    let took = submitted.elapsed();
    assert_eq!(fin.results[0].state, CallState::Done, "{fin:?}");

    let spans = t
        .spans_of(&trace, "failover", |s| {
            // Spans arrive in batches from three processes: a parent still in flight is
            // waited for; one that never arrives fails below after the bounded wait.
            s.iter().any(|s| s.name == "join")
                && s.iter().any(|s| s.name.starts_with("execute_tool"))
                && missing_parent(s, &frontend).is_none()
        })
        .await?;
    assert_no_missing_parent(&spans, &frontend);
    let turn = the(&spans, "turn")?;
    assert_eq!(turn.parent_span_id, frontend);
    assert_eq!(
        turn.resource.get("service.instance.id").map(String::as_str),
        Some("coordinator-b")
    );
    let turn_ms = (turn.end_unix_nano - turn.start_unix_nano) / 1_000_000;
    assert!(turn_ms >= 1000, "turn span {turn_ms} ms");
    assert!(u128::from(turn_ms) <= took.as_millis() + 50);
    let join = the(&spans, "join")?;
    assert_eq!(join.parent_span_id, turn.span_id);
    assert_eq!(
        join.resource.get("service.instance.id").map(String::as_str),
        Some("coordinator-b")
    );
    // The killed replica's spans are lost with it; the job it published reached the
    // worker, whose spans sit under the same turn.
    let exec = spans
        .iter()
        .find(|s| s.name.starts_with("execute_tool"))
        .ok_or_else(|| anyhow::anyhow!("no execute_tool span"))?;
    assert!(descends_from(&spans, exec, &turn.span_id));

    t.stop(&[worker, second]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_name_the_instance_and_numbers_are_integers() -> anyhow::Result<()> {
    let (mut t, coordinator, worker) = Traced::with_nodes().await?;
    let (mut stream, trace, _) = t.submit_sleep("one", 5, 5000).await?;
    read_final(&mut stream, EVENT_WAIT).await?;
    let spans = t
        .spans_of(&trace, "resources", |s| {
            // The worker's `process` span ends after its `execute_tool` (once the result
            // is published) and may come in a later export batch.
            s.iter()
                .any(|s| s.service == "toolfleet-worker" && s.kind == CONSUMER)
                && s.iter().any(|s| s.name == "join")
        })
        .await?;
    for s in &spans {
        let version = s.resource.get("service.version").map(String::as_str);
        assert_eq!(version, Some(env!("CARGO_PKG_VERSION")), "{}", s.name);
        assert_eq!(
            s.resource
                .get("deployment.environment.name")
                .map(String::as_str),
            Some("test")
        );
        let instance = s.resource.get("service.instance.id").map(String::as_str);
        let expected = if s.service == "toolfleet-worker" {
            "worker-a"
        } else {
            "coordinator-a"
        };
        assert_eq!(instance, Some(expected), "{}", s.name);
        for noise in ["code.file.path", "thread.id", "busy_ns", "idle_ns"] {
            assert!(s.attr(noise).is_none(), "{} carries {noise}", s.name);
        }
        assert_ne!(s.attr("toolfleet.session.id"), Some(""), "{}", s.name);
        for (key, ty) in &s.attribute_types {
            let numeric = key.ends_with("_ms")
                || key.starts_with("toolfleet.summary.")
                || key == "toolfleet.attempt"
                || key == "toolfleet.turn.calls"
                || key == "server.port";
            if numeric {
                assert_eq!(*ty, "int", "{key} on {}", s.name);
            }
        }
    }
    let process = spans
        .iter()
        .find(|s| s.service == "toolfleet-worker" && s.kind == CONSUMER)
        .ok_or_else(|| anyhow::anyhow!("no process span"))?;
    assert_eq!(
        process.attribute_types.get("toolfleet.attempt"),
        Some(&"int")
    );
    assert_eq!(process.links.len(), 1, "process links to the producer");
    let producer = spans
        .iter()
        .find(|s| s.span_id == process.links[0].1)
        .ok_or_else(|| anyhow::anyhow!("process links to no span"))?;
    assert_eq!(producer.kind, PRODUCER);
    assert_eq!(process.parent_span_id, the(&spans, "turn")?.span_id);
    let exec = spans
        .iter()
        .find(|s| s.name.starts_with("execute_tool"))
        .ok_or_else(|| anyhow::anyhow!("no execute_tool span"))?;
    assert!(exec.attr("gen_ai.tool.description").is_some());
    assert_eq!(
        exec.attr("toolfleet.tool.provider_name"),
        Some("test__behave")
    );
    let turn = the(&spans, "turn")?;
    assert_eq!(
        turn.attribute_types.get("toolfleet.turn.calls"),
        Some(&"int")
    );

    t.stop(&[worker, coordinator]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_timeout_is_not_the_turn_deadline_and_a_rejection_says_why() -> anyhow::Result<()> {
    let mut t = Traced::start().await?;
    let dir = tempfile::tempdir()?;
    let tenants = dir.path().join("tenants.json");
    let policy = json!({"default": {}, "tenants": {"acme": {"tool_timeout_ms": 200}}});
    std::fs::write(&tenants, policy.to_string())?;
    let tenants = tenants.to_string_lossy().to_string();
    let endpoint = t.receiver.endpoint();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("TOOLFLEET_TENANTS_FILE", tenants.as_str()),
    ];
    let coordinator = t.fleet.spawn_node("coordinator", &env)?;
    let worker = t.spawn("worker", "worker-a")?;
    t.fleet.wait_for_tools(&["test.behave"]).await?;

    // A call cut by its tool timeout (200 ms) well before the turn's deadline.
    let (mut stream, trace, _) = t.submit_sleep("cut", 2000, 5000).await?;
    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    assert!(!fin.deadline_hit);
    assert_eq!(fin.results[0].state, CallState::Timeout, "{fin:?}");
    let spans = t
        .spans_of(&trace, "tool-timeout", |s| {
            s.iter().any(|s| s.name == "join")
        })
        .await?;
    let join = the(&spans, "join")?;
    assert_eq!(join.attr("error.type"), Some("tool_timeout"));
    assert_eq!(join.status_code, STATUS_ERROR);
    // The turn failed too (Jaeger's `error=true` finds it), for the call's timeout,
    // not for the turn's deadline.
    let turn = the(&spans, "turn")?;
    assert_eq!(turn.attr("error.type"), Some("tool_timeout"));
    assert_eq!(turn.status_code, STATUS_ERROR);
    assert_eq!(turn.attr("toolfleet.turn.deadline_hit"), Some("false"));
    assert_eq!(turn.attr("toolfleet.turn.outcome"), Some("complete"));

    // One of two calls failed; every call refused: each turn is ERROR, naming the
    // worst call's code, and a turn whose calls all succeeded is not.
    let cases = [
        (
            "one-failed",
            vec![
                call("fine", "test.behave", json!({"sleep_ms": 1})),
                call("broken", "test.behave", json!({"fail": "boom"})),
            ],
            Some("boom"),
        ),
        (
            "all-refused",
            vec![
                call("nope_1", "crm.noSuchTool", json!({})),
                call("nope_2", "crm.noSuchTool", json!({})),
            ],
            Some("unknown_tool"),
        ),
        (
            "all-fine",
            vec![call("fine", "test.behave", json!({"sleep_ms": 1}))],
            None,
        ),
    ];
    for (label, calls, expected) in cases {
        let (mut stream, trace, _) = t.submit(timed_turn("acme", 5000, calls)).await?;
        read_final(&mut stream, EVENT_WAIT).await?;
        let spans = t
            .spans_of(&trace, label, |s| s.iter().any(|s| s.name == "join"))
            .await?;
        let turn = the(&spans, "turn")?;
        assert_eq!(turn.attr("error.type"), expected, "{label}");
        assert_eq!(
            turn.status_code == STATUS_ERROR,
            expected.is_some(),
            "{label}"
        );
        assert_eq!(turn.attr("toolfleet.tenant.id"), Some("acme"), "{label}");
    }

    // A decision that cannot be read: the turn span says why.
    let decision = json!({"type": "tool_calls", "calls": "not a list"});
    let (mut stream, trace, frontend) = t
        .submit(toolfleet_tests::fleet::turn("acme", decision))
        .await?;
    let events = toolfleet_tests::fleet::read_to_end(&mut stream, EVENT_WAIT).await?;
    assert!(matches!(
        events.last(),
        Some(toolfleet_common::TurnEvent::Error { .. })
    ));
    let spans = t.spans_of(&trace, "rejected", |_| true).await?;
    assert_no_missing_parent(&spans, &frontend);
    let turn = the(&spans, "turn")?;
    assert_eq!(turn.attr("error.type"), Some("invalid_decision"));
    assert_eq!(turn.status_code, STATUS_ERROR);
    assert!(!turn.status_message.is_empty());

    t.stop(&[worker, coordinator]).await?;
    Ok(())
}

/// The frontend's trace is not sampled (`traceparent` flags `00`), so the fleet's
/// parent-based sampler drops every turn of it: a turn whose calls all succeed exports
/// nothing, while a turn with a failed call and one with a call past its deadline are
/// exported whole by the coordinator that ended them and the worker that ran the
/// failing call, so the SRE still finds every failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampled_out_turn_is_exported_only_when_a_call_failed() -> anyhow::Result<()> {
    let (mut t, coordinator, worker) = Traced::with_nodes().await?;
    let turn_of = |calls: Vec<Value>, deadline_ms: u64| timed_turn("acme", deadline_ms, calls);
    let (mut clean, clean_trace, _) = t
        .submit_flagged(
            turn_of(
                vec![
                    call("ok_1", "test.behave", json!({"sleep_ms": 5})),
                    call("ok_2", "test.behave", json!({"sleep_ms": 5})),
                ],
                5000,
            ),
            false,
        )
        .await?;
    let fin = read_final(&mut clean, EVENT_WAIT).await?;
    assert_eq!(fin.summary.ok, 2, "{fin:?}");
    let (mut failing, failing_trace, frontend) = t
        .submit_flagged(
            turn_of(
                vec![
                    call("fine", "test.behave", json!({"sleep_ms": 5})),
                    call("broken", "test.behave", json!({"fail": "boom"})),
                ],
                5000,
            ),
            false,
        )
        .await?;
    let fin = read_final(&mut failing, EVENT_WAIT).await?;
    assert_eq!((fin.summary.ok, fin.summary.errors), (1, 1), "{fin:?}");
    let (mut slow, slow_trace, _) = t
        .submit_flagged(
            turn_of(
                vec![call("late", "test.behave", json!({"sleep_ms": 3000}))],
                800,
            ),
            false,
        )
        .await?;
    let fin = read_final(&mut slow, EVENT_WAIT).await?;
    assert_eq!(fin.summary.timeouts, 1, "{fin:?}");

    let spans = t
        .spans_of(&failing_trace, "sampled-out-failure", |s| {
            s.iter().any(|s| s.name == "join")
                && s.iter().any(|s| {
                    s.name.starts_with("execute_tool") && s.attr("error.type") == Some("boom")
                })
        })
        .await?;
    assert_no_missing_parent(&spans, &frontend);
    let join = the(&spans, "join")?;
    assert_eq!(join.attr("toolfleet.summary.errors"), Some("1"));
    the(&spans, "turn")?;
    let published = spans
        .iter()
        .filter(|s| s.name.starts_with("publish"))
        .count();
    assert_eq!(published, 2, "both calls' publish spans");
    let slow_spans = t
        .spans_of(&slow_trace, "sampled-out-timeout", |s| {
            s.iter().any(|s| s.name == "join")
        })
        .await?;
    assert_eq!(
        the(&slow_spans, "join")?.attr("error.type"),
        Some("deadline_exceeded")
    );
    // Both processes flush on a graceful stop: nothing of the clean turn comes.
    t.stop(&[coordinator, worker]).await?;
    let clean_spans: Vec<ReceivedSpan> = t
        .receiver
        .spans()
        .into_iter()
        .filter(|s| s.trace_id == clean_trace)
        .collect();
    assert!(
        clean_spans.is_empty(),
        "spans of a sampled-out turn without failures: {:?}",
        clean_spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    Ok(())
}

/// Waits (bounded) until every trace of `traces` holds exactly one `turn` span and no
/// span whose parent never arrived; prints each tree.
async fn whole_traces(
    t: &Traced,
    traces: &[(String, String, String)],
) -> anyhow::Result<HashMap<String, Vec<ReceivedSpan>>> {
    let mut out = HashMap::new();
    for (label, trace, frontend) in traces {
        let spans = t
            .spans_of(trace, label, |s| {
                s.iter().filter(|s| s.name == "turn").count() == 1
                    && missing_parent(s, frontend).is_none()
                    && s.iter().any(|s| s.name.starts_with("execute_tool"))
            })
            .await?;
        assert_no_missing_parent(&spans, frontend);
        let turns = spans.iter().filter(|s| s.name == "turn").count();
        assert_eq!(turns, 1, "{label}: {turns} turn spans");
        out.insert(label.clone(), spans);
    }
    Ok(out)
}

/// kill -9 of a coordinator on the default batch delay (5 s), three times: turns it
/// ended just before (a second before, and a tenth of a second before) and a turn in
/// flight. Each turn's trace holds one `turn` span and every span's parent: the killed
/// replica sent the `turn` span of the turns it ended when it ended them, and the turn
/// in flight is ended, and its span exported, by the next replica, which names the
/// killed one as the turn's owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_spans_survive_kill_9_on_the_default_batch_delay() -> anyhow::Result<()> {
    let mut t = Traced::start().await?;
    let worker = t.spawn_with("worker", "worker-a", &[])?;
    let mut coordinator = t.spawn_with("coordinator", "coordinator-0", &[])?;
    t.fleet.wait_for_tools(&["test.behave"]).await?;
    let mut traces = Vec::new();
    let mut in_flight = Vec::new();
    for round in 0..3 {
        let owner = format!("coordinator-{round}");
        let next = format!("coordinator-{}", round + 1);
        for (k, arguments) in [json!({"sleep_ms": 5}), json!({"fail": "boom"})]
            .into_iter()
            .enumerate()
        {
            let id = format!("ended_{round}_{k}");
            let request = timed_turn("acme", 10_000, vec![call(&id, "test.behave", arguments)]);
            let (mut stream, trace, frontend) = t.submit(request).await?;
            read_final(&mut stream, EVENT_WAIT).await?;
            traces.push((id, trace, frontend));
        }
        if round == 0 {
            // Killed a second after its last turn ended, nothing in flight.
            tokio::time::sleep(Duration::from_secs(1)).await;
            t.fleet.kill_node(coordinator).await?;
            coordinator = t.spawn_with("coordinator", &next, &[])?;
            continue;
        }
        // Killed with a turn in flight, a tenth of a second after two turns ended.
        let id = format!("flight_{round}");
        let (mut stream, trace, frontend) = t.submit_sleep(&id, 800, 10_000).await?;
        read_ack(&mut stream, EVENT_WAIT).await?;
        until_state(&mut stream, None, CallState::Running, EVENT_WAIT).await?;
        // A tenth of a second for the export thread, which a loaded machine may not run
        // within milliseconds: still fifty times shorter than the batch delay.
        tokio::time::sleep(Duration::from_millis(100)).await;
        t.fleet.kill_node(coordinator).await?;
        coordinator = t.spawn_with("coordinator", &next, &[])?;
        let fin = read_final(&mut stream, EVENT_WAIT).await?;
        assert_eq!(fin.results[0].state, CallState::Done, "{fin:?}");
        traces.push((id.clone(), trace, frontend));
        in_flight.push((id, owner, next));
    }
    // The survivors flush their batches on the way out.
    t.stop(&[worker, coordinator]).await?;

    let spans = whole_traces(&t, &traces).await?;
    for (label, of_turn) in &spans {
        let turn = the(of_turn, "turn")?;
        assert!(turn.attr("toolfleet.turn.id").is_some(), "{label}");
        let failed = label.starts_with("ended_") && label.ends_with("_1");
        assert_eq!(turn.status_code == STATUS_ERROR, failed, "{label}");
        if failed {
            assert_eq!(turn.attr("error.type"), Some("boom"), "{label}");
        }
    }
    for (id, owner, next) in &in_flight {
        let turn = the(&spans[id], "turn")?;
        let instance = turn.resource.get("service.instance.id").map(String::as_str);
        assert_eq!(instance, Some(next.as_str()), "{id}");
        assert_eq!(
            turn.attr("toolfleet.turn.owner"),
            Some(owner.as_str()),
            "{id}"
        );
        assert_eq!(turn.attr("toolfleet.turn.ended_by"), Some("result"), "{id}");
    }
    Ok(())
}

/// A coordinator that dies between storing a turn's `final` and sending it: the next
/// replica sends the stored `final` (its sweeper, or the client's attach, whichever
/// comes first) and exports the turn's one `turn` span, marked as taken over, with an
/// event naming the replica that stored it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_stored_by_a_replica_that_died_gets_one_turn_span() -> anyhow::Result<()> {
    let mut t = Traced::start().await?;
    let worker = t.spawn_with("worker", "worker-a", &[])?;
    let fault = [("TOOLFLEET_FAULT", "exit_after_final_stored")];
    let _dying = t.spawn_with("coordinator", "coordinator-a", &fault)?;
    t.fleet.wait_for_tools(&["test.behave"]).await?;
    let (mut stream, trace, frontend) = t.submit_sleep("stored", 5, 2000).await?;
    read_ack(&mut stream, EVENT_WAIT).await?;
    // coordinator-a exits once the final is stored; coordinator-b takes over.
    let survivor = t.spawn_with("coordinator", "coordinator-b", &[])?;
    let fin = read_final(&mut stream, EVENT_WAIT).await?;
    assert_eq!(fin.results[0].state, CallState::Done, "{fin:?}");
    t.stop(&[worker, survivor]).await?;

    let traces = [("stored-final".to_string(), trace, frontend)];
    let spans = whole_traces(&t, &traces).await?;
    let turn = the(&spans["stored-final"], "turn")?;
    let instance = turn.resource.get("service.instance.id").map(String::as_str);
    assert_eq!(instance, Some("coordinator-b"));
    assert_eq!(turn.attr("toolfleet.turn.owner"), Some("coordinator-a"));
    assert_eq!(turn.attr("toolfleet.turn.taken_over"), Some("true"));
    let by = turn.attr("toolfleet.turn.ended_by");
    assert!(matches!(by, Some("resend" | "replay")), "{by:?}");
    assert_eq!(turn.attr("toolfleet.summary.ok"), Some("1"));
    let event = turn
        .events
        .iter()
        .find(|(name, _)| name == "toolfleet.turn.taken_over")
        .ok_or_else(|| anyhow::anyhow!("no taken_over event"))?;
    assert_eq!(
        event.1.get("toolfleet.turn.owner").map(String::as_str),
        Some("coordinator-a")
    );
    Ok(())
}
