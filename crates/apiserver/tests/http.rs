//! REST semantics over raw HTTPS: auth, errors, optimistic concurrency, pagination, status
//! subresource, finalizers, garbage collection, namespaces, watch.

mod common;

use std::time::Duration;

use anyhow::Result;
use serde_json::{Value, json};

const CMS: &str = "/api/v1/namespaces/default/configmaps";
const VMS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachines";

fn cm(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v"}})
}

fn vm(name: &str) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "128Mi"}}}}}}
    })
}

async fn wait_until<F, Fut>(what: &str, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline {
        if f().await? {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("timed out waiting for {what}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_errors_and_limits() -> Result<()> {
    let t = common::start().await?;
    let r = t
        .request_as(None, "GET", "/api/v1/namespaces", None, vec![])
        .await?;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["kind"], "Status");
    assert_eq!(r.json()["reason"], "Unauthorized");
    let r = t
        .request_as(Some("wrong"), "GET", "/api", None, vec![])
        .await?;
    assert_eq!(r.status, 401);
    assert_eq!(
        t.request_as(None, "GET", "/healthz", None, vec![])
            .await?
            .status,
        200
    );

    // 404 with a kubectl-style message.
    let r = t.request("GET", &format!("{VMS}/nope"), None).await?;
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json()["message"],
        "virtualmachines.kubevirt.io \"nope\" not found"
    );
    assert_eq!(r.json()["details"]["group"], "kubevirt.io");
    assert_eq!(
        t.request("GET", "/apis/nope.io/v1/things", None)
            .await?
            .status,
        404
    );

    // Bad names → 422 Invalid with a field cause.
    let r = t.request("POST", CMS, Some(cm("Bad_Name"))).await?;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["reason"], "Invalid");
    assert_eq!(r.json()["details"]["causes"][0]["field"], "metadata.name");

    // Missing namespace → 404; namespace mismatch, wrong kind, malformed body → 400.
    let r = t
        .request("POST", "/api/v1/namespaces/ghost/configmaps", Some(cm("a")))
        .await?;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["message"], "namespaces \"ghost\" not found");
    let mut other_ns = cm("a");
    other_ns["metadata"]["namespace"] = json!("kube-system");
    assert_eq!(t.request("POST", CMS, Some(other_ns)).await?.status, 400);
    assert_eq!(t.request("POST", CMS, Some(vm("a"))).await?.status, 400);
    let token = t.srv().token.clone();
    let r = t
        .request_as(
            Some(&token),
            "POST",
            CMS,
            Some("application/json"),
            b"{not json".to_vec(),
        )
        .await?;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["reason"], "BadRequest");

    // YAML bodies are accepted.
    let yaml = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: from-yaml\ndata:\n  a: b\n";
    let r = t
        .request_as(
            Some(&token),
            "POST",
            CMS,
            Some("application/yaml"),
            yaml.as_bytes().to_vec(),
        )
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());

    // 413 above the body limit, and nothing written.
    let big = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big"},
                     "data": {"blob": "x".repeat(4 * 1024 * 1024)}});
    let r = t.request("POST", CMS, Some(big)).await?;
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["reason"], "RequestEntityTooLarge");
    assert_eq!(
        t.request("GET", &format!("{CMS}/big"), None).await?.status,
        404
    );

    // Duplicate create → 409 AlreadyExists.
    assert_eq!(t.request("POST", CMS, Some(cm("dup"))).await?.status, 201);
    let r = t.request("POST", CMS, Some(cm("dup"))).await?;
    assert_eq!(r.status, 409);
    assert_eq!(r.json()["reason"], "AlreadyExists");

    // Unsupported verbs and media types.
    assert_eq!(
        t.request("POST", &format!("{CMS}/dup"), Some(cm("dup")))
            .await?
            .status,
        405
    );
    let r = t
        .request_as(
            Some(&token),
            "PATCH",
            &format!("{CMS}/dup"),
            Some("application/apply-patch+cbor"),
            b"{}".to_vec(),
        )
        .await?;
    assert_eq!(r.status, 415);
    // Server-side apply (approximated as a strategic merge) needs a field manager...
    let apply = |path: String, body: &'static str| {
        let token = token.clone();
        let t = &t;
        async move {
            t.request_as(
                Some(&token),
                "PATCH",
                &path,
                Some("application/apply-patch+yaml"),
                body.as_bytes().to_vec(),
            )
            .await
        }
    };
    assert_eq!(apply(format!("{CMS}/ssa"), "{}").await?.status, 400);
    // ...creates when absent and merges when present.
    let r = apply(
        format!("{CMS}/ssa?fieldManager=test&force=true"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\ndata:\n  a: '1'\n",
    )
    .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = apply(
        format!("{CMS}/ssa?fieldManager=test"),
        r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"ssa"},"data":{"b":"2"}}"#,
    )
    .await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data"], json!({"a": "1", "b": "2"}));
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_update_conflict_generation_status() -> Result<()> {
    let t = common::start().await?;
    let created = t.request("POST", VMS, Some(vm("v1"))).await?;
    assert_eq!(created.status, 201, "{}", created.text());
    let c = created.json();
    assert_eq!(c["metadata"]["generation"], 1);
    assert!(c["metadata"]["uid"].as_str().is_some_and(|u| u.len() == 36));
    assert!(c["metadata"]["creationTimestamp"].is_string());
    let rv0 = c["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();

    // generateName
    let mut g = vm("");
    g["metadata"] = json!({"generateName": "gen-"});
    let r = t.request("POST", VMS, Some(g)).await?;
    assert_eq!(r.status, 201);
    assert!(
        r.json()["metadata"]["name"]
            .as_str()
            .unwrap()
            .starts_with("gen-")
    );

    // Update bumps generation on spec change; stale resourceVersion → 409.
    let mut u = c.clone();
    u["spec"]["runStrategy"] = json!("Always");
    let r = t
        .request("PUT", &format!("{VMS}/v1"), Some(u.clone()))
        .await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["metadata"]["generation"], 2);
    let r = t.request("PUT", &format!("{VMS}/v1"), Some(u)).await?;
    assert_eq!(r.status, 409);
    assert_eq!(r.json()["reason"], "Conflict");
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("the object has been modified")
    );

    // Status via /status does not bump generation; status on the main resource is ignored.
    let cur = t.request("GET", &format!("{VMS}/v1"), None).await?.json();
    let mut s = cur.clone();
    s["status"] = json!({"printableStatus": "Starting"});
    let r = t
        .request("PUT", &format!("{VMS}/v1/status"), Some(s))
        .await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["metadata"]["generation"], 2);
    assert_eq!(r.json()["status"]["printableStatus"], "Starting");
    let r = t.request("GET", &format!("{VMS}/v1/status"), None).await?;
    assert_eq!(r.json()["status"]["printableStatus"], "Starting");
    let mut m = r.json();
    m["status"] = json!({"printableStatus": "Hacked"});
    m["metadata"]["labels"] = json!({"x": "y"});
    let r = t.request("PUT", &format!("{VMS}/v1"), Some(m)).await?;
    assert_eq!(r.json()["status"]["printableStatus"], "Starting");
    assert_eq!(r.json()["metadata"]["labels"]["x"], "y");
    assert_eq!(r.json()["metadata"]["generation"], 2);
    assert_ne!(r.json()["metadata"]["resourceVersion"], json!(rv0));

    // Name mismatch between URL and body → 400.
    let r = t.request("PUT", &format!("{VMS}/other"), Some(cur)).await?;
    assert_eq!(r.status, 400);

    // Patches: strategic merge on a core kind, JSON patch test failure → 422.
    t.request("POST", CMS, Some(cm("p"))).await?;
    let token = t.srv().token.clone();
    let r = t
        .request_as(
            Some(&token),
            "PATCH",
            &format!("{CMS}/p"),
            Some("application/strategic-merge-patch+json"),
            br#"{"data":{"k":null,"n":"1"},"metadata":{"finalizers":["a/b"]}}"#.to_vec(),
        )
        .await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data"], json!({"n": "1"}));
    let r = t
        .request_as(
            Some(&token),
            "PATCH",
            &format!("{CMS}/p"),
            Some("application/json-patch+json"),
            br#"[{"op":"test","path":"/data/n","value":"2"}]"#.to_vec(),
        )
        .await?;
    assert_eq!(r.status, 422);
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_selectors_and_pagination() -> Result<()> {
    let t = common::start().await?;
    for i in 0..7 {
        let mut c = cm(&format!("cm-{i}"));
        c["metadata"]["labels"] = json!({"parity": if i % 2 == 0 { "even" } else { "odd" }});
        assert_eq!(t.request("POST", CMS, Some(c)).await?.status, 201);
    }
    let r = t
        .request("GET", &format!("{CMS}?labelSelector=parity%3Deven"), None)
        .await?
        .json();
    assert_eq!(r["items"].as_array().unwrap().len(), 4);
    assert_eq!(r["kind"], "ConfigMapList");
    assert!(
        r["metadata"]["resourceVersion"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
    let r = t
        .request(
            "GET",
            &format!("{CMS}?labelSelector=parity%20notin%20(even)"),
            None,
        )
        .await?
        .json();
    assert_eq!(r["items"].as_array().unwrap().len(), 3);
    let r = t
        .request(
            "GET",
            &format!("{CMS}?fieldSelector=metadata.name%3Dcm-3"),
            None,
        )
        .await?
        .json();
    assert_eq!(r["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        t.request("GET", &format!("{CMS}?labelSelector=a%20in%20(b"), None)
            .await?
            .status,
        400
    );

    let mut names = Vec::new();
    let mut cont = String::new();
    loop {
        let url = if cont.is_empty() {
            format!("{CMS}?limit=3")
        } else {
            format!("{CMS}?limit=3&continue={cont}")
        };
        let page = t.request("GET", &url, None).await?.json();
        let items = page["items"].as_array().unwrap();
        assert!(items.len() <= 3);
        names.extend(
            items
                .iter()
                .map(|i| i["metadata"]["name"].as_str().unwrap().to_string()),
        );
        match page["metadata"]["continue"].as_str() {
            Some(c) => cont = c.to_string(),
            None => break,
        }
    }
    assert_eq!(names.len(), 7);
    assert_eq!(
        t.request("GET", &format!("{CMS}?limit=3&continue=garbage"), None)
            .await?
            .status,
        400
    );

    // All namespaces, Table output, discovery.
    let all = t.request("GET", "/api/v1/configmaps", None).await?.json();
    assert_eq!(all["items"].as_array().unwrap().len(), 7);
    let apis = t.request("GET", "/apis", None).await?.json();
    assert!(
        apis["groups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["name"] == "kubevirt.io")
    );
    let v1 = t.request("GET", "/apis/kubevirt.io/v1", None).await?.json();
    assert!(
        v1["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "virtualmachines/status")
    );
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalizers_gc_and_namespace_deletion() -> Result<()> {
    let t = common::start().await?;
    // Finalizers hold an object with a deletionTimestamp until they are removed.
    let mut f = cm("held");
    f["metadata"]["finalizers"] = json!(["example.com/hold"]);
    t.request("POST", CMS, Some(f)).await?;
    // kube-apiserver answers 200 with the object even while finalizers hold it (the Python
    // client drops a 202's body) ...
    let r = t.request("DELETE", &format!("{CMS}/held"), None).await?;
    assert_eq!(r.status, 200);
    assert!(r.json()["metadata"]["deletionTimestamp"].is_string());
    // ... and 202 only for the deprecated orphanDependents=false (foreground) on an object not
    // yet gone.
    let mut f2 = cm("held2");
    f2["metadata"]["finalizers"] = json!(["example.com/hold"]);
    t.request("POST", CMS, Some(f2)).await?;
    let r = t
        .request(
            "DELETE",
            &format!("{CMS}/held2"),
            Some(json!({"orphanDependents": false})),
        )
        .await?;
    assert_eq!(r.status, 202);
    let fins = r.json()["metadata"]["finalizers"].clone();
    assert!(
        fins.as_array()
            .unwrap()
            .iter()
            .any(|f| f == "foregroundDeletion"),
        "{fins}"
    );
    let held = t.request("GET", &format!("{CMS}/held"), None).await?.json();
    assert!(held["metadata"]["deletionTimestamp"].is_string());
    let mut released = held.clone();
    released["metadata"]["finalizers"] = json!([]);
    assert_eq!(
        t.request("PUT", &format!("{CMS}/held"), Some(released))
            .await?
            .status,
        200
    );
    assert_eq!(
        t.request("GET", &format!("{CMS}/held"), None).await?.status,
        404
    );

    // Preconditions.
    let c = t.request("POST", CMS, Some(cm("pre"))).await?.json();
    let r = t
        .request(
            "DELETE",
            &format!("{CMS}/pre"),
            Some(json!({"preconditions": {"uid": "wrong"}})),
        )
        .await?;
    assert_eq!(r.status, 409);
    let r = t
        .request(
            "DELETE",
            &format!("{CMS}/pre"),
            Some(json!({"preconditions": {"uid": c["metadata"]["uid"]}})),
        )
        .await?;
    assert_eq!(r.status, 200);

    // Background propagation: dependents of a deleted owner are collected.
    let owner = t.request("POST", VMS, Some(vm("owner"))).await?.json();
    let oref = json!([{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": "owner",
                       "uid": owner["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true}]);
    let mut dep = cm("dependent");
    dep["metadata"]["ownerReferences"] = oref.clone();
    t.request("POST", CMS, Some(dep)).await?;
    assert_eq!(
        t.request("DELETE", &format!("{VMS}/owner"), None)
            .await?
            .status,
        200
    );
    wait_until("dependent collected", || async {
        Ok(t.request("GET", &format!("{CMS}/dependent"), None)
            .await?
            .status
            == 404)
    })
    .await?;

    // Foreground: the owner stays until its dependents are gone.
    let owner = t.request("POST", VMS, Some(vm("fg"))).await?.json();
    let mut dep = cm("fg-dep");
    dep["metadata"]["ownerReferences"] = json!([{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "name": "fg", "uid": owner["metadata"]["uid"]}]);
    t.request("POST", CMS, Some(dep)).await?;
    let r = t
        .request(
            "DELETE",
            &format!("{VMS}/fg"),
            Some(json!({"propagationPolicy": "Foreground"})),
        )
        .await?;
    assert_eq!(r.status, 200);
    wait_until("foreground owner gone", || async {
        Ok(t.request("GET", &format!("{VMS}/fg"), None).await?.status == 404)
    })
    .await?;
    assert_eq!(
        t.request("GET", &format!("{CMS}/fg-dep"), None)
            .await?
            .status,
        404
    );

    // Orphan: the dependent stays, without the owner reference.
    let owner = t.request("POST", VMS, Some(vm("orph"))).await?.json();
    let mut dep = cm("orph-dep");
    dep["metadata"]["ownerReferences"] = json!([{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "name": "orph", "uid": owner["metadata"]["uid"]}]);
    t.request("POST", CMS, Some(dep)).await?;
    t.request(
        "DELETE",
        &format!("{VMS}/orph"),
        Some(json!({"propagationPolicy": "Orphan"})),
    )
    .await?;
    wait_until("orphaning owner gone", || async {
        Ok(t.request("GET", &format!("{VMS}/orph"), None).await?.status == 404)
    })
    .await?;
    let d = t
        .request("GET", &format!("{CMS}/orph-dep"), None)
        .await?
        .json();
    assert!(
        d["metadata"]["ownerReferences"]
            .as_array()
            .is_none_or(|a| a.is_empty()),
        "{d}"
    );

    // Namespace deletion: Terminating, content deleted, then the namespace goes.
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "scratch"}});
    assert_eq!(
        t.request("POST", "/api/v1/namespaces", Some(ns))
            .await?
            .status,
        201
    );
    t.request(
        "POST",
        "/api/v1/namespaces/scratch/configmaps",
        Some(cm("inside")),
    )
    .await?;
    let r = t
        .request("DELETE", "/api/v1/namespaces/scratch", None)
        .await?;
    assert_eq!(r.json()["status"]["phase"], "Terminating");
    wait_until("namespace gone", || async {
        Ok(t.request("GET", "/api/v1/namespaces/scratch", None)
            .await?
            .status
            == 404)
    })
    .await?;
    assert_eq!(
        t.request("GET", "/api/v1/namespaces/scratch/configmaps/inside", None)
            .await?
            .status,
        404
    );

    // deletecollection with a selector.
    for n in ["dc-1", "dc-2"] {
        let mut c = cm(n);
        c["metadata"]["labels"] = json!({"batch": "x"});
        t.request("POST", CMS, Some(c)).await?;
    }
    let r = t
        .request("DELETE", &format!("{CMS}?labelSelector=batch%3Dx"), None)
        .await?;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["items"].as_array().unwrap().len(), 2);
    assert_eq!(
        t.request("GET", &format!("{CMS}/dc-1"), None).await?.status,
        404
    );
    t.shutdown().await;
    Ok(())
}

/// Reads watch lines until `pred` holds for one of them (bounded).
async fn watch_lines(t: &common::TestServer, path: &str, want: usize) -> Result<Vec<Value>> {
    let r = t.request("GET", path, None).await?;
    assert_eq!(r.status, 200, "{}", r.text());
    let lines: Vec<Value> = r
        .text()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert!(lines.len() >= want, "got {lines:?}");
    Ok(lines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_semantics() -> Result<()> {
    let t = common::start().await?;
    let a = t.request("POST", CMS, Some(cm("w-a"))).await?.json();
    let rv = a["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    t.request("POST", CMS, Some(cm("w-b"))).await?;

    // From a resourceVersion: only later events (timeoutSeconds ends the stream).
    let lines = watch_lines(
        &t,
        &format!("{CMS}?watch=true&resourceVersion={rv}&timeoutSeconds=1"),
        1,
    )
    .await?;
    assert_eq!(lines[0]["type"], "ADDED");
    assert_eq!(lines[0]["object"]["metadata"]["name"], "w-b");

    // No resourceVersion: synthetic ADDED for the current state.
    let lines = watch_lines(&t, &format!("{CMS}?watch=1&timeoutSeconds=1"), 2).await?;
    assert!(lines.iter().all(|l| l["type"] == "ADDED"));

    // sendInitialEvents: ADDED then the initial-events-end bookmark.
    let lines = watch_lines(
        &t,
        &format!("{CMS}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1&fieldSelector=metadata.name%3Dw-a"),
        2,
    )
    .await?;
    assert_eq!(lines[0]["type"], "ADDED");
    assert_eq!(lines[0]["object"]["metadata"]["name"], "w-a");
    assert_eq!(lines[1]["type"], "BOOKMARK");
    assert_eq!(
        lines[1]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );

    // Label selector: an object leaving the selection is DELETED for the watcher.
    let mut l = cm("w-l");
    l["metadata"]["labels"] = json!({"sel": "yes"});
    let created = t.request("POST", CMS, Some(l)).await?.json();
    let rv = created["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let mut unl = created.clone();
    unl["metadata"]["labels"] = json!({"sel": "no"});
    t.request("PUT", &format!("{CMS}/w-l"), Some(unl)).await?;
    let lines = watch_lines(
        &t,
        &format!("{CMS}?watch=1&resourceVersion={rv}&labelSelector=sel%3Dyes&timeoutSeconds=1"),
        1,
    )
    .await?;
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["type"], "DELETED");

    // Legacy /watch/ path with a Table representation.
    let lines = watch_lines(
        &t,
        "/api/v1/watch/namespaces/default/configmaps/w-a?timeoutSeconds=1",
        1,
    )
    .await?;
    assert_eq!(lines[0]["object"]["metadata"]["name"], "w-a");

    // Compacted revisions: 410 Expired as an ERROR event.
    let cur = t.srv().store.current_revision().await?;
    t.srv().store.compact(cur).await?;
    let lines = watch_lines(
        &t,
        &format!("{CMS}?watch=1&resourceVersion=1&timeoutSeconds=1"),
        1,
    )
    .await?;
    assert_eq!(lines[0]["type"], "ERROR");
    assert_eq!(lines[0]["object"]["code"], 410);
    assert_eq!(lines[0]["object"]["reason"], "Expired");
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reuses_credentials_and_data() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let s1 = ferrovirt_apiserver::Server::start(common::options(dir.path())).await?;
    let (token, ca) = (s1.token.clone(), s1.ca_pem.clone());
    s1.shutdown().await;
    let s2 = ferrovirt_apiserver::Server::start(common::options(dir.path())).await?;
    assert_eq!((s2.token.clone(), s2.ca_pem.clone()), (token, ca));
    let kc = std::fs::read_to_string(&s2.kubeconfig_path)?;
    assert!(kc.contains(&format!("https://127.0.0.1:{}", s2.addr.port())));
    assert!(kc.contains("certificate-authority-data:"));
    s2.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_tables_bookmarks_and_events() -> Result<()> {
    let t = common::start().await?;
    let get_with_accept = |path: String, accept: &'static str| {
        let t = &t;
        async move { t.request_accept(&path, accept).await }
    };

    // Aggregated discovery when asked for, with its content type.
    let r = get_with_accept(
        "/apis".into(),
        "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json",
    )
    .await?;
    assert_eq!(r.status, 200);
    let ct = r.headers["content-type"].to_str()?.to_string();
    assert!(
        ct.contains("as=APIGroupDiscoveryList") && ct.contains("v=v2"),
        "{ct}"
    );
    let body = r.json();
    let kv = body["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["metadata"]["name"] == "kubevirt.io")
        .cloned()
        .unwrap();
    let vms = kv["versions"][0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resource"] == "virtualmachines")
        .cloned()
        .unwrap();
    assert_eq!(vms["scope"], "Namespaced");
    assert_eq!(vms["subresources"][0]["subresource"], "status");
    let r = get_with_accept(
        "/api".into(),
        "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList",
    )
    .await?;
    assert_eq!(r.json()["items"][0]["metadata"]["name"], "");
    let plain = t.request("GET", "/api", None).await?.json();
    assert_eq!(plain["versions"][0], "v1");
    assert_eq!(
        t.request("GET", "/version", None).await?.json()["major"],
        "1"
    );
    let v3 = t.request("GET", "/openapi/v3", None).await?.json();
    let url = v3["paths"]["api/v1"]["serverRelativeURL"]
        .as_str()
        .unwrap()
        .to_string();
    let core = t.request("GET", &url, None).await?.json();
    assert!(core["components"]["schemas"]["io.k8s.api.core.v1.ConfigMap"].is_object());

    // Table output with includeObject.
    let created = t.request("POST", VMS, Some(vm("tbl"))).await?.json();
    let table = get_with_accept(
        format!("{VMS}?includeObject=Object"),
        "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
    )
    .await?
    .json();
    assert_eq!(table["kind"], "Table");
    assert_eq!(table["columnDefinitions"][0]["name"], "Name");
    assert_eq!(table["rows"][0]["cells"][0], "tbl");
    assert_eq!(table["rows"][0]["object"]["kind"], "VirtualMachine");
    let one = get_with_accept(
        format!("{VMS}/tbl"),
        "application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    .await?
    .json();
    assert_eq!(one["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    let meta = get_with_accept(
        VMS.to_string(),
        "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io",
    )
    .await?
    .json();
    assert_eq!(meta["kind"], "PartialObjectMetadataList");

    // Periodic bookmarks when allowed.
    let rv = created["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let r = t
        .request(
            "GET",
            &format!(
                "{VMS}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=3"
            ),
            None,
        )
        .await?;
    assert!(r.text().contains("\"BOOKMARK\""), "{}", r.text());

    // Core events are selectable by involvedObject fields.
    let ev = json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "tbl.1"},
        "involvedObject": {"kind": "VirtualMachine", "name": "tbl", "namespace": "default", "uid": created["metadata"]["uid"]},
        "reason": "Tested", "message": "m", "type": "Normal"});
    assert_eq!(
        t.request("POST", "/api/v1/namespaces/default/events", Some(ev))
            .await?
            .status,
        201
    );
    let sel = format!(
        "involvedObject.name%3Dtbl,involvedObject.kind%3DVirtualMachine,involvedObject.uid%3D{}",
        created["metadata"]["uid"].as_str().unwrap()
    );
    let evs = t
        .request(
            "GET",
            &format!("/api/v1/namespaces/default/events?fieldSelector={sel}"),
            None,
        )
        .await?
        .json();
    assert_eq!(evs["items"].as_array().unwrap().len(), 1);
    let v1 = t
        .request(
            "GET",
            "/apis/events.k8s.io/v1/namespaces/default/events/tbl.1",
            None,
        )
        .await?
        .json();
    assert_eq!(v1["regarding"]["name"], "tbl");
    assert_eq!(v1["note"], "m");
    t.shutdown().await;
    Ok(())
}
