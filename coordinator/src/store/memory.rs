//! An in-memory [`TurnStore`] for unit tests: the join's decisions without Redis.
//!
//! Owns [`MemoryStore`], which keeps every turn's meta, calls, results, events and
//! queued calls under one lock and decides as the join's scripts do (`store/redis.rs`): a turn
//! id is created once and replayed only to the same caller and request, a result counts
//! once and only while its turn is open and before its deadline, the last result or the
//! deadline or a cancel ends the turn once, a `final` is stored once and marked sent
//! once, a paced turn's freed slot releases its next queued call. Test code can make the
//! store unavailable ([`MemoryStore::set_unavailable`]) and read a turn as stored
//! ([`MemoryStore::turn`]). Never expires a key: tests end before any TTL would.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use toolfleet_common::call::unix_ms;
use toolfleet_common::tool::Rejection;
use toolfleet_common::{CallResult, JobEnvelope};

use super::Immediate;
use crate::store::redis::{
    Attached, CallEntry, Cancelled, Closing, ClosingAhead, Created, Emitted, Finalized, JoinError,
    NewTurn, Recorded, Released, StoredFinal, StoredTurn,
};

/// The one deadline index key of the memory store.
const DEADLINES: &str = "deadlines";

/// One turn as the memory store keeps it.
#[derive(Debug, Clone, Default)]
pub(crate) struct StoredState {
    /// `open` or `final`.
    pub state: String,
    /// How many calls the turn has.
    pub total: usize,
    /// Where its events go.
    pub reply: String,
    /// Its tenant.
    pub tenant: String,
    /// Its deadline, Unix ms.
    pub deadline: u64,
    /// Whether its dispatch is paced.
    pub paced: bool,
    /// Whether its calls go through the tools' lanes.
    pub laned: bool,
    /// When it was created, Unix ms.
    pub created: u64,
    /// The turn span's `traceparent` ('' when not traced).
    pub traceparent: String,
    /// The turn span's stored identity ('' when not traced).
    pub trace: String,
    /// The submitting frontend.
    pub caller: String,
    /// The request digest.
    pub digest: String,
    /// Late results counted.
    pub late: u64,
    /// Duplicate results counted.
    pub duplicates: u64,
    /// Calls by key.
    pub calls: BTreeMap<String, CallEntry>,
    /// Result bodies by call key, as stored.
    pub results: BTreeMap<String, Vec<u8>>,
    /// Every stored event; `seq` is the position plus one.
    pub events: Vec<String>,
    /// How it ended (`complete`, `deadline`, `cancelled`, `no_tools`).
    pub ended: Option<String>,
    /// The seq of the stored `final`, once stored.
    pub final_seq: Option<u64>,
    /// How many times the stored `final` was marked sent.
    pub published: u64,
    /// Queued call keys, in the model's order.
    pub queue: VecDeque<String>,
    /// Queued and released calls' jobs by key.
    pub jobs: HashMap<String, JobEnvelope>,
    /// Released calls whose publish is not confirmed.
    pub dispatching: BTreeSet<String>,
}

impl StoredState {
    /// The turn's calls and results, for whoever ends it.
    fn closing(&self) -> Result<Closing, JoinError> {
        let mut results = HashMap::with_capacity(self.results.len());
        for (key, body) in &self.results {
            let result =
                serde_json::from_slice(body).map_err(|e| JoinError::Decode(e.to_string()))?;
            results.insert(key.clone(), result);
        }
        Ok(Closing {
            reply: self.reply.clone(),
            calls: self.calls.clone().into_iter().collect(),
            results,
            created_unix_ms: self.created,
            traceparent: Some(self.traceparent.clone()).filter(|t| !t.is_empty()),
            trace: Some(self.trace.clone()).filter(|t| !t.is_empty()),
            tenant: self.tenant.clone(),
            deadline_unix_ms: self.deadline,
            laned: self.laned,
        })
    }

    /// Empties the stored result bodies once the `final` holds them, keeping each
    /// call's key (as `kept_in_final` keeps them in the join's calls hash).
    fn keep_bodies_in_final(&mut self) {
        for body in self.results.values_mut() {
            body.clear();
        }
    }

    /// Appends `events`; the seq of the last one.
    fn push(&mut self, events: &[String]) -> u64 {
        self.events.extend_from_slice(events);
        self.events.len() as u64
    }

    fn is_open(&self) -> bool {
        self.state == "open"
    }
}

#[derive(Default)]
struct State {
    turns: HashMap<String, StoredState>,
    /// The deadline index: turn id → deadline, Unix ms.
    deadlines: HashMap<String, u64>,
    /// Marks of turns whose keys are gone (as `HINCRBY` on a missing hash counts).
    marks_of_unknown: HashMap<String, u64>,
    /// The last refused result of each tool.
    rejected: HashMap<String, Rejection>,
}

/// The in-memory store.
#[derive(Default)]
pub(crate) struct MemoryStore {
    state: Mutex<State>,
    /// While set, every call fails as an unreachable Redis would.
    unavailable: AtomicBool,
}

impl MemoryStore {
    /// Makes every later call fail (`true`) or succeed again (`false`).
    pub(crate) fn set_unavailable(&self, unavailable: bool) {
        self.unavailable.store(unavailable, Ordering::SeqCst);
    }

    /// The turn `turn_id` as stored.
    pub(crate) fn turn(&self, turn_id: &str) -> Option<StoredState> {
        self.lock().turns.get(turn_id).cloned()
    }

    /// The deadline index entry of `turn_id`.
    pub(crate) fn deadline_of(&self, turn_id: &str) -> Option<u64> {
        self.lock().deadlines.get(turn_id).copied()
    }

    /// The last refused result of `tool`.
    pub(crate) fn rejected(&self, tool: &str) -> Option<Rejection> {
        self.lock().rejected.get(tool).cloned()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The store, or the error an unreachable Redis gives.
    fn reach(&self) -> Result<MutexGuard<'_, State>, JoinError> {
        if self.unavailable.load(Ordering::SeqCst) {
            let io = std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "memory store unavailable",
            );
            return Err(JoinError::Redis(io.into()));
        }
        Ok(self.lock())
    }

    fn do_record(&self, record: Record<'_>) -> Result<Recorded, JoinError> {
        let mut state = self.reach()?;
        let Some(turn) = state.turns.get_mut(record.turn_id) else {
            return Ok(Recorded::UnknownTurn);
        };
        let Some(call) = turn.calls.get(record.key) else {
            return Ok(Recorded::UnknownCall);
        };
        if call.name != record.tool {
            return Ok(Recorded::WrongTool);
        }
        if turn.results.contains_key(record.key) {
            turn.duplicates += 1;
            let mut again = Vec::new();
            if turn.is_open() {
                for key in &turn.dispatching {
                    if turn.results.contains_key(key) {
                        continue;
                    }
                    if let Some(job) = turn.jobs.get(key) {
                        again.push(released(key, job, &turn.trace));
                    }
                }
            }
            return Ok(Recorded::Duplicate {
                again,
                laned: turn.laned,
            });
        }
        if !turn.is_open() || record.now_ms >= turn.deadline {
            turn.late += 1;
            return Ok(Recorded::Late { laned: turn.laned });
        }
        turn.results
            .insert(record.key.to_string(), record.body.to_vec());
        let seq = turn.push(std::slice::from_ref(&record.state_event.to_string()));
        if turn.results.len() >= turn.total {
            turn.state = "final".to_string();
            turn.ended = Some("complete".to_string());
            if let Some(ahead) = record.ahead.filter(|a| stored_ahead(turn, record.key, a)) {
                let last = turn.push(ahead.events);
                turn.final_seq = Some(last);
                turn.keep_bodies_in_final();
                return Ok(Recorded::CompleteStored {
                    reply: turn.reply.clone(),
                    seq,
                    laned: turn.laned,
                });
            }
            return Ok(Recorded::Complete {
                closing: turn.closing()?,
                paced: turn.paced,
                seq,
            });
        }
        let mut released_call = None;
        if turn.paced {
            if let Some(key) = turn.queue.pop_front() {
                if let Some(entry) = turn.calls.get_mut(&key) {
                    entry.queued = false;
                }
                turn.dispatching.insert(key.clone());
                released_call = turn
                    .jobs
                    .get(&key)
                    .map(|job| released(&key, job, &turn.trace));
            }
        }
        Ok(Recorded::Recorded {
            reply: turn.reply.clone(),
            paced: turn.paced,
            seq,
            released: released_call,
            laned: turn.laned,
        })
    }
}

/// A `RECORD`'s arguments.
struct Record<'a> {
    turn_id: &'a str,
    key: &'a str,
    tool: &'a str,
    body: &'a [u8],
    state_event: &'a str,
    now_ms: u64,
    ahead: Option<ClosingAhead<'a>>,
}

/// Whether the closing events built ahead are stored with the completing result: given,
/// built from every other call's result, each byte for byte the one stored.
fn stored_ahead(turn: &StoredState, key: &str, ahead: &ClosingAhead<'_>) -> bool {
    !ahead.events.is_empty()
        && ahead.checks.len() + 1 == turn.total
        && ahead.checks.iter().all(|(other, body)| {
            other != key && turn.results.get(other).is_some_and(|stored| stored == body)
        })
}

fn released(key: &str, job: &JobEnvelope, trace: &str) -> Released {
    Released {
        key: key.to_string(),
        job: job.clone(),
        trace: trace.to_string(),
    }
}

impl Immediate for MemoryStore {
    fn create(&self, turn: NewTurn<'_>) -> Result<Created, JoinError> {
        let mut state = self.reach()?;
        state
            .deadlines
            .entry(turn.turn_id.to_string())
            .or_insert(turn.deadline_unix_ms);
        if let Some(existing) = state.turns.get(turn.turn_id) {
            return Ok(Created::Exists {
                same_caller: existing.caller == turn.caller && existing.tenant == turn.tenant,
                same_request: existing.digest == turn.digest,
            });
        }
        let mut stored = StoredState {
            state: if turn.ended { "final" } else { "open" }.to_string(),
            total: turn.calls.len(),
            reply: turn.reply.to_string(),
            tenant: turn.tenant.to_string(),
            deadline: turn.deadline_unix_ms,
            paced: turn.paced,
            created: turn.created_unix_ms,
            traceparent: turn.traceparent.to_string(),
            trace: turn.trace.to_string(),
            caller: turn.caller.to_string(),
            digest: turn.digest.to_string(),
            laned: turn.laned,
            calls: turn.calls.into_iter().collect(),
            events: turn.events,
            ..StoredState::default()
        };
        for (key, result) in &turn.results {
            let body = serde_json::to_vec(result).map_err(|e| JoinError::Decode(e.to_string()))?;
            stored.results.insert(key.clone(), body);
        }
        if turn.ended {
            stored.ended = Some("no_tools".to_string());
            stored.final_seq = Some(stored.events.len() as u64);
        }
        for (key, job) in turn.queued {
            stored.queue.push_back(key.clone());
            stored.jobs.insert(key, job);
        }
        state.turns.insert(turn.turn_id.to_string(), stored);
        Ok(Created::New)
    }

    fn finalize(&self, turn_id: &str, reason: &str) -> Result<Finalized, JoinError> {
        let mut state = self.reach()?;
        let Some(turn) = state.turns.get_mut(turn_id) else {
            return Ok(Finalized::UnknownTurn);
        };
        if !turn.is_open() {
            if turn.final_seq.is_some() {
                return Ok(Finalized::AlreadyEnded {
                    published: turn.published > 0,
                });
            }
            return Ok(Finalized::Unstored {
                closing: turn.closing()?,
                ended: turn.ended.clone().unwrap_or_default(),
            });
        }
        turn.state = "final".to_string();
        turn.ended = Some(reason.to_string());
        Ok(Finalized::Ended(turn.closing()?))
    }

    fn cancel(
        &self,
        turn_id: &str,
        caller: &str,
        tenant: Option<&str>,
    ) -> Result<Cancelled, JoinError> {
        let mut state = self.reach()?;
        let Some(turn) = state.turns.get_mut(turn_id) else {
            return Ok(Cancelled::UnknownTurn);
        };
        if turn.caller != caller || tenant.is_some_and(|t| !t.is_empty() && t != turn.tenant) {
            return Ok(Cancelled::UnknownTurn);
        }
        if !turn.is_open() {
            return Ok(Cancelled::AlreadyEnded(
                turn.ended.clone().unwrap_or_default(),
            ));
        }
        turn.state = "final".to_string();
        turn.ended = Some("cancelled".to_string());
        Ok(Cancelled::Ended(turn.closing()?))
    }

    fn store_final(&self, turn_id: &str, events: &[String]) -> Result<StoredFinal, JoinError> {
        let mut state = self.reach()?;
        let Some(turn) = state.turns.get_mut(turn_id) else {
            return Ok(StoredFinal::UnknownTurn);
        };
        if turn.final_seq.is_some() {
            return Ok(StoredFinal::StoredBefore);
        }
        let last = turn.push(events);
        turn.final_seq = Some(last);
        turn.published = 0;
        turn.keep_bodies_in_final();
        Ok(StoredFinal::Stored {
            reply: turn.reply.clone(),
            first_seq: last - events.len() as u64 + 1,
        })
    }

    fn emit(
        &self,
        turn_id: &str,
        unless_result_of: Option<&str>,
        events: &[String],
    ) -> Result<Emitted, JoinError> {
        let mut state = self.reach()?;
        let Some(turn) = state.turns.get_mut(turn_id) else {
            return Ok(Emitted::Nothing);
        };
        let answered =
            unless_result_of.is_some_and(|k| !k.is_empty() && turn.results.contains_key(k));
        if turn.final_seq.is_some() || answered {
            return Ok(Emitted::Nothing);
        }
        let last = turn.push(events);
        Ok(Emitted::Stored {
            reply: turn.reply.clone(),
            first_seq: last - events.len() as u64 + 1,
        })
    }

    fn attach(
        &self,
        turn_id: &str,
        caller: &str,
        tenant: Option<&str>,
        reply: &str,
        after_seq: u64,
    ) -> Result<Attached, JoinError> {
        let mut state = self.reach()?;
        let Some(turn) = state.turns.get_mut(turn_id).filter(|t| t.caller == caller) else {
            return Ok(Attached::UnknownTurn);
        };
        if tenant.is_some_and(|t| !t.is_empty() && t != turn.tenant) {
            return Ok(Attached::OtherTenant);
        }
        turn.reply = reply.to_string();
        let from = usize::try_from(after_seq).unwrap_or(usize::MAX);
        Ok(Attached::Events(
            turn.events.iter().skip(from).cloned().collect(),
        ))
    }

    fn mark_published(&self, turn_id: &str) -> Result<bool, JoinError> {
        let mut state = self.reach()?;
        state.deadlines.remove(turn_id);
        let marks = match state.turns.get_mut(turn_id) {
            Some(turn) => {
                turn.published += 1;
                turn.published
            }
            None => {
                let marks = state
                    .marks_of_unknown
                    .entry(turn_id.to_string())
                    .or_default();
                *marks += 1;
                *marks
            }
        };
        Ok(marks == 1)
    }

    fn due(&self, key: &str, unix_ms: u64, limit: usize) -> Result<Vec<String>, JoinError> {
        let state = self.reach()?;
        if key != DEADLINES {
            return Ok(Vec::new());
        }
        let mut due: Vec<(u64, &String)> = state
            .deadlines
            .iter()
            .filter(|(_, deadline)| **deadline <= unix_ms)
            .map(|(turn_id, deadline)| (*deadline, turn_id))
            .collect();
        due.sort();
        Ok(due
            .into_iter()
            .take(limit)
            .map(|(_, id)| id.clone())
            .collect())
    }

    fn record_encoded(
        &self,
        turn_id: &str,
        call_key: &str,
        result: &CallResult,
        body: &[u8],
        state_event: &str,
        ahead: Option<ClosingAhead<'_>>,
    ) -> Result<Recorded, JoinError> {
        self.do_record(Record {
            turn_id,
            key: call_key,
            tool: &result.name,
            body,
            state_event,
            now_ms: unix_ms(),
            ahead,
        })
    }

    fn stored_events(&self, turn_id: &str) -> Result<StoredTurn, JoinError> {
        let state = self.reach()?;
        Ok(state
            .turns
            .get(turn_id)
            .map(|turn| StoredTurn {
                reply: turn.reply.clone(),
                events: turn.events.clone(),
                trace: Some(turn.trace.clone()).filter(|t| !t.is_empty()),
                ended: turn.ended.clone().unwrap_or_default(),
            })
            .unwrap_or_default())
    }

    fn confirm_dispatched(&self, turn_id: &str, key: &str) -> Result<(), JoinError> {
        let mut state = self.reach()?;
        if let Some(turn) = state.turns.get_mut(turn_id) {
            turn.dispatching.remove(key);
            turn.jobs.remove(key);
        }
        Ok(())
    }

    fn forget_deadline(&self, turn_id: &str) -> Result<(), JoinError> {
        self.reach()?.deadlines.remove(turn_id);
        Ok(())
    }

    fn deadline_keys(&self, _first: u32) -> Vec<String> {
        vec![DEADLINES.to_string()]
    }

    fn reject_result(&self, tool: &str, rejection: &Rejection) -> Result<(), JoinError> {
        self.reach()?
            .rejected
            .insert(tool.to_string(), rejection.clone());
        Ok(())
    }
}
