//! The demo CRM pack: appointments and invoices of sample customers, read from
//! `worker/data/crm_sample.json` (shipped in the binary). Dates are relative to today,
//! so upcoming appointments stay upcoming.

use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::{json, Value};
use time::{Date, OffsetDateTime, Time};

use crate::tool::{Tool, ToolContext, ToolError, ToolOutput};

const SAMPLE: &str = include_str!("../../data/crm_sample.json");

/// Code returned when the customer id is not in the data.
pub const CUSTOMER_NOT_FOUND: &str = "customer_not_found";

#[derive(Debug, Deserialize)]
struct Data {
    customers: std::collections::BTreeMap<String, Customer>,
}

#[derive(Debug, Deserialize)]
struct Customer {
    name: String,
    appointments: Vec<Appointment>,
    invoices: Vec<Invoice>,
}

#[derive(Debug, Deserialize)]
struct Appointment {
    id: String,
    in_days: i64,
    time: String,
    service: String,
    location: String,
    duration_minutes: u32,
}

#[derive(Debug, Deserialize)]
struct Invoice {
    id: String,
    amount_cents: u64,
    currency: String,
    due_in_days: i64,
    description: String,
    status: String,
}

/// Arguments of every CRM tool.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CustomerArgs {
    /// The CRM customer id, e.g. `cust_001`.
    #[serde(rename = "customerId")]
    pub customer_id: String,
}

fn data() -> Result<&'static Data, ToolError> {
    static DATA: OnceLock<Result<Data, String>> = OnceLock::new();
    DATA.get_or_init(|| serde_json::from_str(SAMPLE).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| ToolError::fatal("data_unavailable", format!("sample data: {e}")))
}

fn customer(id: &str) -> Result<&'static Customer, ToolError> {
    data()?
        .customers
        .get(id)
        .ok_or_else(|| ToolError::fatal(CUSTOMER_NOT_FOUND, format!("no customer with id {id:?}")))
}

fn today() -> Date {
    OffsetDateTime::now_utc().date()
}

fn day(offset: i64) -> Date {
    today()
        .checked_add(time::Duration::days(offset))
        .unwrap_or_else(today)
}

fn parse_time(s: &str) -> Time {
    let mut parts = s.split(':');
    let h = parts.next().and_then(|p| p.parse().ok()).unwrap_or(9);
    let m = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    Time::from_hms(h, m, 0).unwrap_or(Time::MIDNIGHT)
}

/// "Tuesday, November 24".
pub fn spoken_date(d: Date) -> String {
    format!("{}, {} {}", d.weekday(), d.month(), d.day())
}

/// "2:00 PM".
pub fn spoken_time(t: Time) -> String {
    let (h, m) = (t.hour(), t.minute());
    let suffix = if h < 12 { "AM" } else { "PM" };
    let h12 = match h % 12 {
        0 => 12,
        h => h,
    };
    format!("{h12}:{m:02} {suffix}")
}

/// "$150.00".
pub fn spoken_amount(cents: u64, currency: &str) -> String {
    let symbol = match currency {
        "USD" | "AUD" | "CAD" => "$",
        "EUR" => "€",
        "GBP" => "£",
        _ => "",
    };
    let amount = format!("{}.{:02}", cents / 100, cents % 100);
    if symbol.is_empty() {
        format!("{amount} {currency}")
    } else {
        format!("{symbol}{amount}")
    }
}

fn appointment_json(a: &Appointment) -> Value {
    let date = day(a.in_days);
    json!({
        "id": a.id,
        "date": date.to_string(),
        "time": a.time,
        "service": a.service,
        "location": a.location,
        "durationMinutes": a.duration_minutes,
    })
}

fn upcoming(c: &Customer) -> Vec<&Appointment> {
    let mut list: Vec<&Appointment> = c.appointments.iter().filter(|a| a.in_days >= 0).collect();
    list.sort_by_key(|a| (a.in_days, parse_time(&a.time)));
    list
}

fn describe(a: &Appointment) -> String {
    format!(
        "a {} on {} at {}",
        a.service,
        spoken_date(day(a.in_days)),
        spoken_time(parse_time(&a.time))
    )
}

/// "a, b and c".
pub fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

async fn list_upcoming(_ctx: ToolContext, args: CustomerArgs) -> Result<ToolOutput, ToolError> {
    let c = customer(&args.customer_id)?;
    let list = upcoming(c);
    let summary = match list.len() {
        0 => "You have no upcoming appointments.".to_string(),
        1 => format!("You have one upcoming appointment: {}.", describe(list[0])),
        n => format!(
            "You have {n} upcoming appointments: {}.",
            join_and(&list.iter().map(|a| describe(a)).collect::<Vec<_>>())
        ),
    };
    let items: Vec<Value> = list.iter().map(|a| appointment_json(a)).collect();
    Ok(ToolOutput::new(json!({
        "customerId": args.customer_id,
        "customerName": c.name,
        "appointments": items,
    }))
    .with_summary(summary))
}

async fn next_appointment(_ctx: ToolContext, args: CustomerArgs) -> Result<ToolOutput, ToolError> {
    let c = customer(&args.customer_id)?;
    let next = upcoming(c).into_iter().next();
    let summary = match next {
        Some(a) => format!("Your next appointment is {}.", describe(a)),
        None => "You have no upcoming appointments.".to_string(),
    };
    Ok(ToolOutput::new(json!({
        "customerId": args.customer_id,
        "appointment": next.map(appointment_json),
    }))
    .with_summary(summary))
}

async fn open_invoices(_ctx: ToolContext, args: CustomerArgs) -> Result<ToolOutput, ToolError> {
    let c = customer(&args.customer_id)?;
    let open: Vec<&Invoice> = c.invoices.iter().filter(|i| i.status == "open").collect();
    let total: u64 = open.iter().map(|i| i.amount_cents).sum();
    let currency = open.first().map_or("USD", |i| i.currency.as_str());
    let summary = match open.as_slice() {
        [] => "You have no open invoices.".to_string(),
        [one] => format!(
            "You have one open invoice for {}, due {}.",
            spoken_amount(one.amount_cents, &one.currency),
            spoken_date(day(one.due_in_days))
        ),
        many => format!(
            "You have {} open invoices totalling {}; the next is due {}.",
            many.len(),
            spoken_amount(total, currency),
            spoken_date(day(many.iter().map(|i| i.due_in_days).min().unwrap_or(0)))
        ),
    };
    let items: Vec<Value> = open
        .iter()
        .map(|i| {
            json!({
                "id": i.id,
                "amount": i.amount_cents as f64 / 100.0,
                "currency": i.currency,
                "dueDate": day(i.due_in_days).to_string(),
                "description": i.description,
            })
        })
        .collect();
    Ok(ToolOutput::new(json!({
        "customerId": args.customer_id,
        "invoices": items,
        "totalDue": total as f64 / 100.0,
        "currency": currency,
    }))
    .with_summary(summary))
}

/// The CRM tools: `crm.listUpcomingAppointments`, `crm.getOpenInvoices`,
/// `crm.getNextAppointment`.
pub fn tools() -> Vec<Tool> {
    vec![
        Tool::builder(
            "crm.listUpcomingAppointments",
            "List the customer's upcoming appointments",
        )
        .waiting_hint("looking up your upcoming appointments")
        .idempotent(3)
        .handler(list_upcoming),
        Tool::builder("crm.getOpenInvoices", "Get the customer's open invoices")
            .waiting_hint("checking your billing")
            .idempotent(3)
            .handler(open_invoices),
        Tool::builder(
            "crm.getNextAppointment",
            "Get the customer's next appointment",
        )
        .waiting_hint("checking your next appointment")
        .idempotent(3)
        .handler(next_appointment),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> ToolContext {
        ToolContext {
            tenant_id: "t".into(),
            turn_id: "turn".into(),
            call_id: "c".into(),
            session_id: None,
            deadline_unix_ms: u64::MAX,
            attempt: 1,
            context: Default::default(),
        }
    }

    #[tokio::test]
    async fn upcoming_appointments_skip_past_ones() {
        let out = list_upcoming(
            ctx(),
            CustomerArgs {
                customer_id: "cust_001".into(),
            },
        )
        .await;
        let out = out.map_err(|e| e.message);
        assert!(
            matches!(&out, Ok(o) if o.value["appointments"].as_array().map(Vec::len) == Some(2))
        );
        let summary = out.ok().and_then(|o| o.summary).unwrap_or_default();
        assert!(summary.starts_with("You have 2 upcoming appointments: a dental cleaning on "));
    }

    #[tokio::test]
    async fn unknown_customer_is_a_typed_error() {
        let err = open_invoices(
            ctx(),
            CustomerArgs {
                customer_id: "nobody".into(),
            },
        )
        .await
        .err()
        .map(|e| e.code);
        assert_eq!(err.as_deref(), Some(CUSTOMER_NOT_FOUND));
    }

    #[test]
    fn spoken_forms() {
        assert_eq!(spoken_amount(15000, "USD"), "$150.00");
        assert_eq!(
            spoken_time(Time::from_hms(14, 0, 0).unwrap_or(Time::MIDNIGHT)),
            "2:00 PM"
        );
        assert_eq!(
            spoken_time(Time::from_hms(0, 5, 0).unwrap_or(Time::MIDNIGHT)),
            "12:05 AM"
        );
    }
}
