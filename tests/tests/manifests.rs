//! The deployment files agree with the code: `docker-compose.yml` (services, health
//! checks, start order, the scalable worker, Jaeger's ports), the Kubernetes manifests in
//! `deploy/k8s` (probes and resources on every workload, the KEDA trigger on the real
//! stream and tool consumers), and the NATS and Redis credentials they use.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_norway::Value;
use toolfleet_common::Names;
use toolfleet_packs as packs;
use toolfleet_tests::read_repo_file as repo_file;

fn yaml(path: &str) -> Result<Value> {
    serde_norway::from_str(&repo_file(path)?).with_context(|| format!("parsing {path}"))
}

/// Every document of a multi-document YAML file.
fn yaml_documents(path: &str) -> Result<Vec<Value>> {
    let text = repo_file(path)?;
    let mut documents = Vec::new();
    for document in serde_norway::Deserializer::from_str(&text) {
        let value = Value::deserialize(document).with_context(|| format!("parsing {path}"))?;
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

fn str_at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a str> {
    at(value, path)?.as_str()
}

fn at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(*key))
}

fn strings(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_sequence)
        .map(|seq| seq.iter().filter_map(scalar).collect())
        .unwrap_or_default()
}

/// A string or number as text.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The demo pack's tool names, as the worker binary serves them by default.
fn demo_tools() -> Result<Vec<String>> {
    Ok(packs::tools_for(&["demo"])
        .map_err(anyhow::Error::msg)?
        .iter()
        .map(|t| t.definition().name.clone())
        .collect())
}

fn port_of(addr: &str) -> Option<&str> {
    addr.rsplit_once(':').map(|(_, port)| port)
}

// ----- docker-compose.yml ---------------------------------------------------------------

fn compose_service<'a>(compose: &'a Value, name: &str) -> Result<&'a Value> {
    at(compose, &["services", name]).with_context(|| format!("no service {name}"))
}

fn compose_env<'a>(service: &'a Value, name: &str) -> Option<&'a str> {
    str_at(service, &["environment", name])
}

#[test]
fn compose_runs_every_service_with_a_health_check() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    for name in [
        "nats",
        "redis",
        "jaeger",
        "coordinator",
        "worker",
        "gateway",
        "postgres",
    ] {
        let service = compose_service(&compose, name)?;
        let test = strings(at(service, &["healthcheck", "test"]));
        assert!(
            test.len() > 1,
            "{name} has no usable health check: {test:?}"
        );
    }
    let coordinator = compose_service(&compose, "coordinator")?;
    assert_eq!(
        at(coordinator, &["deploy", "replicas"]).and_then(Value::as_u64),
        Some(2)
    );
    for (service, dependency) in [
        ("coordinator", "nats"),
        ("coordinator", "redis"),
        ("worker", "coordinator"),
        ("gateway", "coordinator"),
    ] {
        assert_eq!(
            str_at(
                compose_service(&compose, service)?,
                &["depends_on", dependency, "condition"]
            ),
            Some("service_healthy"),
            "{service} must start after {dependency} is healthy"
        );
    }
    Ok(())
}

#[test]
fn compose_workers_scale_and_coordinators_are_probed_on_their_http_port() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    let worker = compose_service(&compose, "worker")?;
    // `--scale worker=N` needs a service without a fixed name, host port or replica count.
    assert!(worker.get("container_name").is_none());
    assert!(worker.get("ports").is_none());
    assert!(at(worker, &["deploy", "replicas"]).is_none());
    assert!(compose_service(&compose, "coordinator")?
        .get("ports")
        .is_none());

    for (name, binary) in [
        ("coordinator", "toolfleet-coordinator"),
        ("worker", "toolfleet-worker"),
    ] {
        let service = compose_service(&compose, name)?;
        assert_eq!(strings(service.get("command")), vec![binary.to_string()]);
        let port = compose_env(service, "TOOLFLEET_HTTP_ADDR")
            .and_then(port_of)
            .with_context(|| format!("{name} has no TOOLFLEET_HTTP_ADDR"))?;
        let test = strings(at(service, &["healthcheck", "test"]));
        assert_eq!(
            test,
            ["CMD", "toolfleet-probe", port, "/readyz"].map(String::from),
            "{name}"
        );
        assert_eq!(
            compose_env(service, "OTEL_EXPORTER_OTLP_ENDPOINT"),
            Some("http://jaeger:4318")
        );
        assert_eq!(
            str_at(service, &["build", "dockerfile"]),
            Some("deploy/Dockerfile")
        );
    }
    Ok(())
}

#[test]
fn compose_jaeger_takes_otlp_and_shows_its_ui() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    let jaeger = compose_service(&compose, "jaeger")?;
    let ports = strings(jaeger.get("ports"));
    for wanted in ["16686:16686", "4318:4318"] {
        assert!(ports.iter().any(|p| p == wanted), "{wanted} in {ports:?}");
    }
    assert_eq!(compose_env(jaeger, "COLLECTOR_OTLP_ENABLED"), Some("true"));
    Ok(())
}

/// The host of an OTLP endpoint URL (`http://jaeger:4318` → `jaeger`).
fn endpoint_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or_default();
    authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
}

/// Jaeger takes OTLP traces only and answers `/v1/metrics` with 404, which every
/// process would log as an ERROR once a minute: each compose service, and the
/// Kubernetes config, whose OTLP endpoint is Jaeger (compose's `jaeger` service, the
/// cluster's `jaeger-collector`) turns metrics export off; Prometheus scrapes `/metrics`.
#[test]
fn whatever_exports_to_jaeger_pushes_no_metrics() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    let services = at(&compose, &["services"])
        .and_then(Value::as_mapping)
        .context("no services")?;
    let jaeger: Vec<&str> = services
        .iter()
        .filter(|(_, s)| str_at(s, &["image"]).is_some_and(|i| i.starts_with("jaegertracing/")))
        .filter_map(|(name, _)| name.as_str())
        .collect();
    assert_eq!(jaeger, ["jaeger"]);
    let mut to_jaeger = Vec::new();
    for (name, service) in services {
        let name = name.as_str().unwrap_or_default();
        let Some(endpoint) = compose_env(service, "OTEL_EXPORTER_OTLP_ENDPOINT") else {
            continue;
        };
        if jaeger.contains(&endpoint_host(endpoint)) {
            assert_eq!(
                compose_env(service, "OTEL_METRICS_EXPORTER"),
                Some("none"),
                "{name} exports to Jaeger"
            );
            to_jaeger.push(name);
        }
    }
    for expected in ["coordinator", "worker", "gateway", "cli"] {
        assert!(to_jaeger.contains(&expected), "{expected}: {to_jaeger:?}");
    }
    let config = yaml("deploy/k8s/config.yaml")?;
    let endpoint =
        str_at(&config, &["data", "OTEL_EXPORTER_OTLP_ENDPOINT"]).context("k8s endpoint")?;
    assert!(
        endpoint_host(endpoint).starts_with("jaeger-collector."),
        "{endpoint}"
    );
    assert_eq!(
        str_at(&config, &["data", "OTEL_METRICS_EXPORTER"]),
        Some("none")
    );
    Ok(())
}

#[test]
fn compose_servers_use_the_deploy_configs() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    let nats = compose_service(&compose, "nats")?;
    assert!(strings(nats.get("command")).contains(&"/etc/nats/nats-server.conf".to_string()));
    assert!(strings(nats.get("volumes")).contains(&"./deploy/nats:/etc/nats:ro".to_string()));
    let redis = compose_service(&compose, "redis")?;
    assert!(strings(redis.get("command")).contains(&"/etc/redis/redis.conf".to_string()));
    let redis_conf = repo_file("deploy/redis/redis.conf")?;
    assert!(redis_conf.lines().any(|l| l.trim() == "appendonly yes"));
    assert!(redis_conf
        .lines()
        .any(|l| l.trim() == "aclfile /etc/redis/users.acl"));
    let nats_conf = repo_file("deploy/nats/nats-server.conf")?;
    assert!(nats_conf.contains("jetstream"));
    assert!(nats_conf.contains("include auth.conf"));
    Ok(())
}

#[test]
fn compose_roles_use_their_own_users() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    let redis = compose_service(&compose, "redis")?;
    // Redis takes each user's password from the environment (deploy/redis/start.sh
    // writes it into the ACL file); no committed placeholder is in the compose file.
    assert!(strings(redis.get("command")).contains(&"/etc/redis/start.sh".to_string()));
    assert!(!repo_file("docker-compose.yml")?.contains("toolfleet-dev-"));
    for variable in [
        "TOOLFLEET_REDIS_PASSWORD",
        "TOOLFLEET_REDIS_WORKER_PASSWORD",
        "TOOLFLEET_REDIS_EXPORTER_PASSWORD",
    ] {
        let value = compose_env(redis, variable).unwrap_or_default();
        assert!(
            value.starts_with(&format!("${{{variable}:?")),
            "redis must refuse to start without {variable}: {value:?}"
        );
    }
    let users = nats_users()?;
    for (service, user) in [
        ("coordinator", "coordinator"),
        ("worker", "worker"),
        ("cli", "frontend"),
        ("gateway", "gateway"),
    ] {
        let s = compose_service(&compose, service)?;
        assert_eq!(
            compose_env(s, "TOOLFLEET_NATS_USER"),
            Some(user),
            "{service}"
        );
        assert!(users.contains(user), "{user} is not a NATS user");
        let nats_password = compose_env(s, "TOOLFLEET_NATS_PASSWORD").unwrap_or_default();
        let variable = format!("TOOLFLEET_NATS_{}_PASSWORD", user.to_uppercase());
        assert!(
            nats_password.starts_with(&format!("${{{variable}:?")),
            "{service} must take the password NATS gets: {nats_password}"
        );
        assert!(
            compose_env(compose_service(&compose, "nats")?, &variable).is_some(),
            "NATS gets no {variable}"
        );
        if service == "gateway" {
            // A frontend: no Redis at all, only NATS and its key database.
            assert_eq!(compose_env(s, "TOOLFLEET_REDIS_URL"), None);
        } else if service.starts_with("worker") {
            // Workers: their own Redis user, confined to their tools' keys.
            let redis_url = compose_env(s, "TOOLFLEET_REDIS_URL").unwrap_or_default();
            assert!(
                redis_url.starts_with("redis://worker:${TOOLFLEET_REDIS_WORKER_PASSWORD:?"),
                "{service}: {redis_url}"
            );
        } else if service != "cli" {
            let redis_url = compose_env(s, "TOOLFLEET_REDIS_URL").unwrap_or_default();
            assert!(
                redis_url.starts_with("redis://toolfleet:${TOOLFLEET_REDIS_PASSWORD:?"),
                "{service}: {redis_url}"
            );
        }
    }
    Ok(())
}

// ----- NATS and Redis credentials ----------------------------------------------------

/// The user names declared in `deploy/nats/auth.conf`.
fn nats_users() -> Result<BTreeSet<String>> {
    Ok(repo_file("deploy/nats/auth.conf")?
        .lines()
        .filter_map(|l| l.trim().strip_prefix("user:"))
        .map(|u| u.trim().to_string())
        .collect())
}

/// The text of one user's block in `deploy/nats/auth.conf`.
fn nats_user_block(user: &str) -> Result<String> {
    let conf = repo_file("deploy/nats/auth.conf")?;
    let marker = format!("user: {user}\n");
    let start = conf
        .find(&marker)
        .with_context(|| format!("no user {user}"))?;
    let rest = &conf[start + marker.len()..];
    // A block ends at the next user or at its account's imports or exports.
    let end = ["user: ", "exports:", "imports:"]
        .iter()
        .filter_map(|m| rest.find(m))
        .min()
        .unwrap_or(rest.len());
    Ok(rest[..end].to_string())
}

/// The subjects quoted in a block of `auth.conf`.
fn quoted_subjects(block: &str) -> BTreeSet<String> {
    block
        .split('"')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

fn acl_password(acl: &str, user: &str) -> Result<String> {
    acl.lines()
        .find(|l| l.starts_with(&format!("user {user} ")))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix('>')))
        .map(String::from)
        .with_context(|| format!("no password for the {user} Redis user"))
}

fn fleet_acl_password(acl: &str) -> Result<String> {
    acl_password(acl, "toolfleet")
}

/// The rules of the toolfleet Redis user without its password.
fn fleet_acl_rules(acl: &str) -> Vec<String> {
    acl_rules(acl, "toolfleet")
}

/// The rules of Redis user `user` without its password.
fn acl_rules(acl: &str, user: &str) -> Vec<String> {
    acl.lines()
        .find(|l| l.starts_with(&format!("user {user} ")))
        .map(|l| {
            l.split_whitespace()
                .filter(|w| !w.starts_with('>'))
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// Where the worker user of `deploy/nats/auth.conf` (account `WORKERS`) reaches the
/// JetStream API of the streams (account `FLEET`).
const WORKER_API: &str = "JS.FLEET.API";

#[test]
fn the_nats_worker_user_pulls_exactly_the_demo_tools() -> Result<()> {
    let names = Names::default();
    let stream = names.jobs_stream();
    let granted: BTreeSet<String> = quoted_subjects(&nats_user_block("worker")?)
        .into_iter()
        .filter(|s| {
            s.contains(&format!(".{stream}."))
                || s.starts_with("fleet.results.")
                || s.starts_with("fleet.progress.")
        })
        .collect();
    let mut wanted = BTreeSet::new();
    for tool in demo_tools()? {
        wanted.insert(names.tool_results_wildcard(&tool));
        wanted.insert(names.tool_progress_wildcard(&tool));
        let consumer = names.tool_consumer(&tool);
        wanted.insert(format!("{WORKER_API}.CONSUMER.INFO.{stream}.{consumer}"));
        wanted.insert(format!(
            "{WORKER_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        ));
        wanted.insert(format!("$JS.ACK.{stream}.{consumer}.>"));
    }
    assert_eq!(granted, wanted);
    Ok(())
}

/// Whether NATS subject pattern `outer` matches every subject `inner` matches.
fn subject_covers(outer: &str, inner: &str) -> bool {
    let mut outer = outer.split('.');
    let mut inner = inner.split('.');
    loop {
        match (outer.next(), inner.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(i)) if i != ">" => {}
            (Some(o), Some(i)) if o == i => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// The local subjects of one account's `imports` in `deploy/nats/auth.conf`: `to:` where
/// an import maps its subject, else its `subject:`.
fn nats_imports(account: &str) -> Result<Vec<String>> {
    let conf = repo_file("deploy/nats/auth.conf")?;
    let start = conf
        .find(&format!("  {account}: {{"))
        .with_context(|| format!("no account {account}"))?;
    let rest = &conf[start..];
    let imports = &rest[rest.find("imports:").context("no imports")?..];
    let imports = &imports[..imports.find("\n    ]").context("imports not closed")?];
    let quoted_after = |line: &str, key: &str| {
        let at = line.find(key)? + key.len();
        line[at..].split('"').next().map(String::from)
    };
    Ok(imports
        .lines()
        .filter(|l| l.trim_start().starts_with("{ s"))
        .filter_map(|l| quoted_after(l, "to: \"").or_else(|| quoted_after(l, "subject: \"")))
        .collect())
}

#[test]
fn workers_have_their_own_account_which_imports_every_subject_they_use() -> Result<()> {
    let conf = repo_file("deploy/nats/auth.conf")?;
    let workers = conf.find("  WORKERS: {").context("no WORKERS account")?;
    let fleet = conf.find("  FLEET: {").context("no FLEET account")?;
    // The worker user is declared inside WORKERS, every other user inside FLEET.
    let worker_at = conf.find("user: worker\n").context("no worker user")?;
    let (workers_end, fleet_end) = if workers < fleet {
        (fleet, conf.len())
    } else {
        (conf.len(), workers)
    };
    assert!(worker_at > workers && worker_at < workers_end);
    for user in ["coordinator", "frontend", "frontend2", "gateway"] {
        let at = conf
            .find(&format!("user: {user}\n"))
            .with_context(|| format!("no {user} user"))?;
        assert!(at > fleet && at < fleet_end, "{user} is not in FLEET");
    }
    let imports = nats_imports("WORKERS")?;
    assert!(
        !imports.iter().any(|i| i.starts_with("$JS.API.")),
        "the JetStream API must be imported under {WORKER_API}"
    );
    let inbox = "_INBOX_worker.>";
    for subject in quoted_subjects(&nats_user_block("worker")?) {
        if subject == inbox {
            continue;
        }
        assert!(
            imports.iter().any(|i| subject_covers(i, &subject)),
            "the worker may use {subject}, which WORKERS does not import"
        );
    }
    // Nothing that would let a worker reach the coordinators' or frontends' subjects.
    let names = Names::default();
    for forbidden in [
        names.turn_submit_any(),
        names.jobs_wildcard(),
        names.ended_wildcard(),
        "_INBOX_frontend.>".to_string(),
        format!("$JS.API.CONSUMER.CREATE.{}.>", names.jobs_stream()),
    ] {
        assert!(
            !imports
                .iter()
                .any(|i| subject_covers(i, &forbidden) || subject_covers(&forbidden, i)),
            "WORKERS imports {forbidden}"
        );
    }
    Ok(())
}

#[test]
fn the_nats_users_name_the_real_subjects() -> Result<()> {
    let names = Names::default();
    let coordinator = quoted_subjects(&nats_user_block("coordinator")?);
    for subject in [
        names.jobs_wildcard(),
        names.progress_wildcard(),
        names.ended_wildcard(),
        names.turn_submit(),
        names.catalog(),
        names.catalog_any(),
        names.registry_changed(),
        names.registry_changed_any(),
        format!(
            "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
            names.results_stream(),
            names.results_consumer()
        ),
        format!("$JS.API.STREAM.CREATE.{}", names.jobs_stream()),
        format!("$JS.API.STREAM.CREATE.{}", names.results_stream()),
    ] {
        assert!(
            coordinator.contains(&subject),
            "coordinator lacks {subject}"
        );
    }
    let worker = quoted_subjects(&nats_user_block("worker")?);
    for subject in [names.registry_changed(), names.turn_cancelled_any()] {
        assert!(worker.contains(&subject), "worker lacks {subject}");
    }
    // A worker announces only its own tools, each on its own subject.
    assert!(!worker.contains(&names.registry_changed_any()));
    for tool in [
        "crm.listUpcomingAppointments",
        "crm.getOpenInvoices",
        "crm.getNextAppointment",
    ] {
        let announcement = names.registry_changed_for(tool);
        assert!(
            worker.contains(&announcement),
            "worker lacks {announcement}"
        );
    }
    assert!(!worker.contains(&names.results_wildcard()));
    assert!(!worker.contains(&names.progress_wildcard()));
    assert!(!worker.contains(&names.ended_wildcard()));
    assert!(!worker.contains(&names.turn_submit()));
    assert!(!worker
        .iter()
        .any(|s| s.starts_with("$JS.API.STREAM.CREATE")));
    assert!(coordinator.contains(&names.turn_submit_any()));
    assert!(coordinator.contains(&names.turn_attach_any()));
    assert!(coordinator.contains(&names.turn_attach()));
    assert!(coordinator.contains(&names.turn_cancel_any()));
    assert!(coordinator.contains(&names.turn_cancel()));
    assert!(coordinator.contains(&format!("{}.cancelled.>", names.prefix())));
    // Each frontend submits only as itself and reads only its own inbox.
    for user in ["frontend", "frontend2", "gateway"] {
        let frontend = quoted_subjects(&nats_user_block(user)?);
        let inbox = format!("_INBOX_{user}.>");
        let expected: BTreeSet<String> = [
            names.turn_submit_as(user),
            names.turn_attach_as(user),
            names.turn_cancel_as(user),
            names.catalog_as(user),
            inbox.clone(),
        ]
        .into_iter()
        .collect();
        assert_eq!(frontend, expected);
        assert!(
            coordinator.contains(&inbox),
            "coordinator cannot answer {user}"
        );
    }
    Ok(())
}

#[test]
fn kubernetes_and_compose_redis_users_have_the_same_rights() -> Result<()> {
    let compose_acl = repo_file("deploy/redis/users.acl")?;
    let secrets = yaml_documents("deploy/k8s/secret.yaml")?;
    let k8s_acl = secrets
        .iter()
        .find_map(|d| str_at(d, &["stringData", "users.acl"]))
        .context("no users.acl in deploy/k8s/secret.yaml")?;
    assert_eq!(fleet_acl_rules(&compose_acl), fleet_acl_rules(k8s_acl));
    assert!(!fleet_acl_rules(k8s_acl).is_empty());
    assert_eq!(
        acl_rules(&compose_acl, "worker"),
        acl_rules(k8s_acl, "worker")
    );
    let worker_url = secrets
        .iter()
        .find_map(|d| str_at(d, &["stringData", "TOOLFLEET_WORKER_REDIS_URL"]))
        .context("no TOOLFLEET_WORKER_REDIS_URL secret")?;
    assert!(
        worker_url.starts_with(&format!(
            "redis://worker:{}@",
            acl_password(k8s_acl, "worker")?
        )),
        "{worker_url}"
    );
    let password = fleet_acl_password(k8s_acl)?;
    let url = secrets
        .iter()
        .find_map(|d| str_at(d, &["stringData", "TOOLFLEET_REDIS_URL"]))
        .context("no TOOLFLEET_REDIS_URL secret")?;
    assert!(
        url.starts_with(&format!("redis://toolfleet:{password}@")),
        "{url}"
    );
    Ok(())
}

// ----- Kubernetes ----------------------------------------------------------------------

/// Every object of the kustomization's own files.
fn k8s_objects() -> Result<Vec<Value>> {
    let kustomization = yaml("deploy/k8s/kustomization.yaml")?;
    let mut objects = Vec::new();
    for resource in strings(kustomization.get("resources")) {
        if resource.starts_with("..") {
            continue;
        }
        objects.extend(yaml_documents(&format!("deploy/k8s/{resource}"))?);
    }
    Ok(objects)
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects
        .iter()
        .filter(|o| str_at(o, &["kind"]) == Some(kind))
        .collect()
}

fn named<'a>(objects: &'a [Value], kind: &str, name: &str) -> Result<&'a Value> {
    of_kind(objects, kind)
        .into_iter()
        .find(|o| str_at(o, &["metadata", "name"]) == Some(name))
        .with_context(|| format!("no {kind} {name}"))
}

fn containers(workload: &Value) -> Vec<&Value> {
    at(workload, &["spec", "template", "spec", "containers"])
        .and_then(Value::as_sequence)
        .map(|s| s.iter().collect())
        .unwrap_or_default()
}

fn container_env<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container
        .get("env")?
        .as_sequence()?
        .iter()
        .find(|e| str_at(e, &["name"]) == Some(name))
        .and_then(|e| str_at(e, &["value"]))
}

#[test]
fn every_workload_has_probes_and_resources() -> Result<()> {
    let objects = k8s_objects()?;
    let workloads: Vec<&Value> = ["Deployment", "StatefulSet"]
        .iter()
        .flat_map(|kind| of_kind(&objects, kind))
        .collect();
    assert!(workloads.len() >= 4, "{} workloads", workloads.len());
    for workload in workloads {
        let name = str_at(workload, &["metadata", "name"]).unwrap_or_default();
        let list = containers(workload);
        assert!(!list.is_empty(), "{name} has no containers");
        for container in list {
            for probe in ["livenessProbe", "readinessProbe"] {
                assert!(container.get(probe).is_some(), "{name} has no {probe}");
            }
            for bound in ["requests", "limits"] {
                for resource in ["cpu", "memory"] {
                    assert!(
                        at(container, &["resources", bound, resource]).is_some(),
                        "{name} has no {bound}.{resource}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn fleet_deployments_probe_their_http_endpoints() -> Result<()> {
    let objects = k8s_objects()?;
    for (name, binary, user) in [
        ("coordinator", "toolfleet-coordinator", "coordinator"),
        ("worker", "toolfleet-worker", "worker"),
    ] {
        let deployment = named(&objects, "Deployment", name)?;
        let container = containers(deployment)
            .into_iter()
            .next()
            .with_context(|| format!("{name} has no container"))?;
        assert_eq!(strings(container.get("command")), vec![binary.to_string()]);
        let port = container_env(container, "TOOLFLEET_HTTP_ADDR")
            .and_then(port_of)
            .with_context(|| format!("{name} has no TOOLFLEET_HTTP_ADDR"))?;
        let ports = container
            .get("ports")
            .and_then(Value::as_sequence)
            .context("no ports")?;
        let http = ports
            .iter()
            .find(|p| str_at(p, &["name"]) == Some("http"))
            .context("no http port")?;
        assert_eq!(
            at(http, &["containerPort"])
                .and_then(Value::as_u64)
                .map(|p| p.to_string()),
            Some(port.to_string()),
            "{name}"
        );
        for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
            assert_eq!(
                str_at(container, &[probe, "httpGet", "path"]),
                Some(path),
                "{name} {probe}"
            );
            assert_eq!(
                str_at(container, &[probe, "httpGet", "port"]),
                Some("http"),
                "{name} {probe}"
            );
        }
        assert_eq!(container_env(container, "TOOLFLEET_NATS_USER"), Some(user));
        assert_eq!(
            at(container, &["securityContext", "allowPrivilegeEscalation"])
                .and_then(Value::as_bool),
            Some(false)
        );
        assert_eq!(
            at(
                deployment,
                &[
                    "spec",
                    "template",
                    "spec",
                    "securityContext",
                    "runAsNonRoot"
                ]
            )
            .and_then(Value::as_bool),
            Some(true)
        );
    }
    Ok(())
}

#[test]
fn coordinators_run_two_replicas_under_a_disruption_budget() -> Result<()> {
    let objects = k8s_objects()?;
    let coordinator = named(&objects, "Deployment", "coordinator")?;
    assert_eq!(
        at(coordinator, &["spec", "replicas"]).and_then(Value::as_u64),
        Some(2)
    );
    let labels =
        at(coordinator, &["spec", "template", "metadata", "labels"]).context("no pod labels")?;
    let budget = named(&objects, "PodDisruptionBudget", "coordinator")?;
    let selector = at(budget, &["spec", "selector", "matchLabels"])
        .and_then(Value::as_mapping)
        .context("no budget selector")?;
    for (key, value) in selector {
        assert_eq!(
            labels.get(key),
            Some(value),
            "the budget selects other pods"
        );
    }
    assert_eq!(
        at(budget, &["spec", "minAvailable"]).and_then(Value::as_u64),
        Some(1)
    );
    for service in of_kind(&objects, "Service") {
        let name = str_at(service, &["metadata", "name"]).unwrap_or_default();
        let selector = at(service, &["spec", "selector"])
            .and_then(Value::as_mapping)
            .with_context(|| format!("service {name} has no selector"))?;
        let matches_some = ["Deployment", "StatefulSet"]
            .iter()
            .flat_map(|kind| of_kind(&objects, kind))
            .any(|w| {
                let labels = at(w, &["spec", "template", "metadata", "labels"]);
                selector
                    .iter()
                    .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
            });
        assert!(matches_some, "service {name} selects no workload");
    }
    Ok(())
}

#[test]
fn keda_scales_workers_on_the_tool_consumers_lag() -> Result<()> {
    let objects = k8s_objects()?;
    let names = Names::default();
    let scaled = named(&objects, "ScaledObject", "worker")?;
    let target = str_at(scaled, &["spec", "scaleTargetRef", "name"]).context("no target")?;
    let worker = named(&objects, "Deployment", target)?;
    assert!(
        at(worker, &["spec", "replicas"]).is_none(),
        "KEDA owns the worker replica count"
    );
    let packs_env = containers(worker)
        .into_iter()
        .find_map(|c| container_env(c, "TOOLFLEET_PACKS"))
        .context("the worker names no packs")?;
    assert_eq!(packs_env, "demo");

    let triggers = at(scaled, &["spec", "triggers"])
        .and_then(Value::as_sequence)
        .context("no triggers")?;
    let mut consumers = BTreeSet::new();
    for trigger in triggers {
        assert_eq!(str_at(trigger, &["type"]), Some("nats-jetstream"));
        assert_eq!(
            str_at(trigger, &["metadata", "stream"]),
            Some(names.jobs_stream().as_str())
        );
        let endpoint = str_at(trigger, &["metadata", "natsServerMonitoringEndpoint"])
            .context("no monitoring endpoint")?;
        assert!(endpoint.ends_with(":8222"), "{endpoint}");
        // The account of deploy/nats/auth.conf that holds the streams
        // (tests/tests/keda.rs reads the triggers from a live server's /jsz).
        assert_eq!(str_at(trigger, &["metadata", "account"]), Some("FLEET"));
        if let Some(consumer) = str_at(trigger, &["metadata", "consumer"]) {
            consumers.insert(consumer.to_string());
        }
    }
    let wanted: BTreeSet<String> = demo_tools()?
        .iter()
        .map(|t| names.tool_consumer(t))
        .collect();
    assert!(wanted.contains("tool_crm_getOpenInvoices"));
    assert_eq!(consumers, wanted);
    Ok(())
}

#[test]
fn the_keda_triggers_are_generated_from_the_workers_tools() -> Result<()> {
    let generated = packs::keda::scaled_object(&Names::default(), "demo", &demo_tools()?, 10);
    assert_eq!(
        repo_file("deploy/k8s/worker-scaledobject.yaml")?,
        generated,
        "regenerate with `toolfleet admin keda --packs demo > deploy/k8s/worker-scaledobject.yaml`"
    );
    Ok(())
}

#[test]
fn the_prometheus_rule_carries_the_tested_alert_rules() -> Result<()> {
    let rules = yaml("deploy/prometheus/alerts.yml")?;
    let operator = yaml("deploy/prometheus/prometheusrule.yaml")?;
    assert_eq!(str_at(&operator, &["kind"]), Some("PrometheusRule"));
    assert_eq!(at(&operator, &["spec", "groups"]), at(&rules, &["groups"]));
    Ok(())
}

#[test]
fn the_service_monitor_scrapes_coordinators_workers_and_gateways() -> Result<()> {
    let objects = k8s_objects()?;
    let monitor = yaml("deploy/prometheus/servicemonitor.yaml")?;
    let wanted = strings(
        at(&monitor, &["spec", "selector", "matchExpressions"])
            .and_then(Value::as_sequence)
            .and_then(|s| s.first())
            .and_then(|e| e.get("values")),
    );
    for name in ["coordinator", "worker", "gateway"] {
        assert!(wanted.contains(&name.to_string()), "{wanted:?}");
        let service = of_kind(&objects, "Service")
            .into_iter()
            .find(|s| str_at(s, &["metadata", "labels", "app.kubernetes.io/name"]) == Some(name))
            .with_context(|| format!("no Service labelled {name}"))?;
        let ports = at(service, &["spec", "ports"]).and_then(Value::as_sequence);
        let has_http = ports
            .into_iter()
            .flatten()
            .any(|p| str_at(p, &["name"]) == Some("http"));
        assert!(has_http, "{name}'s Service has no http port");
    }
    Ok(())
}

#[test]
fn nats_and_redis_run_an_exporter_the_service_monitor_scrapes() -> Result<()> {
    let objects = k8s_objects()?;
    let monitor = yaml("deploy/prometheus/servicemonitor-servers.yaml")?;
    let port = at(&monitor, &["spec", "endpoints"])
        .and_then(Value::as_sequence)
        .and_then(|e| e.first())
        .and_then(|e| str_at(e, &["port"]));
    assert_eq!(port, Some("metrics"));
    for name in ["nats", "redis"] {
        let server = named(&objects, "StatefulSet", name)?;
        let exporter = containers(server)
            .into_iter()
            .find(|c| str_at(c, &["name"]) == Some("exporter"))
            .with_context(|| format!("{name} has no exporter"))?;
        let ports = at(exporter, &["ports"]).and_then(Value::as_sequence);
        assert!(ports
            .into_iter()
            .flatten()
            .any(|p| str_at(p, &["name"]) == Some("metrics")));
        let service = named(&objects, "Service", name)?;
        assert_eq!(
            str_at(service, &["metadata", "labels", "app.kubernetes.io/name"]),
            Some(name)
        );
        let ports = at(service, &["spec", "ports"]).and_then(Value::as_sequence);
        assert!(ports
            .into_iter()
            .flatten()
            .any(|p| str_at(p, &["name"]) == Some("metrics")));
    }
    Ok(())
}

#[test]
fn workers_have_a_disruption_budget_and_redis_a_memory_cap() -> Result<()> {
    let objects = k8s_objects()?;
    let budget = named(&objects, "PodDisruptionBudget", "worker")?;
    assert_eq!(
        at(budget, &["spec", "maxUnavailable"]).and_then(Value::as_u64),
        Some(1)
    );
    let conf = repo_file("deploy/redis/redis.conf")?;
    let setting = |key: &str| {
        conf.lines()
            .find_map(|l| l.strip_prefix(&format!("{key} ")))
            .map(str::trim)
            .map(String::from)
    };
    assert_eq!(setting("maxmemory-policy").as_deref(), Some("noeviction"));
    let cap = setting("maxmemory").context("no maxmemory")?;
    let cap_mb: u64 = cap.trim_end_matches("mb").parse()?;
    let redis = named(&objects, "StatefulSet", "redis")?;
    let limit = containers(redis)
        .into_iter()
        .find_map(|c| str_at(c, &["resources", "limits", "memory"]))
        .context("redis has no memory limit")?;
    let limit_mb: u64 = match limit.strip_suffix("Gi") {
        Some(gi) => gi.parse::<u64>()? * 1024,
        None => limit.trim_end_matches("Mi").parse()?,
    };
    assert!(
        cap_mb * 10 <= limit_mb * 8,
        "maxmemory {cap} too close to the limit {limit}"
    );
    Ok(())
}

// ----- Rendered manifests --------------------------------------------------------------

/// Longest a `kubectl kustomize` may take.
const RENDER_TIMEOUT: Duration = Duration::from_secs(120);

/// The `kubectl` (kustomize built in) of tests/python/requirements-kubectl.txt, installed
/// once per build into a virtual environment beside it.
fn kubectl() -> Result<PathBuf> {
    static KUBECTL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let provisioned = KUBECTL.get_or_init(|| {
        let provision = async {
            let python = toolfleet_tests::python::venv(
                env!("CARGO_TARGET_TMPDIR"),
                "tests/python/requirements-kubectl.txt",
            )
            .await?;
            let kubectl = python.with_file_name("kubectl");
            anyhow::ensure!(kubectl.is_file(), "no kubectl at {}", kubectl.display());
            Ok(kubectl)
        };
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|runtime| runtime.block_on(provision))
            .map_err(|e| format!("provisioning kubectl: {e:#}"))
    });
    provisioned.clone().map_err(anyhow::Error::msg)
}

/// Every object `kubectl kustomize <dir>` renders (`dir` relative to the repository).
fn render(dir: &str) -> Result<Vec<Value>> {
    let child = std::process::Command::new(kubectl()?)
        .arg("kustomize")
        .arg(toolfleet_tests::repo_path(dir))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting kubectl")?;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let Ok(output) = rx.recv_timeout(RENDER_TIMEOUT) else {
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        bail!("kubectl kustomize {dir} ran past {RENDER_TIMEOUT:?}");
    };
    let output = output.context("running kubectl")?;
    if !output.status.success() {
        bail!(
            "kubectl kustomize {dir}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let mut objects = Vec::new();
    for document in serde_norway::Deserializer::from_str(std::str::from_utf8(&output.stdout)?) {
        let value = Value::deserialize(document).with_context(|| format!("parsing {dir}"))?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
}

#[test]
fn kustomize_builds_the_manifests() -> Result<()> {
    let objects = render("deploy/k8s")?;
    let mut kinds = BTreeSet::new();
    for value in &objects {
        if let Some(kind) = str_at(value, &["kind"]) {
            kinds.insert(kind.to_string());
        }
        if str_at(value, &["kind"]) != Some("Namespace") {
            assert_eq!(str_at(value, &["metadata", "namespace"]), Some("toolfleet"));
        }
    }
    for kind in [
        "ConfigMap",
        "Secret",
        "Service",
        "Deployment",
        "StatefulSet",
        "PodDisruptionBudget",
        "ScaledObject",
        "NetworkPolicy",
    ] {
        assert!(kinds.contains(kind), "no {kind} rendered");
    }
    Ok(())
}

// ----- Network policies, evaluated on the rendered manifests ---------------------------

/// Where KEDA and Prometheus run (docs/OPERATIONS.md; network-policy.yaml names them).
const KEDA_NAMESPACE: &str = "keda";
const MONITORING_NAMESPACE: &str = "monitoring";

type Labels = BTreeMap<String, String>;

/// A pod of a rendered workload (its replicas share labels and ports), or a stand-in for
/// any other pod of a namespace.
#[derive(Debug)]
struct Pod {
    /// `<namespace>/<workload>`; `<namespace>/<other>` for a stand-in.
    id: String,
    namespace: String,
    labels: Labels,
    /// Container ports: name, number.
    ports: Vec<(Option<String>, u16)>,
    /// The workload it stands for (`None` for a stand-in).
    workload: Option<Value>,
}

fn labels_at(value: Option<&Value>) -> Labels {
    value
        .and_then(Value::as_mapping)
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.as_str()?.to_string(), scalar(v)?)))
        .collect()
}

/// Whether the label selector `selector` selects `labels` (`{}` selects every pod).
fn selects(selector: &Value, labels: &Labels) -> Result<bool> {
    for (key, value) in labels_at(selector.get("matchLabels")) {
        if labels.get(&key) != Some(&value) {
            return Ok(false);
        }
    }
    let expressions = selector
        .get("matchExpressions")
        .and_then(Value::as_sequence);
    for expression in expressions.into_iter().flatten() {
        let key = str_at(expression, &["key"]).context("expression without key")?;
        let values = strings(expression.get("values"));
        let value = labels.get(key);
        let holds = match str_at(expression, &["operator"]) {
            Some("In") => value.is_some_and(|v| values.contains(v)),
            Some("NotIn") => !value.is_some_and(|v| values.contains(v)),
            Some("Exists") => value.is_some(),
            Some("DoesNotExist") => value.is_none(),
            other => bail!("selector operator {other:?}"),
        };
        if !holds {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A rendered overlay's pods, Services and NetworkPolicies, with KEDA's and the
/// monitoring namespace beside it, and a stand-in pod in each namespace for whatever
/// else runs there.
struct Cluster {
    objects: Vec<Value>,
    namespaces: BTreeMap<String, Labels>,
    pods: Vec<Pod>,
}

impl Cluster {
    fn render(dir: &str) -> Result<Self> {
        let objects = render(dir)?;
        let mut namespaces = BTreeMap::new();
        for namespace in of_kind(&objects, "Namespace") {
            let name = str_at(namespace, &["metadata", "name"]).context("namespace name")?;
            let mut labels = labels_at(at(namespace, &["metadata", "labels"]));
            labels.insert("kubernetes.io/metadata.name".into(), name.into());
            namespaces.insert(name.to_string(), labels);
        }
        for name in [KEDA_NAMESPACE, MONITORING_NAMESPACE, "default"] {
            let labels = Labels::from([("kubernetes.io/metadata.name".into(), name.into())]);
            namespaces.insert(name.to_string(), labels);
        }
        let mut pods = Vec::new();
        for kind in ["Deployment", "StatefulSet", "DaemonSet", "Job"] {
            for workload in of_kind(&objects, kind) {
                let name = str_at(workload, &["metadata", "name"]).context("workload name")?;
                let namespace =
                    str_at(workload, &["metadata", "namespace"]).context("workload namespace")?;
                let mut ports = Vec::new();
                for container in containers(workload) {
                    let declared = at(container, &["ports"]).and_then(Value::as_sequence);
                    for port in declared.into_iter().flatten() {
                        let number = at(port, &["containerPort"])
                            .and_then(Value::as_u64)
                            .context("containerPort")?;
                        let name = str_at(port, &["name"]).map(String::from);
                        ports.push((name, u16::try_from(number)?));
                    }
                }
                pods.push(Pod {
                    id: format!("{namespace}/{name}"),
                    namespace: namespace.to_string(),
                    labels: labels_at(at(workload, &["spec", "template", "metadata", "labels"])),
                    ports,
                    workload: Some(workload.clone()),
                });
            }
        }
        for namespace in namespaces.keys() {
            pods.push(Pod {
                id: format!("{namespace}/<other>"),
                namespace: namespace.clone(),
                labels: Labels::new(),
                ports: Vec::new(),
                workload: None,
            });
        }
        Ok(Self {
            objects,
            namespaces,
            pods,
        })
    }

    fn pod(&self, id: &str) -> Result<&Pod> {
        self.pods
            .iter()
            .find(|p| p.id == id)
            .with_context(|| format!("no pod {id}"))
    }

    /// Whether the NetworkPolicies let `from` open a TCP connection to `port` of `to`:
    /// `to`'s ingress and `from`'s egress both admit it.
    fn allows(&self, from: &Pod, to: &Pod, port: u16) -> Result<bool> {
        Ok(self.admits("Ingress", to, from, to, port)?
            && self.admits("Egress", from, to, to, port)?)
    }

    /// Whether the policies isolating `subject` in `direction` admit `peer` on `port` of
    /// `destination` (a pod no such policy selects admits everything).
    fn admits(
        &self,
        direction: &str,
        subject: &Pod,
        peer: &Pod,
        destination: &Pod,
        port: u16,
    ) -> Result<bool> {
        let (rules_key, peers_key) = match direction {
            "Ingress" => ("ingress", "from"),
            _ => ("egress", "to"),
        };
        let isolating = self.isolating(direction, subject)?;
        for policy in &isolating {
            let namespace = str_at(policy, &["metadata", "namespace"]).unwrap_or_default();
            let rules = at(policy, &["spec", rules_key]).and_then(Value::as_sequence);
            for rule in rules.into_iter().flatten() {
                if self.peer_matches(rule.get(peers_key), namespace, peer)?
                    && port_matches(rule.get("ports"), destination, port)?
                {
                    return Ok(true);
                }
            }
        }
        Ok(isolating.is_empty())
    }

    /// The NetworkPolicies that select `subject` for `direction` (`Ingress`, `Egress`).
    fn isolating(&self, direction: &str, subject: &Pod) -> Result<Vec<&Value>> {
        let mut policies = Vec::new();
        for policy in of_kind(&self.objects, "NetworkPolicy") {
            let namespace = str_at(policy, &["metadata", "namespace"]).context("namespace")?;
            let spec = policy.get("spec").context("policy without spec")?;
            let selector = spec
                .get("podSelector")
                .context("policy without podSelector")?;
            if namespace != subject.namespace || !selects(selector, &subject.labels)? {
                continue;
            }
            let types = match spec.get("policyTypes") {
                Some(types) => strings(Some(types)),
                None if spec.get("egress").is_some() => vec!["Ingress".into(), "Egress".into()],
                None => vec!["Ingress".into()],
            };
            if types.iter().any(|t| t == direction) {
                policies.push(policy);
            }
        }
        Ok(policies)
    }

    /// Whether `peers` (a rule's `from` or `to`) of a policy in `namespace` match `pod`.
    fn peer_matches(&self, peers: Option<&Value>, namespace: &str, pod: &Pod) -> Result<bool> {
        let Some(peers) = peers.and_then(Value::as_sequence) else {
            return Ok(true);
        };
        if peers.is_empty() {
            return Ok(true);
        }
        for peer in peers {
            if peer.get("ipBlock").is_some() {
                bail!("an ipBlock peer: not evaluated here, and no pod's address is known");
            }
            let in_namespace = match peer.get("namespaceSelector") {
                Some(selector) => {
                    let labels = self.namespaces.get(&pod.namespace).cloned();
                    selects(selector, &labels.unwrap_or_default())?
                }
                None => pod.namespace == namespace,
            };
            let pod_matches = match peer.get("podSelector") {
                Some(selector) => selects(selector, &pod.labels)?,
                None => true,
            };
            if in_namespace && pod_matches {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The pods and container ports behind `host:port` as a pod in `namespace` resolves
    /// it (`svc`, `svc.ns[.svc.cluster.local]`, `pod.headless-svc`); `None` for a host
    /// outside the cluster.
    fn resolve(
        &self,
        namespace: &str,
        host: &str,
        port: u16,
    ) -> Result<Option<Vec<(String, u16)>>> {
        let parts: Vec<&str> = host.split('.').collect();
        for first in 0..parts.len().min(2) {
            let Some(name) = parts.get(first) else {
                continue;
            };
            let namespace = match parts.get(first + 1) {
                Some(ns) if self.namespaces.contains_key(*ns) => *ns,
                _ => namespace,
            };
            let service = of_kind(&self.objects, "Service").into_iter().find(|s| {
                str_at(s, &["metadata", "name"]) == Some(name)
                    && str_at(s, &["metadata", "namespace"]) == Some(namespace)
            });
            let Some(service) = service else { continue };
            let service_port = at(service, &["spec", "ports"])
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
                .find(|p| at(p, &["port"]).and_then(Value::as_u64) == Some(u64::from(port)))
                .with_context(|| format!("Service {name} has no port {port}"))?;
            return self.backends(service, service_port).map(Some);
        }
        Ok(None)
    }

    /// The pods and container ports `service_port` of `service` sends to.
    fn backends(&self, service: &Value, service_port: &Value) -> Result<Vec<(String, u16)>> {
        let name = str_at(service, &["metadata", "name"]).unwrap_or_default();
        let namespace = str_at(service, &["metadata", "namespace"]).unwrap_or_default();
        let selector = at(service, &["spec", "selector"])
            .with_context(|| format!("Service {name} selects no pods"))?;
        let selector = serde_norway::to_value(BTreeMap::from([("matchLabels", selector)]))?;
        let mut backends = Vec::new();
        for pod in &self.pods {
            if pod.workload.is_none()
                || pod.namespace != namespace
                || !selects(&selector, &pod.labels)?
            {
                continue;
            }
            let target = service_port
                .get("targetPort")
                .or_else(|| service_port.get("port"));
            let number = match target {
                Some(Value::Number(n)) => u16::try_from(n.as_u64().context("port")?)?,
                Some(Value::String(port_name)) => pod
                    .ports
                    .iter()
                    .find(|(n, _)| n.as_deref() == Some(port_name.as_str()))
                    .map(|(_, number)| *number)
                    .with_context(|| format!("{}: no port {port_name} for {name}", pod.id))?,
                _ => bail!("Service {name}: a port without a number"),
            };
            backends.push((pod.id.clone(), number));
        }
        anyhow::ensure!(!backends.is_empty(), "Service {name} has no pods");
        Ok(backends)
    }

    /// The value of every environment variable of `workload`'s containers, through
    /// `envFrom` ConfigMaps and `configMapKeyRef` / `secretKeyRef` values.
    fn environment(&self, workload: &Value) -> Result<Vec<(String, String)>> {
        let namespace = str_at(workload, &["metadata", "namespace"]).unwrap_or_default();
        let data = |kind: &str, name: &str, key: &str| -> Option<String> {
            let object = of_kind(&self.objects, kind).into_iter().find(|o| {
                str_at(o, &["metadata", "name"]) == Some(name)
                    && str_at(o, &["metadata", "namespace"]) == Some(namespace)
            })?;
            str_at(object, &["data", key])
                .or_else(|| str_at(object, &["stringData", key]))
                .map(String::from)
        };
        let mut env = Vec::new();
        for container in containers(workload) {
            let sources = at(container, &["envFrom"]).and_then(Value::as_sequence);
            for source in sources.into_iter().flatten() {
                let Some(name) = str_at(source, &["configMapRef", "name"]) else {
                    continue;
                };
                let map = of_kind(&self.objects, "ConfigMap").into_iter().find(|o| {
                    str_at(o, &["metadata", "name"]) == Some(name)
                        && str_at(o, &["metadata", "namespace"]) == Some(namespace)
                });
                let map = map.with_context(|| format!("no ConfigMap {name}"))?;
                for (key, value) in labels_at(map.get("data")) {
                    env.push((key, value));
                }
            }
            let vars = at(container, &["env"]).and_then(Value::as_sequence);
            for var in vars.into_iter().flatten() {
                let name = str_at(var, &["name"]).context("env without name")?;
                let value = match var.get("valueFrom") {
                    None => str_at(var, &["value"]).map(String::from),
                    Some(from) => {
                        let secret = from.get("secretKeyRef").map(|r| ("Secret", r));
                        let map = from.get("configMapKeyRef").map(|r| ("ConfigMap", r));
                        match secret.or(map) {
                            Some((kind, r)) => {
                                let object = str_at(r, &["name"]).unwrap_or_default();
                                let key = str_at(r, &["key"]).unwrap_or_default();
                                let value = data(kind, object, key);
                                Some(value.with_context(|| format!("no {kind} {object}/{key}"))?)
                            }
                            None => None,
                        }
                    }
                };
                if let Some(value) = value {
                    env.push((name.to_string(), value));
                }
            }
        }
        Ok(env)
    }

    /// The connections the deployment needs, each with why: (from, to, port) → reason.
    /// The fleet's processes to the servers their URLs name (TOOLFLEET_NATS_URL,
    /// TOOLFLEET_REDIS_URL), the NATS pods to their routes, KEDA to the monitoring
    /// endpoint of each ScaledObject trigger, and Prometheus to every port a
    /// ServiceMonitor of deploy/prometheus scrapes. Also the connections that are
    /// admitted though unused: a Redis client whose URL names a server outside the
    /// cluster keeps the base's Redis Service (`redis`) admitted, as the overlay
    /// documents.
    fn needs(&self, monitors: &[Value]) -> Result<(Needs, Needs)> {
        let (mut needs, mut unused) = (Needs::new(), Needs::new());
        for pod in &self.pods {
            let Some(workload) = &pod.workload else {
                continue;
            };
            for (name, value) in self.environment(workload)? {
                if !matches!(name.as_str(), "TOOLFLEET_NATS_URL" | "TOOLFLEET_REDIS_URL") {
                    continue;
                }
                for url in value.split(',') {
                    let (host, port) = host_and_port(url)?;
                    match self.resolve(&pod.namespace, host, port)? {
                        Some(backends) => {
                            for (to, number) in backends {
                                needs.insert((pod.id.clone(), to, number), format!("{name}={url}"));
                            }
                        }
                        None if name == "TOOLFLEET_REDIS_URL" => {
                            for (to, number) in self
                                .resolve(&pod.namespace, "redis", 6379)?
                                .into_iter()
                                .flatten()
                            {
                                unused
                                    .insert((pod.id.clone(), to, number), format!("{name}={url}"));
                            }
                        }
                        None => {}
                    }
                }
            }
            // A NATS server's routes (its ConfigMap's nats-route:// URLs).
            let volumes =
                at(workload, &["spec", "template", "spec", "volumes"]).and_then(Value::as_sequence);
            for volume in volumes.into_iter().flatten() {
                let Some(map) = str_at(volume, &["configMap", "name"]) else {
                    continue;
                };
                let map = of_kind(&self.objects, "ConfigMap")
                    .into_iter()
                    .find(|o| str_at(o, &["metadata", "name"]) == Some(map));
                for (_, text) in labels_at(map.and_then(|m| m.get("data"))) {
                    let routes = text
                        .split_whitespace()
                        .filter(|w| w.starts_with("nats-route://"));
                    for route in routes {
                        let (host, port) = host_and_port(route)?;
                        let backends = self.resolve(&pod.namespace, host, port)?;
                        for (to, number) in backends.with_context(|| {
                            format!("no Service of the cluster resolves {route}")
                        })? {
                            needs.insert((pod.id.clone(), to, number), format!("route {route}"));
                        }
                    }
                }
            }
        }
        let keda = format!("{KEDA_NAMESPACE}/<other>");
        for scaled in of_kind(&self.objects, "ScaledObject") {
            let namespace = str_at(scaled, &["metadata", "namespace"]).unwrap_or_default();
            let triggers = at(scaled, &["spec", "triggers"]).and_then(Value::as_sequence);
            for trigger in triggers.into_iter().flatten() {
                let Some(endpoint) = str_at(trigger, &["metadata", "natsServerMonitoringEndpoint"])
                else {
                    continue;
                };
                let (host, port) = host_and_port(endpoint)?;
                let backends = self.resolve(namespace, host, port)?;
                for (to, number) in backends
                    .with_context(|| format!("no Service of the cluster resolves {endpoint}"))?
                {
                    needs.insert((keda.clone(), to, number), format!("KEDA {endpoint}"));
                }
            }
        }
        let prometheus = format!("{MONITORING_NAMESPACE}/<other>");
        for monitor in monitors
            .iter()
            .filter(|m| str_at(m, &["kind"]) == Some("ServiceMonitor"))
        {
            let selector = at(monitor, &["spec", "selector"]).context("monitor selector")?;
            let namespace = str_at(monitor, &["metadata", "namespace"]).unwrap_or_default();
            let endpoints = at(monitor, &["spec", "endpoints"]).and_then(Value::as_sequence);
            for endpoint in endpoints.into_iter().flatten() {
                let port_name = str_at(endpoint, &["port"]).context("endpoint port")?;
                for service in of_kind(&self.objects, "Service") {
                    let labels = labels_at(at(service, &["metadata", "labels"]));
                    if str_at(service, &["metadata", "namespace"]) != Some(namespace)
                        || !selects(selector, &labels)?
                    {
                        continue;
                    }
                    let ports = at(service, &["spec", "ports"]).and_then(Value::as_sequence);
                    let port = ports
                        .into_iter()
                        .flatten()
                        .find(|p| str_at(p, &["name"]) == Some(port_name));
                    let Some(port) = port else { continue };
                    for (to, number) in self.backends(service, port)? {
                        let why = format!("ServiceMonitor port {port_name}");
                        needs.insert((prometheus.clone(), to, number), why);
                    }
                }
            }
        }
        Ok((needs, unused))
    }
}

/// Whether `ports` (a rule's `ports`; none: every port) admit TCP `port` of
/// `destination`, a named port by `destination`'s own names.
fn port_matches(ports: Option<&Value>, destination: &Pod, port: u16) -> Result<bool> {
    let Some(ports) = ports.and_then(Value::as_sequence) else {
        return Ok(true);
    };
    if ports.is_empty() {
        return Ok(true);
    }
    for rule in ports {
        if str_at(rule, &["protocol"]).unwrap_or("TCP") != "TCP" {
            continue;
        }
        let admitted = match rule.get("port") {
            None => true,
            Some(Value::Number(n)) => {
                let first = n.as_u64().context("port number")?;
                let last = at(rule, &["endPort"])
                    .and_then(Value::as_u64)
                    .unwrap_or(first);
                (first..=last).contains(&u64::from(port))
            }
            Some(Value::String(name)) => destination
                .ports
                .iter()
                .any(|(n, number)| n.as_deref() == Some(name.as_str()) && *number == port),
            Some(other) => bail!("port {other:?}"),
        };
        if admitted {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Connections (from pod, to pod, container port) and why each is there.
type Needs = BTreeMap<(String, String, u16), String>;

/// `host` and `port` of `scheme://[user[:password]@]host:port[/path]` or `host:port`.
fn host_and_port(url: &str) -> Result<(&str, u16)> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = authority
        .rsplit_once(':')
        .with_context(|| format!("{url} names no port"))?;
    Ok((host, port.parse().with_context(|| url.to_string())?))
}

/// Renders `dir` and checks its NetworkPolicies: every needed connection is admitted,
/// and nothing else reaches a pod a policy isolates (any port of it, from any rendered
/// pod or from any other pod of any namespace).
fn policies_admit_exactly_what_is_needed(dir: &str) -> Result<Cluster> {
    let cluster = Cluster::render(dir)?;
    let monitors = render("deploy/prometheus")?;
    let (needs, unused) = cluster.needs(&monitors)?;
    let mut refused = Vec::new();
    for ((from, to, port), why) in &needs {
        if !cluster.allows(cluster.pod(from)?, cluster.pod(to)?, *port)? {
            refused.push(format!("{from} -> {to}:{port} ({why})"));
        }
    }
    assert!(
        refused.is_empty(),
        "{dir}: needed but refused: {refused:#?}"
    );
    let mut admitted = Vec::new();
    for to in cluster.pods.iter().filter(|p| p.workload.is_some()) {
        if cluster.isolating("Ingress", to)?.is_empty() {
            // No policy isolates `to` (the fleet's own HTTP ports): open by design.
            continue;
        }
        for (_, port) in &to.ports {
            for from in &cluster.pods {
                let key = (from.id.clone(), to.id.clone(), *port);
                if cluster.allows(from, to, *port)?
                    && !needs.contains_key(&key)
                    && !unused.contains_key(&key)
                {
                    admitted.push(format!("{} -> {}:{port}", from.id, to.id));
                }
            }
        }
    }
    assert!(
        admitted.is_empty(),
        "{dir}: admitted but not needed: {admitted:#?}"
    );
    Ok(cluster)
}

/// The connections of `cluster`'s needs from `from` to `to`, as ports.
fn needed_ports(
    cluster: &Cluster,
    monitors: &[Value],
    from: &str,
    to: &str,
) -> Result<BTreeSet<u16>> {
    let (needs, _) = cluster.needs(monitors)?;
    Ok(needs
        .keys()
        .filter(|(f, t, _)| f == from && t == to)
        .map(|(_, _, port)| *port)
        .collect())
}

#[test]
fn network_policies_admit_each_fleet_pod_to_what_it_needs_and_nothing_else() -> Result<()> {
    let cluster = policies_admit_exactly_what_is_needed("deploy/k8s")?;
    let monitors = render("deploy/prometheus")?;
    let ports = |from: &str, to: &str| needed_ports(&cluster, &monitors, from, to);
    let one = |port: u16| BTreeSet::from([port]);
    // The needs are found where they should be: every fleet process reaches NATS, the
    // coordinators and workers Redis, KEDA and Prometheus the servers' ports.
    for process in ["coordinator", "worker", "gateway"] {
        assert_eq!(
            ports(&format!("toolfleet/{process}"), "toolfleet/nats")?,
            one(4222)
        );
    }
    for process in ["coordinator", "worker"] {
        assert_eq!(
            ports(&format!("toolfleet/{process}"), "toolfleet/redis")?,
            one(6379)
        );
    }
    assert!(ports("toolfleet/gateway", "toolfleet/redis")?.is_empty());
    assert_eq!(ports("keda/<other>", "toolfleet/nats")?, one(8222));
    assert_eq!(ports("monitoring/<other>", "toolfleet/nats")?, one(7777));
    assert_eq!(ports("monitoring/<other>", "toolfleet/redis")?, one(9121));
    // Pods of the namespace that are not the fleet's are refused, by label.
    let stray = cluster.pod("toolfleet/<other>")?;
    assert!(!cluster.allows(stray, cluster.pod("toolfleet/nats")?, 4222)?);
    assert!(!cluster.allows(
        cluster.pod("toolfleet/redis")?,
        cluster.pod("toolfleet/nats")?,
        4222
    )?);
    Ok(())
}

#[test]
fn cluster_network_policies_admit_the_routes_and_each_fleet_pod_to_what_it_needs() -> Result<()> {
    let cluster = policies_admit_exactly_what_is_needed("deploy/k8s-cluster")?;
    let monitors = render("deploy/prometheus")?;
    let ports = |from: &str, to: &str| needed_ports(&cluster, &monitors, from, to);
    assert_eq!(
        ports("toolfleet/nats", "toolfleet/nats")?,
        BTreeSet::from([6222])
    );
    for process in ["coordinator", "worker", "gateway"] {
        assert_eq!(
            ports(&format!("toolfleet/{process}"), "toolfleet/nats")?,
            BTreeSet::from([4222])
        );
    }
    Ok(())
}

#[test]
fn the_part_of_label_reaches_pod_templates_but_no_selector_or_claim_template() -> Result<()> {
    let label = "app.kubernetes.io/part-of";
    for dir in ["deploy/k8s", "deploy/k8s-cluster"] {
        let objects = render(dir)?;
        for kind in ["Deployment", "StatefulSet"] {
            for workload in of_kind(&objects, kind) {
                let name = str_at(workload, &["metadata", "name"]).unwrap_or_default();
                let template = labels_at(at(workload, &["spec", "template", "metadata", "labels"]));
                assert_eq!(
                    template.get(label).map(String::as_str),
                    Some("toolfleet"),
                    "{dir} {name}"
                );
                let selector = labels_at(at(workload, &["spec", "selector", "matchLabels"]));
                assert!(
                    !selector.contains_key(label),
                    "{dir} {name}: selector {selector:?}"
                );
                let claims =
                    at(workload, &["spec", "volumeClaimTemplates"]).and_then(Value::as_sequence);
                for claim in claims.into_iter().flatten() {
                    let labels = labels_at(at(claim, &["metadata", "labels"]));
                    assert!(
                        labels.is_empty(),
                        "{dir} {name}: claim template labels {labels:?}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn compose_publishes_the_nats_monitoring_port_on_loopback_only() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    let ports = strings(at(compose_service(&compose, "nats")?, &["ports"]));
    assert!(
        ports.iter().any(|p| p == "127.0.0.1:8222:8222"),
        "{ports:?}"
    );
    assert!(!ports.iter().any(|p| p == "8222:8222"), "{ports:?}");
    Ok(())
}

// ----- Clustered engines ---------------------------------------------------------------

#[test]
fn compose_cluster_profile_runs_three_nats_nodes_and_a_redis_cluster() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    let cluster_acl = repo_file("deploy/redis/users-cluster.acl")?;
    let nats_conf = repo_file("deploy/nats/nats-cluster.conf")?;
    for i in 1..=3 {
        let node = compose_service(&compose, &format!("nats-{i}"))?;
        assert_eq!(strings(node.get("profiles")), vec!["cluster".to_string()]);
        assert_eq!(
            compose_env(node, "TOOLFLEET_NATS_SERVER_NAME"),
            Some(format!("nats-{i}").as_str())
        );
        assert!(nats_conf.contains(&format!("nats-route://nats-{i}:6222")));
    }
    for i in 1..=6 {
        let node = compose_service(&compose, &format!("redis-node-{i}"))?;
        assert_eq!(strings(node.get("profiles")), vec!["cluster".to_string()]);
        assert!(strings(node.get("command")).contains(&"/etc/redis/start.sh".to_string()));
    }
    let redis_conf = repo_file("deploy/redis/redis-cluster.conf")?;
    assert!(redis_conf
        .lines()
        .any(|l| l.trim() == "cluster-enabled yes"));
    for service in ["coordinator-clustered", "worker-clustered"] {
        let s = compose_service(&compose, service)?;
        let nats_url = compose_env(s, "TOOLFLEET_NATS_URL").unwrap_or_default();
        assert_eq!(nats_url.split(',').count(), 3, "{service}: {nats_url}");
        assert_eq!(compose_env(s, "TOOLFLEET_STREAM_REPLICAS"), Some("3"));
        let redis_url = compose_env(s, "TOOLFLEET_REDIS_URL").unwrap_or_default();
        let (user, variable) = match service {
            "worker-clustered" => ("worker", "TOOLFLEET_REDIS_WORKER_PASSWORD"),
            _ => ("toolfleet", "TOOLFLEET_REDIS_PASSWORD"),
        };
        assert!(
            redis_url.starts_with(&format!("redis+cluster://{user}:${{{variable}:?")),
            "{service}: {redis_url}"
        );
        // The URL as compose hands it over, with the variable's value in place.
        let resolved =
            redis_url.replacen(&format!("${{{variable}:?set {variable}}}"), "a-password", 1);
        let target = toolfleet_common::redis_client::RedisTarget::parse(&resolved)?;
        assert!(target.is_cluster());
    }
    // The cluster's fleet and worker users have the single server's rights.
    let single_acl = repo_file("deploy/redis/users.acl")?;
    for user in ["toolfleet", "worker"] {
        assert_eq!(
            acl_rules(&cluster_acl, user),
            acl_rules(&single_acl, user),
            "{user}"
        );
    }
    Ok(())
}

#[test]
fn kubernetes_cluster_variant_runs_three_nats_pods_with_replicated_streams() -> Result<()> {
    let overlay = yaml("deploy/k8s-cluster/kustomization.yaml")?;
    assert!(strings(overlay.get("resources")).contains(&"../k8s".to_string()));
    let statefulset = yaml("deploy/k8s-cluster/nats-statefulset.yaml")?;
    assert_eq!(
        at(&statefulset, &["spec", "replicas"]).and_then(Value::as_u64),
        Some(3)
    );
    let conf = repo_file("deploy/k8s-cluster/nats-server.conf")?;
    for i in 0..3 {
        assert!(conf.contains(&format!("nats-route://nats-{i}.nats-headless:6222")));
    }
    let literals = strings(
        overlay
            .get("configMapGenerator")
            .and_then(|g| g.as_sequence())
            .and_then(|g| {
                g.iter()
                    .find(|m| str_at(m, &["name"]) == Some("toolfleet-config"))
            })
            .and_then(|m| m.get("literals")),
    );
    assert!(literals.contains(&"TOOLFLEET_STREAM_REPLICAS=3".to_string()));
    let urls = literals
        .iter()
        .find_map(|l| l.strip_prefix("TOOLFLEET_NATS_URL="))
        .context("TOOLFLEET_NATS_URL")?;
    assert_eq!(urls.split(',').count(), 3);
    let secret = yaml("deploy/k8s-cluster/redis-url.yaml")?;
    let redis_url = str_at(&secret, &["stringData", "TOOLFLEET_REDIS_URL"]).context("redis url")?;
    assert!(toolfleet_common::redis_client::RedisTarget::parse(redis_url)?.is_cluster());
    let rendered = render("deploy/k8s-cluster")?;
    let nats = named(&rendered, "StatefulSet", "nats")?;
    assert_eq!(
        at(nats, &["spec", "replicas"]).and_then(Value::as_u64),
        Some(3)
    );
    Ok(())
}

// ----- Bindings and least privilege -------------------------------------------------------

/// The frontend → tenants bindings of a `TOOLFLEET_FRONTEND_TENANTS` value (a compose
/// `${VAR:-default}` reads as its default).
fn bindings(value: &str) -> BTreeMap<String, Vec<String>> {
    let value = value
        .strip_prefix("${TOOLFLEET_FRONTEND_TENANTS:-")
        .and_then(|v| v.strip_suffix('}'))
        .unwrap_or(value);
    value
        .split(';')
        .filter_map(|entry| entry.split_once('='))
        .map(|(user, tenants)| {
            let tenants = tenants.split(',').map(|t| t.trim().to_string()).collect();
            (user.trim().to_string(), tenants)
        })
        .collect()
}

/// Every frontend user of auth.conf is bound to tenants of its own, the gateway to all.
fn assert_bound(where_: &str, value: Option<&str>) {
    let bound = bindings(value.unwrap_or_default());
    for user in ["frontend", "frontend2"] {
        let tenants = bound.get(user).cloned().unwrap_or_default();
        assert!(
            !tenants.is_empty() && !tenants.iter().any(|t| t == "*"),
            "{where_}: {user} may name any tenant: {value:?}"
        );
    }
    assert_eq!(
        bound.get("gateway").map(Vec::as_slice),
        Some(&["*".to_string()][..]),
        "{where_}: the gateway serves every tenant"
    );
}

#[test]
fn every_shipped_coordinator_binds_frontends_to_their_tenants() -> Result<()> {
    let compose = yaml("docker-compose.yml")?;
    for service in ["coordinator", "coordinator-clustered"] {
        let s = compose_service(&compose, service)?;
        assert_bound(service, compose_env(s, "TOOLFLEET_FRONTEND_TENANTS"));
    }
    let objects = k8s_objects()?;
    let coordinator = named(&objects, "Deployment", "coordinator")?;
    let containers = at(coordinator, &["spec", "template", "spec", "containers"])
        .and_then(Value::as_sequence)
        .context("coordinator containers")?;
    let value = containers
        .iter()
        .filter_map(|c| at(c, &["env"]).and_then(Value::as_sequence))
        .flatten()
        .find(|e| str_at(e, &["name"]) == Some("TOOLFLEET_FRONTEND_TENANTS"))
        .and_then(|e| str_at(e, &["value"]));
    assert_bound("deploy/k8s coordinator", value);
    Ok(())
}

#[test]
fn the_shipped_gateway_reads_its_keys_as_a_least_privilege_user() -> Result<()> {
    let user_of = |url: &str| {
        url.strip_prefix("postgres://")
            .and_then(|rest| rest.split_once(':'))
            .map(|(user, _)| user.to_string())
    };
    let compose = yaml("docker-compose.yml")?;
    let gateway = compose_service(&compose, "gateway")?;
    let url = compose_env(gateway, "TOOLFLEET_DATABASE_URL").unwrap_or_default();
    assert_eq!(
        user_of(url).as_deref(),
        Some("toolfleet_gateway_login"),
        "{url}"
    );
    // The login is made with the database, a member of the read-only role only.
    let postgres = compose_service(&compose, "postgres")?;
    assert!(strings(postgres.get("volumes"))
        .iter()
        .any(|v| v.starts_with("./deploy/postgres:/docker-entrypoint-initdb.d")));
    let script = repo_file("deploy/postgres/10-gateway-login.sh")?;
    assert!(script.contains("CREATE ROLE toolfleet_gateway_login LOGIN NOSUPERUSER"));
    assert!(script.contains("GRANT toolfleet_gateway TO toolfleet_gateway_login"));
    let objects = k8s_objects()?;
    let secret = named(&objects, "Secret", "toolfleet-credentials")?;
    let url = str_at(secret, &["stringData", "TOOLFLEET_GATEWAY_DATABASE_URL"])
        .context("the k8s gateway database URL")?;
    assert_eq!(
        user_of(url).as_deref(),
        Some("toolfleet_gateway_login"),
        "{url}"
    );
    Ok(())
}

/// Every shipped gateway replica signs stream tokens with the one secret of its
/// deployment (a token minted by one replica reads on another and after a restart):
/// compose refuses to start without it, and k8s takes it from the credentials Secret.
#[test]
fn the_shipped_gateways_share_one_stream_token_secret() -> Result<()> {
    const SECRET: &str = "TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET";
    let compose = yaml("docker-compose.yml")?;
    let gateway = compose_service(&compose, "gateway")?;
    let value = compose_env(gateway, SECRET).unwrap_or_default();
    assert!(
        value.starts_with("${TOOLFLEET_GATEWAY_STREAM_TOKEN_PASSWORD:?"),
        "{value:?}"
    );
    let objects = k8s_objects()?;
    let deployment = named(&objects, "Deployment", "gateway")?;
    let reference = containers(deployment)
        .into_iter()
        .filter_map(|c| at(c, &["env"]).and_then(Value::as_sequence))
        .flatten()
        .find(|var| str_at(var, &["name"]) == Some(SECRET))
        .and_then(|var| at(var, &["valueFrom", "secretKeyRef"]))
        .context("the k8s gateway takes no stream-token secret from a Secret")?;
    assert_eq!(str_at(reference, &["name"]), Some("toolfleet-credentials"));
    let key = str_at(reference, &["key"]).context("no key")?;
    let credentials = named(&objects, "Secret", "toolfleet-credentials")?;
    let secret = str_at(credentials, &["stringData", key]).unwrap_or_default();
    assert!(secret.len() >= 32, "{key} must hold at least 32 bytes");
    Ok(())
}

// ----- .dockerignore ------------------------------------------------------------------------

/// Whether one `.dockerignore` pattern, split at `/`, matches the path `segments`
/// whole: `**` spans any number of segments, `*` and `?` stay within one.
fn pattern_matches(pattern: &[&str], segments: &[&str]) -> bool {
    match pattern.split_first() {
        None => segments.is_empty(),
        Some((&"**", rest)) => {
            (0..=segments.len()).any(|skip| pattern_matches(rest, &segments[skip..]))
        }
        Some((first, rest)) => segments.split_first().is_some_and(|(segment, others)| {
            glob_segment(first.as_bytes(), segment.as_bytes()) && pattern_matches(rest, others)
        }),
    }
}

/// `*` and `?` wildcards within one path segment.
fn glob_segment(pattern: &[u8], text: &[u8]) -> bool {
    match pattern.split_first() {
        None => text.is_empty(),
        Some((b'*', rest)) => (0..=text.len()).any(|skip| glob_segment(rest, &text[skip..])),
        Some((b'?', rest)) => !text.is_empty() && glob_segment(rest, &text[1..]),
        Some((c, rest)) => text.first() == Some(c) && glob_segment(rest, &text[1..]),
    }
}

/// The patterns of `.dockerignore`: (excludes, pattern), `!` patterns re-including.
fn dockerignore() -> Result<Vec<(bool, String)>> {
    Ok(repo_file(".dockerignore")?
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| match l.strip_prefix('!') {
            Some(p) => (false, p.trim_matches('/').to_string()),
            None => (true, l.trim_matches('/').to_string()),
        })
        .collect())
}

/// Whether Docker leaves `path` (relative to the context) out of the build context: the
/// last pattern matching it or a folder above it decides.
fn left_out(patterns: &[(bool, String)], path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').collect();
    let mut out = false;
    for (excludes, pattern) in patterns {
        let pattern: Vec<&str> = pattern.split('/').collect();
        if (1..=segments.len()).any(|n| pattern_matches(&pattern, &segments[..n])) {
            out = *excludes;
        }
    }
    out
}

/// The sources of each `COPY`/`ADD` of `dockerfile` that reads the build context (not
/// `--from` another stage), options left out.
fn context_sources(dockerfile: &str) -> Vec<String> {
    let mut sources = Vec::new();
    for line in dockerfile.lines() {
        let mut words = line.split_whitespace();
        let Some(instruction) = words.next() else {
            continue;
        };
        if !["COPY", "ADD"].contains(&instruction.to_ascii_uppercase().as_str()) {
            continue;
        }
        let args: Vec<&str> = words.collect();
        if args.iter().any(|a| a.starts_with("--from=")) {
            continue;
        }
        let paths: Vec<&str> = args.into_iter().filter(|a| !a.starts_with("--")).collect();
        if let Some((_, from)) = paths.split_last() {
            sources.extend(from.iter().map(|s| s.to_string()));
        }
    }
    sources
}

#[test]
fn dockerignore_matching_follows_docker() {
    let patterns = vec![
        (true, "**/target".to_string()),
        (true, ".env".to_string()),
        (true, "**/*.log".to_string()),
        (true, "docs".to_string()),
        (false, "docs/keep.md".to_string()),
    ];
    for path in [
        "target",
        "target/release/toolfleet",
        "examples/tool-crate/target/debug/x",
        ".env",
        "a.log",
        "deep/er/b.log",
        "docs/other.md",
    ] {
        assert!(left_out(&patterns, path), "{path}");
    }
    for path in [
        "targets",
        "src/target.rs",
        ".env.example/x",
        "docs/keep.md",
        "a.logs",
    ] {
        assert!(!left_out(&patterns, path), "{path}");
    }
    assert_eq!(
        context_sources(
            "FROM a AS b\nCOPY . .\nCOPY --from=b /out/ /usr/bin/\nCOPY --chmod=0755 x.sh /y\n"
        ),
        [".", "x.sh"]
    );
}

/// A checkout that has built holds `target/` (gigabytes) and a `.env` of passwords:
/// `.dockerignore` keeps both out of the build context, and nothing the Dockerfile that
/// compose builds from the repository root copies: with `COPY . .`, no file git tracks
/// or would track (untracked, not ignored).
#[test]
fn dockerignore_leaves_out_target_and_env_and_nothing_the_dockerfile_copies() -> Result<()> {
    let patterns = dockerignore()?;
    for path in [
        "target",
        "target/release/toolfleet-coordinator",
        "examples/tool-crate/target/debug/tool",
        ".env",
        ".git/config",
    ] {
        assert!(left_out(&patterns, path), "{path} is in the build context");
    }
    let compose = yaml("docker-compose.yml")?;
    let mut dockerfiles = BTreeSet::new();
    for (name, service) in at(&compose, &["services"])
        .and_then(Value::as_mapping)
        .context("no services")?
    {
        let Some(build) = service.get("build") else {
            continue;
        };
        assert_eq!(str_at(build, &["context"]), Some("."), "{name:?}");
        dockerfiles.insert(
            str_at(build, &["dockerfile"])
                .context("dockerfile")?
                .to_string(),
        );
    }
    assert!(!dockerfiles.is_empty());
    let listed = std::process::Command::new("git")
        .args(["ls-files", "--cached", "--others", "--exclude-standard"])
        .current_dir(toolfleet_tests::repo_path(""))
        .output()
        .context("running git ls-files")?;
    anyhow::ensure!(listed.status.success(), "git ls-files failed");
    let files: Vec<String> = String::from_utf8(listed.stdout)?
        .lines()
        .map(String::from)
        .collect();
    assert!(
        files.iter().any(|f| f == "Cargo.lock"),
        "{} files",
        files.len()
    );
    for dockerfile in &dockerfiles {
        let sources = context_sources(&repo_file(dockerfile)?);
        assert!(
            sources.iter().any(|s| s == "."),
            "{dockerfile}: {sources:?}"
        );
        for source in sources {
            let source = source.trim_end_matches('/');
            let copied: Vec<&String> = files
                .iter()
                .filter(|f| source == "." || *f == source || f.starts_with(&format!("{source}/")))
                .collect();
            assert!(!copied.is_empty(), "{dockerfile}: nothing at {source}");
            let lost: Vec<&&String> = copied.iter().filter(|f| left_out(&patterns, f)).collect();
            assert!(
                lost.is_empty(),
                "{dockerfile} copies {source}, which loses {lost:?}"
            );
        }
    }
    Ok(())
}
