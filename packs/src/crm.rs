//! The demo CRM pack (`demo`, alias `crm`): appointments and invoices of sample
//! customers, read from `packs/data/crm_sample.json` (shipped in the binary). Dates are
//! relative to today, so upcoming appointments stay upcoming.
//!
//! Owns the CRM tools' definitions, arguments, result shapes and spoken summaries, which
//! [`crate::crm_db`] reuses so that both packs answer alike, and the spoken forms of
//! dates, times and amounts the other packs share. It must never reach a database or
//! the network: the sample data is all it reads.

use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::{json, Value};
use time::{Date, OffsetDateTime, PrimitiveDateTime, Time};
use toolfleet_worker::tool::{Tool, ToolBuilder, ToolContext, ToolError, ToolOutput};

const SAMPLE: &str = include_str!("../data/crm_sample.json");

/// Code returned when the customer id is not in the data.
pub const CUSTOMER_NOT_FOUND: &str = "customer_not_found";

/// What the user hears when every call failed with [`CUSTOMER_NOT_FOUND`].
pub const CUSTOMER_NOT_FOUND_SENTENCE: &str = "I couldn't find a customer with that id.";

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
        .ok_or_else(|| customer_not_found(id))
}

/// The error of a customer id the business does not have: definite, and something the
/// user can act on, so it carries [`CUSTOMER_NOT_FOUND_SENTENCE`].
pub(crate) fn customer_not_found(id: &str) -> ToolError {
    ToolError::fatal(CUSTOMER_NOT_FOUND, format!("no customer with id {id:?}"))
        .with_user_message(CUSTOMER_NOT_FOUND_SENTENCE)
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

/// "a, b and c".
pub fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// An appointment as the CRM tools report it, whichever pack read it.
pub(crate) struct AppointmentView {
    /// The CRM's id of the appointment (`appt_001`).
    pub(crate) id: String,
    /// What is booked, as a caller would say it ("dental cleaning").
    pub(crate) service: String,
    pub(crate) location: String,
    pub(crate) duration_minutes: i64,
    /// When it starts, in the business's local time.
    pub(crate) at: PrimitiveDateTime,
}

impl AppointmentView {
    fn json(&self) -> Value {
        json!({
            "id": self.id,
            "date": self.at.date().to_string(),
            "time": format!("{:02}:{:02}", self.at.hour(), self.at.minute()),
            "service": self.service,
            "location": self.location,
            "durationMinutes": self.duration_minutes,
        })
    }

    fn describe(&self) -> String {
        format!(
            "a {} on {} at {}",
            self.service,
            spoken_date(self.at.date()),
            spoken_time(self.at.time())
        )
    }
}

/// An open invoice as the CRM tools report it, whichever pack read it: `amount_cents`
/// of `currency` (an ISO 4217 code such as `USD`) owed by `due`.
pub(crate) struct InvoiceView {
    pub(crate) id: String,
    pub(crate) amount_cents: u64,
    pub(crate) currency: String,
    pub(crate) due: Date,
    pub(crate) description: String,
}

/// The result of `crm.listUpcomingAppointments`: `list` is soonest first.
pub(crate) fn upcoming_output(
    customer_id: &str,
    customer_name: &str,
    list: &[AppointmentView],
) -> ToolOutput {
    let summary = match list {
        [] => "You have no upcoming appointments.".to_string(),
        [one] => format!("You have one upcoming appointment: {}.", one.describe()),
        many => format!(
            "You have {} upcoming appointments: {}.",
            many.len(),
            join_and(
                &many
                    .iter()
                    .map(AppointmentView::describe)
                    .collect::<Vec<_>>()
            )
        ),
    };
    ToolOutput::new(json!({
        "customerId": customer_id,
        "customerName": customer_name,
        "appointments": list.iter().map(AppointmentView::json).collect::<Vec<_>>(),
    }))
    .with_summary(summary)
}

/// The result of `crm.getNextAppointment`.
pub(crate) fn next_output(customer_id: &str, next: Option<&AppointmentView>) -> ToolOutput {
    let summary = match next {
        Some(a) => format!("Your next appointment is {}.", a.describe()),
        None => "You have no upcoming appointments.".to_string(),
    };
    ToolOutput::new(json!({
        "customerId": customer_id,
        "appointment": next.map(AppointmentView::json),
    }))
    .with_summary(summary)
}

/// The result of `crm.getOpenInvoices`.
pub(crate) fn invoices_output(customer_id: &str, open: &[InvoiceView]) -> ToolOutput {
    let total: u64 = open.iter().map(|i| i.amount_cents).sum();
    let currency = open.first().map_or("USD", |i| i.currency.as_str());
    let summary = match open {
        [] => "You have no open invoices.".to_string(),
        [one] => format!(
            "You have one open invoice for {}, due {}.",
            spoken_amount(one.amount_cents, &one.currency),
            spoken_date(one.due)
        ),
        many => format!(
            "You have {} open invoices totalling {}; the next is due {}.",
            many.len(),
            spoken_amount(total, currency),
            many.iter()
                .map(|i| i.due)
                .min()
                .map(spoken_date)
                .unwrap_or_default()
        ),
    };
    let items: Vec<Value> = open
        .iter()
        .map(|i| {
            json!({
                "id": i.id,
                "amount": i.amount_cents as f64 / 100.0,
                "currency": i.currency,
                "dueDate": i.due.to_string(),
                "description": i.description,
            })
        })
        .collect();
    ToolOutput::new(json!({
        "customerId": customer_id,
        "invoices": items,
        "totalDue": total as f64 / 100.0,
        "currency": currency,
    }))
    .with_summary(summary)
}

/// The upcoming appointments of `c`, soonest first.
fn upcoming(c: &Customer) -> Vec<AppointmentView> {
    let mut list: Vec<AppointmentView> = c
        .appointments
        .iter()
        .filter(|a| a.in_days >= 0)
        .map(|a| AppointmentView {
            id: a.id.clone(),
            service: a.service.clone(),
            location: a.location.clone(),
            duration_minutes: a.duration_minutes.into(),
            at: PrimitiveDateTime::new(day(a.in_days), parse_time(&a.time)),
        })
        .collect();
    list.sort_by_key(|a| a.at);
    list
}

async fn list_upcoming(_ctx: ToolContext, args: CustomerArgs) -> Result<ToolOutput, ToolError> {
    let c = customer(&args.customer_id)?;
    Ok(upcoming_output(&args.customer_id, &c.name, &upcoming(c)))
}

async fn next_appointment(_ctx: ToolContext, args: CustomerArgs) -> Result<ToolOutput, ToolError> {
    let c = customer(&args.customer_id)?;
    Ok(next_output(&args.customer_id, upcoming(c).first()))
}

async fn open_invoices(_ctx: ToolContext, args: CustomerArgs) -> Result<ToolOutput, ToolError> {
    let c = customer(&args.customer_id)?;
    let open: Vec<InvoiceView> = c
        .invoices
        .iter()
        .filter(|i| i.status == "open")
        .map(|i| InvoiceView {
            id: i.id.clone(),
            amount_cents: i.amount_cents,
            currency: i.currency.clone(),
            due: day(i.due_in_days),
            description: i.description.clone(),
        })
        .collect();
    Ok(invoices_output(&args.customer_id, &open))
}

/// The CRM tools' definitions without handlers, in the order `crm.listUpcomingAppointments`,
/// `crm.getOpenInvoices`, `crm.getNextAppointment`; both CRM packs finish these, so their
/// names, descriptions and hints cannot drift apart.
pub(crate) fn builders() -> [ToolBuilder; 3] {
    [
        Tool::builder(
            "crm.listUpcomingAppointments",
            "List the customer's upcoming appointments",
        )
        .waiting_hint("looking up your upcoming appointments"),
        Tool::builder("crm.getOpenInvoices", "Get the customer's open invoices")
            .waiting_hint("checking your billing"),
        Tool::builder(
            "crm.getNextAppointment",
            "Get the customer's next appointment",
        )
        .waiting_hint("checking your next appointment"),
    ]
    .map(|builder| builder.idempotent(3))
}

/// The CRM tools: `crm.listUpcomingAppointments`, `crm.getOpenInvoices`,
/// `crm.getNextAppointment`.
pub fn tools() -> Vec<Tool> {
    let [list, invoices, next] = builders();
    vec![
        list.handler(list_upcoming),
        invoices.handler(open_invoices),
        next.handler(next_appointment),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> ToolContext {
        ToolContext::new("t", Default::default())
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
        .err();
        assert_eq!(
            err.as_ref().map(|e| e.code.as_str()),
            Some(CUSTOMER_NOT_FOUND)
        );
        assert_eq!(err.as_ref().map(|e| e.retryable), Some(false));
        assert_eq!(
            err.and_then(|e| e.user_message).as_deref(),
            Some(CUSTOMER_NOT_FOUND_SENTENCE)
        );
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
