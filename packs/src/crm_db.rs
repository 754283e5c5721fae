//! The CRM pack on PostgreSQL (`crm-db`): the same tools, arguments and result shapes as
//! the sample-data pack in [`crate::crm`], read from the `customers`,
//! `appointments` and `invoices` tables of the turn's business (the tenant id is the
//! `businesses.id` UUID, as in the receptionist pack). Times are spoken in the business's
//! time zone (`businesses.ai_config.timezone`).
//!
//! Owns only the queries: definitions, result shapes and summaries come from
//! [`crate::crm`]. It must never write to the database nor read outside the turn's
//! business: every query goes through [`Db::query_scoped`].

use std::time::Duration;

use time::Date;
use tokio_postgres::Row;
use toolfleet_worker::cache::ResultCache;
use toolfleet_worker::tool::{Tool, ToolContext, ToolError, ToolOutput};

use crate::crm::{
    self, customer_not_found, invoices_output, next_output, upcoming_output, AppointmentView,
    CustomerArgs, InvoiceView,
};
use crate::db::{cached, Db};
use crate::receptionist::{business_of, column};

/// Per-call timeout of the CRM tools.
const TOOL_TIMEOUT: Duration = Duration::from_secs(2);

/// The customer's name and upcoming scheduled appointments, soonest first.
async fn upcoming(
    db: &Db,
    ctx: &ToolContext,
    customer_id: &str,
) -> Result<(String, Vec<AppointmentView>), ToolError> {
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
    let first = rows
        .first()
        .ok_or_else(|| customer_not_found(customer_id))?;
    let name: String = column(first, "name")?;
    let list = joined(&rows, |id, row| {
        Ok(AppointmentView {
            id,
            service: column(row, "service")?,
            location: column(row, "location")?,
            duration_minutes: column::<i32>(row, "duration_minutes")?.into(),
            at: column(row, "local_start")?,
        })
    })?;
    Ok((name, list))
}

/// The rows of a `LEFT JOIN` whose joined side is there (its `id` is not NULL), each
/// read by `read` with that id.
fn joined<T>(
    rows: &[Row],
    read: impl Fn(String, &Row) -> Result<T, ToolError>,
) -> Result<Vec<T>, ToolError> {
    let mut items = Vec::new();
    for row in rows {
        if let Some(id) = column::<Option<String>>(row, "id")? {
            items.push(read(id, row)?);
        }
    }
    Ok(items)
}

async fn open_invoices(
    db: Db,
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
        return Err(customer_not_found(&args.customer_id));
    }
    let open = joined(&rows, |id, row| {
        Ok(InvoiceView {
            id,
            // `invoices.amount_cents` is CHECKed to be non-negative.
            amount_cents: u64::try_from(column::<i64>(row, "amount_cents")?).unwrap_or(0),
            currency: column(row, "currency")?,
            due: column::<Date>(row, "due_date")?,
            description: column(row, "description")?,
        })
    })?;
    Ok(invoices_output(&args.customer_id, &open))
}

/// The CRM tools on PostgreSQL: `crm.listUpcomingAppointments`, `crm.getOpenInvoices`,
/// `crm.getNextAppointment`; cached when `cache` is given.
pub fn tools(db: &Db, cache: Option<&ResultCache>) -> Vec<Tool> {
    let [list, invoices, next] =
        crm::builders().map(|builder| builder.timeout(TOOL_TIMEOUT).tenant_scoped());
    [
        db.tool(list, |db, ctx, args: CustomerArgs| async move {
            let (name, list) = upcoming(&db, &ctx, &args.customer_id).await?;
            Ok(upcoming_output(&args.customer_id, &name, &list))
        }),
        db.tool(invoices, open_invoices),
        db.tool(next, |db, ctx, args: CustomerArgs| async move {
            let (_, list) = upcoming(&db, &ctx, &args.customer_id).await?;
            Ok(next_output(&args.customer_id, list.first()))
        }),
    ]
    .into_iter()
    .map(|tool| cached(cache, tool, &[]))
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
        let sample: Vec<_> = crate::crm::tools()
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
