//! The frontend client: submit a turn, stream its events to `final`, list the catalog.
//!
//! Owns what a NATS frontend does: the request it publishes, the inbox it listens on,
//! reading events until `final` or `error`, and the catalog request. Never touches Redis
//! or JetStream, and never holds a turn's state: the coordinator does.

use std::time::Duration;

use async_nats::HeaderMap;
use futures::StreamExt;
use serde_json::Value;

use crate::credentials::NatsCredentials;
use crate::names::{self, Names};
use crate::tool::{CatalogFormat, CatalogRequest, CatalogResponse};
use crate::turn::{valid_turn_id, FinalEvent, TurnEvent, TurnRequest};

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
    names: Names,
    /// The subject turns are submitted on: `<p>.turns.submit.<user>` for a client with a
    /// NATS user (the coordinator then sends events only to `_INBOX_<user>.…`), else
    /// `<p>.turns.submit`.
    submit_subject: String,
}

impl FleetClient {
    /// Wraps an existing NATS connection without a user: turns go to the unidentified
    /// subject.
    pub fn new(nats: async_nats::Client, names: Names) -> Self {
        let submit_subject = names.turn_submit();
        Self {
            nats,
            names,
            submit_subject,
        }
    }

    /// Wraps a connection made as NATS user `frontend` (with inbox prefix
    /// `_INBOX_<frontend>`): turns go to that user's own submit subject.
    pub fn new_as(nats: async_nats::Client, names: Names, frontend: &str) -> Self {
        let submit_subject = names.turn_submit_as(frontend);
        Self {
            nats,
            names,
            submit_subject,
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
            .apply(async_nats::ConnectOptions::new().name("toolfleet-client"))
            .connect(url)
            .await
            .map_err(|e| ClientError::new(ClientErrorKind::Connect, e.to_string()))?;
        let names = Names::new(prefix);
        Ok(match &credentials.user {
            Some(user) => Self::new_as(nats, names, user),
            None => Self::new(nats, names),
        })
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
            Some(id) if valid_turn_id(&id) => id,
            Some(id) => {
                return Err(ClientError::new(
                    ClientErrorKind::InvalidRequest,
                    format!("turn id {id:?} must be 1-64 characters of [A-Za-z0-9_-]"),
                ))
            }
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        request.turn_id = Some(turn_id.clone());
        let payload = serde_json::to_vec(&request)
            .map_err(|e| ClientError::new(ClientErrorKind::InvalidRequest, e.to_string()))?;
        let max = self.nats.server_info().max_payload;
        if max > 0 && payload.len() > max {
            return Err(ClientError::new(
                ClientErrorKind::PayloadTooLarge,
                format!(
                    "turn request is {} bytes, server max_payload is {max}",
                    payload.len()
                ),
            ));
        }
        let inbox = self.nats.new_inbox();
        let subscriber = self
            .nats
            .subscribe(inbox.clone())
            .await
            .map_err(|e| ClientError::new(ClientErrorKind::Publish, e.to_string()))?;
        headers.insert(names::HEADER_TURN_ID, turn_id.as_str());
        if headers.get(names::HEADER_TRACEPARENT).is_none() {
            crate::telemetry::inject_current(&mut headers);
        }
        self.nats
            .publish_with_reply_and_headers(
                self.submit_subject.clone(),
                inbox,
                headers,
                payload.into(),
            )
            .await
            .map_err(|e| ClientError::new(ClientErrorKind::Publish, e.to_string()))?;
        self.nats
            .flush()
            .await
            .map_err(|e| ClientError::new(ClientErrorKind::Publish, e.to_string()))?;
        Ok(TurnStream {
            turn_id,
            subscriber,
            finished: false,
        })
    }

    /// Submits a turn and waits for its `final` event, collecting every event.
    /// `timeout` bounds the wait for each event.
    pub async fn run_turn(
        &self,
        request: TurnRequest,
        timeout: Duration,
    ) -> Result<TurnOutcome, ClientError> {
        let mut stream = self.submit(request).await?;
        let mut events = Vec::new();
        loop {
            let event = stream.next_event(timeout).await?;
            match event {
                TurnEvent::Final(fin) => {
                    let fin = fin.clone();
                    events.push(TurnEvent::Final(fin.clone()));
                    return Ok(TurnOutcome {
                        turn_id: stream.turn_id,
                        events,
                        final_event: fin,
                    });
                }
                TurnEvent::Error { error, .. } => {
                    return Err(ClientError::new(
                        ClientErrorKind::TurnFailed,
                        format!("{}: {}", error.code, error.message),
                    ));
                }
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
            self.nats.request(self.names.catalog(), body.into()),
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

/// The events of one submitted turn.
#[derive(Debug)]
pub struct TurnStream {
    turn_id: String,
    subscriber: async_nats::Subscriber,
    finished: bool,
}

impl TurnStream {
    /// The turn's id.
    pub fn turn_id(&self) -> &str {
        &self.turn_id
    }

    /// The next event, waiting at most `timeout`. After `final` or `error` the stream is
    /// finished and further calls return a `Closed` error.
    pub async fn next_event(&mut self, timeout: Duration) -> Result<TurnEvent, ClientError> {
        if self.finished {
            return Err(ClientError::new(
                ClientErrorKind::Closed,
                "turn already ended",
            ));
        }
        let message = tokio::time::timeout(timeout, self.subscriber.next())
            .await
            .map_err(|_| {
                ClientError::new(
                    ClientErrorKind::Timeout,
                    format!("no event for turn {} within {timeout:?}", self.turn_id),
                )
            })?
            .ok_or_else(|| ClientError::new(ClientErrorKind::Closed, "subscription closed"))?;
        let event: TurnEvent = serde_json::from_slice(&message.payload)
            .map_err(|e| ClientError::new(ClientErrorKind::Decode, e.to_string()))?;
        if event.is_last() {
            self.finished = true;
            let _ = self.subscriber.unsubscribe().await;
        }
        Ok(event)
    }
}
