//! What a worker sent about one job: its acknowledgements on the consumer's `$JS.ACK`
//! subjects (matched by the job's stream sequence), the results on the turn's result
//! subjects and the progress notices of the turn, each with the time it was seen.
//!
//! Owns subscribing before the job is published and collecting until the job is done
//! with (`+ACK` or `+TERM`) or the wait ends. It judges nothing: the cases do.

use std::time::Duration;

use async_nats::{HeaderMap, Subscriber};
use bytes::Bytes;
use futures::StreamExt;
use tokio::time::Instant;

use super::probe::Probe;

/// How long to keep listening after the job was acked or terminated, to see a result
/// published out of order.
const SETTLE: Duration = Duration::from_millis(300);

/// An acknowledgement the worker sent for one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+ACK` (or an empty body).
    Ack,
    /// `-NAK`, with or without a delay.
    Nak {
        /// Whether it asked for a redelivery delay.
        delay: bool,
    },
    /// `+WPI`: still working.
    Progress,
    /// `+TERM`: never deliver again.
    Term,
    /// Anything else.
    Other(String),
}

/// One thing seen.
#[derive(Debug, Clone)]
pub enum Seen {
    /// An acknowledgement of delivery `delivered`.
    Reply {
        /// The delivery it acknowledges (1 for the first).
        delivered: u64,
        /// What it said.
        reply: Reply,
    },
    /// A result on one of the turn's result subjects.
    Result {
        /// The subject it was published on.
        subject: String,
        /// Its headers.
        headers: Option<HeaderMap>,
        /// Its body.
        body: Bytes,
    },
    /// A `started` progress notice.
    Started {
        /// The notice as JSON.
        notice: serde_json::Value,
    },
}

/// A [`Seen`] with the time since the job was published.
#[derive(Debug, Clone)]
pub struct Event {
    /// Since the job was published.
    pub after: Duration,
    /// What was seen.
    pub seen: Seen,
}

/// The subscriptions of one job.
pub struct Watch {
    acks: Subscriber,
    results: Subscriber,
    old_results: Subscriber,
    progress: Subscriber,
    sequence: u64,
    published: Instant,
    /// Everything seen so far, in order.
    pub events: Vec<Event>,
}

impl Watch {
    /// Subscribes to what the worker will send for turn `turn_id`.
    pub async fn start(probe: &Probe, turn_id: &str) -> Result<Self, async_nats::Error> {
        let names = &probe.names;
        let acks = format!(
            "$JS.ACK.{}.{}.>",
            names.jobs_stream(),
            names.tool_consumer(&probe.tool)
        );
        let watch = Self {
            acks: probe.nats.subscribe(acks).await?,
            results: probe
                .nats
                .subscribe(format!("{}.>", names.result_subject(turn_id)))
                .await?,
            old_results: probe.nats.subscribe(names.result_subject(turn_id)).await?,
            progress: probe
                .nats
                .subscribe(names.turn_progress_wildcard(turn_id))
                .await?,
            sequence: 0,
            published: Instant::now(),
            events: Vec::new(),
        };
        probe.nats.flush().await?;
        Ok(watch)
    }

    /// Publishes the job (`body` with `headers`) on the tool's subject through JetStream.
    pub async fn publish(
        &mut self,
        probe: &Probe,
        headers: HeaderMap,
        body: Vec<u8>,
    ) -> Result<(), async_nats::Error> {
        let subject = probe.names.job_subject(&probe.tool);
        let ack = probe
            .js
            .publish_with_headers(subject, headers, body.into())
            .await?
            .await?;
        self.sequence = ack.sequence;
        self.published = Instant::now();
        Ok(())
    }

    /// Collects until the job is acked or terminated (then [`SETTLE`] longer) or
    /// `timeout` from its publication passes; whether it was done with.
    pub async fn until_done(&mut self, timeout: Duration) -> bool {
        let done = self.until(timeout, is_done).await;
        if done {
            self.until(self.published.elapsed() + SETTLE, |_| false)
                .await;
        }
        done
    }

    /// Collects until `stop` holds for something seen or `timeout` from the job's
    /// publication passes; whether `stop` held.
    pub async fn until(&mut self, timeout: Duration, stop: impl Fn(&Seen) -> bool) -> bool {
        let end = self.published + timeout;
        while let Ok(Some(seen)) = tokio::time::timeout_at(end, self.next()).await {
            let stopped = stop(&seen);
            self.events.push(Event {
                after: self.published.elapsed(),
                seen,
            });
            if stopped {
                return true;
            }
        }
        false
    }

    /// The next thing seen about this job; `None` when a subscription closed.
    ///
    /// The server hands one connection a publisher's messages in the order they were
    /// published, but each subscription has its own queue: results and notices are
    /// taken before acknowledgements, so a result published before its ack is never
    /// seen after it.
    async fn next(&mut self) -> Option<Seen> {
        loop {
            let seen = tokio::select! {
                biased;
                m = self.results.next() => m.map(|m| Some(result_of(m))),
                m = self.old_results.next() => m.map(|m| Some(result_of(m))),
                m = self.progress.next() => m.map(|m| started_of(&m)),
                m = self.acks.next() => m.map(|m| reply_of(&m, self.sequence)),
            };
            match seen {
                None => return None,
                Some(Some(seen)) => return Some(seen),
                Some(None) => continue,
            }
        }
    }

    /// The replies seen, with their delivery and time.
    pub fn replies(&self) -> impl Iterator<Item = (Duration, u64, &Reply)> {
        self.events.iter().filter_map(|e| match &e.seen {
            Seen::Reply { delivered, reply } => Some((e.after, *delivered, reply)),
            _ => None,
        })
    }

    /// The results seen, with their time.
    pub fn results(&self) -> impl Iterator<Item = (Duration, &String, &Option<HeaderMap>, &Bytes)> {
        self.events.iter().filter_map(|e| match &e.seen {
            Seen::Result {
                subject,
                headers,
                body,
            } => Some((e.after, subject, headers, body)),
            _ => None,
        })
    }

    /// The `started` notices seen.
    pub fn started(&self) -> impl Iterator<Item = &serde_json::Value> {
        self.events.iter().filter_map(|e| match &e.seen {
            Seen::Started { notice } => Some(notice),
            _ => None,
        })
    }
}

/// Whether `seen` ends the job's life on the consumer: `+ACK` or `+TERM`.
pub fn is_done(seen: &Seen) -> bool {
    matches!(
        seen,
        Seen::Reply {
            reply: Reply::Ack | Reply::Term,
            ..
        }
    )
}

/// An acknowledgement of the job at stream sequence `sequence`; `None` for other jobs'.
/// Ack subjects are `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.…`.
fn reply_of(message: &async_nats::Message, sequence: u64) -> Option<Seen> {
    let tokens: Vec<&str> = message.subject.split('.').collect();
    let number = |i: usize| tokens.get(i).and_then(|t| t.parse::<u64>().ok());
    if number(5)? != sequence {
        return None;
    }
    let delivered = number(4)?;
    let body = String::from_utf8_lossy(&message.payload);
    let body = body.trim();
    let reply = match body {
        "" | "+ACK" => Reply::Ack,
        "+WPI" => Reply::Progress,
        b if b.starts_with("-NAK") => Reply::Nak {
            delay: b.contains("delay"),
        },
        b if b.starts_with("+TERM") => Reply::Term,
        other => Reply::Other(other.to_string()),
    };
    Some(Seen::Reply { delivered, reply })
}

fn result_of(message: async_nats::Message) -> Seen {
    Seen::Result {
        subject: message.subject.to_string(),
        headers: message.headers,
        body: message.payload,
    }
}

fn started_of(message: &async_nats::Message) -> Option<Seen> {
    let notice: serde_json::Value = serde_json::from_slice(&message.payload).ok()?;
    (notice["kind"] == "started").then_some(Seen::Started { notice })
}
