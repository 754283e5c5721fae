//! The turn store in Redis: a turn's calls, results and events, recorded and finalized
//! by Lua scripts so that a result counts once and a turn ends once, whichever replica
//! runs them. `results.rs` joins the results through it; the integration tests reach it
//! as `toolfleet_coordinator::join`.
//!
//! Keys of one turn share the `{turn_id}` hash tag (see `Names`), so each script touches a
//! single slot and runs unchanged on Redis Cluster. The deadline index is split into
//! buckets, each its own key with its own hash tag, never touched by a script: it is
//! updated with separate commands (`RedisConnection::in_order`), a turn's entry in the
//! bucket of its id (`Names::deadline_bucket`).
//!
//! Owns every read and write of a turn's Redis keys. Never publishes: callers act on
//! what the scripts return (`Recorded`, `Finalized`), and only the caller that got a
//! `Closing` may publish the turn's end.

use std::collections::HashMap;

use redis::{FromRedisValue, Script, Value as RedisValue};
use serde::{Deserialize, Serialize};
use toolfleet_common::call::unix_ms;
use toolfleet_common::redis_client::RedisConnection;
use toolfleet_common::tool::Rejection;
use toolfleet_common::{CallResult, JobEnvelope, Names};

use crate::event_log;

/// Buckets of the deadline index unless configured (`TOOLFLEET_DEADLINE_BUCKETS`).
pub const DEFAULT_DEADLINE_BUCKETS: u32 = 16;

/// Creates a turn unless it exists. KEYS: meta, calls, results, events, queue, jobs.
/// ARGV: ttl_ms, total, reply, tenant, deadline, paced, created, traceparent, trace,
/// caller, state, request digest, laned (its calls go through the tools' lanes: 1/0), n_calls, (key, call)*, n_results, (key, result)*, n_events, event*,
/// n_queued, (key, job)*. The queued calls (held back by the concurrency bound) are
/// kept with the turn, in the model's order, so whichever replica records a result
/// releases the next one.
/// `trace` is the turn span's identity (`trace.rs`), handed back to whoever ends the
/// turn; `caller` is the submitting frontend ('' when unidentified), the only one that
/// may attach. The events (the `ack` and the first call states, or a no-tool turn's
/// narration and `final`) are stored before anything is sent: seq 1, 2, …. A turn
/// created `final` (no tools) has its `final` stored with it. Returns {1} when created,
/// {0, same caller and tenant (1/0), same request digest (1/0)} when the id exists: a
/// frontend serving several tenants (the HTTP gateway) never attaches one tenant to
/// another's turn, and a resubmission replays a turn only when it is the same request
/// (a turn stored without a digest counts as the same).
/// The Lua helper the scripts write a run of values with: `put(command, key, list, first,
/// last)` sends `command key list[first..last]` in slices of 1,000 values, as Redis's Lua
/// unpacks at most about 8,000 (a decision may hold 10,000 calls); an even slice keeps
/// field-value pairs together. Returns the last slice's reply.
macro_rules! put_lua {
    () => {
        r#"
local function put(command, key, list, first, last)
  local reply
  for s = first, last, 1000 do
    reply = redis.call(command, key, unpack(list, s, math.min(s + 999, last)))
  end
  return reply
end
"#
    };
}

/// The Lua helper the scripts that store a `final` end with:
/// `kept_in_final(calls, results)` drops the turn's results hash, since the `final`
/// carries each result from then on, and keeps in each call's entry only its tool and,
/// for a call that had its result, `"recorded":true`: enough to refuse a result of
/// another tool and to tell a redelivered result (a duplicate) from a late one. The
/// calls hash is written anew (the fields deleted, which deletes the key, then set
/// again, its TTL restored) so that it shrinks to Redis's compact encoding, with only
/// the commands the fleet's Redis user may run (deploy/redis/users.acl).
macro_rules! forget_lua {
    () => {
        r#"
local function kept_in_final(calls, results)
  local entries = redis.call('HGETALL', calls)
  if #entries == 0 then return end
  local recorded, stored = {}, redis.call('HGETALL', results)
  for i = 1, #stored, 2 do recorded[stored[i]] = true end
  local ttl = redis.call('PTTL', calls)
  local fields, kept = {}, {}
  for i = 1, #entries, 2 do
    local ok, call = pcall(cjson.decode, entries[i + 1])
    local name = (ok and type(call) == 'table' and call.name) or ''
    fields[#fields + 1] = entries[i]
    kept[#kept + 1] = entries[i]
    kept[#kept + 1] = cjson.encode({name = name, recorded = recorded[entries[i]]})
  end
  put('HDEL', calls, fields, 1, #fields)
  put('HSET', calls, kept, 1, #kept)
  if ttl > 0 then redis.call('PEXPIRE', calls, ttl) end
  redis.call('DEL', results)
end
"#
    };
}

const CREATE: &str = concat!(
    put_lua!(),
    r#"
if redis.call('EXISTS', KEYS[1]) == 1 then
  local owner = redis.call('HMGET', KEYS[1], 'caller', 'tenant', 'digest')
  local same = (owner[1] or '') == ARGV[10] and owner[2] == ARGV[4]
  local digest = (not owner[3]) or owner[3] == ARGV[12]
  return {0, same and 1 or 0, digest and 1 or 0}
end
redis.call('HSET', KEYS[1], 'state', ARGV[11], 'total', ARGV[2], 'reply', ARGV[3],
  'tenant', ARGV[4], 'deadline', ARGV[5], 'paced', ARGV[6], 'created', ARGV[7],
  'traceparent', ARGV[8], 'trace', ARGV[9], 'caller', ARGV[10], 'late', 0, 'duplicates', 0,
  'digest', ARGV[12], 'laned', ARGV[13])
local written = {KEYS[1]}
local i = 14
local n = tonumber(ARGV[i]); i = i + 1
if n > 0 then put('HSET', KEYS[2], ARGV, i, i + 2 * n - 1); written[#written + 1] = KEYS[2] end
i = i + 2 * n
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then put('HSET', KEYS[3], ARGV, i, i + 2 * n - 1); written[#written + 1] = KEYS[3] end
i = i + 2 * n
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then put('RPUSH', KEYS[4], ARGV, i, i + n - 1); written[#written + 1] = KEYS[4] end
i = i + n
if ARGV[11] == 'final' then
  redis.call('HSET', KEYS[1], 'ended', 'no_tools', 'final_seq', n, 'published', 0)
end
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then
  local keys = {}
  for k = i, i + 2 * n - 1, 2 do keys[#keys + 1] = ARGV[k] end
  put('RPUSH', KEYS[5], keys, 1, #keys)
  put('HSET', KEYS[6], ARGV, i, i + 2 * n - 1)
  written[#written + 1] = KEYS[5]; written[#written + 1] = KEYS[6]
end
for _, key in ipairs(written) do redis.call('PEXPIRE', key, ARGV[1]) end
return {1}
"#
);

/// Records one result, write-once per call key, and stores its call's terminal state
/// event. A result recorded at or after the turn's deadline is late even while the turn
/// is still open, so the deadline alone decides the turn's end. KEYS: meta, calls,
/// results, events, queue, jobs, dispatching. ARGV: call key, result JSON, now (Unix
/// ms), the result's tool, the state event. A result whose tool is not the call's is
/// refused (`wrong_tool`) and changes nothing.
///
/// A result of a paced turn frees a slot: the next queued call is released in the same
/// step (its entry no longer `queued`, its key in `dispatching` until its job's publish
/// is confirmed) and handed back with the stored turn trace. A duplicate of a recorded
/// result hands back the released calls still unconfirmed, so a replica that died
/// between releasing and publishing is covered by the redelivery of the result that
/// released them (publishing again is safe: the job's message id de-duplicates it).
///
/// ARGV 6 on, when given: n_checks, (key, body)*, event*: the turn's closing events
/// built ahead (narration, `final` last) from the results whose stored bodies are given
/// for every other call. When this result completes the turn and every other stored
/// result is byte for byte the one given, the events are stored
/// after the call's state (seq + 1, …), the `final` marked stored and the stored
/// results dropped (the `final` carries them; `kept_in_final`), in this one step
/// (`complete_stored`); otherwise the turn is handed back to be closed after the join
/// (`complete`), as without them.
const RECORD: &str = concat!(
    put_lua!(),
    forget_lua!(),
    r#"
local meta = redis.call('HMGET', KEYS[1], 'state', 'deadline', 'reply', 'paced', 'total',
  'created', 'traceparent', 'trace', 'laned', 'tenant')
local state = meta[1]
if not state then return {'unknown'} end
-- A turn stored without the field went through the lanes.
local laned = meta[9] or '1'
local entry = redis.call('HGET', KEYS[2], ARGV[1])
if not entry then return {'unknown_call'} end
local ok, call = pcall(cjson.decode, entry)
if not ok or type(call) ~= 'table' or call.name ~= ARGV[4] then return {'wrong_tool'} end
if call.recorded or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'duplicates', 1)
  local again = {}
  if state == 'open' then
    for _, k in ipairs(redis.call('SMEMBERS', KEYS[7])) do
      if redis.call('HEXISTS', KEYS[3], k) == 0 then
        again[#again + 1] = k
        again[#again + 1] = redis.call('HGET', KEYS[6], k) or ''
      end
    end
  end
  local trace = #again > 0 and meta[8] or ''
  return {'duplicate', trace or '', again, laned}
end
local deadline = tonumber(meta[2])
if state ~= 'open' or (deadline and tonumber(ARGV[3]) >= deadline) then
  redis.call('HINCRBY', KEYS[1], 'late', 1)
  return {'late', laned}
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
if redis.call('PTTL', KEYS[3]) < 0 then
  redis.call('PEXPIRE', KEYS[3], math.max(redis.call('PTTL', KEYS[1]), 1000))
end
local seq = redis.call('RPUSH', KEYS[4], ARGV[5])
if redis.call('HLEN', KEYS[3]) >= tonumber(meta[5]) then
  local n = tonumber(ARGV[6] or '-1')
  if n >= 0 and n + 1 == tonumber(meta[5]) then
    local same = true
    for i = 7, 6 + 2 * n, 2 do
      local stored = redis.call('HGET', KEYS[3], ARGV[i])
      if ARGV[i] == ARGV[1] or not stored or stored ~= ARGV[i + 1] then
        same = false
        break
      end
    end
    local first = 7 + 2 * n
    if same and first <= #ARGV then
      local last = put('RPUSH', KEYS[4], ARGV, first, #ARGV)
      redis.call('HSET', KEYS[1], 'state', 'final', 'ended', 'complete', 'final_seq', last,
        'published', 0)
      kept_in_final(KEYS[2], KEYS[3])
      return {'complete_stored', meta[3], meta[4], seq, laned}
    end
  end
  redis.call('HSET', KEYS[1], 'state', 'final', 'ended', 'complete')
  return {'complete', meta[3], meta[4], redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
    meta[6] or '0', meta[7] or '', meta[8] or '', seq, meta[10] or '', meta[2] or '0', laned}
end
local released = {}
if meta[4] == '1' then
  local k = redis.call('LPOP', KEYS[5])
  if k then
    local queued = redis.call('HGET', KEYS[2], k)
    if queued then
      redis.call('HSET', KEYS[2], k, (string.gsub(queued, '"queued":true}$', '"queued":false}')))
    end
    redis.call('SADD', KEYS[7], k)
    redis.call('PEXPIRE', KEYS[7], math.max(redis.call('PTTL', KEYS[1]), 1000))
    released = {k, redis.call('HGET', KEYS[6], k) or ''}
  end
end
return {'recorded', meta[3], meta[4], seq, #released > 0 and (meta[8] or '') or '', released, laned}
"#
);

/// Ends a turn unless it already ended. KEYS: meta, calls, results. ARGV: reason.
/// For a turn that ended before, says whether its `final` is stored and published; one
/// that ended without a stored `final` (its replica died while ending it) is handed
/// back whole (`unstored`) so this caller can finish it.
const FINALIZE: &str = r#"
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if state ~= 'open' then
  local stored = redis.call('HMGET', KEYS[1], 'final_seq', 'published')
  if stored[1] then return {'already', stored[2] or '0'} end
end
if state == 'open' then redis.call('HSET', KEYS[1], 'state', 'final', 'ended', ARGV[1]) end
local meta = redis.call('HMGET', KEYS[1], 'reply', 'paced', 'created', 'traceparent', 'trace', 'ended',
  'tenant', 'deadline', 'laned')
return {state == 'open' and 'finalized' or 'unstored', meta[1], meta[2], redis.call('HGETALL', KEYS[2]),
  redis.call('HGETALL', KEYS[3]), meta[3] or '0', meta[4] or '', meta[5] or '', meta[6] or '',
  meta[7] or '', meta[8] or '0', meta[9] or '1'}
"#;

/// Ends an open turn because its caller cancelled it. KEYS: meta, calls, results.
/// ARGV: caller, tenant ('' for any). Another caller's or tenant's turn reads as
/// unknown; a turn that already ended is left as it is and says how it ended
/// (`ended`). Returns what FINALIZE returns for the turn it ends.
const CANCEL: &str = r#"
local meta = redis.call('HMGET', KEYS[1], 'caller', 'tenant', 'state', 'ended')
if not meta[3] or (meta[1] or '') ~= ARGV[1] or (ARGV[2] ~= '' and meta[2] ~= ARGV[2]) then
  return {'unknown'}
end
if meta[3] ~= 'open' then return {'ended', meta[4] or ''} end
redis.call('HSET', KEYS[1], 'state', 'final', 'ended', 'cancelled')
local m = redis.call('HMGET', KEYS[1], 'reply', 'paced', 'created', 'traceparent', 'trace', 'deadline',
  'laned')
return {'cancelled', m[1], m[2], redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
  m[3] or '0', m[4] or '', m[5] or '', 'cancelled', meta[2] or '', m[6] or '0', m[7] or '1'}
"#;

/// Stores a turn's closing events (the last call states, the narration, `final` last)
/// unless a `final` is stored already, then drops the stored results (the `final`
/// carries them; `kept_in_final`). KEYS: meta, events, results, calls. ARGV: event*.
/// A meta hash without a `state` (written to after the turn's keys expired) is an
/// unknown turn.
const STORE_FINAL: &str = concat!(
    put_lua!(),
    forget_lua!(),
    r#"
local meta = redis.call('HMGET', KEYS[1], 'state', 'final_seq', 'reply')
if not meta[1] then return {'unknown'} end
if meta[2] then return {'stored_before'} end
local last = put('RPUSH', KEYS[2], ARGV, 1, #ARGV)
redis.call('HSET', KEYS[1], 'final_seq', last, 'published', 0)
kept_in_final(KEYS[4], KEYS[3])
return {'stored', meta[3], last - #ARGV + 1}
"#
);

/// Stores events of a turn that has not ended, and (with a call key) whose call has no
/// result yet, so a `running` never follows the call's terminal state.
/// KEYS: meta, events, results. ARGV: call key ('' for none), event*.
const EMIT: &str = concat!(
    put_lua!(),
    r#"
local meta = redis.call('HMGET', KEYS[1], 'final_seq', 'reply')
if meta[1] then return {'ended'} end
if ARGV[1] ~= '' and redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return {'ended'} end
local reply = meta[2]
if not reply then return {'unknown'} end
local last = put('RPUSH', KEYS[2], ARGV, 2, #ARGV)
return {'emitted', reply, last - (#ARGV - 1) + 1}
"#
);

/// Sends a turn's later events to a new reply subject and returns the stored events
/// after a seq, in one step, so nothing falls between the two. KEYS: meta, events.
/// ARGV: caller, reply, after_seq, tenant ('' for any). Another caller's turn reads as
/// unknown; this caller's turn of another tenant is `other_tenant`, left as it is.
const ATTACH: &str = r#"
local meta = redis.call('HMGET', KEYS[1], 'caller', 'state', 'tenant')
if not meta[2] or (meta[1] or '') ~= ARGV[1] then return {'unknown'} end
if ARGV[4] ~= '' and meta[3] ~= ARGV[4] then return {'other_tenant'} end
redis.call('HSET', KEYS[1], 'reply', ARGV[2])
return {'attached', redis.call('LRANGE', KEYS[2], tonumber(ARGV[3]), -1)}
"#;

/// A call as stored in the turn's `calls` hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallEntry {
    /// Position in the decision.
    pub index: usize,
    /// The model's call id.
    pub id: String,
    /// The tool name.
    pub name: String,
    /// The `parallel` meta-call it came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<String>,
    /// Held back by the turn's concurrency bound and not yet dispatched.
    #[serde(default)]
    pub queued: bool,
}

/// Everything needed to build a turn's `final` event.
#[derive(Debug, Clone)]
pub struct Closing {
    /// Where the turn's events go.
    pub reply: String,
    /// Calls by key.
    pub calls: HashMap<String, CallEntry>,
    /// Results by call key.
    pub results: HashMap<String, CallResult>,
    /// When the turn was taken, Unix milliseconds.
    pub created_unix_ms: u64,
    /// The W3C `traceparent` of the turn's span, when it was traced.
    pub traceparent: Option<String>,
    /// The turn span's stored identity (`trace.rs`), when it was traced.
    pub trace: Option<String>,
    /// Its tenant.
    pub tenant: String,
    /// Its deadline, Unix ms.
    pub deadline_unix_ms: u64,
    /// Whether its calls went through the tools' lanes.
    pub laned: bool,
}

/// What recording a result did.
#[derive(Debug, Clone)]
pub enum Recorded {
    /// No such turn (expired or never created).
    UnknownTurn,
    /// The turn has no call with that key.
    UnknownCall,
    /// The call is of another tool than the result names: a forgery, never recorded.
    WrongTool,
    /// The call already had a result; this one is ignored. `again`: the released
    /// calls whose publish is still unconfirmed (their releaser may have died), to
    /// publish again.
    Duplicate {
        /// Released calls still unconfirmed.
        again: Vec<Released>,
        /// Whether the turn's calls go through the tools' lanes.
        laned: bool,
    },
    /// The turn had already ended, or its deadline had passed; counted as late.
    Late {
        /// Whether the turn's calls went through the tools' lanes.
        laned: bool,
    },
    /// Recorded; the turn is still waiting for others.
    Recorded {
        /// Where the turn's events go.
        reply: String,
        /// Whether the turn's owner paces dispatch by completions.
        paced: bool,
        /// The seq of the call's stored state event.
        seq: u64,
        /// The queued call this result's slot released, to publish now.
        released: Option<Released>,
        /// Whether the turn's calls go through the tools' lanes.
        laned: bool,
    },
    /// Recorded, it was the last one, and the closing events built ahead are stored
    /// after its state, `final` last: this caller sends them and ends the turn.
    CompleteStored {
        /// Where the turn's events go.
        reply: String,
        /// The seq of the call's stored state event; the closing events follow it.
        seq: u64,
        /// Whether the turn's calls went through the tools' lanes.
        laned: bool,
    },
    /// Recorded, and it was the last one: this caller finalizes the turn.
    Complete {
        /// The turn's calls and results.
        closing: Closing,
        /// Whether the turn's owner paces dispatch by completions.
        paced: bool,
        /// The seq of the call's stored state event.
        seq: u64,
    },
}

impl Recorded {
    /// A short name of the outcome, for spans and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnknownTurn => "unknown_turn",
            Self::UnknownCall => "unknown_call",
            Self::WrongTool => "wrong_tool",
            Self::Duplicate { .. } => "duplicate",
            Self::Late { .. } => "late",
            Self::Recorded { .. } => "recorded",
            Self::Complete { .. } | Self::CompleteStored { .. } => "complete",
        }
    }

    /// Whether the result's call holds a lane slot to free: its turn's calls go through
    /// the tools' lanes, or the turn is not known (then freeing is harmless).
    pub fn laned(&self) -> bool {
        match self {
            Self::UnknownTurn => true,
            Self::UnknownCall | Self::WrongTool => false,
            Self::Duplicate { laned, .. }
            | Self::Late { laned }
            | Self::Recorded { laned, .. }
            | Self::CompleteStored { laned, .. } => *laned,
            Self::Complete { closing, .. } => closing.laned,
        }
    }
}

/// Closing events built before a result that may complete its turn is recorded
/// ([`JoinStore::record_encoded`]).
#[derive(Debug, Clone, Copy)]
pub struct ClosingAhead<'a> {
    /// Each other call's key and the stored body of the result the events were built
    /// from.
    pub checks: &'a [(String, Vec<u8>)],
    /// The closing events: the narration, `final` last.
    pub events: &'a [String],
}

/// A queued call of a paced turn released by a freed slot: publish its job, then
/// [`JoinStore::confirm_dispatched`].
#[derive(Debug, Clone)]
pub struct Released {
    /// The call's key.
    pub key: String,
    /// Its job, as stored when the turn was created.
    pub job: JobEnvelope,
    /// The turn span's stored identity (`trace.rs`; empty when not traced).
    pub trace: String,
}

/// An ended turn as stored, for sending its `final` again.
#[derive(Debug, Clone, Default)]
pub struct StoredTurn {
    /// Where its events go.
    pub reply: String,
    /// Every stored event, `final` last.
    pub events: Vec<String>,
    /// The turn span's stored identity (`trace.rs`), when it was traced.
    pub trace: Option<String>,
    /// How it ended (`complete`, `deadline`, `cancelled`, `no_tools`).
    pub ended: String,
}

/// What finalizing did.
#[derive(Debug, Clone)]
pub enum Finalized {
    /// No such turn.
    UnknownTurn,
    /// Ended before, its `final` stored; `published` once it was sent.
    AlreadyEnded {
        /// Whether the stored `final` was marked sent.
        published: bool,
    },
    /// This caller ended it.
    Ended(Closing),
    /// Ended before, but its `final` was never stored (the replica ending it died):
    /// this caller finishes it.
    Unstored {
        /// The turn's calls and results.
        closing: Closing,
        /// How it ended (`complete`, `deadline`, `cancelled`).
        ended: String,
    },
}

/// What attaching to a turn found.
#[derive(Debug, Clone)]
pub enum Attached {
    /// No such turn for this caller.
    UnknownTurn,
    /// This caller's turn, but of another tenant than the one asked for.
    OtherTenant,
    /// The stored events after the seq asked for; later ones follow.
    Events(Vec<String>),
}

/// What a cancel request did to a turn.
#[derive(Debug, Clone)]
pub enum Cancelled {
    /// No such turn for this caller (and tenant).
    UnknownTurn,
    /// The turn had ended before; how it ended.
    AlreadyEnded(String),
    /// This request ended the turn: the caller publishes its end.
    Ended(Closing),
}

/// What creating a turn did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Created {
    /// The turn is new and stored.
    New,
    /// A turn with this id exists; `same_caller` when the same frontend submitted it.
    Exists {
        /// Whether the existing turn is this caller's.
        same_caller: bool,
        /// Whether it was created by the same request (decision, tenant and session).
        same_request: bool,
    },
}

/// What storing a turn's closing events did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredFinal {
    /// No such turn.
    UnknownTurn,
    /// Another caller stored the turn's `final` first; it sends it.
    StoredBefore,
    /// Stored: send the events to `reply`, the first with `first_seq`.
    Stored {
        /// Where the turn's events go.
        reply: String,
        /// The seq of the first stored event.
        first_seq: u64,
    },
}

/// What storing events of a running turn did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Emitted {
    /// No such turn, or it has ended: nothing stored, nothing to send.
    Nothing,
    /// Stored: send the events to `reply`, the first with `first_seq`.
    Stored {
        /// Where the turn's events go.
        reply: String,
        /// The seq of the first stored event.
        first_seq: u64,
    },
}

/// A new turn for [`JoinStore::create`].
pub struct NewTurn<'a> {
    /// The turn id.
    pub turn_id: &'a str,
    /// Where the turn's events go.
    pub reply: &'a str,
    /// The digest of the request that created it (`Taken::digest`).
    pub digest: &'a str,
    /// The tenant.
    pub tenant: &'a str,
    /// Deadline in Unix milliseconds.
    pub deadline_unix_ms: u64,
    /// Whether dispatch is paced by the concurrency bound.
    pub paced: bool,
    /// Every call by key.
    pub calls: Vec<(String, CallEntry)>,
    /// Results known up front (refused calls), by key.
    pub results: Vec<(String, CallResult)>,
    /// How long the keys live.
    pub ttl_ms: u64,
    /// When the turn was taken, Unix milliseconds.
    pub created_unix_ms: u64,
    /// The W3C `traceparent` of the turn's span (empty when not traced).
    pub traceparent: &'a str,
    /// The turn span's identity (`trace.rs`; empty when not traced).
    pub trace: &'a str,
    /// The submitting frontend (empty when unidentified): the only one that may attach.
    pub caller: &'a str,
    /// The first events, stored before they are sent (seq 1, 2, …).
    pub events: Vec<String>,
    /// Whether the turn is created ended (no tools): its events end with its `final`.
    pub ended: bool,
    /// The jobs held back by the concurrency bound, by call key, in the model's order.
    pub queued: Vec<(String, JobEnvelope)>,
    /// Whether its calls go through the tools' lanes (`sharing.rs`): then each result
    /// frees its call's slot.
    pub laned: bool,
}

/// Failure to talk to Redis or to decode what it returned.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Stored data did not decode.
    #[error("stored data: {0}")]
    Decode(String),
}

/// The turn store.
#[derive(Clone)]
pub struct JoinStore {
    redis: RedisConnection,
    names: Names,
    /// Buckets of the deadline index.
    buckets: u32,
    create: Script,
    record: Script,
    finalize: Script,
    store_final: Script,
    emit: Script,
    attach: Script,
    cancel: Script,
}

impl JoinStore {
    /// A store over `redis`.
    pub fn new(redis: RedisConnection, names: Names) -> Self {
        Self {
            redis,
            names,
            buckets: DEFAULT_DEADLINE_BUCKETS,
            create: Script::new(CREATE),
            record: Script::new(RECORD),
            finalize: Script::new(FINALIZE),
            store_final: Script::new(STORE_FINAL),
            emit: Script::new(EMIT),
            attach: Script::new(ATTACH),
            cancel: Script::new(CANCEL),
        }
    }

    /// The same store with its deadline index split into `buckets` keys.
    pub fn with_deadline_buckets(mut self, buckets: u32) -> Self {
        self.buckets = buckets.max(1);
        self
    }

    /// The deadline index bucket of `turn_id`.
    fn deadline_key(&self, turn_id: &str) -> String {
        self.names
            .deadline_bucket_key(Names::deadline_bucket(turn_id, self.buckets))
    }

    fn ended_key(&self, turn_id: &str) -> String {
        self.names
            .ended_bucket_key(Names::deadline_bucket(turn_id, self.buckets))
    }

    /// Deletes the turns that ended and were sent longest ago, at most `per_bucket` of
    /// each bucket of the ended index, and forgets index entries older than
    /// `retention_ms` (their keys expired by themselves); the number of turns whose
    /// keys this call deleted. Open turns are never in the index.
    pub async fn trim_ended(
        &self,
        per_bucket: usize,
        retention_ms: u64,
    ) -> Result<usize, JoinError> {
        let mut redis = self.redis.clone();
        let expired_before = unix_ms().saturating_sub(retention_ms);
        let mut trimmed = 0;
        for bucket in 0..self.buckets {
            let key = self.names.ended_bucket_key(bucket);
            let _: i64 = redis::cmd("ZREMRANGEBYSCORE")
                .arg(&key)
                .arg("-inf")
                .arg(expired_before)
                .query_async(&mut redis)
                .await?;
            let oldest: Vec<String> = redis::cmd("ZRANGE")
                .arg(&key)
                .arg(0)
                .arg(per_bucket.saturating_sub(1))
                .query_async(&mut redis)
                .await?;
            if oldest.is_empty() {
                continue;
            }
            let mut pipe = redis::pipe();
            for turn_id in &oldest {
                let [meta, calls, results, events] = self.keys(turn_id);
                let [queue, jobs, dispatching] = self.queue_keys(turn_id);
                pipe.cmd("DEL")
                    .arg(meta)
                    .arg(calls)
                    .arg(results)
                    .arg(events)
                    .arg(queue)
                    .arg(jobs)
                    .arg(dispatching);
            }
            let deleted: Vec<i64> = pipe.query_async(&mut redis).await?;
            trimmed += deleted.iter().filter(|n| **n > 0).count();
            let _: i64 = redis::cmd("ZREM")
                .arg(&key)
                .arg(&oldest)
                .query_async(&mut redis)
                .await?;
        }
        Ok(trimmed)
    }

    fn keys(&self, turn_id: &str) -> [String; 4] {
        [
            self.names.turn_meta_key(turn_id),
            self.names.turn_calls_key(turn_id),
            self.names.turn_results_key(turn_id),
            self.names.turn_events_key(turn_id),
        ]
    }

    /// The keys of a turn's queued calls: queue, jobs, dispatching.
    fn queue_keys(&self, turn_id: &str) -> [String; 3] {
        [
            self.names.turn_queue_key(turn_id),
            self.names.turn_jobs_key(turn_id),
            self.names.turn_dispatching_key(turn_id),
        ]
    }

    /// The meta and events keys of a turn.
    fn log_keys(&self, turn_id: &str) -> [String; 2] {
        [
            self.names.turn_meta_key(turn_id),
            self.names.turn_events_key(turn_id),
        ]
    }

    /// `script` invoked with the turn's meta and events keys first, as every script that
    /// appends to a turn's event log expects them.
    fn log_invocation<'s>(&self, script: &'s Script, turn_id: &str) -> redis::ScriptInvocation<'s> {
        let mut invocation = script.prepare_invoke();
        for key in self.log_keys(turn_id) {
            invocation.key(key);
        }
        invocation
    }

    /// Adds `events` to `invocation` as the turn's log stores them, one argument each.
    fn event_args<'e>(
        invocation: &mut redis::ScriptInvocation<'_>,
        events: impl IntoIterator<Item = &'e String>,
        turn_id: &str,
    ) {
        for event in events {
            invocation.arg(event_log::stored(event, turn_id).as_ref());
        }
    }

    /// Indexes the turn's deadline, then creates the turn with its first events.
    /// The index comes first so that a turn is never stored without a deadline entry
    /// (an entry without a turn is dropped by the sweeper). Both go out in one pipeline,
    /// one round trip, and Redis runs them in that order.
    pub async fn create(&self, turn: NewTurn<'_>) -> Result<Created, JoinError> {
        let mut redis = self.redis.clone();
        let mut invocation = redis::cmd("EVALSHA");
        invocation.arg(self.create.get_hash()).arg(6);
        let [queue, jobs, _] = self.queue_keys(turn.turn_id);
        for key in self.keys(turn.turn_id).into_iter().chain([queue, jobs]) {
            invocation.arg(key);
        }
        invocation
            .arg(turn.ttl_ms)
            .arg(turn.calls.len())
            .arg(turn.reply)
            .arg(turn.tenant)
            .arg(turn.deadline_unix_ms)
            .arg(u8::from(turn.paced))
            .arg(turn.created_unix_ms)
            .arg(turn.traceparent)
            .arg(turn.trace)
            .arg(turn.caller)
            .arg(if turn.ended { "final" } else { "open" })
            .arg(turn.digest)
            .arg(u8::from(turn.laned))
            .arg(turn.calls.len());
        for (key, entry) in &turn.calls {
            invocation.arg(key).arg(encode(entry)?);
        }
        invocation.arg(turn.results.len());
        for (key, result) in &turn.results {
            invocation.arg(key).arg(encode(result)?);
        }
        invocation.arg(turn.events.len());
        for event in &turn.events {
            invocation.arg(event_log::stored(event, turn.turn_id).as_ref());
        }
        invocation.arg(turn.queued.len());
        for (key, job) in &turn.queued {
            invocation.arg(key).arg(encode(job)?);
        }
        let mut index = redis::cmd("ZADD");
        index
            .arg(self.deadline_key(turn.turn_id))
            .arg("NX")
            .arg(turn.deadline_unix_ms)
            .arg(turn.turn_id);
        // The index entry is sent first and is `NX`, so sending both again changes
        // nothing; on a cluster the index bucket lives in another slot than the turn.
        let reply = match redis.in_order(index.clone(), invocation.clone()).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.create.load_async(&mut redis).await?;
                redis.in_order(index, invocation).await?
            }
            other => other?,
        };
        let created =
            Vec::<i64>::from_redis_value(reply).map_err(|e| JoinError::Decode(e.to_string()))?;
        Ok(match created.as_slice() {
            [1] => Created::New,
            [0, same] => Created::Exists {
                same_caller: *same == 1,
                same_request: true,
            },
            [0, same, digest] => Created::Exists {
                same_caller: *same == 1,
                same_request: *digest == 1,
            },
            other => return Err(JoinError::Decode(format!("create returned {other:?}"))),
        })
    }

    /// Records `result` under `call_key`.
    pub async fn record(
        &self,
        turn_id: &str,
        call_key: &str,
        result: &CallResult,
        state_event: &str,
    ) -> Result<Recorded, JoinError> {
        let body = encode(result)?;
        self.record_encoded(
            turn_id,
            call_key,
            result,
            body.as_bytes(),
            state_event,
            None,
        )
        .await
    }

    /// Records `result` under `call_key`, storing `body` as its JSON: the bytes a worker
    /// published, which decoded as `result`, are stored as they came instead of being
    /// encoded again. With `ahead`, a result that completes the turn stores its closing
    /// events too when they match ([`Recorded::CompleteStored`]).
    pub async fn record_encoded(
        &self,
        turn_id: &str,
        call_key: &str,
        result: &CallResult,
        body: &[u8],
        state_event: &str,
        ahead: Option<ClosingAhead<'_>>,
    ) -> Result<Recorded, JoinError> {
        let mut invocation = self.record.prepare_invoke();
        for key in self
            .keys(turn_id)
            .into_iter()
            .chain(self.queue_keys(turn_id))
        {
            invocation.key(key);
        }
        invocation
            .arg(call_key)
            .arg(body)
            .arg(unix_ms())
            .arg(&result.name)
            .arg(event_log::stored(state_event, turn_id).as_ref());
        if let Some(ahead) = ahead.filter(|a| !a.events.is_empty()) {
            invocation.arg(ahead.checks.len());
            for (key, stored) in ahead.checks {
                invocation.arg(key).arg(stored);
            }
            Self::event_args(&mut invocation, ahead.events, turn_id);
        }
        let reply = self.run(&invocation).await?;
        let tag = string_at(&reply, 0)?;
        Ok(match tag.as_str() {
            "unknown" => Recorded::UnknownTurn,
            "unknown_call" => Recorded::UnknownCall,
            "wrong_tool" => Recorded::WrongTool,
            "duplicate" => Recorded::Duplicate {
                again: released_from(&string_at(&reply, 1)?, reply.get(2))?,
                laned: laned_at(&reply, 3),
            },
            "late" => Recorded::Late {
                laned: laned_at(&reply, 1),
            },
            "recorded" => Recorded::Recorded {
                reply: string_at(&reply, 1)?,
                paced: string_at(&reply, 2)? == "1",
                seq: number_at(&reply, 3)?,
                released: released_from(&string_at(&reply, 4)?, reply.get(5))?
                    .into_iter()
                    .next(),
                laned: laned_at(&reply, 6),
            },
            "complete_stored" => Recorded::CompleteStored {
                reply: string_at(&reply, 1)?,
                seq: number_at(&reply, 3)?,
                laned: laned_at(&reply, 4),
            },
            "complete" => Recorded::Complete {
                paced: string_at(&reply, 2)? == "1",
                closing: closing_from(&reply)?,
                seq: number_at(&reply, 8)?,
            },
            other => return Err(JoinError::Decode(format!("record returned {other:?}"))),
        })
    }

    /// Ends the turn (at its deadline, or with every result in) unless it already ended.
    pub async fn finalize(&self, turn_id: &str, reason: &str) -> Result<Finalized, JoinError> {
        let mut invocation = self.finalize.prepare_invoke();
        for key in self.keys(turn_id) {
            invocation.key(key);
        }
        invocation.arg(reason);
        let reply = self.run(&invocation).await?;
        Ok(match string_at(&reply, 0)?.as_str() {
            "unknown" => Finalized::UnknownTurn,
            "already" => Finalized::AlreadyEnded {
                published: !matches!(string_at(&reply, 1)?.as_str(), "0" | ""),
            },
            "finalized" => Finalized::Ended(closing_from(&reply)?),
            "unstored" => Finalized::Unstored {
                closing: closing_from(&reply)?,
                ended: string_at(&reply, 8).unwrap_or_default(),
            },
            other => return Err(JoinError::Decode(format!("finalize returned {other:?}"))),
        })
    }

    /// Ends the open turn `turn_id` of `caller` (and of `tenant`, when given) because
    /// it was cancelled.
    pub async fn cancel(
        &self,
        turn_id: &str,
        caller: &str,
        tenant: Option<&str>,
    ) -> Result<Cancelled, JoinError> {
        let mut invocation = self.cancel.prepare_invoke();
        let [meta, calls, results, _] = self.keys(turn_id);
        invocation
            .key(meta)
            .key(calls)
            .key(results)
            .arg(caller)
            .arg(tenant.unwrap_or_default());
        let reply = self.run(&invocation).await?;
        Ok(match string_at(&reply, 0)?.as_str() {
            "unknown" => Cancelled::UnknownTurn,
            "ended" => Cancelled::AlreadyEnded(string_at(&reply, 1)?),
            "cancelled" => Cancelled::Ended(closing_from(&reply)?),
            other => return Err(JoinError::Decode(format!("cancel returned {other:?}"))),
        })
    }

    /// Stores a turn's closing events, `final` last, unless its `final` is stored.
    pub async fn store_final(
        &self,
        turn_id: &str,
        events: &[String],
    ) -> Result<StoredFinal, JoinError> {
        let mut invocation = self.log_invocation(&self.store_final, turn_id);
        invocation
            .key(self.names.turn_results_key(turn_id))
            .key(self.names.turn_calls_key(turn_id));
        Self::event_args(&mut invocation, events, turn_id);
        let reply = self.run(&invocation).await?;
        Ok(match string_at(&reply, 0)?.as_str() {
            "unknown" => StoredFinal::UnknownTurn,
            "stored_before" => StoredFinal::StoredBefore,
            "stored" => StoredFinal::Stored {
                reply: string_at(&reply, 1)?,
                first_seq: number_at(&reply, 2)?,
            },
            other => return Err(JoinError::Decode(format!("store_final returned {other:?}"))),
        })
    }

    /// Stores events of a turn that has not ended; with `unless_result_of`, only while
    /// that call has no result.
    pub async fn emit(
        &self,
        turn_id: &str,
        unless_result_of: Option<&str>,
        events: &[String],
    ) -> Result<Emitted, JoinError> {
        let mut invocation = self.log_invocation(&self.emit, turn_id);
        invocation
            .key(self.names.turn_results_key(turn_id))
            .arg(unless_result_of.unwrap_or_default());
        Self::event_args(&mut invocation, events, turn_id);
        let reply = self.run(&invocation).await?;
        Ok(match string_at(&reply, 0)?.as_str() {
            "emitted" => Emitted::Stored {
                reply: string_at(&reply, 1)?,
                first_seq: number_at(&reply, 2)?,
            },
            _ => Emitted::Nothing,
        })
    }

    /// Sends the turn's later events to `reply` and returns its stored events after
    /// `after_seq`, for `caller` (and `tenant`, when given).
    pub async fn attach(
        &self,
        turn_id: &str,
        caller: &str,
        tenant: Option<&str>,
        reply: &str,
        after_seq: u64,
    ) -> Result<Attached, JoinError> {
        let mut invocation = self.log_invocation(&self.attach, turn_id);
        invocation
            .arg(caller)
            .arg(reply)
            .arg(after_seq)
            .arg(tenant.unwrap_or_default());
        let reply = self.run(&invocation).await?;
        match string_at(&reply, 0)?.as_str() {
            "attached" => {}
            "other_tenant" => return Ok(Attached::OtherTenant),
            _ => return Ok(Attached::UnknownTurn),
        }
        let events = match reply.get(1) {
            Some(v) => Vec::<String>::from_redis_value(v.clone())
                .map_err(|e| JoinError::Decode(e.to_string()))?,
            None => Vec::new(),
        };
        Ok(Attached::Events(read_back(events, turn_id)))
    }

    /// Every stored event of a turn, where they go, and what exporting its span needs,
    /// for sending a stored `final` again.
    pub async fn stored_events(&self, turn_id: &str) -> Result<StoredTurn, JoinError> {
        let [meta, events] = self.log_keys(turn_id);
        let mut redis = self.redis.clone();
        type Meta = (Option<String>, Option<String>, Option<String>);
        let ((reply, trace, ended), events): (Meta, Vec<String>) = redis::pipe()
            .cmd("HMGET")
            .arg(meta)
            .arg("reply")
            .arg("trace")
            .arg("ended")
            .cmd("LRANGE")
            .arg(events)
            .arg(0)
            .arg(-1)
            .query_async(&mut redis)
            .await?;
        Ok(StoredTurn {
            reply: reply.unwrap_or_default(),
            events: read_back(events, turn_id),
            trace: trace.filter(|t| !t.is_empty()),
            ended: ended.unwrap_or_default(),
        })
    }

    /// Marks the turn's stored `final` sent and drops the turn from the deadline index,
    /// so no sweeper sends it again. `published` counts the marks: `true` when this
    /// call made the first, so that exactly one replica exports the turn's span.
    pub async fn mark_published(&self, turn_id: &str) -> Result<bool, JoinError> {
        let mut redis = self.redis.clone();
        let mut mark = redis::cmd("HINCRBY");
        mark.arg(self.names.turn_meta_key(turn_id))
            .arg("published")
            .arg(1);
        let mut unindex = redis::cmd("ZREM");
        unindex.arg(self.deadline_key(turn_id)).arg(turn_id);
        // Ended and sent: from now on it may give way when Redis runs short.
        let mut ended = redis::cmd("ZADD");
        ended
            .arg(self.ended_key(turn_id))
            .arg(unix_ms())
            .arg(turn_id);
        let marks: i64 = if redis.is_cluster() {
            // Different slots: the mark first, so a turn is never unindexed unmarked.
            let marks: i64 = mark.query_async(&mut redis).await?;
            let _: i64 = unindex.query_async(&mut redis).await?;
            let _: i64 = ended.query_async(&mut redis).await?;
            marks
        } else {
            let (marks,): (i64,) = redis::pipe()
                .add_command(mark)
                .add_command(unindex)
                .ignore()
                .add_command(ended)
                .ignore()
                .query_async(&mut redis)
                .await?;
            marks
        };
        Ok(marks == 1)
    }

    /// Notes that the job of a released call was published (the stream acknowledged
    /// it): it is no longer handed out again with a duplicate result.
    pub async fn confirm_dispatched(&self, turn_id: &str, key: &str) -> Result<(), JoinError> {
        let [_, jobs, dispatching] = self.queue_keys(turn_id);
        let mut redis = self.redis.clone();
        let _: () = redis::pipe()
            .cmd("SREM")
            .arg(dispatching)
            .arg(key)
            .ignore()
            .cmd("HDEL")
            .arg(jobs)
            .arg(key)
            .ignore()
            .query_async(&mut redis)
            .await?;
        Ok(())
    }

    /// Removes the turn from the deadline index.
    pub async fn forget_deadline(&self, turn_id: &str) -> Result<(), JoinError> {
        let mut redis = self.redis.clone();
        let _: () = redis::cmd("ZREM")
            .arg(self.deadline_key(turn_id))
            .arg(turn_id)
            .query_async(&mut redis)
            .await?;
        Ok(())
    }

    /// Runs a prepared script on this store's connection; its reply, element by element.
    async fn run(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<Vec<RedisValue>, JoinError> {
        let mut redis = self.redis.clone();
        Ok(invocation.invoke_async(&mut redis).await?)
    }

    /// The keys the sweeper reads: every bucket of the deadline index, starting at
    /// `first` (each replica starts elsewhere, so replicas working through a backlog
    /// take different buckets first), then the index of releases before buckets.
    pub fn deadline_keys(&self, first: u32) -> Vec<String> {
        (0..self.buckets)
            .map(|i| self.names.deadline_bucket_key((first + i) % self.buckets))
            .chain([self.names.legacy_deadlines_key()])
            .collect()
    }

    /// Turns in the deadline index key `key` whose deadline is at or before `unix_ms`,
    /// at most `limit`. An entry found outside its turn's bucket (the index of an
    /// earlier release, or one written with another bucket count) is moved to its
    /// bucket first, deadline kept, so `mark_published` finds it there.
    pub async fn due(
        &self,
        key: &str,
        unix_ms: u64,
        limit: usize,
    ) -> Result<Vec<String>, JoinError> {
        let mut redis = self.redis.clone();
        let due: Vec<(String, f64)> = redis::cmd("ZRANGEBYSCORE")
            .arg(key)
            .arg("-inf")
            .arg(unix_ms)
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut redis)
            .await?;
        for (turn_id, deadline) in &due {
            let home = self.deadline_key(turn_id);
            if home != key {
                let mut add = redis::cmd("ZADD");
                add.arg(&home).arg("NX").arg(*deadline).arg(turn_id);
                let mut remove = redis::cmd("ZREM");
                remove.arg(key).arg(turn_id);
                redis.in_order(add, remove).await?;
            }
        }
        Ok(due.into_iter().map(|(turn_id, _)| turn_id).collect())
    }

    /// The turn's late-result and duplicate counters: `(late, duplicates)`.
    pub async fn counters(&self, turn_id: &str) -> Result<(u64, u64), JoinError> {
        let mut redis = self.redis.clone();
        let values: Vec<Option<u64>> = redis::cmd("HMGET")
            .arg(self.names.turn_meta_key(turn_id))
            .arg("late")
            .arg("duplicates")
            .query_async(&mut redis)
            .await?;
        Ok((
            values.first().copied().flatten().unwrap_or(0),
            values.get(1).copied().flatten().unwrap_or(0),
        ))
    }

    /// Writes back the last result of `tool` refused by this coordinator
    /// (`<p>:{registry}:rejected:results`), for the tool's workers to see.
    pub async fn reject_result(&self, tool: &str, rejection: &Rejection) -> Result<(), JoinError> {
        let mut redis = self.redis.clone();
        let body = encode(rejection)?;
        let _: () = redis::cmd("HSET")
            .arg(self.names.rejected_results_key())
            .arg(tool)
            .arg(body)
            .query_async(&mut redis)
            .await?;
        Ok(())
    }
}

/// Stored events of `turn_id` as they were encoded (`event_log.rs`).
fn read_back(events: Vec<String>, turn_id: &str) -> Vec<String> {
    events
        .into_iter()
        .map(|event| event_log::sent(event, turn_id))
        .collect()
}

fn encode<T: Serialize>(value: &T) -> Result<String, JoinError> {
    serde_json::to_string(value).map_err(|e| JoinError::Decode(e.to_string()))
}

/// Element `i` of a script's reply as a `T`; why not, when it is missing or of another
/// type. Shared with the lanes' scripts (`lanes.rs`).
pub(crate) fn reply_at<T: FromRedisValue>(reply: &[RedisValue], i: usize) -> Result<T, String> {
    let value = reply
        .get(i)
        .ok_or_else(|| format!("script reply has no element {i}"))?;
    T::from_redis_value(value.clone()).map_err(|e| e.to_string())
}

fn string_at(reply: &[RedisValue], i: usize) -> Result<String, JoinError> {
    reply_at(reply, i).map_err(JoinError::Decode)
}

fn number_at(reply: &[RedisValue], i: usize) -> Result<u64, JoinError> {
    reply_at(reply, i).map_err(JoinError::Decode)
}

fn pairs<T: serde::de::DeserializeOwned>(
    value: Option<&RedisValue>,
) -> Result<HashMap<String, T>, JoinError> {
    let flat: Vec<String> = match value {
        Some(v) => Vec::<String>::from_redis_value(v.clone())
            .map_err(|e| JoinError::Decode(e.to_string()))?,
        None => Vec::new(),
    };
    let mut map = HashMap::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        let parsed = serde_json::from_str(&v).map_err(|e| JoinError::Decode(e.to_string()))?;
        map.insert(k, parsed);
    }
    Ok(map)
}

/// The released calls in a flat (key, job)* reply, with the turn's stored trace.
fn released_from(trace: &str, value: Option<&RedisValue>) -> Result<Vec<Released>, JoinError> {
    let flat: Vec<String> = match value {
        Some(v) => Vec::<String>::from_redis_value(v.clone())
            .map_err(|e| JoinError::Decode(e.to_string()))?,
        None => Vec::new(),
    };
    flat.chunks_exact(2)
        .map(|pair| {
            let job = serde_json::from_str(&pair[1])
                .map_err(|e| JoinError::Decode(format!("queued job {}: {e}", pair[0])))?;
            Ok(Released {
                key: pair[0].clone(),
                job,
                trace: trace.to_string(),
            })
        })
        .collect()
}

fn closing_from(reply: &[RedisValue]) -> Result<Closing, JoinError> {
    Ok(Closing {
        reply: string_at(reply, 1)?,
        calls: pairs(reply.get(3))?,
        results: pairs(reply.get(4))?,
        created_unix_ms: string_at(reply, 5)?.parse().unwrap_or(0),
        traceparent: Some(string_at(reply, 6)?).filter(|t| !t.is_empty()),
        trace: string_at(reply, 7).ok().filter(|t| !t.is_empty()),
        tenant: string_at(reply, 9).unwrap_or_default(),
        deadline_unix_ms: string_at(reply, 10)
            .ok()
            .and_then(|d| d.parse().ok())
            .unwrap_or(0),
        laned: laned_at(reply, 11),
    })
}

/// Whether the flag at `i` says the turn's calls went through the lanes (so, too, when
/// it is missing).
fn laned_at(reply: &[RedisValue], i: usize) -> bool {
    string_at(reply, i).map_or(true, |flag| flag != "0")
}
