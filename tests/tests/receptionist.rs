//! The receptionist and CRM packs against a real PostgreSQL: tenant scoping, the
//! read-only role, the tenant limits of `examples/receptionist/tenants.json`, the result
//! cache and database failures.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};
use toolfleet_common::call::codes;
use toolfleet_common::job::ProgressNotice;
use toolfleet_common::{CallState, FinalEvent, TurnRequest};
use toolfleet_coordinator::TenantPolicies;
use toolfleet_packs::db::{Db, DbConfig, DbError, DATABASE_UNAVAILABLE};
use toolfleet_packs::{crm_db, receptionist};
use toolfleet_tests::fleet::{
    call, code_at, code_of, crm_call, result_of, tool_calls, turn, value_at, Fleet, Running,
};
use toolfleet_tests::otlp::{OtlpReceiver, ReceivedSpan};
use toolfleet_tests::pg::{
    TestDatabase, BOOKING_A, BOOKING_B, BUSINESS_A, BUSINESS_B, CALLER_PHONE,
};
use toolfleet_tests::{eventually_named, free_port, read_repo_json, repo_path};
use toolfleet_worker::cache::{CacheConfig, ResultCache};
use uuid::Uuid;

const EVENT_WAIT: Duration = Duration::from_secs(10);

/// `(call id, worker id)` of the `started` notices read from `sub` until none came for
/// half a second. Workers send them before their results; the owner relays them as
/// `running`, which may lose the race with `final` for an instant tool, so tests check
/// the notices themselves.
async fn started_notices(sub: &mut async_nats::Subscriber) -> Vec<(String, String)> {
    let mut started = Vec::new();
    for _ in 0..1000 {
        match tokio::time::timeout(Duration::from_millis(500), sub.next()).await {
            Ok(Some(message)) => {
                if let Ok(ProgressNotice::Started {
                    tool_call_id,
                    worker_id,
                    ..
                }) = serde_json::from_slice(&message.payload)
                {
                    started.push((tool_call_id, worker_id));
                }
            }
            _ => break,
        }
    }
    started
}
const RECEPTIONIST_TOOLS: &[&str] = &[
    "get_latest_booking",
    "get_booking_by_id",
    "get_business_services",
    "get_working_hours",
    "get_policies",
    "get_faqs",
];

fn tenants() -> Result<TenantPolicies> {
    TenantPolicies::from_file(&repo_path("examples/receptionist/tenants.json"))
        .map_err(anyhow::Error::msg)
}

/// A fleet whose coordinator uses the receptionist tenants file and whose worker serves
/// the receptionist pack on `db`, with a cache.
struct Receptionist {
    fleet: Fleet,
    db: Db,
    cache: ResultCache,
    _coordinator: Running,
    _worker: Running,
    /// The test database behind `db`, if the test made one; dropped last.
    database: Option<TestDatabase>,
}

impl Receptionist {
    /// A receptionist fleet on a fresh test database.
    async fn on_test_database() -> Result<Self> {
        let database = TestDatabase::create().await?;
        receptionist_fleet(database.db_config(), Some(database)).await
    }

    /// An administrator connection to the test database.
    async fn admin(&self) -> Result<tokio_postgres::Client> {
        self.database
            .as_ref()
            .context("this fleet has no test database")?
            .admin()
            .await
    }
}

/// A receptionist fleet on `db_config`, holding `database` (the test database behind
/// `db_config`, if any).
async fn receptionist_fleet(
    db_config: DbConfig,
    database: Option<TestDatabase>,
) -> Result<Receptionist> {
    let fleet = Fleet::start().await?;
    let mut coordinator = fleet.coordinator_config();
    coordinator.tenants = tenants()?;
    let db = Db::new(db_config);
    let cache = ResultCache::new(CacheConfig::new(fleet.redis.url(), fleet.names.clone()))?;
    let tools = receptionist::tools(&db, Some(&cache));
    let (coordinator, worker) = fleet
        .start_with(coordinator, tools, RECEPTIONIST_TOOLS)
        .await?;
    Ok(Receptionist {
        fleet,
        db,
        cache,
        _coordinator: coordinator,
        _worker: worker,
        database,
    })
}

/// A turn of `tenant` from the caller's phone.
fn call_turn(tenant: &str, decision: Value) -> TurnRequest {
    let mut request = turn(tenant, decision);
    request
        .context
        .insert("customer_phone".into(), json!(CALLER_PHONE));
    request
}

/// Runs a turn of `tenant` from the caller's phone whose decision holds `calls`, and
/// returns its `final` event.
async fn caller_turn(fleet: &Fleet, tenant: &str, calls: Vec<Value>) -> Result<FinalEvent> {
    let request = call_turn(tenant, tool_calls(calls));
    Ok(fleet.run(request, EVENT_WAIT).await?.final_event)
}

/// Asserts that the spoken `text` starts with `opening` and says every one of `parts`.
fn assert_says(text: &str, opening: &str, parts: &[&str]) {
    assert!(text.starts_with(opening), "{text}");
    for part in parts {
        assert!(text.contains(part), "{part} in {text}");
    }
}

fn text_of(value: &Option<Value>) -> String {
    value.as_ref().map(Value::to_string).unwrap_or_default()
}

/// A database URL on loopback `port`, where no PostgreSQL answers.
fn unanswered_db(port: u16) -> DbConfig {
    DbConfig::new(format!("postgres://postgres@127.0.0.1:{port}/toolfleet"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_turn_is_answered_from_postgres() -> Result<()> {
    let r = Receptionist::on_test_database().await?;
    let decision =
        read_repo_json("examples/decisions/receptionist_booking_and_policy.openai.json")?;
    let mut progress = r.fleet.subscribe_progress().await?;
    let outcome = r
        .fleet
        .run(call_turn(BUSINESS_A, decision), EVENT_WAIT)
        .await?;
    let fin = &outcome.final_event;
    assert_eq!(fin.summary.ok, 2, "{fin:?}");
    assert!(!fin.deadline_hit);

    let booking = result_of(fin, "call_booking_01")?;
    assert_eq!(
        value_at(booking, "/booking/booking_id"),
        Some(json!(BOOKING_A))
    );
    assert_eq!(
        value_at(booking, "/booking/status"),
        Some(json!("confirmed"))
    );
    let policy = result_of(fin, "call_policy_02")?;
    assert_eq!(
        value_at(policy, "/policies/0/topic"),
        Some(json!("cancellation"))
    );
    assert_says(
        &fin.text,
        "Your check-up and clean is confirmed for ",
        &["at least 24 hours' notice"],
    );
    // What a caller must never hear stays in the database.
    let everything = serde_json::to_string(fin)?;
    assert!(!everything.contains("Owes $20"));
    assert!(!everything.contains("sarah@example.com"));
    // Both calls were started by a worker.
    let mut started: Vec<String> = started_notices(&mut progress)
        .await
        .into_iter()
        .map(|(call, _)| call)
        .collect();
    started.sort();
    assert_eq!(started, ["call_booking_01", "call_policy_02"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_never_sees_another_tenants_rows() -> Result<()> {
    let r = Receptionist::on_test_database().await?;

    // Business A asks for business B's booking by id, and for the same caller's booking.
    let b_booking = call(
        "b_booking",
        "get_booking_by_id",
        json!({"booking_id": BOOKING_B}),
    );
    let latest = call("latest", "get_latest_booking", json!({}));
    let fin = caller_turn(&r.fleet, BUSINESS_A, vec![b_booking, latest]).await?;
    let b_booking = result_of(&fin, "b_booking")?;
    assert_eq!(
        code_of(b_booking),
        Some(receptionist::BOOKING_NOT_FOUND),
        "{b_booking:?}"
    );
    let latest = result_of(&fin, "latest")?;
    assert_eq!(
        value_at(latest, "/booking/booking_id"),
        Some(json!(BOOKING_A)),
        "{latest:?}"
    );
    assert!(!text_of(&latest.result).contains("blow-dry"));

    // A session without a caller's phone (a staff console) hears a booking by its id;
    // another caller of business A does not, not even from the cache that answer filled.
    let by_id = || {
        call(
            "by_id",
            "get_booking_by_id",
            json!({"booking_id": BOOKING_A}),
        )
    };
    let staff = turn(BUSINESS_A, tool_calls(vec![by_id()]));
    let fin = r.fleet.run(staff, EVENT_WAIT).await?.final_event;
    assert_eq!(
        value_at(result_of(&fin, "by_id")?, "/booking/booking_id"),
        Some(json!(BOOKING_A))
    );
    let mut other_caller = turn(BUSINESS_A, tool_calls(vec![by_id()]));
    other_caller
        .context
        .insert("customer_phone".into(), json!("+61 499 999 999"));
    let fin = r.fleet.run(other_caller, EVENT_WAIT).await?.final_event;
    assert_eq!(
        code_at(&fin, "by_id")?,
        Some(receptionist::BOOKING_NOT_FOUND)
    );

    // Arguments naming business B are refused; A's policy is A's.
    let named_b = call(
        "named_b",
        "get_policies",
        json!({"business_id": BUSINESS_B, "topic": "cancellation"}),
    );
    let own = call("own", "get_policies", json!({"topic": "cancellation"}));
    let fin = caller_turn(&r.fleet, BUSINESS_A, vec![named_b, own]).await?;
    assert_eq!(code_at(&fin, "named_b")?, Some(codes::TENANT_MISMATCH));
    let own = text_of(&result_of(&fin, "own")?.result);
    assert!(own.contains("24 hours"), "{own}");
    assert!(!own.contains("no-shows"), "{own}");

    // The same caller at business B gets B's booking.
    let latest = call("latest", "get_latest_booking", json!({}));
    let fin = caller_turn(&r.fleet, BUSINESS_B, vec![latest]).await?;
    assert_eq!(
        value_at(result_of(&fin, "latest")?, "/booking/booking_id"),
        Some(json!(BOOKING_B))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_role_sees_only_its_business_and_the_hearable_columns() -> Result<()> {
    let database = TestDatabase::create().await?;
    let db = Db::new(database.db_config());
    let a = Uuid::parse_str(BUSINESS_A)?;

    // No business filter in the query: row-level security still scopes it.
    let rows = db
        .query_scoped(a, "SELECT business_id FROM bookings", &[])
        .await?;
    assert!(!rows.is_empty());
    for row in &rows {
        assert_eq!(row.try_get::<_, Uuid>("business_id")?, a);
    }
    let businesses = db.query_scoped(a, "SELECT id FROM businesses", &[]).await?;
    assert_eq!(businesses.len(), 1);

    // Columns a caller must not hear are not readable at all, and nothing can be
    // written.
    for sql in [
        "SELECT internal_notes FROM bookings",
        "SELECT customer_email FROM bookings",
        "SELECT id FROM calls",
        "UPDATE policies SET content = 'x'",
    ] {
        let err = db.query_scoped(a, sql, &[]).await.err();
        assert!(matches!(err, Some(DbError::Query(_))), "{sql}: {err:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_is_a_clear_error() -> Result<()> {
    let r = Receptionist::on_test_database().await?;
    let calls = vec![
        call("absent", "get_policies", json!({})),
        call("blank", "get_faqs", json!({"topic": "  "})),
    ];
    let fin = caller_turn(&r.fleet, BUSINESS_A, calls).await?;
    let absent = result_of(&fin, "absent")?;
    assert_eq!(code_of(absent), Some(codes::INVALID_ARGUMENTS));
    assert!(absent
        .error
        .as_ref()
        .is_some_and(|e| e.message.contains("topic")));
    let blank = result_of(&fin, "blank")?;
    assert_eq!(code_of(blank), Some(receptionist::MISSING_TOPIC));
    assert_eq!(blank.error.as_ref().map(|e| e.retryable), Some(false));
    assert_eq!(blank.attempts, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenants_limits_apply() -> Result<()> {
    let r = Receptionist::on_test_database().await?;
    let calls = vec![
        call("hours", "get_working_hours", json!({})),
        call("services", "get_business_services", json!({})),
        call("third", "get_faqs", json!({"topic": "parking"})),
    ];
    let fin = caller_turn(&r.fleet, BUSINESS_A, calls).await?;
    assert_eq!(result_of(&fin, "hours")?.state, CallState::Done);
    assert_eq!(result_of(&fin, "services")?.state, CallState::Done);
    assert_eq!(code_at(&fin, "third")?, Some(codes::TOO_MANY_CALLS));
    assert!(
        fin.text.contains("Monday to Wednesday 8:00 AM to 5:00 PM"),
        "{}",
        fin.text
    );
    assert!(
        fin.text.contains("teeth whitening (60 minutes, $450)"),
        "{}",
        fin.text
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_identical_call_is_served_from_the_cache() -> Result<()> {
    let r = Receptionist::on_test_database().await?;
    let fleet = &r.fleet;
    let policy = |tenant: &'static str| async move {
        let calls = vec![call(
            "policy",
            "get_policies",
            json!({"topic": "cancellation"}),
        )];
        caller_turn(fleet, tenant, calls).await
    };

    let first = policy(BUSINESS_A).await?;
    let original = text_of(&result_of(&first, "policy")?.result);
    assert!(original.contains("24 hours"), "{original}");
    let stats = r.cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.stores), (0, 1, 1));
    let queries = r.db.stats().queries;

    // Change the row: a result served from the cache still shows the old text.
    let admin = r.admin().await?;
    admin
        .execute(
            "UPDATE policies SET content = 'Changed after caching.' WHERE business_id = $1 AND topic = 'cancellation'",
            &[&Uuid::parse_str(BUSINESS_A)?],
        )
        .await?;

    let mut progress = r.fleet.subscribe_progress().await?;
    let second = policy(BUSINESS_A).await?;
    let cached = result_of(&second, "policy")?;
    assert_eq!(cached.state, CallState::Done);
    assert_eq!(text_of(&cached.result), original);
    assert!(cached.worker_id.is_some());
    assert_eq!(cached.attempts, 1);
    assert_eq!(r.cache.stats().hits, 1);
    assert_eq!(r.db.stats().queries, queries, "a cache hit runs no query");
    // The hit still went through the worker: started, then its result.
    let started = started_notices(&mut progress).await;
    assert_eq!(
        started,
        [(
            "policy".to_string(),
            cached.worker_id.clone().unwrap_or_default()
        )]
    );

    // Another tenant with the same arguments is its own entry.
    let other = policy(BUSINESS_B).await?;
    let other = text_of(&result_of(&other, "policy")?.result);
    assert!(other.contains("no-shows"), "{other}");
    assert_eq!(r.cache.stats().hits, 1);
    assert_eq!(r.db.stats().queries, queries + 1);
    Ok(())
}

/// A worker whose database never answers: `url` refuses connections or stays silent.
async fn assert_database_down(db_config: DbConfig) -> Result<()> {
    let r = receptionist_fleet(db_config, None).await?;
    // A business without limits in the tenants file, so the turn may wait for the retry.
    let tenant = "b3000000-0000-4000-8000-000000000003";
    let started = Instant::now();
    let hours = call("hours", "get_working_hours", json!({}));
    let fin = caller_turn(&r.fleet, tenant, vec![hours]).await?;
    let elapsed = started.elapsed();
    let hours = result_of(&fin, "hours")?;
    assert_eq!(hours.state, CallState::Error, "{hours:?}");
    assert_eq!(code_of(hours), Some(DATABASE_UNAVAILABLE), "{hours:?}");
    assert_eq!(hours.error.as_ref().map(|e| e.retryable), Some(true));
    assert_eq!(
        hours.attempts, 2,
        "a retryable failure is delivered once more"
    );
    assert!(!fin.deadline_hit);
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_database_is_a_retryable_error() -> Result<()> {
    assert_database_down(unanswered_db(free_port()?)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_database_is_a_retryable_error_without_a_hang() -> Result<()> {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let outcome = assert_database_down(unanswered_db(port)).await;
    silent.abort();
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connections_are_replaced() -> Result<()> {
    let database = TestDatabase::create().await?;
    let mut config = database.db_config();
    config.max_connections = 1;
    let r = receptionist_fleet(config, Some(database)).await?;
    let fleet = &r.fleet;
    let hours = |tenant: &'static str| async move {
        let calls = vec![call("hours", "get_working_hours", json!({}))];
        caller_turn(fleet, tenant, calls).await
    };
    let first = hours(BUSINESS_A).await?;
    assert_eq!(result_of(&first, "hours")?.state, CallState::Done);
    assert_eq!(r.db.stats().connections_opened, 1);

    let admin = r.admin().await?;
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await?
        .get(0);
    assert!(killed >= 1);

    // Another business, so the answer cannot come from the cache.
    let second = hours(BUSINESS_B).await?;
    let result = result_of(&second, "hours")?;
    assert_eq!(result.state, CallState::Done, "{result:?}");
    assert!(text_of(&result.result).contains("Harbour Hair Studio"));
    assert_eq!(r.db.stats().connections_opened, 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crm_pack_on_postgres_keeps_its_tools_and_scoping() -> Result<()> {
    let database = TestDatabase::create().await?;
    let fleet = Fleet::start().await?;
    let db = Db::new(database.db_config());
    let tools = crm_db::tools(&db, None);
    let listed = [
        "crm.listUpcomingAppointments",
        "crm.getOpenInvoices",
        "crm.getNextAppointment",
    ];
    let (_c, _w) = fleet
        .start_with(fleet.coordinator_config(), tools, &listed)
        .await?;
    let decision = read_repo_json("examples/decisions/appointments_and_billing.openai.json")?;
    let outcome = fleet.run(turn(BUSINESS_A, decision), EVENT_WAIT).await?;
    let fin = &outcome.final_event;
    assert_eq!(fin.summary.ok, 2, "{fin:?}");
    assert_says(
        &fin.text,
        "You have 2 upcoming appointments: a dental cleaning on ",
        &["You have one open invoice for $150.00"],
    );

    // Business B's customer is invisible to business A.
    let b = crm_call("b", "crm.getOpenInvoices", "cust_101");
    let outcome = fleet
        .run_calls(BUSINESS_A, vec![b], EVENT_WAIT)
        .await
        .context("turn for another business's customer")?;
    assert_eq!(
        code_at(&outcome.final_event, "b")?,
        Some(toolfleet_packs::crm::CUSTOMER_NOT_FOUND)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_hit_still_has_its_execute_tool_span() -> Result<()> {
    let database = TestDatabase::create().await?;
    let receiver = OtlpReceiver::start().await?;
    let mut fleet = Fleet::start().await?;
    let mut coordinator = fleet.coordinator_config();
    coordinator.tenants = tenants()?;
    let _c = fleet.coordinator(coordinator);
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
        ("FLEET_NODE_PACKS", "receptionist".to_string()),
        ("TOOLFLEET_DATABASE_URL", database.url().to_string()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let worker = fleet.spawn_node("worker", &env)?;
    fleet.wait_for_tools(&["get_policies"]).await?;
    for _ in 0..2 {
        let calls = vec![call("policy", "get_policies", json!({"topic": "deposits"}))];
        let fin = caller_turn(&fleet, BUSINESS_A, calls).await?;
        assert_eq!(result_of(&fin, "policy")?.state, CallState::Done);
    }
    fleet
        .terminate_node(worker, Duration::from_secs(15))
        .await?;

    let spans =
        eventually_named("cache spans", Duration::from_secs(10), || {
            let spans = receiver.spans();
            async move {
                (spans.iter().filter(|s| s.name == "tool_cache").count() >= 2).then_some(spans)
            }
        })
        .await?;
    let executes: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| {
            s.attr("gen_ai.operation.name") == Some("execute_tool")
                && s.attr("gen_ai.tool.name") == Some("get_policies")
        })
        .collect();
    assert_eq!(executes.len(), 2, "{executes:#?}");
    let mut hits: Vec<&str> = Vec::new();
    for cache_span in spans.iter().filter(|s| s.name == "tool_cache") {
        assert!(
            executes
                .iter()
                .any(|e| e.span_id == cache_span.parent_span_id),
            "the cache span is a child of the call's execute_tool span: {cache_span:?}"
        );
        hits.push(cache_span.attr("cache.hit").unwrap_or("missing"));
    }
    hits.sort_unstable();
    assert_eq!(hits, ["false", "true"]);
    Ok(())
}
