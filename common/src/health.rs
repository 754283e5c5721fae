//! The health of one fleet process, as `/healthz` and `/readyz` report it.
//!
//! Owns [`Health`]: the start-up phase (answered by `/readyz` before the connections
//! exist, e.g. "connecting to NATS"), the readiness check installed once they do, the
//! draining flag (readiness 503 from the shutdown request on), and the supervised
//! background tasks: a task started with [`Health::supervise`] that panics or returns
//! before its stop token is cancelled marks the process dead, so liveness fails and
//! Kubernetes restarts it; and the routes of `/healthz`, `/readyz` and `/metrics`
//! ([`ops_handler`], [`serve_ops`]) on the `http` server. Never parses HTTP itself
//! (`http` does) and never checks a connection itself (`ready` does).

use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::error;

use crate::http::{serve, Handler, Readiness, Response, ResponseFuture};

/// Shared, cheap-to-clone health state of one process.
#[derive(Clone, Default)]
pub struct Health {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// What the process is doing before it can be ready (`None` once the check is set).
    phase: Mutex<Option<String>>,
    /// What the server refused during the current phase (a permission violation), so
    /// readiness says why a step does not end.
    refused: Mutex<Option<String>>,
    /// The readiness check, once the connections exist.
    ready: Mutex<Option<Readiness>>,
    /// Set at the shutdown request: readiness fails so traffic goes elsewhere.
    draining: AtomicBool,
    /// Supervised tasks that died, with why.
    dead: Mutex<Vec<String>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("live", &self.liveness().is_ok())
            .finish()
    }
}

impl Health {
    /// A process starting up, in `phase` (e.g. "connecting to NATS").
    pub fn starting(phase: &str) -> Self {
        let health = Self::default();
        health.set_phase(phase);
        health
    }

    /// The start-up phase `/readyz` reports until the readiness check is installed.
    pub fn set_phase(&self, phase: &str) {
        *lock(&self.inner.phase) = Some(phase.to_string());
        *lock(&self.inner.refused) = None;
    }

    /// The server refused something during start-up (`-ERR`, such as a permission
    /// violation): readiness names it after the phase until the next phase begins.
    pub fn server_refused(&self, why: &str) {
        if lock(&self.inner.phase).is_some() {
            *lock(&self.inner.refused) = Some(why.to_string());
        }
    }

    /// Installs the readiness check (the connections exist).
    pub fn set_readiness(&self, ready: Readiness) {
        *lock(&self.inner.ready) = Some(ready);
        *lock(&self.inner.phase) = None;
    }

    /// The process was asked to stop: readiness fails from now on.
    pub fn start_draining(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
    }

    /// Whether [`Health::start_draining`] was called.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    /// Records that the supervised task `task` died (`why`): liveness fails from now on.
    pub fn task_died(&self, task: &str, why: &str) {
        error!(
            task,
            why, "background task died; the process is no longer live"
        );
        crate::metrics::FleetMetrics::new().task_died(task);
        lock(&self.inner.dead).push(format!("task {task} died: {why}"));
    }

    /// `Ok` while every supervised task runs (or stopped when told to).
    pub fn liveness(&self) -> Result<(), String> {
        let dead = lock(&self.inner.dead);
        match dead.is_empty() {
            true => Ok(()),
            false => Err(dead.join("; ")),
        }
    }

    /// `Ok` when live, not draining, started and the readiness check passes.
    pub async fn readiness(&self) -> Result<(), String> {
        self.liveness()?;
        if self.is_draining() {
            return Err("draining".into());
        }
        if let Some(phase) = lock(&self.inner.phase).clone() {
            return Err(match lock(&self.inner.refused).clone() {
                Some(why) => format!("{phase}: {why}"),
                None => phase,
            });
        }
        let check = lock(&self.inner.ready).clone();
        match check {
            Some(check) => check().await,
            None => Err("starting".into()),
        }
    }

    /// Runs `task` on `tracker` under supervision: a panic, or a return before `stop` is
    /// cancelled, marks the process dead (see [`Health::task_died`]).
    pub fn supervise<F>(
        &self,
        tracker: &TaskTracker,
        name: &'static str,
        stop: &CancellationToken,
        task: F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        crate::metrics::FleetMetrics::new().task_supervised(name);
        let (health, stop) = (self.clone(), stop.clone());
        tracker.spawn(async move {
            match AssertUnwindSafe(task).catch_unwind().await {
                Ok(()) if stop.is_cancelled() => {}
                Ok(()) => health.task_died(name, "returned before shutdown"),
                Err(panic) => health.task_died(name, &panic_message(panic.as_ref())),
            }
        });
    }
}

// ----- the ops endpoint -------------------------------------------------------------

/// Routes `/healthz` (every supervised task alive), `/readyz`
/// (live, not draining, started, and the readiness check passes) and `/metrics`
/// (Prometheus text of this process's metrics).
pub fn ops_handler(health: Health) -> Handler {
    Arc::new(move |path: String| {
        let health = health.clone();
        Box::pin(async move {
            match path.as_str() {
                "/healthz" | "/livez" => match health.liveness() {
                    Ok(()) => Response::ok("ok\n"),
                    Err(reason) => Response::status(503, format!("not live: {reason}\n")),
                },
                "/readyz" => {
                    match tokio::time::timeout(Duration::from_secs(3), health.readiness()).await {
                        Ok(Ok(())) => Response::ok("ready\n"),
                        Ok(Err(reason)) => Response::status(503, format!("not ready: {reason}\n")),
                        Err(_) => Response::status(503, "not ready: checks timed out\n"),
                    }
                }
                "/metrics" => Response {
                    status: 200,
                    content_type: "text/plain; version=0.0.4; charset=utf-8",
                    body: crate::telemetry::prometheus_text(),
                },
                _ => Response::status(404, "not found\n"),
            }
        }) as ResponseFuture
    })
}

/// Serves `/healthz`, `/readyz` and `/metrics` of `health` on `addr` (nothing when
/// `None`) until `shutdown`.
pub async fn serve_ops(
    addr: Option<SocketAddr>,
    health: &Health,
    shutdown: &CancellationToken,
) -> std::io::Result<()> {
    if let Some(addr) = addr {
        let bound = serve(addr, ops_handler(health.clone()), shutdown.clone()).await?;
        tracing::info!(%bound, "serving /healthz, /readyz and /metrics");
    }
    Ok(())
}

/// What every fleet process sets up before it connects anywhere.
pub struct Started {
    /// The process's health, starting at "connecting to NATS".
    pub health: Health,
    /// The process's instruments.
    pub metrics: crate::metrics::FleetMetrics,
    /// Stops the ops endpoint (and whatever else the process hangs on it).
    pub stop: CancellationToken,
    /// Cancels `stop` when dropped, however the process's `run` returns.
    pub guard: tokio_util::sync::DropGuard,
}

/// Starts a fleet process's health, its ops endpoint on `http_addr` (up from the first
/// second, so `/readyz` names the start-up step) and its metrics under `service`.
pub async fn start_process(
    service: &str,
    http_addr: Option<std::net::SocketAddr>,
) -> std::io::Result<Started> {
    let health = Health::starting("connecting to NATS");
    let stop = CancellationToken::new();
    let guard = stop.clone().drop_guard();
    serve_ops(http_addr, &health, &stop).await?;
    let metrics = crate::metrics::FleetMetrics::new();
    metrics.process_started(service);
    Ok(Started {
        health,
        metrics,
        stop,
        guard,
    })
}

/// The `event` label of every NATS connection event [`observe_nats`] counts.
const NATS_EVENTS: [&str; 8] = [
    "connected",
    "disconnected",
    "lame_duck",
    "draining",
    "closed",
    "slow_consumer",
    "server_error",
    "client_error",
];

/// Whether a failed connection attempt was the server refusing the credentials (a
/// wrong password, an unknown user or token): the server's `-ERR` answer, so counted
/// as `server_error` like any other the server sends (a permission violation).
fn credentials_refused(error: &async_nats::ClientError) -> bool {
    use async_nats::ConnectErrorKind as Kind;
    match error {
        async_nats::ClientError::Other(kind) => {
            [Kind::AuthorizationViolation, Kind::Authentication]
                .iter()
                .any(|refused| refused.to_string() == *kind)
        }
        _ => false,
    }
}

/// The `event` label of `event` (one of [`NATS_EVENTS`]): `client_error` is a connection
/// attempt that failed on the client's side (server unreachable, TLS, timeout),
/// `server_error` what the server refused (credentials at connect, permissions after).
fn nats_event_name(event: &async_nats::Event) -> &'static str {
    use async_nats::Event;
    match event {
        Event::ClientError(error) if credentials_refused(error) => NATS_EVENTS[6],
        Event::Connected => NATS_EVENTS[0],
        Event::Disconnected => NATS_EVENTS[1],
        Event::LameDuckMode => NATS_EVENTS[2],
        Event::Draining => NATS_EVENTS[3],
        Event::Closed => NATS_EVENTS[4],
        Event::SlowConsumer(_) => NATS_EVENTS[5],
        Event::ServerError(_) => NATS_EVENTS[6],
        Event::ClientError(_) => NATS_EVENTS[7],
    }
}

/// `options` with a callback that counts every NATS connection event
/// (`toolfleet.nats.events`, each event's series at 0 from now on) and logs losses at
/// WARN.
pub fn observe_nats(
    options: async_nats::ConnectOptions,
    metrics: crate::metrics::FleetMetrics,
) -> async_nats::ConnectOptions {
    observe_nats_starting(options, metrics, None)
}

/// [`observe_nats`], and while `starting` holds a process's health that is not yet
/// connected, its start-up phase names why the last attempt failed
/// (`connecting to NATS: authorization violation`).
fn observe_nats_starting(
    options: async_nats::ConnectOptions,
    metrics: crate::metrics::FleetMetrics,
    starting: Option<(Health, Arc<AtomicBool>)>,
) -> async_nats::ConnectOptions {
    metrics.nats_events_observed(&NATS_EVENTS);
    options.event_callback(move |event| {
        let metrics = metrics.clone();
        let starting = starting.clone();
        async move {
            use async_nats::Event;
            let name = nats_event_name(&event);
            metrics.nats_event(name);
            if let (Some((health, _)), Event::ServerError(error)) = (&starting, &event) {
                health.server_refused(error.to_string().trim_start_matches("nats: "));
            }
            if let (Some((health, connecting)), Event::ClientError(error)) = (&starting, &event) {
                if connecting.load(Ordering::SeqCst) {
                    let cause = match error {
                        async_nats::ClientError::Other(cause) => cause.clone(),
                        other => other.to_string(),
                    };
                    health.set_phase(&format!("connecting to NATS: {cause}"));
                }
            }
            match event {
                Event::Connected => tracing::info!(event = name, "NATS connected"),
                // Closing is what a drained process does last; not a fault.
                Event::Closed => tracing::info!(event = name, "NATS connection closed"),
                _ => tracing::warn!(event = name, detail = %event, "NATS connection event"),
            }
        }
    })
}

/// Connects a fleet process to NATS at `url` with its role's `credentials` under the
/// client `name`, retrying the first connection and observing connection events, then
/// waits until connected. Until then `health`'s phase is `connecting to NATS`, with the
/// last attempt's failure once there is one. `None` when `stop` fired first.
pub async fn connect_nats(
    url: &str,
    credentials: &crate::credentials::NatsCredentials,
    name: String,
    metrics: crate::metrics::FleetMetrics,
    health: &Health,
    stop: &CancellationToken,
) -> Result<Option<async_nats::Client>, async_nats::ConnectError> {
    let options = credentials
        .apply(crate::failover::prefer_another_server(
            async_nats::ConnectOptions::new(),
        ))
        .name(name)
        .retry_on_initial_connect();
    let connecting = Arc::new(AtomicBool::new(true));
    let starting = Some((health.clone(), Arc::clone(&connecting)));
    let nats = observe_nats_starting(options, metrics, starting)
        .connect(crate::config::NatsUrls(url))
        .await?;
    let up = connected(&nats, stop).await;
    connecting.store(false, Ordering::SeqCst);
    Ok(up.then_some(nats))
}

/// The first delay between two attempts of [`connect_redis`]; it doubles up to
/// [`REDIS_RETRY_MAX`].
#[cfg(feature = "redis")]
const REDIS_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(100);
/// The longest delay between two attempts of [`connect_redis`].
#[cfg(feature = "redis")]
const REDIS_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(2);
/// How long one attempt of [`connect_redis`] may take.
#[cfg(feature = "redis")]
const REDIS_ATTEMPT: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects to the Redis `setting` names, retrying until it answers, as the NATS
/// connection is retried: Redis unreachable (or refusing the password) at start delays
/// readiness instead of ending the process. `health`'s phase is `connecting to Redis`,
/// with the last attempt's failure once there is one. A setting that cannot work (a bad
/// URL, an unreadable TLS file) is an error at once. `None` when `stop` fired first.
#[cfg(feature = "redis")]
pub async fn connect_redis(
    setting: &str,
    options: crate::redis_client::RedisOptions,
    health: &Health,
    stop: &CancellationToken,
) -> Result<Option<crate::redis_client::RedisConnection>, crate::redis_client::ConnectError> {
    use crate::redis_client::{connect, probe, ConnectError};
    health.set_phase("connecting to Redis");
    let mut delay = REDIS_RETRY_FIRST;
    loop {
        let attempt = async {
            probe(setting, &options).await?;
            connect(setting, options.clone()).await
        };
        let cause = tokio::select! {
            _ = stop.cancelled() => return Ok(None),
            attempt = tokio::time::timeout(REDIS_ATTEMPT, attempt) => {
                match attempt {
                    Ok(Ok(redis)) => return Ok(Some(redis)),
                    Ok(Err(ConnectError::Redis(error))) => error.to_string(),
                    Ok(Err(error)) => return Err(error),
                    Err(_) => format!("no answer within {} s", REDIS_ATTEMPT.as_secs()),
                }
            }
        };
        tracing::warn!(%cause, retry_in_ms = delay.as_millis() as u64, "Redis not reached; retrying");
        health.set_phase(&format!("connecting to Redis: {cause}"));
        tokio::select! {
            _ = stop.cancelled() => return Ok(None),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(REDIS_RETRY_MAX);
    }
}

/// Waits until `nats` is connected, or `stop`; `false` when stopped first.
pub async fn connected(nats: &async_nats::Client, stop: &CancellationToken) -> bool {
    while nats.connection_state() != async_nats::connection::State::Connected {
        tokio::select! {
            _ = stop.cancelled() => return false,
            _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
        }
    }
    true
}

/// The text of a panic payload.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_task_fails_liveness_and_a_stopped_one_does_not() {
        let health = Health::starting("connecting to NATS");
        assert_eq!(
            health.readiness().await,
            Err("connecting to NATS".to_string())
        );
        let (tracker, stop) = (TaskTracker::new(), CancellationToken::new());
        let stopping = stop.clone();
        health.supervise(&tracker, "quiet", &stop, async move {
            stopping.cancelled().await;
        });
        health.supervise(&tracker, "boom", &stop, async {
            panic!("semaphore too large");
        });
        tracker.close();
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while health.liveness().is_ok() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .ok();
        assert!(health.liveness().is_err());
        stop.cancel();
        tracker.wait().await;
        let why = health.liveness().err().unwrap_or_default();
        assert!(why.contains("boom") && !why.contains("quiet"), "{why}");
    }

    #[tokio::test]
    async fn draining_fails_readiness() {
        let health = Health::default();
        health.set_readiness(Arc::new(|| Box::pin(async { Ok(()) })));
        assert_eq!(health.readiness().await, Ok(()));
        health.start_draining();
        assert_eq!(health.readiness().await, Err("draining".to_string()));
        assert!(health.liveness().is_ok());
    }

    #[tokio::test]
    async fn serves_health_readiness_and_404() -> Result<(), Box<dyn std::error::Error>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ready: Readiness = Arc::new(|| Box::pin(async { Err("redis down".to_string()) }));
        let health = Health::default();
        health.set_readiness(ready);
        let shutdown = CancellationToken::new();
        let addr = crate::http::serve(
            "127.0.0.1:0".parse()?,
            ops_handler(health),
            shutdown.clone(),
        )
        .await?;
        for (path, want) in [("/healthz", "200"), ("/readyz", "503"), ("/nope", "404")] {
            let mut stream = tokio::net::TcpStream::connect(addr).await?;
            stream
                .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await?;
            let mut out = String::new();
            tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut out)).await??;
            assert!(
                out.starts_with(&format!("HTTP/1.1 {want}")),
                "{path}: {out}"
            );
        }
        shutdown.cancel();
        Ok(())
    }
}
