//! The seam in front of the turn store: [`TurnStore`], what the turn path asks of the
//! store, with the Redis store (`store/redis.rs`) behind it in a running coordinator and
//! an in-memory store (`store/memory.rs`) behind it in unit tests.
//!
//! Owns the trait and its implementations, made from one list of its methods: for
//! [`JoinStore`], which only forwards to the join's own methods (every decision that
//! makes a result count once and a turn end once stays in the join's scripts), and for
//! the memory store through the `Immediate` trait it implements. Never decides anything
//! itself.

use futures::future::BoxFuture;
use toolfleet_common::tool::Rejection;
use toolfleet_common::CallResult;

use crate::store::redis::{
    Attached, Cancelled, ClosingAhead, Created, Emitted, Finalized, JoinError, JoinStore, NewTurn,
    Recorded, StoredFinal, StoredTurn,
};

#[cfg(test)]
pub(crate) mod memory;
pub mod redis;

/// Declares [`TurnStore`] from one list of its methods, and implements it for
/// [`JoinStore`] (each method awaits the join's own method of the same name) and, in unit
/// tests, for every `Immediate` store (each method runs the store's method of the same
/// name, which decides at once). One list, so the trait and both stores cannot drift
/// apart. Every listed method answers `Result<_, JoinError>`; `'a` is the lifetime of
/// the store and of every borrowed argument.
macro_rules! turn_store {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $out:ty;
    )*) => {
        /// What the turn path asks of the store of turns, calls, results and events. Each
        /// method does what the [`JoinStore`] method of the same name documents, in one
        /// step.
        pub trait TurnStore: Send + Sync {
            $(
                $(#[$doc])*
                fn $name<'a>(&'a self, $($arg: $ty),*) -> BoxFuture<'a, Result<$out, JoinError>>;
            )*

            /// The deadline index keys a sweep reads, starting at bucket `first`.
            fn deadline_keys(&self, first: u32) -> Vec<String>;
        }

        impl TurnStore for JoinStore {
            $(
                fn $name<'a>(&'a self, $($arg: $ty),*) -> BoxFuture<'a, Result<$out, JoinError>> {
                    Box::pin(JoinStore::$name(self, $($arg),*))
                }
            )*

            fn deadline_keys(&self, first: u32) -> Vec<String> {
                JoinStore::deadline_keys(self, first)
            }
        }

        /// A store that decides at once, without I/O (`store/memory.rs`): the methods of
        /// [`TurnStore`], answered without a future.
        #[cfg(test)]
        pub(crate) trait Immediate: Send + Sync {
            $(
                fn $name<'a>(&'a self, $($arg: $ty),*) -> Result<$out, JoinError>;
            )*

            fn deadline_keys(&self, first: u32) -> Vec<String>;
        }

        #[cfg(test)]
        impl<S: Immediate> TurnStore for S {
            $(
                fn $name<'a>(&'a self, $($arg: $ty),*) -> BoxFuture<'a, Result<$out, JoinError>> {
                    // Decided when awaited, as the join's script runs then.
                    Box::pin(async move { Immediate::$name(self, $($arg),*) })
                }
            )*

            fn deadline_keys(&self, first: u32) -> Vec<String> {
                Immediate::deadline_keys(self, first)
            }
        }
    };
}

turn_store! {
    /// Stores a new turn with its first events, or says who holds the id.
    fn create(turn: NewTurn<'a>) -> Created;

    /// Records `result` (stored as `body`) under `call_key`, once.
    fn record_encoded(
        turn_id: &'a str, call_key: &'a str, result: &'a CallResult, body: &'a [u8],
        state_event: &'a str, ahead: Option<ClosingAhead<'a>>,
    ) -> Recorded;

    /// Ends the turn for `reason` unless it already ended.
    fn finalize(turn_id: &'a str, reason: &'a str) -> Finalized;

    /// Ends the open turn of `caller` (and `tenant`) because it was cancelled.
    fn cancel(turn_id: &'a str, caller: &'a str, tenant: Option<&'a str>) -> Cancelled;

    /// Stores the closing events, `final` last, unless a `final` is stored.
    fn store_final(turn_id: &'a str, events: &'a [String]) -> StoredFinal;

    /// Stores events of a turn that has not ended.
    fn emit(turn_id: &'a str, unless_result_of: Option<&'a str>, events: &'a [String]) -> Emitted;

    /// Moves the turn's later events to `reply`; the stored events after `after_seq`.
    fn attach(
        turn_id: &'a str, caller: &'a str, tenant: Option<&'a str>, reply: &'a str,
        after_seq: u64,
    ) -> Attached;

    /// Every stored event of a turn, for sending a stored `final` again.
    fn stored_events(turn_id: &'a str) -> StoredTurn;

    /// Marks the stored `final` sent; whether this call was the first.
    fn mark_published(turn_id: &'a str) -> bool;

    /// Notes that a released call's job was published.
    fn confirm_dispatched(turn_id: &'a str, key: &'a str) -> ();

    /// Removes the turn from the deadline index.
    fn forget_deadline(turn_id: &'a str) -> ();

    /// Turns in index `key` whose deadline is at or before `unix_ms`, at most `limit`.
    fn due(key: &'a str, unix_ms: u64, limit: usize) -> Vec<String>;

    /// Writes back the last result of `tool` this coordinator refused.
    fn reject_result(tool: &'a str, rejection: &'a Rejection) -> ();
}
