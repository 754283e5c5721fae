//! The turns this replica owns, and the gate that orders what it publishes per turn.
//!
//! Owns [`OwnedTurns`]: the in-memory table of turns this replica took and has not seen
//! end (reply subject, turn span identity, deadline timer, calls whose terminal state
//! went out), and the per-turn [`TurnGate`]. Only the owner relays `running`; any
//! replica may release a paced turn's next call (the queue is in Redis) or end a turn.
//!
//! Never the source of truth about a turn's state: the join in Redis is (`join.rs`). A
//! turn missing here may still be open there, ended by another replica or the sweeper.
//! Never publishes anything itself.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;

use crate::trace::TurnTrace;

/// A turn this replica took.
pub(crate) struct OwnedTurn {
    /// The frontend's reply subject.
    pub reply: String,
    /// The turn span's identity: it parents the job publishes of queued calls released
    /// here.
    pub trace: Option<TurnTrace>,
    /// Cancels the deadline timer when the turn ends early.
    pub timer: CancellationToken,
    /// Calls whose terminal state this replica published; their `running` is not
    /// relayed any more.
    pub ended_calls: HashSet<String>,
    /// Each dispatched call's tool, by call id: a `started` notice is relayed only for a
    /// call of the tool its subject names.
    pub tools: HashMap<String, String>,
}

/// How one replica orders what it publishes about a turn while it records the turn's
/// results concurrently (their scripts share one pipelined Redis connection).
#[derive(Default)]
pub(crate) struct TurnGate {
    /// Held for reading by each recording from before its script is sent until its
    /// call's state is published; held for writing by whoever ended the turn while it
    /// publishes the end, so `final` follows every state recorded here before the end.
    pub recording: tokio::sync::RwLock<()>,
    /// Held while publishing a state of one of the turn's calls or the turn's end, so a
    /// relayed `running` never follows that call's terminal state.
    pub publishing: tokio::sync::Mutex<()>,
}

/// The turns this replica owns and the gates of turns being recorded or ended here.
#[derive(Default)]
pub(crate) struct OwnedTurns {
    /// Turns taken by this replica and not yet ended.
    owned: Mutex<HashMap<String, OwnedTurn>>,
    /// The gate of each turn whose results are being recorded or whose end is being
    /// published here; dropped when nobody holds it.
    gates: Mutex<HashMap<String, Arc<TurnGate>>>,
    /// Turn requests being taken in here (decoded, checked, created) right now.
    taking: Arc<AtomicUsize>,
}

/// A turn request counted as being taken in until dropped.
pub(crate) struct Taking(Arc<AtomicUsize>);

impl Drop for Taking {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Locks `mutex`, taking the data over from a panicked holder: the maps stay usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl OwnedTurns {
    /// Records that this replica took `turn_id`.
    pub(crate) fn own(&self, turn_id: String, turn: OwnedTurn) {
        lock(&self.owned).insert(turn_id, turn);
    }

    /// Whether this replica owns `turn_id`.
    pub(crate) fn owns(&self, turn_id: &str) -> bool {
        lock(&self.owned).contains_key(turn_id)
    }

    /// The turn span's identity of an owned turn.
    pub(crate) fn trace(&self, turn_id: &str) -> Option<TurnTrace> {
        lock(&self.owned).get(turn_id).and_then(|t| t.trace.clone())
    }

    /// Forgets an ended turn and stops its deadline timer.
    pub(crate) fn release(&self, turn_id: &str) {
        if let Some(turn) = lock(&self.owned).remove(turn_id) {
            turn.timer.cancel();
        }
    }

    /// Stops every owned turn's deadline timer and forgets the turns (their deadline
    /// entries stay in Redis for the sweepers of other replicas).
    pub(crate) fn abandon_all(&self) {
        for (_, turn) in lock(&self.owned).drain() {
            turn.timer.cancel();
        }
    }

    /// Counts one more turn request being taken in, unless the requests being taken
    /// in and the turns owned already reach `max`: then `None`, and the request must be
    /// refused (`overloaded`) rather than queued.
    pub(crate) fn try_take(&self, max: usize) -> Option<Taking> {
        let taking = self.taking.fetch_add(1, Ordering::Relaxed);
        let guard = Taking(Arc::clone(&self.taking));
        (taking + self.count() < max).then_some(guard)
    }

    /// How many turns this replica owns.
    pub(crate) fn count(&self) -> usize {
        lock(&self.owned).len()
    }

    /// Notes that this replica published the terminal state of `call_id`.
    pub(crate) fn mark_ended(&self, turn_id: &str, call_id: &str) {
        if let Some(turn) = lock(&self.owned).get_mut(turn_id) {
            turn.ended_calls.insert(call_id.to_string());
        }
    }

    /// The reply subject for relaying `running` of `call_id`: only while this replica
    /// owns the turn, the call is one of `tool` and its terminal state is not published.
    pub(crate) fn running_target(
        &self,
        turn_id: &str,
        call_id: &str,
        tool: &str,
    ) -> Option<String> {
        lock(&self.owned)
            .get(turn_id)
            .filter(|t| !t.ended_calls.contains(call_id))
            .filter(|t| t.tools.get(call_id).is_some_and(|name| name == tool))
            .map(|t| t.reply.clone())
    }

    /// Runs `work` with the gate of `turn_id` (recording a result, ending the turn, or
    /// relaying a state), then forgets the gate when nobody else holds it.
    pub(crate) async fn gated<T, F, Fut>(&self, turn_id: &str, work: F) -> T
    where
        F: FnOnce(Arc<TurnGate>) -> Fut,
        Fut: Future<Output = T>,
    {
        let gate = Arc::clone(lock(&self.gates).entry(turn_id.to_string()).or_default());
        let out = work(Arc::clone(&gate)).await;
        let mut gates = lock(&self.gates);
        drop(gate);
        // Under the map guard, a count of one means nobody else holds or waits for it.
        if gates
            .get(turn_id)
            .is_some_and(|g| Arc::strong_count(g) == 1)
        {
            gates.remove(turn_id);
        }
        out
    }
}
