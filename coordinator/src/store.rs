//! The seam in front of the turn store: [`TurnStore`], what the turn path asks of the
//! join, with the Redis join (`join.rs`) behind it in a running coordinator and an
//! in-memory store (`store/memory.rs`) behind it in unit tests.
//!
//! Owns the trait and its implementation for [`JoinStore`], which only forwards to the
//! join's own methods: every decision that makes a result count once and a turn end
//! once stays in the join's scripts. Never decides anything itself.

use futures::future::BoxFuture;
use toolfleet_common::tool::Rejection;
use toolfleet_common::CallResult;

use crate::join::{
    Attached, Cancelled, ClosingAhead, Created, Emitted, Finalized, JoinError, JoinStore, NewTurn,
    Recorded, StoredFinal, StoredTurn,
};

#[cfg(test)]
pub(crate) mod memory;

/// What the turn path asks of the store of turns, calls, results and events. Each
/// method does what the [`JoinStore`] method of the same name documents, in one step.
pub trait TurnStore: Send + Sync {
    /// Stores a new turn with its first events, or says who holds the id.
    fn create<'a>(&'a self, turn: NewTurn<'a>) -> BoxFuture<'a, Result<Created, JoinError>>;

    /// Records `result` (stored as `body`) under `call_key`, once.
    fn record_encoded<'a>(
        &'a self,
        turn_id: &'a str,
        call_key: &'a str,
        result: &'a CallResult,
        body: &'a [u8],
        state_event: &'a str,
        ahead: Option<ClosingAhead<'a>>,
    ) -> BoxFuture<'a, Result<Recorded, JoinError>>;

    /// Ends the turn for `reason` unless it already ended.
    fn finalize<'a>(
        &'a self,
        turn_id: &'a str,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<Finalized, JoinError>>;

    /// Ends the open turn of `caller` (and `tenant`) because it was cancelled.
    fn cancel<'a>(
        &'a self,
        turn_id: &'a str,
        caller: &'a str,
        tenant: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Cancelled, JoinError>>;

    /// Stores the closing events, `final` last, unless a `final` is stored.
    fn store_final<'a>(
        &'a self,
        turn_id: &'a str,
        events: &'a [String],
    ) -> BoxFuture<'a, Result<StoredFinal, JoinError>>;

    /// Stores events of a turn that has not ended.
    fn emit<'a>(
        &'a self,
        turn_id: &'a str,
        unless_result_of: Option<&'a str>,
        events: &'a [String],
    ) -> BoxFuture<'a, Result<Emitted, JoinError>>;

    /// Moves the turn's later events to `reply`; the stored events after `after_seq`.
    fn attach<'a>(
        &'a self,
        turn_id: &'a str,
        caller: &'a str,
        tenant: Option<&'a str>,
        reply: &'a str,
        after_seq: u64,
    ) -> BoxFuture<'a, Result<Attached, JoinError>>;

    /// Every stored event of a turn, for sending a stored `final` again.
    fn stored_events<'a>(
        &'a self,
        turn_id: &'a str,
    ) -> BoxFuture<'a, Result<StoredTurn, JoinError>>;

    /// Marks the stored `final` sent; whether this call was the first.
    fn mark_published<'a>(&'a self, turn_id: &'a str) -> BoxFuture<'a, Result<bool, JoinError>>;

    /// Notes that a released call's job was published.
    fn confirm_dispatched<'a>(
        &'a self,
        turn_id: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), JoinError>>;

    /// Removes the turn from the deadline index.
    fn forget_deadline<'a>(&'a self, turn_id: &'a str) -> BoxFuture<'a, Result<(), JoinError>>;

    /// The deadline index keys a sweep reads, starting at bucket `first`.
    fn deadline_keys(&self, first: u32) -> Vec<String>;

    /// Turns in index `key` whose deadline is at or before `unix_ms`, at most `limit`.
    fn due<'a>(
        &'a self,
        key: &'a str,
        unix_ms: u64,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<String>, JoinError>>;

    /// Writes back the last result of `tool` this coordinator refused.
    fn reject_result<'a>(
        &'a self,
        tool: &'a str,
        rejection: &'a Rejection,
    ) -> BoxFuture<'a, Result<(), JoinError>>;
}

impl TurnStore for JoinStore {
    fn create<'a>(&'a self, turn: NewTurn<'a>) -> BoxFuture<'a, Result<Created, JoinError>> {
        Box::pin(JoinStore::create(self, turn))
    }

    fn record_encoded<'a>(
        &'a self,
        turn_id: &'a str,
        call_key: &'a str,
        result: &'a CallResult,
        body: &'a [u8],
        state_event: &'a str,
        ahead: Option<ClosingAhead<'a>>,
    ) -> BoxFuture<'a, Result<Recorded, JoinError>> {
        Box::pin(JoinStore::record_encoded(
            self,
            turn_id,
            call_key,
            result,
            body,
            state_event,
            ahead,
        ))
    }

    fn finalize<'a>(
        &'a self,
        turn_id: &'a str,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<Finalized, JoinError>> {
        Box::pin(JoinStore::finalize(self, turn_id, reason))
    }

    fn cancel<'a>(
        &'a self,
        turn_id: &'a str,
        caller: &'a str,
        tenant: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Cancelled, JoinError>> {
        Box::pin(JoinStore::cancel(self, turn_id, caller, tenant))
    }

    fn store_final<'a>(
        &'a self,
        turn_id: &'a str,
        events: &'a [String],
    ) -> BoxFuture<'a, Result<StoredFinal, JoinError>> {
        Box::pin(JoinStore::store_final(self, turn_id, events))
    }

    fn emit<'a>(
        &'a self,
        turn_id: &'a str,
        unless_result_of: Option<&'a str>,
        events: &'a [String],
    ) -> BoxFuture<'a, Result<Emitted, JoinError>> {
        Box::pin(JoinStore::emit(self, turn_id, unless_result_of, events))
    }

    fn attach<'a>(
        &'a self,
        turn_id: &'a str,
        caller: &'a str,
        tenant: Option<&'a str>,
        reply: &'a str,
        after_seq: u64,
    ) -> BoxFuture<'a, Result<Attached, JoinError>> {
        Box::pin(JoinStore::attach(
            self, turn_id, caller, tenant, reply, after_seq,
        ))
    }

    fn stored_events<'a>(
        &'a self,
        turn_id: &'a str,
    ) -> BoxFuture<'a, Result<StoredTurn, JoinError>> {
        Box::pin(JoinStore::stored_events(self, turn_id))
    }

    fn mark_published<'a>(&'a self, turn_id: &'a str) -> BoxFuture<'a, Result<bool, JoinError>> {
        Box::pin(JoinStore::mark_published(self, turn_id))
    }

    fn confirm_dispatched<'a>(
        &'a self,
        turn_id: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), JoinError>> {
        Box::pin(JoinStore::confirm_dispatched(self, turn_id, key))
    }

    fn forget_deadline<'a>(&'a self, turn_id: &'a str) -> BoxFuture<'a, Result<(), JoinError>> {
        Box::pin(JoinStore::forget_deadline(self, turn_id))
    }

    fn deadline_keys(&self, first: u32) -> Vec<String> {
        JoinStore::deadline_keys(self, first)
    }

    fn due<'a>(
        &'a self,
        key: &'a str,
        unix_ms: u64,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<String>, JoinError>> {
        Box::pin(JoinStore::due(self, key, unix_ms, limit))
    }

    fn reject_result<'a>(
        &'a self,
        tool: &'a str,
        rejection: &'a Rejection,
    ) -> BoxFuture<'a, Result<(), JoinError>> {
        Box::pin(JoinStore::reject_result(self, tool, rejection))
    }
}
