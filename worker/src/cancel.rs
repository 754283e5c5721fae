//! Turns cancelled by their callers, as this worker heard of them on
//! `<p>.cancelled.<turn_id>`: the running calls of such a turn see their
//! [`ToolContext::cancellation`] fire, and its jobs that arrive later are skipped.
//!
//! Owns the table of running turns' tokens and of recently cancelled turns. Notices are
//! core NATS and best effort: a worker that missed one runs the call to its end and
//! publishes its result, which the coordinator counts as late.
//!
//! [`ToolContext::cancellation`]: crate::tool::ToolContext::cancellation

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;
use toolfleet_common::call::unix_ms;

/// How long a cancelled turn is remembered: past the longest deadline a turn may have,
/// so no job of it can still be worth running afterwards.
const REMEMBERED_MS: u64 = 10 * 60 * 1000;

#[derive(Default)]
struct Table {
    /// Turn → its token and how many of its calls run here.
    running: HashMap<String, (CancellationToken, usize)>,
    /// Turn → when to forget its cancel (Unix ms).
    cancelled: HashMap<String, u64>,
}

/// Cancelled turns and the tokens of running calls.
#[derive(Clone, Default)]
pub(crate) struct Cancellations {
    table: Arc<Mutex<Table>>,
}

fn lock(table: &Mutex<Table>) -> MutexGuard<'_, Table> {
    match table.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl Cancellations {
    /// Notes that `turn_id` was cancelled and fires the token of its running calls.
    pub(crate) fn cancel(&self, turn_id: &str) {
        let now = unix_ms();
        let mut table = lock(&self.table);
        if table.cancelled.len() >= 1024 {
            table.cancelled.retain(|_, forget_at| *forget_at > now);
        }
        table
            .cancelled
            .insert(turn_id.to_string(), now + REMEMBERED_MS);
        if let Some((token, _)) = table.running.get(turn_id) {
            token.cancel();
        }
    }

    /// A call of `turn_id` starts: its token, or `None` when the turn was cancelled
    /// (the job is skipped).
    pub(crate) fn enter(&self, turn_id: &str) -> Option<Running> {
        let mut table = lock(&self.table);
        if table
            .cancelled
            .get(turn_id)
            .is_some_and(|forget_at| *forget_at > unix_ms())
        {
            return None;
        }
        let (token, calls) = table
            .running
            .entry(turn_id.to_string())
            .or_insert_with(|| (CancellationToken::new(), 0));
        *calls += 1;
        Some(Running {
            token: token.child_token(),
            turn_id: turn_id.to_string(),
            table: Arc::clone(&self.table),
        })
    }
}

/// A running call's hold on its turn's token; released when dropped.
pub(crate) struct Running {
    token: CancellationToken,
    turn_id: String,
    table: Arc<Mutex<Table>>,
}

impl Running {
    /// Fires when the call's turn is cancelled.
    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut table = lock(&self.table);
        if let Some((_, calls)) = table.running.get_mut(&self.turn_id) {
            *calls -= 1;
            if *calls == 0 {
                table.running.remove(&self.turn_id);
            }
        }
    }
}

/// Subscribes to the cancelled turns of `names` and follows them in the background: the
/// table the calls of this worker take their tokens from.
pub(crate) async fn follow_cancelled(
    nats: &async_nats::Client,
    names: &toolfleet_common::Names,
) -> Result<Cancellations, crate::WorkerError> {
    let subject = names.turn_cancelled_any();
    let subscriber =
        nats.subscribe(subject.clone())
            .await
            .map_err(|e| crate::WorkerError::Subscribe {
                subject,
                message: e.to_string(),
            })?;
    let cancellations = Cancellations::default();
    tokio::spawn(follow(cancellations.clone(), subscriber));
    Ok(cancellations)
}

/// Fires the tokens of turns cancelled on `subscriber` until it ends.
async fn follow(cancellations: Cancellations, mut subscriber: async_nats::Subscriber) {
    use futures::StreamExt;
    while let Some(message) = subscriber.next().await {
        if let Some(turn_id) = message.subject.rsplit('.').next() {
            cancellations.cancel(turn_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_fires_running_calls_and_skips_later_ones() {
        let cancellations = Cancellations::default();
        let first = cancellations.enter("t1").expect("not cancelled yet");
        let other = cancellations.enter("t2").expect("another turn");
        cancellations.cancel("t1");
        assert!(first.token().is_cancelled());
        assert!(!other.token().is_cancelled());
        assert!(cancellations.enter("t1").is_none());
        drop(first);
        assert!(!lock(&cancellations.table).running.contains_key("t1"));
    }
}
