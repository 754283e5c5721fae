//! `toolfleet admin`: set up the database of the receptionist and CRM packs and manage
//! each business's policies and FAQs and the HTTP gateway's API keys; print the worker's KEDA `ScaledObject` (`keda`, no
//! database). Connects with `--database-url` /
//! `TOOLFLEET_DATABASE_URL` as a user that may write (not the tools' read-only role).
//!
//! Owns the admin subcommands and their SQL for policies and FAQs; migrations and
//! demo data belong to the packs' `db` module. It must never update or delete rows,
//! never add a policy or FAQ to a business it has not found, and never splice user
//! input into SQL: values go as query parameters.

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::{json, Map, Value};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};
use toolfleet_packs::db;
use toolfleet_packs::receptionist::{normalize_topic, topic_match};
use uuid::Uuid;

/// Database used when neither `--database-url` nor `TOOLFLEET_DATABASE_URL` is set.
pub use toolfleet_keys::DEFAULT_DATABASE_URL;

/// What `toolfleet admin` can do.
#[derive(Subcommand)]
pub enum AdminCommand {
    /// Create the database if missing and apply the migrations (optionally the demo data).
    Migrate {
        /// Also insert the two demo businesses with bookings, policies and FAQs.
        #[arg(long)]
        seed: bool,
    },
    /// A business's policies.
    Policies {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// A business's FAQs.
    Faqs {
        #[command(subcommand)]
        command: FaqCommand,
    },
    /// The HTTP gateway's API keys (each maps to exactly one tenant).
    Keys {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// Print the worker's KEDA ScaledObject: one trigger per tool of `--packs`.
    Keda {
        /// The packs the worker serves, comma-separated (its `TOOLFLEET_PACKS`).
        #[arg(long, default_value = "demo")]
        packs: String,
        /// Pending jobs per worker replica above which KEDA adds one.
        #[arg(long, default_value_t = 10)]
        lag_threshold: u32,
        /// The fleet's stream partitions (its `TOOLFLEET_STREAM_PARTITIONS`): a trigger
        /// per tool and partition.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
        partitions: u32,
    },
}

/// `toolfleet admin policies ...`
#[derive(Subcommand)]
pub enum PolicyCommand {
    /// Create a policy.
    Add {
        /// The business (`businesses.id`, the tenant id of its turns).
        #[arg(long)]
        business: Uuid,
        /// The topic callers ask about (cancellation, deposits, ...).
        #[arg(long)]
        topic: String,
        /// The policy text, as the receptionist will say it.
        #[arg(long)]
        content: String,
    },
    /// List policies, optionally only those matching a topic.
    List {
        /// The business.
        #[arg(long)]
        business: Uuid,
        /// Only policies on this topic (matched as `get_policies` does).
        #[arg(long)]
        topic: Option<String>,
    },
}

/// `toolfleet admin keys ...`
#[derive(Subcommand)]
pub enum KeyCommand {
    /// Make a key for a tenant; the key is printed once, only its hash is stored.
    Create {
        /// The tenant every request with this key runs for.
        #[arg(long)]
        tenant: String,
        /// A name to tell keys apart.
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List keys (prefix, tenant, name, created, revoked), optionally one tenant's.
    List {
        /// Only this tenant's keys.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Set a key's limits on the chat-completions loop (an omitted limit is cleared: the
    /// gateway's configuration applies); in force within the gateway's key cache period.
    Limit {
        /// The key's id (from `create` or `list`).
        id: String,
        /// Rounds of fleet calls, 1 to 64.
        #[arg(long)]
        max_rounds: Option<u32>,
        /// Calls of one round, 1 to 256.
        #[arg(long)]
        max_calls_per_round: Option<u32>,
        /// `first` (tools only in the first round) or `burst` (none after the first round
        /// with several calls).
        #[arg(long, value_parser = ["first", "burst"])]
        stop_after: Option<String>,
    },
    /// Revoke a key by id; the gateway refuses it within its key cache period.
    Revoke {
        /// The key's id (from `create` or `list`).
        id: String,
    },
}

impl KeyCommand {
    /// Runs this command on `client`; its JSON answer.
    async fn run(self, client: &Client) -> Result<Value> {
        use toolfleet_keys as keys;
        Ok(match self {
            Self::Create { tenant, name } => {
                json!({"status": "ok", "key": keys::create(client, &tenant, &name).await?})
            }
            Self::List { tenant } => {
                json!({"status": "ok", "keys": keys::list(client, tenant.as_deref()).await?})
            }
            Self::Limit {
                id,
                max_rounds,
                max_calls_per_round,
                stop_after,
            } => {
                let limits = keys::ChatLimits {
                    max_rounds,
                    max_calls_per_round,
                    stop_after: match stop_after.as_deref() {
                        Some("first") => Some(keys::StopAfter::First),
                        Some("burst") => Some(keys::StopAfter::Burst),
                        _ => None,
                    },
                };
                json!({"status": "ok", "key": keys::set_chat_limits(client, &id, limits).await?})
            }
            Self::Revoke { id } => json!({"status": "ok", "key": keys::revoke(client, &id).await?}),
        })
    }
}

/// `toolfleet admin faqs ...`
#[derive(Subcommand)]
pub enum FaqCommand {
    /// Create an FAQ.
    Add {
        /// The business (`businesses.id`).
        #[arg(long)]
        business: Uuid,
        /// The question.
        #[arg(long)]
        question: String,
        /// The answer, as the receptionist will say it.
        #[arg(long)]
        answer: String,
        /// The FAQ's topic; stored as its first tag.
        #[arg(long)]
        topic: Option<String>,
        /// More tags, comma-separated.
        #[arg(long, value_delimiter = ',')]
        tags: Vec<String>,
    },
    /// List FAQs, optionally only those matching a topic (a tag or the question).
    List {
        /// The business.
        #[arg(long)]
        business: Uuid,
        /// Only FAQs on this topic (matched as `get_faqs` does).
        #[arg(long)]
        topic: Option<String>,
    },
}

/// Runs `command` against `database_url` and prints its JSON answer.
pub async fn run(database_url: &str, command: AdminCommand) -> Result<()> {
    let answer = match command {
        AdminCommand::Keda {
            packs,
            lag_threshold,
            partitions,
        } => {
            let names: Vec<&str> = packs.split(',').map(str::trim).collect();
            let tools = toolfleet_packs::tools_for(&names).map_err(anyhow::Error::msg)?;
            let tools: Vec<String> = tools.iter().map(|t| t.definition().name.clone()).collect();
            let fleet = toolfleet_common::Names::default().with_partitions(partitions);
            let yaml = toolfleet_packs::keda::scaled_object(&fleet, &packs, &tools, lag_threshold);
            print!("{yaml}");
            return Ok(());
        }
        AdminCommand::Migrate { seed } => migrate(database_url, seed).await?,
        AdminCommand::Policies { command } => command.run(&connect(database_url).await?).await?,
        AdminCommand::Faqs { command } => command.run(&connect(database_url).await?).await?,
        AdminCommand::Keys { command } => command.run(&connect(database_url).await?).await?,
    };
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(())
}

impl PolicyCommand {
    /// Runs this command on `client`; its JSON answer.
    async fn run(self, client: &Client) -> Result<Value> {
        match self {
            Self::Add {
                business,
                topic,
                content,
            } => add_policy(client, business, &topic, &content).await,
            Self::List { business, topic } => {
                list_policies(client, business, topic.as_deref()).await
            }
        }
    }
}

impl FaqCommand {
    /// Runs this command on `client`; its JSON answer.
    async fn run(self, client: &Client) -> Result<Value> {
        match self {
            Self::Add {
                business,
                question,
                answer,
                topic,
                tags,
            } => add_faq(client, business, &question, &answer, topic, tags).await,
            Self::List { business, topic } => list_faqs(client, business, topic.as_deref()).await,
        }
    }
}

async fn connect(url: &str) -> Result<Client> {
    db::connect_admin(url)
        .await
        .with_context(|| format!("connecting to {url} (set TOOLFLEET_DATABASE_URL)"))
}

async fn migrate(url: &str, seed: bool) -> Result<Value> {
    let created = db::create_database_if_missing(url).await?;
    let mut client = connect(url).await?;
    let applied = db::migrate(&mut client).await?;
    if seed {
        db::seed_demo(&mut client).await?;
    }
    let businesses = client
        .query(
            "SELECT id::text AS id, name FROM businesses ORDER BY name",
            &[],
        )
        .await?
        .iter()
        .map(|r| Ok(json!({"id": text(r, "id")?, "name": text(r, "name")?})))
        .collect::<Result<Vec<Value>>>()?;
    Ok(json!({
        "status": "ok",
        "database_created": created,
        "migrations_applied": applied,
        "seeded": seed,
        "businesses": businesses,
    }))
}

async fn ensure_business(client: &Client, business: Uuid) -> Result<()> {
    let found = client
        .query_opt("SELECT 1 FROM businesses WHERE id = $1", &[&business])
        .await?;
    if found.is_none() {
        bail!("no business {business}");
    }
    Ok(())
}

/// `updated_at` as RFC 3339 UTC text.
const UPDATED_AT: &str =
    "to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS updated_at";

fn text(row: &Row, name: &str) -> Result<String> {
    row.try_get(name).with_context(|| format!("column {name}"))
}

/// `row` as a JSON object, column by column in the order its query lists them (the
/// column names are the keys): `text[]` columns as arrays of strings, every other column
/// as text.
fn row_json(row: &Row) -> Result<Value> {
    let mut object = Map::new();
    for column in row.columns() {
        let name = column.name();
        let value = if *column.type_() == Type::TEXT_ARRAY {
            let list: Vec<String> = row
                .try_get(name)
                .with_context(|| format!("column {name}"))?;
            json!(list)
        } else {
            Value::String(text(row, name)?)
        };
        object.insert(name.to_string(), value);
    }
    Ok(Value::Object(object))
}

async fn add_policy(client: &Client, business: Uuid, topic: &str, content: &str) -> Result<Value> {
    let (topic, content) = (topic.trim(), content.trim());
    if topic.is_empty() || content.is_empty() {
        bail!("a policy needs a topic and content");
    }
    let sql = format!(
        "INSERT INTO policies (business_id, topic, content) VALUES ($1, $2, $3)
         RETURNING id::text, business_id::text, topic, content, {UPDATED_AT}"
    );
    let params: [&(dyn ToSql + Sync); 3] = [&business, &topic, &content];
    insert_one(client, business, &sql, &params, "policy").await
}

async fn list_policies(client: &Client, business: Uuid, topic: Option<&str>) -> Result<Value> {
    let sql = format!(
        "SELECT id::text, business_id::text, topic, content, {UPDATED_AT}
         FROM policies WHERE business_id = $1 AND {}
         ORDER BY topic, updated_at DESC",
        topic_match("topic")
    );
    list_matching(client, business, topic, &sql, "policies").await
}

async fn add_faq(
    client: &Client,
    business: Uuid,
    question: &str,
    answer: &str,
    topic: Option<String>,
    tags: Vec<String>,
) -> Result<Value> {
    let (question, answer) = (question.trim(), answer.trim());
    if question.is_empty() || answer.is_empty() {
        bail!("an FAQ needs a question and an answer");
    }
    let mut all: Vec<String> = Vec::new();
    for tag in topic.into_iter().chain(tags) {
        let tag = tag.trim().to_lowercase();
        if !tag.is_empty() && !all.contains(&tag) {
            all.push(tag);
        }
    }
    let sql = format!(
        "INSERT INTO faqs (business_id, question, answer, tags) VALUES ($1, $2, $3, $4)
         RETURNING id::text, business_id::text, question, answer, tags, {UPDATED_AT}"
    );
    let params: [&(dyn ToSql + Sync); 4] = [&business, &question, &answer, &all];
    insert_one(client, business, &sql, &params, "faq").await
}

async fn list_faqs(client: &Client, business: Uuid, topic: Option<&str>) -> Result<Value> {
    let sql = format!(
        "SELECT id::text, business_id::text, question, answer, tags, {UPDATED_AT}
         FROM faqs f WHERE business_id = $1
           AND (EXISTS (SELECT 1 FROM unnest(f.tags) AS t(tag) WHERE {})
                OR {})
         ORDER BY updated_at DESC",
        topic_match("t.tag"),
        topic_match("f.question")
    );
    list_matching(client, business, topic, &sql, "faqs").await
}

/// Once `business` exists, runs the `INSERT ... RETURNING` `sql` with `params` and
/// answers `{"status": "ok", key: <the row as JSON>}` (see [`row_json`]).
async fn insert_one(
    client: &Client,
    business: Uuid,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
    key: &str,
) -> Result<Value> {
    ensure_business(client, business).await?;
    let row = client.query_one(sql, params).await?;
    Ok(json!({"status": "ok", key: row_json(&row)?}))
}

/// Once `business` exists, runs the `SELECT` `sql` with `$1` the business and `$2` the
/// normalized `topic` (empty: all), and answers `{"status": "ok", key: [<rows as JSON>]}`
/// (see [`row_json`]).
async fn list_matching(
    client: &Client,
    business: Uuid,
    topic: Option<&str>,
    sql: &str,
    key: &str,
) -> Result<Value> {
    ensure_business(client, business).await?;
    let topic = normalize_topic(topic.unwrap_or_default());
    let rows = client.query(sql, &[&business, &topic]).await?;
    let items = rows.iter().map(row_json).collect::<Result<Vec<_>>>()?;
    Ok(json!({"status": "ok", key: items}))
}
