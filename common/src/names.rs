//! Every NATS subject, JetStream stream and consumer name, header name and Redis key
//! used by toolfleet. No other module spells one of these strings.
//!
//! All names hang off a configurable prefix (default [`DEFAULT_PREFIX`]), so several
//! fleets can share one NATS account and one Redis database.
//!
//! Never creates, publishes to or reads any of them: it only spells them.

/// Prefix used when none is configured.
pub const DEFAULT_PREFIX: &str = "fleet";

/// Queue group shared by coordinator replicas on the turn subject.
pub const COORDINATOR_QUEUE_GROUP: &str = "toolfleet-coordinators";

/// Header carrying the JetStream de-duplication id.
pub const HEADER_MSG_ID: &str = "Nats-Msg-Id";
/// Header carrying the turn id on jobs, results and progress notices.
pub const HEADER_TURN_ID: &str = "Fleet-Turn-Id";
/// Header carrying the call id on jobs, results and progress notices.
pub const HEADER_CALL_ID: &str = "Fleet-Call-Id";
/// Header carrying the tenant id on jobs.
pub const HEADER_TENANT_ID: &str = "Fleet-Tenant-Id";
/// Header carrying the session id on HTTP tool requests.
pub const HEADER_SESSION_ID: &str = "Fleet-Session-Id";
/// Header carrying the delivery attempt on HTTP tool requests.
pub const HEADER_ATTEMPT: &str = "Fleet-Attempt";
/// Response header an HTTP tool may set: one spoken sentence summarising its result.
pub const HEADER_SUMMARY: &str = "Fleet-Summary";
/// W3C trace context header.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// W3C trace state header.
pub const HEADER_TRACESTATE: &str = "tracestate";
/// W3C `traceparent` of the turn span, on jobs and results: the parent of the spans of
/// the message's consumer, while `traceparent` (the producer's span) becomes a link.
pub const HEADER_TURN_TRACEPARENT: &str = "Fleet-Turn-Traceparent";

/// The name of the explicit parallel meta-tool, flattened into its calls.
pub const PARALLEL_TOOL: &str = "parallel";

/// Names derived from one prefix, and the number of stream partitions their
/// JetStream names are spread over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    prefix: String,
    partitions: u32,
}

impl Default for Names {
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX)
    }
}

impl Names {
    /// Names under `prefix` (a single NATS subject token such as `fleet`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            partitions: 1,
        }
    }

    /// These names with their turns' jobs and results spread over `partitions` pairs
    /// of streams (`TOOLFLEET_STREAM_PARTITIONS`; at least 1).
    pub fn with_partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions.max(1);
        self
    }

    /// How many pairs of jobs and results streams the fleet has.
    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// The stream partition of `turn_id`'s jobs and results.
    pub fn partition_of(&self, turn_id: &str) -> u32 {
        Self::stream_partition(turn_id, self.partitions)
    }

    /// The prefix these names hang off.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    // ----- NATS subjects -------------------------------------------------------------

    /// Frontends without a NATS user publish a `TurnRequest` here, with their inbox as
    /// the reply subject (no caller identity: see [`Names::turn_submit_as`]).
    pub fn turn_submit(&self) -> String {
        format!("{}.turns.submit", self.prefix)
    }

    /// A frontend with NATS user `frontend` publishes its `TurnRequest`s here; NATS lets
    /// only that user publish it, so the last token names the caller.
    pub fn turn_submit_as(&self, frontend: &str) -> String {
        format!("{}.turns.submit.{frontend}", self.prefix)
    }

    /// What coordinators subscribe to for identified turn requests.
    pub fn turn_submit_any(&self) -> String {
        self.turn_submit_as("*")
    }

    /// Frontends without a NATS user attach to a turn here (an [`AttachRequest`], their
    /// inbox as the reply subject).
    ///
    /// [`AttachRequest`]: crate::turn::AttachRequest
    pub fn turn_attach(&self) -> String {
        format!("{}.turns.attach", self.prefix)
    }

    /// A frontend with NATS user `frontend` attaches to its turns here.
    pub fn turn_attach_as(&self, frontend: &str) -> String {
        format!("{}.turns.attach.{frontend}", self.prefix)
    }

    /// What coordinators subscribe to for identified attach requests.
    pub fn turn_attach_any(&self) -> String {
        self.turn_attach_as("*")
    }

    /// Frontends without a NATS user cancel a turn here (a [`CancelRequest`] as a NATS
    /// request).
    ///
    /// [`CancelRequest`]: crate::turn::CancelRequest
    pub fn turn_cancel(&self) -> String {
        format!("{}.turns.cancel", self.prefix)
    }

    /// A frontend with NATS user `frontend` cancels its turns here.
    pub fn turn_cancel_as(&self, frontend: &str) -> String {
        format!("{}.turns.cancel.{frontend}", self.prefix)
    }

    /// What coordinators subscribe to for identified cancel requests.
    pub fn turn_cancel_any(&self) -> String {
        self.turn_cancel_as("*")
    }

    /// Coordinators tell workers here that a turn was cancelled (core NATS, empty body):
    /// its running calls are told to stop and its jobs not yet started are skipped.
    pub fn turn_cancelled(&self, turn_id: &str) -> String {
        concat(&[&self.prefix, ".cancelled.", turn_id])
    }

    /// What workers subscribe to for cancelled turns.
    pub fn turn_cancelled_any(&self) -> String {
        format!("{}.cancelled.*", self.prefix)
    }

    /// The frontend named by an identified submit, attach, cancel or catalog subject;
    /// `None` for the unidentified [`Names::turn_submit`], [`Names::turn_attach`],
    /// [`Names::turn_cancel`] and [`Names::catalog`] (and for anything else).
    pub fn submitting_frontend<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject.strip_prefix(&self.prefix)?;
        let frontend = rest
            .strip_prefix(".turns.submit.")
            .or_else(|| rest.strip_prefix(".turns.attach."))
            .or_else(|| rest.strip_prefix(".turns.cancel."))
            .or_else(|| rest.strip_prefix(".catalog."))?;
        (!frontend.is_empty() && !frontend.contains('.')).then_some(frontend)
    }

    /// Frontends without a NATS user request the tool catalog here (core NATS
    /// request/reply).
    pub fn catalog(&self) -> String {
        format!("{}.catalog", self.prefix)
    }

    /// A frontend with NATS user `frontend` requests the tool catalog here; the answer
    /// goes only to that user's inbox and lists only its tenants' tools.
    pub fn catalog_as(&self, frontend: &str) -> String {
        format!("{}.catalog.{frontend}", self.prefix)
    }

    /// What coordinators subscribe to for identified catalog requests.
    pub fn catalog_any(&self) -> String {
        self.catalog_as("*")
    }

    /// The subject one tool's jobs are published on (stream partition 0).
    pub fn job_subject(&self, tool: &str) -> String {
        self.job_subject_in(0, tool)
    }

    /// The subject one tool's jobs are published on in stream partition `partition`:
    /// `<p>.jobs.<tool>` in partition 0, `<p>.p<k>.jobs.<tool>` in partition k.
    pub fn job_subject_in(&self, partition: u32, tool: &str) -> String {
        self.in_partition(partition, ".jobs.", &[tool])
    }

    /// Wildcard covering every job subject (the jobs stream's subject, partition 0).
    pub fn jobs_wildcard(&self) -> String {
        self.jobs_wildcard_in(0)
    }

    /// Wildcard covering the job subjects of stream partition `partition`.
    pub fn jobs_wildcard_in(&self, partition: u32) -> String {
        self.in_partition(partition, ".jobs.", &[">"])
    }

    /// The stream partition of a job subject, `None` when it is none.
    pub fn job_subject_partition(&self, subject: &str) -> Option<u32> {
        let (partition, rest) = self.split_partition(subject)?;
        rest.strip_prefix(".jobs.")
            .filter(|tool| !tool.is_empty())
            .map(|_| partition)
    }

    /// `<p><kind><parts…>` in partition 0, `<p>.p<k><kind><parts…>` in partition k: each
    /// partition's JetStream subjects have a root of their own, so no partition's stream
    /// overlaps another's and partition 0 keeps the names of an unpartitioned fleet.
    fn in_partition(&self, partition: u32, kind: &str, parts: &[&str]) -> String {
        // One allocation: these are built for every job and every result.
        let parts_len: usize = parts.iter().map(|p| p.len()).sum();
        let mut name = String::with_capacity(self.prefix.len() + 12 + kind.len() + parts_len);
        name.push_str(&self.prefix);
        if partition > 0 {
            use std::fmt::Write as _;
            let _ = write!(name, ".p{partition}");
        }
        name.push_str(kind);
        for part in parts {
            name.push_str(part);
        }
        name
    }

    /// The partition of a partitioned subject and what follows its root (`.jobs.…`,
    /// `.results.…`).
    fn split_partition<'a>(&self, subject: &'a str) -> Option<(u32, &'a str)> {
        let rest = subject.strip_prefix(self.prefix.as_str())?;
        let Some(tail) = rest.strip_prefix(".p") else {
            return Some((0, rest));
        };
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        let partition: u32 = tail[..digits].parse().ok()?;
        // `p0` and leading zeros are not partition roots: one spelling per partition.
        if partition == 0 || tail.starts_with('0') {
            return None;
        }
        Some((partition, &tail[digits..]))
    }

    /// The stream partition of `turn_id`'s jobs and results, of `partitions`: FNV-1a of
    /// the id (as for the deadline buckets), so every coordinator picks the same one.
    pub fn stream_partition(turn_id: &str, partitions: u32) -> u32 {
        Self::deadline_bucket(turn_id, partitions)
    }

    /// A call's `CallResult` without its tool in the subject (JetStream). Still
    /// accepted, but NATS cannot confine it to the workers of the call's tool: workers
    /// publish on [`Names::tool_result_subject`].
    pub fn result_subject(&self, turn_id: &str) -> String {
        concat(&[&self.prefix, ".results.", turn_id])
    }

    /// Workers publish a call of `tool`'s `CallResult` here (JetStream); a worker user's
    /// permissions name `<p>.results.*.<tool>` for each tool it serves.
    pub fn tool_result_subject(&self, turn_id: &str, tool: &str) -> String {
        self.tool_result_subject_in(0, turn_id, tool)
    }

    /// [`Names::tool_result_subject`] in stream partition `partition`: a worker publishes
    /// a job's result in the partition it pulled the job from.
    pub fn tool_result_subject_in(&self, partition: u32, turn_id: &str, tool: &str) -> String {
        self.in_partition(partition, ".results.", &[turn_id, ".", tool])
    }

    /// What the result subjects of `tool` look like in a worker user's permissions.
    pub fn tool_results_wildcard(&self, tool: &str) -> String {
        self.tool_result_subject("*", tool)
    }

    /// The result subjects as a template (`<prefix>.results.{turn_id}`), for span names.
    pub fn results_template(&self) -> String {
        format!("{}.results.{{turn_id}}", self.prefix)
    }

    /// Wildcard covering every result subject (the results stream's subject, partition 0).
    pub fn results_wildcard(&self) -> String {
        self.results_wildcard_in(0)
    }

    /// Wildcard covering the result subjects of stream partition `partition`.
    pub fn results_wildcard_in(&self, partition: u32) -> String {
        self.in_partition(partition, ".results.", &[">"])
    }

    /// Extracts the turn id from a result subject.
    pub fn turn_id_from_result_subject<'a>(&self, subject: &'a str) -> Option<&'a str> {
        self.result_subject_parts(subject).map(|(turn, _)| turn)
    }

    /// The turn id and, on a [`Names::tool_result_subject`], the tool of a result subject
    /// of any stream partition.
    pub fn result_subject_parts<'a>(&self, subject: &'a str) -> Option<(&'a str, Option<&'a str>)> {
        let (_, rest) = self.split_partition(subject)?;
        let rest = rest.strip_prefix(".results.")?;
        Some(match rest.split_once('.') {
            Some((turn, tool)) => (turn, Some(tool)),
            None => (rest, None),
        })
    }

    /// Core NATS `started` notices of one turn's calls of `tool`, published by the
    /// worker running the call; a worker user's permissions name
    /// `<p>.progress.*.<tool>` for each tool it serves ([`Names::tool_progress_wildcard`]).
    pub fn tool_progress_subject(&self, turn_id: &str, tool: &str) -> String {
        concat(&[&self.prefix, ".progress.", turn_id, ".", tool])
    }

    /// What the progress subjects of `tool` look like in a worker user's permissions.
    pub fn tool_progress_wildcard(&self, tool: &str) -> String {
        self.tool_progress_subject("*", tool)
    }

    /// Every progress notice of one turn (any tool).
    pub fn turn_progress_wildcard(&self, turn_id: &str) -> String {
        concat(&[&self.prefix, ".progress.", turn_id, ".>"])
    }

    /// Wildcard covering every progress subject.
    pub fn progress_wildcard(&self) -> String {
        format!("{}.progress.>", self.prefix)
    }

    /// The turn id and tool of a progress subject (`<p>.progress.<turn>.<tool>`).
    pub fn progress_subject_parts<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str)> {
        subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".progress.")?
            .split_once('.')
    }

    /// Core NATS notice from the coordinator that ended a turn to the replica that owns
    /// it (only coordinators may publish here).
    pub fn ended_subject(&self, turn_id: &str) -> String {
        concat(&[&self.prefix, ".ended.", turn_id])
    }

    /// Wildcard covering every ended notice.
    pub fn ended_wildcard(&self) -> String {
        format!("{}.ended.*", self.prefix)
    }

    /// The turn id of an [`Names::ended_subject`].
    pub fn ended_subject_turn<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".ended.")
    }

    /// Workers publish here after (de)registering tools, so coordinators refresh at once.
    pub fn registry_changed(&self) -> String {
        format!("{}.registry.changed", self.prefix)
    }

    /// A worker announces its tool `tool` here after writing its definition and at every
    /// heartbeat. NATS lets a worker user publish only its own tools' subjects, so a
    /// coordinator adds to [`Names::tool_names_key`] only names announced here whose
    /// definition key holds a definition.
    pub fn registry_changed_for(&self, tool: &str) -> String {
        format!("{}.registry.changed.{tool}", self.prefix)
    }

    /// What coordinators subscribe to for tool announcements.
    pub fn registry_changed_any(&self) -> String {
        self.registry_changed_for(">")
    }

    /// The tool of a [`Names::registry_changed_for`] subject.
    pub fn registry_changed_tool<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".registry.changed.")
            .filter(|tool| !tool.is_empty())
    }

    // ----- JetStream -----------------------------------------------------------------

    /// The work-queue stream holding every job (of stream partition 0).
    pub fn jobs_stream(&self) -> String {
        self.jobs_stream_in(0)
    }

    /// The jobs stream of stream partition `partition`: `<P>_JOBS`, `<P>_JOBS_P<k>`.
    pub fn jobs_stream_in(&self, partition: u32) -> String {
        self.stream_in(partition, "_JOBS")
    }

    /// The work-queue stream holding results until a coordinator records them (of
    /// stream partition 0).
    pub fn results_stream(&self) -> String {
        self.results_stream_in(0)
    }

    /// The results stream of stream partition `partition`: `<P>_RESULTS`,
    /// `<P>_RESULTS_P<k>`.
    pub fn results_stream_in(&self, partition: u32) -> String {
        self.stream_in(partition, "_RESULTS")
    }

    /// Every stream of every partition: the jobs and the results stream of each.
    pub fn all_streams(&self) -> Vec<String> {
        (0..self.partitions())
            .flat_map(|k| [self.jobs_stream_in(k), self.results_stream_in(k)])
            .collect()
    }

    fn stream_in(&self, partition: u32, kind: &str) -> String {
        let mut name = self.prefix.to_uppercase();
        name.push_str(kind);
        if partition > 0 {
            name.push_str("_P");
            name.push_str(&partition.to_string());
        }
        name
    }

    /// The durable pull consumer shared by every coordinator replica on the results stream.
    pub fn results_consumer(&self) -> String {
        "coordinators".to_string()
    }

    /// The durable pull consumer shared by every worker replica serving `tool`.
    ///
    /// Consumer names may not contain `.`, `*`, `>` or whitespace, so those become `_`.
    ///
    /// Two tool names can map to one consumer name (`a.b` and `a_b`); workers refuse
    /// to serve a tool whose consumer filters another tool's subject.
    pub fn tool_consumer(&self, tool: &str) -> String {
        let safe: String = tool
            .chars()
            .map(|c| match c {
                '.' | '*' | '>' => '_',
                c if c.is_whitespace() => '_',
                c => c,
            })
            .collect();
        concat(&["tool_", &safe])
    }

    // ----- Redis ---------------------------------------------------------------------

    /// `<p>:turn:{<turn_id>}<suffix>`: one of a turn's keys, all in the turn id's slot.
    fn turn_key(&self, turn_id: &str, suffix: &str) -> String {
        concat(&[&self.prefix, ":turn:{", turn_id, "}", suffix])
    }

    /// Hash of a turn's metadata. Shares the `{turn_id}` hash tag with the turn's other keys.
    pub fn turn_meta_key(&self, turn_id: &str) -> String {
        self.turn_key(turn_id, ":meta")
    }

    /// Hash of a turn's results, field = call key, value = `CallResult` JSON.
    pub fn turn_results_key(&self, turn_id: &str) -> String {
        self.turn_key(turn_id, ":results")
    }

    /// Hash of a turn's calls, field = call key, value = call index and name.
    pub fn turn_calls_key(&self, turn_id: &str) -> String {
        self.turn_key(turn_id, ":calls")
    }

    /// List of the events a turn's frontend was sent, in order: an event's `seq` is its
    /// position (1-based). Attaching replays it.
    pub fn turn_events_key(&self, turn_id: &str) -> String {
        self.turn_key(turn_id, ":events")
    }

    /// List of the keys of a paced turn's calls held back by its concurrency bound, in
    /// the model's order; a recorded result pops the next one.
    pub fn turn_queue_key(&self, turn_id: &str) -> String {
        self.turn_key(turn_id, ":queue")
    }

    /// Hash of a paced turn's held-back jobs, field = call key, value = `JobEnvelope`
    /// JSON.
    pub fn turn_jobs_key(&self, turn_id: &str) -> String {
        self.turn_key(turn_id, ":jobs")
    }

    /// Set of the keys of a paced turn's released calls whose job publish is not yet
    /// confirmed.
    pub fn turn_dispatching_key(&self, turn_id: &str) -> String {
        self.turn_key(turn_id, ":dispatching")
    }

    /// One bucket of the deadline index: a sorted set of open turns scored by deadline
    /// (Unix ms); every replica sweeps every bucket. Each bucket has its own hash tag, so
    /// on Redis Cluster the buckets spread over the masters and no slot sees every turn.
    /// A turn goes to bucket [`deadline_bucket`](Self::deadline_bucket).
    pub fn deadline_bucket_key(&self, bucket: u32) -> String {
        format!("{}:deadlines:{{deadlines:{bucket}}}", self.prefix)
    }

    /// One bucket of the index of ended turns whose `final` was sent: a sorted set
    /// scored by when it was sent (Unix ms), in the deadline index's buckets. When Redis
    /// nears its `maxmemory`, coordinators delete the oldest of these turns first
    /// (retention cut short); open turns are never in it.
    pub fn ended_bucket_key(&self, bucket: u32) -> String {
        format!("{}:ended:{{ended:{bucket}}}", self.prefix)
    }

    /// The deadline index of releases before it was split into buckets; swept until it
    /// is empty, its entries moved to their buckets.
    pub fn legacy_deadlines_key(&self) -> String {
        format!("{}:deadlines", self.prefix)
    }

    /// The bucket of the deadline index `turn_id` goes to, of `buckets`: FNV-1a of the
    /// id, so every process finds the same one.
    pub fn deadline_bucket(turn_id: &str, buckets: u32) -> u32 {
        let mut hash: u32 = 0x811c_9dc5;
        for byte in turn_id.bytes() {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(0x0100_0193);
        }
        hash % buckets.max(1)
    }

    /// Set of the names of every tool announced: written by coordinators only, from the
    /// announcements of [`Names::registry_changed_for`] whose definition they found. A
    /// name counts only while [`Names::tool_definition_key`] holds its definition.
    /// Registry keys share the `{registry}` hash tag.
    pub fn tool_names_key(&self) -> String {
        format!("{}:{{registry}}:names", self.prefix)
    }

    /// Hash of one tool's definition: field `definition` (`ToolDefinition` JSON) and
    /// field `by` (who wrote it). One key per tool, so a Redis ACL can let only the
    /// identity that serves a tool write its definition.
    pub fn tool_definition_key(&self, tool: &str) -> String {
        format!("{}:{{registry}}:tool:{tool}", self.prefix)
    }

    /// Hash of definitions coordinators refused, field = tool name, value =
    /// [`Rejection`](crate::tool::Rejection) JSON; written by coordinators, read by the
    /// tool's workers so the refusal is seen where it was caused.
    pub fn rejected_definitions_key(&self) -> String {
        format!("{}:{{registry}}:rejected:definitions", self.prefix)
    }

    /// Hash of the last result coordinators refused per tool, field = tool name, value =
    /// [`Rejection`](crate::tool::Rejection) JSON naming the turn and call.
    pub fn rejected_results_key(&self) -> String {
        format!("{}:{{registry}}:rejected:results", self.prefix)
    }

    /// Sorted set of live workers for one tool, member = worker id, score = expiry (unix ms).
    pub fn tool_workers_key(&self, tool: &str) -> String {
        format!("{}:{{registry}}:workers:{tool}", self.prefix)
    }

    /// The keys of one tool's lane, the fair queue between tenants in front of its
    /// stream, in this order: `slots` (sorted set: calls published and not yet answered,
    /// score = when the slot lapses, Unix ms), `held` (hash: call → tenant and publish
    /// time), `state` (hash: virtual time, mean slot time, per-tenant counters), `queue`
    /// (hash: the calls waiting, per tenant in arrival order), `ready` (sorted set:
    /// tenants with calls waiting, score = their first call's finish tag), `sending`
    /// (hash: calls handed out and not yet confirmed published). All share the
    /// `{lane:<tool>}` hash tag.
    pub fn lane_keys(&self, tool: &str) -> [String; 6] {
        ["slots", "held", "state", "queue", "ready", "sending"]
            .map(|part| concat(&[&self.prefix, ":lane:{lane:", tool, "}:", part]))
    }

    /// Sorted set of one tenant's turns in flight with a limit on them, member = turn
    /// id, score = its deadline (Unix ms); in the tenant's own `{tenant:<tenant>}` slot.
    pub fn tenant_turns_key(&self, tenant: &str) -> String {
        concat(&[&self.prefix, ":tenant:{tenant:", tenant, "}:turns"])
    }

    /// A cached tool result: `digest` identifies the arguments (and the context the tool
    /// reads). Keys of one tenant share the `{tenant}` hash tag.
    pub fn tool_cache_key(&self, tenant: &str, tool: &str, digest: &str) -> String {
        concat(&[&self.prefix, ":cache:{", tenant, "}:", tool, ":", digest])
    }
}

/// Span names.
pub mod spans {
    /// The whole turn, from request to `final`.
    pub const TURN: &str = "turn";
    /// Joining results and finalizing.
    pub const JOIN: &str = "join";
    /// Narrating the answer.
    pub const NARRATE: &str = "narrate";
    /// A job publish (PRODUCER span; its name is `publish <subject>`).
    pub const PUBLISH: &str = "publish";
    /// A worker processing one job (CONSUMER span; `process <subject>`).
    pub const PROCESS: &str = "process";
    /// A tool executing one call (`execute_tool <tool>`), after the GenAI conventions.
    pub const EXECUTE_TOOL: &str = "execute_tool";
    /// Accepting a turn: decoding, validating, storing, dispatching.
    pub const INTAKE: &str = "intake";
    /// A call refused before dispatch (`refuse_tool <tool>` for a tool in the registry,
    /// `refuse_tool _unknown` otherwise: span names stay a bounded set).
    pub const REFUSE_TOOL: &str = "refuse_tool";
    /// A worker publishing a call's result (PRODUCER span; `publish <subject>`).
    pub const PUBLISH_RESULT: &str = "publish";
}

/// `parts` joined into one allocation, cheaper than `format!` for the names built for
/// every turn and call.
pub fn concat(parts: &[&str]) -> String {
    let mut name = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for part in parts {
        name.push_str(part);
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_partitions_have_roots_of_their_own() {
        let n = Names::new("fleet");
        assert_eq!(n.job_subject_in(0, "crm.get"), "fleet.jobs.crm.get");
        assert_eq!(n.job_subject_in(3, "crm.get"), "fleet.p3.jobs.crm.get");
        assert_eq!(n.jobs_wildcard_in(0), "fleet.jobs.>");
        assert_eq!(n.jobs_wildcard_in(12), "fleet.p12.jobs.>");
        assert_eq!(n.results_wildcard_in(2), "fleet.p2.results.>");
        assert_eq!(
            n.tool_result_subject_in(2, "t1", "crm.get"),
            "fleet.p2.results.t1.crm.get"
        );
        assert_eq!(n.jobs_stream_in(0), "FLEET_JOBS");
        assert_eq!(n.jobs_stream_in(5), "FLEET_JOBS_P5");
        assert_eq!(n.results_stream_in(5), "FLEET_RESULTS_P5");
        assert_eq!(
            Names::new("fleet").with_partitions(2).all_streams(),
            [
                "FLEET_JOBS",
                "FLEET_RESULTS",
                "FLEET_JOBS_P1",
                "FLEET_RESULTS_P1"
            ]
        );
        for k in [0, 1, 7, 15] {
            assert_eq!(
                n.job_subject_partition(&n.job_subject_in(k, "a.b")),
                Some(k)
            );
            assert_eq!(
                n.result_subject_parts(&n.tool_result_subject_in(k, "t9", "a.b")),
                Some(("t9", Some("a.b")))
            );
        }
        for not_a_job in [
            "fleet.p0.jobs.a",
            "fleet.p01.jobs.a",
            "fleet.px.jobs.a",
            "fleet.jobs.",
            "other.jobs.a",
            "fleet.p3.results.t.a",
        ] {
            assert_eq!(n.job_subject_partition(not_a_job), None, "{not_a_job}");
        }
        // Every turn has one partition, and the turns spread over all of them.
        let mut seen = [0u32; 4];
        for i in 0..400 {
            let k = Names::stream_partition(&format!("turn-{i}"), 4);
            assert_eq!(k, Names::stream_partition(&format!("turn-{i}"), 4));
            seen[k as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
        assert_eq!(Names::stream_partition("anything", 1), 0);
    }

    #[test]
    fn per_turn_names_read_as_the_protocol_gives_them() {
        let n = Names::new("fleet");
        for (name, expected) in [
            (n.turn_meta_key("t1"), "fleet:turn:{t1}:meta"),
            (n.turn_results_key("t1"), "fleet:turn:{t1}:results"),
            (n.turn_calls_key("t1"), "fleet:turn:{t1}:calls"),
            (n.turn_events_key("t1"), "fleet:turn:{t1}:events"),
            (n.turn_queue_key("t1"), "fleet:turn:{t1}:queue"),
            (n.turn_jobs_key("t1"), "fleet:turn:{t1}:jobs"),
            (n.turn_dispatching_key("t1"), "fleet:turn:{t1}:dispatching"),
            (
                n.tool_cache_key("acme", "crm.x", "d1"),
                "fleet:cache:{acme}:crm.x:d1",
            ),
            (n.job_subject("crm.x"), "fleet.jobs.crm.x"),
            (n.result_subject("t1"), "fleet.results.t1"),
            (
                n.tool_result_subject("t1", "crm.x"),
                "fleet.results.t1.crm.x",
            ),
            (
                n.tool_progress_subject("t1", "crm.x"),
                "fleet.progress.t1.crm.x",
            ),
            (n.ended_subject("t1"), "fleet.ended.t1"),
            (n.turn_cancelled("t1"), "fleet.cancelled.t1"),
        ] {
            assert_eq!(name, expected);
        }
    }

    #[test]
    fn keys_share_the_turn_hash_tag() {
        let n = Names::default();
        for key in [
            n.turn_meta_key("t1"),
            n.turn_results_key("t1"),
            n.turn_calls_key("t1"),
            n.turn_events_key("t1"),
        ] {
            assert!(key.contains("{t1}"), "{key}");
        }
    }

    #[test]
    fn deadline_buckets_are_stable_and_spread() {
        let n = Names::default();
        assert_eq!(
            Names::deadline_bucket("turn-1", 16),
            Names::deadline_bucket("turn-1", 16)
        );
        let mut seen = std::collections::HashSet::new();
        for i in 0..1000 {
            let bucket = Names::deadline_bucket(&format!("turn-{i}"), 16);
            assert!(bucket < 16);
            seen.insert(bucket);
        }
        assert_eq!(seen.len(), 16, "1000 ids reach every bucket");
        assert_eq!(Names::deadline_bucket("x", 0), 0);
        let tags: std::collections::HashSet<String> =
            (0..16).map(|b| n.deadline_bucket_key(b)).collect();
        assert_eq!(tags.len(), 16);
        assert!(n.deadline_bucket_key(3).ends_with("{deadlines:3}"));
    }

    #[test]
    fn consumer_names_are_legal() {
        let n = Names::default();
        assert_eq!(
            n.tool_consumer("crm.getOpenInvoices"),
            "tool_crm_getOpenInvoices"
        );
        assert_eq!(
            n.turn_id_from_result_subject("fleet.results.abc"),
            Some("abc")
        );
        assert_eq!(n.turn_id_from_result_subject("other.results.abc"), None);
        assert_eq!(
            n.result_subject_parts(&n.tool_result_subject("abc", "crm.getOpenInvoices")),
            Some(("abc", Some("crm.getOpenInvoices")))
        );
    }
}
