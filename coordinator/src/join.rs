//! Where results are joined: a turn's calls and results in Redis, recorded and finalized
//! by Lua scripts so that a result counts once and a turn ends once, whichever replica
//! runs them.
//!
//! Keys of one turn share the `{turn_id}` hash tag (see `Names`), so each script touches a
//! single slot and runs unchanged on Redis Cluster. The deadline index is a separate key,
//! updated with separate commands.
//!
//! Owns every read and write of a turn's Redis keys. Never publishes: callers act on
//! what the scripts return (`Recorded`, `Finalized`), and only the caller that got a
//! `Closing` may publish the turn's end.

use std::collections::HashMap;

use redis::aio::ConnectionManager;
use redis::{FromRedisValue, Script, Value as RedisValue};
use serde::{Deserialize, Serialize};
use toolfleet_common::call::unix_ms;
use toolfleet_common::tool::Rejection;
use toolfleet_common::{CallResult, Names};

/// Creates a turn unless it exists. KEYS: meta, calls, results.
/// ARGV: ttl_ms, total, reply, tenant, deadline, paced, created, traceparent, trace,
/// n_calls, (key, call)*, n_results, (key, result)*. `trace` is the turn span's identity
/// (`trace.rs`), handed back to whoever ends the turn.
const CREATE: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'open', 'total', ARGV[2], 'reply', ARGV[3],
  'tenant', ARGV[4], 'deadline', ARGV[5], 'paced', ARGV[6], 'created', ARGV[7],
  'traceparent', ARGV[8], 'trace', ARGV[9], 'late', 0, 'duplicates', 0)
local i = 10
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]); i = i + 2 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]); i = i + 2 end
for k = 1, 3 do redis.call('PEXPIRE', KEYS[k], ARGV[1]) end
return 1
"#;

/// Records one result, write-once per call key. A result recorded at or after the
/// turn's deadline is late even while the turn is still open, so the deadline alone
/// decides the turn's end. KEYS: meta, calls, results.
/// ARGV: call key, result JSON, now (Unix ms), the result's tool. A result whose tool is
/// not the call's is refused (`wrong_tool`) and changes nothing.
const RECORD: &str = r#"
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
local entry = redis.call('HGET', KEYS[2], ARGV[1])
if not entry then return {'unknown_call'} end
local ok, call = pcall(cjson.decode, entry)
if not ok or type(call) ~= 'table' or call.name ~= ARGV[4] then return {'wrong_tool'} end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'duplicates', 1)
  return {'duplicate'}
end
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline'))
if state ~= 'open' or (deadline and tonumber(ARGV[3]) >= deadline) then
  redis.call('HINCRBY', KEYS[1], 'late', 1)
  return {'late'}
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
if redis.call('PTTL', KEYS[3]) < 0 then
  redis.call('PEXPIRE', KEYS[3], math.max(redis.call('PTTL', KEYS[1]), 1000))
end
local meta = redis.call('HMGET', KEYS[1], 'reply', 'paced', 'total', 'created', 'traceparent', 'trace')
if redis.call('HLEN', KEYS[3]) >= tonumber(meta[3]) then
  redis.call('HSET', KEYS[1], 'state', 'final', 'ended', 'complete')
  return {'complete', meta[1], meta[2], redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
    meta[4] or '0', meta[5] or '', meta[6] or ''}
end
return {'recorded', meta[1], meta[2]}
"#;

/// Ends a turn unless it already ended. KEYS: meta, calls, results. ARGV: reason.
const FINALIZE: &str = r#"
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if state ~= 'open' then return {'already'} end
redis.call('HSET', KEYS[1], 'state', 'final', 'ended', ARGV[1])
local meta = redis.call('HMGET', KEYS[1], 'reply', 'paced', 'created', 'traceparent', 'trace')
return {'finalized', meta[1], meta[2], redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
  meta[3] or '0', meta[4] or '', meta[5] or ''}
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
    /// The call already had a result; this one is ignored.
    Duplicate,
    /// The turn had already ended, or its deadline had passed; counted as late.
    Late,
    /// Recorded; the turn is still waiting for others.
    Recorded {
        /// Where the turn's events go.
        reply: String,
        /// Whether the turn's owner paces dispatch by completions.
        paced: bool,
    },
    /// Recorded, and it was the last one: this caller finalizes the turn.
    Complete {
        /// The turn's calls and results.
        closing: Closing,
        /// Whether the turn's owner paces dispatch by completions.
        paced: bool,
    },
}

impl Recorded {
    /// A short name of the outcome, for spans and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnknownTurn => "unknown_turn",
            Self::UnknownCall => "unknown_call",
            Self::WrongTool => "wrong_tool",
            Self::Duplicate => "duplicate",
            Self::Late => "late",
            Self::Recorded { .. } => "recorded",
            Self::Complete { .. } => "complete",
        }
    }
}

/// What finalizing did.
#[derive(Debug, Clone)]
pub enum Finalized {
    /// No such turn.
    UnknownTurn,
    /// Someone else ended it first.
    AlreadyEnded,
    /// This caller ended it.
    Ended(Closing),
}

/// A new turn for [`JoinStore::create`].
pub struct NewTurn<'a> {
    /// The turn id.
    pub turn_id: &'a str,
    /// Where the turn's events go.
    pub reply: &'a str,
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
    redis: ConnectionManager,
    names: Names,
    create: Script,
    record: Script,
    finalize: Script,
}

impl JoinStore {
    /// A store over `redis`.
    pub fn new(redis: ConnectionManager, names: Names) -> Self {
        Self {
            redis,
            names,
            create: Script::new(CREATE),
            record: Script::new(RECORD),
            finalize: Script::new(FINALIZE),
        }
    }

    fn keys(&self, turn_id: &str) -> [String; 3] {
        [
            self.names.turn_meta_key(turn_id),
            self.names.turn_calls_key(turn_id),
            self.names.turn_results_key(turn_id),
        ]
    }

    /// Indexes the turn's deadline, then creates the turn; `false` if it already exists.
    /// The index comes first so that a turn is never stored without a deadline entry
    /// (an entry without a turn is dropped by the sweeper). Both go out in one pipeline,
    /// one round trip, and Redis runs them in that order.
    pub async fn create(&self, turn: NewTurn<'_>) -> Result<bool, JoinError> {
        let mut redis = self.redis.clone();
        let mut invocation = redis::cmd("EVALSHA");
        invocation.arg(self.create.get_hash()).arg(3);
        for key in self.keys(turn.turn_id) {
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
            .arg(turn.calls.len());
        for (key, entry) in &turn.calls {
            invocation.arg(key).arg(encode(entry)?);
        }
        invocation.arg(turn.results.len());
        for (key, result) in &turn.results {
            invocation.arg(key).arg(encode(result)?);
        }
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD")
            .arg(self.names.deadlines_key())
            .arg("NX")
            .arg(turn.deadline_unix_ms)
            .arg(turn.turn_id)
            .ignore()
            .add_command(invocation);
        let (created,): (i64,) = match pipe.query_async(&mut redis).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                // The index entry is `NX`, so sending it again changes nothing.
                self.create.load_async(&mut redis).await?;
                pipe.query_async(&mut redis).await?
            }
            other => other?,
        };
        Ok(created == 1)
    }

    /// Records `result` under `call_key`.
    pub async fn record(
        &self,
        turn_id: &str,
        call_key: &str,
        result: &CallResult,
    ) -> Result<Recorded, JoinError> {
        let mut invocation = self.record.prepare_invoke();
        for key in self.keys(turn_id) {
            invocation.key(key);
        }
        invocation
            .arg(call_key)
            .arg(encode(result)?)
            .arg(unix_ms())
            .arg(&result.name);
        let mut redis = self.redis.clone();
        let reply: Vec<RedisValue> = invocation.invoke_async(&mut redis).await?;
        let tag = string_at(&reply, 0)?;
        Ok(match tag.as_str() {
            "unknown" => Recorded::UnknownTurn,
            "unknown_call" => Recorded::UnknownCall,
            "wrong_tool" => Recorded::WrongTool,
            "duplicate" => Recorded::Duplicate,
            "late" => Recorded::Late,
            "recorded" => Recorded::Recorded {
                reply: string_at(&reply, 1)?,
                paced: string_at(&reply, 2)? == "1",
            },
            "complete" => Recorded::Complete {
                paced: string_at(&reply, 2)? == "1",
                closing: closing_from(&reply)?,
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
        let mut redis = self.redis.clone();
        let reply: Vec<RedisValue> = invocation.invoke_async(&mut redis).await?;
        Ok(match string_at(&reply, 0)?.as_str() {
            "unknown" => Finalized::UnknownTurn,
            "already" => Finalized::AlreadyEnded,
            "finalized" => Finalized::Ended(closing_from(&reply)?),
            other => return Err(JoinError::Decode(format!("finalize returned {other:?}"))),
        })
    }

    /// Marks a queued call dispatched, so the deadline reports it as `timeout`, not
    /// `skipped`.
    pub async fn mark_dispatched(
        &self,
        turn_id: &str,
        key: &str,
        entry: &CallEntry,
    ) -> Result<(), JoinError> {
        let mut redis = self.redis.clone();
        let _: () = redis::cmd("HSET")
            .arg(self.names.turn_calls_key(turn_id))
            .arg(key)
            .arg(encode(entry)?)
            .query_async(&mut redis)
            .await?;
        Ok(())
    }

    /// Whether the call `call_key` of `turn_id` has a recorded result.
    pub async fn has_result(&self, turn_id: &str, call_key: &str) -> Result<bool, JoinError> {
        let mut redis = self.redis.clone();
        Ok(redis::cmd("HEXISTS")
            .arg(self.names.turn_results_key(turn_id))
            .arg(call_key)
            .query_async(&mut redis)
            .await?)
    }

    /// Removes the turn from the deadline index.
    pub async fn forget_deadline(&self, turn_id: &str) -> Result<(), JoinError> {
        let mut redis = self.redis.clone();
        let _: () = redis::cmd("ZREM")
            .arg(self.names.deadlines_key())
            .arg(turn_id)
            .query_async(&mut redis)
            .await?;
        Ok(())
    }

    /// Turns whose deadline is at or before `unix_ms`, at most `limit`.
    pub async fn due(&self, unix_ms: u64, limit: usize) -> Result<Vec<String>, JoinError> {
        let mut redis = self.redis.clone();
        Ok(redis::cmd("ZRANGEBYSCORE")
            .arg(self.names.deadlines_key())
            .arg("-inf")
            .arg(unix_ms)
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut redis)
            .await?)
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

fn encode<T: Serialize>(value: &T) -> Result<String, JoinError> {
    serde_json::to_string(value).map_err(|e| JoinError::Decode(e.to_string()))
}

fn string_at(reply: &[RedisValue], i: usize) -> Result<String, JoinError> {
    let value = reply
        .get(i)
        .ok_or_else(|| JoinError::Decode(format!("script reply has no element {i}")))?;
    String::from_redis_value(value.clone()).map_err(|e| JoinError::Decode(e.to_string()))
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

fn closing_from(reply: &[RedisValue]) -> Result<Closing, JoinError> {
    Ok(Closing {
        reply: string_at(reply, 1)?,
        calls: pairs(reply.get(3))?,
        results: pairs(reply.get(4))?,
        created_unix_ms: string_at(reply, 5)?.parse().unwrap_or(0),
        traceparent: Some(string_at(reply, 6)?).filter(|t| !t.is_empty()),
        trace: string_at(reply, 7).ok().filter(|t| !t.is_empty()),
    })
}
