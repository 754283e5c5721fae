//! The receptionist pack: read-only tools over a business's bookings, services, hours,
//! policies and FAQs in PostgreSQL, for a voice receptionist.
//!
//! Owns these tools and the one SQL topic match ([`topic_match`]) that `toolfleet admin`
//! reuses. It must never write, never read another business's rows and never return a
//! field a caller may not hear (below).
//!
//! Tenant scoping: the business is always the turn's tenant (`ToolContext::tenant_id`,
//! a `businesses.id` UUID). A `business_id` argument is accepted only when it names that
//! same business (`tenant_mismatch` otherwise); every query runs through
//! [`Db::query_scoped`], whose row-level security hides other businesses' rows even from
//! a query that forgot its `business_id` filter. Results carry only what a caller may
//! hear (never `internal_notes`, e-mail addresses or call records); each tool's output
//! schema lists those fields with `additionalProperties: false`, and the runner checks
//! every result against it.
//!
//! The caller's phone for `get_latest_booking` comes from the turn's context
//! (`customer_phone` or `caller_phone`); a phone argument must match it. Only when the
//! context has none (a chat frontend) is the argument used.

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, PrimitiveDateTime};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;
use toolfleet_common::call::codes;
use toolfleet_common::turn::normalize_tenant;
use toolfleet_worker::cache::ResultCache;
use toolfleet_worker::tool::{Tool, ToolBuilder, ToolContext, ToolError, ToolOutput};
use uuid::Uuid;

use crate::crm::{join_and, spoken_date, spoken_time};
use crate::db::{cached, Db, DATABASE_ERROR};

/// The turn's tenant is not a known business.
pub const UNKNOWN_BUSINESS: &str = "unknown_business";
/// No booking with that id at this business.
pub const BOOKING_NOT_FOUND: &str = "booking_not_found";
/// The booking id is not a UUID.
pub const INVALID_BOOKING_ID: &str = "invalid_booking_id";
/// A policy or FAQ lookup without a usable topic.
pub const MISSING_TOPIC: &str = "missing_topic";
/// A booking lookup without the caller's phone.
pub const MISSING_CUSTOMER_PHONE: &str = "missing_customer_phone";
/// A booking lookup for a phone other than the caller's.
pub const CUSTOMER_PHONE_MISMATCH: &str = "customer_phone_mismatch";

/// What the caller hears when every call failed with [`BOOKING_NOT_FOUND`] or
/// [`INVALID_BOOKING_ID`]: the same for a booking of another business, so it tells
/// nothing about other businesses.
pub const BOOKING_NOT_FOUND_SENTENCE: &str = "I couldn't find a booking with that reference.";
/// What the caller hears when every call failed with [`MISSING_CUSTOMER_PHONE`].
pub const MISSING_CUSTOMER_PHONE_SENTENCE: &str =
    "I'll need the phone number the booking was made under to look it up.";
/// What the caller hears when every call failed with [`CUSTOMER_PHONE_MISMATCH`].
pub const CUSTOMER_PHONE_MISMATCH_SENTENCE: &str =
    "I can only look up bookings for the phone number you're calling from.";

/// Context entries that carry the caller's phone, in order of preference.
pub const PHONE_CONTEXT_KEYS: &[&str] = &["customer_phone", "caller_phone"];

/// Per-call timeout of every receptionist tool.
pub const TOOL_TIMEOUT: Duration = Duration::from_millis(400);

/// Deliveries of a call that failed with a retryable error (the database was down).
const MAX_ATTEMPTS: u32 = 2;

/// Arguments that may name the business a call is about.
trait NamesBusiness {
    /// The `business_id` argument, if any.
    fn named_business(&self) -> Option<&str>;
}

/// Declares the arguments of a receptionist tool: every one takes an optional
/// `business_id`, which [`business_of`] holds to the turn's tenant, then `fields`.
macro_rules! business_args {
    ($(#[$meta:meta])* $name:ident { $($fields:tt)* }) => {
        $(#[$meta])*
        #[derive(Debug, Deserialize, schemars::JsonSchema)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            /// Optional; if given it must be the current business (the turn's tenant).
            #[serde(default)]
            pub business_id: Option<String>,
            $($fields)*
        }

        impl NamesBusiness for $name {
            fn named_business(&self) -> Option<&str> {
                self.business_id.as_deref()
            }
        }
    };
}

business_args! {
    /// Arguments of `get_latest_booking`.
    LatestBookingArgs {
        /// The caller's phone number. The phone of the call is used when the session knows
        /// it; this must then be the same number.
        #[serde(default)]
        pub customer_phone: Option<String>,
    }
}

business_args! {
    /// Arguments of `get_booking_by_id`.
    BookingByIdArgs {
        /// The booking's id (a UUID).
        pub booking_id: String,
    }
}

business_args! {
    /// Arguments of `get_business_services` and `get_working_hours`.
    BusinessArgs {}
}

business_args! {
    /// Arguments of `get_policies` and `get_faqs`.
    TopicArgs {
        /// What the caller asks about, e.g. cancellation, reschedule, late arrival, deposits,
        /// refunds, pricing, hours, location, parking.
        pub topic: String,
    }
}

fn fatal(code: &str, message: impl Into<String>) -> ToolError {
    ToolError::fatal(code, message)
}

/// The business of the turn; refuses a `business_id` argument naming another one.
pub(crate) fn business_of(ctx: &ToolContext, named: Option<&str>) -> Result<Uuid, ToolError> {
    let tenant = normalize_tenant(&ctx.tenant_id);
    if let Some(named) = named.map(normalize_tenant).filter(|n| !n.is_empty()) {
        if named != tenant {
            return Err(fatal(
                codes::TENANT_MISMATCH,
                "business_id names another business; tools only read the current business",
            ));
        }
    }
    Uuid::parse_str(&tenant).map_err(|_| {
        fatal(
            UNKNOWN_BUSINESS,
            format!("tenant {:?} is not a business id", ctx.tenant_id),
        )
    })
}

/// Digits of a phone number (`+61 400-111-222` → `61400111222`).
pub fn phone_digits(phone: &str) -> String {
    phone.chars().filter(char::is_ascii_digit).collect()
}

/// The digits of the phone the call comes from, when the session knows it.
fn phone_of_call(ctx: &ToolContext) -> Option<String> {
    PHONE_CONTEXT_KEYS
        .iter()
        .filter_map(|k| ctx.context.get(*k).and_then(Value::as_str))
        .map(phone_digits)
        .find(|d| !d.is_empty())
}

/// The phone to look bookings up by: the call's, or the argument when the call has none.
fn caller_phone(ctx: &ToolContext, argument: Option<&str>) -> Result<String, ToolError> {
    let from_call = phone_of_call(ctx);
    let from_model = argument.map(phone_digits).filter(|d| !d.is_empty());
    match (from_call, from_model) {
        (Some(call), Some(model)) if call != model => Err(fatal(
            CUSTOMER_PHONE_MISMATCH,
            "bookings can only be looked up for the phone number of this call",
        )
        .with_user_message(CUSTOMER_PHONE_MISMATCH_SENTENCE)),
        (Some(call), _) => Ok(call),
        (None, Some(model)) => Ok(model),
        (None, None) => Err(fatal(
            MISSING_CUSTOMER_PHONE,
            "the caller's phone number is unknown; ask for it and pass customer_phone",
        )
        .with_user_message(MISSING_CUSTOMER_PHONE_SENTENCE)),
    }
}

/// A topic as compared with stored topics and tags: lower case, words separated by
/// single spaces (`Late-Arrival` → `late arrival`).
pub fn normalize_topic(topic: &str) -> String {
    topic
        .to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    name: &str,
) -> Result<T, ToolError> {
    row.try_get(name)
        .map_err(|e| fatal(DATABASE_ERROR, format!("column {name}: {e}")))
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

/// The bookings columns a caller may hear, and the booking's local time.
const BOOKING_COLUMNS: &str = "k.id AS booking_id, k.customer_name, k.service, k.booking_datetime,
       (k.booking_datetime AT TIME ZONE COALESCE(b.ai_config->>'timezone', 'UTC')) AS local_datetime,
       k.duration_minutes, k.status, k.price::float8 AS price, k.customer_notes,
       k.booking_datetime >= now() AS upcoming";

/// A booking as handed to the model, and the facts its summary needs.
struct Booking {
    value: Value,
    service: String,
    status: String,
    local: PrimitiveDateTime,
    upcoming: bool,
}

fn booking_from(row: &Row) -> Result<Option<Booking>, ToolError> {
    let Some(id) = column::<Option<Uuid>>(row, "booking_id")? else {
        return Ok(None);
    };
    let service: String = column(row, "service")?;
    let status: String = column(row, "status")?;
    let at: OffsetDateTime = column(row, "booking_datetime")?;
    let local: PrimitiveDateTime = column(row, "local_datetime")?;
    let upcoming: bool = column(row, "upcoming")?;
    let value = json!({
        "booking_id": id.to_string(),
        "status": status,
        "service": service,
        "booking_datetime": rfc3339(at),
        "local_datetime": format!("{}T{:02}:{:02}:00", local.date(), local.hour(), local.minute()),
        "duration_minutes": column::<Option<i32>>(row, "duration_minutes")?,
        "customer_name": column::<String>(row, "customer_name")?,
        "price": column::<Option<f64>>(row, "price")?,
        "customer_notes": column::<Option<String>>(row, "customer_notes")?,
    });
    Ok(Some(Booking {
        value,
        service,
        status,
        local,
        upcoming,
    }))
}

fn booking_sentence(b: &Booking) -> String {
    let when = format!(
        "{} at {}",
        spoken_date(b.local.date()),
        spoken_time(b.local.time())
    );
    match (b.status.as_str(), b.upcoming) {
        ("cancelled", _) => format!("Your {} on {when} was cancelled.", b.service),
        ("confirmed", true) => format!("Your {} is confirmed for {when}.", b.service),
        (_, true) => format!(
            "Your {} is booked for {when} and is waiting for confirmation.",
            b.service
        ),
        (_, false) => format!(
            "Your most recent booking was a {} on {when}; I don't see an upcoming one.",
            b.service
        ),
    }
}

/// Schema of an object with exactly `properties`, of which `required` must be present.
fn closed_object(required: &[&str], properties: Value) -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": required,
        "properties": properties,
    })
}

/// Schema of a booking in results.
fn booking_schema() -> Value {
    closed_object(
        &[
            "booking_id",
            "status",
            "service",
            "booking_datetime",
            "local_datetime",
            "customer_name",
        ],
        json!({
            "booking_id": {"type": "string"},
            "status": {"type": "string"},
            "service": {"type": "string"},
            "booking_datetime": {"type": "string", "description": "RFC 3339, UTC"},
            "local_datetime": {"type": "string", "description": "the business's local time"},
            "duration_minutes": {"type": ["integer", "null"]},
            "customer_name": {"type": "string"},
            "price": {"type": ["number", "null"]},
            "customer_notes": {"type": ["string", "null"]}
        }),
    )
}

async fn latest_booking(call: Call, args: LatestBookingArgs) -> Result<ToolOutput, ToolError> {
    let phone = caller_phone(&call.ctx, args.customer_phone.as_deref())?;
    let sql = format!(
        "SELECT {BOOKING_COLUMNS}
         FROM businesses b
         LEFT JOIN LATERAL (
             SELECT id, customer_name, service, booking_datetime, duration_minutes, status,
                    price, customer_notes
             FROM bookings
             WHERE business_id = b.id
               AND regexp_replace(customer_phone, '[^0-9]', '', 'g') = $2
             ORDER BY (booking_datetime >= now()) DESC,
                      CASE WHEN booking_datetime >= now() THEN booking_datetime END ASC,
                      booking_datetime DESC
             LIMIT 1
         ) k ON true
         WHERE b.id = $1"
    );
    let row = call.row(&sql, &[&phone]).await?;
    Ok(match booking_from(&row)? {
        Some(booking) => {
            let summary = booking_sentence(&booking);
            ToolOutput::new(json!({"booking": booking.value})).with_summary(summary)
        }
        None => ToolOutput::new(json!({"booking": null}))
            .with_summary("I couldn't find a booking under this phone number."),
    })
}

async fn booking_by_id(call: Call, args: BookingByIdArgs) -> Result<ToolOutput, ToolError> {
    let id = Uuid::parse_str(args.booking_id.trim()).map_err(|_| {
        fatal(
            INVALID_BOOKING_ID,
            format!("{:?} is not a booking id", args.booking_id),
        )
        .with_user_message(BOOKING_NOT_FOUND_SENTENCE)
    })?;
    // A caller whose phone the session knows hears only their own bookings; another
    // customer's booking reads as not found, so its existence is not revealed.
    let phone = phone_of_call(&call.ctx);
    let sql = format!(
        "SELECT {BOOKING_COLUMNS}
         FROM businesses b
         LEFT JOIN bookings k ON k.business_id = b.id AND k.id = $2
              AND ($3::text IS NULL OR regexp_replace(k.customer_phone, '[^0-9]', '', 'g') = $3)
         WHERE b.id = $1"
    );
    let row = call.row(&sql, &[&id, &phone]).await?;
    let booking = booking_from(&row)?.ok_or_else(|| {
        fatal(
            BOOKING_NOT_FOUND,
            format!("no booking {id} at this business"),
        )
        .with_user_message(BOOKING_NOT_FOUND_SENTENCE)
    })?;
    let summary = booking_sentence(&booking);
    Ok(ToolOutput::new(json!({"booking": booking.value})).with_summary(summary))
}

/// No user message: the tenant not being a business is the deployment's fault, and the
/// caller can do nothing about it, so the narrator's fallback line is the right answer.
fn unknown_business() -> ToolError {
    fatal(UNKNOWN_BUSINESS, "no business with the turn's tenant id")
}

/// What a receptionist handler works with: the pool, the call's context and the turn's
/// business, already held to any `business_id` argument ([`business_of`]).
struct Call {
    db: Db,
    ctx: ToolContext,
    business: Uuid,
}

impl Call {
    /// The rows of `sql` for the business (`$1`; `more` are `$2`, ...). Every
    /// receptionist query starts from the `businesses` row, so no rows at all means the
    /// tenant is not a business.
    async fn rows(&self, sql: &str, more: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, ToolError> {
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(1 + more.len());
        params.push(&self.business);
        params.extend_from_slice(more);
        let rows = self.db.query_scoped(self.business, sql, &params).await?;
        if rows.is_empty() {
            return Err(unknown_business());
        }
        Ok(rows)
    }

    /// The first row of [`Call::rows`].
    async fn row(&self, sql: &str, more: &[&(dyn ToSql + Sync)]) -> Result<Row, ToolError> {
        let rows = self.rows(sql, more).await?;
        rows.into_iter().next().ok_or_else(unknown_business)
    }
}

/// `builder` finished with `handler`, which runs once the turn's business is known.
fn tool<A, F, Fut>(db: &Db, builder: ToolBuilder, handler: F) -> Tool
where
    A: NamesBusiness + DeserializeOwned + schemars::JsonSchema + Send + 'static,
    F: Fn(Call, A) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<ToolOutput, ToolError>> + Send + 'static,
{
    db.tool(builder, move |db, ctx, args: A| {
        let call = business_of(&ctx, args.named_business())
            .map(|business| handler(Call { db, ctx, business }, args));
        async move { call?.await }
    })
}

fn money(amount: f64) -> String {
    if amount.fract() == 0.0 {
        format!("${amount:.0}")
    } else {
        format!("${amount:.2}")
    }
}

fn describe_service(service: &Value) -> Option<String> {
    if let Some(name) = service.as_str() {
        return Some(name.to_string());
    }
    let name = service.get("name")?.as_str()?;
    let mut details = Vec::new();
    if let Some(minutes) = service.get("duration_minutes").and_then(Value::as_u64) {
        details.push(format!("{minutes} minutes"));
    }
    if let Some(price) = service.get("price").and_then(Value::as_f64) {
        details.push(money(price));
    }
    Some(if details.is_empty() {
        name.to_string()
    } else {
        format!("{name} ({})", details.join(", "))
    })
}

async fn business_services(call: Call, _args: BusinessArgs) -> Result<ToolOutput, ToolError> {
    let sql = "SELECT name, services FROM businesses WHERE id = $1";
    let row = call.row(sql, &[]).await?;
    let name: String = column(&row, "name")?;
    let services: Value = column(&row, "services")?;
    let services = match services {
        Value::Array(items) => items,
        Value::Null => Vec::new(),
        other => vec![other],
    };
    let spoken: Vec<String> = services.iter().filter_map(describe_service).collect();
    let summary = if spoken.is_empty() {
        format!("I don't have a list of services for {name} on file.")
    } else {
        format!("{name} offers {}.", join_and(&spoken))
    };
    Ok(ToolOutput::new(json!({"business_name": name, "services": services})).with_summary(summary))
}

const WEEK: [&str; 7] = [
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
];

fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

fn spoken_clock(hhmm: &str) -> Option<String> {
    let (h, m) = hhmm.split_once(':')?;
    let time = time::Time::from_hms(h.trim().parse().ok()?, m.trim().parse().ok()?, 0).ok()?;
    Some(spoken_time(time))
}

/// "Monday to Wednesday 8:00 AM to 5:00 PM, Thursday 8:00 AM to 7:00 PM and closed on
/// Sunday", from `{"monday": {"open": "08:00", "close": "17:00"}, "sunday": null, ...}`.
pub fn spoken_hours(hours: &Value) -> Option<String> {
    let day_text = |day: &str| -> Option<Option<String>> {
        match hours.get(day) {
            None | Some(Value::Null) => Some(None),
            Some(Value::String(s)) if s.eq_ignore_ascii_case("closed") => Some(None),
            Some(v) => {
                let open = spoken_clock(v.get("open")?.as_str()?)?;
                let close = spoken_clock(v.get("close")?.as_str()?)?;
                Some(Some(format!("{open} to {close}")))
            }
        }
    };
    let days: Vec<Option<String>> = WEEK.iter().map(|d| day_text(d)).collect::<Option<_>>()?;
    if days.iter().all(Option::is_none) {
        return None;
    }
    let mut groups: Vec<(usize, usize, Option<String>)> = Vec::new();
    for (i, text) in days.into_iter().enumerate() {
        match groups.last_mut() {
            Some((_, end, last)) if *last == text => *end = i,
            _ => groups.push((i, i, text)),
        }
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|(start, end, text)| {
            let span = if start == end {
                capitalize(WEEK[start])
            } else {
                format!("{} to {}", capitalize(WEEK[start]), capitalize(WEEK[end]))
            };
            match text {
                Some(hours) => format!("{span} {hours}"),
                None => format!("closed on {span}"),
            }
        })
        .collect();
    Some(join_and(&parts))
}

async fn working_hours(call: Call, _args: BusinessArgs) -> Result<ToolOutput, ToolError> {
    let sql = "SELECT name, working_hours, COALESCE(ai_config->>'timezone', 'UTC') AS timezone
               FROM businesses WHERE id = $1";
    let row = call.row(sql, &[]).await?;
    let name: String = column(&row, "name")?;
    let hours: Value = column(&row, "working_hours")?;
    let timezone: String = column(&row, "timezone")?;
    let summary = match spoken_hours(&hours) {
        Some(text) => format!("We're open {text}."),
        None => format!("I don't have opening hours for {name} on file."),
    };
    Ok(ToolOutput::new(json!({
        "business_name": name,
        "timezone": timezone,
        "working_hours": hours,
    }))
    .with_summary(summary))
}

fn topic_of(args: &TopicArgs) -> Result<String, ToolError> {
    let topic = normalize_topic(&args.topic);
    if topic.is_empty() {
        return Err(fatal(
            MISSING_TOPIC,
            "a topic is required, e.g. cancellation, reschedule, late arrival, deposits, refunds, pricing, hours, location or parking",
        ));
    }
    Ok(topic)
}

/// SQL: whether the stored text `col` and the normalized topic `$2` ([`normalize_topic`])
/// match: either contains the other, compared as normalized words. The one definition
/// of a topic match: `get_policies`, `get_faqs` and `toolfleet admin ... list --topic`
/// all use it. An empty `$2` matches every non-NULL text.
pub fn topic_match(col: &str) -> String {
    let norm = format!("btrim(regexp_replace(lower({col}), '[^[:alnum:]]+', ' ', 'g'))");
    format!("(strpos($2, {norm}) > 0 OR strpos({norm}, $2) > 0)")
}

/// A stored policy or FAQ as a topic lookup reads it: the topics it is filed under, and
/// the fields that name it in results (a match adds its spoken text and `updated_at`).
struct Filed {
    topics: Vec<String>,
    fields: Map<String, Value>,
}

/// What a topic lookup found: the asked topic (normalized), the matching entries' JSON
/// and spoken texts, and every topic on file in order of appearance.
struct TopicLookup {
    topic: String,
    matched: Vec<Value>,
    spoken: Vec<String>,
    available: Vec<String>,
}

impl TopicLookup {
    /// The tool's result, the matches listed under `list_key`.
    fn output(self, list_key: &str, summary: String) -> ToolOutput {
        ToolOutput::new(json!({
            "topic": self.topic,
            list_key: self.matched,
            "available_topics": self.available,
        }))
        .with_summary(summary)
    }
}

/// Runs the topic query `sql` (`$1` the business, `$2` the normalized topic; one row per
/// stored entry with its `matches`, `updated_at` and spoken `text_column`, NULLs when the
/// business has none) and reads each row's entry with `read` (`None`: no entry).
async fn look_up_topic(
    call: &Call,
    args: &TopicArgs,
    sql: &str,
    text_column: &str,
    read: impl Fn(&Row) -> Result<Option<Filed>, ToolError>,
) -> Result<TopicLookup, ToolError> {
    let topic = topic_of(args)?;
    let rows = call.rows(sql, &[&topic]).await?;
    let mut found = TopicLookup {
        topic,
        matched: Vec::new(),
        spoken: Vec::new(),
        available: Vec::new(),
    };
    for row in &rows {
        let Some(Filed { topics, mut fields }) = read(row)? else {
            continue;
        };
        for topic in topics {
            if !found.available.contains(&topic) {
                found.available.push(topic);
            }
        }
        if column::<bool>(row, "matches")? {
            let text: String = column(row, text_column)?;
            let updated: OffsetDateTime = column(row, "updated_at")?;
            fields.insert(text_column.to_string(), json!(text));
            fields.insert("updated_at".to_string(), json!(rfc3339(updated)));
            found.spoken.push(text);
            found.matched.push(Value::Object(fields));
        }
    }
    Ok(found)
}

async fn policies(call: Call, args: TopicArgs) -> Result<ToolOutput, ToolError> {
    let sql = format!(
        "SELECT p.topic, p.content, p.updated_at, COALESCE({}, false) AS matches
         FROM businesses b LEFT JOIN policies p ON p.business_id = b.id
         WHERE b.id = $1
         ORDER BY p.topic, p.updated_at DESC",
        topic_match("p.topic")
    );
    let found = look_up_topic(&call, &args, &sql, "content", |row| {
        let Some(topic) = column::<Option<String>>(row, "topic")? else {
            return Ok(None);
        };
        let mut fields = Map::new();
        fields.insert("topic".to_string(), json!(topic));
        Ok(Some(Filed {
            topics: vec![topic],
            fields,
        }))
    })
    .await?;
    let summary = if found.spoken.is_empty() {
        format!("I don't have a {} policy on file.", found.topic)
    } else {
        found.spoken.join(" ")
    };
    Ok(found.output("policies", summary))
}

async fn faqs(call: Call, args: TopicArgs) -> Result<ToolOutput, ToolError> {
    let sql = format!(
        "SELECT f.question, f.answer, f.tags, f.updated_at,
                COALESCE(EXISTS (SELECT 1 FROM unnest(f.tags) AS t(tag) WHERE {})
                         OR {}, false) AS matches
         FROM businesses b LEFT JOIN faqs f ON f.business_id = b.id
         WHERE b.id = $1
         ORDER BY f.updated_at DESC",
        topic_match("t.tag"),
        topic_match("f.question")
    );
    let mut found = look_up_topic(&call, &args, &sql, "answer", |row| {
        let Some(question) = column::<Option<String>>(row, "question")? else {
            return Ok(None);
        };
        let tags: Vec<String> = column(row, "tags")?;
        let mut fields = Map::new();
        fields.insert("question".to_string(), json!(question));
        fields.insert("tags".to_string(), json!(tags));
        Ok(Some(Filed {
            topics: tags,
            fields,
        }))
    })
    .await?;
    found.available.sort();
    let summary = match found.spoken.as_slice() {
        [] => format!("I don't have an answer about {} on file.", found.topic),
        [one, ..] => one.clone(),
    };
    Ok(found.output("faqs", summary))
}

fn topics_output_schema(list_key: &str, item: Value) -> Value {
    closed_object(
        &["topic", list_key, "available_topics"],
        json!({
            "topic": {"type": "string"},
            list_key: {"type": "array", "items": item},
            "available_topics": {"type": "array", "items": {"type": "string"}}
        }),
    )
}

/// The receptionist tools: `get_latest_booking`, `get_booking_by_id`,
/// `get_business_services`, `get_working_hours`, `get_policies`, `get_faqs`. With a
/// cache, results are served from Redis for its TTL (the two booking tools keyed also by
/// the caller's phone, which decides what they may return).
pub fn tools(db: &Db, cache: Option<&ResultCache>) -> Vec<Tool> {
    let no_context: &[&str] = &[];
    let bookings = booking_tools(db)
        .into_iter()
        .map(|tool| cached(cache, tool, PHONE_CONTEXT_KEYS));
    let business = business_tools(db)
        .into_iter()
        .map(|tool| cached(cache, tool, no_context));
    bookings.chain(business).collect()
}

/// What every receptionist tool is: tenant-scoped, idempotent, bounded by
/// [`TOOL_TIMEOUT`], with its output schema.
fn base(name: &str, description: &str, hint: &str, output_schema: Value) -> ToolBuilder {
    Tool::builder(name, description)
        .waiting_hint(hint)
        .timeout(TOOL_TIMEOUT)
        .idempotent(MAX_ATTEMPTS)
        .tenant_scoped()
        .output_schema(output_schema)
}

/// The tools that read the caller's bookings (what they may return depends on the
/// call's phone).
fn booking_tools(db: &Db) -> [Tool; 2] {
    let booking = |schema: Value| closed_object(&["booking"], json!({ "booking": schema }));
    [
        tool(
            db,
            base(
                "get_latest_booking",
                "The caller's next booking (or their most recent one when none is upcoming), found by the caller's phone number",
                "checking your booking",
                booking(json!({"anyOf": [{"type": "null"}, booking_schema()]})),
            ),
            latest_booking,
        ),
        tool(
            db,
            base(
                "get_booking_by_id",
                "A booking of this business by its id (only the caller's own when the call's phone is known)",
                "looking up that booking",
                booking(booking_schema()),
            ),
            booking_by_id,
        ),
    ]
}

/// The tools that read what the business publishes: services, hours, policies, FAQs.
fn business_tools(db: &Db) -> [Tool; 4] {
    [
        tool(
            db,
            base(
                "get_business_services",
                "The services this business offers, with durations and prices",
                "checking our services",
                closed_object(
                    &["business_name", "services"],
                    json!({
                        "business_name": {"type": "string"},
                        "services": {"type": "array"}
                    }),
                ),
            ),
            business_services,
        ),
        tool(
            db,
            base(
                "get_working_hours",
                "This business's opening hours by weekday",
                "checking our opening hours",
                closed_object(
                    &["business_name", "timezone", "working_hours"],
                    json!({
                        "business_name": {"type": "string"},
                        "timezone": {"type": "string"},
                        "working_hours": {"type": ["object", "null"]}
                    }),
                ),
            ),
            working_hours,
        ),
        tool(
            db,
            base(
                "get_policies",
                "This business's policy on a topic (cancellation, reschedule, late arrival, deposits, refunds, ...); topic required",
                "checking our policies",
                topics_output_schema(
                    "policies",
                    closed_object(
                        &["topic", "content", "updated_at"],
                        json!({
                            "topic": {"type": "string"},
                            "content": {"type": "string"},
                            "updated_at": {"type": "string"}
                        }),
                    ),
                ),
            ),
            policies,
        ),
        tool(
            db,
            base(
                "get_faqs",
                "Answers to frequently asked questions on a topic (parking, location, pricing, payment, ...); topic required",
                "looking that up",
                topics_output_schema(
                    "faqs",
                    closed_object(
                        &["question", "answer", "tags", "updated_at"],
                        json!({
                            "question": {"type": "string"},
                            "answer": {"type": "string"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                            "updated_at": {"type": "string"}
                        }),
                    ),
                ),
            ),
            faqs,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `error` is there, with `code` and the sentence the caller hears.
    fn assert_refusal(error: Option<ToolError>, code: &str, sentence: &str) {
        assert_eq!(error.as_ref().map(|e| e.code.as_str()), Some(code));
        assert_eq!(
            error.and_then(|e| e.user_message).as_deref(),
            Some(sentence)
        );
    }

    fn ctx(tenant: &str, phone: Option<&str>) -> ToolContext {
        let mut context = Map::new();
        if let Some(p) = phone {
            context.insert("customer_phone".into(), json!(p));
        }
        ToolContext::new(tenant, context)
    }

    const A: &str = "b1000000-0000-4000-8000-000000000001";

    #[test]
    fn business_comes_from_the_tenant() {
        assert!(business_of(&ctx(A, None), None).is_ok());
        assert!(business_of(&ctx(A, None), Some(A)).is_ok());
        let other = business_of(&ctx(A, None), Some("b2000000-0000-4000-8000-000000000002"));
        assert_eq!(
            other.err().map(|e| e.code),
            Some(codes::TENANT_MISMATCH.to_string())
        );
        let bad = business_of(&ctx("salon-42", None), None).err();
        assert_eq!(
            bad.as_ref().map(|e| e.code.as_str()),
            Some(UNKNOWN_BUSINESS)
        );
        // Nothing the caller can act on: the narrator falls back to its generic line.
        assert_eq!(bad.map(|e| e.user_message), Some(None));
    }

    #[test]
    fn the_calls_phone_wins_and_must_match() {
        let c = ctx(A, Some("+61 400 111 222"));
        assert_eq!(caller_phone(&c, None).ok().as_deref(), Some("61400111222"));
        assert_eq!(
            caller_phone(&c, Some("+61400111222")).ok().as_deref(),
            Some("61400111222")
        );
        let mismatch = caller_phone(&c, Some("+61400999999")).err();
        assert_refusal(
            mismatch,
            CUSTOMER_PHONE_MISMATCH,
            CUSTOMER_PHONE_MISMATCH_SENTENCE,
        );
        assert_eq!(
            caller_phone(&ctx(A, None), Some("0400 111 222"))
                .ok()
                .as_deref(),
            Some("0400111222")
        );
        let missing = caller_phone(&ctx(A, None), None).err();
        assert_refusal(
            missing,
            MISSING_CUSTOMER_PHONE,
            MISSING_CUSTOMER_PHONE_SENTENCE,
        );
    }

    #[test]
    fn topics_are_normalized() {
        assert_eq!(normalize_topic("  Late-Arrival "), "late arrival");
        assert_eq!(
            normalize_topic("cancellation_policy"),
            "cancellation policy"
        );
        assert_eq!(normalize_topic(" - "), "");
    }

    #[test]
    fn hours_are_spoken_in_groups() {
        let hours = json!({
            "monday": {"open": "08:00", "close": "17:00"},
            "tuesday": {"open": "08:00", "close": "17:00"},
            "wednesday": {"open": "08:00", "close": "17:00"},
            "thursday": {"open": "08:00", "close": "19:00"},
            "friday": {"open": "08:00", "close": "17:00"},
            "saturday": {"open": "09:00", "close": "13:00"},
            "sunday": null
        });
        assert_eq!(
            spoken_hours(&hours).as_deref(),
            Some("Monday to Wednesday 8:00 AM to 5:00 PM, Thursday 8:00 AM to 7:00 PM, Friday 8:00 AM to 5:00 PM, Saturday 9:00 AM to 1:00 PM and closed on Sunday")
        );
        assert_eq!(spoken_hours(&json!({})), None);
        assert_eq!(spoken_hours(&json!({"monday": {"open": "late"}})), None);
    }

    #[test]
    fn services_are_described() {
        assert_eq!(
            describe_service(&json!({"name": "men's cut", "duration_minutes": 30, "price": 45})),
            Some("men's cut (30 minutes, $45)".to_string())
        );
        assert_eq!(
            describe_service(&json!({"name": "tint", "price": 12.5})),
            Some("tint ($12.50)".to_string())
        );
        assert_eq!(describe_service(&json!("massage")), Some("massage".into()));
    }

    #[test]
    fn output_schemas_exclude_internal_fields() {
        let db = Db::new(crate::db::DbConfig::new(
            "postgres://nobody@127.0.0.1:1/none",
        ));
        for tool in tools(&db, None) {
            let schema = tool.definition().output_schema.clone().unwrap_or_default();
            let text = schema.to_string();
            assert!(
                !text.contains("internal_notes"),
                "{}",
                tool.definition().name
            );
            assert!(
                !text.contains("customer_email"),
                "{}",
                tool.definition().name
            );
            assert_eq!(schema["additionalProperties"], json!(false));
        }
    }
}
