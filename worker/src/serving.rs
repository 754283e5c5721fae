//! The tools this worker serves, kept in line with its [`ToolSet`] while it runs.
//!
//! Owns, per served tool, its bound consumer, its pull loop and its topology watch under
//! the tool's own stop token (a child of the worker's shutdown); a replaced tool is
//! handed to the running loop (no job reaches the old one afterwards); and the registration
//! that follows them: liveness beats every heartbeat, the withdrawal of tools no longer
//! served, `registry.changed` after every change, the coordinators' refusals read back
//! after every beat, and the readiness check over the served tools' consumers (failing
//! while a definition is refused). A tool is announced only once its loop runs, and withdrawn
//! as its loop is told to stop. It never runs a call (the runner does) and never
//! changes the set (its owner does).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_nats::jetstream::{self, consumer::PullConsumer};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_common::health::Health;
use toolfleet_common::topology::{self, Needed};
use tracing::{error, info, warn};

use crate::registry::{Refusals, Registration};
use crate::runner::{serve_tool, ServedTool, Shared};
use crate::tool::Tool;
use crate::{consumers, ConsumerMode, WorkerConfig, WorkerError};

/// A tool being served: what its loop runs and how to stop it.
struct Running {
    /// The tool the pull loop hands each job to; replaced in place when the set
    /// replaces the tool, so no job reaches the old handler afterwards.
    current: watch::Sender<Arc<ServedTool>>,
    /// Cancelled when the tool leaves the set (or at shutdown): its pull loop and
    /// topology watch end; its calls already running finish on `calls`.
    stop: CancellationToken,
    /// Stops the topology watch alone (a replaced tool gets one for its settings).
    watch_stop: CancellationToken,
}

/// What keeps the served tools in line with the set, and the registry with them.
pub(crate) struct Serving {
    config: WorkerConfig,
    shared: Arc<Shared>,
    health: Health,
    /// The jobs stream of each stream partition: every tool is pulled from each.
    jobs_streams: Vec<jetstream::stream::Stream>,
    /// For the readiness check.
    redis: toolfleet_common::redis_client::RedisConnection,
    registration: Registration,
    /// The coordinators' refusals of the served tools, read after every beat.
    refusals: Refusals,
    /// The pull loops and topology watches; closed and awaited at shutdown.
    pub loops: TaskTracker,
    /// Every call of every tool; drained at shutdown.
    pub calls: TaskTracker,
    /// The worker's shutdown: parent of every tool's stop token.
    shutdown: CancellationToken,
    running: BTreeMap<String, Running>,
    /// Tools that cannot be served as they are (bad name, output schema that does not
    /// compile): not tried again until the set replaces them.
    refused: BTreeMap<String, Tool>,
}

impl Serving {
    /// Nothing served yet.
    pub fn new(
        config: WorkerConfig,
        shared: Arc<Shared>,
        health: Health,
        jobs_streams: Vec<jetstream::stream::Stream>,
        redis: toolfleet_common::redis_client::RedisConnection,
        registration: Registration,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            config,
            shared,
            health,
            jobs_streams,
            redis,
            registration,
            refusals: Refusals::default(),
            loops: TaskTracker::new(),
            calls: TaskTracker::new(),
            shutdown,
            running: BTreeMap::new(),
            refused: BTreeMap::new(),
        }
    }

    /// Checks `tool`, binds its consumer and starts its pull loop (not yet announced:
    /// see [`Serving::announce`]).
    pub async fn add(&mut self, tool: Tool) -> Result<(), WorkerError> {
        let (served, consumers) = self.prepare(tool).await?;
        self.start(served, consumers);
        Ok(())
    }

    /// Checks `tool` and binds its consumer in every stream partition (bringing the
    /// consumers' delivery settings in line with the definition); the consumers, by
    /// partition.
    async fn prepare(
        &mut self,
        tool: Tool,
    ) -> Result<(ServedTool, Vec<PullConsumer>), WorkerError> {
        let mut served = crate::checked(tool, &self.config)?;
        let names = &self.shared.names;
        if self.config.consumers == ConsumerMode::Bind {
            // The coordinator creates the consumers from the definition it reads.
            self.registration
                .write_definition(served.tool.definition())
                .await?;
            let name = served.tool.definition().name.as_str();
            let _ = self
                .shared
                .nats
                .publish(names.registry_changed_for(name), bytes::Bytes::new())
                .await;
            let _ = self
                .shared
                .nats
                .publish(names.registry_changed(), bytes::Bytes::new())
                .await;
        }
        let mut bound_consumers = Vec::with_capacity(self.jobs_streams.len());
        for (partition, jobs_stream) in (0..).zip(&self.jobs_streams) {
            let (consumer, bound) = match self.config.consumers {
                ConsumerMode::Create => {
                    consumers::bind(
                        jobs_stream,
                        names,
                        partition,
                        &served.tool,
                        self.config.ack_wait,
                    )
                    .await?
                }
                ConsumerMode::Bind => {
                    let nats = &self.shared.nats;
                    consumers::wait_and_bind(jobs_stream, names, partition, &served.tool, nats)
                        .await?
                }
            };
            // Every partition's consumer has the same settings; the first one's rule.
            if partition == 0 {
                served.bound = bound;
            }
            bound_consumers.push(consumer);
        }
        Ok((served, bound_consumers))
    }

    /// Starts `served`'s pull loops (one per stream partition, the tool's concurrency
    /// split between them, at least one call each) and topology watch under a stop
    /// token of its own.
    fn start(&mut self, served: ServedTool, consumers: Vec<PullConsumer>) {
        let name = served.tool.definition().name.clone();
        let stop = self.shutdown.child_token();
        let served = Arc::new(served);
        let watch_stop = self.watch(&served, &stop);
        let (current, tool) = watch::channel(served);
        let concurrency = self.config.concurrency;
        self.shared.metrics.worker_capacity(&name, concurrency);
        // The tool's running-call count exists from now on, at 0 until a call runs, and
        // so do its job counters (hand-backs, redeliveries, ...) until their first event.
        self.shared.metrics.in_flight(&name, 0);
        self.shared.metrics.tool_served(&name);
        let each = concurrency.div_ceil(consumers.len().max(1)).max(1);
        for consumer in consumers {
            let serve = serve_tool(
                Arc::clone(&self.shared),
                tool.clone(),
                consumer,
                each,
                stop.clone(),
                self.calls.clone(),
            );
            self.health
                .supervise(&self.loops, "pull_loop", &stop, serve);
        }
        let running = Running {
            current,
            stop,
            watch_stop,
        };
        self.running.insert(name, running);
    }

    /// Starts the watch that recreates `served`'s consumer when it disappears, under a
    /// child of `stop`; its stop token. In `bind` mode there is none: the coordinator
    /// recreates consumers.
    fn watch(&self, served: &ServedTool, stop: &CancellationToken) -> CancellationToken {
        let watch_stop = stop.child_token();
        if self.config.consumers == ConsumerMode::Bind {
            return watch_stop;
        }
        let names = &self.shared.names;
        let needed = (0..names.partitions())
            .map(|partition| {
                Needed::Consumer(
                    names.jobs_stream_in(partition),
                    consumers::config(names, partition, &served.tool, self.config.ack_wait),
                )
            })
            .collect();
        let watch = topology::watch(
            self.shared.js.clone(),
            needed,
            self.config.topology_check,
            self.shared.metrics.clone(),
            watch_stop.clone(),
        );
        self.health
            .supervise(&self.loops, "topology", &watch_stop, watch);
        watch_stop
    }

    /// Puts `tool` in place of the served tool of the same name: its consumer is bound
    /// again (settings updated) and the running pull loop hands every later job to it.
    async fn replace(&mut self, name: &str, tool: Tool) -> Result<(), WorkerError> {
        let (served, _consumers) = self.prepare(tool).await?;
        let Some(running) = self.running.get(name) else {
            return Ok(());
        };
        running.watch_stop.cancel();
        let watch_stop = self.watch(&served, &running.stop);
        running.current.send_replace(Arc::new(served));
        if let Some(running) = self.running.get_mut(name) {
            running.watch_stop = watch_stop;
        }
        Ok(())
    }

    /// Stops pulling `name`'s jobs; its running calls finish.
    fn stop(&mut self, name: &str) {
        if let Some(running) = self.running.remove(name) {
            running.stop.cancel();
            self.shared.metrics.worker_capacity(name, 0);
        }
    }

    /// Announces the tools now served (definitions and liveness), withdraws the ones no
    /// longer served, tells the coordinators (`registry.changed`) and points the
    /// readiness check at the served tools' consumers.
    pub async fn announce(&mut self) -> Result<(), WorkerError> {
        let definitions: Vec<_> = self
            .running
            .values()
            .map(|r| r.current.borrow().tool.definition().clone())
            .collect();
        let dropped = self.registration.set_tools(&definitions)?;
        self.registration.withdraw_tools(&dropped).await?;
        self.registration.beat().await?;
        self.announce_names().await;
        let names = &self.shared.names;
        let _ = self
            .shared
            .nats
            .publish(names.registry_changed(), "".into())
            .await;
        let consumers = self
            .running
            .keys()
            .flat_map(|name| {
                (0..names.partitions())
                    .map(|k| (names.jobs_stream_in(k), names.tool_consumer(name)))
            })
            .collect();
        let needs = toolfleet_common::ready::Needs {
            streams: Vec::new(),
            consumers,
        };
        let check = toolfleet_common::ready::readiness(
            self.shared.nats.clone(),
            self.shared.js.clone(),
            self.redis.clone(),
            needs,
        );
        self.health.set_readiness(self.refusals.guard(check));
        info!(
            tools = definitions.len(),
            withdrawn = dropped.len(),
            "serving tools"
        );
        Ok(())
    }

    /// Serves exactly the tools of `wanted`: stops the tools that left it, puts
    /// replaced ones in place, starts the new ones, and announces the result when
    /// anything changed. A tool whose consumer cannot be bound now is tried again at the
    /// next beat (a replaced one keeps being served as it was meanwhile).
    async fn reconcile(&mut self, wanted: &BTreeMap<String, Tool>) {
        let gone: Vec<String> = self
            .running
            .keys()
            .filter(|name| !wanted.contains_key(*name))
            .cloned()
            .collect();
        for name in &gone {
            self.stop(name);
        }
        self.refused
            .retain(|name, tool| wanted.get(name).is_some_and(|t| t.same_as(tool)));
        let mut changed = !gone.is_empty();
        for (name, tool) in wanted {
            if self.refused.contains_key(name) {
                continue;
            }
            let outcome = match self.running.get(name) {
                Some(r) if r.current.borrow().tool.same_as(tool) => continue,
                Some(_) => self.replace(name, tool.clone()).await,
                None => self.add(tool.clone()).await,
            };
            match outcome {
                Ok(()) => changed = true,
                Err(error @ WorkerError::Consumer { .. }) => {
                    warn!(tool = %name, %error, "cannot serve the tool yet; trying again at the next beat");
                }
                Err(error) => {
                    error!(tool = %name, %error, "cannot serve the tool");
                    changed |= self.running.contains_key(name);
                    self.stop(name);
                    self.refused.insert(name.clone(), tool.clone());
                }
            }
        }
        if changed {
            if let Err(error) = self.announce().await {
                warn!(%error, "could not announce the served tools; the next beat writes them");
            }
        }
    }

    /// Announces every registered tool on its own registry subject (a coordinator adds
    /// the name of one it does not know yet); whether every announcement was sent.
    async fn announce_names(&self) -> bool {
        let names = &self.shared.names;
        let mut sent = true;
        for tool in self.registration.tool_names() {
            let subject = names.registry_changed_for(tool);
            sent &= self
                .shared
                .nats
                .publish(subject, bytes::Bytes::new())
                .await
                .is_ok();
        }
        sent
    }

    /// Until `stop`: follows `tools` (until the shutdown request) and renews the
    /// registration every heartbeat; then hands the registration back for withdrawal.
    pub async fn run(
        mut self,
        mut tools: watch::Receiver<BTreeMap<String, Tool>>,
        stop: CancellationToken,
    ) -> Registration {
        let mut beats = tokio::time::interval(self.config.heartbeat);
        beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        beats.reset();
        let mut set_alive = true;
        loop {
            let following = set_alive && !self.shutdown.is_cancelled();
            tokio::select! {
                _ = stop.cancelled() => break,
                changed = tools.changed(), if following => {
                    if changed.is_err() {
                        set_alive = false;
                        continue;
                    }
                    let wanted = tools.borrow_and_update().clone();
                    self.reconcile(&wanted).await;
                }
                _ = beats.tick() => {
                    if following {
                        let wanted = tools.borrow().clone();
                        self.reconcile(&wanted).await;
                    }
                    // Bounded by the period, so beats keep their pace while Redis is
                    // away (a request would otherwise wait for the client's reconnect).
                    let period = self.config.heartbeat;
                    match tokio::time::timeout(period, self.registration.beat()).await {
                        Ok(Err(error)) => {
                            self.shared.metrics.redis_error("heartbeat");
                            warn!(%error, "heartbeat failed");
                        }
                        Err(_) => {
                            self.shared.metrics.redis_error("heartbeat");
                            warn!(period_ms = period.as_millis() as u64, "heartbeat unanswered within its period");
                        }
                        Ok(Ok(())) if !self.announce_names().await => {
                            warn!("tool announcements not sent; the next heartbeat sends them");
                        }
                        Ok(Ok(())) => {
                            let reading = self.registration.read_refusals(&self.refusals);
                            match tokio::time::timeout(period, reading).await {
                                Ok(Ok(_)) => {}
                                Ok(Err(error)) => {
                                    self.shared.metrics.redis_error("read_refusals");
                                    warn!(%error, "reading the coordinators' refusals failed");
                                }
                                Err(_) => {
                                    self.shared.metrics.redis_error("read_refusals");
                                    warn!("reading the coordinators' refusals unanswered within the heartbeat");
                                }
                            }
                        }
                    }
                }
            }
        }
        self.registration
    }
}
