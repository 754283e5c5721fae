//! `toolfleet`: run a local fleet, send the demo turn, submit a decision from a file,
//! list the tool catalog.
//!
//! Owns the command line (flags, subcommands, their defaults), telemetry set-up for
//! this process, and streaming one turn's events to the terminal. It must never hold
//! fleet logic of its own: coordinating, running tools and storing results stay in the
//! coordinator, worker and packs crates, which it only wires together.
//!
//! # Layout
//!
//! | module | what lives there |
//! |---|---|
//! | `toolfleet_cli::conformance` (the library) | `toolfleet conformance`: a worker of any language checked against PROTOCOL §7 |
//! | `toolfleet_cli::local` (the library) | starting a local fleet (servers when none answer, coordinator, worker) |
//! | `toolfleet_cli::process` (the library) | the global flags naming the fleet, telemetry around a command |
//! | `toolfleet_cli::node` (the library) | one coordinator or worker in this process (hidden commands) |
//! | `admin` | database migrations and per-business policies and FAQs |
//! | `print` | rendering turn events for a terminal |
//!
//! The benchmark and the chaos run are developer tools, in `toolfleet-dev` (`devtools/`).

mod admin;
mod print;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::{json, Map, Value};
use toolfleet_common::client::{ClientError, ClientErrorKind, TurnStream};
use toolfleet_common::credentials::NatsCredentials;
use toolfleet_common::telemetry;
use toolfleet_common::turn::CancelOutcome;
use toolfleet_common::{CatalogFormat, FleetClient, TurnEvent, TurnRequest};
use tracing::Instrument;

use toolfleet_cli::local::{self, LocalFleet};
use toolfleet_cli::node;
use toolfleet_cli::process::{self, FleetArgs};

/// The demo's model decision: a recorded OpenAI Chat Completions response for
/// "Show me my appointments and my billing".
const DEMO_DECISION: &str =
    include_str!("../../examples/decisions/appointments_and_billing.openai.json");
const DEMO_MESSAGE: &str = "Show me my appointments and my billing";

/// The environment `toolfleet up` reads beyond its flags, for its help.
const UP_ENVIRONMENT: &str = "\
Environment:
  TOOLFLEET_NATS_URL, TOOLFLEET_REDIS_URL  servers to use; when none answers there, nats-server
                                           and redis-server are started on free loopback ports
  TOOLFLEET_MCP_SERVERS      the MCP servers file of the mcp pack
  TOOLFLEET_HTTP_TOOLS_FILE  the tool declarations of the http pack
  TOOLFLEET_DATABASE_URL     PostgreSQL of the receptionist and crm-db packs and of --gateway
  TOOLFLEET_HTTP_ADDR        the coordinator's /healthz, /readyz, /metrics (the worker's on a
                             free port of the same host); unset: free loopback ports; off: none";

#[derive(Parser)]
#[command(
    name = "toolfleet",
    version,
    about = "Run LLM tool calls on a NATS + Redis worker fleet"
)]
struct Cli {
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a local fleet and send the turn "Show me my appointments and my billing".
    Demo {
        /// CRM customer id of the caller.
        #[arg(long, default_value = "cust_001")]
        customer: String,
        /// Print raw events as JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Run a local fleet (coordinator and worker) until Ctrl-C.
    #[command(after_help = UP_ENVIRONMENT)]
    Up {
        /// Tool packs the worker serves: demo, test, conformance, receptionist and crm-db
        /// (TOOLFLEET_DATABASE_URL), http (TOOLFLEET_HTTP_TOOLS_FILE), mcp
        /// (TOOLFLEET_MCP_SERVERS).
        #[arg(long, value_delimiter = ',', default_value = "demo,test")]
        packs: Vec<String>,
        /// Also serve the HTTP gateway and its live turn page, with a fresh API key for
        /// tenant `demo` (needs PostgreSQL at TOOLFLEET_DATABASE_URL and the
        /// toolfleet-gateway binary beside toolfleet, on PATH or at TOOLFLEET_GATEWAY_BIN).
        #[arg(long)]
        gateway: bool,
        /// Where the gateway listens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        gateway_addr: std::net::SocketAddr,
    },
    /// Submit a model decision (any supported shape) from a JSON file and stream the turn.
    Submit {
        /// The decision file (`-` for stdin).
        file: PathBuf,
        /// Tenant id.
        #[arg(long, default_value = "demo")]
        tenant: String,
        /// What the user said.
        #[arg(long)]
        message: Option<String>,
        /// Turn deadline in milliseconds.
        #[arg(long)]
        deadline_ms: Option<u64>,
        /// Context entries `key=value` handed to every tool.
        #[arg(long = "context", value_parser = parse_kv)]
        context: Vec<(String, String)>,
        /// Start a local fleet for this turn instead of using a running one.
        #[arg(long)]
        local: bool,
        /// Tool packs the local fleet's worker serves (with `--local`).
        #[arg(long, value_delimiter = ',', default_value = "demo,test")]
        packs: Vec<String>,
        /// Print raw events as JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Show a turn this frontend submitted, by id: its stored events up to now, or with
    /// `--watch` everything until its `final`.
    Turn {
        /// The turn id.
        id: String,
        /// Follow the turn until its `final`.
        #[arg(long)]
        watch: bool,
        /// Print raw events as JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a turn this frontend submitted, by id: it ends at once with a `final` in
    /// which every call without a result is `cancelled`. Prints the answer as JSON.
    Cancel {
        /// The turn id.
        id: String,
        /// The turn's tenant (for a frontend that serves several).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Set up the database of the receptionist and CRM packs; manage policies and FAQs.
    Admin {
        /// PostgreSQL URL of a user that may write.
        #[arg(long, env = "TOOLFLEET_DATABASE_URL", default_value = admin::DEFAULT_DATABASE_URL)]
        database_url: String,
        #[command(subcommand)]
        command: admin::AdminCommand,
    },
    /// List the tool catalog.
    Catalog {
        /// openai, anthropic, mcp or native.
        #[arg(long, default_value = "openai")]
        format: CatalogFormat,
        /// Only the tools this tenant may call.
        #[arg(long)]
        tenant: Option<String>,
        /// Start a local fleet to list its tools.
        #[arg(long)]
        local: bool,
    },
    /// Check the worker serving the conformance probe NAME against the worker protocol
    /// (PROTOCOL §7.11): retry NAKs, +TERM, keep-alives, panics, result and definition
    /// types, and with --pid the drain on SIGTERM. Exits 1 when a case fails.
    Conformance {
        /// The probe tool the worker serves.
        #[arg(long, default_value = "conformance.probe")]
        tool: String,
        /// Longest wait of one case, in milliseconds.
        #[arg(long = "timeout-ms", default_value_t = 20_000)]
        timeout_ms: u64,
        /// The worker's process id: the shutdown case sends it SIGTERM.
        #[arg(long)]
        pid: Option<i32>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Node(node::NodeCommand),
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let (service, fleet_node) = match &cli.command {
        Command::Node(node) => (node.service(), true),
        _ => ("toolfleet-cli", false),
    };
    // A process that runs a coordinator (`coordinator`, and the local fleets of `demo`,
    // `submit --local`, `up`) ends a turn's trace with the `turn` span.
    let config = process::telemetry_config(service, fleet_node, service != "toolfleet-worker")?;
    process::run_traced(&config, run(cli)).await
}

/// Where the command's fleet is: the NATS and Redis URLs and the prefix.
struct Servers<'a> {
    nats: &'a str,
    redis: &'a str,
    prefix: &'a str,
}

impl Servers<'_> {
    /// A local fleet serving `packs` on these servers (started when none answer).
    async fn local(&self, packs: &[&str]) -> Result<LocalFleet> {
        LocalFleet::start(self.nats, self.redis, self.prefix, packs).await
    }

    /// A frontend client of a running fleet, with the credentials of the environment.
    async fn client(&self) -> Result<FleetClient> {
        let credentials = NatsCredentials::from_env()?;
        match FleetClient::connect_with(self.nats, self.prefix, &credentials).await {
            Ok(client) => Ok(client),
            Err(error) if error.kind() == ClientErrorKind::Connect => {
                Err(anyhow::Error::new(error).context(no_fleet_at(self.nats)))
            }
            Err(error) => Err(error.into()),
        }
    }
}

impl Servers<'_> {
    /// `error` of a command on a running fleet, with what to do when no coordinator
    /// answered on its NATS.
    fn explain(&self, error: anyhow::Error) -> anyhow::Error {
        let no_coordinator = error
            .downcast_ref::<ClientError>()
            .is_some_and(|e| e.kind() == ClientErrorKind::NoResponders);
        if !no_coordinator {
            return error;
        }
        let (url, prefix) = (self.nats, self.prefix);
        error.context(format!(
            "NATS answers at {url} but no coordinator of prefix {prefix} does: start a fleet \
             with `toolfleet up`, or point TOOLFLEET_NATS_URL (or --nats) and TOOLFLEET_PREFIX \
             (or --prefix) at a running fleet"
        ))
    }
}

/// What to do when no NATS server answers at `url`.
fn no_fleet_at(url: &str) -> String {
    format!(
        "no fleet answers at {url}: start one with `toolfleet up`, or point TOOLFLEET_NATS_URL \
         (or --nats) at a running fleet's NATS"
    )
}

async fn run(cli: Cli) -> Result<()> {
    let fleet = &cli.fleet;
    let servers = Servers {
        nats: &fleet.nats,
        redis: &fleet.redis,
        prefix: &fleet.prefix,
    };
    match cli.command {
        Command::Demo { customer, json } => demo(&servers, &customer, json).await,
        Command::Up {
            packs,
            gateway,
            gateway_addr,
        } => up(&servers, &packs, gateway.then_some(gateway_addr)).await,
        Command::Submit {
            file,
            tenant,
            message,
            deadline_ms,
            context,
            local,
            packs,
            json,
        } => {
            let decision = read_decision(&file)?;
            let request = TurnRequest {
                turn_id: None,
                tenant_id: tenant,
                session_id: None,
                user_message: message,
                decision,
                deadline_ms,
                options: Default::default(),
                context: context
                    .into_iter()
                    .map(|(k, v)| (k, Value::String(v)))
                    .collect(),
            };
            let local_packs = local.then_some(packs.as_slice());
            submit(&servers, request, local_packs, json)
                .await
                .map_err(|e| if local { e } else { servers.explain(e) })
        }
        Command::Admin {
            database_url,
            command,
        } => admin::run(&database_url, command).await,
        Command::Catalog {
            format,
            tenant,
            local,
        } => catalog(&servers, format, tenant, local).await.map_err(|e| {
            if local {
                e
            } else {
                servers.explain(e)
            }
        }),
        Command::Turn { id, watch, json } => show_turn(&servers, &id, watch, json)
            .await
            .map_err(|e| servers.explain(e)),
        Command::Cancel { id, tenant } => cancel_turn(&servers, &id, tenant.as_deref())
            .await
            .map_err(|e| servers.explain(e)),
        Command::Conformance {
            tool,
            timeout_ms,
            pid,
            json,
        } => {
            let settings = toolfleet_cli::conformance::Settings {
                nats_url: fleet.nats.clone(),
                redis_url: fleet.redis.clone(),
                prefix: fleet.prefix.clone(),
                tool,
                timeout: Duration::from_millis(timeout_ms),
                pid,
            };
            conformance(&settings, json).await
        }
        Command::Node(node) => node.run(fleet).await,
    }
}

/// `toolfleet demo`: a local fleet answers the recorded two-call decision.
async fn demo(servers: &Servers<'_>, customer: &str, json: bool) -> Result<()> {
    let fleet = servers.local(&["demo"]).await?;
    let decision: Value = serde_json::from_str(DEMO_DECISION)?;
    let decision = retarget_customer(decision, customer);
    let mut context = Map::new();
    context.insert("customerId".into(), json!(customer));
    println!("user: {DEMO_MESSAGE}");
    let request = TurnRequest {
        turn_id: None,
        tenant_id: "demo".into(),
        session_id: Some("demo-session".into()),
        user_message: Some(DEMO_MESSAGE.into()),
        decision,
        deadline_ms: Some(5_000),
        options: Default::default(),
        context,
    };
    let outcome = stream_turn(&fleet.client, request, json).await;
    fleet.stop().await;
    outcome
}

/// `toolfleet up`: a local fleet serving `packs` until Ctrl-C or SIGTERM, with the HTTP
/// gateway on `gateway` when given.
async fn up(
    servers: &Servers<'_>,
    packs: &[String],
    gateway: Option<std::net::SocketAddr>,
) -> Result<()> {
    // Listening for Ctrl-C and SIGTERM before anything starts: a signal while the
    // servers, the fleet or the gateway are still starting drops what has started (each
    // child process is killed with its handle) instead of ending this process with
    // them left running.
    let stop = toolfleet_common::shutdown::on_signal();
    let names: Vec<&str> = packs.iter().map(String::as_str).collect();
    let started = async {
        let fleet = servers.local(&names).await?;
        println!(
            "fleet up: nats {} redis {} prefix {} (Ctrl-C to stop)",
            fleet.nats_url, fleet.redis_url, servers.prefix
        );
        if let (Some(coordinator), Some(worker)) = (fleet.ops.coordinator, fleet.ops.worker) {
            println!("ops endpoints (/healthz, /readyz, /metrics): coordinator http://{coordinator}, worker http://{worker}");
        }
        let tools = fleet.tool_names();
        println!("serving {} tools: {}", tools.len(), tools.join(", "));
        let served = match gateway {
            Some(addr) => Some(local::LocalGateway::start(&fleet, servers.prefix, addr).await?),
            None => None,
        };
        anyhow::Ok((fleet, served))
    };
    let (fleet, served) = tokio::select! {
        started = started => started?,
        () = stop.cancelled() => return Ok(()),
    };
    stop.cancelled().await;
    if let Some(gateway) = served {
        gateway.stop().await;
    }
    fleet.stop().await;
    Ok(())
}

/// The decision in `file` (`-` for stdin), as JSON.
fn read_decision(file: &std::path::Path) -> Result<Value> {
    let text = if file.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?
    };
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))
}

/// `toolfleet submit`: streams `request` on a running fleet, or on a local one serving
/// `local_packs` when given.
async fn submit(
    servers: &Servers<'_>,
    request: TurnRequest,
    local_packs: Option<&[String]>,
    json: bool,
) -> Result<()> {
    let Some(packs) = local_packs else {
        return stream_turn(&servers.client().await?, request, json).await;
    };
    let names: Vec<&str> = packs.iter().map(String::as_str).collect();
    let fleet = servers.local(&names).await?;
    let outcome = stream_turn(&fleet.client, request, json).await;
    fleet.stop().await;
    outcome
}

/// `toolfleet turn ID`: the turn's stored events (a finished turn to its `final`), then,
/// with `watch`, its later ones until `final`.
async fn show_turn(servers: &Servers<'_>, id: &str, watch: bool, json: bool) -> Result<()> {
    let client = servers.client().await?;
    let span = tracing::Span::none();
    let mut stream = client.attach(id).await?;
    let idle = (!watch).then_some(Duration::from_millis(500));
    print_until_end(&mut stream, json, Instant::now(), &span, idle).await
}

/// `toolfleet cancel ID`: cancels the turn and prints what the cancel did; an error
/// when no turn `id` of this frontend is stored.
async fn cancel_turn(servers: &Servers<'_>, id: &str, tenant: Option<&str>) -> Result<()> {
    let client = servers.client().await?;
    let reply = client.cancel(id, tenant, CANCEL_WAIT).await?;
    println!("{}", serde_json::to_string(&reply)?);
    match reply.outcome {
        CancelOutcome::Cancelled | CancelOutcome::AlreadyEnded => Ok(()),
        other => anyhow::bail!("turn {id} was not cancelled: {other:?}"),
    }
}

/// `toolfleet catalog`: the tools with a live worker, in `format`.
async fn catalog(
    servers: &Servers<'_>,
    format: CatalogFormat,
    tenant: Option<String>,
    local: bool,
) -> Result<()> {
    let fleet = if local {
        Some(servers.local(&["demo", "test"]).await?)
    } else {
        None
    };
    let client = match &fleet {
        Some(f) => f.client.clone(),
        None => servers.client().await?,
    };
    let tools = client
        .catalog(format, tenant, Duration::from_secs(5))
        .await?;
    println!("{}", serde_json::to_string_pretty(&tools)?);
    if let Some(f) = fleet {
        f.stop().await;
    }
    Ok(())
}

/// `toolfleet conformance`: the report on the terminal (or as JSON); an error when a
/// case failed.
async fn conformance(settings: &toolfleet_cli::conformance::Settings, json: bool) -> Result<()> {
    let report = match toolfleet_cli::conformance::run(settings).await {
        Ok(report) => report,
        Err(error @ toolfleet_cli::conformance::ConformanceError::Nats(_)) => {
            return Err(anyhow::Error::new(error).context(no_fleet_at(&settings.nats_url)))
        }
        Err(error) => return Err(error.into()),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    if !report.passed() {
        anyhow::bail!("the worker serving {} does not conform", settings.tool);
    }
    Ok(())
}

/// Points every call's `customerId` argument at `customer`.
fn retarget_customer(mut decision: Value, customer: &str) -> Value {
    let arguments = json!({ "customerId": customer }).to_string();
    if let Some(calls) = decision
        .pointer_mut("/choices/0/message/tool_calls")
        .and_then(Value::as_array_mut)
    {
        for call in calls {
            if let Some(f) = call.get_mut("function") {
                f["arguments"] = Value::String(arguments.clone());
            }
        }
    }
    decision
}

async fn stream_turn(client: &FleetClient, request: TurnRequest, json: bool) -> Result<()> {
    let span = tracing::info_span!(
        "submit turn",
        otel.kind = "client",
        toolfleet.tenant.id = %request.tenant_id,
        toolfleet.turn.id = tracing::field::Empty,
        toolfleet.turn.deadline_hit = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    let outcome = stream_turn_in(client, request, json, &span)
        .instrument(span.clone())
        .await;
    if let Err(error) = &outcome {
        let code = match error.downcast_ref::<TurnFailed>() {
            Some(failed) => failed.code.clone(),
            None => "client_error".to_string(),
        };
        telemetry::set_error(&span, &code, &error.to_string());
    }
    outcome
}

/// The turn ended with a turn-level `error` event.
#[derive(Debug, thiserror::Error)]
#[error("turn failed: {code}: {message}")]
struct TurnFailed {
    code: String,
    message: String,
}

async fn stream_turn_in(
    client: &FleetClient,
    request: TurnRequest,
    json: bool,
    span: &tracing::Span,
) -> Result<()> {
    let started = Instant::now();
    let mut stream = client.submit(request).await?;
    span.record("toolfleet.turn.id", stream.turn_id());
    if !json {
        println!("turn {}", stream.turn_id());
        if let Some(trace_id) = telemetry::trace_id(span) {
            println!("trace {trace_id}");
        }
    }
    // Ctrl-C cancels the turn; its `final` (the cancelled calls) is still printed.
    tokio::select! {
        outcome = print_until_end(&mut stream, json, started, span, None) => return outcome,
        _ = tokio::signal::ctrl_c() => {}
    }
    let turn_id = stream.turn_id().to_string();
    let reply = client.cancel(&turn_id, None, CANCEL_WAIT).await?;
    if !json {
        println!("cancel   {:?}", reply.outcome);
    }
    print_until_end(&mut stream, json, started, span, None).await
}

/// How long `toolfleet cancel` and Ctrl-C on `toolfleet submit` wait for a coordinator
/// to answer a cancel.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// Prints the turn's events until `final` or `error`; with `idle`, also stops (with
/// success) after that long without an event.
async fn print_until_end(
    stream: &mut TurnStream,
    json: bool,
    started: Instant,
    span: &tracing::Span,
    idle: Option<Duration>,
) -> Result<()> {
    loop {
        let event = match stream
            .next_event(idle.unwrap_or(Duration::from_secs(30)))
            .await
        {
            Ok(event) => event,
            Err(e) if idle.is_some() && e.kind() == ClientErrorKind::Timeout => {
                if !json {
                    println!(
                        "         running    (seq {} so far; --watch follows it)",
                        stream.last_seq()
                    );
                }
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        if json {
            println!("{}", serde_json::to_string(&event)?);
        } else {
            print::event(&event, started.elapsed());
        }
        match event {
            TurnEvent::Final(fin) => {
                span.record("toolfleet.turn.deadline_hit", fin.deadline_hit);
                if fin.deadline_hit {
                    let message = "the turn's deadline passed before every result was in";
                    telemetry::set_error(span, "deadline_exceeded", message);
                }
                return Ok(());
            }
            TurnEvent::Error { error, .. } => {
                return Err(TurnFailed {
                    code: error.code,
                    message: error.message,
                }
                .into())
            }
            _ => {}
        }
    }
}
