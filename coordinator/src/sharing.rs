//! How tenants share the fleet: every job passes through its tool's lane
//! (`lanes.rs`), and each tenant's own limits are applied before its turn is stored.
//!
//! Owns the policy around the lanes: the tool's slots (live workers ×
//! `TOOLFLEET_LANE_WORKER_SLOTS`), a tenant's weight and cap from the tenants file,
//! publishing the calls a lane hands out (whichever turn they belong to) and confirming
//! them, freeing a slot when a result is recorded, the per-tenant refusals with
//! `overloaded` (too many turns in flight, or a backlog on a tool that would outlive the
//! new turn's deadline), the lanes' upkeep and the per-tenant metrics.
//!
//! Owns [`dispatch`], the one way a turn's jobs leave (through the lanes, or straight to
//! `dispatch.rs`'s publish), and the dispatch of the queued calls a result released.
//! Jobs that could not be published are handed back to the caller, which records their
//! results (`results.rs`).
//!
//! Sharing is priced by contention: [`laned`] decides, once per turn before it is
//! stored, whether its calls go through the lanes. They do while a tool's lane holds
//! or queues calls, or when this replica's calls in flight past the lane and the new
//! ones would take half the tool's slots; otherwise they go straight onto the stream,
//! and their results free no slot, so an uncontended tool runs no lane script. The
//! decision is stored with the turn (`laned`), so whichever replica records a result or
//! ends the turn knows whether it holds slots.
//!
//! A lane that Redis cannot reach never stops a call: its jobs are published at once,
//! unshared. Never publishes a frontend event; a refusal is returned to `intake.rs`.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use toolfleet_common::call::unix_ms;
use toolfleet_common::turn::turn_codes;
use toolfleet_common::{CallError, JobEnvelope};
use tracing::{debug, warn};

use crate::config::TenantPolicy;
use crate::dispatch::{publish, Dispatched, Jobs, Unpublished};
use crate::fault;
use crate::lanes::{self, Freed, HandedOut, LaneClock, LaneEntry, LaneError, SlotFreed};
use crate::replica::Sharing;
use crate::store::redis::Released;
use crate::trace::TurnTrace;

/// How long a slot outlives its call's deadline when no result frees it.
const SLOT_GRACE_MS: u64 = 1000;

/// A call handed out and not confirmed published after this long is handed out again
/// (its publisher died); the stream de-duplicates a second copy.
const RESEND_AFTER_MS: u64 = 3000;

/// What a lane keeps of a waiting call: its job and its turn's stored trace identity.
#[derive(Debug, Serialize, Deserialize)]
struct Waiting {
    job: JobEnvelope,
    #[serde(default)]
    trace: String,
}

/// The clock of `tool`'s lane now: its slots from the registry's live workers.
fn clock(sharing: Sharing<'_>, tool: &str) -> LaneClock {
    let workers = sharing
        .registry
        .snapshot()
        .get(tool)
        .map_or(1, |t| t.live_workers.max(1));
    LaneClock {
        now_ms: unix_ms(),
        slots: workers.saturating_mul(sharing.config.lane_worker_slots),
        headroom_ms: crate::limits::millis(sharing.config.lane_headroom),
        grace_ms: SLOT_GRACE_MS,
    }
}

/// The cap on `tenant`'s calls in flight on `tool` (0: none).
fn cap(policy: &TenantPolicy, tool: &str) -> usize {
    policy.calls_in_flight_on(tool).unwrap_or(0)
}

/// Whether a turn of `jobs` goes through its tools' lanes: with fair sharing on, when
/// any of its tools nears its slots or its lane holds calls (`Lanes::near`). A turn
/// that does not is published straight onto the stream and its results free no slot:
/// an uncontended tool pays nothing for sharing. Decided once, before the turn is
/// stored (its results and its queued calls follow the stored decision).
pub(crate) fn laned(sharing: Sharing<'_>, turn_id: &str, jobs: &Jobs) -> bool {
    if !sharing.config.fair_sharing {
        return false;
    }
    let mut calls: BTreeMap<&str, Vec<(String, u64)>> = BTreeMap::new();
    for (key, job) in jobs.now.iter().chain(&jobs.queued) {
        calls
            .entry(job.call.name.as_str())
            .or_default()
            .push((lanes::member(turn_id, key), job.deadline_unix_ms));
    }
    let tools: Vec<lanes::ToolCalls<'_>> = calls
        .into_iter()
        .map(|(tool, calls)| (tool, clock(sharing, tool).slots, calls))
        .collect();
    sharing.lanes.pressure.laned(&tools, unix_ms())
}

/// Dispatches `jobs` of one turn: through their tools' lanes, shared fairly between
/// tenants, when the turn is `laned` ([`laned`]); else straight onto the stream. Returns the keys of the jobs published or
/// stored in a lane, and the jobs that could not be published, for the caller to record.
pub(crate) async fn dispatch(
    sharing: Sharing<'_>,
    turn_id: &str,
    jobs: Vec<(String, JobEnvelope)>,
    trace: Option<&TurnTrace>,
    laned: bool,
) -> Dispatched {
    if laned {
        return dispatch_fairly(sharing, turn_id, jobs, trace).await;
    }
    publish(sharing.jobs, turn_id, jobs, trace).await
}

/// Dispatches the jobs of queued calls that freed slots released (by any replica's
/// recording: the queue is stored with the turn), under the turn span, and confirms
/// each one published or stored in its tool's lane, so a duplicate result no longer
/// hands it out again. Returns the jobs that could not be published.
pub(crate) async fn dispatch_released(
    sharing: Sharing<'_>,
    turn_id: &str,
    released: Vec<Released>,
    laned: bool,
) -> Vec<Unpublished> {
    let Some(stored) = released.first().map(|r| r.trace.clone()) else {
        return Vec::new();
    };
    fault::point(fault::EXIT_AFTER_CALL_RELEASED);
    let trace = sharing
        .turns
        .trace(turn_id)
        .or_else(|| TurnTrace::decode(&stored));
    let jobs = released.into_iter().map(|r| (r.key, r.job)).collect();
    let dispatched = dispatch(sharing, turn_id, jobs, trace.as_ref(), laned).await;
    for key in dispatched.published {
        if let Err(error) = sharing.store.confirm_dispatched(turn_id, &key).await {
            // Harmless: a duplicate result may publish it again, which the stream
            // de-duplicates by message id.
            warn!(%turn_id, call = %key, %error, "could not confirm a released call's publish");
        }
    }
    dispatched.failed
}

/// Publishes `jobs` of one turn through their tools' lanes: the calls that fit now are
/// published (with any other tenant's calls the lane hands out with them), the rest
/// wait in the lane. Returns the keys published or stored in a lane, and the jobs that
/// could not be published.
async fn dispatch_fairly(
    sharing: Sharing<'_>,
    turn_id: &str,
    jobs: Vec<(String, JobEnvelope)>,
    trace: Option<&TurnTrace>,
) -> Dispatched {
    let Some(tenant) = jobs.first().map(|(_, job)| job.tenant_id.clone()) else {
        return Dispatched::default();
    };
    let policy = sharing.config.tenants.get(&tenant);
    let stored_trace = TurnTrace::stored(trace).1;
    let mut by_tool: BTreeMap<String, Vec<(String, JobEnvelope)>> = BTreeMap::new();
    for (key, job) in jobs {
        by_tool
            .entry(job.call.name.clone())
            .or_default()
            .push((key, job));
    }
    let label = sharing.config.tenants.label(&tenant);
    let mut accepted = Vec::new();
    let mut now = Vec::new();
    let mut others = Vec::new();
    for (tool, group) in by_tool {
        let members: Vec<String> = group
            .iter()
            .map(|(key, _)| lanes::member(turn_id, key))
            .collect();
        let share = (tenant.as_str(), policy.weight(), cap(policy, &tool));
        let clock = clock(sharing, &tool);
        let admitted = match admit(
            sharing,
            &tool,
            clock,
            share,
            &group,
            &members,
            &stored_trace,
        )
        .await
        {
            Ok(admitted) => admitted,
            Err(error) => {
                warn!(%turn_id, %tool, %error, "the tool's lane is unavailable; publishing unshared");
                sharing.metrics.redis_error("lane_admit");
                now.extend(group);
                continue;
            }
        };
        sharing
            .lanes
            .pressure
            .note(&tool, admitted.waiting, admitted.in_flight);
        let mut run: HashMap<&str, ()> = admitted.again.iter().map(|m| (m.as_str(), ())).collect();
        for out in &admitted.handed_out {
            if members.contains(&out.member) {
                run.insert(out.member.as_str(), ());
            } else {
                others.push((tool.clone(), out.clone()));
            }
        }
        for ((key, job), member) in group.into_iter().zip(&members) {
            if run.contains_key(member.as_str()) {
                sharing.metrics.lane_waited(&label, 0.0);
                now.push((key, job));
            } else {
                accepted.push(key);
            }
        }
    }
    let mut dispatched = publish(sharing.jobs, turn_id, now, trace).await;
    accepted.append(&mut dispatched.published);
    dispatched.published = accepted;
    let failed = publish_handed_out(sharing, others).await;
    dispatched.failed.extend(failed);
    dispatched
}

/// Lets one turn's calls of `tool` onto its lane. A lane not lately seen with calls
/// waiting is asked first to take them at once without their payloads (no queue entry
/// to write and read back, no job to encode); when calls wait there or these do not
/// all fit, they are queued with their payloads, as on a contended lane.
async fn admit(
    sharing: Sharing<'_>,
    tool: &str,
    clock: LaneClock,
    share: (&str, u32, usize),
    group: &[(String, JobEnvelope)],
    members: &[String],
    stored_trace: &str,
) -> Result<lanes::Admitted, LaneError> {
    let store = &sharing.lanes.store;
    let entries = group.iter().zip(members);
    if !sharing.lanes.pressure.contended(tool, clock.now_ms) {
        let bare: Vec<(&str, u64)> = entries
            .clone()
            .map(|((_, job), member)| (member.as_str(), job.deadline_unix_ms))
            .collect();
        if let Some(admitted) = store.admit_bare(tool, clock, share, &bare).await? {
            return Ok(admitted);
        }
    }
    let entries: Vec<LaneEntry> = entries
        .map(|((_, job), member)| LaneEntry {
            member: member.clone(),
            deadline_ms: job.deadline_unix_ms,
            payload: encode(job, stored_trace),
        })
        .collect();
    store.admit(tool, clock, share, &entries).await
}

/// The payload a lane keeps for `job`.
fn encode(job: &JobEnvelope, trace: &str) -> String {
    #[derive(Serialize)]
    struct Borrowed<'a> {
        job: &'a JobEnvelope,
        trace: &'a str,
    }
    serde_json::to_string(&Borrowed { job, trace }).unwrap_or_default()
}

/// The calls of one turn that lanes handed out: the turn's stored trace, and each
/// call's tool, key and job in the order handed out.
type HandedTurn = (String, Vec<(String, String, JobEnvelope)>);

/// Publishes calls lanes handed out (of any turn, by `tool`), each under its turn's
/// span, and confirms the published ones so no tick hands them out again. Returns the
/// jobs that could not be published.
async fn publish_handed_out(
    sharing: Sharing<'_>,
    calls: Vec<(String, HandedOut)>,
) -> Vec<Unpublished> {
    let mut failed = Vec::new();
    if calls.is_empty() {
        return failed;
    }
    let now_ms = unix_ms();
    let mut turns: BTreeMap<String, HandedTurn> = BTreeMap::new();
    for (tool, out) in calls {
        let Some((turn_id, key)) = lanes::split_member(&out.member) else {
            warn!(member = %out.member, "a lane handed out a call it cannot name");
            continue;
        };
        let waiting: Waiting = match serde_json::from_str(&out.payload) {
            Ok(w) => w,
            Err(error) => {
                warn!(%turn_id, call = %key, %error, "a lane handed out a call that does not decode");
                continue;
            }
        };
        let waited = now_ms.saturating_sub(out.queued_ms) as f64 / 1000.0;
        let label = sharing.config.tenants.label(&out.tenant);
        sharing.metrics.lane_waited(&label, waited);
        let entry = turns
            .entry(turn_id.to_string())
            .or_insert_with(|| (waiting.trace.clone(), Vec::new()));
        entry.1.push((tool, key.to_string(), waiting.job));
    }
    for (turn_id, (stored, calls)) in turns {
        let trace = sharing
            .turns
            .trace(&turn_id)
            .or_else(|| TurnTrace::decode(&stored));
        let tools: HashMap<String, String> = calls
            .iter()
            .map(|(tool, key, _)| (key.clone(), tool.clone()))
            .collect();
        let jobs = calls.into_iter().map(|(_, key, job)| (key, job)).collect();
        let dispatched = publish(sharing.jobs, &turn_id, jobs, trace.as_ref()).await;
        failed.extend(dispatched.failed);
        let mut by_tool: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for key in &dispatched.published {
            if let Some(tool) = tools.get(key) {
                by_tool
                    .entry(tool.as_str())
                    .or_default()
                    .push(lanes::member(&turn_id, key));
            }
        }
        for (tool, members) in by_tool {
            if let Err(error) = sharing.lanes.store.confirm(tool, &members).await {
                // Harmless: the next tick hands them out again, and the stream
                // de-duplicates the second copy.
                debug!(%turn_id, %tool, %error, "could not confirm calls a lane handed out");
            }
        }
    }
    failed
}

/// Frees the lane slot of the call `key` of `turn_id` on `tool` (its result was
/// recorded, or came late or twice) and publishes what the lane hands out instead.
/// `Err` when the lane could not be reached: the result is then delivered again, and
/// freeing twice frees once. Returns the jobs handed out that could not be published.
pub(crate) async fn release(
    sharing: Sharing<'_>,
    tool: &str,
    turn_id: &str,
    key: &str,
    laned: bool,
) -> Result<Vec<Unpublished>, LaneError> {
    if !sharing.config.fair_sharing {
        return Ok(Vec::new());
    }
    let member = lanes::member(turn_id, key);
    if !laned {
        sharing.lanes.pressure.ended_past(tool, &member);
        return Ok(Vec::new());
    }
    let freed = match sharing
        .lanes
        .release(tool, clock(sharing, tool), member)
        .await
        .inspect_err(|_| sharing.metrics.redis_error("lane_release"))?
    {
        SlotFreed::Ran(freed) => freed,
        // The call that ran the script publishes what it handed out.
        SlotFreed::Joined => return Ok(Vec::new()),
    };
    Ok(hand_out_freed(sharing, tool, freed).await)
}

/// Notes what a script that freed slots of `tool`'s lane found there, and publishes the
/// calls it handed out; returns those that could not be published.
async fn hand_out_freed(sharing: Sharing<'_>, tool: &str, freed: Freed) -> Vec<Unpublished> {
    sharing
        .lanes
        .pressure
        .note(tool, freed.waiting, freed.in_flight);
    let calls = freed
        .handed_out
        .into_iter()
        .map(|out| (tool.to_string(), out))
        .collect();
    publish_handed_out(sharing, calls).await
}

/// Releases what a turn that ended without all its results (cancelled, or past its
/// deadline) holds on the lanes, at once instead of at its deadline: the slots of its
/// calls in flight, its calls still waiting (dropped when their turn would come), and
/// its place among its tenant's turns in flight. `missing` are the (tool, call key)
/// pairs without a result. Calls the lanes hand out into the freed slots are published
/// here; one that cannot be is left to the lane's tick, which hands it out again.
pub(crate) async fn turn_closed(
    sharing: Sharing<'_>,
    tenant: &str,
    turn_id: &str,
    deadline_ms: u64,
    missing: &[(&str, &str)],
    laned: bool,
) {
    if !sharing.config.fair_sharing {
        return;
    }
    let mut by_tool: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (tool, key) in missing {
        let member = lanes::member(turn_id, key);
        if laned {
            by_tool.entry(tool).or_default().push(member);
        } else {
            sharing.lanes.pressure.ended_past(tool, &member);
        }
    }
    let until_ms = deadline_ms.max(unix_ms()).saturating_add(SLOT_GRACE_MS);
    for (tool, members) in by_tool {
        let freed = match sharing
            .lanes
            .store
            .forget(tool, clock(sharing, tool), until_ms, &members)
            .await
        {
            Ok(freed) => freed,
            Err(error) => {
                // The slots lapse at the deadline instead.
                debug!(%turn_id, %tool, %error, "an ended turn's lane slots not released");
                sharing.metrics.redis_error("lane_forget");
                continue;
            }
        };
        for unpublished in hand_out_freed(sharing, tool, freed).await {
            debug!(turn_id = %unpublished.turn_id, call = %unpublished.key, "a handed-out call not published; the lane's tick hands it out again");
        }
    }
    turn_ended(sharing, tenant, turn_id).await;
}

/// Releases what a turn refused when it was to be stored (its id taken by another
/// request) took when it was admitted: its place among its tenant's turns in flight and
/// its calls counted past the lanes (`jobs`, those it would have published at once).
pub(crate) async fn turn_refused(
    sharing: Sharing<'_>,
    tenant: &str,
    turn_id: &str,
    jobs: &[(String, JobEnvelope)],
    laned: bool,
) {
    if !sharing.config.fair_sharing {
        return;
    }
    if !laned {
        for (key, job) in jobs {
            let member = lanes::member(turn_id, key);
            sharing.lanes.pressure.ended_past(&job.call.name, &member);
        }
    }
    turn_ended(sharing, tenant, turn_id).await;
}

/// Stops counting `turn_id` among `tenant`'s turns in flight (it ended), when the
/// tenant's turns are limited. Best effort: a turn not removed stops counting at its
/// deadline.
pub(crate) async fn turn_ended(sharing: Sharing<'_>, tenant: &str, turn_id: &str) {
    if tenant.is_empty()
        || sharing
            .config
            .tenants
            .get(tenant)
            .max_turns_in_flight
            .is_none()
    {
        return;
    }
    if let Err(error) = sharing.lanes.store.end_turn(tenant, turn_id).await {
        debug!(%turn_id, %error, "could not stop counting a turn in flight");
    }
}

/// Whether the tenant may start a turn of `jobs` ending at `deadline_ms`: under its
/// limit of turns in flight, and without a backlog on any of the turn's tools that
/// would outlive `budget_ms`. Else the `overloaded` refusal, with a retry hint. A check
/// that cannot reach Redis lets the turn in.
pub(crate) async fn admit_turn(
    sharing: Sharing<'_>,
    turn_id: &str,
    tenant: &str,
    jobs: &Jobs,
    deadline_ms: u64,
    budget_ms: u64,
) -> Result<(), CallError> {
    if !sharing.config.fair_sharing || (jobs.now.is_empty() && jobs.queued.is_empty()) {
        return Ok(());
    }
    let policy = sharing.config.tenants.get(tenant);
    let now_ms = unix_ms();
    let mut calls: BTreeMap<&str, u64> = BTreeMap::new();
    for (_, job) in jobs.now.iter().chain(&jobs.queued) {
        *calls.entry(job.call.name.as_str()).or_default() += 1;
    }
    for (tool, n) in calls {
        if !sharing.lanes.pressure.contended(tool, now_ms) {
            continue;
        }
        let standing = match sharing.lanes.store.peek(tool, tenant).await {
            Ok(standing) => standing,
            Err(error) => {
                debug!(%tool, %error, "a lane's backlog not read; the turn goes in");
                continue;
            }
        };
        let slots = clock(sharing, tool).slots;
        if let Some(wait) = backlog_wait(standing, n, slots, policy, tool) {
            if standing.waiting > 0 && wait.total_ms > budget_ms as f64 {
                sharing
                    .metrics
                    .tenant_refused(&sharing.config.tenants.label(tenant), "backlog");
                let retry = wait.drained_ms.ceil().max(100.0) as u64;
                return Err(CallError::retryable(
                    turn_codes::OVERLOADED,
                    format!(
                        "this tenant's {} calls waiting for {tool} would hold this turn about {:.0} ms, past its {budget_ms} ms deadline; nothing was stored, retry after {retry} ms",
                        standing.waiting, wait.total_ms
                    ),
                )
                .retry_after(std::time::Duration::from_millis(retry)));
            }
        }
    }
    if let Some(limit) = policy.max_turns_in_flight {
        let taken = sharing
            .lanes
            .store
            .take_turn(tenant, turn_id, deadline_ms, limit, now_ms)
            .await;
        match taken {
            Ok(Ok(())) => {}
            Ok(Err(first_deadline)) => {
                sharing
                    .metrics
                    .tenant_refused(&sharing.config.tenants.label(tenant), "turns_in_flight");
                let retry = first_deadline.saturating_sub(now_ms).clamp(100, 60_000);
                return Err(CallError::retryable(
                    turn_codes::OVERLOADED,
                    format!(
                        "this tenant has {limit} turns in flight, its limit (max_turns_in_flight in the tenants file); nothing was stored, retry after {retry} ms"
                    ),
                )
                .retry_after(std::time::Duration::from_millis(retry)));
            }
            Err(error) => {
                warn!(%turn_id, %error, "a tenant's turns in flight not counted; the turn goes in");
                sharing.metrics.redis_error("tenant_turns");
            }
        }
    }
    Ok(())
}

/// How long a new turn's calls would wait behind its tenant's backlog on one lane.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct BacklogWait {
    /// Until the tenant's calls waiting now have started, ms.
    pub drained_ms: f64,
    /// Until the new turn's calls have started too, ms.
    pub total_ms: f64,
}

/// The wait of `new` calls behind `standing` on a lane of `slots` slots: the tenant's
/// share of the slots is its weight over the weights waiting (at most its cap), and a
/// slot frees every mean slot time. `None` before the lane has a mean.
pub(crate) fn backlog_wait(
    standing: lanes::Standing,
    new: u64,
    slots: usize,
    policy: &TenantPolicy,
    tool: &str,
) -> Option<BacklogWait> {
    if standing.mean_ms <= 0.0 {
        return None;
    }
    let weight = f64::from(policy.weight());
    let weights = (standing.weights as f64).max(weight);
    let mut share = slots as f64 * weight / weights;
    if let Some(cap) = policy.calls_in_flight_on(tool) {
        share = share.min(cap as f64);
    }
    let per_call = standing.mean_ms / share.max(1.0);
    Some(BacklogWait {
        drained_ms: standing.waiting as f64 * per_call,
        total_ms: (standing.waiting + new) as f64 * per_call,
    })
}

/// Every `tool`'s lane's upkeep (lapsed slots, unconfirmed calls handed out again) and
/// the per-tenant gauges, summed over the tools. Returns the jobs handed out that could
/// not be published.
pub(crate) async fn tick(sharing: Sharing<'_>, tools: &[String]) -> Vec<Unpublished> {
    let mut failed = Vec::new();
    if !sharing.config.fair_sharing {
        return failed;
    }
    let mut counts = Vec::new();
    for tool in tools {
        let ticked = match sharing
            .lanes
            .store
            .tick(tool, clock(sharing, tool), RESEND_AFTER_MS)
            .await
        {
            Ok(ticked) => ticked,
            Err(error) => {
                debug!(%tool, %error, "lane upkeep skipped");
                continue;
            }
        };
        let waiting: u64 = ticked.tenants.iter().map(|(_, w, _)| w).sum();
        let in_flight: u64 = ticked.tenants.iter().map(|(_, _, n)| n).sum();
        sharing.lanes.pressure.note(tool, waiting, in_flight);
        let calls = ticked
            .handed_out
            .into_iter()
            .map(|out| (tool.clone(), out))
            .collect();
        failed.extend(publish_handed_out(sharing, calls).await);
        counts.extend(ticked.tenants);
    }
    let mut by_label: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for label in sharing.config.tenants.tenants.keys() {
        by_label.insert(sharing.config.tenants.label(label), (0, 0));
    }
    by_label.insert("_other".to_string(), (0, 0));
    for (tenant, (waiting, in_flight)) in lanes::sum_counts(&counts) {
        let sum = by_label
            .entry(sharing.config.tenants.label(tenant))
            .or_default();
        sum.0 += waiting;
        sum.1 += in_flight;
    }
    for (label, (waiting, in_flight)) in by_label {
        sharing.metrics.tenant_calls(&label, waiting, in_flight);
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lanes::Standing;

    fn standing(waiting: u64, mean_ms: f64, weights: u64) -> Standing {
        Standing {
            waiting,
            in_flight: 8,
            mean_ms,
            weights,
        }
    }

    #[test]
    fn a_backlog_is_measured_in_the_tenants_share() {
        let policy = TenantPolicy::default();
        // Alone on 8 slots of 200 ms: 256 calls take 6.4 s to start.
        let wait = backlog_wait(standing(256, 200.0, 1), 4, 8, &policy, "t");
        assert_eq!(
            wait,
            Some(BacklogWait {
                drained_ms: 6400.0,
                total_ms: 6500.0
            })
        );
        // Beside another tenant of the same weight: half the slots, twice as long.
        let shared = backlog_wait(standing(256, 200.0, 2), 4, 8, &policy, "t");
        assert_eq!(shared.map(|w| w.drained_ms), Some(12_800.0));
        // Capped at 2 calls in flight: a quarter of the slots.
        let capped = TenantPolicy {
            max_calls_in_flight: Some(2),
            ..TenantPolicy::default()
        };
        let wait = backlog_wait(standing(10, 200.0, 1), 0, 8, &capped, "t");
        assert_eq!(wait.map(|w| w.drained_ms), Some(1000.0));
        // No mean yet: no estimate.
        assert_eq!(backlog_wait(standing(10, 0.0, 1), 1, 8, &policy, "t"), None);
    }

    #[test]
    fn a_waiting_call_keeps_its_job_and_trace() {
        let job: JobEnvelope = serde_json::from_value(serde_json::json!({
            "turn_id": "t1", "tenant_id": "acme",
            "call": {"id": "c1", "name": "crm.get", "arguments": {}},
            "deadline_unix_ms": 5, "timeout_ms": 1, "dispatched_unix_ms": 0
        }))
        .unwrap_or_else(|e| panic!("job: {e}"));
        let payload = encode(&job, "trace-id");
        let back: Waiting =
            serde_json::from_str(&payload).unwrap_or_else(|e| panic!("payload: {e}"));
        assert_eq!(back.job.call.id, "c1");
        assert_eq!(back.trace, "trace-id");
    }
}
