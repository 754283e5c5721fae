//! Keeping running jobs alive: one task per worker sends each running job's progress
//! ack every third of its ack wait, so JetStream does not redeliver a call that is
//! still running.
//!
//! Owns [`Keepalives`] (the running jobs in the order their next progress ack falls
//! due, on a [`Timetable`]) and [`Kept`] (a job's place there, given up when dropped:
//! its result published, its job handed back, its task unwound). A job that ends before
//! its first progress ack is due, nearly every one, costs an insert and a removal, and
//! neither a task nor a timer of its own.
//!
//! Never acks a job's end (`runner.rs` does).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;
use toolfleet_common::timetable::Timetable;

/// The running jobs whose progress acks one task sends.
#[derive(Default)]
pub(crate) struct Keepalives {
    /// Each kept job's id, by when its next progress ack is due.
    due: Timetable<u64>,
    /// Each kept job by id.
    jobs: Mutex<HashMap<u64, KeptJob>>,
    next_id: AtomicU64,
}

struct KeptJob {
    message: Arc<jetstream::Message>,
    period_ms: u64,
    /// When its next progress ack is due, Unix ms (its key in `due`).
    due: u64,
}

/// A running job's place in [`Keepalives`]; its progress acks stop when it is dropped.
pub(crate) struct Kept {
    id: u64,
    keepalives: Arc<Keepalives>,
}

impl Drop for Kept {
    fn drop(&mut self) {
        let mut jobs = lock(&self.keepalives.jobs);
        if let Some(job) = jobs.remove(&self.id) {
            self.keepalives.due.remove(job.due, self.id);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl Keepalives {
    /// Sends `message`'s progress ack every `period` until the returned [`Kept`] is
    /// dropped.
    pub(crate) fn keep(
        self: &Arc<Self>,
        message: Arc<jetstream::Message>,
        period: Duration,
    ) -> Kept {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX).max(1);
        let due = unix_ms().saturating_add(period_ms);
        let mut jobs = lock(&self.jobs);
        jobs.insert(
            id,
            KeptJob {
                message,
                period_ms,
                due,
            },
        );
        self.due.insert(due, id);
        Kept {
            id,
            keepalives: Arc::clone(self),
        }
    }

    /// Sends the progress acks as they fall due, until `stop`. A job whose progress ack
    /// cannot be sent gets no more (its connection is gone; the server redelivers it).
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        while let Some(due) = self.due.next_due_until(&stop).await {
            for id in due {
                let Some(message) = lock(&self.jobs).get(&id).map(|j| Arc::clone(&j.message))
                else {
                    continue;
                };
                let sent = message.ack_with(AckKind::Progress).await.is_ok();
                let mut jobs = lock(&self.jobs);
                match jobs.get_mut(&id) {
                    Some(job) if sent => {
                        job.due = unix_ms().saturating_add(job.period_ms);
                        self.due.insert(job.due, id);
                    }
                    Some(_) => {
                        jobs.remove(&id);
                    }
                    None => {}
                }
            }
        }
    }
}
