//! The receptionist pack: read-only tools over a business's bookings, services, hours,
//! policies and FAQs in PostgreSQL, for a voice receptionist.
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

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, PrimitiveDateTime};
use tokio_postgres::Row;
use toolfleet_common::call::codes;
use uuid::Uuid;

use crate::cache::ResultCache;
use crate::db::{Db, DATABASE_ERROR};
use crate::packs::crm::{join_and, spoken_date, spoken_time};
use crate::tool::{Tool, ToolContext, ToolError, ToolOutput};

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

/// Context entries that carry the caller's phone, in order of preference.
pub const PHONE_CONTEXT_KEYS: &[&str] = &["customer_phone", "caller_phone"];

/// Per-call timeout of every receptionist tool.
pub const TOOL_TIMEOUT: Duration = Duration::from_millis(400);

/// Deliveries of a call that failed with a retryable error (the database was down).
const MAX_ATTEMPTS: u32 = 2;

/// Arguments of `get_latest_booking`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LatestBookingArgs {
    /// Optional; if given it must be the current business (the turn's tenant).
    #[serde(default)]
    pub business_id: Option<String>,
    /// The caller's phone number. The phone of the call is used when the session knows
    /// it; this must then be the same number.
    #[serde(default)]
    pub customer_phone: Option<String>,
}

/// Arguments of `get_booking_by_id`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BookingByIdArgs {
    /// Optional; if given it must be the current business (the turn's tenant).
    #[serde(default)]
    pub business_id: Option<String>,
    /// The booking's id (a UUID).
    pub booking_id: String,
}

/// Arguments of `get_business_services` and `get_working_hours`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BusinessArgs {
    /// Optional; if given it must be the current business (the turn's tenant).
    #[serde(default)]
    pub business_id: Option<String>,
}

/// Arguments of `get_policies` and `get_faqs`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TopicArgs {
    /// Optional; if given it must be the current business (the turn's tenant).
    #[serde(default)]
    pub business_id: Option<String>,
    /// What the caller asks about, e.g. cancellation, reschedule, late arrival, deposits,
    /// refunds, pricing, hours, location, parking.
    pub topic: String,
}

fn fatal(code: &str, message: impl Into<String>) -> ToolError {
    ToolError::fatal(code, message)
}

/// The business of the turn; refuses a `business_id` argument naming another one.
pub(crate) fn business_of(ctx: &ToolContext, named: Option<&str>) -> Result<Uuid, ToolError> {
    if let Some(named) = named.map(str::trim).filter(|n| !n.is_empty()) {
        if !named.eq_ignore_ascii_case(ctx.tenant_id.trim()) {
            return Err(fatal(
                codes::TENANT_MISMATCH,
                "business_id names another business; tools only read the current business",
            ));
        }
    }
    Uuid::parse_str(ctx.tenant_id.trim()).map_err(|_| {
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

/// The phone to look bookings up by: the call's, or the argument when the call has none.
fn caller_phone(ctx: &ToolContext, argument: Option<&str>) -> Result<String, ToolError> {
    let from_call = PHONE_CONTEXT_KEYS
        .iter()
        .filter_map(|k| ctx.context.get(*k).and_then(Value::as_str))
        .map(phone_digits)
        .find(|d| !d.is_empty());
    let from_model = argument.map(phone_digits).filter(|d| !d.is_empty());
    match (from_call, from_model) {
        (Some(call), Some(model)) if call != model => Err(fatal(
            CUSTOMER_PHONE_MISMATCH,
            "bookings can only be looked up for the phone number of this call",
        )),
        (Some(call), _) => Ok(call),
        (None, Some(model)) => Ok(model),
        (None, None) => Err(fatal(
            MISSING_CUSTOMER_PHONE,
            "the caller's phone number is unknown; ask for it and pass customer_phone",
        )),
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

/// Schema of a booking in results.
fn booking_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["booking_id", "status", "service", "booking_datetime", "local_datetime", "customer_name"],
        "properties": {
            "booking_id": {"type": "string"},
            "status": {"type": "string"},
            "service": {"type": "string"},
            "booking_datetime": {"type": "string", "description": "RFC 3339, UTC"},
            "local_datetime": {"type": "string", "description": "the business's local time"},
            "duration_minutes": {"type": ["integer", "null"]},
            "customer_name": {"type": "string"},
            "price": {"type": ["number", "null"]},
            "customer_notes": {"type": ["string", "null"]}
        }
    })
}

async fn latest_booking(
    db: &Db,
    ctx: ToolContext,
    args: LatestBookingArgs,
) -> Result<ToolOutput, ToolError> {
    let business = business_of(&ctx, args.business_id.as_deref())?;
    let phone = caller_phone(&ctx, args.customer_phone.as_deref())?;
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
    let rows = db
        .query_scoped(business, &sql, &[&business, &phone])
        .await?;
    let row = rows.first().ok_or_else(unknown_business)?;
    Ok(match booking_from(row)? {
        Some(booking) => {
            let summary = booking_sentence(&booking);
            ToolOutput::new(json!({"booking": booking.value})).with_summary(summary)
        }
        None => ToolOutput::new(json!({"booking": null}))
            .with_summary("I couldn't find a booking under this phone number."),
    })
}

async fn booking_by_id(
    db: &Db,
    ctx: ToolContext,
    args: BookingByIdArgs,
) -> Result<ToolOutput, ToolError> {
    let business = business_of(&ctx, args.business_id.as_deref())?;
    let id = Uuid::parse_str(args.booking_id.trim()).map_err(|_| {
        fatal(
            INVALID_BOOKING_ID,
            format!("{:?} is not a booking id", args.booking_id),
        )
    })?;
    let sql = format!(
        "SELECT {BOOKING_COLUMNS}
         FROM businesses b
         LEFT JOIN bookings k ON k.business_id = b.id AND k.id = $2
         WHERE b.id = $1"
    );
    let rows = db.query_scoped(business, &sql, &[&business, &id]).await?;
    let row = rows.first().ok_or_else(unknown_business)?;
    let booking = booking_from(row)?.ok_or_else(|| {
        fatal(
            BOOKING_NOT_FOUND,
            format!("no booking {id} at this business"),
        )
    })?;
    let summary = booking_sentence(&booking);
    Ok(ToolOutput::new(json!({"booking": booking.value})).with_summary(summary))
}

fn unknown_business() -> ToolError {
    fatal(UNKNOWN_BUSINESS, "no business with the turn's tenant id")
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

async fn business_services(
    db: &Db,
    ctx: ToolContext,
    args: BusinessArgs,
) -> Result<ToolOutput, ToolError> {
    let business = business_of(&ctx, args.business_id.as_deref())?;
    let rows = db
        .query_scoped(
            business,
            "SELECT name, services FROM businesses WHERE id = $1",
            &[&business],
        )
        .await?;
    let row = rows.first().ok_or_else(unknown_business)?;
    let name: String = column(row, "name")?;
    let services: Value = column(row, "services")?;
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

async fn working_hours(
    db: &Db,
    ctx: ToolContext,
    args: BusinessArgs,
) -> Result<ToolOutput, ToolError> {
    let business = business_of(&ctx, args.business_id.as_deref())?;
    let rows = db
        .query_scoped(
            business,
            "SELECT name, working_hours, COALESCE(ai_config->>'timezone', 'UTC') AS timezone
             FROM businesses WHERE id = $1",
            &[&business],
        )
        .await?;
    let row = rows.first().ok_or_else(unknown_business)?;
    let name: String = column(row, "name")?;
    let hours: Value = column(row, "working_hours")?;
    let timezone: String = column(row, "timezone")?;
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

/// SQL: whether the stored text `$col` and the topic `$2` match (either contains the
/// other, compared as normalized words).
fn topic_match(col: &str) -> String {
    let norm = format!("btrim(regexp_replace(lower({col}), '[^[:alnum:]]+', ' ', 'g'))");
    format!("(strpos($2, {norm}) > 0 OR strpos({norm}, $2) > 0)")
}

async fn policies(db: &Db, ctx: ToolContext, args: TopicArgs) -> Result<ToolOutput, ToolError> {
    let business = business_of(&ctx, args.business_id.as_deref())?;
    let topic = topic_of(&args)?;
    let sql = format!(
        "SELECT p.topic, p.content, p.updated_at, COALESCE({}, false) AS matches
         FROM businesses b LEFT JOIN policies p ON p.business_id = b.id
         WHERE b.id = $1
         ORDER BY p.topic, p.updated_at DESC",
        topic_match("p.topic")
    );
    let rows = db
        .query_scoped(business, &sql, &[&business, &topic])
        .await?;
    if rows.is_empty() {
        return Err(unknown_business());
    }
    let mut matched = Vec::new();
    let mut spoken = Vec::new();
    let mut available: Vec<String> = Vec::new();
    for row in &rows {
        let Some(stored_topic) = column::<Option<String>>(row, "topic")? else {
            continue;
        };
        if !available.contains(&stored_topic) {
            available.push(stored_topic.clone());
        }
        if column::<bool>(row, "matches")? {
            let content: String = column(row, "content")?;
            let updated: OffsetDateTime = column(row, "updated_at")?;
            spoken.push(content.clone());
            matched.push(json!({
                "topic": stored_topic,
                "content": content,
                "updated_at": rfc3339(updated),
            }));
        }
    }
    let summary = if spoken.is_empty() {
        format!("I don't have a {topic} policy on file.")
    } else {
        spoken.join(" ")
    };
    Ok(ToolOutput::new(json!({
        "topic": topic,
        "policies": matched,
        "available_topics": available,
    }))
    .with_summary(summary))
}

async fn faqs(db: &Db, ctx: ToolContext, args: TopicArgs) -> Result<ToolOutput, ToolError> {
    let business = business_of(&ctx, args.business_id.as_deref())?;
    let topic = topic_of(&args)?;
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
    let rows = db
        .query_scoped(business, &sql, &[&business, &topic])
        .await?;
    if rows.is_empty() {
        return Err(unknown_business());
    }
    let mut matched = Vec::new();
    let mut answers = Vec::new();
    let mut available: Vec<String> = Vec::new();
    for row in &rows {
        let Some(question) = column::<Option<String>>(row, "question")? else {
            continue;
        };
        let tags: Vec<String> = column(row, "tags")?;
        for tag in &tags {
            if !available.contains(tag) {
                available.push(tag.clone());
            }
        }
        if column::<bool>(row, "matches")? {
            let answer: String = column(row, "answer")?;
            let updated: OffsetDateTime = column(row, "updated_at")?;
            answers.push(answer.clone());
            matched.push(json!({
                "question": question,
                "answer": answer,
                "tags": tags,
                "updated_at": rfc3339(updated),
            }));
        }
    }
    available.sort();
    let summary = match answers.as_slice() {
        [] => format!("I don't have an answer about {topic} on file."),
        [one, ..] => one.clone(),
    };
    Ok(ToolOutput::new(json!({
        "topic": topic,
        "faqs": matched,
        "available_topics": available,
    }))
    .with_summary(summary))
}

fn topics_output_schema(list_key: &str, item: Value) -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["topic", list_key, "available_topics"],
        "properties": {
            "topic": {"type": "string"},
            list_key: {"type": "array", "items": item},
            "available_topics": {"type": "array", "items": {"type": "string"}}
        }
    })
}

/// The receptionist tools: `get_latest_booking`, `get_booking_by_id`,
/// `get_business_services`, `get_working_hours`, `get_policies`, `get_faqs`. With a
/// cache, results are served from Redis for its TTL (`get_latest_booking` keyed also by
/// the caller's phone).
pub fn tools(db: &Db, cache: Option<&ResultCache>) -> Vec<Tool> {
    let base = |name: &str, description: &str, hint: &str| {
        Tool::builder(name, description)
            .waiting_hint(hint)
            .timeout(TOOL_TIMEOUT)
            .idempotent(MAX_ATTEMPTS)
            .tenant_scoped()
    };
    let tools = vec![
        (
            {
                let db = db.clone();
                base(
                    "get_latest_booking",
                    "The caller's next booking (or their most recent one when none is upcoming), found by the caller's phone number",
                    "checking your booking",
                )
                .output_schema(json!({
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["booking"],
                    "properties": {"booking": {"anyOf": [{"type": "null"}, booking_schema()]}}
                }))
                .handler(move |ctx, args: LatestBookingArgs| {
                    let db = db.clone();
                    async move { latest_booking(&db, ctx, args).await }
                })
            },
            PHONE_CONTEXT_KEYS,
        ),
        (
            {
                let db = db.clone();
                base(
                    "get_booking_by_id",
                    "A booking of this business by its id",
                    "looking up that booking",
                )
                .output_schema(json!({
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["booking"],
                    "properties": {"booking": booking_schema()}
                }))
                .handler(move |ctx, args: BookingByIdArgs| {
                    let db = db.clone();
                    async move { booking_by_id(&db, ctx, args).await }
                })
            },
            &[][..],
        ),
        (
            {
                let db = db.clone();
                base(
                    "get_business_services",
                    "The services this business offers, with durations and prices",
                    "checking our services",
                )
                .output_schema(json!({
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["business_name", "services"],
                    "properties": {
                        "business_name": {"type": "string"},
                        "services": {"type": "array"}
                    }
                }))
                .handler(move |ctx, args: BusinessArgs| {
                    let db = db.clone();
                    async move { business_services(&db, ctx, args).await }
                })
            },
            &[][..],
        ),
        (
            {
                let db = db.clone();
                base(
                    "get_working_hours",
                    "This business's opening hours by weekday",
                    "checking our opening hours",
                )
                .output_schema(json!({
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["business_name", "timezone", "working_hours"],
                    "properties": {
                        "business_name": {"type": "string"},
                        "timezone": {"type": "string"},
                        "working_hours": {"type": ["object", "null"]}
                    }
                }))
                .handler(move |ctx, args: BusinessArgs| {
                    let db = db.clone();
                    async move { working_hours(&db, ctx, args).await }
                })
            },
            &[][..],
        ),
        (
            {
                let db = db.clone();
                base(
                    "get_policies",
                    "This business's policy on a topic (cancellation, reschedule, late arrival, deposits, refunds, ...); topic required",
                    "checking our policies",
                )
                .output_schema(topics_output_schema(
                    "policies",
                    json!({
                        "type": "object",
                        "additionalProperties": false,
                        "required": ["topic", "content", "updated_at"],
                        "properties": {
                            "topic": {"type": "string"},
                            "content": {"type": "string"},
                            "updated_at": {"type": "string"}
                        }
                    }),
                ))
                .handler(move |ctx, args: TopicArgs| {
                    let db = db.clone();
                    async move { policies(&db, ctx, args).await }
                })
            },
            &[][..],
        ),
        (
            {
                let db = db.clone();
                base(
                    "get_faqs",
                    "Answers to frequently asked questions on a topic (parking, location, pricing, payment, ...); topic required",
                    "looking that up",
                )
                .output_schema(topics_output_schema(
                    "faqs",
                    json!({
                        "type": "object",
                        "additionalProperties": false,
                        "required": ["question", "answer", "tags", "updated_at"],
                        "properties": {
                            "question": {"type": "string"},
                            "answer": {"type": "string"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                            "updated_at": {"type": "string"}
                        }
                    }),
                ))
                .handler(move |ctx, args: TopicArgs| {
                    let db = db.clone();
                    async move { faqs(&db, ctx, args).await }
                })
            },
            &[][..],
        ),
    ];
    tools
        .into_iter()
        .map(|(tool, vary_on)| match cache {
            Some(cache) => cache.wrap(tool, vary_on),
            None => tool,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn ctx(tenant: &str, phone: Option<&str>) -> ToolContext {
        let mut context = Map::new();
        if let Some(p) = phone {
            context.insert("customer_phone".into(), json!(p));
        }
        ToolContext {
            tenant_id: tenant.into(),
            turn_id: "t".into(),
            call_id: "c".into(),
            session_id: None,
            deadline_unix_ms: u64::MAX,
            attempt: 1,
            context,
        }
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
        let bad = business_of(&ctx("salon-42", None), None);
        assert_eq!(
            bad.err().map(|e| e.code),
            Some(UNKNOWN_BUSINESS.to_string())
        );
    }

    #[test]
    fn the_calls_phone_wins_and_must_match() {
        let c = ctx(A, Some("+61 400 111 222"));
        assert_eq!(caller_phone(&c, None).ok().as_deref(), Some("61400111222"));
        assert_eq!(
            caller_phone(&c, Some("+61400111222")).ok().as_deref(),
            Some("61400111222")
        );
        assert_eq!(
            caller_phone(&c, Some("+61400999999")).err().map(|e| e.code),
            Some(CUSTOMER_PHONE_MISMATCH.to_string())
        );
        assert_eq!(
            caller_phone(&ctx(A, None), Some("0400 111 222"))
                .ok()
                .as_deref(),
            Some("0400111222")
        );
        assert_eq!(
            caller_phone(&ctx(A, None), None).err().map(|e| e.code),
            Some(MISSING_CUSTOMER_PHONE.to_string())
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
