//! Keys due at a time, waited for by one task: the deadlines of a coordinator's turns,
//! the keep-alive acks of a worker's running jobs.
//!
//! Owns [`Timetable`]: a set of `(due, key)` in time order and the time its one waiting
//! task wakes next. Putting in a key due after that time, or taking one out, wakes
//! nobody; only a key due before it does. So a process that adds and removes an entry
//! per turn or per job, most of them gone long before they are due, costs no task, no
//! runtime timer and no thread woken per entry, where a task sleeping per entry costs a
//! spawn, a timer and a wake-up to cancel it.
//!
//! Never acts on what is due: [`Timetable::next_due`] hands the keys to its caller.
//! Times are Unix milliseconds ([`crate::call::unix_ms`]).

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::call::unix_ms;

/// How long the waiting task sleeps with nothing in the table, unless told of a key.
const IDLE: Duration = Duration::from_secs(60);

/// Keys in the order they fall due; see the module documentation.
pub struct Timetable<K> {
    inner: Mutex<Inner<K>>,
    earlier: Notify,
}

struct Inner<K> {
    /// `(due in Unix ms, key)` of every key.
    by_time: BTreeSet<(u64, K)>,
    /// When the waiting task wakes next, Unix ms (`u64::MAX`: when told of a key). Every
    /// key in `by_time` is due at or after it, or the task has been told.
    wakes_at: u64,
}

impl<K: Ord> Default for Timetable<K> {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                by_time: BTreeSet::new(),
                wakes_at: u64::MAX,
            }),
            earlier: Notify::new(),
        }
    }
}

impl<K: Ord> Timetable<K> {
    /// Locks the table, taking it over from a panicked holder: it stays usable.
    fn lock(&self) -> MutexGuard<'_, Inner<K>> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Puts `key` in, due at `due` (Unix ms). Wakes the waiting task only when `due`
    /// comes before the time it wakes at.
    pub fn insert(&self, due: u64, key: K) {
        let mut inner = self.lock();
        inner.by_time.insert((due, key));
        if due < inner.wakes_at {
            inner.wakes_at = due;
            self.earlier.notify_one();
        }
    }

    /// Takes `key`, due at `due`, out; whether it was in. The waiting task is not woken:
    /// at worst it wakes at that time and finds nothing due.
    pub fn remove(&self, due: u64, key: K) -> bool {
        self.lock().by_time.remove(&(due, key))
    }

    /// Takes every key out.
    pub fn clear(&self) {
        self.lock().by_time.clear();
    }

    /// How many keys are in.
    pub fn len(&self) -> usize {
        self.lock().by_time.len()
    }

    /// Whether no key is in.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes out the keys due at or before `now` and returns them in time order, with
    /// when the next key falls due (`None`: none left; the next insert tells).
    pub fn due(&self, now: u64) -> (Vec<K>, Option<u64>) {
        let mut inner = self.lock();
        let mut due = Vec::new();
        while inner.by_time.first().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, key)) = inner.by_time.pop_first() {
                due.push(key);
            }
        }
        let next = inner.by_time.first().map(|(at, _)| *at);
        inner.wakes_at = next.unwrap_or(u64::MAX);
        (due, next)
    }

    /// Waits until a key falls due and takes out every key due by then. Cancel-safe:
    /// keys are taken out only when it returns. Meant for one waiting task per table.
    pub async fn next_due(&self) -> Vec<K> {
        loop {
            let (due, next) = self.due(unix_ms());
            if !due.is_empty() {
                return due;
            }
            let wait = next.map_or(IDLE, |at| {
                Duration::from_millis(at.saturating_sub(unix_ms()))
            });
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.earlier.notified() => {}
            }
        }
    }

    /// [`Timetable::next_due`] until `stop` is cancelled: then `None`.
    pub async fn next_due_until(&self, stop: &CancellationToken) -> Option<Vec<K>> {
        tokio::select! {
            _ = stop.cancelled() => None,
            due = self.next_due() => Some(due),
        }
    }

    /// Whether the waiting task has been told of an earlier key since it last looked.
    #[cfg(test)]
    fn told(&self) -> bool {
        let told = self.earlier.notified();
        futures::pin_mut!(told);
        told.enable()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_out_in_time_order_once_due() {
        let table = Timetable::default();
        table.insert(100, "a");
        // The first key wakes the waiting task; a later one leaves it asleep.
        assert!(table.told());
        table.insert(300, "c");
        table.insert(200, "b");
        assert!(!table.told());
        assert_eq!(table.due(99), (vec![], Some(100)));
        // A key taken out is never due.
        assert!(table.remove(200, "b"));
        assert!(!table.remove(200, "b"));
        assert_eq!(table.due(250), (vec!["a"], Some(300)));
        // Earlier than the next wake-up: the waiting task is told.
        table.insert(260, "d");
        assert!(table.told());
        assert_eq!(table.due(1_000), (vec!["d", "c"], None));
        // Empty: the next key wakes the task, whenever it is due.
        table.insert(5_000, "e");
        assert!(table.told());
        assert_eq!(table.len(), 1);
        table.clear();
        assert!(table.is_empty());
        assert_eq!(table.due(u64::MAX), (vec![], None));
    }

    #[tokio::test]
    async fn the_waiting_task_wakes_for_an_earlier_key() {
        let table = std::sync::Arc::new(Timetable::default());
        table.insert(unix_ms() + 60_000, 1);
        let waiting = {
            let table = std::sync::Arc::clone(&table);
            tokio::spawn(async move { table.next_due().await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        table.insert(unix_ms() + 10, 2);
        let due = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken within the bound")
            .expect("the task ran");
        assert_eq!(due, vec![2]);
        assert_eq!(table.len(), 1);
    }
}
