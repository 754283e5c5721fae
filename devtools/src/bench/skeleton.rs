//! The bare hops of a durable turn: the floor a turn of three calls stands on when
//! nothing of toolfleet runs between the servers.
//!
//! A turn that keeps its guarantees crosses, in order: the frontend's request to a
//! coordinator; one Redis round trip that stores the turn; the `ack` back; three jobs
//! stored in the jobs stream and pulled by a worker; three results stored in the results
//! stream and pulled by a coordinator; one Redis round trip per result that records it;
//! the `final` back once the third is recorded. Here a stand-in coordinator and worker,
//! each on its own connections and its own runtime with as many threads as the fleet's
//! processes get, cross exactly those hops with the product's stream settings and two
//! one-line Lua scripts, and nothing else: no decoding, validation, spans, call states
//! or narration. What the overhead phase measures above this is what toolfleet adds.
//!
//! Owns the stand-ins' threads and the streams and keys they use under the prefix it is
//! handed (removed by the bench's cleanup of that prefix). It must never touch another
//! prefix.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use async_nats::jetstream::{self, consumer::PullConsumer};
use bytes::Bytes;
use futures::StreamExt;
use redis::Script;
use serde::Serialize;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use toolfleet_common::redis_client::RedisConnection;
use toolfleet_common::Names;

use super::fleet::Env;
use super::stats::{Latencies, Summary};

/// Calls per skeleton turn, as in the overhead phase.
const CALLS: usize = 3;
/// The stand-in tool's name in the job and result subjects.
const TOOL: &str = "skeleton";
/// Longest wait for one turn.
const TURN_WAIT: Duration = Duration::from_secs(5);
/// Stores a turn (`CREATE`'s place): its call count, with an expiry.
const STORE: &str =
    "redis.call('HSET', KEYS[1], 'calls', ARGV[1]); redis.call('PEXPIRE', KEYS[1], 60000); return 1";
/// Records one result (`RECORD`'s place): the count of results recorded so far.
const RECORD: &str = "return redis.call('HINCRBY', KEYS[1], 'done', 1)";

/// Submit → `ack` and submit → `final` of the skeleton's turns.
#[derive(Debug, Clone, Serialize)]
pub struct Skeleton {
    /// Submit → `ack`: request, one Redis round trip, reply.
    pub ack: Summary,
    /// Submit → `final`.
    pub turn: Summary,
}

/// Runs `warmup` and then `samples` skeleton turns one after another, each role on
/// `threads` runtime threads (one per CPU when `None`, as a fleet's processes).
pub async fn measure(
    env: &Env,
    prefix: &str,
    warmup: usize,
    samples: usize,
    threads: Option<usize>,
) -> Result<Skeleton> {
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let names = Names::new(prefix);
    let js = jetstream::new(env.nats.clone());
    let streams = toolfleet_common::streams::ensure_streams(&js, &names)
        .await
        .context("creating the skeleton's streams")?;
    let (jobs, results) = match (streams.jobs.first(), streams.results.first()) {
        (Some(j), Some(r)) => (j.clone(), r.clone()),
        _ => bail!("no stream partition"),
    };
    let pull = |durable: &str, filter: String| jetstream::consumer::pull::Config {
        durable_name: Some(durable.to_string()),
        filter_subject: filter,
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(10),
        ..Default::default()
    };
    let job_durable = format!("{}-skeleton-jobs", names.prefix());
    let result_durable = format!("{}-skeleton-results", names.prefix());
    let _: PullConsumer = jobs
        .create_consumer(pull(&job_durable, names.job_subject_in(0, TOOL)))
        .await
        .context("creating the skeleton's job consumer")?;
    let _: PullConsumer = results
        .create_consumer(pull(&result_durable, names.results_wildcard_in(0)))
        .await
        .context("creating the skeleton's result consumer")?;

    let stop = CancellationToken::new();
    let _stop_on_exit = stop.clone().drop_guard();
    let intake = format!("{}.skeleton.turn", names.prefix());
    let mut coordinator = {
        let (nats_url, redis_url) = (env.nats_url.clone(), env.redis_url.clone());
        let (names, intake, stop) = (names.clone(), intake.clone(), stop.clone());
        on_own_thread("bench-skeleton-coordinator", threads, move |ready| {
            let role = Coordinator {
                names,
                intake,
                durable: result_durable,
            };
            role.run(nats_url, redis_url, ready, stop)
        })?
    };
    let mut worker = {
        let (nats_url, names, stop) = (env.nats_url.clone(), names.clone(), stop.clone());
        on_own_thread("bench-skeleton-worker", threads, move |ready| {
            run_worker(nats_url, names, job_durable, ready, stop)
        })?
    };
    coordinator.ready().await?;
    worker.ready().await?;

    let turns = drive(env, &intake, warmup, samples).await;
    stop.cancel();
    // A role that failed says why first: the turns only saw it stop answering.
    coordinator.join().await?;
    worker.join().await?;
    turns
}

/// Submits `warmup` and then `samples` turns on `intake` one after another, and times
/// the measured ones.
async fn drive(env: &Env, intake: &str, warmup: usize, samples: usize) -> Result<Skeleton> {
    let inbox = env.nats.new_inbox();
    let mut events = env.nats.subscribe(format!("{inbox}.*")).await?;
    env.nats.flush().await?;
    let (mut ack, mut turn) = (Latencies::default(), Latencies::default());
    // The stand-in's subscription reaches the server over its own connection: until a
    // first turn is answered, one that finds no responder is submitted again.
    let answer_by = Instant::now() + TURN_WAIT;
    let mut attempt = 0;
    let mut i = 0;
    while i < warmup + samples {
        attempt += 1;
        let reply = format!("{inbox}.{attempt}");
        let start = Instant::now();
        env.nats
            .publish_with_reply(intake.to_string(), reply.clone(), Bytes::new())
            .await?;
        let mut acked = None;
        loop {
            let message = tokio::time::timeout(TURN_WAIT, events.next())
                .await
                .map_err(|_| anyhow!("skeleton turn {i}: no event within {TURN_WAIT:?}"))?
                .ok_or_else(|| anyhow!("the skeleton's event subscription ended"))?;
            if message.subject.as_str() != reply {
                continue;
            }
            if let Some(status) = message.status {
                if i == 0 && Instant::now() < answer_by {
                    break;
                }
                bail!("skeleton turn {i}: NATS status {status} (no coordinator listening)");
            }
            match &message.payload[..] {
                b"ack" => acked = Some(start.elapsed()),
                b"final" if acked.is_some() => break,
                b"final" => bail!("skeleton turn {i}: final before ack"),
                other => bail!(
                    "skeleton turn {i}: unexpected event {}",
                    String::from_utf8_lossy(other)
                ),
            }
        }
        let Some(acked) = acked else {
            // Not answered: the first turn, before the stand-in was listening.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if i >= warmup {
            ack.push(acked);
            turn.push(start.elapsed());
        }
        i += 1;
    }
    Ok(Skeleton {
        ack: ack.summary(),
        turn: turn.summary(),
    })
}

/// A role on a thread of its own, which blocks on the role's runtime.
struct Role {
    ready: oneshot::Receiver<()>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Role {
    /// Waits until the role is connected and bound, or reports why it is not.
    async fn ready(&mut self) -> Result<()> {
        match tokio::time::timeout(TURN_WAIT, &mut self.ready).await {
            Ok(Ok(())) => Ok(()),
            // The role ended before it was ready: its own error says why.
            Ok(Err(_)) => {
                self.join_thread().await?;
                bail!("a skeleton role ended before it was ready")
            }
            Err(_) => bail!("a skeleton role was not ready within {TURN_WAIT:?}"),
        }
    }

    /// Waits (on a blocking thread, at most [`TURN_WAIT`]) for the role's thread, which
    /// ends once its stop token is cancelled.
    async fn join(mut self) -> Result<()> {
        self.join_thread().await
    }

    /// [`Role::join`], leaving the role without a thread.
    async fn join_thread(&mut self) -> Result<()> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let joined = tokio::task::spawn_blocking(move || thread.join());
        match tokio::time::timeout(TURN_WAIT, joined).await {
            Ok(Ok(Ok(ended))) => ended,
            Ok(_) => bail!("a skeleton role panicked"),
            Err(_) => bail!("a skeleton role did not stop within {TURN_WAIT:?}"),
        }
    }
}

/// Runs the future `work` builds on a runtime of `threads` threads (a single-threaded
/// one for 0 or 1), started on a new thread; `work` is handed the sender it signals
/// readiness on.
fn on_own_thread<F>(
    name: &str,
    threads: usize,
    work: impl FnOnce(oneshot::Sender<()>) -> F + Send + 'static,
) -> Result<Role>
where
    F: Future<Output = Result<()>> + Send + 'static,
{
    let (ready, ready_rx) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let runtime = match threads {
                0 | 1 => tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?,
                n => tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(n)
                    .enable_all()
                    .build()?,
            };
            // Spawned, so that with several threads the role runs on the runtime's
            // workers as a fleet's processes do, not on the thread that blocks on it.
            runtime.block_on(async move {
                tokio::spawn(work(ready))
                    .await
                    .map_err(|e| anyhow!("a skeleton role panicked: {e}"))?
            })
        });
    Ok(Role {
        ready: ready_rx,
        thread: Some(thread.with_context(|| format!("starting thread {name}"))?),
    })
}

/// A NATS connection of the role's own, on the role's runtime.
async fn connect(nats_url: &str, name: &str) -> Result<async_nats::Client> {
    Ok(async_nats::ConnectOptions::new()
        .name(name)
        .connect(toolfleet_common::config::NatsUrls(nats_url))
        .await?)
}

/// The pull consumer `durable` of the stream `stream`, bound over `js`.
async fn bind(js: &jetstream::Context, stream: String, durable: &str) -> Result<PullConsumer> {
    js.get_stream_no_info(stream)
        .await?
        .get_consumer(durable)
        .await
        .map_err(|e| anyhow!("binding consumer {durable}: {e}"))
}

/// The stand-in coordinator: takes turns, stores each, publishes its jobs; records each
/// result and sends the `final` after the last.
struct Coordinator {
    names: Names,
    intake: String,
    durable: String,
}

impl Coordinator {
    async fn run(
        self,
        nats_url: String,
        redis_url: String,
        ready: oneshot::Sender<()>,
        stop: CancellationToken,
    ) -> Result<()> {
        let nats = connect(&nats_url, "toolfleet-bench-skeleton-coordinator").await?;
        let redis = toolfleet_common::redis_client::connect(&redis_url, Default::default()).await?;
        let js = jetstream::new(nats.clone());
        let results = bind(&js, self.names.results_stream_in(0), &self.durable).await?;
        let mut turns = nats.subscribe(self.intake.clone()).await?;
        let mut results = results
            .stream()
            .max_messages_per_batch(64)
            .messages()
            .await?;
        nats.flush().await?;
        let _ = ready.send(());
        let shared = Arc::new(Shared {
            names: self.names,
            nats,
            js,
            redis,
            store: Script::new(STORE),
            record: Script::new(RECORD),
            next_turn: AtomicU64::new(0),
        });
        loop {
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                Some(request) = turns.next() => {
                    let shared = Arc::clone(&shared);
                    tokio::spawn(async move {
                        if let Err(error) = shared.take_turn(request).await {
                            tracing::warn!(%error, "skeleton turn failed");
                        }
                    });
                }
                Some(result) = results.next() => {
                    let result = match result {
                        Ok(result) => result,
                        Err(error) => {
                            tracing::warn!(%error, "skeleton results pull");
                            continue;
                        }
                    };
                    let shared = Arc::clone(&shared);
                    tokio::spawn(async move {
                        if let Err(error) = shared.record(result).await {
                            tracing::warn!(%error, "skeleton result not recorded");
                        }
                    });
                }
            }
        }
    }
}

/// What the stand-in coordinator's tasks share.
struct Shared {
    names: Names,
    nats: async_nats::Client,
    js: jetstream::Context,
    redis: RedisConnection,
    store: Script,
    record: Script,
    next_turn: AtomicU64,
}

impl Shared {
    /// Stores the turn, sends its `ack`, and publishes its jobs until each is stored.
    async fn take_turn(&self, request: async_nats::Message) -> Result<()> {
        let reply = request
            .reply
            .context("a turn request without a reply subject")?;
        let turn = self.next_turn.fetch_add(1, Ordering::Relaxed).to_string();
        let mut redis = self.redis.clone();
        let _: i64 = self
            .store
            .key(self.key(&turn))
            .arg(CALLS)
            .invoke_async(&mut redis)
            .await?;
        self.nats
            .publish(reply.clone(), Bytes::from_static(b"ack"))
            .await?;
        let job = Bytes::from(format!("{turn} {reply}"));
        let mut acks = Vec::with_capacity(CALLS);
        for _ in 0..CALLS {
            acks.push(
                self.js
                    .publish(self.names.job_subject_in(0, TOOL), job.clone())
                    .await?,
            );
        }
        for ack in acks {
            ack.await?;
        }
        Ok(())
    }

    /// Records one result and sends the turn's `final` when it was the last.
    async fn record(&self, result: jetstream::Message) -> Result<()> {
        let body = std::str::from_utf8(&result.payload)?;
        let (turn, reply) = body.split_once(' ').context("a result without its turn")?;
        let mut redis = self.redis.clone();
        let recorded: usize = self
            .record
            .key(self.key(turn))
            .invoke_async(&mut redis)
            .await?;
        result.ack().await.map_err(|e| anyhow!(e))?;
        if recorded == CALLS {
            self.nats
                .publish(reply.to_string(), Bytes::from_static(b"final"))
                .await?;
        }
        Ok(())
    }

    fn key(&self, turn: &str) -> String {
        format!("{}:skeleton:{turn}", self.names.prefix())
    }
}

/// The stand-in worker: pulls each job, publishes its result until it is stored, then
/// acks the job.
async fn run_worker(
    nats_url: String,
    names: Names,
    durable: String,
    ready: oneshot::Sender<()>,
    stop: CancellationToken,
) -> Result<()> {
    let nats = connect(&nats_url, "toolfleet-bench-skeleton-worker").await?;
    let js = jetstream::new(nats.clone());
    let jobs = bind(&js, names.jobs_stream_in(0), &durable).await?;
    let mut jobs = jobs.stream().max_messages_per_batch(8).messages().await?;
    nats.flush().await?;
    let _ = ready.send(());
    let names = Arc::new(names);
    loop {
        let job = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            Some(job) = jobs.next() => job,
        };
        let job = match job {
            Ok(job) => job,
            Err(error) => {
                tracing::warn!(%error, "skeleton jobs pull");
                continue;
            }
        };
        let (js, names) = (js.clone(), Arc::clone(&names));
        tokio::spawn(async move {
            let turn = job.payload.split(|b| *b == b' ').next().unwrap_or_default();
            let turn = String::from_utf8_lossy(turn);
            let subject = names.tool_result_subject_in(0, &turn, TOOL);
            let published = match js.publish(subject, job.payload.clone()).await {
                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match published {
                Ok(()) => {
                    let _ = job.ack().await;
                }
                Err(error) => tracing::warn!(%error, "skeleton result not published"),
            }
        });
    }
}
