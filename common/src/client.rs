//! The frontend client: submit a turn, stream its events to `final`, attach to a turn
//! by id, list the catalog.
//!
//! Owns what a NATS frontend does: the request it publishes, the inbox it listens on,
//! reading events until `final` or `error` in `seq` order (duplicates dropped, gaps
//! filled by attaching), resubmitting the same turn id while no acceptance arrives, and
//! attaching again after a silence (a NATS restart, a lost publish). Never touches Redis
//! or JetStream, and never holds a turn's state: the coordinator does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::Value;

use crate::call::CallError;
use crate::credentials::NatsCredentials;
use crate::failover::Failover;
use crate::names::{self, Names};
use crate::tool::{CatalogFormat, CatalogRequest, CatalogResponse};
use crate::turn::{
    seq_of, turn_codes, valid_turn_id, AttachRequest, CancelOutcome, CancelReply, CancelRequest,
    FinalEvent, TurnEvent, TurnRequest,
};

/// Silence after which a stream asks again: it resubmits a turn not yet accepted, or
/// attaches to an accepted one from the last `seq` it holds. Doubles up to
/// [`PROBE_MAX`] while nothing arrives, and stays at this once an accepted turn is past
/// its deadline (its `final` is due).
pub const PROBE_START: Duration = Duration::from_millis(1000);

/// Longest silence between two probes of a stream.
pub const PROBE_MAX: Duration = Duration::from_secs(4);

/// Silence after which a stream whose turn is not yet accepted takes its client to
/// another NATS server of the cluster: any live coordinator acknowledges at once, so
/// nothing at all (not even "no responders") means this server is cut off from them.
pub const FAILOVER_UNACCEPTED: Duration = Duration::from_millis(2500);

/// For an accepted turn, how long past its deadline a silent stream waits before taking
/// its client to another server (the turn must have ended by then).
pub const FAILOVER_PAST_DEADLINE: Duration = Duration::from_secs(2);

/// How long making the standby connection may take before a stream gives up on it for
/// now (and asks through its own connection alone).
const STANDBY_CONNECT: Duration = Duration::from_secs(1);

/// Least time between two attempts to make the standby connection, and between two
/// moves of it off the server the client's own connection is on.
const STANDBY_RETRY: Duration = Duration::from_secs(1);

/// How long a `final` heard through the standby connection alone waits for its copy
/// through the client's own connection before that connection counts as cut off.
const OWN_COPY_WAIT: Duration = Duration::from_millis(250);

/// The deadline assumed for a turn whose request names none (the coordinators' default
/// `TOOLFLEET_DEFAULT_DEADLINE_MS`).
const ASSUMED_DEADLINE: Duration = Duration::from_secs(15);

/// How long one cancel request waits for its answer.
const CANCEL_TRY: Duration = Duration::from_secs(2);

/// Wait before a cancel request is sent again (no coordinator answered, or the turn
/// store was unavailable).
const CANCEL_RETRY: Duration = Duration::from_millis(200);

/// What went wrong in a client operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientErrorKind {
    /// The NATS connection could not be made.
    Connect,
    /// The request could not be encoded or is invalid (e.g. a bad turn id).
    InvalidRequest,
    /// The request is larger than the server's `max_payload`.
    PayloadTooLarge,
    /// Publishing or subscribing failed.
    Publish,
    /// No event (or reply) arrived in time.
    Timeout,
    /// No coordinator is listening.
    NoResponders,
    /// An event or reply could not be decoded.
    Decode,
    /// The event stream ended before `final`.
    Closed,
    /// The turn ended with an `error` event.
    TurnFailed,
}

/// A client error with its kind; match on [`ClientError::kind`], not on the message.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct ClientError {
    kind: ClientErrorKind,
    message: String,
}

impl ClientError {
    fn new(kind: ClientErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> ClientErrorKind {
        self.kind
    }
}

/// A cheap, cloneable handle for frontends.
#[derive(Debug, Clone)]
pub struct FleetClient {
    nats: async_nats::Client,
    /// Moves the connection to another server when this one is cut off.
    failover: Failover,
    /// The subject turns are submitted on: `<p>.turns.submit.<user>` for a client with a
    /// NATS user (the coordinator then sends events only to `_INBOX_<user>.…`), else
    /// `<p>.turns.submit`.
    submit_subject: String,
    /// Where this client attaches to its turns (`<p>.turns.attach[.<user>]`).
    attach_subject: String,
    /// Where this client cancels its turns (`<p>.turns.cancel[.<user>]`).
    cancel_subject: String,
    /// Where this client asks for the tool catalog (`<p>.catalog[.<user>]`).
    catalog_subject: String,
    /// On a cluster: the second connection silent turns also ask through.
    standby: Option<Arc<Standby>>,
}

impl FleetClient {
    /// Wraps an existing NATS connection without a user: turns go to the unidentified
    /// subject.
    pub fn new(nats: async_nats::Client, names: Names) -> Self {
        Self::for_user(nats, &names, None)
    }

    /// Wraps a connection made as NATS user `frontend` (with inbox prefix
    /// `_INBOX_<frontend>`): turns go to that user's own submit subject.
    pub fn new_as(nats: async_nats::Client, names: Names, frontend: &str) -> Self {
        Self::for_user(nats, &names, Some(frontend))
    }

    /// Wraps `nats`, sending on the subjects of NATS user `frontend`, or on the
    /// unidentified ones without a user.
    fn for_user(nats: async_nats::Client, names: &Names, frontend: Option<&str>) -> Self {
        let subject = |plain: fn(&Names) -> String, own: fn(&Names, &str) -> String| {
            frontend.map_or_else(|| plain(names), |user| own(names, user))
        };
        Self {
            failover: Failover::of(&nats, false),
            nats,
            submit_subject: subject(Names::turn_submit, Names::turn_submit_as),
            attach_subject: subject(Names::turn_attach, Names::turn_attach_as),
            cancel_subject: subject(Names::turn_cancel, Names::turn_cancel_as),
            catalog_subject: subject(Names::catalog, Names::catalog_as),
            standby: None,
        }
    }

    /// Connects to NATS at `url`, using names under `prefix`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, ClientError> {
        Self::connect_with(url, prefix, &NatsCredentials::none()).await
    }

    /// Like [`FleetClient::connect`], authenticating with `credentials`; turn events and
    /// catalog replies arrive on the credentials' inbox prefix.
    pub async fn connect_with(
        url: &str,
        prefix: &str,
        credentials: &NatsCredentials,
    ) -> Result<Self, ClientError> {
        let nats = credentials
            .apply(crate::failover::prefer_another_server(
                async_nats::ConnectOptions::new().name("toolfleet-client"),
            ))
            .connect(crate::config::NatsUrls(url))
            .await
            .map_err(|e| ClientError::new(ClientErrorKind::Connect, e.to_string()))?;
        let names = Names::new(prefix);
        let mut client = match &credentials.user {
            Some(user) => Self::new_as(nats, names, user),
            None => Self::new(nats, names),
        };
        client.failover = Failover::for_urls(&client.nats, url);
        if client.failover.clustered {
            client = client.with_standby(url, credentials.clone());
        }
        Ok(client)
    }

    /// Gives the client a standby connection to the NATS servers of `urls`, made with
    /// `credentials` the first time a turn goes silent too long, on another server than
    /// the client's own. A silent turn then asks through both connections and hears its
    /// events on whichever server reaches a coordinator: one server cut off from its
    /// cluster (it keeps its clients and swallows what they publish) no longer silences
    /// the turn until the client's connection moves. The client's own connection still
    /// moves when a turn stays silent longer.
    pub fn with_standby(mut self, urls: &str, credentials: NatsCredentials) -> Self {
        self.standby = Some(Arc::new(Standby {
            urls: urls.to_string(),
            credentials,
            conn: Default::default(),
        }));
        self
    }

    /// The underlying NATS client.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// Submits a turn and returns the stream of its events. A turn id is generated when
    /// the request has none.
    pub async fn submit(&self, request: TurnRequest) -> Result<TurnStream, ClientError> {
        self.submit_with_headers(request, HeaderMap::new()).await
    }

    /// Like [`FleetClient::submit`], with extra NATS headers. Unless `headers` already
    /// carry a `traceparent`, the current span's trace context is injected, so the turn
    /// becomes a child of the caller's span.
    pub async fn submit_with_headers(
        &self,
        mut request: TurnRequest,
        mut headers: HeaderMap,
    ) -> Result<TurnStream, ClientError> {
        let turn_id = match request.turn_id.take() {
            Some(id) => checked_turn_id(id)?,
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        request.turn_id = Some(turn_id.clone());
        let encode = |request: &TurnRequest| {
            serde_json::to_vec(request)
                .map_err(|e| ClientError::new(ClientErrorKind::InvalidRequest, e.to_string()))
        };
        let mut payload = encode(&request)?;
        let max = self.nats.server_info().max_payload;
        if max > 0 && payload.len() > max {
            // The calls whose arguments do not fit fail alone (`arguments_too_large`).
            let rest = payload.len() - serde_json::to_vec(&request.decision).map_or(0, |d| d.len());
            // Headers (trace context, turn id) ride in the same message.
            let room = max.saturating_sub(rest + 4096);
            let len = |d: &Value| serde_json::to_vec(d).map_or(usize::MAX, |d| d.len());
            if crate::oversize::fit_decision(&mut request.decision, room, len).is_some() {
                payload = encode(&request)?;
            }
        }
        if max > 0 && payload.len() > max {
            return Err(ClientError::new(
                ClientErrorKind::PayloadTooLarge,
                format!(
                    "turn request is {} bytes, server max_payload is {max}",
                    payload.len()
                ),
            ));
        }
        headers.insert(names::HEADER_TURN_ID, turn_id.as_str());
        if headers.get(names::HEADER_TRACEPARENT).is_none() {
            crate::telemetry::inject_current(&mut headers);
        }
        let submission = Submission {
            subject: self.submit_subject.clone(),
            headers,
            payload: payload.into(),
        };
        let mut stream = self.stream(turn_id, Some(submission)).await?;
        if let Some(ms) = request.deadline_ms {
            stream.deadline = Duration::from_millis(ms);
        }
        stream.ask().await?;
        Ok(stream)
    }

    /// Follows turn `turn_id`, submitted earlier by this frontend: its stored events from
    /// the first (`ack`), then its later ones, until `final`. A finished turn replays to
    /// its `final` at once; an id this frontend never submitted, or one past its
    /// retention, ends with an `error` event whose code is `unknown_turn`.
    pub async fn attach(&self, turn_id: &str) -> Result<TurnStream, ClientError> {
        self.attach_from(turn_id, None, 0).await
    }

    /// Like [`FleetClient::attach`], from the event after `after_seq` (the last one the
    /// caller holds, such as an SSE `Last-Event-ID`), for `tenant` when this frontend
    /// serves several: this frontend's turn of another tenant ends the stream with an
    /// `error` whose code is `tenant_not_allowed`.
    pub async fn attach_from(
        &self,
        turn_id: &str,
        tenant: Option<&str>,
        after_seq: u64,
    ) -> Result<TurnStream, ClientError> {
        let mut stream = self.stream(checked_turn_id(turn_id)?, None).await?;
        stream.tenant = tenant.map(str::to_string);
        stream.next_seq = after_seq.saturating_add(1);
        stream.resumed_from = after_seq;
        stream.ask().await?;
        Ok(stream)
    }

    /// Cancels turn `turn_id`, submitted earlier by this frontend (for `tenant`, when
    /// this frontend serves several): the turn ends at once with one `final` in which
    /// every call without a result is `cancelled`, sent to whoever follows the turn.
    /// Idempotent: a turn that already ended is left as it is
    /// ([`CancelOutcome::AlreadyEnded`]). Asked again while no coordinator answers or
    /// the turn store is unavailable, until `timeout`.
    pub async fn cancel(
        &self,
        turn_id: &str,
        tenant: Option<&str>,
        timeout: Duration,
    ) -> Result<CancelReply, ClientError> {
        let request = CancelRequest {
            turn_id: checked_turn_id(turn_id)?,
            tenant_id: tenant.map(str::to_string),
        };
        let body = serde_json::to_vec(&request)
            .map_err(|e| ClientError::new(ClientErrorKind::InvalidRequest, e.to_string()))?;
        let until = tokio::time::Instant::now() + timeout;
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let asked = tokio::time::timeout(
                left.min(CANCEL_TRY),
                self.nats
                    .request(self.cancel_subject.clone(), body.clone().into()),
            )
            .await;
            let failure = match asked {
                Ok(Ok(message)) => {
                    let reply: CancelReply = serde_json::from_slice(&message.payload)
                        .map_err(|e| ClientError::new(ClientErrorKind::Decode, e.to_string()))?;
                    if reply.outcome != CancelOutcome::Unavailable {
                        return Ok(reply);
                    }
                    ClientError::new(ClientErrorKind::TurnFailed, "the turn store is unavailable")
                }
                Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                    ClientError::new(ClientErrorKind::NoResponders, e.to_string())
                }
                Ok(Err(e)) => ClientError::new(ClientErrorKind::Publish, e.to_string()),
                Err(_) => ClientError::new(ClientErrorKind::Timeout, "no cancel answer in time"),
            };
            if tokio::time::Instant::now() + CANCEL_RETRY >= until {
                return Err(failure);
            }
            tokio::time::sleep(CANCEL_RETRY).await;
        }
    }

    /// A stream of `turn_id`'s events on a new inbox.
    async fn stream(
        &self,
        turn_id: String,
        submission: Option<Submission>,
    ) -> Result<TurnStream, ClientError> {
        let inbox = self.nats.new_inbox();
        let subscriber = self
            .nats
            .subscribe(inbox.clone())
            .await
            .map_err(|e| ClientError::new(ClientErrorKind::Publish, e.to_string()))?;
        Ok(TurnStream {
            turn_id,
            subscriber,
            finished: false,
            nats: self.nats.clone(),
            inbox,
            submission,
            attach_subject: self.attach_subject.clone(),
            tenant: None,
            next_seq: 1,
            resumed_from: 0,
            early: BTreeMap::new(),
            probe: PROBE_START,
            refusal: None,
            asks: 0,
            no_responders: 0,
            failover: self.failover.clone(),
            started: tokio::time::Instant::now(),
            heard: tokio::time::Instant::now(),
            heard_own: tokio::time::Instant::now(),
            heard_through_standby: false,
            deadline: ASSUMED_DEADLINE,
            standby: self.standby.clone(),
            backup: None,
        })
    }

    /// Submits a turn and waits for its `final` event, collecting every event.
    /// `timeout` bounds the wait for each event.
    ///
    /// A turn refused with the retryable `overloaded` (the fleet shedding load: its
    /// Redis nearly full, or the tenant past its limits) was never stored, so it is
    /// submitted again, with the same turn id, once the `retry_after_ms` the refusal
    /// names has passed ([`OVERLOADED_WAIT`] when it names none), for at most
    /// `timeout` of waiting in all; then the refusal is the answer.
    pub async fn run_turn(
        &self,
        request: TurnRequest,
        timeout: Duration,
    ) -> Result<TurnOutcome, ClientError> {
        let mut request = request;
        request
            .turn_id
            .get_or_insert_with(|| uuid::Uuid::new_v4().simple().to_string());
        let mut waited = Duration::ZERO;
        loop {
            match self.run_once(request.clone(), timeout).await? {
                Ran::Ended(outcome) => return Ok(outcome),
                Ran::Refused(error) => {
                    let wait = match overloaded_wait(&error) {
                        Some(wait) if waited + wait <= timeout => wait,
                        _ => {
                            return Err(ClientError::new(
                                ClientErrorKind::TurnFailed,
                                format!("{}: {}", error.code, error.message),
                            ))
                        }
                    };
                    tokio::time::sleep(wait).await;
                    waited += wait;
                }
            }
        }
    }

    /// One submission of `request`, to its `final` or its `error`.
    async fn run_once(&self, request: TurnRequest, timeout: Duration) -> Result<Ran, ClientError> {
        let mut stream = self.submit(request).await?;
        let mut events = Vec::new();
        loop {
            match stream.next_event(timeout).await? {
                TurnEvent::Final(fin) => {
                    events.push(TurnEvent::Final(fin.clone()));
                    return Ok(Ran::Ended(TurnOutcome {
                        turn_id: stream.turn_id,
                        events,
                        final_event: fin,
                    }));
                }
                TurnEvent::Error { error, .. } => return Ok(Ran::Refused(error)),
                other => events.push(other),
            }
        }
    }

    /// The tool catalog in `format`, optionally restricted to one tenant's tools.
    pub async fn catalog(
        &self,
        format: CatalogFormat,
        tenant_id: Option<String>,
        timeout: Duration,
    ) -> Result<Vec<Value>, ClientError> {
        let body = serde_json::to_vec(&CatalogRequest { format, tenant_id })
            .map_err(|e| ClientError::new(ClientErrorKind::InvalidRequest, e.to_string()))?;
        let reply = tokio::time::timeout(
            timeout,
            self.nats.request(self.catalog_subject.clone(), body.into()),
        )
        .await
        .map_err(|_| ClientError::new(ClientErrorKind::Timeout, "no catalog reply in time"))?
        .map_err(|e| {
            let kind = match e.kind() {
                async_nats::RequestErrorKind::NoResponders => ClientErrorKind::NoResponders,
                async_nats::RequestErrorKind::TimedOut => ClientErrorKind::Timeout,
                async_nats::RequestErrorKind::MaxPayloadExceeded => {
                    ClientErrorKind::PayloadTooLarge
                }
                _ => ClientErrorKind::Publish,
            };
            ClientError::new(kind, e.to_string())
        })?;
        let response: CatalogResponse = serde_json::from_slice(&reply.payload)
            .map_err(|e| ClientError::new(ClientErrorKind::Decode, e.to_string()))?;
        if let Some(error) = response.error {
            return Err(ClientError::new(
                ClientErrorKind::InvalidRequest,
                format!("{}: {}", error.code, error.message),
            ));
        }
        Ok(response.tools)
    }
}

/// How long [`FleetClient::run_turn`] waits before submitting again a turn refused with
/// `overloaded` that names no `retry_after_ms`.
pub const OVERLOADED_WAIT: Duration = Duration::from_secs(1);

/// How one submission of a turn ended.
enum Ran {
    /// With its `final`.
    Ended(TurnOutcome),
    /// With its `error`.
    Refused(CallError),
}

/// How long to wait before submitting again a turn refused with `error`: only for the
/// retryable `overloaded`, which is refused before the turn is stored.
fn overloaded_wait(error: &CallError) -> Option<Duration> {
    (error.code == turn_codes::OVERLOADED && error.retryable).then(|| {
        error
            .retry_after_ms
            .map_or(OVERLOADED_WAIT, Duration::from_millis)
    })
}

/// Every event of a finished turn.
#[derive(Debug, Clone)]
pub struct TurnOutcome {
    /// The turn id.
    pub turn_id: String,
    /// Every event in arrival order, `final` last.
    pub events: Vec<TurnEvent>,
    /// The `final` event.
    pub final_event: FinalEvent,
}

impl TurnOutcome {
    /// The `narration` chunks in arrival order.
    pub fn narration(&self) -> Vec<&str> {
        fn text(event: &TurnEvent) -> Option<&str> {
            match event {
                TurnEvent::Narration { text, .. } => Some(text.as_str()),
                _ => None,
            }
        }
        self.events.iter().filter_map(text).collect()
    }
}

/// A clustered client's second NATS connection, shared by its streams: made on first
/// need, kept on another server than the client's own connection.
#[derive(Debug)]
struct Standby {
    /// The servers to connect to (the client's own list).
    urls: String,
    /// The client's own credentials: the standby reads the same inboxes.
    credentials: NatsCredentials,
    conn: tokio::sync::Mutex<StandbyConn>,
}

/// The standby connection once made, and when it was last tried or moved.
#[derive(Debug, Default)]
struct StandbyConn {
    client: Option<async_nats::Client>,
    tried: Option<tokio::time::Instant>,
    moved: Option<tokio::time::Instant>,
}

impl Standby {
    /// The standby connection, made now if it was not yet (within [`STANDBY_CONNECT`],
    /// at most once per [`STANDBY_RETRY`]); none while it cannot be made. One on the
    /// same server as `own` is moved to another (it avoids its last server).
    async fn client(&self, own: &async_nats::Client) -> Option<async_nats::Client> {
        let mut conn = self.conn.lock().await;
        let now = tokio::time::Instant::now();
        if conn.client.is_none() {
            if conn.tried.is_some_and(|at| now - at < STANDBY_RETRY) {
                return None;
            }
            conn.tried = Some(now);
            let connect = self
                .credentials
                .apply(crate::failover::prefer_another_server(
                    async_nats::ConnectOptions::new().name("toolfleet-client-standby"),
                ))
                .connect(crate::config::NatsUrls(&self.urls));
            match tokio::time::timeout(STANDBY_CONNECT, connect).await {
                Ok(Ok(client)) => conn.client = Some(client),
                Ok(Err(error)) => {
                    tracing::debug!(%error, "the standby NATS connection could not be made");
                    return None;
                }
                Err(_) => return None,
            }
        }
        let client = conn.client.clone()?;
        let on_own = || client.server_info().server_id == own.server_info().server_id;
        if on_own() && conn.moved.is_none_or(|at| now - at >= STANDBY_RETRY) {
            conn.moved = Some(now);
            let _ = client.force_reconnect().await;
            // What is sent before the move lands would go to the server the standby is
            // there to avoid: wait for the next server's `INFO`.
            let landed = async {
                while on_own() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            if tokio::time::timeout(STANDBY_CONNECT, landed).await.is_err() {
                tracing::debug!("the standby NATS connection did not move off the client's server");
            }
        }
        Some(client)
    }
}

/// A stream's subscription to its inbox through the standby connection.
#[derive(Debug)]
struct Backup {
    nats: async_nats::Client,
    subscriber: async_nats::Subscriber,
    /// When the stream called the standby in.
    since: tokio::time::Instant,
}

/// A turn request as published, kept to publish it again while no acceptance arrives.
#[derive(Debug, Clone)]
struct Submission {
    subject: String,
    headers: HeaderMap,
    payload: Bytes,
}

/// The events of one submitted (or attached) turn, in `seq` order.
#[derive(Debug)]
pub struct TurnStream {
    turn_id: String,
    subscriber: async_nats::Subscriber,
    finished: bool,
    nats: async_nats::Client,
    inbox: String,
    /// The request, until the turn is accepted (its first stored event arrives).
    submission: Option<Submission>,
    attach_subject: String,
    /// The tenant attach requests name (a frontend serving several tenants).
    tenant: Option<String>,
    /// The `seq` of the next event to hand out; every lower one was handed out.
    next_seq: u64,
    /// The `seq` the stream was attached after (0: from the first event).
    resumed_from: u64,
    /// Events that arrived ahead of a gap, by `seq`.
    early: BTreeMap<u64, TurnEvent>,
    /// The current silence before the next probe.
    probe: Duration,
    /// The last retryable refusal of the submission (`unavailable`): the request is
    /// submitted again, and this is handed out only if the wait ends without acceptance.
    refusal: Option<TurnEvent>,
    /// The client's server mover.
    failover: Failover,
    /// When the stream began.
    started: tokio::time::Instant,
    /// When a coordinator was last heard (an event or a refusal).
    heard: tokio::time::Instant,
    /// When anything last arrived through the client's own connection.
    heard_own: tokio::time::Instant,
    /// Whether an event reached the stream through the standby before any copy of it
    /// through the client's own connection.
    heard_through_standby: bool,
    /// The client's standby connection, when it has one.
    standby: Option<Arc<Standby>>,
    /// The inbox's subscription through the standby, once the turn went silent too long.
    backup: Option<Backup>,
    /// The turn's budget: its `ack`'s `deadline_ms` once handed out, else the request's,
    /// else the coordinators' default.
    deadline: Duration,
    /// Asks sent: the submission and each time it was sent again, or each attach.
    asks: u32,
    /// Answers of NATS for the coordinators that no coordinator listened.
    no_responders: u32,
}

impl TurnStream {
    /// The turn's id.
    pub fn turn_id(&self) -> &str {
        &self.turn_id
    }

    /// Whether the turn was accepted: an event stored with it arrived.
    pub fn accepted(&self) -> bool {
        self.next_seq > self.resumed_from + 1
    }

    /// The last `seq` handed out (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// How many times the stream asked for the turn: the submission and each time it
    /// was sent again, or each attach, whether or not the ask reached the server.
    pub fn asks(&self) -> u32 {
        self.asks
    }

    /// How many asks NATS answered with "no responders": no coordinator was
    /// subscribed when the ask arrived.
    pub fn no_responders(&self) -> u32 {
        self.no_responders
    }

    /// The turn's budget as the stream knows it: the `deadline_ms` of its `ack` once
    /// that was handed out, else the request's, else the coordinators' default (15 s).
    /// Past it, measured from the stream's start, a silent stream asks every
    /// [`PROBE_START`] for the `final` that is due.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Whether an event of this turn reached the stream through the client's standby
    /// connection before (or without) its copy through the client's own: the turn was
    /// silent too long on the client's own server ([`FleetClient::with_standby`]).
    pub fn heard_through_standby(&self) -> bool {
        self.heard_through_standby
    }

    /// The next event in `seq` order, waiting at most `timeout`. Duplicates are dropped;
    /// after a gap, or after [`PROBE_START`] of silence, the stream attaches again from
    /// the last `seq` it handed out (or, before acceptance, submits the same turn again).
    /// After `final` or `error` the stream is finished and further calls return a
    /// `Closed` error. An attach that finds an accepted turn gone (Redis lost it) ends the
    /// stream with `turn_state_lost`; one answered `unavailable` (the turn store failing
    /// over) is asked again, and that answer handed out only at the timeout.
    pub async fn next_event(&mut self, timeout: Duration) -> Result<TurnEvent, ClientError> {
        if self.finished {
            return Err(ClientError::new(
                ClientErrorKind::Closed,
                "turn already ended",
            ));
        }
        let until = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(event) = self.early.remove(&self.next_seq) {
                self.next_seq += 1;
                return Ok(self.hand_out(event).await);
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                if let Some(refusal) = self.refusal.take() {
                    return Ok(self.hand_out(refusal).await);
                }
                return Err(ClientError::new(
                    ClientErrorKind::Timeout,
                    format!("no event for turn {} within {timeout:?}", self.turn_id),
                ));
            }
            let wait = self.wait_from(now, until);
            let next = next_of(&mut self.subscriber, self.backup.as_mut());
            match tokio::time::timeout(wait, next).await {
                Ok((Some(message), through_backup)) => {
                    if !through_backup {
                        self.heard_own = tokio::time::Instant::now();
                    }
                    if let Some(event) = self.receive(message, through_backup).await {
                        return Ok(event);
                    }
                }
                Ok((None, true)) => {
                    // The standby's subscription ended: the stream goes on with its own.
                    self.backup = None;
                }
                Ok((None, false)) => {
                    return Err(ClientError::new(
                        ClientErrorKind::Closed,
                        "subscription closed",
                    ))
                }
                Err(_) if tokio::time::Instant::now() < until => {
                    // Within the caller's time: with NATS gone, an ask's flush waits for
                    // the connection to come back.
                    let _ = tokio::time::timeout_at(until, self.on_silence()).await;
                }
                Err(_) => {}
            }
        }
    }

    /// How long to wait for the next message from `now`: until the next probe or
    /// `until`, and, on a cluster, no later than the silence would make this server
    /// look cut off or call for the standby connection.
    fn wait_from(&self, now: tokio::time::Instant, until: tokio::time::Instant) -> Duration {
        let mut wait = self.probe.min(until - now);
        if self.failover.clustered {
            let standby_due = self.standby_wanted().then(|| self.standby_due());
            for due in std::iter::once(self.failover_due()).chain(standby_due) {
                if due > now + Duration::from_millis(10) {
                    wait = wait.min(due - now);
                }
            }
        }
        wait
    }

    /// A silent turn: calls in the standby connection, moves away from a cut-off
    /// server, asks again, then waits longer before the next ask.
    async fn on_silence(&mut self) {
        self.back_up_if_due().await;
        let moved = self.move_if_cut_off().await;
        let _ = self.ask().await;
        // Silence is normal while calls run; past the deadline the `final` is due, and a
        // probe that found no route (a partition healing) is repeated at once rather
        // than 4 s later.
        self.probe = if moved || self.overdue() {
            PROBE_START
        } else {
            (self.probe * 2).min(PROBE_MAX)
        };
    }

    /// Takes in one message of the inbox (`through_backup`: it came through the
    /// standby): the event to hand out now, if it is one; duplicates are dropped, early
    /// events held (and the gap attached for), a retryable refusal kept for the timeout.
    async fn receive(
        &mut self,
        message: async_nats::Message,
        through_backup: bool,
    ) -> Option<TurnEvent> {
        if let Some(status) = message.status {
            // NATS answered for the coordinators (no responders while none listens): the
            // next probe asks again.
            if status == async_nats::StatusCode::NO_RESPONDERS {
                self.no_responders += 1;
            }
            return None;
        }
        // Only coordinators answer on a turn's inbox; anything else that reaches it (a
        // job a worker had delivered there) is not an event and is dropped.
        let Ok(event) = crate::turn::decode_event(&message.payload) else {
            tracing::debug!(subject = %message.subject, "a message that is not a turn event was dropped");
            return None;
        };
        self.probe = PROBE_START;
        self.heard = tokio::time::Instant::now();
        let seq = seq_of(&message.payload);
        if seq.is_none_or(|seq| seq >= self.next_seq) {
            self.heard_through_standby |= through_backup;
        }
        match seq {
            None if Self::is_retryable_refusal(&event) => {
                self.refusal = Some(event);
                None
            }
            None => Some(self.unstored(event).await),
            // A turn ends once, so its `final` or `error` is new to a stream that has
            // not ended, whatever its seq: a Redis that lost acknowledged writes when
            // it died (`appendfsync everysec` with a slow disk) numbers the turn's
            // later events again from below the seq this stream holds.
            Some(seq) if seq < self.next_seq && event.is_last() => Some(self.hand_out(event).await),
            Some(seq) if seq < self.next_seq => None,
            Some(seq) if seq == self.next_seq => {
                self.next_seq += 1;
                self.submission = None;
                Some(self.hand_out(event).await)
            }
            Some(seq) => {
                self.submission = None;
                self.early.insert(seq, event);
                // Bounded, as a probe is: the caller's wait goes on in `next_event`.
                let _ = tokio::time::timeout(PROBE_START, self.ask()).await;
                None
            }
        }
    }

    /// Whether the turn was accepted and its deadline has passed: its `final` is due.
    fn overdue(&self) -> bool {
        self.accepted() && self.started.elapsed() >= self.deadline
    }

    /// When the silence would have lasted longer than a healthy turn allows:
    /// [`FAILOVER_UNACCEPTED`] after the last word before acceptance, or the deadline +
    /// [`FAILOVER_PAST_DEADLINE`] (and a probe period of silence) after it.
    fn failover_due(&self) -> tokio::time::Instant {
        match self.accepted() {
            false => self.heard + FAILOVER_UNACCEPTED,
            true => (self.started + self.deadline + FAILOVER_PAST_DEADLINE)
                .max(self.heard + PROBE_START),
        }
    }

    /// Whether the stream would call in the client's standby connection once silent long
    /// enough: the client is on a cluster, has a standby and does not use it yet.
    fn standby_wanted(&self) -> bool {
        self.failover.clustered && self.standby.is_some() && self.backup.is_none()
    }

    /// When the silence calls in the standby connection: a probe period after the last
    /// word before acceptance (any live coordinator acknowledges at once), or after the
    /// deadline (the `final` is due) and a probe period of silence. Ahead of
    /// [`TurnStream::failover_due`], so a turn whose own server is cut off is heard
    /// through the standby before the client's connection moves.
    fn standby_due(&self) -> tokio::time::Instant {
        match self.accepted() {
            false => self.heard + PROBE_START,
            true => (self.started + self.deadline + PROBE_START).max(self.heard + PROBE_START),
        }
    }

    /// Subscribes the turn's inbox through the client's standby connection too, when
    /// the silence has lasted [`TurnStream::standby_due`]; from then on the stream asks
    /// through both connections and reads both (duplicates are dropped by `seq`).
    async fn back_up_if_due(&mut self) {
        if !self.standby_wanted() || tokio::time::Instant::now() < self.standby_due() {
            return;
        }
        let Some(standby) = self.standby.clone() else {
            return;
        };
        let Some(nats) = standby.client(&self.nats).await else {
            return;
        };
        match nats.subscribe(self.inbox.clone()).await {
            Ok(subscriber) => {
                tracing::debug!(
                    turn_id = %self.turn_id,
                    silent_ms = self.heard.elapsed().as_millis() as u64,
                    "no coordinator heard; asking through the standby NATS connection too"
                );
                self.backup = Some(Backup {
                    nats,
                    subscriber,
                    since: tokio::time::Instant::now(),
                });
            }
            Err(error) => tracing::debug!(%error, "could not subscribe through the standby"),
        }
    }

    /// Takes the client to another server of its cluster when no coordinator has been
    /// heard for longer than a healthy turn allows ([`TurnStream::failover_due`]). The
    /// reconnect is queued before the next probe, so that probe goes out through the new
    /// server (subscriptions follow the connection). Whether it moved.
    async fn move_if_cut_off(&mut self) -> bool {
        if tokio::time::Instant::now() < self.failover_due() || !self.failover.claim() {
            return false;
        }
        tracing::info!(
            turn_id = %self.turn_id,
            silent_ms = self.heard.elapsed().as_millis() as u64,
            "no coordinator heard through this NATS server; moving to another"
        );
        if let Err(error) = self.nats.force_reconnect().await {
            tracing::warn!(%error, "could not move to another NATS server");
            return false;
        }
        true
    }

    /// At the turn's last event: when nothing at all came through the client's own
    /// connection since the standby was called in, and the event's copy does not come
    /// through it within [`OWN_COPY_WAIT`] either, the client's own server is cut off
    /// (a reply reaches both subscriptions) and the connection moves to another server,
    /// at once rather than after [`TurnStream::failover_due`]'s silence on the next turn.
    async fn move_if_heard_through_standby_alone(&mut self) {
        let Some(backup) = &self.backup else {
            return;
        };
        if self.heard_own >= backup.since {
            return;
        }
        if let Ok(Some(_)) = tokio::time::timeout(OWN_COPY_WAIT, self.subscriber.next()).await {
            return;
        }
        if !self.failover.claim() {
            return;
        }
        tracing::info!(
            turn_id = %self.turn_id,
            "the turn was heard through the standby NATS connection alone; moving to another server"
        );
        if let Err(error) = self.nats.force_reconnect().await {
            tracing::warn!(%error, "could not move to another NATS server");
        }
    }

    /// Publishes the turn request again while it is not accepted, else an attach from
    /// the last `seq` handed out.
    async fn ask(&mut self) -> Result<(), ClientError> {
        self.asks += 1;
        if self.asks > 1 {
            // An event on the caller's span (`submit turn`): why a turn took longer
            // than its work.
            let kind = if self.submission.is_some() {
                "resubmit"
            } else {
                "attach"
            };
            tracing::info!(
                toolfleet.turn.id = %self.turn_id,
                toolfleet.ask.count = self.asks,
                toolfleet.ask.kind = kind,
                toolfleet.ask.after_seq = self.last_seq(),
                "asked for the turn again"
            );
        }
        // Through the standby first: the client's own connection may be the one that
        // is down, and its flush would hold the ask up until it reconnects.
        if let Some(backup) = &self.backup {
            let through = backup.nats.clone();
            match tokio::time::timeout(STANDBY_CONNECT, self.ask_through(&through)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, "could not ask through the standby connection")
                }
                Err(_) => tracing::debug!("the standby connection took no ask in time"),
            }
        }
        let own = self.nats.clone();
        self.ask_through(&own).await
    }

    /// Publishes the ask of [`TurnStream::ask`] through `nats` and flushes it.
    async fn ask_through(&self, nats: &async_nats::Client) -> Result<(), ClientError> {
        let publish = match &self.submission {
            Some(s) => {
                nats.publish_with_reply_and_headers(
                    s.subject.clone(),
                    self.inbox.clone(),
                    s.headers.clone(),
                    s.payload.clone(),
                )
                .await
            }
            None => {
                let request = AttachRequest {
                    turn_id: self.turn_id.clone(),
                    after_seq: self.last_seq(),
                    tenant_id: self.tenant.clone(),
                };
                let body = serde_json::to_vec(&request).map_err(|e| {
                    ClientError::new(ClientErrorKind::InvalidRequest, e.to_string())
                })?;
                nats.publish_with_reply(
                    self.attach_subject.clone(),
                    self.inbox.clone(),
                    body.into(),
                )
                .await
            }
        };
        publish.map_err(|e| ClientError::new(ClientErrorKind::Publish, e.to_string()))?;
        nats.flush()
            .await
            .map_err(|e| ClientError::new(ClientErrorKind::Publish, e.to_string()))
    }

    /// Whether `event` answers a submission or an attach with a passing reason (the
    /// turn store unavailable): the request is then sent again at the next probe, and
    /// the answer handed out only if nothing else comes before the caller's timeout. An
    /// accepted turn goes on while its store fails over; an attach that finds the store
    /// unavailable says nothing about how the turn ends.
    fn is_retryable_refusal(event: &TurnEvent) -> bool {
        matches!(event, TurnEvent::Error { error, .. }
            if error.retryable && error.code == turn_codes::UNAVAILABLE)
    }

    /// An event with no `seq`: the `error` of a request whose turn was never stored, or
    /// of an attach. `unknown_turn` for a turn this stream saw accepted means its state
    /// is gone.
    async fn unstored(&mut self, event: TurnEvent) -> TurnEvent {
        let event = match event {
            TurnEvent::Error { turn_id, mut error }
                if error.code == turn_codes::UNKNOWN_TURN && self.accepted() =>
            {
                error.code = turn_codes::TURN_STATE_LOST.to_string();
                error.message = format!(
                    "turn {} was accepted but its stored state is gone",
                    self.turn_id
                );
                TurnEvent::Error { turn_id, error }
            }
            other => other,
        };
        self.hand_out(event).await
    }

    /// Hands `event` out, closing the stream after the last one.
    async fn hand_out(&mut self, event: TurnEvent) -> TurnEvent {
        if let TurnEvent::Ack {
            deadline_ms: Some(ms),
            ..
        } = &event
        {
            // The budget the coordinator applied, which an attach (or a request that named
            // none, or one above the limits) cannot know otherwise.
            self.deadline = Duration::from_millis(*ms);
        }
        if event.is_last() {
            self.finished = true;
            self.move_if_heard_through_standby_alone().await;
            let _ = self.subscriber.unsubscribe().await;
            if let Some(mut backup) = self.backup.take() {
                let _ = backup.subscriber.unsubscribe().await;
            }
        }
        event
    }
}

/// The next message on `own` or, when there is one, on `backup`: whichever comes
/// first, and whether it came through `backup`. `None` when that subscription ended.
async fn next_of(
    own: &mut async_nats::Subscriber,
    backup: Option<&mut Backup>,
) -> (Option<async_nats::Message>, bool) {
    match backup {
        Some(backup) => tokio::select! {
            message = own.next() => (message, false),
            message = backup.subscriber.next() => (message, true),
        },
        None => (own.next().await, false),
    }
}

/// `turn_id` as the id of a request, or the refusal of an invalid one
/// ([`valid_turn_id`]), before anything is sent for it.
fn checked_turn_id(turn_id: impl Into<String>) -> Result<String, ClientError> {
    let turn_id = turn_id.into();
    if valid_turn_id(&turn_id) {
        return Ok(turn_id);
    }
    Err(ClientError::new(
        ClientErrorKind::InvalidRequest,
        format!("turn id {turn_id:?} must be 1-64 characters of [A-Za-z0-9_-]"),
    ))
}
