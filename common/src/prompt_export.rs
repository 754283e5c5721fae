//! Exporting a trace's closing span the moment it ends, and each local subtree whole.
//!
//! The batch processor exports what ended in the last `OTEL_BSP_SCHEDULE_DELAY` (5 s by
//! default), so a process killed with `-9` loses up to that much. For most spans that
//! loses only leaves of a trace. Not for a coordinator's `turn` span: the workers' spans
//! and every other replica's spans of the turn hang under it, so losing it leaves them
//! pointing at a parent that never arrives. [`PromptClosing`] sits in front of the
//! batch processor and:
//!
//! - hands the span named `closing` (`turn`) to a thread of its own, which exports it at
//!   once through its own exporter — or, when its last request went out less than
//!   [`MIN_INTERVAL`] ago, at that mark together with the others that ended meanwhile:
//!   the span is sent while the replica that ended the turn is alive, its end costs the
//!   turn's task nothing but a channel send;
//! - holds each span whose parent is a *local* span (a Redis script span under its
//!   `intake`, a `narrate` under its `join`) until that parent ends, and hands the
//!   subtree to the batch processor together with its root. A kill therefore loses a
//!   subtree whole or not at all: it never exports a child whose local parent dies in
//!   the buffer. Spans whose parent is remote (the turn's preset context, a frontend) or
//!   who have none are the roots;
//! - bounds what it holds: a subtree held longer than [`HOLD`] (a parent that never ends)
//!   or beyond [`MAX_HELD`] spans is handed on as it is, oldest first.
//!
//! When the export thread cannot start or its queue is full, the closing span goes
//! through the batch processor like any other. Never changes a span.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::trace::SpanId;
use opentelemetry::Context;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;

/// Longest a subtree is held for its local root.
pub const HOLD: Duration = Duration::from_secs(30);

/// Spans held at once at most.
pub const MAX_HELD: usize = 8192;

/// Closing spans queued for the export thread at most; beyond, they go to the batch.
const QUEUE: usize = 4096;

/// Closing spans exported in one request at most.
const MAX_BATCH: usize = 512;

/// Shortest time between two requests of the export thread: at most 100 requests a
/// second however many turns end, while a turn ending after a quiet spell goes at once.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// What the export thread is asked to do.
enum Message {
    Span(Box<SpanData>),
    Resource(Resource),
    Flush(SyncSender<OTelSdkResult>),
    Shutdown(SyncSender<OTelSdkResult>),
}

/// The span processor described in the module docs, in front of `inner` (the batch
/// processor).
#[derive(Debug)]
pub struct PromptClosing<P> {
    inner: P,
    closing: &'static str,
    queue: Option<SyncSender<Message>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    held: Mutex<Held>,
}

/// Subtrees waiting for their local root, by the id of the span they wait for.
#[derive(Debug, Default)]
struct Held {
    waiting: HashMap<SpanId, (Instant, Vec<SpanData>)>,
    order: VecDeque<(SpanId, Instant)>,
    count: usize,
}

impl Held {
    /// Takes the subtree waiting for `id`.
    fn take(&mut self, id: SpanId) -> Vec<SpanData> {
        match self.waiting.remove(&id) {
            Some((_, spans)) => {
                self.count -= spans.len();
                spans
            }
            None => Vec::new(),
        }
    }

    /// Holds `spans` until `parent` ends.
    fn hold(&mut self, parent: SpanId, spans: Vec<SpanData>, now: Instant) {
        self.count += spans.len();
        let entry = self.waiting.entry(parent).or_insert_with(|| {
            self.order.push_back((parent, now));
            (now, Vec::new())
        });
        entry.1.extend(spans);
    }

    /// The subtrees past [`HOLD`], and the oldest beyond [`MAX_HELD`] spans.
    fn expired(&mut self, now: Instant) -> Vec<SpanData> {
        let mut out = Vec::new();
        while let Some(&(id, since)) = self.order.front() {
            let current = self.waiting.get(&id).is_some_and(|(at, _)| *at == since);
            if !current {
                self.order.pop_front();
                continue;
            }
            if now.duration_since(since) < HOLD && self.count <= MAX_HELD {
                break;
            }
            self.order.pop_front();
            out.extend(self.take(id));
        }
        out
    }
}

impl<P: SpanProcessor> PromptClosing<P> {
    /// Exports spans named `closing` through `exporter` at once and hands the others,
    /// subtree by subtree, to `inner`.
    pub fn new<E: SpanExporter + 'static>(inner: P, exporter: E, closing: &'static str) -> Self {
        let (queue, receiver) = mpsc::sync_channel(QUEUE);
        let thread = std::thread::Builder::new()
            .name("toolfleet-closing-span".into())
            .spawn(move || export_loop(exporter, receiver))
            .ok();
        Self {
            inner,
            closing,
            queue: thread.as_ref().map(|_| queue),
            thread: Mutex::new(thread),
            held: Mutex::new(Held::default()),
        }
    }

    /// Sends `message` to the export thread and waits (at most `timeout`) for its answer.
    fn ask(
        &self,
        message: impl FnOnce(SyncSender<OTelSdkResult>) -> Message,
        timeout: Duration,
    ) -> OTelSdkResult {
        let Some(queue) = &self.queue else {
            return Ok(());
        };
        let (answer, answered) = mpsc::sync_channel(1);
        queue
            .send(message(answer))
            .map_err(|_| OTelSdkError::AlreadyShutdown)?;
        answered
            .recv_timeout(timeout)
            .map_err(|_| OTelSdkError::Timeout(timeout))?
    }
}

/// The export thread: exports a closing span as soon as it comes, unless the last
/// request went out less than [`MIN_INTERVAL`] ago: then at that mark, with every
/// closing span that came meanwhile (at most [`MAX_BATCH`] a request). A flush is
/// answered once every span queued before it was exported.
fn export_loop<E: SpanExporter>(mut exporter: E, receiver: Receiver<Message>) {
    let mut batch: Vec<SpanData> = Vec::new();
    let mut last: Option<Instant> = None;
    let export = |exporter: &E, batch: &mut Vec<SpanData>, last: &mut Option<Instant>| {
        if !batch.is_empty() {
            let _ = futures::executor::block_on(exporter.export(std::mem::take(batch)));
            *last = Some(Instant::now());
        }
    };
    loop {
        let message = if batch.is_empty() {
            match receiver.recv() {
                Ok(message) => message,
                Err(_) => return,
            }
        } else {
            let now = Instant::now();
            let due = last.map_or(now, |at| at + MIN_INTERVAL);
            if batch.len() >= MAX_BATCH || now >= due {
                export(&exporter, &mut batch, &mut last);
                continue;
            }
            match receiver.recv_timeout(due - now) {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    export(&exporter, &mut batch, &mut last);
                    return;
                }
            }
        };
        match message {
            Message::Span(span) => batch.push(*span),
            Message::Resource(resource) => {
                export(&exporter, &mut batch, &mut last);
                exporter.set_resource(&resource);
            }
            Message::Flush(answer) => {
                export(&exporter, &mut batch, &mut last);
                let _ = answer.send(Ok(()));
            }
            Message::Shutdown(answer) => {
                export(&exporter, &mut batch, &mut last);
                let _ = answer.send(exporter.shutdown());
                return;
            }
        }
    }
}

impl<P: SpanProcessor> SpanProcessor for PromptClosing<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        let now = Instant::now();
        let local_parent = span.parent_span_id != SpanId::INVALID && !span.parent_span_is_remote;
        let mut ready = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let mut ready = held.expired(now);
            let mut subtree = held.take(span.span_context.span_id());
            if local_parent {
                subtree.push(span);
                held.hold(subtree_parent(&subtree), subtree, now);
                ready.extend(held.expired(now));
                ready
            } else {
                ready.append(&mut subtree);
                ready.push(span);
                ready
            }
        };
        if let Some(last) = ready.pop() {
            for span in ready {
                self.inner.on_end(span);
            }
            self.send(last);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        let held = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let ids: Vec<SpanId> = held.waiting.keys().copied().collect();
            let mut all = Vec::new();
            for id in ids {
                all.extend(held.take(id));
            }
            held.order.clear();
            all
        };
        for span in held {
            self.inner.on_end(span);
        }
        let prompt = self.ask(Message::Flush, Duration::from_secs(10));
        self.inner.force_flush().and(prompt)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _ = self.force_flush();
        let prompt = self.ask(Message::Shutdown, timeout);
        if let Some(thread) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if prompt.is_ok() {
                let _ = thread.join();
            }
        }
        self.inner.shutdown_with_timeout(timeout).and(prompt)
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Some(queue) = &self.queue {
            let _ = queue.send(Message::Resource(resource.clone()));
        }
        self.inner.set_resource(resource);
    }
}

impl<P: SpanProcessor> PromptClosing<P> {
    /// Hands `span` on: a closing span to the export thread, anything else (or a closing
    /// span the thread cannot take) to `inner`.
    fn send(&self, span: SpanData) {
        if span.name != self.closing {
            return self.inner.on_end(span);
        }
        let Some(queue) = &self.queue else {
            return self.inner.on_end(span);
        };
        match queue.try_send(Message::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(Message::Span(span)))
            | Err(TrySendError::Disconnected(Message::Span(span))) => self.inner.on_end(*span),
            Err(_) => {}
        }
    }
}

/// The span the subtree `spans` (its root last) waits for: its root's parent.
fn subtree_parent(spans: &[SpanData]) -> SpanId {
    spans
        .last()
        .map_or(SpanId::INVALID, |root| root.parent_span_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_spans::{ended_span, Collected};
    use std::sync::Arc;

    fn span(id: u64, parent: u64, remote: bool, name: &'static str) -> SpanData {
        let mut span = ended_span(7, id, parent, name, true);
        span.parent_span_is_remote = remote;
        span
    }

    #[test]
    fn a_subtree_goes_on_with_its_root_and_the_closing_span_goes_at_once() {
        let batch = Collected::default();
        let exported = Collected::default();
        let p = PromptClosing::new(batch.clone(), exported.clone(), "turn");
        // intake (under the turn's remote context) with its script span inside.
        p.on_end(span(2, 1, false, "EVALSHA CREATE"));
        assert!(batch.names().is_empty(), "held for its parent");
        p.on_end(span(1, 9, true, "intake"));
        assert_eq!(batch.names(), ["EVALSHA CREATE", "intake"]);
        // Two levels: narrate under join under a result span.
        p.on_end(span(5, 4, false, "narrate"));
        p.on_end(span(4, 3, false, "join"));
        assert_eq!(batch.names().len(), 2);
        p.on_end(span(3, 9, true, "process"));
        assert_eq!(
            batch.names(),
            ["EVALSHA CREATE", "intake", "narrate", "join", "process"]
        );
        // The closing span skips the batch.
        p.on_end(span(9, 8, true, "turn"));
        assert_eq!(batch.names().len(), 5);
        assert_eq!(p.force_flush().ok(), Some(()));
        assert_eq!(exported.names(), ["exported turn"]);
        assert_eq!(
            p.shutdown_with_timeout(Duration::from_secs(5)).ok(),
            Some(())
        );
    }

    #[test]
    fn closing_spans_that_end_together_share_a_request() {
        #[derive(Debug, Clone, Default)]
        struct Requests(Arc<Mutex<Vec<usize>>>);
        impl SpanExporter for Requests {
            async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
                if let Ok(mut v) = self.0.lock() {
                    v.push(batch.len());
                }
                Ok(())
            }
        }
        let requests = Requests::default();
        let p = PromptClosing::new(Collected::default(), requests.clone(), "turn");
        for i in 0..50 {
            p.on_end(span(100 + i, 1, true, "turn"));
        }
        assert_eq!(p.force_flush().ok(), Some(()));
        let sizes = requests.0.lock().map(|v| v.clone()).unwrap_or_default();
        assert_eq!(sizes.iter().sum::<usize>(), 50);
        // The first at once; the others within the interval after it, together.
        assert!(sizes.len() <= 3, "{sizes:?}");
        let _ = p.shutdown_with_timeout(Duration::from_secs(5));
    }

    #[test]
    fn held_spans_are_bounded_and_flushed() {
        let batch = Collected::default();
        let p = PromptClosing::new(batch.clone(), Collected::default(), "turn");
        for i in 0..(MAX_HELD as u64 + 10) {
            // Every span waits for a parent that never ends.
            p.on_end(span(1000 + i, 1, false, "orphan-to-be"));
        }
        // Beyond the bound the oldest subtree goes on as it is (here the one subtree).
        assert!(!batch.names().is_empty());
        let before = batch.names().len();
        p.on_end(span(5, 4, false, "waiting"));
        assert_eq!(batch.names().len(), before);
        // A flush hands on everything held.
        assert_eq!(p.force_flush().ok(), Some(()));
        assert_eq!(batch.names().len(), MAX_HELD + 10 + 1);
        let _ = p.shutdown_with_timeout(Duration::from_secs(5));
    }
}
