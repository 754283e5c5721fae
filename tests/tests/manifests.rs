//! The deployment files agree with the code: `docker-compose.yml` (services, health
//! checks, start order, the scalable worker, Jaeger's ports), the Kubernetes manifests in
//! `deploy/k8s` (probes and resources on every workload, the KEDA trigger on the real
//! stream and tool consumers), and the NATS and Redis credentials they use.

use std::collections::BTreeSet;

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
        names.registry_changed(),
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
            names.catalog(),
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
        assert_eq!(str_at(trigger, &["metadata", "account"]), Some("$G"));
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

#[test]
fn kustomize_builds_the_manifests_when_kubectl_is_installed() -> Result<()> {
    let dir = toolfleet_tests::repo_path("deploy/k8s");
    let output = match std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
    {
        Ok(output) => output,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("kubectl is not installed; kustomize build not checked");
            return Ok(());
        }
        Err(error) => return Err(error.into()),
    };
    if !output.status.success() {
        bail!(
            "kubectl kustomize failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let rendered = String::from_utf8(output.stdout)?;
    let mut kinds = BTreeSet::new();
    for document in serde_norway::Deserializer::from_str(&rendered) {
        let value = Value::deserialize(document)?;
        if let Some(kind) = str_at(&value, &["kind"]) {
            kinds.insert(kind.to_string());
        }
        if str_at(&value, &["kind"]) != Some("Namespace") {
            assert_eq!(
                str_at(&value, &["metadata", "namespace"]),
                Some("toolfleet")
            );
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
    ] {
        assert!(kinds.contains(kind), "no {kind} rendered");
    }
    Ok(())
}

/// Who each ingress rule of a NetworkPolicy admits to which ports: (ports, peers), each
/// peer as `pod:<name label>`, `pods:<part-of label>` or `namespace:<name>`.
fn admitted(policy: &Value) -> Vec<(Vec<String>, Vec<String>)> {
    let rules = at(policy, &["spec", "ingress"]).and_then(Value::as_sequence);
    rules
        .into_iter()
        .flatten()
        .map(|rule| {
            let ports = at(rule, &["ports"])
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
                .filter_map(|p| p.get("port").and_then(scalar))
                .collect();
            let peers = at(rule, &["from"])
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
                .filter_map(|peer| {
                    let pod = |label| str_at(peer, &["podSelector", "matchLabels", label]);
                    let namespace = str_at(
                        peer,
                        &[
                            "namespaceSelector",
                            "matchLabels",
                            "kubernetes.io/metadata.name",
                        ],
                    );
                    pod("app.kubernetes.io/name")
                        .map(|n| format!("pod:{n}"))
                        .or_else(|| pod("app.kubernetes.io/part-of").map(|n| format!("pods:{n}")))
                        .or_else(|| namespace.map(|n| format!("namespace:{n}")))
                })
                .collect();
            (ports, peers)
        })
        .collect()
}

/// The peers a policy admits to `port`.
fn peers_on(policy: &Value, port: &str) -> BTreeSet<String> {
    admitted(policy)
        .into_iter()
        .filter(|(ports, _)| ports.iter().any(|p| p == port))
        .flat_map(|(_, peers)| peers)
        .collect()
}

#[test]
fn network_policies_confine_the_servers_ports() -> Result<()> {
    let objects = k8s_objects()?;
    let nats = named(&objects, "NetworkPolicy", "nats")?;
    assert_eq!(
        str_at(
            nats,
            &[
                "spec",
                "podSelector",
                "matchLabels",
                "app.kubernetes.io/name"
            ]
        ),
        Some("nats")
    );
    let set = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(peers_on(nats, "4222"), set(&["pods:toolfleet"]));
    assert_eq!(peers_on(nats, "8222"), set(&["namespace:keda"]));
    assert_eq!(peers_on(nats, "7777"), set(&["namespace:monitoring"]));
    let redis = named(&objects, "NetworkPolicy", "redis")?;
    assert_eq!(
        peers_on(redis, "6379"),
        set(&["pod:coordinator", "pod:worker"])
    );
    assert_eq!(peers_on(redis, "9121"), set(&["namespace:monitoring"]));
    // Compose publishes the unauthenticated monitoring port on the host's loopback only.
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
    if let Ok(output) = std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(toolfleet_tests::repo_path("deploy/k8s-cluster"))
        .output()
    {
        assert!(
            output.status.success(),
            "kubectl kustomize deploy/k8s-cluster: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
