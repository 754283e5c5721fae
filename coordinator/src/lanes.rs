//! Where tenants share a tool: each tool's lane in Redis, a weighted fair queue in front
//! of the tool's stream, and each tenant's turns in flight.
//!
//! A lane holds a call out of the stream while the tool's slots (its live workers ×
//! their slots, plus a little headroom) are taken, in a queue of its tenant's own. When
//! a slot frees (a result, by whichever replica records it), the lane hands out the
//! waiting call with the smallest finish tag: self-clocked fair queueing, where a
//! tenant's next call is tagged `max(virtual time, its last tag) + 1 / weight`. A
//! tenant that floods a tool therefore queues behind itself: a tenant arriving with one
//! call is tagged just past the virtual time and starts at the next free slot. A
//! tenant's cap on calls in flight skips it while it holds that many slots.
//!
//! Every change is one Lua script over the lane's keys, which share the
//! `{lane:<tool>}` hash tag (`Names::lane_keys`), so replicas race safely and the
//! lane runs unchanged on Redis Cluster. A slot lapses at its call's deadline (plus a
//! grace) if no result ever frees it; a call handed out but never confirmed published
//! (its replica died) is handed out again by the next tick. Only the commands the
//! coordinator's Redis user may run are used (deploy/redis/users.acl).
//!
//! Owns the lane and tenant keys and their scripts, and [`Lanes`], this replica's handle
//! on them (the store and the lanes it lately saw contended); never publishes a job and
//! never decides a policy (`sharing.rs` does both).

use std::collections::HashMap;
use std::sync::Mutex;

use redis::{FromRedisValue, Script, Value as RedisValue};
use tokio::sync::oneshot;
use toolfleet_common::call::unix_ms;
use toolfleet_common::redis_client::RedisConnection;
use toolfleet_common::Names;

use crate::store::redis::reply_at;

/// The Lua helpers every lane script shares. KEYS: slots, held, state, queue, ready,
/// sending (`Names::lane_keys`). ARGV 1-4: now (Unix ms), the tool's slots, headroom
/// (ms of mean slot time), grace (ms a slot outlives its call's deadline).
macro_rules! lane_lua {
    () => {
        r#"
local slots, held, state, queue, ready, sending = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now = tonumber(ARGV[1])
local capacity = math.max(1, tonumber(ARGV[2]))
local headroom = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])

-- The first n tab-separated fields of s, then the rest.
local function fields(s, n)
  local out, pos = {}, 1
  for i = 1, n do
    local tab = string.find(s, '\t', pos, true)
    if not tab then out[i] = string.sub(s, pos); return out end
    out[i] = string.sub(s, pos, tab - 1)
    pos = tab + 1
  end
  out[n + 1] = string.sub(s, pos)
  return out
end

local function num(key, field)
  return tonumber(redis.call('HGET', key, field) or '0') or 0
end

-- Frees member's slot; its tenant, or nil when it held none. answered: a result came,
-- so the slot's time counts in the mean.
local function free(member, answered)
  if redis.call('ZREM', slots, member) == 0 then return nil end
  local h = redis.call('HGET', held, member)
  redis.call('HDEL', held, member)
  redis.call('HDEL', sending, member)
  if not h then return '' end
  local f = fields(h, 1)
  if redis.call('HINCRBY', state, 'n:' .. f[1], -1) <= 0 then
    redis.call('HDEL', state, 'n:' .. f[1])
  end
  if answered and f[2] then
    local took = math.max(0, now - (tonumber(f[2]) or now))
    local mean = num(state, 'mean')
    if mean <= 0 then mean = took else mean = mean * 0.8 + took * 0.2 end
    redis.call('HSET', state, 'mean', string.format('%.3f', math.max(mean, 0.001)))
  end
  return f[1]
end

-- Slots whose call's deadline (plus grace) passed without a result.
local function reclaim()
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', slots, '-inf', now, 'LIMIT', 0, 256)) do
    free(member, false)
  end
end

-- Calls the lane lets onto the stream at once: the slots, plus the calls the workers
-- finish in `headroom` ms (at least one, at most as many as the slots).
local function limit()
  if headroom <= 0 then return capacity end
  local mean = num(state, 'mean')
  local extra = capacity
  if mean > 0 then
    extra = math.min(capacity, math.max(1, math.ceil(capacity * headroom / mean)))
  end
  return capacity + extra
end

local function take(member, tenant, deadline)
  if redis.call('ZADD', slots, deadline + grace, member) == 1 then
    redis.call('HINCRBY', state, 'n:' .. tenant, 1)
  end
  redis.call('HSET', held, member, tenant .. '\t' .. ARGV[1])
end

-- Queues a call at the tail of its tenant's queue with its finish tag.
local function push(tenant, weight, cap, member, deadline, payload)
  local tag = math.max(num(state, 'v'), num(state, 'last:' .. tenant)) + math.floor(1000000 / weight)
  local ftag = string.format('%.0f', tag)
  local tail = redis.call('HINCRBY', state, 't:' .. tenant, 1)
  local head = num(state, 'h:' .. tenant)
  if head == 0 then head = 1 end
  redis.call('HSET', state, 'h:' .. tenant, head, 'last:' .. tenant, ftag, 'cap:' .. tenant, cap,
    'w:' .. tenant, weight)
  redis.call('HSET', queue, tenant .. '\t' .. tail,
    ftag .. '\t' .. deadline .. '\t' .. member .. '\t' .. ARGV[1] .. '\t' .. payload)
  if tail == head then redis.call('ZADD', ready, ftag, tenant) end
  redis.call('HINCRBY', state, 'waiting', 1)
end

-- Takes the first call of tenant's queue.
local function pop(tenant)
  local head, tail = num(state, 'h:' .. tenant), num(state, 't:' .. tenant)
  if head == 0 then
    redis.call('ZREM', ready, tenant)
    return nil
  end
  local field = tenant .. '\t' .. head
  local entry = redis.call('HGET', queue, field)
  redis.call('HDEL', queue, field)
  if head >= tail then
    redis.call('HDEL', state, 'h:' .. tenant, 't:' .. tenant, 'last:' .. tenant, 'cap:' .. tenant,
      'w:' .. tenant)
    redis.call('ZREM', ready, tenant)
  else
    redis.call('HSET', state, 'h:' .. tenant, head + 1)
    local after = redis.call('HGET', queue, tenant .. '\t' .. (head + 1))
    if after then redis.call('ZADD', ready, fields(after, 1)[1], tenant) end
  end
  if entry then redis.call('HINCRBY', state, 'waiting', -1) end
  return entry
end

-- Hands out waiting calls, smallest finish tag first among the tenants under their
-- cap, while the lane has room: each as member, tenant, queued at, payload in out.
-- A call whose deadline passed is dropped (its turn ends it). Calls of own were queued
-- by this script's caller, who publishes them; the others are noted as sending.
local function fill(out, own)
  local used = redis.call('ZCOUNT', slots, '-inf', '+inf')
  local most = limit()
  local steps = 0
  while used < most and steps < 512 do
    steps = steps + 1
    local picked
    for _, tenant in ipairs(redis.call('ZRANGEBYSCORE', ready, '-inf', '+inf')) do
      local cap = num(state, 'cap:' .. tenant)
      if cap <= 0 or num(state, 'n:' .. tenant) < cap then picked = tenant; break end
    end
    if not picked then break end
    local entry = pop(picked)
    if entry then
      local e = fields(entry, 4)
      if tonumber(e[1]) > num(state, 'v') then redis.call('HSET', state, 'v', e[1]) end
      local deadline = tonumber(e[2])
      -- A call whose turn ended while it waited (cancel, deadline) is dropped.
      local gone = redis.call('HDEL', state, 'x:' .. e[3]) == 1
      if deadline > now and not gone then
        take(e[3], picked, deadline)
        if not own[e[3]] then
          redis.call('HSET', sending, e[3], ARGV[1] .. '\t' .. picked .. '\t' .. e[4] .. '\t' .. e[5])
        end
        out[#out + 1] = e[3]; out[#out + 1] = picked; out[#out + 1] = e[4]; out[#out + 1] = e[5]
        used = used + 1
      end
    end
  end
  if num(state, 'waiting') <= 0 then redis.call('HDEL', state, 'v', 'waiting') end
end

local function in_flight()
  return redis.call('ZCOUNT', slots, '-inf', '+inf')
end
"#
    };
}

/// Queues calls of one tenant on the lane and hands out what now fits. ARGV 5 on:
/// tenant, weight, cap on its calls in flight (0: none), n, (member, deadline, payload)*,
/// then `bare`. A call already holding a slot is not queued again but handed back
/// (`again`) to be published again (its message id de-duplicates it). Returns
/// {waiting, in flight, again, handed out}.
///
/// `bare` ('1') is the uncontended case, sent without payloads: when no call waits on
/// the lane and every new call fits the lane and the tenant's cap, each takes its slot
/// at once, which leaves the lane as queueing and handing it out would (the tenant's
/// queue and the virtual time are cleared whenever nothing waits) and stores no
/// payload; otherwise nothing changes and the answer is {-1}: the caller admits again
/// with payloads.
const ADMIT: &str = concat!(
    lane_lua!(),
    r#"
reclaim()
local tenant, weight, cap = ARGV[5], math.max(1, tonumber(ARGV[6])), tonumber(ARGV[7])
local last = 8 + 3 * tonumber(ARGV[8])
local own, out, again = {}, {}, {}
if ARGV[last + 1] == '1' then
  local fresh = 0
  for i = 9, last, 3 do
    if redis.call('HEXISTS', held, ARGV[i]) == 0 then fresh = fresh + 1 end
  end
  if num(state, 'waiting') > 0 or in_flight() + fresh > limit()
      or (cap > 0 and num(state, 'n:' .. tenant) + fresh > cap) then
    return {-1}
  end
  for i = 9, last, 3 do
    local deadline = tonumber(ARGV[i + 1])
    if redis.call('HEXISTS', held, ARGV[i]) == 1 then
      again[#again + 1] = ARGV[i]
    elseif deadline > now then
      take(ARGV[i], tenant, deadline)
      out[#out + 1] = ARGV[i]; out[#out + 1] = tenant; out[#out + 1] = ARGV[1]; out[#out + 1] = ''
    end
  end
  return {0, in_flight(), again, out}
end
for i = 9, last, 3 do
  if redis.call('HEXISTS', held, ARGV[i]) == 1 then
    again[#again + 1] = ARGV[i]
  else
    own[ARGV[i]] = true
    push(tenant, weight, cap, ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2])
  end
end
fill(out, own)
return {num(state, 'waiting'), in_flight(), again, out}
"#
);

/// Frees calls' slots (their results came) and hands out what now fits. ARGV 5 on:
/// members. Returns {the last one's tenant ('' when none held a slot), waiting, in
/// flight, handed out}.
const RELEASE: &str = concat!(
    lane_lua!(),
    r#"
local tenant
for i = 5, #ARGV do tenant = free(ARGV[i], true) or tenant end
reclaim()
local out = {}
fill(out, {})
return {tenant or '', num(state, 'waiting'), in_flight(), out}
"#
);

/// Forgets calls whose turn ended without their results (cancelled, or past its
/// deadline): a call holding a slot frees it at once; any other is marked gone, so the
/// lane drops it instead of handing it out, until ARGV 5 (the turn's deadline plus the
/// grace; past it the lane drops it anyway and the tick clears the mark). Then hands out
/// what fits. ARGV 6 on: members. Returns {slots freed, waiting, in flight, handed out}.
const FORGET: &str = concat!(
    lane_lua!(),
    r#"
local until_ms = ARGV[5]
local freed = 0
for i = 6, #ARGV do
  if free(ARGV[i], false) then
    freed = freed + 1
  else
    redis.call('HSET', state, 'x:' .. ARGV[i], until_ms)
  end
end
reclaim()
local out = {}
fill(out, {})
return {freed, num(state, 'waiting'), in_flight(), out}
"#
);

/// The lane's upkeep: lapsed slots freed, calls handed out but unconfirmed for ARGV 5 ms
/// handed out again, what fits handed out. Returns {handed out, (tenant, waiting, in
/// flight)*}.
const TICK: &str = concat!(
    lane_lua!(),
    r#"
reclaim()
local out = {}
local unsent = redis.call('HGETALL', sending)
for i = 1, #unsent, 2 do
  local s = fields(unsent[i + 1], 1)
  if now - (tonumber(s[1]) or 0) >= tonumber(ARGV[5]) then
    redis.call('HSET', sending, unsent[i], ARGV[1] .. '\t' .. s[2])
    local r = fields(s[2], 2)
    out[#out + 1] = unsent[i]; out[#out + 1] = r[1]; out[#out + 1] = r[2]; out[#out + 1] = r[3]
  end
end
fill(out, {})
local counts, order = {}, {}
local st = redis.call('HGETALL', state)
for i = 1, #st, 2 do
  local kind, tenant = string.sub(st[i], 1, 2), string.sub(st[i], 3)
  if kind == 'x:' then
    if (tonumber(st[i + 1]) or 0) <= now then redis.call('HDEL', state, st[i]) end
  elseif kind == 'n:' or kind == 't:' then
    if not counts[tenant] then counts[tenant] = {0, 0}; order[#order + 1] = tenant end
    if kind == 'n:' then
      counts[tenant][2] = tonumber(st[i + 1]) or 0
    else
      local head = num(state, 'h:' .. tenant)
      counts[tenant][1] = math.max(0, (tonumber(st[i + 1]) or 0) - head + 1)
    end
  end
end
local flat = {}
for _, tenant in ipairs(order) do
  flat[#flat + 1] = tenant
  flat[#flat + 1] = string.format('%d', counts[tenant][1])
  flat[#flat + 1] = string.format('%d', counts[tenant][2])
end
return {out, flat}
"#
);

/// What a tenant has on a lane, for judging a new turn. KEYS: state, ready. ARGV:
/// tenant. Returns {its calls waiting, its calls in flight, mean slot time in ms
/// (string), the sum of the weights of the tenants with calls waiting}.
const PEEK: &str = r#"
local state, ready = KEYS[1], KEYS[2]
local function num(field) return tonumber(redis.call('HGET', state, field) or '0') or 0 end
local t = ARGV[1]
local head, tail = num('h:' .. t), num('t:' .. t)
local waiting = 0
if head > 0 then waiting = math.max(0, tail - head + 1) end
local weights = 0
for _, r in ipairs(redis.call('ZRANGEBYSCORE', ready, '-inf', '+inf')) do
  weights = weights + math.max(1, num('w:' .. r))
end
return {waiting, num('n:' .. t), string.format('%.3f', num('mean')), weights}
"#;

/// Counts a turn in its tenant's turns in flight unless that would pass the tenant's
/// limit. KEYS: the tenant's turns. ARGV: now, limit, turn id, deadline, ttl (ms).
/// Turns past their deadline no longer count. Returns {1} when counted (or counted
/// before: a resubmission), {0, the earliest deadline of those counted} when full.
const TAKE_TURN: &str = r#"
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local added = redis.call('ZADD', KEYS[1], 'NX', ARGV[4], ARGV[3])
if added == 1 and redis.call('ZCOUNT', KEYS[1], '-inf', '+inf') > tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[3])
  local first = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return {0, first[2] or ARGV[1]}
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {1}
"#;

/// How a lane is run now: the settings every lane script takes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneClock {
    /// Now, Unix ms.
    pub now_ms: u64,
    /// The tool's slots: its live workers × the slots of each.
    pub slots: usize,
    /// Work kept on the stream beyond the slots, in ms of mean slot time.
    pub headroom_ms: u64,
    /// How long a slot outlives its call's deadline without a result.
    pub grace_ms: u64,
}

/// A call of one tenant for [`LaneStore::admit`].
#[derive(Debug, Clone)]
pub(crate) struct LaneEntry {
    /// [`member`] of the call.
    pub member: String,
    /// Its turn's deadline, Unix ms: past it the call is dropped, not handed out.
    pub deadline_ms: u64,
    /// What the lane keeps for whoever publishes it.
    pub payload: String,
}

/// A call the lane handed out: publish it, then [`LaneStore::confirm`] it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HandedOut {
    /// [`member`] of the call.
    pub member: String,
    /// Its tenant.
    pub tenant: String,
    /// When it was queued, Unix ms.
    pub queued_ms: u64,
    /// What the admitting replica stored.
    pub payload: String,
}

/// What [`LaneStore::admit`] did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Admitted {
    /// Calls waiting on the lane afterwards, every tenant's.
    pub waiting: u64,
    /// Calls holding the lane's slots afterwards.
    pub in_flight: u64,
    /// Members of calls that held a slot already: publish them again.
    pub again: Vec<String>,
    /// Calls handed out, this tenant's (first queued, so published by the caller) and
    /// others'.
    pub handed_out: Vec<HandedOut>,
}

/// What [`LaneStore::release`] did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Freed {
    /// Calls waiting on the lane afterwards.
    pub waiting: u64,
    /// Calls holding the lane's slots afterwards.
    pub in_flight: u64,
    /// Calls handed out to fill the freed slot.
    pub handed_out: Vec<HandedOut>,
}

/// What [`LaneStore::tick`] did and found.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ticked {
    /// Calls handed out (again, or into slots that lapsed).
    pub handed_out: Vec<HandedOut>,
    /// Each tenant on the lane: (tenant, calls waiting, calls in flight).
    pub tenants: Vec<(String, u64, u64)>,
}

/// A tenant's standing on a lane ([`LaneStore::peek`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Standing {
    /// The tenant's calls waiting.
    pub waiting: u64,
    /// The tenant's calls holding slots.
    pub in_flight: u64,
    /// Mean time a call holds a slot, ms (0 before any call ended).
    pub mean_ms: f64,
    /// Sum of the weights of the tenants with calls waiting.
    pub weights: u64,
}

/// Failure to talk to Redis or to read what a lane script returned.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LaneError {
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A script's reply was not what it returns.
    #[error("lane reply: {0}")]
    Decode(String),
}

/// The member of a call in a lane: `<turn_id>:<call key>` (turn ids have no `:`).
pub(crate) fn member(turn_id: &str, key: &str) -> String {
    toolfleet_common::names::concat(&[turn_id, ":", key])
}

/// The turn id and call key of a lane member.
pub(crate) fn split_member(member: &str) -> Option<(&str, &str)> {
    member.split_once(':')
}

/// The lanes and the tenants' turn counts in Redis.
#[derive(Clone)]
pub(crate) struct LaneStore {
    redis: RedisConnection,
    names: Names,
    admit: Script,
    release: Script,
    forget: Script,
    tick: Script,
    peek: Script,
    take_turn: Script,
}

impl LaneStore {
    /// A store over `redis`.
    pub(crate) fn new(redis: RedisConnection, names: Names) -> Self {
        Self {
            redis,
            names,
            admit: Script::new(ADMIT),
            release: Script::new(RELEASE),
            forget: Script::new(FORGET),
            tick: Script::new(TICK),
            peek: Script::new(PEEK),
            take_turn: Script::new(TAKE_TURN),
        }
    }

    fn invocation<'a>(
        &self,
        script: &'a Script,
        tool: &str,
        clock: LaneClock,
    ) -> redis::ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        for key in self.names.lane_keys(tool) {
            invocation.key(key);
        }
        invocation
            .arg(clock.now_ms)
            .arg(clock.slots)
            .arg(clock.headroom_ms)
            .arg(clock.grace_ms);
        invocation
    }

    /// Queues `entries` of `tenant` on `tool`'s lane and hands out what fits.
    pub(crate) async fn admit(
        &self,
        tool: &str,
        clock: LaneClock,
        share: (&str, u32, usize),
        entries: &[LaneEntry],
    ) -> Result<Admitted, LaneError> {
        let mut invocation = self.admission(tool, clock, share, entries.len());
        for entry in entries {
            invocation
                .arg(&entry.member)
                .arg(entry.deadline_ms)
                .arg(&entry.payload);
        }
        self.admitted(invocation.arg("0"))
            .await?
            .ok_or_else(|| LaneError::Decode("a full admission answered as a bare one".into()))
    }

    /// Lets `members` of `tenant` (each with its deadline) onto `tool`'s lane at once
    /// when no call waits there and all of them fit, storing no payload; `None`, with
    /// the lane unchanged, when they do not: then [`LaneStore::admit`] them.
    pub(crate) async fn admit_bare(
        &self,
        tool: &str,
        clock: LaneClock,
        share: (&str, u32, usize),
        members: &[(&str, u64)],
    ) -> Result<Option<Admitted>, LaneError> {
        let mut invocation = self.admission(tool, clock, share, members.len());
        for (member, deadline_ms) in members {
            invocation.arg(member).arg(deadline_ms).arg("");
        }
        self.admitted(invocation.arg("1")).await
    }

    /// The admission script's invocation up to its calls: the lane, the clock, the
    /// tenant's share and how many calls follow.
    fn admission(
        &self,
        tool: &str,
        clock: LaneClock,
        share: (&str, u32, usize),
        calls: usize,
    ) -> redis::ScriptInvocation<'_> {
        let (tenant, weight, cap) = share;
        let mut invocation = self.invocation(&self.admit, tool, clock);
        invocation
            .arg(tenant)
            .arg(weight.max(1))
            .arg(cap)
            .arg(calls);
        invocation
    }

    /// Runs an admission: `None` when a bare one was answered "not at once".
    async fn admitted(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<Option<Admitted>, LaneError> {
        let mut redis = self.redis.clone();
        let reply: Vec<RedisValue> = invocation.invoke_async(&mut redis).await?;
        if matches!(reply.first(), Some(RedisValue::Int(-1))) {
            return Ok(None);
        }
        Ok(Some(Admitted {
            waiting: number_at(&reply, 0)?,
            in_flight: number_at(&reply, 1)?,
            again: strings_at(&reply, 2)?,
            handed_out: handed_out(&strings_at(&reply, 3)?)?,
        }))
    }

    /// Frees the slots of `members` on `tool`'s lane and hands out what fits.
    pub(crate) async fn release(
        &self,
        tool: &str,
        clock: LaneClock,
        members: &[String],
    ) -> Result<Freed, LaneError> {
        let mut invocation = self.invocation(&self.release, tool, clock);
        for member in members {
            invocation.arg(member);
        }
        self.freed(&invocation).await
    }

    /// Runs a script that frees slots: `RELEASE` or `FORGET`, whose replies both end
    /// with {waiting, in flight, handed out}.
    async fn freed(&self, invocation: &redis::ScriptInvocation<'_>) -> Result<Freed, LaneError> {
        let mut redis = self.redis.clone();
        let reply: Vec<RedisValue> = invocation.invoke_async(&mut redis).await?;
        Ok(Freed {
            waiting: number_at(&reply, 1)?,
            in_flight: number_at(&reply, 2)?,
            handed_out: handed_out(&strings_at(&reply, 3)?)?,
        })
    }

    /// Forgets `members` of `tool`, calls of a turn that ended without their results:
    /// their slots are freed, and those still waiting are dropped when their turn comes
    /// (marked until `until_ms`); hands out what fits.
    pub(crate) async fn forget(
        &self,
        tool: &str,
        clock: LaneClock,
        until_ms: u64,
        members: &[String],
    ) -> Result<Freed, LaneError> {
        let mut invocation = self.invocation(&self.forget, tool, clock);
        invocation.arg(until_ms);
        for member in members {
            invocation.arg(member);
        }
        self.freed(&invocation).await
    }

    /// Notes that the handed-out calls `members` of `tool` were published, so no tick
    /// hands them out again.
    pub(crate) async fn confirm(&self, tool: &str, members: &[String]) -> Result<(), LaneError> {
        if members.is_empty() {
            return Ok(());
        }
        let [_, _, _, _, _, sending] = self.names.lane_keys(tool);
        let mut redis = self.redis.clone();
        let _: () = redis::cmd("HDEL")
            .arg(sending)
            .arg(members)
            .query_async(&mut redis)
            .await?;
        Ok(())
    }

    /// `tool`'s lane's upkeep: lapsed slots freed, calls unconfirmed for `resend_ms`
    /// handed out again, what fits handed out; and every tenant's counts.
    pub(crate) async fn tick(
        &self,
        tool: &str,
        clock: LaneClock,
        resend_ms: u64,
    ) -> Result<Ticked, LaneError> {
        let mut invocation = self.invocation(&self.tick, tool, clock);
        invocation.arg(resend_ms);
        let mut redis = self.redis.clone();
        let reply: Vec<RedisValue> = invocation.invoke_async(&mut redis).await?;
        let flat = strings_at(&reply, 1)?;
        let mut tenants = Vec::with_capacity(flat.len() / 3);
        for row in flat.chunks_exact(3) {
            tenants.push((row[0].clone(), parse(&row[1])?, parse(&row[2])?));
        }
        Ok(Ticked {
            handed_out: handed_out(&strings_at(&reply, 0)?)?,
            tenants,
        })
    }

    /// `tenant`'s standing on `tool`'s lane.
    pub(crate) async fn peek(&self, tool: &str, tenant: &str) -> Result<Standing, LaneError> {
        let [_, _, state, _, ready, _] = self.names.lane_keys(tool);
        let mut invocation = self.peek.prepare_invoke();
        invocation.key(state).key(ready).arg(tenant);
        let mut redis = self.redis.clone();
        let reply: Vec<RedisValue> = invocation.invoke_async(&mut redis).await?;
        Ok(Standing {
            waiting: number_at(&reply, 0)?,
            in_flight: number_at(&reply, 1)?,
            mean_ms: string_at(&reply, 2)?.parse().unwrap_or(0.0),
            weights: number_at(&reply, 3)?,
        })
    }

    /// Counts `turn_id` (ending at `deadline_ms`) in `tenant`'s turns in flight unless
    /// `limit` are; `Err` with the earliest deadline of those counted when full.
    pub(crate) async fn take_turn(
        &self,
        tenant: &str,
        turn_id: &str,
        deadline_ms: u64,
        limit: usize,
        now_ms: u64,
    ) -> Result<Result<(), u64>, LaneError> {
        let mut invocation = self.take_turn.prepare_invoke();
        let ttl = deadline_ms.saturating_sub(now_ms).saturating_add(60_000);
        invocation
            .key(self.names.tenant_turns_key(tenant))
            .arg(now_ms)
            .arg(limit)
            .arg(turn_id)
            .arg(deadline_ms)
            .arg(ttl);
        let mut redis = self.redis.clone();
        let reply: Vec<RedisValue> = invocation.invoke_async(&mut redis).await?;
        if number_at(&reply, 0)? == 1 {
            return Ok(Ok(()));
        }
        let first: f64 = string_at(&reply, 1)?.parse().unwrap_or(0.0);
        Ok(Err(first.max(0.0) as u64))
    }

    /// Stops counting `turn_id` in `tenant`'s turns in flight.
    pub(crate) async fn end_turn(&self, tenant: &str, turn_id: &str) -> Result<(), LaneError> {
        let mut redis = self.redis.clone();
        let _: i64 = redis::cmd("ZREM")
            .arg(self.names.tenant_turns_key(tenant))
            .arg(turn_id)
            .query_async(&mut redis)
            .await?;
        Ok(())
    }
}

fn parse(text: &str) -> Result<u64, LaneError> {
    text.parse()
        .map_err(|_| LaneError::Decode(format!("{text:?} is not a count")))
}

fn number_at(reply: &[RedisValue], i: usize) -> Result<u64, LaneError> {
    reply_at(reply, i).map_err(LaneError::Decode)
}

fn string_at(reply: &[RedisValue], i: usize) -> Result<String, LaneError> {
    reply_at(reply, i).map_err(LaneError::Decode)
}

fn strings_at(reply: &[RedisValue], i: usize) -> Result<Vec<String>, LaneError> {
    match reply.get(i) {
        Some(value) => Vec::<String>::from_redis_value(value.clone())
            .map_err(|e| LaneError::Decode(e.to_string())),
        None => Ok(Vec::new()),
    }
}

/// Calls handed out, from a flat (member, tenant, queued at, payload)* reply.
fn handed_out(flat: &[String]) -> Result<Vec<HandedOut>, LaneError> {
    flat.chunks_exact(4)
        .map(|row| {
            Ok(HandedOut {
                member: row[0].clone(),
                tenant: row[1].clone(),
                queued_ms: parse(&row[2])?,
                payload: row[3].clone(),
            })
        })
        .collect()
}

/// Tenants' counts summed over lanes, by tenant.
pub(crate) fn sum_counts<'a>(
    lanes: impl IntoIterator<Item = &'a (String, u64, u64)>,
) -> HashMap<&'a str, (u64, u64)> {
    let mut sums: HashMap<&str, (u64, u64)> = HashMap::new();
    for (tenant, waiting, in_flight) in lanes {
        let sum = sums.entry(tenant.as_str()).or_default();
        sum.0 += waiting;
        sum.1 += in_flight;
    }
    sums
}

/// How long a lane seen with calls waiting counts as contended here, so a new turn's
/// backlog is looked at; other turns skip the look.
const CONTENDED_FOR_MS: u64 = 2000;

/// How long a tool's new calls keep going through its lane after it was last seen
/// near its slots or holding calls.
const LANED_FOR_MS: u64 = 2000;

/// This replica's lanes: the store, how near each tool is to its slots, and the slots
/// waiting to be freed while a release of their tool is in flight.
pub(crate) struct Lanes {
    pub(crate) store: LaneStore,
    /// How near each tool is to its slots, seen from here: whether a turn's calls go
    /// through the lane at all.
    pub(crate) pressure: Pressure,
    /// Tool → the releases asked for while one of that tool's ran.
    releasing: Mutex<HashMap<String, Releasing>>,
}

/// Releases of one tool's lane that wait for the script in flight: each member with
/// the channel that tells its caller whether its slot was freed.
#[derive(Default)]
struct Releasing {
    waiting: Vec<(String, oneshot::Sender<bool>)>,
}

/// What one [`Lanes::release`] call did.
pub(crate) enum SlotFreed {
    /// This call ran the scripts: what they freed and handed out, which the caller
    /// publishes (the slots of calls that asked meanwhile included).
    Ran(Freed),
    /// Another call's script freed this slot too; it publishes what was handed out.
    Joined,
}

impl Lanes {
    /// Lanes over `store`.
    pub(crate) fn new(store: LaneStore) -> Self {
        Self {
            store,
            pressure: Pressure::default(),
            releasing: Mutex::default(),
        }
    }

    /// Frees the slot of `member` on `tool`'s lane. One script per tool runs at a
    /// time: the slots asked for while it runs are freed together by the next one, run
    /// by the call that started the first (results of one turn arrive together, so most
    /// of a turn's slots go in one script). Every member of a script that failed is
    /// released again on its own, so each caller learns its own failure (the result is
    /// then delivered again; freeing twice frees once).
    pub(crate) async fn release(
        &self,
        tool: &str,
        clock: LaneClock,
        member: String,
    ) -> Result<SlotFreed, LaneError> {
        let joined = {
            let Ok(mut releasing) = self.releasing.lock() else {
                return self.release_alone(tool, clock, member).await;
            };
            match releasing.get_mut(tool) {
                Some(running) => {
                    let (sent, freed) = oneshot::channel();
                    running.waiting.push((member.clone(), sent));
                    Some(freed)
                }
                None => {
                    releasing.insert(tool.to_string(), Releasing::default());
                    None
                }
            }
        };
        if let Some(freed) = joined {
            return match freed.await {
                Ok(true) => Ok(SlotFreed::Joined),
                // The script failed (or its runner went away): alone, for this
                // caller's own outcome.
                _ => self.release_alone(tool, clock, member).await,
            };
        }
        let mut total = Freed::default();
        let mut members = vec![member];
        let mut waiters: Vec<oneshot::Sender<bool>> = Vec::new();
        let mut first = true;
        loop {
            let outcome = self.store.release(tool, clock, &members).await;
            let ok = outcome.is_ok();
            for waiter in waiters.drain(..) {
                let _ = waiter.send(ok);
            }
            match outcome {
                Ok(freed) => {
                    total.waiting = freed.waiting;
                    total.handed_out.extend(freed.handed_out);
                }
                // The first script held this caller's own slot.
                Err(error) if first => {
                    self.stop_releasing(tool);
                    return Err(error);
                }
                Err(_) => {}
            }
            first = false;
            let next = match self.releasing.lock() {
                Ok(mut releasing) => match releasing.get_mut(tool) {
                    Some(running) if !running.waiting.is_empty() => {
                        std::mem::take(&mut running.waiting)
                    }
                    _ => {
                        releasing.remove(tool);
                        Vec::new()
                    }
                },
                Err(_) => Vec::new(),
            };
            if next.is_empty() {
                return Ok(SlotFreed::Ran(total));
            }
            (members, waiters) = next.into_iter().unzip();
        }
    }

    /// Frees `member`'s slot in a script of its own.
    async fn release_alone(
        &self,
        tool: &str,
        clock: LaneClock,
        member: String,
    ) -> Result<SlotFreed, LaneError> {
        Ok(SlotFreed::Ran(
            self.store.release(tool, clock, &[member]).await?,
        ))
    }

    /// Forgets that a release of `tool` runs; the calls that joined it in the meantime
    /// are told to release on their own.
    fn stop_releasing(&self, tool: &str) {
        if let Ok(mut releasing) = self.releasing.lock() {
            if let Some(running) = releasing.remove(tool) {
                for (_, waiter) in running.waiting {
                    let _ = waiter.send(false);
                }
            }
        }
    }
}

/// One turn's calls of one tool, for [`Pressure::laned`]: the tool, its slots, and each
/// call's member with its turn's deadline (Unix ms).
pub(crate) type ToolCalls<'a> = (&'a str, usize, Vec<(String, u64)>);

/// How near each tool is to its slots, seen from this replica (`sharing::laned`).
#[derive(Default)]
pub(crate) struct Pressure {
    /// Tool → when this replica last saw calls waiting on its lane (Unix ms).
    contended: Mutex<HashMap<String, u64>>,
    /// Tool → until when (Unix ms) new turns' calls go through its lane: while the lane
    /// holds calls, and a while after this replica saw the tool near its slots.
    laned_until: Mutex<HashMap<String, u64>>,
    /// Tool → the calls this replica published past the lane (member → its turn's
    /// deadline, Unix ms) whose results it has not recorded: how near the tool is to
    /// its slots, seen from here. A result recorded by another replica leaves its
    /// member here until the deadline, which only errs towards using the lane.
    unlaned: Mutex<HashMap<String, HashMap<String, u64>>>,
}

impl Pressure {
    /// Notes how many calls wait on `tool`'s lane and how many hold its slots.
    pub(crate) fn note(&self, tool: &str, waiting: u64, in_flight: u64) {
        self.note_at(tool, waiting, in_flight, unix_ms());
    }

    /// [`Pressure::note`] at `now_ms`.
    fn note_at(&self, tool: &str, waiting: u64, in_flight: u64, now_ms: u64) {
        if let Ok(mut seen) = self.contended.lock() {
            if waiting > 0 {
                seen.insert(tool.to_string(), now_ms);
            } else {
                seen.remove(tool);
            }
        }
        if let Ok(mut until) = self.laned_until.lock() {
            if waiting > 0 || in_flight > 0 {
                let at = until.entry(tool.to_string()).or_default();
                *at = (*at).max(now_ms + LANED_FOR_MS);
            } else {
                // Drained: new calls go past it until the tool nears its slots again.
                until.remove(tool);
            }
        }
    }

    /// Whether a turn's calls go through their tools' lanes. `tools` are the turn's
    /// tools, each with its slots and the turn's calls of it as (member, deadline): the
    /// turn is laned when any of its tools' lanes holds or queues calls, or when this
    /// replica's calls in flight past a tool's lane and the turn's would take more than
    /// half its slots (then the tool stays laned a while: [`LANED_FOR_MS`]). Otherwise
    /// the turn's calls are counted in flight past the lanes at once (before the turn is
    /// stored, so turns decided meanwhile count them) and go straight onto the stream.
    pub(crate) fn laned(&self, tools: &[ToolCalls<'_>], now_ms: u64) -> bool {
        let (Ok(mut until), Ok(mut unlaned)) = (self.laned_until.lock(), self.unlaned.lock())
        else {
            return true;
        };
        let mut laned = false;
        for (tool, slots, calls) in tools {
            if self.contended(tool, now_ms) || until.get(*tool).is_some_and(|at| now_ms < *at) {
                laned = true;
                continue;
            }
            let past = unlaned.get_mut(*tool).map_or(0, |past| {
                past.retain(|_, deadline| *deadline > now_ms);
                past.len()
            });
            if (past + calls.len()) * 2 > (*slots).max(1) {
                until.insert((*tool).to_string(), now_ms + LANED_FOR_MS);
                laned = true;
            }
        }
        if !laned {
            for (tool, _, calls) in tools {
                unlaned
                    .entry((*tool).to_string())
                    .or_default()
                    .extend(calls.iter().cloned());
            }
        }
        laned
    }

    /// Notes that the call `member` of `tool`, published past the lane, has ended.
    pub(crate) fn ended_past(&self, tool: &str, member: &str) {
        if let Ok(mut unlaned) = self.unlaned.lock() {
            if let Some(calls) = unlaned.get_mut(tool) {
                calls.remove(member);
            }
        }
    }

    /// Whether `tool`'s lane was lately seen with calls waiting.
    pub(crate) fn contended(&self, tool: &str, now_ms: u64) -> bool {
        self.contended
            .lock()
            .ok()
            .and_then(|seen| seen.get(tool).copied())
            .is_some_and(|at| now_ms.saturating_sub(at) < CONTENDED_FOR_MS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The turn's calls of tool `t` (of 8 slots), named `<turn>:<i>`.
    fn turn(turn: &str, calls: usize, deadline: u64) -> Vec<ToolCalls<'static>> {
        let members = (0..calls)
            .map(|i| (format!("{turn}:{i}"), deadline))
            .collect();
        vec![("t", 8, members)]
    }

    #[test]
    fn an_uncontended_tool_is_used_past_its_lane_until_half_its_slots() {
        let p = Pressure::default();
        // 8 slots: a turn of 3 calls goes past the lane, then one of 1 (4 of 8), not
        // one of 2 more.
        assert!(!p.laned(&turn("a", 3, 60_000), 1_000));
        assert!(!p.laned(&turn("b", 1, 60_000), 1_000));
        assert!(p.laned(&turn("c", 1, 60_000), 1_000), "5 of 8 slots");
        // Laned for a while after, even once the calls ended.
        for i in 0..3 {
            p.ended_past("t", &format!("a:{i}"));
        }
        p.ended_past("t", "b:0");
        assert!(p.laned(&turn("d", 1, 60_000), 1_000 + LANED_FOR_MS - 1));
        assert!(!p.laned(&turn("e", 1, 60_000), 1_000 + LANED_FOR_MS));
        // Another tool is not affected; a turn with one laned tool is laned whole, and
        // its calls of the other tool are not counted past the lane.
        let mixed = vec![
            ("u", 8, vec![("f:0".to_string(), 60_000)]),
            turn("f", 1, 60_000).remove(0),
        ];
        p.note_at("t", 0, 1, 1_000 + LANED_FOR_MS);
        assert!(p.laned(&mixed, 1_000 + LANED_FOR_MS));
        assert!(!p.laned(
            &[("u", 8, vec![("g:0".to_string(), 60_000)])],
            1_000 + LANED_FOR_MS
        ));
        assert!(
            !p.laned(
                &[("u", 4, vec![("h:0".to_string(), 60_000)])],
                1_000 + LANED_FOR_MS
            ),
            "u holds g:0 only: 2 of 4 slots"
        );
    }

    #[test]
    fn a_lane_holding_or_queueing_calls_keeps_new_turns_in_it_until_it_drains() {
        let p = Pressure::default();
        p.note_at("t", 0, 3, 1_000);
        assert!(p.laned(&turn("a", 1, 60_000), 1_500));
        p.note_at("t", 2, 8, 1_500);
        assert!(p.laned(&turn("b", 1, 60_000), 3_000), "calls waiting");
        p.note_at("t", 0, 0, 3_000);
        // Drained, and no longer seen contended.
        assert!(!p.laned(&turn("c", 1, 60_000), 3_500 + CONTENDED_FOR_MS));
    }

    #[test]
    fn calls_past_their_deadline_stop_counting() {
        let p = Pressure::default();
        assert!(!p.laned(&turn("a", 4, 2_000), 1_000));
        assert!(p.laned(&turn("b", 1, 60_000), 1_000));
        let q = Pressure::default();
        assert!(!q.laned(&turn("a", 4, 2_000), 1_000));
        assert!(
            !q.laned(&turn("b", 1, 60_000), 2_000),
            "their deadline passed"
        );
    }

    #[test]
    fn members_name_their_turn_and_call() {
        let m = member("t-1", "call:odd");
        assert_eq!(split_member(&m), Some(("t-1", "call:odd")));
    }

    #[test]
    fn handed_out_rows() {
        let flat: Vec<String> = ["t:a", "acme", "12", "{}"].map(String::from).to_vec();
        let rows = handed_out(&flat).unwrap_or_default();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].tenant, "acme");
        assert_eq!(rows[0].queued_ms, 12);
        assert!(handed_out(&["t:a", "x", "soon", "{}"].map(String::from)).is_err());
    }
}
