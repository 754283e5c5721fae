//! The tenants phase: a flooding tenant beside a light one on one worker of 8 slots.
//!
//! The heavy tenant keeps `heavy_turns` turns of four 200 ms `test.behave` calls in
//! flight, first alone (its throughput), then while the light tenant runs
//! `light_turns` turns of one 10 ms call one after another (their latency, and the
//! heavy tenant's throughput beside them). Every turn of either must end with every
//! call answered: a turn that ends otherwise is counted as failed, one that never ends
//! as lost.
//!
//! Owns the two tenants' turns and their figures; never starts a fleet and never
//! formats the report.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use serde_json::{json, Map};
use tokio::task::JoinSet;
use toolfleet_common::{FleetClient, TurnEvent, TurnRequest};

use super::phases::decision;
use super::progress::Progress;
use super::stats::{Latencies, Summary};

/// The flooding tenant.
const HEAVY: &str = "bench-heavy";
/// The light tenant.
const LIGHT: &str = "bench-light";
/// The heavy tenant's calls per turn and their length.
const HEAVY_CALLS: usize = 4;
const HEAVY_MS: u64 = 200;
/// The light tenant's one call.
const LIGHT_MS: u64 = 10;
/// The light tenant's deadline (the default's 5 s of the reproduction).
const LIGHT_DEADLINE_MS: u64 = 5_000;
/// The heavy tenant's deadline: long enough for its own backlog.
const HEAVY_DEADLINE_MS: u64 = 60_000;
/// Longest wait for any one event of a turn.
const EVENT_WAIT: Duration = Duration::from_secs(70);

/// The tenants phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Tenants {
    /// Heavy turns kept in flight.
    pub heavy_turns_in_flight: usize,
    /// Heavy turns per second, alone.
    pub heavy_alone_turns_per_s: f64,
    /// Heavy turns per second while the light tenant ran.
    pub heavy_beside_turns_per_s: f64,
    /// The light tenant's turns, submit → `final` (those that failed included).
    pub light_turn: Summary,
    /// Light turns that hit their deadline.
    pub light_deadline_hit: usize,
    /// Heavy turns that ended without every call answered (a deadline, an error event).
    pub heavy_failed: usize,
    /// Light turns that ended without their call answered.
    pub light_failed: usize,
    /// Turns accepted whose stream never ended (either tenant).
    pub lost: usize,
}

fn request(tenant: &str, calls: usize, sleep_ms: u64, deadline_ms: u64) -> TurnRequest {
    TurnRequest {
        turn_id: None,
        tenant_id: tenant.into(),
        session_id: None,
        user_message: None,
        decision: decision("test.behave", &json!({"sleep_ms": sleep_ms}), calls),
        deadline_ms: Some(deadline_ms),
        options: Default::default(),
        context: Map::new(),
    }
}

/// How one turn ended.
enum Ended {
    /// Every call answered, before the deadline.
    Answered(Duration),
    /// A `final` with a deadline hit or a call not answered, or an `error` event, after
    /// `took`.
    Failed { deadline_hit: bool, took: Duration },
    /// No `final` or `error` within the wait.
    Lost,
}

async fn run_turn(client: &FleetClient, request: TurnRequest) -> Ended {
    let start = Instant::now();
    let Ok(mut stream) = client.submit(request).await else {
        return Ended::Lost;
    };
    loop {
        match stream.next_event(EVENT_WAIT).await {
            Ok(TurnEvent::Final(fin)) => {
                return match !fin.deadline_hit && fin.summary.ok == fin.summary.total {
                    true => Ended::Answered(start.elapsed()),
                    false => Ended::Failed {
                        deadline_hit: fin.deadline_hit,
                        took: start.elapsed(),
                    },
                };
            }
            Ok(TurnEvent::Error { .. }) => {
                return Ended::Failed {
                    deadline_hit: false,
                    took: start.elapsed(),
                }
            }
            Ok(_) => {}
            Err(_) => return Ended::Lost,
        }
    }
}

/// The heavy tenant's closed loop: `turns` tasks, each submitting its next turn when
/// the last one ends, until `stop`. Counts turns that ended after `counting` was set.
struct Heavy {
    stop: Arc<AtomicBool>,
    counting: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    lost: Arc<AtomicUsize>,
    tasks: JoinSet<()>,
}

impl Heavy {
    fn start(client: &FleetClient, turns: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let counting = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let lost = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        for _ in 0..turns {
            let client = client.clone();
            let (stop, counting) = (Arc::clone(&stop), Arc::clone(&counting));
            let (answered, failed, lost) = (
                Arc::clone(&answered),
                Arc::clone(&failed),
                Arc::clone(&lost),
            );
            tasks.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let turn = request(HEAVY, HEAVY_CALLS, HEAVY_MS, HEAVY_DEADLINE_MS);
                    let ended = run_turn(&client, turn).await;
                    let counter = match ended {
                        Ended::Answered(_) => &answered,
                        Ended::Failed { .. } => &failed,
                        Ended::Lost => &lost,
                    };
                    // Failures and losses count whenever they happen.
                    if counting.load(Ordering::Relaxed) || !matches!(ended, Ended::Answered(_)) {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        Self {
            stop,
            counting,
            answered,
            failed,
            lost,
            tasks,
        }
    }

    /// Heavy turns per second answered over `window`, from now.
    async fn measure(&self, window: Duration) -> f64 {
        let before = self.answered.load(Ordering::Relaxed);
        self.counting.store(true, Ordering::Relaxed);
        let start = Instant::now();
        tokio::time::sleep(window).await;
        (self.answered.load(Ordering::Relaxed) - before) as f64 / start.elapsed().as_secs_f64()
    }

    /// Counts answered turns from now on; returns a reading to take later.
    fn mark(&self) -> (usize, Instant) {
        self.counting.store(true, Ordering::Relaxed);
        (self.answered.load(Ordering::Relaxed), Instant::now())
    }

    fn since(&self, mark: (usize, Instant)) -> f64 {
        (self.answered.load(Ordering::Relaxed) - mark.0) as f64 / mark.1.elapsed().as_secs_f64()
    }

    /// Stops submitting and waits for every turn in flight to end (bounded by each
    /// turn's own event wait).
    async fn stop(mut self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        while self.tasks.join_next().await.is_some() {}
        (
            self.failed.load(Ordering::Relaxed),
            self.lost.load(Ordering::Relaxed),
        )
    }
}

/// Runs the phase: the heavy tenant alone for `warmup` + `window`, then the light
/// tenant's `light_turns` beside it.
pub async fn tenants(
    client: &FleetClient,
    heavy_turns: usize,
    light_turns: usize,
    warmup: Duration,
    window: Duration,
    progress: &Progress,
) -> Result<Tenants> {
    let heavy = Heavy::start(client, heavy_turns);
    tokio::time::sleep(warmup).await;
    progress.note(format_args!("  heavy tenant alone for {window:?}"));
    let alone = heavy.measure(window).await;
    progress.note(format_args!(
        "  {light_turns} light turns beside the heavy tenant"
    ));
    let mark = heavy.mark();
    let mut light = Latencies::default();
    let (mut light_failed, mut light_deadline_hit, mut light_lost) = (0, 0, 0);
    for _ in 0..light_turns {
        match run_turn(client, request(LIGHT, 1, LIGHT_MS, LIGHT_DEADLINE_MS)).await {
            Ended::Answered(took) => light.push(took),
            Ended::Failed { deadline_hit, took } => {
                light.push(took);
                light_failed += 1;
                light_deadline_hit += usize::from(deadline_hit);
            }
            Ended::Lost => light_lost += 1,
        }
    }
    let beside = heavy.since(mark);
    let (heavy_failed, heavy_lost) = heavy.stop().await;
    Ok(Tenants {
        heavy_turns_in_flight: heavy_turns,
        heavy_alone_turns_per_s: alone,
        heavy_beside_turns_per_s: beside,
        light_turn: light.summary(),
        light_deadline_hit,
        heavy_failed,
        light_failed,
        lost: heavy_lost + light_lost,
    })
}
