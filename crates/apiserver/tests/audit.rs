//! The audit log against a real server in a temp dir: one audit.k8s.io/v1 Event line per
//! call (allowed, 403 and 401 alike) with the user, verb and objectRef; at level Request JSON
//! bodies are recorded, Secret data never (neither through kubectl nor a JSON POST).

mod common;

use anyhow::Result;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_is_audited_and_secret_data_never() -> Result<()> {
    common::require_kubectl();
    let path = std::sync::Arc::new(std::sync::Mutex::new(None));
    let p2 = path.clone();
    let t = common::start_with(move |o| {
        let log = o.data_dir.join("audit.log");
        *p2.lock().unwrap() = Some(log.clone());
        o.audit_log = Some((log, ferrovirt_apiserver::audit::Level::Request));
    })
    .await?;
    let log = path.lock().unwrap().clone().unwrap();
    t.kubectl_ok(&["create", "namespace", "a"]).await?;
    t.kubectl_ok(&[
        "-n",
        "a",
        "create",
        "secret",
        "generic",
        "s1",
        "--from-literal=password=SUPERSECRET1",
    ])
    .await?;
    let secret = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "s2", "namespace": "a"},
        "stringData": {"password": "SUPERSECRET2"}, "data": {"k": "U1VQRVJTRUNSRVQz"}});
    let r = t
        .request("POST", "/api/v1/namespaces/a/secrets", Some(secret))
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "cm1", "namespace": "a"}, "data": {"k": "visible"}});
    let r = t
        .request("POST", "/api/v1/namespaces/a/configmaps", Some(cm))
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = t
        .request("GET", "/api/v1/namespaces/a/secrets/s2", None)
        .await?;
    assert_eq!(r.status, 200);
    // Unauthenticated.
    let r = t
        .request_as(
            Some("wrong"),
            "GET",
            "/api/v1/namespaces/a/secrets",
            None,
            vec![],
        )
        .await?;
    assert_eq!(r.status, 401);

    let text = std::fs::read_to_string(&log)?;
    for needle in ["SUPERSECRET", "U1VQRVJTRUNSRVQ", "UPERSECRET"] {
        assert!(!text.contains(needle), "secret data in the audit log");
    }
    let events: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert!(
        events
            .iter()
            .all(|e| e["apiVersion"] == "audit.k8s.io/v1" && e["kind"] == "Event")
    );
    let find = |verb: &str, resource: &str, name: &str| {
        events.iter().find(|e| {
            e["verb"] == verb
                && e["objectRef"]["resource"] == resource
                && (name.is_empty() || e["objectRef"]["name"] == name)
        })
    };
    let created = find("create", "secrets", "").expect("secret create audited");
    assert_eq!(created["user"]["username"], "system:admin");
    assert_eq!(created["objectRef"]["namespace"], "a");
    assert!(created.get("requestObject").is_none());
    let got = find("get", "secrets", "s2").expect("secret get audited");
    assert_eq!(got["responseStatus"]["code"], 200);
    let cm = find("create", "configmaps", "").expect("configmap create audited");
    assert_eq!(cm["requestObject"]["data"]["k"], "visible");
    assert_eq!(cm["level"], "Request");
    assert!(
        events
            .iter()
            .any(|e| e["responseStatus"]["code"] == 401 && e["verb"] == "list"),
        "the 401 is audited"
    );
    // kubectl's discovery and the namespace create are there too.
    assert!(find("create", "namespaces", "").is_some());
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&log)?.permissions());
    assert_eq!(mode & 0o777, 0o600);
    t.shutdown().await;
    Ok(())
}
