//! The CRM pack on PostgreSQL (`crm-db`): the same tools, arguments and result shapes as
//! the sample-data pack in [`crate::packs::crm`], read from the `customers`,
//! `appointments` and `invoices` tables of the turn's business (the tenant id is the
//! `businesses.id` UUID, as in the receptionist pack). Times are spoken in the business's
//! time zone (`businesses.ai_config.timezone`).

use std::time::Duration;

use serde_json::{json, Value};
use time::{Date, PrimitiveDateTime};

use crate::cache::ResultCache;
use crate::db::Db;
use crate::packs::crm::{
    join_and, spoken_amount, spoken_date, spoken_time, CustomerArgs, CUSTOMER_NOT_FOUND,
};
use crate::packs::receptionist::{business_of, column};
use crate::tool::{Tool, ToolContext, ToolError, ToolOutput};

/// Per-call timeout of the CRM tools.
const TOOL_TIMEOUT: Duration = Duration::from_secs(2);

struct Appointment {
    id: String,
    service: String,
    location: String,
    duration_minutes: i32,
    local: PrimitiveDateTime,
}

impl Appointment {
    fn json(&self) -> Value {
        json!({
            "id": self.id,
            "date": self.local.date().to_string(),
            "time": format!("{:02}:{:02}", self.local.hour(), self.local.minute()),
            "service": self.service,
            "location": self.location,
            "durationMinutes": self.duration_minutes,
        })
    }

    fn describe(&self) -> String {
        format!(
            "a {} on {} at {}",
            self.service,
            spoken_date(self.local.date()),
            spoken_time(self.local.time())
        )
    }
}

fn not_found(id: &str) -> ToolError {
    ToolError::fatal(CUSTOMER_NOT_FOUND, format!("no customer with id {id:?}"))
}

/// The customer's name and upcoming scheduled appointments, soonest first.
async fn upcoming(
    db: &Db,
    ctx: &ToolContext,
    customer_id: &str,
) -> Result<(String, Vec<Appointment>), ToolError> {
    let business = business_of(ctx, None)?;
    let rows = db
        .query_scoped(
            business,
            "SELECT c.name, a.id, a.service, a.location, a.duration_minutes,
                    (a.starts_at AT TIME ZONE COALESCE(b.ai_config->>'timezone', 'UTC')) AS local_start
             FROM businesses b
             JOIN customers c ON c.business_id = b.id AND c.id = $2
             LEFT JOIN appointments a
                    ON a.business_id = b.id AND a.customer_id = c.id
                   AND a.status = 'scheduled' AND a.starts_at >= now()
             WHERE b.id = $1
             ORDER BY a.starts_at",
            &[&business, &customer_id],
        )
        .await?;
    let first = rows.first().ok_or_else(|| not_found(customer_id))?;
    let name: String = column(first, "name")?;
    let mut list = Vec::new();
    for row in &rows {
        let Some(id) = column::<Option<String>>(row, "id")? else {
            continue;
        };
        list.push(Appointment {
            id,
            service: column(row, "service")?,
            location: column(row, "location")?,
            duration_minutes: column(row, "duration_minutes")?,
            local: column(row, "local_start")?,
        });
    }
    Ok((name, list))
}

async fn list_upcoming(
    db: &Db,
    ctx: ToolContext,
    args: CustomerArgs,
) -> Result<ToolOutput, ToolError> {
    let (name, list) = upcoming(db, &ctx, &args.customer_id).await?;
    let summary = match list.as_slice() {
        [] => "You have no upcoming appointments.".to_string(),
        [one] => format!("You have one upcoming appointment: {}.", one.describe()),
        many => format!(
            "You have {} upcoming appointments: {}.",
            many.len(),
            join_and(&many.iter().map(Appointment::describe).collect::<Vec<_>>())
        ),
    };
    Ok(ToolOutput::new(json!({
        "customerId": args.customer_id,
        "customerName": name,
        "appointments": list.iter().map(Appointment::json).collect::<Vec<_>>(),
    }))
    .with_summary(summary))
}

async fn next_appointment(
    db: &Db,
    ctx: ToolContext,
    args: CustomerArgs,
) -> Result<ToolOutput, ToolError> {
    let (_, list) = upcoming(db, &ctx, &args.customer_id).await?;
    let next = list.first();
    let summary = match next {
        Some(a) => format!("Your next appointment is {}.", a.describe()),
        None => "You have no upcoming appointments.".to_string(),
    };
    Ok(ToolOutput::new(json!({
        "customerId": args.customer_id,
        "appointment": next.map(Appointment::json),
    }))
    .with_summary(summary))
}

async fn open_invoices(
    db: &Db,
    ctx: ToolContext,
    args: CustomerArgs,
) -> Result<ToolOutput, ToolError> {
    let business = business_of(&ctx, None)?;
    let rows = db
        .query_scoped(
            business,
            "SELECT c.name, i.id, i.amount_cents, i.currency, i.due_date, i.description
             FROM customers c
             LEFT JOIN invoices i
                    ON i.business_id = c.business_id AND i.customer_id = c.id AND i.status = 'open'
             WHERE c.business_id = $1 AND c.id = $2
             ORDER BY i.due_date",
            &[&business, &args.customer_id],
        )
        .await?;
    if rows.is_empty() {
        return Err(not_found(&args.customer_id));
    }
    let mut items = Vec::new();
    let mut open: Vec<(i64, String, Date)> = Vec::new();
    for row in &rows {
        let Some(id) = column::<Option<String>>(row, "id")? else {
            continue;
        };
        let cents: i64 = column(row, "amount_cents")?;
        let currency: String = column(row, "currency")?;
        let due: Date = column(row, "due_date")?;
        items.push(json!({
            "id": id,
            "amount": cents as f64 / 100.0,
            "currency": currency,
            "dueDate": due.to_string(),
            "description": column::<String>(row, "description")?,
        }));
        open.push((cents, currency, due));
    }
    let total: i64 = open.iter().map(|(c, _, _)| *c).sum();
    let currency = open
        .first()
        .map_or("USD", |(_, c, _)| c.as_str())
        .to_string();
    let cents = |c: i64| u64::try_from(c).unwrap_or(0);
    let summary = match open.as_slice() {
        [] => "You have no open invoices.".to_string(),
        [(c, cur, due)] => format!(
            "You have one open invoice for {}, due {}.",
            spoken_amount(cents(*c), cur),
            spoken_date(*due)
        ),
        many => format!(
            "You have {} open invoices totalling {}; the next is due {}.",
            many.len(),
            spoken_amount(cents(total), &currency),
            spoken_date(many[0].2)
        ),
    };
    Ok(ToolOutput::new(json!({
        "customerId": args.customer_id,
        "invoices": items,
        "totalDue": total as f64 / 100.0,
        "currency": currency,
    }))
    .with_summary(summary))
}

/// The CRM tools on PostgreSQL: `crm.listUpcomingAppointments`, `crm.getOpenInvoices`,
/// `crm.getNextAppointment`; cached when `cache` is given.
pub fn tools(db: &Db, cache: Option<&ResultCache>) -> Vec<Tool> {
    let list = {
        let db = db.clone();
        Tool::builder(
            "crm.listUpcomingAppointments",
            "List the customer's upcoming appointments",
        )
        .waiting_hint("looking up your upcoming appointments")
        .idempotent(3)
        .timeout(TOOL_TIMEOUT)
        .tenant_scoped()
        .handler(move |ctx, args: CustomerArgs| {
            let db = db.clone();
            async move { list_upcoming(&db, ctx, args).await }
        })
    };
    let invoices = {
        let db = db.clone();
        Tool::builder("crm.getOpenInvoices", "Get the customer's open invoices")
            .waiting_hint("checking your billing")
            .idempotent(3)
            .timeout(TOOL_TIMEOUT)
            .tenant_scoped()
            .handler(move |ctx, args: CustomerArgs| {
                let db = db.clone();
                async move { open_invoices(&db, ctx, args).await }
            })
    };
    let next = {
        let db = db.clone();
        Tool::builder(
            "crm.getNextAppointment",
            "Get the customer's next appointment",
        )
        .waiting_hint("checking your next appointment")
        .idempotent(3)
        .timeout(TOOL_TIMEOUT)
        .tenant_scoped()
        .handler(move |ctx, args: CustomerArgs| {
            let db = db.clone();
            async move { next_appointment(&db, ctx, args).await }
        })
    };
    [list, invoices, next]
        .into_iter()
        .map(|tool| match cache {
            Some(cache) => cache.wrap(tool, &[]),
            None => tool,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_names_and_schemas_as_the_sample_pack() {
        let db = Db::new(crate::db::DbConfig::new(
            "postgres://nobody@127.0.0.1:1/none",
        ));
        let on_db: Vec<_> = tools(&db, None)
            .iter()
            .map(|t| {
                (
                    t.definition().name.clone(),
                    t.definition().input_schema.clone(),
                )
            })
            .collect();
        let sample: Vec<_> = crate::packs::crm::tools()
            .iter()
            .map(|t| {
                (
                    t.definition().name.clone(),
                    t.definition().input_schema.clone(),
                )
            })
            .collect();
        assert_eq!(on_db, sample);
    }
}
