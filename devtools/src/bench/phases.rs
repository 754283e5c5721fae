//! The measurements: the floor of the servers, a turn's overhead at concurrency 1,
//! throughput under concurrent turns, parallel speedup, worker scaling, and the
//! coordinator's memory with many turns in flight.
//!
//! Owns the turns each phase submits and the figures it computes from them. It must
//! never start or stop fleets or servers (it is handed a client or a running fleet) and
//! never format the report.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use async_nats::jetstream;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Map, Value};
use tokio::task::JoinSet;
use toolfleet_common::{CallState, FleetClient, Names, TurnEvent, TurnRequest};

use super::fleet::{floor_stream, Env, Fleet};
use super::progress::Progress;
use super::skeleton::{self, Skeleton};
use super::stats::{self, Latencies, Rss, Summary};

/// Tenant of every bench turn.
const TENANT: &str = "bench";
/// Longest wait for any one event of a turn.
const EVENT_WAIT: Duration = Duration::from_secs(20);

/// `turns` rounds at concurrency 1, a tenth more first as warm-up (not measured), for
/// at most `cap`: each round tries the `N` ways in turn, way `k` with `attempt(k)`.
/// Returns each way's latencies and how many attempts failed. The first failure is
/// noted (`an <phase>-phase <unit> failed`); a way that never succeeded fails the phase.
pub async fn interleaved<const N: usize, F, Fut>(
    turns: usize,
    cap: Duration,
    (phase, unit): (&str, &str),
    progress: &Progress,
    mut attempt: F,
) -> Result<([Summary; N], usize)>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let mut lat: [Latencies; N] = std::array::from_fn(|_| Latencies::default());
    let mut failed = 0;
    let started = Instant::now();
    for i in 0..turns + turns / 10 {
        if started.elapsed() > cap {
            break;
        }
        for (k, way) in lat.iter_mut().enumerate() {
            // Whatever `attempt` prepares before its future runs stays off the clock.
            let pending = attempt(k);
            let t = Instant::now();
            match pending.await {
                Ok(()) if i >= turns / 10 => way.push(t.elapsed()),
                Ok(()) => {}
                Err(error) => {
                    failed += 1;
                    if failed == 1 {
                        progress.note(format_args!("  an {phase}-phase {unit} failed: {error:#}"));
                    }
                }
            }
        }
    }
    if lat.iter().any(|l| l.len() == 0) {
        bail!("no {unit} completed one of the ways");
    }
    Ok((lat.map(|l| l.summary()), failed))
}

/// A decision of `calls` calls of `tool` with `arguments`, in the simple form.
pub fn decision(tool: &str, arguments: &Value, calls: usize) -> Value {
    let calls: Vec<Value> = (0..calls)
        .map(|i| json!({"id": format!("call_{i}"), "toolName": tool, "arguments": arguments}))
        .collect();
    json!({"type": "tool_calls", "calls": calls})
}

fn request(decision: &Value, deadline_ms: u64) -> TurnRequest {
    TurnRequest {
        turn_id: None,
        tenant_id: TENANT.into(),
        session_id: None,
        user_message: None,
        decision: decision.clone(),
        deadline_ms: Some(deadline_ms),
        options: Default::default(),
        context: Map::new(),
    }
}

/// When a turn's events arrived, counted from just before it was submitted.
#[derive(Debug, Clone, Copy)]
struct Timing {
    ack: Duration,
    first_running: Duration,
    first_done: Duration,
    last_done: Duration,
    fin: Duration,
    ended: Instant,
    /// The longest call's own duration as its worker measured it.
    slowest_call: Duration,
}

/// Submits one turn and reads its events to `final`; an `error` event, a result that
/// is not `ok`, or a missed deadline is a failure.
async fn timed_turn(client: &FleetClient, request: TurnRequest) -> Result<Timing> {
    let start = Instant::now();
    let mut stream = client.submit(request).await?;
    let mut ack = None;
    let mut first_running = None;
    let mut first_done = None;
    let mut last_done = None;
    loop {
        match stream.next_event(EVENT_WAIT).await? {
            TurnEvent::Ack { .. } => ack = Some(start.elapsed()),
            TurnEvent::ToolState {
                state: CallState::Running,
                ..
            } => {
                first_running.get_or_insert(start.elapsed());
            }
            TurnEvent::ToolState { state, .. } if state.is_terminal() => {
                let now = start.elapsed();
                first_done.get_or_insert(now);
                last_done = Some(now);
            }
            TurnEvent::Final(fin) => {
                let elapsed = start.elapsed();
                if fin.deadline_hit || fin.summary.ok != fin.summary.total {
                    bail!(
                        "turn ended with {} of {} calls ok (deadline hit: {})",
                        fin.summary.ok,
                        fin.summary.total,
                        fin.deadline_hit
                    );
                }
                return Ok(Timing {
                    ack: ack.unwrap_or(elapsed),
                    // A call that ends within the worker's `running` delay has no
                    // `running`: the dispatch stage ends with the first call state
                    // after `pending`, whichever it is.
                    first_running: first_running
                        .into_iter()
                        .chain(first_done)
                        .min()
                        .unwrap_or(elapsed),
                    first_done: first_done.unwrap_or(elapsed),
                    last_done: last_done.unwrap_or(elapsed),
                    fin: elapsed,
                    slowest_call: Duration::from_millis(
                        fin.results.iter().map(|r| r.duration_ms).max().unwrap_or(0),
                    ),
                    ended: Instant::now(),
                });
            }
            TurnEvent::Error { error, .. } => {
                bail!("turn failed: {}: {}", error.code, error.message)
            }
            _ => {}
        }
    }
}

/// Runs `warmup` then `turns` turns of `decision` one after another, stopping early
/// once `cap` (when given) has passed and one turn after the warm-up has run, and
/// hands each measured turn's timing to
/// `record`. Returns how many turns failed; the first failure is noted on `progress`.
async fn one_after_another(
    client: &FleetClient,
    decision: &Value,
    warmup: usize,
    turns: usize,
    cap: Option<Duration>,
    progress: &Progress,
    mut record: impl FnMut(Timing),
) -> usize {
    let started = Instant::now();
    let mut failed = 0;
    for i in 0..warmup + turns {
        // The cap bounds the phase, but not before one turn past the warm-up: a slow
        // fleet (a debug build under callgrind) still gives a figure.
        if i > warmup && cap.is_some_and(|cap| started.elapsed() > cap) {
            break;
        }
        match timed_turn(client, request(decision, 5_000)).await {
            Ok(t) if i >= warmup => record(t),
            Ok(_) => {}
            Err(error) => {
                failed += 1;
                if failed == 1 {
                    progress.note(format_args!("  a turn failed: {error:#}"));
                }
            }
        }
    }
    failed
}

/// Round trips to the servers with nothing of toolfleet in between.
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    /// Core NATS request to a responder on another connection and its reply.
    pub nats_request_reply: Summary,
    /// Redis `PING`.
    pub redis_ping: Summary,
    /// JetStream publish to a file-backed stream, until its ack.
    pub jetstream_publish: Summary,
    /// NATS request-reply p50 + Redis p50: the least any coordinator on these servers
    /// can add to a turn.
    pub floor_p50_ms: f64,
    /// A turn of three calls through the bare hops a durable turn crosses, with nothing
    /// of toolfleet between them (`skeleton.rs`); `None` when it could not be measured.
    pub skeleton: Option<Skeleton>,
}

/// Measures the floor with `samples` round trips of each kind, after a warm-up.
/// The bare durable turn's roles run on `threads` runtime threads each, as the fleets'
/// processes do (`None`: one per CPU).
pub async fn floor(
    env: &Env,
    prefix: &str,
    samples: usize,
    threads: Option<usize>,
) -> Result<Floor> {
    let warmup = (samples / 10).max(10);
    let nats_request_reply = nats_round_trips(env, prefix, warmup, samples).await?;
    let redis_ping = redis_round_trips(env, warmup, samples).await?;
    let jetstream_publish = jetstream_publishes(env, prefix, warmup, samples).await?;
    // Without it the floor still stands: an attached fleet's servers may refuse the
    // bench the streams it needs.
    let skeleton = match skeleton::measure(env, prefix, warmup, samples, threads).await {
        Ok(skeleton) => Some(skeleton),
        Err(error) => {
            env.progress.note(format_args!(
                "  the bare durable turn was not measured: {error:#}"
            ));
            None
        }
    };
    Ok(Floor {
        floor_p50_ms: stats::round3(nats_request_reply.p50_ms + redis_ping.p50_ms),
        nats_request_reply,
        redis_ping,
        jetstream_publish,
        skeleton,
    })
}

/// Core NATS requests to an echo responder on a second connection, and their replies.
async fn nats_round_trips(
    env: &Env,
    prefix: &str,
    warmup: usize,
    samples: usize,
) -> Result<Summary> {
    let responder = async_nats::ConnectOptions::new()
        .name("toolfleet-bench-echo")
        .connect(toolfleet_common::config::NatsUrls(&env.nats_url))
        .await?;
    let subject = format!("{prefix}.floor.echo");
    let mut echo = responder.subscribe(subject.clone()).await?;
    responder.flush().await?;
    let echo_task = {
        let responder = responder.clone();
        tokio::spawn(async move {
            while let Some(message) = echo.next().await {
                if let Some(reply) = message.reply {
                    let _ = responder.publish(reply, message.payload).await;
                }
            }
        })
    };
    // The echo's subscription reaches the server over its own connection: wait until a
    // request finds it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while env
        .nats
        .request(subject.clone(), "ping".into())
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("the echo responder did not answer within 5 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut rtt = Latencies::default();
    for i in 0..warmup + samples {
        let start = Instant::now();
        tokio::time::timeout(
            Duration::from_secs(5),
            env.nats.request(subject.clone(), "ping".into()),
        )
        .await
        .context("no echo within 5 s")??;
        if i >= warmup {
            rtt.push(start.elapsed());
        }
    }
    echo_task.abort();
    Ok(rtt.summary())
}

/// Redis `PING`s.
async fn redis_round_trips(env: &Env, warmup: usize, samples: usize) -> Result<Summary> {
    let mut redis = env.redis.clone();
    let mut rtt = Latencies::default();
    for i in 0..warmup + samples {
        let start = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut redis).await?;
        if i >= warmup {
            rtt.push(start.elapsed());
        }
    }
    Ok(rtt.summary())
}

/// JetStream publishes of 256 bytes to a file-backed stream, each until its ack.
async fn jetstream_publishes(
    env: &Env,
    prefix: &str,
    warmup: usize,
    samples: usize,
) -> Result<Summary> {
    let js = jetstream::new(env.nats.clone());
    let stream_name = floor_stream(&Names::new(prefix));
    let floor_subject = format!("{prefix}.floor.js");
    js.get_or_create_stream(jetstream::stream::Config {
        name: stream_name.clone(),
        subjects: vec![floor_subject.clone()],
        storage: jetstream::stream::StorageType::File,
        retention: jetstream::stream::RetentionPolicy::Limits,
        max_messages: 10_000,
        ..Default::default()
    })
    .await?;
    let mut rtt = Latencies::default();
    for i in 0..warmup + samples {
        let start = Instant::now();
        js.publish(floor_subject.clone(), "x".repeat(256).into())
            .await?
            .await?;
        if i >= warmup {
            rtt.push(start.elapsed());
        }
    }
    let _ = js.delete_stream(&stream_name).await;
    Ok(rtt.summary())
}

/// A turn of three no-op calls at concurrency 1.
#[derive(Debug, Clone, Serialize)]
pub struct Overhead {
    /// Calls per turn.
    pub calls_per_turn: usize,
    /// Turns that failed.
    pub failed: usize,
    /// Submit → `final`.
    pub turn: Summary,
    /// Submit → `ack`.
    pub ack: Summary,
    /// Submit → the first `running` state (the first terminal state of a turn whose calls
    /// all ended before their worker's `running` delay).
    pub first_running: Summary,
    /// Submit → the first terminal state of a call.
    pub first_done: Summary,
    /// Submit → the last terminal state of a call.
    pub last_done: Summary,
    /// `turn.p50_ms` over the floor's p50; `None` without a floor phase.
    pub floor_multiple_p50: Option<f64>,
    /// `turn.p50_ms` less the bare durable turn's p50: what toolfleet adds to the hops
    /// a turn must cross; `None` without a floor phase.
    pub over_skeleton_p50_ms: Option<f64>,
    /// Where the slowest turns lose their time, stage by stage.
    pub tail: Tail,
    /// Context switches per measured turn of each kind of process watched (summed over
    /// the processes of one kind): how often a turn puts a thread to sleep and wakes
    /// one, which a clock on a shared host cannot tell apart from the work.
    pub context_switches_per_turn: BTreeMap<String, f64>,
}

/// The stages of a turn (submit → `ack`, `ack` → first `running`, → first terminal
/// state, → last terminal state, → `final`), mean ms over the turns at or below the
/// median and over the slowest 1 % (at or above p99): which stage the tail comes from.
#[derive(Debug, Clone, Serialize)]
pub struct Tail {
    /// The stages' names, in order.
    pub stages: [&'static str; 5],
    /// Mean ms of each stage over the turns at or below the median.
    pub typical_ms: [f64; 5],
    /// Mean ms of each stage over the turns at or above p99.
    pub slowest_ms: [f64; 5],
    /// How many turns each mean is over.
    pub turns: [usize; 2],
}

impl Tail {
    const STAGES: [&'static str; 5] = [
        "ack",
        "first running or done",
        "first done",
        "last done",
        "final",
    ];

    /// From each turn's event times since submit: ack, first running, first done, last
    /// done, final.
    fn from_turns(turns: &[[Duration; 5]]) -> Self {
        let mut by_final: Vec<&[Duration; 5]> = turns.iter().collect();
        by_final.sort_unstable_by_key(|t| t[4]);
        let n = by_final.len();
        let median = n.div_ceil(2);
        let p99 = (n * 99)
            .div_ceil(100)
            .saturating_sub(1)
            .min(n.saturating_sub(1));
        let mean = |group: &[&[Duration; 5]]| -> [f64; 5] {
            let mut out = [0.0; 5];
            for (i, slot) in out.iter_mut().enumerate() {
                let total: f64 = group
                    .iter()
                    .map(|t| {
                        let before = if i == 0 { Duration::ZERO } else { t[i - 1] };
                        t[i].saturating_sub(before).as_secs_f64() * 1000.0
                    })
                    .sum();
                *slot = stats::round3(total / group.len().max(1) as f64);
            }
            out
        };
        let typical = &by_final[..median];
        let slowest = &by_final[p99.min(n)..];
        Self {
            stages: Self::STAGES,
            typical_ms: mean(typical),
            slowest_ms: mean(slowest),
            turns: [typical.len(), slowest.len()],
        }
    }
}

/// Runs `warmup` then up to `turns` turns one after another, for at most `cap`.
pub async fn overhead(
    client: &FleetClient,
    warmup: usize,
    turns: usize,
    cap: Duration,
    floor: Option<&Floor>,
    probe: &Probe,
    progress: &Progress,
) -> Result<Overhead> {
    let decision = decision("test.noop", &json!({}), 3);
    let mut fin = Latencies::default();
    let mut ack = Latencies::default();
    let mut first_running = Latencies::default();
    let mut first_done = Latencies::default();
    let mut last_done = Latencies::default();
    let mut events = Vec::with_capacity(turns);
    let warm_failed = one_after_another(client, &decision, warmup, 0, None, progress, |_| {}).await;
    let before = switches_by_kind(probe);
    let failed = one_after_another(client, &decision, 0, turns, Some(cap), progress, |t| {
        events.push([t.ack, t.first_running, t.first_done, t.last_done, t.fin]);
        fin.push(t.fin);
        ack.push(t.ack);
        first_running.push(t.first_running);
        first_done.push(t.first_done);
        last_done.push(t.last_done);
    })
    .await;
    let after = switches_by_kind(probe);
    if fin.len() == 0 {
        bail!("no turn completed");
    }
    let per_turn = (fin.len() + failed) as f64;
    let context_switches_per_turn = after
        .into_iter()
        .filter_map(|(kind, n)| {
            let used = n.checked_sub(*before.get(&kind)?)?;
            Some((kind, stats::round3(used as f64 / per_turn)))
        })
        .collect();
    let turn = fin.summary();
    Ok(Overhead {
        calls_per_turn: 3,
        failed: warm_failed + failed,
        floor_multiple_p50: floor
            .filter(|f| f.floor_p50_ms > 0.0)
            .map(|f| stats::round3(turn.p50_ms / f.floor_p50_ms)),
        over_skeleton_p50_ms: floor
            .and_then(|f| f.skeleton.as_ref())
            .map(|s| stats::round3(turn.p50_ms - s.turn.p50_ms)),
        turn,
        ack: ack.summary(),
        first_running: first_running.summary(),
        first_done: first_done.summary(),
        last_done: last_done.summary(),
        tail: Tail::from_turns(&events),
        context_switches_per_turn,
    })
}

/// Turns run by a closed loop of concurrent submitters.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// Turns in flight at any time.
    pub concurrency: usize,
    /// Calls per turn.
    pub calls_per_turn: usize,
    /// Length of the measured window (after the warm-up), seconds.
    pub seconds: f64,
    /// Turns that ended inside the window.
    pub turns: usize,
    /// Turns that failed inside the window.
    pub failed: usize,
    /// `turns / seconds`.
    pub turns_per_s: f64,
    /// `turns * calls_per_turn / seconds`.
    pub calls_per_s: f64,
    /// Submit → `final` of the turns that ended inside the window.
    pub turn: Summary,
    /// CPU time per turn of each process (summed over processes of one kind) inside
    /// the window, ms.
    pub cpu_ms_per_turn: BTreeMap<String, f64>,
    /// CPUs busy on average inside the window, over every process watched.
    pub cpus_busy: f64,
    /// Peak resident memory (`VmHWM`) of each kind of process at the end of the run,
    /// the largest of a kind's processes, MiB.
    pub peak_rss_mib: BTreeMap<String, f64>,
}

/// Processes whose CPU time is watched, by kind.
pub type Probe = Vec<(String, u32)>;

fn cpu_by_kind(probe: &Probe) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (kind, pid) in probe {
        if let Some(s) = stats::cpu_seconds(*pid) {
            *out.entry(kind.clone()).or_insert(0.0) += s;
        }
    }
    out
}

fn switches_by_kind(probe: &Probe) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (kind, pid) in probe {
        if let Some(n) = stats::context_switches(*pid) {
            *out.entry(kind.clone()).or_insert(0) += n;
        }
    }
    out
}

fn peak_rss_by_kind(probe: &Probe) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (kind, pid) in probe {
        if let Some(r) = stats::rss(*pid) {
            let peak = out.entry(kind.clone()).or_insert(0.0_f64);
            *peak = peak.max(r.hwm_mib);
        }
    }
    out
}

/// Keeps `concurrency` turns of `decision` in flight for `warmup + window`, counts the
/// turns that end inside the window and the CPU time the `probe` processes use in it;
/// the first failure is noted on `progress`.
#[allow(clippy::too_many_arguments)]
pub async fn closed_loop(
    client: &FleetClient,
    decision: &Value,
    calls_per_turn: usize,
    concurrency: usize,
    warmup: Duration,
    window: Duration,
    deadline_ms: u64,
    probe: &Probe,
    progress: &Progress,
) -> Result<Throughput> {
    let start = Instant::now();
    let from = start + warmup;
    let to = from + window;
    let sampler = {
        let probe = probe.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(from.into()).await;
            let before = cpu_by_kind(&probe);
            tokio::time::sleep_until(to.into()).await;
            let after = cpu_by_kind(&probe);
            after
                .into_iter()
                .map(|(kind, s)| {
                    let used = s - before.get(&kind).copied().unwrap_or(s);
                    (kind, used)
                })
                .collect::<BTreeMap<String, f64>>()
        })
    };
    let mut set = JoinSet::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let decision = decision.clone();
        set.spawn(async move {
            let mut latencies = Latencies::default();
            let mut failed = 0usize;
            let mut first_error = None;
            while Instant::now() < to {
                match timed_turn(&client, request(&decision, deadline_ms)).await {
                    Ok(t) if t.ended >= from && t.ended <= to => latencies.push(t.fin),
                    Ok(_) => {}
                    Err(error) => {
                        let now = Instant::now();
                        if now >= from && now <= to {
                            failed += 1;
                        }
                        first_error.get_or_insert_with(|| format!("{error:#}"));
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            (latencies, failed, first_error)
        });
    }
    let mut all = Latencies::default();
    let mut failed = 0;
    let mut first_error = None;
    while let Some(joined) = set.join_next().await {
        let (latencies, f, e) = joined?;
        all.extend(latencies);
        failed += f;
        if first_error.is_none() {
            first_error = e;
        }
    }
    if let Some(error) = first_error {
        progress.note(format_args!(
            "  turns failed ({failed} in the window); the first: {error}"
        ));
    }
    let cpu = sampler.await?;
    let seconds = window.as_secs_f64();
    let turns = all.len();
    let cpus_busy = stats::round3(cpu.values().sum::<f64>() / seconds);
    let cpu_ms_per_turn = cpu
        .into_iter()
        .map(|(kind, s)| (kind, stats::round3(s * 1000.0 / turns.max(1) as f64)))
        .collect();
    Ok(Throughput {
        concurrency,
        calls_per_turn,
        seconds: stats::round3(seconds),
        turns,
        failed,
        turns_per_s: stats::round3(turns as f64 / seconds),
        calls_per_s: stats::round3((turns * calls_per_turn) as f64 / seconds),
        turn: all.summary(),
        cpu_ms_per_turn,
        cpus_busy,
        peak_rss_mib: peak_rss_by_kind(probe),
    })
}

/// Three calls of 50 ms each in one turn.
#[derive(Debug, Clone, Serialize)]
pub struct Parallel {
    /// Calls per turn.
    pub calls: usize,
    /// Each call's sleep, ms.
    pub sleep_ms: u64,
    /// What a runner calling them one after another would need, ms.
    pub sequential_ms: u64,
    /// Turns that failed.
    pub failed: usize,
    /// Submit → `final`.
    pub turn: Summary,
    /// The slowest call's duration as its worker measured it (whole milliseconds).
    pub slowest_call: Summary,
    /// Submit → `final` of three no-op calls, each turn after the fleet idled as long
    /// as the calls sleep: the overhead of a fleet whose processes were asleep.
    pub idle_noop_turn: Summary,
    /// `sequential_ms / turn.p50_ms`.
    pub speedup_p50: f64,
}

/// Runs `turns` turns of three 50 ms calls one after another (after a short warm-up).
pub async fn parallel(client: &FleetClient, turns: usize, progress: &Progress) -> Result<Parallel> {
    const SLEEP_MS: u64 = 50;
    const CALLS: usize = 3;
    let decision = decision("test.behave", &json!({"sleep_ms": SLEEP_MS}), CALLS);
    let mut latencies = Latencies::default();
    let mut slowest = Latencies::default();
    let mut failed = one_after_another(client, &decision, 5, turns, None, progress, |t| {
        latencies.push(t.fin);
        slowest.push(t.slowest_call);
    })
    .await;
    let noop = self::decision("test.noop", &json!({}), CALLS);
    let mut idle_noop = Latencies::default();
    for _ in 0..turns {
        tokio::time::sleep(Duration::from_millis(SLEEP_MS)).await;
        match timed_turn(client, request(&noop, 5_000)).await {
            Ok(t) => idle_noop.push(t.fin),
            Err(_) => failed += 1,
        }
    }
    let turn = latencies.summary();
    let sequential_ms = SLEEP_MS * CALLS as u64;
    Ok(Parallel {
        calls: CALLS,
        sleep_ms: SLEEP_MS,
        sequential_ms,
        failed,
        speedup_p50: if turn.p50_ms > 0.0 {
            stats::round3(sequential_ms as f64 / turn.p50_ms)
        } else {
            0.0
        },
        turn,
        slowest_call: slowest.summary(),
        idle_noop_turn: idle_noop.summary(),
    })
}

/// Cancelling turns whose one call runs for two seconds.
#[derive(Debug, Clone, Serialize)]
pub struct Cancel {
    /// Turns measured.
    pub turns: usize,
    /// Turns whose cancel did not end them with a `cancelled` call.
    pub failed: usize,
    /// From sending the cancel to the cancelled turn's `final` at the client.
    pub cancel_to_final: Summary,
    /// From sending the cancel to its answer.
    pub cancel_answered: Summary,
}

/// The call every cancelled turn runs: long enough that only the cancel ends it.
const CANCELLED_SLEEP_MS: u64 = 2_000;

/// Runs `turns` turns of one 2 s call one after another, each cancelled as soon as its
/// call runs (its `running` event, or 100 ms after `ack`).
pub async fn cancel(client: &FleetClient, turns: usize, progress: &Progress) -> Result<Cancel> {
    let decision = decision("test.behave", &json!({"sleep_ms": CANCELLED_SLEEP_MS}), 1);
    let (mut to_final, mut answered) = (Latencies::default(), Latencies::default());
    let mut failed = 0;
    for _ in 0..turns {
        match cancel_one(client, &decision).await {
            Ok((fin, answer)) => {
                to_final.push(fin);
                answered.push(answer);
            }
            Err(error) => {
                failed += 1;
                progress.note(format!("  cancel failed: {error:#}"));
            }
        }
    }
    Ok(Cancel {
        turns,
        failed,
        cancel_to_final: to_final.summary(),
        cancel_answered: answered.summary(),
    })
}

/// One cancelled turn: (cancel → `final`, cancel → answer).
async fn cancel_one(client: &FleetClient, decision: &Value) -> Result<(Duration, Duration)> {
    const WAIT: Duration = Duration::from_secs(5);
    let mut stream = client.submit(request(decision, 10_000)).await?;
    let turn_id = stream.turn_id().to_string();
    let ack = stream.next_event(WAIT).await?;
    if !matches!(ack, TurnEvent::Ack { .. }) {
        bail!("expected ack, got {}", ack.kind());
    }
    let until = Instant::now() + Duration::from_millis(100);
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        match stream.next_event(left).await {
            Ok(TurnEvent::ToolState {
                state: CallState::Running,
                ..
            }) => break,
            Ok(TurnEvent::Final(_) | TurnEvent::Error { .. }) => bail!("ended before the cancel"),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let sent = Instant::now();
    let answering = {
        let client = client.clone();
        let turn_id = turn_id.clone();
        tokio::spawn(async move {
            let reply = client.cancel(&turn_id, None, WAIT).await;
            (reply, sent.elapsed())
        })
    };
    let fin = loop {
        match stream.next_event(WAIT).await? {
            TurnEvent::Final(fin) => break fin,
            TurnEvent::Error { error, .. } => bail!("turn error {}", error.code),
            _ => {}
        }
    };
    let to_final = sent.elapsed();
    let (reply, to_answer) = answering.await?;
    let reply = reply?;
    if fin.results.first().map(|r| r.state) != Some(CallState::Cancelled) {
        bail!("the call was not cancelled ({:?})", reply.outcome);
    }
    Ok((to_final, to_answer))
}

/// Throughput of a sleeping tool with a given number of worker processes.
#[derive(Debug, Clone, Serialize)]
pub struct ScalingPoint {
    /// Worker processes.
    pub workers: usize,
    /// Calls each worker runs at once.
    pub concurrency_per_worker: usize,
    /// The tool's sleep, ms.
    pub sleep_ms: u64,
    /// `workers * concurrency_per_worker * 1000 / sleep_ms`.
    pub ideal_calls_per_s: f64,
    /// `calls_per_s / ideal_calls_per_s`.
    pub efficiency: f64,
    /// The closed loop's figures.
    #[serde(flatten)]
    pub run: Throughput,
}

/// Saturates `workers` workers of `concurrency` slots each with 20 ms calls.
pub async fn scaling_point(
    client: &FleetClient,
    workers: usize,
    concurrency: usize,
    warmup: Duration,
    window: Duration,
    probe: &Probe,
    progress: &Progress,
) -> Result<ScalingPoint> {
    const SLEEP_MS: u64 = 20;
    const CALLS: usize = 3;
    let slots = workers * concurrency;
    // Twice as many calls in flight as there are slots keeps every slot busy.
    let turns_in_flight = (2 * slots).div_ceil(CALLS).max(1);
    let decision = decision("test.behave", &json!({"sleep_ms": SLEEP_MS}), CALLS);
    let run = closed_loop(
        client,
        &decision,
        CALLS,
        turns_in_flight,
        warmup,
        window,
        30_000,
        probe,
        progress,
    )
    .await?;
    let ideal = slots as f64 * 1000.0 / SLEEP_MS as f64;
    Ok(ScalingPoint {
        workers,
        concurrency_per_worker: concurrency,
        sleep_ms: SLEEP_MS,
        ideal_calls_per_s: ideal,
        efficiency: stats::round3(run.calls_per_s / ideal),
        run,
    })
}

/// The coordinator's memory with many turns in flight.
#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    /// Turns submitted at once.
    pub turns: usize,
    /// Calls per turn.
    pub calls_per_turn: usize,
    /// Each call's sleep, ms.
    pub sleep_ms: u64,
    /// Coordinator memory before the turns were submitted.
    pub idle: Rss,
    /// Largest `VmRSS` sampled while every turn had been acknowledged and none had
    /// ended, MiB.
    pub in_flight_rss_mib: f64,
    /// Samples taken in that interval.
    pub samples: usize,
    /// Coordinator memory after every turn ended (its `hwm_mib` is the peak over the
    /// whole phase).
    pub after: Rss,
    /// Seconds from the first submit to the last `ack`.
    pub submit_seconds: f64,
    /// Turns that failed.
    pub failed: usize,
}

/// Submits `turns` turns of three calls sleeping `sleep_ms` and samples the
/// coordinator's resident memory while they are all in flight.
pub async fn memory(fleet: &Fleet, turns: usize, sleep_ms: u64) -> Result<Memory> {
    const CALLS: usize = 3;
    let pid = fleet.coordinator.pid;
    let idle = stats::rss(pid).context("reading the coordinator's memory")?;
    let decision = decision("test.behave", &json!({"sleep_ms": sleep_ms}), CALLS);
    let acked = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut set = JoinSet::new();
    for _ in 0..turns {
        let stream = fleet
            .client
            .submit(request(&decision, sleep_ms + 30_000))
            .await?;
        let acked = Arc::clone(&acked);
        let ended = Arc::clone(&ended);
        set.spawn(async move {
            let mut stream = stream;
            let outcome = loop {
                match stream
                    .next_event(EVENT_WAIT + Duration::from_millis(sleep_ms))
                    .await
                {
                    Ok(TurnEvent::Ack { .. }) => {
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(TurnEvent::Final(fin)) => {
                        break fin.summary.ok == fin.summary.total && !fin.deadline_hit
                    }
                    Ok(TurnEvent::Error { .. }) | Err(_) => break false,
                    Ok(_) => {}
                }
            };
            ended.fetch_add(1, Ordering::Relaxed);
            outcome
        });
    }
    let all_acked = tokio::time::timeout(Duration::from_secs(60), async {
        while acked.load(Ordering::Relaxed) < turns {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .is_ok();
    let submit_seconds = stats::round3(start.elapsed().as_secs_f64());
    let mut samples = 0;
    let mut in_flight = 0.0f64;
    if all_acked {
        while ended.load(Ordering::Relaxed) == 0 {
            if let Some(r) = stats::rss(pid) {
                in_flight = in_flight.max(r.rss_mib);
                samples += 1;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut failed = 0;
    while let Some(joined) = set.join_next().await {
        if !joined.unwrap_or(false) {
            failed += 1;
        }
    }
    if samples == 0 {
        bail!(
            "the {turns} turns were not all in flight at once (acknowledged in {submit_seconds} s; calls sleep {sleep_ms} ms)"
        );
    }
    let after = stats::rss(pid).context("reading the coordinator's memory")?;
    Ok(Memory {
        turns,
        calls_per_turn: CALLS,
        sleep_ms,
        idle,
        in_flight_rss_mib: in_flight,
        samples,
        after,
        submit_seconds,
        failed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_is_split_into_stages() {
        let ms = Duration::from_millis;
        // 99 turns of 1 ms per stage, one turn whose dispatch (ack → running) took 20 ms.
        let mut turns = vec![[ms(1), ms(2), ms(3), ms(4), ms(5)]; 99];
        turns.push([ms(1), ms(21), ms(22), ms(23), ms(24)]);
        let tail = Tail::from_turns(&turns);
        // At or above p99 of 100 turns: the 99th (nearest rank) and the 100th.
        assert_eq!(tail.turns, [50, 2]);
        assert_eq!(tail.typical_ms, [1.0; 5]);
        assert_eq!(tail.slowest_ms, [1.0, 10.5, 1.0, 1.0, 1.0]);
    }
}
