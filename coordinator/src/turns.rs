//! The turns this replica owns, and the gate that orders what it publishes per turn.
//!
//! Owns [`OwnedTurns`]: the in-memory table of turns this replica took and has not seen
//! end (reply subject, turn span identity, deadline, calls whose terminal state went
//! out, the results known here for closing the turn ahead: [`Ahead`]), the order of
//! their deadlines for the one clock that ends them (`deadline.rs`), and the per-turn
//! [`TurnGate`]. Only the owner relays `running`; any
//! replica may release a paced turn's next call (the queue is in Redis) or end a turn.
//!
//! Never the source of truth about a turn's state: the join in Redis is (`store/redis.rs`). A
//! turn missing here may still be open there, ended by another replica or the sweeper.
//! Never publishes anything itself.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;
use toolfleet_common::timetable::Timetable;
use toolfleet_common::CallResult;

use crate::callers::Reply;
use crate::store::redis::CallEntry;
use crate::trace::TurnTrace;

/// Most calls of a turn whose closing events are built ahead (see [`Ahead`]).
pub(crate) const AHEAD_MAX_CALLS: usize = 64;

/// Most bytes of results an owned turn keeps to build its closing events ahead; a turn
/// past it closes after the join.
pub(crate) const AHEAD_MAX_BYTES: usize = 64 * 1024;

/// A turn this replica took.
pub(crate) struct OwnedTurn {
    /// The frontend's reply subject.
    pub reply: Reply,
    /// The turn span's identity: it parents the job publishes of queued calls released
    /// here.
    pub trace: Option<TurnTrace>,
    /// When the turn's deadline passes, Unix milliseconds.
    pub deadline_unix_ms: u64,
    /// Calls whose terminal state this replica published; their `running` is not
    /// relayed any more.
    pub ended_calls: HashSet<String>,
    /// Each dispatched call's tool, by call id: a `started` notice is relayed only for a
    /// call of the tool its subject names.
    pub tools: HashMap<String, String>,
    /// Calls a worker announced as running, by call id: the timing of a call the turn
    /// ends without its result.
    pub started: HashMap<String, Started>,
    /// What building the turn's closing events ahead needs, when the narrator narrates
    /// ahead and the turn is small enough.
    pub ahead: Option<Ahead>,
}

/// What an owned turn keeps so that the result completing it can carry the turn's
/// closing events into the same `RECORD` script (`store/redis.rs`): every call, and each
/// result recorded or being recorded here (or refused up front) with its stored body.
/// The script stores the events only if every other call's stored result is byte for
/// byte the one the events were built from; a result stored by another
/// replica with other bytes (a job run twice) fails the check, and the turn closes after
/// the join as before.
pub(crate) struct Ahead {
    /// Every call by key, in the model's order.
    pub calls: Vec<(String, CallEntry)>,
    /// Results known here by call key, each with its stored body (a later copy of a
    /// result replaces an earlier one).
    pub known: HashMap<String, (CallResult, Vec<u8>)>,
    /// Bytes of the known results' bodies.
    pub bytes: usize,
    /// When the turn was taken, Unix milliseconds.
    pub created_unix_ms: u64,
}

impl Ahead {
    /// Keeps `calls` (the turn's, in the model's order) and the results refused up
    /// front (`refused`, as the join stored them); `None` for a turn too large to keep.
    pub(crate) fn new(
        calls: Vec<(String, CallEntry)>,
        refused: &[(String, CallResult)],
        created_unix_ms: u64,
    ) -> Option<Self> {
        if calls.len() > AHEAD_MAX_CALLS {
            return None;
        }
        let mut ahead = Self {
            calls,
            known: HashMap::new(),
            bytes: 0,
            created_unix_ms,
        };
        for (key, result) in refused {
            let body = serde_json::to_vec(result).ok()?;
            if !ahead.know(key, result, &body) {
                return None;
            }
        }
        Some(ahead)
    }

    /// Notes `result`, stored (or being stored) as `body`; `false` when the turn keeps
    /// too many bytes of results to go on.
    fn know(&mut self, key: &str, result: &CallResult, body: &[u8]) -> bool {
        let replaced = self.known.get(key).map_or(0, |(_, stored)| stored.len());
        self.bytes = self.bytes - replaced + body.len();
        if self.bytes > AHEAD_MAX_BYTES {
            return false;
        }
        self.known
            .insert(key.to_string(), (result.clone(), body.to_vec()));
        true
    }
}

/// An owned turn whose every other result is known here: its results in the model's
/// order, to build the closing events from, and what the script checks.
pub(crate) struct Ready {
    /// Every call's result, in the model's order.
    pub results: Vec<CallResult>,
    /// Each other call's key and the stored body of the result the events hold.
    pub checks: Vec<(String, Vec<u8>)>,
    /// When the turn was taken, Unix milliseconds.
    pub created_unix_ms: u64,
    /// The turn span's identity, when traced.
    pub trace: Option<TurnTrace>,
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
    /// The owned turns by deadline, for the clock that ends them.
    deadlines: Timetable<String>,
}

/// A turn request counted as being taken in until dropped.
pub(crate) struct Taking(Arc<AtomicUsize>);

impl Drop for Taking {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A call a worker announced as running (its `started` notice).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Started {
    /// When the worker began executing it, Unix milliseconds.
    pub unix_ms: u64,
    /// The delivery attempt.
    pub attempt: u32,
    /// The worker running it.
    pub worker_id: String,
}

/// Locks `mutex`, taking the data over from a panicked holder: the maps stay usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl OwnedTurns {
    /// Records that this replica took `turn_id`, to be ended at its deadline unless it
    /// ends before. A turn whose deadline is later than the clock's next wake-up (every
    /// turn of one budget taken after another) leaves the clock asleep.
    pub(crate) fn own(&self, turn_id: String, turn: OwnedTurn) {
        let deadline = turn.deadline_unix_ms;
        lock(&self.owned).insert(turn_id.clone(), turn);
        self.deadlines.insert(deadline, turn_id);
    }

    /// The owned turns whose deadline passed, taken out of the clock's order once it
    /// falls due: each is ended once by the clock (`deadline.rs`); `None` once `stop` is
    /// cancelled.
    pub(crate) async fn past_deadline(&self, stop: &CancellationToken) -> Option<Vec<String>> {
        self.deadlines.next_due_until(stop).await
    }

    /// Whether this replica owns `turn_id`.
    pub(crate) fn owns(&self, turn_id: &str) -> bool {
        lock(&self.owned).contains_key(turn_id)
    }

    /// The turn span's identity of an owned turn.
    pub(crate) fn trace(&self, turn_id: &str) -> Option<TurnTrace> {
        lock(&self.owned).get(turn_id).and_then(|t| t.trace.clone())
    }

    /// Forgets an ended turn; the clock no longer ends it at its deadline.
    pub(crate) fn release(&self, turn_id: &str) {
        let Some(turn) = lock(&self.owned).remove(turn_id) else {
            return;
        };
        self.deadlines
            .remove(turn.deadline_unix_ms, turn_id.to_string());
    }

    /// Forgets every owned turn; the clock ends none of them (their deadline entries
    /// stay in Redis for the sweepers of other replicas).
    pub(crate) fn abandon_all(&self) {
        lock(&self.owned).clear();
        self.deadlines.clear();
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

    /// Notes `result` of call `key` of `turn_id`, about to be recorded as `body`. When
    /// this replica owns the turn, keeps it ahead and now knows a result of every call,
    /// returns what the closing events are built from.
    pub(crate) fn note_result(
        &self,
        turn_id: &str,
        key: &str,
        result: &CallResult,
        body: &[u8],
    ) -> Option<Ready> {
        let mut owned = lock(&self.owned);
        let turn = owned.get_mut(turn_id)?;
        let ahead = turn.ahead.as_mut()?;
        if !ahead.calls.iter().any(|(k, _)| k == key) {
            return None;
        }
        if !ahead.know(key, result, body) {
            turn.ahead = None;
            return None;
        }
        if ahead.known.len() < ahead.calls.len() {
            return None;
        }
        let mut results = Vec::with_capacity(ahead.calls.len());
        let mut checks = Vec::with_capacity(ahead.calls.len() - 1);
        for (k, _) in &ahead.calls {
            let (result, stored) = ahead.known.get(k)?;
            results.push(result.clone());
            if k != key {
                checks.push((k.clone(), stored.clone()));
            }
        }
        Some(Ready {
            results,
            checks,
            created_unix_ms: ahead.created_unix_ms,
            trace: turn.trace.clone(),
        })
    }

    /// Notes that a worker announced `call_id` of an owned turn as running; a later
    /// attempt replaces an earlier one.
    pub(crate) fn note_started(&self, turn_id: &str, call_id: &str, started: Started) {
        if let Some(turn) = lock(&self.owned).get_mut(turn_id) {
            turn.started.insert(call_id.to_string(), started);
        }
    }

    /// The calls of `turn_id` announced as running, by call id (empty when this
    /// replica does not own the turn).
    pub(crate) fn started(&self, turn_id: &str) -> HashMap<String, Started> {
        lock(&self.owned)
            .get(turn_id)
            .map(|t| t.started.clone())
            .unwrap_or_default()
    }

    /// Notes that this replica published the terminal state of `call_id`.
    pub(crate) fn mark_ended(&self, turn_id: &str, call_id: &str) {
        if let Some(turn) = lock(&self.owned).get_mut(turn_id) {
            turn.ended_calls.insert(call_id.to_string());
        }
    }

    /// The reply subject for relaying `running` of `call_id`: only while this replica
    /// owns the turn, the call is one of `tool` and its terminal state is not published.
    pub(crate) fn running_target(&self, turn_id: &str, call_id: &str, tool: &str) -> Option<Reply> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use toolfleet_common::ToolCall;

    fn entry(index: usize) -> (String, CallEntry) {
        let id = format!("c{index}");
        let entry = CallEntry {
            index,
            id: id.clone(),
            name: "test.noop".to_string(),
            parent_id: None,
            queued: false,
        };
        (id, entry)
    }

    fn result(id: &str, value: serde_json::Value) -> CallResult {
        let call = ToolCall {
            id: id.to_string(),
            name: "test.noop".to_string(),
            arguments: json!({}),
            parent_id: None,
        };
        CallResult::success(&call, value)
    }

    fn owning(turns: &OwnedTurns, ahead: Option<Ahead>) {
        owning_until(turns, "t", 0, ahead);
    }

    fn owning_until(turns: &OwnedTurns, id: &str, deadline_unix_ms: u64, ahead: Option<Ahead>) {
        let turn = OwnedTurn {
            reply: Reply::kept("_INBOX.reply").expect("an inbox subject"),
            trace: None,
            deadline_unix_ms,
            ended_calls: HashSet::new(),
            started: HashMap::new(),
            tools: HashMap::new(),
            ahead,
        };
        turns.own(id.to_string(), turn);
    }

    #[tokio::test]
    async fn only_turns_still_owned_are_past_their_deadline() {
        let turns = OwnedTurns::default();
        let now = toolfleet_common::call::unix_ms();
        owning_until(&turns, "ended", now, None);
        owning_until(&turns, "due", now + 1, None);
        owning_until(&turns, "later", now + 60_000, None);
        turns.release("ended");
        let stop = CancellationToken::new();
        let due = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            turns.past_deadline(&stop),
        )
        .await
        .expect("due within the bound");
        assert_eq!(due, Some(vec!["due".to_string()]));
        stop.cancel();
        assert_eq!(turns.past_deadline(&stop).await, None);
        // Still owned until it is ended; no longer in the clock's order.
        assert!(turns.owns("due"));
        turns.abandon_all();
        assert_eq!(turns.count(), 0);
    }

    fn note(turns: &OwnedTurns, id: &str, value: serde_json::Value) -> Option<Ready> {
        let r = result(id, value);
        let body = serde_json::to_vec(&r).unwrap_or_default();
        turns.note_result("t", id, &r, &body)
    }

    #[test]
    fn a_turn_is_ready_to_close_ahead_once_every_result_is_known() {
        let turns = OwnedTurns::default();
        let refused = result("c1", json!("refused"));
        let calls = (0..3).map(entry).collect();
        owning(&turns, Ahead::new(calls, &[("c1".to_string(), refused)], 7));
        assert!(note(&turns, "c2", json!(2)).is_none());
        // A key the turn does not have is not counted.
        assert!(note(&turns, "c9", json!(9)).is_none());
        let ready = note(&turns, "c0", json!(0)).expect("every result known");
        let values: Vec<_> = ready.results.iter().map(|r| r.result.clone()).collect();
        assert_eq!(
            values,
            [Some(json!(0)), Some(json!("refused")), Some(json!(2))]
        );
        let keys: Vec<_> = ready.checks.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["c1", "c2"]);
        let c2 = serde_json::to_vec(&result("c2", json!(2))).unwrap_or_default();
        assert_eq!(ready.checks[1].1, c2);
        assert_eq!(ready.created_unix_ms, 7);
    }

    #[test]
    fn a_turn_past_the_bounds_closes_after_the_join() {
        let turns = OwnedTurns::default();
        let many = (0..=AHEAD_MAX_CALLS).map(entry).collect();
        assert!(Ahead::new(many, &[], 0).is_none());
        owning(&turns, Ahead::new((0..2).map(entry).collect(), &[], 0));
        let large = json!("x".repeat(AHEAD_MAX_BYTES));
        assert!(note(&turns, "c0", large).is_none());
        assert!(note(&turns, "c1", json!(1)).is_none());
        // A turn not owned here is never closed ahead.
        assert!(OwnedTurns::default()
            .note_result("t", "c0", &result("c0", json!(0)), b"{}")
            .is_none());
    }

    #[test]
    fn a_result_noted_again_replaces_the_earlier_copy() {
        let turns = OwnedTurns::default();
        owning(&turns, Ahead::new((0..2).map(entry).collect(), &[], 0));
        let half = "x".repeat(AHEAD_MAX_BYTES * 2 / 3);
        assert!(note(&turns, "c0", json!(half)).is_none());
        // Redelivered and run again: only the latest copy counts, bytes included.
        assert!(note(&turns, "c0", json!([half])).is_none());
        let ready = note(&turns, "c1", json!(1)).expect("every result known");
        assert_eq!(ready.results[0].result, Some(json!([half])));
    }
}
